"""Precision policies: the compute dtype, the loss scaler and the backend flags of a training step.

Every precision string is parsed here, in :func:`get_policy`, and nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import numbers
import warnings
from typing import Callable, ClassVar

import torch
from torch import nn

from . import _compat, fp8, fp32_modules
from .guard import FiniteGuard, GradientGuard, ScalerGuard

__all__ = ["PrecisionPolicy", "FP32Policy", "BF16Policy", "FP16Policy", "FP8Policy", "get_policy", "PRECISIONS"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """An immutable description of how a training step handles precision.

    The Trainer reaches a policy only through ``autocast``, ``make_guard`` (built
    from ``make_scaler``), ``backend_flags``, ``check_model``, ``prepare_model``,
    ``check_sharding`` and ``prepare_sharding`` (FSDP2 only), ``optimizer_step_hook`` and ``memory_format``,
    plus the attributes ``name``, ``compute_dtype`` and ``keep_fp32``. Subclass it (or
    one of the concrete policies) to support custom hardware.

    Args:
        tf32: let fp32 matmuls and convolutions use TF32 tensor cores on CUDA.
        cudnn_benchmark: autotune cuDNN algorithms; ``None`` follows ``tf32``.
        channels_last: ``None`` puts models with 2-D convolutions into
            channels_last on CUDA only; ``True`` always; ``False`` never.
        keep_fp32: modules to run in fp32 under autocast: module classes (matched with
            isinstance) or name patterns (fnmatch over ``model.named_modules()`` names).
            A kept module runs with autocast off, on fp32 inputs, and gives fp32 outputs.
        note: why this policy was chosen (filled in by ``get_policy("auto")``).

    Raises:
        TypeError: a ``keep_fp32`` entry is neither a module class nor a string.

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
        """A context manager for the forward pass and the loss.

        The step keeps a ``torch.autocast`` returned here and enters it step after step (it asks
        again for a new policy, when the autocast cache setting or default dtype changes, and for a
        step nested in another); any other context manager is asked for anew each step.
        """
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

    def backend_flags(self) -> contextlib.AbstractContextManager:
        """Set TF32 and ``cudnn.benchmark`` while the block runs, then restore the caller's values."""
        benchmark = self.tf32 if self.cudnn_benchmark is None else self.cudnn_benchmark
        return _BackendFlags((_tf32_flags(self.tf32), benchmark))

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
        fp8.check_converted(inner, allowed=())

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Check that the model's device supports this policy, convert its layout, keep ``keep_fp32`` modules fp32.

        Raises:
            ValueError: the device cannot run ``compute_dtype`` natively, or a
                ``keep_fp32`` pattern matches no module.
        """
        device = next((p.device for p in model.parameters()), None)
        if device is not None:
            _check_device_support(self, device)
        memory_format = self.memory_format(model)
        if memory_format is not torch.contiguous_format:
            model = model.to(memory_format=memory_format)
        fp32_modules.keep_fp32_(_inner(model), self.keep_fp32)
        return model

    def prepare_sharding(self, model: nn.Module) -> nn.Module:
        """Ready the prepared model for FSDP2's ``fully_shard``, which comes next; unchanged by default.

        It may replace parameters: ``distributed.wrap`` records the optimizer's parameters by name first,
        and repoints the optimizer at the sharded ones afterwards.

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
        """What to run after each optimizer step (and after a checkpoint loads) on ``model``; None for nothing.

        Asked once per configuration, so the per-step cost of None is one test. It runs after the
        optimizer step, once ``global_step`` counts it, and after skipped steps too (the weights
        did not change then; it must be harmless to run again). The step's verdict may not be
        booked yet (on CUDA it is read later); ``trainer.stats`` books it, at the cost of a wait.

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
        _check_real("init_scale", self.init_scale, lambda v: tiny <= v <= big,
                    f"a number in [{tiny:.4g}, {big:.4g}] (fp32's normal range)")
        _check_real("growth_factor", self.growth_factor, lambda v: 1 < v <= big, "a number > 1, finite in fp32")
        _check_real("backoff_factor", self.backoff_factor, lambda v: tiny <= v < 1, f"a number in [{tiny:.4g}, 1)")
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


def _check_real(name: str, value: object, in_range: Callable[[float], bool], valid: str) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a real number (not a bool or a tensor) in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not in_range(float(value)):
        raise ValueError(f"{name} must be {valid}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Policy(BF16Policy):
    """fp8 matmuls in chosen ``nn.Linear`` layers (torchao's float8 training), bf16 autocast for the rest.

    Needs torchao (``pip install "precisionloop[fp8]"``) and a CUDA GPU of compute capability
    8.9 or higher. fp8 pays only on large matmuls, and only compiled: ``precisionloop.autotune``
    times each layer at the shapes it sees and converts those that gain.

    Args:
        recipe: torchao's scaling recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        layers: names (as in ``model.named_modules()``) of the ``nn.Linear`` layers to convert;
            ``None`` converts every one whose dimensions are multiples of 16, except the
            first and the last. Only plain ``nn.Linear`` layers without hooks convert (torchao
            replaces the module). A policy that would convert no layer is refused.
        emulate: emulate the fp8 matmuls in fp32, on any device (for tests; slow).
        fsdp_float8_all_gather: under ``distributed="fsdp"``, all-gather the converted layers'
            weights in fp8 (torchao's fp8 all-gather: half bf16's traffic), their scales computed
            in one all-reduce after each optimizer step. Only the ``"tensorwise"`` recipe can; the
            others all-gather bf16 and log so. On the CPU (gloo, which has no fp8 dtypes) every
            converted layer needs a bias, or this must be False. A converted weight shared with a
            module that is not converted is refused (the all-gather would untie them). Weights
            changed outside the Trainer's steps and loads (``model.load_state_dict``, an EMA swap)
            keep the old weights' all-gather scales until the next optimizer step, which can clip
            them: change them through ``Trainer.load``.

    Raises:
        ValueError: an unknown recipe, or a flag that is not True or False.
    """

    name: ClassVar[str] = "fp8"

    recipe: str = "tensorwise"
    layers: tuple[str, ...] | None = None
    emulate: bool = False
    fsdp_float8_all_gather: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recipe not in fp8.RECIPES:
            raise ValueError(f"FP8Policy recipe must be one of {', '.join(fp8.RECIPES)}, got {self.recipe!r}")
        for flag in ("emulate", "fsdp_float8_all_gather"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.layers is not None:
            try:  # a generator is read once, here
                names = None if isinstance(self.layers, str) else tuple(self.layers)
            except TypeError:
                names = None
            if names is None or not all(isinstance(n, str) for n in names):
                raise ValueError(f"layers must be a tuple of module names, got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(names))))  # frozen: one canonical form

    def check_model(self, model: nn.Module, device: torch.device | None = None) -> None:
        # Everything that can fail, before the Trainer touches the model or the optimizer.
        fp8.require_torchao()
        fp8.check_unwrapped(model)
        if device is not None:
            fp8.check_device(device, self.emulate)
        fp8.check_layers(model, self.layers)
        kept = self.kept_modules(model)
        both = [n for n in self.layers or () if fp32_modules.within(n, kept)]
        if both:
            raise ValueError(f"FP8Policy layers {', '.join(both)} are also kept in fp32 by keep_fp32; name each in one")
        # Refused whoever converted them: an earlier policy's recipe, emulation and layers would carry on unseen.
        fp8.check_converted(model, allowed=())
        if not self.planned_layers(model):
            why = ("layers=() names none" if self.layers is not None else
                   "no nn.Linear but the first and the last has both dimensions a multiple of 16"
                   if not fp8.default_layers(model) else "keep_fp32 keeps every one in fp32")
            raise ValueError(f"FP8Policy would convert no layer of this {type(model).__name__} to fp8 ({why}), "
                             "training it in plain bf16 under the name fp8; use precision='bf16', or name the "
                             "layers with FP8Policy(layers=...)")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """bf16's preparation, then the chosen ``nn.Linear`` layers converted to fp8 training.

        Raises:
            ValueError: torchao is missing, the device has no fp8 matmuls (and ``emulate``
                is off), or a named layer cannot be converted.
        """
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        fp8.check_device(device, self.emulate)
        model = super().prepare_model(model)
        model, converted = fp8.convert(model, self.recipe, self.emulate, self.layers)
        log.info("fp8: %d nn.Linear layer(s) converted (%s recipe)", len(converted), self.recipe)
        return model

    def prepare_sharding(self, model: nn.Module) -> nn.Module:
        """Wrap the converted layers' weights so FSDP2 all-gathers them in fp8 (tensorwise recipe, flag on).

        Raises:
            ValueError: before any change, as :func:`precisionloop.fp8.wrap_for_fp8_all_gather` says
                (on the CPU, a converted layer without a bias).
        """
        if not self._fp8_all_gather():
            return model
        wrapped = fp8.wrap_for_fp8_all_gather(model)
        log.info("fp8: FSDP2 all-gathers %d layer weight(s) in fp8", len(wrapped))
        return model

    def check_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Refuse, before the conversion, layers whose weights FSDP2 could not all-gather in fp8 (see ``prepare_sharding``)."""
        if not self._fp8_all_gather(quiet=True):
            return
        fp8.check_all_gather(model, self.planned_layers(model), device)

    def kept_modules(self, model: nn.Module) -> set[str]:
        """Names of the modules of the unprepared ``model`` that ``keep_fp32`` keeps in fp32."""
        return {name for name, _ in fp32_modules.select_modules(model, self.keep_fp32)}

    def planned_layers(self, model: nn.Module) -> list[str]:
        """The layers ``prepare_model`` will convert on the unprepared ``model``: chosen or default, none kept in fp32."""
        kept = self.kept_modules(model)
        return [n for n in (fp8.default_layers(model) if self.layers is None else self.layers)
                if not fp32_modules.within(n, kept)]

    def _fp8_all_gather(self, quiet: bool = False) -> bool:
        """Whether FSDP2 all-gathers the converted weights in fp8: the flag is on and the recipe can."""
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise" and not quiet:
            log.info("fp8: FSDP2 all-gathers weights in bf16: fp8 all-gather needs the tensorwise recipe, not %s",
                     self.recipe)
        return self.fsdp_float8_all_gather and self.recipe == "tensorwise"

    def optimizer_step_hook(self, model: nn.Module) -> Callable[[], None] | None:
        """Recompute the fp8 all-gather scales in one all-reduce, when the model all-gathers in fp8."""
        if not fp8.fp8_all_gather_layers(model):
            return None
        return functools.partial(fp8.precompute_scales, model)

    def check_compile(self, mode: str | None, device_type: str) -> None:
        if mode is None and device_type == "cuda":
            warnings.warn("fp8 without torch.compile is known to be slower than bf16 (torchao's casts run "
                          "eagerly); pass compile=True", UserWarning, stacklevel=4)


# The one precision table: canonical name -> factory, then every accepted spelling.
PRECISIONS: dict[str, Callable[[], PrecisionPolicy]] = {
    "fp32": lambda: FP32Policy(tf32=False),
    "tf32": lambda: FP32Policy(tf32=True),
    "bf16": BF16Policy,
    "fp16": FP16Policy,
    "fp8": FP8Policy,
}
_ALIASES = {
    "float32": "fp32", "32": "fp32", "32-true": "fp32", "full": "fp32",
    "bfloat16": "bf16", "bf16-mixed": "bf16",
    "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16",
    "float8": "fp8", "8": "fp8",
}
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def get_policy(spec: str | int | torch.dtype | PrecisionPolicy, device: str | torch.device | None = None) -> PrecisionPolicy:
    """Turn a precision spec into a policy.

    Args:
        spec: ``"fp32"`` (strict, TF32 off), ``"tf32"``, ``"bf16"``, ``"fp16"``,
            ``"auto"``, an alias (float32, bfloat16, float16, half, 32, 16, and
            Lightning's ``"bf16-mixed"``/``"16-mixed"``/``"32-true"``), a torch
            dtype, or a policy instance, which is returned unchanged.
        device: the device that ``"auto"`` chooses for; the current CUDA device
            or the CPU when ``None``.

    Raises:
        ValueError: ``spec`` names no known precision, or ``device`` no device.

    Example:
        >>> from precisionloop import get_policy
        >>> get_policy("BFloat16").name
        'bf16'
    """
    if device is not None:
        _parse_device(device)  # a bad device is an error whatever the spec, not only for "auto"
    if isinstance(spec, PrecisionPolicy):
        return spec
    key = _normalise(spec)
    if key == "auto":
        return _auto_policy(_as_device(device))
    return PRECISIONS[key]()


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


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda' or 'cuda:1'") from None


def _as_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = _parse_device(device)
    if device.type == "meta":
        raise ValueError("device 'meta' holds no data, so nothing can train there; use 'cpu' or 'cuda'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} was requested but this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s): use 'cuda:0' to 'cuda:{torch.cuda.device_count() - 1}', or 'cpu'")
    elif device.type != "cpu":
        # Another backend (a custom policy's hardware) is usable if torch can put a tensor there; its own
        # errors (ModuleNotFoundError, AssertionError, ...) say less than this.
        try:
            torch.empty(0, device=device)
        except Exception as e:
            usable = "'cpu' or 'cuda'" if torch.cuda.is_available() else "'cpu'"
            raise ValueError(f"device {str(device)!r} is not usable with this torch build "
                             f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}); use {usable}") from None
    return device


def _cuda_bf16_native(device: torch.device) -> bool:
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _auto_policy(device: torch.device) -> PrecisionPolicy:
    if device.type == "cuda":
        label = f"{torch.cuda.get_device_name(device)} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        if _cuda_bf16_native(device):
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


def _check_device_support(policy: PrecisionPolicy, device: torch.device) -> None:
    dtype = policy.compute_dtype
    if dtype == torch.float32:
        return
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"precision {policy.name!r} needs autocast, which torch does not offer on {device}; use precision='fp32'")
    if device.type == "cuda" and dtype == torch.bfloat16 and not _cuda_bf16_native(device):
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(
            f"precision {policy.name!r} needs native bf16, but {torch.cuda.get_device_name(device)} on {device} "
            f"has compute capability {cc} (bf16 needs 8.0 or higher); use precision='fp16', which adds loss scaling"
        )
    if device.type == "cpu" and dtype == torch.float16:
        warnings.warn(
            "fp16 autocast on the CPU is supported but very slow (tens of times slower than fp32); "
            "consider precision='bf16' on the CPU",
            UserWarning,
            stacklevel=4,  # the caller of Trainer(...)
        )


# Backend flags. torch >= 2.9 has per-backend `fp32_precision` settings, and mixing them
# with the legacy `allow_tf32` switches raises, so use whichever API this torch provides.
_NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _tf32_flags(tf32: bool) -> tuple:
    if _NEW_TF32_API:
        precision = "tf32" if tf32 else "ieee"
        return (precision, precision, precision)
    return (tf32, tf32)


_FLAGS = _compat.backend_flag_accessors()  # (getter, setter) per TF32 switch, then cudnn.benchmark's
_GETTERS = tuple(get for get, _ in _FLAGS)
_SETTERS = tuple(set_flag for _, set_flag in _FLAGS)


def _read_flags() -> tuple[tuple, bool]:
    """The TF32 switches (``_tf32_flags``'s form) and ``cudnn.benchmark``, as set now."""
    *tf32, benchmark = [get() for get in _GETTERS]
    return tuple(tf32), benchmark


def _write_flags(tf32: tuple, benchmark: bool) -> None:
    """Set the TF32 switches (``_tf32_flags``'s form) and ``cudnn.benchmark``."""
    _set_differing((*tf32, benchmark), (None,) * len(_SETTERS))


def _set_differing(wanted: tuple, now: tuple) -> None:
    """Write each flag whose wanted value differs from ``now``'s (both flat, in ``_FLAGS``'s order)."""
    for set_flag, value, was in zip(_SETTERS, wanted, now):
        if value != was:
            set_flag(value)


class _BackendFlags:
    """The context manager of ``PrecisionPolicy.backend_flags``.

    A class, not a generator: Trainer.step enters one every step. One object may be entered
    again after it exits, but not while it is open (its exit would restore the wrong flags).
    It writes only the flags that differ (a read or write costs ~1 us of host time on some hosts,
    and a standalone step sets and restores them), and on exit restores those that differ from
    what is set then: the block may have changed some too.
    """

    __slots__ = ("_wanted", "_saved", "_open")

    def __init__(self, wanted: tuple[tuple, bool]):
        self._wanted = (*wanted[0], wanted[1])  # flat, as the getters return them
        self._saved: tuple | None = None
        self._open = False

    def __enter__(self) -> None:
        if self._open:
            raise RuntimeError("this backend_flags() context is already open; call policy.backend_flags() again "
                               "for a nested one")
        saved = tuple([get() for get in _GETTERS])
        if saved != self._wanted:  # else already set (inside fit, or for the same policy): nothing to write or restore
            try:
                _set_differing(self._wanted, saved)
            except BaseException:
                with contextlib.suppress(Exception):  # a write refused midway (frozen cuDNN flags, say): undo the rest
                    _set_differing(saved, tuple([get() for get in _GETTERS]))
                raise
            self._saved = saved
        self._open = True

    def __exit__(self, *exc) -> None:
        self._open = False
        if self._saved is not None:
            saved, self._saved = self._saved, None
            _set_differing(saved, tuple([get() for get in _GETTERS]))
