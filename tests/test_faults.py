"""Reproducers for issue 15: faults in the step, the loop, checkpoints, autotune and diagnostics.

Each test asserts the behaviour the issue asks for; uses only the public API.
"""

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from conftest import fp32_only_loss

from precisionloop import FP16Policy, Trainer
from precisionloop.diagnostics import gradient_underflow

pytestmark = pytest.mark.filterwarnings(
    "ignore:fp16 autocast on the CPU:UserWarning",
    "ignore:.*was saved under precision.*:UserWarning",
)


# Helpers (the reproducer helpers) -----------------------------------------------

def net(drop=0.0, out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(drop), nn.Linear(16, out))


def mk(p="fp32", opt=torch.optim.AdamW, drop=0.0, out=3, lr=0.1, **kw):
    m = net(drop, out)
    return m, Trainer(m, opt(m.parameters(), lr=lr), p, device="cpu", **kw)


def batch(seed=1, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


B = batch()


def fused_sgd(params, lr):
    return torch.optim.SGD(params, lr, momentum=0.9, fused=True)


def momentum_sgd(params, lr):
    return torch.optim.SGD(params, lr, momentum=0.9)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def same_params(model, saved):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), saved, strict=True))


def same_models(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def opt_state(optimizer):
    return copy.deepcopy(optimizer.state_dict())


def same_state(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


NAN_LOSS = lambda o, y: o.sum() * float("nan")  # noqa: E731


# 1 ----------------------------------------------------------------------------------------

@pytest.fixture
def poisoned_empty():
    # With deterministic algorithms on, torch fills uninitialised memory (torch.empty*) with NaN,
    # so reading a buffer that was allocated but never written shows up as NaN instead of
    # whatever the allocator happened to hand out.
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fused_sgd_first_step_skipped_is_a_no_op(precision, poisoned_empty):
    """Issue 15 item 1: a skipped first step of fused momentum SGD leaves nothing behind."""
    m, t = mk(precision, opt=fused_sgd)
    loss_fn = t.loss_fn
    t.loss_fn = NAN_LOSS
    assert t.step(B).skipped
    t.loss_fn = loss_fn
    t.step(batch(2))
    t.step(batch(3))
    # fp16: the skip halved the loss scale, so the reference starts from that scale.
    ref_policy = FP16Policy(init_scale=2.0**15) if precision == "fp16" else precision
    ref_m, ref = mk(ref_policy, opt=fused_sgd)
    ref.step(batch(2))
    ref.step(batch(3))
    for p in m.parameters():
        assert torch.isfinite(t.optimizer.state[p]["momentum_buffer"]).all(), "garbage momentum buffer"
        assert torch.isfinite(p).all()
    assert same_models(m, ref_m)
    assert t.stats.skipped == 1 and ref.stats.skipped == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("reset", ["state.clear", "load of a run saved before its first step"])
def test_fused_sgd_step_skipped_after_its_state_was_reset_is_a_no_op(precision, reset, poisoned_empty, tmp_path):
    """The first-step check is redone once the momentum buffers are gone, whatever the parameter count says."""
    m, t = mk(precision, opt=fused_sgd)
    ref_m, ref = mk(precision, opt=fused_sgd)
    t.save(tmp_path / "before.pt")
    for trainer in (t, ref):
        trainer.step(batch(2))
        trainer.step(batch(3))
        if reset == "state.clear":
            trainer.optimizer.state.clear()
        else:
            trainer.load(tmp_path / "before.pt")
    loss_fn, t.loss_fn = t.loss_fn, NAN_LOSS
    assert t.step(B).skipped  # the buffers' first step, skipped: it must not leave them uninitialised
    t.loss_fn = loss_fn
    t.step(batch(4))
    ref.step(batch(4))
    for p in m.parameters():
        assert torch.isfinite(t.optimizer.state[p]["momentum_buffer"]).all(), "garbage momentum buffer"
    assert same_models(m, ref_m) and same_state(t.optimizer.state_dict(), ref.optimizer.state_dict())


def _switch_momentum_on(trainer, model):
    for group in trainer.optimizer.param_groups:
        group["momentum"] = 0.9


def _replace_the_head(trainer, model):
    torch.manual_seed(5)
    model[3] = nn.Linear(16, 3)  # a new head, as many parameters: the group's list is replaced, not edited
    trainer.optimizer.param_groups[1]["params"] = list(model[3].parameters())


@pytest.mark.parametrize("change", [_switch_momentum_on, _replace_the_head], ids=["momentum-on", "new-head"])
def test_fused_sgd_step_skipped_after_its_groups_changed_is_a_no_op(change, poisoned_empty):
    """The parameter count and the state are as they were, yet some parameters have no momentum buffer now."""
    models = []
    for skip in (True, False):
        m = net()
        momentum = 0.0 if change is _switch_momentum_on else 0.9
        opt = torch.optim.SGD([{"params": list(m[0].parameters())}, {"params": list(m[3].parameters())}], lr=0.1,
                              momentum=momentum, fused=True)
        t = Trainer(m, opt, "fp32", device="cpu")
        t.step(batch(2))
        t.step(batch(3))
        change(t, m)
        if skip:
            loss_fn, t.loss_fn = t.loss_fn, NAN_LOSS
            assert t.step(B).skipped
            t.loss_fn = loss_fn
        t.step(batch(4))
        for p in m.parameters():
            assert torch.isfinite(t.optimizer.state[p]["momentum_buffer"]).all(), "garbage momentum buffer"
        models.append(m)
    assert same_models(*models)


class _TwoHeads(nn.Module):
    """A head used only once ``late`` is set: its parameters' first gradient comes after the others' buffers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 3)
        self.late = False

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h) + self.b(h) if self.late else self.a(h)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("skip_first_late_step", [False, True])
def test_fused_sgd_trains_a_parameter_whose_first_gradient_comes_late(precision, skip_first_late_step):
    """torch's fused SGD raises on a mix of parameters with and without momentum buffers; the guard steps that
    step with torch's default SGD, as if the optimizer had not been fused."""
    runs = {}
    for fused in (True, False):
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused or None)
        t = Trainer(model, opt, FP16Policy(growth_interval=1000) if precision == "fp16" else precision, device="cpu")
        for i in range(6):
            model.late = i >= 2
            if i == 2 and skip_first_late_step:
                loss_fn, t.loss_fn = t.loss_fn, NAN_LOSS
                assert t.step(batch(i)).skipped
                t.loss_fn = loss_fn
            else:
                t.step(batch(i))
        runs[fused] = (model, t)
    (fused_model, fused_t), (plain_model, plain_t) = runs[True], runs[False]
    assert fused_t.optimizer.param_groups[0]["fused"] is True  # put back after that step
    assert fused_t.stats == plain_t.stats
    for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(fused_t.optimizer.state[p]["momentum_buffer"],
                                   plain_t.optimizer.state[q]["momentum_buffer"])


# 2 ----------------------------------------------------------------------------------------

def test_save_before_first_step_changes_nothing(tmp_path):
    """Issue 15 item 2: save() before the first step does not change training."""
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


# 3 ----------------------------------------------------------------------------------------

class ModeProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []  # (training, grad enabled) per forward

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled()))
        return x


def test_fit_trains_in_train_mode():
    """Issue 15 item 3: fit() trains in train mode even after model.eval(); validation is in eval mode."""
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


# 4 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fp64_parameters_rejected_under_mixed_precision(precision):
    """Issue 15 item 4: fp64 parameters under bf16/fp16 are a ValueError naming float64."""
    model = net().double()
    with pytest.raises(ValueError, match="float64"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")


def test_fp64_parameters_allowed_under_fp32():
    """Issue 15 item 4: fp64 parameters may stay allowed under fp32."""
    model = net().double()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step((B[0].double(), B[1])).stepped


# 5 ----------------------------------------------------------------------------------------

def unfrozen_late(precision, **kw):
    """Layer 0 frozen when the Trainer is built, then unfrozen and added to the optimizer."""
    m = net()
    for p in m[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    t = Trainer(m, opt, precision, device="cpu", **kw)
    for p in m[0].parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(m[0].parameters())})
    return m, t


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_late_unfrozen_parameter_nan_skips_the_step(precision):
    """Issue 15 item 5: NaN in a late-added parameter's gradient skips the step."""
    m, t = unfrozen_late(precision)
    before = params_of(m)
    m[0].weight.register_hook(lambda g: g * float("nan"))
    t.step(B)
    assert t.stats.skipped == 1
    assert same_params(m, before), "the step changed weights although a gradient was NaN"


def test_late_unfrozen_parameter_is_clipped():
    """Issue 15 item 5: max_grad_norm clips a late-added parameter's gradient too."""
    m, t = unfrozen_late("fp32", max_grad_norm=0.01)
    ref = copy.deepcopy(m)
    result = t.step(B)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(B[0]), B[1]).backward()
    total = nn.utils.clip_grad_norm_(list(ref.parameters()), 0.01)
    ref_opt.step()
    assert result.grad_norm == pytest.approx(float(total), rel=1e-5)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


# 6 ----------------------------------------------------------------------------------------

def test_empty_batch_is_a_value_error_that_changes_nothing():
    """Issue 15 item 6: an empty batch raises ValueError from step and changes nothing."""
    m, t = mk()
    t.step(B)
    before, state = params_of(m), opt_state(t.optimizer)
    stats, step = dataclasses.asdict(t.stats), t.global_step
    with pytest.raises(ValueError, match="empty"):
        t.step((torch.randn(0, 8), torch.randint(0, 3, (0,))))
    assert same_params(m, before)
    assert same_state(t.optimizer.state_dict(), state)
    assert t.global_step == step and dataclasses.asdict(t.stats) == stats
    assert t.step(batch(2)).stepped


# 7 ----------------------------------------------------------------------------------------

@pytest.fixture
def float64_default():
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_under_float64_default_dtype(precision, float64_default):
    """Issue 15 item 7: fp32/bf16 steps of an fp32 model work with float64 as the default dtype."""
    model = net().float()
    t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.1), precision, device="cpu")
    result = t.step((B[0].float(), B[1]))
    assert result.stepped
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


# 8 ----------------------------------------------------------------------------------------

def test_failed_load_changes_nothing(tmp_path):
    """Issue 15 item 8: a load() that fails (other output width) is all or nothing."""
    other_m, other = mk(out=5)
    other.step((B[0], B[1] % 5))
    other.save(tmp_path / "wide.pt")
    torch.manual_seed(123)  # other weights than the checkpoint's
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 3))
    t = Trainer(m, torch.optim.AdamW(m.parameters(), lr=0.1), "fp32", device="cpu")
    t.step(B)
    before, state = params_of(m), opt_state(t.optimizer)
    with pytest.raises(Exception):
        t.load(tmp_path / "wide.pt")
    assert torch.equal(m[0].weight, before[0]) and torch.equal(m[0].bias, before[1]), "layer 0 was overwritten"
    assert same_params(m, before)
    assert same_state(t.optimizer.state_dict(), state)


# 9 ----------------------------------------------------------------------------------------

def test_load_from_another_optimizer_class_is_a_value_error(tmp_path):
    """Issue 15 item 9: a checkpoint from another optimizer class raises ValueError naming both."""
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


# 10 ---------------------------------------------------------------------------------------

def test_load_discards_an_open_accumulation_window(tmp_path):
    """Issue 15 item 10: load() discards the gradients of an open accumulation window."""
    m, t = mk(grad_accum_steps=2)
    t.step(batch(2))
    t.step(batch(3))
    t.save(tmp_path / "ckpt.pt")
    t.step(batch(4))  # opens a window
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


# 11 ---------------------------------------------------------------------------------------

def shuffled_loader():
    # Shuffled by the global RNG (no explicit generator): the order fit() replays on resume.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (24,), generator=g)), batch_size=4, shuffle=True)


@pytest.mark.parametrize("accum, nth", [(1, 4), (2, 3), (2, 4)], ids=["accum1", "accum2-window-start", "accum2-mid-window"])
def test_interrupt_in_backward_leaks_no_partial_gradient(accum, nth):
    """Issue 15 item 11: a KeyboardInterrupt in backward leaves no partial .grad; resuming fit matches."""
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


# 12 ---------------------------------------------------------------------------------------

def test_max_consecutive_skips_in_fit_keeps_counters_consistent(tmp_path):
    """Issue 15 item 12: after max_consecutive_skips stops fit, global_step == batch_in_epoch and save works."""
    _, t = mk(max_consecutive_skips=3)
    t.loss_fn = NAN_LOSS
    with pytest.raises(RuntimeError, match="in a row"):
        t.fit([batch(i) for i in range(6)], epochs=1, progress=False)
    assert t.epoch == 0
    assert t.global_step == t.batch_in_epoch, (t.global_step, t.batch_in_epoch)
    assert t.save(tmp_path / "after.pt").is_file()


# 13 ---------------------------------------------------------------------------------------

def test_end_of_epoch_flush_counts_like_any_step(tmp_path):
    """Issue 15 item 13: the end-of-epoch flush reaches callbacks and periodic checkpoints."""
    _, t = mk(grad_accum_steps=2)

    class Due:
        n = 0

        def on_step_end(self, trainer, result):
            Due.n += bool(result.due)

    t.fit([batch(i) for i in range(5)], epochs=2, progress=False, callbacks=[Due()],
          checkpoint_dir=tmp_path, checkpoint_every=3)
    assert t.global_step == 6
    assert Due.n == t.global_step
    assert (tmp_path / "step-00000003.pt").is_file()
    assert (tmp_path / "step-00000006.pt").is_file()


# 14 ---------------------------------------------------------------------------------------

def test_checkpoint_file_mode_follows_umask(tmp_path):
    """Issue 15 item 14: checkpoint files get mode 0o666 & ~umask, like torch.save and open()."""
    _, t = mk()
    t.step(B)
    old = os.umask(0o022)
    try:
        path = t.save(tmp_path / "ckpt.pt")
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~0o022)


# 15 ---------------------------------------------------------------------------------------

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
    """Issue 15 item 15: fit steps ReduceLROnPlateau with the validation loss at each epoch end."""
    m, t = with_plateau()
    data, val = [batch(2), batch(3)], [batch(4)]
    lrs, history = [], []
    for epochs in (1, 2, 3):
        history += t.fit(data, epochs=epochs, val_loader=val, progress=False)
        lrs.append(t.optimizer.param_groups[0]["lr"])
    assert lrs == [0.1, 0.05, 0.025]
    assert t.scheduler.best == pytest.approx(history[0]["val_loss"], rel=1e-6)


def test_reduce_lr_on_plateau_needs_val_loader():
    """Issue 15 item 15: fit with ReduceLROnPlateau and no val_loader is a ValueError before training."""
    m, t = with_plateau()
    before = params_of(m)
    with pytest.raises(ValueError) as info:
        t.fit([batch(2), batch(3)], epochs=1, progress=False)
    assert "ReduceLROnPlateau" in str(info.value) and "val_loader" in str(info.value)
    assert same_params(m, before) and t.global_step == 0


def test_step_alone_never_steps_reduce_lr_on_plateau():
    """Issue 15 item 15: Trainer.step never steps a ReduceLROnPlateau."""
    m, t = with_plateau()
    for i in range(3):
        assert t.step(batch(i)).stepped
    assert t.optimizer.param_groups[0]["lr"] == 0.1
    assert t.scheduler.last_epoch == 0


# 16 ---------------------------------------------------------------------------------------

def test_step_under_no_grad():
    """Issue 15 item 16: step() under torch.no_grad() trains exactly as outside it."""
    m, t = mk()
    with torch.no_grad():
        assert t.step(B).stepped
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
    ref_m, ref = mk()
    ref.step(B)
    assert same_models(m, ref_m)


# 17 ---------------------------------------------------------------------------------------

class PlusTen(Trainer):
    def compute_loss(self, batch):
        return super().compute_loss(batch) + 10


def test_evaluate_uses_overridden_compute_loss():
    """Issue 15 item 17: evaluate() uses an overridden compute_loss."""
    m = net()
    t = PlusTen(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu")
    with torch.no_grad():
        plain = F.cross_entropy(m(B[0]), B[1]).item()
    assert t.evaluate([B])["val_loss"] == pytest.approx(plain + 10, rel=1e-6)


def test_fit_validation_uses_overridden_compute_loss():
    """Issue 15 item 17: with lr=0, fit's val_loss (through compute_loss) equals its train_loss."""
    m = net()
    t = PlusTen(m, torch.optim.SGD(m.parameters(), lr=0.0), "fp32", device="cpu")
    record = t.fit([B], epochs=1, val_loader=[B], progress=False)[0]
    assert record["train_loss"] > 10
    assert record["val_loss"] == pytest.approx(record["train_loss"], rel=1e-6)


class DictTrainer(Trainer):
    calls = 0

    def forward_batch(self, batch):
        DictTrainer.calls += 1
        return self.model(batch["x"]), batch["y"]


def dict_batch(seed):
    x, y = batch(seed)
    return {"x": x, "y": y}


def test_dict_batch_subclass_works_everywhere():
    """Issue 15 item 17: a dict-batch subclass works in step, fit(+val, underflow_every) and evaluate(+metric)."""
    m = net()
    t = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step(dict_batch(1)).stepped
    history = t.fit([dict_batch(2), dict_batch(3)], epochs=1, val_loader=[dict_batch(4)], progress=False,
                    underflow_every=1)
    assert "val_loss" in history[0] and len(t.underflow_history) == 2
    result = t.evaluate([dict_batch(5)], metrics={"acc": MulticlassAccuracy(num_classes=3)})
    assert 0.0 <= result["acc"] <= 1.0


def test_dict_batch_subclass_autotune_runs_the_subclass():
    """Issue 15 item 17: autotune trials run the subclass's forward_batch/compute_loss."""
    m = net()
    t = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="auto", autotune=True, device="cpu")
    DictTrainer.calls = 0
    assert t.step(dict_batch(1)).stepped
    assert DictTrainer.calls > 1  # the trials went through the subclass, not only the real step


# 18 ---------------------------------------------------------------------------------------

def test_autotune_with_adamw():
    """Issue 15 item 18: autotune works with torch's AdamW (its defaults are not all constructor kwargs)."""
    m = net()
    t = Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-3), precision="auto", autotune=True, device="cpu")
    assert t.step(B).stepped


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_autotune_keeps_per_group_settings(opt_cls):
    """Issue 15 item 18: autotune trials keep the optimizer's per-group settings (two groups, two lrs)."""
    m = net()
    groups = [{"params": m[0].parameters(), "lr": 1e-3}, {"params": m[3].parameters(), "lr": 1e-2}]
    opt = opt_cls(groups, lr=1e-3)
    t = Trainer(m, opt, precision="auto", autotune=True, device="cpu")
    seen = []
    # A global optimizer step pre-hook sees every optimizer that steps, the trials' copies included.
    handle = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: seen.append(tuple(g["lr"] for g in o.param_groups)))
    try:
        assert t.step(B).stepped
    finally:
        handle.remove()
    assert len(seen) > 1
    assert set(seen) == {(1e-3, 1e-2)}, f"optimizers stepped with lrs {sorted(set(seen))}"


# 19 ---------------------------------------------------------------------------------------

class FlagProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.eval_flags = []

    def forward(self, x):
        if not self.training:
            self.eval_flags.append(torch.backends.cuda.matmul.fp32_precision)
        return x


def test_validation_after_autotune_runs_under_the_chosen_flags():
    """Issue 15 item 19: validation in the fit that autotuned runs under the chosen policy's backend flags."""
    torch.manual_seed(0)
    probe = FlagProbe()
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), probe, nn.Linear(16, 3))
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="auto", autotune=True, device="cpu",
                loss_fn=fp32_only_loss)
    assert t.policy.tf32  # the pre-autotune policy
    t.fit([batch(2)], epochs=1, val_loader=[batch(3)], progress=False)
    assert t.policy.name == "fp32" and not t.policy.tf32
    expected = "tf32" if t.policy.tf32 else "ieee"
    assert probe.eval_flags and set(probe.eval_flags) == {expected}, probe.eval_flags


# 20 ---------------------------------------------------------------------------------------

def test_underflow_measurement_with_all_zero_gradients(tmp_path):
    """Issue 15 item 20: fit(underflow_every=1) with all-zero gradients records an empty measurement."""
    _, t = mk()
    t.loss_fn = lambda o, y: 0 * o.sum()
    t.fit([batch(2), batch(3)], epochs=1, progress=False, underflow_every=1)
    assert t.global_step == 2
    assert len(t.underflow_history) == 2
    assert all(entry["nonzero"] == 0 for entry in t.underflow_history)
    assert t.save(tmp_path / "after.pt").is_file()


# 21 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_gradient_underflow_rejects_bad_scale(scale):
    """Issue 15 item 21: gradient_underflow rejects a NaN, infinite, zero or negative scale."""
    grads = [("w", torch.tensor([1e-9, 1e-3, 0.5]))]
    with pytest.raises(ValueError, match="scale"):
        gradient_underflow(grads, torch.float16, scale)


# 22 ---------------------------------------------------------------------------------------

def test_dict_batch_to_default_forward_batch_names_the_override():
    """Issue 15 item 22: a 2-key dict batch to the default forward_batch is a TypeError naming forward_batch."""
    _, t = mk()
    with pytest.raises(TypeError, match="forward_batch"):
        t.step(dict_batch(1))
