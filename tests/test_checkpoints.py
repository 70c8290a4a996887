"""Checkpoints: save and load, bitwise-exact resume, atomic saves and file modes, all-or-nothing loads, and the
checks a loaded state must pass (the model's keys, shapes and dtypes; the optimizer's class and group sizes; the
scheduler's class and interval). A refused load leaves the Trainer exactly as it was."""

from __future__ import annotations

import copy
import os
import random
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from conftest import (B, X, Y, _scheduled, _trainer, batch, batches, dataset, make_trainer, mk, opt_state, params_of,
                      net, pure_bf16, same_models, same_params, same_state, seed_all, tiny_mlp)

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


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


def loader():
    # A shuffled DataLoader with no explicit generator: its order comes from the global RNG.
    return DataLoader(NoisyDataset(dataset()), batch_size=4, shuffle=True)


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
    from test_checkpoints import make_trainer, loader, seed_all
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
    state = torch.load(tmp_path / "c.pt", weights_only=True)  # plain tensors and containers: no pickled code
    model = trainer.model.state_dict()
    assert state["model"].keys() == model.keys() and all(torch.equal(v, model[k]) for k, v in state["model"].items())


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


def test_a_scripts_own_checkpoint_is_named_for_what_it_is_with_the_way_forward(tmp_path):
    """A torch file holding a type weights-only loading refuses (an argparse.Namespace, as torchvision's reference
    scripts save) is not called corrupt; the message is whole and plain."""
    import argparse

    trainer = make_trainer("bf16")
    path = tmp_path / "model_0.pth"
    torch.save({"model": trainer.model.state_dict(), "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(ValueError) as info:
        trainer.load(path)
    message = str(info.value)
    assert "torch file from another program" in message and "argparse.Namespace" in message
    assert "weights_only=False" in message and "before building the Trainer" in message
    assert "\x1b" not in message and "corrupt" not in message


class Counters:
    """A hand loop's own state, with a state_dict."""

    def __init__(self, epoch=0):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def test_a_hand_loops_own_state_round_trips_with_the_trainers(tmp_path):
    model, trainer = mk("bf16")
    ema = torch.optim.swa_utils.AveragedModel(model)
    trainer.step(B)
    ema.update_parameters(model)
    trainer.step(batch(2))
    ema.update_parameters(model)
    settings = {"dtype": torch.bfloat16, "seen": {1, 2}}  # what weights-only loading takes besides tensors
    trainer.save(tmp_path / "c.pt", extra={"ema": ema, "counters": Counters(epoch=3), "settings": Counters(settings)})
    fresh_model, fresh = mk("bf16")
    fresh_ema, counters, loaded = torch.optim.swa_utils.AveragedModel(fresh_model), Counters(), Counters()
    fresh.load(tmp_path / "c.pt", extra={"ema": fresh_ema, "counters": counters, "settings": loaded})
    assert counters.epoch == 3 and loaded.epoch == settings
    assert same_models(fresh_ema, ema) and same_models(fresh_model, model)
    assert torch.equal(fresh_ema.n_averaged, ema.n_averaged)


def test_own_state_a_checkpoint_could_not_load_is_refused_when_saved(tmp_path):
    _, trainer = mk("bf16")
    with pytest.raises(TypeError, match=r"'counters'.*numpy.*float\(\)"):
        trainer.save(tmp_path / "c.pt", extra={"counters": Counters(epoch=np.float64(3.0))})
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("case", ["a name not saved", "a state refused"])
def test_a_load_whose_own_state_does_not_fit_changes_nothing(tmp_path, case):
    _, trainer = mk("bf16")
    trainer.step(B)
    trainer.save(tmp_path / "c.pt", extra={"counters": Counters(epoch=3), "ema": nn.Linear(2, 2)})
    _, fresh = mk("bf16")
    counters, before = Counters(), params_of(fresh.model)
    extra = {"counters": counters, "ema": nn.Linear(3, 3)} if case == "a state refused" else {"other": Counters()}
    with pytest.raises(ValueError, match="ema did not load its state|no state for other.*nothing was loaded"):
        fresh.load(tmp_path / "c.pt", extra=extra)
    assert counters.epoch == 0 and all(torch.equal(p, q) for p, q in zip(fresh.model.parameters(), before))
    assert fresh.global_step == 0


def test_loading_under_another_precision_warns_with_both_names(tmp_path):
    trainer = make_trainer("fp16")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=2, progress=False)
    trainer.save(tmp_path / "c.pt")
    other = make_trainer("bf16")
    with pytest.warns(UserWarning, match="'fp16'.*'bf16'") as record:
        other.load(tmp_path / "c.pt")
    assert record[0].filename == __file__  # the caller's line, through load or load_state_dict alike
    third = make_trainer("bf16")
    with pytest.warns(UserWarning, match="'fp16'.*'bf16'") as record:
        third.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert record[0].filename == __file__
    for p, q in zip(trainer.model.parameters(), other.model.parameters()):
        assert torch.equal(p, q)
    assert other.stats.scale is None and other.stats.min_scale is None  # no scaler here: the saved scale is gone
    record = other.fit(DataLoader(dataset(), batch_size=4), epochs=2, max_steps=3, progress=False)[-1]
    assert record["stats_scale"] is None and record["stats_max_scale"] is None
    other.save(tmp_path / "bf16.pt")  # neither bf16 nor fp32 has a scaler: the warning names none
    with pytest.warns(UserWarning, match=r"saved under precision 'bf16' and is loaded under 'fp32'$"):
        make_trainer("fp32").load(tmp_path / "bf16.pt")


def test_periodic_checkpoints_rotate(tmp_path):
    trainer = make_trainer("bf16")
    from precisionloop import Checkpoints

    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, checkpoints=Checkpoints(tmp_path, every=3, keep_last=2),
                progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006.pt", "step-00000009.pt"]
    fresh = make_trainer("bf16")
    fresh.load(tmp_path / "step-00000009.pt")
    assert fresh.global_step == 9 and fresh.batch_in_epoch == 9


def test_save_with_gradients_accumulated_is_refused(tmp_path):
    trainer = make_trainer("fp32", grad_accum_steps=2)
    trainer.step(next(iter(DataLoader(dataset(), batch_size=4))))
    with pytest.raises(RuntimeError, match="accumulat"):
        trainer.save(tmp_path / "c.pt")
    trainer.flush()
    trainer.save(tmp_path / "c.pt")


def test_resume_with_fewer_batches_is_an_error(tmp_path):
    trainer = make_trainer("fp32")
    trainer.fit(DataLoader(dataset(), batch_size=4), epochs=1, max_steps=7, progress=False)
    trainer.save(tmp_path / "c.pt")
    other = make_trainer("fp32")
    other.load(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="5 batches"):
        other.fit(DataLoader(dataset(20), batch_size=4), epochs=1, progress=False)


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


def _step_scheduled(kind, interval, seed=0):
    model = tiny_mlp(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = (torch.optim.lr_scheduler.StepLR(opt, 1) if kind == "StepLR"
                 else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    return Trainer(model, opt, "fp32", device="cpu", scheduler=scheduler, scheduler_interval=interval)


@pytest.mark.parametrize("loaded_by, match", [(("StepLR", "epoch"), "scheduler_interval='step'"),
                                              (("LambdaLR", "step"), "StepLR.*LambdaLR")], ids=["interval", "class"])
def test_a_checkpoint_of_another_scheduler_is_refused_before_anything_changes(tmp_path, loaded_by, match):
    saver = _step_scheduled("StepLR", "step")
    saver.step(batches(1)[0])
    saver.save(tmp_path / "s.pt")
    loader = _step_scheduled(*loaded_by, seed=3)
    before = params_of(loader.model)
    with pytest.raises(ValueError, match=match):
        loader.load(tmp_path / "s.pt")
    assert same_params(loader.model, before) and loader.global_step == 0


BATCH = (torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0]))


def _adam_trainer(precision: str = "fp16") -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), precision, device="cpu")


def _everything(t: Trainer) -> dict:
    """What a load can change: weights, optimizer state and groups, counters, stats, loss scale, RNGs."""
    return copy.deepcopy({
        "weights": [p.detach().clone() for p in t.model.parameters()],
        "optimizer": t.optimizer.state_dict(),
        "counters": (t.global_step, t.epoch, t.batch_in_epoch),
        "stats": t.stats,
        "scaler": t.scaler.state_dict() if t.scaler is not None else None,
        "rng": (torch.get_rng_state(), random.getstate(), torch.from_numpy(np.random.get_state()[1].copy())),
    })


DAMAGES = {  # what a load checks: the model's keys, shapes and dtypes, and the optimizer's param-group sizes
    "a weight missing": (lambda s: s["model"].pop("weight"), "weight"),
    "an unknown weight": (lambda s: s["model"].update(extra=torch.zeros(3)), "extra"),
    "a weight of another shape": (lambda s: s["model"].update(weight=torch.zeros(5, 4)), "weight"),
    "int64 weights": (lambda s: s["model"].update(weight=s["model"]["weight"].long()), "int64"),
    "fp64 weights": (lambda s: s["model"].update(bias=s["model"]["bias"].double()), "float64"),
    "a param group of another size": (lambda s: s["optimizer"]["param_groups"][0].update(params=[0]), "param"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(case):
    damage, message = DAMAGES[case]
    source = _adam_trainer()
    source.step(BATCH)
    state = copy.deepcopy(source.state_dict())
    damage(state)

    t = _adam_trainer()
    for _ in range(3):
        t.step(BATCH)
    before = _everything(t)
    with pytest.raises(ValueError, match=message):
        t.load_state_dict(state)
    after = _everything(t)
    assert same_state(after, before)
    assert t.step(BATCH).stepped  # and it trains on


def test_a_model_the_user_compiled_resumes_exactly():
    """torch.compile(model) passed in: its names carry _orig_mod., the saved state's do not. It saved, but no load
    fitted (\"missing _orig_mod.0.weight\"), and keep_fp32 patterns had to name the wrapper's prefix."""
    from precisionloop import BF16Policy

    def make() -> Trainer:
        torch.manual_seed(0)
        model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), BF16Policy(keep_fp32=("2",)), device="cpu")

    straight = make()
    straight.step(BATCH)
    state = copy.deepcopy(straight.state_dict())
    for _ in range(2):
        straight.step(BATCH)
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.step(BATCH)
    assert same_models(resumed.model, straight.model)
    assert resumed.stats == straight.stats


def momentum_sgd(params, lr):
    return torch.optim.SGD(params, lr, momentum=0.9)


def test_save_before_first_step_changes_nothing(tmp_path):
    """save() before the first step does not change training."""
    m, t = mk()
    t.save(tmp_path / "early.pt")
    t.step(batch(2))
    t.step(batch(3))
    ref_m, ref = mk()
    ref.step(batch(2))
    ref.step(batch(3))
    assert float(t.optimizer.state[m[0].weight]["step"]) == 2
    assert same_state(t.optimizer.state_dict(), ref.optimizer.state_dict())
    assert same_models(m, ref_m)


def test_load_from_another_optimizer_class_is_a_value_error(tmp_path):
    """A checkpoint from another optimizer class raises ValueError naming both."""
    _, sgd = mk(opt=momentum_sgd)
    sgd.step(B)
    sgd.save(tmp_path / "sgd.pt")
    torch.manual_seed(123)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 3))
    t = Trainer(m, torch.optim.AdamW(m.parameters(), lr=0.1), "fp32", device="cpu")
    t.step(B)
    before, state, step = params_of(m), opt_state(t.optimizer), t.global_step
    with pytest.raises(ValueError) as info:
        t.load(tmp_path / "sgd.pt")
    assert "SGD" in str(info.value) and "AdamW" in str(info.value)
    assert same_params(m, before)
    assert same_state(t.optimizer.state_dict(), state)
    assert t.global_step == step


def test_load_discards_the_gradients_accumulated_so_far(tmp_path):
    m, t = mk(grad_accum_steps=2)
    t.step(batch(2))
    t.step(batch(3))
    t.save(tmp_path / "ckpt.pt")
    t.step(batch(4))  # accumulates, without an optimizer step
    t.load(tmp_path / "ckpt.pt")
    torch.manual_seed(99)
    fresh_m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 3))
    fresh = Trainer(fresh_m, torch.optim.AdamW(fresh_m.parameters(), lr=0.1), "fp32", device="cpu",
                    grad_accum_steps=2)
    fresh.load(tmp_path / "ckpt.pt")
    for tr in (t, fresh):
        tr.step(batch(5))
        tr.step(batch(6))
    assert same_models(m, fresh_m)
    assert same_state(t.optimizer.state_dict(), fresh.optimizer.state_dict())


def test_checkpoint_file_mode_follows_umask(tmp_path):
    """Checkpoint files get mode 0o666 & ~umask, like torch.save and open()."""
    _, t = mk()
    t.step(B)
    old = os.umask(0o022)
    try:
        path = t.save(tmp_path / "ckpt.pt")
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~0o022)


def test_load_keeps_the_live_optimizers_fused_kernel(tmp_path):
    """A checkpoint of a foreach run, loaded into a fused optimizer, keeps the fused kernel."""
    a = tiny_mlp()
    saver = Trainer(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), "bf16", device="cpu")
    saver.step(batches(1)[0])
    saver.save(tmp_path / "c.pt")
    b = tiny_mlp()
    optimizer = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, fused=True)
    loader = Trainer(b, optimizer, "bf16", device="cpu")
    loader.load(tmp_path / "c.pt")
    assert optimizer.param_groups[0]["fused"] is True
    assert loader.step(batches(2)[1]).stepped


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x)  # b never gets a gradient


def test_a_parameter_that_never_had_a_gradient_loads(tmp_path):
    torch.manual_seed(0)
    model = _TwoHeads()
    trainer = Trainer(model, torch.optim.Adam(model.parameters()), "bf16", device="cpu")
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    trainer.step(batch)
    trainer.save(tmp_path / "u.pt")
    other = _TwoHeads()
    resumed = Trainer(other, torch.optim.Adam(other.parameters()), "bf16", device="cpu")
    resumed.load(tmp_path / "u.pt")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    assert other.b.weight not in resumed.optimizer.state or not resumed.optimizer.state[other.b.weight]
    trainer.step(batch)
    resumed.step(batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


def test_keep_last_never_deletes_this_runs_newest_checkpoint(tmp_path):
    for stale in (11, 12):  # an earlier, longer run's files with higher step numbers
        (tmp_path / f"step-{stale:08d}.pt").write_bytes(b"old")
        os.utime(tmp_path / f"step-{stale:08d}.pt", (1, 1))
    from precisionloop import Checkpoints

    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    trainer.fit(batches(4), epochs=1, progress=False, checkpoints=Checkpoints(tmp_path, every=1, keep_last=2))
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000003.pt", "step-00000004.pt"]


# save() keeps the mode open() would -------------------------------------------------------------------------------

def test_save_over_a_file_keeps_its_mode(tmp_path):
    t = _trainer()
    path = t.save(tmp_path / "ckpt.pt")
    os.chmod(path, 0o600)
    t.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_state_dict_holds_the_live_tensors_as_documented():
    """The docstring's promise: training on changes the weights in it; a deepcopy keeps a snapshot."""
    t = _trainer()
    t.step((X, Y))
    live, snapshot = t.state_dict(), copy.deepcopy(t.state_dict())
    t.step((X, Y))
    assert torch.equal(live["model"]["weight"], t.model.weight)
    assert not torch.equal(snapshot["model"]["weight"], t.model.weight)


def test_pure_bf16_saves_bf16_weights_that_resume_exactly_and_load_into_an_fp32_model(tmp_path):
    model, trainer = pure_bf16()
    for seed in (1, 2):
        trainer.step(batch(seed))
    trainer.save(tmp_path / "pure.pt")
    saved = torch.load(tmp_path / "pure.pt", weights_only=True)
    assert {v.dtype for v in saved["model"].values()} == {torch.bfloat16}  # the training dtype, no fp32 copy
    trainer.step(batch(3))  # stochastic rounding draws random numbers: the checkpoint's RNG state replays them
    resumed_model, resumed = pure_bf16()
    resumed.load(tmp_path / "pure.pt")
    resumed.step(batch(3))
    assert same_models(model, resumed_model) and same_state(opt_state(trainer.optimizer), opt_state(resumed.optimizer))
    fp32 = net()
    fp32.load_state_dict(saved["model"])  # torch casts each bf16 tensor to the fp32 parameter's dtype, exactly
    assert all(p.dtype == torch.float32 and torch.equal(p, saved["model"][n].float()) for n, p in fp32.named_parameters())


def test_an_activation_checkpointed_model_round_trips_its_optimizer_state(tmp_path):
    """Its parameters' names carry checkpoint_wrapper's part, which torch.distributed.checkpoint's state drops."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(checkpoint_wrapper(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 4))
        return model, Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32", device="cpu")

    model, trainer = make()
    trainer.step((torch.randn(8, 16), torch.randint(0, 4, (8,))))
    trainer.save(tmp_path / "c.pt")
    model2, resumed = make()
    resumed.load(tmp_path / "c.pt")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    assert torch.equal(resumed.optimizer.state[model2[0]._checkpoint_wrapped_module.weight]["exp_avg"],
                       trainer.optimizer.state[model[0]._checkpoint_wrapped_module.weight]["exp_avg"])


def test_a_checkpoint_saved_by_version_0_2_0_loads_or_is_refused_naming_its_version():
    """tests/data/checkpoint-0.2.0.pt: nn.Linear(4, 2) after three fp32 steps of momentum SGD (lr 0.1) with a
    StepLR(step_size=1, gamma=0.5) stepped per optimizer step, saved by precisionloop 0.2.0."""
    path = Path(__file__).parent / "data" / "checkpoint-0.2.0.pt"
    saved = torch.load(path, weights_only=True)["model"]
    torch.manual_seed(3)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                      scheduler_interval="step")
    before = params_of(model)
    try:
        trainer.load(path)
    except ValueError as error:
        assert "0.2.0" in str(error) or "version 1" in str(error), error
        assert same_params(model, before) and trainer.global_step == 0
    else:
        assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters())
        assert trainer.global_step == 3 and optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
        assert trainer.step((torch.randn(4, 4), torch.tensor([0, 1, 1, 0]))).stepped
