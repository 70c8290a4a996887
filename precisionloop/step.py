"""The training step: forward and loss under autocast, backward, and every ``grad_accum_steps`` micro-batches one
optimizer step, the same for every precision: the gradients unscaled and checked for inf/NaN in one pass, the
policy's ``should_skip`` judging, the step taken or skipped on the device where the optimizer takes the flag. Each
step's outcome reaches the host without blocking and is counted later, so a fused optimizer never waits for the
step just queued."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Mapping
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
            micro-batch loss of the accumulation was not finite, or the policy's ``should_skip`` said so.
        scale: the loss scale after this step, or ``None`` without a scaler.
        grad_norm: the total gradient norm before clipping, when ``max_grad_norm`` is set or the policy's
            ``should_skip`` asked for it.
        nonfinite: the names of the parameters whose gradients held an inf or NaN, checked per parameter from the
            second skipped step in a row on, else ``()``. On CUDA "in a row" counts the skips the host has seen
            when the step starts: at once after ``result.skipped`` is read, else a step later.
        outputs: with ``step(batch, outputs=True)``, the model's outputs for this micro-batch, their tensors (in
            tuples, lists and mappings) detached, copied when compiled; else ``None``.
    """

    __slots__ = ("_loss", "_scale", "_grad_norm", "_outcome", "outputs")

    def __init__(self, loss: torch.Tensor, scale=None, grad_norm=None, outcome: _Outcome | None = None):
        self._loss, self._scale, self._grad_norm, self._outcome = loss, scale, grad_norm, outcome
        self.outputs = None

    loss = property(lambda self: float(self._loss))
    skipped = property(lambda self: self._outcome is not None and self._outcome.skipped())
    stepped = property(lambda self: self._outcome is not None and not self._outcome.skipped())
    scale = property(lambda self: (None if self._scale is None else self._scale.item()) if self._outcome is None
                     else self._outcome.scale())
    grad_norm = property(lambda self: None if self._grad_norm is None else self._grad_norm.item())
    nonfinite = property(lambda self: () if self._outcome is None else self._outcome.nonfinite())

    def __repr__(self) -> str:
        return (f"StepResult(loss={self.loss:.6g}, stepped={self.stepped}, skipped={self.skipped}, "
                f"scale={self.scale}, grad_norm={self.grad_norm})")


@dataclasses.dataclass
class TrainStats:
    """Optimizer-step and loss-scale counters over the run (``trainer.stats``)."""

    steps: int = 0
    """optimizer steps taken or skipped whose outcome has been counted (``Trainer.global_step`` counts them queued)"""
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


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``fn`` applied to every tensor in a nested batch or output: mappings, lists, tuples and named tuples."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in tree.items()}
        return mapped if type(tree) is dict else type(tree)(mapped)
    if isinstance(tree, (list, tuple)):
        mapped = [map_tensors(fn, v) for v in tree]
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)
    return tree


def output_field(outputs: Any, name: str) -> Any:
    """``outputs.name`` or ``outputs[name]`` (a Hugging Face ``ModelOutput`` has both), else None."""
    return outputs.get(name) if isinstance(outputs, Mapping) else getattr(outputs, name, None)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        hint = ("reduce it to one number per batch (reduction='mean')" if isinstance(loss, torch.Tensor) else
                "A loss_fn that gets None or a tuple usually means the targets never reached the model. " + OWN_LOSS)
        raise RefusedLoss(f"loss_fn (or compute_loss) returned {what}, not a scalar tensor; nothing was changed. {hint}")
    if not loss.requires_grad:
        raise RefusedLoss("the loss does not require grad, so backward would reach no parameter: are all parameters "
                           "frozen, or was it computed under torch.no_grad()? Nothing was changed")


def _start_momentum_buffers(optimizer: torch.optim.Optimizer) -> bool:
    """Zero momentum buffers for a fused SGD's new parameters (torch's ``empty_like`` ones would keep garbage through
    a skip); whether the step may be skipped on the device: without dampening momentum from zero steps as torch's
    first step does, with it (never fused by the Trainer) the host decides."""
    if type(optimizer) is not torch.optim.SGD:
        return True
    for group in optimizer.param_groups:
        if group["fused"] and group["momentum"] != 0:
            for p in group["params"]:
                if p.grad is not None and optimizer.state.get(p, {}).get("momentum_buffer") is None:
                    if group["dampening"] != 0:
                        return False
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


class _NoLossScale:
    """A scale of one (jmp's NoOpLossScale): the step never asks whether there is a loss scaler."""

    scaler = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def inverse(self) -> torch.Tensor | None:
        return None

    def adjust(self, nonfinite: torch.Tensor, row: torch.Tensor) -> None:
        """Update the scale after a step, and copy it into the outcome's ``row[2]``."""

    def value(self) -> torch.Tensor | None:
        return None


class _DynamicLossScale(_NoLossScale):
    """The policy's ``GradScaler``: its scale and growth settings, with the check and the update done by the step."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def inverse(self) -> torch.Tensor:
        return self.value().double().reciprocal().float()  # as GradScaler.unscale_ computes it

    def adjust(self, nonfinite: torch.Tensor, row: torch.Tensor) -> None:
        _compat.update_scale_(self.scaler, nonfinite)  # backs off on non-finite values only, not a judged skip
        row[2].copy_(self.value())

    def value(self) -> torch.Tensor | None:
        return _compat.scaler_scale_tensor(self.scaler)


def fuse_default_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Switch a torch SGD, Adam or AdamW on CUDA left at its default implementation, without state, to its fused one
    (the same algorithm, taking the inf/NaN flag as a device tensor: no host sync)."""
    groups = optimizer.param_groups
    if (type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) or optimizer.state
            or any(g.get("fused") is not None or g.get("foreach") or g.get("capturable") or g.get("differentiable")
                   or g.get("dampening") for g in groups)
            or not all(p.is_cuda and p.is_floating_point() for g in groups for p in g["params"])
            or any(getattr(m, "sparse", False) for m in model.modules())):
        return
    _compat.use_fused_implementation(optimizer)


class _Outcome:
    """One optimizer step in one row, ``[skip, non-finite, scale, the micro-batch losses...]`` (a non-finite NaN: not
    judged apart from the skip; a scale NaN: no scaler), which the check writes in place. ``send`` starts its way to
    the host: on CUDA a copy without blocking, then an event."""

    __slots__ = ("row", "values", "event", "names", "flags")

    def __init__(self, losses: list[torch.Tensor], zero: torch.Tensor, nan: torch.Tensor):
        self.row = torch.stack([zero, nan, nan, *losses]).float()  # a bf16 loss promoted, an fp64 one rounded
        self.values, self.event, self.names, self.flags = self.row, None, (), None

    def send(self, names: list[str], flags: torch.Tensor | None) -> None:
        self.names, self.flags = names, flags
        if self.row.is_cuda:
            with torch.inference_mode(False):
                self.values = self.row.to("cpu", non_blocking=True)
                self.flags = None if flags is None else flags.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.row.device))

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        if not isinstance(self.values, list):  # read once, then kept
            if self.event is not None:
                self.event.synchronize()
            self.values = self.values.tolist()
        return self.values

    def skipped(self) -> bool:
        return bool(self.read()[0])

    def scale(self) -> float | None:
        scale = self.read()[2]
        return None if math.isnan(scale) else scale

    def nonfinite(self) -> tuple[str, ...]:
        if self.flags is None:
            return ()
        if self.event is not None:
            self.event.synchronize()
        return tuple(name for name, flag in zip(self.names, self.flags.tolist()) if flag)


class StepEngine:
    """Accumulation, the checked optimizer step, clipping, the policy's judgement, counting outcomes, the skip limit.
    Its state round-trips through ``state_dict``. ``probe(step)`` runs between unscaling and clipping (``fit``'s
    underflow figures); what it returns, if not None, after the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: Any, scaler: Any, *,
                 device_type: str, compile_mode: str | None, forward_batch: Callable[[Any], Any],
                 compute_loss: Callable[[Any, Any], Any], scheduler: Any, grad_accum_steps: int,
                 max_grad_norm: float | None, max_consecutive_skips: int, distributed: str | None):
        self.model, self.optimizer, self.policy, self.device_type = model, optimizer, policy, device_type
        self.loss_scale = _NoLossScale() if scaler is None else _DynamicLossScale(scaler)
        self.forward_batch, self.compute_loss, self.compile_mode = forward_batch, compute_loss, compile_mode
        self.scheduler, self.distributed = scheduler, distributed
        self.grad_accum_steps, self.max_grad_norm, self.max_consecutive_skips = grad_accum_steps, max_grad_norm, max_consecutive_skips
        self.stats = TrainStats()
        self.last_loss: float | None = None  # the last micro-batch loss of the last counted optimizer step
        self.micro = self.global_step = self.consecutive_skips = 0
        self.collapse_warned = self.unsynced = self.sync_next = False  # sync_next: fit's last micro-batch of an epoch
        self.probe: Callable[[int], Callable[[], None] | None] | None = None
        self._pending: list[_Outcome] = []  # outcomes not counted yet, oldest first: at most two
        self._losses: list[torch.Tensor] = []  # the open accumulation's micro-batch losses, checked with its gradients
        self._zero_nan: tuple[torch.Tensor, torch.Tensor] | None = None

    def step(self, batch: Any, keep_outputs: bool = False) -> StepResult:
        """One micro-batch, then the optimizer step if the accumulation is complete; an exception discards it."""
        syncs = self.micro + 1 >= self.grad_accum_steps or self.sync_next  # else no gradient all-reduce
        compiled, nothing = self.compile_mode is not None, contextlib.nullcontext()
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's CUDA-graph outputs may be reused
        try:
            # A step under the caller's no_grad() still trains.
            with torch.enable_grad(), _compat.compiled_backward_like_eager() if compiled else nothing, \
                    _dist.no_sync(self.model) if self.distributed and not syncs else nothing:
                with self.policy.autocast(self.device_type):
                    outputs, targets = self.forward_batch(batch)
                    loss = self.compute_loss(outputs, targets)
                _check_loss(loss)
                if keep_outputs:  # copied when compiled: the next CUDA-graph replay overwrites them
                    outputs = map_tensors(lambda t: t.detach().clone() if compiled else t.detach(), outputs)
                else:  # dropped before the backward, which can then free them (a language model's logits are large)
                    outputs = None
                if loss.dim():
                    loss = loss.reshape(())  # the outcome stacks scalars
                scaled = self.loss_scale.scale(loss)
                (scaled / self.grad_accum_steps if self.grad_accum_steps > 1 else scaled).backward()
                self.unsynced = bool(self.distributed) and not syncs
                self.micro += 1
                kept = scaled.detach()  # scaled: the check unscales it with the gradients
                if self.micro < self.grad_accum_steps:
                    # A CUDA-graph output would be overwritten by the next replay; the scale is updated in place.
                    self._losses.append(kept.clone() if compiled else kept)
                    scale = self.loss_scale.value()
                    result = StepResult(loss.detach().clone() if compiled else loss.detach(),
                                        scale=None if scale is None else scale.clone())
                else:
                    self._losses.append(kept)
                    result = self.optimizer_step(None if compiled else loss.detach())
                result.outputs = outputs
                return result
        except RefusedLoss:
            raise  # refused before its backward: nothing changed
        except _compat.compile_error_types() as e:
            self.discard_accumulation()
            raise RuntimeError(f"torch.compile(mode={self.compile_mode!r}) failed: {str(e).strip()[:300]}. Train "
                               "eagerly with compile=False, or try another mode") from e
        except BaseException:
            self.discard_accumulation()
            raise

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

    def optimizer_step(self, loss: torch.Tensor | None = None) -> StepResult:
        """Check, clip, judge, then step or skip: on the device where the optimizer takes the flag, else on the host.
        The result's loss is ``loss`` if given, else the last micro-batch's (compiled: safe from the next CUDA-graph
        replay)."""
        # A scheduler must have set this step's LR, so with one every earlier outcome is counted first; without,
        # those already on the host or two steps old, so the host never waits for the step just queued.
        self.sync(wait_all=self.scheduler is not None)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # add_param_group too
        grads = [g for p in params if (g := p.grad) is not None]
        outcome = _Outcome(self._losses, *self._constants(self._losses[-1].device))
        nonfinite = self._check(grads, outcome.row)
        if self.micro < self.grad_accum_steps:  # a flushed partial accumulation: averaged over what it holds
            _compat.foreach_mul_(grads, self.grad_accum_steps / self.micro)
        after = self.probe(self.global_step + 1) if self.probe is not None else None
        names, flags = self._nonfinite_flags(params, nonfinite) if self._names_parameters(nonfinite) else ((), None)
        norm = [None if self.max_grad_norm is None else _whole(nn.utils.clip_grad_norm_(params, self.max_grad_norm))]

        def grad_norm() -> torch.Tensor:
            if norm[0] is None:
                norm[0] = _whole(nn.utils.get_total_norm(grads))
            return norm[0]

        skip = self.policy.should_skip(nonfinite, grad_norm)
        try:
            if _compat.skips_on_device(self.optimizer) and _start_momentum_buffers(self.optimizer):
                self.optimizer.grad_scale, self.optimizer.found_inf = None, skip  # GradScaler's contract
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.grad_scale, self.optimizer.found_inf
            elif not skip.item():  # the one host sync
                self.optimizer.step()
            self.loss_scale.adjust(nonfinite, outcome.row)
        finally:  # the weights may have changed: the step counts, whatever was raised
            self.micro, self.unsynced, self.global_step, self._losses = 0, False, self.global_step + 1, []
            with contextlib.suppress(Exception):  # counted with the others (a second error would hide the first)
                if skip is not nonfinite:
                    outcome.row[1].copy_(nonfinite)
                    outcome.row[0].copy_(skip)
                outcome.send(names, flags)
                self._pending.append(outcome)
        if after is not None:
            after()
        self.optimizer.zero_grad(set_to_none=True)
        if outcome.event is None:
            self.sync()  # on the host already: counted now, so the skip limit fires at its step
        return StepResult(outcome.row[-1] if loss is None else loss, grad_norm=norm[0], outcome=outcome)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """0 and NaN on the loss's device, made once: the outcome row starts from them without a fill per step."""
        if self._zero_nan is None or self._zero_nan[0].device != device:
            with torch.inference_mode(False):
                self._zero_nan = (torch.zeros((), device=device), torch.full((), float("nan"), device=device))
        return self._zero_nan

    def _check(self, grads: list[torch.Tensor], row: torch.Tensor) -> torch.Tensor:
        """``row[0]``: 1.0 if a gradient or a micro-batch loss (``row[3:]``, scaled) is not finite, else 0.0 (fp32:
        fused optimizers skip only on exactly 1), the gradients and the losses unscaled (exactly by a power-of-two scale,
        to the last bit by another); alike on every rank. A NaN loss (a batch of ignored targets: 0/0) can leave
        every gradient finite."""
        found = row[0]
        inverse = self.loss_scale.inverse()
        for group in _compat.group_by_device_and_dtype([row[3:], *map(_compat.dense_values, grads)]):
            here = found if group[0].device == found.device else torch.zeros_like(found, device=group[0].device)
            _compat.non_finite_any_(group, here, inverse)
            if here is not found:  # a maximum, not a sum: fused optimizers skip only on exactly 1
                torch.maximum(found, here.to(found.device), out=found)
        if self.distributed:  # each rank's loss is its own, whatever the gradients agree on
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        return found

    def _names_parameters(self, nonfinite: torch.Tensor) -> bool:
        """Whether this step checks each parameter: when the step before it was skipped. Under DDP/FSDP2 every rank
        decides alike, from the step two back on CUDA (outcomes arrive late), else the last; one process, from the
        last step counted."""
        lag = 2 if nonfinite.is_cuda else 1
        before = self.global_step + 1 - lag if self.distributed else self.stats.steps
        return before > self.stats.steps - self.consecutive_skips  # inside the run of skips that ends the count

    def _nonfinite_flags(self, params: list[nn.Parameter], nonfinite: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The parameters' names, and 1 for each whose gradient holds an inf or NaN: a read of every gradient, made
        only while steps are being skipped. Every rank gets the same flags (under FSDP2 each holds a shard)."""
        names = {p: n for n, p in _compat.unwrap(self.model).named_parameters()}
        flags = torch.stack([torch.zeros_like(nonfinite) if p.grad is None else
                             (~_compat.dense_values(p.grad).isfinite()).any().to(nonfinite) for p in params])
        if self.distributed:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return [names[p] for p in params], flags

    def accumulating(self) -> bool:
        """Whether micro-batches of an unfinished accumulation hold gradients."""
        return self.micro > 0

    def counted(self) -> tuple[TrainStats, float | None]:
        """The stats and the last loss counted so far, without waiting for the steps still on their way."""
        return self.stats, self.last_loss

    def set_probe(self, probe: Callable[[int], Callable[[], None] | None] | None) -> None:
        self.probe = probe

    def set_sync_next(self, sync: bool) -> None:
        """All-reduce the next micro-batch's gradients even if it does not complete the accumulation (an epoch's last)."""
        self.sync_next = sync

    def discard_accumulation(self) -> None:
        """Drop the gradients of an open accumulation (after an error, or on load)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro, self.unsynced, self._losses = 0, False, []

    def sync(self, wait_all: bool = True) -> None:
        """Count the steps' outcomes: all, waiting; else those on the host and any two steps old (skip limit too)."""
        while self._pending and (wait_all or len(self._pending) > 1 or self._pending[0].ready()):
            values = self._pending[0].read()  # an interrupt in the wait leaves it pending
            self._count(values, self._pending.pop(0))

    def _count(self, values: list[float], outcome: _Outcome) -> None:
        """Count an outcome; then the scheduler's step if it was taken, the collapse warning, the skip limit."""
        skipped, scale = bool(values[0]), outcome.scale()
        nonfinite = skipped if math.isnan(values[1]) else bool(values[1])
        self.last_loss = values[-1]
        self.stats.record(skipped, scale)
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
            why = "by the policy's should_skip, with finite gradients and loss"
            advice = "check what the policy's should_skip judges by, such as a gradient-norm bound"
            if nonfinite:
                why = "for non-finite gradients or loss"
                advice = "the loss or the model diverged. Lower the learning rate or check the data"
                advice += "" if scale is None else ", or try precision='bf16', which needs no loss scale"
            raise RuntimeError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped {why} (at optimizer step "
                f"{self.stats.steps}" + ("" if scale is None else f", loss scale {scale}")
                + (f"; non-finite gradients in {', '.join(self.stats.nonfinite[:8])}" if self.stats.nonfinite else "")
                + f"); {advice}")

    def state_dict(self) -> dict:
        """The loss scaler's state, the counters and the stats, every outcome counted first.

        Raises:
            RuntimeError: an accumulation is open (its gradients cannot be saved).
        """
        if self.micro:
            raise RuntimeError(f"cannot save with an accumulation open ({self.micro} of {self.grad_accum_steps} "
                               "micro-batches done): save after an optimizer step, or flush()")
        self.sync()
        scaler = self.loss_scale.scaler
        return {"scaler": None if scaler is None else scaler.state_dict(), "stats": dataclasses.asdict(self.stats),
                "counters": {"global_step": self.global_step, "consecutive_skips": self.consecutive_skips,
                             "collapse_warned": self.collapse_warned}}

    def load_state_dict(self, state: dict) -> None:
        """Replace all of it: the outcomes not counted yet, the open accumulation, the scale, counters and stats."""
        self._pending = []
        self.discard_accumulation()
        scaler, counters = self.loss_scale.scaler, state["counters"]
        if scaler is not None and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        self.global_step, self.consecutive_skips = counters["global_step"], counters["consecutive_skips"]
        self.collapse_warned = counters["collapse_warned"]
        self.stats = TrainStats(**state["stats"])
        self.last_loss = None  # the replaced run's last loss is not this one's
        if scaler is None:  # an fp16 run loaded without a scaler reports no scale
            self.stats.scale = self.stats.min_scale = self.stats.max_scale = None
        else:
            self.stats.scale = scaler.get_scale()


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm over every rank's shard under FSDP2 (a DTensor), as it is otherwise."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
