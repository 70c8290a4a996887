"""What a reduced-precision cast does to a model's gradients: underflow, subnormals, and overflow under a loss scale."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterable

import torch
from torch import nn

from . import _compat

__all__ = ["gradient_underflow", "underflow_summary", "UnderflowReport", "ParameterUnderflow"]


@dataclasses.dataclass(frozen=True)
class ParameterUnderflow:
    """One parameter's share of the report."""

    nonzero: int
    underflow: float


@dataclasses.dataclass(frozen=True)
class UnderflowReport:
    """Fractions are of the nonzero gradient values; see :func:`gradient_underflow`."""

    dtype: torch.dtype
    scale: float
    nonzero: int
    median_abs: float
    underflow: float
    subnormal: float
    underflow_scaled: float
    overflow_scaled: float
    by_parameter: dict[str, ParameterUnderflow]

    def to_dict(self) -> dict:
        """A JSON-ready copy."""
        return {**dataclasses.asdict(self), "dtype": str(self.dtype).replace("torch.", "")}

    def __str__(self) -> str:
        name, finfo = str(self.dtype).replace("torch.", ""), torch.finfo(self.dtype)
        lines = [
            f"gradient underflow in {name} (smallest subnormal {finfo.smallest_normal * finfo.eps:.3g}, "
            f"largest finite {finfo.max:.6g}), loss scale {self.scale:g}",
            f"  nonzero gradient values   {self.nonzero:>12,}",
            f"  median |gradient|         {self.median_abs:>12.3g}",
            f"  become 0 in {name:<9}     {self.underflow:>12.4%}",
            f"  land in subnormals        {self.subnormal:>12.4%}",
            f"  become 0 after x{self.scale:<8g} {self.underflow_scaled:>12.4%}",
            f"  overflow after x{self.scale:<8g} {self.overflow_scaled:>12.4%}",
        ]
        worst = sorted([(n, p) for n, p in self.by_parameter.items() if p.underflow > 0], key=lambda x: -x[1].underflow)
        if not worst:
            return "\n".join([*lines, "  no parameter loses any value to underflow unscaled"])
        width = max(len(n) for n, _ in worst[:10])
        lines.append("  parameters losing the most values to underflow (unscaled):")
        return "\n".join(lines + [f"    {n:<{width}}  {p.underflow:>9.4%} of {p.nonzero:,}" for n, p in worst[:10]])


def gradient_underflow(
    model: nn.Module | Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float16,
    scale: float | torch.Tensor = 65536.0,
) -> UnderflowReport:
    """Count what casting the current gradients to ``dtype`` does, unscaled and times ``scale``.

    A nonzero value underflows when ``grad.to(dtype)`` is exactly 0: the real cast on the gradients' device, not a
    threshold. The counts reach the host in one transfer.

    Args:
        model: a module with ``.grad`` filled, or ``(name, gradient)`` pairs.
        dtype: the precision to test, usually ``torch.float16`` or ``torch.bfloat16``.
        scale: the loss scale to test (a power of two keeps the fp32 product exact).

    Raises:
        ValueError: ``dtype`` is not a floating-point torch dtype of 16 bits or more, ``scale`` is not a
            finite number > 0, or no nonzero gradient exists.

    Example:
        >>> report = gradient_underflow([("w", torch.tensor([1e-9, 1e-3, 0.0]))])
        >>> report.nonzero, report.underflow, report.underflow_scaled
        (2, 0.5, 0.0)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        # fp8 dtypes have no comparison kernels on every device: the cast test would fail half-way
        raise ValueError(f"dtype must be a floating-point torch.dtype of 16 bits or more, such as torch.float16 or "
                         f"torch.bfloat16; got {dtype!r}")
    if isinstance(scale, (bool, str, bytes)) or not (isinstance(scale, (numbers.Real, torch.Tensor))
                                                     and math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    pairs = ((n, p.grad) for n, p in model.named_parameters()) if isinstance(model, nn.Module) else model
    grads = [(n, g) for n, g in pairs if g is not None]
    if not grads:
        raise ValueError("no gradients to analyse: run backward() first")
    tiny, device = torch.finfo(dtype).smallest_normal, grads[0][1].device
    counts, magnitudes = [], []
    for _, grad in grads:
        g = _compat.dense_values(grad).detach().float().reshape(-1)
        nonzero, cast, scaled = g != 0, g.to(dtype), (g * scale).to(dtype)
        counts.append(torch.stack([nonzero.sum(), (nonzero & (cast == 0)).sum(), ((cast != 0) & (cast.abs() < tiny)).sum(),
                                   (nonzero & (scaled == 0)).sum(), (g.isfinite() & scaled.isinf()).sum()]).to(device))
        magnitudes.append(g[nonzero].abs().to(device))
    table = torch.stack(counts).tolist()  # the one transfer
    total = [sum(column) for column in zip(*table)]
    if total[0] == 0:
        raise ValueError("every gradient value is zero: nothing to analyse")
    by_parameter = {name: ParameterUnderflow(int(row[0]), row[1] / row[0] if row[0] else 0.0)
                    for (name, _), row in zip(grads, table)}
    return UnderflowReport(dtype, float(scale), int(total[0]), float(torch.cat(magnitudes).median()),
                           *(t / total[0] for t in total[1:]), by_parameter)


def underflow_summary(model: nn.Module, dtype: torch.dtype, scale: float) -> dict:
    """The headline numbers of :func:`gradient_underflow`, which ``fit(underflow_every=N)`` keeps.

    All-zero or absent gradients give ``nonzero`` 0 and fractions None.
    """
    record = {"dtype": str(dtype).replace("torch.", ""), "scale": float(scale), "nonzero": 0,
              "median_abs": None, "underflow": None, "underflow_scaled": None}
    nonzero = [p.grad.ne(0).any() for p in model.parameters() if p.grad is not None]
    if not nonzero or not bool(torch.stack(nonzero).any()):  # one host sync
        return record
    report = gradient_underflow(model, dtype, scale)
    record.update(nonzero=report.nonzero, median_abs=report.median_abs,
                  underflow=report.underflow, underflow_scaled=report.underflow_scaled)
    return record
