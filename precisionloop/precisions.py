"""The one precision table: every precision string, alias and dtype is parsed here, in :func:`get_policy`."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from . import _compat
from .fp8 import FP8Policy
from .policy import (BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy, compute_capability,
                     cuda_bf16_native, resolve_device)

__all__ = ["PRECISIONS", "get_policy", "default_precisions"]

PRECISIONS: dict[str, Callable[[], PrecisionPolicy]] = {
    "fp32": FP32Policy,
    "fp32-strict": lambda: FP32Policy(tf32=False),
    "tf32": lambda: FP32Policy(tf32=True),
    "bf16": BF16Policy,
    "bf16-pure": BF16PurePolicy,
    "fp16": FP16Policy,
    "fp8": FP8Policy,
}
_ALIASES = {
    "float32": "fp32", "32": "fp32", "32-true": "fp32", "full": "fp32", "no": "fp32",
    "bfloat16": "bf16", "bf16-mixed": "bf16", "pure-bf16": "bf16-pure",
    "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16",
    "float8": "fp8", "8": "fp8",
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
}


def default_precisions(device_type: str) -> list[str]:
    """The precisions autotune and the benchmark compare by default, strict fp32 (their reference) first; tf32 and fp16
    only on CUDA (elsewhere TF32 changes nothing and fp16 autocast is about 20x slower), bf16-pure and fp8 if asked."""
    return ["fp32-strict", "tf32", "bf16", "fp16"] if device_type == "cuda" else ["fp32", "bf16"]


def get_policy(spec: str | int | torch.dtype | PrecisionPolicy,
               device: str | torch.device | None = None) -> PrecisionPolicy:
    """Turn a precision spec into a policy.

    Args:
        spec: ``"fp32"`` (TF32 as the process has it), ``"fp32-strict"`` (strict IEEE), ``"tf32"``, ``"bf16"``,
            ``"bf16-pure"`` (bf16 weights, no fp32 master copy), ``"fp16"``, ``"fp8"``, ``"auto"``, an alias
            (``"half"``, Lightning's ``"bf16-mixed"``, ...; case-insensitive), a torch dtype, or a policy instance,
            which is returned unchanged.
        device: the device ``"auto"`` chooses for; the current CUDA device or the CPU when ``None``.

    Raises:
        ValueError: ``spec`` names no known precision.
    """
    if isinstance(spec, PrecisionPolicy):
        return spec
    key = spec.strip().lower() if isinstance(spec, str) else str(spec) if isinstance(spec, int) else spec
    key = _ALIASES.get(key, key)
    if key == "auto":
        return _auto_policy(resolve_device(device))
    if key not in PRECISIONS:
        hint = f"; pass an instance, such as {spec.__name__}()" if isinstance(spec, type) else ""
        raise ValueError(f"unknown precision {spec!r}{hint}; valid: {', '.join([*PRECISIONS, 'auto'])}, the aliases "
                         f"{', '.join(a for a in _ALIASES if isinstance(a, str))}, torch.float32/bfloat16/float16, "
                         "or a PrecisionPolicy instance")
    return PRECISIONS[key]()


def _auto_policy(device: torch.device) -> PrecisionPolicy:
    if device.type == "cuda":
        label = f"{torch.cuda.get_device_name(device)} (compute capability {compute_capability(device)})"
        policy: PrecisionPolicy = (BF16Policy(note=f"auto: {label} has native bf16") if cuda_bf16_native(device)
                                   else FP16Policy(note=f"auto: {label} has no native bf16, so fp16 with loss scaling"))
    elif device.type == "cpu" and _compat.cpu_bf16_native():
        policy = BF16Policy(note="auto: this CPU runs bf16 natively")
    else:
        policy = FP32Policy(tf32=False, note=f"auto: no native reduced precision nor TF32 on {device}, so strict fp32")
    logging.getLogger(__name__).info("precision='auto' chose %s: %s", policy.name, policy.note)
    return policy
