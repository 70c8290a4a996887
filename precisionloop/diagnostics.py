"""What fp16, bf16 or fp8 does to a model's gradients, activations and weights, and the updates it would lose."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from . import _compat

__all__ = ["gradient_underflow", "underflow_summary", "precision_report", "lost_updates", "UnderflowReport",
           "ParameterUnderflow", "PrecisionReport", "LostUpdates", "FORMATS"]

FORMATS = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)  # precision_report's default
_AMAX_FLOOR = 1e-12  # torchao's: an all-zero tensor still gets a finite scale
_NO_INF = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)  # they overflow past their largest value


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Report:
    def to_dict(self) -> dict:
        """A JSON-ready copy, dtypes by name."""
        return {k: _name(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(self).items()}


def _cast_counts(x: torch.Tensor, dtype: torch.dtype, scale: float | str = 1.0) -> torch.Tensor:
    """Of the finite nonzero values of ``x`` (fp32): [count, become 0, land in subnormals, overflow, summed relative
    error of the survivors' round trip], float64 on its device; ``scale``: a factor or torchao's amax scaling."""
    finfo, nonzero = torch.finfo(dtype), (x != 0) & x.isfinite()
    if isinstance(scale, str):
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
        finite = rows.abs().where(rows.isfinite(), 0.0)  # one inf or NaN does not decide every other value's scale
        amax = finite.amax(dim=-1, keepdim=True) if scale == "rowwise" else finite.amax()
        factor = (finfo.max / amax.double().clamp(min=_AMAX_FLOOR)).float()  # float64 first, as torchao does
        if scale == "rowwise":
            factor = torch.exp2(torch.floor(torch.log2(factor)))
        scaled = (rows * factor).clamp(-finfo.max, finfo.max).reshape(x.shape)
    else:
        scaled = x * scale
    cast = scaled.to(dtype).float()  # compared in fp32: fp8 has no comparison kernels everywhere
    zero = nonzero & (cast == 0)
    over = nonzero & (~cast.isfinite() | (scaled.abs() > finfo.max) if dtype in _NO_INF else ~cast.isfinite())
    survive = nonzero & ~zero & ~over
    error = ((cast - scaled).abs() / scaled.abs()).where(survive, 0.0).double().sum()
    subnormal = nonzero & (cast != 0) & (cast.abs() < finfo.smallest_normal)
    return torch.stack([*(mask.sum().double() for mask in (nonzero, zero, subnormal, over)), error])


def _fractions(counts: Sequence[float], suffix: str = "") -> dict[str, float]:
    """``underflow``, ``overflow`` and ``error`` (each name + ``suffix``) from :func:`_cast_counts`'s counts."""
    count, zero, _, over, error = counts  # whole counts: max(n, 1) changes only n = 0, whose share is 0
    return {f"underflow{suffix}": zero / max(count, 1), f"overflow{suffix}": over / max(count, 1),
            f"error{suffix}": error / max(count - zero - over, 1)}


@dataclasses.dataclass(frozen=True)
class ParameterUnderflow:
    """One parameter's share of the report: fractions of its nonzero gradient values, unscaled and scaled."""

    nonzero: int
    underflow: float
    overflow: float = 0.0
    error: float = 0.0
    underflow_scaled: float = 0.0
    overflow_scaled: float = 0.0
    error_scaled: float = 0.0


@dataclasses.dataclass(frozen=True)
class UnderflowReport(_Report):
    """Fractions of the finite nonzero gradient values: ``underflow``, the cast is exactly 0; ``overflow``, it is inf
    (past the largest finite value, for a format without inf such as e4m3); ``error``, the mean relative error of the
    round trip over the values that neither become 0 nor overflow. See :func:`gradient_underflow`."""

    dtype: torch.dtype
    scale: float | str
    nonzero: int
    median_abs: float
    underflow: float
    subnormal: float
    overflow: float
    error: float
    underflow_scaled: float
    overflow_scaled: float
    error_scaled: float
    by_parameter: dict[str, ParameterUnderflow]

    def __str__(self) -> str:
        name, finfo = _name(self.dtype), torch.finfo(self.dtype)
        scaled = f"x {self.scale}" if isinstance(self.scale, str) else f"x {self.scale:g}"
        lines = [f"gradients in {name} (smallest subnormal {finfo.smallest_normal * finfo.eps:.3g}, largest finite "
                 f"{finfo.max:.6g}): {self.nonzero:,} nonzero values, median |gradient| {self.median_abs:.3g}",
                 f"  {'':<22}{'unscaled':>12}{scaled:>14}",
                 f"  {'become 0':<22}{self.underflow:>12.4%}{self.underflow_scaled:>14.4%}",
                 f"  {'overflow':<22}{self.overflow:>12.4%}{self.overflow_scaled:>14.4%}",
                 f"  {'mean relative error':<22}{self.error:>12.3g}{self.error_scaled:>14.3g}",
                 f"  {'land in subnormals':<22}{self.subnormal:>12.4%}"]
        worst = sorted([(n, p) for n, p in self.by_parameter.items() if p.underflow > 0], key=lambda x: -x[1].underflow)
        if not worst:
            return "\n".join([*lines, "  no parameter loses any value to underflow unscaled"])
        width = max(len(n) for n, _ in worst[:10])
        lines.append("  parameters losing the most values to underflow (unscaled):")
        return "\n".join(lines + [f"    {n:<{width}}  {p.underflow:>9.4%} of {p.nonzero:,}" for n, p in worst[:10]])


def _check_format(dtype: Any, scale: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype == torch.float64:
        raise ValueError(f"dtype must be a floating-point torch.dtype narrower than float64, such as torch.float16, "
                         f"torch.bfloat16 or torch.float8_e4m3fn; got {dtype!r}")
    if scale in ("tensorwise", "rowwise"):
        if dtype.itemsize != 1:
            raise ValueError(f"scale={scale!r} is torchao's amax scaling for fp8 formats, not {dtype}")
    elif isinstance(scale, (bool, str, bytes)) or not isinstance(scale, (numbers.Real, torch.Tensor)) \
            or not 0 < float(scale) < math.inf:
        raise ValueError(f"scale must be a finite number > 0, 'tensorwise' or 'rowwise', got {scale!r}")


def gradient_underflow(model: nn.Module | Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float16,
                       scale: float | str | torch.Tensor = 65536.0) -> UnderflowReport:
    """Count what casting the current gradients to ``dtype`` does, unscaled and scaled: the real cast on the
    gradients' device, counted in one transfer to the host.

    Args:
        model: a module with ``.grad`` filled, or ``(name, gradient)`` pairs.
        dtype: the format to test: ``torch.float16``, ``torch.bfloat16``, ``torch.float8_e4m3fn``, ...
        scale: a loss scale (a power of two keeps the fp32 product exact), or ``"tensorwise"``/``"rowwise"``: the
            amax scaling of torchao's float8 recipes (rows along the last dimension; a 1-D tensor is one row).

    Raises:
        ValueError: ``dtype`` is not a floating-point torch dtype narrower than float64, ``scale`` is none of the
            above, or no nonzero gradient exists.
    """
    _check_format(dtype, scale)
    scale = scale if isinstance(scale, str) else float(scale)
    pairs = ((n, p.grad) for n, p in model.named_parameters()) if isinstance(model, nn.Module) else model
    grads = [(n, g) for n, g in pairs if g is not None]
    if not grads:
        raise ValueError("no gradients to analyse: run backward() first")
    device, rows, magnitudes = grads[0][1].device, [], []
    for _, grad in grads:
        g = _compat.dense_values(grad).detach().float()
        rows.append(torch.cat([_cast_counts(g, dtype), _cast_counts(g, dtype, scale)]).to(device))
        magnitudes.append(g[(g != 0) & g.isfinite()].abs().reshape(-1).to(device))
    table = torch.stack(rows).tolist()  # the one transfer
    total = [sum(column) for column in zip(*table)]
    if total[0] == 0:
        raise ValueError("every gradient value is zero: nothing to analyse")
    by_parameter = {name: ParameterUnderflow(int(row[0]), **_fractions(row[:5]), **_fractions(row[5:], "_scaled"))
                    for (name, _), row in zip(grads, table)}
    return UnderflowReport(dtype, scale, int(total[0]), float(torch.cat(magnitudes).median()), **_fractions(total[:5]),
                           subnormal=total[2] / total[0], **_fractions(total[5:], "_scaled"), by_parameter=by_parameter)


def underflow_summary(model: nn.Module, dtype: torch.dtype, scale: float) -> dict:
    """The headline numbers of :func:`gradient_underflow`, which ``fit(underflow_every=N)`` keeps; gradients absent,
    all zero or none finite (a NaN loss) give ``nonzero`` 0 and fractions None."""
    record = {"dtype": _name(dtype), "scale": float(scale), "nonzero": 0,
              "median_abs": None, "underflow": None, "underflow_scaled": None}
    try:
        report = gradient_underflow(model, dtype, scale)
    except ValueError:  # nothing to count: fit's dtype and scale are valid
        return record
    return {**record, **{key: getattr(report, key) for key in record if key not in ("dtype", "scale")}}


@dataclasses.dataclass(frozen=True)
class PrecisionReport(_Report):
    """Per layer, tensor (``input``, ``weight``, ``output grad``) and format: ``underflow``, ``overflow`` and ``error``
    as in :class:`UnderflowReport`."""

    formats: tuple[str, ...]
    rows: list[dict]  # {"layer", "tensor", "nonzero", format: {"underflow", "overflow", "error"}, ...}

    def __str__(self) -> str:
        width = max([5, *(len(r["layer"]) for r in self.rows)])
        head = "".join(f" | {f + ' (0 / inf / err)':<27}" for f in self.formats)
        lines = [f"{'layer':<{width}}  {'tensor':<11} {'nonzero':>11}{head}"]
        for r in self.rows:
            cells = "".join(f" | {r[f]['underflow']:>8.3%} {r[f]['overflow']:>8.3%} {r[f]['error']:>8.2g}"
                            for f in self.formats)
            lines.append(f"{r['layer']:<{width}}  {r['tensor']:<11} {r['nonzero']:>11,}{cells}")
        return "\n".join(lines + ["16-bit formats as cast, fp8 ones with torchao's tensorwise scaling; 0: become 0, "
                                  "inf: overflow, err: mean relative error of the values that survive; values as the "
                                  "Trainer's policy computes them (under autocast, outputs are in its dtype already)"])


def precision_report(trainer: Any, batch: Any, formats: Sequence[torch.dtype] = FORMATS) -> PrecisionReport:
    """What each format would do to every ``nn.Linear`` and convolution's inputs, weights and output gradients in
    one forward and backward of ``batch`` through ``trainer`` under its policy (an fp32 Trainer shows every format
    from fp32), fp8 formats scaled tensorwise as torchao's default recipe does. Nothing changes: weights, optimizer
    state, counters, gradients, buffers, train or eval modes, RNG state.

    Raises:
        ValueError: a compiled or distributed Trainer, or a format not a floating-point torch dtype below float64.
    """
    if trainer.compile_mode is not None or trainer.distributed:
        raise ValueError("precision_report hooks every layer, which needs an eager single-process Trainer: build one "
                         "with compile=False and distributed=None over the same model")
    for dtype in formats:
        _check_format(dtype, 1.0)
    model, counts = trainer.model, {}
    layers = {m: n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))}

    def measure(layer: str, tensor: str, x: torch.Tensor) -> None:
        x = x.detach().float()
        found = torch.stack([_cast_counts(x, f, "tensorwise" if f.itemsize == 1 else 1.0) for f in formats])
        counts[layer, tensor] = counts.get((layer, tensor), 0) + found  # a layer called twice: both calls count

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            measure(layers[module], "input", args[0])
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: measure(layers[module], "output grad", grad))

    modes = {m: m.training for m in model.modules()}
    saved = {b: b.detach().clone() for b in model.buffers()}
    handles = [m.register_forward_hook(hook) for m in layers]
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():  # dropout draws as training would
            model.train()
            with trainer.autocast():
                loss = trainer.compute_loss(*trainer.forward_batch(trainer.to_device(batch)))
            with trainer.policy.backend_flags(trainer.device.type):  # returns the gradients: .grad stays as it was
                torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
        for module, name in layers.items():
            measure(name, "weight", module.weight)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for b, value in saved.items():
                b.copy_(value)
        for module, mode in modes.items():
            module.training = mode
    keys = [(n, t) for n in layers.values() for t in ("input", "weight", "output grad") if (n, t) in counts]
    tables = torch.stack([counts[k] for k in keys]).tolist() if keys else []  # the one transfer
    names = [_name(f) for f in formats]
    rows = [{"layer": n, "tensor": t, "nonzero": int(table[0][0]), **{f: _fractions(c) for f, c in zip(names, table)}}
            for (n, t), table in zip(keys, tables)]
    return PrecisionReport(tuple(names), rows)


@dataclasses.dataclass(frozen=True)
class LostUpdates(_Report):
    """What :func:`lost_updates` found: ``lost``, the fraction of the nonzero updates lost, in total and per parameter
    (``{name: (nonzero, lost)}``); None when no weight moved."""

    dtype: torch.dtype
    nonzero: int
    lost: float | None
    by_parameter: dict[str, tuple[int, float | None]]

    def __str__(self) -> str:
        lost = "no weight moved" if self.lost is None else f"{self.lost:.4%} would be lost"
        lines = [f"updates in {_name(self.dtype)} weights: {self.nonzero:,} nonzero, {lost}"]
        worst = sorted(((n, f) for n, (_, f) in self.by_parameter.items() if f), key=lambda x: -x[1])[:10]
        return "\n".join(lines + [f"    {n}  {f:.4%}" for n, f in worst])


def lost_updates(before: Mapping[str, torch.Tensor], model: nn.Module,
                 dtype: torch.dtype = torch.bfloat16) -> LostUpdates:
    """The share of a step's nonzero updates that weights stored in ``dtype`` would lose: the update added to the
    old weight in ``dtype`` rounds back to it (round to nearest even, the real cast).

    Args:
        before: ``{name: parameter.detach().clone()}`` taken before the step, for the parameters to count.
        model: the model after the step, fp32 weights (a ``"bf16-pure"`` model has lost its updates already).
        dtype: the storage format to test.
    """
    _check_format(dtype, 1.0)
    names, rows = [], []
    for name, p in model.named_parameters():
        if name in before:
            old = _compat.dense_values(before[name].detach()).to(p.device).float()  # under FSDP2, this rank's shard
            stored = old.to(dtype).float()
            update = _compat.dense_values(p.detach()).float() - old
            moved = (update != 0) & update.isfinite()
            lost = moved & ((stored + update).to(dtype).float() == stored)
            names.append(name)
            rows.append(torch.stack([moved.sum(), lost.sum()]).to(rows[0].device if rows else p.device))
    table = torch.stack(rows).tolist() if rows else []
    total = [sum(column) for column in zip(*table)] or [0, 0]
    return LostUpdates(dtype, int(total[0]), total[1] / total[0] if total[0] else None,
                       {n: (int(m), lost / m if m else None) for n, (m, lost) in zip(names, table)})
