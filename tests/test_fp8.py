"""FP8Policy through torchao, on the CPU with torchao's emulation (the real kernels need CUDA compute capability 8.9+)."""

import builtins
import re
import warnings

import pytest
import torch
from torch import nn

from precisionloop import BF16Policy, FP8Policy, Trainer, get_policy
from precisionloop import fp8 as fp8_module
from precisionloop.keep_fp32 import is_kept

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'precisionloop[fp8]')")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 30), nn.ReLU(), nn.Linear(30, 4))


def data(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def test_fp8_is_in_the_one_table():
    for spec in ("fp8", "FP8", "float8"):
        assert isinstance(get_policy(spec), FP8Policy)
    policy = FP8Policy(recipe="rowwise", layers=("4", "2"))
    assert policy.layers == ("2", "4") and policy.compute_dtype == torch.bfloat16 and policy.make_scaler("cpu") is None
    assert hash(policy) == hash(FP8Policy(recipe="rowwise", layers=("2", "4"))) and "rowwise" in repr(policy)
    with pytest.raises(ValueError, match="recipe.*tensorwise"):
        FP8Policy(recipe="fastest")
    with pytest.raises(ValueError, match="layers"):
        FP8Policy(layers="2")


def test_default_layers_skip_first_last_and_odd_shapes():
    converted = Trainer(model := mlp(), torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True), device="cpu")
    kinds = {name: type(m).__name__ for name, m in converted.model.named_modules() if isinstance(m, nn.Linear)}
    # first (0) and last (8) skipped; 6 is 32 -> 30, not a multiple of 16
    assert kinds == {"0": "Linear", "2": "Float8Linear", "4": "Float8Linear", "6": "Linear", "8": "Linear"}


def test_fp8_step_trains_and_keeps_linear_state_dict_keys():
    model = mlp()
    keys = list(model.state_dict())
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), FP8Policy(emulate=True), device="cpu")
    losses = [trainer.step(b).loss for b in data(6) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert list(trainer.model.state_dict()) == keys


@pytest.mark.parametrize("saved, loaded", [("fp8", "bf16"), ("bf16", "fp8"), ("fp8", "fp32")])
def test_checkpoints_move_between_fp8_and_other_precisions(tmp_path, saved, loaded):
    policies = {"fp8": FP8Policy(emulate=True), "bf16": BF16Policy(), "fp32": "fp32"}
    model = mlp()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policies[saved], device="cpu")
    for b in data(2):
        trainer.step(b)
    trainer.save(tmp_path / "c.pt")
    other = mlp(seed=5)
    resumed = Trainer(other, torch.optim.AdamW(other.parameters(), lr=1e-2), policies[loaded], device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load(tmp_path / "c.pt")
    assert any("precision" in str(w.message) for w in caught)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()))
    assert resumed.global_step == 2 and resumed.step(data(3)[2]).stepped


def test_kept_modules_are_not_converted():
    model = mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, keep_fp32=("2",)),
                      device="cpu")
    modules = dict(trainer.model.named_modules())
    assert type(modules["2"]) is nn.Linear and is_kept(modules["2"]) and isinstance(modules["4"], Float8Linear)


def test_named_layers_are_checked():
    model = mlp()
    with pytest.raises(ValueError, match=r"'6'.*in_features|out_features 30"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("6",)), device="cpu")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="'1'.*not an nn.Linear"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("1", "2")), device="cpu")
    assert all(type(m) is not Float8Linear for m in model.modules())  # refused before anything was converted
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_no_fp8_matmuls_on_the_cpu_without_emulation():
    model = mlp()
    with pytest.raises(ValueError, match="compute capability 8.9"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8", device="cpu")
    assert all(type(m) is not Float8Linear for m in model.modules())


def test_old_cuda_gpus_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(ValueError, match="A100 has 8.0"):
        fp8_module.check_device(torch.device("cuda", 0), emulate=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_module.check_device(torch.device("cuda", 0), emulate=False)


def test_missing_torchao_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    model = mlp()
    with pytest.raises(ValueError, match=r'torchao.*pip install "precisionloop\[fp8\]"'):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True), device="cpu")


def test_uncompiled_fp8_on_cuda_says_so():
    with pytest.warns(UserWarning, match="compile=True"):
        FP8Policy().check_compile(None, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FP8Policy().check_compile("reduce-overhead", "cuda")
        FP8Policy().check_compile(None, "cpu")
        BF16Policy().check_compile(None, "cuda")


def test_eligibility_reasons():
    eligible = fp8_module.eligible
    assert eligible("fc", nn.Linear(30, 32)) == "in_features 30 is not a multiple of 16"
    assert eligible("fc", nn.Linear(32, 30)) == "out_features 30 is not a multiple of 16"
    assert eligible("fc", nn.Linear(32, 64)) is None
    assert fp8_module.config("tensorwise", True).pad_inner_dim  # unaligned token counts are padded
    assert eligible("conv", nn.Conv1d(16, 16, 1)) == "conv is a Conv1d, not an nn.Linear"
    float8 = fp8_module.require_torchao()
    converted = float8.convert_to_float8_training(nn.Linear(32, 32), config=fp8_module.config("tensorwise", True))
    assert eligible("", converted) == "already fp8 (Float8Linear)"
    hooked = nn.Linear(32, 32)
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert "forward pre hooks" in eligible("fc", hooked)


def test_autotune_times_fp8_over_its_default_layers(capsys):
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    candidates = [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))]
    result = autotune(mlp(), lambda p: torch.optim.SGD(p, lr=0.01), data(1)[0], candidates, device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0)
    labels = [r.candidate.label for r in result.results]
    assert "fp8 emulate=True" in labels  # whole-model fp8 at FP8Policy()'s default layers
    assert "fp8 per layer" not in capsys.readouterr().out


def aligned_mlp(seed=0):
    torch.manual_seed(seed)  # every Linear aligned, the first and the last too
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def aligned_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 16, generator=g), torch.randint(0, 16, (16,), generator=g)


def test_autotune_also_times_every_eligible_layer_in_fp8(capsys):
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    assert fp8_module.eligible_layers(aligned_mlp()) == ("0", "2", "4") and fp8_module.default_layers(aligned_mlp()) == ("2",)
    result = autotune(aligned_mlp(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                      [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0, verbose=False)
    layer_sets = {r.candidate.policy(torch.device("cpu")).layers for r in result.results if r.candidate.precision == "fp8"}
    assert None in layer_sets and ("0", "2", "4") in layer_sets  # the default layers, and every eligible one
    assert len(layer_sets) == len([r for r in result.results if r.candidate.precision == "fp8"])  # no set twice
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    assert all(r.rejected is None and r.timing.rounds_ms for r in fp8_rows)


def test_autotune_offers_fp8_when_only_the_first_and_last_layers_can_take_it(capsys):
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    assert fp8_module.default_layers(model) == ()  # FP8Policy() would refuse this model
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                      [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0, verbose=False)
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    assert fp8_rows and all(r.rejected is None for r in fp8_rows)
    assert ("0", "2") in {r.candidate.policy(torch.device("cpu")).layers for r in fp8_rows}
    assert all(r.candidate.policy(torch.device("cpu")).layers is not None for r in fp8_rows)  # not the refused default


def test_autotune_leaves_layers_kept_in_fp32_out_of_every_fp8_set():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    candidate = Candidate("fp8", options=(("emulate", True), ("keep_fp32", ("0",))))
    result = autotune(aligned_mlp(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(), [Candidate("bf16"), candidate],
                      device="cpu", steps=2, warmup=1, rounds=2, tolerance=1.0, verbose=False)
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    assert ("2", "4") in {r.candidate.policy(torch.device("cpu")).layers for r in fp8_rows}
    assert all(r.rejected is None for r in fp8_rows)  # no set names a kept layer, which the policy would refuse


def test_autotune_leaves_layers_fp8_cannot_take_here_out_of_every_set():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = aligned_mlp()
            self.alias = self.net[2]  # the same Linear under a second name

        def forward(self, x):
            return self.net(x)

    candidate = Candidate("fp8", options=(("emulate", True), ("keep_fp32", ("net.0",))))
    result = autotune(Aliased(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(), [Candidate("bf16"), candidate],
                      device="cpu", steps=2, warmup=1, rounds=2, tolerance=1.0, verbose=False)
    # net.0 is kept in fp32 and net.2 registered under two names: the default set is empty, every set is net.4.
    assert [r.candidate.policy(torch.device("cpu")).layers for r in result.results if r.candidate.precision == "fp8"] == [
        ("net.4",)]
    assert all(r.rejected is None for r in result.results)


class _SometimesCalled(nn.Module):
    """An aux Linear that the sample batch calls with no rows (a branch taken by no example), registered mid-model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.aux, self.b, self.c = nn.Linear(16, 32), nn.Linear(16, 16), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        rare = x[:, 0] > 1e9
        return y.index_add(0, rare.nonzero().flatten(), self.aux(x[rare]))


def test_autotune_leaves_layers_called_with_no_tokens_out_of_every_fp8_set():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    result = autotune(_SometimesCalled(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                      [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0, verbose=False)
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    layer_sets = {r.candidate.policy(torch.device("cpu")).layers for r in fp8_rows}
    assert ("a", "b", "c") in layer_sets and ("b",) in layer_sets  # every layer; the default set (aux, b) less aux
    assert all(r.rejected is None for r in fp8_rows)  # torchao cannot scale an empty input: aux is left out


class _SometimesCalledByKeyword(_SometimesCalled):
    def forward(self, x):
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        rare = x[:, 0] > 1e9
        return y.index_add(0, rare.nonzero().flatten(), self.aux(input=x[rare]))


def test_autotune_finds_a_layer_called_by_keyword_with_no_tokens():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    result = autotune(_SometimesCalledByKeyword(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                      [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0, verbose=False)
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    assert {r.candidate.policy(torch.device("cpu")).layers for r in fp8_rows} == {("a", "b", "c"), ("b",)}
    assert all(r.rejected is None for r in fp8_rows)


def test_autotune_says_so_when_every_fp8_layer_is_called_with_no_tokens():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    class OnlyEmpty(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.aux, self.c = nn.Linear(16, 30), nn.Linear(16, 16), nn.Linear(30, 16)

        def forward(self, x):
            rare = x[:, 0] > 1e9
            return self.c(self.a(x)).index_add(0, rare.nonzero().flatten(), self.aux(x[rare]))

    with pytest.raises(RuntimeError, match="declined: every layer fp8 can take is called with no tokens"):
        autotune(OnlyEmpty(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                 [Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2, warmup=1, rounds=2, verbose=False)


def test_autotune_says_why_fp8_was_declined_when_nothing_is_left_to_try():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    only = Candidate("fp8", options=(("emulate", True), ("keep_fp32", (nn.Linear,))))
    with pytest.raises(RuntimeError, match=r"no candidate left to try: fp8 emulate=True keep_fp32=\(Linear,\) "
                                           r"declined: no nn.Linear layer fp8 can take"):
        autotune(aligned_mlp(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(), [only], device="cpu", steps=2,
                 warmup=1, rounds=2, verbose=False)


def test_an_explicit_layers_none_is_replaced_not_repeated():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    result = autotune(aligned_mlp(), lambda p: torch.optim.SGD(p, lr=0.01), aligned_batch(),
                      [Candidate("fp8", options=(("layers", None), ("emulate", True)))], device="cpu", steps=2, warmup=1,
                      rounds=2, tolerance=1.0, verbose=False)
    keys = [[k for k, _ in r.candidate.options] for r in result.results if r.candidate.precision == "fp8"]
    assert all(k.count("layers") == 1 for k in keys) and ["emulate", "layers"] in keys


def test_autotune_declines_fp8_without_convertible_layers(capsys):
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))  # one Linear
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.01), batch,
                      [Candidate("bf16"), Candidate("fp8", options=(("emulate", True),))], device="cpu", steps=2, warmup=1,
                      rounds=2)
    assert "declined: no nn.Linear layer fp8 can take" in capsys.readouterr().out
    assert all(r.candidate.precision != "fp8" for r in result.results)


def test_a_model_converted_earlier_is_refused_by_other_policies():
    model = mlp()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True), device="cpu")
    with pytest.raises(ValueError, match="converted to fp8 by an earlier FP8Policy"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    with pytest.raises(ValueError, match="converted to fp8"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("2",)), device="cpu")
    # Another fp8 policy too, even one that looks the same: the conversion's recipe and emulation would carry
    # on under it unseen (a later FP8Policy(recipe="rowwise") kept scaling tensorwise; keep_fp32 kept fp8).
    for policy in (FP8Policy(emulate=True), FP8Policy(emulate=True, recipe="rowwise"), FP8Policy(emulate=True, keep_fp32=("4",))):
        with pytest.raises(ValueError, match="converted to fp8 by an earlier FP8Policy"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    fresh = mlp()
    fresh.load_state_dict(model.state_dict())  # what the message advises: same keys
    Trainer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), FP8Policy(emulate=True, recipe="rowwise"), device="cpu")


def test_an_fp8_policy_that_would_convert_nothing_is_refused():
    ends_only = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 4))  # the default skips first and last
    odd = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 30), nn.ReLU(), nn.Linear(30, 4))
    cases = [(mlp(), FP8Policy(emulate=True, layers=()), "layers=\\(\\) names none"),
             (mlp(), FP8Policy(emulate=True, layers=(n for n in ())), "layers=\\(\\) names none"),
             (ends_only, FP8Policy(emulate=True), "first and the last"),
             (odd, FP8Policy(emulate=True), "first and the last"),
             (mlp(), FP8Policy(emulate=True, keep_fp32=("*",)), "keep_fp32 keeps every one")]
    for model, policy, why in cases:
        with pytest.raises(ValueError, match=f"would convert no layer.*{why}.*precision='bf16'"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
        assert not any(fp8_module.is_float8_linear(m) for m in model.modules())
    with pytest.raises(ValueError, match="layers must be a tuple of module names, got 5"):
        FP8Policy(layers=5)


class LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_linear_subclasses_and_hooked_linears_are_not_converted():
    from torch.nn.utils import parametrizations

    model = mlp()
    model[4] = LoRALinear(64, 32)
    model[2].register_forward_hook(lambda m, i, o: None)
    with pytest.raises(ValueError, match="'2' cannot be converted.*forward hooks"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("2",)), device="cpu")
    with pytest.raises(ValueError, match="'4' cannot be converted.*LoRALinear, a subclass of nn.Linear"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("4",)), device="cpu")
    assert fp8_module.default_layers(model) == ()  # neither is picked by default; nothing left to convert
    mha = nn.MultiheadAttention(32, 4)
    assert "subclass of nn.Linear" in fp8_module.eligible("out_proj", mha.out_proj)
    normed = mlp()
    parametrizations.weight_norm(normed[2])  # a default candidate otherwise: the swap failed half-way
    assert fp8_module.default_layers(normed) == ("4",)
    with pytest.raises(ValueError, match="'2' cannot be converted.*ParametrizedLinear, a subclass"):
        Trainer(normed, torch.optim.SGD(normed.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("2", "4")),
                device="cpu")
    assert not any(fp8_module.is_float8_linear(m) for m in normed.modules())


def test_a_layer_both_kept_and_converted_is_refused():
    model = mlp()
    with pytest.raises(ValueError, match="also kept in fp32"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("2",), keep_fp32=("2",)),
                device="cpu")


def test_device_is_checked_before_anything_changes():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="8.9"):
        FP8Policy().check_model(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="8.9"):
        Trainer(model, optimizer, "fp8", device="cpu")
    assert optimizer.param_groups[0]["fused"] is None and all(type(m) is not Float8Linear for m in model.modules())


def test_fp8_candidates_only_when_compiling(monkeypatch):
    from precisionloop import tuning

    monkeypatch.setattr(tuning, "_fp8_available", lambda device: True)
    assert all(c.precision != "fp8" for c in tuning.default_candidates(mlp(), "cpu", compile=False))
    assert [c for c in tuning.default_candidates(mlp(), "cpu", compile=True) if c.precision == "fp8"] == [
        tuning.Candidate("fp8", compile=True)]


def test_candidates_with_equal_labels_and_list_options():
    from precisionloop import autotune
    from precisionloop.tuning import Candidate

    a = Candidate("fp8", options=(("emulate", True), ("layers", ["2"])))
    b = Candidate("fp8", options=(("emulate", True), ("layers", ("4",))))
    assert a.options == (("emulate", True), ("layers", ("2",)))  # lists became tuples
    assert (a.label, b.label) == ("fp8 emulate=True layers=('2',)", "fp8 emulate=True layers=('4',)")  # by name
    assert Candidate("fp8", options=(("layers", ("0", "2")),)).label == "fp8 layers=('0','2')"
    # Longer tuples are labelled by their length, so two candidates can share a label; both are still timed.
    c = Candidate("bf16", options=(("keep_fp32", ("0", "2", "4", "6")),))
    d = Candidate("bf16", options=(("keep_fp32", ("0", "2", "4", "8")),))
    assert c.label == d.label == "bf16 keep_fp32=<4 names>" and hash(c) != hash(d)
    result = autotune(mlp(), lambda p: torch.optim.SGD(p, lr=0.01), data(1)[0], [a, b, c, d], device="cpu", steps=2,
                      warmup=1, rounds=2, tolerance=1.0, verbose=False)
    assert {r.candidate for r in result.results} == {a, b, c, d} and all(r.timing.rounds_ms for r in result.results)


def _saved(tmp_path, policy, name="c.pt"):
    model = mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    trainer.step(data(1)[0])
    return trainer.save(tmp_path / name)


def test_a_checkpoint_records_the_fp8_settings_and_a_load_says_when_they_differ(tmp_path):
    path = _saved(tmp_path, FP8Policy(emulate=True, layers=("2",)))
    state = torch.load(path, weights_only=True)
    assert state["options"]["layers"] == ["2"] and state["options"]["recipe"] == "tensorwise"
    for other, shown in ((FP8Policy(emulate=True, layers=("4",)), "layers=['4']"),
                         (FP8Policy(emulate=True, layers=("2",), recipe="rowwise"), "recipe='rowwise'")):
        model = mlp()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), other, device="cpu")
        with pytest.warns(UserWarning, match=rf"saved under precision 'fp8' \(.*layers=\['2'\].*loaded under 'fp8' \(.*{re.escape(shown)}"):
            trainer.load(path)
    model = mlp()
    same = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=("2",)), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load(path)  # the same settings: nothing to say


def test_a_trainer_waiting_to_autotune_resumes_under_the_saved_policy_whole(tmp_path):
    saved = FP8Policy(emulate=True, recipe="rowwise", layers=("2",), keep_fp32=(nn.ReLU, "6"))
    path = _saved(tmp_path, saved)
    model = mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto", device="cpu", autotune=True)
    trainer.load(path)
    assert trainer.policy == saved  # recipe, layers, emulate and keep_fp32 (a class and a pattern) alike
    assert fp8_module.converted_layers(trainer.model) == ["2"] and trainer.model[2].config.cast_config_weight.short_str() != "dyn_ten_e4m3"
    assert is_kept(trainer.model[6]) and is_kept(trainer.model[1])


def test_a_failed_load_leaves_a_trainer_waiting_to_autotune_untouched(tmp_path):
    path = _saved(tmp_path, FP8Policy(emulate=True, layers=("2",)))
    state = torch.load(path, weights_only=True)
    state["options"]["emulate"] = False  # saved on an fp8 GPU: the CPU cannot run it
    model = mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto", device="cpu", autotune=True)
    before = trainer.policy
    with pytest.raises(ValueError, match="compute capability 8.9"):
        trainer.load_state_dict(state)
    assert trainer.policy is before and trainer._autotune_compile is not None
    assert not fp8_module.converted_layers(model) and trainer.global_step == 0
    state["options"]["bogus"] = 1
    with pytest.raises(ValueError, match="records settings.*bogus.*FP8Policy does not take"):
        trainer.load_state_dict(state)


def test_a_module_registered_under_two_names_is_not_converted():
    model = mlp()
    model.alias = model[2]  # one module, two names: converted under one, the other would run it in bf16
    for name in ("alias", "2"):
        with pytest.raises(ValueError, match=rf"'{name}' cannot be converted.*also registered as"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True, layers=(name,)),
                    device="cpu")
    assert fp8_module.default_layers(model) == ("4",)  # 2 is left out by default
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP8Policy(emulate=True), device="cpu")
    assert trainer.model.alias is trainer.model[2] and type(trainer.model[2]) is nn.Linear
