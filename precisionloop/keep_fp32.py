"""Chosen submodules run in float32 inside autocast. Only each kept instance's ``forward`` is replaced: ``state_dict``
keys, ``repr`` and ``type(module)`` (which FSDP2 swaps) stay, and dynamo traces it without a graph break."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["validate_keep_fp32", "select_modules", "keep_fp32_", "is_kept", "within"]


def validate_keep_fp32(entries: Any) -> tuple:
    """``entries`` as a tuple in one order without duplicates, so policies keeping the same modules are equal.

    Args:
        entries: one or a tuple or list of ``nn.Module`` subclasses (``isinstance``) or ``fnmatch`` name patterns.

    Raises:
        TypeError: an entry is neither (a module instance, say).
        ValueError: an empty pattern.
    """
    entries = list(entries) if isinstance(entries, (tuple, list)) else [entries]
    for entry in entries:
        if entry == "":
            raise ValueError("keep_fp32's empty pattern '' matches only the root; '*' matches every module")
        if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
            raise TypeError(f"keep_fp32 takes nn.Module subclasses and str name patterns, not {entry!r}"
                            f"{' (pass the class, not an instance)' if isinstance(entry, nn.Module) else ''}")
    names = {e: e if isinstance(e, str) else f"{e.__module__}.{e.__qualname__}" for e in entries}
    return tuple(sorted(names, key=lambda e: (isinstance(e, str), names[e])))


def select_modules(model: nn.Module, entries: Any) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs that ``entries`` keeps, outermost only, in module order (a ModuleList or
    ModuleDict, never called itself, stands for what it holds). A class may match nothing, a pattern may not.

    Raises:
        TypeError, ValueError: as :func:`validate_keep_fp32`; ValueError naming close names for a pattern matching none.
    """
    entries = validate_keep_fp32(entries)
    classes, patterns = tuple(e for e in entries if isinstance(e, type)), [e for e in entries if isinstance(e, str)]
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in ["", *names]):
            close = difflib.get_close_matches(pattern, names, n=5) or names[:5]
            raise ValueError(f"keep_fp32 pattern {pattern!r} matches no module; close names: {', '.join(close)}")
    selected: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():  # parents first: autocast is already off inside a kept one
        if not within(name, [n for n, _ in selected]) and (
                isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            selected += _called(name, module)
    return selected


def _called(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    return [pair for child, m in module.named_children() for pair in _called(f"{name}.{child}" if name else child, m)]


def keep_fp32_(model: nn.Module, entries: Any) -> list[str]:
    """Make the modules ``entries`` selects run with autocast off on float32 inputs, in place; returns their names.
    Modules kept before but not selected now run normally again.

    Raises:
        TypeError, ValueError: as :func:`select_modules`, before any change.
    """
    selected = select_modules(model, entries)
    for module in [m for m in model.modules() if is_kept(m)]:  # back to their earlier forward: none wrapped twice
        if (inner := module.__dict__.pop("forward").inner) is not None:
            module.forward = inner
    for _, module in selected:
        module.forward = _FP32Forward(module)
    return [name for name, _ in selected]


def is_kept(module: nn.Module) -> bool:
    """Whether :func:`keep_fp32_` made ``module`` run in float32."""
    return isinstance(module.__dict__.get("forward"), _FP32Forward)


def within(name: str, names: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``names`` or inside one (the root, ``""``, holds every module)."""
    return any(name == n or n == "" or name.startswith(n + ".") for n in names)


class _FP32Forward:
    """A kept module's ``forward``: the instance's earlier one, else the class's, looked up at each call (FSDP2 swaps
    the class). It holds the module, not a bound method: a cycle, which deepcopy and pickle handle."""

    def __init__(self, module: nn.Module):
        self.module, self.inner = module, module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Inputs below fp32 cast up; float64 left alone, as custom_fwd does.
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.float() if t.is_floating_point() and t.element_size() < 4 else t, (args, kwargs))
        # Both always: disabling an inactive autocast is free, and fixed blocks trace cleanly.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)  # dynamo traces no function.__get__

    @property
    def __wrapped__(self) -> Any:  # also what inspect.signature(module.forward) reports
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
