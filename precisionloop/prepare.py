"""Readying a model for training: the ``compile=`` mode, then layout, compile and DDP/FSDP2 wrapping."""

from __future__ import annotations

import torch
from torch import nn

from . import _compat
from . import keep_fp32 as fp32_modules
from . import distributed as _dist
from .policy import PrecisionPolicy

__all__ = ["compile_mode", "prepare_model"]


def compile_mode(compile: bool | str | None, device: torch.device) -> str | None:
    """The ``torch.compile`` mode for a ``compile=`` argument: None (eager), a default per device, or the named mode.

    Raises:
        ValueError: not a bool or a mode torch knows.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    modes = _compat.compile_modes()
    if not isinstance(compile, str) or compile not in modes:
        raise ValueError(f"compile must be False, True or a torch.compile mode among {', '.join(modes)}; got {compile!r}")
    return compile


def prepare_model(model: nn.Module, policy: PrecisionPolicy, mode: str | None, distributed: str | None,
                  device: torch.device, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.memory_format]:
    """Apply a policy to a model on its device: layout, compile, then DDP/FSDP2; returns it and the input layout."""
    if not _dist.is_wrapped(model):
        model = policy.prepare_model(model)
    else:  # a model the user wrapped keeps its layout; its kept modules (named as in the model inside) still run in fp32
        fp32_modules.keep_fp32_(_dist.unwrap(model), policy.keep_fp32)
    input_format = policy.memory_format(_dist.unwrap(model))
    if mode is not None:
        _dist.unwrap(model).compile(mode=mode)  # in place, so state_dict keys do not change
    if distributed == "fsdp" and input_format == torch.channels_last:
        # FSDP2 cannot shard non-contiguous parameters; channels_last inputs still steer cuDNN to NHWC kernels.
        model = model.to(memory_format=torch.contiguous_format)
    if distributed:
        model = _dist.wrap(model, distributed, policy, device, optimizer)
    return model, input_format
