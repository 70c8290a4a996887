"""Keep chosen submodules in float32 while the rest of the model runs under autocast.

Only each kept instance's ``forward`` is replaced, so ``state_dict`` keys, ``repr`` and ``type(module)`` (which
FSDP2 swaps) are unchanged, an exception cannot leave autocast off, and dynamo traces it without a graph break.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["validate_keep_fp32", "select_modules", "keep_fp32_", "is_kept", "within", "entry_names", "entries_from_text"]

_VALID = "an nn.Module subclass (matched with isinstance) or a str pattern (fnmatch over named_modules() names)"


def validate_keep_fp32(entries: Any) -> tuple:
    """Normalise a ``keep_fp32`` option to a hashable tuple: duplicates dropped, classes then patterns, sorted.

    Args:
        entries: one entry or a tuple/list of them; an entry is an ``nn.Module`` subclass (matched with
            ``isinstance``) or a non-empty ``str`` pattern (``fnmatch.fnmatchcase`` over ``named_modules()`` names).

    Raises:
        TypeError: an entry is neither (a module instance, an int, ``None``).
        ValueError: a pattern is empty (it would match only the root module).

    Example:
        >>> validate_keep_fp32([nn.LayerNorm, "head", nn.LayerNorm])
        (<class 'torch.nn.modules.normalization.LayerNorm'>, 'head')
    """
    items = list(entries) if isinstance(entries, (tuple, list)) else [entries]  # iterating a str gives its characters
    out: list = []
    for entry in items:
        if isinstance(entry, str):
            if not entry:
                raise ValueError("keep_fp32 got the empty pattern '', which matches only the root module; "
                                 "use '*' to keep every module in float32")
        elif not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            hint = " (pass the class, not an instance)" if isinstance(entry, nn.Module) else ""
            raise TypeError(f"keep_fp32 entries must each be {_VALID}; got {entry!r}{hint}")
        if entry not in out:
            out.append(entry)
    # One canonical order, so policies naming the same modules compare and hash equal.
    return tuple(sorted(out, key=lambda e: (isinstance(e, str), entry_names([e])[0])))


def select_modules(model: nn.Module, entries: Any) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs of ``model`` that ``entries`` selects, outermost only, in tree order.

    A class matching nothing is fine (a policy may list ``nn.LayerNorm`` for models without one); a pattern
    matching nothing is almost always a typo. A ModuleList or ModuleDict stands for the modules it holds.

    Raises:
        TypeError, ValueError: as :func:`validate_keep_fp32`; ValueError also for a pattern that matches no module.
    """
    entries = validate_keep_fp32(entries)
    classes = tuple(e for e in entries if isinstance(e, type))
    patterns = [e for e in entries if isinstance(e, str)]
    named = list(model.named_modules())
    names = [name for name, _ in named]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(_no_match_message(model, pattern, names))
    selected: list[tuple[str, nn.Module]] = []
    outer: list[str] = []  # names matched, containers included
    for name, module in named:
        if not (isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            continue
        # Inside a kept ancestor autocast is already off and inputs fp32: a second wrapper would only cost.
        # named_modules() is pre-order, so an ancestor is already in `outer`.
        if any(_is_descendant(name, o) for o in outer):
            continue
        outer.append(name)
        selected.extend(_callable_parts(name, module))
    return selected


def _callable_parts(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A ModuleList or ModuleDict is never called, so keeping it means keeping what it holds."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    prefix = f"{name}." if name else ""
    return [part for child_name, child in module.named_children() for part in _callable_parts(prefix + child_name, child)]


def keep_fp32_(model: nn.Module, entries: Any) -> list[str]:
    """Make the selected submodules of ``model`` run in float32, in place; returns their names.

    Their forward runs with autocast off (cpu, cuda and the inputs' device type) and float inputs below fp32, nested
    in tuples, lists and dicts too, cast to float32 (float64 left alone, as ``custom_fwd`` does). The kept set becomes
    exactly what ``entries`` selects: nothing is wrapped twice, and modules kept before but not now run normally.

    Raises:
        TypeError, ValueError: as :func:`select_modules`.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> keep_fp32_(model, [nn.LayerNorm])
        ['1']
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.randn(2, 4)).dtype
        torch.float32
    """
    selected = select_modules(model, entries)
    chosen = {id(module) for _, module in selected}
    for module in model.modules():
        if is_kept(module) and id(module) not in chosen:
            _release(module)
    for _, module in selected:
        if not is_kept(module):
            module.forward = _FP32Forward(module)
    return [name for name, _ in selected]


def _release(module: nn.Module) -> None:
    wrapper = module.__dict__["forward"]
    if wrapper.inner is not None:
        module.forward = wrapper.inner
    else:
        del module.forward


def is_kept(module: nn.Module) -> bool:
    """True for a module that :func:`keep_fp32_` made run in float32."""
    return isinstance(module.__dict__.get("forward"), _FP32Forward)


def entries_from_text(text: str) -> tuple:
    """``keep_fp32`` entries from comma-separated names: a ``torch.nn`` module class by its name, else a pattern.

    Example:
        >>> entries_from_text("LayerNorm, head")
        (<class 'torch.nn.modules.normalization.LayerNorm'>, 'head')
    """
    entries = []
    for name in filter(None, (n.strip() for n in text.split(","))):
        cls = getattr(nn, name, None)
        entries.append(cls if isinstance(cls, type) and issubclass(cls, nn.Module) else name)
    return validate_keep_fp32(entries)


def entry_names(entries: tuple) -> list[str]:
    """``keep_fp32`` entries as strings (classes by their qualified name), for checkpoints and messages."""
    return [e if isinstance(e, str) else f"{e.__module__}.{e.__qualname__}" for e in entries]


class _FP32Forward:
    """A kept module's ``forward``: autocast off, fp32 inputs. It holds the module, not a bound method (a cycle deepcopy
    and pickle handle), and calls the instance's earlier ``forward`` if any, else the class's, looked up at call time
    so that FSDP2's class swap is honoured."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner: Callable | None = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        # cpu and cuda always: disabling an inactive autocast is free and fixed blocks trace cleanly.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            other = _other_device_type(args, kwargs)
            if other is None:
                return self._forward(*args, **kwargs)
            with torch.autocast(other, enabled=False):
                return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __wrapped__(self) -> Callable:
        # inspect.signature(module.forward) reports the real signature; a property pickles nothing extra
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __repr__(self) -> str:
        return f"<keep_fp32 forward of {type(self.module).__name__}>"


def _to_fp32(value: Any) -> Any:
    """``value`` with every sub-fp32 floating-point tensor in it cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64) else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple: rebuild by position
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_fp32(v)) for k, v in value.items())
    return value


def _other_device_type(args: tuple, kwargs: dict) -> str | None:
    """The device type of the first top-level tensor input, if autocast exists for it and it is not cpu/cuda."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "cuda"):
            # torch.autocast raises for device types without autocast (meta, older mps)
            available = getattr(torch.amp, "is_autocast_available", lambda _: False)
            return value.device.type if available(value.device.type) else None
    return None


def _is_descendant(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(ancestor + "."))


def within(name: str, modules: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one (``""``, the root, holds every module)."""
    return any(name == m or _is_descendant(name, m) for m in modules)


def _no_match_message(model: nn.Module, pattern: str, names: list[str]) -> str:
    candidates = [n for n in names if n]  # the root's name "" is never a useful suggestion
    close = difflib.get_close_matches(pattern, candidates, n=5) or candidates[:5]
    listed = ", ".join(repr(n) for n in close) if close else "(it has no submodules)"
    return f"keep_fp32 pattern {pattern!r} matches no module of {type(model).__name__}; close module names: {listed}"
