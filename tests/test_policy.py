"""Precision policies: the name table and get_policy, autocast dtypes inside the step, backend flags set and
restored, custom policies, and pure bf16."""

import contextlib
import logging
import warnings

import pytest
import torch
from torch import nn
from conftest import B, batches, pure_bf16, read_flags, steps_without_host_sync, tf32_flags, tiny_cnn, tiny_mlp, \
    write_flags

import precisionloop
from precisionloop import BF16AdamW, BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy, Trainer, get_policy

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


@pytest.mark.parametrize(
    "spec, name",
    [
        ("fp32", "fp32"), ("FP32", "fp32"), ("float32", "fp32"), ("32", "fp32"), (32, "fp32"), (" 32-true ", "fp32"),
        ("no", "fp32"),
        (torch.float32, "fp32"), ("fp32-strict", "fp32-strict"), ("FP32-Strict", "fp32-strict"),
        ("tf32", "tf32"), ("TF32", "tf32"),
        ("bf16", "bf16"), ("BFloat16", "bf16"), ("bf16-mixed", "bf16"), (torch.bfloat16, "bf16"),
        ("bf16-pure", "bf16-pure"), (" BF16-Pure ", "bf16-pure"), ("pure-bf16", "bf16-pure"),
        ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("HALF", "fp16"), ("16", "fp16"), (16, "fp16"),
        ("16-mixed", "fp16"), (torch.float16, "fp16"),
    ],
)
def test_name_table(spec, name):
    assert get_policy(spec).name == name


def test_table_semantics():
    fp32, strict, tf32 = get_policy("fp32"), get_policy("fp32-strict"), get_policy("tf32")
    assert isinstance(fp32, FP32Policy) and fp32.tf32 is None
    assert isinstance(strict, FP32Policy) and strict.tf32 is False
    assert isinstance(tf32, FP32Policy) and tf32.tf32 is True
    assert get_policy("bf16").compute_dtype == torch.bfloat16 and get_policy("bf16").tf32
    assert get_policy("fp16").compute_dtype == torch.float16 and get_policy("fp16").tf32
    assert get_policy("fp16").make_scaler("cpu").get_scale() == 2.0**16
    assert get_policy("bf16").make_scaler("cpu") is None and get_policy("fp32").make_scaler("cpu") is None
    pure = get_policy("bf16-pure")
    assert type(pure) is BF16PurePolicy and pure.compute_dtype == torch.bfloat16 and pure.make_scaler("cpu") is None
    assert pure != get_policy("bf16")  # another precision, not a setting of bf16's


def test_instance_passes_through():
    policy = FP16Policy(init_scale=8.0)
    assert get_policy(policy) is policy


@pytest.mark.parametrize("bad", ["fp4", "bf16-true", "int8", "", 64, True, None, 3.5, torch.float64])
def test_unknown_precision_names_value_and_options(bad):
    with pytest.raises(ValueError) as info:
        get_policy(bad)
    message = str(info.value)
    assert repr(bad) in message
    for valid in ("fp32", "tf32", "bf16", "fp16", "fp8", "auto"):
        assert valid in message


def test_a_policy_class_is_refused_naming_the_instance_to_pass():
    with pytest.raises(ValueError, match=r"BF16Policy.*pass an instance"):
        get_policy(BF16Policy)


def test_auto_on_cpu_is_visible(caplog):
    with caplog.at_level(logging.INFO, logger="precisionloop"):
        policy = get_policy("auto", "cpu")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN's check
    assert policy.name == ("bf16" if native else "fp32-strict")
    assert policy.compute_dtype == (torch.bfloat16 if native else torch.float32)
    assert any("auto" in r.getMessage() and policy.name in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("capability, name", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"), ((6, 1), "fp16")])
def test_auto_on_cuda_follows_native_bf16(monkeypatch, capability, name):
    for attribute, value in (("is_available", lambda: True), ("device_count", lambda: 1), ("current_device", lambda: 0),
                             ("get_device_capability", lambda device=None: capability),
                             ("get_device_name", lambda device=None: "Fake GPU")):
        monkeypatch.setattr(torch.cuda, attribute, value)
    monkeypatch.setattr(torch.version, "hip", None)
    policy = get_policy("auto", "cuda")
    assert policy.name == name
    assert "Fake GPU" in policy.note


def test_fp16_on_cpu_warns_at_construction_pointing_at_the_callers_line():
    model = tiny_mlp()
    with pytest.warns(UserWarning, match="slow") as record:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", device="cpu")
    assert record[0].filename == __file__


@pytest.mark.parametrize("policy", [FP32Policy(tf32=False), FP32Policy(tf32=True), BF16Policy(),
                                    FP16Policy(cudnn_benchmark=False)])
def test_backend_flags_set_and_restored(policy):
    outside = (tf32_flags(not policy.tf32), not policy.tf32)
    write_flags(*outside)
    try:
        with policy.backend_flags():
            inside = read_flags()
        assert inside[0] == tf32_flags(policy.tf32)
        expected_benchmark = policy.tf32 if policy.cudnn_benchmark is None else policy.cudnn_benchmark
        assert inside[1] is expected_benchmark
        assert read_flags() == outside
        with pytest.raises(KeyError), policy.backend_flags():
            raise KeyError("boom")
        assert read_flags() == outside
    finally:
        write_flags(tf32_flags(True), False)


@pytest.mark.parametrize("script_tf32, script_benchmark", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("precision", ["fp32", "fp32-strict", "bf16"])
def test_fp32_trains_with_the_flags_the_script_set_and_the_others_set_their_own(precision, script_tf32,
                                                                               script_benchmark):
    """On CUDA, inside a step "fp32" sees TF32 and cudnn.benchmark as the script left them; "fp32-strict" strict IEEE
    without benchmark; "bf16" TF32 and benchmark on. On the CPU, whose math they do not change, each leaves them.
    After the step, the script's flags again."""
    model = Probe()
    cuda = torch.cuda.is_available()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cuda" if cuda else "cpu")
    outside = (tf32_flags(script_tf32), script_benchmark)
    write_flags(*outside)
    try:
        trainer.step(batches(1)[0])
        want = {"fp32": outside, "fp32-strict": (tf32_flags(False), False), "bf16": (tf32_flags(True), True)}
        assert (model.seen[-1]["tf32"], model.seen[-1]["benchmark"]) == (want[precision] if cuda else outside)
        assert read_flags() == outside
    finally:
        write_flags(tf32_flags(True), False)


class Probe(nn.Module):
    """Records the autocast state and flags seen inside forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.seen = []

    def forward(self, x):
        out = self.linear(x)
        self.seen.append(dict(
            autocast=torch.is_autocast_enabled("cpu"),
            out_dtype=out.dtype,
            benchmark=torch.backends.cudnn.benchmark,
            tf32=read_flags()[0],
        ))
        return out


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype_inside_forward_and_fp32_after(precision, dtype):
    model = Probe()
    with pytest.warns(UserWarning) if precision == "fp16" else contextlib.nullcontext():
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=2)
    before = read_flags()
    trainer.step(batches(1)[0])
    seen = model.seen[-1]
    assert seen["out_dtype"] == dtype
    assert seen["autocast"] is (dtype != torch.float32)
    assert read_flags() == before, "flags leaked out of the step"
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_fp32_policy_disables_an_outer_autocast():
    model = Probe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.step(batches(1)[0])
    assert model.seen[-1]["out_dtype"] == torch.float32


class LayoutProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_cnn()
        self.input_channels_last = None

    def forward(self, x):
        self.input_channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return self.net(x)


@pytest.mark.parametrize("channels_last", [None, True, False])
def test_channels_last_layout_for_conv_models(channels_last):
    model = LayoutProbe()
    policy = BF16Policy(channels_last=channels_last)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    trainer.step((torch.randn(2, 3, 8, 8), torch.tensor([0, 1])))
    conv_weight = model.net[0].weight
    want = channels_last is True  # None means CUDA only
    assert model.input_channels_last is want
    assert (conv_weight.is_contiguous(memory_format=torch.channels_last) and not conv_weight.is_contiguous()) is want


def test_public_api_is_explicit():
    for name in precisionloop.__all__:
        assert hasattr(precisionloop, name)
    assert issubclass(FP16Policy, PrecisionPolicy) and issubclass(BF16Policy, PrecisionPolicy)


def test_backend_flags_under_torchs_frozen_flags_raise_and_leave_every_flag_as_it_was():
    # torch refuses cudnn.benchmark writes after disable_global_flags(); the TF32 switch written before it is undone.
    policy = BF16Policy()
    outside = (tf32_flags(False), False)
    write_flags(*outside)
    torch.backends.disable_global_flags()
    try:
        with pytest.raises(RuntimeError, match="not allowed"), policy.backend_flags():
            pass
        assert read_flags() == outside
    finally:
        # torch has no public undo; the flag lives in the globals of the function that reads it
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        write_flags(tf32_flags(True), False)
    assert not torch.backends.flags_frozen()


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_trainer_autocast_runs_a_users_eval_loop_as_the_step_runs_its_forward(precision, dtype):
    model = Probe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")
    trainer.step(batches(1)[0])
    in_step = model.seen[-1]
    before = read_flags()
    model.eval()
    with torch.no_grad(), trainer.autocast():
        for x, _ in batches(2):
            model(x)
    assert model.seen[-1] == in_step and model.seen[-1]["out_dtype"] == dtype
    assert read_flags() == before and not torch.is_autocast_enabled("cpu")  # both restored after the block
    with pytest.raises(KeyError), trainer.autocast():
        raise KeyError("boom")
    assert read_flags() == before and not torch.is_autocast_enabled("cpu")


def test_a_resume_under_the_same_policy_does_not_warn(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=8.0), device="cpu")
    trainer.step(batches(1)[0])
    path = trainer.save(tmp_path / "c.pt")
    model = tiny_mlp()
    same = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=8), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 8 == 8.0: the same policy
        same.load(path)


class CountingPolicy(FP16Policy):
    """A custom-hardware style policy: its own name, scaler and autocast."""

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
    model = Probe()
    policy = CountingPolicy()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    assert trainer.policy is policy and model.prepared_by == "counting-fp16"
    results = [trainer.step(b) for b in batches(2)]
    assert policy.calls == 2  # asked for anew each step
    assert [seen["out_dtype"] for seen in model.seen] == [torch.bfloat16, torch.bfloat16]
    assert [r.scale for r in results] == [8.0, 16.0]


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


class CudaProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_cnn()
        self.seen = []

    def forward(self, x):
        out = self.net[0](x)
        self.seen.append(dict(dtype=out.dtype, input_channels_last=x.is_contiguous(memory_format=torch.channels_last)
                              and not x.is_contiguous(), tf32=read_flags()[0], benchmark=torch.backends.cudnn.benchmark))
        return self.net[1:](out)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, dtype", [("tf32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cuda_autocast_flags_and_channels_last(precision, dtype):
    model = CudaProbe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cuda")
    before = read_flags()
    x = torch.randn(4, 3, 16, 16)
    assert trainer.step((x, torch.tensor([0, 1, 2, 3]))).stepped
    seen = model.seen[-1]
    assert seen["dtype"] == dtype and seen["input_channels_last"]
    assert seen["tf32"] == tf32_flags(True) and seen["benchmark"] is True
    assert read_flags() == before
    assert model.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())


@pytest.mark.gpu
def test_auto_picks_bf16_on_a_native_bf16_gpu():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("this GPU has no native bf16")
    policy = get_policy("auto", "cuda")
    assert isinstance(policy, BF16Policy) and "compute capability" in policy.note


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # on CUDA, BF16AdamW's update is compiled


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_adamw_keeps_on_average_the_updates_that_rounding_to_nearest_loses(device):
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16, device=device))
    w.grad = torch.ones_like(w)
    BF16AdamW([w], lr=1e-4, weight_decay=0.0).step()  # Adam's first step moves each weight by lr
    one = torch.ones_like(w)
    assert torch.equal(one - 1e-4, one)  # rounded to nearest, 1 - 1e-4 is 1 in bf16
    assert 0 < (w < 1).float().mean() < 0.05  # 1e-4 is 2.6% of bf16's spacing below 1 (2**-8)
    assert w.float().mean().item() == pytest.approx(1 - 1e-4, abs=3e-5)  # the mean's error is about 6e-6


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_adamw_on_fp32_weights_is_torchs_adamw_under_a_grad_scaler_too(device):
    torch.manual_seed(0)
    ours, theirs = nn.Linear(8, 4).to(device), nn.Linear(8, 4).to(device)
    theirs.load_state_dict(ours.state_dict())
    optimizers = BF16AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1), \
        torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    scalers = [torch.amp.GradScaler(device, init_scale=1024.0) for _ in optimizers]
    for i in range(6):
        x = torch.randn(16, 8, device=device) * (float("inf") if i == 3 else 1)  # step 3 is skipped
        for model, optimizer, scaler in zip((ours, theirs), optimizers, scalers):
            optimizer.zero_grad()
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # ours gets the scale to divide by and the inf flag; torch's unscaled gradients
            scaler.update()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert [s["step"].item() for s in optimizers[0].state.values()] == [5.0, 5.0]
    before = [p.detach().clone() for p in ours.parameters()]
    optimizers[0].found_inf, optimizers[0].grad_scale = torch.tensor(2.0, device=device), None  # two devices' flags
    optimizers[0].step()
    assert all(torch.equal(p, b) for p, b in zip(ours.parameters(), before))
    assert [s["step"].item() for s in optimizers[0].state.values()] == [5.0, 5.0]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_adamw_follows_a_scheduler_that_moves_lr_and_momentum_under_a_bf16_default_dtype(device):
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 1).to(device), nn.Linear(4, 1).to(device)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(8, 4, device=device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a float32 step counter stays exact past bf16's 256
    try:
        optimizers = BF16AdamW(ours.parameters(), lr=1e-3, weight_decay=0.0), \
            torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.0)
        schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=600) for o in optimizers]
        for _ in range(400):  # OneCycleLR moves the betas too, every step
            for model, optimizer, scheduler in zip((ours, theirs), optimizers, schedulers):
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
                scheduler.step()
    finally:
        torch.set_default_dtype(default)
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("bad", [dict(lr=-1e-3), dict(betas=(1.0, 0.999)), dict(betas=(0.9, 1.0)), dict(eps=-1e-8),
                                 dict(weight_decay=-0.1)])
def test_bf16_adamw_refuses_the_arguments_torchs_adamw_refuses_in_its_words(bad):
    w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW([w], **bad)
    with pytest.raises(ValueError) as ours:
        BF16AdamW([w], **bad)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name, value", [("amsgrad", True), ("maximize", True), ("foreach", False)])
def test_bf16_adamw_refuses_a_torch_adamw_option_it_lacks_in_a_param_group(name, value):
    w, v = nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"no {name}={value}.*torch.optim.AdamW"):
        BF16AdamW([{"params": [w], name: value}])
    optimizer = BF16AdamW([w])
    with pytest.raises(ValueError, match=f"no {name}={value}"):
        optimizer.add_param_group({"params": [v], name: value})
    assert [g["params"] for g in optimizer.param_groups] == [[w]]


def test_bf16_adamw_loads_torchs_adamw_state_at_its_defaults_and_refuses_amsgrad_leaving_itself_unchanged():
    w = nn.Parameter(torch.ones(3))  # fp32, as keep_fp32 keeps a module's weights
    w.grad = torch.ones_like(w)
    theirs, amsgrad = torch.optim.AdamW([w], lr=1e-2), torch.optim.AdamW([w], amsgrad=True)
    theirs.step()
    amsgrad.step()
    ours = BF16AdamW([w])
    ours.load_state_dict(theirs.state_dict())
    with pytest.raises(ValueError, match="no amsgrad=True"):
        ours.load_state_dict(amsgrad.state_dict())
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["amsgrad"] is False
    assert ours.state[w]["step"].item() == 1 and "max_exp_avg_sq" not in ours.state[w]


def test_bf16_adamw_refuses_a_sparse_gradient_before_it_changes_any_state():
    dense, embedding = nn.Linear(2, 1).to(torch.bfloat16), nn.Embedding(4, 2, sparse=True).to(torch.bfloat16)
    optimizer = BF16AdamW([{"params": dense.parameters()}, {"params": embedding.parameters()}])  # dense first
    dense(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    embedding(torch.tensor([1])).sum().backward()
    before = [p.detach().clone() for p in (*dense.parameters(), *embedding.parameters())]
    with pytest.raises(ValueError, match="sparse gradient"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip((*dense.parameters(), *embedding.parameters()), before))
    assert [s["step"].item() for s in optimizer.state.values()] == [1.0, 1.0]


def test_bf16_adamw_refuses_fp16_weights_pointing_at_bf16_ones_or_torchs_adamw():
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16 weights.*use bf16 weights or torch.optim.AdamW"):
        BF16AdamW([half])
    optimizer = BF16AdamW([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="fp16 weights"):
        optimizer.add_param_group({"params": [half]})
    assert len(optimizer.param_groups) == 1


@pytest.mark.gpu
def test_pure_bf16_steps_on_cuda_without_a_host_sync_before_and_after_a_resume(tmp_path):
    _, trainer = pure_bf16(device="cuda")
    trainer.step(B)  # the first step compiles the update
    assert all(r.stepped for r in steps_without_host_sync(trainer, [trainer.to_device(B)] * 3))
    trainer.save(tmp_path / "pure.pt")
    _, resumed = pure_bf16(device="cuda")
    resumed.load(tmp_path / "pure.pt")
    resumed.step(B)
    assert all(r.stepped for r in steps_without_host_sync(resumed, [resumed.to_device(B)] * 3))


def test_pure_bf16_trains_bf16_weights_and_gradients():
    model, trainer = pure_bf16()
    before = [p.detach().clone() for p in model.parameters()]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # cast in place at construction
    grads = []
    for p in model.parameters():
        p.register_hook(lambda grad: grads.append(grad.dtype))
    assert trainer.step(B).stepped
    assert grads == [torch.bfloat16] * len(before)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.bfloat16}
    assert trainer.policy.name == "bf16-pure" and trainer.stats.steps == 1


