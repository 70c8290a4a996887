"""Checkpoint files: atomic writes, readable errors for bad files, and every RNG the data path uses."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "precisionloop-checkpoint"
VERSION = 1

try:
    import numpy as np
except ImportError:  # numpy is optional; its RNG is saved only when it is there
    np = None


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` with ``torch.save`` so that ``path`` holds either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


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
        np_state = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"][: torch.cuda.device_count()]
        for index, s in enumerate(saved):
            torch.cuda.set_rng_state(s, index)
    if "numpy" in state and np is not None:
        s = state["numpy"]
        np.random.set_state({
            "bit_generator": s["bit_generator"],
            "state": {"key": s["key"].numpy().astype(np.uint32), "pos": s["pos"]},
            "has_gauss": s["has_gauss"],
            "gauss": s["gauss"],
        })
