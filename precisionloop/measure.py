"""Autotune's timing: training steps in interleaved rounds of fresh instances (cuDNN picks kernels per instance)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Callable, Iterable, Mapping

import torch

__all__ = ["NOISY_SPREAD", "Run", "Measurement", "warm_up", "time_steps", "reset_memory", "peak_mb", "as_run",
           "error_text", "run_alone", "interleaved", "format_time", "format_memory", "noisy_legend"]

NOISY_SPREAD = 0.10  # a measurement whose (max - min) / median over rounds exceeds this is flagged as noisy


@dataclasses.dataclass
class Run:
    """A step, and a ``teardown`` called after its instance is timed."""

    step: Callable[[], object]
    teardown: Callable[[], None] | None = None


@dataclasses.dataclass
class Measurement:
    """One system measured over rounds: a figure per round (ms per step) and what follows from them."""

    name: str
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    peak_mb: float | None = None  # CUDA: max_memory_allocated over the steady-state steps, top round
    settings: dict = dataclasses.field(default_factory=dict)
    error: str | None = None

    median_ms = property(lambda self: statistics.median(self.rounds_ms) if self.rounds_ms else None)
    min_ms = property(lambda self: min(self.rounds_ms) if self.rounds_ms else None)
    max_ms = property(lambda self: max(self.rounds_ms) if self.rounds_ms else None)
    spread = property(lambda self: (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else None)
    noisy = property(lambda self: self.spread is not None and self.spread > NOISY_SPREAD)


def warm_up(step: Callable[[], object], warmup: int, device: torch.device) -> None:
    """``warmup`` untimed steps; on CUDA the memory is reset (:func:`reset_memory`) after the first and before the
    last, so the peaks are a steady-state step's (cuDNN's trials and the optimizer state's creation dropped)."""
    for i in range(warmup):
        step()
        if i == max(warmup - 2, 0) and device.type == "cuda":  # never between alternating blocks: the cache stays warm
            reset_memory(device)


def time_steps(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """``warmup`` untimed steps, then ``iters`` step times in ms. On CUDA, events around each step with nothing
    waiting between steps, each queued while the one before runs (a training loop's steady state); else ``timer``."""
    warm_up(step, warmup, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        start = timer()
        step()
        times.append((timer() - start) * 1e3)
    return times


def reset_memory(device: torch.device) -> None:
    """Free what can be freed and, on CUDA, restart the peak-memory counters."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    """CUDA's peak allocated MB since the counters restarted; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def as_run(made: Callable[[], object] | Run) -> Run:
    """What a factory returned, as a :class:`Run`."""
    return made if isinstance(made, Run) else Run(made)


def error_text(e: Exception) -> str:
    """A failing system's error, as the measurement records it."""
    return f"{type(e).__name__}: {e}"  # text, not the exception: its frames would keep the instance alive


def run_alone(factory: Callable, time_step: Callable[[Run], float], device: torch.device) -> tuple | str:
    """Build one instance, time it by ``time_step(run)``: (ms, peak MB), or its error as text."""
    try:
        reset_memory(device)
        run = as_run(factory())
        try:
            ms = time_step(run)
        finally:
            if run.teardown is not None:
                run.teardown()
        return ms, peak_mb(device)
    except Exception as e:  # noqa: BLE001 - one failing system must not lose the others' numbers
        return error_text(e)


def interleaved(systems: Mapping[str, Callable], *, rounds: int = 3, iters: int, warmup: int, device: torch.device,
                timer: Callable[[], float] = time.perf_counter,
                time_round: Callable[[int, dict[str, Callable]], dict] | None = None) -> dict[str, Measurement]:
    """Time every system in ``rounds`` rounds, a fresh instance each round, the order rotated left by the round.

    Each is timed alone, its figure the round's median step; a system that raises gets ``error`` and is not run again.

    Args:
        systems: name -> factory building a fresh model and optimizer, returning a step callable or a :class:`Run`.
        time_round: another method: given the round's index and its factories in order, it returns per name (ms per
            step, peak MB) or the error's text, as :func:`run_alone` does.

    Raises:
        ValueError: ``rounds`` or ``iters`` below 1, or ``warmup`` below 0.
    """
    if rounds < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"interleaved needs rounds >= 1, iters >= 1 and warmup >= 0; got rounds={rounds}, "
                         f"iters={iters}, warmup={warmup}")

    def median_step(run: Run) -> float:
        return statistics.median(time_steps(run.step, iters=iters, warmup=warmup, device=device, timer=timer))

    def alone(r: int, factories: dict[str, Callable]) -> dict:
        return {name: run_alone(factory, median_step, device) for name, factory in factories.items()}

    settings = {"rounds": rounds, "iters": iters, "warmup": warmup, "device": str(device)}
    results = {name: Measurement(name, settings=dict(settings)) for name in systems}
    names = list(systems)
    for r in range(rounds):
        order = [n for n in names[r % len(names):] + names[:r % len(names)] if results[n].error is None]
        for name, result in (time_round or alone)(r, {n: systems[n] for n in order}).items():
            m = results[name]
            if isinstance(result, str):
                m.error = result
            else:
                m.rounds_ms.append(result[0])
                if result[1] is not None:  # CUDA: the highest round's peak
                    m.peak_mb = max(m.peak_mb or 0, result[1])
    reset_memory(device)
    return results


def format_time(m) -> str:
    """"10.71 ms [10.5-11.0]" (median [min-max] over rounds), " !" appended when noisy; "-" if unmeasured."""
    if m.median_ms is None:
        return "-"
    d = 1 if m.min_ms >= 10 else 2 if m.min_ms >= 1 else 3
    return f"{m.median_ms:.2f} ms [{m.min_ms:.{d}f}-{m.max_ms:.{d}f}]" + (" !" if m.noisy else "")


def format_memory(m) -> str:
    """"1234 MB", or "n/a" without a peak."""
    return "n/a" if m.peak_mb is None else f"{m.peak_mb:.0f} MB"


def noisy_legend(measurements: Iterable) -> str:
    """The legend of the " !" mark if any measurement is noisy, else ""."""
    if not any(m.noisy for m in measurements):
        return ""
    return (f"! = noisy: the rounds spread over more than {NOISY_SPREAD:.0%} of their median; rerun with more "
            "rounds or timed steps")
