"""Choose which ``nn.Linear`` layers to train in fp8 by timing each at the shape it really sees.

Large matmuls gain from fp8, small ones lose to the cost of casting and scaling. torchao is
imported only when fp8 is used.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from . import checkpoint, fp8, measure
from .fp8 import eligible

__all__ = ["LinearShape", "LayerTiming", "Fp8Choice", "linear_shapes", "eligible", "time_linear", "choose_fp8_layers"]

log = logging.getLogger(__name__)


class LinearShape(NamedTuple):
    """What one Linear saw on the sample batch: per call, its input's rows; the first input's dtype under autocast."""

    token_counts: tuple[int, ...]
    in_features: int
    out_features: int
    dtype: torch.dtype
    bias: bool

    @property
    def tokens(self) -> int:
        """The largest token count of any call: the shape the layer is timed at."""
        return max(self.token_counts)

    @property
    def calls(self) -> int:
        return len(self.token_counts)

    @property
    def timing_key(self) -> tuple:
        """Layers with equal keys run the same matmuls, so one timing serves them all."""
        return self.tokens, self.in_features, self.out_features, self.dtype, self.bias

    def __str__(self) -> str:
        calls = f" (x{self.calls} calls)" if self.calls > 1 else ""
        return f"{self.tokens} x {self.in_features} -> {self.out_features}{calls}"


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where ``device`` has autocast, as the rest of the model will run."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def linear_shapes(model: nn.Module, sample_batch: Any, run: Callable[[nn.Module, Any], Any]) -> dict[str, LinearShape]:
    """Run ``run(model, sample_batch)`` once (e.g. ``lambda m, b: m(b[0])``) and record each nn.Linear's input shape.

    The forward runs under ``torch.no_grad()`` and bf16 autocast, as training under an fp8 policy
    would; buffers (BatchNorm statistics) and the RNG are restored afterwards. Returns qualified
    name -> :class:`LinearShape` in the order of first call (a root Linear is named ""); layers
    never called are absent.
    """
    seen: dict[str, list] = {}

    def hook_for(name: str):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and x.dim() >= 1:
                entry = seen.setdefault(name, [[], module.in_features, module.out_features, x.dtype,
                                               module.bias is not None])
                entry[0].append(x.numel() // max(x.shape[-1], 1))
        return hook

    device = _model_device(model)
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    handles = [m.register_forward_hook(hook_for(name), with_kwargs=True)
               for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    rng = checkpoint.rng_state()  # run may draw from torch's, Python's or numpy's generators (dropout, say)
    try:
        with torch.no_grad(), _autocast(device):
            run(model, sample_batch)
    finally:
        checkpoint.set_rng_state(rng)
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
    return {name: LinearShape(tuple(counts), *rest) for name, (counts, *rest) in seen.items()}


def _check_counts(**counts: tuple[object, int]) -> None:
    """Refuse counts that are not integers at or above their minimum (``name=(value, minimum)``)."""
    bad = measure.count_errors(**counts)
    if bad:
        wanted = ", ".join(f"{name} >= {low}" for name, (_, low) in counts.items())
        raise ValueError(f"need integers {wanted}; got {', '.join(bad)}")


def _layer_factory(source: nn.Linear, tokens: int, dtype: torch.dtype, device: torch.device,
                   convert: Callable[[nn.Module], nn.Module], context: Callable[[], contextlib.AbstractContextManager],
                   graphed: bool = False):
    """A factory for measure.interleaved: a fresh converted copy of ``source`` per round, stepping fwd + bwd."""
    def build() -> measure.Run:
        layer = convert(copy.deepcopy(source))
        # A private generator: the same inputs in every round and system, and the caller's RNG untouched.
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, source.in_features, device=device, dtype=dtype, generator=gen).requires_grad_()
        grad = []

        def step() -> None:
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten now
            y = layer(x)
            if not grad:  # a random output gradient, as a loss would give
                grad.append(torch.randn(y.shape, device=device, dtype=y.dtype, generator=gen))
            y.backward(grad[0])
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return measure.Run(step, context=context())
    return build


def time_linear(linear: nn.Linear, tokens: int, device: str | torch.device, *, recipe: str = "tensorwise",
                emulate: bool | None = None, iters: int = 20, warmup: int = 5, rounds: int = 3,
                compile: bool | None = None, dtype: torch.dtype | None = None,
                timer: Callable[[], float] | None = None) -> tuple[measure.Measurement, measure.Measurement]:
    """Time one Linear's forward + backward at ``tokens`` rows, in bf16 and in fp8: (bf16, fp8) measurements.

    Each round steps fresh copies of ``linear`` (which is not touched), one converted with
    ``convert_to_float8_training``, under bf16 autocast on random inputs and output gradients;
    a failing system has ``error`` set.

    Args:
        recipe: the torchao recipe: "tensorwise", "rowwise", ...
        emulate: emulated fp8 matmuls; None: off CUDA only.
        compile: ``torch.compile`` both copies, as torchao's casts are only fast fused (on CUDA as CUDA
            graphs, with at least 3 warm-up steps); None: on CUDA only.
        dtype: the input dtype the layer sees; its weight's if None.

    Raises:
        ValueError: ``linear`` is not an ``nn.Linear``, bad ``tokens`` or counts, torchao is missing, or
            the recipe is unknown.
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"time_linear times an nn.Linear, got a {type(linear).__name__}")
    _check_counts(tokens=(tokens, 1), rounds=(rounds, 1), iters=(iters, 1), warmup=(warmup, 0))
    device, emulate = _device_and_emulate(device, emulate)
    compile = device.type == "cuda" if compile is None else compile
    config = fp8.config(recipe, emulate)
    convert_fp8 = fp8.require_torchao().convert_to_float8_training
    source = copy.deepcopy(linear).to(device)
    dtype = dtype or source.weight.dtype
    # Alone, one layer's step is a few kernels whose launches would outweigh the matmuls; in the
    # compiled model they sit among the model's other kernels. CUDA graphs time what the GPU does.
    graphed = compile and device.type == "cuda"
    if graphed:
        warmup = max(warmup, 3)  # CUDA-graph trees: a warm-up run, then a recording, then replays worth timing

    def compiled(layer: nn.Module) -> nn.Module:
        # dynamic=False: one static graph per shape, not a dynamic one a second shape would force on later layers.
        return torch.compile(layer, dynamic=False, mode="reduce-overhead" if graphed else None) if compile else layer

    def context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(_autocast(device))
        if compile:  # every distinct shape is a recompile; past the default limit dynamo falls back to eager
            limit = max(torch._dynamo.config.recompile_limit, 256)
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
        return stack

    systems = {"bf16": _layer_factory(source, tokens, dtype, device, compiled, context, graphed),
               "fp8": _layer_factory(source, tokens, dtype, device, lambda m: compiled(convert_fp8(m, config=config)),
                                     context, graphed)}
    results = measure.interleaved(systems, rounds=rounds, iters=iters, warmup=warmup, device=device, timer=timer)
    for m in results.values():
        m.settings.update(recipe=recipe, emulate=emulate, compile=compile, cuda_graphs=graphed, tokens=tokens)
    return results["bf16"], results["fp8"]


def _device_and_emulate(device: str | torch.device, emulate: bool | None) -> tuple[torch.device, bool]:
    """The device, and whether fp8 is emulated there: None means off CUDA only."""
    device = torch.device(device)
    return device, device.type != "cuda" if emulate is None else emulate


@dataclasses.dataclass
class LayerTiming:
    """One Linear's row of the table: its shape, both timings, and the verdict."""

    name: str
    shape: LinearShape | None
    bf16: measure.Measurement | None = None
    fp8: measure.Measurement | None = None
    chosen: bool = False
    verdict: str = ""
    same_as: str | None = None

    @property
    def ratio(self) -> tuple[float, float, float] | None:
        """fp8 / bf16 time, (median, min, max) over rounds paired in time; None without both timings."""
        try:
            return measure.paired_ratio(self.fp8, self.bf16) if self.bf16 is not None and self.fp8 is not None else None
        except ValueError:  # one side failed or lost rounds
            return None

    @property
    def saved_ms(self) -> float:
        """Median time saved per training step (all calls of the layer) if chosen, else 0."""
        return (self.bf16.median_ms - self.fp8.median_ms) * self.shape.calls if self.chosen else 0.0


def _display_name(name: str) -> str:
    return name or "<root>"


@dataclasses.dataclass
class Fp8Choice:
    """The layers to convert to fp8, and the table they were chosen from."""

    layers: tuple[str, ...]
    table: list[LayerTiming]
    recipe: str
    emulate: bool = False

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """For ``convert_to_float8_training(model, module_filter_fn=choice.module_filter_fn)``, on the same model."""
        return fqn in self.layers

    @property
    def saved_ms(self) -> float:
        return sum(t.saved_ms for t in self.table)

    def __str__(self) -> str:
        rows = [("layer", "shape (tokens x in -> out)", "bf16 ms [min-max]", "fp8 ms [min-max]", "fp8/bf16", "verdict")]
        for t in self.table:
            ms = [measure.format_time(m) if m is not None and m.rounds_ms else "-" for m in (t.bf16, t.fp8)]
            ratio = measure.format_ratio(t.ratio) if t.ratio else "-"
            same = f" (same shape as {_display_name(t.same_as)})" if t.same_as is not None else ""
            rows.append((_display_name(t.name), str(t.shape) if t.shape else "-", *ms, ratio, t.verdict + same))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        mode = "emulated fp8: these times say nothing about fp8 speed on a GPU" if self.emulate else "real fp8"
        lines.append(f"fp8 ({self.recipe}, {mode}) for {len(self.layers)} of {len(self.table)} Linear layers; "
                     f"summed per-layer time saved: {self.saved_ms:.3f} ms per step (forward + backward, medians)")
        legend = measure.noisy_legend(m for t in self.table for m in (t.bf16, t.fp8) if m is not None)
        return "\n".join(lines + ([legend] if legend else []))


def _verdict(bf16: measure.Measurement, fp8: measure.Measurement, margin: float) -> tuple[bool, str]:
    """(chosen, verdict): fp8 wins only when its slowest round beats bf16's fastest, by ``margin`` more."""
    for label, m in (("bf16", bf16), ("fp8", fp8)):
        if m.error is not None:
            return False, f"skipped: {label} failed: {m.error.splitlines()[0][:100]}"
        if not m.rounds_ms:
            return False, f"skipped: {label} has no rounds"
    if fp8.max_ms < bf16.min_ms * (1 - margin):
        return True, "fp8"
    if fp8.median_ms >= bf16.median_ms:
        return False, "bf16: fp8 is not faster"
    extra = f" and the {margin:.0%} margin" if margin else ""
    return False, f"bf16: not faster beyond the spread{extra}"


def choose_fp8_layers(model: nn.Module, sample_batch: Any, run: Callable[[nn.Module, Any], Any],
                      device: str | torch.device, *, recipe: str = "tensorwise", emulate: bool | None = None,
                      iters: int = 20, warmup: int = 5, rounds: int = 3, margin: float = 0.0,
                      compile: bool | None = None, skip: Mapping[str, str] | None = None,
                      verbose: bool = False) -> Fp8Choice:
    """Time every Linear of ``model`` at its real shape in bf16 and fp8 and choose those fp8 clearly speeds up.

    A layer is chosen when ``fp8.max_ms < bf16.min_ms * (1 - margin)``: separated beyond the
    measured spread. Layers of one shape, dtype and bias are timed once. Layers not called on
    ``sample_batch`` (run as :func:`linear_shapes` runs it), that fp8 cannot run (:func:`eligible`)
    or named in ``skip`` (name -> the reason to show) are listed as skipped. ``model`` is not
    changed. The other settings are :func:`time_linear`'s.

    Raises:
        ValueError: torchao is missing, the recipe is unknown, or bad counts or margin.
    """
    device, emulate = _device_and_emulate(device, emulate)
    _check_counts(rounds=(rounds, 1), iters=(iters, 1), warmup=(warmup, 0))
    if not 0 <= margin < 1:
        raise ValueError(f"need 0 <= margin < 1; got {margin!r}")
    fp8.config(recipe, emulate)  # fail before the capture, not after it
    shapes = linear_shapes(model, sample_batch, run)
    timing = dict(recipe=recipe, emulate=emulate, iters=iters, warmup=warmup, rounds=rounds, compile=compile)
    timed: dict[tuple, LayerTiming] = {}
    skip = dict(skip or {})
    table = [LayerTiming(name, shapes.get(name), verdict=f"skipped: {skip[name]}") if name in skip else
             _time_layer(name, module, shapes.get(name), device, timing, timed, margin)
             for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    choice = Fp8Choice(tuple(t.name for t in table if t.chosen), table, recipe, emulate)
    log.info("fp8 chosen for %d of %d Linear layers", len(choice.layers), len(table))
    if verbose:
        print(choice)
    return choice


def _time_layer(name: str, module: nn.Linear, shape: LinearShape | None, device: torch.device, timing: dict,
                timed: dict[tuple, LayerTiming], margin: float) -> LayerTiming:
    """One layer's row: skipped, reused from an identical layer timed before, or timed now."""
    if shape is None:
        return LayerTiming(name, None, verdict="skipped: not called on the sample batch")
    reason = eligible(name, module, shape.token_counts)
    if reason is not None:
        return LayerTiming(name, shape, verdict=f"skipped: {reason}")
    key = shape.timing_key + (module.weight.dtype,)
    first = timed.get(key)
    if first is not None:
        return dataclasses.replace(first, name=name, shape=shape, same_as=first.name)
    bf16, fp8 = time_linear(module, shape.tokens, device, dtype=shape.dtype, **timing)
    chosen, verdict = _verdict(bf16, fp8, margin)
    timed[key] = row = LayerTiming(name, shape, bf16, fp8, chosen, verdict)
    return row
