"""graph_optimizer_step: the guarded optimizer step as one CUDA graph. The checks run anywhere; the graph on CUDA only."""

import warnings

import pytest
import torch
from conftest import batches, steps_without_host_sync, tiny_cnn, tiny_mlp

from precisionloop import Trainer, get_policy
from torch import nn

from precisionloop.captured import CapturedStep, check_graphable

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")


def _check(device=CUDA, guard=None, optimizer=None, **settings):
    model = tiny_mlp()
    settings = {**dict(will_fuse=False, max_grad_norm=None, distributed=None, autotune=False), **settings}
    check_graphable(device, guard or get_policy("bf16").make_guard("cuda"),
                    optimizer or torch.optim.SGD(model.parameters(), lr=0.1, fused=True), **settings)


def test_a_fused_sgd_under_bf16_and_fp32_on_cuda_is_graphable():
    _check()
    _check(guard=get_policy("fp32").make_guard("cuda"))
    model = tiny_mlp()
    _check(optimizer=torch.optim.AdamW(model.parameters()), will_fuse=True)  # the Trainer will fuse it


@pytest.mark.parametrize("overrides, match", [
    (dict(device=torch.device("cpu")), "CUDA graphs need a CUDA device; the device is cpu"),
    (dict(autotune=True), "choose the policy first"),
    (dict(distributed="ddp"), "distributed='ddp'"),
    (dict(max_grad_norm=1.0), "max_grad_norm=None"),
])
def test_what_cannot_be_captured_is_refused_with_the_reason(overrides, match):
    with pytest.raises(ValueError, match=f"graph_optimizer_step=True: .*{match}"):
        _check(**overrides)


def test_a_loss_scaler_and_unfused_or_other_optimizers_are_refused():
    with pytest.raises(ValueError, match="ScalerGuard is not capturable .*'bf16' or 'fp32'"):
        _check(guard=get_policy("fp16").make_guard("cpu"))
    model = tiny_mlp()
    with pytest.raises(ValueError, match=r"got SGD with fused=\[None\]"):
        _check(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # default implementation, fuse_optimizer=False
    with pytest.raises(ValueError, match="got Adagrad"):
        _check(optimizer=torch.optim.Adagrad(model.parameters()), will_fuse=True)


def test_the_trainer_refuses_before_it_changes_anything():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="graph_optimizer_step must be True or False, got 'yes'"):
        Trainer(model, optimizer, "bf16", device="cpu", graph_optimizer_step="yes")
    with pytest.raises(ValueError, match="the device is cpu"):
        Trainer(model, optimizer, "bf16", device="cpu", graph_optimizer_step=True)
    assert optimizer.param_groups[0]["fused"] is None and not optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# When to capture anew, on the CPU: a stand-in records "captures" and replays nothing --------------------


class _NoGraph:
    def replay(self):
        pass


@pytest.fixture
def recorded(monkeypatch):
    """A CapturedStep over a fused CPU SGD with momentum buffers, whose capture makes a graph that does nothing."""
    monkeypatch.setattr(CapturedStep, "_record", lambda self, params, ones: _NoGraph())
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the momentum buffers: a graph is captured only over state that exists
    step = CapturedStep(opt)
    assert step.step(params) is not None and step.captures == 1
    return step, opt, params


def _captures_after(step, params):
    found = step.step(params)
    return None if found is None else step.captures


@pytest.mark.parametrize("change", [
    lambda opt, params: opt.state[params[0]].__setitem__("momentum_buffer", torch.zeros_like(params[0])),
    lambda opt, params: opt.state.__setitem__(params[1], dict(opt.state[params[1]])),
    lambda opt, params: opt.load_state_dict(opt.state_dict()),
    lambda opt, params: setattr(params[0], "data", params[0].data.clone()),
    lambda opt, params: opt.param_groups[0].__setitem__("momentum", 0.8),
    lambda opt, params: opt.param_groups[0].__setitem__("weight_decay", 1e-4),
    lambda opt, params: setattr(params[2], "grad", None),
    lambda opt, params: setattr(opt.state[params[0]]["momentum_buffer"], "data", torch.zeros_like(params[0])),
    lambda opt, params: torch.utils.swap_tensors(opt.state[params[1]]["momentum_buffer"], torch.zeros_like(params[1])),
], ids=["state-entry", "state-dict", "load", "new-data", "momentum", "weight-decay", "no-grad", "state-new-data",
        "state-swapped"])
def test_what_the_graph_was_captured_over_changing_means_a_new_capture(recorded, change):
    step, opt, params = recorded
    assert _captures_after(step, params) == 1  # nothing changed: replayed
    change(opt, params)
    assert _captures_after(step, params) == 2


def test_a_new_lr_is_filled_into_the_graphs_lr_and_a_tensor_lr_gives_up(recorded):
    step, opt, params = recorded
    opt.param_groups[0]["lr"] = 0.05
    assert _captures_after(step, params) == 1 and step._lrs[0][0].item() == pytest.approx(0.05)
    opt.param_groups[0]["lr"] = torch.tensor(0.05)
    assert step.step(params) is None and "tensor LR" in step.given_up


@pytest.mark.parametrize("key, value", [("momentum", torch.tensor(0.9)), ("betas", (torch.tensor(0.9), 0.99))])
def test_a_tensor_setting_gives_up_the_graph(recorded, key, value):
    """A kernel may read a tensor setting once, at capture: a later in-place change would go unseen."""
    step, opt, params = recorded
    opt.param_groups[0][key] = value
    assert step.step(params) is None and f"a tensor setting ('{key}')" in step.given_up


def test_a_state_value_that_is_not_a_tensor_is_matched_too(recorded):
    step, opt, params = recorded
    opt.state[params[0]]["note"] = 1.0  # one more entry: captured anew
    assert _captures_after(step, params) == 2 and _captures_after(step, params) == 2  # then replayed
    setattr(opt.state[params[1]]["momentum_buffer"], "data", torch.zeros_like(params[1]))
    assert _captures_after(step, params) == 3


def test_a_state_value_without_an_address_gives_up_the_graph(recorded):
    step, opt, params = recorded
    opt.state[params[0]]["extra"] = torch.zeros(3).to_sparse()
    assert step.step(params) is None and "optimizer state tensor is not dense" in step.given_up
    assert step.step(params) is None  # and stays eager, without raising


def test_a_load_starts_the_count_of_quick_recaptures_again(recorded):
    step, opt, params = recorded
    for i in range(2):  # two quick recaptures: one more in a row would give up
        opt.param_groups[0]["momentum"] = 0.8 - 0.1 * i
        assert _captures_after(step, params) == 2 + i
    step.invalidate()  # as a load does
    assert _captures_after(step, params) == 4
    opt.param_groups[0]["momentum"] = 0.5
    assert _captures_after(step, params) == 5 and step.given_up is None


def test_settings_that_change_within_100_steps_three_times_give_up(recorded):
    step, opt, params = recorded
    for i in range(2):
        opt.param_groups[0]["momentum"] = 0.8 - 0.1 * i
        assert _captures_after(step, params) == 2 + i
    opt.param_groups[0]["momentum"] = 0.5  # the third change
    assert step.step(params) is None and "changed 3 times within 100 steps" in step.given_up


def test_hooks_and_steps_without_gradients_stay_eager(recorded):
    step, opt, params = recorded
    handle = opt.register_step_post_hook(lambda *args: None)
    assert step.step(params) is None and step.given_up is None
    handle.remove()
    for p in params:
        p.grad = None
    assert step.step(params) is None and step.given_up is None and step.replays == 1


def test_the_engine_warns_once_and_drops_a_graph_that_gave_up(recorded):
    from precisionloop.engine import StepEngine

    step, opt, params = recorded
    engine = StepEngine(nn.Linear(1, 1), opt, torch.device("cpu"), loss_of=None, scheduler=None, grad_accum_steps=1,
                        max_grad_norm=None, max_consecutive_skips=3, distributed=None)
    engine.captured, engine.micro = step, 1
    opt.param_groups[0]["lr"] = torch.tensor(0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raised as an error: the graph is dropped first, so it does not repeat
        with pytest.raises(RuntimeWarning, match="runs eagerly from now on: a tensor LR"):
            engine._replay()
    assert engine.captured is None


# On CUDA -------------------------------------------------------------------------------------------------

# LRs that are fp32 numbers (the schedule below halves them): the graph reads each LR from an fp32 tensor.
OPTIMIZERS = {
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=2**-4, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=2**-4),
    "adam-amsgrad-wd": lambda p: torch.optim.Adam(p, lr=2**-7, weight_decay=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=2**-7),
}


def _data(n, nan_at=(4, 5)):
    data = []
    for i, (x, y) in enumerate(batches(n)):
        if i in nan_at:
            x = x.clone()
            x[0, 0] = float("nan")  # a NaN loss: every gradient is NaN, and the step must be skipped
        data.append((x.cuda(), y.cuda()))
    return data


def _trainer(make, graphed, scheduled=True, **kw):
    model = tiny_mlp()
    opt = make(model.parameters())
    # a new LR every step, booked at the next
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s % 4)) if scheduled else None
    kw.setdefault("device", "cuda")
    return Trainer(model, opt, "bf16", scheduler=sched, graph_optimizer_step=graphed, **kw)


def _assert_same(a, b):
    """The same weights, optimizer state, LR and counters, bit for bit."""
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    assert [g["lr"] for g in a.optimizer.param_groups] == [g["lr"] for g in b.optimizer.param_groups]
    assert a.stats == b.stats and a.global_step == b.global_step


@gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_captured_step_is_the_eager_step_bit_for_bit(name):
    eager, graphed = _trainer(OPTIMIZERS[name], False), _trainer(OPTIMIZERS[name], True)
    data = _data(14)
    for batch in data:
        assert eager.step(batch).skipped == graphed.step(batch).skipped
    _assert_same(eager, graphed)
    assert graphed.stats.skipped == 2 and torch.isfinite(next(graphed.model.parameters())).all()
    captured = graphed.engine.captured
    assert captured.captures == 1 and captured.replays >= 12  # eager until the optimizer has its state
    assert all(g.get("capturable", False) is False for g in graphed.optimizer.param_groups)  # restored after capture
    assert eager.engine.captured is None


@gpu
def test_a_captured_step_takes_no_host_sync():
    trainer = _trainer(OPTIMIZERS["adamw"], True)
    data = _data(6, nan_at=())
    for batch in data[:2]:
        trainer.step(batch)  # state, then the capture
    results = steps_without_host_sync(trainer, data[2:])
    assert all(r.stepped for r in results) and trainer.engine.captured.replays == 5


@gpu
def test_a_load_and_a_frozen_layer_are_captured_anew_and_stay_exact():
    eager, graphed = _trainer(OPTIMIZERS["sgd-nesterov-wd"], False), _trainer(OPTIMIZERS["sgd-nesterov-wd"], True)
    data = _data(14)
    for t in (eager, graphed):
        for batch in data[:6]:
            t.step(batch)
        saved = t.state_dict()
        for batch in data[6:9]:
            t.step(batch)
        t.load_state_dict(saved)  # new optimizer state tensors: the old graph would write the replaced ones
        for batch in data[6:10]:
            t.step(batch)
        t.model[2].requires_grad_(False)  # no gradients there: the eager step leaves those parameters alone
        for batch in data[10:]:
            t.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 3 and graphed.engine.captured.given_up is None


@gpu
def test_a_step_on_another_stream_is_captured_for_that_stream():
    eager, graphed = _trainer(OPTIMIZERS["adamw"], False), _trainer(OPTIMIZERS["adamw"], True)
    data = _data(8)
    for t in (eager, graphed):
        for batch in data[:4]:
            t.step(batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for batch in data[4:]:
                t.step(batch)
        torch.cuda.current_stream().wait_stream(side)
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 2 and graphed.engine.captured.replays == 7


@gpu
def test_settings_that_keep_changing_give_up_the_graph_with_one_warning():
    eager, graphed = _trainer(OPTIMIZERS["sgd-nesterov-wd"], False), _trainer(OPTIMIZERS["sgd-nesterov-wd"], True)
    data = _data(10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in (eager, graphed):
            for i, batch in enumerate(data):
                t.optimizer.param_groups[0]["momentum"] = 0.9 - 0.01 * i  # a momentum schedule: baked into a graph
                t.step(batch)
    _assert_same(eager, graphed)
    ours = [w for w in seen if "graph_optimizer_step" in str(w.message)]
    assert len(ours) == 1 and "changed 3 times" in str(ours[0].message) and ours[0].filename == __file__
    assert graphed.engine.captured is None  # eager from then on


@gpu
def test_partial_windows_and_step_hooks_run_eagerly():
    eager, graphed = (_trainer(OPTIMIZERS["adamw"], g, grad_accum_steps=2) for g in (False, True))
    calls = []
    data = _data(11, nan_at=(3,))
    for t in (eager, graphed):
        for batch in data[:8]:
            t.step(batch)
        handle = t.optimizer.register_step_pre_hook(lambda *a: calls.append(1))
        t.step(data[8])
        t.step(data[9])  # a hook: the replay would skip it, so this step is eager
        handle.remove()
        t.step(data[10])
        t.flush()  # a window of one, rescaled: eager
    _assert_same(eager, graphed)
    assert calls == [1, 1] and graphed.engine.captured.replays == 3  # steps 2-4 (step 1 made the state)


def _fp32(x):
    return float(torch.tensor(x, dtype=torch.float32))


@gpu
@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adamw"])
def test_other_lrs_step_as_the_eager_step_with_each_lr_rounded_to_fp32(name):
    eager, graphed = _trainer(OPTIMIZERS[name], False, False), _trainer(OPTIMIZERS[name], True, False)
    for i, batch in enumerate(_data(30, nan_at=(7,))):
        lr = 1e-3 / (1 + 0.37 * i)  # not an fp32 number
        eager.optimizer.param_groups[0]["lr"], graphed.optimizer.param_groups[0]["lr"] = _fp32(lr), lr
        eager.step(batch)
        graphed.step(batch)
    graphed.optimizer.param_groups[0]["lr"] = eager.optimizer.param_groups[0]["lr"]
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 1


@gpu
def test_state_cleared_or_replaced_in_place_is_captured_anew():
    eager, graphed = _trainer(OPTIMIZERS["adamw"], False), _trainer(OPTIMIZERS["adamw"], True)
    data = _data(12, nan_at=())
    for t in (eager, graphed):
        before_any_step = t.state_dict()  # no optimizer state: a load clears it in place
        for batch in data[:4]:
            t.step(batch)
        t.load_state_dict(before_any_step)
        for batch in data[4:8]:
            t.step(batch)
        for p in list(t.optimizer.state):  # each parameter's state replaced by a copy, by hand
            t.optimizer.state[p] = {k: v.clone() for k, v in t.optimizer.state[p].items()}
        for batch in data[8:]:
            t.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 3


@gpu
def test_state_given_new_memory_is_captured_anew():
    """The same state tensors given new memory (the old is freed): the graph must not go on writing the old."""
    eager, graphed = _trainer(OPTIMIZERS["adamw"], False), _trainer(OPTIMIZERS["adamw"], True)
    data = _data(10, nan_at=())
    for t in (eager, graphed):
        for batch in data[:4]:
            t.step(batch)
        for state in t.optimizer.state.values():
            for v in state.values():
                v.data = v.data.clone()
        for batch in data[4:]:
            t.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 2


@gpu
def test_tensor_betas_give_up_the_graph_and_step_as_the_eager_step():
    """Fused Adam reads host-tensor betas once, at capture: a graph would miss the in-place change below."""
    def make(params):
        return torch.optim.Adam(params, lr=2**-7, betas=(torch.tensor(0.9), torch.tensor(0.999)))

    eager, graphed = (_trainer(make, g, False) for g in (False, True))
    data = _data(8, nan_at=())
    with pytest.warns(RuntimeWarning, match=r"a tensor setting \('betas'\) is not captured"):
        for t in (eager, graphed):
            for batch in data[:4]:
                t.step(batch)
            t.optimizer.param_groups[0]["betas"][0].fill_(0.5)
            for batch in data[4:]:
                t.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured is None


class _LateHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.late_head = tiny_mlp(), nn.Linear(4, 4), nn.Linear(4, 4)
        self.late = False

    def forward(self, x):
        h = self.body(x)
        return self.head(h) + self.late_head(h) if self.late else self.head(h)


@gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_a_default_sgd_trains_a_head_first_used_late(graphed):
    """The Trainer fuses a default SGD; torch's fused SGD raises on a head whose first gradient comes after the
    other parameters' momentum buffers exist. That step runs torch's default SGD, so it trains as unfused."""
    runs = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = _LateHead()
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=2**-4, momentum=0.9), "bf16", device="cuda",
                    fuse_optimizer=fuse, graph_optimizer_step=graphed and fuse)
        for i, batch in enumerate(_data(10, nan_at=(4,))):
            model.late = i >= 4  # its first step is skipped (NaN), the next one starts its buffers
            t.step(batch)
        runs.append((model, t))
    (a, ta), (b, tb) = runs
    assert ta.optimizer.param_groups[0]["fused"] is True and ta.stats == tb.stats and ta.stats.skipped == 1
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@gpu
def test_a_tensor_lr_set_after_the_capture_gives_up_the_graph():
    eager, graphed = (_trainer(OPTIMIZERS["sgd-nesterov-wd"], g, False) for g in (False, True))
    data = _data(8, nan_at=())
    with pytest.warns(RuntimeWarning, match="a tensor LR is not captured"):
        for t in (eager, graphed):
            for batch in data[:3]:
                t.step(batch)
            lr = t.optimizer.param_groups[0]["lr"] = torch.tensor(2**-5, device="cuda")  # fused SGD takes it
            for batch in data[3:5]:
                t.step(batch)
            lr.fill_(2**-6)  # as a scheduler sets a tensor LR: in place
            for batch in data[5:]:
                t.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured is None


@gpu
def test_an_interrupted_warm_up_leaves_adams_step_counts_as_they_were(monkeypatch):
    eager, graphed = _trainer(OPTIMIZERS["adamw"], False), _trainer(OPTIMIZERS["adamw"], True)
    data = _data(6, nan_at=())
    eager.step(data[0])
    graphed.step(data[0])  # eager: it makes Adam's state
    fused = torch._fused_adamw_

    def interrupted(*args, **kwargs):  # after _fused_adam counted the step up, before it counts it back down
        monkeypatch.setattr(torch, "_fused_adamw_", fused)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "_fused_adamw_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        graphed.step(data[1])
    assert graphed.global_step == 1 and graphed.engine.captured.captures == 0
    for batch in data[2:]:
        eager.step(batch)
        graphed.step(batch)
    _assert_same(eager, graphed)
    assert graphed.engine.captured.captures == 1


@gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs; run on the two-GPU machine")
def test_a_trainer_on_the_second_gpu_captures_there():
    eager, graphed = (_trainer(OPTIMIZERS["adamw"], g, device="cuda:1") for g in (False, True))
    assert torch.cuda.current_device() == 0
    for batch in _data(8):
        eager.step(batch)
        graphed.step(batch)
    _assert_same(eager, graphed)
    assert graphed.stats.skipped == 2 and graphed.engine.captured.replays == 7


@gpu
def test_compiled_and_captured_fit_trains_and_skips_nans():
    model = tiny_cnn()
    armed = {"on": False}
    model[-1].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "bf16", device="cuda",
                      compile=True, graph_optimizer_step=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, pin_memory=True)  # a pin thread
    trainer.fit(loader, epochs=2, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items() if "weight" in k}
    armed["on"] = True
    assert trainer.step(data[0]).skipped
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert trainer.stats.skipped == 1 and trainer.engine.captured.replays >= 10
