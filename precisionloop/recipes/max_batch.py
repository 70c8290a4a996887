"""``--max-batch``: the largest batch that fits per precision, by doubling and then bisecting.

The search (:func:`search`) only asks ``fits(batch)``, so it runs anywhere; :func:`recovering` turns a step that
may run out of memory into such a function, and checks after every try that the allocator is back where it
started, so that no try leaves memory behind to shrink the next. :func:`cuda_try` is the real try: a fresh
Trainer, built as the recipe builds it, takes two training steps (the optimizer state exists in the second).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Callable

import torch

MB = 2**20


@dataclasses.dataclass(frozen=True)
class Allocator:
    """What the recovery needs of a memory allocator: CUDA's (:func:`cuda_allocator`), or a stand-in."""

    allocated: Callable[[], int]
    empty_cache: Callable[[], None]
    reset_peak: Callable[[], None]


def cuda_allocator(device: torch.device) -> Allocator:
    """The CUDA caching allocator of ``device``."""
    return Allocator(lambda: torch.cuda.memory_allocated(device), torch.cuda.empty_cache,
                     lambda: torch.cuda.reset_peak_memory_stats(device))


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The largest batch that fitted (None: not even the smallest tried), its peak MB, and how the search went."""

    largest: int | None
    peak_mb: float | None
    smallest_failed: int | None  # None: nothing tried failed
    tries: tuple[tuple[int, bool], ...]  # (batch, fitted), in order
    stopped: str  # "resolved", "cap" (the cap fitted) or "time" (the time limit ended it)
    seconds: float


def search(fits: Callable[[int], float | None], start: int = 64, cap: int = 4096, resolution: int = 8,
           seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Double from ``start`` until a batch fails or ``cap`` fits, then bisect to ``resolution``.

    Args:
        fits: the peak MB of a training step at this batch, or None when it ran out of memory.
        start: the first batch tried.
        cap: the largest batch tried.
        resolution: the bisection stops when the largest fit and the smallest failure are this close;
            batches tried while bisecting are multiples of it.
        seconds: no new try starts after this long (the result then says ``stopped="time"``).

    Raises:
        ValueError: a size below 1, or ``start`` above ``cap``.
    """
    for name, value in (("start", start), ("cap", cap), ("resolution", resolution)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if start > cap:
        raise ValueError(f"start ({start}) must not exceed cap ({cap})")
    began = clock()
    fit, fit_peak, failed, tries = 0, None, None, []

    def trial(batch: int) -> bool:
        nonlocal fit, fit_peak, failed
        peak = fits(batch)
        tries.append((batch, peak is not None))
        if peak is None:
            failed = batch
        else:
            fit, fit_peak = batch, peak
        return peak is not None

    def out_of_time() -> bool:
        return seconds is not None and clock() - began >= seconds

    batch = start
    while trial(batch) and batch < cap:  # doubling
        if out_of_time():
            return _result(fit, fit_peak, failed, tries, "time", clock() - began)
        batch = min(2 * batch, cap)
    while failed is not None and failed - fit > resolution:  # bisecting
        if out_of_time():
            return _result(fit, fit_peak, failed, tries, "time", clock() - began)
        middle = max((fit + failed) // 2 // resolution * resolution, fit + resolution)
        if middle >= failed:
            break
        trial(middle)
    return _result(fit, fit_peak, failed, tries, "resolved" if failed is not None else "cap", clock() - began)


def _result(fit: int, peak: float | None, failed: int | None, tries: list, stopped: str, seconds: float) -> SearchResult:
    return SearchResult(fit or None, peak, failed, tuple(tries), stopped, seconds)


def settle(allocator: Allocator) -> int:
    """Collect garbage (reference cycles through frames included), empty the cache, restart the peak; bytes left."""
    gc.collect()
    allocator.empty_cache()
    allocator.reset_peak()
    return allocator.allocated()


def recovering(run: Callable[[int], float], allocator: Allocator) -> Callable[[int], float | None]:
    """``run(batch)`` as a ``fits`` for :func:`search`: None when it runs out of memory, never leaving memory behind.

    ``run`` builds everything it needs itself and keeps no reference once it returns or raises. An
    out-of-memory error is dropped at once, its traceback with it (the frames of the failed step and their
    tensors); after every try the garbage is collected and the cache emptied, and the memory allocated must
    be back at what it was before the first try.

    Raises:
        RuntimeError: memory is still allocated after a try, which would shrink every later one.
    """
    baseline = settle(allocator)

    def fits(batch: int) -> float | None:
        try:
            peak: float | None = run(batch)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one, as are cuBLAS's and cuDNN's failed allocations
            if not is_out_of_memory(e):
                raise
            peak = None  # leaving the handler drops the exception and its traceback
        left = settle(allocator) - baseline
        if left:
            raise RuntimeError(f"{left / MB:.1f} MB is still allocated after the try at batch {batch} "
                               f"({'out of memory' if peak is None else 'it fitted'}): something kept a reference, "
                               "and every later try would have less memory; the search stopped")
        return peak

    return fits


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is the GPU running out of memory: the allocator's, or a library's failed allocation."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES))


_OOM_MESSAGES = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def cuda_try(args: argparse.Namespace, device: torch.device, precision: str) -> Callable[[int], float]:
    """One try at a batch: a fresh model, optimizer and Trainer as the recipe builds them, two steps; the peak MB."""
    from . import resnet18_bench as bench  # the recipe's own builders; imported here, as the recipe imports this

    def run(batch_size: int) -> float:
        policy = bench.policy_for(precision, args)
        model = bench.make_model(args)
        trainer = bench.Trainer(model, bench.make_optimizer(model.parameters(), args.fused, args.optimizer), policy,
                                device=device, compile=bench.compile_for(policy, args, device), distributed=None,
                                loss_fn=bench.loss_of(args))
        batch = trainer.to_device(bench.make_batch(args, batch_size, device))
        for _ in range(2):
            trainer.step(batch)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / MB

    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe's ``--max-batch`` flags."""
    g = parser.add_argument_group("--max-batch", "the largest batch that fits per precision (CUDA only): doubling "
                                                 "from --max-batch-start, then bisecting")
    g.add_argument("--max-batch", action="store_true", help="search for the largest batch per precision that fits, "
                   "and print it beside its peak memory after the speed table")
    g.add_argument("--max-batch-start", type=int, default=64, help="the first batch tried (default 64)")
    g.add_argument("--max-batch-cap", type=int, default=4096, help="the largest batch tried (default 4096)")
    g.add_argument("--max-batch-resolution", type=int, default=8,
                   help="bisect until the largest fit and the smallest failure are this close (default 8)")
    g.add_argument("--max-batch-seconds", type=float, default=None,
                   help="per precision, start no new try after this many seconds (default: no limit)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--max-batch`` off CUDA, under ``--distributed``, or with sizes that make no search."""
    if not args.max_batch:
        return
    if args.device.type != "cuda":
        parser.error(f"--max-batch searches for the largest batch that fits in a CUDA GPU's memory, and the device "
                     f"is {args.device}, whose memory torch does not report; run it with --device cuda")
    if args.distributed:
        parser.error("--max-batch runs on one GPU: leave out --distributed (and torchrun)")
    for flag in ("start", "cap", "resolution"):
        value = getattr(args, f"max_batch_{flag}")
        if value < 1:
            parser.error(f"--max-batch-{flag} must be >= 1, got {value}")
    if args.max_batch_start > args.max_batch_cap:
        parser.error(f"--max-batch-start ({args.max_batch_start}) must not exceed --max-batch-cap ({args.max_batch_cap})")
    if args.max_batch_seconds is not None and args.max_batch_seconds <= 0:
        parser.error(f"--max-batch-seconds must be > 0, got {args.max_batch_seconds}")


def run_search(args: argparse.Namespace, device: torch.device) -> dict[str, SearchResult | str]:
    """:func:`search` for each of ``args.precisions`` on ``device``, each try recovering from running out of memory.

    A precision whose search failed (memory left behind, a policy the device cannot run) gets the error's
    first line instead, and the next precision starts from a fresh baseline.
    """
    allocator = cuda_allocator(device)
    got: dict[str, SearchResult | str] = {}
    for precision in args.precisions:
        try:
            got[precision] = search(recovering(cuda_try(args, device, precision), allocator), args.max_batch_start,
                                    args.max_batch_cap, args.max_batch_resolution, args.max_batch_seconds)
        except (RuntimeError, ValueError) as e:
            got[precision] = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return got


def describe(result: SearchResult) -> str:
    """The largest batch as a reader takes it: exact to the resolution, at least the cap, or at least so much."""
    if result.largest is None:
        return f"none (< {result.smallest_failed})"
    if result.stopped == "cap":
        return f">= {result.largest} (the cap)"
    if result.stopped == "time":
        return f">= {result.largest} (time limit)" + (f", < {result.smallest_failed}" if result.smallest_failed else "")
    return f"{result.largest} (< {result.smallest_failed})"


def format_table(results: dict[str, SearchResult | str], args: argparse.Namespace) -> str:
    """A row per precision: the largest batch, its peak MB, the tries and the seconds they took (or the error)."""
    lines = [f"\nlargest batch that fits, per precision: fresh Trainer, two training steps each try, doubling from "
             f"{args.max_batch_start} to at most {args.max_batch_cap}, then bisecting to {args.max_batch_resolution}:",
             f"{'precision':>10} | {'largest batch':>24} | {'peak MB':>9} | {'tries':>5} | {'seconds':>7}"]
    for precision, r in results.items():
        if isinstance(r, str):
            lines.append(f"{precision:>10} | {r}")
            continue
        peak = "" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        lines.append(f"{precision:>10} | {describe(r):>24} | {peak:>9} | {len(r.tries):>5} | {r.seconds:>7.1f}")
    total = sum(r.seconds for r in results.values() if not isinstance(r, str))
    lines.append(f"search time in all: {total:.0f} s (each try builds a model and runs two steps; an out-of-memory "
                 "try is dropped and its memory returned before the next)")
    return "\n".join(lines)


def report(args: argparse.Namespace, device: torch.device) -> str:
    """Search each precision and format the table."""
    return format_table(run_search(args, device), args)
