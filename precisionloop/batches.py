"""Batches: moving them to the device (and transforming their inputs there), their size, and the default
``(inputs, targets)`` shape."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

__all__ = ["to_device", "on_device", "normalize_uint8", "note_uint8_inputs", "batch_size", "pair", "check_pair"]


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


def on_device(batch: Any, device: torch.device, memory_format: torch.memory_format,
              transform: Callable[[Any], Any] | None, pairs: bool) -> Any:
    """``to_device``, then ``transform`` there: on the inputs of an ``(inputs, targets)`` batch (``pairs``), else on
    the whole batch; what it returns is put in ``memory_format`` too."""
    batch = to_device(batch, device, memory_format)
    if transform is None:
        return batch
    if pairs:
        inputs, targets = pair(batch)
        out = transform(inputs)
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[:1] != inputs.shape[:1]:
            what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"input_transform returned {what} for inputs of shape {tuple(inputs.shape)}: it must return "
                            "the inputs as a tensor with the same batch size (the first dimension)")
        batch = (out, targets)
    else:
        out = transform(batch)
        if not _is_whole_batch(out, batch):
            raise TypeError(f"input_transform returned {type(out).__name__} for a batch that is a "
                            f"{type(batch).__name__}: with forward_batch or compute_loss overridden it gets the whole "
                            "batch and must return the whole batch (a dict for a dict, say), not None or one field")
        batch = out
    return to_device(batch, device, memory_format)


def _is_whole_batch(out: Any, batch: Any) -> bool:
    """Whether a whole-batch transform's result can be a batch: not None, nor a bare tensor for a container batch
    (the transform returned one field instead of the batch)."""
    if isinstance(batch, (Mapping, list, tuple)) and isinstance(out, torch.Tensor):
        return False
    return out is not None


def note_uint8_inputs(error: BaseException, inputs: Any) -> None:
    """Note on an error the model raised on uint8 inputs given with no ``input_transform``: the usual cause is
    images that were never turned into floats. Out-of-memory errors get none; Python before 3.11 has no notes."""
    if (isinstance(inputs, torch.Tensor) and inputs.dtype == torch.uint8 and hasattr(error, "add_note")
            and not isinstance(error, torch.OutOfMemoryError)):
        error.add_note("The inputs are uint8 and no input_transform is set. For uint8 images, pass "
                       "input_transform=precisionloop.normalize_uint8(mean, std) to the Trainer, which turns them "
                       "into normalised floats on the device")


class _NormalizeUint8:
    """uint8 images to float32, normalised per channel; see :func:`normalize_uint8`."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1) for v in (mean, std))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # mean and std per device, moved once

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
            what = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
            whole = (" (with forward_batch or compute_loss overridden, input_transform gets the whole batch: wrap it, "
                     "e.g. lambda b: {**b, 'x': norm(b['x'])})") if not isinstance(images, torch.Tensor) else ""
            raise TypeError(f"normalize_uint8 takes uint8 images (0-255), got {what}{whole}; for float images that "
                            "are already scaled, pass no input_transform (or one of your own)")
        channels = len(self.mean)
        if images.dim() not in (3, 4) or (channels > 1 and images.shape[-3] != channels):
            raise ValueError(f"normalize_uint8 takes images (N, C, H, W) or (C, H, W) with C = {channels} channels, as "
                             f"many as its mean and std; got shape {tuple(images.shape)}")
        if images.device not in self._on:  # moved once: a copy from pageable memory each step could block the host
            self._on[images.device] = (self.mean.to(images.device), self.std.to(images.device))
        mean, std = self._on[images.device]
        return (images.float() / 255 - mean) / std

    def __repr__(self) -> str:
        return f"normalize_uint8(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def normalize_uint8(mean: Sequence[float], std: Sequence[float]) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``input_transform`` turning uint8 images ``(N, C, H, W)`` into float32 ``(x / 255 - mean) / std`` per channel.

    The same values as torchvision's ``ToTensor()`` then ``Normalize(mean, std)``, computed where the images
    are: given as ``Trainer(input_transform=...)``, on the device, after the batch has crossed as uint8 (a
    quarter of float32's bytes). The Trainer puts the result in the model's layout (channels_last on CUDA).

    Args:
        mean: the channels' means, on the 0-1 scale (ImageNet's: ``(0.485, 0.456, 0.406)``).
        std: the channels' standard deviations, on the same scale (ImageNet's: ``(0.229, 0.224, 0.225)``).

    Raises:
        ValueError: ``mean`` and ``std`` are not sequences of equal length with finite values, a std is not > 0,
            or a value is above 1 (statistics on the 0-255 scale).
    """
    try:
        values = [[float(v) for v in mean], [float(v) for v in std]]
    except (TypeError, ValueError):
        raise ValueError(f"normalize_uint8 takes sequences of numbers, got mean={mean!r}, std={std!r}") from None
    if not values[0] or len(values[0]) != len(values[1]):
        raise ValueError(f"normalize_uint8 needs one mean and one std per channel, got {len(values[0])} means "
                         f"and {len(values[1])} stds")
    if not all(abs(v) < float("inf") for v in values[0] + values[1]) or min(values[1]) <= 0:
        raise ValueError(f"normalize_uint8 needs finite means and stds > 0, got mean={mean!r}, std={std!r}")
    if max(values[0] + values[1]) > 1:
        raise ValueError(f"normalize_uint8 takes statistics on the 0-1 scale, as the images are divided by 255 first; "
                         f"got mean={mean!r}, std={std!r}: for 0-255 statistics divide them by 255")
    return _NormalizeUint8(*values)


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) batch of tensors, lists, tuples and mappings."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors(value)


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor of one or more dimensions in a (nested) batch that has one above 0
    (an empty side tensor, such as a detection batch's boxes, does not make the batch empty), 0 when none has; 1 for
    a batch of 0-d tensors only (a scalar beside the data has no batch dimension); None when it holds no tensor."""
    found = list(tensors(batch))
    sizes = [t.shape[0] for t in found if t.dim()]
    return next((n for n in sizes if n), 0) if sizes else (1 if found else None)


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
