"""Precision policies: the autocast dtype, the loss scaler and the backend flags of a training step."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from . import _compat, keep_fp32 as fp32_modules
from ._compat import resolve_device

__all__ = ["PrecisionPolicy", "FP32Policy", "BF16Policy", "BF16PurePolicy", "FP16Policy", "resolve_device", "has_tf32"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """How a training step handles precision, immutable; subclass it (or a concrete policy) for custom hardware.

    Args:
        tf32: fp32 matmuls and convolutions on CUDA use TF32 tensor cores (True), strict IEEE fp32 (False), or as
            this process has them (None: the flag is left as found).
        cudnn_benchmark: autotune cuDNN algorithms; ``None`` follows ``tf32``.
        channels_last: 2-D convolution models in channels_last: ``None`` on CUDA only, ``True`` always, ``False`` never.
        keep_fp32: modules run in fp32 (autocast off, fp32 inputs): classes or ``named_modules()`` fnmatch patterns.
        note: why this policy was chosen (``get_policy("auto")`` fills it in).
    """

    name: ClassVar[str] = "custom"
    compute_dtype: ClassVar[torch.dtype] = torch.float32
    param_dtype: ClassVar[torch.dtype] = torch.float32  # what prepare_model casts fp32 weights outside keep_fp32 to

    tf32: bool | None = True
    cudnn_benchmark: bool | None = None
    channels_last: bool | None = None
    keep_fp32: tuple = ()
    note: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_fp32", fp32_modules.validate_keep_fp32(self.keep_fp32))  # frozen

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context manager for the forward pass and the loss."""
        if self.compute_dtype == torch.float32:
            return torch.autocast(device_type, enabled=False)  # also switches off an autocast the caller opened
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler | None:
        """A fresh loss scaler for this device type, or ``None`` when gradients need no scaling."""
        return None

    def should_skip(self, nonfinite: torch.Tensor, grad_norm: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Whether to skip this optimizer step: a float32 tensor on ``nonfinite``'s device, 1.0 to skip, else 0.0
        (torch's fused optimizers skip only on exactly 1). Stay on the device: reading a value here syncs the host.

        Args:
            nonfinite: 1.0 if a gradient or a micro-batch loss held an inf or NaN, alike on every rank.
            grad_norm: gives the total norm of the unscaled gradients before clipping (computed at its first call
                when clipping is off); the same on every rank.
        """
        return nonfinite

    def backend_flags(self, device_type: str = "cuda") -> contextlib.AbstractContextManager:
        """On CUDA, the TF32 switches and ``cudnn.benchmark`` the policy names set for the block, then restored."""
        benchmark = self.tf32 if self.cudnn_benchmark is None else self.cudnn_benchmark
        precision = None if self.tf32 is None else "tf32" if self.tf32 else "ieee"
        if device_type != "cuda" or (precision is None and benchmark is None):  # each step enters it: read nothing
            return contextlib.nullcontext()
        return _flags_set((precision, precision, precision, benchmark))

    def check_compile(self, mode: str | None, device_type: str) -> None:
        """Warn if this policy is known to run slowly with this compile mode; silent by default."""

    def memory_format(self, model: nn.Module) -> torch.memory_format:
        """The layout for this model's 4-D weights and 4-D floating-point inputs."""
        conv = self.channels_last is not False and any(isinstance(m, nn.Conv2d) for m in model.modules())
        if conv and (self.channels_last or any(p.is_cuda for p in model.parameters())):
            return torch.channels_last
        return torch.contiguous_format

    def check_model(self, model: nn.Module, device: torch.device | None = None) -> None:
        """A ValueError, before any change, if a ``keep_fp32`` pattern matches nothing or layers are already fp8."""
        inner = _compat.unwrap(model)
        fp32_modules.select_modules(inner, self.keep_fp32)
        converted = converted_layers(inner)
        if converted:  # torchao's conversion cannot be undone
            raise ValueError(f"layers {', '.join(converted[:5])} were converted to fp8 by an earlier FP8Policy; build "
                             "the model anew (its state_dict keys are the same) to train it under this policy")

    def check_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise a ValueError, before anything changes, unless the weights are fp32 master weights."""
        reduced = self.compute_dtype != torch.float32
        bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.is_floating_point()
               and p.dtype != torch.float32 and (p.dtype in (torch.float16, torch.bfloat16) or reduced)]
        if bad:
            raise ValueError(
                f"parameters {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} are not fp32; precision "
                f"{self.name!r} keeps fp32 master weights and lowers precision through autocast. Call model.float() "
                "first; or, for bf16 weights with no fp32 copy, use precision='bf16-pure'")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Check the device runs this policy (else a ValueError), set the layout, keep ``keep_fp32`` modules fp32."""
        device = next((p.device for p in model.parameters()), None)
        if device is not None and self.compute_dtype != torch.float32:  # fp32 runs on every device
            _check_device_support(self.name, self.compute_dtype, device)
        memory_format = self.memory_format(model)
        if memory_format is not torch.contiguous_format:
            model = model.to(memory_format=memory_format)
        fp32_modules.keep_fp32_(_compat.unwrap(model), self.keep_fp32)
        return model


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP32Policy(PrecisionPolicy):
    """fp32 everywhere: ``tf32=None`` (``"fp32"``) leaves TF32 and ``cudnn.benchmark`` as the process has them,
    ``tf32=True`` (``"tf32"``) turns both on, ``tf32=False`` (``"fp32-strict"``) is strict IEEE fp32 without
    ``cudnn.benchmark``, for reproducibility."""

    tf32: bool | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return {None: "fp32", True: "tf32", False: "fp32-strict"}[self.tf32]

    def check_model(self, model: nn.Module, device: torch.device | None = None) -> None:
        """As :meth:`PrecisionPolicy.check_model`, and a ValueError for tf32 where there is no TF32 (it is fp32)."""
        super().check_model(model, device)
        if self.tf32 and device is not None and not has_tf32(device):
            where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type.upper()
            raise ValueError(f"precision 'tf32': TF32 needs a CUDA GPU of compute capability 8.0+, and the {where} has "
                             "none (tf32 would run as fp32); use fp32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16Policy(PrecisionPolicy):
    """bf16 autocast with fp32 master weights; bf16 keeps fp32's exponent range, so no loss scaler."""

    name: ClassVar[str] = "bf16"
    compute_dtype: ClassVar[torch.dtype] = torch.bfloat16


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16PurePolicy(BF16Policy):
    """bf16 weights, gradients and update, with no fp32 master copy; ``keep_fp32`` modules stay fp32.

    ``prepare_model`` casts the rest to bf16 in place; autocast stays on, so the ops it keeps in fp32 (softmax, the
    losses) still run in fp32. Rounded to nearest, a bf16 weight loses small updates, so the optimizer must round
    stochastically and say so with ``bf16_stochastic_round = True``, as :class:`precisionloop.BF16AdamW` and
    torchao's optimizers built with ``bf16_stochastic_round=True`` do.
    """

    name: ClassVar[str] = "bf16-pure"
    param_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def check_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise a ValueError unless the parameters are fp32 or bf16 and the optimizer rounds stochastically."""
        bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters()
               if p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16)]
        if bad:
            raise ValueError(f"parameters {', '.join(bad[:5])} are neither fp32 nor bf16; precision {self.name!r} "
                             "casts fp32 weights to bf16 itself: call model.float() first")
        if getattr(optimizer, "bf16_stochastic_round", False) is not True:
            raise ValueError(
                f"precision {self.name!r} keeps no fp32 master copy, so the optimizer must round its update "
                f"stochastically, and {type(optimizer).__name__} does not say it does (bf16_stochastic_round = True): "
                "a bf16 weight rounded to nearest loses updates smaller than half its last bit. Use "
                "precisionloop.BF16AdamW(params), or precision='bf16'")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """As :meth:`PrecisionPolicy.prepare_model`, then the floating tensors outside ``keep_fp32`` cast to bf16."""
        model = super().prepare_model(model)
        inner = _compat.unwrap(model)
        selected = fp32_modules.select_modules(inner, self.keep_fp32)
        kept = {id(t) for _, m in selected for t in [*m.parameters(), *m.buffers()]}
        with torch.no_grad():  # in place, so the optimizer keeps its parameters
            for t in [*inner.parameters(), *inner.buffers()]:
                if t.is_floating_point() and id(t) not in kept:
                    t.data = t.data.to(self.param_dtype)
        return model


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16Policy(PrecisionPolicy):
    """fp16 autocast with fp32 master weights and dynamic loss scaling (``torch.amp.GradScaler``)."""

    name: ClassVar[str] = "fp16"
    compute_dtype: ClassVar[torch.dtype] = torch.float16

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type, init_scale=self.init_scale, growth_factor=self.growth_factor,
                                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, such as ``(8, 0)``; ``(0, 0)`` for any other device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def has_tf32(device: torch.device) -> bool:
    """Whether ``device`` has TF32 math: an NVIDIA GPU of compute capability 8.0 or higher."""
    return not torch.version.hip and compute_capability(device) >= (8, 0)


def cuda_bf16_native(device: torch.device) -> bool:
    """Whether a CUDA (or ROCm) device runs bf16 natively: compute capability 8.0 or higher."""
    return bool(torch.version.hip) or compute_capability(device) >= (8, 0)


def converted_layers(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` converted to fp8 (torchao's ``Float8Linear``, sharded by FSDP2 or not)."""
    # By class name through the MRO: torchao need not be imported, and FSDP2 swaps a sharded module's class.
    return [name for name, m in model.named_modules() if any(c.__name__ == "Float8Linear" for c in type(m).__mro__)]


def warn_overridden_flags(policy: PrecisionPolicy) -> None:
    """Warn when the policy's backend flags override ones this process set away from torch's defaults."""
    with policy.backend_flags("cuda"):
        wanted = _current()
    overridden = [f"{label}={now!r} (the Trainer sets {want!r})"
                  for (label, _, _, defaults), want, now in zip(_FLAGS, wanted, _current())
                  if now not in defaults and want != now]
    if overridden:
        warnings.warn(f"precision {policy.name!r} overrides this process's {', '.join(overridden)} while it trains; "
                      "a policy with tf32=None and cudnn_benchmark=None leaves them (precision='fp32' is one), or pass "
                      "the values you want", UserWarning, stacklevel=_compat.stacklevel_outside_package())


def _check_device_support(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a reduced precision the device cannot run natively; warn where a CPU runs it slower than fp32."""
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"precision {name!r} needs autocast, which torch does not offer on {device}; use 'fp32'")
    if device.type == "cuda" and dtype == torch.bfloat16 and not cuda_bf16_native(device):
        raise ValueError(f"precision {name!r} needs native bf16, but {torch.cuda.get_device_name(device)} has compute "
                         "capability below 8.0; use precision='fp16', which adds loss scaling")
    native = device.type != "cpu" or _compat.cpu_bf16_native()
    stacklevel = _compat.stacklevel_outside_package()
    if device.type == "cpu" and dtype == torch.float16:
        warnings.warn("fp16 autocast on the CPU is supported but very slow (tens of times slower than fp32); consider "
                      f"precision={'bf16' if native else 'fp32'!r}", UserWarning, stacklevel=stacklevel)
    elif not native:  # what a script swapped to precision="bf16" meets on most laptops
        warnings.warn(f"precision {name!r}: this CPU has no native bf16, so its autocast runs emulated, often ten "
                      "times slower than fp32; consider precision='fp32'", UserWarning, stacklevel=stacklevel)


# Each flag a policy sets: its label, owner, attribute and torch's defaults ("none" defers to the global setting),
# values nobody chose. The TF32 switches are torch's per-backend fp32_precision, "tf32" or "ieee".
_FLAGS = (("cuda.matmul.fp32_precision", torch.backends.cuda.matmul, "fp32_precision", ("none", "ieee")),
          ("cudnn.conv.fp32_precision", torch.backends.cudnn.conv, "fp32_precision", ("none", "tf32")),
          ("cudnn.rnn.fp32_precision", torch.backends.cudnn.rnn, "fp32_precision", ("none", "tf32")),
          ("cudnn.benchmark", torch.backends.cudnn, "benchmark", (False,)))


def _current() -> tuple:
    return tuple(getattr(owner, name) for _, owner, name, _ in _FLAGS)


@contextlib.contextmanager
def _flags_set(wanted: tuple) -> Iterator[None]:
    """Each of ``_FLAGS`` set to its wanted value, unless None, for the block; each one that differs restored after."""
    saved = _current()
    try:
        for (_, owner, name, _), value, was in zip(_FLAGS, wanted, saved):
            if value is not None and value != was:
                setattr(owner, name, value)
        yield
    finally:  # also after a write refused midway: nothing set stays set
        for (_, owner, name, _), was in zip(_FLAGS, saved):
            if getattr(owner, name) != was:
                setattr(owner, name, was)
