"""keep_fp32: chosen submodules run in float32 (autocast off, fp32 inputs) inside a bf16/fp16 autocast region.

Through the Trainer: kept modules run in fp32, the training equals a hand-written torch.amp loop, eager and
compiled, bad entries fail before the model is touched, policies stay values, checkpoints say when the choice
differs. Then the mechanism, ``keep_fp32_``, on its own (DDP and FSDP2: test_distributed).
"""

import contextlib
import copy
import dataclasses
import inspect
import io
import pickle
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn
from conftest import B, ProbeNorm

from precisionloop import BF16AdamW, BF16Policy, BF16PurePolicy, FP16Policy, Trainer, get_policy
from precisionloop.keep_fp32 import is_kept, keep_fp32_, select_modules, validate_keep_fp32, within

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")

POLICIES = {"bf16": BF16Policy, "fp16": FP16Policy}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class ProbeLinear(nn.Linear):
    """A Linear that records, on each call, whether CPU autocast is on and its input's dtype."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return super().forward(x)


class Net(nn.Module):
    """Linear -> ReLU -> LayerNorm -> head Linear. ``hand_fp32`` names the modules whose fp32 region is written out
    by hand (autocast off, ``.float()`` inputs): the reference for the Trainer."""

    def __init__(self, seed=0, probes=False, hand_fp32=()):
        super().__init__()
        torch.manual_seed(seed)
        linear, norm = (ProbeLinear, ProbeNorm) if probes else (nn.Linear, nn.LayerNorm)
        self.body, self.norm, self.head = linear(8, 16), norm(16), linear(16, 4)
        self.hand_fp32 = set(hand_fp32)

    def _call(self, name, x):
        if name not in self.hand_fp32:
            return getattr(self, name)(x)
        with torch.autocast("cpu", enabled=False):
            return getattr(self, name)(x.float())

    def forward(self, x):
        return self._call("head", self._call("norm", torch.relu(self.body(x))))


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
def test_kept_modules_run_with_autocast_off_on_fp32_inputs(precision):
    low, policy = LOW[precision], POLICIES[precision]
    model, outputs = Net(probes=True), []
    assert trainer_for(model, policy(keep_fp32=(nn.LayerNorm,)), loss_fn=recording_loss(outputs)).step(data(1)[0]).stepped
    assert model.norm.seen == [(False, torch.float32)]  # kept: autocast off, its low-precision input cast up
    assert model.body.seen == model.head.seen == [(True, torch.float32)] and outputs == [low]  # the rest: autocast on
    by_name, outputs = Net(probes=True), []
    trainer_for(by_name, policy(keep_fp32=("he*",)), loss_fn=recording_loss(outputs)).step(data(1)[0])
    assert [n for n, m in by_name.named_modules() if is_kept(m)] == ["head"] and outputs == [torch.float32]
    assert by_name.head.seen == [(False, torch.float32)] and by_name.norm.seen == [(True, low)]  # the control


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
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_is_bitwise_equal_to_a_hand_written_amp_loop(precision):
    batches, model = data(3), Net()
    trainer = trainer_for(model, POLICIES[precision](keep_fp32=(nn.LayerNorm, "head")))
    assert all(trainer.step(b).stepped for b in batches)
    reference = hand_loop(Net(hand_fp32=("norm", "head")), batches, precision)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    plain = hand_loop(Net(), batches, precision)  # and keep_fp32 changed the training
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def train_three_steps(policy, **kwargs):
    model, outputs, norm_outputs = Net(), [], []
    model.norm.register_forward_hook(lambda m, i, o: norm_outputs.append(o.dtype))
    trainer = trainer_for(model, policy, loss_fn=recording_loss(outputs), **kwargs)
    for b in data(3):
        trainer.step(b)
    return model, outputs, norm_outputs


def test_compiled_step_matches_eager_and_keeps_outputs_fp32():
    policy = BF16Policy(keep_fp32=(nn.LayerNorm, "head"))
    eager, eager_outputs, _ = train_three_steps(policy)
    torch._dynamo.reset()
    compiled, outputs, norm_outputs = train_three_steps(policy, compile="default")
    assert outputs == eager_outputs == norm_outputs == [torch.float32] * 3
    # Measured on torch 2.14 CPU: <= 3e-8 apart; a compiled backward recast to bf16 would be ~4e-4 apart.
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), norm=nn.BatchNorm2d(4), pool=nn.AdaptiveAvgPool2d(1),
                                     flat=nn.Flatten(), head=nn.Linear(4, 2)))


def test_a_pattern_matching_nothing_fails_at_construction_naming_close_names_and_leaves_the_model_untouched():
    model = conv_net()
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # channels_last=True: preparing the model would change its weights' layout, so a late failure would show.
    policy = BF16Policy(keep_fp32=(nn.BatchNorm2d, "haed"), channels_last=True)
    with pytest.raises(ValueError, match=r"keep_fp32 pattern 'haed' matches no module.*head"):
        Trainer(model, optimizer, policy, device="cpu")
    assert not any(is_kept(m) for m in model.modules()) and all("forward" not in vars(m) for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and v.stride() == before[k][1], k
    trainer = Trainer(model, optimizer, dataclasses.replace(policy, keep_fp32=(nn.BatchNorm2d, "head")), device="cpu")
    assert trainer.step((torch.randn(2, 3, 6, 6), torch.tensor([0, 1]))).stepped
    assert [n for n, m in model.named_modules() if is_kept(m)] == ["norm", "head"]


@pytest.mark.parametrize("bad", [3, nn.LayerNorm(4), None, torch.Tensor, b"head"])
def test_a_bad_entry_is_a_type_error_naming_it(bad):
    for call in (lambda: BF16Policy(keep_fp32=(bad,)), lambda: FP16Policy(keep_fp32=("head", bad)),
                 lambda: keep_fp32_(net(), ("head", bad))):
        with pytest.raises(TypeError, match=r"keep_fp32 takes nn.Module subclasses and str name patterns") as info:
            call()
        assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match="not an instance"):
        validate_keep_fp32(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="empty pattern"):
        BF16Policy(keep_fp32=("",))


def test_policies_stay_values_normalised_hashable_and_shown():
    policy = BF16Policy(keep_fp32=(nn.LayerNorm, "head"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.keep_fp32 = ()
    same = BF16Policy(keep_fp32=["head", nn.LayerNorm, "head", nn.LayerNorm])  # a list, duplicates, another order
    assert same == policy and hash(same) == hash(policy) and same.keep_fp32 == (nn.LayerNorm, "head")
    assert BF16Policy(keep_fp32=("head",)) != policy and BF16Policy(keep_fp32=nn.LayerNorm).keep_fp32 == (nn.LayerNorm,)
    assert "keep_fp32=(" in repr(policy) and "LayerNorm" in repr(policy) and "'head'" in repr(policy)
    assert dataclasses.replace(get_policy("bf16"), keep_fp32=["head"]).keep_fp32 == ("head",)
    assert get_policy("bf16").keep_fp32 == () == get_policy("fp16").keep_fp32


@pytest.mark.filterwarnings("ignore:checkpoint .* was saved under:UserWarning")  # what a load says is checkpoint's
def test_a_checkpoint_moves_between_policies_keeping_other_modules(tmp_path):
    kept = trainer_for(Net(), BF16Policy(keep_fp32=(nn.LayerNorm, "head")))
    kept.step(data(1)[0])
    kept.save(tmp_path / "c.pt")
    plain = trainer_for(Net(seed=3), BF16Policy())
    plain.load(tmp_path / "c.pt")  # the same keys: keep_fp32 adds no module
    assert plain.global_step == 1
    assert all(torch.equal(p, q) for p, q in zip(kept.model.parameters(), plain.model.parameters()))
    assert plain.step(data(1, seed=2)[0]).stepped


def test_modules_kept_by_an_earlier_policy_are_released():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(keep_fp32=(nn.LayerNorm,)), device="cpu")
    assert is_kept(model[1])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(), device="cpu")
    assert not is_kept(model[1]) and "forward" not in vars(model[1])


def test_pure_bf16_keeps_the_kept_modules_fp32_and_casts_the_rest_to_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Sequential(nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
    policy = dataclasses.replace(get_policy("bf16-pure"), keep_fp32=(nn.LayerNorm, "2"))
    trainer = Trainer(model, BF16AdamW(model.parameters(), lr=1e-2), policy, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert trainer.step(B).stepped
    dtypes = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}
    fp32 = {n for n, d in dtypes.items() if d == torch.float32}
    assert fp32 == {"1.weight", "1.bias", "2.0.weight", "2.0.bias", "2.0.running_mean", "2.0.running_var"}
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in fp32)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # fp32 and bf16 ones both trained


# The mechanism on its own ----------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


class BlockNet(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class HandWritten(nn.Module):
    """BlockNet's forward with the norms and the head written out in fp32 by hand."""

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


def net(seed=0):
    torch.manual_seed(seed)
    return BlockNet()


def forward_backward(model, x, autocast=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast(**BF16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    return out, {name.removeprefix("_orig_mod.").removeprefix("inner."): p.grad.clone()
                 for name, p in model.named_parameters()}


def same(a, b):
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_bitwise_equal_to_the_hand_written_reference_and_unchanged_without_autocast():
    model, x = net(), torch.randn(6, 4)
    assert keep_fp32_(model, [nn.LayerNorm, "head"]) == ["blocks.0.norm", "blocks.1.norm", "head"]
    out = forward_backward(model, x)
    assert out[0].dtype == torch.float32 and same(out, forward_backward(HandWritten(net()), x))
    assert forward_backward(net(), x)[0].dtype == torch.bfloat16  # the control
    assert same(forward_backward(model, x, autocast=False), forward_backward(net(), x, autocast=False))


def test_autocast_is_back_on_after_a_kept_module_and_after_one_that_raises():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), ProbeNorm(8), nn.Linear(8, 2))
    assert keep_fp32_(model, [nn.LayerNorm]) == ["1"]  # isinstance: ProbeNorm is a LayerNorm
    with torch.autocast(**BF16):
        hidden = model[:2](torch.randn(3, 4))
        assert model[1].seen == [(False, torch.float32)] and hidden.dtype == torch.float32
        assert model[2](hidden).dtype == torch.bfloat16
        with pytest.raises(RuntimeError):
            model[1](torch.randn(3, 5))  # wrong width
        assert torch.is_autocast_enabled("cpu") and model[0](torch.randn(3, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("entries, expected", [
    ((nn.LayerNorm,), ["blocks.0.norm", "blocks.1.norm"]),
    (("blocks.*.norm",), ["blocks.0.norm", "blocks.1.norm"]),
    (("blocks.1.*",), ["blocks.1.lin", "blocks.1.norm"]),
    ((nn.Linear, "head"), ["embed", "blocks.0.lin", "blocks.1.lin", "head"]),
    (("blocks.0", nn.LayerNorm), ["blocks.0", "blocks.1.norm"]),  # an ancestor and its descendant: the ancestor
    (("blocks", "blocks.*"), ["blocks.0", "blocks.1"]),  # a ModuleList is never called: what it holds is kept
    ((nn.ModuleList,), ["blocks.0", "blocks.1"]),
    ((BlockNet,), [""]),
    ((nn.BatchNorm1d,), []),  # a class with no instance is not an error
])
def test_selection(entries, expected):
    model = net()
    assert [name for name, _ in select_modules(model, entries)] == expected
    assert keep_fp32_(model, entries) == expected


def test_within_is_by_whole_name_parts():
    assert within("blocks.0.norm", ["blocks.0"]) and within("blocks.0", ["blocks.0"]) and within("head", [""])
    assert not within("blocks.10", ["blocks.1"]) and not within("blocks", ["blocks.0"])


def test_everything_inside_a_kept_module_runs_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), ProbeNorm(8)))
    inner = []
    model[1][0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    assert keep_fp32_(model, ["1", ProbeNorm]) == ["1"]
    with torch.autocast(**BF16):
        assert model(torch.randn(3, 4)).dtype == torch.float32
    assert inner == [torch.float32] and model[1][1].seen == [(False, torch.float32)]


class Scale(nn.Module):
    """Takes keyword, nested and namedtuple inputs and returns a tuple."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x, *, extra):
        self.seen = [x.dtype, *(t.dtype for t in extra["pair"]), extra["pair"].b.dtype, extra["steps"].dtype]
        return x * self.weight + extra["pair"].a * 2.0, x @ extra["pair"].b


def test_nested_inputs_are_cast_up_and_integer_and_float64_ones_left_alone():
    module, pair = Scale(), namedtuple("Pair", "a b")
    keep_fp32_(module, [Scale])
    x, a, b = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8, 8)
    with torch.autocast(**BF16):
        y, z = module(x.bfloat16(), extra={"pair": pair(a.bfloat16(), b.half()), "steps": torch.tensor([1])})
    assert module.seen == [torch.float32] * 4 + [torch.int64] and y.dtype == z.dtype == torch.float32
    assert torch.equal(y, x.bfloat16().float() * 0.5 + a.bfloat16().float() * 2.0)
    double = nn.LayerNorm(4).double()
    keep_fp32_(double, [nn.LayerNorm])
    with torch.autocast(**BF16):
        assert double(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_state_dict_keys_module_tree_and_repr_are_unchanged():
    model, plain = net(), net()
    keep_fp32_(model, [nn.LayerNorm, "head"])
    assert list(model.state_dict()) == list(plain.state_dict()) and repr(model) == repr(plain)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()] and type(model.head) is nn.Linear
    plain.load_state_dict(model.state_dict())


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_fp32_and_use_their_own_parameters(how):
    model, x = net(), torch.randn(4, 4)
    keep_fp32_(model, [nn.LayerNorm, "head"])
    out, _ = forward_backward(model, x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    clone = {"deepcopy": lambda: copy.deepcopy(model), "pickle": lambda: pickle.loads(pickle.dumps(model)),
             "torch.save": lambda: torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)}[how]()
    assert torch.equal(forward_backward(clone, x)[0], out)
    with torch.no_grad():
        clone.head.bias.add_(1.0)  # the copy's kept head computes with the copy's weights
    torch.testing.assert_close(forward_backward(clone, x)[0], out + 1.0)
    assert torch.equal(forward_backward(model, x)[0], out)
    torch.testing.assert_close(forward_backward(copy.deepcopy(clone), x)[0], out + 1.0)


def test_applying_again_wraps_nothing_twice_and_keeps_an_earlier_instance_forward():
    model, once, x = net(), net(), torch.randn(4, 4)
    keep_fp32_(once, [nn.LayerNorm, "head"])
    names = keep_fp32_(model, [nn.LayerNorm, "head"])
    assert keep_fp32_(model, ("head", nn.LayerNorm)) == names == keep_fp32_(copy.deepcopy(model), [nn.LayerNorm, "head"])
    assert same(forward_backward(model, x), forward_backward(once, x))
    torch.manual_seed(0)
    norm = nn.LayerNorm(4)
    norm.forward = lambda x: nn.LayerNorm.forward(norm, x) * 2  # patched by another library, say
    keep_fp32_(norm, [nn.LayerNorm])
    with torch.autocast(**BF16):
        out = norm(x.bfloat16())
    with torch.autocast("cpu", enabled=False):
        assert torch.equal(out, nn.LayerNorm.forward(norm, x.bfloat16().float()) * 2)
    head = nn.Linear(2, 2)
    keep_fp32_(head, [nn.Linear])
    assert list(inspect.signature(head.forward).parameters) == ["input"]


def _eager_backward_autocast():
    """AOTAutograd traces the backward under the forward's autocast unless told not to (pytorch/pytorch#153044):
    a kept module's weight gradients would be bf16 matmuls, unlike eager. "off" matches eager."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "backward_pass_autocast"):
        pytest.skip("this torch has no torch._functorch.config.backward_pass_autocast")
    return functorch_config.patch(backward_pass_autocast="off")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_matches_eager_without_graph_breaks(backend):
    torch._dynamo.reset()
    model, x = net(), torch.randn(6, 4)
    keep_fp32_(model, [nn.LayerNorm, "head"])
    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)  # a graph break would raise
    with _eager_backward_autocast() if backend != "eager" else contextlib.nullcontext():
        for _ in range(2):
            out = forward_backward(compiled, x)
            assert out[0].dtype == torch.float32 and same(out, forward_backward(model, x))
    assert list(compiled.state_dict()) == ["_orig_mod." + k for k in model.state_dict()]


def test_bf16_pure_keeps_a_weight_a_kept_module_shares_in_fp32():
    """A tied embedding and head, the head kept in fp32: their one weight stays fp32, as the kept head needs."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.embed(x))

    model = Tied()
    Trainer(model, BF16AdamW(model.parameters()), BF16PurePolicy(keep_fp32=("head",)), device="cpu")
    assert model.head.weight is model.embed.weight and model.head.weight.dtype == torch.float32
