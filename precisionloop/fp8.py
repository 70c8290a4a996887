"""fp8 training through torchao's float8 (an optional dependency, imported only when a policy needs it)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import ClassVar

import torch
from torch import nn

from . import _compat, keep_fp32 as fp32_modules
from .policy import BF16Policy, compute_capability, converted_layers

__all__ = ["FP8Policy", "default_layers", "converted_layers"]

_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
_ALIGNMENT = 16  # torch._scaled_mm needs both dimensions of each fp8 operand to be multiples of 16


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """The layers ``FP8Policy()`` converts: every plain ``nn.Linear`` with both dimensions multiples of 16 but the
    model's first and last ``nn.Linear``, the most sensitive to rounding (embedding-like input, logits)."""
    inner = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)][1:-1]
    return tuple(name for name, m in inner if _unfit(m) is None)


def _unfit(module: nn.Module) -> str | None:
    """Why torchao cannot convert ``module`` to fp8 training, or None when it can."""
    # Float8Linear is rebuilt from the weight and bias alone: a subclass's forward (LoRA, MultiheadAttention's
    # out_proj, a parametrization such as weight_norm) or a hook would be lost.
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__}, not a plain nn.Linear"
    if module._forward_hooks or module._forward_pre_hooks:
        return "it has forward hooks, which the conversion would drop"
    sizes = {"in_features": module.in_features, "out_features": module.out_features}
    return next((f"{k} {v} is not a multiple of {_ALIGNMENT}" for k, v in sizes.items() if v % _ALIGNMENT), None)


def require_torchao():
    """torchao's ``float8`` module; a ValueError naming the extra that installs it when torchao is missing."""
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError("precision 'fp8' needs torchao: pip install \"precisionloop[fp8]\"") from None
    return float8


def check_device(device: torch.device, emulate: bool) -> None:
    """Raise unless ``device`` has fp8 matmuls (CUDA compute capability 8.9+) or they are emulated."""
    if emulate or compute_capability(device) >= (8, 9):
        return
    here = (f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, compute_capability(device)))}"
            if device.type == "cuda" else f"not {device}")
    raise ValueError(f"precision 'fp8' needs fp8 matmuls, which need a CUDA GPU of compute capability 8.9 or higher "
                     f"(Ada, Hopper or newer); {here}. Use precision='bf16', or FP8Policy(emulate=True) to emulate "
                     "fp8 in fp32 (for tests: slow, and no memory saved)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Policy(BF16Policy):
    """fp8 matmuls in chosen ``nn.Linear`` layers through torchao's float8 training, bf16 autocast for the rest.

    Needs torchao (``pip install "precisionloop[fp8]"``) and a CUDA GPU of compute capability 8.9 or higher. fp8 pays
    only on large matmuls, and only compiled. Modules that ``keep_fp32`` keeps are never converted.

    Args:
        recipe: torchao's scaling recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        layers: names (as in ``model.named_modules()``) of the layers to convert, each a plain ``nn.Linear``
            without hooks and with both dimensions multiples of 16; ``None``: :func:`default_layers`.
        emulate: emulate the fp8 matmuls in fp32, on any device (for tests: slow).

    Raises:
        ValueError: an unknown recipe, ``emulate`` not True or False, or ``layers`` not a tuple of names.
    """

    name: ClassVar[str] = "fp8"
    recipe: str = "tensorwise"
    layers: tuple[str, ...] | None = None
    emulate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recipe not in _RECIPES:
            raise ValueError(f"FP8Policy recipe must be one of {', '.join(_RECIPES)}, got {self.recipe!r}")
        if not isinstance(self.emulate, bool):
            raise ValueError(f"emulate must be True or False, got {self.emulate!r}")
        if self.layers is not None:
            names = tuple(self.layers) if isinstance(self.layers, (tuple, list, set, frozenset)) else (None,)
            if not all(isinstance(n, str) for n in names):  # a str alone would be read as its characters
                raise ValueError(f"layers must be a tuple of module names, got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(names))))  # frozen: one canonical form

    def check_model(self, model: nn.Module, device: torch.device | None = None) -> None:
        """A ValueError, before anything changes, if torchao is missing, ``device`` has no fp8 matmuls, the model is
        wrapped (DDP or FSDP2 would train it without fp8), a named layer cannot be converted or is kept, or none is."""
        require_torchao()
        if _compat.is_wrapped(model):
            raise ValueError("precision 'fp8' converts layers before wrapping: pass the plain model and "
                             "distributed='ddp' or 'fsdp' instead of a model you wrapped yourself")
        super().check_model(model, device)  # keep_fp32 patterns; layers an earlier FP8Policy converted
        if device is not None:
            check_device(device, self.emulate)
        modules = dict(model.named_modules())
        for name in self.layers or ():
            why = "no such module" if name not in modules else _unfit(modules[name])
            if why:
                raise ValueError(f"FP8Policy layers: {name!r} cannot be converted to fp8 ({why})")
        planned = self._planned(model)
        kept = sorted(set(self.layers or ()) - set(planned))
        if kept:
            raise ValueError(f"FP8Policy layers {', '.join(kept)} are also kept in fp32 by keep_fp32; name each in one")
        if not planned:
            raise ValueError(f"FP8Policy would convert no layer of this {type(model).__name__} to fp8, training it in "
                             "plain bf16 under the name fp8 (by default it converts every nn.Linear with both "
                             "dimensions multiples of 16 but the first and the last, never one keep_fp32 keeps); use "
                             "precision='bf16', or name the layers with FP8Policy(layers=...)")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """bf16's preparation, then the chosen layers converted to torchao's ``Float8Linear`` in place; a ValueError
        if torchao is missing or the model's device has no fp8 matmuls (``emulate`` off)."""
        float8 = require_torchao()
        check_device(next((p.device for p in model.parameters()), torch.device("cpu")), self.emulate)
        model = super().prepare_model(model)
        planned = set(self._planned(model))
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulate,
                                     pad_inner_dim=True)  # token counts not multiples of 16: padded, not refused
        logging.getLogger(__name__).info("fp8: %d nn.Linear layer(s) converted (%s recipe)", len(planned), self.recipe)
        return float8.convert_to_float8_training(model, module_filter_fn=lambda _, name: name in planned, config=config)

    def check_compile(self, mode: str | None, device_type: str) -> None:
        """Warn that uncompiled fp8 on CUDA is slower than bf16."""
        if mode is None and device_type == "cuda":
            warnings.warn("fp8 without torch.compile is known to be slower than bf16 (torchao's casts run "
                          "eagerly); pass compile=True", UserWarning, stacklevel=_compat.stacklevel_outside_package())

    def _planned(self, model: nn.Module) -> list[str]:
        """The layers to convert: chosen or default, less those ``keep_fp32`` keeps (or that sit inside one)."""
        kept = [name for name, _ in fp32_modules.select_modules(model, self.keep_fp32)]
        chosen = default_layers(model) if self.layers is None else self.layers
        return [name for name in chosen if not fp32_modules.within(name, kept)]
