"""Where a Trainer's memory goes: the tensors' exact sizes on every device; on CUDA the allocator's peak and reserve.

It takes the Trainer (any object with ``model``, ``optimizer``, ``device``) and imports nothing from the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch

__all__ = ["MemoryBreakdown", "memory_breakdown"]

_MB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """A Trainer's memory in MB (2**20 bytes), from :func:`memory_breakdown`.

    The first four are exact on every device: the bytes of the tensors' storages, one shared by views or tied weights
    counted once; under FSDP2 this process's local shards. The allocator's rounding (512 bytes on CUDA) and the loss
    scaler's two scalars are in none of them. The last three are ``None`` off CUDA.
    """

    parameters_mb: float
    """every parameter of the model, trainable or not"""
    buffers_mb: float
    """the model's buffers (BatchNorm's running statistics, for one)"""
    gradients_mb: float
    """the ``.grad`` tensors now: 0 after an optimizer step (the Trainer frees them), full-sized in an open window"""
    optimizer_state_mb: float
    """every tensor in ``optimizer.state``: Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``"""
    peak_mb: float | None = None
    """CUDA: ``torch.cuda.max_memory_allocated`` on the Trainer's device since the last ``reset_peak_memory_stats()``"""
    activations_and_workspace_mb: float | None = None
    """CUDA: the peak less the exact parts on the Trainer's device, at least 0: activations saved for backward,
    kernels' workspace, the optimizer step's temporaries, the gradients if none are present now"""
    reserved_mb: float | None = None
    """CUDA: ``torch.cuda.memory_reserved`` now, the allocator's cache included; under ``compile="reduce-overhead"``
    also the pools CUDA graphs replay into without allocating, so their activations are here and not in the peak"""

    def to_dict(self) -> dict[str, float | None]:
        """The fields by name."""
        return dataclasses.asdict(self)


def _leaves(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding a tensor's data: itself, or a subclass's inner tensors (a DTensor's local shard)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    for name in flatten()[0]:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):  # a DTensor also names its device mesh
            yield from _leaves(inner)


def _storage_bytes(tensors: Iterable[Any]) -> dict[torch.device, int]:
    """Bytes of the storages behind ``tensors`` (non-tensors ignored), by device, each storage counted once."""
    # A view (a slice of a flat buffer, a transposed weight) or aliased parameters share one storage: count it once,
    # whole, keyed by its base address.
    seen: set[tuple[torch.device, int]] = set()
    total: dict[torch.device, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for leaf in _leaves(tensor):
            storage = leaf.untyped_storage()
            key = (leaf.device, storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total[leaf.device] = total.get(leaf.device, 0) + storage.nbytes()
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Any]:
    for state in optimizer.state.values():
        yield from state.values()


def _cuda_device(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def memory_breakdown(trainer: Any) -> MemoryBreakdown:
    """Where ``trainer``'s memory goes now: parameters, buffers, gradients, optimizer state; on CUDA the peak.

    Example:
        >>> import torch
        >>> from precisionloop import Trainer, memory_breakdown
        >>> model = torch.nn.Linear(16, 8)
        >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", device="cpu")
        >>> memory_breakdown(trainer).parameters_mb * 2**20  # (16 * 8 + 8) fp32 values
        544.0
    """
    model, device = trainer.model, trainer.device
    parts = {
        "parameters_mb": _storage_bytes(model.parameters()),
        "buffers_mb": _storage_bytes(model.buffers()),
        "gradients_mb": _storage_bytes(p.grad for p in model.parameters()),
        "optimizer_state_mb": _storage_bytes(_optimizer_tensors(trainer.optimizer)),
    }
    exact = {name: sum(by_device.values()) / _MB for name, by_device in parts.items()}
    if device.type != "cuda":
        return MemoryBreakdown(**exact)
    device = _cuda_device(device)
    peak = torch.cuda.max_memory_allocated(device) / _MB
    here = sum(by_device.get(device, 0) for by_device in parts.values()) / _MB
    return MemoryBreakdown(**exact, peak_mb=peak, activations_and_workspace_mb=max(peak - here, 0.0),
                           reserved_mb=torch.cuda.memory_reserved(device) / _MB)
