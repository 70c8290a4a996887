import logging
import math
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from conftest import batches, fp32_only_loss, tiny_mlp, count_flag_writes, read_flags, tf32_flags, write_flags

from precisionloop import FP16Policy, Trainer
from precisionloop import policy as policy_mod

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def dataset(n=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


class NoisyDataset(Dataset):
    """Draws from torch, numpy and Python RNGs while loading, like random augmentation does."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        noise = 0.01 * (torch.randn(()) + float(np.random.randn()) + random.random())
        return x + noise, y


def dropout_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def make_trainer(precision, seed=0, **kwargs):
    model = dropout_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    policy = FP16Policy(growth_interval=4) if precision == "fp16" else precision
    return Trainer(model, opt, policy, device="cpu", scheduler=sched, scheduler_interval="step", **kwargs)


def loader():
    # A shuffled DataLoader with no explicit generator: its order comes from the global RNG.
    return DataLoader(NoisyDataset(dataset()), batch_size=4, shuffle=True)


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("grad_accum_steps", [1, 3])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_mid_epoch_resume_is_bitwise_exact(tmp_path, precision, grad_accum_steps):
    seed_all(0)
    full = make_trainer(precision, grad_accum_steps=grad_accum_steps)
    full.fit(loader(), epochs=3, progress=False)

    seed_all(0)
    first = make_trainer(precision, grad_accum_steps=grad_accum_steps)
    first.fit(loader(), epochs=3, max_steps=5, progress=False)  # stops inside epoch 2 (4 steps/epoch) or 1
    assert first.batch_in_epoch > 0, "the test must stop mid-epoch"
    first.save(tmp_path / "ckpt.pt")

    seed_all(12345)  # a fresh process would start from some other RNG state
    resumed = make_trainer(precision, seed=7, grad_accum_steps=grad_accum_steps)
    resumed.load(tmp_path / "ckpt.pt")
    resumed.fit(loader(), epochs=3, progress=False)

    assert resumed.global_step == full.global_step and resumed.epoch == 3
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    assert resumed.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]
    if precision == "fp16":
        assert resumed.scaler.get_scale() == full.scaler.get_scale()


RESUME_SCRIPT = textwrap.dedent("""
    import random, sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_fit import make_trainer, loader, seed_all
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "first":
        seed_all(0)
        t = make_trainer("fp16")
        t.fit(loader(), epochs=2, max_steps=6, progress=False)
        t.save(path)
    else:
        t = make_trainer("fp16", seed=99)
        t.load(path)
        t.fit(loader(), epochs=2, progress=False)
        torch.save([p.detach() for p in t.model.parameters()], path + ".params")
""")


def test_resume_in_a_fresh_process_is_bitwise_exact(tmp_path):
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(tests=str(Path(__file__).parent)))
    ckpt = str(tmp_path / "ckpt.pt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for mode in ("first", "second"):
        subprocess.run([sys.executable, str(script), mode, ckpt], check=True, env=env, timeout=300)
    seed_all(0)
    full = make_trainer("fp16")
    full.fit(loader(), epochs=2, progress=False)
    for p, q in zip(full.model.parameters(), torch.load(ckpt + ".params")):
        assert torch.equal(p, q)


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


def test_final_partial_window_is_stepped_and_epochs_count_restored_ones(tmp_path):
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
            self.steps.append(result.due)

        def on_epoch_end(self, trainer, record):
            self.epochs.append(record["epoch"])

    recorder = Recorder()
    trainer = make_trainer("bf16")
    history = trainer.fit(DataLoader(dataset(), batch_size=4), epochs=5, max_steps=13, progress=False, callbacks=[recorder, object()])
    assert trainer.global_step == 13 and trainer.epoch == 1 and trainer.batch_in_epoch == 3
    assert len(recorder.steps) == 13 and recorder.epochs == [1, 2]
    assert [h["complete"] for h in history] == [True, False]


def test_scaler_state_survives_save_and_load(tmp_path):
    trainer = make_trainer("fp16")
    armed = {"on": True}
    trainer.model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    data = list(DataLoader(dataset(), batch_size=4))
    trainer.step(data[0])
    armed["on"] = False
    for b in data[1:4]:
        trainer.step(b)
    state = trainer.scaler.state_dict()
    assert state["scale"] == 2.0**15 and state["_growth_tracker"] == 3
    trainer.save(tmp_path / "c.pt")
    fresh = make_trainer("fp16", seed=5)
    fresh.load(tmp_path / "c.pt")
    assert fresh.scaler.state_dict() == state
    assert fresh.stats.skipped == 1 and fresh.stats.steps == 4 and fresh.stats.min_scale == 2.0**15


def test_checkpoint_is_weights_only_loadable(tmp_path):
    trainer = make_trainer("fp16")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=2, progress=False)
    trainer.save(tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert state["precision"] == "fp16" and state["counters"]["global_step"] == 2
    assert set(state["rng"]) >= {"torch", "python", "numpy"} and state["scaler"]["scale"] > 0


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    trainer = make_trainer("bf16")
    path = tmp_path / "c.pt"
    trainer.save(path)
    before = path.read_bytes()
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=2, progress=False)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"], "the temporary file was left behind"


def test_bad_checkpoint_files_get_clear_errors(tmp_path):
    trainer = make_trainer("bf16")
    good = tmp_path / "good.pt"
    trainer.save(good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(256))
    pickled_garbage = tmp_path / "pickled-garbage.pt"
    pickled_garbage.write_bytes(b"\x80\x02" + bytes(range(256)))  # starts like a pickle, then nonsense
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    for path, message in ((truncated, "truncated"), (garbage, "truncated"), (pickled_garbage, "truncated"),
                          (foreign, "not a precisionloop checkpoint")):
        with pytest.raises(ValueError, match=message) as info:
            trainer.load(path)
        assert str(path) in str(info.value)
        assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        trainer.load(tmp_path / "missing.pt")


def test_loading_under_another_precision_warns_with_both_names(tmp_path):
    trainer = make_trainer("fp16")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=2, progress=False)
    trainer.save(tmp_path / "c.pt")
    other = make_trainer("bf16")
    with pytest.warns(UserWarning, match="'fp16'.*'bf16'"):
        other.load(tmp_path / "c.pt")
    for p, q in zip(trainer.model.parameters(), other.model.parameters()):
        assert torch.equal(p, q)


def test_periodic_checkpoints_rotate(tmp_path):
    trainer = make_trainer("bf16")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, checkpoint_dir=tmp_path, checkpoint_every=3, keep_last=2,
                progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006.pt", "step-00000009.pt"]
    fresh = make_trainer("bf16")
    fresh.load(tmp_path / "step-00000009.pt")
    assert fresh.global_step == 9 and fresh.batch_in_epoch == 9


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    trainer = make_trainer("fp32", grad_accum_steps=2)
    trainer.step(next(iter(DataLoader(dataset(), batch_size=4))))
    with pytest.raises(RuntimeError, match="accumulation window"):
        trainer.save(tmp_path / "c.pt")
    trainer.flush()
    trainer.save(tmp_path / "c.pt")


def test_fit_rejects_bad_arguments(tmp_path):
    trainer = make_trainer("fp32")
    data = DataLoader(dataset(), batch_size=4)
    with pytest.raises(ValueError, match="val_loader"):
        trainer.fit(data, metrics={"acc": MulticlassAccuracy(num_classes=4)}, progress=False)
    with pytest.raises(TypeError, match="torchmetrics"):
        trainer.fit(data, val_loader=data, metrics={"acc": lambda a, b: 0}, progress=False)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        trainer.fit(data, checkpoint_every=2, progress=False)
    with pytest.raises(ValueError, match="max_steps"):
        trainer.fit(data, max_steps=0, progress=False)
    with pytest.raises(ValueError, match="epochs"):
        trainer.fit(data, epochs=-1, progress=False)


def test_resume_with_fewer_batches_is_an_error(tmp_path):
    trainer = make_trainer("fp32")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=7, progress=False)
    trainer.save(tmp_path / "c.pt")
    other = make_trainer("fp32")
    other.load(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="only 5 batches"):
        other.fit(DataLoader(dataset(20), batch_size=4), epochs=1, progress=False)


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


@pytest.mark.parametrize("autotune", [False, True])
def test_fit_sets_the_backend_flags_once_an_epoch_not_every_step(monkeypatch, callers_flags, autotune):
    counts, seen = {}, []

    class Seen:
        def on_step_end(self, trainer, result):
            seen.append((read_flags(), trainer.policy.tf32))

    for n in (3, 9):
        writes = count_flag_writes(monkeypatch)
        model = dropout_mlp()
        # With autotune, a loss that refuses non-fp32 outputs fixes the choice (fp32 without TF32, not the
        # bf16 it starts from): on the CPU the candidates can time alike, and each run must swap policies.
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto" if autotune else "bf16",
                          device="cpu", autotune=autotune, loss_fn=fp32_only_loss if autotune else None)
        trainer.fit(DataLoader(dataset(4 * n), batch_size=4), epochs=1, progress=False, callbacks=[Seen()])
        counts[n] = len(writes)
        assert read_flags() == callers_flags  # the caller's flags are back
    assert 0 < counts[3] == counts[9], counts  # the writes do not grow with the steps
    assert not autotune or seen[-1][1] is False  # the chosen policy, which differs from the first one
    # Callbacks run under the flags of the policy that trains, the one autotune chose included.
    assert all(flags == (tf32_flags(tf32), tf32) for flags, tf32 in seen)


def test_fit_restores_the_callers_flags_when_a_step_fails(callers_flags):
    trainer = make_trainer("bf16")
    calls = []

    def failing(outputs, targets):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return nn.functional.cross_entropy(outputs, targets)

    trainer.loss_fn = failing
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, progress=False)
    assert read_flags() == callers_flags and trainer.global_step == 2


def test_a_generator_loader_stopped_by_max_steps_leaves_the_callers_flags(callers_flags):
    # The loader's own save-and-restore runs when fit stops early; it must run before fit restores the
    # caller's flags, or the policy's flags it saved would outlive fit.
    class Loader:
        def __iter__(self):
            saved = torch.backends.cudnn.benchmark
            try:
                yield from DataLoader(dataset(), batch_size=4)
            finally:
                torch.backends.cudnn.benchmark = saved

    trainer = make_trainer("bf16")
    trainer.fit(Loader(), epochs=1, max_steps=3, progress=False)
    assert trainer.global_step == 3 and read_flags() == callers_flags


def test_a_skip_limit_reached_before_fit_raises_before_the_loader_is_opened(monkeypatch):
    from precisionloop import engine

    class InFlight(engine._HostCopy):  # as on CUDA: the last skip is not booked when fit begins
        def __init__(self, row):
            super().__init__(row)
            self.event = type("Event", (), {"synchronize": lambda self: None})()

    monkeypatch.setattr(engine, "_HostCopy", InFlight)
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu", max_consecutive_skips=3)
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    for b in batches(3):
        assert trainer.step(b).skipped

    class Loader:
        opened = False

        def __len__(self):
            return 2

        def __iter__(self):  # a DataLoader starts its workers here
            Loader.opened = True
            return iter(batches(2))

    with pytest.raises(RuntimeError, match="3 optimizer steps in a row"):
        trainer.fit(Loader(), epochs=1, progress=False)
    assert not Loader.opened and trainer.global_step == 3


def test_a_failed_end_of_epoch_flush_is_replayed_by_the_next_fit(monkeypatch):
    # The last window is partial, so the epoch ends with flush(); an interrupt before its optimizer update drops
    # the window, and the next fit must train those batches again rather than resume past them.
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
        if len(calls) == 3:  # steps 1 and 2 are windows of two; the third is the flush of batch 5
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", clip_failing_in_the_flush)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, epochs=1, progress=False)
    assert trainer.global_step == 2 and trainer.loop_state.batch_in_epoch == 4
    trainer.fit(data, epochs=1, progress=False)
    assert trainer.global_step == ref.global_step == 3 and trainer.epoch == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


# The scheduler's interval: "step" after every optimizer step taken, "epoch" at each epoch's end of fit.

def _scheduled(interval, gamma=0.5):
    model = dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    return Trainer(model, opt, "fp32", device="cpu", scheduler=sched, scheduler_interval=interval)


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


def test_an_epoch_scheduler_resumes_exactly_mid_epoch(tmp_path):
    loader = DataLoader(dataset(), batch_size=4, shuffle=True)
    torch.manual_seed(0)
    full = _scheduled("epoch")
    full.fit(loader, epochs=2, progress=False)
    torch.manual_seed(0)
    first = _scheduled("epoch")
    first.fit(loader, epochs=2, max_steps=13, progress=False)  # stops in the second epoch
    first.save(tmp_path / "mid.pt")
    resumed = _scheduled("epoch")
    resumed.load(tmp_path / "mid.pt")
    resumed.fit(loader, epochs=2, progress=False)
    assert resumed.scheduler.last_epoch == full.scheduler.last_epoch == 2
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), full.model.parameters()))


def test_a_checkpoint_keeps_its_scheduler_interval(tmp_path):
    saved = _scheduled("epoch")
    saved.save(tmp_path / "epoch.pt")
    other = _scheduled("step")
    before = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(ValueError, match="scheduler_interval='epoch'.*nothing was loaded"):
        other.load(tmp_path / "epoch.pt")
    assert all(torch.equal(p, q) for p, q in zip(other.model.parameters(), before))


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
        history = trainer.fit(_SlowLoader(0.05), epochs=2, progress=False)
    assert all(r["data_fraction"] > 0.5 and r["data_s"] >= 6 * 0.05 for r in history)
    warnings_given = [r for r in caplog.records if "waited for input" in r.getMessage()]
    assert len(warnings_given) == 1 and "not the precision" in warnings_given[0].getMessage()
    assert "workers" in warnings_given[0].getMessage() and "uint8" in warnings_given[0].getMessage()


def test_a_fast_loader_gets_a_small_data_fraction_and_no_warning(caplog):
    trainer = make_trainer("fp32")
    with caplog.at_level(logging.WARNING, logger="precisionloop"):
        history = trainer.fit(_SlowLoader(0.0), epochs=1, progress=False)
    assert history[0]["data_fraction"] < 0.3
    assert not [r for r in caplog.records if "waited for input" in r.getMessage()]


def test_the_csv_logger_writes_booked_values_every_n_steps_and_each_epoch(tmp_path):
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


def test_a_logger_is_any_object_with_log_metrics_and_a_class_is_refused():
    seen = []

    class Mine:
        def log_metrics(self, metrics, step):
            seen.append((step, dict(metrics)))

    trainer = make_trainer("bf16")
    with pytest.raises(ValueError, match=r"loggers\[0\] is the class Mine \(pass an instance\)"):
        trainer.fit(DataLoader(dataset(), batch_size=4), progress=False, loggers=[Mine])
    trainer.fit(DataLoader(dataset(), batch_size=4), progress=False, loggers=[Mine()], log_every=5)
    assert [s for s, m in seen if "lr" in m] == [5, 10] and "loss_scale" not in seen[0][1]
    assert seen[-1][0] == 10 and "train_loss" in seen[-1][1]


def test_the_tensorboard_logger_writes_scalars_or_names_its_extra(tmp_path):
    from precisionloop.loggers import TensorBoardLogger

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"pip install \"precisionloop\[tensorboard\]\""):
            TensorBoardLogger(tmp_path)
        return
    logger = TensorBoardLogger(tmp_path)
    make_trainer("bf16").fit(DataLoader(dataset(), batch_size=4), progress=False, loggers=[logger], log_every=5)
    logger.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
