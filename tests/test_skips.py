"""Steps with non-finite gradients are skipped: inf/NaN with and without a scaler, the gradient guards, fused
optimizers, the consecutive-skip limit, and how each step's verdict is booked."""

import copy
import warnings

import pytest
import torch
from torch import nn
from conftest import (B, batch, batches, mk, net, opt_state, params_of, pure_bf16, same_models, same_params, same_state,
                      steps_without_host_sync, tiny_mlp, unfrozen_late)

from precisionloop import BF16Policy, FP16Policy, Trainer, _compat
from precisionloop.guard import FiniteGuard, ScalerGuard, fuse_default_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


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


def test_a_non_finite_sparse_gradient_among_dense_ones_is_caught():
    from precisionloop.guard import FiniteGuard

    guard = FiniteGuard()
    dense = [torch.ones(3), torch.ones(2)]
    assert guard.unscale_(None, dense).item() == 0
    sparse = torch.sparse_coo_tensor([[0]], [float("inf")], (3,), check_invariants=True)
    assert guard.unscale_(None, [torch.ones(3), sparse]).item() == 1  # a sparse gradient by its values
    assert guard.unscale_(None, [sparse, torch.ones(3)]).item() == 1
    assert guard.unscale_(None, [torch.ones(3), torch.tensor([1.0, float("nan")])]).item() == 1
    assert guard.unscale_(None, dense).item() == 0
    assert guard.unscale_(None, []).item() == 0  # no gradient at all (every parameter frozen this step): nothing to skip


def test_the_check_off_the_cpu_reads_the_gradients_and_writes_none_back(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from precisionloop import _compat
    from precisionloop.guard import FiniteGuard

    monkeypatch.setattr(_compat, "fused_non_finite_", _compat.norms_non_finite_)  # the CUDA path, on CPU tensors

    class Writes(TorchDispatchMode):  # every op that writes into one of the gradients
        def __init__(self, grads):
            super().__init__()
            self.storages, self.seen = {g.untyped_storage().data_ptr() for g in grads}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                        func._schema.arguments[len(args):]]):
                values = value if isinstance(value, (list, tuple)) else [value]
                if arg.alias_info is not None and arg.alias_info.is_write and any(  # views and .data too
                        isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in self.storages for v in values):
                    self.seen.append(str(func))
            return func(*args, **kwargs)

    grads = [torch.randn(5), torch.randn(4, 3), torch.randn(2, dtype=torch.float64), torch.randn(3, dtype=torch.bfloat16)]
    grads[1][2, 1] = float("nan")
    with Writes(grads) as writes:
        found = FiniteGuard().unscale_(None, grads)
    assert found.item() == 1.0 and writes.seen == []
    with Writes(grads) as control:  # the mode sees a write when there is one
        torch._amp_foreach_non_finite_check_and_unscale_(grads[:2], torch.zeros(()), torch.ones(()))
    assert control.seen


@pytest.mark.parametrize("nonfinite", [(0,), (1,), (2,), (0, 1), (0, 1, 2), (1, 2)])
def test_the_verdict_over_several_dtypes_is_exactly_one_so_a_fused_optimizer_skips(nonfinite):
    from precisionloop.guard import FiniteGuard

    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float64),
             torch.ones(0, dtype=torch.bfloat16)]  # an empty gradient has no inf-norm, and no inf
    for i in nonfinite:
        grads[i][0] = float("inf") if i != 1 else float("nan")
    found = FiniteGuard().unscale_(None, grads)
    assert found.dtype == torch.float32 and found.item() == 1.0  # fused kernels skip only on exactly 1
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    _compat.step_with_verdict(torch.optim.SGD([param], lr=0.1, fused=True), found)
    assert torch.equal(param.detach(), torch.ones(3))
    assert FiniteGuard().unscale_(None, [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]).item() == 0.0


def test_a_failing_collective_is_raised_not_retried():
    from precisionloop.guard import FiniteGuard

    calls = []

    def all_reduce_max(found):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("collective failed")
        return found

    guard = FiniteGuard(all_reduce_max=all_reduce_max)
    grads = [torch.ones(3), torch.ones(2)]
    guard.unscale_(None, grads)
    with pytest.raises(RuntimeError, match="collective failed"):
        guard.unscale_(None, grads)  # raised from the agreement, after the check: not run a second time
    assert len(calls) == 2


# The verdict's booking. On CUDA each optimizer step's verdict is copied to the host without blocking
# and booked at the next optimizer step; on the CPU at once. ``_deferred`` makes the CPU book as CUDA does.

class _InFlight:
    """An event on a copy to the host: landed by the next optimizer step unless ``slow``; ``interrupt`` makes the
    next wait raise KeyboardInterrupt."""

    interrupt = False
    slow = False

    def query(self):
        return not _InFlight.slow

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


def test_a_copy_still_in_flight_is_booked_two_steps_on_and_the_skip_limit_then(monkeypatch):
    monkeypatch.setattr(_InFlight, "slow", True)  # the GPU lags: no copy has landed when the next step starts
    _, poison, trainer = _deferred(monkeypatch, max_consecutive_skips=2)
    poison.armed = True
    data = batches(4)
    booked = []
    for b in data[:3]:
        assert trainer.step(b).skipped
        booked.append(trainer.engine.stats.steps)
    assert booked == [0, 0, 1]  # never the step just queued, nor the one before it; two steps on it is waited for
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row") as info:
        trainer.step(data[3])  # the limit was reached at step 2: booked, and raised, two steps on
    assert trainer.engine.stats.steps == 2 and trainer.global_step == 3 and "optimizer step 2" in str(info.value)
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row"):
        trainer.stats  # books the third skip
    assert trainer.engine.stats.steps == 3


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


def _steps(model, optimizer, n=3):
    guard = FiniteGuard()
    for x, y in batches(n):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        found = guard.unscale_(optimizer, [p.grad for p in model.parameters()])
        guard.step(optimizer, found)
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_default_optimizer_switched_to_fused_equals_torch_fused(cls):
    kwargs = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.01}
    a, b = tiny_mlp(), tiny_mlp()
    switched = cls(a.parameters(), **kwargs)
    assert fuse_default_optimizer(switched, device_types=("cpu",))
    assert switched.param_groups[0]["fused"] is True and switched.param_groups[0]["foreach"] is False
    reference = cls(b.parameters(), fused=True, **kwargs)
    _steps(a, switched)
    _steps(b, reference)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, fused=False),
    lambda p: torch.optim.AdamW(p, foreach=True),
    lambda p: torch.optim.Adam(p, capturable=True),
    lambda p: torch.optim.RMSprop(p),
    lambda p: type("MyAdam", (torch.optim.Adam,), {})(p),
], ids=["fused=False", "foreach=True", "capturable", "RMSprop", "subclass"])
def test_optimizers_left_as_given(make):
    optimizer = make(tiny_mlp().parameters())
    groups = [dict(g) for g in optimizer.param_groups]
    assert not fuse_default_optimizer(optimizer, device_types=("cpu",))
    assert [dict(g) for g in optimizer.param_groups] == groups


def test_optimizer_with_state_left_as_given():
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    _steps(model, optimizer, 1)
    assert not fuse_default_optimizer(optimizer, device_types=("cpu",))


def test_not_switched_off_the_named_devices():
    assert not fuse_default_optimizer(torch.optim.AdamW(tiny_mlp().parameters()))  # CPU parameters, "cuda" only


def test_guards_share_one_interface():
    scaler_guard = ScalerGuard(torch.amp.GradScaler("cpu", init_scale=4.0))
    finite = FiniteGuard()
    loss = torch.tensor(2.0, requires_grad=True)
    assert scaler_guard.scale(loss).item() == 8.0 and finite.scale(loss) is loss
    assert finite.scale_tensor() is None and finite.scale_value() is None and finite.state_dict() is None
    assert scaler_guard.scale_value() == 4.0 and set(scaler_guard.state_dict()) >= {"scale", "growth_factor"}


def test_fsdp_refuses_fused_optimizers_without_dtensor_kernels():
    from precisionloop import distributed as dist

    params = list(tiny_mlp().parameters())
    with pytest.raises(ValueError, match="fused SGD.*Adam and AdamW work.*fused=False"):
        dist.check_optimizer(torch.optim.SGD(params, lr=0.1, fused=True), "fsdp")
    dist.check_optimizer(torch.optim.AdamW(params, lr=0.1, fused=True), "fsdp")  # its fused kernel takes DTensors
    dist.check_optimizer(torch.optim.SGD(params, lr=0.1), "fsdp")
    dist.check_optimizer(torch.optim.SGD(params, lr=0.1, fused=True), "ddp")
    assert dist.may_fuse(torch.optim.AdamW(params), "fsdp") and not dist.may_fuse(torch.optim.SGD(params, lr=0.1), "fsdp")


def _verdict(guard, grads, bad):
    grads[0].fill_(float("inf") if bad else 1.0)
    return guard.unscale_(None, grads)


def fused_sgd(params, lr):
    return torch.optim.SGD(params, lr, momentum=0.9, fused=True)


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
def test_fused_sgd_first_step_skipped_is_a_no_op(precision, poisoned_empty):
    """A skipped first step of fused momentum SGD leaves nothing behind."""
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


def test_a_skip_limit_reached_before_fit_raises_before_the_loader_is_opened(monkeypatch):
    from precisionloop import engine

    class InFlight(engine._HostCopy):  # as on CUDA: the last skip is not booked when fit begins
        def __init__(self, row):
            super().__init__(row)
            self.event = type("Event", (), {"synchronize": lambda self: None, "query": lambda self: False})()

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
def test_cuda_verdict_is_booked_by_stats_and_the_skip_limit_still_fires():
    model = tiny_mlp()
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), "bf16", device="cuda",
                      max_consecutive_skips=2)
    data = batches(2)
    assert trainer.step(data[0]).skipped
    trainer.step(data[1])  # the second verdict may still be on its way to the host
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row"):
        _ = trainer.stats


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


def _verdict_run(scheduled: bool, n: int = 40):
    """n fused bf16 steps on CUDA with NaN gradients at steps 5, 17 and 18 (1-based); the stats booked after each."""
    _, armed, trainer = _fused_trainer_with_nans(scheduled)
    optimizer = trainer.optimizer
    data = [(x.cuda(), y.cuda()) for x, y in batches(n, seed=3)]
    results, booked, lrs = [trainer.step(data[0])], [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(data[1:], start=2):
            armed["on"] = i in (5, 17, 18)
            results.append(trainer.step(batch))
            booked.append(trainer.engine.stats.steps)
            lrs.append(optimizer.param_groups[0]["lr"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer, results, booked, lrs


@pytest.mark.gpu
def test_cuda_each_verdict_is_booked_once_landed_without_a_sync_and_each_result_keeps_its_own():
    trainer, results, booked, _ = _verdict_run(scheduled=False)
    # Once its copy has landed, and two steps on at the latest; never the step just queued: no host sync.
    assert all(i - 2 <= n <= i - 1 for i, n in enumerate(booked, start=2)), booked
    assert [r.skipped for r in results] == [i in (5, 17, 18) for i in range(1, 41)]  # read after all 40 steps
    losses = [r.loss for r in results]
    stats = trainer.stats
    assert (stats.steps, stats.skipped, trainer.engine.last_loss) == (40, 3, losses[-1])


@pytest.mark.gpu
def test_cuda_a_scheduler_books_each_step_at_the_next_so_the_lr_follows_real_steps():
    trainer, results, booked, lrs = _verdict_run(scheduled=True)
    assert booked == list(range(1, 40))  # each step booked by the next
    taken = [sum(r.stepped for r in results[:i]) for i in range(1, 40)]  # steps really taken before step i + 1
    assert lrs == pytest.approx([0.1 / (1 + t) for t in taken])
    assert trainer.stats.steps == 40 and trainer.stats.skipped == 3


def _stream_run(streams):
    """Fused bf16 steps on CUDA, step i on streams[i % len] (None: the default); NaN gradients at steps 3, 6 and 7."""
    model, armed, trainer = _fused_trainer_with_nans()
    data = [(x.cuda(), y.cuda()) for x, y in batches(40, seed=5)]
    torch.cuda.synchronize()
    results, last = [], torch.cuda.current_stream()
    for i, batch in enumerate(data):
        armed["on"] = i in (3, 6, 7)
        stream = streams[i % len(streams)] or torch.cuda.current_stream()
        stream.wait_stream(last)  # the weights the last step wrote, as any program that switches streams must
        with torch.cuda.stream(stream):
            results.append(trainer.step(batch))
        last = stream
    stats = trainer.stats  # read on the default stream, which waited for none of the side streams
    return model, [(r.loss, r.skipped) for r in results], (stats.steps, stats.skipped)


@pytest.mark.gpu
def test_cuda_steps_on_side_streams_book_the_same_verdicts_as_on_one_stream():
    reference = _stream_run([None])
    one_side = _stream_run([torch.cuda.Stream()])
    alternating = _stream_run([torch.cuda.Stream(), None, torch.cuda.Stream()])
    torch.cuda.synchronize()
    for model, results, stats in (one_side, alternating):
        assert stats == reference[2] == (40, 3)
        assert results == reference[1]
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference[0].parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
def test_a_trainer_on_the_second_gpu_waits_for_its_verdicts_copy_on_that_gpus_stream(monkeypatch):
    # The copy runs on the rows' device's stream; an event recorded on the current device's (cuda:0) would not
    # wait for it, and the rows could be read before they land.
    recorded, record = [], torch.cuda.Event.record

    def record_where(self, stream=None):
        recorded.append(None if stream is None else stream.device)
        return record(self, stream)

    monkeypatch.setattr(torch.cuda.Event, "record", record_where)
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), "bf16", device="cuda:1")
    assert torch.cuda.current_device() == 0
    for batch in batches(10):
        trainer.step(batch)
    assert trainer.stats.steps == 10 and trainer.stats.skipped == 0
    assert recorded and set(recorded) == {torch.device("cuda", 1)}, recorded


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)],
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
    kept = Trainer(model2, make(model2.parameters()), precision, device="cuda", fuse_optimizer=False)
    assert kept.optimizer.param_groups[0]["fused"] is None  # left as given when asked


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


@pytest.mark.gpu
def test_cuda_pure_bf16_skips_a_non_finite_step_with_weights_and_optimizer_state_unchanged():
    model = net()
    poison = Poison(model[0].weight)
    optim = pytest.importorskip("torchao.optim")
    trainer = Trainer(model, optim._AdamW(model.parameters(), lr=1e-2, bf16_stochastic_round=True), "bf16-pure",
                      device="cuda")
    trainer.step(B)
    weights, state = copy.deepcopy(model.state_dict()), opt_state(trainer.optimizer)
    poison.armed = True
    assert trainer.step(batch(2)).skipped
    assert all(torch.equal(v, weights[k]) and v.dtype == torch.bfloat16 and v.is_cuda for k, v in model.state_dict().items())
    assert same_state(opt_state(trainer.optimizer), state)
    poison.armed = False
    assert trainer.step(batch(3)).stepped and trainer.stats.skipped == 1
    assert all(torch.isfinite(p).all() and not torch.equal(p, weights[n]) for n, p in model.named_parameters())


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
