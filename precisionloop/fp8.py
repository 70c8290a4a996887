"""fp8 training through torchao: the requirements, and which ``nn.Linear`` layers to convert.

torchao is an optional dependency (``pip install "precisionloop[fp8]"``); it is imported only
when an fp8 policy prepares a model. Converted layers (torchao's ``Float8Linear``) keep the
``weight``/``bias`` names of ``nn.Linear``, so checkpoints move between fp8 and bf16/fp32 runs.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from . import fp32_modules

__all__ = ["ALIGNMENT", "RECIPES", "require_torchao", "check_device", "eligible", "default_layers", "check_layers",
           "convert", "config", "converted_layers", "check_converted", "check_unwrapped"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``)."""

INSTALL = 'pip install "precisionloop[fp8]"'


def require_torchao():
    """The ``torchao.float8`` module.

    Raises:
        ValueError: torchao is not installed; the message names the extra that installs it.
    """
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError(f"precision 'fp8' needs torchao, which is not installed: {INSTALL}") from None
    return float8


def check_device(device: torch.device, emulate: bool) -> None:
    """Raise unless ``device`` has fp8 matmuls (CUDA compute capability 8.9 or higher), or they are emulated.

    Raises:
        ValueError: naming the requirement and the device.
    """
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


ALIGNMENT = 16
"""torch._scaled_mm needs every dimension of both fp8 operands to be a multiple of this."""


def eligible(name: str, linear: nn.Module, tokens: int | Iterable[int] | None = None) -> str | None:
    """Why ``linear`` cannot be converted to fp8, or None if it can.

    torch._scaled_mm needs every dimension of its operands to be a multiple of 16. In and out
    features must be; token counts (the weight gradient's inner dimension) are padded by
    :func:`config`.

    Args:
        name: the layer's fully qualified name, for the message.
        linear: the layer.
        tokens: the token count(s) its inputs had (see :class:`LinearShape`); not checked if None.

    Returns:
        a short reason, such as "in_features 30 is not a multiple of 16", or None.
    """
    if not isinstance(linear, nn.Linear):
        return f"{name or '<root>'} is a {type(linear).__name__}, not an nn.Linear"
    if type(linear).__name__ == "Float8Linear":
        return "already fp8 (Float8Linear)"
    if not linear.weight.is_floating_point():
        return f"weight dtype {linear.weight.dtype} is not floating point"
    for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features)):
        if size % ALIGNMENT:
            return f"{what} {size} is not a multiple of {ALIGNMENT}"
    counts = [tokens] if isinstance(tokens, int) else list(tokens or [])
    if any(count == 0 for count in counts):
        return "no tokens: called on an empty input"
    return None  # unaligned token counts are padded (see config)


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """Every eligible ``nn.Linear`` but the first and the last, which are the most sensitive (embedding-like input, logits)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    inner = linears[1:-1]
    return tuple(name for name, m in inner if eligible(name, m) is None)


def check_layers(model: nn.Module, layers: Iterable[str] | None) -> None:
    """Raise unless every named layer is an ``nn.Linear`` of ``model`` that fp8 kernels can take.

    Raises:
        ValueError: naming the layer and why.
    """
    modules = dict(model.named_modules())
    for name in sorted(set(layers or ())):
        module = modules.get(name)
        why = "no such module" if module is None else eligible(name, module)
        if why:
            raise ValueError(f"FP8Policy layers: {name!r} cannot be converted to fp8 ({why})")


def convert(model: nn.Module, recipe: str, emulate: bool, layers: Iterable[str] | None) -> tuple[nn.Module, list[str]]:
    """Convert the chosen ``nn.Linear`` layers of ``model`` to fp8 training; returns the model and the names converted.

    Modules kept in fp32 (``keep_fp32``), and everything inside them, are never converted.

    Args:
        model: the model, already on its device.
        recipe: one of :data:`RECIPES`.
        emulate: emulate the fp8 matmuls (any device; for tests).
        layers: the names (as in ``model.named_modules()``) to convert; None for :func:`default_layers`.

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
        if fqn in wanted and not any(fqn == k or fqn.startswith(f"{k}.") or k == "" for k in kept):
            converted.append(fqn)
            return True
        return False

    model = float8.convert_to_float8_training(model, module_filter_fn=take, config=config(recipe, emulate))
    return model, sorted(converted)


def config(recipe: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, padding inner dimensions to multiples of 16.

    Padding lets any token count through (the weight gradient's inner dimension is the number of
    tokens, which a last partial batch or a ViT's 197 tokens would otherwise make unaligned).
    """
    float8 = require_torchao()
    names = [r.value for r in float8.Float8LinearRecipeName]
    if recipe not in names:  # torchao asserts instead, which python -O would skip
        raise ValueError(f"unknown fp8 recipe {recipe!r}; torchao knows {', '.join(names)}")
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, pad_inner_dim=True)


def converted_layers(model: nn.Module) -> list[str]:
    """Names of the layers an fp8 policy already converted (torchao's Float8Linear)."""
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def check_converted(model: nn.Module, allowed: Iterable[str] | None) -> None:
    """Refuse a model with fp8 layers this policy would not have converted (``allowed`` None: any).

    torchao's conversion cannot be undone, so a model trained under fp8 and then handed to a
    bf16 Trainer would silently keep training those layers in fp8.

    Raises:
        ValueError: naming the converted layers.
    """
    extra = [n for n in converted_layers(model) if allowed is not None and n not in set(allowed)]
    if extra:
        raise ValueError(f"layers {', '.join(extra[:5])} were converted to fp8 by an earlier FP8Policy, and torchao's "
                         "conversion cannot be undone; build the model anew (load its state_dict into a fresh one, "
                         "the keys are the same) to train it under this policy")


def check_unwrapped(model: nn.Module) -> None:
    """Refuse a model the user already wrapped in DDP or FSDP2: it would be used as it is, without fp8.

    Raises:
        ValueError: saying to pass the plain model with ``distributed=``.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, (nn.parallel.DistributedDataParallel, FSDPModule)):
        raise ValueError("precision 'fp8' converts layers before wrapping: pass the plain model and "
                         "distributed='ddp' or 'fsdp' instead of a model you wrapped yourself")

