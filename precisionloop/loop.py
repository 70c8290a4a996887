"""The loop around the step: ``fit`` and ``evaluate``, progress, callbacks, periodic checkpoints and exact-resume replay.

Training goes through ``trainer.step`` and ``flush`` and validation through the Trainer's override points, so a
subclass's ``forward_batch`` and ``compute_loss`` are honoured in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import time
import types
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from . import _compat
from . import checkpoint, diagnostics
from . import distributed as _dist
from . import feed
from .batches import batch_size
from .engine import LossNotScalar
from .checks import check_callbacks, check_directory, check_flag, check_int, check_loader, check_loggers, is_plateau, length

__all__ = ["LoopState", "FitOptions", "fit", "evaluate"]

log = logging.getLogger(__name__)
_END = object()


@dataclasses.dataclass
class LoopState:
    """Where training stands in the data: what a checkpoint needs to resume mid-epoch."""

    epoch: int = 0  # completed epochs
    batch_in_epoch: int = 0  # micro-batches consumed in the current epoch
    rng_epoch_start: dict | None = None  # the RNG state the epoch's shuffle was drawn from


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """``fit``'s options, checked once, before the first step."""

    epochs: int
    max_steps: int | None = None
    progress: bool = True
    callbacks: Sequence[Any] = ()
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    keep_last: int | None = None
    log_every: int = 20
    underflow_every: int | None = None
    loggers: Sequence[Any] = ()
    device_feed: bool = True

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs, 0)
        for name in ("max_steps", "checkpoint_every", "keep_last", "underflow_every"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("log_every", self.log_every, 1)
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to")
        if self.checkpoint_dir is not None and self.checkpoint_every is None:
            raise ValueError("checkpoint_dir is written every checkpoint_every optimizer steps: set checkpoint_every too")
        check_callbacks(self.callbacks)
        check_loggers(self.loggers)
        if self.keep_last is not None and self.checkpoint_every is None:
            raise ValueError("keep_last applies to periodic checkpoints: set checkpoint_every too")
        check_flag("progress", self.progress)
        check_flag("device_feed", self.device_feed)
        if self.checkpoint_dir is not None:
            check_directory("checkpoint_dir", self.checkpoint_dir)

    def reached(self, global_step: int) -> bool:
        return self.max_steps is not None and global_step >= self.max_steps


def fit(trainer, train_loader: Iterable, options: FitOptions, val_loader: Iterable | None,
        metrics: Mapping[str, Any] | None) -> list[dict]:
    """:meth:`Trainer.fit`'s body; see its docstring."""
    pairs = trainer.takes_pairs()
    check_loader("train_loader", train_loader, pairs)
    if val_loader is not None:
        check_loader("val_loader", val_loader, pairs)
    metrics = check_metrics(metrics, val_loader)
    epochs_left = options.epochs - trainer.loop_state.epoch
    for name, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
        _check_generator(name, loader, epochs_left if options.max_steps is None else 1)
    if is_plateau(trainer.scheduler) and val_loader is None:
        raise ValueError("the scheduler is a ReduceLROnPlateau, which fit steps with the validation loss at each "
                         "epoch's end: pass a val_loader, or step it yourself around trainer.step")
    if trainer.distributed:
        # Each rank sees its share of the data; only rank 0 reports and writes.
        train_loader = _dist.shard_loader(train_loader)
        val_loader = _dist.shard_loader(val_loader) if val_loader is not None else None
        options = dataclasses.replace(options, progress=options.progress and _dist.is_main())
    trainer.model.train()  # a model left in eval mode would train with frozen dropout and batch norms
    engine, state = trainer.engine, trainer.loop_state
    engine.probe = _underflow_probe(trainer, options.underflow_every) if options.underflow_every else None
    history, warned = [], False
    if epochs_left <= 0 and not options.reached(engine.global_step):
        warnings.warn(f"fit(epochs={options.epochs}) has nothing to do: {state.epoch} epochs are done already "
                      "(epochs counts every epoch, restored ones included); pass a larger epochs to train on",
                      UserWarning, stacklevel=_compat.stacklevel_outside_package())
    try:
        while state.epoch < options.epochs and not options.reached(engine.global_step):
            record = _run_epoch(trainer, train_loader, options)
            # A run stopped by max_steps mid-epoch is validated too: its last record carries val_loss.
            if val_loader is not None and (record["complete"] or options.reached(engine.global_step)):
                record.update(validate(trainer, val_loader, metrics))
            if record["complete"] and trainer.scheduler_interval == "epoch":
                if is_plateau(trainer.scheduler):
                    trainer.scheduler.step(record["val_loss"])
                else:
                    trainer.scheduler.step()
            if record["complete"]:  # counted only now: a validation that fails leaves the epoch's end to the next fit
                state.epoch, state.batch_in_epoch, state.rng_epoch_start = state.epoch + 1, 0, None
            history.append(record)
            warned = _log_epoch(record, options, trainer.global_step, warned, trainer.compile_mode is None,
                                trainer.device.type != "cpu")
            for cb in options.callbacks:
                if hasattr(cb, "on_epoch_end"):
                    cb.on_epoch_end(trainer, record)
    finally:
        engine.probe = None
    stats = trainer.stats
    if stats.steps and _dist.is_main():
        log.info("fit: %d optimizer steps, %d skipped (%.2f%%)%s", stats.steps, stats.skipped,
                 100 * stats.skipped / stats.steps, f", loss scale {stats.scale:g}" if stats.scale is not None else "")
    return history


def _check_generator(name: str, loader: Any, epochs: int) -> None:
    """Refuse a generator that is spent, or an iterator (a generator, ``iter(...)``, ``map(...)``) that fit would
    need for more than one epoch (no ``max_steps``)."""
    if inspect.isgenerator(loader) and inspect.getgeneratorstate(loader) == inspect.GEN_CLOSED:
        raise ValueError(f"{name} is a generator that is already spent: it yields no more batches. Pass a list or a "
                         "DataLoader, which start again each epoch")
    if isinstance(loader, Iterator) and epochs > 1:
        raise ValueError(f"{name} is a {type(loader).__name__}, an iterator, which can be iterated once only, and fit "
                         f"has {epochs} epochs to run: pass a list or a DataLoader, which start again each epoch, or "
                         "fit one epoch at a time")


DATA_WARNING = 0.3
"""The share of an epoch spent waiting for input above which ``fit`` warns (once a call)."""


def _log_epoch(record: dict, options: FitOptions, step: int, warned: bool, eager: bool, accelerator: bool) -> bool:
    """The epoch's numbers to the loggers, and one warning a fit when the input bounds training; True once warned."""
    if not _dist.is_main():
        return warned
    numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for logger in options.loggers:
        logger.log_metrics(numbers, step)
    if record["data_fraction"] > DATA_WARNING and not warned:
        warned = True
        log.warning("fit: %.0f%% of epoch %d waited for input, so the input pipeline, not the precision, bounds "
                    "training. Try %s", 100 * record["data_fraction"], record["epoch"], _input_advice(eager, accelerator))
    return warned


def _input_advice(eager: bool, accelerator: bool) -> str:
    """The usual fixes for a loader that bounds training, those that apply to this device and step."""
    if not accelerator:  # on the CPU nothing is copied to a device: pinning and device-resident data do not apply
        return ("more DataLoader workers, lighter per-sample transforms, or keeping a dataset that fits in memory as "
                "tensors")
    # The DataLoader's work in this process (receiving, pinning) and the step's launches share one interpreter.
    last = ("keeping a dataset that fits on the device, or compile=True: the loader's work in this process and the "
            "step's kernel launches share its CPU time, and compiled steps launch less") if eager else (
            "or keeping a dataset that fits on the device")
    return ("more DataLoader workers, moving images as uint8 and normalising them on the device, pin_memory on or off "
            f"(measure both), {last}")


def _start_epoch(trainer, loader: Iterable) -> tuple[Any, int]:
    """An iterator over this epoch's batches, fast-forwarded past those a checkpoint already consumed.

    An epoch begun before (``rng_epoch_start`` set) replays the shuffle it drew: mid-epoch (a checkpoint, or a
    ``fit`` stopped by an exception) with the RNG as it is now restored after the replay; at its first batch, from
    the epoch's own RNG state, as nothing of it was trained (a loader may draw its seed at the first batch).
    """
    state = trainer.loop_state
    resume_at, resume_rng = state.batch_in_epoch, None
    if state.rng_epoch_start is None:
        # The sampler and the DataLoader draw their seeds from these states when the iterator is made.
        state.rng_epoch_start = {**checkpoint.rng_state(), "loader": [g.get_state() for g in _generators_of(loader)]}
        resume_at = state.batch_in_epoch = 0
    else:
        resume_rng = checkpoint.rng_state() if resume_at else None
        checkpoint.set_rng_state(state.rng_epoch_start)
        _set_generators(loader, state.rng_epoch_start.get("loader"))
    try:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(state.epoch)
        iterator = iter(loader)
        for done in range(resume_at):  # replay the same shuffle up to where the checkpoint stopped
            if next(iterator, _END) is _END:
                raise ValueError(f"the checkpoint stopped at batch {resume_at} of epoch {state.epoch + 1}, but this "
                                 f"train_loader has only {done} batches per epoch; resume with the same data")
    finally:  # a failed or interrupted replay too: the RNG the run goes on from is the one it had
        if resume_rng is not None:
            checkpoint.set_rng_state(resume_rng)
    return iterator, resume_at


def _generators_of(loader: Iterable) -> list[torch.Generator]:
    """The generators of its own a loader shuffles with (``DataLoader(generator=...)``, its sampler's), each once."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _set_generators(loader: Iterable, states: list | None) -> None:
    """Put a loader's own generators back as the epoch began (an older checkpoint recorded none)."""
    generators = _generators_of(loader)
    if states is None or len(states) != len(generators):
        if states is not None or generators:
            log.warning("the train_loader shuffles with %d generators of its own, and the epoch began with %s: its "
                        "order is drawn anew, not replayed", len(generators), "none recorded" if states is None
                        else len(states))
        return
    for generator, saved in zip(generators, states):
        generator.set_state(saved)


class _Window:
    """The open accumulation window's first batch and, when accumulating, the RNG state before that batch was read.

    An exception escaping ``fit`` (a failed step, a callback, a Ctrl-C while the loader waits) drops the window's
    gradients and puts ``batch_in_epoch`` and the RNG back to its start, so a ``save`` can follow and the next
    ``fit`` trains the window again as first drawn.
    """

    def __init__(self, trainer):
        # A window opened by hand before fit is dropped too: it began here, as far as this epoch's batches go.
        self.trainer, self.rng = trainer, None
        self.start = trainer.loop_state.batch_in_epoch if trainer.engine.micro else None

    def before_batch(self) -> None:
        """Before the loader is read: a window opens with the next batch unless one is open."""
        engine = self.trainer.engine
        if engine.micro == 0:
            self.start = self.trainer.loop_state.batch_in_epoch
            self.rng = checkpoint.rng_state() if engine.grad_accum_steps > 1 else None

    def step(self, batch: Any):
        """``trainer.step`` with the batch counted."""
        engine, state = self.trainer.engine, self.trainer.loop_state
        before = engine.global_step
        try:
            result = self.trainer.step(batch)
        except BaseException:
            if engine.global_step != before:  # the optimizer step completed (the skip limit): the batch was used
                state.batch_in_epoch += 1
                self.start = None
            raise
        state.batch_in_epoch += 1
        if result.due:
            self.start = None
        return result

    def flush(self):
        """``trainer.flush`` at the epoch's end."""
        before = self.trainer.engine.global_step
        try:
            return self.trainer.flush()
        finally:
            if self.trainer.engine.global_step != before:  # stepped, even if the skip limit then raised
                self.start = None

    def rewind(self) -> None:
        """After an exception: the open window's gradients dropped, its batches and RNG state put back."""
        if self.start is None:
            return
        self.trainer.engine.discard_window()
        self.trainer.loop_state.batch_in_epoch, self.start = self.start, None
        if self.rng is not None:
            checkpoint.set_rng_state(self.rng)


def _run_epoch(trainer, loader: Iterable, options: FitOptions) -> dict:
    engine, state = trainer.engine, trainer.loop_state
    # trainer.stats books the steps taken before this epoch (it may raise their skip limit: before anything opens),
    # so the epoch's skipped count starts from them.
    totals = _EpochTotals(trainer, trainer.stats.skipped)
    iterator, resume_at = _start_epoch(trainer, loader)
    total = length(loader)
    bar = tqdm(total=total, initial=resume_at, desc=f"epoch {state.epoch + 1}/{options.epochs}",
               disable=not options.progress, dynamic_ncols=True, leave=True)
    with contextlib.ExitStack() as cleanup:  # last in, first out; each runs even if one before it raised
        flags = cleanup.enter_context(contextlib.ExitStack())  # the caller's flags come back last
        cleanup.callback(bar.close)
        cleanup.callback(_close_generator, iterator, loader)
        cleanup.callback(setattr, engine, "sync_next", False)
        flags.enter_context(trainer.policy.backend_flags())
        pull = functools.partial(totals.next_batch, iterator)
        if options.device_feed and trainer.device.type == "cuda":
            pull = feed.device_feed(pull, trainer.to_device, _END, feed.CudaStreams(trainer.device))
        window = _Window(trainer)
        try:
            complete = _train_batches(trainer, pull, window, flags, bar, totals, options, total)
        except BaseException:
            window.rewind()
            raise
    if totals.count == 0 and resume_at == 0:  # an epoch counted as trained with nothing trained would mislead
        why = (f"it is a {type(loader).__name__}, an iterator, spent by an earlier epoch: pass a list or a DataLoader, "
               "which start again each epoch") if isinstance(loader, Iterator) else "a loader over an empty dataset?"
        if totals.empty:
            why = f"each of its {totals.empty} batches was empty (size 0)"
            state.batch_in_epoch, state.rng_epoch_start = 0, None  # the next fit reads the epoch afresh, and says so
        raise ValueError(f"train_loader yielded no batches in epoch {state.epoch + 1}: nothing was trained ({why})")
    if totals.empty:
        log.warning("fit: %d batches of epoch %d were empty (size 0) and were passed over", totals.empty,
                    state.epoch + 1)
    return totals.record(trainer, complete)


def _train_batches(trainer, pull, window: _Window, flags: contextlib.ExitStack, bar, totals, options: FitOptions,
                   total: int | None) -> bool:
    """Train on the epoch's batches, then step a partial window; whether the epoch ran to its end."""
    engine, state, held = trainer.engine, trainer.loop_state, trainer.policy
    while True:
        window.before_batch()
        if (batch := pull()) is _END:
            break
        if batch_size(batch) == 0:  # nothing to train on (a collate that filters samples): counted as read
            if trainer.distributed:  # the other ranks would all-reduce a backward this one does not run
                raise ValueError(f"batch {state.batch_in_epoch + 1} of epoch {state.epoch + 1} is empty (size 0) on "
                                 f"rank {_dist.rank()}: under several processes every rank trains each micro-batch, "
                                 "as their gradients are all-reduced together; drop empty batches in the loader")
            state.batch_in_epoch += 1
            totals.empty += 1
            bar.update(1)
            continue
        engine.sync_next = total is not None and state.batch_in_epoch + 1 == total
        result = window.step(batch)
        if trainer.policy is not held:  # autotune chose another policy at the first step
            flags.close()
            held = trainer.policy
            flags.enter_context(held.backend_flags())
        totals.add(result, batch)
        if options.progress:
            bar.update(1)
            if totals.count % options.log_every == 0:
                bar.set_postfix(_postfix(engine, totals), refresh=False)
        if _after_step(trainer, result, options, totals):
            return total is not None and state.batch_in_epoch >= total  # stopped on the last batch
    result = window.flush()
    if result is not None:
        _after_step(trainer, result, options, totals)
    return True


def _close_generator(iterator: Any, loader: Iterable) -> None:
    """Close this epoch's generator, left open by a break, so that its own cleanup runs under the epoch's flags."""
    if iterator is not loader and isinstance(iterator, types.GeneratorType):
        iterator.close()


def _after_step(trainer, result, options: FitOptions, totals) -> bool:
    """Callbacks, loggers and periodic checkpoints after a micro-step; True when ``max_steps`` is reached."""
    for cb in options.callbacks:
        if hasattr(cb, "on_step_end"):
            cb.on_step_end(trainer, result)
    if not result.due:
        return False
    if options.loggers and trainer.global_step % options.log_every == 0 and _dist.is_main():
        metrics = totals.step_metrics(trainer)
        for logger in options.loggers:  # under the step the values are from: on CUDA the last one booked
            logger.log_metrics(metrics, trainer.engine.stats.steps)
    if options.checkpoint_every is not None and trainer.global_step % options.checkpoint_every == 0:
        _periodic_save(trainer, Path(options.checkpoint_dir), options.keep_last)
    return options.reached(trainer.global_step)


class _EpochTotals:
    """An epoch's summed loss (on the device: no sync per step), its sample count and the counters at its start."""

    def __init__(self, trainer, skipped_before: int):
        self.trainer = trainer
        # The finite losses' sum and count, on the device: a skipped step's NaN or inf loss would hide the others.
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=trainer.device)
        self.finite = torch.zeros((), dtype=torch.int64, device=trainer.device)
        self.count, self.samples, self.empty = 0, 0, 0  # micro-batches trained, their samples, empty ones passed over
        self.steps_before, self.skipped_before = trainer.global_step, skipped_before
        self.measured_before = len(trainer.underflow_history)
        self.start = time.perf_counter()
        self.data_s = 0.0  # blocked on the loader
        self.logged = (self.start, 0)  # when the loggers last wrote, and the samples by then

    def next_batch(self, iterator: Any) -> Any:
        """The loader's next batch (``_END`` at the end), the wait timed on the host.

        Only the wait, with the device feed or without: the copy to the device is not in it (from pageable memory on
        the step's stream it would also wait for the GPU's queued work, and count the step's time as the input's).
        """
        began = time.perf_counter()
        batch = next(iterator, _END)
        self.data_s += time.perf_counter() - began
        return batch

    def step_metrics(self, trainer) -> dict:
        """What the loggers get every ``log_every`` optimizer steps, from values already on the host."""
        engine, now = trainer.engine, time.perf_counter()
        since, samples = self.logged
        self.logged = (now, self.samples)
        metrics = {"loss": engine.last_loss, "lr": trainer.optimizer.param_groups[0]["lr"],
                   "skipped": engine.stats.skipped, "samples_per_s": (self.samples - samples) / max(now - since, 1e-9)}
        if engine.stats.scale is not None:
            metrics["loss_scale"] = engine.stats.scale
        return {k: v for k, v in metrics.items() if v is not None}

    def add(self, result, batch: Any) -> None:
        loss = result._loss  # still on the device: the callbacks, which may read it, run after this
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss, 0.0)
        self.finite += finite
        self.count += 1
        self.samples += batch_size(batch) or 0

    def record(self, trainer, complete: bool) -> dict:
        elapsed = time.perf_counter() - self.start
        loss_sum, finite, samples = self.loss_sum, self.finite, self.samples
        if trainer.distributed:
            totals = _dist.all_reduce_sum_(torch.stack([loss_sum.float(), finite.float(),
                                                        torch.tensor(float(samples), device=trainer.device)]))
            loss_sum, finite, samples = totals[0], totals[1], int(totals[2])
        finite = int(finite)
        stats, state = trainer.stats, trainer.loop_state
        measured = trainer.underflow_history[self.measured_before:]
        underflow = {k: measured[-1][k] for k in ("underflow", "underflow_scaled")} if measured else {}
        return {
            "epoch": state.epoch + 1,  # fit counts a complete epoch after its validation
            "complete": complete,
            "train_loss": float(loss_sum) / finite if finite else float("nan"),
            "steps": trainer.global_step - self.steps_before,
            "skipped": stats.skipped - self.skipped_before,
            "time_s": elapsed,
            "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            "data_s": self.data_s,
            "data_fraction": self.data_s / elapsed if elapsed > 0 else 0.0,
            **{f"stats_{k}": v for k, v in dataclasses.asdict(stats).items()},
            **underflow,
        }


def _postfix(engine, totals) -> dict:
    # From the last booked step: already on the host, so the bar costs no sync.
    postfix = {"loss": f"{engine.last_loss:.4g}" if engine.last_loss is not None else "-", "skipped": engine.stats.skipped}
    if engine.stats.scale is not None:
        postfix["scale"] = f"{engine.stats.scale:g}"
    postfix["data"] = f"{totals.data_s / max(time.perf_counter() - totals.start, 1e-9):.0%}"
    return postfix


def _periodic_save(trainer, directory: Path, keep_last: int | None) -> None:
    path = trainer.save(directory / f"step-{trainer.global_step:08d}.pt")
    if keep_last is not None and _dist.is_main():
        # Newest by write time, not by name: files of an earlier, longer run must not outlive this run's.
        others = sorted((p for p in directory.glob("step-*.pt") if p != path), key=lambda p: p.stat().st_mtime)
        for old in others[:max(0, len(others) - (keep_last - 1))]:
            old.unlink(missing_ok=True)


def _underflow_probe(trainer, every: int):
    """Measures underflow on the unscaled gradients every ``every`` optimizer steps, into ``trainer.underflow_history``."""
    def probe(step: int) -> None:
        if step % every:
            return
        # Against the policy's own reduced dtype, or fp16 for an fp32 policy: what would fp16 lose here?
        dtype = trainer.policy.compute_dtype if trainer.policy.compute_dtype != torch.float32 else torch.float16
        scale = trainer.engine.guard.scale_value() or 65536.0
        trainer.underflow_history.append({"step": step, **diagnostics.underflow_summary(trainer.model, dtype, scale)})
    return probe


def evaluate(trainer, loader: Iterable, metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """:meth:`Trainer.evaluate`'s body."""
    check_loader("loader", loader, trainer.takes_pairs())
    return validate(trainer, loader, check_metrics(metrics, loader))


def validate(trainer, loader: Iterable, metrics: dict[str, Any]) -> dict[str, float]:
    """Mean loss and metrics over ``loader`` in eval mode, without grad, under the policy's autocast and flags.

    The RNG states are put back after it (a DataLoader draws its seeds when iterated), so validating, or stopping
    for it mid-epoch, changes nothing in the training that follows.
    """
    model, device = trainer.model, trainer.device
    was_training, rng = model.training, checkpoint.rng_state()
    model.eval()
    for metric in metrics.values():
        metric.to(device)
        metric.reset()
    loss_sum, count, seen = torch.zeros((), dtype=torch.float32, device=device), 0, 0
    try:
        # The flags of the policy in force now: autotune may have replaced the one fit started with.
        with trainer.policy.backend_flags(), torch.no_grad():
            for batch in loader:
                seen += 1
                n = batch_size(batch)
                if n == 0:
                    continue  # an empty batch has no loss to average in
                batch = trainer._on_device(batch)
                with trainer.policy.autocast(device.type):
                    loss, outputs, targets = _evaluation_step(trainer, batch, bool(metrics))
                n = n or 1
                loss_sum += loss.float() * n
                count += n
                if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
                    outputs = outputs.float()
                for metric in metrics.values():
                    metric.update(outputs, targets)
        if trainer.distributed:
            totals = _dist.all_reduce_sum_(torch.stack([loss_sum.float(), torch.tensor(float(count), device=device),
                                                        torch.tensor(float(seen), device=device)]))
            loss_sum, count, seen = totals[0], int(totals[1]), int(totals[2])
        if count == 0:  # on every rank alike: the counts were summed
            raise ValueError("the validation loader yielded no batches, so there is no loss to report (a spent "
                             "generator, or a loader over an empty dataset)" if seen == 0 else
                             f"every one of the validation loader's {seen} batches is empty (size 0): no loss to report")
        # torchmetrics syncs each metric's state across ranks in compute().
        result = {"val_loss": float(loss_sum) / count if count else float("nan")}
        for name, metric in metrics.items():
            value = metric.compute()
            result[name] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else (
                value.tolist() if isinstance(value, torch.Tensor) else value)
            metric.reset()
        return result
    finally:
        model.train(was_training)
        checkpoint.set_rng_state(rng)


def _evaluation_step(trainer, batch: Any, need_outputs: bool) -> tuple[torch.Tensor, Any, Any]:
    """Loss, outputs and targets for validation, through the same override points as training."""
    if not trainer.overrides("compute_loss"):  # one forward gives both
        outputs, targets = trainer.forward_batch(batch)
        loss = trainer.loss_fn(outputs, targets)
    else:
        loss, outputs, targets = trainer.compute_loss(batch), None, None
        if need_outputs:  # an overridden compute_loss defines the loss; metrics still need forward_batch's outputs
            try:
                outputs, targets = trainer.forward_batch(batch)
            except TypeError as e:
                if trainer.overrides("forward_batch"):
                    raise
                raise TypeError(f"{e}. The metrics are computed from forward_batch's (outputs, targets): with "
                                "compute_loss overridden, override forward_batch too, or pass no metrics") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossNotScalar(loss)
    return loss, outputs, targets


def check_metrics(metrics: Mapping[str, Any] | None, loader: Iterable | None) -> dict[str, Any]:
    """A dict of torchmetrics ``Metric`` objects, checked.

    Raises:
        ValueError: metrics without a loader to compute them on, or named as a value fit or evaluate reports.
        TypeError: not a mapping of ``Metric`` objects.
    """
    if not metrics:
        return {}
    if loader is None:
        raise ValueError("metrics are computed on val_loader: pass val_loader too")
    from torchmetrics import Metric

    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> torchmetrics.Metric, got {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TypeError(f"metrics[{name!r}] must be a torchmetrics.Metric, got {type(metric).__name__}")
    taken = [n for n in metrics if n in _RECORD_KEYS or str(n).startswith("stats_")]
    if taken:
        raise ValueError(f"metrics named {', '.join(map(repr, taken))} would overwrite the values fit and evaluate "
                         f"report under those names ({', '.join(sorted(_RECORD_KEYS))}, stats_*): name them otherwise")
    return dict(metrics)


_RECORD_KEYS = frozenset({"epoch", "complete", "train_loss", "steps", "skipped", "time_s", "samples_per_s", "data_s",
                          "data_fraction", "underflow", "underflow_scaled", "val_loss"})
