"""The Trainer: one training-step code path for every precision policy."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from . import checkpoint, diagnostics
from . import distributed as _dist
from .policy import PrecisionPolicy, _as_device, _parse_device, get_policy

__all__ = ["Trainer", "StepResult", "TrainStats"]

log = logging.getLogger(__name__)


class StepResult:
    """What one call to :meth:`Trainer.step` did; its values reach the host only when read.

    Reading a field copies it from the device, which waits for the step to finish:
    read only what you need, and not every step if speed matters.

    Attributes:
        loss: the micro-batch's loss, unscaled and not divided by ``grad_accum_steps``.
        stepped: the optimizer updated the parameters.
        skipped: an optimizer step was due but skipped for non-finite gradients.
        scale: the loss scale after this step, or ``None`` without a scaler.
        grad_norm: the total gradient norm before clipping, when ``max_grad_norm`` is set.
        due: an optimizer step was due at this micro-batch (the last of its accumulation window).
    """

    __slots__ = ("_loss", "_found_inf", "_scale", "_grad_norm", "due")

    def __init__(self, loss, *, due: bool, found_inf=None, scale=None, grad_norm=None):
        self._loss = loss
        self._found_inf = found_inf
        self._scale = scale
        self._grad_norm = grad_norm
        self.due = due

    @staticmethod
    def _host(value):
        return value.item() if isinstance(value, torch.Tensor) else value

    @property
    def loss(self) -> float:
        self._loss = float(self._host(self._loss))
        return self._loss

    @property
    def skipped(self) -> bool:
        return self.due and bool(self._host(self._found_inf))

    @property
    def stepped(self) -> bool:
        return self.due and not self.skipped

    @property
    def scale(self) -> float | None:
        self._scale = self._host(self._scale)
        return self._scale

    @property
    def grad_norm(self) -> float | None:
        self._grad_norm = self._host(self._grad_norm)
        return self._grad_norm

    def __repr__(self) -> str:
        return (f"StepResult(loss={self.loss:.6g}, stepped={self.stepped}, skipped={self.skipped}, "
                f"scale={self.scale}, grad_norm={self.grad_norm})")


@dataclasses.dataclass
class TrainStats:
    """Running optimizer-step and loss-scale counters, kept as ``trainer.stats``."""

    steps: int = 0
    """optimizer steps that were due, taken or skipped"""
    skipped: int = 0
    steps_since_overflow: int = 0
    scale: float | None = None
    min_scale: float | None = None
    max_scale: float | None = None

    def _record(self, skipped: bool, scale: float | None) -> None:
        self.steps += 1
        self.skipped += skipped
        self.steps_since_overflow = 0 if skipped else self.steps_since_overflow + 1
        if scale is not None:
            self.scale = scale
            self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
            self.max_scale = scale if self.max_scale is None else max(self.max_scale, scale)


class Trainer:
    """Trains a model with fp32 master weights under a precision policy.

    Args:
        model: the model; it is moved to ``device`` and passed through ``policy.prepare_model``.
        optimizer: an optimizer over the model's trainable parameters.
        precision: a spec for :func:`precisionloop.get_policy` or a policy instance.
        device: where to train; CUDA when available, else the CPU.
        loss_fn: ``loss_fn(outputs, targets)``; ``torch.nn.functional.cross_entropy`` by default.
        scheduler: an LR scheduler, stepped only after optimizer steps that really happened.
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the unscaled gradients to this total norm.
        max_consecutive_skips: raise after this many skipped steps in a row.
        compile: ``torch.compile`` the model's forward and backward. ``True`` picks
            ``"reduce-overhead"`` (CUDA graphs, which pay most on launch-bound steps)
            on CUDA and ``"default"`` elsewhere; a string names the mode. The optimizer
            step and the loss scaler stay eager, so skip detection is unchanged.
        distributed: under torchrun, ``"auto"`` (with several processes) and ``"ddp"``
            wrap the model in DistributedDataParallel, and ``"fsdp"`` shards it with
            FSDP2 using a MixedPrecisionPolicy derived from the precision policy; the
            process group is initialised if needed (NCCL on CUDA, gloo on the CPU) and
            the device follows LOCAL_RANK. ``None`` never distributes. A model you
            wrapped yourself is used as it is.
        autotune: with ``precision="auto"``, choose the configuration by measuring:
            the first ``step`` runs :func:`precisionloop.autotune` on copies of the model
            with that first batch (compiled candidates too when ``compile=True``), prints
            the table, and trains with the fastest sound candidate. Not with ``distributed``.

    Raises:
        ValueError: bad arguments, an optimizer that does not hold the model's
            trainable parameters, fp16/bf16 parameters, or a device that cannot
            run the precision.

    Example:
        >>> import torch
        >>> from precisionloop import Trainer
        >>> model = torch.nn.Linear(8, 3)
        >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", device="cpu")
        >>> result = trainer.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))
        >>> result.stepped, next(model.parameters()).dtype
        (True, torch.float32)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: str | int | torch.dtype | PrecisionPolicy = "bf16",
        *,
        device: str | torch.device | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scheduler: Any = None,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        max_consecutive_skips: int = 20,
        compile: bool | str = False,
        distributed: str | None = "auto",
        autotune: bool = False,
    ):
        _check_positive_int("grad_accum_steps", grad_accum_steps)
        _check_positive_int("max_consecutive_skips", max_consecutive_skips)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler drives a different optimizer than the one given to the Trainer")
        if autotune and not (isinstance(precision, str) and precision.strip().lower() == "auto"):
            raise ValueError(f"autotune=True chooses the precision itself: pass precision='auto', not {precision!r}")
        self.distributed, device = _dist.resolve(distributed, None if device is None else _parse_device(device))
        if autotune and self.distributed:
            raise ValueError("autotune=True runs on one process: tune once with precisionloop.autotune and pass "
                             "the chosen policy to the distributed Trainer")
        self.device = _as_device(device)
        _check_master_weights(model)
        self._params = _check_optimizer(model, optimizer)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn if loss_fn is not None else nn.functional.cross_entropy
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_skips = max_consecutive_skips
        self._autotune_compile = compile if autotune else None  # the choice waits for the first batch
        self.model = model.to(self.device)
        self._configure(get_policy(precision, self.device), _compile_mode(compile, self.device), prepare=not autotune)
        self._stats = TrainStats(scale=self._last_scale)
        self._pending: tuple[torch.Tensor, Any] | None = None  # the last step's verdict, not yet read
        self._micro = 0  # micro-batches since the last optimizer step
        self.global_step = 0  # optimizer steps taken or skipped
        self.epoch = 0  # completed epochs
        self.batch_in_epoch = 0  # micro-batches consumed in the current epoch
        self._rng_epoch_start: dict | None = None
        self._consecutive_skips = 0
        self._collapse_warned = False
        self._unsynced = False  # the last backward skipped the gradient all-reduce
        self._last_in_epoch = False  # set by fit: the next micro-batch closes the epoch, so gradients must sync
        self._underflow_every: int | None = None
        self.underflow_history: list[dict] = []  # filled by fit(underflow_every=N)
        self._ones: dict[torch.device, torch.Tensor] = {}
        if _dist.is_main():
            log.info("Trainer on %s with %r%s", self.device, self.policy,
                     f", {self.distributed} over {_dist.world_size()} processes" if self.distributed else "")

    def _configure(self, policy: PrecisionPolicy, compile_mode: str | None, prepare: bool = True) -> None:
        """Apply a policy (and compile mode) to the model: layout, compile, wrapping, scaler."""
        self.policy, self.compile_mode = policy, compile_mode
        self._input_format = torch.contiguous_format
        self.scaler, self._last_scale = None, None
        if not prepare:
            return
        model = self.model
        if not _dist.is_wrapped(model):
            model = policy.prepare_model(model)
        self._input_format = policy.memory_format(_dist.unwrap(model))
        if compile_mode is not None:
            _dist.unwrap(model).compile(mode=compile_mode)  # in place, so state_dict keys do not change
        if self.distributed == "fsdp" and self._input_format == torch.channels_last:
            # FSDP2 cannot shard non-contiguous parameters; channels_last inputs still steer cuDNN to NHWC kernels.
            model = model.to(memory_format=torch.contiguous_format)
        self.model = _dist.wrap(model, self.distributed, policy, self.device, self.optimizer) if self.distributed else model
        if self.distributed == "fsdp":
            self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.scaler = policy.make_scaler(self.device.type)
        if self.scaler is not None and self.distributed == "fsdp":
            self.scaler = _dist.sharded_scaler(self.scaler, self.device.type)
        self._last_scale = self.scaler.get_scale() if self.scaler is not None else None

    def _run_autotune(self, batch: Any) -> None:
        from .autotune import autotune, default_candidates

        optimizer = self.optimizer
        # A fresh optimizer of the same kind per candidate; per-group settings beyond the defaults are not copied.
        factory = lambda params: type(optimizer)(params, **optimizer.defaults)  # noqa: E731
        compile_candidates = self._autotune_compile not in (None, False)
        result = autotune(self.model, factory, batch, default_candidates(self.model, self.device, compile=compile_candidates),
                          device=self.device, loss_fn=self.loss_fn, verbose=self.is_main)
        self._autotune_compile = None
        self._configure(result.policy, _compile_mode(result.best.compile, self.device))
        self._stats.scale = self._last_scale
        log.info("autotune: training with %s", result.best.label)

    @property
    def is_main(self) -> bool:
        """True on the process that reports and writes checkpoints: rank 0, or the only one."""
        return _dist.is_main()

    def __repr__(self) -> str:
        return f"Trainer(model={type(self.model).__name__}, device={self.device}, policy={self.policy!r})"

    # The step --------------------------------------------------------------------------

    def forward_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run the model on one batch and return ``(outputs, targets)``; override for other batch shapes."""
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            raise TypeError(
                f"the default forward_batch expects a batch of (inputs, targets), got {type(batch).__name__}; "
                "override Trainer.forward_batch (or compute_loss) for other batch shapes"
            ) from None
        return self.model(inputs), targets

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch; runs under autocast. Override it for other losses or batch shapes."""
        return self.loss_fn(*self.forward_batch(batch))

    def step(self, batch: Any) -> StepResult:
        """Train on one micro-batch; every ``grad_accum_steps`` calls take one optimizer step.

        No host sync happens here unless the optimizer forces one: a non-fused optimizer
        under fp16 (``GradScaler.step`` reads the inf check) or under fp32/bf16 (the skip
        decision is made on the host). With a fused optimizer the skip happens on the
        device, and the step's verdict is read one optimizer step later.
        """
        if self._autotune_compile is not None:
            self._run_autotune(batch)
        with self.policy.backend_flags():
            batch = self.to_device(batch)
            if self.compile_mode is not None:
                return self._compiled_step(batch)
            return self._step(batch)

    def _step(self, batch: Any) -> StepResult:
        syncs = self._micro + 1 >= self.grad_accum_steps or self._last_in_epoch
        # No gradient all-reduce on micro-steps that do not step; nothing to enter in one process.
        with _dist.no_sync(self.model) if self.distributed and not syncs else contextlib.nullcontext():
            with self.policy.autocast(self.device.type):
                loss = self.compute_loss(batch)
            scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self._unsynced = bool(self.distributed) and not syncs
        self._micro += 1
        if self._micro < self.grad_accum_steps:
            return StepResult(loss.detach(), due=False, scale=self._last_scale)
        return self._optimizer_step(loss.detach())

    def _compiled_step(self, batch: Any) -> StepResult:
        from torch._dynamo.exc import TorchDynamoException

        # Tells CUDA-graph trees a new iteration begins, so the last step's outputs may be reused; a no-op otherwise.
        torch.compiler.cudagraph_mark_step_begin()
        try:
            return self._step(batch)
        except TorchDynamoException as e:
            raise RuntimeError(
                f"torch.compile(mode={self.compile_mode!r}) failed on {type(self.model).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. "
                "Train eagerly with compile=False, or try another mode"
            ) from e

    def flush(self) -> StepResult | None:
        """Take the optimizer step for an incomplete accumulation window, if one is open.

        The window's gradients are rescaled to the mean over the micro-batches it
        holds, as if the accumulated batch had simply been smaller. The result's
        ``loss`` is NaN: no micro-batch ran in this call.
        """
        if self._micro == 0:
            return None
        if self._unsynced:
            _dist.average_gradients(self.model, self._params)
        with self.policy.backend_flags():
            return self._optimizer_step(torch.full((), float("nan")))

    @property
    def stats(self) -> TrainStats:
        """Optimizer-step and loss-scale counters, brought up to date (this waits for the last step).

        Raises:
            RuntimeError: the last steps hit ``max_consecutive_skips``.
        """
        self._settle()
        return self._stats

    def _optimizer_step(self, loss: torch.Tensor) -> StepResult:
        self._settle()  # the previous step's verdict, so the scheduler is right for this one
        optimizer, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
            found_inf = _scaler_found_inf(scaler, optimizer)
        else:
            found_inf = self._found_nonfinite()
            if self.distributed:  # each rank checks its own (shard of the) gradients; all must agree
                _dist.all_reduce_max_(found_inf)
        if self._micro < self.grad_accum_steps:
            grads = [p.grad for p in self._params if p.grad is not None]
            torch._foreach_mul_(grads, self.grad_accum_steps / self._micro)
        if self._underflow_every is not None and (self.global_step + 1) % self._underflow_every == 0:
            self._measure_underflow()
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            # The scale as a device tensor: get_scale() would sync the host.
            verdict = torch.cat([found_inf.reshape(1).float(), scaler._get_scale_async().reshape(1).float()])
        else:
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                # Fused optimizers take the inf check as a tensor and skip on the device (the
                # same contract GradScaler uses), so no host sync is needed.
                optimizer.grad_scale, optimizer.found_inf = None, found_inf
                try:
                    optimizer.step()
                finally:
                    del optimizer.grad_scale, optimizer.found_inf
            elif not found_inf.item():  # nothing else guards the weights: the one host sync
                optimizer.step()
            verdict = found_inf.reshape(1).float()
        optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        self._unsynced = False
        self.global_step += 1
        host = verdict.to("cpu", non_blocking=True)
        event = None
        if verdict.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (host, event)
        if scaler is not None:
            self._last_scale = verdict[1]
        if event is None:
            self._settle()
        return StepResult(loss, due=True, found_inf=verdict[0], scale=self._last_scale, grad_norm=grad_norm)

    def _settle(self) -> None:
        """Book the last optimizer step's verdict: counters, scheduler, skip limit, collapse warning."""
        if self._pending is None:
            return
        host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # waits for that step only, not for work queued since
        values = host.tolist()
        skipped = bool(values[0])
        scale = values[1] if len(values) > 1 else None
        self._stats._record(skipped, scale)
        if skipped:
            self._consecutive_skips += 1
            if self._consecutive_skips >= self.max_consecutive_skips:
                raise RuntimeError(
                    f"{self._consecutive_skips} optimizer steps in a row were skipped for non-finite gradients "
                    f"(at optimizer step {self._stats.steps}, loss scale {scale}); the loss or the model diverged. "
                    "Lower the learning rate, check the data, or try precision='bf16' or 'fp32'"
                )
        else:
            self._consecutive_skips = 0
            if self.scheduler is not None:
                self.scheduler.step()
        if scale is not None and scale < 1 and not self._collapse_warned:
            self._collapse_warned = True
            warnings.warn(
                f"the loss scale fell to {scale:g} (below 1) at optimizer step {self._stats.steps}: the loss scale is "
                "collapsing, so gradients are non-finite even unscaled; fp16 is unlikely to train this model",
                RuntimeWarning,
                stacklevel=4,
            )

    def _measure_underflow(self) -> None:
        # Against the policy's own reduced dtype, or fp16 for an fp32 policy: what would fp16 lose here?
        dtype = self.policy.compute_dtype if self.policy.compute_dtype != torch.float32 else torch.float16
        scale = self.scaler.get_scale() if self.scaler is not None else 65536.0
        report = diagnostics.gradient_underflow(self.model, dtype, scale)
        self.underflow_history.append({
            "step": self.global_step + 1, "dtype": str(dtype).replace("torch.", ""), "scale": scale,
            "nonzero": report.nonzero, "median_abs": report.median_abs,
            "underflow": report.underflow, "underflow_scaled": report.underflow_scaled,
        })

    def _found_nonfinite(self) -> torch.Tensor:
        """1.0 on the device if any gradient holds an inf or NaN, else 0.0; no host sync."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self._params:
            if p.grad is not None:
                g = p.grad._values() if p.grad.is_sparse else p.grad
                g = g.to_local() if hasattr(g, "to_local") else g  # an FSDP2 shard
                groups.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros((), device=self.device)
        for (device, _), grads in groups.items():
            if device not in self._ones:
                self._ones[device] = torch.ones((), device=device)
            found_here = found if device == self.device else torch.zeros((), device=device)
            # GradScaler's fused check, with an inverse scale of 1 so the gradients are untouched.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, self._ones[device])
            if found_here is not found:
                found += found_here.to(self.device)
        return found

    # The loop ----------------------------------------------------------------------------

    def fit(
        self,
        train_loader: Iterable,
        epochs: int = 1,
        *,
        val_loader: Iterable | None = None,
        metrics: Mapping[str, Any] | None = None,
        max_steps: int | None = None,
        progress: bool = True,
        callbacks: Sequence[Any] = (),
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_last: int | None = None,
        log_every: int = 20,
        underflow_every: int | None = None,
    ) -> list[dict]:
        """Train until ``epochs`` epochs (counting restored ones) or ``max_steps`` optimizer steps.

        An incomplete accumulation window at the end of an epoch is stepped, with its
        gradients averaged over the micro-batches it holds (see :meth:`flush`).

        Args:
            train_loader: an iterable of batches, usually a DataLoader.
            epochs: the total number of epochs, those restored from a checkpoint included.
            val_loader: batches for validation after every epoch.
            metrics: torchmetrics ``Metric`` objects by name, computed on ``val_loader``.
            max_steps: stop after this many optimizer steps in total.
            progress: show a tqdm bar per epoch; ``False`` prints nothing.
            callbacks: objects with optional ``on_step_end(trainer, result)`` and
                ``on_epoch_end(trainer, record)`` methods.
            checkpoint_dir: where periodic checkpoints go.
            checkpoint_every: save ``step-NNNNNNNN.pt`` every this many optimizer steps.
            keep_last: keep only the newest this many periodic checkpoints.
            log_every: read the loss for the progress bar every this many steps (a host sync).
            underflow_every: measure gradient underflow every this many optimizer steps
                (see :mod:`precisionloop.diagnostics`); off by default.

        Returns:
            One dict per epoch run: ``epoch``, ``train_loss``, ``steps``, ``skipped``,
            ``time_s``, ``samples_per_s``, ``complete``, the loss-scale counters, and
            ``val_loss`` plus each metric under its name when ``val_loader`` is given.

        Raises:
            ValueError: bad arguments.
        """
        _check_nonnegative_int("epochs", epochs)
        for name, value in (("max_steps", max_steps), ("checkpoint_every", checkpoint_every), ("keep_last", keep_last),
                            ("underflow_every", underflow_every)):
            if value is not None:
                _check_positive_int(name, value)
        _check_positive_int("log_every", log_every)
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to")
        if keep_last is not None and checkpoint_every is None:
            raise ValueError("keep_last applies to periodic checkpoints: set checkpoint_every too")
        metrics = _check_metrics(metrics, val_loader)
        if self.distributed:
            # Each rank sees its share of the data; only rank 0 reports and writes.
            train_loader = _dist.shard_loader(train_loader)
            val_loader = _dist.shard_loader(val_loader) if val_loader is not None else None
            progress = progress and _dist.is_main()
        self._underflow_every = underflow_every
        history = []
        try:
            with self.policy.backend_flags():
                while self.epoch < epochs and not self._reached(max_steps):
                    record = self._run_epoch(train_loader, epochs, max_steps, progress, callbacks, log_every,
                                             checkpoint_dir, checkpoint_every, keep_last)
                    if record["complete"] and val_loader is not None:
                        record.update(self._validate(val_loader, metrics))
                    history.append(record)
                    for cb in callbacks:
                        if hasattr(cb, "on_epoch_end"):
                            cb.on_epoch_end(self, record)
        finally:
            self._underflow_every = None
        stats = self.stats
        if stats.steps and _dist.is_main():
            log.info("fit: %d optimizer steps, %d skipped (%.2f%%)%s", stats.steps, stats.skipped,
                     100 * stats.skipped / stats.steps, f", loss scale {stats.scale:g}" if stats.scale is not None else "")
        return history

    def _reached(self, max_steps: int | None) -> bool:
        return max_steps is not None and self.global_step >= max_steps

    def _run_epoch(self, loader, epochs, max_steps, progress, callbacks, log_every, checkpoint_dir, checkpoint_every, keep_last) -> dict:
        resume_at = self.batch_in_epoch
        if resume_at == 0 or self._rng_epoch_start is None:
            # The sampler and the DataLoader draw their seeds from this state when the iterator is made.
            self._rng_epoch_start = checkpoint.rng_state()
            resume_at = self.batch_in_epoch = 0
            resume_rng = None
        else:
            resume_rng = checkpoint.rng_state()
            checkpoint.set_rng_state(self._rng_epoch_start)
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        iterator = iter(loader)
        for done in range(resume_at):  # replay the same shuffle up to where the checkpoint stopped
            if next(iterator, _END) is _END:
                raise ValueError(f"the checkpoint stopped at batch {resume_at} of epoch {self.epoch + 1}, but this "
                                 f"train_loader has only {done} batches per epoch; resume with the same data")
        if resume_rng is not None:
            checkpoint.set_rng_state(resume_rng)
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = tqdm(total=total, initial=resume_at, desc=f"epoch {self.epoch + 1}/{epochs}", disable=not progress,
                   dynamic_ncols=True, leave=True)
        steps_before, skipped_before, measured_before = self.global_step, self._stats.skipped, len(self.underflow_history)
        loss_sum, n_losses, samples, start = torch.zeros((), device=self.device), 0, 0, time.perf_counter()
        complete = True
        try:
            for batch in iterator:
                self._last_in_epoch = total is not None and self.batch_in_epoch + 1 == total
                result = self.step(batch)
                self.batch_in_epoch += 1
                loss_sum += result._loss
                n_losses += 1
                samples += _batch_size(batch)
                if progress:
                    bar.update(1)
                    if n_losses % log_every == 0:
                        bar.set_postfix(self._postfix(result), refresh=False)
                for cb in callbacks:
                    if hasattr(cb, "on_step_end"):
                        cb.on_step_end(self, result)
                if result.due:
                    if checkpoint_every is not None and self.global_step % checkpoint_every == 0:
                        self._periodic_save(checkpoint_dir, keep_last)
                    if self._reached(max_steps):
                        complete = total is not None and self.batch_in_epoch >= total  # stopped on the last batch
                        break
            else:
                self.flush()
        finally:
            self._last_in_epoch = False
            bar.close()
        if complete:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._rng_epoch_start = None
        elapsed = time.perf_counter() - start
        if self.distributed:
            totals = _dist.all_reduce_sum_(torch.stack([loss_sum.float(), torch.tensor(float(n_losses), device=self.device),
                                                        torch.tensor(float(samples), device=self.device)]))
            loss_sum, n_losses, samples = totals[0], int(totals[1]), int(totals[2])
        stats = self.stats
        measured = self.underflow_history[measured_before:]
        underflow = {k: measured[-1][k] for k in ("underflow", "underflow_scaled")} if measured else {}
        return {
            "epoch": self.epoch if complete else self.epoch + 1,
            "complete": complete,
            "train_loss": float(loss_sum) / n_losses if n_losses else float("nan"),
            "steps": self.global_step - steps_before,
            "skipped": stats.skipped - skipped_before,
            "time_s": elapsed,
            "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            **{f"stats_{k}": v for k, v in dataclasses.asdict(stats).items()},
            **underflow,
        }

    def _postfix(self, result: StepResult) -> dict:
        postfix = {"loss": f"{result.loss:.4g}", "skipped": self._stats.skipped}
        if self.scaler is not None:
            postfix["scale"] = f"{result.scale:g}"
        return postfix

    def _periodic_save(self, directory, keep_last: int | None) -> None:
        directory = Path(directory)
        self.save(directory / f"step-{self.global_step:08d}.pt")
        if keep_last is not None and _dist.is_main():
            for old in sorted(directory.glob("step-*.pt"))[:-keep_last]:
                old.unlink(missing_ok=True)

    def evaluate(self, loader: Iterable, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Mean loss and each metric over ``loader``, in eval mode, without grad, under the policy's autocast.

        Args:
            loader: an iterable of batches.
            metrics: torchmetrics ``Metric`` objects by name; each is reset before and after.

        Returns:
            ``{"val_loss": mean loss, name: metric value, ...}``.
        """
        metrics = _check_metrics(metrics, loader)
        with self.policy.backend_flags():
            return self._validate(loader, metrics)

    def _validate(self, loader: Iterable, metrics: dict[str, Any]) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        for metric in metrics.values():
            metric.to(self.device)
            metric.reset()
        loss_sum, count = torch.zeros((), device=self.device), 0
        try:
            with torch.no_grad():
                for batch in loader:
                    batch = self.to_device(batch)
                    with self.policy.autocast(self.device.type):
                        outputs, targets = self.forward_batch(batch)
                        loss = self.loss_fn(outputs, targets)
                    n = _batch_size(batch)
                    loss_sum += loss.float() * n
                    count += n
                    if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
                        outputs = outputs.float()
                    for metric in metrics.values():
                        metric.update(outputs, targets)
            if self.distributed:
                totals = _dist.all_reduce_sum_(torch.stack([loss_sum.float(), torch.tensor(float(count), device=self.device)]))
                loss_sum, count = totals[0], int(totals[1])
            # torchmetrics syncs each metric's state across ranks in compute().
            result = {"val_loss": float(loss_sum) / count if count else float("nan")}
            for name, metric in metrics.items():
                value = metric.compute()
                result[name] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else (
                    value.tolist() if isinstance(value, torch.Tensor) else value)
                metric.reset()
            return result
        finally:
            self.model.train(was_training)

    # State ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: model, optimizer, scheduler, scaler, counters and RNGs.

        Raises:
            RuntimeError: an accumulation window is open (its gradients cannot be saved).
        """
        if self._micro:
            raise RuntimeError(
                f"cannot save in the middle of an accumulation window ({self._micro} of {self.grad_accum_steps} "
                "micro-batches done); save after an optimizer step or call flush() first"
            )
        self._settle()
        model_state, optimizer_state = _full_state(self.model, self.optimizer, self.distributed)
        rng = checkpoint.rng_state()
        return {
            "format": checkpoint.FORMAT,
            "version": checkpoint.VERSION,
            "precision": self.policy.name,
            "world_size": _dist.world_size(),
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "counters": {
                "global_step": self.global_step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "consecutive_skips": self._consecutive_skips,
                "collapse_warned": self._collapse_warned,
            },
            "stats": dataclasses.asdict(self._stats),
            "rng": rng,
            "rng_per_rank": _dist.gather_objects(rng) if self.distributed else None,
            "rng_epoch_start": self._rng_epoch_start,
        }

    def load_state_dict(self, state: dict, *, source: str = "the checkpoint") -> None:
        """Restore what :meth:`state_dict` returned, including the RNG states.

        A Trainer still waiting to autotune takes the checkpoint's precision instead.
        """
        if self._autotune_compile is not None:
            self._configure(get_policy(state.get("precision"), self.device), None)
            self._autotune_compile = None
            log.info("autotune skipped: resuming under the checkpoint's precision %s", self.policy.name)
        if state.get("precision") != self.policy.name:
            warnings.warn(
                f"{source} was saved under precision {state.get('precision')!r} and is loaded under "
                f"{self.policy.name!r}; the loss-scaler state does not carry over between them",
                UserWarning,
                stacklevel=3,
            )
        self._settle()
        _load_full_state(self.model, self.optimizer, state["model"], state["optimizer"], self.distributed)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        counters = state["counters"]
        self.global_step = counters["global_step"]
        self.epoch = counters["epoch"]
        self.batch_in_epoch = counters["batch_in_epoch"]
        self._consecutive_skips = counters["consecutive_skips"]
        self._collapse_warned = counters["collapse_warned"]
        self._stats = TrainStats(**state["stats"])
        if self.scaler is not None:
            self._last_scale = self.scaler.get_scale()
            self._stats.scale = self._last_scale
        self._micro = 0
        self._rng_epoch_start = state.get("rng_epoch_start")
        per_rank = state.get("rng_per_rank")
        if per_rank and len(per_rank) == _dist.world_size():
            checkpoint.set_rng_state(per_rank[_dist.rank()])
        else:
            checkpoint.set_rng_state(state["rng"])

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint atomically: ``path`` holds the old file or the whole new one, never half.

        Raises:
            RuntimeError: an accumulation window is open.
        """
        state = self.state_dict()  # every rank takes part: the state is gathered
        path = Path(path)
        if _dist.is_main():
            checkpoint.atomic_save(state, path)
        _dist.barrier()  # no rank reads the file before rank 0 has written it
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Resume from a checkpoint written by :meth:`save`; the next ``fit`` continues where it stopped.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is truncated, corrupt or not a precisionloop checkpoint.
        """
        self.load_state_dict(checkpoint.read(path), source=f"checkpoint {path}")

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the device, 4-D float tensors in the model's layout."""
        if isinstance(batch, torch.Tensor):
            memory_format = self._input_format if batch.dim() == 4 and batch.is_floating_point() else torch.preserve_format
            return batch.to(self.device, non_blocking=self.device.type == "cuda", memory_format=memory_format)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return type(batch)(*(self.to_device(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch


_END = object()


def _compile_mode(compile: bool | str | None, device: torch.device) -> str | None:
    if compile is None or compile is False:
        return None
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    from torch._inductor import list_mode_options

    modes = list(list_mode_options())
    if not isinstance(compile, str) or compile not in modes:
        raise ValueError(f"compile must be False, True or a torch.compile mode among {', '.join(modes)}; got {compile!r}")
    return compile


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_nonnegative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _check_metrics(metrics: Mapping[str, Any] | None, loader: Iterable | None) -> dict[str, Any]:
    if not metrics:
        return {}
    if loader is None:
        raise ValueError("metrics are computed on val_loader: pass val_loader too")
    from torchmetrics import Metric

    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> torchmetrics.Metric, got {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TypeError(f"metrics[{name!r}] must be a torchmetrics.Metric, got {type(metric).__name__}")
    return dict(metrics)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _check_master_weights(model: nn.Module) -> None:
    low = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise ValueError(
            f"parameters {', '.join(low[:5])}{' ...' if len(low) > 5 else ''} are not fp32; mixed precision keeps "
            "fp32 master weights and runs low precision through autocast. Call model.float() before building the Trainer"
        )


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    owned = {id(p) for p in model.parameters()}
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for i, n in trainable.items() if i not in in_optimizer]
    foreign = len(in_optimizer - owned)
    if missing or foreign:
        parts = []
        if missing:
            parts.append(f"trainable parameters missing from the optimizer: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if foreign:
            parts.append(f"{foreign} optimizer tensor(s) that are not parameters of the model")
        raise ValueError("the optimizer must hold exactly the model's trainable parameters; found " + "; ".join(parts))
    return [p for p in model.parameters() if p.requires_grad]


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, distributed: str | None) -> tuple[dict, dict]:
    # torch.distributed.checkpoint's helpers give one layout (parameter names, no DDP prefix, and
    # unsharded under FSDP2) whatever the run was, so checkpoints move between one process, DDP and FSDP2.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = distributed == "fsdp"
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def _load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict,
                     distributed: str | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=distributed == "fsdp"))


def _scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    # The scaler's own verdict from unscale_(); right for fused optimizers too, whose step()
    # always runs and skips on the device.
    found = list(scaler._found_inf_per_device(optimizer).values())
    return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).sum()
