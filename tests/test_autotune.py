"""autotune and Trainer.autotuned: the choice among candidates, the trials it runs, the Trainer it builds."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from conftest import B, DictTrainer, batches, dict_batch, fp32_only_loss, net, tiny_cnn, tiny_mlp

from precisionloop import Candidate, Trainer, autotune, default_candidates, get_policy

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")
QUICK = dict(device="cpu", steps=2, warmup=1, rounds=2)


def test_picks_the_fastest_sound_candidate_and_leaves_the_model_and_rng_alone():
    model = tiny_mlp()
    before = [p.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.05), batches(1, batch_size=32)[0], **QUICK)
    accepted = [r for r in result.results if r.rejected is None]
    assert result.best == min(accepted, key=lambda r: r.timing.median_ms).candidate
    assert result.policy.name == get_policy(result.best.precision).name
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "autotune must not train the model"
    assert torch.equal(torch.get_rng_state(), rng), "autotune must leave the caller's RNG as it was"
    table = str(result)
    assert "CHOSEN" in table and "loss drift" in table and result.best.label in table


def test_rejects_drifting_and_skipping_candidates():
    candidates = [Candidate("fp32"), Candidate("bf16")]
    # bf16's loss differs from fp32's by ~1e-3 of the first loss: a tiny tolerance rejects it.
    result = autotune(tiny_mlp(), lambda p: torch.optim.SGD(p, lr=0.05), batches(1, batch_size=32)[0],
                      candidates=candidates, tolerance=1e-7, **QUICK)
    rejected = {r.candidate.precision: r.rejected for r in result.results}
    assert rejected["fp32"] is None and "loss drift" in rejected["bf16"] and result.best.precision == "fp32"

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.linear(x) * 1e6

    with pytest.raises(RuntimeError, match="every candidate was rejected") as caught:
        autotune(Exploding(), lambda p: torch.optim.SGD(p, lr=10.0), batches(1)[0], candidates=[Candidate("fp16")],
                 **QUICK)
    assert "skipped" in str(caught.value) and "raise tolerance" not in str(caught.value)


def test_when_only_the_loss_drift_rejects_every_candidate_the_error_says_how_to_go_on():
    with pytest.raises(RuntimeError, match=r"(?s)raise tolerance.*bf16: loss drift"):
        autotune(tiny_mlp(), lambda p: torch.optim.SGD(p, lr=0.1), batches(1, batch_size=16)[0],
                 candidates=[Candidate("bf16")], tolerance=1e-7, **QUICK)


def test_a_failing_candidate_is_rejected_with_its_error_and_the_others_still_run():
    result = autotune(tiny_mlp(), lambda p: torch.optim.SGD(p, lr=0.1), batches(1)[0], loss_fn=fp32_only_loss,
                      candidates=[Candidate("fp32"), Candidate("bf16")], **QUICK)
    rejected = {r.candidate.precision: r.rejected for r in result.results}
    assert "fp32 only" in rejected["bf16"] and result.best.precision == "fp32"


def test_default_candidates_cover_layouts_for_conv_models_only():
    mlp, cnn = default_candidates(tiny_mlp(), "cpu"), default_candidates(tiny_cnn(), "cpu")
    assert {c.precision for c in mlp} == {"fp32", "bf16"} and {c.channels_last for c in mlp} == {None}
    assert {c.channels_last for c in cnn} == {True, False} and len(cnn) == 4
    assert {c.compile for c in default_candidates(tiny_mlp(), "cpu", compile=True)} == {False, True}


def test_a_misspelt_candidate_is_refused_at_once():
    with pytest.raises(ValueError, match="fp9"):
        Candidate("fp9")


def test_autotuned_builds_a_trainer_at_the_winning_configuration():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer.autotuned(model, optimizer, batches(1)[0], loss_fn=fp32_only_loss, **QUICK)
    result = trainer.autotune_result
    assert result.best.precision == "fp32" and trainer.policy == result.policy
    assert trainer.model is model and trainer.optimizer is optimizer and trainer.global_step == 0
    assert trainer.step(batches(1)[0]).stepped


def test_autotuned_times_the_subclass():
    model = net()
    DictTrainer.calls = 0
    trainer = DictTrainer.autotuned(model, torch.optim.SGD(model.parameters(), lr=0.1), dict_batch(1), **QUICK)
    assert isinstance(trainer, DictTrainer) and DictTrainer.calls > 1  # the trials went through forward_batch
    assert trainer.step(dict_batch(2)).stepped


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_the_trials_keep_the_optimizers_class_and_per_group_settings(opt_cls):
    model = net()
    groups = [{"params": model[0].parameters(), "lr": 1e-3}, {"params": model[3].parameters(), "lr": 1e-2}]
    seen = []
    # A global optimizer step pre-hook sees every optimizer that steps, the trials' included.
    handle = register_optimizer_step_pre_hook(lambda o, args, kwargs: seen.append(
        (type(o), tuple(g["lr"] for g in o.param_groups), tuple(len(g["params"]) for g in o.param_groups))))
    try:
        Trainer.autotuned(model, opt_cls(groups, lr=1e-3), B, **QUICK)
    finally:
        handle.remove()
    assert len(seen) > 1 and set(seen) == {(opt_cls, (1e-3, 1e-2), (2, 2))}


def test_the_trials_build_optimizers_that_need_constructor_arguments():
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
    trainer = Trainer.autotuned(model, MyOpt(model.parameters(), lr=0.1), batches(1)[0], **QUICK)
    assert trainer.step(batches(1)[0]).stepped


@pytest.mark.gpu
def test_autotuned_on_cuda_chooses_among_every_precision_with_peaks():
    model = tiny_cnn()
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    trainer = Trainer.autotuned(model, torch.optim.SGD(model.parameters(), lr=0.05), batch, device="cuda", steps=3)
    result = trainer.autotune_result
    assert {r.candidate.precision for r in result.results} == {"fp32-strict", "tf32", "bf16", "fp16"}
    assert all(r.timing.peak_mb is not None for r in result.results if r.rejected is None)
    assert trainer.step(batch).stepped
