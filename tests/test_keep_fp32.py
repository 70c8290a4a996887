"""keep_fp32: chosen submodules run in float32 (autocast off, fp32 inputs) inside a bf16/fp16 autocast region.

Through the Trainer: kept modules run in fp32 inside a bf16/fp16 step, eager and compiled, bad entries fail
before the model is touched, policies stay values, and checkpoints record the choice. The mechanism
(``keep_fp32_``) is also tested on its own.
"""

import contextlib
import copy
import dataclasses
import io
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from conftest import B, ProbeNorm, stochastic_adamw

from precisionloop import BF16Policy, FP16Policy, Trainer, get_policy
from precisionloop.keep_fp32 import is_kept, keep_fp32_, select_modules, validate_keep_fp32

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


BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


class BlockNet(nn.Module):
    def __init__(self, width=8, classes=3, depth=2):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Scale(nn.Module):
    """Takes keyword and nested inputs and returns a tuple, to exercise the input casting."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((8,), 0.5))
        self.seen = {}

    def forward(self, x, *, extra=None):
        self.seen = {"x": x.dtype, "pair": [t.dtype for t in extra["pair"]], "scale": extra["scale"].dtype}
        y = x * self.weight + extra["pair"][0] * extra["scale"]
        return y, x @ extra["pair"][1]


def net(seed=0, **kwargs):
    torch.manual_seed(seed)
    return BlockNet(**kwargs)


def forward_backward(model, x, autocast=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast(**BF16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_kept_module_sees_autocast_off_and_fp32_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), ProbeNorm(8), nn.Linear(8, 2))
    linear_out = []
    model[0].register_forward_hook(lambda m, i, o: linear_out.append(o.dtype))
    assert keep_fp32_(model, [ProbeNorm]) == ["1"]
    with torch.autocast(**BF16):
        hidden = model[:2](torch.randn(3, 4))
        after = model[2](hidden)
    assert linear_out == [torch.bfloat16]
    assert model[1].seen == [(False, torch.float32)]
    assert hidden.dtype == torch.float32
    # Autocast is back on for the modules after the kept one.
    assert after.dtype == torch.bfloat16


def test_autocast_is_restored_when_the_kept_module_raises():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    keep_fp32_(model, [nn.LayerNorm])
    with torch.autocast(**BF16):
        with pytest.raises(RuntimeError):
            model[1](torch.randn(3, 5))  # wrong width
        assert torch.is_autocast_enabled("cpu")
        assert model[0](torch.randn(3, 4)).dtype == torch.bfloat16


def test_without_autocast_a_kept_module_behaves_as_before():
    model, plain = net(), net()
    keep_fp32_(model, [nn.LayerNorm, "head"])
    x = torch.randn(5, 4)
    out, grads = forward_backward(model, x, autocast=False)
    ref_out, ref_grads = forward_backward(plain, x, autocast=False)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


class HandWritten(nn.Module):
    """The reference: BlockNet's forward with the norms and the head written out in fp32 by hand."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        fp32 = torch.autocast("cpu", enabled=False)
        x = self.inner.embed(x)
        for block in self.inner.blocks:
            h = torch.relu(block.lin(x))
            with fp32:
                x = block.norm(h.float())
        with fp32:
            return self.inner.head(x.float())


def test_bitwise_equal_to_hand_written_reference():
    model, reference = net(), HandWritten(net())
    assert keep_fp32_(model, [nn.LayerNorm, "head"]) == ["blocks.0.norm", "blocks.1.norm", "head"]
    x = torch.randn(6, 4)
    out, grads = forward_backward(model, x)
    ref_out, ref_grads = forward_backward(reference, x)
    assert out.dtype == torch.float32
    assert torch.equal(out, ref_out)
    assert grads.keys() == {k.removeprefix("inner.") for k in ref_grads}
    for k, g in ref_grads.items():
        assert torch.equal(grads[k.removeprefix("inner.")], g), k
    # And it really differs from leaving everything under autocast.
    plain_out, _ = forward_backward(net(), x)
    assert plain_out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "entries, expected",
    [
        ((nn.LayerNorm,), ["blocks.0.norm", "blocks.1.norm"]),
        (("head",), ["head"]),
        (("blocks.*.norm",), ["blocks.0.norm", "blocks.1.norm"]),
        (("blocks.1.*",), ["blocks.1.lin", "blocks.1.norm"]),
        ((nn.Linear, "head"), ["embed", "blocks.0.lin", "blocks.1.lin", "head"]),
        # Ancestor and descendant both match: only the ancestor is kept.
        (("blocks.0", nn.LayerNorm), ["blocks.0", "blocks.1.norm"]),
        # A ModuleList is never called: keeping it keeps what it holds.
        (("blocks", "blocks.*"), ["blocks.0", "blocks.1"]),
        ((nn.ModuleList,), ["blocks.0", "blocks.1"]),
        ((BlockNet,), [""]),
        ((nn.BatchNorm1d,), []),  # a class with no instances is not an error
    ],
)
def test_selection(entries, expected):
    model = net()
    assert [name for name, _ in select_modules(model, entries)] == expected
    assert keep_fp32_(model, entries) == expected


def test_isinstance_matches_subclasses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), ProbeNorm(8))
    assert keep_fp32_(model, nn.LayerNorm) == ["1"]


def test_nested_kept_modules_all_run_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), ProbeNorm(8)))
    inner_linear = []
    model[1][0].register_forward_hook(lambda m, i, o: inner_linear.append(o.dtype))
    assert keep_fp32_(model, ["1", ProbeNorm]) == ["1"]
    with torch.autocast(**BF16):
        out = model(torch.randn(3, 4))
    assert inner_linear == [torch.float32]
    assert model[1][1].seen == [(False, torch.float32)]
    assert out.dtype == torch.float32


def test_keyword_and_nested_inputs_are_cast_and_tuple_outputs_are_fp32():
    module = Scale()
    keep_fp32_(module, [Scale])
    x, a, b = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8, 8)
    with torch.autocast(**BF16):
        extra = {"pair": (a.bfloat16(), b.bfloat16()), "scale": torch.tensor(2.0, dtype=torch.float16)}
        y, z = module(x.bfloat16(), extra=extra)
    assert module.seen == {"x": torch.float32, "pair": [torch.float32, torch.float32], "scale": torch.float32}
    assert y.dtype == z.dtype == torch.float32
    assert torch.equal(y, x.bfloat16().float() * 0.5 + a.bfloat16().float() * 2.0)


def test_integer_and_float64_inputs_are_left_alone():
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4)
    keep_fp32_(embedding, [nn.Embedding])
    with torch.autocast(**BF16):
        assert embedding(torch.tensor([1, 2])).dtype == torch.float32
    double = nn.LayerNorm(4).double()
    keep_fp32_(double, [nn.LayerNorm])
    with torch.autocast(**BF16):
        assert double(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_validate_normalises_to_a_hashable_tuple():
    assert validate_keep_fp32([nn.LayerNorm, "head"]) == (nn.LayerNorm, "head")
    assert validate_keep_fp32(nn.LayerNorm) == (nn.LayerNorm,)
    assert validate_keep_fp32("blocks.*.norm") == ("blocks.*.norm",)
    assert validate_keep_fp32(()) == ()
    assert validate_keep_fp32(["head", "head", nn.LayerNorm, nn.LayerNorm]) == (nn.LayerNorm, "head")
    assert validate_keep_fp32(["head", nn.Linear, nn.LayerNorm]) == validate_keep_fp32([nn.LayerNorm, "head", nn.Linear])
    assert hash(validate_keep_fp32([nn.LayerNorm, "head"])) == hash((nn.LayerNorm, "head"))


@pytest.mark.parametrize("bad", [3, nn.LayerNorm(4), None, torch.Tensor, b"head"])
def test_bad_entry_is_a_type_error_naming_option_and_entry(bad):
    for call in (lambda: validate_keep_fp32([nn.LayerNorm, bad]), lambda: keep_fp32_(net(), ("head", bad))):
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "keep_fp32" in message and repr(bad) in message
        assert "nn.Module subclass" in message and "str pattern" in message


def test_module_instance_gets_a_hint():
    with pytest.raises(TypeError, match="not an instance"):
        validate_keep_fp32(nn.LayerNorm(4))


def test_empty_pattern_is_rejected():
    with pytest.raises(ValueError, match="empty pattern"):
        validate_keep_fp32([""])


def test_pattern_matching_nothing_names_pattern_and_close_modules():
    model = net()
    with pytest.raises(ValueError) as info:
        keep_fp32_(model, [nn.LayerNorm, "blocks.*.nrom"])
    message = str(info.value)
    assert "'blocks.*.nrom'" in message and "keep_fp32" in message
    assert "'blocks.0.norm'" in message
    # Nothing was changed before the error.
    assert "forward" not in vars(model.blocks[0].norm)


def test_pattern_with_no_close_name_still_lists_module_names():
    with pytest.raises(ValueError, match=r"'zzzzzz'.*'embed'"):
        select_modules(net(), ["zzzzzz"])


def test_state_dict_keys_and_module_tree_unchanged():
    model, plain = net(), net()
    keep_fp32_(model, [nn.LayerNorm, "head"])
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert type(model.head) is nn.Linear and repr(model) == repr(plain)
    plain.load_state_dict(model.state_dict())


def _copies(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return {
        "deepcopy": copy.deepcopy(model),
        "pickle": pickle.loads(pickle.dumps(model)),
        "torch.save": torch.load(buf, weights_only=False),
    }


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_fp32_and_use_their_own_parameters(how):
    model = net()
    keep_fp32_(model, [nn.LayerNorm, "head"])
    x = torch.randn(4, 4)
    out, _ = forward_backward(model, x)
    clone = _copies(model)[how]
    clone_out, _ = forward_backward(clone, x)
    assert clone_out.dtype == torch.float32 and torch.equal(clone_out, out)
    # The copy's kept head computes with the copy's weights, not the original's.
    with torch.no_grad():
        clone.head.bias.add_(1.0)
    torch.testing.assert_close(forward_backward(clone, x)[0], out + 1.0)
    assert torch.equal(forward_backward(model, x)[0], out)
    # And the copy can be copied again.
    torch.testing.assert_close(forward_backward(copy.deepcopy(clone), x)[0], out + 1.0)


def test_applying_twice_is_idempotent():
    model, once = net(), net()
    keep_fp32_(once, [nn.LayerNorm, "head"])
    names = keep_fp32_(model, [nn.LayerNorm, "head"])
    forwards = [model.get_submodule(n).forward for n in names]
    assert keep_fp32_(model, ("head", nn.LayerNorm)) == names
    assert keep_fp32_(copy.deepcopy(model), [nn.LayerNorm, "head"]) == names
    assert [model.get_submodule(n).forward for n in names] == forwards
    x = torch.randn(4, 4)
    out, grads = forward_backward(model, x)
    ref_out, ref_grads = forward_backward(once, x)
    assert torch.equal(out, ref_out) and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_an_existing_instance_forward_is_kept_and_the_signature_is_reported():
    import inspect

    torch.manual_seed(0)
    norm = nn.LayerNorm(4)
    norm.forward = lambda x: nn.LayerNorm.forward(norm, x) * 2  # e.g. patched by another library
    keep_fp32_(norm, [nn.LayerNorm])
    x = torch.randn(2, 4)
    with torch.autocast(**BF16):
        out = norm(x.bfloat16())
    with torch.autocast("cpu", enabled=False):
        assert torch.equal(out, nn.LayerNorm.forward(norm, x.bfloat16().float()) * 2)
    assert list(inspect.signature(nn.Linear(2, 2).forward).parameters) == ["input"]
    head = nn.Linear(2, 2)
    keep_fp32_(head, [nn.Linear])
    assert list(inspect.signature(head.forward).parameters) == ["input"]


def _eager_backward_autocast():
    """AOTAutograd traces the backward under the forward's autocast unless told not to
    (pytorch/pytorch#153044, #179804): a kept module's weight gradients would then be
    bf16 matmuls, unlike eager, where backward runs outside autocast. "off" matches eager."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "backward_pass_autocast"):
        pytest.skip("this torch has no torch._functorch.config.backward_pass_autocast")
    return functorch_config.patch(backward_pass_autocast="off")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_matches_eager_without_graph_breaks(backend):
    torch._dynamo.reset()
    model = net()
    keep_fp32_(model, [nn.LayerNorm, "head"])
    compiled_model = copy.deepcopy(model)
    # fullgraph=True turns any graph break into an error.
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    x = torch.randn(6, 4)
    with _eager_backward_autocast() if backend != "eager" else contextlib.nullcontext():
        for _ in range(2):
            out, grads = forward_backward(model, x)
            compiled_out, compiled_grads = forward_backward(compiled, x)
            assert compiled_out.dtype == torch.float32
            assert torch.equal(compiled_out, out)
            for k, g in grads.items():
                assert torch.equal(compiled_grads["_orig_mod." + k], g), k
    assert list(compiled.state_dict()) == ["_orig_mod." + k for k in model.state_dict()]


def test_modules_kept_by_an_earlier_policy_are_released():
    from precisionloop.keep_fp32 import is_kept

    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(keep_fp32=(nn.LayerNorm,)), device="cpu")
    assert is_kept(model[1])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(), device="cpu")
    assert not is_kept(model[1]) and "forward" not in model[1].__dict__


def test_pure_bf16_keeps_the_kept_modules_fp32_and_casts_the_rest_to_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Sequential(nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
    policy = dataclasses.replace(get_policy("bf16-pure"), keep_fp32=(nn.LayerNorm, "2"))
    trainer = Trainer(model, stochastic_adamw(model.parameters()), policy, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert trainer.step(B).stepped
    dtypes = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}
    fp32 = {n for n, d in dtypes.items() if d == torch.float32}
    assert fp32 == {"1.weight", "1.bias", "2.0.weight", "2.0.bias", "2.0.running_mean", "2.0.running_var"}
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in fp32)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # fp32 and bf16 ones both trained
    assert is_kept(model[1]) and is_kept(model[2]) and not is_kept(model[0])
