"""precisionloop.fp8_tuning: shape capture, eligibility, the choice rule, one emulated timing. CPU only; no timing thresholds."""

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8", reason="fp8 tuning needs torchao (pip install 'precisionloop[fp8]')")

from precisionloop import fp8_tuning  # noqa: E402
from precisionloop.fp8_tuning import (  # noqa: E402
    Fp8Choice, LayerTiming, LinearShape, choose_fp8_layers, eligible, linear_shapes, time_linear,
)
from precisionloop.measure import Measurement  # noqa: E402

CPU = torch.device("cpu")
FAST = dict(iters=2, warmup=1, rounds=2)


def call(model, batch):
    return model(batch)


class Shared(nn.Module):
    """A layer called twice, a layer never called, a BatchNorm whose statistics the capture must not move."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 48, bias=False)

    def forward(self, x):  # x: (batch, seq, 32)
        x = self.shared(x)
        x = self.shared(input=torch.relu(x))  # by keyword: the hook must still see the input
        x = self.norm(x.float().transpose(1, 2)).transpose(1, 2)
        return self.head(x[:, :4])


def test_module_imports_torchao_only_lazily():
    tree = ast.parse(Path(fp8_tuning.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    froms = {(n.level, n.module) for n in top if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("torchao") for name in names | {m for _, m in froms if m})
    assert {f for f in froms if f[0] == 1} <= {(1, None), (1, "fp8")}  # measure and fp8 (which imports torchao lazily)


def test_linear_shapes_records_real_shapes_calls_and_dtype():
    model = Shared()
    norm_stats = model.norm.running_mean.clone()
    batch = torch.randn(2, 8, 32)
    rng = torch.get_rng_state()
    shapes = linear_shapes(model, batch, call)

    assert set(shapes) == {"shared", "head"}  # "unused" was never called
    assert shapes["shared"] == LinearShape((16, 16), 32, 32, torch.float32, True)  # 2 x 8 tokens, twice
    assert (shapes["shared"].tokens, shapes["shared"].calls) == (16, 2)
    assert shapes["head"].token_counts == (8,) and shapes["head"].out_features == 48 and not shapes["head"].bias
    assert str(shapes["shared"]) == "16 x 32 -> 32 (x2 calls)"
    assert torch.equal(model.norm.running_mean, norm_stats)  # buffers restored
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.shared._forward_hooks and not model.head._forward_hooks


def test_linear_shapes_runs_under_bf16_autocast_and_no_grad():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    seen = []
    shapes = linear_shapes(model, torch.randn(16, 32), lambda m, b: seen.append(torch.is_grad_enabled()) or m(b))
    assert seen == [False]
    assert shapes["0"].dtype == torch.float32 and shapes["2"].dtype == torch.bfloat16  # fed by a bf16 matmul


def test_linear_shapes_root_linear_is_named_empty_and_hooks_go_on_error():
    root = nn.Linear(32, 16)
    assert linear_shapes(root, torch.randn(4, 5, 32), call) == {"": LinearShape((20,), 32, 16, torch.float32, True)}

    def fails(model, batch):
        model(batch)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        linear_shapes(root, torch.randn(4, 32), fails)
    assert not root._forward_hooks


def test_eligibility_reasons():
    assert eligible("fc", nn.Linear(30, 32)) == "in_features 30 is not a multiple of 16"
    assert eligible("fc", nn.Linear(32, 30)) == "out_features 30 is not a multiple of 16"
    assert eligible("fc", nn.Linear(32, 64)) is None
    assert eligible("fc", nn.Linear(32, 64), 48) is None
    assert eligible("fc", nn.Linear(32, 64), (32, 24)) is None  # unaligned token counts are padded
    assert eligible("fc", nn.Linear(32, 64), (32, 0)) == "no tokens: called on an empty input"
    from precisionloop import fp8

    assert fp8.config("tensorwise", True).pad_inner_dim
    assert eligible("conv", nn.Conv1d(16, 16, 1)) == "conv is a Conv1d, not an nn.Linear"
    float8 = fp8_tuning.fp8.require_torchao()
    converted = float8.convert_to_float8_training(nn.Linear(32, 32), config=fp8_tuning.fp8.config("tensorwise", True))
    assert eligible("", converted) == "already fp8 (Float8Linear)"


def _m(name, *rounds_ms, error=None):
    return Measurement(name, list(rounds_ms), error=error)


# bf16 and fp8 rounds per (in, out): (32, 64) separated, (64, 32) overlapping, (32, 32) slower, (64, 16) fp8 fails.
FAKE = {
    (32, 64): ([10.0, 11.0, 12.0], [5.0, 6.0, 7.0]),
    (64, 32): ([10.0, 11.0, 12.0], [9.0, 10.0, 13.0]),
    (32, 32): ([10.0, 11.0, 12.0], [12.0, 13.0, 14.0]),
}


@pytest.fixture
def fake_timer(monkeypatch):
    calls = []

    def fake(linear, tokens, device, **kwargs):
        calls.append((linear.in_features, linear.out_features, tokens, kwargs))
        if (linear.in_features, linear.out_features) == (32, 16):
            return _m("bf16", 1.0, 1.0), _m("fp8", error="RuntimeError: no fp8 here\nmore")
        bf16, fp8 = FAKE[linear.in_features, linear.out_features]
        return _m("bf16", *bf16), _m("fp8", *fp8)

    monkeypatch.setattr(fp8_tuning, "time_linear", fake)
    return calls


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                         nn.Linear(32, 30), nn.Linear(30, 32), nn.Linear(32, 16))


def _run(model, x):  # layer 5 (in_features 30) is never called; layer 6 twice
    for i in (0, 1, 2, 3):
        x = model[i](x)
    model[6](x)
    model[6](x)
    return model[4](x)


def test_choice_rule_separated_chosen_overlap_not_identical_timed_once(fake_timer):
    choice = choose_fp8_layers(_model(), torch.randn(16, 32), _run, CPU, **FAST)
    rows = {t.name: t for t in choice.table}

    assert choice.layers == ("0",)
    assert [c[:3] for c in fake_timer] == [(32, 64, 16), (64, 32, 16), (32, 32, 16), (32, 16, 16)]  # "3" reused
    assert fake_timer[0][3]["emulate"] is True and fake_timer[0][3]["dtype"] == torch.float32
    assert rows["0"].verdict == "fp8" and rows["0"].chosen
    assert rows["1"].verdict == "bf16: not faster beyond the spread" and not rows["1"].chosen
    assert rows["2"].verdict == "bf16: fp8 is not faster"
    assert rows["3"].same_as == "2" and rows["3"].verdict == rows["2"].verdict and rows["3"].bf16 is rows["2"].bf16
    assert rows["4"].verdict == "skipped: out_features 30 is not a multiple of 16"
    assert rows["5"].verdict == "skipped: not called on the sample batch" and rows["5"].shape is None
    assert rows["6"].verdict == "skipped: fp8 failed: RuntimeError: no fp8 here"
    assert rows["6"].shape.calls == 2
    assert choice.saved_ms == pytest.approx(11.0 - 6.0)

    text = str(choice)
    assert "(same shape as 2)" in text and "16 x 32 -> 64" in text and "0.545x [0.500-0.583]" in text
    summary = [line for line in text.splitlines() if line.startswith("fp8 (tensorwise, emulated fp8")]
    assert len(summary) == 1 and "1 of 7 Linear layers" in summary[0] and "5.000 ms per step" in summary[0]


def test_margin_and_shared_layers_count_every_call(fake_timer):
    model = nn.Sequential(nn.Linear(32, 64))
    assert choose_fp8_layers(model, torch.randn(16, 32), call, CPU, margin=0.5, **FAST).layers == ()
    assert "and the 50% margin" in str(choose_fp8_layers(model, torch.randn(16, 32), call, CPU, margin=0.5, **FAST))
    twice = choose_fp8_layers(model, torch.randn(16, 32), lambda m, b: (m(b), m(b)), CPU, margin=0.2, **FAST)
    assert twice.layers == ("0",) and twice.saved_ms == pytest.approx(2 * (11.0 - 6.0))


def test_module_filter_fn_converts_exactly_the_chosen_layers():
    model = _model()
    choice = Fp8Choice(("0", "3"), [], "tensorwise", emulate=True)
    config = fp8_tuning.fp8.config("tensorwise", True)
    converted = fp8_tuning.fp8.require_torchao().convert_to_float8_training(copy.deepcopy(model), config=config,
                                                                 module_filter_fn=choice.module_filter_fn)
    kinds = [type(m).__name__ for m in converted]
    assert kinds == ["Float8Linear", "Linear", "Linear", "Float8Linear", "Linear", "Linear", "Linear"]


def test_time_linear_emulated_on_cpu_returns_rounds_and_leaves_the_layer_alone():
    torch.manual_seed(0)
    linear = nn.Linear(32, 32)
    weight = linear.weight.detach().clone()
    rng = torch.get_rng_state()
    bf16, fp8 = time_linear(linear, 16, "cpu", **FAST)

    for m, name in ((bf16, "bf16"), (fp8, "fp8")):
        assert m.name == name and m.error is None and len(m.rounds_ms) == 2
        assert m.settings["emulate"] is True and m.settings["compile"] is False and m.settings["tokens"] == 16
    assert type(linear) is nn.Linear and linear.weight.grad is None and torch.equal(linear.weight, weight)
    assert torch.equal(torch.get_rng_state(), rng)


def test_time_linear_compiles_fresh_fp8_copies_when_asked(monkeypatch):
    compiled = []
    real_compile = torch.compile

    def eager_compile(module, **kwargs):  # dynamo only: the plumbing, without inductor's build time
        compiled.append((type(module).__name__, kwargs))
        return real_compile(module, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    bf16, fp8 = time_linear(nn.Linear(32, 32), 16, CPU, compile=True, **FAST)
    assert bf16.error is None and fp8.error is None and len(fp8.rounds_ms) == 2
    # Both copies of each round, on an equal footing (the model they will run in is compiled too); no CUDA graphs off CUDA.
    seen = sorted((name, tuple(sorted(kwargs.items()))) for name, kwargs in compiled)
    options = (("dynamic", False), ("mode", None))
    assert seen == [("Float8Linear", options)] * 2 + [("Linear", options)] * 2
    assert fp8.settings["cuda_graphs"] is False


def test_real_emulated_choice_end_to_end_prints_a_table():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 20))
    before = copy.deepcopy(model.state_dict())
    choice = choose_fp8_layers(model, torch.randn(2, 8, 32), call, CPU, **FAST)
    assert [t.name for t in choice.table] == ["0", "2", "4", "5"]
    # "0" sees the fp32 input, "2" and "4" the bf16 output of a matmul: only "4" repeats a timed shape.
    assert [t.same_as for t in choice.table] == [None, None, "2", None]
    assert choice.table[3].verdict.startswith("skipped: out_features 20")
    assert all(len(m.rounds_ms) == 2 for t in choice.table[:3] for m in (t.bf16, t.fp8))
    assert set(choice.layers) <= {"0", "2", "4"} and len(str(choice).splitlines()) >= 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_recipe_and_bad_arguments():
    with pytest.raises(ValueError, match="unknown fp8 recipe 'nope'.*tensorwise"):
        time_linear(nn.Linear(32, 32), 16, CPU, recipe="nope", **FAST)
    with pytest.raises(ValueError, match="margin"):
        choose_fp8_layers(nn.Linear(32, 32), torch.randn(16, 32), call, CPU, margin=1.5)


def test_missing_torchao_is_a_value_error_naming_the_extra(monkeypatch):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # None in sys.modules: "import torchao" raises ImportError
    called = []
    hint = r'torchao.*pip install "precisionloop\[fp8\]"'
    with pytest.raises(ValueError, match=hint):
        time_linear(nn.Linear(32, 32), 16, CPU, **FAST)
    with pytest.raises(ValueError, match=hint):
        choose_fp8_layers(nn.Linear(32, 32), torch.randn(16, 32), lambda m, b: called.append(1), CPU, **FAST)
    assert not called  # refused before running the model


def test_layer_timing_ratio_is_none_without_both_timings():
    row = LayerTiming("x", None, _m("bf16", 1.0, 2.0), _m("fp8"))
    assert row.ratio is None and row.saved_ms == 0.0


def test_bad_counts_and_layers_are_refused_before_any_timing():
    import random

    for kwargs in (dict(rounds=1.5), dict(iters=True), dict(warmup=-1), dict(rounds=0)):
        with pytest.raises(ValueError, match="need integers"):
            choose_fp8_layers(nn.Sequential(nn.Linear(32, 32)), torch.randn(4, 32), call, CPU, **{**FAST, **kwargs})
    for tokens in (0, -4, 2.5):
        with pytest.raises(ValueError, match=rf"got tokens={tokens!r}$"):
            time_linear(nn.Linear(32, 32), tokens, CPU, **FAST)
    with pytest.raises(ValueError, match="times an nn.Linear, got a Conv2d"):
        time_linear(nn.Conv2d(3, 8, 3), 16, CPU, **FAST)
    # The capture leaves Python's random stream as it was, even when the model draws from it.
    state = random.getstate()

    class Noisy(nn.Linear):
        def forward(self, x):
            return super().forward(x) * random.random()

    import numpy as np

    numpy_state = np.random.get_state()

    class Noisier(Noisy):
        def forward(self, x):
            return super().forward(x) * float(np.random.rand())

    linear_shapes(Noisier(32, 32), torch.randn(4, 32), call)
    assert random.getstate() == state
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(np.random.get_state(), numpy_state))


def test_a_candidate_with_a_setting_its_policy_lacks_is_refused_at_once():
    from precisionloop import Candidate

    with pytest.raises(ValueError, match="options bogus: its policy takes"):
        Candidate("fp8", options=(("bogus", 1),))
    with pytest.raises(ValueError, match="options layers"):
        Candidate("bf16", options=(("layers", ("0",)),))
    with pytest.raises(ValueError, match="precision"):
        Candidate("fp9")
    assert Candidate("fp8", options=(("layers", ["0"]),)).options == (("layers", ("0",)),)


def test_a_candidate_with_a_bad_setting_value_is_refused_at_once():
    from precisionloop import Candidate

    with pytest.raises(ValueError, match="init_scale"):
        Candidate("fp16", options=(("init_scale", -1.0),))
