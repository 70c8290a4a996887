"""A damaged or foreign Trainer state is refused before anything changes (a load is all or nothing).

Each case takes a good state saved after one step, damages one entry, and loads it into a Trainer that
has taken three: a load that failed half-way would leave that Trainer with some of the older state.
Without these checks a state lacking "rng", "counters" or "stats" loaded the weights, the optimizer and the
step count, then raised a KeyError; int64 weights were truncated into the model; an optimizer moment of the
wrong shape, or an LR of "fast", failed at the next step instead of at the load.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")

BATCH = (torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0]))


def _trainer(precision: str = "fp16") -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), precision, device="cpu")


def _everything(t: Trainer) -> dict:
    """What a load can change: weights, optimizer state and groups, scheduler-free counters, stats, scale, RNGs."""
    return copy.deepcopy({
        "weights": [p.detach().clone() for p in t.model.parameters()],
        "optimizer": t.optimizer.state_dict(),
        "steps": (t.engine.global_step, t.engine.consecutive_skips, t.loop_state.epoch, t.loop_state.batch_in_epoch),
        "stats": t.stats,
        "scale": t.engine.guard.scale_value(),
        "rng": (torch.get_rng_state(), random.getstate()),
    })


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _pop(key):
    return lambda s: s.pop(key)


def _set(*path_and_value):
    *path, value = path_and_value

    def damage(s):
        for key in path[:-1]:
            s = s[key]
        s[path[-1]] = value(s[path[-1]]) if callable(value) else value
    return damage


DAMAGES = {
    "no rng": (_pop("rng"), "'rng' is missing"),
    "no counters": (_pop("counters"), "'counters' is missing"),
    "no stats": (_pop("stats"), "'stats' is missing"),
    "no optimizer": (_pop("optimizer"), "'optimizer' is missing"),
    "step count a string": (_set("counters", "global_step", "3"), "global_step"),
    "collapse_warned an int": (_set("counters", "collapse_warned", 1), "collapse_warned"),
    "stats with an extra field": (_set("stats", "extra", 0), "'stats' has the fields"),
    "stats count a string": (_set("stats", "steps", "x"), "stats\\['steps'\\]"),
    "torch RNG cut short": (_set("rng", "torch", lambda t: t[:100]), "'rng' does not restore"),
    "python RNG not a triple": (_set("rng", "python", [1, 2]), "'rng' does not restore"),
    "int64 weights": (_set("model", "weight", lambda t: t.long()), "weight is torch.int64, the model's torch.float32"),
    "fp64 weights": (_set("model", "bias", lambda t: t.double()), "bias is torch.float64"),
    "a moment of another shape": (_set("optimizer", "state", "weight", "exp_avg", torch.zeros(7)),
                                  "'exp_avg' has shape \\[7\\]"),
    "an LR of 'fast'": (_set("optimizer", "param_groups", 0, "lr", "fast"), "param_groups\\[0\\]\\['lr'\\]"),
    "betas of one": (_set("optimizer", "param_groups", 0, "betas", (0.9,)), "betas"),
    "a scaler state without its keys": (_set("scaler", {"scale": 1.0}), "'scaler' is"),
    # numpy does not range-check it: the next draw crashed the process
    "a numpy RNG position past its key": (_set("rng", "numpy", "pos", 10**9), "numpy state"),
    "CUDA RNG states not a list": (_set("rng", "cuda", torch.zeros(16, dtype=torch.uint8)), "CUDA states"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_state_is_refused_and_changes_nothing(case):
    damage, message = DAMAGES[case]
    source = _trainer()
    source.step(BATCH)
    state = copy.deepcopy(source.state_dict())
    damage(state)

    t = _trainer()
    for _ in range(3):
        t.step(BATCH)
    before = _everything(t)
    with pytest.raises(ValueError, match=message) as error:
        t.load_state_dict(state)
    assert "nothing was loaded" in str(error.value)
    assert _same(_everything(t), before)
    assert t.step(BATCH).stepped  # and it trains on


@pytest.mark.parametrize("foreign", [None, "state", 3])
def test_what_is_not_a_trainer_state_is_named(foreign):
    t = _trainer("bf16")
    value = t.model.state_dict() if foreign == "state" else foreign
    with pytest.raises(ValueError, match="not a precisionloop Trainer state .* got a"):
        t.load_state_dict(value)


def test_a_good_state_still_loads_into_a_fresh_trainer_and_one_that_stepped():
    source = _trainer()
    source.step(BATCH)
    state = copy.deepcopy(source.state_dict())
    for steps in (0, 3):
        t = _trainer()
        for _ in range(steps):
            t.step(BATCH)
        t.load_state_dict(copy.deepcopy(state))
        assert t.engine.global_step == 1 and _same(list(t.model.parameters()), list(source.model.parameters()))


def test_a_third_party_optimizer_may_keep_state_of_any_shape():
    """Shapes are checked against the parameter for torch's own optimizers only (others keep preconditioners)."""

    class Preconditioned(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p].setdefault("gram", torch.zeros(p.numel(), p.numel()))
            return super().step(closure)

    Preconditioned.__module__ = "somewhere.else"

    def make() -> Trainer:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        return Trainer(model, Preconditioned(model.parameters(), lr=0.1), "bf16", device="cpu")

    source = make()
    source.step(BATCH)
    fresh = make()
    fresh.load_state_dict(copy.deepcopy(source.state_dict()))
    assert fresh.optimizer.state[fresh.model.weight]["gram"].shape == (12, 12)


def test_what_older_or_other_runs_saved_still_loads():
    """A saved scaler of {} (GradScaler(enabled=False)), stats without a field added later, and a setting left
    unset on one side (None) load as before the checks."""
    source = _trainer()
    source.step(BATCH)
    state = copy.deepcopy(source.state_dict())
    state["scaler"] = {}
    del state["stats"]["max_scale"]
    state["optimizer"]["param_groups"][0]["maximize"] = None
    t = _trainer()
    t.load_state_dict(state)
    assert t.engine.global_step == 1


def test_muon_with_an_unset_option_loads_into_one_that_sets_it():
    def make(adjust):
        torch.manual_seed(0)
        model = nn.Linear(4, 3, bias=False)
        return Trainer(model, torch.optim.Muon(model.parameters(), lr=0.01, adjust_lr_fn=adjust), "bf16", device="cpu")

    source = make(None)
    source.step(BATCH)
    t = make("match_rms_adamw")
    t.load_state_dict(copy.deepcopy(source.state_dict()))
    assert t.engine.global_step == 1


def test_a_pending_autotune_checks_the_scaler_of_the_policy_it_takes_from_the_checkpoint():
    source = _trainer("fp16")
    source.step(BATCH)
    state = copy.deepcopy(source.state_dict())
    del state["scaler"]["scale"]
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), "auto", autotune=True, device="cpu")
    policy, weights = t.policy, [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(ValueError, match="'scaler' is .*nothing was loaded"):
        t.load_state_dict(state)
    assert t.policy is policy and all(torch.equal(a, b) for a, b in zip(t.model.parameters(), weights))


def test_a_model_the_user_compiled_resumes_exactly():
    """torch.compile(model) passed in: its names carry _orig_mod., the saved state's do not. It saved, but no load
    fitted (\"missing _orig_mod.0.weight\"), and keep_fp32 patterns had to name the wrapper's prefix."""
    from precisionloop import BF16Policy

    def make() -> Trainer:
        torch.manual_seed(0)
        model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), BF16Policy(keep_fp32=("2",)), device="cpu")

    straight = make()
    straight.step(BATCH)
    state = copy.deepcopy(straight.state_dict())
    for _ in range(2):
        straight.step(BATCH)
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.step(BATCH)
    assert _same(list(resumed.model.parameters()), list(straight.model.parameters()))
    assert resumed.stats == straight.stats
