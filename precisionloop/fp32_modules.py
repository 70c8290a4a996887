"""Keep chosen submodules in float32 while the rest of the model runs under autocast.

A policy's ``keep_fp32`` option names modules (by class or by name pattern) whose
forward must not run in bf16/fp16: normalisation layers, a loss head, a softmax
over many classes. :func:`keep_fp32_` makes such a module run with autocast
disabled and its low-precision floating-point inputs cast to float32.

The mechanism replaces the *instance's* ``forward`` with a small picklable
callable object, rather than inserting a wrapper module or registering hooks:

* no module is added to the tree, so ``state_dict`` keys and ``repr`` are unchanged;
* ``type(module)`` is unchanged, so FSDP2's ``fully_shard`` (which swaps the
  class for a generated subclass) and ``isinstance`` checks keep working;
* the autocast-disabled region is a ``with`` block inside the call, so an
  exception cannot leave it open (a pre-hook/post-hook pair could);
* the object holds the module itself, not a bound method, so ``copy.deepcopy``
  and pickling of the model work (a bound method is pickled as
  ``getattr(module, "forward")``, which would resolve to the wrapper itself);
* dynamo traces the ``with torch.autocast(..., enabled=False)`` block, so
  ``torch.compile`` of the model needs no graph break for it.
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
    """Normalise a ``keep_fp32`` option to a hashable tuple of entries.

    Args:
        entries: a tuple or list of entries, or a single entry. An entry is an
            ``nn.Module`` subclass (matches its instances and their subclasses'
            instances) or a non-empty ``str`` pattern matched with
            ``fnmatch.fnmatchcase`` against the names of ``model.named_modules()``.

    Returns:
        A tuple of the entries, duplicates dropped, classes first then patterns, each
        sorted by name (so two policies with the same modules compare and hash equal).

    Raises:
        TypeError: an entry is neither a ``str`` nor an ``nn.Module`` subclass
            (for example a module instance, an int, or ``None``).
        ValueError: a pattern is the empty string (it would match only the root module).

    Example:
        >>> from torch import nn
        >>> validate_keep_fp32([nn.LayerNorm, "head", nn.LayerNorm])
        (<class 'torch.nn.modules.normalization.LayerNorm'>, 'head')
        >>> validate_keep_fp32("blocks.*.norm")
        ('blocks.*.norm',)
    """
    # A bare str or class is one entry; iterating a str would give its characters.
    items = list(entries) if isinstance(entries, (tuple, list)) else [entries]
    out: list = []
    for entry in items:
        if isinstance(entry, str):
            if not entry:
                raise ValueError(
                    "keep_fp32 got the empty pattern '', which matches only the root module; "
                    "use '*' to keep every module in float32"
                )
        elif not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            hint = " (pass the class, not an instance)" if isinstance(entry, nn.Module) else ""
            raise TypeError(f"keep_fp32 entries must each be {_VALID}; got {entry!r}{hint}")
        if entry not in out:
            out.append(entry)
    # One canonical order, so policies naming the same modules compare and hash equal.
    return tuple(sorted(out, key=lambda e: (isinstance(e, str), e if isinstance(e, str) else f"{e.__module__}.{e.__qualname__}")))


def select_modules(model: nn.Module, entries: Any) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``entries`` selects, outermost first in tree order.

    A module is selected when it is an instance of a class entry or its name
    matches a pattern entry. A module whose ancestor is also selected is left out.
    A class that matches nothing is not an error (a policy may list
    ``nn.LayerNorm`` for models that have none); a pattern that matches nothing
    is, since it is almost always a typo.

    Args:
        model: the model to search. Names are those of ``model.named_modules()``
            (the root is ``""``; a module shared under two names is found under its first).
        entries: as accepted by :func:`validate_keep_fp32`.

    Returns:
        ``(name, module)`` pairs, each module once.

    Raises:
        TypeError, ValueError: as :func:`validate_keep_fp32`.
        ValueError: a pattern matches no module; the message lists close names.
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
    outer: list[str] = []  # the names matched, containers included, whose descendants need no second wrapper
    for name, module in named:
        if not (isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            continue
        # Keep the outermost match only: inside a kept ancestor autocast is
        # already off and the inputs reaching the descendant are already fp32, so
        # a second wrapper would change nothing and only add context switches
        # (and dynamo work) per call. named_modules() is pre-order, so any
        # selected ancestor is already in `selected`.
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
    """Make the selected submodules of ``model`` run in float32, in place.

    Each selected module's forward then runs with autocast disabled for the
    "cpu" and "cuda" device types (and for the device type of its inputs, if
    another), and its float16/bfloat16 (and other sub-fp32 floating-point)
    tensor inputs, positional or keyword and nested in tuples, lists and dicts,
    are cast to float32 first. float64 inputs are left alone, as
    ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` does. Outputs are
    float32 when the module's parameters are (fp32 master weights).

    The kept set is exactly what ``entries`` selects: calling it again does not wrap a module
    twice, and modules an earlier call kept but these entries do not select run normally again
    (so a model trained under one policy and then another is not left with stale fp32 modules).

    Args:
        model: the model to change; its ``state_dict`` keys, module tree and
            module classes are unchanged.
        entries: as accepted by :func:`validate_keep_fp32`.

    Returns:
        The names (as in ``model.named_modules()``) of the kept modules.

    Raises:
        TypeError, ValueError: as :func:`select_modules`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> keep_fp32_(model, [nn.LayerNorm])
        ['1']
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.float32
    """
    selected = select_modules(model, entries)
    chosen = {id(module) for _, module in selected}
    for module in model.modules():  # what an earlier policy kept and this one does not runs under autocast again
        if is_kept(module) and id(module) not in chosen:
            _release(module)
    kept = []
    for name, module in selected:
        if not is_kept(module):
            module.forward = _FP32Forward(module)
        kept.append(name)
    return kept


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
    """``keep_fp32`` entries from comma-separated names, as a command line gives them.

    A name of an ``nn.Module`` class in ``torch.nn`` (``LayerNorm``, ``BatchNorm2d``) becomes that
    class; any other name is a module-name pattern.

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
    """The replacement ``forward`` of one kept module: autocast off, fp32 inputs.

    It holds the module (a reference cycle, which deepcopy's and pickle's memos
    handle) and, if the instance already had its own ``forward`` attribute, that
    callable; otherwise it calls the class's ``forward``, looked up at call time
    so that FSDP2's class swap is honoured.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner: Callable | None = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        # Both common device types are switched off unconditionally: autocast
        # for a device only affects tensors on that device, disabling an
        # inactive autocast is free, and fixed `with` blocks trace cleanly
        # under dynamo. A third device type (xpu, mps, ...) is taken from the inputs.
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
        # Lets inspect.signature(module.forward) report the real signature;
        # a property, so nothing extra is pickled.
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __repr__(self) -> str:
        return f"<keep_fp32 forward of {type(self.module).__name__}>"


def _to_fp32(value: Any) -> Any:
    """``value`` with every sub-fp32 floating-point tensor in it cast to float32."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            return value.float()
        return value
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
            device_type = value.device.type
            # torch.autocast raises for device types without autocast (meta, older mps).
            available = getattr(torch.amp, "is_autocast_available", lambda _: False)
            return device_type if available(device_type) else None
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
    return (
        f"keep_fp32 pattern {pattern!r} matches no module of {type(model).__name__}; "
        f"close module names: {listed}"
    )
