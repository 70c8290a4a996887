"""``--max-batch``: the largest batch that fits, by doubling and then bisecting, no try leaving memory behind."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable

import torch

__all__ = ["Allocator", "SearchResult", "search", "recovering", "describe", "format_table"]

_MB = 2**20
_OOM_MESSAGES = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                 "CUDNN_STATUS_ALLOC_FAILED")


@dataclasses.dataclass(frozen=True)
class Allocator:
    """What the recovery needs of a memory allocator: CUDA's (:meth:`cuda`), or a stand-in."""

    allocated: Callable[[], int]
    empty_cache: Callable[[], None]
    reset_peak: Callable[[], None]

    @classmethod
    def cuda(cls, device: torch.device) -> "Allocator":
        return cls(lambda: torch.cuda.memory_allocated(device), torch.cuda.empty_cache,
                   lambda: torch.cuda.reset_peak_memory_stats(device))


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The largest batch that fitted (None: not even the first), its peak MB, and how the search went."""

    largest: int | None
    peak_mb: float | None
    smallest_failed: int | None
    tries: tuple[tuple[int, bool], ...]  # (batch, fitted), in order
    stopped: str  # "resolved", "cap" (the cap fitted) or "time"
    seconds: float


def search(fits: Callable[[int], float | None], start: int = 64, cap: int = 4096, resolution: int = 8,
           seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Double from ``start`` until a batch fails or ``cap`` fits, then bisect to ``resolution``.

    Args:
        fits: the peak MB of a training step at this batch, or None when it ran out of memory.
        resolution: bisect until the largest fit and the smallest failure are this close (tries are its multiples).
        seconds: no new try starts after this long.

    Raises:
        ValueError: a size below 1, or ``start`` above ``cap``.
    """
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (start, cap, resolution)) or start > cap:
        raise ValueError(f"need ints start <= cap and resolution >= 1; got {start}, {cap}, {resolution}")
    began, tries = clock(), []
    fit, peak, failed = 0, None, None

    def trial(batch: int) -> bool:
        nonlocal fit, peak, failed
        got = fits(batch)
        tries.append((batch, got is not None))
        if got is None:
            failed = batch
        else:
            fit, peak = batch, got
        return got is not None

    def done(stopped: str) -> SearchResult:
        return SearchResult(fit or None, peak, failed, tuple(tries), stopped, clock() - began)

    def out_of_time() -> bool:
        return seconds is not None and clock() - began >= seconds

    batch = start
    while trial(batch) and batch < cap:  # doubling
        if out_of_time():
            return done("time")
        batch = min(2 * batch, cap)
    while failed is not None and failed - fit > resolution:  # bisecting
        middle = max((fit + failed) // 2 // resolution * resolution, fit + resolution)
        if out_of_time() or middle >= failed:
            return done("time" if out_of_time() else "resolved")
        trial(middle)
    return done("resolved" if failed is not None else "cap")


def _settle(allocator: Allocator) -> int:
    """Collect garbage (cycles through frames included), empty the cache, restart the peak; the bytes left."""
    gc.collect()
    allocator.empty_cache()
    allocator.reset_peak()
    return allocator.allocated()


def recovering(run: Callable[[int], float], allocator: Allocator) -> Callable[[int], float | None]:
    """``run(batch)`` as a ``fits`` for :func:`search`: None when it runs out of memory, never leaving memory behind.

    Raises:
        RuntimeError: memory is still allocated after a try (every later try would have less), or ``run`` failed
            for another reason.
    """
    baseline = _settle(allocator)

    def fits(batch: int) -> float | None:
        try:
            peak = run(batch)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one, as are cuBLAS's and cuDNN's failed allocations
            if not any(m in str(e) for m in _OOM_MESSAGES):
                raise
            peak = None  # leaving the handler drops the exception and the frames of the failed step
        left = _settle(allocator) - baseline
        if left:
            raise RuntimeError(f"{left / _MB:.1f} MB is still allocated after the try at batch {batch} "
                               f"({'out of memory' if peak is None else 'it fitted'}); the search stopped")
        return peak

    return fits


def describe(result: SearchResult) -> str:
    """The largest batch as a reader takes it: exact to the resolution, at least the cap, or at least so much."""
    if result.largest is None:
        return f"none (< {result.smallest_failed})"
    if result.stopped == "resolved":
        return f"{result.largest} (< {result.smallest_failed})"
    return f">= {result.largest} ({'the cap' if result.stopped == 'cap' else 'time limit'})"


def format_table(results: dict[str, SearchResult | str]) -> str:
    """A row per precision: the largest batch, its peak MB, the tries and their seconds, or the error."""
    lines = ["\nlargest batch that fits, per precision (a fresh Trainer and two steps per try):",
             f"{'precision':>10} | {'largest batch':>24} | {'peak MB':>9} | {'tries':>5} | {'seconds':>7}"]
    for precision, r in results.items():
        if isinstance(r, str):
            lines.append(f"{precision:>10} | {r}")
        else:
            peak = "" if r.peak_mb is None else f"{r.peak_mb:.0f}"
            lines.append(f"{precision:>10} | {describe(r):>24} | {peak:>9} | {len(r.tries):>5} | {r.seconds:>7.1f}")
    return "\n".join(lines)
