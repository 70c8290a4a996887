"""Checkpoints: atomic files, every RNG the data path draws from, and the Trainer's state saved and restored all or
nothing, in one layout whether the run had one process, DDP or FSDP2."""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import os
import pickle
import random
import re
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import _compat, distributed as _dist
from .step import map_tensors

FORMAT = "precisionloop-checkpoint"
VERSION = 1  # the layout 0.2.0 wrote too, so its checkpoints load
_WRITER = next((d.version for d in importlib.metadata.distributions(name="precisionloop")), "unknown")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` so that ``path`` holds either the old file or the whole new one (a new name, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:  # made as open() makes any file: the umask applies
            if path.is_file():
                os.chmod(tmp, path.stat().st_mode & 0o777)
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


_REFUSED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")  # in torch's text, the type it refused


def read(path: str | os.PathLike) -> Any:
    """A torch file loaded with ``weights_only=True``; a ValueError for a damaged file or another program's."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except Exception as e:  # a damaged file can fail anywhere in the unpickler
        refused = _REFUSED.search(str(e))
        if refused:  # torch's text holds terminal escape codes; the type it refused is what matters
            raise ValueError(f"{path} is a torch file from another program, not a precisionloop checkpoint: it "
                             f"holds the type {refused.group(1)}, which weights_only=True loading refuses. If you "
                             "trust it, load it yourself (torch.load(path, weights_only=False)) and load the model's "
                             "and the optimizer's states from it before building the Trainer") from None
        raise ValueError(f"cannot read checkpoint {path}: truncated, corrupt or not a torch file ({e!s:.200})") from None


def rng_state() -> dict:
    """Every RNG state a training run draws from, in a form ``weights_only`` loading accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # only once CUDA is in use: reading it would start it
        state["cuda"] = torch.cuda.get_rng_state_all()
    name, key, pos, has_gauss, gauss = np.random.get_state()  # its key as a tensor: weights_only refuses arrays
    state["numpy"] = {"bit_generator": name, "key": torch.from_numpy(key.astype("int64")), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # a list in older files
    if "numpy" in state:
        s = state["numpy"]
        key = s["key"].numpy().astype(np.uint32)
        np.random.set_state((s["bit_generator"], key, s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():  # the devices both runs have
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def trainer_state(trainer, extra: Mapping[str, Any]) -> dict:
    """Everything a Trainer needs to resume exactly, and ``extra``'s states, as a ``weights_only``-loadable dict."""
    extra_states = {name: obj.state_dict() for name, obj in extra.items()}
    for name, state in extra_states.items():  # found now, not when the run is to resume
        _check_loadable(name, state)
    engine = trainer._engine.state_dict()  # first: it refuses an open accumulation
    scheduler = trainer.scheduler
    model_state, optimizer_state = _full_state(trainer.model, trainer.optimizer, trainer.distributed)
    rng = rng_state()
    rng_per_rank = None
    if trainer.distributed:  # every rank's, so that each resumes its own
        rng_per_rank = [None] * _dist.world_size()
        torch.distributed.all_gather_object(rng_per_rank, rng)
    return {
        "format": FORMAT, "version": VERSION, "written_by": "precisionloop " + _WRITER,
        "precision": trainer.policy.name,
        "model": model_state, "optimizer": optimizer_state, "optimizer_class": type(trainer.optimizer).__name__,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
        "scheduler_interval": trainer.scheduler_interval,
        "scaler": engine["scaler"], "stats": engine["stats"],
        "counters": {**engine["counters"], "epoch": trainer.epoch, "batch_in_epoch": trainer.batch_in_epoch},
        "rng": rng, "rng_per_rank": rng_per_rank,
        "rng_epoch_start": trainer._rng_epoch_start,
        "extra": extra_states,
    }


def load_state(trainer, state: dict, source: str, extra: Mapping[str, Any]) -> None:
    """:meth:`Trainer.load_state_dict`'s body: every check first, then every change."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{source} is not a precisionloop checkpoint (Trainer.state_dict's dict, format={FORMAT!r}): "
                         "load another program's states into the model and the optimizer before building the Trainer")
    if state.get("version", 0) > VERSION:
        raise ValueError(f"{source} was written by a newer precisionloop ({state.get('written_by', 'unknown')}, "
                         f"checkpoint version {state['version']}); upgrade precisionloop to load it")
    problems = _model_problems(trainer.model, state["model"])
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    if state["optimizer_class"] != type(optimizer).__name__:
        problems.append(f"it holds a {state['optimizer_class']}'s state, this optimizer is a {type(optimizer).__name__}")
    saved_groups = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
    groups = [len(g["params"]) for g in optimizer.param_groups]
    if saved_groups != groups:
        problems.append(f"its optimizer parameter groups have sizes {saved_groups}, this optimizer's {groups}")
    scheduler_class = type(scheduler).__name__ if scheduler is not None else None
    if (state["scheduler_class"], state["scheduler_interval"]) != (scheduler_class, trainer.scheduler_interval):
        problems.append(f"it was saved with scheduler {state['scheduler_class']} (scheduler_interval="
                        f"{state['scheduler_interval']!r}), this Trainer has {scheduler_class} "
                        f"({trainer.scheduler_interval!r})")
    saved_extra = state.get("extra", {})  # older files hold none
    missing = [name for name in extra if name not in saved_extra]
    if missing:
        problems.append(f"it holds no state for {', '.join(missing)} (it has: {', '.join(saved_extra) or 'none'})")
    if problems:
        raise ValueError(f"{source} does not fit this Trainer: {'; '.join(problems[:5])}; nothing was loaded")
    if state["precision"] != trainer.policy.name:
        scale = "; the loss scale does not carry over" if state["scaler"] or trainer.scaler is not None else ""
        warnings.warn(f"{source} was saved under precision {state['precision']!r} and is loaded under "
                      f"{trainer.policy.name!r}{scale}", UserWarning, stacklevel=_compat.stacklevel_outside_package())
    _load_extra(extra, saved_extra, source)  # first: if one refuses its state, each is put back and nothing changed
    trainer._engine.load_state_dict(state)  # first: its pending outcomes would step the scheduler
    _load_full_state(trainer.model, optimizer, state["model"], state["optimizer"], trainer.distributed)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    trainer.epoch, trainer.batch_in_epoch = state["counters"]["epoch"], state["counters"]["batch_in_epoch"]
    trainer._rng_epoch_start = state["rng_epoch_start"]
    per_rank = state["rng_per_rank"]
    set_rng_state(per_rank[_dist.rank()] if per_rank and len(per_rank) == _dist.world_size() else state["rng"])


def _check_loadable(name: str, state: Any) -> None:
    """A TypeError if loading ``state`` with weights_only=True would fail, by torch's own check (tensors left out)."""
    saved = io.BytesIO()
    torch.save(map_tensors(lambda t: None, state), saved)
    try:
        torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _REFUSED.search(str(e))
        raise TypeError(f"the state_dict of extra {name!r} holds a {refused.group(1) if refused else 'type'}, which "
                        "loading with weights_only=True refuses: keep numbers, strings, tensors, lists and dicts there "
                        "(a numpy number: float())") from None


def _load_extra(objects: Mapping[str, Any], saved: dict, source: str) -> None:
    """Each object's saved state; if one refuses its own, every one put back as it was."""
    before = []
    try:
        for name, obj in objects.items():
            before.append((obj, copy.deepcopy(obj.state_dict())))
            obj.load_state_dict(saved[name])
    except Exception as e:
        for obj, state in before:
            obj.load_state_dict(state)
        raise ValueError(f"{source}: {name} did not load its state ({e!s:.300}); nothing was loaded") from e


def _model_problems(model: nn.Module, saved: dict) -> list[str]:
    """The saved tensors' names, shapes and dtypes against the model's (torch would cast another dtype silently)."""
    expected = {k: v for k, v in _compat.unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}
    problems = [f"missing {k}" for k in expected if k not in saved] + [f"unexpected {k}" for k in saved if k not in expected]
    return problems + [f"{k} is {list(saved[k].shape)} {saved[k].dtype}, the model's {list(v.shape)} {v.dtype}"
                       for k, v in expected.items() if k in saved and (saved[k].shape, saved[k].dtype) != (v.shape, v.dtype)]


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, distributed: str | None) -> tuple[dict, dict]:
    """The model's and optimizer's state by parameter name, unsharded under FSDP2, as torch.distributed.checkpoint
    gives it; an empty optimizer's is written here (that would start it with a zero-lr step, changing Adam's count)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    full = distributed == "fsdp"
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    if optimizer.state:
        return get_state_dict(model, optimizer, options=options)
    # By state_dict name, as torch.distributed.checkpoint writes them (activation checkpointing's wrappers dropped).
    names: dict[int, str] = {}
    for name, p in _compat.unwrap(model).state_dict(keep_vars=True).items():
        if isinstance(p, nn.Parameter):
            names.setdefault(id(p), name)  # a tied parameter by its first name
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return get_model_state_dict(model, options=options), {"state": {}, "param_groups": groups}


def _load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict,
                     distributed: str | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    # strict=False: a parameter that never had a gradient (an unused branch) has no optimizer state.
    options = StateDictOptions(full_state_dict=distributed == "fsdp", strict=False)
    kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]  # the live ones
    if optimizer_state["state"]:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options)
    else:
        set_model_state_dict(model, model_state, options=options)
        optimizer.state.clear()  # the saved optimizer had not stepped yet
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)
