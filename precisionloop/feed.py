"""The device feed: each batch copied to a CUDA device on a side stream, so the copy runs beside the step before it.

``fit`` takes the next batch only once the current step is queued: with no host sync in the step (a fused optimizer)
the GPU is still computing it while the host waits for the loader and issues the copy, which on a side stream does
not queue behind the step. The loader is never read ahead, so a checkpoint's batch count and RNG state describe the
same point of the data, a stop leaves no batch behind, and no state outlives an exception. The step's stream waits
for the copy, and each tensor is recorded there, so the caching allocator reuses its memory only after the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .batches import tensors

__all__ = ["CudaStreams", "device_feed", "tensors"]


class CudaStreams:
    """The side stream a feed copies on, handing each batch over to the device's current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def copying(self, batch: Any) -> Iterator[None]:
        """Work in the block runs on the side stream; after what is queued on the current stream when the batch
        holds CUDA tensors, which a loader may have made there."""
        if any(t.is_cuda for t in tensors(batch)):
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            yield

    def hand_over(self, batch: Any) -> None:
        """The current stream waits for the copies queued so far; the batch's memory is kept until it is done."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.side)
        for t in tensors(batch):
            if t.is_cuda:
                t.record_stream(current)


def device_feed(pull: Callable[[], Any], move: Callable[[Any], Any], end: object, streams) -> Callable[[], Any]:
    """A function giving ``pull()``'s next batch moved by ``move`` on the side stream of ``streams``, or ``end``.

    Args:
        pull: the loader's next batch, or ``end`` when it has no more.
        move: the batch on the device (``Trainer.to_device``).
        streams: :class:`CudaStreams`, or an object with the same ``copying`` and ``hand_over``.
    """
    def next_batch() -> Any:
        batch = pull()
        if batch is end:
            return end
        with streams.copying(batch):
            batch = move(batch)
        streams.hand_over(batch)
        return batch

    return next_batch
