"""What a step reports: :class:`StepResult` per call and :class:`TrainStats` over the run."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["StepResult", "TrainStats"]


class StepResult:
    """What one call to :meth:`Trainer.step` did; its values reach the host only when read.

    Reading a field waits for the step to finish: read only what you need, and not every step if speed matters.

    Attributes:
        loss: the micro-batch's loss, unscaled and not divided by ``grad_accum_steps``.
        stepped: the optimizer updated the parameters.
        skipped: an optimizer step was due but skipped for non-finite gradients.
        scale: the loss scale after this step, or ``None`` without a scaler.
        grad_norm: the total gradient norm before clipping, when ``max_grad_norm`` is set.
        due: an optimizer step was due at this micro-batch (the last of its accumulation window).
    """

    __slots__ = ("_loss", "_found_inf", "_scale", "_grad_norm", "due")

    def __init__(self, loss, *, due: bool, found_inf=None, scale=None, grad_norm=None):
        self._loss, self._found_inf, self._scale, self._grad_norm, self.due = loss, found_inf, scale, grad_norm, due

    @staticmethod
    def _host(value):
        return value.item() if isinstance(value, torch.Tensor) else value

    @property
    def loss(self) -> float:
        self._loss = float(self._host(self._loss))
        return self._loss

    @property
    def skipped(self) -> bool:
        return self.due and bool(self._host(self._found_inf))

    @property
    def stepped(self) -> bool:
        return self.due and not self.skipped

    @property
    def scale(self) -> float | None:
        self._scale = self._host(self._scale)
        return self._scale

    @property
    def grad_norm(self) -> float | None:
        self._grad_norm = self._host(self._grad_norm)
        return self._grad_norm

    def __repr__(self) -> str:
        return (f"StepResult(loss={self.loss:.6g}, stepped={self.stepped}, skipped={self.skipped}, "
                f"scale={self.scale}, grad_norm={self.grad_norm})")


@dataclasses.dataclass
class TrainStats:
    """Running optimizer-step and loss-scale counters, kept as ``trainer.stats``."""

    steps: int = 0
    """optimizer steps that were due, taken or skipped"""
    skipped: int = 0
    steps_since_overflow: int = 0
    scale: float | None = None
    min_scale: float | None = None
    max_scale: float | None = None

    def record(self, skipped: bool, scale: float | None) -> None:
        """Count one optimizer step."""
        self.steps += 1
        self.skipped += skipped
        self.steps_since_overflow = 0 if skipped else self.steps_since_overflow + 1
        if scale is not None:
            self.scale = scale
            self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
            self.max_scale = scale if self.max_scale is None else max(self.max_scale, scale)
