"""The recipe's and the benchmarks' timing: :func:`precisionloop.measure.interleaved` by any of :data:`METHODS`, steps
in a context, CUDA's reserved memory, progress; the method that fits what is timed; ratios of rounds paired in time."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable, ContextManager, Mapping

import torch

from precisionloop import measure

__all__ = ["METHODS", "Run", "Measurement", "time_block", "interleaved", "choose_method", "paired_ratio",
           "format_ratio"]

METHODS = ("pipelined", "alternating", "alone")  # interleaved(pipelined=True), (blocks > 1), or neither


@dataclasses.dataclass
class Run(measure.Run):
    """A :class:`~precisionloop.measure.Run` whose steps run in ``context``, a context manager or a factory of them."""

    context: ContextManager | Callable[[], ContextManager] = contextlib.nullcontext


@dataclasses.dataclass
class Measurement(measure.Measurement):
    """A :class:`~precisionloop.measure.Measurement` with CUDA's peak reserved MB (graph pools included) when alone."""

    reserved_mb: float | None = None

    def to_dict(self) -> dict:  # JSON-ready, the derived figures included
        return {**dataclasses.asdict(self), "median_ms": self.median_ms, "min_ms": self.min_ms,
                "max_ms": self.max_ms, "spread": self.spread, "noisy": self.noisy}


def _entered(run: measure.Run) -> ContextManager:
    """The context ``run``'s steps run in, a fresh one from a factory (``torch.no_grad`` is one)."""
    context = run.context if isinstance(run, Run) else contextlib.nullcontext
    fresh = not hasattr(context, "__enter__") or isinstance(context, type)
    return context() if fresh else context


def time_block(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: Callable[[], float] = time.perf_counter) -> float:
    """``warmup`` untimed steps, then ``iters`` back to back with one sync at the end: the block's ms over ``iters``."""
    measure.warm_up(step, warmup, device)
    _sync(device)
    start = timer()
    for _ in range(iters):
        step()
    _sync(device)
    return (timer() - start) * 1e3 / iters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _alone_round(factories: Mapping[str, Callable], pipelined: bool, reserved: dict[str, float], device: torch.device,
                 **timing) -> dict:
    """Each system alone, its median step or (``pipelined``) :func:`time_block`; its reserved peak to ``reserved``."""
    def timed(run: measure.Run) -> float:
        with _entered(run):
            if pipelined:
                return time_block(run.step, device=device, **timing)
            return statistics.median(measure.time_steps(run.step, device=device, **timing))

    got = {}
    for name, factory in factories.items():
        got[name] = measure.run_alone(factory, timed, device)
        if device.type == "cuda" and not isinstance(got[name], str):  # the counters run until the next reset
            reserved[name] = max(reserved.get(name, 0.0), torch.cuda.max_memory_reserved(device) / 2**20)
    return got


def _alternating_round(factories: Mapping[str, Callable], iters: int, warmup: int, blocks: int,
                       device: torch.device, timer) -> dict:
    """Build and warm up every system, then alternate their timed steps in ``blocks`` blocks (rotated per block)."""
    runs, times, out, peaks = {}, {}, {}, {}
    try:
        for name, factory in factories.items():
            try:  # the peak over a warm-up step, less what the systems built before hold
                base = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
                runs[name] = measure.as_run(factory())
                with _entered(runs[name]):
                    measure.warm_up(runs[name].step, warmup, device)
                peaks[name] = None if base is None else measure.peak_mb(device) - base
                times[name] = []
            except Exception as e:  # noqa: BLE001 - one failing system must not lose the others' numbers
                out[name] = measure.error_text(e)
        for b in range(blocks):
            names = list(times)
            for name in names[b % len(names):] + names[:b % len(names)] if names else []:
                try:
                    with _entered(runs[name]):
                        times[name] += measure.time_steps(runs[name].step, iters=iters // blocks + (b < iters % blocks),
                                                          warmup=0, device=device, timer=timer)
                except Exception as e:  # noqa: BLE001 - as above
                    out[name] = measure.error_text(e)
                    del times[name]
        return {**out, **{name: (statistics.median(t), peaks[name]) for name, t in times.items()}}
    finally:
        for run in runs.values():
            if run.teardown is not None:
                run.teardown()


def interleaved(systems: Mapping[str, Callable], *, rounds: int = 3, iters: int, warmup: int, device: torch.device,
                blocks: int = 1, pipelined: bool = False, on_run: Callable[[int, str], None] | None = None,
                timer: Callable[[], float] = time.perf_counter) -> dict[str, Measurement]:
    """:func:`precisionloop.measure.interleaved`, each system alone by default, its steps in its :class:`Run`'s context.

    ``pipelined=True`` times the steps back to back; ``blocks=k`` builds the round's systems side by side and
    alternates their timed steps in ``k`` blocks, so a drifting host moves them alike (each peak taken over its
    warm-up, less what the systems built before hold). ``on_run(round_index, name)`` is called before each round's
    systems are built. The method is recorded in the settings.

    Raises:
        ValueError: ``blocks`` outside 1..iters (1 when pipelined); as :func:`precisionloop.measure.interleaved`.
    """
    if not 1 <= blocks <= iters or (pipelined and blocks != 1):
        raise ValueError(f"interleaved needs 1 <= blocks <= iters (1 when pipelined); got blocks={blocks}, "
                         f"iters={iters}")
    timing = {"iters": iters, "warmup": warmup, "device": device, "timer": timer}
    reserved: dict[str, float] = {}

    def each_round(r: int, factories: dict[str, Callable]) -> dict:
        for name in factories if on_run else ():
            on_run(r, name)
        if blocks > 1:
            return _alternating_round(factories, blocks=blocks, **timing)
        return _alone_round(factories, pipelined, reserved, **timing)

    measured = measure.interleaved(systems, rounds=rounds, time_round=each_round, **timing)
    method = "pipelined" if pipelined else "alternating" if blocks > 1 else "alone"
    for m in measured.values():
        m.settings["method"] = method
    return {name: Measurement(**vars(m), reserved_mb=reserved.get(name)) for name, m in measured.items()}


def choose_method(device: torch.device, compiled: bool, asked: str = "auto") -> tuple[str, str]:
    """The method in :data:`METHODS` that times a step as a training loop sees it, and why; ``asked`` unless "auto"."""
    if asked != "auto":
        return asked, "asked for"
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


def format_ratio(ratio: tuple[float, float, float]) -> str:
    """"0.980x [0.950-1.010]" from a :func:`paired_ratio` result."""
    return "{:.3f}x [{:.3f}-{:.3f}]".format(*ratio)
