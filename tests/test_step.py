"""The optimizer step: equal to a hand-written torch.amp loop, what a step returns, the batches it takes, and
errors and interrupts between a step's optimizer update and the end of its bookkeeping."""

import copy
import warnings

import pytest
import torch
from torch import nn
from conftest import B, batches, mk, net, same_models, tiny_mlp

from precisionloop import BF16Policy, FP16Policy, FP32Policy, Trainer, get_policy

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def hand_loop(model, data, dtype, max_grad_norm, init_scale=2.0**16):
    """The canonical torch.amp recipe, written out by hand."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=dtype == torch.float16)
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return scaler


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp16-overflowing"])
def test_equals_hand_written_amp_loop(precision, max_grad_norm):
    data = batches(6)
    init_scale = 2.0**100 if precision == "fp16-overflowing" else 2.0**16
    dtype = DTYPES[precision.split("-")[0]]
    reference = tiny_mlp()
    ref_scaler = hand_loop(reference, data, dtype, max_grad_norm, init_scale)

    model = tiny_mlp()
    policy = {"fp32": FP32Policy(), "bf16": BF16Policy(), "fp16": FP16Policy(init_scale=init_scale)}[precision.split("-")[0]]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy,
                      device="cpu", max_grad_norm=max_grad_norm)
    results = [trainer.step(b) for b in data]

    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    if dtype == torch.float16:
        assert trainer.scaler.get_scale() == ref_scaler.get_scale()
        if precision == "fp16-overflowing":
            assert results[0].skipped and trainer.stats.skipped > 0
    assert all(r.grad_norm is not None for r in results) is (max_grad_norm is not None)


def test_step_result_is_unscaled_undivided_loss():
    (x, y), = batches(1)
    model = tiny_mlp()
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(copy.deepcopy(model)(x), y))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    result = trainer.step((x, y))
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert not result.stepped and not result.skipped and result.grad_norm is None


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, a, b):
        return self.linear(a + b).squeeze(-1)


class RegressionTrainer(Trainer):
    def compute_loss(self, batch):
        return nn.functional.mse_loss(self.model(batch["a"], batch["b"]), batch["y"])


def test_compute_loss_override_for_other_batch_shapes():
    model = TwoInputs()
    trainer = RegressionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    batch = {"a": torch.randn(4, 16), "b": torch.randn(4, 16), "y": torch.randn(4)}
    assert trainer.step(batch).stepped


def test_frozen_parameters_may_stay_out_of_the_optimizer():
    model = tiny_mlp()
    model[0].requires_grad_(False)
    trainer = Trainer(model, torch.optim.SGD(model[2].parameters(), lr=0.1), "bf16", device="cpu")
    frozen = model[0].weight.clone()
    assert trainer.step(batches(1)[0]).stepped
    assert torch.equal(model[0].weight, frozen)


def test_no_deprecated_amp_warnings():
    model = tiny_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(), device="cpu")
        trainer.step(batches(1)[0])


class AfterStepPolicy(BF16Policy):
    """Records, at each call of its step hook, the first layer's weight."""

    def optimizer_step_hook(self, model):
        seen = []
        object.__setattr__(self, "seen", seen)  # frozen dataclass; a fresh record per configuration
        return lambda: seen.append(model[0].weight.detach().clone())


def test_the_policy_step_hook_runs_after_each_optimizer_step_and_each_load(tmp_path):
    model = tiny_mlp()
    policy = AfterStepPolicy()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", grad_accum_steps=2)
    for batch in batches(4):
        before = model[0].weight.detach().clone()
        stepped = trainer.step(batch).due
        # Once per optimizer step, not per micro-batch; after the step, so it sees the updated weights.
        assert len(policy.seen) == trainer.global_step
        if stepped:
            assert torch.equal(policy.seen[-1], model[0].weight) and not torch.equal(policy.seen[-1], before)
    assert len(policy.seen) == 2
    trainer.save(tmp_path / "c.pt")
    with torch.no_grad():
        model[0].weight.zero_()
    trainer.load(tmp_path / "c.pt")
    assert len(policy.seen) == 3 and torch.equal(policy.seen[2], policy.seen[1])  # after the load: the loaded weights
    other = tiny_mlp()
    assert Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), "bf16", device="cpu").engine.after_step is None


class BookkeepingProbe(BF16Policy):
    """Its step hook records what the Trainer had booked when it ran: optimizer steps and skipped steps."""

    def optimizer_step_hook(self, model):
        seen = []
        object.__setattr__(self, "seen", seen)
        return lambda: seen.append((self.trainer.global_step, self.trainer.stats.skipped))


def test_the_step_hook_runs_after_the_bookkeeping_and_after_skipped_steps_too():
    model = tiny_mlp()
    policy = BookkeepingProbe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    object.__setattr__(policy, "trainer", trainer)
    good, bad = batches(2)
    trainer.step(good)
    bad = (torch.full_like(bad[0], float("inf")), bad[1])  # non-finite gradients: the step is skipped
    assert not trainer.step(bad).stepped
    # On the CPU the verdict is booked at once: the hook saw each step counted, the skipped one as skipped.
    assert policy.seen == [(1, 0), (2, 1)]


class _HalfLoss(Trainer):
    """A loss returned in bf16 and shaped (1,): the step's verdict must still read it right."""

    def compute_loss(self, batch):
        return super().compute_loss(batch).to(torch.bfloat16).reshape(1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_bf16_loss_of_shape_one_reaches_the_result_and_the_counters(precision):
    torch.manual_seed(0)
    model = tiny_mlp()
    trainer = _HalfLoss(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")
    x, y = batches(1)[0]
    expected = nn.functional.cross_entropy(copy.deepcopy(model)(x), y).to(torch.bfloat16).item()
    result = trainer.step((x, y))
    assert result.loss == expected and result.stepped and trainer.engine.last_loss == expected
    assert trainer.stats.steps == 1 and (result.scale is None) == (precision == "fp32")


def test_a_float64_loss_keeps_its_digits_on_due_and_non_due_steps():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2,
                      loss_fn=lambda out, y: nn.functional.cross_entropy(out.double(), y))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    with torch.no_grad():
        exact = nn.functional.cross_entropy(model(x).double(), y).item()
    first, second = trainer.step((x, y)), trainer.step((x, y))
    assert first.loss == exact and second.loss == exact and second.stepped
    assert trainer.engine.last_loss == exact


def test_to_device_moves_nested_batches_and_lays_out_4d_float_tensors():
    from precisionloop.batches import to_device

    cpu, cl = torch.device("cpu"), torch.channels_last
    x, y = torch.randn(2, 3, 4, 4).contiguous(memory_format=cl), torch.tensor([1, 0])
    out = to_device({"x": x, "y": [y]}, cpu, cl)
    assert out["x"] is x and out["y"][0] is y  # already there and laid out: .to returns them as they are
    z = torch.randn(2, 3, 4, 4)
    moved = to_device((z, y), cpu, cl)
    assert moved[0] is not z and moved[0].is_contiguous(memory_format=cl) and torch.equal(moved[0], z)
    assert to_device(torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.device("meta"), cl).device.type == "meta"


def test_to_device_rebuilds_a_list_subclass_with_a_fields_attribute_as_a_list():
    from precisionloop.batches import to_device

    class Fields(list):
        _fields = ("x",)

    batch = Fields([torch.zeros(2, 3, 4, 4)])  # NCHW: moved to channels_last, so the list is rebuilt
    out = to_device(batch, torch.device("cpu"), torch.channels_last)
    assert type(out) is Fields and out[0].is_contiguous(memory_format=torch.channels_last)


def test_a_float64_loss_keeps_its_digits():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    expected = nn.functional.cross_entropy(model(x).double(), y).item()  # before the step changes the weights
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu",
                      loss_fn=lambda out, target: nn.functional.cross_entropy(out.double(), target))
    result = trainer.step((x, y))
    assert result.loss == expected and trainer.stats.steps == 1


# Errors and interrupts between a step's optimizer update and the end of its bookkeeping.

def _interrupt_once(monkeypatch, owner, name, after=False):
    """Make ``owner.name`` raise KeyboardInterrupt on its first call (before it runs, or after it returned)."""
    real, fired = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if not fired and not after:
            fired.append(1)
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("after", [False, True])
def test_an_interrupt_after_the_optimizer_update_still_counts_the_step_everywhere(monkeypatch, after):
    from precisionloop import engine

    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5 ** e)
    trainer = Trainer(model, optimizer, "bf16", device="cpu", scheduler=scheduler, scheduler_interval="step")
    _interrupt_once(monkeypatch, engine._HostCopy, "__init__", after=after)  # as the verdict starts to the host
    b = batches(1)[0]
    with pytest.raises(KeyboardInterrupt):
        trainer.step(b)  # the weights were updated: the step happened
    trainer.step(b)  # the user retries the batch
    updates = int(optimizer.state[model[0].weight]["step"])
    assert updates == trainer.global_step == trainer.stats.steps == trainer.scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)


def test_a_flush_interrupted_after_its_update_is_not_stepped_again(monkeypatch):
    from precisionloop import engine

    def make():
        model = tiny_mlp()
        return model, Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu", grad_accum_steps=2)

    b = batches(1)[0]
    ref_model, ref = make()
    ref.step(b)
    ref.flush()
    model, trainer = make()
    trainer.step(b)
    _interrupt_once(monkeypatch, engine._HostCopy, "__init__")
    with pytest.raises(KeyboardInterrupt):
        trainer.flush()
    assert trainer.flush() is None  # the window was stepped and dropped: never a second step on the same gradients
    assert trainer.global_step == trainer.stats.steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_flush_interrupted_before_its_update_drops_the_window_and_the_next_one_trains(monkeypatch, precision):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=4,
                      max_grad_norm=1e9)
    data = batches(3)
    trainer.step(data[0])
    before = [p.detach().clone() for p in model.parameters()]
    _interrupt_once(monkeypatch, nn.utils, "clip_grad_norm_")  # after unscale_ and the partial window's rescale
    with pytest.raises(KeyboardInterrupt):
        trainer.flush()
    assert trainer.engine.micro == 0 and trainer.flush() is None and trainer.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    trainer.step(data[1])  # fp16: before, the scaler still held the dropped window's unscale_ and raised here
    assert trainer.flush().stepped and trainer.global_step == trainer.stats.steps == 1


def test_an_interrupt_as_a_verdict_starts_to_be_booked_loses_no_step(monkeypatch):
    from precisionloop.results import TrainStats

    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    data = batches(3)
    trainer.step(data[0])
    _interrupt_once(monkeypatch, TrainStats, "record")  # the next booking, before it counts anything
    with pytest.raises(KeyboardInterrupt):
        trainer.step(data[1])
    trainer.step(data[1])
    assert trainer.global_step == trainer.stats.steps == 3


def test_a_first_optimizer_step_flushed_under_inference_mode_leaves_state_later_steps_can_update():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, "bf16", device="cpu", grad_accum_steps=2)
    data = batches(3)
    trainer.step(data[0])
    with torch.inference_mode():
        assert trainer.flush().stepped
    assert not optimizer.state[model[0].weight]["momentum_buffer"].is_inference()
    for b in data[1:]:
        trainer.step(b)  # before: "Inplace update to inference tensor outside InferenceMode"
    assert trainer.global_step == 2


def test_the_scale_a_result_reports_is_current_after_a_step_interrupted_past_its_update(monkeypatch):
    from precisionloop import engine

    def make():
        model = tiny_mlp()
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=4.0, growth_interval=1),
                       device="cpu", grad_accum_steps=2)

    b = batches(1)[0]
    ref, trainer = make(), make()
    ref.step(b)
    ref.step(b)  # one optimizer step: the scale grows from 4 to 8
    trainer.step(b)
    _interrupt_once(monkeypatch, engine._HostCopy, "__init__", after=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.step(b)
    assert trainer.step(b).scale == ref.step(b).scale == 8.0  # a micro-batch that does not step


def test_a_second_interrupt_while_booking_a_failed_step_does_not_replace_the_first_error(monkeypatch):
    from precisionloop import engine
    from precisionloop.results import TrainStats

    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    counted = []

    def copy_failing(self, row):
        raise ValueError("the first error")

    def record_interrupted(self, skipped, scale):
        counted.append(skipped)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine._HostCopy, "__init__", copy_failing)
    monkeypatch.setattr(TrainStats, "record", record_interrupted)
    try:
        trainer.step(batches(1)[0])
    except ValueError as e:
        assert "the first error" in str(e)
    except KeyboardInterrupt:  # caught here, or it would stop the test session
        pytest.fail("the interrupt in the failed step's booking replaced the step's first error")
    else:
        pytest.fail("the step's error was lost")
    assert counted and trainer.global_step == 1
    monkeypatch.undo()
    trainer.step(batches(1)[0])
    assert trainer.global_step == 2


def test_the_policys_follow_up_runs_after_a_step_whose_booking_raised():
    class Flaky(torch.optim.lr_scheduler.LambdaLR):
        def step(self, *args, **kwargs):
            if self.last_epoch == 1:
                self.last_epoch += 1  # this scheduler step counts, then its user code fails
                raise ValueError("scheduler bug")
            return super().step(*args, **kwargs)

    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "bf16", device="cpu", scheduler=Flaky(optimizer, lambda e: 1.0),
                      scheduler_interval="step")
    hooks = []
    trainer.engine.after_step = lambda: hooks.append(trainer.global_step)  # as a policy's optimizer_step_hook
    data = batches(3)
    trainer.step(data[0])
    with pytest.raises(ValueError, match="scheduler bug"):
        trainer.step(data[1])  # on the CPU the step is booked at its end, after its follow-up
    trainer.step(data[2])
    assert hooks == [1, 2, 3] and trainer.global_step == trainer.stats.steps == 3


@pytest.fixture
def float64_default():
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_under_float64_default_dtype(precision, float64_default):
    """fp32/bf16 steps of an fp32 model work with float64 as the default dtype."""
    model = net().float()
    t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.1), precision, device="cpu")
    result = t.step((B[0].float(), B[1]))
    assert result.stepped
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_step_under_no_grad():
    """step() under torch.no_grad() trains exactly as outside it."""
    m, t = mk()
    with torch.no_grad():
        assert t.step(B).stepped
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
    ref_m, ref = mk()
    ref.step(B)
    assert same_models(m, ref_m)


def test_trainer_settings_stay_readable_and_counters_settable():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2,
                      max_grad_norm=1.0, max_consecutive_skips=5)
    assert (trainer.grad_accum_steps, trainer.max_grad_norm, trainer.max_consecutive_skips) == (2, 1.0, 5)
    trainer.global_step, trainer.epoch, trainer.batch_in_epoch = 7, 2, 3
    assert (trainer.engine.global_step, trainer.loop_state.epoch, trainer.loop_state.batch_in_epoch) == (7, 2, 3)


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


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_cuda_matches_hand_written_loop(precision):
    data = batches(4)
    reference, model = tiny_mlp().cuda(), tiny_mlp()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": None}[precision]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    policy = get_policy(precision)
    with policy.backend_flags():
        for x, y in data:
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(reference(x.cuda()), y.cuda())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cuda")
    for b in data:
        trainer.step(b)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
