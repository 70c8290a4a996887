""":func:`autotune`: choose a precision by timing candidates on the user's own model and batch."""

from __future__ import annotations

import copy
import inspect
import dataclasses
import logging
import math
import numbers
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from . import checkpoint, fp8, measure
from . import keep_fp32 as fp32_modules
from .batches import to_device
from .devices import resolve_device
from .engine import StepEngine
from .fp8 import FP8Policy
from .policy import PrecisionPolicy
from .precisions import get_policy
from .prepare import compile_mode, prepare_model

__all__ = ["autotune", "autotune_trainer", "Candidate", "AutotuneResult", "CandidateResult", "default_candidates"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try: a precision spec, a channels_last choice and a compile choice."""

    precision: str
    channels_last: bool | None = None
    compile: bool | str = False
    options: tuple = ()
    """(field, value) pairs set on the policy, e.g. ``(("layers", ("blocks.0.fc1",)),)`` for FP8Policy."""

    def __post_init__(self) -> None:
        # Lists become tuples, to stay hashable; bad settings fail here, not inside autotune's trials.
        options = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in self.options)
        object.__setattr__(self, "options", options)
        policy = get_policy(self.precision)
        known = {f.name for f in dataclasses.fields(policy) if f.init}
        unknown = sorted(k for k, _ in options if k not in known)
        if unknown:
            raise ValueError(f"Candidate({self.precision!r}) options {', '.join(unknown)}: its policy takes "
                             f"{', '.join(sorted(known))}")
        dataclasses.replace(policy, **dict(options))  # the policy checks the values
        compile_mode(self.compile, torch.device("cpu"))  # refuses a mode torch does not know

    def policy(self, device: torch.device) -> PrecisionPolicy:
        return dataclasses.replace(get_policy(self.precision, device), channels_last=self.channels_last, **dict(self.options))

    @property
    def label(self) -> str:
        layout = {None: "", True: " +channels_last", False: " NCHW"}[self.channels_last]
        compiled = "" if not self.compile else f" +compile({'auto' if self.compile is True else self.compile})"
        options = "".join(f" {k}={_option_text(v)}" for k, v in self.options)
        return f"{self.precision}{options}{layout}{compiled}"

    def complexity(self, model: nn.Module, device: torch.device) -> tuple[int, int]:
        """(compiled, not the policy's default layout): the tie rule prefers the smaller."""
        conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
        natural = conv and device.type == "cuda"  # what a policy with channels_last=None picks
        layout = natural if self.channels_last is None else (self.channels_last and conv)
        return int(bool(self.compile)), int(layout != natural)


def _option_text(value: Any) -> str:
    """A setting for a label: a short tuple by its entries, a long one by its length."""
    if not isinstance(value, tuple):
        return str(value)
    if len(value) > 3:
        kind = "names" if all(isinstance(v, str) for v in value) else "entries"
        return f"<{len(value)} {kind}>"  # a count that reads as one: layers=<25 names>, not layers=25
    items = [repr(v) if isinstance(v, str) else getattr(v, "__name__", str(v)) for v in value]
    return "(" + ",".join(items) + ("," if len(items) == 1 else "") + ")"


@dataclasses.dataclass
class CandidateResult:
    """One candidate's measurement and verdict."""

    candidate: Candidate
    timing: measure.Measurement | None = None
    skipped: int = 0
    drift: float | None = None
    rejected: str | None = None
    note: str = ""

    @property
    def median_ms(self) -> float | None:
        return self.timing.median_ms if self.timing is not None else None

    @property
    def peak_mb(self) -> float | None:
        return self.timing.peak_mb if self.timing is not None else None


@dataclasses.dataclass
class AutotuneResult:
    """The chosen candidate, its policy, and the table the choice was made from."""

    best: Candidate
    policy: PrecisionPolicy
    results: list[CandidateResult]
    tolerance: float

    def __str__(self) -> str:
        width = max(len(r.candidate.label) for r in self.results)
        lines = [f"{'candidate':<{width}}  {'median ms [min-max] over rounds':>32}  {'peak mem':>12}  {'skipped':>7}  "
                 f"{'loss drift':>10}  verdict"]
        for r in sorted(self.results, key=lambda r: (r.rejected is not None, r.median_ms or math.inf)):
            ms = measure.format_time(r.timing) if r.timing is not None and r.timing.rounds_ms else "-"
            mem = measure.format_memory(r.timing) if r.timing is not None else "n/a"
            drift = f"{r.drift:.2e}" if r.drift is not None else "-"
            verdict = "CHOSEN" if r.candidate == self.best else (f"rejected: {r.rejected}" if r.rejected else "ok")
            lines.append(f"{r.candidate.label:<{width}}  {ms:>32}  {mem:>12}  {r.skipped:>7}  {drift:>10}  {verdict}{r.note}")
        lines.append(f"(loss drift: the largest gap to the strict-fp32 loss over the same steps, over the first loss; "
                     f"limit {self.tolerance:g})")
        legend = measure.noisy_legend(r.timing for r in self.results if r.timing is not None)
        return "\n".join(lines + ([legend] if legend else []))


def default_candidates(model: nn.Module, device: str | torch.device | None = None, *, compile: bool = False) -> list[Candidate]:
    """fp32, tf32, bf16 and fp16 (tf32 and fp16 only on CUDA), both layouts for conv models, compiled too if asked.

    With ``compile``, where fp8 matmuls exist, a compiled fp8 candidate that :func:`autotune` makes concrete.
    """
    device = resolve_device(device)
    precisions = tunable_precisions(device)
    layouts: list[bool | None] = [True, False] if any(isinstance(m, nn.Conv2d) for m in model.modules()) else [None]
    compiles: list[bool | str] = [False, True] if compile else [False]
    candidates = [Candidate(p, layout, c) for p in precisions for layout in layouts for c in compiles]
    if compile and _fp8_available(device):  # fp8 only compiled: eager, torchao's casts make it slower than bf16
        candidates.append(Candidate("fp8", compile=True))
    return candidates


def _check_autotune_arguments(model: Any, optimizer_factory: Any, sample_batch: Any, steps: Any, warmup: Any,
                              rounds: Any, tolerance: Any) -> None:
    """Refuse what every trial would otherwise fail on alike."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer_factory):
        raise ValueError(f"optimizer_factory must be a callable taking parameters and returning an optimizer, "
                         f"such as lambda p: torch.optim.AdamW(p, lr=1e-3); got {optimizer_factory!r}")
    if sample_batch is None or isinstance(sample_batch, (str, bytes)) or (
            isinstance(sample_batch, (tuple, list, dict)) and not sample_batch):
        raise ValueError(f"sample_batch must be a batch as the Trainer takes it ((inputs, targets), or what your "
                         f"loss_for reads), got {sample_batch!r:.60}")
    bad = measure.count_errors(steps=(steps, 1), warmup=(warmup, 0), rounds=(rounds, 1))
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance > 0:
        bad.append(f"tolerance={tolerance!r}")
    if bad:
        raise ValueError(f"need steps >= 1, warmup >= 0 and rounds >= 1 (ints) and tolerance > 0 (a number); "
                         f"got {', '.join(bad)}")


def tunable_precisions(device: torch.device) -> list[str]:
    """The precisions :func:`default_candidates` tries on ``device`` (fp8 aside): tf32 and fp16 only on CUDA."""
    return ["fp32", "tf32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]


def _fp8_available(device: torch.device) -> bool:
    try:
        fp8.require_torchao()
        fp8.check_device(device, emulate=False)
    except ValueError:
        return False
    return True


def autotune(model: nn.Module, optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
             sample_batch: Any, candidates: Sequence[Candidate] | None = None, *,
             device: str | torch.device | None = None, loss_fn: Callable | None = None,
             loss_for: Callable[[nn.Module], Callable[[Any], torch.Tensor]] | None = None, steps: int = 10,
             warmup: int = 3, rounds: int = 3, tolerance: float = 0.05, verbose: bool = True) -> AutotuneResult:
    """Train copies of ``model`` for a few steps under each candidate and pick the fastest sound one.

    Each candidate is timed in ``rounds`` interleaved rounds, a fresh copy each (:func:`measure.interleaved`), and
    rejected if it skips or fails a step, or if its loss at any step of the first round differs from strict fp32's by
    more than ``tolerance`` times the first loss. Within each other's spread the simpler candidate wins (eager over
    compiled, the default layout over the other). ``model`` itself is not touched.

    Args:
        optimizer_factory: builds a fresh optimizer from parameters, e.g. ``lambda p: torch.optim.AdamW(p)``.
        sample_batch: one real batch, as ``Trainer.step`` takes it.
        candidates: what to try; :func:`default_candidates` when None.
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
        loss_for: instead of ``loss_fn``, ``loss_for(model)`` returns the loss of a batch on that model.
        steps: timed steps per round; they count towards the loss comparison.
        warmup: untimed steps per round, first; they count towards it too.
        verbose: print the table the choice was made from.

    Raises:
        ValueError: bad arguments.
        RuntimeError: every candidate was rejected.

    Example:
        >>> import torch
        >>> from precisionloop import autotune
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
        >>> result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.1), batch, device="cpu", steps=2, rounds=2, verbose=False)
        >>> result.best.precision in {"fp32", "bf16"}
        True
    """
    device = resolve_device(device)
    _check_autotune_arguments(model, optimizer_factory, sample_batch, steps, warmup, rounds, tolerance)
    candidates = _checked_candidates(candidates, model, device)
    loss_fn = loss_fn or nn.functional.cross_entropy
    loss_for = loss_for or (lambda model: lambda batch: loss_fn(model(batch[0]), batch[1]))
    rng = checkpoint.rng_state()  # trials reseed for equal dropout masks; the caller's RNG must not notice
    try:
        candidates, declined = _with_fp8_layers(candidates, model, sample_batch, loss_for, device,
                                                print if verbose else log.info)
        if not candidates:
            raise RuntimeError("autotune: no candidate left to try: " + "; ".join(declined))
        runs, trials, timings = _time_trials(candidates, model, optimizer_factory, sample_batch, device, loss_for,
                                             steps, warmup, rounds)
    finally:
        checkpoint.set_rng_state(rng)
    results = [r for r in _judge(runs, trials, timings, tolerance) if r.candidate in candidates]  # reference if asked
    accepted = [r for r in results if r.rejected is None]
    if not accepted:
        raise RuntimeError(_all_rejected(results, tolerance, steps + warmup))
    best = _choose(accepted, model, device)
    outcome = AutotuneResult(best, best.policy(device), results, tolerance)
    log.info("autotune chose %s", best.label)
    if verbose:
        print(outcome)
    return outcome


def _checked_candidates(candidates: Sequence[Candidate] | None, model: nn.Module, device: torch.device) -> list:
    """The candidates as a list, :func:`default_candidates` for None; refused when empty or not Candidates."""
    candidates = list(candidates) if candidates is not None else default_candidates(model, device)
    if not candidates:
        raise ValueError("no candidates to try")
    wrong = [c for c in candidates if not isinstance(c, Candidate)]
    if wrong:
        raise ValueError(f"candidates must be Candidate objects (precisionloop.Candidate('bf16'), ...), got {wrong[0]!r}")
    return candidates


def _time_trials(candidates, model, optimizer_factory, batch, device, loss_for, steps, warmup, rounds):
    """Strict fp32 (the loss reference) and every candidate, timed in interleaved rounds: (runs, trials, timings)."""
    reference = Candidate("fp32", channels_last=False)
    runs = [reference] + [c for c in candidates if c != reference]
    trials = {c: _Trial(c, model, optimizer_factory, batch, device, loss_for) for c in runs}
    keys = {c: f"{i}: {c.label}" for i, c in enumerate(trials)}  # labels can repeat (fp8 layer counts)
    timed = measure.interleaved({keys[c]: t.build for c, t in trials.items()}, rounds=rounds, iters=steps,
                                warmup=warmup, device=device)
    return runs, trials, {c: timed[keys[c]] for c in trials}


def _with_fp8_layers(candidates: list[Candidate], model: nn.Module, batch: Any, loss_for, device: torch.device,
                     say: Callable[[str], None]) -> tuple[list[Candidate], list[str]]:
    """fp8 candidates without ``layers`` made concrete (see :func:`_distinct_sets`), and why any was declined."""
    out, declined = [], []

    def decline(why: str) -> None:
        declined.append(why)
        say(f"autotune: {why}")

    for c in candidates:
        policy = c.policy(device)
        if not isinstance(policy, FP8Policy) or policy.layers is not None:
            out.append(c)
            continue
        try:
            fp8.check_device(device, policy.emulate)
            default, every = _fp8_layer_sets(policy, model)  # a keep_fp32 pattern that matches nothing raises
        except ValueError:
            out.append(c)  # it will be rejected with that error
            continue
        if not every:
            decline(f"{c.label} declined: no nn.Linear layer fp8 can take (both dimensions multiples of "
                    f"{fp8.ALIGNMENT}, a plain nn.Linear registered under one name, not kept in fp32)")
            continue
        concrete = _distinct_sets(c, default, every, _called_empty(model, batch, loss_for, device, policy))
        if not concrete:
            decline(f"{c.label} declined: every layer fp8 can take is called with no tokens on the sample batch")
        out.extend(concrete)
    return out, declined


def _distinct_sets(c: Candidate, default: tuple[str, ...], every: tuple[str, ...], empty: set[str]) -> list[Candidate]:
    """One candidate per distinct, non-empty layer set: the default layers (``c`` itself if whole), every layer.
    Layers called with no tokens are left out (torchao cannot scale an empty input); both sets are timed in the whole
    model, as which is faster depends on what the compiled model fuses around them."""
    usable_default = tuple(n for n in default if n not in empty)
    options = tuple((k, v) for k, v in c.options if k != "layers")  # an explicit layers=None is replaced
    out, seen = [], []
    for i, layers in enumerate((usable_default, tuple(n for n in every if n not in empty))):
        if layers and set(layers) not in seen:
            seen.append(set(layers))
            as_given = i == 0 and usable_default == default
            out.append(c if as_given else dataclasses.replace(c, options=(*options, ("layers", layers))))
    return out


def _fp8_layer_sets(policy: FP8Policy, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the policy's default layers, every layer fp8 can take that ``keep_fp32`` does not keep)."""
    kept = policy.kept_modules(model)
    every = tuple(n for n in fp8.eligible_layers(model) if not fp32_modules.within(n, kept))
    return tuple(policy.planned_layers(model)), every


def _called_empty(model: nn.Module, batch: Any, loss_for, device: torch.device, policy: FP8Policy) -> set[str]:
    """The ``nn.Linear`` layers that one forward of a copy of ``model``, as a trial's first, calls with no rows; none
    if it fails, as the trials then meet the same error and reject the candidate with it."""
    empty: set[str] = set()

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and x.numel() == 0:
                empty.add(name)
        return hook

    try:
        trial = copy.deepcopy(model).to(device)
        for name, m in trial.named_modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(hook_for(name), with_kwargs=True)
        torch.manual_seed(0)  # as _Trial seeds; the caller restores the RNG
        with torch.no_grad(), policy.autocast(device.type):
            loss_for(trial)(to_device(batch, device, torch.contiguous_format))
    except Exception as e:  # noqa: BLE001 - the trials report it
        log.info("autotune: the fp8 layer scan failed (%s: %s); the fp8 trials will meet it", type(e).__name__, e)
    return empty


class _Trial:
    """A candidate's factory for :func:`measure.interleaved`: a fresh copy per round, losses of the first round kept."""

    def __init__(self, candidate: Candidate, model, optimizer_factory, batch, device: torch.device, loss_for):
        self.candidate, self.model, self.optimizer_factory = candidate, model, optimizer_factory
        self.batch, self.device, self.loss_for = batch, device, loss_for
        self.losses: list[float] | None = None
        self.skipped = 0

    def build(self) -> measure.Run:
        torch.manual_seed(0)  # the same dropout masks for every candidate and round
        policy, mode = self.candidate.policy(self.device), compile_mode(self.candidate.compile, self.device)
        model = copy.deepcopy(self.model).to(self.device)
        optimizer = self.optimizer_factory(model.parameters())
        model, input_format = prepare_model(model, policy, mode, None, self.device, optimizer)
        engine = StepEngine(model, optimizer, self.device, compute_loss=self.loss_for(model), scheduler=None,
                            grad_accum_steps=1, max_grad_norm=None, max_consecutive_skips=2**62, distributed=None)
        engine.configure(model, policy, policy.make_guard(self.device.type), mode)
        batch, results = to_device(self.batch, self.device, input_format), []

        def teardown() -> None:
            engine.sync()
            self.skipped = max(self.skipped, engine.stats.skipped)
            if self.losses is None:
                self.losses = [r.loss for r in results]

        return measure.Run(lambda: results.append(engine.step(batch)), context=policy.backend_flags(), teardown=teardown)


def _judge(runs: list[Candidate], trials: dict, timings: dict, tolerance: float) -> list[CandidateResult]:
    """Each candidate's result against the strict-fp32 reference, ``runs[0]``."""
    reference = trials[runs[0]].losses
    results = []
    for c in runs:
        trial, timing = trials[c], timings[c]
        result = CandidateResult(c, timing, skipped=trial.skipped)
        if timing.error is not None:
            result.rejected = timing.error.splitlines()[0][:100]
        elif reference is None:
            result.rejected = "the strict-fp32 reference failed, so the loss cannot be compared"
        else:
            # Relative to the first loss: a ratio to the current loss blows up as training drives it to 0.
            result.drift = max(abs(a - b) for a, b in zip(trial.losses, reference)) / max(abs(reference[0]), 1e-8)
            if trial.skipped:
                result.rejected = f"skipped {trial.skipped} of {len(trial.losses)} steps"
            elif not math.isfinite(result.drift) or result.drift > tolerance:
                result.rejected = f"loss drift {result.drift:.2e} > {tolerance:g}"
        results.append(result)
    return results


def _all_rejected(results: list[CandidateResult], tolerance: float, steps: int) -> str:
    """Each candidate's reason, and a way out when only the loss drift stopped them."""
    lines = [f"  {r.candidate.label}: {r.rejected}" for r in results]
    if all(r.drift is not None and math.isfinite(r.drift) and r.rejected.startswith("loss drift") for r in results):
        closest = min(r.drift for r in results)
        lines.append(f"every candidate's loss parted from strict fp32's by more than tolerance={tolerance:g} of the "
                     f"first loss (the closest by {closest:.3g}) over {steps} steps on one sample batch. A model "
                     "that memorises its batch fast amplifies any rounding difference that way")
        if closest <= 0.5:  # beyond, the losses differ too much to call it rounding; 20% headroom for a rerun
            magnitude = 10 ** math.floor(math.log10(1.2 * closest))  # the suggestion: rounded up to one digit
            suggested = math.ceil(1.2 * closest / magnitude) * magnitude
            lines[-1] += (f"; if the curves both fall, raise tolerance (e.g. tolerance={suggested:g}) "
                          "or time fewer steps, and pass the chosen policy to the Trainer")
    return "autotune: every candidate was rejected:\n" + "\n".join(lines)


def _choose(accepted: list[CandidateResult], model: nn.Module, device: torch.device) -> Candidate:
    """The fastest by median, unless a simpler candidate's spread overlaps the fastest's: then the simplest such."""
    fastest = min(accepted, key=lambda r: r.median_ms)
    tied = [r for r in accepted if r.timing.min_ms <= fastest.timing.max_ms and fastest.timing.min_ms <= r.timing.max_ms]
    chosen = min(tied, key=lambda r: (r.candidate.complexity(model, device), r.median_ms))
    if chosen is not fastest:
        chosen.note = f" (within the spread of {fastest.candidate.label}, and simpler)"
        fastest.note = f" (faster by median, but within {chosen.candidate.label}'s spread)"
    return chosen.candidate


def autotune_trainer(trainer, batch: Any, compile: bool) -> AutotuneResult:
    """:func:`autotune` for a Trainer waiting to choose: its model, optimizer's settings and loss (a subclass's too)."""
    def loss_for(model: nn.Module) -> Callable[[Any], torch.Tensor]:
        view = copy.copy(trainer)  # the Trainer's compute_loss (an override too) on the trial's model
        view.model = model
        return view.compute_loss

    candidates = default_candidates(trainer.model, trainer.device, compile=compile)
    return autotune(trainer.model, _trial_optimizer(trainer.optimizer, trainer.model), batch, candidates,
                    device=trainer.device, loss_fn=trainer.loss_fn, loss_for=loss_for, verbose=trainer.is_main)


def _trial_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A factory for fresh optimizers like ``optimizer`` over a copy's parameters, per-group settings included."""
    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        twin = {id(p): q for p, q in zip(model.parameters(), params)}  # the copy's parameters, in model order
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [twin[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        # Constructor arguments too (a custom optimizer may require lr), but only those it accepts:
        # torch 2.14's AdamW keeps decoupled_weight_decay in its defaults yet refuses it as an argument.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})
    return build
