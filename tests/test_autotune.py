"""autotune: the choice among candidates, the trials it runs, and Trainer(autotune=True)."""

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from conftest import B, DictTrainer, batch, batches, dict_batch, fp32_only_loss, net, tiny_cnn, tiny_mlp

from precisionloop import Candidate, Trainer, autotune
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


def test_dict_batch_subclass_autotune_runs_the_subclass():
    """autotune trials run the subclass's forward_batch/compute_loss."""
    m = net()
    t = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="auto", autotune=True, device="cpu")
    DictTrainer.calls = 0
    assert t.step(dict_batch(1)).stepped
    assert DictTrainer.calls > 1  # the trials went through the subclass, not only the real step


def test_autotune_with_adamw():
    """autotune works with torch's AdamW (its defaults are not all constructor kwargs)."""
    m = net()
    t = Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-3), precision="auto", autotune=True, device="cpu")
    assert t.step(B).stepped


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_autotune_keeps_per_group_settings(opt_cls):
    """autotune trials keep the optimizer's per-group settings (two groups, two lrs)."""
    m = net()
    groups = [{"params": m[0].parameters(), "lr": 1e-3}, {"params": m[3].parameters(), "lr": 1e-2}]
    opt = opt_cls(groups, lr=1e-3)
    t = Trainer(m, opt, precision="auto", autotune=True, device="cpu")
    seen = []
    # A global optimizer step pre-hook sees every optimizer that steps, the trials' copies included.
    handle = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: seen.append(tuple(g["lr"] for g in o.param_groups)))
    try:
        assert t.step(B).stepped
    finally:
        handle.remove()
    assert len(seen) > 1
    assert set(seen) == {(1e-3, 1e-2)}, f"optimizers stepped with lrs {sorted(set(seen))}"


class FlagProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.eval_flags = []

    def forward(self, x):
        if not self.training:
            self.eval_flags.append(torch.backends.cuda.matmul.fp32_precision)
        return x


def test_validation_after_autotune_runs_under_the_chosen_flags():
    """Validation in the fit that autotuned runs under the chosen policy's backend flags."""
    torch.manual_seed(0)
    probe = FlagProbe()
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), probe, nn.Linear(16, 3))
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="auto", autotune=True, device="cpu",
                loss_fn=fp32_only_loss)
    assert t.policy.tf32  # the pre-autotune policy
    t.fit([batch(2)], epochs=1, val_loader=[batch(3)], progress=False)
    assert t.policy.name == "fp32" and not t.policy.tf32
    expected = "tf32" if t.policy.tf32 else "ieee"
    assert probe.eval_flags and set(probe.eval_flags) == {expected}, probe.eval_flags


def test_autotune_builds_trial_optimizers_that_need_constructor_arguments():
    class MyOpt(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    model = tiny_mlp()
    trainer = Trainer(model, MyOpt(model.parameters(), lr=0.1), "auto", device="cpu", autotune=True)
    assert trainer.step(batches(1)[0]).stepped


@pytest.mark.gpu
def test_autotune_on_cuda_prints_its_table(capsys):
    from precisionloop import autotune

    model = tiny_cnn()
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.05, fused=True), batch, device="cuda", steps=3, warmup=2)
    out = capsys.readouterr().out
    assert "CHOSEN" in out and result.best.label in out
    assert {r.candidate.precision for r in result.results} == {"fp32", "tf32", "bf16", "fp16"}
    assert all(r.peak_mb is not None for r in result.results if r.rejected is None)


@pytest.mark.gpu
def test_trainer_autotune_on_cuda_trains_with_its_choice(capsys):
    model = tiny_cnn()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, fused=True), "auto", device="cuda", autotune=True)
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    assert trainer.step(batch).stepped and "CHOSEN" in capsys.readouterr().out
    assert trainer.policy.name in {"fp32", "tf32", "bf16", "fp16"} and trainer.step(batch).stepped


def test_a_candidate_with_a_setting_its_policy_lacks_is_refused_at_once():
    pytest.importorskip("torchao.float8", reason="fp8 candidates need torchao (pip install 'precisionloop[fp8]')")
    with pytest.raises(ValueError, match="options bogus: its policy takes"):
        Candidate("fp8", options=(("bogus", 1),))
    with pytest.raises(ValueError, match="options layers"):
        Candidate("bf16", options=(("layers", ("0",)),))
    with pytest.raises(ValueError, match="precision"):
        Candidate("fp9")
    assert Candidate("fp8", options=(("layers", ["0"]),)).options == (("layers", ("0",)),)


def test_a_candidate_with_a_bad_setting_value_is_refused_at_once():
    with pytest.raises(ValueError, match="init_scale"):
        Candidate("fp16", options=(("init_scale", -1.0),))


def test_the_removed_fp8_tuning_module_says_what_to_use_instead():
    with pytest.raises(ImportError, match=r"removed in 0.2.0: autotune times fp8 .*FP8Policy\(layers="):
        import precisionloop.fp8_tuning  # noqa: F401
