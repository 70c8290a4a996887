"""Time training steps in interleaved rounds of fresh instances (a median with its spread), and read peak memory.

Each round builds every system afresh, as cuDNN picks kernels per instance. Imports torch and the stdlib only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import numbers
import os
import statistics
import time
from typing import Callable, ContextManager, Iterable, Mapping

import torch

__all__ = [
    "NOISY_SPREAD", "NOISY_MARK", "METHODS", "Measurement", "Run", "time_steps", "time_block", "reset_memory", "peak_mb",
    "memory_kind", "interleaved", "method_of", "choose_method", "describe_method", "paired_ratio", "format_time",
    "format_ratio", "format_memory", "noisy_legend",
]

NOISY_SPREAD = 0.10
"""A measurement whose (max - min) / median over rounds exceeds this is flagged as noisy."""

NOISY_MARK = " !"

_CLEAR_REFS = "/proc/self/clear_refs"
_rss = {"baseline_kb": None, "usable": None}  # the CPU resident-set baseline taken by the last reset_memory

_Timer = Callable[[], float]


def _warm_up(step: Callable[[], object], warmup: int, device: torch.device) -> None:
    """Run ``warmup`` untimed steps; on CUDA empty the cache and restart the peak counters before the last one, so
    the reserved peak is a steady-state step's: cuDNN's trial workspaces and the optimizer state's creation are
    dropped, CUDA-graph pools (in use) kept, and the last warm-up step grows the cache back untimed."""
    before_reset = warmup - 1 if warmup >= 2 else warmup
    for _ in range(before_reset):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if warmup:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup - before_reset):
        step()


def time_steps(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: _Timer | None = None) -> list[float]:
    """Run ``warmup`` untimed steps, then return ``iters`` step times in ms: CUDA events on CUDA, else the wall clock.

    On CUDA the peak counters restart before the last warm-up step, so peaks are a steady-state step's. ``timer``, a
    clock in seconds for tests, replaces ``time.perf_counter``; on CUDA it is a ValueError.
    """
    if timer is not None and device.type == "cuda":
        raise ValueError("timer replaces the wall clock off CUDA only; CUDA steps are timed with CUDA events")
    _warm_up(step, warmup, device)
    if device.type != "cuda":
        clock = timer or time.perf_counter
        times = []
        for _ in range(iters):
            start = clock()
            step()
            times.append((clock() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def time_block(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
               timer: _Timer | None = None) -> float:
    """Run ``warmup`` untimed steps, then ``iters`` back to back, and return the block's time over ``iters`` in ms.

    As in a training loop, nothing waits for the device between timed steps, so each is queued while the one before
    runs; CUDA events (else the wall clock) bracket the block. Warm-up, peaks and ``timer`` as in :func:`time_steps`.
    """
    if timer is not None and device.type == "cuda":
        raise ValueError("timer replaces the wall clock off CUDA only; CUDA steps are timed with CUDA events")
    _warm_up(step, warmup, device)
    if device.type != "cuda":
        clock = timer or time.perf_counter
        start = clock()
        for _ in range(iters):
            step()
        return (clock() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM); None where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def _reset_rss() -> None:
    """Restart the resident-set high-water mark and remember the resident set now."""
    # Freed heap pages go back to the OS first, so an earlier run's leftovers don't hide the next one's growth.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # 5: reset VmHWM to the current resident set
    except OSError:
        _rss.update(baseline_kb=None, usable=False)
        return
    baseline = _status_kb("VmRSS")
    _rss.update(baseline_kb=baseline, usable=baseline is not None and _status_kb("VmHWM") is not None)


def reset_memory(device: torch.device) -> None:
    """Free what can be freed and restart the peak-memory counter (on the CPU: the resident-set high-water mark)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_rss()


def peak_mb(device: torch.device) -> float | None:
    """Peak MB since :func:`reset_memory`: CUDA's allocated peak, or the CPU's resident-set growth (None if unknown)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if not _rss["usable"]:
        return None
    hwm = _status_kb("VmHWM")
    return None if hwm is None else max(hwm - _rss["baseline_kb"], 0) / 1024


def memory_kind(device: torch.device) -> str:
    """The unit label of :func:`peak_mb` on ``device``: "MB" (CUDA allocator), "MB RSS" (CPU resident set) or "n/a"."""
    if device.type == "cuda":
        return "MB"
    if device.type != "cpu":
        return "n/a"
    if _rss["usable"] is None:  # no reset yet: look without touching the high-water mark
        return "MB RSS" if os.access(_CLEAR_REFS, os.W_OK) and _status_kb("VmHWM") is not None else "n/a"
    return "MB RSS" if _rss["usable"] else "n/a"


@dataclasses.dataclass
class Run:
    """What a factory may return instead of a bare step.

    ``context`` wraps the warm-up and timed steps: a context manager, or (needed with ``blocks > 1``, which enters it
    once per block) a callable returning a fresh one, e.g. ``policy.backend_flags``. ``teardown`` runs after the steps.
    """

    step: Callable[[], object]
    context: ContextManager | Callable[[], ContextManager] | None = None
    teardown: Callable[[], None] | None = None


_Factory = Callable[[], Callable[[], object] | Run]
# (ms per step, peak allocated MB, peak reserved MB), or the error that stopped the system
_RoundResult = tuple[float, float | None, float | None] | str


@dataclasses.dataclass
class Measurement:
    """One configuration measured over rounds: per-round medians and what follows from them."""

    name: str
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    peak_mb: float | None = None
    memory_kind: str = "n/a"
    settings: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    reserved_mb: float | None = None
    """CUDA, timed alone: ``max_memory_reserved`` in steady-state steps, CUDA-graph pools included; highest round."""

    @property
    def median_ms(self) -> float | None:
        """The median of the per-round medians."""
        return statistics.median(self.rounds_ms) if self.rounds_ms else None

    @property
    def min_ms(self) -> float | None:
        return min(self.rounds_ms) if self.rounds_ms else None

    @property
    def max_ms(self) -> float | None:
        return max(self.rounds_ms) if self.rounds_ms else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median over the rounds."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.rounds_ms and self.median_ms else None

    @property
    def noisy(self) -> bool:
        return self.spread is not None and self.spread > NOISY_SPREAD

    def to_dict(self) -> dict:
        """A JSON-ready dict, the derived figures included."""
        return {"name": self.name, "rounds_ms": list(self.rounds_ms), "median_ms": self.median_ms,
                "min_ms": self.min_ms, "max_ms": self.max_ms, "spread": self.spread, "noisy": self.noisy,
                "peak_mb": self.peak_mb, "reserved_mb": self.reserved_mb, "memory_kind": self.memory_kind,
                "settings": dict(self.settings), "error": self.error}


def _as_run(made: Callable[[], object] | Run) -> Run:
    return made if isinstance(made, Run) else Run(made)


def _is_context_object(context: object) -> bool:
    """A context manager instance, not a factory of them (a class such as ``torch.no_grad`` is a factory)."""
    return hasattr(context, "__enter__") and not isinstance(context, type)


def _context_for(run: Run) -> ContextManager:
    """The context to enter now: none, the one the run holds, or a fresh one from its factory."""
    if run.context is None:
        return contextlib.nullcontext()
    return run.context if _is_context_object(run.context) else run.context()


def _error_text(e: Exception) -> str:
    """Text, not the exception: its traceback's frames would keep the failed instance alive."""
    return f"{type(e).__name__}: {e}"


def _run_alone(factory: _Factory, *, iters: int, warmup: int, device: torch.device,
               timer: _Timer | None, pipelined: bool = False) -> _RoundResult:
    """Build one fresh instance and time it: (ms per step, peak memory, peak reserved), or its error as text."""
    try:
        reset_memory(device)
        run = _as_run(factory())
        try:
            with _context_for(run):
                if pipelined:
                    ms = time_block(run.step, iters=iters, warmup=warmup, device=device, timer=timer)
                else:
                    ms = statistics.median(time_steps(run.step, iters=iters, warmup=warmup, device=device, timer=timer))
            reserved = torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None
            return ms, peak_mb(device), reserved
        finally:
            if run.teardown is not None:
                run.teardown()
    except Exception as e:  # noqa: BLE001 - one failing system must not lose the others' numbers
        return _error_text(e)


def _resident_mb(device: torch.device) -> float | None:
    """Memory held now: CUDA's allocated memory, or the CPU resident set; None if unknown."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / 2**20
    kb = _status_kb("VmRSS") if device.type == "cpu" else None
    return None if kb is None else kb / 1024


@dataclasses.dataclass
class _LiveSystem:
    """One system's instance inside a blocked round."""

    run: Run
    own_mb: float | None
    times: list[float] = dataclasses.field(default_factory=list)
    peak_mb: float | None = None


def _build_and_warm_up(factory: _Factory, *, warmup: int, device: torch.device) -> _LiveSystem:
    """Build an instance and run its warm-up steps; what it then holds is its own memory."""
    before = _resident_mb(device)
    run = _as_run(factory())
    try:
        if _is_context_object(run.context):
            raise TypeError("with blocks > 1 a Run's context is entered once per block: give a zero-argument callable "
                            f"returning a fresh context manager, not the context manager {run.context!r}")
        with _context_for(run):
            for _ in range(warmup):
                run.step()
        after = _resident_mb(device)
    except BaseException:
        if run.teardown is not None:
            run.teardown()
        raise
    return _LiveSystem(run, None if before is None or after is None else max(after - before, 0.0))


def _time_live_block(live: _LiveSystem, steps: int, device: torch.device, timer: _Timer | None,
                origin_mb: float | None, held_by_others: float | None) -> None:
    """Time ``steps`` steps of one instance; its peak is the block's top over the round's origin, less the others'."""
    base = None
    if device.type != "cuda":
        _reset_rss()  # trims the heap first, so the resident set is read after it
        base = _resident_mb(device)
    with _context_for(live.run):
        live.times += time_steps(live.run.step, iters=steps, warmup=0, device=device, timer=timer)
    top = _block_peak_mb(device, base)
    if top is None or held_by_others is None or origin_mb is None:
        return
    peak = max(top - origin_mb - held_by_others, 0.0)
    live.peak_mb = peak if live.peak_mb is None else max(live.peak_mb, peak)


def _block_peak_mb(device: torch.device, base: float | None) -> float | None:
    """The most memory in use since the block began: CUDA's peak allocated, or the CPU resident set's highest."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20  # time_steps restarted the counter
    growth = peak_mb(device)
    return None if growth is None or base is None else base + growth


def _call_teardown(live: _LiveSystem) -> str | None:
    """Run an instance's teardown; its error as text, so the others still get theirs."""
    if live.run.teardown is None:
        return None
    try:
        live.run.teardown()
    except Exception as e:  # noqa: BLE001 - one failing teardown must not skip the others' or lose the results
        return _error_text(e)
    return None


def _blocked_round(factories: Mapping[str, _Factory], order: list[str], *, r: int, iters: int, warmup: int,
                   blocks: int, device: torch.device, timer: _Timer | None,
                   on_run: Callable[[int, str], None] | None) -> dict[str, _RoundResult]:
    """Build and warm up every system in ``order``, then time them in ``blocks`` alternating blocks of steps."""
    reset_memory(device)
    origin = 0.0 if device.type == "cuda" else _resident_mb(device)
    live: dict[str, _LiveSystem] = {}
    out: dict[str, _RoundResult] = {}
    try:
        for name in order:
            if on_run is not None:
                on_run(r, name)
            try:
                live[name] = _build_and_warm_up(factories[name], warmup=warmup, device=device)
            except Exception as e:  # noqa: BLE001 - one failing system must not lose the others' numbers
                out[name] = _error_text(e)
        for b in range(blocks):
            steps = iters // blocks + (b < iters % blocks)
            names = [n for n in order if n in live]
            for name in names[b % len(names):] + names[:b % len(names)] if names else []:
                others = [x.own_mb for n, x in live.items() if n != name]
                try:
                    _time_live_block(live[name], steps, device, timer, origin, None if None in others else sum(others))
                except Exception as e:  # noqa: BLE001 - as above
                    out[name] = _error_text(e)
                    _call_teardown(live.pop(name))  # the step's error is the one to report
        out.update({name: (statistics.median(x.times), x.peak_mb, None) for name, x in live.items()})
        return out
    finally:
        for name, x in live.items():
            failed = _call_teardown(x)
            if failed is not None:
                out[name] = failed


def _record_round(m: Measurement, got: _RoundResult) -> None:
    """Add one round's result, or its error, to a measurement."""
    if isinstance(got, str):
        m.error = got
        return
    ms, peak, reserved = got
    m.rounds_ms.append(ms)
    if peak is not None:
        m.peak_mb = peak if m.peak_mb is None else max(m.peak_mb, peak)
    if reserved is not None:
        m.reserved_mb = reserved if m.reserved_mb is None else max(m.reserved_mb, reserved)


def count_errors(**counts: tuple[object, int]) -> list[str]:
    """``name=value`` for each ``name=(value, minimum)`` that is not an int (bools aside) at or above its minimum."""
    return [f"{name}={value!r}" for name, (value, low) in counts.items()
            if isinstance(value, bool) or not isinstance(value, int) or value < low]


def _check_counts(rounds: int, iters: int, warmup: int, blocks: int, systems: Mapping, pipelined: bool = False) -> None:
    """Refuse bad counts before any system is built."""
    if pipelined and blocks != 1:
        raise ValueError(f"pipelined times each system alone in one block of back-to-back steps; blocks={blocks} "
                         "alternates systems side by side instead: pass one of the two")
    counts = {"rounds": rounds, "iters": iters, "blocks": blocks, "warmup": warmup}
    if any(not isinstance(v, numbers.Integral) for v in counts.values()):
        raise ValueError(f"interleaved needs whole numbers; got {counts}")
    if rounds < 1 or iters < 1 or warmup < 0 or not systems or not 1 <= blocks <= iters:
        raise ValueError("interleaved needs rounds >= 1, iters >= 1, warmup >= 0, 1 <= blocks <= iters and a system; "
                         f"got rounds={rounds}, iters={iters}, warmup={warmup}, blocks={blocks}, {len(systems)} systems")
    if blocks > 1 and warmup < 1:
        raise ValueError("blocks > 1 needs warmup >= 1: what each system holds is read after its warm-up, before the "
                         "blocks, and memory it allocated only in its first timed step would count against the others")


def interleaved(systems: Mapping[str, _Factory], *, rounds: int = 3, iters: int, warmup: int, device: torch.device,
                timer: _Timer | None = None, on_run: Callable[[int, str], None] | None = None,
                blocks: int = 1, pipelined: bool = False) -> dict[str, Measurement]:
    """Time every system in ``rounds`` rounds, a fresh instance each round, the order rotated by the round.

    Round ``r`` rotates the systems left by ``r`` (A B C, then B C A, ...). With ``blocks=1`` each runs alone, after
    :func:`reset_memory`, its figure the median step, or with ``pipelined=True`` the block's time over ``iters``
    (:func:`time_block`). With ``blocks=k`` all are built and warmed up first, then their timed steps alternate in
    ``k`` blocks (block ``b`` rotated by ``b``), so a drifting host moves them alike; a system's peak is the memory in
    use during its blocks less what the others held after warm-up (memory kept for everyone, such as cuBLAS
    workspaces, counts for each only from the second round on). A raising system gets ``error`` and is not run again.

    Args:
        systems: name -> zero-argument factory building a fresh model and optimizer and returning a step callable
            or a :class:`Run`.
        iters: timed steps per system and round.
        on_run: called as ``on_run(round_index, name)`` before each system is built.
        pipelined: time each system's steps as one block (``blocks`` must be 1).

    Raises:
        ValueError: a count is not a whole number, ``rounds`` or ``iters`` is below 1, ``warmup`` below 0 (below 1
            with blocks), ``blocks`` below 1 or above ``iters`` (or not 1 with ``pipelined``), or no system.
    """
    _check_counts(rounds, iters, warmup, blocks, systems, pipelined)
    names = list(systems)
    settings = {"rounds": rounds, "iters": iters, "warmup": warmup, "device": str(device),
                "method": method_of(blocks, pipelined)}
    if blocks > 1:
        settings["blocks"] = blocks
    results = {name: Measurement(name, settings=dict(settings)) for name in names}
    for r in range(rounds):
        shift = r % len(names)
        order = [n for n in names[shift:] + names[:shift] if results[n].error is None]
        if blocks > 1:
            measured = _blocked_round(systems, order, r=r, iters=iters, warmup=warmup, blocks=blocks, device=device,
                                      timer=timer, on_run=on_run) if order else {}
        else:
            measured = {}
            for name in order:
                if on_run is not None:
                    on_run(r, name)
                measured[name] = _run_alone(systems[name], iters=iters, warmup=warmup, device=device, timer=timer,
                                            pipelined=pipelined)
        for name, got in measured.items():
            _record_round(results[name], got)
    reset_memory(device)  # let the last system's memory go before the caller goes on
    for m in results.values():
        m.memory_kind = memory_kind(device) if m.peak_mb is not None else "n/a"
    return results


METHODS = ("pipelined", "alternating", "alone")
"""How :func:`interleaved` times a round: ``pipelined=True``, ``blocks > 1``, or neither."""


def method_of(blocks: int, pipelined: bool = False) -> str:
    """The name in :data:`METHODS` of the method :func:`interleaved` runs with these arguments."""
    return "pipelined" if pipelined else "alternating" if blocks > 1 else "alone"


def choose_method(device: torch.device, compiled: bool) -> tuple[str, str]:
    """The method that times a step as a training loop sees it, and why: (a name in :data:`METHODS`, the reason)."""
    if device.type != "cuda":
        return "alone", ("off CUDA the wall clock times each step, and a system alone in memory has a resident-set "
                         "growth of its own")
    if compiled:
        return "pipelined", ("compiled: a step started on an idle GPU adds in series the host time before its first "
                             "kernel runs (guards, graph launch), which a training loop hides behind the step before; "
                             "back-to-back steps time the steady state")
    return "alternating", ("eager on CUDA: where the host bounds the step its speed drifts within a second, and "
                           "alternating the systems step by step moves them alike")


def describe_method(method: str, *, iters: int, blocks: int = 1) -> str:
    """A sentence saying how a round times its systems under ``method`` (a name in :data:`METHODS`).

    Raises:
        ValueError: ``method`` is not in :data:`METHODS`.
    """
    if method == "pipelined":
        return ("pipelined: each round runs the systems one after the other, each alone in memory, in an order rotated "
                f"by the round, and times its {iters} steps back to back with one synchronisation at the end (CUDA "
                f"events around the block on CUDA); a round's figure is the block's time / {iters}")
    if method == "alternating":
        steps = "step by step" if blocks == iters else f"in {blocks} blocks"
        return (f"alternating: each round builds the systems side by side and alternates their timed steps {steps}; "
                "a round's figure is the median of its timed steps")
    if method == "alone":
        return ("alone: each round runs the systems one after the other, each alone in memory, in an order rotated by "
                "the round; a round's figure is the median of its timed steps")
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")


def paired_ratio(a, b) -> tuple[float, float, float]:
    """(median, min, max) of ``a.rounds_ms[i] / b.rounds_ms[i]``, two measurements of one :func:`interleaved` call.

    Raises:
        ValueError: either has no rounds, or their round counts differ.
    """
    if not a.rounds_ms or len(a.rounds_ms) != len(b.rounds_ms):
        raise ValueError(f"paired_ratio needs the same, non-zero number of rounds; got {len(a.rounds_ms)} and {len(b.rounds_ms)}")
    ratios = [x / y for x, y in zip(a.rounds_ms, b.rounds_ms)]
    return statistics.median(ratios), min(ratios), max(ratios)


def format_time(m) -> str:
    """"10.71 ms [10.5-11.0]" (median over rounds [min-max]), with NOISY_MARK appended when noisy; "-" if unmeasured."""
    if m.median_ms is None:
        return "-"
    d = 1 if m.min_ms >= 10 else 2 if m.min_ms >= 1 else 3
    return f"{m.median_ms:.2f} ms [{m.min_ms:.{d}f}-{m.max_ms:.{d}f}]" + (NOISY_MARK if m.noisy else "")


def format_ratio(ratio: tuple[float, float, float]) -> str:
    """"0.980x [0.950-1.010]" from a :func:`paired_ratio` result."""
    median, low, high = ratio
    return f"{median:.3f}x [{low:.3f}-{high:.3f}]"


def format_memory(m) -> str:
    """"45 MB RSS", "1234 MB" or "n/a", from ``peak_mb`` and ``memory_kind``."""
    return f"{m.peak_mb:.0f} {m.memory_kind}" if m.peak_mb is not None and m.memory_kind != "n/a" else "n/a"


def noisy_legend(measurements: Iterable) -> str:
    """The legend line for NOISY_MARK if any of ``measurements`` is noisy, else ""."""
    if not any(getattr(m, "noisy", False) for m in measurements):
        return ""
    return (f"{NOISY_MARK.strip()} = noisy: the round medians spread over more than {NOISY_SPREAD:.0%} of their median "
            "((max-min)/median); treat with care, or rerun with more rounds or timed steps")
