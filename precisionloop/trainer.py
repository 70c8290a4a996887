"""The Trainer: the public front end that checks arguments, assembles the parts and delegates.

The step lives in :mod:`precisionloop.engine`, the loop in :mod:`precisionloop.loop`, the state
in :mod:`precisionloop.checkpoint` and the measuring in :mod:`precisionloop.tuning`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from . import checkpoint, loop
from . import distributed as _dist
from .captured import check_graphable
from .guard import fusable, fuse_default_optimizer
from .engine import StepEngine, StepResult, TrainStats, compile_mode, prepare_model, to_device
from .policy import PrecisionPolicy, _as_device, _parse_device, get_policy
from .tuning import autotune as _autotune
from .tuning import default_candidates

__all__ = ["Trainer", "StepResult", "TrainStats"]

log = logging.getLogger(__name__)


class Trainer:
    """Trains a model with fp32 master weights under a precision policy.

    Args:
        model: the model; it is moved to ``device`` and passed through ``policy.prepare_model``.
        optimizer: an optimizer over the model's trainable parameters.
        precision: a spec for :func:`precisionloop.get_policy` or a policy instance.
        device: where to train; CUDA when available, else the CPU.
        loss_fn: ``loss_fn(outputs, targets)``; ``torch.nn.functional.cross_entropy`` by default.
        scheduler: an LR scheduler, stepped only after optimizer steps that really happened.
            A ``ReduceLROnPlateau`` is stepped by ``fit`` instead, with the validation loss
            at each epoch's end.
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the unscaled gradients to this total norm.
        max_consecutive_skips: raise after this many skipped steps in a row. On CUDA without a
            scheduler the verdicts are read 16 steps at a time, so the error can come up to
            16 steps later; ``trainer.stats`` reads them all at once.
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
        fuse_optimizer: on CUDA, a torch ``SGD``, ``Adam`` or ``AdamW`` built with its default
            implementation (``fused`` and ``foreach`` not given) runs its fused one, whose
            step takes the skip verdict on the device: no host sync per step. The algorithm
            and hyperparameters are unchanged. ``False`` keeps the optimizer as given; each
            optimizer step then syncs the host once to decide a skip. Under FSDP2, only Adam
            and AdamW (whose fused kernels take sharded parameters).
        graph_optimizer_step: on CUDA, capture the guarded optimizer step (the inf/NaN check and a
            fused SGD, Adam or AdamW update) as one CUDA graph and replay it each step, which saves
            the optimizer's host time on launch-bound steps. Results are bit for bit the eager
            step's with each LR rounded to fp32 (the graph reads it from a tensor). It costs one
            more gradient-sized buffer and a copy per step. Not under fp16 (its loss scaler), no
            clipping, not distributed; partial windows and probed steps run eagerly, and so does every step after
            a warning if the optimizer's settings keep changing. See :mod:`precisionloop.captured`.
        autotune: with ``precision="auto"``, choose the configuration by measuring:
            the first ``step`` runs :func:`precisionloop.autotune` on copies of the model
            with that first batch (compiled candidates too when ``compile=True``), prints
            the table, and trains with the fastest sound candidate. Not with ``distributed``.

    Raises:
        ValueError: bad arguments, an optimizer that does not hold the model's
            trainable parameters, parameters that are not fp32, a device that cannot
            run the precision, a fused SGD/Adagrad under ``distributed="fsdp"``, or a
            ``graph_optimizer_step`` the setup cannot capture (the message says why).

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
                 scheduler: Any = None, grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 max_consecutive_skips: int = 20, compile: bool | str = False, distributed: str | None = "auto",
                 autotune: bool = False, fuse_optimizer: bool = True, graph_optimizer_step: bool = False):
        _check_arguments(model, optimizer, loss_fn, autotune=autotune, fuse_optimizer=fuse_optimizer,
                         graph_optimizer_step=graph_optimizer_step)
        loop.check_int("grad_accum_steps", grad_accum_steps, 1)
        loop.check_int("max_consecutive_skips", max_consecutive_skips, 1)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real)
                                          or not 0 < max_grad_norm < float("inf")):
            raise ValueError(f"max_grad_norm must be a finite number > 0, or None; got {max_grad_norm!r}")
        if scheduler is not None and (isinstance(scheduler, type) or not callable(getattr(scheduler, "step", None))):
            raise ValueError(f"scheduler must be an LR scheduler instance built on the optimizer, got {scheduler!r}")
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler drives a different optimizer than the one given to the Trainer")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("LBFGS steps through a closure that re-evaluates the loss, which a guarded step cannot "
                             "skip; use another torch.optim optimizer")
        if autotune and not (isinstance(precision, str) and precision.strip().lower() == "auto"):
            raise ValueError(f"autotune=True chooses the precision itself: pass precision='auto', not {precision!r}")
        self.distributed, device = _dist.resolve(distributed, None if device is None else _parse_device(device))
        if autotune and self.distributed:
            raise ValueError("autotune=True runs on one process: tune once with precisionloop.autotune and pass "
                             "the chosen policy to the distributed Trainer")
        self.device = _as_device(device)
        policy = get_policy(precision, self.device)
        policy.check_model(model, self.device)
        if self.distributed == "fsdp":
            policy.check_sharding(model, self.device)
        _check_master_weights(model, policy)
        _check_optimizer(model, optimizer)
        _dist.check_optimizer(optimizer, self.distributed)
        mode = compile_mode(compile, self.device)
        if graph_optimizer_step:
            check_graphable(self.device, policy.make_guard(self.device.type), optimizer,
                            will_fuse=fuse_optimizer and fusable(optimizer, model), max_grad_norm=max_grad_norm,
                            distributed=self.distributed, autotune=autotune)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.loss_fn = loss_fn if loss_fn is not None else nn.functional.cross_entropy
        self.underflow_history: list[dict] = []  # filled by fit(underflow_every=N)
        self.loop_state = loop.LoopState()
        self._flags_held_for: PrecisionPolicy | None = None  # set while fit holds that policy's backend flags
        self.model = model.to(self.device)
        if fuse_optimizer and _dist.may_fuse(optimizer, self.distributed) and fuse_default_optimizer(optimizer, model):
            log.info("%s runs its fused implementation, so a skipped step is decided on the device without a host "
                     "sync (fuse_optimizer=False keeps it as given)", type(optimizer).__name__)
        self.engine = StepEngine(self.model, optimizer, self.device, loss_of=self.compute_loss,
                                 scheduler=None if loop.is_plateau(scheduler) else scheduler,
                                 grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
                                 max_consecutive_skips=max_consecutive_skips, distributed=self.distributed,
                                 graph_optimizer_step=graph_optimizer_step)
        self._autotune_compile = compile if autotune else None  # the choice waits for the first batch
        self._configure(policy, mode, prepare=not autotune)
        if _dist.is_main():
            log.info("Trainer on %s with %r%s", self.device, self.policy,
                     f", {self.distributed} over {_dist.world_size()} processes" if self.distributed else "")

    def _configure(self, policy: PrecisionPolicy, mode: str | None, prepare: bool = True) -> None:
        """Apply a policy (and compile mode): layout, compile, wrapping, gradient guard.

        The Trainer's own fields change only once the policy has prepared the model, so a policy
        that refuses the model or its device leaves the Trainer as it was.
        """
        self.engine.settle()  # the old guard's verdicts are booked under it, before anything changes
        model, input_format = self.model, torch.contiguous_format
        guard = policy.make_guard(self.device.type)
        if prepare:
            policy.check_compile(mode, self.device.type)
            _check_master_weights(model, policy)
            model, input_format = prepare_model(model, policy, mode, self.distributed, self.device, self.optimizer)
            guard = _dist.adapt_guard(guard, self.distributed, self.device.type)
        self.model, self._input_format, self.policy, self.compile_mode = model, input_format, policy, mode
        self.engine.configure(self.model, policy, guard, mode)

    def _run_autotune(self, batch: Any) -> None:
        candidates = default_candidates(self.model, self.device, compile=self._autotune_compile not in (None, False))
        result = _autotune(self.model, _trial_optimizer(self.optimizer, self.model), batch, candidates,
                           device=self.device, loss_fn=self.loss_fn, loss_for=self._loss_for, verbose=self.is_main)
        self._autotune_compile = None
        self._configure(result.policy, compile_mode(result.best.compile, self.device))
        log.info("autotune: training with %s", result.best.label)

    def _loss_for(self, model: nn.Module) -> Callable[[Any], torch.Tensor]:
        """This Trainer's ``compute_loss`` (a subclass's too) on another model: autotune's trials run it."""
        view = copy.copy(self)
        view.model = model
        return view.compute_loss

    @property
    def is_main(self) -> bool:
        """True on the process that reports and writes checkpoints: rank 0, or the only one."""
        return _dist.is_main()

    def __repr__(self) -> str:
        return f"Trainer(model={type(self.model).__name__}, device={self.device}, policy={self.policy!r})"

    # Override points ---------------------------------------------------------------------------------

    def forward_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run the model on one batch and return ``(outputs, targets)``; override for other batch shapes."""
        inputs, targets = _pair(batch)
        return self.model(inputs), targets

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch; runs under autocast. Override it for other losses or batch shapes."""
        return self.loss_fn(*self.forward_batch(batch))

    def _evaluation_step(self, batch: Any, need_outputs: bool) -> tuple[torch.Tensor, Any, Any]:
        """Loss, outputs and targets for validation, through the same override points as training."""
        if type(self).compute_loss is Trainer.compute_loss:  # one forward gives both
            outputs, targets = self.forward_batch(batch)
            return self.loss_fn(outputs, targets), outputs, targets
        loss = self.compute_loss(batch)
        # An overridden compute_loss defines the loss; metrics still need forward_batch's outputs.
        return (loss, *self.forward_batch(batch)) if need_outputs else (loss, None, None)

    # The step ----------------------------------------------------------------------------------------

    def step(self, batch: Any) -> StepResult:
        """Train on one micro-batch; every ``grad_accum_steps`` calls take one optimizer step.

        No host sync happens here unless the optimizer forces one: a non-fused optimizer
        under fp16 (``GradScaler.step`` reads the inf check) or under fp32/bf16 (the skip
        decision is made on the host). With a fused optimizer the skip happens on the
        device, and the step's verdict is booked later: at the next optimizer step with a
        scheduler, else in blocks of 16 steps on CUDA (``trainer.stats`` books all). Gradients are
        enabled inside the step even under the caller's ``torch.no_grad()``. The policy's
        backend flags are set for the step and the caller's restored after it; a loop of your
        own that holds ``trainer.policy.backend_flags()`` around its steps saves those writes.

        Raises:
            ValueError: the batch is empty (nothing is changed).
            TypeError: the batch is not ``(inputs, targets)`` and neither ``forward_batch`` nor ``compute_loss``
                is overridden (nothing is changed, an open accumulation window included).
        """
        if loop.batch_size(batch) == 0:
            raise ValueError("the batch is empty (batch size 0): nothing to train on; nothing was changed")
        if not ((type(batch) is tuple or type(batch) is list) and len(batch) == 2) and _default_batch_shape(self):
            _check_pair(batch)  # refused here, not in the step, which would drop an open window
        if self._autotune_compile is not None:
            self._run_autotune(batch)
        with self._backend_flags():
            return self.engine.step(self.to_device(batch))

    def flush(self) -> StepResult | None:
        """Take the optimizer step for an incomplete accumulation window, if one is open.

        The window's gradients are rescaled to the mean over the micro-batches it
        holds, as if the accumulated batch had simply been smaller. The result's
        ``loss`` is NaN: no micro-batch ran in this call. As with ``step``, an
        exception (a Ctrl-C too) discards the window, so a retry never steps on it twice.
        """
        with self._backend_flags():
            return self.engine.flush()

    def _backend_flags(self) -> contextlib.AbstractContextManager:
        """The policy's backend flags, or nothing to do while ``fit`` holds them for this policy."""
        return contextlib.nullcontext() if self._flags_held_for is self.policy else self.policy.backend_flags()

    @property
    def stats(self) -> TrainStats:
        """Optimizer-step and loss-scale counters, brought up to date (this waits for the last step).

        Raises:
            RuntimeError: the last steps hit ``max_consecutive_skips``.
        """
        self.engine.settle()
        return self.engine.stats

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler, or ``None`` when the policy needs none."""
        return self.engine.guard.scaler

    @property
    def global_step(self) -> int:
        """Optimizer steps taken or skipped."""
        return self.engine.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.engine.global_step = value

    @property
    def epoch(self) -> int:
        """Completed epochs."""
        return self.loop_state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.loop_state.epoch = value

    @property
    def batch_in_epoch(self) -> int:
        """Micro-batches consumed in the current epoch."""
        return self.loop_state.batch_in_epoch

    @batch_in_epoch.setter
    def batch_in_epoch(self, value: int) -> None:
        self.loop_state.batch_in_epoch = value

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.engine.grad_accum_steps

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping norm, or None."""
        return self.engine.max_grad_norm

    @property
    def max_consecutive_skips(self) -> int:
        """Skipped optimizer steps in a row that raise."""
        return self.engine.max_consecutive_skips

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to the device, 4-D float tensors in the model's layout."""
        return to_device(batch, self.device, self._input_format)

    # The loop ----------------------------------------------------------------------------------------

    def fit(self, train_loader: Iterable, epochs: int = 1, *, val_loader: Iterable | None = None,
            metrics: Mapping[str, Any] | None = None, max_steps: int | None = None, progress: bool = True,
            callbacks: Sequence[Any] = (), checkpoint_dir: str | os.PathLike | None = None,
            checkpoint_every: int | None = None, keep_last: int | None = None, log_every: int = 20,
            underflow_every: int | None = None) -> list[dict]:
        """Train until ``epochs`` epochs (counting restored ones) or ``max_steps`` optimizer steps.

        The model is put in train mode. An incomplete accumulation window at the end of an
        epoch is stepped, with its gradients averaged over the micro-batches it holds (see
        :meth:`flush`), and counts as a step for callbacks and ``checkpoint_every``. A
        ``ReduceLROnPlateau`` scheduler is stepped with ``val_loss`` after each epoch. If a
        step fails or is interrupted, its accumulation window is discarded and the next
        ``fit`` replays it. The policy's backend flags (TF32, ``cudnn.benchmark``) are set at
        each epoch's start and the caller's restored at its end; ``on_step_end`` callbacks,
        periodic saves and the loader's iteration in this process run under them too.

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
            log_every: refresh the progress bar's loss (the last booked step's; no host sync) every this many steps.
            underflow_every: measure gradient underflow every this many optimizer steps
                (see :mod:`precisionloop.diagnostics`); off by default.

        Returns:
            One dict per epoch run: ``epoch``, ``train_loss``, ``steps``, ``skipped``,
            ``time_s``, ``samples_per_s``, ``complete``, the loss-scale counters, and
            ``val_loss`` plus each metric under its name when ``val_loader`` is given.

        Raises:
            ValueError: bad arguments, or a ReduceLROnPlateau without ``val_loader``.
        """
        plan = loop.FitPlan(epochs, max_steps, progress, callbacks, checkpoint_dir, checkpoint_every, keep_last,
                            log_every, underflow_every)
        return loop.fit(self, train_loader, plan, val_loader, metrics)

    def evaluate(self, loader: Iterable, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Mean loss and each metric over ``loader``, in eval mode, without grad, under the policy's autocast.

        The loss is ``compute_loss``'s (a subclass's override too); metrics see ``forward_batch``'s outputs.

        Args:
            loader: an iterable of batches.
            metrics: torchmetrics ``Metric`` objects by name; each is reset before and after.

        Returns:
            ``{"val_loss": mean loss, name: metric value, ...}``.
        """
        return loop.evaluate(self, loader, metrics)

    # State -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: model, optimizer, scheduler, scaler, counters and RNGs.

        As torch's ``state_dict``, it holds the live weight and optimizer tensors (the counters and RNG states
        are copies): training on changes them in it. ``copy.deepcopy`` it to keep a snapshot in memory.

        Raises:
            RuntimeError: an accumulation window is open (its gradients cannot be saved).
        """
        if self.engine.micro:
            raise RuntimeError(
                f"cannot save in the middle of an accumulation window ({self.engine.micro} of {self.engine.grad_accum_steps} "
                "micro-batches done); save after an optimizer step or call flush() first")
        return checkpoint.trainer_state(self)

    def load_state_dict(self, state: dict, *, source: str = "the checkpoint") -> None:
        """Restore what :meth:`state_dict` returned, including the RNG states; all or nothing.

        An open accumulation window is discarded. A Trainer still waiting to autotune takes
        the checkpoint's policy instead: its precision, settings and ``keep_fp32``.

        Raises:
            ValueError: the state is not a Trainer state, is incomplete or damaged, or does not fit this
                model or optimizer; nothing was changed.
        """
        pending = self._autotune_compile is not None  # the policy comes from the checkpoint: its scaler is checked below
        checkpoint.check_fits(self.model, self.optimizer, state, source, self.scheduler,
                              stats_type=type(self.engine.stats), guard=None if pending else self.engine.guard)
        if pending:
            policy = checkpoint.policy_from_record(state, self.device)  # its settings too: fp8 layers, keep_fp32
            mode = compile_mode(state.get("compile_mode"), self.device)  # as the saved run trained
            policy.check_model(self.model, self.device)  # what can fail, before the model changes
            _check_master_weights(self.model, policy)
            checkpoint.check_scaler(state, policy.make_guard(self.device.type), source)
            self._configure(policy, mode)
            self._autotune_compile = None
            log.info("autotune skipped: resuming under the checkpoint's precision %s", self.policy.name)
        saved, now = state.get("precision"), self.policy.name
        if saved != now:
            warnings.warn(f"{source} was saved under precision {saved!r} and is loaded under {now!r}; "
                          "the loss-scaler state does not carry over between them", UserWarning, stacklevel=3)
        elif checkpoint.settings_differ(state, checkpoint.policy_record(self.policy)):
            warnings.warn(f"{source} was saved under precision {checkpoint.precision_of(state)} and is loaded under "
                          f"{checkpoint.precision_of(checkpoint.policy_record(self.policy))}; training goes on with "
                          "this Trainer's settings", UserWarning, stacklevel=3)
        checkpoint.restore_trainer(self, state)

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
            ValueError: the file is truncated, corrupt, not a precisionloop checkpoint, or
                does not fit this model or optimizer (then nothing is changed).
        """
        self.load_state_dict(checkpoint.read(path), source=f"checkpoint {path}")


def _pair(batch: Any, suffix: str = "") -> tuple[Any, Any]:
    """The default batch's ``(inputs, targets)``; a TypeError that names the override points for any other shape."""
    try:
        if isinstance(batch, (Mapping, str, bytes)):
            raise TypeError
        inputs, targets = batch
    except (TypeError, ValueError):
        raise TypeError(
            f"the default forward_batch expects a batch of (inputs, targets), got {type(batch).__name__}"
            f"{f' of length {len(batch)}' if isinstance(batch, (list, tuple)) else ''}; override "
            f"Trainer.forward_batch (or compute_loss) for other batch shapes{suffix}") from None
    return inputs, targets


def _default_batch_shape(trainer: Trainer) -> bool:
    """Whether the batch reaches the default ``forward_batch`` (neither it nor ``compute_loss`` is overridden)."""
    return (getattr(trainer.compute_loss, "__func__", None) is Trainer.compute_loss
            and getattr(trainer.forward_batch, "__func__", None) is Trainer.forward_batch)


def _check_pair(batch: Any) -> None:
    """Refuse a list or tuple not of two, and a mapping or string; leave other iterables to ``forward_batch``
    (a generator checked here would be used up before the step)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return
    if isinstance(batch, (tuple, list, Mapping, str, bytes)):
        _pair(batch, "; nothing was changed")


def _check_arguments(model: Any, optimizer: Any, loss_fn: Any, **flags: Any) -> None:
    """The arguments' kinds, before anything else looks at them (a string optimizer fails on param_groups otherwise)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(getattr(optimizer, "param_groups", None), list) and callable(getattr(optimizer, "step", None))):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or one like it: param_groups and step) built on "
                         f"the model's parameters, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (outputs, targets) -> loss tensor, such as "
                         f"torch.nn.functional.cross_entropy, or None for that default; got {loss_fn!r}")
    for name, value in flags.items():
        loop.check_flag(name, value)


def _check_master_weights(model: nn.Module, policy: PrecisionPolicy) -> None:
    reduced = policy.compute_dtype != torch.float32
    bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32
           and (p.dtype in (torch.float16, torch.bfloat16) or reduced)]
    if bad:
        raise ValueError(
            f"parameters {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} are not fp32; precision "
            f"{policy.name!r} keeps fp32 master weights and runs low precision through autocast. "
            "Call model.float() before building the Trainer")


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
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


def _trial_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A factory for fresh optimizers like ``optimizer`` over a copy's parameters, per-group settings included."""
    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        twin = {id(p): q for p, q in zip(model.parameters(), params)}  # the copy's parameters, in model order
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [twin[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        # Constructor arguments too (a custom optimizer may require lr), but only those it accepts:
        # torch 2.14's AdamW keeps decoupled_weight_decay in its defaults yet refuses it as an argument.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})
    return build
