"""Each private torch API behind one function that ``tests/test_compat.py`` pins; unwrap, is_wrapped, resolve_device."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def scaler_scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The loss scale as a device tensor (None before the first ``scale``); ``get_scale()`` would sync the host."""
    return scaler._get_scale_async()


def update_scale_(scaler: torch.amp.GradScaler, found_inf: torch.Tensor) -> None:
    """``scaler.update()`` from a found-inf flag of our own: back off on 1, else grow after its interval."""
    torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found_inf, scaler._growth_factor,
                             scaler._backoff_factor, scaler._growth_interval)


# GradScaler's fused check takes no complex gradient; its CUDA kernel takes no bf16 and counts finite fp64 values
# beyond fp32's range as inf. Its write-back doubles the check's memory traffic, which a large GPU-bound step pays
# for: ResNet18's 11.7M values gain from one launch, a Transformer's 237M lose.
_FUSED_CHECK_DTYPES = {"cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                       "cuda": (torch.float16, torch.float32)}
FUSED_CHECK_MAX_ELEMENTS = 2**25  # the most CUDA gradient values one fused check takes


def non_finite_any_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor | None) -> None:
    """Multiply gradients (all of one device and dtype) by ``inv_scale``, set ``found_inf`` (fp32, one element) to 1
    if one is not finite: GradScaler's fused kernel where it runs and pays, else foreach inf-norms (and a multiply)."""
    device = grads[0].device.type
    fused = grads[0].dtype in _FUSED_CHECK_DTYPES.get(device, ())
    if fused and (inv_scale is not None or device == "cpu"
                  or sum(map(torch.Tensor.numel, grads)) <= FUSED_CHECK_MAX_ELEMENTS):
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)  # a scale of one: the values stay
        scale = one if inv_scale is None else inv_scale.to(found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale)
        return
    grads = [g for g in grads if g.numel()]  # an inf-norm of nothing is an error
    if not grads:
        return
    found = (~torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf"))))).any()
    torch.maximum(found_inf, found.to(found_inf.dtype), out=found_inf)
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale)


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by (device, dtype), torch's own grouping for foreach kernels, done in C++."""
    return [lists[0] for lists, _ in torch._C._group_tensors_by_device_and_dtype([tensors], False).values()]


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers whose ``step`` takes the inf/NaN flag as a tensor (torch's fused ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def use_fused_implementation(optimizer: torch.optim.Optimizer) -> None:
    """Make a torch SGD/Adam/AdamW without state run its fused kernels, as if built with ``fused=True``."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True  # what the constructors set for fused=True


def foreach_mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor in place, in as few kernels as torch can."""
    torch._foreach_mul_(tensors, factor)


def compile_error_types() -> tuple[type[BaseException], ...]:
    """The exception types ``torch.compile`` raises when tracing or compiling fails."""
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


@contextlib.contextmanager
def compiled_backward_like_eager() -> Iterator[None]:
    """Inside the block a compiled backward runs without autocast, as the eager one does: torch's default
    (``backward_pass_autocast="same_as_forward"``) would recast to bf16/fp16 the backward of ``keep_fp32`` regions.
    Set and restored by hand: ``config.patch`` costs four times as much, every step."""
    import torch._functorch.config as config

    old = getattr(config, "backward_pass_autocast", None)  # torch 2.10 and later
    if old is not None:
        config.backward_pass_autocast = "off"
    try:
        yield
    finally:
        if old is not None:
            config.backward_pass_autocast = old


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and a ``torch.compile`` wrapper (``_orig_mod``), named as checkpoints name it."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # compiled only if dynamo is loaded already
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped in DDP or sharded by FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, (nn.parallel.DistributedDataParallel, FSDPModule))


def resolve_device(device: str | torch.device | None, index: int | None = None) -> torch.device:
    """The device to train on, by default CUDA if there is a GPU, else the CPU; a CUDA device without an index gets
    ``index``, else the current device's. A ValueError where CUDA is asked for and there is none."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was requested but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return device


def cpu_bf16_native() -> bool:
    """True when this CPU runs bf16 natively (oneDNN's check)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def is_batch_norm(module: nn.Module) -> bool:
    """Batch and instance norms: the layers with fp32 running statistics."""
    return isinstance(module, _NormBase)


def dense_values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's stored values: itself when dense, its values when sparse, its local shard under FSDP2."""
    g = grad._values() if grad.is_sparse else grad
    return g.to_local() if hasattr(g, "to_local") else g


def stacklevel_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside precisionloop (``sys._getframe``)."""
    package, frame, level = os.path.dirname(os.path.abspath(__file__)) + os.sep, sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
