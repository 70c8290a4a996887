"""What a checkpoint records of the policy, and how a load uses it: warnings, and a Trainer waiting to autotune."""

import dataclasses
import enum
import warnings

import numpy as np
import pytest
import torch
from conftest import batches, tiny_mlp
from torch import nn

from precisionloop import BF16Policy, FP16Policy, Trainer
from precisionloop import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


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
