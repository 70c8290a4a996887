"""keep_fp32 through the Trainer: kept modules run in fp32 inside a bf16/fp16 step, eager and compiled,
bad entries fail before the model is touched, policies stay values, and checkpoints record the choice.

tests/test_fp32_modules.py covers the mechanism (``keep_fp32_``) on its own; these go through ``Trainer``.
"""

import contextlib
import copy
import dataclasses
import warnings
from collections import OrderedDict

import pytest
import torch
from conftest import ProbeNorm
from torch import nn

import precisionloop._compat
from precisionloop import BF16Policy, FP16Policy, Trainer, get_policy
from precisionloop.fp32_modules import is_kept

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")

POLICIES = {"bf16": BF16Policy, "fp16": FP16Policy}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ProbeLinear(nn.Linear):
    """The same probe on a Linear."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return super().forward(x)


class Net(nn.Module):
    """Linear -> ReLU -> LayerNorm -> head Linear. ``hand=True`` writes the fp32 regions out by hand
    (autocast off, ``.float()`` inputs) for the modules ``hand_fp32`` names: the reference for the Trainer."""

    def __init__(self, seed=0, width=16, classes=4, probes=False, hand_fp32=()):
        super().__init__()
        torch.manual_seed(seed)
        linear, norm = (ProbeLinear, ProbeNorm) if probes else (nn.Linear, nn.LayerNorm)
        self.body = linear(8, width)
        self.norm = norm(width)
        self.head = linear(width, classes)
        self.hand_fp32 = set(hand_fp32)

    def _call(self, name, x):
        module = getattr(self, name)
        if name not in self.hand_fp32:
            return module(x)
        with torch.autocast("cpu", enabled=False):
            return module(x.float())

    def forward(self, x):
        x = torch.relu(self.body(x))
        return self._call("head", self._call("norm", x))


def data(n=3, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def trainer_for(model, policy, **kwargs):
    return Trainer(model, sgd(model), policy, device="cpu", **kwargs)


def recording_loss(log):
    def loss_fn(outputs, targets):
        log.append(outputs.dtype)
        return nn.functional.cross_entropy(outputs, targets)
    return loss_fn


# 1. What a kept module sees inside Trainer.step --------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_kept_class_runs_with_autocast_off_on_fp32_inputs(precision):
    low = LOW[precision]
    model, outputs = Net(probes=True), []
    trainer = trainer_for(model, POLICIES[precision](keep_fp32=(nn.LayerNorm,)), loss_fn=recording_loss(outputs))
    assert trainer.step(data(1)[0]).stepped
    assert model.norm.seen == [(False, torch.float32)]  # the kept norm: autocast off, its low-precision input cast up
    assert model.body.seen == [(True, torch.float32)] and model.head.seen == [(True, torch.float32)]  # the rest: on
    assert outputs == [low]  # the head is not kept, so the output is low precision
    # The control: without keep_fp32 the same norm runs under autocast on the body's low-precision output.
    plain = Net(probes=True)
    trainer_for(plain, POLICIES[precision]()).step(data(1)[0])
    assert plain.norm.seen == [(True, low)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_kept_name_pattern_runs_with_autocast_off_on_fp32_inputs(precision):
    model, outputs = Net(probes=True), []
    trainer = trainer_for(model, POLICIES[precision](keep_fp32=("he*",)), loss_fn=recording_loss(outputs))
    trainer.step(data(1)[0])
    assert [n for n, m in model.named_modules() if is_kept(m)] == ["head"]
    assert model.head.seen == [(False, torch.float32)]
    assert model.body.seen == [(True, torch.float32)] and model.norm.seen == [(True, LOW[precision])]
    assert outputs == [torch.float32]


# 2. Bitwise equal to a hand-written torch.amp loop ----------------------------------------------------------


def hand_loop(model, batches, precision):
    """torch's own recipe, with the kept regions written out in the model (Net(hand_fp32=...))."""
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    for x, y in batches:
        with torch.autocast("cpu", dtype=LOW[precision]):
            loss = nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_is_bitwise_equal_to_a_hand_written_amp_loop(precision):
    batches = data(3)
    model = Net()
    trainer = trainer_for(model, POLICIES[precision](keep_fp32=(nn.LayerNorm, "head")))
    for b in batches:
        assert trainer.step(b).stepped
    reference = hand_loop(Net(hand_fp32=("norm", "head")), batches, precision)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    # And keep_fp32 changed the training: the plain amp loop ends elsewhere.
    plain = hand_loop(Net(), batches, precision)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


# 3. compile="default": no behavioural difference --------------------------------------------------------------


@contextlib.contextmanager
def fresh_dynamo():
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def train_three_steps(policy, **kwargs):
    model, outputs, norm_outputs = Net(), [], []
    model.norm.register_forward_hook(lambda m, i, o: norm_outputs.append(o.dtype))
    trainer = trainer_for(model, policy, loss_fn=recording_loss(outputs), **kwargs)
    for b in data(3):
        trainer.step(b)
    return model, outputs, norm_outputs


# Measured on torch 2.14 CPU: compiled vs eager differ by <= 3e-8 in any weight after three steps; with
# the compiled backward recast to bf16 (compiled_backward_like_eager made a no-op) they differ by ~4e-4.
# The kept head matters: a LayerNorm's backward has no autocast-listed op, so with only the norm kept
# the recast changes nothing.
COMPILE_TOL = dict(atol=1e-6, rtol=1e-6)


def test_compiled_step_matches_eager_and_keeps_outputs_fp32():
    policy = BF16Policy(keep_fp32=(nn.LayerNorm, "head"))
    eager, eager_outputs, _ = train_three_steps(policy)
    with fresh_dynamo():
        compiled, outputs, norm_outputs = train_three_steps(policy, compile="default")
    assert outputs == eager_outputs == [torch.float32] * 3
    assert norm_outputs == [torch.float32] * 3
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, **COMPILE_TOL, msg=lambda m: f"{name}: {m}")


# 4. Bad entries ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [BF16Policy, FP16Policy])
@pytest.mark.parametrize("bad", [3, nn.LayerNorm(4)])
def test_bad_entry_is_a_type_error_naming_keep_fp32(cls, bad):
    with pytest.raises(TypeError, match="keep_fp32"):
        cls(keep_fp32=(bad,))


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), norm=nn.BatchNorm2d(4), pool=nn.AdaptiveAvgPool2d(1),
                                     flat=nn.Flatten(), head=nn.Linear(4, 2)))


def test_pattern_matching_nothing_fails_at_construction_and_leaves_the_model_untouched():
    model = conv_net()
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # channels_last=True: preparing the model would change its weights' layout, so a late failure would show.
    policy = BF16Policy(keep_fp32=(nn.BatchNorm2d, "haed"), channels_last=True)
    with pytest.raises(ValueError, match=r"keep_fp32 pattern 'haed'.*close module names: 'head'"):
        Trainer(model, optimizer, policy, device="cpu")
    assert not any(is_kept(m) for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and v.stride() == before[k][1], k
    # The same model and optimizer then work with a correct pattern.
    trainer = Trainer(model, optimizer, dataclasses.replace(policy, keep_fp32=(nn.BatchNorm2d, "head")), device="cpu")
    assert trainer.step((torch.randn(2, 3, 6, 6), torch.tensor([0, 1]))).stepped
    assert [n for n, m in model.named_modules() if is_kept(m)] == ["norm", "head"]


# 5. The policy stays a value ---------------------------------------------------------------------------------


def test_policy_with_keep_fp32_is_immutable_hashable_and_shows_it():
    policy = BF16Policy(keep_fp32=(nn.LayerNorm, "head"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.keep_fp32 = ()
    same = BF16Policy(keep_fp32=[nn.LayerNorm, "head", nn.LayerNorm])  # a list, with a duplicate
    assert same == policy and hash(same) == hash(policy) and same.keep_fp32 == (nn.LayerNorm, "head")
    assert policy in {same} and BF16Policy() not in {policy}
    assert BF16Policy(keep_fp32=("head",)) != policy
    assert "keep_fp32=(" in repr(policy) and "LayerNorm" in repr(policy) and "'head'" in repr(policy)
    assert dataclasses.replace(get_policy("bf16"), keep_fp32=["head"]).keep_fp32 == ("head",)
    assert get_policy("bf16").keep_fp32 == () and get_policy("bf16") == BF16Policy()
    assert get_policy("fp16").keep_fp32 == () and get_policy(policy) is policy


# 6. Checkpoints ---------------------------------------------------------------------------------------------


def saved(tmp_path, policy, name):
    model = Net()
    trainer = trainer_for(model, policy)
    trainer.step(data(1)[0])
    return trainer.save(tmp_path / name)


def test_checkpoint_records_keep_fp32(tmp_path):
    state = torch.load(saved(tmp_path, BF16Policy(keep_fp32=(nn.LayerNorm, "head")), "kept.pt"), weights_only=True)
    assert state["precision"] == "bf16"
    assert state["keep_fp32"] == ["torch.nn.modules.normalization.LayerNorm", "head"]
    assert torch.load(saved(tmp_path, BF16Policy(), "plain.pt"), weights_only=True)["keep_fp32"] == []


@pytest.mark.parametrize("saved_keep, loading_keep", [((nn.LayerNorm, "head"), ()), ((), (nn.LayerNorm, "head"))])
def test_loading_under_other_keep_fp32_warns_naming_it(tmp_path, saved_keep, loading_keep):
    path = saved(tmp_path, BF16Policy(keep_fp32=saved_keep), "c.pt")
    trainer = trainer_for(Net(seed=3), BF16Policy(keep_fp32=loading_keep))
    with pytest.warns(UserWarning, match=r"keeping torch\.nn\.modules\.normalization\.LayerNorm, head in fp32"):
        trainer.load(path)
    assert trainer.global_step == 1


def test_loading_under_the_same_keep_fp32_does_not_warn(tmp_path):
    path = saved(tmp_path, BF16Policy(keep_fp32=(nn.LayerNorm, "head")), "c.pt")
    trainer = trainer_for(Net(seed=3), BF16Policy(keep_fp32=[nn.LayerNorm, "head", nn.LayerNorm]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.load(path)
    assert trainer.global_step == 1

