"""The training step: forward and loss under autocast, backward, and every ``grad_accum_steps`` micro-batches one
optimizer step behind the policy's gradient guard, which owns loss scaling and the inf/NaN verdict for every precision.

Each optimizer step's verdict (found inf, loss, scale) stays on the device and is copied to the host without blocking,
then booked later (see :meth:`StepEngine.optimizer_step`), so a fused optimizer never waits for the step just queued.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import _compat
from . import distributed as _dist
from .guard import GradientGuard
from .policy import PrecisionPolicy
from .results import StepResult, TrainStats

__all__ = ["StepEngine", "LossNotScalar", "LossWithoutGrad"]


class LossNotScalar(ValueError):
    """The loss of a micro-batch is not a scalar tensor; raised before its backward."""

    def __init__(self, loss: Any):
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        super().__init__(f"loss_fn (or compute_loss) returned {what}, not a scalar: reduce it to one number per "
                         "batch, e.g. reduction='mean' (nn.CrossEntropyLoss(reduction='none') gives one per sample); "
                         "nothing was changed")


class LossWithoutGrad(ValueError):
    """The loss of a micro-batch does not require grad, so its backward would reach no parameter."""

    def __init__(self) -> None:
        super().__init__("loss_fn (or compute_loss) returned a loss that does not require grad, so backward would "
                         "reach no parameter: the model's parameters are all frozen (requires_grad=False), or the "
                         "loss was detached or computed under torch.no_grad() or torch.inference_mode(); nothing "
                         "was changed")


class _HostCopy:
    """A step's verdict row on its way to the host: a non-blocking copy and an event after it; off CUDA, the row itself.

    torch puts a non-blocking copy to the CPU in pinned memory from its caching host allocator.
    """

    __slots__ = ("values", "event")

    def __init__(self, row: torch.Tensor):
        if not row.is_cuda:
            self.values, self.event = row, None
            return
        with torch.inference_mode(False):
            self.values = row.to("cpu", non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(row.device))  # the copy's stream, whichever device is current

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


class StepEngine:
    """Accumulation, the guarded optimizer step, clipping, the verdict's booking and the skip limit.

    ``compute_loss(batch)`` computes one micro-batch's loss, under the policy's autocast. ``probe``, when set, is
    called with the optimizer step's number after the gradients are unscaled and before they are clipped (fit's
    underflow telemetry). ``after_step``, the policy's ``optimizer_step_hook``, runs after each optimizer step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 compute_loss: Callable[[Any], torch.Tensor], scheduler: Any, grad_accum_steps: int,
                 max_grad_norm: float | None, max_consecutive_skips: int, distributed: str | None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.compute_loss, self.scheduler, self.distributed = compute_loss, scheduler, distributed
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        self.max_consecutive_skips = max_consecutive_skips
        self.policy: PrecisionPolicy | None = None
        self.guard: GradientGuard | None = None
        self.compile_mode: str | None = None
        self.last_scale: Any = None  # the loss scale after the last optimizer step (a device tensor or a float)
        self.last_loss: float | None = None  # the loss of the last booked optimizer step, on the host
        self.stats = TrainStats()
        self.micro = 0  # micro-batches since the last optimizer step
        self.global_step = 0  # optimizer steps taken or skipped
        self.consecutive_skips = 0
        self.collapse_warned = False
        self.unsynced = False  # the last backward skipped the gradient all-reduce
        self.sync_next = False  # set by the loop: the next micro-batch closes the epoch, so gradients must sync
        self.probe: Callable[[int], None] | None = None
        self.after_step: Callable[[], None] | None = None
        self._pending: list[_HostCopy] = []  # verdicts not booked yet, oldest first: at most two

    def configure(self, model: nn.Module, policy: PrecisionPolicy, guard: GradientGuard, mode: str | None) -> None:
        """Train ``model`` (already prepared) under ``policy`` with ``guard``; the counters carry on."""
        self.model, self.policy, self.guard, self.compile_mode = model, policy, guard, mode
        self.after_step = policy.optimizer_step_hook(model)
        self.last_scale = guard.scale_value()
        self.stats.scale = self.last_scale

    def params(self) -> list[nn.Parameter]:
        """The optimizer's parameters now: one added after construction is guarded and clipped too."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, batch: Any) -> StepResult:
        """One micro-batch: forward and backward, then the optimizer step if the window is full.

        An exception (a Ctrl-C too) discards the open accumulation window: no partial gradient leaks into the next step.
        """
        try:
            with torch.enable_grad():  # a step under the caller's no_grad() still trains
                if self.compile_mode is not None:
                    return self._compiled_step(batch)
                return self._step(batch)
        except (LossNotScalar, LossWithoutGrad):
            raise  # refused before its backward: the open window is as it was
        except BaseException:
            self.discard_window()
            raise

    def _step(self, batch: Any) -> StepResult:
        syncs = self.micro + 1 >= self.grad_accum_steps or self.sync_next
        # No gradient all-reduce on micro-steps that do not step; nothing to enter in one process.
        with _dist.no_sync(self.model) if self.distributed and not syncs else contextlib.nullcontext():
            with self.policy.autocast(self.device.type):
                loss = self.compute_loss(batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise LossNotScalar(loss)
            if not loss.requires_grad:
                raise LossWithoutGrad()
            scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
            self.guard.scale(scaled).backward()
        self.unsynced = bool(self.distributed) and not syncs
        self.micro += 1
        loss = loss.detach()
        if self.micro < self.grad_accum_steps:
            if self.compile_mode is not None:
                loss = loss.clone()  # a CUDA-graph output would be overwritten by the next replay
            return StepResult(loss, due=False, scale=self.last_scale)
        return self.optimizer_step(loss)  # it copies the loss into the verdict before a CUDA graph replays again

    def _compiled_step(self, batch: Any) -> StepResult:
        # Tells CUDA-graph trees a new iteration begins, so the last step's outputs may be reused; a no-op otherwise.
        torch.compiler.cudagraph_mark_step_begin()
        try:
            with _compat.compiled_backward_like_eager():
                return self._step(batch)
        except _compat.compile_error_types() as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"torch.compile(mode={self.compile_mode!r}) failed on "
                               f"{type(_dist.unwrap(self.model)).__name__}: {first}. "
                               "Train eagerly with compile=False, or try another mode") from e

    def flush(self) -> StepResult | None:
        """The optimizer step for an incomplete window, its gradients averaged over the micro-batches it holds.

        As in :meth:`step`, an exception discards the window: a retry never steps twice on it.
        """
        if self.micro == 0:
            return None
        try:
            # Outside inference mode: a first step would make optimizer state that later steps could not update.
            with torch.inference_mode(False):
                if self.unsynced:
                    _dist.average_gradients(self.model, self.params())
                return self.optimizer_step(torch.full((), float("nan"), dtype=torch.float32, device=self.device))
        except BaseException:
            self.discard_window()
            raise

    def optimizer_step(self, loss: torch.Tensor) -> StepResult:
        """Book the last step; unscale and check, rescale a partial window, probe, clip; step under the verdict."""
        # Earlier verdicts first. A scheduler must have set this step's LR: the last step is booked, waiting for
        # it. Otherwise a verdict is booked once its copy has landed, or two steps on, so the host never waits
        # for the step just queued, and the skip limit fires at most two optimizer steps late.
        self._book_pending(wait_all=self.scheduler is not None)
        found_inf, grad_norm = self._unscale_and_clip()
        copy = None
        try:
            self.guard.step(self.optimizer, found_inf)
            self.guard.update()
            row = self._verdict(found_inf, loss)
            copy = _HostCopy(row)
            self._pending.append(copy)
        finally:  # the weights may have changed: the step counts, whatever was raised
            self.micro, self.unsynced = 0, False
            self.global_step += 1
            if copy is None or not self._pending or self._pending[-1] is not copy:  # not queued: book it now
                self._book_failed_step(found_inf, loss)
        self.optimizer.zero_grad(set_to_none=True)
        on_host = self._pending[-1].event is None
        if self.guard.scaler is not None:
            self.last_scale = row[2]
        if self.after_step is not None:  # the policy's follow-up on the new weights (fp8 all-gather's scales)
            self.after_step()
        if on_host:  # on the CPU the verdict is booked now, after the follow-up: a skip limit raised here must not skip it
            self.sync()
        return StepResult(row[1], due=True, found_inf=row[0], scale=self.last_scale, grad_norm=grad_norm)

    def _book_failed_step(self, found_inf: torch.Tensor, loss: torch.Tensor) -> None:
        """After an error past the update: the step booked on the host now (an error path, so a sync is fine).

        A second error or Ctrl-C here is swallowed, so the first one is the one raised.
        """
        for _ in range(len(self._pending)):  # the steps before it first, each on its own
            with contextlib.suppress(Exception, KeyboardInterrupt):
                self._book_oldest()
        self._pending = []  # what could not be read is given up
        with contextlib.suppress(Exception, KeyboardInterrupt):
            if self.guard.scaler is not None:
                self.last_scale = self.guard.scale_value()
            values = self._verdict(found_inf, loss).tolist()
            self._count(values)
            self._follow(values)

    def _verdict(self, found_inf: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``[found_inf, loss, scale]`` as one row on the verdict's device: fp32, or fp64 for a float64 loss."""
        scale = self.guard.scale_tensor()
        parts = [found_inf, loss.to(found_inf.device)] + ([] if scale is None else [scale])
        row = torch.stack([t.reshape(()) for t in parts])
        return row if row.dtype in (torch.float32, torch.float64) else row.float()

    def _unscale_and_clip(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unscale and check the gradients, rescale a partial window, probe, clip: (found_inf, grad_norm)."""
        params = self.params()
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = self.guard.unscale_(self.optimizer, grads)
        if self.micro < self.grad_accum_steps:
            _compat.foreach_mul_(grads, self.grad_accum_steps / self.micro)
        if self.probe is not None:
            self.probe(self.global_step + 1)
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return found_inf, grad_norm

    def discard_window(self) -> None:
        """Drop the gradients of an open accumulation window (after an error, or on load)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro, self.unsynced = 0, False
        if self.guard is not None:
            self.guard.abandon()

    def sync(self) -> None:
        """Book every optimizer step's verdict not booked yet, waiting for them: counters, scheduler, skip limit.

        Raises:
            RuntimeError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        self._book_pending(wait_all=True)

    def _book_pending(self, wait_all: bool) -> None:
        """Book the pending verdicts, oldest first: all of them, or those landed and any two steps old."""
        while self._pending:
            if not wait_all and len(self._pending) < 2 and not self._pending[0].landed():
                return
            self._book_oldest()

    def _book_oldest(self) -> None:
        values = self._pending[0].read()  # an interrupt in the wait leaves it pending, to be read next time
        self._count(values)
        self._pending.pop(0)  # counted: never counted again, even if what follows raises
        self._follow(values)

    def counters(self) -> dict:
        """The counters a checkpoint saves (``stats`` apart)."""
        return {"global_step": self.global_step, "consecutive_skips": self.consecutive_skips,
                "collapse_warned": self.collapse_warned}

    def load_counters(self, counters: dict, stats: dict) -> None:
        """Take a checkpoint's counters and stats; the loss scale is read from the guard, already loaded."""
        self.global_step, self.consecutive_skips = counters["global_step"], counters["consecutive_skips"]
        self.collapse_warned = counters["collapse_warned"]
        self.stats = type(self.stats)(**stats)
        self.last_loss = None  # the replaced run's last loss (the progress bar's) is not this one's
        self.last_scale = self.stats.scale = self.guard.scale_value()
        if self.last_scale is None:  # no scaler here (a checkpoint of an fp16 run): no scale to report
            self.stats.min_scale = self.stats.max_scale = None

    def discard_pending(self) -> None:
        """Forget the verdict not yet booked: a load replaces the counters, stats and scheduler it would change."""
        self._pending = []

    def _count(self, values: list[float]) -> None:
        """A verdict's counters; no user code runs here."""
        skipped = bool(values[0])
        if not math.isnan(values[1]):  # a flush's verdict has no micro-batch loss
            self.last_loss = values[1]
        self.stats.record(skipped, values[2] if len(values) > 2 else None)
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0

    def _follow(self, values: list[float]) -> None:
        """What a counted verdict sets off: the scheduler's step if it was taken, the collapse warning, the skip limit."""
        skipped, scale = bool(values[0]), (values[2] if len(values) > 2 else None)
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        if scale is not None and scale < 1 and not self.collapse_warned:
            self.collapse_warned = True
            warnings.warn(f"the loss scale fell to {scale:g} (below 1) at optimizer step {self.stats.steps}: the loss "
                          "scale is collapsing, so gradients are non-finite even unscaled; fp16 is unlikely to train "
                          "this model", RuntimeWarning, stacklevel=_compat.stacklevel_outside_package())
        if skipped and self.consecutive_skips >= self.max_consecutive_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for non-finite gradients (at optimizer "
                f"step {self.stats.steps}, loss scale {scale}); the loss or the model diverged. "
                "Lower the learning rate, check the data, or try precision='bf16' or 'fp32'")

