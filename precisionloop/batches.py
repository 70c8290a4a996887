"""Batches: moving them to the device, their size, and the default ``(inputs, targets)`` shape."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["to_device", "batch_size", "pair", "check_pair"]


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format) -> Any:
    """Move every tensor in a (nested) batch to ``device``, 4-D float tensors in ``memory_format``."""
    if isinstance(batch, torch.Tensor):
        fmt = memory_format if batch.dim() == 4 and batch.is_floating_point() else torch.preserve_format
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
        return type(batch)(*moved) if isinstance(batch, tuple) and hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor in a (nested) batch; None when it holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size(item)
            if size is not None:
                return size
    return None


def pair(batch: Any, suffix: str = "") -> tuple[Any, Any]:
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


def check_pair(batch: Any) -> None:
    """Refuse a list or tuple not of two, a mapping or a string; other iterables are left to ``forward_batch``
    (a generator checked here would be used up before the step)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return
    if isinstance(batch, (tuple, list, Mapping, str, bytes)):
        pair(batch, "; nothing was changed")
