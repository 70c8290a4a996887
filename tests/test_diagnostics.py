"""gradient_underflow (the real cast, counted on each side of every boundary), fit's underflow_every, and the
skip counters of the training stats."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from conftest import batch, batches, mk, tiny_mlp

from precisionloop import FP16Policy, Trainer
from precisionloop.diagnostics import gradient_underflow

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
    assert "0.weight" in text and "22.2222%" in text and "nonzero gradient values" in text
    assert report.to_dict()["dtype"] == "float16"


def test_bad_arguments():
    with pytest.raises(ValueError, match="backward"):
        gradient_underflow(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="floating-point"):
        gradient_underflow([("w", torch.ones(2))], torch.int8)
    with pytest.raises(ValueError, match="scale"):
        gradient_underflow([("w", torch.ones(2))], scale=0.0)
    with pytest.raises(ValueError, match="every gradient value is zero"):
        gradient_underflow([("w", torch.zeros(2))])


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
