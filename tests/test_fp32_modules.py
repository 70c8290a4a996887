"""keep_fp32: chosen submodules run in float32 (autocast off, fp32 inputs) inside a bf16/fp16 autocast region."""

import contextlib
import copy
import io
import pickle

import pytest
import torch
from conftest import ProbeNorm
from torch import nn

from precisionloop.fp32_modules import keep_fp32_, select_modules, validate_keep_fp32

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


class Net(nn.Module):
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
    return Net(**kwargs)


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
    """The reference: Net's forward with the norms and the head written out in fp32 by hand."""

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
        ((Net,), [""]),
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
