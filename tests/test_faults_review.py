"""Defects found by the code review and a hostile-user probe of the split (2026-11-29); each test failed before its fix."""

import collections
import copy
import os

import pytest
import torch
from conftest import batches, tiny_mlp
from torch import nn

from precisionloop import BF16Policy, FP16Policy, FP32Policy, Trainer
from precisionloop.guard import fuse_default_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_load_keeps_the_live_optimizers_fused_kernel(tmp_path):
    """A checkpoint of a foreach run, loaded into an optimizer switched to its fused kernel, keeps the fused kernel."""
    a = tiny_mlp()
    saver = Trainer(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), "bf16", device="cpu")
    saver.step(batches(1)[0])
    saver.save(tmp_path / "c.pt")
    b = tiny_mlp()
    optimizer = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    assert fuse_default_optimizer(optimizer, device_types=("cpu",))
    loader = Trainer(b, optimizer, "bf16", device="cpu")
    loader.load(tmp_path / "c.pt")
    assert optimizer.param_groups[0]["fused"] is True and optimizer.param_groups[0]["foreach"] is False
    assert loader.step(batches(2)[1]).stepped


def test_models_with_sparse_embeddings_keep_their_optimizer():
    model = nn.Sequential(nn.EmbeddingBag(10, 3, sparse=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not fuse_default_optimizer(optimizer, model, device_types=("cpu",))
    assert optimizer.param_groups[0]["fused"] is None


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.emb, self.lin2 = nn.Linear(4, 3), nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.lin(x) if x.is_floating_point() else self.lin2(self.emb(x))


def test_same_gradient_count_with_a_sparse_gradient_is_still_checked():
    torch.manual_seed(0)
    model = _Branches()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert trainer.step((torch.randn(4, 4), torch.randint(0, 3, (4,)))).stepped  # 2 dense gradients
    assert trainer.step((torch.randint(0, 10, (4,)), torch.randint(0, 3, (4,)))).stepped  # 2 again, one sparse


def test_an_error_before_the_step_keeps_the_batch_count_in_step_with_the_window():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    good, empty = (torch.randn(4, 8), torch.randint(0, 3, (4,))), (torch.randn(0, 8), torch.randint(0, 3, (0,)))
    with pytest.raises(ValueError, match="empty"):
        trainer.fit([good, empty, good, good], epochs=1, progress=False)
    # batch 0 was stepped into the still-open window; the empty batch was not consumed
    assert trainer.batch_in_epoch == 1 and trainer.engine.micro == 1


def test_autotune_builds_trial_optimizers_that_need_constructor_arguments():
    class MyOpt(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    model = tiny_mlp()
    trainer = Trainer(model, MyOpt(model.parameters(), lr=0.1), "auto", device="cpu", autotune=True)
    assert trainer.step(batches(1)[0]).stepped


def test_trainer_settings_stay_readable_and_counters_settable():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2,
                      max_grad_norm=1.0, max_consecutive_skips=5)
    assert (trainer.grad_accum_steps, trainer.max_grad_norm, trainer.max_consecutive_skips) == (2, 1.0, 5)
    trainer.global_step, trainer.epoch, trainer.batch_in_epoch = 7, 2, 3
    assert (trainer.engine.global_step, trainer.loop_state.epoch, trainer.loop_state.batch_in_epoch) == (7, 2, 3)


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


def test_fp16_step_interrupted_between_unscale_and_update_leaves_the_trainer_usable():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "fp16", device="cpu")
    trainer.step(batches(1)[0])

    def interrupt(*args):
        raise KeyboardInterrupt

    handle = optimizer.register_step_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.step(batches(2)[1])
    handle.remove()
    assert trainer.step(batches(3)[2]).stepped


def test_a_checkpoint_of_another_scheduler_is_refused_before_anything_changes(tmp_path):
    a = tiny_mlp()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    saver = Trainer(a, opt_a, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(opt_a, 1),
                    scheduler_interval="step")
    saver.step(batches(1)[0])
    saver.save(tmp_path / "s.pt")
    b = tiny_mlp(seed=3)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    loader = Trainer(b, opt_b, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0),
                     scheduler_interval="step")
    before = _params(b)
    with pytest.raises(ValueError, match="StepLR.*LambdaLR"):
        loader.load(tmp_path / "s.pt")
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before)) and loader.global_step == 0


def test_keep_last_never_deletes_this_runs_newest_checkpoint(tmp_path):
    for stale in (11, 12):  # an earlier, longer run's files with higher step numbers
        (tmp_path / f"step-{stale:08d}.pt").write_bytes(b"old")
        os.utime(tmp_path / f"step-{stale:08d}.pt", (1, 1))
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    trainer.fit(batches(4), epochs=1, progress=False, checkpoint_dir=tmp_path, checkpoint_every=1, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000003.pt", "step-00000004.pt"]


def test_meta_device_is_refused_before_the_model_moves():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="meta"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="meta")
    assert all(p.device.type == "cpu" for p in model.parameters())


class AttrDict(dict):
    __getattr__ = dict.__getitem__


class _AttrTrainer(Trainer):
    def forward_batch(self, batch):
        return self.model(batch.x), batch.y


def test_dict_subclass_batches_keep_their_type():
    model = tiny_mlp()
    trainer = _AttrTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    x, y = batches(1)[0]
    assert trainer.step(AttrDict(x=x, y=y)).stepped
    assert trainer.evaluate([AttrDict(x=x, y=y)])["val_loss"] > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(scheduler=torch.optim.lr_scheduler.CosineAnnealingLR), "scheduler"),
    (dict(max_grad_norm="1"), "max_grad_norm"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"),
])
def test_bad_trainer_arguments_are_refused_at_construction(kwargs, match):
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", **kwargs)


def test_lbfgs_is_refused_at_construction():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="LBFGS"):
        Trainer(model, torch.optim.LBFGS(model.parameters()), "fp32", device="cpu")


@pytest.mark.parametrize("make, match", [
    (lambda: FP16Policy(init_scale=float("inf")), "init_scale"),
    (lambda: FP16Policy(growth_factor=float("inf")), "growth_factor"),
    (lambda: FP32Policy(tf32="no"), "tf32"),
    (lambda: BF16Policy(channels_last="yes"), "channels_last"),
])
def test_bad_policy_arguments_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_fit_arguments_are_refused_before_training(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    before = _params(model)

    class Callback:
        def on_step_end(self, trainer, result):
            pass

    with pytest.raises(ValueError, match="callbacks"):
        trainer.fit(batches(2), progress=False, callbacks=Callback())
    with pytest.raises(ValueError, match="checkpoint_every"):
        trainer.fit(batches(2), progress=False, checkpoint_dir=tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_empty_validation_batch_does_not_make_the_loss_nan():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    x, y = batches(1)[0]
    result = trainer.evaluate([(x, y), (x[:0], y[:0])])
    assert result["val_loss"] == pytest.approx(trainer.evaluate([(x, y)])["val_loss"])


def test_modules_kept_by_an_earlier_policy_are_released():
    from precisionloop.fp32_modules import is_kept

    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(keep_fp32=(nn.LayerNorm,)), device="cpu")
    assert is_kept(model[1])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(), device="cpu")
    assert not is_kept(model[1]) and "forward" not in model[1].__dict__
