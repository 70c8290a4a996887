"""Where a Trainer's memory goes: the tensors' exact sizes on every device; on CUDA the allocator's peak and reserve."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

__all__ = ["MemoryBreakdown", "memory_breakdown"]


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """A Trainer's memory in MB (2**20 bytes). The first four are exact on every device: the bytes of the tensors'
    storages, one shared by views or tied weights counted once; under FSDP2 this process's shards.

    Attributes:
        parameters_mb: every parameter of the model, trainable or not.
        buffers_mb: the model's buffers (BatchNorm's running statistics, for one).
        gradients_mb: the ``.grad`` tensors now: none after an optimizer step, all of them in an open accumulation.
        optimizer_state_mb: every tensor in ``optimizer.state`` (Adam's moments and step, SGD's momentum).
        peak_mb: CUDA only: ``torch.cuda.max_memory_allocated`` on the Trainer's device.
        activations_and_workspace_mb: CUDA only: the peak less the exact parts on that device (activations, workspace).
        reserved_mb: CUDA only: ``torch.cuda.memory_reserved`` now, the allocator's cache and CUDA graph pools included.
    """

    parameters_mb: float
    buffers_mb: float
    gradients_mb: float
    optimizer_state_mb: float
    peak_mb: float | None = None
    activations_and_workspace_mb: float | None = None
    reserved_mb: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def memory_breakdown(trainer: Any) -> MemoryBreakdown:
    """Where ``trainer``'s memory goes now; it reads only ``trainer.model``, ``.optimizer`` and ``.device``."""
    model, device = trainer.model, trainer.device
    state = (t for s in trainer.optimizer.state.values() for t in s.values())
    parts = {"parameters_mb": model.parameters(), "buffers_mb": model.buffers(),
             "gradients_mb": (p.grad for p in model.parameters()), "optimizer_state_mb": state}
    parts = {name: _bytes_by_device(tensors) for name, tensors in parts.items()}
    exact = {name: sum(by_device.values()) / 2**20 for name, by_device in parts.items()}
    if device.type != "cuda":
        return MemoryBreakdown(**exact)
    device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    here = sum(by_device.get(device, 0) for by_device in parts.values()) / 2**20
    return MemoryBreakdown(**exact, peak_mb=peak, activations_and_workspace_mb=max(peak - here, 0.0),
                           reserved_mb=torch.cuda.memory_reserved(device) / 2**20)


def _bytes_by_device(tensors: Iterable[Any]) -> dict[torch.device, int]:
    """Bytes of the storages behind ``tensors`` (other values ignored) by device, each storage once, whole."""
    seen, total = set(), {}
    for leaf in (leaf for t in tensors if isinstance(t, torch.Tensor) for leaf in _leaves(t)):
        storage = leaf.untyped_storage()
        if storage.nbytes() and (leaf.device, storage.data_ptr()) not in seen:
            seen.add((leaf.device, storage.data_ptr()))
            total[leaf.device] = total.get(leaf.device, 0) + storage.nbytes()
    return total


def _leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's data: itself, or a subclass's inner tensors (a DTensor's local shard)."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    inner = (getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
    return [leaf for t in inner if isinstance(t, torch.Tensor) for leaf in _leaves(t)]  # a DTensor also names its mesh
