"""The guarded optimizer step captured as one CUDA graph: ``Trainer(graph_optimizer_step=True)``.

On short steps the host is the bottleneck, and a fused optimizer's Python ``step`` is most of the
guarded step's host time. Here it runs once under capture; every later step copies the gradients
into the graph's own buffers (one foreach copy) and replays the graph: zero the verdict, check the
buffers for inf/NaN, step the optimizer under that verdict. The kernels are the eager guarded step's
own, so the weights and optimizer state come out bit for bit the same (``tests/test_captured.py``), the
LR aside: the graph reads it from an fp32 tensor, so an LR that is not an fp32 number steps rounded to one.

The price: one more gradient-sized buffer (the parameters' size in fp32) and one copy per step.

A graph holds addresses and constants. It is replayed only while they still hold: the same
parameters at the same addresses, each with a gradient, the same optimizer state and groups (the
state's tensors at the same addresses too), the same hyperparameters and the same CUDA stream. A number
LR may change (a scheduler's): the graph reads it from a device tensor, refilled when it changes.
Anything else changed is captured again at the next step; a tensor LR or other tensor setting (which a
kernel may read once, at capture), and a graph that keeps changing (changed three times, each within 100
steps of the capture before), are given up with a warning, and the eager step runs from then on, as it
does for steps the graph cannot take (a partial window, a probe, a missing gradient, optimizer step hooks).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any

import torch

from . import _compat
from .guard import FiniteGuard, GradientGuard

__all__ = ["CapturedStep", "check_graphable"]

_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_QUICK_REPLAYS = 100  # a graph replaced before this many replays was captured in vain
_QUICK_LIMIT = 3  # that many in a row, and the settings change too often to capture


def check_graphable(device: torch.device, guard: GradientGuard, optimizer: torch.optim.Optimizer, *,
                    will_fuse: bool, max_grad_norm: float | None, distributed: str | None, autotune: bool) -> None:
    """Refuse, with the reason, a setup whose optimizer step cannot be captured.

    Args:
        will_fuse: the Trainer will switch this optimizer to its fused implementation.

    Raises:
        ValueError: not CUDA, a loss scaler, clipping, distributed training, autotune, or an
            optimizer other than a fused torch SGD, Adam or AdamW.
    """
    why = None
    if device.type != "cuda":
        why = f"CUDA graphs need a CUDA device; the device is {device}"
    elif autotune:
        why = "autotune may pick any precision; choose the policy first (precisionloop.autotune) and pass it"
    elif distributed:
        why = f"distributed={distributed!r} all-reduces the verdict between ranks, which the graph does not"
    elif max_grad_norm is not None:
        why = "clipping (max_grad_norm) is not captured; pass max_grad_norm=None"
    elif type(guard) is not FiniteGuard:
        why = (f"the policy's {type(guard).__name__} is not capturable (a GradScaler keeps its state on the host); "
               "use precision 'bf16' or 'fp32'")
    elif type(optimizer) not in _CLASSES or not (will_fuse or all(g.get("fused") for g in optimizer.param_groups)):
        why = (f"it captures the fused torch SGD, Adam and AdamW (fused=True, or built with defaults and "
               f"fuse_optimizer=True); got {type(optimizer).__name__} "
               f"with fused={[g.get('fused') for g in optimizer.param_groups]}")
    if why:
        raise ValueError(f"graph_optimizer_step=True: {why}")


class CapturedStep:
    """One optimizer's guarded step as a CUDA graph, captured when first needed and replayed after."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.captures = 0  # graphs captured so far
        self.replays = 0  # steps replayed so far
        self.given_up: str | None = None  # why this stays eager for good
        self._graph: Any = None
        self._static: list[torch.Tensor] = []  # the gradients the graph reads
        self._found: torch.Tensor | None = None  # the graph's verdict: 1.0 when it skipped the update
        self._ones: torch.Tensor | None = None  # the inverse scale of one the check multiplies by
        self._lrs: list[tuple[torch.Tensor, float]] = []  # per group: the LR tensor the graph reads, its value
        self._held: tuple = ()  # the optimizer's objects the graph was captured over (see _objects)
        self._stream: int | None = None  # the CUDA stream it was captured for
        self._ptrs: list[int] = []  # the addresses of the parameters it steps
        self._settings: list[list[tuple[str, Any]]] = []
        self._dicts: list[dict | None] = []  # each stepped parameter's optimizer state dict
        self._sizes: list[int] = []
        self._state_tensors: list[Any] = []  # the values of those dicts, in order
        self._state_ptrs: list[int | None] = []  # their addresses (None for a value that is not a tensor)
        self._all_tensors = True  # every one of those values is a tensor
        self._params: list[torch.Tensor] = []  # the stepped parameters' tensors, held
        self._quick = 0  # graphs in a row replaced after fewer than _QUICK_REPLAYS replays
        self._replays_at_capture = 0

    def step(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """Step under the graph and return its verdict (a device tensor the next replay overwrites), or None.

        None leaves the step to the caller's eager path; nothing has changed then. Parameters without
        a gradient are left out of the graph, as the eager step leaves them.
        """
        if self.given_up is not None or _compat.has_step_hooks(self.optimizer):
            return None  # hooks run in Python, which a replay skips
        live, grads = [], []
        for p in params:
            if (g := p.grad) is not None:  # .grad read once: ~0.1 us a parameter a step
                live.append(p)
                grads.append(g)
        if not grads:
            return None
        if self._graph is None or not self._matches(live):
            if not self._state_ready(live) or not self._capture(live, grads):
                return None
        for i, (group, (lr, value)) in enumerate(zip(self.optimizer.param_groups, self._lrs)):
            now = group["lr"]
            if now is not value and (isinstance(now, torch.Tensor) or now != value):  # a scheduler's new LR: one fill
                if isinstance(now, torch.Tensor):  # a scheduler fills it in place, where the graph would not see it
                    self._give_up("a tensor LR is not captured (the graph reads its own LR tensor)")
                    return None
                lr.fill_(now)
                self._lrs[i] = (lr, now)
        _compat.foreach_copy_(self._static, grads)
        self._graph.replay()
        self.replays += 1
        return self._found

    def _objects(self) -> tuple:
        """The optimizer's state and groups, held (not as ids, which a freed object's successor may reuse)."""
        opt = self.optimizer
        return (opt.state, opt.param_groups, *opt.param_groups)

    def _matches(self, live: list[torch.nn.Parameter]) -> bool:
        """The graph still fits: the same objects, the same parameters with gradients at the same addresses, the
        same stream and settings (LRs aside)."""
        objects, held = self._objects(), self._held
        if len(objects) != len(held) or any(a is not b for a, b in zip(objects, held)):
            return False
        if _compat.current_stream_id(self._found.device) != self._stream or [p.data_ptr() for p in live] != self._ptrs:
            return False
        # Each parameter's state dict, the same object holding as many tensors: a cleared or replaced one (a load of a
        # run saved before its first step clears the state in place) would leave the graph stepping orphans.
        dicts = list(map(self.optimizer.state.get, live))
        if not all(map(operator.is_, dicts, self._dicts)) or list(map(_size, dicts)) != self._sizes:
            return False
        values = list(_values(dicts))
        if not all(map(operator.is_, values, self._state_tensors)):  # an entry replaced by hand
            return False
        # The same tensor given new memory (.data =, swap_tensors). The values are the captured objects by now, so
        # if those were all tensors (the usual case) the unbound method serves: half the cost of _address.
        if list(map(torch.Tensor.data_ptr if self._all_tensors else _address, values)) != self._state_ptrs:
            return False
        return all(_same_settings(g, s) for g, s in zip(self.optimizer.param_groups, self._settings))

    def _state_ready(self, live: list[torch.nn.Parameter]) -> bool:
        """Every parameter with a gradient has the state its step updates in place (eager steps make it), and
        every LR is a number."""
        opt = self.optimizer
        if not _compat.skips_on_device(opt) or not all(g.get("fused") for g in opt.param_groups):
            self._give_up(f"{type(opt).__name__} is not fused, so its step would not take the graph's verdict")
            return False
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                self._give_up("a tensor LR is not captured (the graph reads its own LR tensor)")
                return False
            tensor = next((k for k, v in group.items() if k not in ("params", "lr") and _holds_tensor(v)), None)
            if tensor is not None:  # a fused kernel may read it once, at capture: a later in-place change goes unseen
                self._give_up(f"a tensor setting ({tensor!r}) is not captured; only the LR may change between steps")
                return False
            needs = "momentum_buffer" if isinstance(opt, torch.optim.SGD) else "step"
            if isinstance(opt, torch.optim.SGD) and group["momentum"] == 0:
                continue
            if any(opt.state.get(p, {}).get(needs) is None for p in group["params"] if p.grad is not None):
                return False
        return True

    def _capture(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> bool:
        """Capture the step over buffers like ``grads``; False (and eager for good) if capture fails."""
        if self._graph is not None:
            self._quick = self._quick + 1 if self.replays - self._replays_at_capture < _QUICK_REPLAYS else 0
            if self._quick >= _QUICK_LIMIT:
                self._give_up(f"the optimizer's settings or state changed {_QUICK_LIMIT} times within "
                              f"{_QUICK_REPLAYS} steps of a capture")
                return False
        if any(g.layout != torch.strided or type(g) is not torch.Tensor for g in grads):
            self._give_up("a gradient is sparse or a tensor subclass")
            return False
        values = list(_values([self.optimizer.state.get(p) for p in params]))
        if any(isinstance(v, torch.Tensor) and v.layout != torch.strided for v in values):
            self._give_up("an optimizer state tensor is not dense, so it has no address to match")
            return False
        self._release()
        device = grads[0].device
        try:
            state_ptrs = list(map(_address, values))
            self._static = [torch.empty_like(g) for g in grads]
            self._found = torch.zeros((), dtype=torch.float32, device=device)
            # Held for the graph's life: it keeps raw addresses, and a freed tensor's memory is soon another's.
            self._ones = torch.ones((), dtype=torch.float32, device=device)
            self._lrs = [(torch.full((), float(g["lr"]), dtype=torch.float32, device=device), g["lr"])
                         for g in self.optimizer.param_groups]
            self._graph = self._record(params, self._ones)
        except Exception as e:  # noqa: BLE001 - any failure leaves the eager step, which is always right
            self._release()
            self._give_up(f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            return False
        except BaseException:
            self._release()
            raise
        opt = self.optimizer
        self._ptrs, self._stream = [p.data_ptr() for p in params], _compat.current_stream_id(self._found.device)
        self._settings = [_settings_of(g) for g in opt.param_groups]
        self._dicts = [opt.state.get(p) for p in params]
        self._sizes = list(map(_size, self._dicts))
        # The state's values and the parameters' tensors too, held so their memory is never another's while the graph
        # writes it: a parameter given new data (freed, then reallocated) can then never reappear at its old address.
        self._state_tensors = values  # read before the capture, whose skipped warm-up replaces no state object
        self._state_ptrs = state_ptrs
        self._all_tensors = None not in self._state_ptrs
        self._params = [p.detach() for p in params]
        self._held = self._objects()  # last: until it is set, the graph matches nothing
        self.captures += 1
        self._replays_at_capture = self.replays
        return True

    def _record(self, params: list[torch.nn.Parameter], ones: torch.Tensor) -> Any:
        """Warm up on a side stream with NaN gradients (so the step is skipped), then capture on it.

        Put back after: the parameters' own gradients and the groups' LRs (and ``capturable``); after a
        failure, also the current stream and device, and Adam's step counts, which a skipped step counts up
        and back down, so a warm-up cut off in between would leave them one too high.
        """
        opt, found, device = self.optimizer, self._found, self._found.device
        saved_grads, saved_lrs = [p.grad for p in params], [g["lr"] for g in opt.param_groups]
        current, current_device = torch.cuda.current_stream(device), torch.cuda.current_device()
        counts = [(t, t.clone()) for p in params for k, t in (opt.state.get(p) or {}).items()
                  if k == "step" and isinstance(t, torch.Tensor)]

        def body() -> None:
            found.zero_()
            _compat.non_finite_check_(self._static, found, ones)
            _compat.step_with_verdict(opt, found)

        graph = side = None
        try:
            for p, s in zip(params, self._static):
                p.grad = s
            for g, (lr, _) in zip(opt.param_groups, self._lrs):
                g["lr"] = lr
            side = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.device(device):  # the parameters' device, whichever is current
                with torch.cuda.stream(side):
                    for s in self._static:
                        s.fill_(float("nan"))  # the warm-up's verdict is "skip": no weight or state changes
                    body()
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a DataLoader's pin-memory thread may allocate while this thread captures
                with _compat.capturable_groups(opt), torch.cuda.graph(graph, stream=side,
                                                                       capture_error_mode="thread_local"):
                    body()
            return graph
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one raised
                _undo_capture(graph, side, current, current_device, counts)
            raise
        finally:
            for g, lr in zip(opt.param_groups, saved_lrs):  # first: a group left with the graph's LR tensor would save it
                g["lr"] = lr
            for p, g in zip(params, saved_grads):
                p.grad = g

    def invalidate(self) -> None:
        """Drop the graph: the state it steps is being replaced (a load). The next step captures anew, and a run of
        quick recaptures (towards giving up) starts again from zero."""
        self._release()
        self._quick = 0

    def _release(self) -> None:
        """Drop the graph and its buffers, once the device is done with them."""
        if self._graph is not None and self._found.is_cuda:
            torch.cuda.synchronize(self._found.device)  # a replay may still be running
        self._graph, self._static, self._lrs, self._held, self._ones = None, [], [], (), None
        self._dicts, self._state_tensors, self._state_ptrs, self._params = [], [], [], []

    def _give_up(self, why: str) -> None:
        """Stay eager for good (the engine warns once, naming ``why``)."""
        self.given_up = why
        self._release()


def _undo_capture(graph: Any, side: Any, current: Any, device_index: int, counts: list) -> None:
    """After a failed capture: end a capture left open (an interrupt inside ``torch.cuda.graph``'s entry), make the
    caller's stream and device current again, and put back Adam's step counts. Each part runs whatever the one
    before raised: the counts matter most."""
    with contextlib.suppress(Exception):
        if graph is not None and side is not None:
            with torch.cuda.stream(side):
                if torch.cuda.is_current_stream_capturing():
                    graph.capture_end()
    with contextlib.suppress(Exception):
        if torch.cuda.current_stream(current.device) != current:  # a failed capture_end skips restoring it
            torch.cuda.set_stream(current)
        torch.cuda.set_device(device_index)
    torch.cuda.synchronize(current.device)
    for count, saved in counts:
        count.copy_(saved)


def _settings_of(group: dict) -> list[tuple[str, Any]]:
    """A group's settings but its LR, lists copied (``betas`` edited in place must not match itself)."""
    return [(k, list(v) if isinstance(v, list) else v) for k, v in group.items() if k not in ("params", "lr")]


def _size(state: dict | None) -> int:
    return -1 if state is None else len(state)


def _address(value: Any) -> int | None:
    return value.data_ptr() if isinstance(value, torch.Tensor) else None


def _holds_tensor(value: Any) -> bool:
    """A tensor, or a list or tuple holding one (Adam's ``betas`` may be a pair of tensors)."""
    return isinstance(value, torch.Tensor) or (isinstance(value, (list, tuple))
                                               and any(isinstance(v, torch.Tensor) for v in value))


def _values(dicts: list[dict | None]) -> Any:
    """Every value of the dicts, in order (None for a parameter without state contributes nothing)."""
    return itertools.chain.from_iterable(map(dict.values, filter(None, dicts)))


def _same_settings(group: dict, settings: list[tuple[str, Any]]) -> bool:
    """The group's settings (LR and parameters aside) are those captured; a tensor (or a pair of them) by identity,
    never compared (that would sync), and never captured anyway (``_state_ready``)."""
    if len(group) != len(settings) + 2:
        return False
    for key, value in settings:
        now = group.get(key, _MISSING)
        if now is not value and (_holds_tensor(now) or _holds_tensor(value) or now != value):
            return False
    return True


_MISSING = object()
