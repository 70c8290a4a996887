"""The Trainer: the public front end that checks arguments, assembles the parts and delegates.

The step lives in :mod:`precisionloop.engine`, the loop in :mod:`precisionloop.loop`, the state
in :mod:`precisionloop.checkpoint` and the measuring in :mod:`precisionloop.tuning`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from . import batches, checkpoint, checks, loop
from . import distributed as _dist
from .devices import parse_device, resolve_device
from .engine import StepEngine
from .guard import fuse_default_optimizer
from .memory import MemoryBreakdown, memory_breakdown
from .policy import PrecisionPolicy
from .precisions import get_policy, is_auto
from .prepare import compile_mode, prepare_model
from .results import StepResult, TrainStats

__all__ = ["Trainer", "StepResult", "TrainStats"]

log = logging.getLogger(__name__)

# Options that were removed, and what to use instead.
_REMOVED = {
    "graph_optimizer_step": "it was removed in 0.2.0; pass compile=True, which on CUDA compiles the forward and "
                            "backward with CUDA graphs (torch.compile mode 'reduce-overhead')",
}


def _forwarded(owner: str, name: str, doc: str, settable: bool = True) -> property:
    """A Trainer property that reads (and sets) ``self.<owner>.<name>``."""
    def get(self):
        return getattr(getattr(self, owner), name)

    def set_(self, value) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, set_ if settable else None, doc=doc)


class Trainer:
    """Trains a model under a precision policy: fp32 master weights, or bf16 ones under ``"bf16-pure"``.

    Args:
        model: the model; it is moved to ``device`` and passed through ``policy.prepare_model``.
        optimizer: an optimizer over the model's trainable parameters.
        precision: a spec for :func:`precisionloop.get_policy` or a policy instance.
        device: where to train; CUDA when available, else the CPU.
        loss_fn: ``loss_fn(outputs, targets)``; ``torch.nn.functional.cross_entropy`` by default.
        scheduler: an LR scheduler built on ``optimizer``; ``scheduler_interval`` says when it steps.
        scheduler_interval: ``"step"``: after every optimizer step really taken (skipped ones do not count);
            ``"epoch"``: at the end of each epoch of ``fit`` (a loop of your own steps it itself). Required with a
            scheduler; a ``ReduceLROnPlateau`` is always stepped by ``fit`` at each epoch's end with ``val_loss``.
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the unscaled gradients to this total norm.
        max_consecutive_skips: raise after this many skipped steps in a row (on CUDA up to two steps late).
        compile: ``torch.compile`` the forward and backward: ``True`` is ``"reduce-overhead"`` (CUDA graphs)
            on CUDA and ``"default"`` elsewhere; a string names the mode. The optimizer step stays eager.
        distributed: under torchrun, ``"auto"`` (several processes) and ``"ddp"`` wrap the model in DDP,
            ``"fsdp"`` shards it with FSDP2, ``None`` never distributes; a model you wrapped is used as it is.
        fuse_optimizer: on CUDA, a torch ``SGD``, ``Adam`` or ``AdamW`` at its default implementation runs
            its fused one, which skips on the device without a host sync; ``False`` keeps it as given.
        autotune: with ``precision="auto"``, the first ``step`` measures candidates with
            :func:`precisionloop.autotune` on copies of the model and trains with the fastest sound one.
        input_transform: run on the device on the inputs (the whole batch if ``forward_batch`` or ``compute_loss`` is
            overridden) in ``step``, ``fit``, ``evaluate``; for uint8 images :func:`precisionloop.normalize_uint8`.

    Raises:
        ValueError: bad arguments, an optimizer that does not hold exactly the model's trainable parameters,
            weights or an optimizer the policy refuses (``check_weights``), or a device that cannot run it.

    Example:
        >>> import torch
        >>> from precisionloop import Trainer
        >>> model = torch.nn.Linear(8, 3)
        >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", device="cpu")
        >>> result = trainer.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))
        >>> result.stepped, next(model.parameters()).dtype
        (True, torch.float32)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 precision: str | int | torch.dtype | PrecisionPolicy = "bf16", *,
                 device: str | torch.device | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 scheduler: Any = None, scheduler_interval: str | None = None, grad_accum_steps: int = 1,
                 max_grad_norm: float | None = None, max_consecutive_skips: int = 20, compile: bool | str = False,
                 distributed: str | None = "auto", autotune: bool = False, fuse_optimizer: bool = True,
                 input_transform: Callable[[Any], Any] | None = None, **removed: Any):
        checks.refuse_removed("Trainer", removed, _REMOVED)
        checks.check_trainer_arguments(model, optimizer, loss_fn, scheduler, scheduler_interval,
                                       grad_accum_steps=grad_accum_steps, input_transform=input_transform,
                                       max_grad_norm=max_grad_norm, max_consecutive_skips=max_consecutive_skips,
                                       autotune=autotune, fuse_optimizer=fuse_optimizer)
        if autotune and not is_auto(precision):
            raise ValueError(f"autotune=True chooses the precision itself: pass precision='auto', not {precision!r}")
        self.distributed, device = _dist.resolve(distributed, None if device is None else parse_device(device))
        if autotune and self.distributed:
            raise ValueError("autotune=True runs on one process: tune once with precisionloop.autotune and pass "
                             "the chosen policy to the distributed Trainer")
        self.device = resolve_device(device)
        policy = get_policy(precision, self.device)
        policy.check_model(model, self.device)
        if self.distributed == "fsdp":
            policy.check_sharding(model, self.device)
        policy.check_weights(model, optimizer)
        checks.check_optimizer_params(model, optimizer, self.device)
        _dist.check_optimizer(optimizer, self.distributed)
        mode = compile_mode(compile, self.device)
        self.optimizer, self.scheduler, self.input_transform = optimizer, scheduler, input_transform
        self.scheduler_interval = "epoch" if checks.is_plateau(scheduler) else scheduler_interval
        self.loss_fn = loss_fn if loss_fn is not None else nn.functional.cross_entropy
        self.underflow_history: list[dict] = []  # filled by fit(underflow_every=N)
        self.loop_state = loop.LoopState()
        self.model = model.to(self.device)
        if fuse_optimizer and _dist.may_fuse(optimizer, self.distributed) and fuse_default_optimizer(optimizer, model):
            log.info("%s runs its fused implementation, so a skipped step is decided on the device without a host "
                     "sync (fuse_optimizer=False keeps it as given)", type(optimizer).__name__)
        self.engine = StepEngine(self.model, optimizer, self.device, compute_loss=self.compute_loss,
                                 scheduler=scheduler if self.scheduler_interval == "step" else None,
                                 grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
                                 max_consecutive_skips=max_consecutive_skips, distributed=self.distributed)
        self._autotune_compile = compile if autotune else None  # the choice waits for the first batch
        self._configure(policy, mode, prepare=not autotune)
        if _dist.is_main():
            log.info("Trainer on %s with %r%s", self.device, self.policy,
                     f", {self.distributed} over {_dist.world_size()} processes" if self.distributed else "")

    def _configure(self, policy: PrecisionPolicy, mode: str | None, prepare: bool = True) -> None:
        """Apply a policy and compile mode; fields change only once the policy has prepared the model.

        So a policy that refuses the model or its device leaves the Trainer as it was.
        """
        self.engine.sync()  # the old guard's verdict is booked under it, before anything changes
        model, input_format = self.model, torch.contiguous_format
        guard = policy.make_guard(self.device.type)
        if prepare:
            policy.check_compile(mode, self.device.type)
            policy.check_weights(model, self.optimizer)
            model, input_format = prepare_model(model, policy, mode, self.distributed, self.device, self.optimizer)
            guard = _dist.adapt_guard(guard, self.distributed, self.device.type)
        self.model, self._input_format, self.policy, self.compile_mode = model, input_format, policy, mode
        self.engine.configure(self.model, policy, guard, mode)

    def _run_autotune(self, batch: Any) -> None:
        result = autotune_trainer(self, batch, compile=self._autotune_compile not in (None, False))
        self._autotune_compile = None
        self._configure(result.policy, compile_mode(result.best.compile, self.device))
        log.info("autotune: training with %s", result.best.label)

    is_main = property(lambda self: _dist.is_main(), doc="True on rank 0 (or the only process): it reports and saves.")

    def __repr__(self) -> str:
        return f"Trainer(model={type(self.model).__name__}, device={self.device}, policy={self.policy!r})"

    def forward_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run the model on one batch and return ``(outputs, targets)``; override for other batch shapes."""
        inputs, targets = batches.pair(batch)
        try:
            return self.model(inputs), targets
        except RuntimeError as e:
            if self.input_transform is None:
                batches.note_uint8_inputs(e, inputs)
            raise

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch; runs under autocast. Override it for other losses or batch shapes."""
        return self.loss_fn(*self.forward_batch(batch))

    def takes_pairs(self) -> bool:
        """Whether batches are ``(inputs, targets)``: neither ``forward_batch`` nor ``compute_loss`` is overridden."""
        return not (self.overrides("compute_loss") or self.overrides("forward_batch"))

    def overrides(self, name: str) -> bool:
        """Whether this Trainer's class overrides the method ``name`` (``"forward_batch"``, ``"compute_loss"``)."""
        return getattr(type(self), name) is not getattr(Trainer, name)

    def step(self, batch: Any) -> StepResult:
        """Train on one micro-batch; every ``grad_accum_steps`` calls take one optimizer step.

        It moves the batch to the device and enables grad, leaving train/eval mode and backend flags as they were.
        With a fused optimizer it never waits for the step's verdict, booked once it reaches the host (or by ``stats``).

        Raises:
            ValueError: the batch is empty, or the loss is not a scalar or does not require grad (raised before
                backward; nothing is changed).
            TypeError: the batch is not ``(inputs, targets)`` and neither ``forward_batch`` nor ``compute_loss``
                is overridden (nothing is changed, an open accumulation window included).
        """
        if batches.batch_size(batch) == 0:
            raise ValueError("the batch is empty (batch size 0): nothing to train on; nothing was changed")
        if self.takes_pairs():
            batches.check_pair(batch)  # refused here, not in the step (it drops the window)
        if self._autotune_compile is not None:
            self._run_autotune(self._on_device(batch))  # the candidates get what the model will
        with self.policy.backend_flags():
            return self.engine.step(self._on_device(batch))

    def flush(self) -> StepResult | None:
        """Take the optimizer step for an open accumulation window, its gradients averaged; None if none is open.

        The result's ``loss`` is NaN. As with ``step``, an exception discards the window.
        """
        with self.policy.backend_flags():
            return self.engine.flush()

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The training step's autocast and backend flags, for your own evaluation code; restored after the block."""
        with self.policy.backend_flags(), self.policy.autocast(self.device.type):
            yield

    @property
    def stats(self) -> TrainStats:
        """Optimizer-step and loss-scale counters, brought up to date (this waits for the last step).

        Raises:
            RuntimeError: the last steps hit ``max_consecutive_skips``.
        """
        self.engine.sync()
        return self.engine.stats

    scaler = property(lambda self: self.engine.guard.scaler, doc="The loss scaler, or ``None`` when the policy needs none.")

    def memory_breakdown(self) -> MemoryBreakdown:
        """Parameters, gradients, optimizer state and on CUDA the peak, in MB: :func:`precisionloop.memory_breakdown`."""
        return memory_breakdown(self)

    global_step = _forwarded("engine", "global_step", "Optimizer steps taken or skipped.")
    epoch = _forwarded("loop_state", "epoch", "Completed epochs.")
    batch_in_epoch = _forwarded("loop_state", "batch_in_epoch", "Micro-batches consumed in the current epoch.")
    grad_accum_steps = _forwarded("engine", "grad_accum_steps", "Micro-batches per optimizer step.", settable=False)
    max_grad_norm = _forwarded("engine", "max_grad_norm", "The clipping norm, or None.", settable=False)
    max_consecutive_skips = _forwarded("engine", "max_consecutive_skips", "Skips in a row that raise.", settable=False)

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the device, 4-D float tensors in the model's layout."""
        return batches.to_device(batch, self.device, self._input_format)

    def _on_device(self, batch: Any) -> Any:  # what the model is given: on the device, through input_transform
        return batches.on_device(batch, self.device, self._input_format, self.input_transform, self.takes_pairs())

    def fit(self, train_loader: Iterable, epochs: int = 1, *, val_loader: Iterable | None = None,
            metrics: Mapping[str, Any] | None = None, max_steps: int | None = None, progress: bool = True,
            callbacks: Sequence[Any] = (), checkpoint_dir: str | os.PathLike | None = None,
            checkpoint_every: int | None = None, keep_last: int | None = None, log_every: int = 20,
            underflow_every: int | None = None, loggers: Sequence[Any] = (), device_feed: bool = True) -> list[dict]:
        """Train until ``epochs`` epochs (counting restored ones) or ``max_steps`` optimizer steps.

        The model is put in train mode; an incomplete accumulation window at an epoch's end is stepped
        (see :meth:`flush`); empty batches are passed over. An exception that stops ``fit`` discards the open
        window; the next ``fit`` replays it.

        Args:
            train_loader: an iterable of batches, usually a DataLoader.
            epochs: the total number of epochs, those restored from a checkpoint included.
            val_loader: batches for validation after every epoch.
            metrics: torchmetrics ``Metric`` objects by name, computed on ``val_loader``.
            max_steps: stop after this many optimizer steps in total.
            progress: a tqdm bar per epoch, with the loss and the share of time spent waiting for input.
            callbacks: objects with ``on_step_end(trainer, result)`` and/or ``on_epoch_end(trainer, record)``.
            checkpoint_dir: where periodic checkpoints ``step-NNNNNNNN.pt`` go.
            checkpoint_every: save one every this many optimizer steps.
            keep_last: keep only the newest this many periodic checkpoints.
            log_every: write to the loggers every this many optimizer steps (values of the last step booked), and
                refresh the bar every this many micro-batches.
            underflow_every: measure gradient underflow every this many optimizer steps (:mod:`precisionloop.diagnostics`).
            loggers: :mod:`precisionloop.loggers` or objects with ``log_metrics(metrics, step)``, also at epoch ends.
            device_feed: on CUDA, copy each batch on a side stream, beside the step before it; no effect on the CPU.

        Returns:
            One dict per epoch: ``epoch``, ``train_loss``, ``steps``, ``skipped``, ``time_s``, ``samples_per_s``,
            ``data_s`` and ``data_fraction`` (time blocked on the loader), ``complete``, the loss-scale
            counters, and ``val_loss`` and the metrics with ``val_loader``.

        Raises:
            ValueError: bad arguments, a loader with no batches, or a ReduceLROnPlateau without ``val_loader``.
        """
        options = loop.FitOptions(epochs, max_steps, progress, callbacks, checkpoint_dir, checkpoint_every,
                                  keep_last, log_every, underflow_every, loggers, device_feed)
        return loop.fit(self, train_loader, options, val_loader, metrics)

    def evaluate(self, loader: Iterable, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """``{"val_loss": mean loss, name: metric, ...}`` over ``loader``: eval mode, no grad, the policy's autocast.

        Raises:
            ValueError: ``loader`` has or yields no batch (a spent generator); batches of size 0 are passed over."""
        return loop.evaluate(self, loader, metrics)

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: model, optimizer, scheduler, scaler, counters and RNGs.

        It holds the live tensors, as torch's ``state_dict`` does: ``copy.deepcopy`` it for a snapshot.

        Raises:
            RuntimeError: an accumulation window is open (its gradients cannot be saved).
        """
        if self.engine.micro:
            raise RuntimeError(
                f"cannot save in the middle of an accumulation window ({self.engine.micro} of "
                f"{self.engine.grad_accum_steps} micro-batches done); save after an optimizer step or call flush() first")
        return checkpoint.trainer_state(self)

    def load_state_dict(self, state: dict, *, source: str = "the checkpoint") -> None:
        """Restore what :meth:`state_dict` returned, RNG states included; all or nothing.

        An open window is discarded; a Trainer still waiting to autotune takes the checkpoint's policy.

        Raises:
            ValueError: the state is not a Trainer state, is incomplete or damaged, or does not fit this
                model or optimizer; nothing was changed.
        """
        checkpoint.load_state(self, state, source)

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
            ValueError: the file is truncated, corrupt, not a precisionloop checkpoint, or does not fit this
                model or optimizer (then nothing is changed).
        """
        self.load_state_dict(checkpoint.read(path), source=f"checkpoint {path}")


# --- autotune glue (to be merged) ---
from . import tuning  # noqa: E402 - tuning never imports the trainer


def _autotuned(cls, model: nn.Module, optimizer: torch.optim.Optimizer, sample_batch: Any, *,
               candidates: Sequence[tuning.Candidate] | None = None, compile: bool = False, steps: int = 10,
               warmup: int = 3, rounds: int = 3, tolerance: float = 0.05, **trainer_options: Any) -> "Trainer":
    """A Trainer at the configuration :func:`precisionloop.autotune` picks on ``sample_batch``; its table is
    ``trainer.autotune_result``. ``compile=True`` adds compiled candidates; the other options go to the Trainer."""
    result = tuning.tune(cls, model, tuning.optimizer_like(optimizer, model), sample_batch, candidates=candidates,
                         compile=compile, steps=steps, warmup=warmup, rounds=rounds, tolerance=tolerance,
                         **trainer_options)
    trainer = cls(model, optimizer, result.policy, compile=result.best.compile, **trainer_options)
    trainer.autotune_result = result
    return trainer


Trainer.autotuned = classmethod(_autotuned)


def autotune(model: nn.Module, optimizer_factory: Callable, sample_batch: Any, **options: Any) -> tuning.AutotuneResult:
    """:func:`precisionloop.tuning.tune` with :class:`Trainer`: the fastest sound precision for ``model``, untouched.

    Args:
        optimizer_factory: builds a fresh optimizer from parameters, e.g. ``lambda p: torch.optim.AdamW(p)``.
        sample_batch: one real batch, as ``Trainer.step`` takes it.
        options: ``tune``'s (``candidates``, ``compile``, ``steps``, ``tolerance``, ...) and the Trainer's.

    Raises:
        ValueError: bad arguments.
        RuntimeError: every candidate was rejected.
    """
    return tuning.tune(Trainer, model, optimizer_factory, sample_batch, **options)
