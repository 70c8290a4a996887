"""Time training steps in interleaved rounds of fresh instances (cuDNN picks kernels per instance): a median with
its spread, and CUDA's peak memory. Imports torch and the stdlib only."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Callable, ContextManager, Iterable, Mapping

import torch

__all__ = ["NOISY_SPREAD", "METHODS", "Run", "Measurement", "time_steps", "time_block", "reset_memory", "peak_mb",
           "interleaved", "choose_method", "paired_ratio", "format_time", "format_ratio", "format_memory",
           "noisy_legend"]

NOISY_SPREAD = 0.10  # a measurement whose (max - min) / median over rounds exceeds this is flagged as noisy
METHODS = ("pipelined", "alternating", "alone")  # interleaved(pipelined=True), (blocks > 1), or neither


@dataclasses.dataclass
class Run:
    """What a factory may return instead of a bare step: ``context`` wraps the steps (a context manager, or a
    callable returning a fresh one, as ``blocks > 1`` enters it per block); ``teardown`` runs after them."""

    step: Callable[[], object]
    context: ContextManager | Callable[[], ContextManager] | None = None
    teardown: Callable[[], None] | None = None

    def enter(self) -> ContextManager:
        if self.context is None:
            return contextlib.nullcontext()
        fresh = not hasattr(self.context, "__enter__") or isinstance(self.context, type)  # torch.no_grad is a factory
        return self.context() if fresh else self.context


@dataclasses.dataclass
class Measurement:
    """One system measured over rounds: a figure per round (ms per step) and what follows from them."""

    name: str
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    peak_mb: float | None = None  # CUDA, timed alone: max_memory_allocated over the steady-state steps, top round
    reserved_mb: float | None = None  # the same for max_memory_reserved, CUDA-graph pools included
    settings: dict = dataclasses.field(default_factory=dict)
    error: str | None = None

    median_ms = property(lambda self: statistics.median(self.rounds_ms) if self.rounds_ms else None,
                         doc="The median of the rounds' figures.")
    min_ms = property(lambda self: min(self.rounds_ms) if self.rounds_ms else None)
    max_ms = property(lambda self: max(self.rounds_ms) if self.rounds_ms else None)
    spread = property(lambda self: (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else None)
    noisy = property(lambda self: self.spread is not None and self.spread > NOISY_SPREAD)

    def to_dict(self) -> dict:  # JSON-ready, the derived figures included
        return {**dataclasses.asdict(self), "median_ms": self.median_ms, "min_ms": self.min_ms,
                "max_ms": self.max_ms, "spread": self.spread, "noisy": self.noisy}


def _warm_up(step: Callable[[], object], warmup: int, device: torch.device) -> None:
    """``warmup`` untimed steps; on CUDA the cache is emptied and the peaks restarted after the first and before the
    last, so the peaks are a steady-state step's (cuDNN's trials and the optimizer state's creation dropped)."""
    before = warmup - 1 if warmup >= 2 else warmup
    for _ in range(before):
        step()
    if device.type == "cuda" and warmup:  # never between the blocks of alternating steps: the cache stays warm
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup - before):
        step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """``warmup`` untimed steps, then ``iters`` step times in ms. On CUDA, events around each step with nothing
    waiting between steps, each queued while the one before runs (a training loop's steady state); else ``timer``."""
    _warm_up(step, warmup, device)
    if device.type == "cuda":
        _sync(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        _sync(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        start = timer()
        step()
        times.append((timer() - start) * 1e3)
    return times


def time_block(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: Callable[[], float] = time.perf_counter) -> float:
    """``warmup`` untimed steps, then ``iters`` back to back with one sync at the end: the block's ms over ``iters``."""
    _warm_up(step, warmup, device)
    _sync(device)
    start = timer()
    for _ in range(iters):
        step()
    _sync(device)
    return (timer() - start) * 1e3 / iters


def reset_memory(device: torch.device) -> None:
    """Free what can be freed and, on CUDA, restart the peak-memory counters."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    """CUDA's peak allocated MB since the counters restarted; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _as_run(made: Callable[[], object] | Run) -> Run:
    return made if isinstance(made, Run) else Run(made)


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"  # text, not the exception: its frames would keep the instance alive


def _run_alone(factory: Callable, iters: int, warmup: int, device: torch.device, timer, pipelined: bool):
    """Build one instance and time it: (ms per step, peak MB, reserved MB), or its error as text."""
    try:
        reset_memory(device)
        run = _as_run(factory())
        try:
            with run.enter():
                if pipelined:
                    ms = time_block(run.step, iters=iters, warmup=warmup, device=device, timer=timer)
                else:
                    ms = statistics.median(time_steps(run.step, iters=iters, warmup=warmup, device=device, timer=timer))
        finally:
            if run.teardown is not None:
                run.teardown()
        reserved = torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None
        return ms, peak_mb(device), reserved
    except Exception as e:  # noqa: BLE001 - one failing system must not lose the others' numbers
        return _error_text(e)


def _alternating_round(factories: Mapping[str, Callable], iters: int, warmup: int, blocks: int,
                       device: torch.device, timer) -> dict:
    """Build and warm up every system, then alternate their timed steps in ``blocks`` blocks (rotated per block)."""
    runs, times, out, peaks = {}, {}, {}, {}
    try:
        for name, factory in factories.items():
            try:  # the peak over a warm-up step, less what the systems built before hold
                base = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
                runs[name] = _as_run(factory())
                with runs[name].enter():
                    _warm_up(runs[name].step, warmup, device)
                peaks[name] = None if base is None else peak_mb(device) - base
                times[name] = []
            except Exception as e:  # noqa: BLE001 - as in _run_alone
                out[name] = _error_text(e)
        for b in range(blocks):
            names = list(times)
            for name in names[b % len(names):] + names[:b % len(names)] if names else []:
                try:
                    with runs[name].enter():
                        times[name] += time_steps(runs[name].step, iters=iters // blocks + (b < iters % blocks),
                                                  warmup=0, device=device, timer=timer)
                except Exception as e:  # noqa: BLE001 - as above
                    out[name] = _error_text(e)
                    del times[name]
        return {**out, **{name: (statistics.median(t), peaks[name], None) for name, t in times.items()}}
    finally:
        for run in runs.values():
            if run.teardown is not None:
                run.teardown()


def interleaved(systems: Mapping[str, Callable], *, rounds: int = 3, iters: int, warmup: int, device: torch.device,
                blocks: int = 1, pipelined: bool = False, on_run: Callable[[int, str], None] | None = None,
                timer: Callable[[], float] = time.perf_counter) -> dict[str, Measurement]:
    """Time every system in ``rounds`` rounds, a fresh instance each round, the order rotated left by the round.

    Alone by default (the round's figure is the median step); ``pipelined=True`` times the steps back to back;
    ``blocks=k`` builds the round's systems side by side and alternates their timed steps in ``k`` blocks, so a
    drifting host moves them alike (each peak taken over its warm-up, less what the systems built before hold). A
    system that raises gets ``error`` and is not run again.

    Args:
        systems: name -> factory building a fresh model and optimizer, returning a step callable or a :class:`Run`.
        on_run: called as ``on_run(round_index, name)`` before each round's systems are built.

    Raises:
        ValueError: ``rounds`` or ``iters`` below 1, ``warmup`` below 0, ``blocks`` outside 1..iters (or pipelined).
    """
    if rounds < 1 or iters < 1 or warmup < 0 or not 1 <= blocks <= iters or (pipelined and blocks != 1):
        raise ValueError(f"interleaved needs rounds >= 1, iters >= 1, warmup >= 0 and 1 <= blocks <= iters (1 when "
                         f"pipelined); got rounds={rounds}, iters={iters}, warmup={warmup}, blocks={blocks}")
    method = "pipelined" if pipelined else "alternating" if blocks > 1 else "alone"
    settings = {"rounds": rounds, "iters": iters, "warmup": warmup, "device": str(device), "method": method}
    results = {name: Measurement(name, settings=dict(settings)) for name in systems}
    names = list(systems)
    for r in range(rounds):
        order = [n for n in names[r % len(names):] + names[:r % len(names)] if results[n].error is None]
        for name in order if on_run else ():
            on_run(r, name)
        if blocks > 1:
            got = _alternating_round({n: systems[n] for n in order}, iters, warmup, blocks, device, timer)
        else:
            got = {n: _run_alone(systems[n], iters, warmup, device, timer, pipelined) for n in order}
        for name, result in got.items():
            m = results[name]
            if isinstance(result, str):
                m.error = result
                continue
            m.rounds_ms.append(result[0])
            if result[1] is not None:  # CUDA: the highest round's peaks
                m.peak_mb = max(m.peak_mb or 0, result[1])
                m.reserved_mb = None if result[2] is None else max(m.reserved_mb or 0, result[2])
    reset_memory(device)
    return results


def choose_method(device: torch.device, compiled: bool) -> tuple[str, str]:
    """The method in :data:`METHODS` that times a step as a training loop sees it, and why."""
    if device.type != "cuda":
        return "alone", "off CUDA the wall clock times each step"
    if compiled:
        return "pipelined", ("compiled: a step started on an idle GPU adds the host time before its first kernel, "
                             "which a training loop hides behind the step before")
    return "alternating", "eager on CUDA: the host's speed drifts within a second, and alternating moves all alike"


def paired_ratio(a: Measurement, b: Measurement) -> tuple[float, float, float]:
    """(median, min, max) of ``a.rounds_ms[i] / b.rounds_ms[i]``, two measurements of one :func:`interleaved` call.

    Raises:
        ValueError: either has no rounds, or their round counts differ.
    """
    if not a.rounds_ms or len(a.rounds_ms) != len(b.rounds_ms):
        raise ValueError(f"paired_ratio needs the same rounds; got {len(a.rounds_ms)} and {len(b.rounds_ms)}")
    ratios = [x / y for x, y in zip(a.rounds_ms, b.rounds_ms)]
    return statistics.median(ratios), min(ratios), max(ratios)


def format_time(m) -> str:
    """"10.71 ms [10.5-11.0]" (median [min-max] over rounds), " !" appended when noisy; "-" if unmeasured."""
    if m.median_ms is None:
        return "-"
    d = 1 if m.min_ms >= 10 else 2 if m.min_ms >= 1 else 3
    return f"{m.median_ms:.2f} ms [{m.min_ms:.{d}f}-{m.max_ms:.{d}f}]" + (" !" if m.noisy else "")


def format_ratio(ratio: tuple[float, float, float]) -> str:
    """"0.980x [0.950-1.010]" from a :func:`paired_ratio` result."""
    return "{:.3f}x [{:.3f}-{:.3f}]".format(*ratio)


def format_memory(m) -> str:
    """"1234 MB", or "n/a" without a peak."""
    return "n/a" if m.peak_mb is None else f"{m.peak_mb:.0f} MB"


def noisy_legend(measurements: Iterable) -> str:
    """The legend of the " !" mark if any measurement is noisy, else ""."""
    if not any(getattr(m, "noisy", False) for m in measurements):
        return ""
    return (f"! = noisy: the rounds spread over more than {NOISY_SPREAD:.0%} of their median; rerun with more "
            "rounds or timed steps")
