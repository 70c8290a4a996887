"""fit and evaluate: train and eval modes, history and metrics, callbacks, progress, loggers, schedulers, backend
flags around fit, interrupts in fit, and the time spent waiting for data."""

import contextlib
import logging
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from conftest import (B, DictTrainer, _scheduled, batch, batches, dataset, dict_batch, dropout_mlp, make_trainer, mk, net,
                      params_of, read_flags, same_models, same_params, seed_all, tf32_flags, tiny_mlp, write_flags)

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def test_history_keys_and_metrics_match_evaluate():
    seed_all(0)
    trainer = make_trainer("bf16")
    val = DataLoader(dataset(24, seed=9), batch_size=8)
    metrics = {"acc": MulticlassAccuracy(num_classes=4)}
    history = trainer.fit(DataLoader(dataset(), batch_size=8), epochs=2, val_loader=val, metrics=metrics, progress=False)
    assert [h["epoch"] for h in history] == [1, 2]
    for record in history:
        for key in ("train_loss", "skipped", "steps", "time_s", "samples_per_s", "val_loss", "acc", "complete",
                    "stats_scale", "stats_skipped", "stats_steps"):
            assert key in record, key
        assert record["steps"] == 5 and record["complete"] and record["samples_per_s"] > 0
    assert trainer.model.training, "fit must leave the model in train mode"
    again = trainer.evaluate(val, {"acc": MulticlassAccuracy(num_classes=4)})
    assert again["acc"] == history[-1]["acc"] and again["val_loss"] == pytest.approx(history[-1]["val_loss"])
    assert trainer.model.training


def test_evaluate_matches_a_hand_computed_accuracy_and_keeps_eval_mode():
    trainer = make_trainer("fp32")
    trainer.model.eval()
    val = dataset(24, seed=9)
    result = trainer.evaluate(DataLoader(val, batch_size=5), {"acc": MulticlassAccuracy(num_classes=4, average="micro")})
    with torch.no_grad():
        logits = trainer.model(val.tensors[0])
    assert result["acc"] == pytest.approx(float((logits.argmax(1) == val.tensors[1]).float().mean()))
    assert result["val_loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, val.tensors[1])), rel=1e-5)
    assert not trainer.model.training


def test_progress_false_prints_nothing(capfd):
    trainer = make_trainer("bf16")
    trainer.fit(DataLoader(dataset(), batch_size=8), epochs=1, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_progress_bar_shows_loss_and_skips(capfd):
    trainer = make_trainer("fp16")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, log_every=2)
    err = capfd.readouterr().err
    assert "epoch 1/1" in err and "loss=" in err and "scale=" in err and "skipped=" in err


def test_an_epochs_last_partial_accumulation_is_stepped_and_epochs_count_restored_ones(tmp_path):
    trainer = make_trainer("fp32", grad_accum_steps=2)
    history = trainer.fit(DataLoader(dataset(20), batch_size=4), epochs=1, progress=False)  # 5 micro-batches
    assert history[0]["steps"] == 3 and trainer.global_step == 3
    trainer.save(tmp_path / "c.pt")
    other = make_trainer("fp32", grad_accum_steps=2)
    other.load(tmp_path / "c.pt")
    history = other.fit(DataLoader(dataset(20), batch_size=4), epochs=2, progress=False)
    assert len(history) == 1 and other.epoch == 2 and other.global_step == 6


def test_max_steps_caps_the_total_and_callbacks_fire():
    class Recorder:
        def __init__(self):
            self.steps, self.epochs = [], []

        def on_step_end(self, trainer, result):
            self.steps.append(result.stepped or result.skipped)

        def on_epoch_end(self, trainer, record):
            self.epochs.append(record["epoch"])

    recorder = Recorder()
    trainer = make_trainer("bf16")
    history = trainer.fit(DataLoader(dataset(), batch_size=4), epochs=5, max_steps=13, progress=False, callbacks=[recorder])
    assert trainer.global_step == 13 and trainer.epoch == 1 and trainer.batch_in_epoch == 3
    assert len(recorder.steps) == 13 and recorder.epochs == [1, 2]
    assert [h["complete"] for h in history] == [True, False]


def test_metrics_without_a_validation_loader_are_refused():
    trainer = make_trainer("fp32")
    data = DataLoader(dataset(), batch_size=4)
    with pytest.raises(ValueError, match="val_loader"):
        trainer.fit(data, metrics={"acc": MulticlassAccuracy(num_classes=4)}, progress=False)
    assert trainer.global_step == 0


def test_max_steps_on_the_last_batch_completes_the_epoch():
    trainer = make_trainer("fp32")
    history = trainer.fit(DataLoader(dataset(), batch_size=4), epochs=3, max_steps=10, progress=False)  # 10 batches/epoch
    assert history[-1]["complete"] and trainer.epoch == 1 and trainer.batch_in_epoch == 0


@pytest.fixture
def callers_flags():
    """The caller's flags, unlike every policy's (TF32 and cuDNN benchmark go together), put back afterwards."""
    before = read_flags()
    outside = (tf32_flags(True), False)
    write_flags(*outside)
    yield outside
    write_flags(*before)


@pytest.mark.parametrize("end", ["finished", "a step raised", "a generator loader stopped by max_steps"])
def test_fit_leaves_the_callers_backend_flags_as_they_were(callers_flags, end):
    seen = []

    class Seen:
        def on_step_end(self, trainer, result):
            seen.append(read_flags())

    class Loader:  # its own save-and-restore runs when fit stops early, before fit restores the caller's flags
        def __iter__(self):
            saved = torch.backends.cudnn.benchmark
            try:
                yield from DataLoader(dataset(), batch_size=4)
            finally:
                torch.backends.cudnn.benchmark = saved

    def loss_fn(outputs, targets):
        if end == "a step raised" and len(seen) == 2:
            raise KeyboardInterrupt
        return nn.functional.cross_entropy(outputs, targets)

    trainer = make_trainer("bf16", loss_fn=loss_fn)
    loader = Loader() if "generator" in end else DataLoader(dataset(), batch_size=4)
    with pytest.raises(KeyboardInterrupt) if end == "a step raised" else contextlib.nullcontext():
        trainer.fit(loader, epochs=1, max_steps=3, progress=False, callbacks=[Seen()])
    assert read_flags() == callers_flags and seen  # the caller's flags are back


def test_a_failed_end_of_epoch_flush_is_replayed_by_the_next_fit(monkeypatch):
    # 5 batches at grad_accum_steps=2: the epoch ends with flush(); an interrupt before its optimizer update drops
    # the accumulated gradients, and the next fit must train those batches again rather than resume past them.
    data = [(x, y) for x, y in batches(5)]

    def make():
        model = tiny_mlp()
        return model, Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu",
                              grad_accum_steps=2, max_grad_norm=1e9)

    ref_model, ref = make()
    ref.fit(data, epochs=1, progress=False)
    model, trainer = make()
    clip, calls = nn.utils.clip_grad_norm_, []

    def clip_failing_in_the_flush(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # steps 1 and 2 take two batches each; the third is the flush of batch 5
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", clip_failing_in_the_flush)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, epochs=1, progress=False)
    assert trainer.global_step == 2 and trainer.batch_in_epoch == 4
    trainer.fit(data, epochs=1, progress=False)
    assert trainer.global_step == ref.global_step == 3 and trainer.epoch == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_an_epoch_scheduler_steps_once_per_epoch_of_fit():
    trainer = _scheduled("epoch")
    lrs = []

    class Seen:
        def on_step_end(self, trainer, result):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])

    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=3, progress=False, callbacks=[Seen()])  # 10 steps an epoch
    assert lrs == [1.0] * 10 + [0.5] * 10 + [0.25] * 10
    assert trainer.optimizer.param_groups[0]["lr"] == 0.125 and trainer.scheduler.last_epoch == 3


def test_a_step_scheduler_steps_after_every_optimizer_step():
    trainer = _scheduled("step")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, progress=False)
    assert trainer.scheduler.last_epoch == 10 and trainer.optimizer.param_groups[0]["lr"] == 0.5 ** 10


def test_fit_stopped_by_max_steps_mid_epoch_still_validates():
    trainer = make_trainer("fp32")
    records = []

    class Needs:
        def on_epoch_end(self, trainer, record):
            records.append(record["val_loss"])  # a user's callback that reads it

    history = trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=1, progress=False,
                          val_loader=DataLoader(dataset(8), batch_size=4), callbacks=[Needs()])
    assert not history[-1]["complete"] and math.isfinite(history[-1]["val_loss"]) and records


# The input pipeline: how long fit waits for batches, and the loggers.

class _SlowLoader:
    """Batches that take ``delay`` seconds each to arrive, as from an overloaded DataLoader."""

    def __init__(self, delay, n=6):
        self.delay, self.data = delay, list(DataLoader(dataset(4 * n), batch_size=4))

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        for batch in self.data:
            time.sleep(self.delay)
            yield batch


def test_a_slow_loader_shows_in_data_fraction_and_gets_one_warning(caplog):
    trainer = make_trainer("fp32")
    with caplog.at_level(logging.WARNING, logger="precisionloop"):
        # Half a second a batch: far longer than a step of this tiny model, even with the CPU shared.
        history = trainer.fit(_SlowLoader(0.5, n=3), epochs=2, progress=False)
    assert all(r["data_fraction"] > 0.5 and r["data_s"] >= 3 * 0.5 for r in history)
    warnings_given = [r for r in caplog.records if "waited for input" in r.getMessage()]
    assert len(warnings_given) == 1 and "workers" in warnings_given[0].getMessage()


def test_a_fast_loader_gets_a_small_data_fraction_and_no_warning(caplog):
    trainer = make_trainer("fp32")
    loss_fn = trainer.loss_fn

    def slow_loss(outputs, targets):  # a step that takes 0.1 s, so a loaded machine cannot make the loader look slow
        time.sleep(0.1)
        return loss_fn(outputs, targets)

    trainer.loss_fn = slow_loss
    with caplog.at_level(logging.WARNING, logger="precisionloop"):
        history = trainer.fit(_SlowLoader(0.0), epochs=1, progress=False)
    assert history[0]["data_fraction"] < 0.3
    assert not [r for r in caplog.records if "waited for input" in r.getMessage()]


def test_the_csv_logger_writes_values_every_n_steps_and_each_epoch(tmp_path):
    import csv

    from precisionloop.loggers import CSVLogger

    trainer = make_trainer("fp16")
    path = tmp_path / "logs" / "metrics.csv"
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=2, progress=False, log_every=4, loggers=[CSVLogger(path)],
                val_loader=DataLoader(dataset(8), batch_size=4))
    rows = list(csv.DictReader(path.open()))
    header = list(rows[0])
    assert header[0] == "step" and {"loss", "lr", "loss_scale", "skipped", "samples_per_s", "val_loss"} <= set(header)
    step_rows = [r for r in rows if r["val_loss"] == ""]
    epoch_rows = [r for r in rows if r["val_loss"] != ""]
    assert [int(r["step"]) for r in step_rows] == [4, 8, 12, 16, 20]
    assert [int(r["step"]) for r in epoch_rows] == [10, 20] and all(r["loss"] == "" for r in epoch_rows)
    assert all(float(r["loss_scale"]) > 0 and float(r["samples_per_s"]) > 0 for r in step_rows)
    assert float(epoch_rows[-1]["train_loss"]) > 0 and 0 <= float(epoch_rows[-1]["data_fraction"]) <= 1


def test_the_csv_logger_writes_a_one_element_tensor_as_its_number(tmp_path):
    from precisionloop.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "m.csv")
    logger.log_metrics({"loss": torch.tensor(1.5), "acc": torch.tensor([0.25])}, 1)
    assert (tmp_path / "m.csv").read_text().splitlines() == ["step,loss,acc", "1,1.5,0.25"]


def test_a_logger_is_any_object_with_log_metrics():
    seen = []

    class Mine:
        def log_metrics(self, metrics, step):
            seen.append((step, dict(metrics)))

    trainer = make_trainer("bf16")
    trainer.fit(DataLoader(dataset(), batch_size=4), progress=False, loggers=[Mine()], log_every=5)
    assert [s for s, m in seen if "lr" in m] == [5, 10] and "loss_scale" not in seen[0][1]
    assert seen[-1][0] == 10 and "train_loss" in seen[-1][1]


def test_the_tensorboard_logger_writes_scalars_or_names_its_extra(tmp_path):
    from precisionloop.loggers import TensorBoardLogger

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"pip install tensorboard"):
            TensorBoardLogger(tmp_path)
        return
    logger = TensorBoardLogger(tmp_path)
    make_trainer("bf16").fit(DataLoader(dataset(), batch_size=4), progress=False, loggers=[logger], log_every=5)
    logger.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))


class ModeProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []  # (training, grad enabled) per forward

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled()))
        return x


def test_fit_trains_in_train_mode():
    """fit() trains in train mode even after model.eval(); validation is in eval mode."""
    torch.manual_seed(0)
    probe = ModeProbe()
    model = nn.Sequential(nn.Linear(8, 16), probe, nn.ReLU(), nn.Linear(16, 3))
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    model.eval()
    t.fit([batch(2), batch(3)], epochs=1, val_loader=[batch(4)], progress=False)
    train = [training for training, grad in probe.seen if grad]
    val = [training for training, grad in probe.seen if not grad]
    assert len(train) == 2 and len(val) == 1
    assert all(train), f"training forwards saw training={train}"
    assert not any(val)


def shuffled_loader():
    # Shuffled by the global RNG (no explicit generator): the order fit() replays on resume.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (24,), generator=g)), batch_size=4, shuffle=True)


@pytest.mark.parametrize("accum, nth", [(1, 4), (2, 3), (2, 4)], ids=["accum1", "accum2-first-micro-batch", "accum2-second-micro-batch"])
def test_interrupt_in_backward_leaks_no_partial_gradient(accum, nth):
    """A KeyboardInterrupt in backward leaves no partial .grad; resuming fit matches."""
    loader = shuffled_loader()
    torch.manual_seed(5)
    ref_m, ref = mk(grad_accum_steps=accum)
    torch.manual_seed(5)
    ref.fit(loader, epochs=2, progress=False)

    m, t = mk(grad_accum_steps=accum)
    torch.manual_seed(5)
    calls = [0]

    def interrupt(g):
        calls[0] += 1
        if calls[0] == nth:  # layer 0's weight gets its gradient last in backward: the others have theirs
            raise KeyboardInterrupt
        return g

    handle = m[0].weight.register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        t.fit(loader, epochs=2, progress=False)
    handle.remove()
    t.fit(loader, epochs=2, progress=False)
    assert t.global_step == ref.global_step
    assert same_models(m, ref_m)


def test_end_of_epoch_flush_counts_like_any_step(tmp_path):
    """The end-of-epoch flush reaches callbacks and periodic checkpoints."""
    from precisionloop import Checkpoints

    _, t = mk(grad_accum_steps=2)

    class Count:
        n = 0

        def on_step_end(self, trainer, result):
            Count.n += result.stepped or result.skipped

    t.fit([batch(i) for i in range(5)], epochs=2, progress=False, callbacks=[Count()],
          checkpoints=Checkpoints(tmp_path, every=3))
    assert t.global_step == 6
    assert Count.n == t.global_step
    assert (tmp_path / "step-00000003.pt").is_file()
    assert (tmp_path / "step-00000006.pt").is_file()


def plateau(optimizer):
    # threshold_mode="abs" with a huge threshold: no epoch after the first counts as better,
    # whatever the loss, so with patience=0 the LR halves after every epoch after the first.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0,
                                                      threshold=1e9, threshold_mode="abs")


def with_plateau():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, Trainer(m, opt, "fp32", device="cpu", scheduler=plateau(opt))


def test_reduce_lr_on_plateau_steps_with_val_loss_each_epoch():
    """fit steps ReduceLROnPlateau with the validation loss at each epoch end."""
    m, t = with_plateau()
    data, val = [batch(2), batch(3)], [batch(4)]
    lrs, history = [], []
    for epochs in (1, 2, 3):
        history += t.fit(data, epochs=epochs, val_loader=val, progress=False)
        lrs.append(t.optimizer.param_groups[0]["lr"])
    assert lrs == [0.1, 0.05, 0.025]
    assert t.scheduler.best == pytest.approx(history[0]["val_loss"], rel=1e-6)


def test_reduce_lr_on_plateau_needs_val_loader():
    """fit with ReduceLROnPlateau and no val_loader is a ValueError before training."""
    m, t = with_plateau()
    before = params_of(m)
    with pytest.raises(ValueError) as info:
        t.fit([batch(2), batch(3)], epochs=1, progress=False)
    assert "ReduceLROnPlateau" in str(info.value) and "val_loader" in str(info.value)
    assert same_params(m, before) and t.global_step == 0


def test_step_alone_never_steps_reduce_lr_on_plateau():
    """Trainer.step never steps a ReduceLROnPlateau."""
    m, t = with_plateau()
    for i in range(3):
        assert t.step(batch(i)).stepped
    assert t.optimizer.param_groups[0]["lr"] == 0.1
    assert t.scheduler.last_epoch == 0


class PlusTen(Trainer):
    def compute_loss(self, outputs, targets):
        return super().compute_loss(outputs, targets) + 10


def test_evaluate_and_fits_validation_use_an_overridden_compute_loss():
    m = net()
    t = PlusTen(m, torch.optim.SGD(m.parameters(), lr=0.0), "fp32", device="cpu")
    with torch.no_grad():
        plain = F.cross_entropy(m(B[0]), B[1]).item()
    assert t.evaluate([B])["val_loss"] == pytest.approx(plain + 10, rel=1e-6)
    record = t.fit([B], epochs=1, val_loader=[B], progress=False)[0]  # lr=0: training changes nothing
    assert record["val_loss"] == pytest.approx(record["train_loss"], rel=1e-6) == pytest.approx(plain + 10, rel=1e-6)


class Doubled(Trainer):
    def forward_batch(self, batch):
        inputs, targets = batch
        return self.model(inputs * 2), targets


class DoubledPlusTen(Doubled, PlusTen):
    pass


@pytest.mark.parametrize("cls", [PlusTen, Doubled, DoubledPlusTen])
def test_validation_runs_the_model_once_per_batch_whatever_is_overridden(cls):
    m, calls = net(), []
    m.register_forward_hook(lambda *args: calls.append(1))
    t = cls(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu")
    metrics = {"acc": MulticlassAccuracy(num_classes=3, average="micro")}
    assert 0 <= t.evaluate([B] * 5, metrics)["acc"] <= 1 and len(calls) == 5
    t.fit([B], val_loader=[B] * 5, metrics=metrics, progress=False)
    assert len(calls) == 5 + 1 + 5


def test_dict_batch_subclass_works_everywhere():
    """A dict-batch subclass works in step, fit(+val, underflow_every) and evaluate(+metric)."""
    m = net()
    t = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step(dict_batch(1)).stepped
    history = t.fit([dict_batch(2), dict_batch(3)], epochs=1, val_loader=[dict_batch(4)], progress=False,
                    underflow_every=1)
    assert "val_loss" in history[0] and len(t.underflow_history) == 2
    result = t.evaluate([dict_batch(5)], metrics={"acc": MulticlassAccuracy(num_classes=3)})
    assert 0.0 <= result["acc"] <= 1.0


def _accumulating_dropout_trainer():
    model = dropout_mlp()
    return model, Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32", device="cpu",
                          grad_accum_steps=3)


class _Augmented(torch.utils.data.Dataset):
    """Random noise added in __getitem__: a main-process DataLoader draws it from the global RNG."""

    def __init__(self):
        self.base = dataset()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


def _augmented_loader():
    return DataLoader(_Augmented(), batch_size=4, shuffle=True)


def _straight_run(epochs=2):
    seed_all(11)
    model, trainer = _accumulating_dropout_trainer()
    seed_all(12)
    trainer.fit(_augmented_loader(), epochs=epochs, progress=False)
    return model, trainer


@pytest.mark.parametrize("where, at, start", [("callback", 16, 3), ("callback", 12, 0), ("loader", 4, 3),
                                              ("loader", 0, 0)],
                         ids=["callback-mid-accumulation", "callback-first-batch", "loader-mid-accumulation", "loader-first-batch"])
def test_an_interrupt_mid_accumulation_can_be_saved_and_resumes_as_if_uninterrupted(tmp_path, where, at, start):
    """A Ctrl-C in a callback or while the loader reads, with gradients accumulated: fit drops them and puts the
    batches and the RNG (dropout, augmentation) back to its start, so save works and the resumed run, shuffle
    included, is the uninterrupted one. 10 batches an epoch, 3 accumulated per step, 11 callbacks in epoch 1 (the flush)."""
    ref_model, ref = _straight_run()
    seed_all(11)
    model, trainer = _accumulating_dropout_trainer()
    seed_all(12)
    calls = []

    class Interrupt:
        def on_step_end(self, trainer, result):
            calls.append(result.stepped or result.skipped)
            if where == "callback" and len(calls) == at:
                raise KeyboardInterrupt

    class Loader:  # the DataLoader, interrupted in epoch 2 once batch `at` is read
        def __init__(self):
            self.inner, self.epoch = _augmented_loader(), 0

        def __len__(self):
            return len(self.inner)

        def __iter__(self):
            self.epoch += 1
            for i, b in enumerate(self.inner):
                if where == "loader" and self.epoch == 2 and i == at:
                    raise KeyboardInterrupt
                yield b

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(Loader(), epochs=2, progress=False, callbacks=[Interrupt()])
    assert trainer.flush() is None and trainer.batch_in_epoch == start  # the accumulated gradients were dropped
    trainer.save(tmp_path / "ckpt.pt")
    seed_all(99)  # the process's RNG moves on: the checkpoint holds the RNG as the interrupted step began
    model2, resumed = _accumulating_dropout_trainer()
    resumed.load(tmp_path / "ckpt.pt")
    # The same kind of loader (a generator over a DataLoader iterates it lazily, so it draws its seeds at the first
    # batch, not at iter()); a fresh one, at its first epoch, does not interrupt.
    resumed.fit(Loader(), epochs=2, progress=False)
    assert resumed.global_step == ref.global_step
    assert same_models(model2, ref_model)


def test_a_max_steps_stop_mid_epoch_with_validation_resumes_as_if_uninterrupted(tmp_path):
    """The validation after the stop iterates a DataLoader, which draws its seed from the global RNG: fit puts the
    RNG back after validating, so the checkpoint resumes the run as it would have gone on."""
    def run():
        seed_all(3)
        model = dropout_mlp()
        return model, Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32", device="cpu")

    val = DataLoader(dataset(16, seed=5), batch_size=4, shuffle=True)
    ref_model, ref = run()
    seed_all(4)
    ref.fit(DataLoader(dataset(), batch_size=4, shuffle=True), epochs=2, progress=False)
    model, trainer = run()
    seed_all(4)
    trainer.fit(DataLoader(dataset(), batch_size=4, shuffle=True), epochs=2, max_steps=13, val_loader=val,
                progress=False)
    trainer.save(tmp_path / "ckpt.pt")
    model2, resumed = run()
    resumed.load(tmp_path / "ckpt.pt")
    resumed.fit(DataLoader(dataset(), batch_size=4, shuffle=True), epochs=2, progress=False)
    assert resumed.global_step == ref.global_step == 20 and same_models(model2, ref_model)


def test_train_loss_is_the_mean_of_the_finite_losses_when_a_step_is_skipped():
    """A NaN batch's step is skipped; its NaN loss is left out of train_loss."""
    data = [b for b in batches(5)]
    data[2] = (torch.full_like(data[2][0], float("nan")), data[2][1])
    losses = []

    class Read:
        def on_step_end(self, trainer, result):
            losses.append(result.loss)

    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    record = trainer.fit(data, progress=False, callbacks=[Read()])[0]
    assert trainer.stats.skipped == 1
    assert math.isnan(losses[2]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 2)
    assert record["train_loss"] == pytest.approx(sum(v for i, v in enumerate(losses) if i != 2) / 4)


def test_gradients_accumulated_by_hand_before_fit_are_dropped_by_an_exception_in_fit():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=3)
    data = batches(4)
    trainer.step(data[0])

    class Stop:
        def on_step_end(self, trainer, result):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, progress=False, callbacks=[Stop()])
    assert trainer.flush() is None and trainer.batch_in_epoch == 0
    assert all(p.grad is None for p in model.parameters())
    trainer.state_dict()  # nothing is left open: a save may follow


@pytest.mark.parametrize("how", ["same-process", "checkpoint"])
def test_a_loader_with_its_own_generator_resumes_its_shuffle(tmp_path, how):
    """DataLoader(generator=...) draws each epoch's order from that generator, not the global RNG: an epoch
    resumed mid-way puts it back as the epoch began, so its order, and the next epoch's, are the ones trained."""
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())

    def run(stop_at=None):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
        loader = lambda: DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))
        if stop_at is None:
            trainer.fit(loader(), epochs=3, progress=False)
            return model
        live = loader()
        trainer.fit(live, epochs=3, max_steps=stop_at, progress=False)  # stops in epoch 2
        if how == "same-process":
            trainer.fit(live, epochs=3, progress=False)
            return model
        trainer.save(tmp_path / "c.pt")
        torch.manual_seed(0)
        fresh_model = nn.Linear(4, 2)
        fresh = Trainer(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.1), "fp32", device="cpu")
        fresh.load(tmp_path / "c.pt")
        fresh.fit(loader(), epochs=3, progress=False)
        return fresh_model

    assert same_models(run(), run(stop_at=11))


def test_a_loss_of_shape_one_trains_and_fit_counts_its_batches():
    model = nn.Linear(8, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu",
                      loss_fn=lambda out, y: F.cross_entropy(out, y).reshape(1))
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(3)]
    history = trainer.fit(data, epochs=2, progress=False)
    assert trainer.global_step == 6 and trainer.epoch == 2 and math.isfinite(history[-1]["train_loss"])


def test_checkpoints_refuse_a_period_or_a_count_below_one(tmp_path):
    from precisionloop import Checkpoints

    for bad in (dict(every=0), dict(every=10, keep_last=0)):
        with pytest.raises(ValueError, match="every >= 1 and keep_last >= 1"):
            Checkpoints(tmp_path, **bad)


def test_fit_averages_low_precision_losses_in_fp32():
    class BF16Loss(Trainer):
        def compute_loss(self, outputs, targets):  # 1 + 2^-7 is exact in bf16; three of them summed in bf16 are not
            return (outputs.float().sum() * 0 + 1.0078125).bfloat16()

    model = tiny_mlp()
    trainer = BF16Loss(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert trainer.fit(batches(3), epochs=1, progress=False)[0]["train_loss"] == 1.0078125


def test_fit_leaves_open_an_iterator_it_did_not_make():
    """A stream passed as the loader is the caller's: fit stopped by max_steps leaves it open for the next fit."""
    _, trainer = mk()

    def stream():
        for seed in range(100):
            yield batch(seed)

    batches_in = stream()
    trainer.fit(batches_in, max_steps=3, progress=False)
    trainer.fit(batches_in, max_steps=6, progress=False)
    assert trainer.global_step == 6
