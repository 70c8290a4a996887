"""Loggers for ``fit(loggers=[...])``: any object with ``log_metrics(metrics, step)`` and an optional ``close()``.

Only the main process logs: every ``log_every`` optimizer steps, values already booked (no host sync) under the step
they are from (on CUDA up to two steps back): ``loss``, ``lr``, ``loss_scale`` (with a loss scaler), ``skipped``,
``samples_per_s``; at each epoch's end the epoch's record (``train_loss``, ``val_loss``, the metrics,
``data_fraction``, ...). ``fit`` does not close the loggers: a logger may serve several ``fit`` calls.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Mapping, Protocol

__all__ = ["Logger", "CSVLogger", "TensorBoardLogger"]


class Logger(Protocol):
    """What ``fit`` calls; ``close()`` is optional and called by you."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...


class CSVLogger:
    """Rows of metrics in a CSV file: a ``step`` column, then one column per metric, empty where a row lacks it.

    A metric seen for the first time adds a column, and the file is written anew with the wider header.

    Args:
        path: the file; its directory is made if needed. An existing file is replaced.
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"CSVLogger needs a file path, got {path!r}")
        self.path = Path(path)
        self._columns: list[str] = ["step"]
        self._rows: list[dict] = []
        self._written = False

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        self._columns += new
        if new or not self._written:
            self._rewrite()
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self._columns, restval="").writerow(row)

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w", newline="") as f:
            writer = csv.DictWriter(f, self._columns, restval="")
            writer.writeheader()
            writer.writerows(self._rows)
        os.replace(partial, self.path)  # a reader never sees half a header
        self._written = True

    def close(self) -> None:
        """Nothing to release: each row is on disk once logged."""


class TensorBoardLogger:
    """Scalars for TensorBoard through ``torch.utils.tensorboard`` (``pip install "precisionloop[tensorboard]"``).

    Args:
        log_dir: the run's directory, as TensorBoard's ``--logdir`` sees it.

    Raises:
        ValueError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError('TensorBoardLogger needs the tensorboard package: pip install "precisionloop[tensorboard]"'
                             ) from None
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
