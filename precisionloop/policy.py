"""Precision policies: the compute dtype, the gradient guard and the backend flags of a training step.

Precision strings are parsed in :mod:`precisionloop.precisions`, nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from . import _compat
from . import keep_fp32 as fp32_modules
from .checks import check_master_weights, check_real
from .devices import check_device_support
from .guard import FiniteGuard, GradientGuard, ScalerGuard

__all__ = ["PrecisionPolicy", "FP32Policy", "BF16Policy", "BF16PurePolicy", "FP16Policy", "refuse_fp8_layers",
           "rounds_stochastically"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """An immutable description of how a training step handles precision.

    The Trainer reaches a policy only through its methods and the attributes ``name``, ``compute_dtype`` and
    ``keep_fp32``: subclass it (or a concrete policy) to support custom hardware.

    Args:
        tf32: let fp32 matmuls and convolutions use TF32 tensor cores on CUDA.
        cudnn_benchmark: autotune cuDNN algorithms; ``None`` follows ``tf32``.
        channels_last: ``None`` puts models with 2-D convolutions into channels_last on CUDA only; ``True``
            always; ``False`` never.
        keep_fp32: modules to run in fp32 (autocast off, fp32 inputs and outputs): module classes (matched with
            isinstance) or name patterns (fnmatch over ``model.named_modules()`` names).
        note: why this policy was chosen (filled in by ``get_policy("auto")``).

    Raises:
        TypeError: a ``keep_fp32`` entry is neither a module class nor a string.
        ValueError: a flag is not a bool (or ``None`` where allowed), or a ``keep_fp32`` pattern is empty.

    Example:
        >>> import torch
        >>> from precisionloop import BF16Policy
        >>> policy = BF16Policy()
        >>> with policy.backend_flags(), policy.autocast("cpu"):
        ...     y = torch.nn.Linear(4, 2)(torch.randn(3, 4))
        >>> y.dtype
        torch.bfloat16
    """

    name: ClassVar[str] = "custom"
    compute_dtype: ClassVar[torch.dtype] = torch.float32

    tf32: bool = True
    cudnn_benchmark: bool | None = None
    channels_last: bool | None = None
    keep_fp32: tuple = ()
    note: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("tf32", "cudnn_benchmark", "channels_last"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name != "tf32")):
                raise ValueError(f"{name} must be {'True or False' if name == 'tf32' else 'True, False or None'}, "
                                 f"got {value!r}")
        object.__setattr__(self, "keep_fp32", fp32_modules.validate_keep_fp32(self.keep_fp32))  # frozen: normalise once

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """A context manager for the forward pass and the loss, asked for anew each step."""
        if self.compute_dtype == torch.float32:
            # An explicit disabled autocast also switches off any autocast the caller opened.
            return torch.autocast(device_type, enabled=False)
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler | None:
        """A fresh loss scaler for this device type, or ``None`` when gradients need no scaling."""
        return None

    def make_guard(self, device_type: str) -> GradientGuard:
        """The step's gradient guard: loss scaling through ``make_scaler``'s scaler, else a non-finite check."""
        scaler = self.make_scaler(device_type)
        return ScalerGuard(scaler) if scaler is not None else FiniteGuard()

    @contextlib.contextmanager
    def backend_flags(self) -> Iterator[None]:
        """Set TF32 and ``cudnn.benchmark`` while the block runs, then restore the caller's values."""
        benchmark = self.tf32 if self.cudnn_benchmark is None else self.cudnn_benchmark
        with _flags_set((*_tf32_values(self.tf32), benchmark)):
            yield

    def check_compile(self, mode: str | None, device_type: str) -> None:
        """Say so (a warning) if this policy is known to run slowly with this compile mode; silent by default."""

    def memory_format(self, model: nn.Module) -> torch.memory_format:
        """The layout for this model's 4-D weights and 4-D floating-point inputs."""
        if self.channels_last is False or not any(isinstance(m, nn.Conv2d) for m in model.modules()):
            return torch.contiguous_format
        if self.channels_last or any(p.is_cuda for p in model.parameters()):
            return torch.channels_last
        return torch.contiguous_format

    def check_model(self, model: nn.Module, device: torch.device | None = None) -> None:
        """Raise, before anything changes, if this policy cannot apply to ``model`` (on ``device``).

        Raises:
            ValueError: a ``keep_fp32`` pattern matches no module (the message names close ones),
                or the model has layers an earlier fp8 policy converted.
        """
        inner = _inner(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)
        fp32_modules.select_modules(inner, self.keep_fp32)  # names as inside a wrapper, as the Trainer wraps
        refuse_fp8_layers(inner)

    def check_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise, before anything changes, if the weights' dtypes or the optimizer do not suit this policy.

        The default wants fp32 master weights, with precision coming down through autocast only.

        Raises:
            ValueError: a floating-point parameter is not fp32 (the message names the parameters).
        """
        check_master_weights(model, self.name, self.compute_dtype)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Check that the model's device supports this policy, convert its layout, keep ``keep_fp32`` modules fp32.

        Raises:
            ValueError: the device cannot run ``compute_dtype`` natively, or a ``keep_fp32`` pattern matches no module.
        """
        device = next((p.device for p in model.parameters()), None)
        if device is not None:
            check_device_support(self.name, self.compute_dtype, device)
        memory_format = self.memory_format(model)
        if memory_format is not torch.contiguous_format:
            model = model.to(memory_format=memory_format)
        fp32_modules.keep_fp32_(_inner(model), self.keep_fp32)
        return model

    def prepare_sharding(self, model: nn.Module) -> nn.Module:
        """Ready the prepared model for FSDP2's ``fully_shard``, which comes next; unchanged by default.

        It may replace parameters: the optimizer is repointed at the sharded ones by name afterwards.

        Args:
            model: the model ``prepare_model`` returned, not yet sharded.
        """
        return model

    def check_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Raise, before anything changes, if ``prepare_sharding`` would refuse ``model``; nothing by default.

        The Trainer calls it at construction under ``distributed="fsdp"``, after :meth:`check_model`.

        Args:
            model: the user's model, not yet prepared.
            device: where it will train.
        """

    def optimizer_step_hook(self, model: nn.Module) -> Callable[[], None] | None:
        """What to run on ``model`` after each optimizer step (and after a checkpoint loads); None for nothing.

        Asked once per configuration. It runs once ``global_step`` counts the step, after skipped steps too
        (so it must be harmless to run again), and possibly before the step's verdict is booked (on CUDA it is
        read later; ``trainer.stats`` waits for it).

        Args:
            model: the model as it trains (prepared, and wrapped or sharded if distributed).
        """
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP32Policy(PrecisionPolicy):
    """fp32 everywhere: ``tf32=False`` is strict IEEE fp32, ``tf32=True`` uses TF32 tensor cores."""

    tf32: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return "tf32" if self.tf32 else "fp32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16Policy(PrecisionPolicy):
    """bf16 autocast with fp32 master weights; bf16 keeps fp32's exponent range, so no loss scaler."""

    name: ClassVar[str] = "bf16"
    compute_dtype: ClassVar[torch.dtype] = torch.bfloat16


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16PurePolicy(BF16Policy):
    """bf16 weights, gradients and optimizer update, with no fp32 master copy; ``keep_fp32`` modules stay fp32.

    ``prepare_model`` casts the rest to bf16 in place (the optimizer keeps its parameters); autocast stays on,
    so the ops it keeps in fp32 (softmax, the losses) still run in fp32. A bf16 weight rounded to nearest loses
    updates smaller than half its last bit, so the optimizer must round stochastically and say so with
    ``bf16_stochastic_round = True``, as torchao's do (``torchao.optim._AdamW(params, bf16_stochastic_round=True)``).

    Example:
        >>> import torch
        >>> from precisionloop import get_policy
        >>> get_policy("bf16-pure").name
        'bf16-pure'
    """

    name: ClassVar[str] = "bf16-pure"

    def check_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise unless the parameters are fp32 or bf16 and the optimizer rounds its update stochastically.

        Raises:
            ValueError: a parameter of another floating dtype, or an optimizer that does not declare
                ``bf16_stochastic_round = True``.
        """
        bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters()
               if p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16)]
        if bad:
            raise ValueError(f"parameters {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} are neither fp32 nor "
                             f"bf16; precision {self.name!r} casts fp32 weights to bf16 itself: call model.float() first")
        if isinstance(model, nn.parallel.DistributedDataParallel):  # used as it is: prepare_model does not cast it
            kept = {id(p) for _, m in fp32_modules.select_modules(_inner(model.module), self.keep_fp32)
                    for p in m.parameters()}
            fp32 = [n for n, p in model.module.named_parameters() if p.dtype == torch.float32 and id(p) not in kept]
            if fp32:
                raise ValueError(f"the model you wrapped in DDP has fp32 parameters ({', '.join(fp32[:5])}"
                                 f"{' ...' if len(fp32) > 5 else ''}), and precision {self.name!r} casts only a model "
                                 "it wraps itself: pass the model unwrapped (the Trainer wraps it), or cast it to "
                                 "bf16 before wrapping it")
        if not rounds_stochastically(optimizer):
            raise ValueError(
                f"precision {self.name!r} trains bf16 weights with no fp32 master copy, so the optimizer must round "
                f"its update stochastically, and {type(optimizer).__name__} does not say it does "
                "(bf16_stochastic_round = True): a bf16 weight rounded to nearest loses updates smaller than half its "
                "last bit. Use torchao.optim._AdamW(params, bf16_stochastic_round=True) (or AdamW8bit with it), "
                "or precision='bf16', which keeps fp32 master weights")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """As :meth:`PrecisionPolicy.prepare_model`, then cast the floating tensors outside ``keep_fp32`` to bf16.

        Raises:
            ValueError: as :meth:`PrecisionPolicy.prepare_model`.
        """
        model = super().prepare_model(model)
        cast_outside_kept_(_inner(model), self.keep_fp32, self.compute_dtype)
        return model


def rounds_stochastically(optimizer: object) -> bool:
    """Whether an optimizer declares that it rounds its bf16 updates stochastically (``bf16_stochastic_round``)."""
    return getattr(optimizer, "bf16_stochastic_round", False) is True


def cast_outside_kept_(model: nn.Module, keep_fp32: tuple, dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers outside ``keep_fp32`` to ``dtype`` in place, float64 ones too.

    A parameter keeps its identity (its ``data`` is replaced, as ``Module.to`` does), so an optimizer built on
    it still holds it.
    """
    kept = {id(m) for _, outer in fp32_modules.select_modules(model, keep_fp32) for m in outer.modules()}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in kept:
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point() and b.dtype != dtype:
                    setattr(module, name, b.to(dtype))  # a registered buffer stays one, persistent or not


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16Policy(PrecisionPolicy):
    """fp16 autocast with fp32 master weights and a dynamic loss scaler.

    Args:
        init_scale: the first loss scale.
        growth_factor: the scale's multiplier after ``growth_interval`` finite steps.
        backoff_factor: the scale's multiplier after a step with non-finite gradients.
        growth_interval: how many finite steps in a row before the scale grows.

    Raises:
        ValueError: a scaler argument is out of range.
    """

    name: ClassVar[str] = "fp16"
    compute_dtype: ClassVar[torch.dtype] = torch.float16

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        super().__post_init__()
        # The scaler keeps the scale in fp32 and its growth counter in int32. A scale that rounds to 0 or
        # whose inverse overflows makes torch's unscale turn finite gradients into inf/NaN without flagging
        # them (its check reads the gradients before the multiply), so the range is fp32's normal numbers.
        tiny, big = _FP32.tiny, _FP32.max
        check_real("init_scale", self.init_scale, lambda v: tiny <= v <= big,
                   f"a number in [{tiny:.4g}, {big:.4g}] (fp32's normal range)")
        check_real("growth_factor", self.growth_factor, lambda v: 1 < v <= big, "a number > 1, finite in fp32")
        check_real("backoff_factor", self.backoff_factor, lambda v: tiny <= v < 1, f"a number in [{tiny:.4g}, 1)")
        if (isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int)
                or not 1 <= self.growth_interval <= _INT32_MAX):
            raise ValueError(f"growth_interval must be an int in [1, {_INT32_MAX}], got {self.growth_interval!r}")

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(
            device_type,
            init_scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )


def _inner(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper, whose names (no ``_orig_mod.``) keep_fp32 patterns use."""
    inner = _compat.compiled_original(model)
    return model if inner is None else inner


_FP32 = torch.finfo(torch.float32)
_INT32_MAX = torch.iinfo(torch.int32).max


def refuse_fp8_layers(model: nn.Module) -> None:
    """Refuse a model with layers an earlier fp8 policy converted: torchao's conversion cannot be undone.

    Found by class name in the MRO (FSDP2 swaps a sharded module's class for a subclass), without importing torchao.

    Raises:
        ValueError: naming the converted layers.
    """
    converted = [n for n, m in model.named_modules() if any(c.__name__ == "Float8Linear" for c in type(m).__mro__)]
    if converted:
        raise ValueError(f"layers {', '.join(converted[:5])} were converted to fp8 by an earlier FP8Policy, and "
                         "torchao's conversion cannot be undone; build the model anew (load its state_dict into a "
                         "fresh one, the keys are the same) to train it under this policy")


# torch >= 2.9 has per-backend ``fp32_precision`` settings, and mixing them with the legacy
# ``allow_tf32`` switches raises, so use whichever API this torch provides.
_MATMUL, _CUDNN = torch.backends.cuda.matmul, torch.backends.cudnn
_NEW_TF32_API = hasattr(_MATMUL, "fp32_precision")
_FLAGS = (((_MATMUL, "fp32_precision"), (_CUDNN.conv, "fp32_precision"), (_CUDNN.rnn, "fp32_precision"))
          if _NEW_TF32_API else ((_MATMUL, "allow_tf32"), (_CUDNN, "allow_tf32"))) + ((_CUDNN, "benchmark"),)


def _tf32_values(tf32: bool) -> tuple:
    """The TF32 switches' values, in ``_FLAGS``'s order."""
    if _NEW_TF32_API:
        return ("tf32" if tf32 else "ieee",) * 3
    return (tf32, tf32)


@contextlib.contextmanager
def _flags_set(wanted: tuple) -> Iterator[None]:
    """Each of ``_FLAGS`` set to its wanted value for the block; every one that differs then is restored after."""
    saved = tuple(getattr(owner, name) for owner, name in _FLAGS)
    try:
        for (owner, name), value, was in zip(_FLAGS, wanted, saved):
            if value != was:
                setattr(owner, name, value)
        yield
    finally:  # also after a write refused midway (frozen cuDNN flags, say): nothing set stays set
        for (owner, name), was in zip(_FLAGS, saved):
            if getattr(owner, name) != was:
                setattr(owner, name, was)
