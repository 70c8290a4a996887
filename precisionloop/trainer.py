"""The Trainer: checks its arguments, readies the model under the policy, and hands steps, epochs and checkpoints to
:mod:`~precisionloop.step`, :mod:`~precisionloop.loop` and :mod:`~precisionloop.checkpoint`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from . import _compat, checkpoint, loop, tuning, distributed as _dist, keep_fp32 as fp32_modules
from .loop import Checkpoints
from .memory import MemoryBreakdown, memory_breakdown
from .policy import PrecisionPolicy, resolve_device, warn_overridden_flags
from .precisions import get_policy
from .step import OWN_LOSS, RefusedLoss, StepEngine, StepResult, TrainStats, fuse_default_optimizer, output_field

__all__ = ["Trainer", "autotune"]


class Trainer:
    """Trains a model under a precision policy: fp32 master weights, or bf16 ones under ``"bf16-pure"``.

    Args:
        model: the model; it is moved to ``device`` and readied by the policy (layout, ``keep_fp32``).
        optimizer: an optimizer over exactly the model's trainable parameters. On CUDA a torch SGD, Adam or AdamW at its
            default implementation runs fused (same algorithm, no host sync per step) unless built with ``fused=False``.
        precision: a spec for :func:`precisionloop.get_policy` (``"bf16"``, ``"fp16"``, ...) or a policy instance.
        device: where to train; the current CUDA device when there is one, else the CPU.
        loss_fn: ``loss_fn(outputs, targets)``; ``torch.nn.functional.cross_entropy`` by default.
        scheduler: an LR scheduler built on ``optimizer``.
        scheduler_interval: ``"step"``: after each optimizer step taken, not skipped; ``"epoch"``: at each epoch's end
            of ``fit``. Required with a scheduler but a ``ReduceLROnPlateau``, which ``fit`` steps with ``val_loss``.
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the unscaled gradients to this total norm.
        max_consecutive_skips: raise after this many skipped steps in a row (on CUDA up to two steps late).
        compile: ``torch.compile`` the forward and backward: ``True`` is ``"reduce-overhead"`` (CUDA graphs) on CUDA,
            ``"default"`` elsewhere; a string names the mode. The optimizer step stays eager.
        distributed: under torchrun, ``"auto"`` (several processes) and ``"ddp"`` wrap the model in DDP, ``"fsdp"``
            shards it with FSDP2, ``None`` never distributes. A model you wrapped is used as it is, and refused where
            the policy would change its weights (bf16-pure's cast, channels_last): pass it unwrapped.

    Raises:
        ValueError: an optimizer that does not hold exactly the model's trainable parameters, a scheduler without
            ``scheduler_interval``, weights the policy refuses, or a device that cannot run it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 precision: str | torch.dtype | PrecisionPolicy = "bf16", *, device: str | torch.device | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, scheduler: Any = None,
                 scheduler_interval: str | None = None, grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 max_consecutive_skips: int = 20, compile: bool | str = False, distributed: str | None = "auto"):
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        _check_arguments(model, optimizer, loss_fn, scheduler, "epoch" if plateau else scheduler_interval,
                         grad_accum_steps, max_grad_norm)
        self.distributed, device = _dist.resolve(distributed, device)
        self.device = resolve_device(device)
        self.policy = policy = get_policy(precision, self.device)
        policy.check_model(model, self.device)
        policy.check_weights(model, optimizer)
        if self.device.type == "cuda":
            warn_overridden_flags(policy)
        if compile is True:  # CUDA graphs on CUDA; torch refuses an unknown mode
            compile = "reduce-overhead" if self.device.type == "cuda" else "default"
        self.compile_mode = None if compile is False else compile
        policy.check_compile(self.compile_mode, self.device.type)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = "epoch" if plateau else scheduler_interval
        self.loss_fn = loss_fn if loss_fn is not None else nn.functional.cross_entropy
        self.underflow_history: list[dict] = []  # filled by fit(underflow_every=N)
        self.epoch = self.batch_in_epoch = 0  # completed epochs; micro-batches trained in the current one
        self._rng_epoch_start: dict | None = None  # the RNG state the current epoch's shuffle was drawn from
        self._takes_pairs = type(self).forward_batch is Trainer.forward_batch
        self.model, self._input_format = self._prepare(model.to(self.device))
        self.scaler: torch.amp.GradScaler | None = policy.make_scaler(self.device.type)
        """The loss scaler, or ``None`` when there is none."""
        self._engine = StepEngine(
            self.model, optimizer, policy, self.scaler, device_type=self.device.type, compile_mode=self.compile_mode,
            forward_batch=self.forward_batch, compute_loss=self.compute_loss,
            scheduler=scheduler if self.scheduler_interval == "step" else None, grad_accum_steps=grad_accum_steps,
            max_grad_norm=max_grad_norm, max_consecutive_skips=max_consecutive_skips, distributed=self.distributed)

    def _prepare(self, model: nn.Module) -> tuple[nn.Module, torch.memory_format]:
        """The policy's layout and ``keep_fp32``, then compile in place (state-dict keys unchanged), then DDP/FSDP2."""
        if _compat.is_wrapped(model):
            _refuse_changes_to_wrapped(model, self.policy)
        if self.distributed != "fsdp" or type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            fuse_default_optimizer(self.optimizer, model)  # FSDP2's DTensors have no rule for fused SGD
        if _compat.is_wrapped(model):  # the user chose how to distribute it; its kept modules still run in fp32
            fp32_modules.keep_fp32_(_compat.unwrap(model), self.policy.keep_fp32)
        else:
            model = self.policy.prepare_model(model)
        input_format = self.policy.memory_format(_compat.unwrap(model))
        if self.compile_mode is not None:
            _compat.unwrap(model).compile(mode=self.compile_mode)
        if self.distributed and not _compat.is_wrapped(model):
            if self.distributed == "fsdp":  # FSDP2 shards only contiguous parameters; the inputs still steer cuDNN
                model = model.to(memory_format=torch.contiguous_format)
            model = _dist.wrap(model, self.distributed, self.policy.compute_dtype, self.device, self.optimizer)
        return model, input_format

    is_main = property(lambda self: _dist.is_main(), doc="True on rank 0 (or the only process): it reports and saves.")
    global_step = property(lambda self: self._engine.global_step,
                           doc="Optimizer steps taken or skipped, as they are queued (``stats.steps``: as counted).")
    grad_accum_steps = property(lambda self: self._engine.grad_accum_steps, doc="Micro-batches per optimizer step.")
    max_grad_norm = property(lambda self: self._engine.max_grad_norm, doc="The clipping norm, or None.")

    def __repr__(self) -> str:
        return f"Trainer(model={type(self.model).__name__}, device={self.device}, policy={self.policy!r})"

    def forward_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run the model on one batch and return ``(outputs, targets)``: ``model(inputs)`` for ``(inputs, targets)``,
        ``model(**batch)`` and its ``"labels"`` for a mapping (a Hugging Face model's batch); override it for others."""
        try:
            if isinstance(batch, Mapping):
                return self.model(**batch), batch.get("labels")
            inputs, targets = batch
            return self.model(inputs), targets
        except RuntimeError as e:  # torch names the dtypes, not the cause: numpy's default dtype
            tensors = batch.values() if isinstance(batch, Mapping) else [inputs]
            if "double" in str(e).lower() and any(getattr(t, "dtype", None) == torch.float64 for t in tensors):
                raise TypeError("the batch holds float64 tensors (numpy's default dtype), and the model's weights are "
                                "fp32: convert the inputs with .float(), e.g. torch.from_numpy(x).float()") from e
            raise

    def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """``loss_fn(outputs, targets)``; for an output object (a Hugging Face model's), ``loss_fn`` of its ``logits``
        if a ``loss_fn`` was given, else its ``loss``. Override it for another loss."""
        if isinstance(outputs, torch.Tensor):
            return self.loss_fn(outputs, targets)
        logits = output_field(outputs, "logits")
        if self.loss_fn is not nn.functional.cross_entropy:  # a loss_fn was given
            return self.loss_fn(outputs if logits is None else logits, targets)
        loss = output_field(outputs, "loss")
        if loss is not None:
            return loss
        if logits is not None and targets is None:
            raise RefusedLoss(f"the model returned a {type(outputs).__name__} with logits but no loss (a Hugging Face "
                              "model computes it only when the batch has 'labels'): add the labels to the batch, or "
                              "pass a loss_fn(logits, labels); nothing was changed")
        raise RefusedLoss(f"the model returned a {type(outputs).__name__}, and the default loss takes a tensor of "
                          f"logits; nothing was changed. {OWN_LOSS}")

    def step(self, batch: Any, *, outputs: bool = False) -> StepResult:
        """Train on one micro-batch; every ``grad_accum_steps`` calls take one optimizer step.

        The batch is moved to the device; grad is enabled; train/eval mode and the backend flags are left as they
        were. With a fused optimizer nothing waits for the step: its result is read when you read it.

        Args:
            batch: ``(inputs, targets)``, a mapping of keyword arguments, or what ``forward_batch`` takes.
            outputs: keep the model's outputs in ``result.outputs`` (for training metrics).

        Raises:
            ValueError: the loss is not a scalar or does not require grad (before backward; nothing changed).
            TypeError: a batch neither ``(inputs, targets)`` nor a mapping, with no ``forward_batch`` override.
        """
        pair = isinstance(batch, (tuple, list)) and len(batch) == 2
        if self._takes_pairs and not (pair or isinstance(batch, Mapping)):
            hint = (" (fit and evaluate take batches: a DataLoader, or a list of (inputs, targets) pairs, not "
                    "[inputs, targets])" if isinstance(batch, torch.Tensor) else "")
            raise TypeError(f"the default forward_batch expects a batch of (inputs, targets) or a mapping of the "
                            f"model's keyword arguments, got {type(batch).__name__}{hint}; override "
                            "Trainer.forward_batch for other batch shapes; nothing was changed")
        with self.policy.backend_flags(self.device.type):
            return self._engine.step(self.to_device(batch), outputs)

    def flush(self) -> StepResult | None:
        """The optimizer step of an open accumulation (gradients averaged, ``loss`` NaN), or None; errors discard it."""
        with self.policy.backend_flags(self.device.type):
            return self._engine.flush()

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The training step's autocast and backend flags, for your own evaluation code."""
        with self.policy.backend_flags(self.device.type), self.policy.autocast(self.device.type):
            yield

    @property
    def stats(self) -> TrainStats:
        """Optimizer-step and loss-scale counters, up to date (this waits for the last step).

        Raises:
            RuntimeError: the last steps hit ``max_consecutive_skips``.
        """
        self._engine.sync()
        return self._engine.stats

    def memory_breakdown(self) -> MemoryBreakdown:
        """Parameters, gradients, optimizer state and on CUDA the peak, in MB: :func:`precisionloop.memory_breakdown`."""
        return memory_breakdown(self)

    def to_device(self, batch: Any) -> Any:
        """Every tensor in a (nested) batch moved to the device, 4-D float tensors in the model's layout."""
        return loop.to_device(batch, self.device, self._input_format)

    def fit(self, train_loader: Iterable, epochs: int = 1, *, val_loader: Iterable | None = None,
            metrics: Mapping[str, Any] | None = None, max_steps: int | None = None, progress: bool = True,
            callbacks: Sequence[Any] = (), checkpoints: Checkpoints | None = None, log_every: int = 20,
            underflow_every: int | None = None, loggers: Sequence[Any] = ()) -> list[dict]:
        """Train until ``epochs`` epochs (restored ones included) or ``max_steps`` optimizer steps.

        The model is put in train mode; an accumulation left open at an epoch's end is stepped (see :meth:`flush`).
        An exception that stops ``fit`` discards the open accumulation; the next ``fit`` trains it again.

        Args:
            train_loader: an iterable of batches, usually a DataLoader.
            epochs: the total number of epochs, those restored from a checkpoint included.
            val_loader: batches for validation after every epoch.
            metrics: torchmetrics ``Metric`` objects by name, computed on ``val_loader``.
            max_steps: stop after this many optimizer steps in total.
            progress: a tqdm bar per epoch, with the loss and the share of time spent waiting for input.
            callbacks: objects with ``on_step_end(trainer, result)`` and/or ``on_epoch_end(trainer, record)``.
            checkpoints: periodic checkpoints, :class:`precisionloop.Checkpoints`.
            log_every: log every this many optimizer steps; refresh the bar every this many micro-batches.
            underflow_every: measure gradient underflow every this many optimizer steps (:mod:`precisionloop.diagnostics`).
            loggers: :mod:`precisionloop.loggers` or objects with ``log_metrics(metrics, step)``, also at epoch ends.

        Returns:
            One dict per epoch: ``epoch``, ``complete``, ``train_loss`` (of the finite losses), ``steps``,
            ``skipped``, ``time_s``, ``samples_per_s``, ``data_s`` and ``data_fraction`` (time waiting for the
            loader), the ``stats_*`` counters, and ``val_loss`` and the metrics with ``val_loader``.

        Raises:
            ValueError: a Dataset for a loader, metrics or a ReduceLROnPlateau without ``val_loader``, or an epoch
                with no batches.
        """
        return loop.fit(self, train_loader, epochs, val_loader, metrics, max_steps, progress, callbacks, checkpoints,
                        log_every, underflow_every, loggers)

    def evaluate(self, loader: Iterable, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """``{"val_loss": mean loss, name: metric, ...}`` over ``loader``: eval mode, no grad, the policy's autocast."""
        loop.check_loader("loader", loader)
        return loop.validate(self, loader, metrics or {})

    @classmethod
    def autotuned(cls, model: nn.Module, optimizer: torch.optim.Optimizer, sample_batch: Any, *,
                  candidates: Sequence[tuning.Candidate] | None = None, compile: bool = False, steps: int = 10,
                  warmup: int = 3, rounds: int = 3, tolerance: float = 0.05, **trainer_options: Any) -> Trainer:
        """A Trainer at the fastest sound configuration on ``sample_batch``, each candidate timed through this class
        on a copy of the model with a fresh optimizer like ``optimizer``; the table is ``trainer.autotune_result``.

        Raises:
            RuntimeError: every candidate was rejected.
        """
        result = tuning.tune(cls, model, tuning.optimizer_like(optimizer, model), sample_batch, candidates=candidates,
                             compile=compile, steps=steps, warmup=warmup, rounds=rounds, tolerance=tolerance,
                             **trainer_options)
        trainer = cls(model, optimizer, result.policy, compile=result.best.compile, **trainer_options)
        trainer.autotune_result = result
        return trainer

    def state_dict(self, extra: Mapping[str, Any] | None = None) -> dict:
        """Everything needed to resume exactly: model, optimizer, scheduler, scaler, counters and RNG states.

        Args:
            extra: your own objects with a ``state_dict`` (a model EMA, your loop's counters), saved by name.

        Raises:
            RuntimeError: an accumulation is open (its gradients cannot be saved).
        """
        return checkpoint.trainer_state(self, extra or {})

    def load_state_dict(self, state: dict, *, source: str = "the checkpoint",
                        extra: Mapping[str, Any] | None = None) -> None:
        """Restore :meth:`state_dict`'s dict and ``extra``'s objects, all or nothing; an open accumulation is dropped.

        Raises:
            ValueError: the state does not fit this model, optimizer or scheduler, holds none for an ``extra``
                name, or an ``extra`` object refused its own; nothing was changed.
        """
        checkpoint.load_state(self, state, source, extra or {})

    def save(self, path: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a checkpoint atomically: ``path`` holds the old file or the whole new one, never half.

        Args:
            extra: your own objects with a ``state_dict``, saved by name and restored by :meth:`load`.

        Raises:
            RuntimeError: an accumulation is open.
            TypeError: an ``extra`` state holds a type a checkpoint could not load (a numpy number, a ``Path``).
        """
        state, path = self.state_dict(extra), Path(path)  # every rank takes part: the state is gathered
        if self.is_main:
            checkpoint.atomic_save(state, path)
        _dist.barrier()  # no rank reads the file before rank 0 has written it
        return path

    def load(self, path: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> None:
        """Resume from :meth:`save`'s file and ``extra``'s objects; the next ``fit`` goes on where it stopped.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is damaged, not a precisionloop checkpoint, or does not fit (nothing changed).
        """
        self.load_state_dict(checkpoint.read(path), source=f"checkpoint {path}", extra=extra)


def _check_arguments(model: Any, optimizer: Any, loss_fn: Any, scheduler: Any, interval: Any, accum: Any,
                     max_norm: Any) -> None:
    """The traps users fall into, refused before anything changes."""
    if isinstance(loss_fn, type):
        raise ValueError(f"loss_fn is the class {loss_fn.__name__}; pass an instance, such as {loss_fn.__name__}()")
    if interval not in (("step", "epoch") if scheduler is not None else (None,)):
        raise ValueError(f"a scheduler needs scheduler_interval 'step' (after every optimizer step taken) or 'epoch' "
                         f"(at each epoch's end of fit), and none is needed without one; got scheduler="
                         f"{type(scheduler).__name__ if scheduler is not None else None}, scheduler_interval={interval!r}")
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ValueError(f"grad_accum_steps must be an int >= 1, got {accum!r}")
    if max_norm is not None and not max_norm > 0:  # a script's grad_clip=0.0 means "no clipping": here it is None
        raise ValueError(f"max_grad_norm must be > 0, or None for no clipping; {max_norm!r} would zero every gradient")
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing, foreign = [n for i, n in trainable.items() if i not in given], given - {id(p) for p in model.parameters()}
    if missing or foreign:
        raise ValueError("the optimizer must hold exactly the model's trainable parameters; "
                         + (f"it lacks {', '.join(missing[:5])}" if missing else f"it holds {len(foreign)} other tensors"))


def _refuse_changes_to_wrapped(model: nn.Module, policy: PrecisionPolicy) -> None:
    """A ValueError if the policy would cast or re-lay the weights of a model wrapped in DDP or FSDP2: the wrapper's
    buckets or shards were built for them as they are, so it would train them unchanged under the policy's name."""
    inner = _compat.unwrap(model)
    kept = {id(p) for _, m in fp32_modules.select_modules(inner, policy.keep_fp32) for p in m.parameters()}
    layout = policy.memory_format(inner)
    params = list(inner.named_parameters())
    cast = [n for n, p in params
            if policy.param_dtype != torch.float32 and p.dtype == torch.float32 and id(p) not in kept]
    relaid = [n for n, p in params if p.dim() == 4 and not p.is_contiguous(memory_format=layout)]
    if cast or relaid:
        change = f"cast {cast[0]} to {policy.param_dtype}" if cast else f"lay {relaid[0]} out in {layout}"
        raise ValueError(f"precision {policy.name!r} would {change} inside this {type(model).__name__}, which was "
                         "built for the weights as they are: pass the model unwrapped and let the Trainer wrap it "
                         "(distributed='ddp' or 'fsdp'); nothing was changed")


def autotune(model: nn.Module, optimizer_factory: Callable, sample_batch: Any, **options: Any) -> tuning.AutotuneResult:
    """The fastest sound precision for ``model`` (left untouched), timed through :class:`Trainer` on copies.

    Args:
        optimizer_factory: builds a fresh optimizer from parameters, e.g. ``lambda p: torch.optim.AdamW(p)``.
        options: :func:`precisionloop.tuning.tune`'s (``candidates``, ``compile``, ...) and the Trainer's.

    Raises:
        RuntimeError: every candidate was rejected.
    """
    return tuning.tune(Trainer, model, optimizer_factory, sample_batch, **options)
