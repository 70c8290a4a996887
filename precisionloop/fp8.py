"""fp8 training through torchao (optional, imported only when needed): requirements, and which layers to convert.

``Float8Linear`` keeps ``nn.Linear``'s ``weight``/``bias`` names, so checkpoints move between fp8 and bf16/fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Callable, ClassVar, Iterable

import torch
from torch import nn

from . import _compat
from . import keep_fp32 as fp32_modules
from .policy import BF16Policy

log = logging.getLogger(__name__)

__all__ = ["FP8Policy", "ALIGNMENT", "RECIPES", "require_torchao", "check_device", "eligible", "eligible_layers", "default_layers",
           "check_layers", "convert", "config", "is_float8_linear", "converted_layers", "check_unwrapped",
           "wrap_for_fp8_all_gather", "check_all_gather", "fp8_all_gather_layers", "precompute_scales"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearConfig.from_recipe_name
INSTALL = 'pip install "precisionloop[fp8]"'
ALIGNMENT = 16  # torch._scaled_mm needs every dimension of both fp8 operands to be a multiple of this


def require_torchao():
    """The ``torchao.float8`` module; a ValueError naming the extra that installs it when torchao is missing."""
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError(f"precision 'fp8' needs torchao, which is not installed: {INSTALL}") from None
    return float8


def check_device(device: torch.device, emulate: bool) -> None:
    """Raise a ValueError unless ``device`` has fp8 matmuls (CUDA compute capability 8.9+) or they are emulated."""
    if emulate:
        return
    hint = "; FP8Policy(emulate=True) emulates fp8 in fp32 (for tests: slow, and no memory saving)"
    if device.type != "cuda":
        raise ValueError(f"precision 'fp8' needs fp8 matmuls, which need a CUDA GPU of compute capability 8.9 or "
                         f"higher (Ada, Hopper or newer), not {device}{hint}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"precision 'fp8' needs fp8 matmuls, which need compute capability 8.9 or higher; "
                         f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}. "
                         f"Use precision='bf16'{hint}")


def eligible(name: str, linear: nn.Module) -> str | None:
    """Why fp8 cannot convert ``linear`` (``name`` in messages): "in_features 30 is not a multiple of 16"; or None."""
    if not isinstance(linear, nn.Linear):
        return f"{name or '<root>'} is a {type(linear).__name__}, not an nn.Linear"
    if is_float8_linear(linear):
        return "already fp8 (Float8Linear)"
    # Float8Linear is built from the weight and bias alone: a subclass's forward (MultiheadAttention's
    # out_proj, LoRA), a parametrization or a hook (weight_norm, pruning) would be lost.
    if type(linear) is not nn.Linear:
        return f"a {type(linear).__name__}, a subclass of nn.Linear whose own behaviour fp8's Float8Linear would drop"
    hooks = [kind for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
             if getattr(linear, kind, None)]
    if hooks:
        return f"it has {', '.join(h.strip('_').replace('_', ' ') for h in hooks)}, which fp8's Float8Linear would drop"
    if not linear.weight.is_floating_point():
        return f"weight dtype {linear.weight.dtype} is not floating point"
    for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features)):
        if size % ALIGNMENT:
            return f"{what} {size} is not a multiple of {ALIGNMENT}"
    return None


def eligible_layers(model: nn.Module) -> tuple[str, ...]:
    """Every ``nn.Linear`` fp8 can convert (:func:`eligible`) and registered under one name, in module order."""
    names = _names_of(model)
    return tuple(name for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and eligible(name, m) is None and len(names[id(m)]) == 1)


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """Every eligible ``nn.Linear`` but the first and the last, the most sensitive (embedding-like input, logits)."""
    inner = set([name for name, m in model.named_modules() if isinstance(m, nn.Linear)][1:-1])
    return tuple(name for name in eligible_layers(model) if name in inner)


def _names_of(model: nn.Module) -> dict[int, list[str]]:
    """Every name each module is registered under (one module can sit in two places)."""
    names: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    return names


def check_layers(model: nn.Module, layers: Iterable[str] | None) -> None:
    """Raise a ValueError, naming the layer and why, unless every named layer is an ``nn.Linear`` fp8 can take."""
    modules = dict(model.named_modules(remove_duplicate=False))
    names = _names_of(model)
    for name in sorted(set(layers or ())):
        module = modules.get(name)
        # The conversion swaps a module under one name; under another it would go on running in bf16.
        others = [repr(n) for n in names[id(module)] if n != name] if module is not None else []
        why = ("no such module" if module is None else f"the same module is also registered as {', '.join(others)}"
               if others else eligible(name, module))
        if why:
            raise ValueError(f"FP8Policy layers: {name!r} cannot be converted to fp8 ({why})")


def convert(model: nn.Module, recipe: str, emulate: bool, layers: Iterable[str] | None) -> tuple[nn.Module, list[str]]:
    """Convert the chosen ``nn.Linear`` layers of ``model`` to fp8 training; returns the model and the names converted.

    ``layers`` are names as in ``model.named_modules()`` (None: :func:`default_layers`); ``emulate`` runs the
    fp8 matmuls on any device (for tests). Modules kept in fp32, and everything inside them, are never converted.

    Raises:
        ValueError: torchao is missing, or a named layer is not an eligible ``nn.Linear`` of the model.
    """
    float8 = require_torchao()
    check_layers(model, layers)
    modules = dict(model.named_modules())
    wanted = set(default_layers(model) if layers is None else layers)
    kept = [name for name, m in modules.items() if fp32_modules.is_kept(m)]
    converted: list[str] = []

    def take(module: nn.Module, fqn: str) -> bool:
        if fqn in wanted and not fp32_modules.within(fqn, kept):
            converted.append(fqn)
            return True
        return False

    model = float8.convert_to_float8_training(model, module_filter_fn=take, config=config(recipe, emulate))
    return model, sorted(converted)


def config(recipe: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, padding inner dimensions (token counts) to multiples of 16."""
    float8 = require_torchao()
    names = [r.value for r in float8.Float8LinearRecipeName]
    if recipe not in names:  # torchao asserts instead, which python -O would skip
        raise ValueError(f"unknown fp8 recipe {recipe!r}; torchao knows {', '.join(names)}")
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, pad_inner_dim=True)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's Float8Linear, sharded or not, without importing torchao."""
    # By name through the MRO: FSDP2 swaps a sharded module's class for a subclass ("FSDPFloat8Linear").
    return any(cls.__name__ == "Float8Linear" for cls in type(module).__mro__)


def converted_layers(model: nn.Module) -> list[str]:
    """Names of the layers an fp8 policy already converted (torchao's Float8Linear)."""
    return [name for name, m in model.named_modules() if is_float8_linear(m)]


def check_unwrapped(model: nn.Module) -> None:
    """Raise a ValueError for a model the user wrapped in DDP or FSDP2: it would be used as it is, without fp8."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, (nn.parallel.DistributedDataParallel, FSDPModule)):
        raise ValueError("precision 'fp8' converts layers before wrapping: pass the plain model and "
                         "distributed='ddp' or 'fsdp' instead of a model you wrapped yourself")


def wrap_for_fp8_all_gather(model: nn.Module) -> list[str]:
    """Make FSDP2 all-gather the converted layers' weights in fp8 instead of bf16; returns the layers' names.

    As torchao's ``Float8Linear.from_float(enable_fsdp_float8_all_gather=True)``: each weight becomes a new
    ``nn.Parameter`` over ``WeightWithDynamicFloat8CastTensor``, which casts each shard to fp8 before the all-gather.
    Call it just before ``fully_shard``, then repoint the optimizer (``distributed.wrap`` does, by name); weights
    already wrapped are left as they are.

    Raises:
        ValueError: before any change: torchao is missing, a layer does not scale its weight tensorwise (the
            only recipe torchao's fp8 all-gather takes), or :func:`check_all_gather` refuses.
    """
    require_torchao()
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    layers = [(name, m) for name, m in model.named_modules()
              if is_float8_linear(m) and not isinstance(m.weight, WeightWithDynamicFloat8CastTensor)]
    for name, m in layers:
        cast = m.config.cast_config_weight
        if cast.scaling_granularity is not ScalingGranularity.TENSORWISE or cast.scaling_type is not ScalingType.DYNAMIC:
            raise ValueError(f"fp8 all-gather needs tensorwise dynamic weight scaling (the 'tensorwise' recipe); layer "
                             f"{name!r} scales its weight {cast.short_str()}")
    if layers:
        check_all_gather(model, [name for name, _ in layers], layers[0][1].weight.device)
    wrapped: dict[int, nn.Parameter] = {}  # one new Parameter per weight: converted layers that share one stay tied
    for _, m in layers:
        m.config = dataclasses.replace(m.config, enable_fsdp_float8_all_gather=True)
        weight = m.weight
        if id(weight) not in wrapped:
            inner = WeightWithDynamicFloat8CastTensor(weight, m.linear_mm_config, m.config.cast_config_weight.target_dtype)
            wrapped[id(weight)] = nn.Parameter(inner, requires_grad=weight.requires_grad)
        m.weight = wrapped[id(weight)]
    return [name for name, _ in layers]


def check_all_gather(model: nn.Module, names: Iterable[str], device: torch.device) -> None:
    """Raise unless FSDP2 can all-gather the weights of layers ``names`` in fp8 on ``device``, converted yet or not.

    Raises:
        ValueError: a weight is shared with a module not among ``names`` (a tied embedding and head): the
            new Parameter would untie them. Or, on the CPU (gloo), a layer has no bias.
    """
    modules = dict(model.named_modules())
    layers = [(name, modules[name]) for name in names if name in modules]
    chosen = {id(m) for _, m in layers}
    owners: dict[int, list[str]] = {}
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        if id(owner) not in chosen:
            for p in owner.parameters(recurse=False):
                owners.setdefault(id(p), []).append(owner_name or "<root>")
    tied = [(name, owners[id(m.weight)][0]) for name, m in layers if id(m.weight) in owners]
    if tied:
        raise ValueError(f"layer {tied[0][0]!r} shares its weight with {tied[0][1]!r}, which is not converted to fp8; "
                         "FSDP2's fp8 all-gather would untie them. Convert both (FP8Policy(layers=...)) or pass "
                         "FP8Policy(fsdp_float8_all_gather=False)")
    # FSDP2 packs one module's all-gather inputs into one buffer: uint8 for mixed dtypes (fp8 weight and bias),
    # but fp8 for fp8 weights alone, which gloo refuses ("Invalid scalar type") at the first forward.
    bare = [name for name, m in layers if torch.device(device).type == "cpu" and m.bias is None]
    if bare:
        raise ValueError(f"fp8 all-gather on the CPU runs over gloo, which cannot all-gather fp8 tensors, and FSDP2 "
                         f"may all-gather the fp8 weight of a layer without a bias alone ({', '.join(bare[:5])}); "
                         "use FP8Policy(fsdp_float8_all_gather=False) on the CPU")


def fp8_all_gather_layers(model: nn.Module) -> list[str]:
    """Names of the layers FSDP2 all-gathers in fp8: a DTensor weight over ``WeightWithDynamicFloat8CastTensor``."""
    if not converted_layers(model):
        return []  # no fp8 layer: no need to import torchao
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    with torch.no_grad():  # to_local() without autograd history on the shard
        return [name for name, m in model.named_modules() if is_float8_linear(m)
                and isinstance(m.weight, DTensor) and isinstance(m.weight.to_local(), WeightWithDynamicFloat8CastTensor)]


def precompute_scales(model: nn.Module) -> None:
    """Compute the fp8 scales of every fp8-all-gathered weight of ``model`` in one all-reduce.

    torchao's ``precompute_float8_dynamic_scale_for_fsdp``; without it each layer's all-gather all-reduces its own
    amax. Call it whenever the weights change (optimizer step, checkpoint load): a stale scale would clip larger ones.
    """
    require_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Policy(BF16Policy):
    """fp8 matmuls in chosen ``nn.Linear`` layers (torchao's float8 training), bf16 autocast for the rest.

    Needs torchao (``pip install "precisionloop[fp8]"``) and a CUDA GPU of compute capability 8.9 or higher. fp8
    pays only on large matmuls, and only compiled: ``precisionloop.autotune`` times it at the default layers and at
    every layer it can take.

    Args:
        recipe: torchao's scaling recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        layers: names (as in ``model.named_modules()``) of the ``nn.Linear`` layers to convert; ``None``: every one
            with both dimensions multiples of 16 but the first and the last. Only plain ``nn.Linear`` layers without
            hooks convert (torchao replaces the module); a policy that would convert no layer is refused.
        emulate: emulate the fp8 matmuls in fp32, on any device (for tests; slow).
        fsdp_float8_all_gather: under ``distributed="fsdp"``, all-gather the converted layers' weights in fp8 (half
            bf16's traffic), their scales computed in one all-reduce after each optimizer step. Only the
            ``"tensorwise"`` recipe can; the others all-gather bf16 and log so. On the CPU (gloo has no fp8 dtypes)
            every converted layer needs a bias, or this must be False. A converted weight shared with an unconverted
            module is refused (the all-gather would untie them). Weights changed outside the Trainer's steps and
            loads (``model.load_state_dict``, an EMA swap) keep stale scales until the next optimizer step, which can
            clip them: change them through ``Trainer.load``.

    Raises:
        ValueError: an unknown recipe, a flag that is not True or False, or ``layers`` that are not module names.
    """

    name: ClassVar[str] = "fp8"

    recipe: str = "tensorwise"
    layers: tuple[str, ...] | None = None
    emulate: bool = False
    fsdp_float8_all_gather: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recipe not in RECIPES:
            raise ValueError(f"FP8Policy recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
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
        require_torchao()
        check_unwrapped(model)
        if device is not None:
            check_device(device, self.emulate)
        check_layers(model, self.layers)
        kept = self.kept_modules(model)
        both = [n for n in self.layers or () if fp32_modules.within(n, kept)]
        if both:
            raise ValueError(f"FP8Policy layers {', '.join(both)} are also kept in fp32 by keep_fp32; name each in one")
        # Refused whoever converted them: an earlier policy's recipe, emulation and layers would carry on unseen.
        super().check_model(model, device)
        if not self.planned_layers(model):
            why = ("layers=() names none" if self.layers is not None else
                   "no nn.Linear but the first and the last has both dimensions a multiple of 16"
                   if not default_layers(model) else "keep_fp32 keeps every one in fp32")
            raise ValueError(f"FP8Policy would convert no layer of this {type(model).__name__} to fp8 ({why}), "
                             "training it in plain bf16 under the name fp8; use precision='bf16', or name the "
                             "layers with FP8Policy(layers=...)")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """bf16's preparation, then the chosen ``nn.Linear`` layers converted to fp8 training.

        Raises:
            ValueError: torchao is missing, no fp8 matmuls here (``emulate`` off), or a layer cannot be converted.
        """
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        check_device(device, self.emulate)
        model = super().prepare_model(model)
        model, converted = convert(model, self.recipe, self.emulate, self.layers)
        log.info("fp8: %d nn.Linear layer(s) converted (%s recipe)", len(converted), self.recipe)
        return model

    def prepare_sharding(self, model: nn.Module) -> nn.Module:
        """Wrap the converted layers' weights so FSDP2 all-gathers them in fp8 (tensorwise recipe, flag on).

        Raises:
            ValueError: before any change, as :func:`wrap_for_fp8_all_gather` says (on the CPU, a layer without a bias).
        """
        if not self._fp8_all_gather():
            return model
        wrapped = wrap_for_fp8_all_gather(model)
        log.info("fp8: FSDP2 all-gathers %d layer weight(s) in fp8", len(wrapped))
        return model

    def check_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Refuse, before conversion, layers FSDP2 could not all-gather in fp8 (see ``prepare_sharding``)."""
        if not self._fp8_all_gather(quiet=True):
            return
        check_all_gather(model, self.planned_layers(model), device)

    def kept_modules(self, model: nn.Module) -> set[str]:
        """Names of the modules of the unprepared ``model`` that ``keep_fp32`` keeps in fp32."""
        return {name for name, _ in fp32_modules.select_modules(model, self.keep_fp32)}

    def planned_layers(self, model: nn.Module) -> list[str]:
        """The layers ``prepare_model`` converts in the unprepared ``model``: chosen or default, not kept in fp32."""
        kept = self.kept_modules(model)
        return [n for n in (default_layers(model) if self.layers is None else self.layers)
                if not fp32_modules.within(n, kept)]

    def _fp8_all_gather(self, quiet: bool = False) -> bool:
        """Whether FSDP2 all-gathers the converted weights in fp8: the flag is on and the recipe can."""
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise" and not quiet:
            log.info("fp8: FSDP2 all-gathers weights in bf16: fp8 all-gather needs the tensorwise recipe, not %s",
                     self.recipe)
        return self.fsdp_float8_all_gather and self.recipe == "tensorwise"

    def optimizer_step_hook(self, model: nn.Module) -> Callable[[], None] | None:
        """Recompute the fp8 all-gather scales in one all-reduce, when the model all-gathers in fp8."""
        if not fp8_all_gather_layers(model):
            return None
        return functools.partial(precompute_scales, model)

    def check_compile(self, mode: str | None, device_type: str) -> None:
        if mode is None and device_type == "cuda":
            warnings.warn("fp8 without torch.compile is known to be slower than bf16 (torchao's casts run "
                          "eagerly); pass compile=True", UserWarning, stacklevel=_compat.stacklevel_outside_package())
