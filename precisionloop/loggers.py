"""Loggers for ``fit(loggers=[...])``, which takes any object with a ``log_metrics(metrics, step)`` method.

Only the main process logs, every ``log_every`` optimizer steps (``loss``, ``lr``, ``loss_scale``...) and at each
epoch's end. ``fit`` does not close a logger: one may serve several ``fit`` calls."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["CSVLogger", "TensorBoardLogger"]


def _number(value: Any) -> Any:
    """A one-element tensor's number (a 0-d loss, say); anything else as it is."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


class CSVLogger:
    """Rows of metrics in a CSV file: ``step``, then a column per metric (a new metric rewrites the file wider).

    Args:
        path: the file, replaced if it exists; its directory is made if needed.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._columns: list[str] = []
        self._rows: list[dict] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **{k: _number(v) for k, v in metrics.items()}}
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        self._columns += new
        if new:  # the first row too: its step is new
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            with partial.open("w", newline="") as f:
                writer = csv.DictWriter(f, self._columns, restval="")
                writer.writeheader()
                writer.writerows(self._rows)
            os.replace(partial, self.path)  # a reader never sees half a header
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self._columns, restval="").writerow(row)

    def close(self) -> None:
        """Nothing to release: each row is on disk once logged."""


class TensorBoardLogger:
    """Scalars for TensorBoard through ``torch.utils.tensorboard`` (``pip install tensorboard``).

    Args:
        log_dir: the run's directory, as TensorBoard's ``--logdir`` sees it.

    Raises:
        ValueError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("TensorBoardLogger needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            value = _number(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
