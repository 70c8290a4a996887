import pytest
import torch
from conftest import batches, tiny_cnn, tiny_mlp

from precisionloop import Candidate, autotune
from precisionloop.tuning import default_candidates

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def test_picks_the_fastest_sound_candidate_and_shows_the_table(capsys):
    model = tiny_mlp()
    before = [p.clone() for p in model.parameters()]
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.05), batch, device="cpu", steps=3, warmup=1)
    out = capsys.readouterr().out
    assert "CHOSEN" in out and "loss drift" in out
    accepted = [r for r in result.results if r.rejected is None]
    assert result.best == min(accepted, key=lambda r: r.median_ms).candidate
    assert result.policy.name == get_name(result.best.precision)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "autotune must not train the model itself"


def get_name(spec):
    from precisionloop import get_policy

    return get_policy(spec).name


def test_rejects_skipping_and_drifting_candidates(capsys):
    model = tiny_mlp()
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    candidates = [Candidate("fp32"), Candidate("bf16")]
    # bf16's loss differs from fp32's by ~1e-3 of the first loss: a tiny tolerance rejects it.
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.05), batch, candidates, device="cpu", steps=3,
                      warmup=1, tolerance=1e-7, verbose=False)
    verdicts = {r.candidate.precision: r.rejected for r in result.results}
    assert verdicts["fp32"] is None and "loss drift" in verdicts["bf16"] and result.best.precision == "fp32"

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.linear(x) * 1e6

    with pytest.raises(RuntimeError, match="every candidate was rejected") as caught:
        autotune(Exploding(), lambda p: torch.optim.SGD(p, lr=10.0), batch, [Candidate("fp16")], device="cpu",
                 steps=2, warmup=1, verbose=False)
    assert "raise tolerance" not in str(caught.value)  # skipped steps are no rounding difference


def test_when_only_the_loss_drift_rejects_every_candidate_the_error_says_how_to_go_on():
    batch = batches(1, batch_size=16)[0]
    with pytest.raises(RuntimeError, match=r"(?s)bf16: loss drift.*raise tolerance \(e\.g\. tolerance=0\.00\d+\)") as caught:
        autotune(tiny_mlp(), lambda p: torch.optim.SGD(p, lr=0.1), batch, [Candidate("bf16")], device="cpu",
                 steps=2, warmup=1, tolerance=1e-7, verbose=False)
    suggested = float(str(caught.value).split("tolerance=")[-1].split(")")[0])
    closest = float(str(caught.value).split("the closest by ")[1].split(")")[0])
    assert suggested >= 1.2 * closest  # headroom over the drift seen
    # The suggestion lets the closest candidate through.
    result = autotune(tiny_mlp(), lambda p: torch.optim.SGD(p, lr=0.1), batch, [Candidate("bf16")], device="cpu",
                      steps=2, warmup=1, tolerance=suggested, verbose=False)
    assert result.best.precision == "bf16"


def test_default_candidates_cover_layouts_for_conv_models_only():
    mlp, cnn = default_candidates(tiny_mlp(), "cpu"), default_candidates(tiny_cnn(), "cpu")
    assert {c.precision for c in mlp} == {"fp32", "bf16"} and {c.channels_last for c in mlp} == {None}
    assert {c.channels_last for c in cnn} == {True, False} and len(cnn) == 4
    assert {c.compile for c in default_candidates(tiny_mlp(), "cpu", compile=True)} == {False, True}


def test_trainer_autotune_chooses_at_the_first_step(capsys, tmp_path):
    from precisionloop import Trainer

    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "auto", device="cpu", autotune=True)
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    rng = torch.get_rng_state()
    result = trainer.step(batch)
    assert torch.equal(torch.get_rng_state(), rng), "autotune must leave the caller's RNG as it was"
    assert "CHOSEN" in capsys.readouterr().out
    assert result.stepped and trainer.policy.name in {"fp32", "bf16"} and trainer.stats.steps == 1
    trainer.save(tmp_path / "c.pt")

    other_model = tiny_mlp()
    resumed = Trainer(other_model, torch.optim.SGD(other_model.parameters(), lr=0.05), "auto", device="cpu", autotune=True)
    resumed.load(tmp_path / "c.pt")
    assert resumed.policy.name == trainer.policy.name
    resumed.step(batch)
    assert "CHOSEN" not in capsys.readouterr().out, "a resumed run keeps the checkpoint's precision"


def test_trainer_autotune_needs_auto_precision():
    from precisionloop import Trainer

    model = tiny_mlp()
    with pytest.raises(ValueError, match="precision='auto'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "bf16", device="cpu", autotune=True)
