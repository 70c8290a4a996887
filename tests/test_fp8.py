"""FP8Policy on the CPU through torchao's emulation (real fp8 matmuls need CUDA compute capability 8.9+)."""

import builtins
import warnings

import pytest
import torch
from torch import nn

from precisionloop import BF16Policy, FP8Policy, Trainer, get_policy
from precisionloop.fp8 import converted_layers, default_layers
from precisionloop.keep_fp32 import is_kept

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'precisionloop[fp8]')")
EMULATED = FP8Policy(emulate=True)


def mlp(seed=0):
    torch.manual_seed(seed)  # 0 and 8 are the first and last Linear; 6 (32 -> 30) is not aligned
    return nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 30), nn.ReLU(), nn.Linear(30, 4))


def data(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def trainer(policy, model=None, optimizer=torch.optim.SGD, **kwargs):
    model = mlp() if model is None else model
    return Trainer(model, optimizer(model.parameters(), lr=0.01), policy, device="cpu", **kwargs)


def untouched(model):
    return not converted_layers(model) and all(type(m) in (nn.Linear, nn.ReLU, nn.Sequential) for m in model.modules())


def test_the_policy_is_a_value_in_the_one_table():
    assert all(isinstance(get_policy(spec), FP8Policy) for spec in ("fp8", "FP8", "float8"))
    policy = FP8Policy(recipe="rowwise", layers=["4", "2", "4"])
    assert policy.layers == ("2", "4") and policy.compute_dtype == torch.bfloat16 and policy.make_scaler("cpu") is None
    assert policy == FP8Policy(recipe="rowwise", layers=("2", "4")) and hash(policy) == hash(FP8Policy(
        recipe="rowwise", layers=("2", "4"))) and "rowwise" in repr(policy) and isinstance(policy, BF16Policy)
    for bad, message in ((dict(recipe="fastest"), "recipe must be one of tensorwise"),
                         (dict(layers="2"), "layers must be a tuple of module names, got '2'"),
                         (dict(layers=5), "layers must be a tuple of module names, got 5"),
                         (dict(emulate="yes"), "emulate must be True or False")):
        with pytest.raises(ValueError, match=message):
            FP8Policy(**bad)


def test_the_default_layers_skip_the_first_the_last_and_unaligned_ones():
    model = mlp()
    assert default_layers(model) == ("2", "4") and converted_layers(model) == []
    converted = trainer(EMULATED, model).model
    kinds = {name: type(m).__name__ for name, m in converted.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {"0": "Linear", "2": "Float8Linear", "4": "Float8Linear", "6": "Linear", "8": "Linear"}
    assert converted_layers(converted) == ["2", "4"]
    ends = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # aligned, but the first and the last
    assert default_layers(ends) == ()
    assert converted_layers(trainer(FP8Policy(emulate=True, layers=("0", "2")), ends).model) == ["0", "2"]


def test_it_trains_and_keeps_linear_state_dict_keys():
    model = mlp()
    keys = list(model.state_dict())
    fp8 = trainer(EMULATED, model, torch.optim.AdamW)
    losses = [fp8.step(b).loss for b in data(6) for _ in range(2)]
    assert torch.isfinite(torch.tensor(losses)).all() and losses[-1] < losses[0]
    assert list(fp8.model.state_dict()) == keys


@pytest.mark.parametrize("saved, loaded", [("fp8", "bf16"), ("bf16", "fp8"), ("fp8", "fp32")])
def test_checkpoints_move_between_fp8_and_other_precisions(tmp_path, saved, loaded):
    policies = {"fp8": EMULATED, "bf16": BF16Policy(), "fp32": "fp32"}
    first = trainer(policies[saved], optimizer=torch.optim.AdamW)
    for b in data(2):
        first.step(b)
    first.save(tmp_path / "c.pt")
    resumed = trainer(policies[loaded], mlp(seed=5), torch.optim.AdamW)
    with pytest.warns(UserWarning, match="precision"):
        resumed.load(tmp_path / "c.pt")
    mine, theirs = first.model.state_dict(), resumed.model.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert resumed.global_step == 2 and resumed.step(data(3)[2]).stepped


def test_modules_kept_in_fp32_are_never_converted():
    model = trainer(FP8Policy(emulate=True, keep_fp32=("2",))).model
    assert converted_layers(model) == ["4"] and type(model[2]) is nn.Linear and is_kept(model[2])
    with pytest.raises(ValueError, match="layers 2 are also kept in fp32 by keep_fp32"):
        trainer(FP8Policy(emulate=True, layers=("2",), keep_fp32=("2",)))


class LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_named_layers_fp8_cannot_take_are_refused_before_anything_changes():
    from torch.nn.utils import parametrizations

    model = mlp()
    model[4] = LoRALinear(64, 32)
    model[2].register_forward_hook(lambda m, i, o: None)
    before = [p.detach().clone() for p in model.parameters()]
    for layers, why in ((("6",), "'6' cannot be converted to fp8 \\(in_features 32|out_features 30 is not a multiple"),
                        (("1", "2"), "'1' cannot be converted to fp8 \\(a ReLU, not a plain nn.Linear"),
                        (("9",), "'9' cannot be converted to fp8 \\(no such module"),
                        (("2",), "'2' cannot be converted.*forward hooks"),
                        (("4",), "'4' cannot be converted.*a LoRALinear, not a plain nn.Linear")):
        with pytest.raises(ValueError, match=why):
            trainer(FP8Policy(emulate=True, layers=layers), model)
    assert not converted_layers(model) and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert default_layers(model) == ()  # neither the hooked nor the subclass is taken by default
    normed = mlp()
    parametrizations.weight_norm(normed[2])
    assert default_layers(normed) == ("4",)
    with pytest.raises(ValueError, match="'2' cannot be converted.*ParametrizedLinear"):
        trainer(FP8Policy(emulate=True, layers=("2", "4")), normed)
    assert not converted_layers(normed)


def test_a_policy_that_would_convert_nothing_is_refused():
    ends_only = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 4))
    odd = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 30), nn.ReLU(), nn.Linear(30, 4))
    for model, policy in ((mlp(), FP8Policy(emulate=True, layers=())), (ends_only, EMULATED), (odd, EMULATED),
                          (mlp(), FP8Policy(emulate=True, keep_fp32=("*",)))):
        with pytest.raises(ValueError, match="would convert no layer.*precision='bf16'.*FP8Policy\\(layers=...\\)"):
            trainer(policy, model)
        assert not converted_layers(model)


def test_no_fp8_matmuls_here_is_refused_before_anything_changes(monkeypatch):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="compute capability 8.9 or higher.*not cpu.*FP8Policy\\(emulate=True\\)"):
        Trainer(model, optimizer, "fp8", device="cpu")
    assert optimizer.param_groups[0]["fused"] is None and untouched(model)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(ValueError, match="A100 has 8.0"):
        FP8Policy().check_model(model, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    FP8Policy().check_model(model, torch.device("cuda", 0))


def test_missing_torchao_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ValueError, match=r'torchao: pip install "precisionloop\[fp8\]"'):
        trainer(EMULATED)


def test_uncompiled_fp8_on_cuda_says_so():
    with pytest.warns(UserWarning, match="slower than bf16.*compile=True"):
        FP8Policy().check_compile(None, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FP8Policy().check_compile("reduce-overhead", "cuda")
        FP8Policy().check_compile(None, "cpu")


def test_a_model_converted_earlier_is_refused_by_every_policy():
    model = trainer(EMULATED).model
    # Another fp8 policy too, even one that looks the same: the first conversion's recipe would carry on unseen.
    for policy in ("bf16", EMULATED, FP8Policy(emulate=True, recipe="rowwise"), FP8Policy(emulate=True, layers=("2",))):
        with pytest.raises(ValueError, match="converted to fp8 by an earlier FP8Policy"):
            trainer(policy, model)
    fresh = mlp()
    fresh.load_state_dict(model.state_dict())  # what the message advises: the keys are the same
    assert converted_layers(trainer(FP8Policy(emulate=True, recipe="rowwise"), fresh).model) == ["2", "4"]


def test_a_model_wrapped_in_ddp_is_refused(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(mlp())
        with pytest.raises(ValueError, match="converts layers before wrapping.*distributed='ddp' or 'fsdp'"):
            trainer(EMULATED, wrapped)
        assert untouched(wrapped.module)
    finally:
        dist.destroy_process_group()
