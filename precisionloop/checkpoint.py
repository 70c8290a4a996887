"""Checkpoints: atomic files, readable errors for bad files, every RNG the data path uses, and the
Trainer's state assembled for saving and restored all or nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import numbers
import os
import random
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _compat
from . import distributed as _dist
from . import keep_fp32 as fp32_modules
from .policy import PrecisionPolicy
from .precisions import get_policy
from .prepare import compile_mode

log = logging.getLogger(__name__)

FORMAT = "precisionloop-checkpoint"
VERSION = 1

try:
    import numpy as np
except ImportError:  # numpy is optional; its RNG is saved only when it is there
    np = None


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` with ``torch.save`` so that ``path`` holds either the old file or the whole new one."""
    path = Path(path)
    if path.name in ("", ".", "..") or path.is_dir():
        raise IsADirectoryError(f"cannot write checkpoint {str(path) or repr('')}: it names a directory; give a file "
                                f"path, such as {path / 'checkpoint.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # The mode open() would give: an existing file keeps its own (one open() may not write is refused, not
    # replaced), a new one 0666 less the umask (mkstemp makes 0600). A symlink is replaced, its target untouched.
    existing = path.lstat() if os.path.lexists(path) else None
    regular = existing is not None and stat.S_ISREG(existing.st_mode)
    if regular and not os.access(path, os.W_OK):
        raise PermissionError(f"cannot write checkpoint {path}: the file is not writable; it was left as it was")
    mode = stat.S_IMODE(existing.st_mode) if regular else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def read(path: str | os.PathLike) -> dict:
    """Load a precisionloop checkpoint with ``weights_only=True``.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: the file is truncated, corrupt, or not a precisionloop checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file can fail anywhere in the unpickler (EOFError, IndexError, ...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read checkpoint {path}: the file is truncated, corrupt or not a torch checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is a torch file but not a precisionloop checkpoint (it has no format={FORMAT!r} entry)")
    if state.get("version", 0) > VERSION:
        raise ValueError(f"{path} was written by a newer precisionloop (checkpoint version {state['version']} > {VERSION})")
    return state


def rng_state() -> dict:
    """Every RNG state a training run draws from, in a form ``weights_only`` loading accepts."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        s = np.random.get_state(legacy=False)
        state["numpy"] = {"bit_generator": s["bit_generator"], "key": torch.from_numpy(s["state"]["key"].astype("int64")),
                          "pos": int(s["state"]["pos"]), "has_gauss": int(s["has_gauss"]), "gauss": float(s["gauss"])}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    _set_cpu_rngs(state, torch.default_generator, random, None if np is None else np.random)
    if "cuda" in state and torch.cuda.is_available():
        for index, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, index)


def _set_cpu_rngs(state: dict, torch_rng: Any, python_rng: Any, numpy_rng: Any) -> None:
    """Load ``state``'s torch, Python and numpy entries into generators: the global ones, or fresh ones to test."""
    torch_rng.set_state(state["torch"])
    version, internal, gauss = state["python"]
    python_rng.setstate((version, tuple(internal), gauss))
    if "numpy" in state and numpy_rng is not None:
        s = state["numpy"]
        key = s["key"].numpy().astype(np.uint32)
        if key.shape != (624,) or not 0 <= s["pos"] <= 624:  # numpy does not check: the next draw would crash
            raise ValueError("its numpy state has a key of other than 624 words or a position outside 0-624")
        numpy_rng.set_state({"bit_generator": s["bit_generator"], "state": {"key": key, "pos": s["pos"]},
                             "has_gauss": s["has_gauss"], "gauss": s["gauss"]})


def _rng_problem(state: Any) -> str | None:
    """Why :func:`set_rng_state` would fail on ``state`` (tried on fresh generators), or None."""
    try:
        _set_cpu_rngs(state, torch.Generator(), random.Random(), None if np is None else np.random.RandomState())
        for key in ("cuda", "loader"):  # the loader's: its own generators' (an epoch's start only)
            states = state.get(key, [])
            if not isinstance(states, (list, tuple)) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                                and t.dim() == 1 for t in states):
                return f"its {'CUDA' if key == 'cuda' else 'loader'} states are not a list of byte tensors"
    except Exception as e:  # whatever the generators refuse: a missing key, a wrong type or size
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def trainer_state(trainer) -> dict:
    """Everything a Trainer needs to resume exactly, as a ``weights_only``-loadable dict."""
    engine, loop = trainer.engine, trainer.loop_state
    engine.sync()
    model_state, optimizer_state = full_state(trainer.model, trainer.optimizer, engine.distributed)
    rng = rng_state()
    return {
        "format": FORMAT,
        "version": VERSION,
        **policy_record(trainer.policy),
        "compile_mode": trainer.compile_mode,
        "world_size": _dist.world_size(),
        "model": model_state,
        "optimizer": optimizer_state,
        "optimizer_class": type(trainer.optimizer).__name__,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "scheduler_class": type(trainer.scheduler).__name__ if trainer.scheduler is not None else None,
        "scheduler_interval": trainer.scheduler_interval,
        "scaler": engine.guard.state_dict(),
        "counters": {**engine.counters(), "epoch": loop.epoch, "batch_in_epoch": loop.batch_in_epoch},
        "stats": dataclasses.asdict(engine.stats),
        "rng": rng,
        "rng_per_rank": _dist.gather_objects(rng) if engine.distributed else None,
        "rng_epoch_start": loop.rng_epoch_start,
    }


def policy_record(policy: PrecisionPolicy) -> dict:
    """What a checkpoint records of the policy: its name and class, the modules it keeps in fp32, its settings."""
    options, unrecorded = policy_options(policy)
    names = fp32_modules.entry_names(policy.keep_fp32)
    return {"precision": policy.name, "policy_class": _qualified(type(policy)), "keep_fp32": names,
            "keep_fp32_classes": [n for e, n in zip(policy.keep_fp32, names) if not isinstance(e, str)],
            "options": options, "unrecorded": unrecorded}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_SKIP = object()


def _as_builtin(value: Any) -> Any:
    """``value`` as a builtin bool, int, float, str or None that ``weights_only`` loading takes, else ``_SKIP``."""
    if isinstance(value, enum.Enum):
        return _SKIP
    for kind in (bool, int, float, str):  # bool first: it is an int; numpy's float64 is a float
        if isinstance(value, kind):
            return kind(value)
    return None if value is None else _SKIP


def policy_options(policy: PrecisionPolicy) -> tuple[dict, list[str]]:
    """The policy's settings but ``keep_fp32`` as builtins (tuples as lists), and the names of those that are not."""
    options, unrecorded = {}, []
    for field in dataclasses.fields(policy):
        if not field.init or not field.compare or field.name == "keep_fp32":
            continue
        value = getattr(policy, field.name)
        builtin = [_as_builtin(v) for v in value] if isinstance(value, tuple) else _as_builtin(value)
        if builtin is _SKIP or (isinstance(builtin, list) and _SKIP in builtin):
            unrecorded.append(field.name)
        else:
            options[field.name] = builtin
    return options, unrecorded


def settings_differ(saved: dict, now: dict) -> bool:
    """Whether two policy records describe different policies of one precision (an old record: by ``keep_fp32``)."""
    return ((saved.get("keep_fp32") or []) != now["keep_fp32"]
            or any(key in saved and saved[key] != now[key] for key in ("options", "policy_class", "unrecorded")))


def precision_of(state: dict) -> str:
    """The precision a checkpoint (or :func:`policy_record`) names, its class if custom, its non-default settings."""
    try:
        table = get_policy(state.get("precision"))
        defaults, cls = policy_options(table)[0], _qualified(type(table))
    except ValueError:  # a custom policy's name: every setting is news
        defaults, cls = {}, None
    custom = state.get("policy_class") if state.get("policy_class") not in (None, cls) else None
    changed = [f"{k}={v!r}" for k, v in (state.get("options") or {}).items() if k not in defaults or defaults[k] != v]
    details = ([custom] if custom else []) + changed
    keep = state.get("keep_fp32") or []
    return (repr(state.get("precision")) + (f" ({', '.join(details)})" if details else "")
            + (f" keeping {', '.join(keep)} in fp32" if keep else ""))


def policy_from_record(state: dict, device: torch.device) -> PrecisionPolicy:
    """The policy a checkpoint (or :func:`policy_record`) was saved under, settings and ``keep_fp32`` included.

    A ``keep_fp32`` class is looked up among the modules already imported; nothing is imported for a checkpoint.

    Raises:
        ValueError: the record cannot rebuild the policy: a precision or class not the precision table's, a
            setting not recordable or not the policy's, or a ``keep_fp32`` class not found.
    """
    where = "pass the policy it was saved under to the Trainer instead"
    try:
        policy = get_policy(state.get("precision"), device)
    except ValueError as e:
        raise ValueError(f"{e}; the checkpoint was saved under a policy the precision table does not build: {where}") from None
    if state.get("policy_class") not in (None, _qualified(type(policy))) or state.get("unrecorded"):
        raise ValueError(f"the checkpoint was saved under {precision_of(state)}, which its record cannot rebuild "
                         f"(a policy class of your own, or settings {state.get('unrecorded') or []}): {where}")
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in (state.get("options") or {}).items()}
    keep = tuple(_keep_entry(n, state) for n in state.get("keep_fp32") or ())
    try:
        return dataclasses.replace(policy, **options, keep_fp32=keep)
    except TypeError as e:
        raise ValueError(f"the checkpoint's precision {state.get('precision')!r} records settings "
                         f"{', '.join(sorted(options))} that {type(policy).__name__} does not take ({e}): {where}") from None


def _keep_entry(name: str, state: dict) -> Any:
    """A recorded ``keep_fp32`` entry: its class where the record says it is one (or, in older records, where
    one of that name is found), else the module-name pattern."""
    classes = state.get("keep_fp32_classes")
    if classes is not None and name not in classes:
        return name
    found = _find_class(name)
    if found is None and classes is not None:
        raise ValueError(f"keep_fp32 class {name} of the checkpoint's policy is not among the imported modules' "
                         "classes (defined in a function?): pass the policy it was saved under to the Trainer instead")
    return name if found is None else found


def _find_class(name: str) -> type | None:
    """The ``nn.Module`` class named ``module.qualname`` among imported modules (nested classes too), or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        found: Any = sys.modules.get(".".join(parts[:cut]))
        for attr in parts[cut:] if found is not None else ():
            found = getattr(found, attr, None)
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
    return None


def load_state(trainer, state: dict, source: str) -> None:
    """:meth:`Trainer.load_state_dict`'s body: check, take the saved policy if autotune is pending, warn, restore."""
    pending = trainer._autotune_compile is not None  # the policy comes from the checkpoint: its scaler is checked below
    check_fits(trainer.model, trainer.optimizer, state, source, trainer.scheduler,
               stats_type=type(trainer.engine.stats), guard=None if pending else trainer.engine.guard)
    if trainer.scheduler is None and state.get("scheduler") is not None:
        raise ValueError(f"{source} holds the state of a {state.get('scheduler_class') or 'an LR'} scheduler, but this "
                         "Trainer has none, so the schedule would stop where it was: build the Trainer with the saved "
                         "run's scheduler (and scheduler_interval); nothing was loaded")
    if trainer.scheduler is not None and state.get("scheduler") is None:
        log.warning("%s holds no scheduler state: this Trainer's %s starts from its beginning", source,
                    type(trainer.scheduler).__name__)
    saved_interval = state.get("scheduler_interval")
    if trainer.scheduler is not None and saved_interval not in (None, trainer.scheduler_interval):
        raise ValueError(f"{source} was saved with scheduler_interval={saved_interval!r}, but this Trainer's is "
                         f"{trainer.scheduler_interval!r}; build the Trainer as the saved run was; nothing was loaded")
    if pending:
        policy = policy_from_record(state, trainer.device)  # its settings too: fp8 layers, keep_fp32
        mode = compile_mode(state.get("compile_mode"), trainer.device)  # as the saved run trained
        policy.check_model(trainer.model, trainer.device)  # what can fail, before the model changes
        policy.check_weights(trainer.model, trainer.optimizer)
        check_scaler(state, policy.make_guard(trainer.device.type), source)
        trainer._configure(policy, mode)
        trainer._autotune_compile = None
        log.info("autotune skipped: resuming under the checkpoint's precision %s", trainer.policy.name)
    saved, now = state.get("precision"), trainer.policy.name
    if saved != now:
        scaled = bool(state.get("scaler")) or trainer.engine.guard.scaler is not None
        warnings.warn(f"{source} was saved under precision {saved!r} and is loaded under {now!r}"
                      + ("; the loss-scaler state does not carry over between them" if scaled else ""),
                      UserWarning, stacklevel=_compat.stacklevel_outside_package())
    elif settings_differ(state, policy_record(trainer.policy)):
        warnings.warn(f"{source} was saved under precision {precision_of(state)} and is loaded under "
                      f"{precision_of(policy_record(trainer.policy))}; training goes on with this Trainer's settings",
                      UserWarning, stacklevel=_compat.stacklevel_outside_package())
    restore_trainer(trainer, state)


def restore_trainer(trainer, state: dict) -> None:
    """Load a :func:`trainer_state` into ``trainer``; call :func:`check_fits` first, so a misfit changes nothing."""
    engine, loop = trainer.engine, trainer.loop_state
    engine.discard_pending()  # not booked: the counters, stats and scheduler it would change are replaced below
    engine.discard_window()  # gradients of an open window belong to the run being replaced
    load_full_state(trainer.model, trainer.optimizer, state["model"], state["optimizer"], engine.distributed)
    if trainer.scheduler is not None and state.get("scheduler") is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    engine.guard.load_state_dict(state.get("scaler"))
    counters = state["counters"]
    engine.load_counters(counters, state["stats"])
    loop.epoch, loop.batch_in_epoch = counters["epoch"], counters["batch_in_epoch"]
    loop.rng_epoch_start = state.get("rng_epoch_start")
    per_rank = state.get("rng_per_rank")
    set_rng_state(per_rank[_dist.rank()] if per_rank and len(per_rank) == _dist.world_size() else state["rng"])
    if engine.after_step is not None:
        engine.after_step()  # new weights, as after an optimizer step (fp8 all-gather scales them anew), last


def check_fits(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, source: str, scheduler=None, *,
               stats_type: type | None = None, guard: Any = None) -> None:
    """Refuse, before any change, a state that is incomplete or whose tensors, optimizer or scheduler do not fit.

    Args:
        stats_type: the dataclass the saved stats must fill (the engine's ``TrainStats``).
        guard: the live gradient guard, whose ``state_dict`` keys a saved scaler state must have.

    Raises:
        ValueError: naming what does not fit.
    """
    _check_layout(state, source, stats_type, guard)
    saved_scheduler = state.get("scheduler_class")
    if scheduler is not None and saved_scheduler is not None and saved_scheduler != type(scheduler).__name__:
        raise ValueError(f"{source} holds the state of a {saved_scheduler} scheduler, but this Trainer's scheduler is a "
                         f"{type(scheduler).__name__}; nothing was loaded")
    if scheduler is not None and state.get("scheduler") is not None:
        _refuse(source, "holds scheduler state this scheduler cannot take",
                _entries_problems("scheduler", state["scheduler"], scheduler.state_dict()))
    _refuse(source, "does not fit this model", _model_problems(model, state["model"]))
    saved_class = state.get("optimizer_class")
    if saved_class is not None and saved_class != type(optimizer).__name__:
        raise ValueError(f"{source} holds the state of a {saved_class} optimizer, but this Trainer's optimizer is a "
                         f"{type(optimizer).__name__}; build the Trainer with a {saved_class}. Nothing was loaded")
    if isinstance(optimizer, torch.optim.SparseAdam) and state["optimizer"]["state"] and not optimizer.state:
        # torch.distributed.checkpoint sets up an empty optimizer's state with a step on dense zero gradients
        raise ValueError(f"{source} holds SparseAdam state, which loads only into a SparseAdam that has state of its "
                         "own (torch.distributed.checkpoint starts an empty one with a dense step, which SparseAdam "
                         "refuses): take one trainer.step first, then load; nothing was loaded")
    saved_groups = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
    groups = [len(g["params"]) for g in optimizer.param_groups]
    if saved_groups != groups:
        raise ValueError(f"{source} has optimizer parameter groups of sizes {saved_groups}, this optimizer "
                         f"{groups}; nothing was loaded")
    _refuse(source, "holds optimizer state this optimizer cannot step with",
            _optimizer_state_problems(model, optimizer, state["optimizer"]))


def _refuse(source: str, what: str, problems: list[str]) -> None:
    """Raise a ValueError naming the first five of ``problems``, if any."""
    if problems:
        more = " ..." if len(problems) > 5 else ""
        raise ValueError(f"{source} {what}: {'; '.join(problems[:5])}{more}; nothing was loaded")


def _model_problems(model: nn.Module, saved_model: dict) -> list[str]:
    """The saved tensors' names, shapes and dtypes against the model's."""
    expected = {k: v for k, v in _dist.unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}
    saved = {k: v for k, v in saved_model.items() if isinstance(v, torch.Tensor)}
    problems = [f"missing {k}" for k in expected if k not in saved] + [f"unexpected {k}" for k in saved if k not in expected]
    both = [k for k in expected if k in saved]
    problems += [f"{k} has shape {list(saved[k].shape)}, the model {list(expected[k].shape)}"
                 for k in both if saved[k].shape != expected[k].shape]
    # torch would cast silently (an int64 weight truncated, fp64 rounded): another dtype is another run's tensor
    return problems + [f"{k} is {saved[k].dtype}, the model's {expected[k].dtype}"
                       for k in both if saved[k].dtype != expected[k].dtype]


_COUNTERS = (("global_step", int), ("epoch", int), ("batch_in_epoch", int), ("consecutive_skips", int),
             ("collapse_warned", bool))


def _is(value: Any, kind: type) -> bool:
    """``isinstance``, with a bool not counted as an int."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _check_layout(state: Any, source: str, stats_type: type | None, guard: Any) -> None:
    """Refuse a state that lacks an entry :func:`restore_trainer` reads, or holds one it would fail on half-way."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{source} is not a precisionloop Trainer state (the dict Trainer.state_dict returns, with "
                         f"format={FORMAT!r}); got a {type(state).__name__}; nothing was loaded")
    problems = [f"{key!r} is {'missing' if key not in state else 'a ' + type(state[key]).__name__}, not a dict"
                for key in ("model", "optimizer", "counters", "stats", "rng") if not isinstance(state.get(key), dict)]
    if not problems:
        saved_optimizer = state["optimizer"]
        if not (isinstance(saved_optimizer.get("state"), dict) and isinstance(saved_optimizer.get("param_groups"), list)
                and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_optimizer["param_groups"])):
            problems.append("'optimizer' lacks its 'state' dict or its 'param_groups' (dicts with 'params' lists)")
        counters = state["counters"]
        problems += [f"counters[{k!r}] is {counters.get(k, 'missing')!r}, not {kind.__name__}"
                     for k, kind in _COUNTERS if not _is(counters.get(k), kind) or (kind is int and counters[k] < 0)]
        if stats_type is not None:
            problems += _stats_problems(state["stats"], stats_type)
        for key in ("rng", "rng_epoch_start"):
            why = None if state.get(key) is None else _rng_problem(state[key])
            problems += [f"{key!r} does not restore ({why})"] if why else []
        per_rank = state.get("rng_per_rank")
        if per_rank is not None and (not isinstance(per_rank, list) or any(_rng_problem(r) for r in per_rank)):
            problems.append("'rng_per_rank' is not a list of RNG states that restore")
        problems += _scaler_problems(state.get("scaler"), guard)
    _refuse(source, "is incomplete or damaged", problems)


def _stats_problems(stats: dict, stats_type: type) -> list[str]:
    """The saved stats against the dataclass: its fields (or some), counts as ints, scales as numbers or None."""
    fields = {f.name: f.default for f in dataclasses.fields(stats_type)}
    if not set(stats) <= set(fields):  # fewer is fine: a field added later takes its default, as the dataclass would
        return [f"'stats' has the fields {sorted(stats)}, not among {sorted(fields)}"]
    return [f"stats[{name!r}] is {value!r}" for name, value in stats.items()
            if not (_is(value, int) if isinstance(fields[name], int) else value is None or _is(value, numbers.Real))]


def _scaler_problems(saved: Any, guard: Any) -> list[str]:
    """A saved scaler state that the live guard's scaler could not load (a missing key fails half-way)."""
    live = guard.state_dict() if guard is not None else None
    if not saved or not isinstance(live, dict):
        return []  # nothing to load (a disabled scaler saves {}), or no scaler here (a precision change: load warns)
    if not isinstance(saved, dict) or not set(live) <= set(saved):
        return [f"'scaler' is {sorted(saved) if isinstance(saved, dict) else type(saved).__name__}, "
                f"not a scaler state with {sorted(live)}"]
    return []


def check_scaler(state: dict, guard: Any, source: str) -> None:
    """Refuse a saved scaler state that ``guard``'s scaler could not load (for a policy chosen from the checkpoint)."""
    _refuse(source, "is incomplete or damaged", _scaler_problems(state.get("scaler"), guard))


def _optimizer_state_problems(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> list[str]:
    """Per-parameter state tensors whose shapes could not step the parameter, and hyperparameters of another kind.
    A tensor is compared with the live state where there is one; else, for torch's own optimizers, it must broadcast
    to its parameter (Adafactor keeps a row and a column); others may keep state of any shape."""
    params = _parameters_by_name(model)
    builtin = type(optimizer).__module__.startswith("torch.optim")
    problems = []
    for name, entries in saved["state"].items():
        param = params.get(name)
        if param is None or not isinstance(entries, dict):
            problems.append(f"it holds state for {name}, which the model has no parameter of" if param is None else
                            f"the state of {name} is a {type(entries).__name__}, not a dict")
            continue
        live = optimizer.state.get(param, {})
        for key, value in entries.items():
            was = live.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if isinstance(was, torch.Tensor) and value.shape != was.shape:
                problems.append(f"{name}'s {key!r} has shape {list(value.shape)}, the optimizer's {list(was.shape)}")
            elif was is None and builtin and not _broadcasts(value.shape, param.shape):
                problems.append(f"{name}'s {key!r} has shape {list(value.shape)}, which does not fit the parameter's "
                                f"{list(param.shape)}")
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        problems += [f"param_groups[{i}][{key!r}] is {value!r}, where the optimizer has {group[key]!r}"
                     for key, value in saved_group.items()
                     if key in group and key not in ("params", *_KERNEL_KEYS) and not _same_kind(value, group[key])]
    return problems


def _entries_problems(what: str, saved: Any, live: dict) -> list[str]:
    """A saved state dict against the live one's: some key in common (another torch may add or drop some), and
    each common value of the same kind."""
    if not isinstance(saved, dict) or (live and not set(saved) & set(live)):
        return [f"{what!r} is {sorted(saved) if isinstance(saved, dict) else type(saved).__name__}, not a state with "
                f"{sorted(live)}"]
    return [f"{what}[{k!r}] is {saved[k]!r:.60}, where this one has {v!r:.60}" for k, v in live.items()
            if k in saved and not _same_kind(saved[k], v)]


def _parameters_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters under their ``state_dict`` names, as torch.distributed.checkpoint writes them: without the parts
    torch's wrappers (activation checkpointing) put in ``named_parameters``."""
    return {k: v for k, v in _dist.unwrap(model).state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)}


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    return len(shape) == len(to) and all(a in (b, 1) for a, b in zip(shape, to))


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether a saved hyperparameter can stand where the live one is: a bool for a bool, a number for a number, ..."""
    if live is None or saved is None:
        return True  # an option left unset on one side (Muon's adjust_lr_fn): the saved one replaces the live one
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if isinstance(live, torch.Tensor) and live.numel() != 1:
        return isinstance(saved, torch.Tensor) and saved.shape == live.shape
    if isinstance(live, (numbers.Real, torch.Tensor)):
        return _is(saved, numbers.Real) or (isinstance(saved, torch.Tensor) and saved.numel() == 1)
    if isinstance(live, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(live)
    return isinstance(saved, str) if isinstance(live, str) else True


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, distributed: str | None) -> tuple[dict, dict]:
    """The model's and optimizer's state in one layout whatever the run: parameter names, unsharded under FSDP2."""
    # torch.distributed.checkpoint's helpers give that layout (checkpoints move between one process, DDP and FSDP2),
    # but would initialise an empty optimizer with a zero-lr step (Adam's step count changes): that one is done here.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    full = distributed == "fsdp"
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    if optimizer.state:
        return _unwrap_tensor_subclasses(get_state_dict(model, optimizer, options=options))
    names: dict[int, str] = {}
    for name, p in _parameters_by_name(model).items():
        names.setdefault(id(p), name)  # a tied parameter by its first name
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return _unwrap_tensor_subclasses(get_model_state_dict(model, options=options)), {"state": {}, "param_groups": groups}


def _unwrap_tensor_subclasses(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with tensor subclasses replaced by the plain tensors they wrap: under
    one process FSDP2's full state dict keeps an fp8-all-gathered weight as torchao's wrapper subclass, which saved
    as is would load only where torchao is imported."""
    if isinstance(value, dict):
        return {k: _unwrap_tensor_subclasses(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap_tensor_subclasses(v) for v in value)
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, nn.Parameter) or isinstance(value, DTensor):
        return value  # a DTensor (a sharded layout) is left to torch.distributed.checkpoint
    inner_names, _ = value.__tensor_flatten__() if hasattr(value, "__tensor_flatten__") else ([], None)
    for name in inner_names:  # the wrapped tensor: same shape and dtype as the wrapper
        inner = getattr(value, name)
        if isinstance(inner, torch.Tensor) and inner.shape == value.shape and inner.dtype == value.dtype:
            return _unwrap_tensor_subclasses(inner)
    raise ValueError(f"cannot save a {type(value).__name__} tensor as a plain tensor: no wrapped tensor of its shape. "
                     "Quantized optimizer states (torchao's 8-bit, 4-bit and fp8 ones) cannot be checkpointed: "
                     "to save and resume, train with an optimizer whose state is not quantized")


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict,
                    distributed: str | None) -> None:
    """Load what :func:`full_state` returned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    # check_fits has matched every model tensor; strict=False lets parameters that never had a gradient
    # (an unused branch) have no optimizer state, as they had none when saved.
    options = StateDictOptions(full_state_dict=distributed == "fsdp", strict=False)
    # Which kernel runs (fused, foreach) belongs to the live optimizer, not to the saved run.
    kernels = [{k: g[k] for k in _KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    if optimizer_state["state"]:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options)
    else:
        set_model_state_dict(model, model_state, options=options)
        optimizer.state.clear()  # the saved optimizer had not stepped yet
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)


_KERNEL_KEYS = ("fused", "foreach")
