"""Precision policies: the name table and get_policy, autocast dtypes inside the step, backend flags set and
restored, custom policies, and what a checkpoint records of the policy and how a load uses it."""

import contextlib
import dataclasses
import enum
import logging
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from conftest import B, batches, count_flag_writes, pure_bf16, read_flags, tf32_flags, tiny_cnn, tiny_mlp, write_flags

import precisionloop
from precisionloop import BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy, Trainer, _compat, checkpoint, devices, get_policy, policy as policy_mod, precisions

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


@pytest.mark.parametrize(
    "spec, name",
    [
        ("fp32", "fp32"), ("FP32", "fp32"), ("float32", "fp32"), ("32", "fp32"), (32, "fp32"), (" 32-true ", "fp32"),
        (torch.float32, "fp32"),
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
    strict, tf32 = get_policy("fp32"), get_policy("tf32")
    assert isinstance(strict, FP32Policy) and not strict.tf32
    assert isinstance(tf32, FP32Policy) and tf32.tf32
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
    with pytest.raises(ValueError, match=r"precision is the class BF16Policy; pass an instance, such as BF16Policy\(\)"):
        get_policy(BF16Policy)


def test_policies_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BF16Policy().tf32 = False


@pytest.mark.parametrize(
    "kwargs", [dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(backoff_factor=0.0),
               dict(growth_interval=0), dict(growth_interval=2.5),
               # what fp32 and int32 cannot hold (the scaler's dtypes), and what is not a number at all
               dict(init_scale=1e-50), dict(init_scale=1e300), dict(backoff_factor=1e-50), dict(growth_factor=1e39),
               dict(growth_interval=2**31), dict(init_scale=None), dict(init_scale="65536"), dict(init_scale=True),
               dict(init_scale=torch.tensor(4.0)), dict(growth_factor=float("nan"))]
)
def test_fp16_policy_rejects_bad_scaler_args(kwargs):
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{key} must be"):
        FP16Policy(**kwargs)


def test_a_scale_that_rounds_to_zero_in_fp32_never_reaches_a_step():
    """init_scale=1e-50 was accepted; in fp32 it is 0, the unscale multiplies by inf and torch's check, which reads
    the gradients before the multiply, let the NaN it made into the weights without a skip."""
    with pytest.raises(ValueError, match="init_scale"):
        FP16Policy(init_scale=1e-50)
    grads, found = [torch.zeros(3)], torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor(float("inf")))
    assert grads[0].isnan().all() and found.item() == 0  # torch's behaviour the range check guards against
    assert FP16Policy(init_scale=torch.finfo(torch.float32).tiny).init_scale > 0  # the range's ends are accepted
    assert FP16Policy(init_scale=torch.finfo(torch.float32).max, growth_interval=2**31 - 1).growth_interval == 2**31 - 1


def test_auto_on_cpu_is_visible(caplog):
    with caplog.at_level(logging.INFO, logger="precisionloop"):
        policy = get_policy("auto", "cpu")
    expected = "bf16" if _compat.cpu_bf16_native() else "tf32"
    assert policy.name == expected
    assert "auto" in repr(policy)
    assert any("auto" in r.getMessage() and expected in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("capability, name", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"), ((6, 1), "fp16")])
def test_auto_on_cuda_follows_native_bf16(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    policy = precisions._auto_policy(torch.device("cuda", 0))
    assert policy.name == name
    assert "Fake GPU" in policy.note


def test_bf16_on_old_cuda_gpu_suggests_fp16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match="fp16") as info:
        devices.check_device_support("bf16", torch.bfloat16, torch.device("cuda", 0))
    assert "7.0" in str(info.value) and "V100" in str(info.value)
    devices.check_device_support("fp16", torch.float16, torch.device("cuda", 0))  # fp16 is fine there


def test_fp16_on_cpu_warns_at_construction_pointing_at_the_callers_line():
    model = tiny_mlp()
    with pytest.warns(UserWarning, match="slow") as record:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", device="cpu")
    assert record[0].filename == __file__


def _flags():
    return read_flags()


@pytest.mark.parametrize("policy", [FP32Policy(), FP32Policy(tf32=True), BF16Policy(), FP16Policy(cudnn_benchmark=False)])
def test_backend_flags_set_and_restored(policy):
    outside = (tf32_flags(not policy.tf32), not policy.tf32)
    write_flags(*outside)
    try:
        with policy.backend_flags():
            inside = _flags()
        assert inside[0] == tf32_flags(policy.tf32)
        expected_benchmark = policy.tf32 if policy.cudnn_benchmark is None else policy.cudnn_benchmark
        assert inside[1] is expected_benchmark
        assert _flags() == outside
        with pytest.raises(KeyError), policy.backend_flags():
            raise KeyError("boom")
        assert _flags() == outside
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


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("tf32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype_inside_forward_and_fp32_after(precision, dtype):
    model = Probe()
    with pytest.warns(UserWarning) if precision == "fp16" else contextlib.nullcontext():
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=2)
    before = _flags()
    trainer.step(batches(1)[0])
    seen = model.seen[-1]
    assert seen["out_dtype"] == dtype
    assert seen["autocast"] is (dtype != torch.float32)
    assert seen["tf32"] == tf32_flags(trainer.policy.tf32)
    assert _flags() == before, "flags leaked out of the step"
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


def test_backend_flags_undo_a_write_refused_midway(monkeypatch):
    policy = BF16Policy()
    outside = (tf32_flags(False), False)
    write_flags(*outside)

    class Refusing:  # cuDNN's benchmark refused, after the TF32 flags were written (as under disable_global_flags)
        benchmark = False

        def __setattr__(self, name, value):
            raise RuntimeError("not allowed to set torch.backends.cudnn flags")

    try:
        monkeypatch.setattr(policy_mod, "_FLAGS", (*policy_mod._FLAGS[:-1], (Refusing(), "benchmark")))
        with pytest.raises(RuntimeError, match="not allowed"), policy.backend_flags():
            pass
        assert _flags()[0] == outside[0]  # the TF32 half was undone
    finally:
        monkeypatch.undo()
        write_flags(tf32_flags(True), False)


def test_backend_flags_under_torchs_frozen_flags_raise_and_leave_every_flag_as_it_was():
    # torch refuses cudnn.benchmark writes after disable_global_flags(); the TF32 switch written before it is undone.
    policy = BF16Policy()
    outside = (tf32_flags(False), False)
    write_flags(*outside)
    torch.backends.disable_global_flags()
    try:
        with pytest.raises(RuntimeError, match="not allowed"), policy.backend_flags():
            pass
        assert _flags() == outside
    finally:
        # torch has no public undo; the flag lives in the globals of the function that reads it
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        write_flags(tf32_flags(True), False)
    assert not torch.backends.flags_frozen()


def test_backend_flags_write_only_what_differs_and_restore_what_the_block_changed(monkeypatch):
    policy = BF16Policy()  # TF32 and cudnn.benchmark on
    outside = (tf32_flags(True), False)  # only cudnn.benchmark differs from the policy's
    write_flags(*outside)
    written = count_flag_writes(monkeypatch)
    last = len(policy_mod._FLAGS) - 1
    try:
        with policy.backend_flags():
            assert [i for i, _ in written] == [last] and _flags() == (tf32_flags(True), True)
            torch.backends.cudnn.benchmark = False
            write_flags(tf32_flags(False), False)  # the block changes flags the context did not write
        assert _flags() == outside  # restored too
        written.clear()
        with policy.backend_flags():
            pass
        assert [i for i, _ in written] == [last] * 2  # set and restored: one flag each way
    finally:
        monkeypatch.undo()
        write_flags(tf32_flags(True), False)


def test_the_compiled_backward_setting_refuses_to_be_entered_twice_while_open():
    from precisionloop import _compat

    eager = _compat.compiled_backward_like_eager()
    with eager:
        with pytest.raises(RuntimeError, match="already entered"):
            eager.__enter__()
    with eager:
        pass


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_trainer_autocast_runs_a_users_eval_loop_as_the_step_runs_its_forward(precision, dtype):
    model = Probe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")
    trainer.step(batches(1)[0])
    in_step = model.seen[-1]
    before = _flags()
    model.eval()
    with torch.no_grad(), trainer.autocast():
        for x, _ in batches(2):
            model(x)
    assert model.seen[-1] == in_step and model.seen[-1]["out_dtype"] == dtype
    assert _flags() == before and not torch.is_autocast_enabled("cpu")  # both restored after the block
    with pytest.raises(KeyError), trainer.autocast():
        raise KeyError("boom")
    assert _flags() == before and not torch.is_autocast_enabled("cpu")


def _save(tmp_path, policy, model=None, name="c.pt", **kwargs):
    model = model or tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", **kwargs)
    trainer.step(batches(1)[0])
    return trainer.save(tmp_path / name)


def _waiting(model=None):
    model = model or tiny_mlp()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto", device="cpu", autotune=True)


def _load_quietly(trainer, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.load(path)
    return [str(w.message) for w in caught if "saved under" in str(w.message)]


class Mode(str, enum.Enum):
    FAST = "fast"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModePolicy(BF16Policy):
    mode: Mode = Mode.FAST


class LoudBF16(BF16Policy):
    """Same name and settings as bf16, other behaviour: a record of name and settings alone would not tell."""


class Outer:
    class Norm(nn.LayerNorm):
        pass


def test_settings_of_numpy_or_enum_types_still_save_and_load(tmp_path):
    for policy in (FP16Policy(init_scale=np.float64(1024.0)), ModePolicy()):
        path = _save(tmp_path, policy)
        state = torch.load(path, weights_only=True)  # what Trainer.load reads
        model = tiny_mlp()
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu").load(path)
    assert state["unrecorded"] == ["mode"] and "mode" not in state["options"]
    with pytest.raises(ValueError, match=r"cannot rebuild.*\['mode'\].*pass the policy"):
        _waiting().load(path)
    assert type(torch.load(_save(tmp_path, FP16Policy(init_scale=np.float64(8.0))), weights_only=True)
                ["options"]["init_scale"]) is float


def test_a_plain_resume_does_not_warn(tmp_path):
    path = _save(tmp_path, FP16Policy(init_scale=8.0, growth_interval=100))
    model = tiny_mlp()
    same = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=8, growth_interval=100),
                   device="cpu")
    assert _load_quietly(same, path) == []  # 8 == 8.0
    # A checkpoint from before settings were recorded: compared by precision and keep_fp32 only.
    state = torch.load(path, weights_only=True)
    for key in ("options", "policy_class", "unrecorded", "keep_fp32_classes"):
        del state[key]
    torch.save(state, tmp_path / "old.pt")
    assert _load_quietly(same, tmp_path / "old.pt") == []
    model = tiny_mlp()
    other = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=16.0), device="cpu")
    assert any("init_scale=8.0" in m and "init_scale=16.0" in m for m in _load_quietly(other, path))


def test_a_policy_class_of_ones_own_is_recorded(tmp_path):
    path = _save(tmp_path, LoudBF16())
    model = tiny_mlp()
    plain = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(), device="cpu")
    assert any("LoudBF16" in m for m in _load_quietly(plain, path))
    waiting = _waiting()
    with pytest.raises(ValueError, match=r"LoudBF16.*cannot rebuild.*pass the policy"):
        waiting.load(path)
    assert waiting._autotune_compile is not None and waiting.global_step == 0  # nothing changed


def test_keep_fp32_classes_nested_or_local_resume_or_fail_clearly(tmp_path):
    def model_with(norm):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), norm(32), nn.Linear(32, 4))

    path = _save(tmp_path, BF16Policy(keep_fp32=(Outer.Norm,)), model_with(Outer.Norm))
    waiting = _waiting(model_with(Outer.Norm))
    waiting.load(path)
    assert waiting.policy == BF16Policy(keep_fp32=(Outer.Norm,))

    class Local(nn.LayerNorm):
        pass

    path = _save(tmp_path, BF16Policy(keep_fp32=(Local,)), model_with(Local), name="local.pt")
    with pytest.raises(ValueError, match=r"keep_fp32 class .*<locals>\.Local of the checkpoint's policy is not among the imported"):
        _waiting(model_with(Local)).load(path)


def test_a_trainer_waiting_to_autotune_resumes_compiled_if_the_saved_run_was(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu", compile=True)
    path = trainer.save(tmp_path / "c.pt")  # before any step: nothing compiles
    waiting = _waiting()
    waiting.load(path)
    assert waiting.compile_mode == "default" and waiting.policy == BF16Policy()
    assert checkpoint.policy_record(BF16Policy())["policy_class"].endswith("BF16Policy")


def test_a_policy_that_fails_to_prepare_on_resume_leaves_the_waiting_trainer_as_it_was(tmp_path, monkeypatch):
    path = _save(tmp_path, BF16Policy())
    waiting = _waiting()
    before = (waiting.policy, waiting.model, waiting.compile_mode)

    def refuse(self, model):
        raise ValueError("this device cannot run bf16")

    monkeypatch.setattr(BF16Policy, "prepare_model", refuse)
    with pytest.raises(ValueError, match="cannot run bf16"):
        waiting.load(path)
    assert (waiting.policy, waiting.model, waiting.compile_mode) == before and waiting._autotune_compile is not None


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


def test_pure_bf16_trains_bf16_weights_and_gradients():
    model, trainer = pure_bf16()
    before = [p.detach().clone() for p in model.parameters()]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # cast in place at construction
    grads = []
    trainer.engine.probe = lambda step: grads.extend(p.grad.dtype for p in model.parameters())
    assert trainer.step(B).stepped
    assert grads == [torch.bfloat16] * len(before)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.bfloat16}
    assert trainer.policy.name == "bf16-pure" and trainer.stats.steps == 1


def test_pure_bf16_rounds_updates_too_small_for_bf16_into_the_weights_on_average():
    # An update of 1/16 of a bf16 step at 1.0 is lost by round-to-nearest; stochastic rounding keeps it on average.
    optim = pytest.importorskip("torchao.optim")
    weight = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = optim._AdamW([weight], lr=2.0**-7 / 16, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, bf16_stochastic_round=True)
    for _ in range(8):
        weight.grad = torch.ones_like(weight)  # Adam's step is lr * sign(grad) with these betas
        opt.step()
    assert abs(weight.float().mean().item() - (1 - 8 * 2.0**-7 / 16)) < 2.0**-9
