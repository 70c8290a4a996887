"""gradient_underflow (the real cast, counted on each side of every boundary, in every format), precision_report,
lost_updates, fit's underflow_every, and the skip counters of the training stats."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from conftest import batch, batches, mk, tiny_mlp

from precisionloop import FP16Policy, Trainer
from precisionloop.diagnostics import gradient_underflow, lost_updates, precision_report, underflow_summary

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


SUB = 2.0**-24  # fp16's smallest subnormal
LOSS_SCALE = 65536.0


def boundary_values():
    # (value, underflows, subnormal after the cast, underflows x65536, overflows x65536)
    return [
        (0.4 * SUB, True, False, False, False),       # below half the smallest subnormal
        (0.5 * SUB, True, False, False, False),       # exactly half: ties to even, so 0
        (0.6 * SUB, False, True, False, False),       # between half and the smallest subnormal: rounds up to it
        (SUB, False, True, False, False),
        (3 * SUB, False, True, False, False),          # subnormal
        (2.0**-15, False, True, False, False),         # largest-exponent subnormal range
        (2.0**-14, False, False, False, False),        # smallest normal
        (1e-3, False, False, False, False),            # normal
        (2.0**-42, True, False, True, False),          # too small even after x65536
        (65504 / LOSS_SCALE, False, False, False, False),  # exactly fp16's max after scaling
        (70000 / LOSS_SCALE, False, False, False, True),   # above 65504 after scaling
        (-0.4 * SUB, True, False, False, False),       # sign does not matter
        (0.0, None, None, None, None),                 # zeros are not counted
    ]


def test_exact_counts_on_both_sides_of_each_boundary():
    rows = boundary_values()
    grad = torch.tensor([r[0] for r in rows])
    report = gradient_underflow([("w", grad)], torch.float16, LOSS_SCALE)
    counted = [r for r in rows if r[1] is not None]
    assert report.nonzero == len(counted) == 12
    for index, field in ((1, "underflow"), (2, "subnormal"), (3, "underflow_scaled"), (4, "overflow_scaled")):
        assert getattr(report, field) == sum(r[index] for r in counted) / len(counted), field
    magnitudes = sorted(abs(r[0]) for r in counted)
    assert report.median_abs == pytest.approx(magnitudes[(len(magnitudes) - 1) // 2])


def test_bf16_keeps_fp32_range():
    grad = torch.tensor([r[0] for r in boundary_values()] + [1e-30, 3e38 / LOSS_SCALE])
    report = gradient_underflow([("w", grad)], torch.bfloat16, LOSS_SCALE)
    assert report.underflow == 0 and report.subnormal == 0 and report.underflow_scaled == 0 and report.overflow_scaled == 0
    assert "bfloat16" in str(report)
    # Only fp32's own subnormals fall below bf16's range.
    tiny = gradient_underflow([("w", torch.tensor([1e-45, 1.0]))], torch.bfloat16)
    assert tiny.underflow == 0.5


def test_per_parameter_breakdown_and_table():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].weight.grad = torch.tensor([[1e-9, 1e-10], [1e-3, 0.0]])
    model[0].bias.grad = torch.tensor([1e-3, 1e-3])
    model[1].weight.grad = torch.full((2, 2), 1e-3)
    report = gradient_underflow(model)
    assert report.by_parameter["0.weight"].nonzero == 3
    assert report.by_parameter["0.weight"].underflow == pytest.approx(2 / 3)
    assert report.by_parameter["1.weight"].underflow == 0
    assert "1.bias" not in report.by_parameter
    assert report.nonzero == 9 and report.underflow == pytest.approx(2 / 9)
    text = str(report)
    assert "0.weight" in text and "22.2222%" in text and "9 nonzero values" in text
    assert report.to_dict()["dtype"] == "float16"


def test_bad_arguments():
    with pytest.raises(ValueError, match="backward"):
        gradient_underflow(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="floating-point"):
        gradient_underflow([("w", torch.ones(2))], torch.int8)
    with pytest.raises(ValueError, match="scale"):
        gradient_underflow([("w", torch.ones(2))], scale=0.0)
    with pytest.raises(ValueError, match="'tensorwise' or 'rowwise'"):
        gradient_underflow([("w", torch.ones(2))], torch.float8_e4m3fn, scale="columnwise")
    with pytest.raises(ValueError, match="every gradient value is zero"):
        gradient_underflow([("w", torch.zeros(2))])


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype, smallest, largest, over", [
    (torch.float16, 2.0**-24, 65504.0, 70000.0), (torch.bfloat16, 2.0**-133, 2.0**127 * (2 - 2.0**-7), 3.4e38),
    (E4M3, 2.0**-9, 448.0, 500.0), (E5M2, 2.0**-16, 57344.0, 70000.0)])
def test_each_format_at_its_smallest_subnormal_and_largest_finite_value(dtype, smallest, largest, over):
    # 0.4x the smallest subnormal becomes 0, the smallest and the largest stay exact, `over` overflows (to inf, or
    # past the largest for e4m3, which has no inf); 1.25x the smallest rounds to it (error 0.2)
    grad = torch.tensor([0.4 * smallest, smallest, 1.25 * smallest, largest, -largest, over, 0.0])
    report = gradient_underflow([("w", grad)], dtype, scale=1.0)
    assert report.nonzero == 6 and report.underflow == 1 / 6 and report.overflow == 1 / 6
    assert report.subnormal == 2 / 6  # the smallest, and 1.25x it, which rounds to it
    assert report.error == pytest.approx(0.2 / 4)
    assert report.underflow_scaled == report.underflow and report.overflow_scaled == report.overflow


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_amax_scaling_tensorwise_and_rowwise(dtype):
    largest = torch.finfo(dtype).max
    grad = torch.tensor([[1e-8, 1.0, 2.0], [3.0, 0.0, 1e-30]])
    # Tensorwise: 3.0 maps to the largest value, which nothing then exceeds; 1e-30 becomes 0 and so does 1e-8 (e4m3).
    tensorwise = gradient_underflow([("w", grad)], dtype, scale="tensorwise")
    gone = (1e-8 * largest / 3 < torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2) + 1
    assert tensorwise.overflow_scaled == 0 and tensorwise.underflow_scaled == gone / 5
    # Rowwise: each row's own amax, scales rounded down to a power of two (so 2.0 and 3.0 lie below the largest).
    rowwise = gradient_underflow([("w", grad)], dtype, scale="rowwise")
    assert rowwise.overflow_scaled == 0
    scales = [2.0 ** torch.floor(torch.log2(torch.tensor(largest / a))).item() for a in (2.0, 3.0)]
    expected = torch.tensor([[1e-8 * scales[0], scales[0], 2 * scales[0]], [3 * scales[1], 0, 1e-30 * scales[1]]])
    cast = expected.to(dtype).float()
    nonzero = expected != 0
    assert rowwise.underflow_scaled == ((cast == 0) & (grad != 0)).sum().item() / 5
    survive = (cast != 0) & nonzero
    assert rowwise.error_scaled == pytest.approx(((cast - expected).abs() / expected.abs())[survive].mean().item())
    # An inf or NaN among the values does not set the scale of the finite ones.
    spoiled = gradient_underflow([("w", torch.tensor([float("inf"), float("nan"), 1.0, 2.0]))], dtype, "tensorwise")
    assert spoiled.nonzero == 2 and spoiled.underflow_scaled == 0 and spoiled.overflow_scaled == 0


def test_e4m3_overflows_past_its_largest_value_and_amax_scaling_is_for_fp8_only():
    assert gradient_underflow([("w", torch.tensor([450.0, 448.0]))], E4M3, 1.0).overflow == 0.5  # no inf to reach
    assert gradient_underflow([("w", torch.tensor([65510.0, 65504.0]))], torch.float16, 1.0).overflow == 0  # rounds down
    with pytest.raises(ValueError, match="amax scaling for fp8"):
        gradient_underflow([("w", torch.ones(2))], torch.bfloat16, "tensorwise")


def test_lost_updates_exact_on_a_constructed_case():
    layer = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.ones_(layer.weight)
    before = {"weight": layer.weight.detach().clone()}
    with torch.no_grad():  # bf16's spacing at 1.0 is 2^-7: 1e-4 rounds back to 1.0, 1e-2 does not
        layer.weight += torch.tensor([[1e-4, 1e-2, 0.0]])
    report = lost_updates(before, layer)
    assert report.nonzero == 2 and report.lost == 0.5 and report.by_parameter == {"weight": (2, 0.5)}
    assert lost_updates(before, layer, torch.float32).lost == 0.0  # fp32 keeps both
    assert lost_updates({}, layer).lost is None and "50.0000% would be lost" in str(report)


def test_precision_report_measures_every_layer_and_changes_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "bf16", device="cpu")
    data = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0]))
    trainer.step(data)
    model[1].eval()  # a frozen batch norm in a model that trains
    torch.nn.functional.mse_loss(model(data[0]), torch.zeros(4, 3)).backward()  # an open window's gradients
    state, grads = copy.deepcopy(model.state_dict()), [p.grad.clone() for p in model.parameters()]
    optimizer_state, rng, steps = copy.deepcopy(optimizer.state_dict()), torch.get_rng_state(), trainer.global_step
    report = precision_report(trainer, data)
    assert [(r["layer"], r["tensor"]) for r in report.rows] == [
        (layer, tensor) for layer in ("0", "4") for tensor in ("input", "weight", "output grad")]
    assert report.formats == ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    weight = report.rows[1]
    assert weight["nonzero"] == 36 and weight["float8_e4m3fn"]["overflow"] == 0 and weight["bfloat16"]["error"] > 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert str(optimizer.state_dict()) == str(optimizer_state) and trainer.global_step == steps
    assert torch.equal(torch.get_rng_state(), rng) and model.training and not model[1].training
    assert "output grad" in str(report) and report.to_dict()["rows"][0]["layer"] == "0"
    other = tiny_mlp()
    compiled = Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), "fp32", device="cpu", compile=True)
    with pytest.raises(ValueError, match="eager single-process"):
        precision_report(compiled, data)


def test_counters_after_injected_overflows():
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), FP16Policy(init_scale=1024.0), device="cpu")
    pattern = [False, True, True, False, False, True, False]
    for b, poison in zip(batches(len(pattern)), pattern):
        armed["on"] = poison
        trainer.step(b)
    stats = trainer.stats
    assert stats.steps == 7 and stats.skipped == 3 and stats.steps_since_overflow == 1
    assert stats.scale == 128.0 and stats.min_scale == 128.0 and stats.max_scale == 1024.0


def test_fit_records_underflow_every_n_steps():
    x = torch.randn(64, 16)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp16", device="cpu")
    history = trainer.fit(data, epochs=1, underflow_every=3, progress=False)
    assert [m["step"] for m in trainer.underflow_history] == [3, 6]
    assert all(m["dtype"] == "float16" and m["nonzero"] > 0 and 0 <= m["underflow_scaled"] <= m["underflow"] <= 1
               for m in trainer.underflow_history)
    assert history[0]["underflow"] == trainer.underflow_history[-1]["underflow"]
    assert all(0 <= m["lost_updates"] <= 1 for m in trainer.underflow_history)
    other = tiny_mlp()
    untouched = Trainer(other, torch.optim.SGD(other.parameters(), lr=0.01), "fp16", device="cpu")
    assert "underflow" not in untouched.fit(data, epochs=1, progress=False)[0]
    assert untouched.underflow_history == []


def test_underflow_measurement_with_all_zero_gradients(tmp_path):
    """fit(underflow_every=1) with all-zero gradients records an empty measurement."""
    _, t = mk(loss_fn=lambda o, y: 0 * o.sum())
    t.fit([batch(2), batch(3)], epochs=1, progress=False, underflow_every=1)
    assert t.global_step == 2
    assert len(t.underflow_history) == 2
    assert all(entry["nonzero"] == 0 for entry in t.underflow_history)
    assert t.save(tmp_path / "after.pt").is_file()


def test_underflow_measurement_after_a_nan_loss_or_with_sparse_gradients():
    """A step whose gradients are all NaN, and sparse gradients, are measured without an error."""
    _, t = mk(loss_fn=lambda o, y: o.sum() * float("nan"))
    t.fit([batch(2)], epochs=1, progress=False, underflow_every=1)
    assert [entry["nonzero"] for entry in t.underflow_history] == [0]
    embed = torch.nn.Embedding(10, 4, sparse=True)
    embed(torch.tensor([1, 2])).sum().backward()
    assert underflow_summary(embed, torch.float16, 65536.0)["nonzero"] == 8
