import copy
import warnings

import pytest
import torch
from conftest import batches, tiny_mlp
from torch import nn

from precisionloop import BF16Policy, FP16Policy, FP32Policy, Trainer

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


def test_clipping_uses_unscaled_gradients():
    data = batches(1)
    model, reference = tiny_mlp(), tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", device="cpu", max_grad_norm=1e9)
    result = trainer.step(data[0])
    x, y = data[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()]))
    assert result.grad_norm == pytest.approx(float(expected), rel=1e-3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_accumulation_equals_one_large_batch(precision):
    (x, y), = batches(1, batch_size=8)
    big, small = tiny_mlp(), tiny_mlp()
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.5), precision, device="cpu").step((x, y))
    trainer = Trainer(small, torch.optim.SGD(small.parameters(), lr=0.5), precision, device="cpu", grad_accum_steps=4)
    results = [trainer.step((x[i:i + 2], y[i:i + 2])) for i in range(0, 8, 2)]
    assert [r.stepped for r in results] == [False, False, False, True]
    tol = dict(atol=1e-6, rtol=1e-5) if precision == "fp32" else dict(atol=2e-3, rtol=1e-2)
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, **tol)


def test_flush_steps_a_partial_window_as_its_mean():
    (x, y), = batches(1, batch_size=6)
    big, small = tiny_mlp(), tiny_mlp()
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.5), "fp32", device="cpu").step((x, y))
    trainer = Trainer(small, torch.optim.SGD(small.parameters(), lr=0.5), "fp32", device="cpu", grad_accum_steps=4)
    assert trainer.flush() is None
    for i in range(0, 6, 2):
        assert not trainer.step((x[i:i + 2], y[i:i + 2])).stepped
    assert trainer.flush().stepped
    assert trainer.flush() is None
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


class Poison:
    """A gradient hook that replaces one parameter's gradient with inf or NaN while armed."""

    def __init__(self, param, value=float("inf")):
        self.armed = False
        self.value = value
        param.register_hook(lambda g: torch.full_like(g, self.value) if self.armed else g)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_injected_inf_skips_the_step(precision, fused):
    model = tiny_mlp()
    poison = Poison(model[0].weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = Trainer(model, optimizer, precision, device="cpu", scheduler=scheduler, scheduler_interval="step")
    data = batches(3)
    trainer.step(data[0])
    lr, scale = optimizer.param_groups[0]["lr"], trainer.scaler.get_scale() if trainer.scaler else None
    before = copy.deepcopy(model.state_dict())
    adam_steps = float(optimizer.state[model[2].weight]["step"])

    poison.armed = True
    result = trainer.step(data[1])
    assert result.skipped and not result.stepped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed on a skipped step"
    assert optimizer.param_groups[0]["lr"] == lr, "scheduler advanced on a skipped step"
    assert float(optimizer.state[model[2].weight]["step"]) == adam_steps
    if precision == "fp16":
        assert result.scale == scale * 0.5
    else:
        assert result.scale is None
    assert trainer.stats.skipped == 1 and trainer.stats.steps == 2 and trainer.stats.steps_since_overflow == 0

    poison.armed = False
    result = trainer.step(data[2])
    assert result.stepped and not result.skipped
    assert optimizer.param_groups[0]["lr"] == lr * 0.5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.stats.steps_since_overflow == 1


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_nan_without_scaler_is_skipped(precision):
    model = tiny_mlp()
    poison = Poison(model[2].bias, float("nan"))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")
    before = copy.deepcopy(model.state_dict())
    poison.armed = True
    assert trainer.step(batches(1)[0]).skipped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_scale_grows_after_growth_interval():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), FP16Policy(init_scale=256.0, growth_interval=3), device="cpu")
    scales = [trainer.step(b).scale for b in batches(7)]
    assert scales == [256.0, 256.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    assert trainer.stats.min_scale == 256.0 and trainer.stats.max_scale == 1024.0


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_consecutive_skips_raise(precision):
    model = tiny_mlp()
    Poison(model[0].bias).armed = True
    poison = Poison(model[0].weight)
    poison.armed = True
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", max_consecutive_skips=3)
    data = batches(3)
    trainer.step(data[0])
    trainer.step(data[1])
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row") as info:
        trainer.step(data[2])
    assert "optimizer step 3" in str(info.value)
    assert ("loss scale 8192" in str(info.value)) is (precision == "fp16")


def test_collapse_warning_given_once():
    model = tiny_mlp()
    poison = Poison(model[0].weight)
    poison.armed = True
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=4.0), device="cpu")
    data = batches(1)[0]
    trainer.step(data)
    trainer.step(data)  # scale 1.0: not yet below 1
    with pytest.warns(RuntimeWarning, match="collapsing") as record:
        trainer.step(data)
    assert record[0].filename == __file__  # the line that called step, not a line inside the package
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.step(data)
    assert trainer.stats.min_scale == 0.25


def test_collapse_warning_names_the_callers_line_when_stats_books_it(monkeypatch):
    _, poison, trainer = _deferred(monkeypatch, FP16Policy(init_scale=1.0))  # booked at the next step, or by stats
    poison.armed = True
    trainer.step(batches(1)[0])  # scale 0.5: not yet booked
    with pytest.warns(RuntimeWarning, match="collapsing") as record:
        trainer.stats
    assert record[0].filename == __file__


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


def test_default_compute_loss_names_the_override():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    with pytest.raises(TypeError, match="compute_loss"):
        trainer.step(torch.randn(4, 16))


def test_bad_input_at_construction():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="missing from the optimizer.*0.weight"):
        Trainer(model, torch.optim.SGD(list(model.parameters())[1:], lr=0.1), device="cpu")
    with pytest.raises(ValueError, match="not parameters of the model"):
        Trainer(model, torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1), device="cpu")
    half = tiny_mlp().half()
    with pytest.raises(ValueError, match=r"0.weight \(torch.float16\).*model.float\(\)"):
        Trainer(half, torch.optim.SGD(half.parameters(), lr=0.1), device="cpu")
    with pytest.raises(ValueError, match="'fp4'"):
        Trainer(model, opt, "fp4", device="cpu")
    for kwargs, key in [(dict(grad_accum_steps=0), "grad_accum_steps"), (dict(grad_accum_steps=1.5), "grad_accum_steps"),
                        (dict(max_consecutive_skips=0), "max_consecutive_skips"), (dict(max_grad_norm=-1.0), "max_grad_norm"),
                        (dict(device="tpu9"), "device")]:
        with pytest.raises(ValueError, match=key):
            Trainer(model, opt, "fp32", **{"device": "cpu", **kwargs})
    other = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler"):
        Trainer(model, opt, device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(other, 1), scheduler_interval="step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_an_error():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="CUDA is not available"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")


def test_frozen_parameters_may_stay_out_of_the_optimizer():
    model = tiny_mlp()
    model[0].requires_grad_(False)
    trainer = Trainer(model, torch.optim.SGD(model[2].parameters(), lr=0.1), "bf16", device="cpu")
    frozen = model[0].weight.clone()
    assert trainer.step(batches(1)[0]).stepped
    assert torch.equal(model[0].weight, frozen)


class CountingPolicy(FP16Policy):
    """A custom-hardware style policy: its own name, scaler and autocast bookkeeping."""

    name = "counting-fp16"

    def autocast(self, device_type):
        object.__setattr__(self, "calls", getattr(self, "calls", 0) + 1)
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def make_scaler(self, device_type):
        return torch.amp.GradScaler(device_type, init_scale=4.0, growth_interval=1)

    def prepare_model(self, model):
        model.prepared_by = self.name
        return model


def test_custom_policy_subclass_is_honoured():
    model = Probe16()
    policy = CountingPolicy()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    assert trainer.policy is policy and model.prepared_by == "counting-fp16"
    results = [trainer.step(b) for b in batches(2)]
    assert policy.calls == 2  # asked for anew each step
    assert model.dtypes == [torch.bfloat16, torch.bfloat16]
    assert [r.scale for r in results] == [8.0, 16.0]


class Probe16(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.dtypes = []

    def forward(self, x):
        out = self.linear(x)
        self.dtypes.append(out.dtype)
        return out


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


def test_a_raising_step_hook_leaves_a_load_whole(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    for batch in batches(2):
        trainer.step(batch)
    trainer.save(tmp_path / "c.pt")
    trainer.step(batches(3)[2])

    def broken():
        raise RuntimeError("hook failed")

    trainer.engine.after_step = broken
    with pytest.raises(RuntimeError, match="hook failed"):
        trainer.load(tmp_path / "c.pt")
    assert trainer.global_step == 2  # everything else was restored before the hook ran


def test_same_gradient_count_with_a_non_finite_sparse_gradient_is_caught():
    from precisionloop.guard import FiniteGuard

    guard = FiniteGuard()
    dense = [torch.ones(3), torch.ones(2)]
    assert guard.unscale_(None, dense).item() == 0  # all dense on one device: the next step of that count takes one kernel
    sparse = torch.sparse_coo_tensor([[0]], [float("inf")], (3,), check_invariants=True)
    assert guard.unscale_(None, [torch.ones(3), sparse]).item() == 1  # torch refuses the one kernel: grouped instead
    assert guard.unscale_(None, [torch.ones(3), torch.tensor([1.0, float("nan")])]).item() == 1
    assert guard.unscale_(None, dense).item() == 0


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


def test_a_failing_collective_on_the_one_kernel_path_is_raised_not_retried():
    from precisionloop.guard import FiniteGuard

    calls = []

    def all_reduce_max(found):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("collective failed")
        return found

    guard = FiniteGuard(all_reduce_max=all_reduce_max)
    grads = [torch.ones(3), torch.ones(2)]
    guard.unscale_(None, grads)  # the grouping path; the next call of this count takes the one kernel
    with pytest.raises(RuntimeError, match="collective failed"):
        guard.unscale_(None, grads)
    assert len(calls) == 2


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


# The verdict's booking. On CUDA each optimizer step's verdict is copied to the host without blocking
# and booked at the next optimizer step; on the CPU at once. ``_deferred`` makes the CPU book as CUDA does.

class _InFlight:
    """An event whose copy is still on its way; ``interrupt`` makes the next wait raise KeyboardInterrupt."""

    interrupt = False

    def synchronize(self):
        if _InFlight.interrupt:
            _InFlight.interrupt = False
            raise KeyboardInterrupt


def _deferred(monkeypatch, precision="bf16", **kw):
    """A tiny trainer on the CPU whose verdicts are booked one optimizer step late, as on CUDA: (model, poison, trainer)."""
    from precisionloop import engine

    class InFlight(engine._HostCopy):
        def __init__(self, row):
            super().__init__(row)
            self.values, self.event = row.clone(), _InFlight()

    monkeypatch.setattr(engine, "_HostCopy", InFlight)
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", **kw)
    return model, Poison(model[0].weight), trainer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_deferred_verdict_is_booked_at_the_next_optimizer_step_and_results_keep_their_own(monkeypatch, precision):
    ref_model = tiny_mlp()
    ref = Trainer(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), precision, device="cpu")
    ref_poison = Poison(ref_model[0].weight)
    model, poison, trainer = _deferred(monkeypatch, precision)
    kept = []
    for i, b in enumerate(batches(6)):
        ref_poison.armed = poison.armed = i in (2, 4)
        kept.append((ref.step(b), trainer.step(b)))
        assert trainer.engine.stats.steps == i  # the step before is booked, this one is on its way
    assert trainer.stats == ref.stats and trainer.engine.last_loss == ref.engine.last_loss
    assert [(r.loss, r.skipped, r.scale) for r, _ in kept] == [(r.loss, r.skipped, r.scale) for _, r in kept]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_a_deferred_skip_limit_raises_one_step_late_with_every_step_counted(monkeypatch):
    _, poison, trainer = _deferred(monkeypatch, max_consecutive_skips=3)
    poison.armed = True
    data = batches(5)
    for b in data[:3]:
        assert trainer.step(b).skipped
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row") as info:
        trainer.step(data[3])  # books the third skip before this step's update: its window is dropped
    assert "optimizer step 3" in str(info.value)
    assert trainer.engine.stats.steps == trainer.global_step == 3 and trainer.engine.micro == 0
    poison.armed = False
    assert trainer.step(data[4]).stepped and trainer.stats.steps == 4  # training can go on after the error


def test_a_deferred_scheduler_steps_before_the_next_update_and_only_for_steps_taken(monkeypatch):
    _, poison, trainer = _deferred(monkeypatch)
    optimizer = trainer.optimizer
    trainer.scheduler = trainer.engine.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer.scheduler_interval = "step"
    lrs, stepped = [], 0
    for i, b in enumerate(batches(6)):
        poison.armed = i in (1, 2)
        stepped += trainer.step(b).stepped
        lrs.append(optimizer.param_groups[0]["lr"])  # the LR the next update will use, once this step is booked
    trainer.stats
    assert lrs == [0.1 * 0.5**n for n in (0, 1, 1, 1, 2, 3)] and stepped == 4
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**4


def test_an_interrupt_while_waiting_for_a_verdict_loses_no_step(monkeypatch):
    _, _, trainer = _deferred(monkeypatch)
    data = batches(3)
    trainer.step(data[0])
    _InFlight.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        trainer.step(data[1])  # the wait for the first step's verdict, before this step's update
    trainer.step(data[2])
    assert trainer.global_step == 2 and trainer.stats.steps == 2


def test_fit_counts_as_skipped_only_its_own_steps_when_earlier_ones_are_not_booked_yet(monkeypatch):
    _, poison, trainer = _deferred(monkeypatch)
    poison.armed = True
    for b in batches(3, seed=3):
        assert trainer.step(b).skipped
    poison.armed = False
    record = trainer.fit(batches(2), epochs=1, progress=False)[0]
    assert (record["steps"], record["skipped"]) == (2, 0) and trainer.stats.skipped == 3


def test_a_load_replaces_the_unbooked_verdict_and_does_not_raise_the_old_runs_skip_limit(monkeypatch, tmp_path):
    _, poison, trainer = _deferred(monkeypatch, max_consecutive_skips=2)
    data = batches(3)
    trainer.step(data[0])
    good = trainer.save(tmp_path / "good.pt")
    poison.armed = True
    for b in data[1:]:
        assert trainer.step(b).skipped  # the second skip is not booked yet
    trainer.load(good)  # the run being replaced is not booked: its skip limit is not this run's error
    assert trainer.global_step == 1 and trainer.stats.steps == 1 and trainer.stats.skipped == 0
    poison.armed = False
    assert trainer.step(data[1]).stepped and trainer.stats.steps == 2


def test_a_new_policy_books_the_old_guards_verdict_first(monkeypatch):
    _, _, trainer = _deferred(monkeypatch, "fp16")
    for b in batches(2):
        trainer.step(b)
    trainer._configure(BF16Policy(), None)  # what autotune and a load do, here with a verdict unbooked
    assert trainer.stats.steps == 2 and trainer.stats.scale is None
    trainer.step(batches(1)[0])
    assert trainer.stats.steps == 3 and trainer.stats.scale is None


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


def test_a_load_forgets_the_replaced_runs_last_loss(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    data = batches(3)
    trainer.step(data[0])
    trainer.save(tmp_path / "one.pt")
    trainer.step(data[1])
    assert trainer.engine.last_loss is not None
    trainer.load(tmp_path / "one.pt")
    assert trainer.engine.last_loss is None  # the progress bar shows "-" until this run books a step


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


class _AutocastSeen(nn.Module):
    """A tiny MLP that records, inside forward, the autocast dtype and whether autocast's weight cache is on."""

    def __init__(self):
        super().__init__()
        self.net, self.seen = tiny_mlp(), []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
                          torch.is_autocast_cache_enabled()))
        return self.net(x)


def test_a_policy_whose_autocast_is_a_one_use_context_manager_gets_asked_every_step():
    import contextlib

    class OneUse(BF16Policy):
        @contextlib.contextmanager
        def autocast(self, device_type):  # a generator's context manager cannot be entered twice
            with torch.autocast(device_type, dtype=torch.bfloat16):
                yield

    model = _AutocastSeen()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), OneUse(), device="cpu")
    for b in batches(3):
        trainer.step(b)
    assert [dtype for dtype, _ in model.seen] == [torch.bfloat16] * 3


def test_a_step_nested_in_a_forward_leaves_autocast_as_it_found_it():
    # The kept torch.autocast saves the state it restores on itself: entered twice, the outer exit left autocast on.
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu", grad_accum_steps=2)
    inner = batches(1, seed=5)[0]
    nested = []

    def hook(module, args):
        if not nested:
            nested.append(1)
            trainer.step(inner)

    handle = model[0].register_forward_pre_hook(hook)
    trainer.step(batches(1)[0])
    handle.remove()
    assert nested and not torch.is_autocast_enabled("cpu")
    assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32
    trainer.step(batches(1)[0])
    assert not torch.is_autocast_enabled("cpu")


def test_the_kept_autocast_follows_a_new_default_autocast_dtype():
    # torch.autocast(device, enabled=False) (the fp32 policy's) sets the default dtype it read when made.
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.seen = tiny_mlp(), []

        def forward(self, x):
            with torch.autocast("cpu"):  # no dtype: the default one
                self.seen.append(torch.get_autocast_dtype("cpu"))
                return self.net(x).float()

    model = Inner()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    default = torch.get_autocast_dtype("cpu")
    trainer.step(batches(1)[0])
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        trainer.step(batches(1)[0])
    finally:
        torch.set_autocast_dtype("cpu", default)
    assert model.seen == [default, torch.float16]
