"""Choose a precision by measuring the candidates on the user's own model and batch; and the step timer it uses."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import statistics
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .policy import PrecisionPolicy, _as_device, get_policy

__all__ = ["autotune", "Candidate", "AutotuneResult", "default_candidates", "time_steps"]

log = logging.getLogger(__name__)


def time_steps(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device) -> list[float]:
    """Run ``warmup`` untimed steps, then return ``iters`` per-step times in milliseconds.

    CUDA steps are timed with CUDA events, CPU steps with the wall clock. On CUDA the
    peak-memory counter restarts after the warm-up, so cuDNN's one-off autotuning
    workspace does not count as the step's memory.
    """
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def reset_memory(device: torch.device) -> None:
    """Free cached blocks and restart the peak-memory counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    """Peak allocated CUDA memory in MB; None on the CPU, where torch reports no per-run peak."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try: a precision spec, a channels_last choice and a compile choice."""

    precision: str
    channels_last: bool | None = None
    compile: bool | str = False

    def policy(self, device: torch.device) -> PrecisionPolicy:
        return dataclasses.replace(get_policy(self.precision, device), channels_last=self.channels_last)

    @property
    def label(self) -> str:
        layout = {None: "", True: " +channels_last", False: " NCHW"}[self.channels_last]
        compiled = "" if not self.compile else f" +compile({'auto' if self.compile is True else self.compile})"
        return f"{self.precision}{layout}{compiled}"


@dataclasses.dataclass
class CandidateResult:
    candidate: Candidate
    median_ms: float | None = None
    peak_mb: float | None = None
    skipped: int = 0
    drift: float | None = None
    rejected: str | None = None


@dataclasses.dataclass
class AutotuneResult:
    """The chosen candidate, its policy, and the table the choice was made from."""

    best: Candidate
    policy: PrecisionPolicy
    results: list[CandidateResult]
    tolerance: float

    def __str__(self) -> str:
        width = max(len(r.candidate.label) for r in self.results)
        lines = [f"{'candidate':<{width}}  {'median ms':>9}  {'peak MB':>8}  {'skipped':>7}  {'loss drift':>10}  verdict"]
        for r in sorted(self.results, key=lambda r: (r.rejected is not None, r.median_ms or math.inf)):
            ms = f"{r.median_ms:.2f}" if r.median_ms is not None else "-"
            mb = f"{r.peak_mb:.0f}" if r.peak_mb is not None else "n/a"
            drift = f"{r.drift:.2e}" if r.drift is not None else "-"
            verdict = "CHOSEN" if r.candidate == self.best else (f"rejected: {r.rejected}" if r.rejected else "ok")
            lines.append(f"{r.candidate.label:<{width}}  {ms:>9}  {mb:>8}  {r.skipped:>7}  {drift:>10}  {verdict}")
        lines.append(f"(loss drift: the largest gap to the strict-fp32 loss over the same steps, over the first loss; limit {self.tolerance:g})")
        return "\n".join(lines)


def default_candidates(model: nn.Module, device: str | torch.device | None = None, *, compile: bool = False) -> list[Candidate]:
    """fp32, tf32, bf16 and fp16; with and without channels_last for conv models; compiled too if asked.

    On the CPU, tf32 (the same as fp32 there) and fp16 (very slow there) are left out.
    """
    device = _as_device(device)
    precisions = ["fp32", "tf32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]
    layouts: list[bool | None] = [True, False] if any(isinstance(m, nn.Conv2d) for m in model.modules()) else [None]
    compiles: list[bool | str] = [False, True] if compile else [False]
    return [Candidate(p, layout, c) for p in precisions for layout in layouts for c in compiles]


def autotune(
    model: nn.Module,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    sample_batch: Any,
    candidates: Sequence[Candidate] | None = None,
    *,
    device: str | torch.device | None = None,
    loss_fn: Callable | None = None,
    steps: int = 10,
    warmup: int = 3,
    tolerance: float = 0.05,
    verbose: bool = True,
) -> AutotuneResult:
    """Train a copy of ``model`` for a few steps under each candidate and pick the fastest sound one.

    Each candidate starts from the same weights and runs ``warmup + steps`` optimizer
    steps on ``sample_batch``. A candidate is rejected when it skips a step, when its
    loss differs from the strict-fp32 run's at any step by more than ``tolerance`` times
    the first loss, or when it fails. ``model`` itself is not touched.

    Args:
        model: the model to tune for.
        optimizer_factory: builds a fresh optimizer from parameters, e.g.
            ``lambda params: torch.optim.AdamW(params, lr=1e-3)``.
        sample_batch: one real batch, as ``Trainer.step`` takes it.
        candidates: what to try; :func:`default_candidates` when None.
        device: where to train; CUDA when available.
        loss_fn: as for ``Trainer``.
        steps: timed steps per candidate.
        warmup: untimed steps first (they count towards the loss comparison).
        tolerance: the largest loss gap to strict fp32 accepted, as a fraction of the first loss.
        verbose: print the table the choice was made from.

    Raises:
        RuntimeError: every candidate was rejected.

    Example:
        >>> import torch
        >>> from precisionloop import autotune
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
        >>> result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.1), batch, device="cpu", steps=2, verbose=False)
        >>> result.best.precision in {"fp32", "bf16"}
        True
    """
    from . import checkpoint
    from .trainer import Trainer

    device = _as_device(device)
    if steps < 1 or warmup < 0 or not tolerance > 0:
        raise ValueError(f"need steps >= 1, warmup >= 0 and tolerance > 0; got {steps}, {warmup}, {tolerance}")
    candidates = list(candidates) if candidates is not None else default_candidates(model, device)
    if not candidates:
        raise ValueError("no candidates to try")
    reference = Candidate("fp32", channels_last=False)
    runs = [reference] + [c for c in candidates if c != reference]
    reference_losses: list[float] | None = None
    results = []
    rng = checkpoint.rng_state()  # trials reseed for equal dropout masks; the caller's RNG must not notice
    for candidate in runs:
        result = CandidateResult(candidate)
        try:
            losses, times, skipped, peak = _trial(Trainer, model, optimizer_factory, sample_batch, candidate, device,
                                                  loss_fn, steps, warmup)
            result.median_ms, result.peak_mb, result.skipped = statistics.median(times), peak, skipped
            if reference_losses is None:
                reference_losses = losses
            # Relative to the first loss: a ratio to the current loss blows up as training drives it to 0.
            result.drift = max(abs(a - b) for a, b in zip(losses, reference_losses)) / max(abs(reference_losses[0]), 1e-8)
            if skipped:
                result.rejected = f"skipped {skipped} of {len(losses)} steps"
            elif not math.isfinite(result.drift) or result.drift > tolerance:
                result.rejected = f"loss drift {result.drift:.2e} > {tolerance:g}"
        except Exception as e:  # a candidate that cannot run is rejected, not fatal
            result.rejected = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:80] if str(e).strip() else ''}"
        if candidate in candidates:
            results.append(result)
    checkpoint.set_rng_state(rng)
    accepted = [r for r in results if r.rejected is None]
    if not accepted:
        raise RuntimeError("autotune: every candidate was rejected:\n" + "\n".join(f"  {r.candidate.label}: {r.rejected}" for r in results))
    best = min(accepted, key=lambda r: r.median_ms).candidate
    outcome = AutotuneResult(best, best.policy(device), results, tolerance)
    log.info("autotune chose %s", best.label)
    if verbose:
        print(outcome)
    return outcome


def _trial(trainer_cls, model, optimizer_factory, batch, candidate: Candidate, device, loss_fn, steps, warmup):
    reset_memory(device)
    torch.manual_seed(0)  # the same dropout masks for every candidate
    copy_ = copy.deepcopy(model)
    trainer = trainer_cls(copy_, optimizer_factory(copy_.parameters()), candidate.policy(device), device=device,
                          loss_fn=loss_fn, compile=candidate.compile, distributed=None)
    batch = trainer.to_device(batch)
    results = []
    times = time_steps(lambda: results.append(trainer.step(batch)), iters=steps, warmup=warmup, device=device)
    losses = [r.loss for r in results]
    return losses, times, trainer.stats.skipped, peak_mb(device)
