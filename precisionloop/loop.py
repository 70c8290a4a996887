"""``fit`` and ``evaluate`` around the step; ``fit`` trains through ``trainer.step``, so a subclass's overrides count."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import checkpoint, diagnostics, distributed as _dist
from .step import map_tensors, output_field

__all__ = ["Checkpoints"]

log = logging.getLogger(__name__)
_END = object()


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Periodic checkpoints for ``fit``: ``directory/step-NNNNNNNN.pt`` (made at the first save) every ``every``
    optimizer steps, the newest ``keep_last`` kept (``None``: all)."""

    directory: str | os.PathLike
    every: int
    keep_last: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1 or (self.keep_last is not None and self.keep_last < 1):
            raise ValueError(f"Checkpoints needs every >= 1 and keep_last >= 1 or None, got {self.every}, {self.keep_last}")

    def save(self, trainer) -> None:
        path = trainer.save(Path(self.directory) / f"step-{trainer.global_step:08d}.pt")
        if self.keep_last is not None and _dist.is_main():
            # Newest by write time, not by name: files of an earlier, longer run must not outlive this run's.
            others = sorted((p for p in path.parent.glob("step-*.pt") if p != path), key=lambda p: p.stat().st_mtime)
            for old in others[:max(0, len(others) - (self.keep_last - 1))]:
                old.unlink(missing_ok=True)


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format) -> Any:
    """Every tensor in a (nested) batch moved to ``device``, 4-D float tensors in ``memory_format``."""
    def move(t: torch.Tensor) -> torch.Tensor:
        fmt = memory_format if t.dim() == 4 and t.is_floating_point() else torch.preserve_format
        return t.to(device, non_blocking=True, memory_format=fmt)

    return map_tensors(move, batch)


def batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor with one in a (nested) batch; 1 if it has none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((batch_size(v) for v in values if isinstance(v, (torch.Tensor, Mapping, list, tuple))), 1)


def check_loader(name: str, loader: Any) -> None:
    """Refuse a Dataset passed where a loader of batches belongs."""
    if isinstance(loader, torch.utils.data.Dataset) and not isinstance(loader, torch.utils.data.IterableDataset):
        raise ValueError(f"{name} is a {type(loader).__name__}, which holds single samples, not batches: wrap it as "
                         "DataLoader(dataset, batch_size=..., shuffle=...) from torch.utils.data")


def fit(trainer, train_loader: Iterable, epochs: int, val_loader: Iterable | None, metrics: Mapping | None,
        max_steps: int | None, progress: bool, callbacks, checkpoints: Checkpoints | None, log_every: int,
        underflow_every: int | None, loggers) -> list[dict]:
    """:meth:`Trainer.fit`'s body; see its docstring."""
    check_loader("train_loader", train_loader)
    check_loader("val_loader", val_loader)
    plateau = isinstance(trainer.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if (metrics or plateau) and val_loader is None:
        needs = "metrics are computed on val_loader" if metrics else "a ReduceLROnPlateau is stepped with the val_loss"
        raise ValueError(f"{needs} at each epoch's end: pass a val_loader")
    if trainer.distributed:  # each rank sees its share of the data; only rank 0 reports
        train_loader = _dist.shard_loader(train_loader)
        val_loader = _dist.shard_loader(val_loader)
        progress = progress and _dist.is_main()
    loggers = loggers if _dist.is_main() else ()  # only rank 0 logs
    max_steps = math.inf if max_steps is None else max_steps
    options = dict(progress=progress, callbacks=callbacks, checkpoints=checkpoints, log_every=log_every,
                   loggers=loggers, max_steps=max_steps)
    trainer.model.train()  # a model left in eval mode would train with frozen dropout and batch norms
    trainer._engine.set_probe(_underflow_probe(trainer, underflow_every) if underflow_every else None)
    history: list[dict] = []
    try:
        while trainer.epoch < epochs and trainer.global_step < max_steps:
            record = _Epoch(trainer, train_loader, options).run(epochs)
            if val_loader is not None:  # an epoch cut short by max_steps too
                record.update(validate(trainer, val_loader, metrics or {}))
            if record["complete"]:
                if trainer.scheduler_interval == "epoch":
                    trainer.scheduler.step(*([record["val_loss"]] if plateau else []))
                trainer.epoch, trainer.batch_in_epoch, trainer._rng_epoch_start = trainer.epoch + 1, 0, None
            history.append(record)
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for logger in loggers:
                logger.log_metrics(numbers, trainer.global_step)
            for cb in callbacks:
                if hasattr(cb, "on_epoch_end"):
                    cb.on_epoch_end(trainer, record)
    finally:
        trainer._engine.set_probe(None)
    if history and max(r["data_fraction"] for r in history) > 0.3 and _dist.is_main():
        log.warning("fit: up to %.0f%% of an epoch waited for input, so the input pipeline bounds training: try "
                    "more DataLoader workers, lighter transforms, or uint8 images normalised on the device",
                    100 * max(r["data_fraction"] for r in history))
    return history


def _start_epoch(trainer, loader: Iterable) -> Any:
    """An iterator over this epoch's batches, past those already trained. An epoch begun before replays the shuffle
    it drew from its starting RNG state (the global RNGs, the loader's generators), then puts the RNG back."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found = (getattr(owner, "generator", None) for owner in owners)  # those of its own a loader shuffles with
    generators = list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())  # each once
    if trainer._rng_epoch_start is None:  # samplers draw their seeds from these when the iterator is made
        trainer._rng_epoch_start = {**checkpoint.rng_state(), "loader": [g.get_state() for g in generators]}
    now = checkpoint.rng_state() if trainer.batch_in_epoch else None
    checkpoint.set_rng_state(trainer._rng_epoch_start)
    for g, state in zip(generators, trainer._rng_epoch_start.get("loader", [])):
        g.set_state(state)
    try:
        if hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(trainer.epoch)
        iterator = iter(loader)
        for done in range(trainer.batch_in_epoch):
            if next(iterator, _END) is _END:
                raise ValueError(f"the checkpoint stopped at batch {trainer.batch_in_epoch} of epoch {trainer.epoch + 1}, "
                                 f"but this train_loader has {done} batches an epoch; resume with the same data")
    finally:
        if now is not None:
            checkpoint.set_rng_state(now)
    return iterator


class _Epoch:
    """One epoch of ``fit``. An exception before an accumulation's optimizer step drops its gradients and puts
    ``batch_in_epoch`` (and, when accumulating, the RNG state) back to its first batch: the next ``fit`` replays it."""

    def __init__(self, trainer, loader: Iterable, options: dict):
        self.trainer, self.engine, self.options = trainer, trainer._engine, options
        self.skipped_before = trainer.stats.skipped  # counts the steps before this epoch first
        self.steps_before = trainer.global_step
        self.iterator = _start_epoch(trainer, loader)
        # A generator made from the loader is fit's to close: its own cleanup then runs under the flags it ran under.
        made = isinstance(self.iterator, types.GeneratorType) and self.iterator is not loader
        self.closing = contextlib.closing(self.iterator) if made else contextlib.nullcontext()
        try:
            self.total = len(loader)
        except TypeError:  # a generator, an IterableDataset's loader
            self.total = None
        self.first, self.first_step = trainer.batch_in_epoch, trainer.global_step  # an accumulation opened by hand
        self.rng, self.losses = None, []  # losses: summed into totals 64 at a time, a few kernels, not per batch
        self.totals = torch.zeros(2, device=trainer.device)  # the finite losses' sum and count
        self.samples = self.logged_samples = 0
        self.start = self.logged_at = time.perf_counter()
        self.data_s = 0.0

    def run(self, epochs: int) -> dict:
        trainer = self.trainer
        bar = tqdm(total=self.total, initial=trainer.batch_in_epoch, disable=not self.options["progress"],
                   desc=f"epoch {trainer.epoch + 1}/{epochs} {trainer.policy.name}", dynamic_ncols=True)
        try:
            with bar, trainer.policy.backend_flags(trainer.device.type), self.closing:
                complete = self._train(bar)
        except BaseException:
            if trainer.global_step == self.first_step:  # no optimizer step since the accumulation's first batch
                self.engine.discard_accumulation()
                trainer.batch_in_epoch = self.first
                if self.rng is not None:
                    checkpoint.set_rng_state(self.rng)
            raise
        finally:
            self.engine.set_sync_next(False)
        if trainer.batch_in_epoch == 0:
            raise ValueError(f"train_loader yielded no batches in epoch {trainer.epoch + 1}: nothing was trained "
                             "(an empty dataset, or an iterator spent by an earlier epoch: pass a list or a DataLoader)")
        return self._record(complete)

    def _train(self, bar) -> bool:
        """Train on the epoch's batches, then flush an open accumulation; whether the epoch ran to its end."""
        trainer, engine, options = self.trainer, self.engine, self.options
        while True:
            if not engine.accumulating():  # where an exception rewinds to: this accumulation's first batch
                self.first, self.first_step = trainer.batch_in_epoch, trainer.global_step
                self.rng = checkpoint.rng_state() if trainer.grad_accum_steps > 1 else None
            waited = time.perf_counter()
            batch = next(self.iterator, _END)
            self.data_s += time.perf_counter() - waited
            if batch is _END:
                self._after(trainer.flush())
                return True
            engine.set_sync_next(self.total is not None and trainer.batch_in_epoch + 1 == self.total)
            try:
                result = trainer.step(batch)
            finally:  # a step that raised after its optimizer step used its batch; one that raised before is rewound
                trainer.batch_in_epoch += 1
            self.losses.append(result._loss)
            self._fold(at=64)
            self.samples += batch_size(batch)
            bar.update(1)
            if options["progress"] and trainer.batch_in_epoch % options["log_every"] == 0:
                stats, last_loss = engine.counted()
                scale = {} if stats.scale is None else {"scale": f"{stats.scale:g}"}
                loss = f"{last_loss:.4g}" if last_loss is not None else "-"
                bar.set_postfix({"loss": loss, "skipped": stats.skipped, **scale,
                                 "data": f"{self.data_s / (time.perf_counter() - self.start):.0%}"}, refresh=False)
            if self._after(result):
                return self.total is not None and trainer.batch_in_epoch >= self.total

    def _after(self, result) -> bool:
        """Callbacks, loggers and periodic checkpoints after a micro-batch; True once ``max_steps`` is reached."""
        if result is None:
            return False
        trainer, options = self.trainer, self.options
        for cb in options["callbacks"]:
            if hasattr(cb, "on_step_end"):
                cb.on_step_end(trainer, result)
        if result._outcome is None:  # no optimizer step: mid-accumulation
            return False
        if options["loggers"] and trainer.global_step % options["log_every"] == 0:
            now = time.perf_counter()
            stats, last_loss = self.engine.counted()  # on the host already: no sync
            rate = (self.samples - self.logged_samples) / max(now - self.logged_at, 1e-9)  # a frozen test clock
            metrics = {"loss": last_loss, "lr": trainer.optimizer.param_groups[0]["lr"],
                       "skipped": stats.skipped, "samples_per_s": rate, "loss_scale": stats.scale}
            for logger in options["loggers"]:
                logger.log_metrics({k: v for k, v in metrics.items() if v is not None}, stats.steps)
            self.logged_at, self.logged_samples = now, self.samples
        if options["checkpoints"] is not None and trainer.global_step % options["checkpoints"].every == 0:
            options["checkpoints"].save(trainer)
        return trainer.global_step >= options["max_steps"]

    def _fold(self, at: int = 1) -> None:
        """Once ``at`` micro-batch losses wait, sum them into ``totals``, in fp32 (a bf16 loss summed in bf16 loses)."""
        if len(self.losses) >= at:
            losses = torch.stack(self.losses).float()
            self.losses = []
            finite = torch.isfinite(losses)
            self.totals += torch.stack([torch.where(finite, losses, 0.0).sum(), finite.sum()])

    def _record(self, complete: bool) -> dict:
        self._fold()
        trainer, elapsed = self.trainer, time.perf_counter() - self.start
        totals = torch.cat([self.totals, self.totals.new_tensor([self.samples])])
        if trainer.distributed:
            torch.distributed.all_reduce(totals)  # a sum
        loss_sum, finite, samples = totals.tolist()
        stats = trainer.stats
        measured = [m for m in trainer.underflow_history if m["step"] > self.steps_before]
        return {
            "epoch": trainer.epoch + 1, "complete": complete,
            "train_loss": loss_sum / finite if finite else float("nan"),  # skipped steps' NaN losses left out
            "steps": trainer.global_step - self.steps_before, "skipped": stats.skipped - self.skipped_before,
            "time_s": elapsed, "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            "data_s": self.data_s, "data_fraction": self.data_s / elapsed if elapsed > 0 else 0.0,
            **{f"stats_{k}": v for k, v in dataclasses.asdict(stats).items()},
            **({k: measured[-1].get(k) for k in ("underflow", "underflow_scaled", "lost_updates")} if measured else {}),
        }


def _underflow_probe(trainer, every: int):
    """Every ``every`` optimizer steps, the unscaled gradients' underflow, then the updates bf16 weights would lose."""
    def probe(step: int):
        if step % every:
            return None
        # Against the policy's reduced dtype, or fp16 for an fp32 policy: what would fp16 lose here?
        dtype = trainer.policy.compute_dtype if trainer.policy.compute_dtype != torch.float32 else torch.float16
        scale = trainer.scaler.get_scale() if trainer.scaler is not None else 65536.0
        record = {"step": step, **diagnostics.underflow_summary(trainer.model, dtype, scale)}
        trainer.underflow_history.append(record)
        # A copy of the fp32 weights (bf16-pure ones have lost those updates already): memory the size of the weights.
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                  if p.requires_grad and p.dtype == torch.float32}
        return lambda: record.update(lost_updates=diagnostics.lost_updates(before, trainer.model).lost)
    return probe


def validate(trainer, loader: Iterable, metrics: Mapping) -> dict[str, float]:
    """Mean loss and metrics over ``loader``: eval mode, no grad, the policy's autocast; the RNG put back after."""
    model, device = trainer.model, trainer.device
    was_training, rng = model.training, checkpoint.rng_state()  # a DataLoader draws its seeds when iterated
    model.eval()
    for metric in metrics.values():
        metric.to(device).reset()
    loss_sum, count = torch.zeros((), device=device), 0
    try:
        with trainer.policy.backend_flags(device.type), torch.no_grad():
            for batch in loader:
                batch = trainer.to_device(batch)
                with trainer.policy.autocast(device.type):
                    outputs, targets = trainer.forward_batch(batch)
                    loss = trainer.compute_loss(outputs, targets)
                n = batch_size(batch)
                loss_sum += loss.float() * n
                count += n
                predictions = outputs if isinstance(outputs, torch.Tensor) else output_field(outputs, "logits")
                for metric in metrics.values():
                    metric.update(predictions.float() if predictions.is_floating_point() else predictions, targets)
        totals = torch.stack([loss_sum, loss_sum.new_tensor(count)])
        if trainer.distributed:
            torch.distributed.all_reduce(totals)  # a sum
        loss_sum, count = totals.tolist()
        if count == 0:
            raise ValueError("the validation loader yielded no batches, so there is no loss to report")
        result = {"val_loss": loss_sum / count}
        for name, metric in metrics.items():  # torchmetrics syncs across ranks in compute()
            value = metric.compute()
            result[name] = value.item() if value.numel() == 1 else value.tolist()
        return result
    finally:
        model.train(was_training)
        checkpoint.set_rng_state(rng)
