"""The training step: forward and loss under autocast, backward, and every ``grad_accum_steps``
micro-batches one optimizer step behind the policy's gradient guard.

One code path serves every precision: the guard (see :mod:`precisionloop.guard`) owns loss
scaling and the inf/NaN verdict. The verdict stays on the device, one row per optimizer step, and is
booked (counters, scheduler, skip limit) later: at the next optimizer step when a scheduler needs it,
else every ``VERDICTS_PER_COPY`` steps on CUDA. So a fused optimizer never syncs the host.
No loop and no files here: :mod:`precisionloop.loop` and :mod:`precisionloop.checkpoint` do those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import _compat, fp32_modules
from . import distributed as _dist
from .captured import CapturedStep
from .guard import GradientGuard
from .policy import PrecisionPolicy

VERDICTS_PER_COPY = 16
"""Without a scheduler, a CUDA step's verdicts reach the host in blocks of this many optimizer steps."""

__all__ = ["StepResult", "TrainStats", "StepEngine", "prepare_model", "compile_mode", "to_device"]


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


def compile_mode(compile: bool | str | None, device: torch.device) -> str | None:
    """The ``torch.compile`` mode for a ``compile=`` argument: None (eager), a default per device, or the named mode.

    Raises:
        ValueError: not a bool or a mode torch knows.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    modes = _compat.compile_modes()
    if not isinstance(compile, str) or compile not in modes:
        raise ValueError(f"compile must be False, True or a torch.compile mode among {', '.join(modes)}; got {compile!r}")
    return compile


def prepare_model(model: nn.Module, policy: PrecisionPolicy, mode: str | None, distributed: str | None,
                  device: torch.device, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.memory_format]:
    """Apply a policy to a model on its device: layout, compile, then DDP/FSDP2; returns it and the input layout."""
    if not _dist.is_wrapped(model):
        model = policy.prepare_model(model)
    else:  # a model the user wrapped keeps its layout; its kept modules (named as in the model inside) still run in fp32
        fp32_modules.keep_fp32_(_dist.unwrap(model), policy.keep_fp32)
    input_format = policy.memory_format(_dist.unwrap(model))
    if mode is not None:
        _dist.unwrap(model).compile(mode=mode)  # in place, so state_dict keys do not change
    if distributed == "fsdp" and input_format == torch.channels_last:
        # FSDP2 cannot shard non-contiguous parameters; channels_last inputs still steer cuDNN to NHWC kernels.
        model = model.to(memory_format=torch.contiguous_format)
    if distributed:
        model = _dist.wrap(model, distributed, policy, device, optimizer)
    return model, input_format


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format) -> Any:
    """Move every tensor in a (nested) batch to ``device``, 4-D float tensors in ``memory_format``."""
    if isinstance(batch, torch.Tensor):
        fmt = memory_format if batch.dim() == 4 and batch.is_floating_point() else torch.preserve_format
        if batch.device == device and (fmt is torch.preserve_format or (
                fmt is torch.channels_last and _exactly_channels_last(batch))):
            return batch  # what .to would return, without its argument parsing (microseconds a step)
        return batch.to(device, non_blocking=device.type == "cuda", memory_format=fmt)
    if isinstance(batch, dict):
        moved = {k: to_device(v, device, memory_format) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)  # a dict subclass stays one (attribute-style batches, say)
        except TypeError:
            return moved
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device, memory_format) for v in batch]
        if isinstance(batch, tuple):
            if all(m is v for m, v in zip(moved, batch)):
                return batch  # nothing moved: the same (immutable) tuple, not a copy of it
            if hasattr(batch, "_fields"):
                return type(batch)(*moved)  # a named tuple
        return type(batch)(moved)
    return batch


def _exactly_channels_last(t: torch.Tensor) -> bool:
    """A 4-D tensor with channels_last's own strides, and not also contiguous: one ``.to(channels_last)`` returns as is.

    ``.to`` goes by the layout the strides suggest, which differs from ``is_contiguous(channels_last)``
    where dimensions of size 1 carry other strides; tensors contiguous in both layouts, or with
    such strides, are left to it.
    """
    n, c, h, w = t.shape
    return t.stride() == (h * w * c, 1, w * c, c) and not t.is_contiguous()


class StepEngine:
    """Accumulation, the guarded optimizer step, clipping, the deferred verdict and the skip limit.

    ``loss_of(batch)`` computes one micro-batch's loss; it runs under the policy's autocast.
    ``probe``, when set, is called with the optimizer step's number after the gradients are
    unscaled and before they are clipped (fit's underflow telemetry uses it). ``after_step``, the
    policy's ``optimizer_step_hook``, runs after each optimizer step (fp8 all-gather's scales).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 loss_of: Callable[[Any], torch.Tensor], scheduler: Any, grad_accum_steps: int,
                 max_grad_norm: float | None, max_consecutive_skips: int, distributed: str | None,
                 graph_optimizer_step: bool = False):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.loss_of, self.scheduler, self.distributed = loss_of, scheduler, distributed
        self.grad_accum_steps, self.max_grad_norm, self.max_consecutive_skips = grad_accum_steps, max_grad_norm, max_consecutive_skips
        self.policy: PrecisionPolicy | None = None
        self.guard: GradientGuard | None = None
        self.compile_mode: str | None = None
        self.last_scale: Any = None
        self.last_loss: float | None = None  # the loss of the last booked optimizer step, on the host
        self.stats = TrainStats()
        self.micro = 0  # micro-batches since the last optimizer step
        self.global_step = 0  # optimizer steps taken or skipped
        self.consecutive_skips = 0
        self.collapse_warned = False
        self.unsynced = False  # the last backward skipped the gradient all-reduce
        self.sync_next = False  # set by the loop: the next micro-batch closes the epoch, so gradients must sync
        self.probe: Callable[[int], None] | None = None
        self.after_step: Callable[[], None] | None = None  # the policy's optimizer_step_hook, asked in configure
        # Verdicts per copy to the host (with no scheduler): on the CPU each step is booked at once.
        self._verdicts_per_copy = VERDICTS_PER_COPY if device.type == "cuda" else 1
        self._verdicts = _VerdictBlocks()
        self._limit_hit: tuple[int, int, float | None] | None = None  # the skip limit, reached in rows being booked
        self.graph_optimizer_step = graph_optimizer_step  # checked by the Trainer (captured.check_graphable)
        self.captured: CapturedStep | None = None  # the step's CUDA graph, made anew in configure
        self._kept_autocast: tuple[torch.autocast, tuple] | None = None

    def configure(self, model: nn.Module, policy: PrecisionPolicy, guard: GradientGuard, mode: str | None) -> None:
        """Train ``model`` (already prepared) under ``policy`` with ``guard``; the counters carry on."""
        self.model, self.policy, self.guard, self.compile_mode = model, policy, guard, mode
        self.after_step = policy.optimizer_step_hook(model)
        self._kept_autocast = None  # the policy's torch.autocast and the settings it was made under (see _autocast)
        self.captured = CapturedStep(self.optimizer) if self.graph_optimizer_step else None
        self.last_scale = guard.scale_value()
        self.stats.scale = self.last_scale

    @property
    def verdicts_per_copy(self) -> int:
        """Optimizer steps whose verdicts reach the host in one copy when there is no scheduler (from the next block)."""
        return self._verdicts_per_copy

    @verdicts_per_copy.setter
    def verdicts_per_copy(self, value: int) -> None:
        try:
            count = operator.index(value) if not isinstance(value, bool) else 0  # any integer type, not a bool
        except TypeError:
            count = 0
        if count < 1:
            raise ValueError(f"verdicts_per_copy must be an int of at least 1; got {value!r}")
        self._verdicts_per_copy = count

    def params(self) -> list[nn.Parameter]:
        """The optimizer's parameters now: one added after construction is guarded and clipped too."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, batch: Any) -> StepResult:
        """One micro-batch: forward and backward, then the optimizer step if the window is full.

        An exception (a Ctrl-C too) discards the open accumulation window, so no partial
        gradient leaks into the next step.
        """
        try:
            with torch.enable_grad():  # a step under the caller's no_grad() still trains
                if self.compile_mode is not None:
                    return self._compiled_step(batch)
                return self._step(batch)
        except BaseException:
            self.discard_window()
            raise

    def _step(self, batch: Any) -> StepResult:
        syncs = self.micro + 1 >= self.grad_accum_steps or self.sync_next
        # No gradient all-reduce on micro-steps that do not step; nothing to enter in one process.
        with _dist.no_sync(self.model) if self.distributed and not syncs else contextlib.nullcontext():
            autocast, key = self._autocast()
            with autocast:
                loss = self.loss_of(batch)
            if key is not None:
                self._kept_autocast = (autocast, key)
            scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
            self.guard.scale(scaled).backward()
        self.unsynced = bool(self.distributed) and not syncs
        self.micro += 1
        loss = loss.detach()
        if self.micro < self.grad_accum_steps:
            if self.compile_mode is not None:
                loss = loss.clone()  # a CUDA-graph output would be overwritten by the next replay
            return StepResult(loss, due=False, scale=self.last_scale)
        return self.optimizer_step(loss)  # it copies the loss into the verdict before anything replays

    def _compiled_step(self, batch: Any) -> StepResult:
        # Tells CUDA-graph trees a new iteration begins, so the last step's outputs may be reused; a no-op otherwise.
        torch.compiler.cudagraph_mark_step_begin()
        try:
            with _compat.compiled_backward_like_eager():
                return self._step(batch)
        except _compat.compile_error_types() as e:
            raise RuntimeError(
                f"torch.compile(mode={self.compile_mode!r}) failed on {type(_dist.unwrap(self.model)).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. "
                "Train eagerly with compile=False, or try another mode"
            ) from e

    def _autocast(self) -> tuple[contextlib.AbstractContextManager, tuple | None]:
        """The policy's autocast for this step, and the settings to keep it under (None: not to be kept).

        A ``torch.autocast`` the policy returned is kept and entered step after step, as nanoGPT's
        loop does: making one (its checks ask the device's properties) cost 5-10 us more than entering
        one made before, in hot loops on the H200 machines' hosts, and more inside a step. It reads the autocast cache setting and
        the default autocast dtype when made, so it is made again when either changes. It is taken
        out while in use (it saves the state it restores on itself, so a nested step must not enter
        it twice) and put back after. Anything else a policy returns (a generator's context manager
        cannot be entered twice) is asked for anew each step.
        """
        key = (torch.is_autocast_cache_enabled(), torch.get_autocast_dtype(self.device.type))
        kept, self._kept_autocast = self._kept_autocast, None
        if kept is not None and kept[1] == key:
            return kept
        made = self.policy.autocast(self.device.type)
        return made, (key if type(made) is torch.autocast else None)

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
        """Unscale and check, rescale a partial window, probe, clip, step under the verdict, update, ``after_step``."""
        self._verdicts.copy_stranded()  # before anything changes, or this step would find no row to write
        self._book()  # the verdicts copied so far; with a scheduler, the last step's, so this step's LR is right
        found_inf = self._replay() if self.captured is not None else None
        if found_inf is None:  # the eager step: no graph, or one this step cannot take
            found_inf, grad_norm = self._unscale_and_clip()
            self.guard.step(self.optimizer, found_inf)
        else:
            grad_norm = None  # a captured step never clips (captured.check_graphable)
        written, done = self._verdicts.written, False
        try:
            self.guard.update()
            scale = self.guard.scale_tensor()
            if loss.device != found_inf.device:
                loss = loss.to(found_inf.device)
            parts = [found_inf, loss] + ([] if scale is None else [scale])
            # With a scheduler each step is booked before the next: the LR must follow real steps only.
            height = 1 if self.scheduler is not None else self._verdicts_per_copy
            verdict = self._verdicts.write(parts, height)  # found_inf, loss (and scale): views of the row
            if scale is not None:
                self.last_scale = verdict[2]
            done = True
        finally:  # the weights may have changed: the step counts, whatever was raised
            self.micro, self.unsynced = 0, False
            self.global_step += 1
            if not done:
                self._after_failed_update(found_inf, loss, wrote=self._verdicts.written != written)
        self.optimizer.zero_grad(set_to_none=True)
        on_host = self._verdicts.copy_if_full()  # on the CPU the copy is the rows themselves, booked below
        if self.after_step is not None:  # the policy's follow-up on the new weights (fp8 all-gather's scales)
            self.after_step()
        if on_host:  # after the follow-up: a skip limit raised here must not leave the new weights without it
            self._book()
        return StepResult(verdict[1], due=True, found_inf=verdict[0], scale=self.last_scale, grad_norm=grad_norm)

    def _unscale_and_clip(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unscale and check the gradients, rescale a partial window, probe, clip: (found_inf, grad_norm)."""
        # Straight from the groups, .grad read once: a list of the parameters first costs ~0.1 us each a step.
        grads = [g for group in self.optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
        found_inf = self.guard.unscale_(self.optimizer, grads)
        if self.micro < self.grad_accum_steps:
            _compat.foreach_mul_(grads, self.grad_accum_steps / self.micro)
        if self.probe is not None:
            self.probe(self.global_step + 1)
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = nn.utils.clip_grad_norm_(self.params(), self.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return found_inf, grad_norm

    def _replay(self) -> torch.Tensor | None:
        """The check and update as one CUDA graph replay; None when this step needs the eager path.

        Partial windows (a flush rescales the gradients) and probed steps stay eager; so does every
        step once the graph gave up, after one warning that says why.
        """
        if self.micro < self.grad_accum_steps or self.probe is not None:
            return None
        found_inf = self.captured.step(self.params())
        if found_inf is None and self.captured.given_up is not None:
            why, self.captured = self.captured.given_up, None  # first: a warning raised as an error must not repeat
            warnings.warn(f"graph_optimizer_step: the optimizer step runs eagerly from now on: {why}",
                          RuntimeWarning, stacklevel=_caller_level())
        return found_inf

    def _after_failed_update(self, found_inf: torch.Tensor, loss: torch.Tensor, wrote: bool) -> None:
        """After an error past a step's optimizer update: the loss scale brought up to date, and the step's verdict
        read on the host now if its row was not written.

        An error path, so syncs are fine. A second error or Ctrl-C here is swallowed, so the first
        one is the one raised; the step then stays counted in ``global_step`` but may be missing from ``stats``.
        """
        with contextlib.suppress(Exception, KeyboardInterrupt):
            scale = self.guard.scale_value()
            if scale is not None:
                self.last_scale = scale
            if not wrote:
                self._verdicts.add_on_host([float(found_inf), float(loss)] + ([] if scale is None else [scale]))

    def discard_window(self) -> None:
        """Drop the gradients of an open accumulation window (after an error, or on load)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro, self.unsynced = 0, False
        if self.guard is not None:
            self.guard.abandon()

    def settle(self) -> None:
        """Book every optimizer step taken so far: counters, scheduler, skip limit, collapse warning.

        This waits for the last optimizer step to finish on the device.

        Raises:
            RuntimeError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        self._verdicts.copy()
        self._book()

    def forget_graph(self) -> None:
        """Drop the captured step's graph, if any: a load replaces the optimizer state it steps.

        The graph's own checks would see the new state too; dropping it here frees its memory at once, and the
        next capture does not count towards giving up (that is for settings changed again and again).
        """
        if self.captured is not None:
            self.captured.invalidate()

    def discard_verdicts(self) -> None:
        """Forget the verdicts not yet booked: a load replaces the counters, stats and scheduler they would change."""
        self._verdicts = _VerdictBlocks()
        self._limit_hit = None

    def _book(self) -> None:
        """Book the verdicts on the host or copied there, waiting for that copy only, not for work queued since.

        One row at a time, taken off the queue once its counters are set and before what it sets
        off (the scheduler's step, the collapse warning) runs: an error or an interrupt leaves the
        rest for the next call. A row whose follow-up raised counts as booked, its scheduler step
        lost. Only a Ctrl-C in the instant between a row's count and its removal counts it twice.
        """
        unread = self._verdicts.receive()
        while unread:
            skipped, scale = self._count(unread[0])
            unread.pop(0)  # counted: never counted again, even if what follows raises
            self._follow(skipped, scale)
        if self._limit_hit is not None:
            (skips, step, scale), self._limit_hit = self._limit_hit, None
            raise RuntimeError(
                f"{skips} optimizer steps in a row were skipped for non-finite gradients (at optimizer step {step}, "
                f"loss scale {scale}); the loss or the model diverged. "
                "Lower the learning rate, check the data, or try precision='bf16' or 'fp32'")

    def _count(self, values: list[float]) -> tuple[bool, float | None]:
        """A row's counters (no user code runs here): stats, the skip run, the skip limit; (skipped, scale)."""
        skipped, self.last_loss, scale = bool(values[0]), values[1], (values[2] if len(values) > 2 else None)
        self.stats._record(skipped, scale)
        if not skipped:
            self.consecutive_skips = 0
        else:
            self.consecutive_skips += 1
            # Raised once the rows read with it are booked, so the counters stay whole.
            if self.consecutive_skips >= self.max_consecutive_skips and self._limit_hit is None:
                self._limit_hit = (self.consecutive_skips, self.stats.steps, scale)
        return skipped, scale

    def _follow(self, skipped: bool, scale: float | None) -> None:
        """What a counted row sets off: the scheduler's step for a step taken, the collapse warning."""
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        if scale is not None and scale < 1 and not self.collapse_warned:
            self.collapse_warned = True
            warnings.warn(
                f"the loss scale fell to {scale:g} (below 1) at optimizer step {self.stats.steps}: the loss scale is "
                "collapsing, so gradients are non-finite even unscaled; fp16 is unlikely to train this model",
                RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised here at the first frame outside this package.

    A row is booked from several depths (a step, a compiled step, ``trainer.stats``, ``save``,
    ``fit``), so no fixed level names the user's line.
    """
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    here = inspect.currentframe()  # None on Pythons without frames: then the caller's caller
    frame, level = (here.f_back.f_back if here else None), 2  # level 1: the function calling warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class _VerdictBlocks:
    """Each optimizer step's verdict, a row of a device block, copied to the host a block at a time.

    A step writes its row with one kernel; a full block is copied to a pinned buffer with one
    copy and one event. A block is never reused, so a ``StepResult`` read long after its step
    still reads its own row. A block belongs to the CUDA stream current when it was made: its
    copy runs there, and a step on another stream starts a new block.
    """

    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None  # this block, one row per optimizer step
        self._views: tuple[torch.Tensor, ...] = ()  # its rows, made once
        self._filled = 0  # rows written and not yet copied
        self._device: torch.device | None = None
        self._stream_id: int | None = None  # the CUDA stream this block was written on (None on the CPU)
        self._kind: tuple | None = None  # the block's (dtype, width, stream id)
        self._pending: tuple[torch.Tensor, Any] | None = None  # a copy on its way to the host: (buffer, event)
        self._host: torch.Tensor | None = None  # the pinned buffer, reused: a copy is read before the next is queued
        self._event: Any = None
        self.unread: list[list[float]] = []  # rows on the host, not yet booked
        self.written = 0  # rows written, ever: tells the engine whether a step's write got that far

    def write(self, parts: list[torch.Tensor], height: int) -> tuple[torch.Tensor, ...]:
        """Stack ``parts`` into the next row of this block (of ``height`` rows); return the row's values, as views.

        fp32, or fp64 for a float64 loss, which keeps its digits. A new dtype, width or stream
        ends the block early (rare): its rows are read to the host at once, on its own stream.
        """
        device = parts[0].device
        stream_id = _compat.current_stream_id(device)
        parts = [t if t.dim() == 0 else t.reshape(()) for t in parts]
        rows = self._rows
        if rows is None and height == 1:  # a block of one (a scheduler, the CPU): one call makes and fills it
            row = torch.stack(parts)
            if row.dtype not in (torch.float32, torch.float64):  # promoted from the parts: fp64 only for a float64 loss
                row = row.float()
            self._rows, self._views, self._filled = row.unsqueeze(0), (row,), 1
            self._device, self._stream_id, self._kind = device, stream_id, (row.dtype, len(parts), stream_id)
            self.written += 1
            return row.unbind()
        width = len(parts)
        kind = (torch.float64 if torch.float64 in [t.dtype for t in parts] else torch.float32, width, stream_id)
        if rows is None or kind != self._kind:  # the block's dtype, width and stream, kept to spare tensor queries
            if rows is not None:
                self.receive()  # older rows first (none are on their way when a step writes: it booked them)
                with self._on_stream():
                    self.unread += rows[: self._filled].tolist()
                self._rows, self._filled = None, 0  # read: not to be read again if what follows fails
            with torch.inference_mode(False):  # a flush under inference mode must not make a block later steps cannot write
                rows = torch.empty((height, width), dtype=kind[0], device=device)
                self._rows, self._views, self._filled = rows, rows.unbind(), 0
            self._device, self._stream_id, self._kind = device, stream_id, kind
        row = self._views[self._filled]
        torch.stack(parts, out=row)
        self._filled += 1
        self.written += 1
        return row.unbind()

    def copy_if_full(self) -> bool:
        """Queue the block's copy once it is full; True when its rows are on the host already (the CPU).

        Called in the step that wrote the last row, so the block's stream is current and the whole
        block is copied: no slice and no stream query (with a scheduler this runs every step).
        """
        rows = self._rows
        if rows is None or self._filled < rows.shape[0]:
            return False
        self.receive()
        self._send(rows)
        return self._pending[1] is None

    def add_on_host(self, values: list[float]) -> None:
        """Queue a row read on the host (a step whose row was not written), after every row written before it."""
        self.receive()
        if self._filled:
            with self._on_stream():
                self.unread += self._rows[: self._filled].tolist()
            self._rows, self._views, self._filled = None, (), 0
        self.unread.append(values)

    def copy_stranded(self) -> None:
        """Queue the copy of a full block that was never sent: an interrupt stopped its step before ``copy_if_full``."""
        if self._rows is not None and self._filled == self._rows.shape[0]:
            self.copy()

    def copy(self) -> None:
        """Queue the copy of the rows written so far (the last copy is read first); a new block starts."""
        if self._filled == 0:
            return
        self.receive()
        with self._on_stream():
            self._send(self._rows[: self._filled])

    def _send(self, rows: torch.Tensor) -> None:
        """Queue the copy of ``rows`` (the CPU's are on the host already), then let the block go.

        Only once its copy is queued: an error (out of memory, Ctrl-C) before then loses no row.
        """
        pending = self._queue_copy(rows) if rows.is_cuda else (rows, None)
        self._pending, self._rows, self._views, self._filled = pending, None, (), 0

    def _queue_copy(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A non-blocking copy of ``rows`` into the pinned buffer, and an event after it, on the current stream.

        The buffer is made as tall as the first block copied (so a full block, the usual copy, needs
        no slice of it) and made again for a taller one.
        """
        host, filled = self._host, rows.shape[0]
        if host is None or host.shape[0] < filled or host.shape[1:] != rows.shape[1:] or host.dtype != rows.dtype:
            with torch.inference_mode(False):
                host = self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
        if host.shape[0] != filled:
            host = host[:filled]
        host.copy_(rows, non_blocking=True)  # on the current stream of the rows' device, the block's stream here
        self._event.record(torch.cuda.current_stream(rows.device))  # there too, whichever device is current
        return host, self._event

    def receive(self) -> list[list[float]]:
        """Wait for the copy on its way, if any, and return the rows on the host (the list to book from)."""
        if self._pending is not None:
            host, event = self._pending
            if event is not None:
                event.synchronize()  # an interrupt here leaves the copy pending, to be read next time
            self.unread, self._pending = self.unread + host.tolist(), None
        return self.unread

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """The block's CUDA stream made current, if another is; a Stream object is made only then."""
        if self._stream_id is None or _compat.current_stream_id(self._device) == self._stream_id:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.ExternalStream(self._stream_id, device=self._device))
