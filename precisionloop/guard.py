"""Gradient guards: what stands between a backward pass and the optimizer step.

The step calls a policy's guard the same way whatever the precision, never asking whether there is a loss scaler:

- ``scale(loss)``: the loss to call ``backward`` on;
- ``unscale_(optimizer, grads)``: unscale the gradients in place, return the inf/NaN verdict on the device (1.0: skip);
- ``step(optimizer, found_inf)``: step the optimizer unless the verdict says skip;
- ``update()``: adjust the loss scale after the step; ``abandon()``: forget a step that failed midway;
- ``scale_tensor()`` / ``scale_value()``: the scale on the device / host, or None;
- ``state_dict()`` / ``load_state_dict()``: the scaler's state, or None.

``ScalerGuard`` is backed by a ``torch.amp.GradScaler`` (fp16); ``FiniteGuard`` is a plain non-finite check (fp32,
bf16). With a fused optimizer neither syncs the host, except on a fused SGD's first momentum step (``_FirstStepCheck``).
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

    torch's fused SGD allocates the buffers with ``empty_like`` and fills them in the kernel, so a step skipped on
    the device leaves them uninitialised and the next step reads garbage into the weights (torch's own
    ``GradScaler.step`` is hit the same way): until the buffers exist, the skip is decided on the host. Buffers go
    missing when the state is cleared or loaded empty, a group's momentum is switched on or its parameter list
    replaced, and for a parameter whose first gradient comes late; so the last scan holds only while ``_key_of`` is
    unchanged and no parameter then without a buffer has a gradient. Not seen: a buffer deleted by hand from one
    parameter's state, or a parameter list edited in place to the same length.
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
    """What a fused SGD's buffers depend on, short of the state's entries (see :class:`_FirstStepCheck`)."""
    groups = tuple((id(g["params"]), len(g["params"]), bool(g.get("fused")), g.get("momentum", 0) != 0)
                   for g in optimizer.param_groups)
    return groups, id(optimizer.state), len(optimizer.state)


def _host_decided_step(optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    """``step()``, unless a fused SGD group mixes parameters with and without momentum buffers.

    torch's fused SGD raises on such a mix (it starts buffers only when none exists), where the default SGD starts
    each new one by itself; so such a step runs those groups on the default implementation (gradients unscaled by then).
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

    The fused kernels take the skip verdict as a device tensor, so a guarded step needs no host sync; the default
    (foreach) ones need it on the host first. The algorithm and hyperparameters stay the same. Left alone: other classes
    (subclasses too); an optimizer with state, or with parameters off ``device_types``; a group that set ``fused``,
    ``foreach``, ``capturable`` or ``differentiable`` itself, or holds a non-float parameter; an optimizer of a
    ``model`` with sparse embeddings (the fused kernels take no sparse gradients).
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
            # Decided on the host while a buffer is missing; update() still backs off, as unscale_ recorded the verdict.
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

    def __init__(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.all_reduce_max = all_reduce_max
        self._first = _FirstStepCheck()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
        """The inf/NaN verdict of ``grads`` as a device tensor, 0 or 1, checked per (device, dtype) group.

        By GradScaler's fused check, one launch that writes each value back as it was; on CUDA, for bf16 and fp64
        gradients and for groups too large for the write-back to be cheap, by the inf-norms, which only read (see
        ``_compat.non_finite_any_``). Shards (FSDP2's DTensors) and sparse gradients are checked by their local
        values; the verdicts meet on the first gradient's device, then are agreed across ranks.
        """
        grads = [_compat.dense_values(g) for g in grads]
        found = self._zero_on(grads[0].device if grads else torch.device("cpu"))
        groups = _compat.group_by_device_and_dtype(grads).items() if grads else ()  # torch's grouping takes no empty list
        for (where, _), (tensors, _) in groups:
            here = found if where == found.device else self._zero_on(where)
            _compat.non_finite_any_(tensors[0], here)
            if here is not found:  # 1, not a sum: a fused optimizer skips only when the verdict is exactly 1
                torch.maximum(found, here.to(found.device), out=found)
        if self.all_reduce_max is not None:
            self.all_reduce_max(found)
        return found

    @staticmethod
    def _zero_on(device: torch.device) -> torch.Tensor:
        # fp32 explicitly, as GradScaler's found_inf is: what fused optimizers take, whatever the default dtype is.
        return torch.zeros((), dtype=torch.float32, device=device)

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
