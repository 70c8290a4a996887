"""The one precision table: every precision string, alias and dtype is parsed here, in :func:`get_policy`."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from . import _compat
from .devices import cuda_bf16_native, parse_device, resolve_device
from .fp8 import FP8Policy
from .policy import BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy

__all__ = ["PRECISIONS", "get_policy", "is_auto"]

log = logging.getLogger(__name__)

PRECISIONS: dict[str, Callable[[], PrecisionPolicy]] = {
    "fp32": lambda: FP32Policy(tf32=False),
    "tf32": lambda: FP32Policy(tf32=True),
    "bf16": BF16Policy,
    "bf16-pure": BF16PurePolicy,
    "fp16": FP16Policy,
    "fp8": FP8Policy,
}
_ALIASES = {
    "float32": "fp32", "32": "fp32", "32-true": "fp32", "full": "fp32",
    "bfloat16": "bf16", "bf16-mixed": "bf16",
    "pure-bf16": "bf16-pure",
    "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16",
    "float8": "fp8", "8": "fp8",
}
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def get_policy(spec: str | int | torch.dtype | PrecisionPolicy, device: str | torch.device | None = None) -> PrecisionPolicy:
    """Turn a precision spec into a policy.

    Args:
        spec: ``"fp32"`` (strict, TF32 off), ``"tf32"``, ``"bf16"``, ``"bf16-pure"`` (bf16 weights, no fp32 master
            copy), ``"fp16"``, ``"fp8"``, ``"auto"``, an alias (``"half"``, Lightning's ``"bf16-mixed"``, ...;
            case-insensitive), a torch dtype, or a policy instance, which is returned unchanged.
        device: the device that ``"auto"`` chooses for; the current CUDA device or the CPU when ``None``.

    Raises:
        ValueError: ``spec`` names no known precision, or ``device`` no device.

    Example:
        >>> from precisionloop import get_policy
        >>> get_policy("BFloat16").name
        'bf16'
    """
    if device is not None:
        parse_device(device)  # a bad device is an error whatever the spec, not only for "auto"
    if isinstance(spec, PrecisionPolicy):
        return spec
    if isinstance(spec, type) and issubclass(spec, PrecisionPolicy):
        raise ValueError(f"precision is the class {spec.__name__}; pass an instance, such as {spec.__name__}()")
    key = _normalise(spec)
    if key == "auto":
        return _auto_policy(resolve_device(device))
    return PRECISIONS[key]()


def is_auto(spec: object) -> bool:
    """Whether ``spec`` asks :func:`get_policy` to choose (``"auto"``, in any spelling).

    Raises:
        ValueError: ``spec`` names no known precision.
    """
    return not isinstance(spec, PrecisionPolicy) and _normalise(spec) == "auto"


def _normalise(spec: object) -> str:
    key: str | None = None
    if isinstance(spec, torch.dtype):
        key = _DTYPES.get(spec)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        key = str(spec)
    elif isinstance(spec, str):
        key = spec.strip().lower()
    key = _ALIASES.get(key, key)  # type: ignore[arg-type]
    if key == "auto" or key in PRECISIONS:
        return key  # type: ignore[return-value]
    raise ValueError(
        f"unknown precision {spec!r}; valid: {', '.join([*PRECISIONS, 'auto'])}, "
        f"the aliases {', '.join(_ALIASES)}, a torch dtype among "
        f"{', '.join(str(d) for d in _DTYPES)}, or a PrecisionPolicy instance"
    )


def _auto_policy(device: torch.device) -> PrecisionPolicy:
    if device.type == "cuda":
        label = f"{torch.cuda.get_device_name(device)} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        if cuda_bf16_native(device):
            policy: PrecisionPolicy = BF16Policy(note=f"auto: {label} has native bf16")
        else:
            policy = FP16Policy(note=f"auto: {label} has no native bf16, so fp16 with loss scaling")
    elif device.type == "cpu" and _compat.cpu_bf16_native():
        policy = BF16Policy(note="auto: this CPU runs bf16 natively")
    else:
        policy = FP32Policy(tf32=True, note=f"auto: no native reduced precision found for {device}")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0:
        log.info("precision='auto' chose %s: %s", policy.name, policy.note)
    return policy


