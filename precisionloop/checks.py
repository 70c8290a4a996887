"""Argument checks shared by the Trainer and ``fit``: each raises a ValueError that names the argument."""

from __future__ import annotations

import inspect
import numbers
import os
import types
from collections.abc import Iterable
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .batches import normalize_uint8

__all__ = ["refuse_removed", "check_int", "check_flag", "check_real", "check_loader", "length", "check_callbacks", "check_loggers", "check_directory",
           "check_trainer_arguments", "check_scheduler_interval", "check_master_weights", "check_optimizer_params", "is_plateau"]


def refuse_removed(owner: str, given: Mapping[str, Any], removed: Mapping[str, str]) -> None:
    """A TypeError for an unknown keyword argument, a ValueError saying what replaces a removed one."""
    for name in given:
        if name not in removed:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        raise ValueError(f"{owner}({name}=...): {removed[name]}")


def check_int(name: str, value: object, low: int) -> None:
    """Raise unless ``value`` is an int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """Raise unless ``value`` is True or False (or 1 or 0): a string such as "no" is true."""
    if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_real(name: str, value: object, in_range: Callable[[float], bool], valid: str) -> None:
    """Raise unless ``value`` is a real number (not a bool or a tensor) for which ``in_range`` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not in_range(float(value)):
        raise ValueError(f"{name} must be {valid}, got {value!r}")


def check_loader(name: str, loader: Any, pairs: bool = True) -> None:
    """Raise unless ``loader`` is an iterable of batches: a Dataset is not one, nor (when batches are the default
    ``(inputs, targets)`` pairs, ``pairs``) a list of tensors."""
    if isinstance(loader, torch.utils.data.Dataset) and not isinstance(loader, torch.utils.data.IterableDataset):
        raise ValueError(f"{name} is a {type(loader).__name__}, which holds single samples, not batches: wrap it as "
                         f"DataLoader(dataset, batch_size=..., shuffle=...) from torch.utils.data")
    if pairs and isinstance(loader, (list, tuple)) and loader and all(isinstance(item, torch.Tensor) for item in loader):
        raise ValueError(f"{name} is a {type(loader).__name__} of tensors, which fit would take as one batch per "
                         f"tensor; for (inputs, targets) tensors use DataLoader(TensorDataset(inputs, targets), "
                         f"batch_size=...) from torch.utils.data, or pass a list of (inputs, targets) batches")
    if not (isinstance(loader, Iterable) or hasattr(type(loader), "__getitem__")) or isinstance(loader, (str, bytes)):
        raise ValueError(f"{name} must be an iterable of batches (a DataLoader, a list of batches, ...), "
                         f"got {type(loader).__name__}")
    if length(loader) == 0:
        raise ValueError(f"{name} has no batches (len 0), so there is nothing to {'train on' if name == 'train_loader' else 'evaluate'}: "
                         "a DataLoader with drop_last=True over fewer samples than batch_size gives none")


def length(loader: Any) -> int | None:
    """``len(loader)``, or None where it has none (a generator, a DataLoader over an IterableDataset)."""
    try:
        return len(loader)
    except TypeError:
        return None


_HOOKS = ("on_step_end", "on_epoch_end")


def check_callbacks(callbacks: Any) -> None:
    """Raise unless ``callbacks`` is a list or tuple of objects whose hooks, where they have them, are callable.

    A bare function would be skipped silently; a class fails at the first step unless its hooks are static or
    class methods.
    """
    if not isinstance(callbacks, (list, tuple)):
        raise ValueError(f"callbacks must be a list or tuple of callback objects, got {type(callbacks).__name__}")
    for index, cb in enumerate(callbacks):
        hooks = [getattr(cb, name, None) for name in _HOOKS]
        why = None
        if isinstance(cb, type):
            if not any(hooks) or any(isinstance(inspect.getattr_static(cb, n, None), types.FunctionType) for n in _HOOKS):
                why = f"the class {cb.__name__} (pass an instance)"
        elif callable(cb) and not any(hooks):
            why = repr(cb)[:80]
        elif all(h is None for h in hooks):  # a typo (on_epoch_ends) would make it a callback that never runs
            near = sorted(n for n in dir(cb) if n.startswith("on_"))
            why = f"{repr(cb)[:80]}, which has neither hook" + (f" (it has {', '.join(near)})" if near else "")
        elif not all(h is None or callable(h) for h in hooks):
            why = f"{repr(cb)[:80]}, whose hooks are not all callable"
        if why:
            raise ValueError(f"callbacks[{index}] is {why}; a callback is an object with an "
                             "on_step_end(trainer, result) and/or an on_epoch_end(trainer, record) method")


def check_loggers(loggers: Any) -> None:
    """Raise unless ``loggers`` is a list or tuple of objects with a callable ``log_metrics(metrics, step)``."""
    if not isinstance(loggers, (list, tuple)):
        raise ValueError(f"loggers must be a list or tuple of loggers, got {type(loggers).__name__}")
    for index, logger in enumerate(loggers):
        if isinstance(logger, type) or not callable(getattr(logger, "log_metrics", None)):
            what = f"the class {logger.__name__} (pass an instance)" if isinstance(logger, type) else repr(logger)[:80]
            raise ValueError(f"loggers[{index}] is {what}; a logger is an object with a log_metrics(metrics, step) "
                             "method, such as precisionloop.loggers.CSVLogger(path)")


def check_directory(name: str, path: Any) -> None:
    """Raise unless ``path`` is a non-empty path to a writable directory or to nothing yet, under a writable one."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{name} must be a non-empty path (str or os.PathLike), got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} {os.fspath(path)!r} exists and is not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the directory made at the first save goes in the nearest existing one
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {os.fspath(path)!r} cannot be written: {existing!r} is not writable by this process")


def is_plateau(scheduler: Any) -> bool:
    """True for schedulers stepped with a metric (ReduceLROnPlateau), which ``fit`` steps once per epoch."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def check_trainer_arguments(model: Any, optimizer: Any, loss_fn: Any, scheduler: Any, interval: Any, *,
                            grad_accum_steps: Any, input_transform: Any,
                            max_grad_norm: Any, max_consecutive_skips: Any, **flags: Any) -> None:
    """The Trainer's arguments, each on its own, before anything looks at them together."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(getattr(optimizer, "param_groups", None), list) and callable(getattr(optimizer, "step", None))):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or one like it: param_groups and step) built on "
                         f"the model's parameters, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS steps through a closure that re-evaluates the loss, which a guarded step cannot "
                         "skip; use another torch.optim optimizer")
    if isinstance(loss_fn, type):
        raise ValueError(f"loss_fn is the class {loss_fn.__name__}; pass an instance, such as "
                         f"loss_fn={loss_fn.__name__}(), or a function (outputs, targets) -> scalar loss")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (outputs, targets) -> loss tensor, such as "
                         f"torch.nn.functional.cross_entropy, or None for that default; got {loss_fn!r}")
    if input_transform is not None:
        _check_input_transform(input_transform)
    if scheduler is not None and (isinstance(scheduler, type) or not callable(getattr(scheduler, "step", None))):
        raise ValueError(f"scheduler must be an LR scheduler instance built on the optimizer, got {scheduler!r}")
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler drives a different optimizer than the one given to the Trainer")
    check_scheduler_interval(scheduler, interval)
    check_int("grad_accum_steps", grad_accum_steps, 1)
    check_int("max_consecutive_skips", max_consecutive_skips, 1)
    if max_grad_norm is not None:
        check_real("max_grad_norm", max_grad_norm, lambda v: 0 < v < float("inf"), "a finite number > 0, or None")
    for name, value in flags.items():
        check_flag(name, value)


def _check_input_transform(transform: Any) -> None:
    """A callable of one argument, and not a module with trainable parameters (no optimizer steps them)."""
    if isinstance(transform, type) or not callable(transform):
        what = f"the class {transform.__name__} (pass an instance)" if isinstance(transform, type) else repr(transform)[:80]
        raise ValueError(f"input_transform must be a callable run on the device on each batch's inputs, such as "
                         f"precisionloop.normalize_uint8(mean, std), or None; got {what}")
    if not _takes_one_argument(transform):
        hint = (": normalize_uint8 builds the transform, so pass input_transform=normalize_uint8(mean, std), called"
                if transform is normalize_uint8 else "")
        raise ValueError(f"input_transform {getattr(transform, '__name__', repr(transform)[:80])} cannot "
                         f"be called with one argument (the inputs){hint}")
    trainable = [n for n, p in transform.named_parameters() if p.requires_grad] if isinstance(transform, nn.Module) else []
    if trainable:
        raise ValueError(f"input_transform {type(transform).__name__} has trainable parameters ({', '.join(trainable[:3])}"
                         f"{', ...' if len(trainable) > 3 else ''}), which only the model's optimizer could step, so "
                         "their gradients would only grow: make it part of the model, or freeze it with "
                         "input_transform.requires_grad_(False)")


def _takes_one_argument(fn: Callable) -> bool:
    """Whether ``fn(x)`` binds; True where the signature cannot be read (some builtins, odd wrappers)."""
    try:
        signature = inspect.signature(fn, follow_wrapped=False)  # a functools.wraps wrapper takes its own arguments
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None)
    except TypeError:
        return False
    return True


def check_scheduler_interval(scheduler: Any, interval: Any) -> None:
    """Raise unless a scheduler comes with ``scheduler_interval`` "step" or "epoch" (a ReduceLROnPlateau: "epoch" or None)."""
    if interval is not None and interval not in ("step", "epoch"):
        raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {interval!r}")
    if scheduler is None:
        if interval is not None:
            raise ValueError(f"scheduler_interval={interval!r} was given without a scheduler")
    elif is_plateau(scheduler):
        if interval == "step":
            raise ValueError("a ReduceLROnPlateau steps with the validation loss, which fit computes at each epoch's "
                             "end: pass scheduler_interval='epoch' (or leave it out)")
    elif interval is None:
        raise ValueError(f"a scheduler ({type(scheduler).__name__}) needs scheduler_interval: 'step' steps it after "
                         "every optimizer step taken, 'epoch' at the end of each epoch of fit")


def check_master_weights(model: nn.Module, name: str, compute_dtype: torch.dtype) -> None:
    """Refuse parameters that are not fp32: the policies keep fp32 master weights and reduce precision by autocast."""
    reduced = compute_dtype != torch.float32
    bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32
           and (p.dtype in (torch.float16, torch.bfloat16) or reduced)]
    if bad:
        raise ValueError(
            f"parameters {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} are not fp32; precision "
            f"{name!r} keeps fp32 master weights and runs low precision through autocast. "
            "Call model.float() before building the Trainer; or, for bf16 weights with no fp32 master copy, "
            "use precision='bf16-pure' with an optimizer that rounds its update stochastically, such as "
            "torchao.optim._AdamW(params, bf16_stochastic_round=True)")


def check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Refuse an optimizer that does not hold exactly the model's trainable parameters, or one built with
    ``capturable=True`` (CUDA graphs' optimizer state) for a run on the CPU, where torch's step would assert."""
    if device.type == "cpu" and any(group.get("capturable") for group in optimizer.param_groups):
        raise ValueError(f"{type(optimizer).__name__} was built with capturable=True, which torch's optimizers run "
                         "only on accelerators, and this Trainer trains on the CPU: build it with capturable=False")
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    owned = {id(p) for p in model.parameters()}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for i, n in trainable.items() if i not in held]
    foreign = len(held - owned)
    parts = []
    if missing:
        parts.append(f"trainable parameters missing from the optimizer: {', '.join(missing[:5])}"
                     f"{' ...' if len(missing) > 5 else ''}")
    if foreign:
        parts.append(f"{foreign} optimizer tensor(s) that are not parameters of the model")
    if parts:
        raise ValueError("the optimizer must hold exactly the model's trainable parameters; found " + "; ".join(parts))
