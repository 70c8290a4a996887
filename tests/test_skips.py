"""Steps with non-finite gradients are skipped: inf/NaN under every policy, fused optimizers (their first
skipped step, no host sync on CUDA), the consecutive-skip limit, and the loss scale."""

import copy
import functools
import dataclasses
import warnings

import pytest
import torch
from torch import nn
from conftest import (B, batch, batches, mk, opt_state, params_of, pure_bf16, same_models, same_params, same_state,
                      steps_without_host_sync, tiny_mlp, unfrozen_late)

from precisionloop import BF16Policy, FP16Policy, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


class Poison:
    """A gradient hook that replaces one parameter's gradient with inf or NaN while armed."""

    def __init__(self, param, value=float("inf")):
        self.armed = False
        self.value = value
        param.register_hook(lambda g: torch.full_like(g, self.value) if self.armed else g)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_non_finite_gradient_skips_the_step_and_the_scheduler(precision, fused, value):
    model = tiny_mlp()
    poison = Poison(model[0].weight, value)
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


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_nan_loss_with_finite_gradients_skips_the_step(precision, accum):
    # Every target ignored (a batch of prompt tokens only): cross_entropy is 0/0, NaN, and every gradient exactly 0.
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = Trainer(model, optimizer, precision, device="cpu", grad_accum_steps=accum, max_consecutive_skips=2)
    trainer.step(batches(1)[0])
    trainer.flush()
    before, state, scale = copy.deepcopy(model.state_dict()), opt_state(optimizer), trainer.stats.scale
    x, y = batches(1)[0]
    ignored = (x, torch.full_like(y, -100))
    results = [trainer.step(b) for b in [ignored, (x, y)][:accum]]  # one NaN micro-batch skips the accumulation
    assert results[-1].skipped and not results[-1].stepped and trainer.stats.skipped == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert same_state(opt_state(optimizer), state)
    assert trainer.stats.scale == (scale / 2 if precision == "fp16" else None)
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row were skipped for non-finite gradients or loss"):
        [trainer.step(ignored) for _ in range(accum)]


def spike_policy(base, max_norm):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SkipSpikes(base):  # what docs/custom-policies.md shows
        max_norm: float

        def should_skip(self, nonfinite, grad_norm):
            return torch.maximum(nonfinite, (grad_norm() > self.max_norm).float())

    return SkipSpikes(max_norm=max_norm, **({"init_scale": 8.0} if base is FP16Policy else {}))


@pytest.mark.parametrize("clip", [None, 100.0])
@pytest.mark.parametrize("base", [FP16Policy, BF16Policy])
def test_a_policy_skips_a_finite_step_whose_gradient_norm_spikes_without_backing_off(base, clip):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), spike_policy(base, 5.0), device="cpu",
                      max_grad_norm=clip, max_consecutive_skips=2)
    x, y = batches(1)[0]
    assert trainer.step((x, y)).stepped
    before, state = copy.deepcopy(model.state_dict()), opt_state(trainer.optimizer)
    result = trainer.step((x * 100, y))
    assert result.skipped and result.grad_norm > 5.0 and trainer.stats.skipped == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and same_state(opt_state(trainer.optimizer), state)
    assert result.scale == (8.0 if base is FP16Policy else None)  # a finite skip backs off no loss scale
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row were skipped by the policy's should_skip"):
        trainer.step((x * 100, y))


@pytest.mark.gpu
def test_a_policy_judging_the_gradient_norm_adds_no_host_sync():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), spike_policy(BF16Policy, 5.0),
                      device="cuda")
    data = [trainer.to_device((x * k, y)) for k, (x, y) in zip([1, 1, 100, 1], batches(4))]
    trainer.step(data[0])
    results = steps_without_host_sync(trainer, data[1:])
    assert [r.skipped for r in results] == [False, True, False] and trainer.stats.skipped == 1


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
    trainer.step(data[0])  # fires once a run of skips: the diverged state can still be saved and read
    assert trainer.stats.skipped == 4 and trainer.state_dict()["counters"]["consecutive_skips"] == 4


def test_collapse_warning_given_once():
    model = tiny_mlp()
    poison = Poison(model[0].weight)
    poison.armed = True
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=4.0), device="cpu")
    data = batches(1)[0]
    trainer.step(data)
    trainer.step(data)  # scale 1.0: not yet below 1
    with pytest.warns(RuntimeWarning, match="loss scale|collapsing") as record:
        trainer.step(data)
    assert record[0].filename == __file__  # the line that called step, not a line inside the package
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.step(data)
    assert trainer.stats.min_scale == 0.25


def fused_sgd(params, lr, dampening=0.0):
    return torch.optim.SGD(params, lr, momentum=0.9, dampening=dampening, fused=True)


NAN_LOSS = lambda o, y: o.sum() * float("nan")  # noqa: E731


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
@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_fused_sgd_first_step_skipped_is_a_no_op(precision, dampening, poisoned_empty):
    """A skipped first step of fused momentum SGD leaves nothing behind: the next is torch's default SGD's first."""
    fused_sgd_here = functools.partial(fused_sgd, dampening=dampening)
    m, t = mk(precision, opt=fused_sgd_here)
    for p in m.parameters():
        t.optimizer.state[p]  # a read that makes an empty entry, as a script's inspection can
    loss_fn = t.loss_fn
    t.loss_fn = NAN_LOSS
    assert t.step(B).skipped
    t.loss_fn = loss_fn
    t.step(batch(2))
    t.step(batch(3))
    # fp16: the skip halved the loss scale, so the reference starts from that scale.
    ref_policy = FP16Policy(init_scale=2.0**15) if precision == "fp16" else precision
    ref_m, ref = mk(ref_policy, opt=functools.partial(torch.optim.SGD, momentum=0.9, dampening=dampening))
    ref.step(batch(2))
    ref.step(batch(3))
    for p in m.parameters():
        assert torch.isfinite(t.optimizer.state[p]["momentum_buffer"]).all(), "garbage momentum buffer"
        assert torch.isfinite(p).all()
    for p, q in zip(m.parameters(), ref_m.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # fused and default SGD may round apart
    assert t.stats.skipped == 1 and ref.stats.skipped == 0


@pytest.mark.parametrize("accum", [1, 2])
def test_fp16_losses_reach_the_loggers_unscaled(accum):
    """The losses are checked scaled and unscaled with the gradients: what fit logs is each step's loss."""
    class Seen:
        def __init__(self):
            self.logged, self.results = [], []

        def log_metrics(self, metrics, step):
            if "epoch" not in metrics:  # not the epoch's record
                self.logged.append(metrics["loss"])

        def on_step_end(self, trainer, result):
            if result.stepped or result.skipped:
                self.results.append(result.loss)

    _, t = mk(FP16Policy(init_scale=2.0**10), grad_accum_steps=accum)
    seen = Seen()
    t.fit([batch(i) for i in range(4)], progress=False, log_every=1, loggers=[seen], callbacks=[seen])
    assert len(seen.logged) == 4 // accum and seen.logged == pytest.approx(seen.results, rel=1e-6)
    assert t.stats.scale == 2.0**10


@pytest.mark.parametrize("load", ["trainer", "optimizer"])
def test_fused_sgd_first_step_skipped_after_loading_a_state_saved_before_any_step(load, tmp_path, poisoned_empty):
    """The loaded optimizer has no momentum buffers again: a skipped first step after the load leaves none behind."""
    m, t = mk("fp32", opt=fused_sgd)
    t.save(tmp_path / "fresh.pt")
    fresh = copy.deepcopy(t.optimizer.state_dict())
    t.step(batch(2))  # every parameter has its buffer now
    if load == "trainer":
        t.load(tmp_path / "fresh.pt")
    else:
        t.optimizer.load_state_dict(fresh)
    loss_fn, t.loss_fn = t.loss_fn, NAN_LOSS
    assert t.step(B).skipped
    t.loss_fn = loss_fn
    t.step(batch(2))
    for p in m.parameters():
        assert torch.isfinite(t.optimizer.state[p]["momentum_buffer"]).all(), "garbage momentum buffer"


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
    """torch's fused SGD raises on a mix of parameters with and without momentum buffers; the Trainer's fused SGD
    trains as torch's default SGD does."""
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
    assert fused_t.optimizer.param_groups[0]["fused"] is True  # stepped fused throughout
    assert fused_t.stats == plain_t.stats
    for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(fused_t.optimizer.state[p]["momentum_buffer"],
                                   plain_t.optimizer.state[q]["momentum_buffer"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_late_unfrozen_parameter_nan_skips_the_step(precision):
    """NaN in a late-added parameter's gradient skips the step."""
    m, t = unfrozen_late(precision)
    before = params_of(m)
    m[0].weight.register_hook(lambda g: g * float("nan"))
    t.step(B)
    assert t.stats.skipped == 1
    assert same_params(m, before), "the step changed weights although a gradient was NaN"


def test_max_consecutive_skips_in_fit_keeps_counters_consistent(tmp_path):
    """After max_consecutive_skips stops fit, global_step == batch_in_epoch and save works."""
    _, t = mk(max_consecutive_skips=3)
    t.loss_fn = NAN_LOSS
    with pytest.raises(RuntimeError, match="in a row"):
        t.fit([batch(i) for i in range(6)], epochs=1, progress=False)
    assert t.epoch == 0
    assert t.global_step == t.batch_in_epoch, (t.global_step, t.batch_in_epoch)
    assert t.save(tmp_path / "after.pt").is_file()


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


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_inf_skips_with_fused_and_foreach_adam(fused):
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    trainer = Trainer(model, optimizer, FP16Policy(), device="cuda", scheduler=scheduler,
                      scheduler_interval="step" if scheduler is not None else None)
    data = batches(2)
    trainer.step(data[0])
    before = copy.deepcopy(model.state_dict())
    armed["on"] = True
    result = trainer.step(data[1])
    assert result.skipped and result.scale == 2.0**15
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optimizer.param_groups[0]["lr"] == 0.005


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_fused_optimizer_steps_without_host_sync(precision):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), precision, device="cuda",
                      max_grad_norm=1.0)
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    trainer.step(data[0])  # the first step creates optimizer state and scaler tensors
    results = steps_without_host_sync(trainer, data[1:])
    assert all(r.stepped for r in results)
    assert trainer.stats.steps == 4


@pytest.mark.gpu
def test_cuda_skip_limit_fires_at_most_two_steps_late():
    model = tiny_mlp()
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), "bf16", device="cuda",
                      max_consecutive_skips=3)
    steps = 0
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row") as info:
        for batch in batches(6):
            steps += 1
            trainer.step(batch)
    assert 3 <= steps <= 5 and "optimizer step 3" in str(info.value)


def _fused_trainer_with_nans(scheduled: bool = False):
    """A bf16 Trainer on CUDA with fused SGD whose first layer's gradients are NaN while ``armed["on"]``.

    Returns (model, armed, trainer); with ``scheduled``, a LambdaLR that lowers the LR each step.
    """
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k)) if scheduled else None
    return model, armed, Trainer(model, optimizer, "bf16", device="cuda", scheduler=scheduler,
                                 scheduler_interval="step" if scheduler is not None else None)


def _nan_run(scheduled: bool, n: int = 40):
    """n fused bf16 steps on CUDA, with no host sync allowed, NaN gradients at steps 5, 17 and 18 (1-based)."""
    _, armed, trainer = _fused_trainer_with_nans(scheduled)
    data = [(x.cuda(), y.cuda()) for x, y in batches(n, seed=3)]
    results, lrs = [trainer.step(data[0])], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(data[1:], start=2):
            armed["on"] = i in (5, 17, 18)
            results.append(trainer.step(batch))
            lrs.append(trainer.optimizer.param_groups[0]["lr"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer, results, lrs


@pytest.mark.gpu
def test_cuda_results_and_stats_report_each_skip_without_a_host_sync():
    trainer, results, _ = _nan_run(scheduled=False)
    assert [r.skipped for r in results] == [i in (5, 17, 18) for i in range(1, 41)]  # read after all 40 steps
    assert (trainer.stats.steps, trainer.stats.skipped) == (40, 3)


@pytest.mark.gpu
def test_cuda_a_step_scheduler_follows_the_steps_really_taken():
    trainer, results, lrs = _nan_run(scheduled=True)
    taken = [sum(r.stepped for r in results[:i]) for i in range(1, 40)]  # steps really taken before step i + 1
    assert lrs == pytest.approx([0.1 / (1 + t) for t in taken])
    assert trainer.stats.steps == 40 and trainer.stats.skipped == 3


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, **kw),
                                  lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw)],
                         ids=["AdamW()", "SGD(momentum)"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_default_optimizers_step_without_host_sync_and_still_skip(make, precision):
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    optimizer = make(model.parameters())
    trainer = Trainer(model, optimizer, precision, device="cuda")
    assert optimizer.param_groups[0]["fused"] is True  # the default implementation was swapped for the fused one
    data = [(x.cuda(), y.cuda()) for x, y in batches(5)]
    trainer.step(data[0])  # creates optimizer state (and SGD's momentum buffers, decided on the host once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.step(data[1])
        armed["on"] = True
        weights = copy.deepcopy(model.state_dict())
        state = copy.deepcopy(optimizer.state_dict()["state"])
        skipped = trainer.step(data[2])
        after_weights = copy.deepcopy(model.state_dict())  # device copies: compared after the sync check
        after_state = copy.deepcopy(optimizer.state_dict()["state"])
        armed["on"] = False
        trainer.step(data[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    unchanged = all(torch.equal(v, weights[k]) for k, v in after_weights.items())
    same_state = all(torch.equal(v, state[i][k]) for i, s in after_state.items() for k, v in s.items()
                     if isinstance(v, torch.Tensor))
    assert unchanged and same_state  # a non-finite gradient reached neither the weights nor the optimizer state
    assert skipped.skipped and trainer.stats.skipped == 1
    model2 = tiny_mlp()
    kept = Trainer(model2, make(model2.parameters(), fused=False), precision, device="cuda")
    assert kept.optimizer.param_groups[0]["fused"] is False  # built with fused=False: left as given


@pytest.mark.gpu
def test_default_optimizer_fused_equals_torch_fused():
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    a, b = tiny_mlp(), tiny_mlp()
    ta = Trainer(a, torch.optim.AdamW(a.parameters(), lr=1e-2), "bf16", device="cuda")
    tb = Trainer(b, torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True), "bf16", device="cuda")
    for batch in data:
        ta.step(batch)
        tb.step(batch)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_pure_bf16_skips_a_non_finite_step_with_weights_and_optimizer_state_unchanged(value):
    model, trainer = pure_bf16(scheduler=None)
    poison = Poison(model[0].weight, value)
    trainer.step(B)  # the optimizer state exists from here on
    weights, state = copy.deepcopy(model.state_dict()), opt_state(trainer.optimizer)
    poison.armed = True
    result = trainer.step(batch(2))
    assert result.skipped and not result.stepped
    assert all(torch.equal(v, weights[k]) and v.dtype == torch.bfloat16 for k, v in model.state_dict().items())
    assert same_state(opt_state(trainer.optimizer), state), "the optimizer state changed on a skipped step"
    poison.armed = False
    assert trainer.step(batch(3)).stepped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.stats.skipped == 1 and trainer.stats.steps == 3


def _plain_state(optimizer):
    """Every state tensor as plain copies: an 8-bit state (torchao's OptimState8bit) as its codes and scales."""
    def plain(value):
        if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
            return tuple(getattr(value, name).clone() for name in value.__tensor_flatten__()[0])
        return value.clone() if isinstance(value, torch.Tensor) else value
    return [{k: plain(v) for k, v in s.items()} for s in optimizer.state.values()]


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_8bit_optimizer_states_keep_the_skip_guarantee(precision):
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))  # 4096 weights: torchao quantizes them
    poison = Poison(model[2].weight, float("nan"))
    opt = optim.AdamW8bit(model.parameters(), lr=1e-2, bf16_stochastic_round=precision == "bf16-pure")
    trainer = Trainer(model, opt, precision, device="cpu")
    data = [(torch.randn(4, 64, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 2, 0])) for i in range(3)]
    trainer.step(data[0])
    assert type(opt.state[model[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    weights, state = copy.deepcopy(model.state_dict()), _plain_state(opt)
    poison.armed = True
    assert trainer.step(data[1]).skipped
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert same_state(_plain_state(opt), state), "the 8-bit state changed on a skipped step"
    poison.armed = False
    assert trainer.step(data[2]).stepped and not same_state(_plain_state(opt), state)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_skipped_step_names_its_parameters_from_the_second_in_a_row(device, fused):
    model = tiny_mlp()
    poison = Poison(model[2].weight, float("nan"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    trainer = Trainer(model, optimizer, "bf16", device=device, max_consecutive_skips=3)
    data = batches(4)
    assert trainer.step(data[0]).nonfinite == ()
    poison.armed = True
    first = trainer.step(data[1])
    assert first.skipped and first.nonfinite == ()  # a first skip is checked as one flag, at no extra cost
    second = trainer.step(data[2])
    assert second.skipped and second.nonfinite == ("2.weight",)
    assert trainer.stats.nonfinite == ("2.weight",)
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row .*non-finite gradients in 2.weight"):
        trainer.step(data[3])
        trainer.stats  # on CUDA the outcome is counted when read
