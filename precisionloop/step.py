"""The training step: forward and loss under autocast, backward, and every ``grad_accum_steps`` micro-batches an
optimizer step behind the gradient guard (loss scaling, the inf/NaN check). Each step's outcome reaches the host
without blocking and is counted later, so a fused optimizer never waits for the step just queued."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import _compat, distributed as _dist

__all__ = ["StepResult", "TrainStats"]


class StepResult:
    """What one call to :meth:`Trainer.step` did; its values reach the host only when read.

    Attributes:
        loss: the micro-batch's loss, unscaled and not divided by ``grad_accum_steps``.
        stepped: the optimizer updated the parameters.
        skipped: this micro-batch ended an accumulation, but its optimizer step was skipped: a gradient or a
            micro-batch loss of the accumulation was not finite.
        scale: the loss scale after this step, or ``None`` without a scaler.
        grad_norm: the total gradient norm before clipping, when ``max_grad_norm`` is set.
        nonfinite: the names of the parameters whose gradients held an inf or NaN, checked per parameter from the
            second skipped step in a row on, else ``()``. On CUDA "in a row" counts the skips the host has seen
            when the step starts: at once after ``result.skipped`` is read, else a step later.
    """

    __slots__ = ("_loss", "_found_inf", "_scale", "_grad_norm", "_optimizer_step", "_outcome")

    def __init__(self, loss, optimizer_step: bool, found_inf=None, scale=None, grad_norm=None, outcome=None):
        self._loss, self._found_inf, self._scale, self._grad_norm = loss, found_inf, scale, grad_norm
        self._optimizer_step, self._outcome = optimizer_step, outcome  # this micro-batch ended an accumulation

    loss = property(lambda self: float(self._loss))
    skipped = property(lambda self: self._optimizer_step and bool(self._found_inf))
    stepped = property(lambda self: self._optimizer_step and not self.skipped)
    scale = property(lambda self: _host(self._scale))
    grad_norm = property(lambda self: _host(self._grad_norm))
    nonfinite = property(lambda self: self._outcome.nonfinite() if self._outcome is not None else ())

    def __repr__(self) -> str:
        return (f"StepResult(loss={self.loss:.6g}, stepped={self.stepped}, skipped={self.skipped}, "
                f"scale={self.scale}, grad_norm={self.grad_norm})")


def _host(value):
    return value.item() if isinstance(value, torch.Tensor) else value


@dataclasses.dataclass
class TrainStats:
    """Optimizer-step and loss-scale counters over the run (``trainer.stats``)."""

    steps: int = 0
    """optimizer steps taken or skipped"""
    skipped: int = 0
    steps_since_overflow: int = 0
    scale: float | None = None
    min_scale: float | None = None
    max_scale: float | None = None
    nonfinite: tuple[str, ...] = ()
    """the parameters named by the last skipped step checked per parameter (:attr:`StepResult.nonfinite`)"""

    def record(self, skipped: bool, scale: float | None) -> None:
        """Count one optimizer step."""
        self.steps += 1
        self.skipped += skipped
        self.steps_since_overflow = 0 if skipped else self.steps_since_overflow + 1
        if scale is not None:
            self.scale = scale
            self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
            self.max_scale = scale if self.max_scale is None else max(self.max_scale, scale)


class RefusedLoss(ValueError):
    """A loss refused before its backward: nothing was changed."""


OWN_LOSS = """If the model computes its own loss, give it the targets in forward_batch and return that loss:

    class MyTrainer(Trainer):
        def forward_batch(self, batch):
            inputs, targets = batch
            return self.model(inputs, targets), targets

        def compute_loss(self, outputs, targets):
            return outputs[1]  # (logits, loss); or outputs.loss for an output object"""


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        hint = ("reduce it to one number per batch (reduction='mean')" if isinstance(loss, torch.Tensor) else
                "A loss_fn that gets None or a tuple usually means the targets never reached the model. " + OWN_LOSS)
        raise RefusedLoss(f"loss_fn (or compute_loss) returned {what}, not a scalar tensor; nothing was changed. {hint}")
    if not loss.requires_grad:
        raise RefusedLoss("the loss does not require grad, so backward would reach no parameter: are all parameters "
                           "frozen, or was it computed under torch.no_grad()? Nothing was changed")


class _FusedSGDFirstStep:
    """Whether a fused SGD with momentum is about to step a parameter without a momentum buffer: torch makes them
    with ``empty_like`` and fills them in the kernel, so a step skipped on the device would leave garbage there.
    Until they exist the skip is decided on the host; the scan is redone only when the groups or the state change."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._waiting: list[torch.Tensor] = []

    def needs_host(self, optimizer: torch.optim.Optimizer) -> bool:
        key = (tuple((id(g["params"]), len(g["params"]), g.get("fused"), g.get("momentum")) for g in optimizer.param_groups),
               id(optimizer.state), len(optimizer.state))
        if key == self._key and not any(p.grad is not None for p in self._waiting):
            return False
        waiting = [p for g in optimizer.param_groups if g.get("fused") and g.get("momentum", 0) != 0
                   for p in g["params"] if optimizer.state.get(p, {}).get("momentum_buffer") is None]
        if any(p.grad is not None for p in waiting):
            return True
        self._key, self._waiting = key, waiting
        return False


def _step_on_host(optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    """``step()``; a fused SGD group mixing parameters with and without buffers (which torch's fused SGD refuses)
    steps, gradients unscaled by then, on the default implementation, which starts each new buffer itself."""
    mixed = [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum", 0) != 0
             and len({optimizer.state.get(p, {}).get("momentum_buffer") is None
                      for p in g["params"] if p.grad is not None}) == 2]
    if not mixed:
        return step()
    for group in mixed:
        group["fused"] = False
    try:
        optimizer.step()
    finally:
        for group in mixed:
            group["fused"] = True


class _Guard:
    """Between backward and the optimizer step under every precision: loss scaling if the policy makes a ``GradScaler``,
    and a step with inf/NaN gradients skipped (by every rank, via ``all_reduce_max``, without a scaler)."""

    def __init__(self, scaler: torch.amp.GradScaler | None, all_reduce_max: Callable[[torch.Tensor], Any] | None):
        self.scaler, self.all_reduce_max, self._first = scaler, all_reduce_max, _FusedSGDFirstStep()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor],
                          losses: list[torch.Tensor]) -> torch.Tensor:
        """1.0 (on the first gradient's device) if any gradient or micro-batch loss is not finite, else 0.0; the
        gradients unscaled first. A scaler's own flag is set, so that it skips the step and backs off."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            found = _compat.scaler_found_inf(self.scaler, optimizer)
        else:
            grads = [_compat.dense_values(g) for g in grads]
            found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")  # fp32: fused kernels
            for group in _compat.group_by_device_and_dtype(grads) if grads else ():
                here = found if group[0].device == found.device else torch.zeros_like(found, device=group[0].device)
                _compat.non_finite_any_(group, here)
                if here is not found:  # a maximum, not a sum: fused optimizers skip only on exactly 1
                    torch.maximum(found, here.to(found.device), out=found)
        if losses:  # a NaN loss (a batch of ignored targets: 0/0) can leave every gradient finite; checked on a copy
            _compat.non_finite_any_([torch.stack(losses).to(found.device, torch.float32)], found)
        if self.all_reduce_max is not None:  # each rank's loss is its own, whatever the gradients agree on
            self.all_reduce_max(found)
        return found

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        on_host = self._first.needs_host(optimizer)
        if self.scaler is not None and not on_host:
            self.scaler.step(optimizer)  # fused optimizers skip on the device, others sync inside GradScaler
        elif _compat.skips_on_device(optimizer) and not on_host:
            _compat.step_skipping_on_device(optimizer, found_inf)
        elif not found_inf.item():  # the one host sync (a scaler still backs off in update())
            _step_on_host(optimizer, optimizer.step if self.scaler is None else lambda: self.scaler.step(optimizer))
        if self.scaler is not None:
            self.scaler.update()

    def abandon(self) -> None:
        """Forget an unscale whose step never came (an error in between)."""
        if self.scaler is not None:
            _compat.forget_unscale(self.scaler)

    def scale_tensor(self) -> torch.Tensor | None:
        return None if self.scaler is None else _compat.scaler_scale_tensor(self.scaler)


def make_guard(scaler: torch.amp.GradScaler | None, distributed: str | None, device_type: str) -> _Guard:
    """The step's guard over the policy's scaler, with the collective it needs to agree across ranks."""
    if scaler is not None and distributed == "fsdp":  # each rank holds a shard: the scaler all-reduces its check
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device_type, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                                   backoff_factor=scaler.get_backoff_factor(),
                                   growth_interval=scaler.get_growth_interval())
    return _Guard(scaler, _dist.all_reduce_max_ if distributed else None)


def fuse_default_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Switch a torch SGD, Adam or AdamW on CUDA left at its default implementation, without state, to its fused one
    (the same algorithm, taking the inf/NaN flag as a device tensor: no host sync); whether it did."""
    groups = optimizer.param_groups
    if (type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) or optimizer.state
            or any(g.get("fused") is not None or g.get("foreach") or g.get("capturable") or g.get("differentiable")
                   for g in groups)
            or not all(p.is_cuda and p.is_floating_point() for g in groups for p in g["params"])
            or any(getattr(m, "sparse", False) for m in model.modules())):
        return False
    _compat.use_fused_implementation(optimizer)
    return True


class _Outcome:
    """A step's found inf, loss, scale (and named per-parameter flags) on their way to the host: on CUDA one row (safe
    from the next CUDA-graph replay) copied without blocking, an event after it; elsewhere the tensors, read at once."""

    __slots__ = ("found_inf", "loss", "scale", "values", "event", "names", "flags")

    def __init__(self, found_inf: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor | None,
                 names: list[str] = (), flags: torch.Tensor | None = None):
        self.event, self.names, self.flags = None, names, flags
        if not found_inf.is_cuda:  # the scaler updates its scale in place
            self.found_inf, self.loss, self.scale = found_inf, loss, None if scale is None else scale.clone()
            return
        row = torch.stack([found_inf, loss.to(found_inf.device, torch.float32), *([] if scale is None else [scale])])
        self.found_inf, self.loss, self.scale = row[0], row[1], None if scale is None else row[2]
        with torch.inference_mode(False):
            self.values = row.to("cpu", non_blocking=True)
            self.flags = None if flags is None else flags.to("cpu", non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(row.device))

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        if self.event is None:
            return [self.found_inf.item(), self.loss.item(), *([] if self.scale is None else [self.scale.item()])]
        self.event.synchronize()
        return self.values.tolist()

    def nonfinite(self) -> tuple[str, ...]:
        if self.flags is None:
            return ()
        if self.event is not None:
            self.event.synchronize()
        return tuple(name for name, flag in zip(self.names, self.flags.tolist()) if flag)


class StepEngine:
    """Accumulation, the guarded optimizer step, clipping, counting outcomes, the skip limit. ``probe(step)`` runs
    between unscaling and clipping (``fit``'s underflow figures); what it returns, if not None, after the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, guard: _Guard, *,
                 autocast: Callable[[], Any], compile_mode: str | None, forward_batch: Callable[[Any], Any],
                 compute_loss: Callable[[Any, Any], Any],
                 scheduler: Any, grad_accum_steps: int, max_grad_norm: float | None, max_consecutive_skips: int,
                 distributed: str | None):
        self.model, self.optimizer, self.guard, self.autocast, self.compile_mode = model, optimizer, guard, autocast, compile_mode
        self.forward_batch, self.compute_loss = forward_batch, compute_loss
        self.scheduler, self.distributed = scheduler, distributed
        self.grad_accum_steps, self.max_grad_norm, self.max_consecutive_skips = grad_accum_steps, max_grad_norm, max_consecutive_skips
        self.stats = TrainStats()
        self.last_loss: float | None = None  # the loss of the last counted optimizer step, on the host
        self.micro = self.global_step = self.consecutive_skips = 0
        self.collapse_warned = self.unsynced = self.sync_next = False  # sync_next: fit's last micro-batch of an epoch
        self.probe: Callable[[int], Callable[[], None] | None] | None = None
        self._pending: list[_Outcome] = []  # outcomes not counted yet, oldest first: at most two
        self._losses: list[torch.Tensor] = []  # the open accumulation's micro-batch losses, checked with its gradients
        self.recent_skips: collections.deque[int] = collections.deque(maxlen=2)  # the last skipped steps' numbers

    def step(self, batch: Any) -> StepResult:
        """One micro-batch, then the optimizer step if the accumulation is complete; an exception discards it."""
        try:
            with torch.enable_grad():  # a step under the caller's no_grad() still trains
                if self.compile_mode is None:
                    return self._step(batch)
                torch.compiler.cudagraph_mark_step_begin()  # the last step's CUDA-graph outputs may be reused
                with _compat.compiled_backward_like_eager():
                    return self._step(batch)
        except RefusedLoss:
            raise  # refused before its backward: nothing changed
        except _compat.compile_error_types() as e:
            self.discard_accumulation()
            raise RuntimeError(f"torch.compile(mode={self.compile_mode!r}) failed: {str(e).strip()[:300]}. Train "
                               "eagerly with compile=False, or try another mode") from e
        except BaseException:
            self.discard_accumulation()
            raise

    def _step(self, batch: Any) -> StepResult:
        syncs = self.micro + 1 >= self.grad_accum_steps or self.sync_next  # else no gradient all-reduce
        with _dist.no_sync(self.model) if self.distributed and not syncs else contextlib.nullcontext():
            with self.autocast():
                loss = self.compute_loss(*self.forward_batch(batch))
            _check_loss(loss)
            self.guard.scale(loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss).backward()
        self.unsynced = bool(self.distributed) and not syncs
        self.micro += 1
        loss = loss.detach().reshape(())  # a (1,) loss too: the outcome stacks scalars
        if self.micro < self.grad_accum_steps:
            # A CUDA-graph output would be overwritten by the next replay.
            loss = loss if self.compile_mode is None else loss.clone()
            self._losses.append(loss)
            scale = self.guard.scale_tensor()
            return StepResult(loss, False, scale=None if scale is None else scale.clone())
        self._losses.append(loss)
        return self.optimizer_step(loss)

    def flush(self) -> StepResult | None:
        """The optimizer step for an open accumulation, its gradients averaged over what it holds."""
        if self.micro == 0:
            return None
        try:
            with torch.inference_mode(False):  # optimizer state made in inference mode could not be updated later
                if self.unsynced:
                    _dist.average_gradients(self.model, self.optimizer)
                return self.optimizer_step(torch.full((), float("nan")))
        except BaseException:
            self.discard_accumulation()
            raise

    def optimizer_step(self, loss: torch.Tensor) -> StepResult:
        # A scheduler must have set this step's LR, so with one every earlier outcome is counted first; without,
        # those already on the host or two steps old, so the host never waits for the step just queued.
        self.sync(wait_all=self.scheduler is not None)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # add_param_group too
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = self.guard.unscale_and_check(self.optimizer, grads, self._losses)
        if self.micro < self.grad_accum_steps:  # a flushed partial accumulation: averaged over what it holds
            _compat.foreach_mul_(grads, self.grad_accum_steps / self.micro)
        after = self.probe(self.global_step + 1) if self.probe is not None else None
        if self.distributed:  # every rank decides alike: from the step two back on CUDA (counted above), else the last
            check = self.global_step + 1 - (2 if found_inf.is_cuda else 1) in self.recent_skips
        else:
            check = self.consecutive_skips > 0
        names, flags = self._nonfinite_flags(params, found_inf.device) if check else ((), None)
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        outcome = None
        try:
            self.guard.step(self.optimizer, found_inf)  # and the scaler's update
            outcome = _Outcome(found_inf, loss, self.guard.scale_tensor(), names, flags)
            self._pending.append(outcome)
        finally:  # the weights may have changed: the step counts, whatever was raised
            self.micro, self.unsynced, self.global_step, self._losses = 0, False, self.global_step + 1, []
            if outcome is None:  # counted with the others (a second error would hide the first)
                with contextlib.suppress(Exception):
                    self._pending.append(_Outcome(found_inf, loss, None))
        if after is not None:
            after()
        self.optimizer.zero_grad(set_to_none=True)
        if outcome.event is None:
            self.sync()  # on the host already: counted now, so the skip limit fires at its step
        return StepResult(outcome.loss, True, found_inf=outcome.found_inf, scale=outcome.scale, grad_norm=grad_norm,
                          outcome=outcome if flags is not None else None)

    def _nonfinite_flags(self, params: list[nn.Parameter], device: torch.device) -> tuple[list[str], torch.Tensor]:
        """The parameters' names, and 1 for each whose gradient holds an inf or NaN: a read of every gradient, made
        only while steps are being skipped. Every rank gets the same flags (under FSDP2 each holds a shard)."""
        names = {p: n for n, p in _dist.unwrap(self.model).named_parameters()}
        flags = torch.stack([torch.zeros((), device=device) if p.grad is None else
                             (~_compat.dense_values(p.grad).isfinite()).any().to(device, torch.float32) for p in params])
        if self.distributed:
            _dist.all_reduce_max_(flags)
        return [names[p] for p in params], flags

    def discard_accumulation(self) -> None:
        """Drop the gradients of an open accumulation (after an error, or on load)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro, self.unsynced, self._losses = 0, False, []
        self.guard.abandon()

    def sync(self, wait_all: bool = True) -> None:
        """Count the steps' outcomes: all, waiting; else those on the host and any two steps old (skip limit too)."""
        while self._pending and (wait_all or len(self._pending) > 1 or self._pending[0].ready()):
            values = self._pending[0].read()  # an interrupt in the wait leaves it pending
            self._count(values, self._pending.pop(0))

    def _count(self, values: list[float], outcome: _Outcome) -> None:
        """Count an outcome; then the scheduler's step if it was taken, the collapse warning, the skip limit."""
        skipped, scale = bool(values[0]), (values[2] if len(values) > 2 else None)
        if not math.isnan(values[1]):  # a flush has no micro-batch loss
            self.last_loss = values[1]
        self.stats.record(skipped, scale)
        if skipped:
            self.recent_skips.append(self.stats.steps)
        if skipped and outcome.flags is not None:
            self.stats.nonfinite = outcome.nonfinite()
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        if scale is not None and scale < 1 and not self.collapse_warned:
            self.collapse_warned = True
            warnings.warn(f"the loss scale fell to {scale:g} at optimizer step {self.stats.steps}: gradients are "
                          "non-finite even unscaled, so fp16 is unlikely to train this model", RuntimeWarning,
                          stacklevel=_compat.stacklevel_outside_package())
        if skipped and self.consecutive_skips == self.max_consecutive_skips:  # once a run: a save can follow
            raise RuntimeError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for non-finite gradients or loss (at "
                f"optimizer step {self.stats.steps}" + ("" if scale is None else f", loss scale {scale}")
                + (f"; non-finite gradients in {', '.join(self.stats.nonfinite[:8])}" if self.stats.nonfinite else "")
                + "); the loss or the model diverged. Lower the learning rate or check the data"
                + ("" if scale is None else ", or try precision='bf16', which needs no loss scale"))
