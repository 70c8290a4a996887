"""Gradient guards and the fused-implementation switch for default optimizers (its CUDA path runs in test_gpu.py)."""

import pytest
import torch
from conftest import batches, tiny_mlp

from precisionloop.guard import FiniteGuard, ScalerGuard, fuse_default_optimizer


def _steps(model, optimizer, n=3):
    guard = FiniteGuard()
    for x, y in batches(n):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        found = guard.unscale_(optimizer, [p.grad for p in model.parameters()])
        guard.step(optimizer, found)
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_default_optimizer_switched_to_fused_equals_torch_fused(cls):
    kwargs = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.01}
    a, b = tiny_mlp(), tiny_mlp()
    switched = cls(a.parameters(), **kwargs)
    assert fuse_default_optimizer(switched, device_types=("cpu",))
    assert switched.param_groups[0]["fused"] is True and switched.param_groups[0]["foreach"] is False
    reference = cls(b.parameters(), fused=True, **kwargs)
    _steps(a, switched)
    _steps(b, reference)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, fused=False),
    lambda p: torch.optim.AdamW(p, foreach=True),
    lambda p: torch.optim.Adam(p, capturable=True),
    lambda p: torch.optim.RMSprop(p),
    lambda p: type("MyAdam", (torch.optim.Adam,), {})(p),
], ids=["fused=False", "foreach=True", "capturable", "RMSprop", "subclass"])
def test_optimizers_left_as_given(make):
    optimizer = make(tiny_mlp().parameters())
    groups = [dict(g) for g in optimizer.param_groups]
    assert not fuse_default_optimizer(optimizer, device_types=("cpu",))
    assert [dict(g) for g in optimizer.param_groups] == groups


def test_optimizer_with_state_left_as_given():
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    _steps(model, optimizer, 1)
    assert not fuse_default_optimizer(optimizer, device_types=("cpu",))


def test_not_switched_off_the_named_devices():
    assert not fuse_default_optimizer(torch.optim.AdamW(tiny_mlp().parameters()))  # CPU parameters, "cuda" only


def test_guards_share_one_interface():
    scaler_guard = ScalerGuard(torch.amp.GradScaler("cpu", init_scale=4.0))
    finite = FiniteGuard()
    loss = torch.tensor(2.0, requires_grad=True)
    assert scaler_guard.scale(loss).item() == 8.0 and finite.scale(loss) is loss
    assert finite.scale_tensor() is None and finite.scale_value() is None and finite.state_dict() is None
    assert scaler_guard.scale_value() == 4.0 and set(scaler_guard.state_dict()) >= {"scale", "growth_factor"}


def test_fsdp_refuses_fused_optimizers_without_dtensor_kernels():
    from precisionloop import distributed as dist

    params = list(tiny_mlp().parameters())
    with pytest.raises(ValueError, match="fused SGD.*Adam and AdamW work.*fused=False"):
        dist.check_optimizer(torch.optim.SGD(params, lr=0.1, fused=True), "fsdp")
    dist.check_optimizer(torch.optim.AdamW(params, lr=0.1, fused=True), "fsdp")  # its fused kernel takes DTensors
    dist.check_optimizer(torch.optim.SGD(params, lr=0.1), "fsdp")
    dist.check_optimizer(torch.optim.SGD(params, lr=0.1, fused=True), "ddp")
    assert dist.may_fuse(torch.optim.AdamW(params), "fsdp") and not dist.may_fuse(torch.optim.SGD(params, lr=0.1), "fsdp")


def _verdict(guard, grads, bad):
    grads[0].fill_(float("inf") if bad else 1.0)
    return guard.unscale_(None, grads)
