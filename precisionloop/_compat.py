"""Every private torch API precisionloop relies on, each behind one small function.

A torch upgrade that renames or changes one of these breaks exactly one function here,
and ``tests/test_compat.py`` pins each of them, so the break is loud, not silent.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import optimizer as _optimizer_module  # asked every step: imported once


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The scaler's inf/NaN verdict from its last ``unscale_(optimizer)``, as one device tensor (no host sync)."""
    found = list(scaler._found_inf_per_device(optimizer).values())
    return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).sum()


def scaler_scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The current loss scale as a device tensor; ``get_scale()`` would sync the host."""
    return scaler._get_scale_async()


def forget_unscale(scaler: torch.amp.GradScaler) -> None:
    """Forget an ``unscale_`` whose ``step``/``update`` never came (an error in between), so the next step can unscale."""
    scaler._per_optimizer_states.clear()


def non_finite_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's fused check: sets ``found_inf`` to 1 if any gradient is inf/NaN, and multiplies by ``inv_scale``."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (dynamo's ``OptimizedModule``) holds; None for any other module.

    Its parameter names carry an ``_orig_mod.`` prefix that torch.distributed.checkpoint's state dicts drop.
    Looked up without importing dynamo: a model was compiled only if dynamo is loaded already.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def current_stream_id(device: torch.device) -> int | None:
    """The current CUDA stream on ``device`` as a plain number (no Stream object: it is asked every step); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers whose ``step`` takes the inf verdict as a tensor (torch's fused ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_with_verdict(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Step a fused optimizer with ``found_inf`` as its verdict: it skips the update on the device when set.

    This is the contract GradScaler uses with fused optimizers: ``grad_scale`` and
    ``found_inf`` attributes read by ``step``. They are removed again afterwards.
    """
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def use_fused_implementation(optimizer: torch.optim.Optimizer) -> None:
    """Make a torch SGD/Adam/AdamW without state run its fused kernels, as if built with ``fused=True``."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
    # What the constructors set for fused=True: the GradScaler contract, and SGD's device/dtype check.
    optimizer._step_supports_amp_scaling = True
    if isinstance(optimizer, torch.optim.SGD):
        optimizer._need_device_dtype_check_for_fused = True


def foreach_mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor in place, in as few kernels as torch can."""
    torch._foreach_mul_(tensors, factor)


def foreach_div_(tensors: list[torch.Tensor], divisor: float) -> None:
    """Divide every tensor in place, in as few kernels as torch can."""
    torch._foreach_div_(tensors, divisor)


def backend_flag_accessors() -> tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...]:
    """A (getter, setter) pair per TF32 switch and for ``cudnn.benchmark``, in ``policy._read_flags``'s order.

    torch >= 2.9: matmul's, cuDNN conv's and cuDNN RNN's ``fp32_precision``; before: matmul's and
    cuDNN's ``allow_tf32``; then ``cudnn.benchmark``. Each getter is the C function the public
    property calls, without its Python lookups: a step reads them all twice, and the properties
    cost 0.7-2 us a read on a CPU where the functions cost 0.1. The setters stay the public
    properties (a step writes only the flags that differ), so torch's own checks on a write hold,
    ``torch.backends.disable_global_flags()`` among them.
    """
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    # partials, not lambdas: calling one runs no Python frame
    if hasattr(matmul, "fp32_precision"):
        tf32 = [(functools.partial(torch._C._get_fp32_precision_getter, "cuda", op),
                 functools.partial(setattr, owner, "fp32_precision"))
                for op, owner in (("matmul", matmul), ("conv", cudnn.conv), ("rnn", cudnn.rnn))]
    else:
        tf32 = [(torch._C._get_cublas_allow_tf32, functools.partial(setattr, matmul, "allow_tf32")),
                (torch._C._get_cudnn_allow_tf32, functools.partial(setattr, cudnn, "allow_tf32"))]
    return (*tf32, (torch._C._get_cudnn_benchmark, functools.partial(setattr, cudnn, "benchmark")))


def compile_modes() -> list[str]:
    """The mode names ``torch.compile`` accepts."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def compile_error_types() -> tuple[type[BaseException], ...]:
    """The exception types ``torch.compile`` raises when tracing or compiling fails."""
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


class compiled_backward_like_eager:
    """Inside the block, a compiled backward runs without autocast, as the step's eager backward does.

    torch's default (``backward_pass_autocast="same_as_forward"``) traces the backward under the
    forward's autocast, which recasts the backward of regions that ran with autocast off (the
    ``keep_fp32`` modules) to bf16/fp16. Torch versions without the setting are left alone. A
    class, not a generator, and the setting set and restored by hand: it is entered every step.
    """

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        import torch._functorch.config as config

        if hasattr(self, "_saved"):  # entered twice: the inner exit would leave the setting "off" for good
            raise RuntimeError("compiled_backward_like_eager() is already entered; use a new one")
        self._saved = getattr(config, "backward_pass_autocast", None)
        if self._saved is not None:
            config.backward_pass_autocast = "off"

    def __exit__(self, *exc) -> None:
        saved = self._saved
        del self._saved
        if saved is not None:
            import torch._functorch.config as config

            config.backward_pass_autocast = saved


def cpu_bf16_native() -> bool:
    """True when this CPU runs bf16 natively (oneDNN's check)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def is_batch_norm(module: nn.Module) -> bool:
    """Batch and instance norms: the layers with fp32 running statistics."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(module, _NormBase)


def dense_values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's stored values: itself when dense, its non-zero values when sparse, its local shard under FSDP2."""
    g = grad._values() if grad.is_sparse else grad
    return g.to_local() if hasattr(g, "to_local") else g


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy each ``src`` tensor into its ``dst`` tensor, in as few kernels as torch can."""
    torch._foreach_copy_(dst, src)


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` runs hooks: the optimizer's own step hooks or torch's global ones."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _optimizer_module._global_optimizer_pre_hooks or _optimizer_module._global_optimizer_post_hooks)


class capturable_groups:
    """Inside the block, every param group says ``capturable=True``, as Adam and AdamW require under CUDA graph capture.

    Their fused kernels ignore the flag (they keep the step count on the device either way), so only
    the check in ``step`` sees it; the groups' own values come back on exit.
    """

    __slots__ = ("_optimizer", "_saved")

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer

    def __enter__(self) -> None:
        self._saved = [g.get("capturable", _ABSENT) for g in self._optimizer.param_groups]
        try:
            for g in self._optimizer.param_groups:
                g["capturable"] = True
        except BaseException:  # a Ctrl-C midway: no group keeps the flag
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        for g, value in zip(self._optimizer.param_groups, self._saved):
            if value is _ABSENT:
                del g["capturable"]
            else:
                g["capturable"] = value


_ABSENT = object()
