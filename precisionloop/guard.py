"""Gradient guards: what stands between a backward pass and the optimizer step.

A policy hands the step one guard, and the step calls it the same way whatever the precision,
so it never asks whether there is a loss scaler:

- ``scale(loss)``: the loss to call ``backward`` on;
- ``unscale_(optimizer, grads)``: unscale the gradients in place and return the inf/NaN
  verdict as a device tensor (1.0: skip);
- ``step(optimizer, found_inf)``: step the optimizer unless the verdict says skip;
- ``update()``: adjust the loss scale after the step; ``abandon()``: forget a step that failed midway;
- ``scale_tensor()`` / ``scale_value()``: the scale on the device / host, or None;
- ``state_dict()`` / ``load_state_dict()``: the scaler's state, or None.

``ScalerGuard`` is backed by a ``torch.amp.GradScaler`` (fp16); ``FiniteGuard`` is a plain
non-finite check (fp32, bf16). With a fused optimizer neither syncs the host, except on a fused
SGD's first momentum step (see ``_FirstStepCheck``).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from . import _compat

__all__ = ["GradientGuard", "ScalerGuard", "FiniteGuard", "fuse_default_optimizer", "fusable"]


class GradientGuard(Protocol):
    """The interface the step uses; see the module docstring."""

    scaler: torch.amp.GradScaler | None

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor: ...
    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None: ...
    def update(self) -> None: ...
    def abandon(self) -> None: ...
    def scale_tensor(self) -> torch.Tensor | None: ...
    def scale_value(self) -> float | None: ...
    def state_dict(self) -> dict | None: ...
    def load_state_dict(self, state: dict | None) -> None: ...


class _FirstStepCheck:
    """Whether a fused SGD with momentum lacks a momentum buffer for a parameter it is about to step.

    torch's fused SGD allocates the buffers with ``empty_like`` and fills them in the
    kernel; a step skipped on the device leaves them uninitialised, and the next step
    reads garbage into the weights. torch's own fp16 recipe (``GradScaler.step``) is hit
    the same way. Until the buffers exist, the skip is decided on the host instead.

    Buffers go missing when the state is cleared (``optimizer.state.clear()``, a load of a
    run saved before its first step), when a group's momentum is switched on or its parameter
    list replaced, and are missing for a parameter whose first gradient comes late (a branch
    not taken at first). So the last scan is trusted only while the groups (each one's parameter
    list, its count, fused and momentum on or off), the state object and its size are unchanged
    and none of the parameters then without a buffer has a gradient. That costs a few comparisons
    a group, plus ~0.1 us for each such parameter (a frozen layer in the optimizer stays one).
    Not seen: a buffer deleted by hand from one parameter's state (``del state[p][...]``,
    ``state[p] = {}``), a group's parameter list edited in place to the same length, or the
    state object replaced twice between steps (its id may be reused).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None  # the groups, the state's id and size at the last scan (see _key_of)
        self._waiting: list[torch.Tensor] = []  # fused-SGD parameters without a buffer then (no gradient either)

    def needs_host(self, optimizer: torch.optim.Optimizer) -> bool:
        key = _key_of(optimizer)
        if key == self._key and not any(p.grad is not None for p in self._waiting):
            return False
        state, waiting = optimizer.state, []
        for group in optimizer.param_groups:
            if group.get("fused") and group.get("momentum", 0) != 0:
                for p in group["params"]:
                    if state.get(p, {}).get("momentum_buffer") is None:
                        if p.grad is not None:
                            return True
                        waiting.append(p)
        self._key, self._waiting = key, waiting
        return False


def _key_of(optimizer: torch.optim.Optimizer) -> tuple:
    """What a fused SGD's buffers depend on, short of the state's entries: per group, its parameter list (the
    object and its length), fused, and momentum on or off; and the state object's id and size."""
    groups = tuple((id(g["params"]), len(g["params"]), bool(g.get("fused")), g.get("momentum", 0) != 0)
                   for g in optimizer.param_groups)
    return groups, id(optimizer.state), len(optimizer.state)


def _host_decided_step(optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    """``step()``, unless a fused SGD group mixes parameters with and without momentum buffers.

    torch's fused SGD raises on such a mix (it starts buffers only when none exists), where the
    default SGD starts each new one by itself; so such a step runs the default implementation on
    those groups (the gradients are unscaled by then), and the fused one again after.
    """
    mixed = [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum", 0) != 0
             and len({optimizer.state.get(p, {}).get("momentum_buffer") is None
                      for p in g["params"] if p.grad is not None}) == 2]
    if not mixed:
        step()
        return
    for group in mixed:
        group["fused"] = False
    try:
        optimizer.step()
    finally:
        for group in mixed:
            group["fused"] = True


def _step_under_verdict(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, first: _FirstStepCheck) -> None:
    if _compat.skips_on_device(optimizer) and not first.needs_host(optimizer):
        _compat.step_with_verdict(optimizer, found_inf)  # skipped on the device: no host sync
    elif not found_inf.item():  # nothing else guards the weights: the one host sync
        _host_decided_step(optimizer, optimizer.step)


def fuse_default_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None = None,
                           device_types: tuple[str, ...] = ("cuda",)) -> bool:
    """Switch a torch SGD, Adam or AdamW left at its default implementation to its fused one; True if switched.

    The fused kernels take the skip verdict as a device tensor, so a guarded step needs no
    host sync; the default (foreach) ones need the verdict on the host first. The algorithm
    and every hyperparameter stay the same. Left alone: other classes (subclasses too), an
    optimizer with state, and any group that set ``fused``, ``foreach``, ``capturable`` or
    ``differentiable`` itself, or holds a parameter the fused kernels cannot take, and any
    optimizer of a ``model`` with sparse embeddings (the fused kernels take no sparse gradients).
    """
    if not fusable(optimizer, model) or not all(
            p.device.type in device_types for group in optimizer.param_groups for p in group["params"]):
        return False
    _compat.use_fused_implementation(optimizer)
    return True


def fusable(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> bool:
    """Whether :func:`fuse_default_optimizer` would switch this optimizer once its parameters are on a CUDA device."""
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    if model is not None and any(getattr(m, "sparse", False) for m in model.modules()
                                 if isinstance(m, (nn.Embedding, nn.EmbeddingBag))):
        return False
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") or group.get("capturable") or group.get("differentiable"):
            return False
        if not all(p.is_floating_point() for p in group["params"]):
            return False
    return True


class ScalerGuard:
    """Loss scaling through a ``torch.amp.GradScaler`` (or a subclass, such as FSDP's sharded one)."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self._first = _FirstStepCheck()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
        self.scaler.unscale_(optimizer)
        return _compat.scaler_found_inf(self.scaler, optimizer)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        if self._first.needs_host(optimizer):
            # Decided on the host while a buffer is missing; update() still backs off, since unscale_ recorded the verdict.
            if not found_inf.item():
                _host_decided_step(optimizer, lambda: self.scaler.step(optimizer))
            return
        self.scaler.step(optimizer)  # fused optimizers skip on the device, others sync inside GradScaler

    def update(self) -> None:
        self.scaler.update()

    def abandon(self) -> None:
        """Forget a step that failed between ``unscale_`` and ``update``."""
        _compat.forget_unscale(self.scaler)

    def scale_tensor(self) -> torch.Tensor:
        return _compat.scaler_scale_tensor(self.scaler)

    def scale_value(self) -> float:
        return self.scaler.get_scale()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.scaler.load_state_dict(state)


class FiniteGuard:
    """No loss scale; a step whose gradients hold an inf or NaN is skipped.

    Args:
        all_reduce_max: under several processes, makes every rank's verdict the maximum
            over all ranks, so that all skip together.
    """

    scaler = None

    _SLAB = 256  # verdict flags per zero-filled slab

    def __init__(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.all_reduce_max = all_reduce_max
        self._ones: dict[torch.device, torch.Tensor] = {}
        # Per device: a slab's zeros, the next unused one, the CUDA stream that filled it.
        self._zeros: dict[torch.device, tuple[tuple[torch.Tensor, ...], int, int | None]] = {}
        self._first = _FirstStepCheck()
        self._plain = -1  # the gradient count last seen all dense, plain tensors on one device and dtype

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
        # The same count as a step seen all dense on one device: one kernel, no regrouping and no per-gradient
        # check (it costs ~0.1 us a gradient every step). A gradient of another kind with that count (a sparse one,
        # from an embedding used on some steps only) makes torch refuse the kernel before it runs: group then.
        if grads and self._plain == len(grads):
            device = grads[0].device
            found = self._zero_on(device)
            try:
                _compat.non_finite_check_(grads, found, self._ones_on(device))
            except (RuntimeError, NotImplementedError):
                self._plain = -1
            else:
                return self._agree(found)  # outside the try: a failed collective is not retried
        return self._grouped(grads)

    def _grouped(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The check per (device, dtype) group, the verdicts summed on the first group's device."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            g = _compat.dense_values(g)
            groups.setdefault((g.device, g.dtype), []).append(g)
        device = next(iter(groups))[0] if groups else torch.device("cpu")
        found = self._zero_on(device)
        for (where, _), tensors in groups.items():
            here = found if where == device else self._zero_on(where)
            _compat.non_finite_check_(tensors, here, self._ones_on(where))  # an inverse scale of 1 leaves them alone
            if here is not found:
                found += here.to(device)
        if len(groups) == 1 and all(g.layout == torch.strided and type(g) is torch.Tensor for g in grads):
            self._plain = len(grads)  # the same parameters next step take the one-kernel path
        return self._agree(found)

    def _zero_on(self, device: torch.device) -> torch.Tensor:
        """A fresh fp32 zero for a verdict: the next unused element of a zero-filled slab.

        A fill per step would cost a kernel launch (tens of microseconds of host time on some
        hosts); a slab costs one every ``_SLAB`` steps. No element is handed out twice, so a
        verdict the step returned (or a queued kernel) never sees it change. The slab is filled on
        the CUDA stream current when it is made, and a step on another stream gets a new slab, so
        its check never depends on a fill queued elsewhere (no step waits for the last one). Like
        the model's weights, the inverse scale of one (``_ones_on``) is made once: a caller that
        switches streams must order them, as for any tensor two streams share.
        fp32 explicitly: the fused check rejects other dtypes, whatever torch's default dtype is.
        """
        stream = _compat.current_stream_id(device)
        zeros, used, made_on = self._zeros.get(device, ((), self._SLAB, stream))
        if used >= self._SLAB or made_on != stream:
            # Outside inference mode, or a step under it (a flush) would leave later steps a slab they cannot write.
            with torch.inference_mode(False):
                # its elements as views, made in one call: indexing a tensor each step costs more
                zeros, used = torch.zeros(self._SLAB, dtype=torch.float32, device=device).unbind(), 0
        self._zeros[device] = (zeros, used + 1, stream)
        return zeros[used]

    def _ones_on(self, device: torch.device) -> torch.Tensor:
        ones = self._ones.get(device)
        if ones is None:
            ones = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return ones

    def _agree(self, found: torch.Tensor) -> torch.Tensor:
        if self.all_reduce_max is not None:
            self.all_reduce_max(found)
        return found

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        _step_under_verdict(optimizer, found_inf, self._first)

    def update(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def scale_tensor(self) -> None:
        return None

    def scale_value(self) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass
