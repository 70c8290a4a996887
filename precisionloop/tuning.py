"""Choose a precision by timing candidate Trainers on the user's own model and batch."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from . import fp8, measure
from .policy import PrecisionPolicy, resolve_device
from .precisions import default_precisions, get_policy

__all__ = ["Candidate", "CandidateResult", "AutotuneResult", "default_candidates", "tune", "optimizer_like"]

_OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try: a precision spec, a channels_last choice and a compile choice."""

    precision: str
    channels_last: bool | None = None
    compile: bool | str = False

    def __post_init__(self) -> None:
        get_policy(self.precision)  # a misspelt precision fails here, not in every trial

    def policy(self, device: torch.device) -> PrecisionPolicy:
        return dataclasses.replace(get_policy(self.precision, device), channels_last=self.channels_last)

    @property
    def label(self) -> str:
        layout = {None: "", True: " +channels_last", False: " NCHW"}[self.channels_last]
        compiled = f" +compile({'auto' if self.compile is True else self.compile})" if self.compile else ""
        return f"{self.precision}{layout}{compiled}"


@dataclasses.dataclass
class CandidateResult:
    """One candidate's measurement and outcome."""

    candidate: Candidate
    timing: measure.Measurement
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
        lines = [f"{'candidate':<{width}}  {'median ms [min-max] over rounds':>32}  {'peak mem':>8}  {'skipped':>7}  "
                 f"{'loss drift':>10}  outcome"]
        for r in sorted(self.results, key=lambda r: (r.rejected is not None, r.timing.median_ms or math.inf)):
            drift = "-" if r.drift is None else f"{r.drift:.2e}"
            outcome = "CHOSEN" if r.candidate == self.best else f"rejected: {r.rejected}" if r.rejected else "ok"
            lines.append(f"{r.candidate.label:<{width}}  {measure.format_time(r.timing):>32}  "
                         f"{measure.format_memory(r.timing):>8}  {r.skipped:>7}  {drift:>10}  {outcome}")
        lines.append(f"(loss drift: the largest gap to the strict-fp32 loss over the same steps, over the first loss; "
                     f"limit {self.tolerance:g})")
        legend = measure.noisy_legend(r.timing for r in self.results)
        return "\n".join(lines + ([legend] if legend else []))


def default_candidates(model: nn.Module, device: str | torch.device | None = None, *,
                       compile: bool = False) -> list[Candidate]:
    """:func:`~precisionloop.precisions.default_precisions`, both layouts for conv models, compiled too if asked;
    with ``compile``, ``FP8Policy()`` compiled where fp8 runs (eager, torchao's casts make it slower than bf16)."""
    device = resolve_device(device)
    precisions = default_precisions(device.type)
    layouts = [True, False] if any(isinstance(m, nn.Conv2d) for m in model.modules()) else [None]
    compiles = [False, True] if compile else [False]
    candidates = [Candidate(p, layout, c) for p in precisions for layout in layouts for c in compiles]
    if compile:
        with contextlib.suppress(ValueError):  # no torchao, or no fp8 matmuls on this device
            fp8.require_torchao()
            fp8.check_device(device, emulate=False)
            candidates.append(Candidate("fp8", compile=True))
    return candidates


def tune(trainer_cls: type, model: nn.Module, make_optimizer: _OptimizerFactory, sample_batch: Any, *,
         candidates: Sequence[Candidate] | None = None, compile: bool = False, steps: int = 10, warmup: int = 3,
         rounds: int = 3, tolerance: float = 0.05, **trainer_options: Any) -> AutotuneResult:
    """Train copies of ``model`` for a few steps under each candidate and pick the fastest sound one.

    Each candidate is ``trainer_cls(copy of model, make_optimizer(its parameters), policy, compile=...,
    **trainer_options)`` stepping ``sample_batch`` in ``rounds`` interleaved rounds, a fresh copy each. It is
    rejected if it fails or skips a step, or if its loss in the first round strays from strict fp32's by more than
    ``tolerance`` times the first loss. Within each other's spread the simpler one wins (eager, then the default
    layout). ``model`` and the RNG are left as they were.

    Args:
        candidates: what to try; :func:`default_candidates` (``compile`` passed on) when None.
        steps: timed steps per round, compared by their loss (``warmup`` steps too).
        trainer_options: further ``trainer_cls`` arguments (``device``, ``loss_fn``, ...); trials run in one process.

    Raises:
        RuntimeError: every candidate was rejected.
    """
    device = resolve_device(trainer_options.get("device"))
    candidates = list(candidates) if candidates is not None else default_candidates(model, device, compile=compile)
    reference = Candidate(default_precisions(device.type)[0], channels_last=False)
    options = {**trainer_options, "device": device, "distributed": None}
    trials = {c: _trial(trainer_cls, c, model, make_optimizer, sample_batch, options)
              for c in dict.fromkeys([reference, *candidates])}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # trials reseed
        timed = measure.interleaved({c.label: build for c, (build, _) in trials.items()}, rounds=rounds, iters=steps,
                                    warmup=warmup, device=device)
    results = [_judge(c, seen, timed[c.label], trials[reference][1]["losses"], tolerance)
               for c, (_, seen) in trials.items() if c in candidates]
    accepted = [r for r in results if r.rejected is None]
    if not accepted:
        drift = all(r.rejected.startswith("loss drift") for r in results)
        raise RuntimeError(f"autotune: every candidate was rejected{': raise tolerance?' if drift else ''}\n"
                           + "\n".join(f"  {r.candidate.label}: {r.rejected}" for r in results))
    fast = min(accepted, key=lambda r: r.timing.median_ms).timing
    tied = [r for r in accepted if r.timing.min_ms <= fast.max_ms and fast.min_ms <= r.timing.max_ms]
    best = min(tied, key=lambda r: (_complexity(r.candidate, model, device), r.timing.median_ms)).candidate
    return AutotuneResult(best, best.policy(device), results, tolerance)


def _trial(trainer_cls: type, candidate: Candidate, model: nn.Module, make_optimizer: _OptimizerFactory, batch: Any,
           options: dict) -> tuple[Callable[[], measure.Run], dict]:
    """A factory of fresh Trainers for :func:`measure.interleaved`, and what they saw: first-round losses, max skips."""
    seen = {"losses": None, "skipped": 0}

    def build() -> measure.Run:
        torch.manual_seed(0)  # the same dropout masks for every candidate and round
        copied = copy.deepcopy(model)
        trainer = trainer_cls(copied, make_optimizer(copied.parameters()), candidate.policy(options["device"]),
                              compile=candidate.compile, **options)
        on_device, results = trainer.to_device(batch), []

        def teardown() -> None:
            seen["skipped"] = max(seen["skipped"], trainer.stats.skipped)
            seen["losses"] = seen["losses"] or [r.loss for r in results]

        return measure.Run(lambda: results.append(trainer.step(on_device)), teardown=teardown)

    return build, seen


def _judge(candidate: Candidate, seen: dict, timing: measure.Measurement, reference: list[float] | None,
           tolerance: float) -> CandidateResult:
    """A candidate's outcome against the strict-fp32 losses."""
    result = CandidateResult(candidate, timing, skipped=seen["skipped"])
    if timing.error is not None:
        result.rejected = timing.error.splitlines()[0][:100]
    elif reference is None:
        result.rejected = "the strict-fp32 reference failed, so the loss cannot be compared"
    else:
        # Relative to the first loss: a ratio to the current loss blows up as training drives it to 0.
        result.drift = max(abs(a - b) for a, b in zip(seen["losses"], reference)) / max(abs(reference[0]), 1e-8)
        if result.skipped:
            result.rejected = f"skipped {result.skipped} of {len(seen['losses'])} steps"
        elif not math.isfinite(result.drift) or result.drift > tolerance:
            result.rejected = f"loss drift {result.drift:.2e} > {tolerance:g}"
    return result


def _complexity(candidate: Candidate, model: nn.Module, device: torch.device) -> tuple[int, int]:
    """(compiled, not the policy's default layout): the tie rule prefers the smaller."""
    # channels_last=None picks channels_last for conv models on CUDA only; for other models the layout is moot.
    off_default = candidate.channels_last not in (None, device.type == "cuda")
    return int(bool(candidate.compile)), int(off_default and any(isinstance(m, nn.Conv2d) for m in model.modules()))


def optimizer_like(optimizer: torch.optim.Optimizer, model: nn.Module) -> _OptimizerFactory:
    """A factory of fresh optimizers of ``optimizer``'s class and per-group settings for a copy of ``model``, whose
    parameters are matched to the groups by their position in ``model.parameters()``."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    groups = [({k: v for k, v in g.items() if k != "params"}, [position[id(p)] for p in g["params"]])
              for g in optimizer.param_groups]
    # Constructor arguments too (a custom optimizer may require lr), but only those it accepts:
    # torch 2.14's AdamW keeps decoupled_weight_decay in its defaults yet refuses it as an argument.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        return type(optimizer)([{**settings, "params": [params[i] for i in indices]} for settings, indices in groups],
                               **defaults)

    return build
