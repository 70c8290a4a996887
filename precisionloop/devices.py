"""Devices: parsing a ``device=`` argument, and what a device can run."""

from __future__ import annotations

import warnings

import torch

from . import _compat

__all__ = ["parse_device", "resolve_device", "cuda_bf16_native", "check_device_support"]


def parse_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, with a ValueError that names the choices."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda' or 'cuda:1'") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to train on: the current CUDA device or the CPU by default, with an index for CUDA.

    Raises:
        ValueError: the device is unknown, holds no data, or is not usable here (the message names usable ones).
    """
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = parse_device(device)
    if device.type == "meta":
        raise ValueError("device 'meta' holds no data, so nothing can train there; use 'cpu' or 'cuda'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was requested but CUDA is not available; use device='cpu'")
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(f"device {str(device)!r} was requested but this machine has {count} CUDA device(s): "
                             f"use 'cuda:0' to 'cuda:{count - 1}', or 'cpu'")
    elif device.type != "cpu":
        # Another backend (a custom policy's hardware) is usable if torch can put a tensor there.
        try:
            torch.empty(0, device=device)
        except Exception as e:
            usable = "'cpu' or 'cuda'" if torch.cuda.is_available() else "'cpu'"
            first = (str(e).strip().splitlines() or [""])[0][:120]
            raise ValueError(f"device {str(device)!r} is not usable with this torch build "
                             f"({type(e).__name__}: {first}); use {usable}") from None
    return device


def cuda_bf16_native(device: torch.device) -> bool:
    """Whether a CUDA (or ROCm) device runs bf16 natively: compute capability 8.0 or higher."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


def check_device_support(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a precision the device cannot run natively; warn for fp16 on the CPU (correct, but very slow).

    Raises:
        ValueError: no autocast on this device, or bf16 on a CUDA GPU without native bf16.
    """
    if dtype == torch.float32:
        return
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"precision {name!r} needs autocast, which torch does not offer on {device}; "
                         "use precision='fp32'")
    if device.type == "cuda" and dtype == torch.bfloat16 and not cuda_bf16_native(device):
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"precision {name!r} needs native bf16, but {torch.cuda.get_device_name(device)} on {device} "
                         f"has compute capability {cc} (bf16 needs 8.0 or higher); use precision='fp16', which adds "
                         "loss scaling")
    if device.type == "cpu" and dtype == torch.float16:
        warnings.warn("fp16 autocast on the CPU is supported but very slow (tens of times slower than fp32); "
                      "consider precision='bf16' on the CPU", UserWarning, stacklevel=_compat.stacklevel_outside_package())
