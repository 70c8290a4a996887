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


def test_each_verdict_is_a_fresh_zero_that_later_steps_leave_alone(monkeypatch):
    # The flags come from zero-filled slabs (no fill kernel a step); none may be handed out twice,
    # across a refill too, or a returned verdict would change under the caller.
    guard = FiniteGuard()
    monkeypatch.setattr(guard, "_SLAB", 3)
    grads = [torch.ones(4), torch.ones(2, 2)]
    pattern = [True, False, False, True, False, True, False, False]
    verdicts = [_verdict(guard, grads, bad) for bad in pattern]
    assert [bool(v) for v in verdicts] == pattern
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in verdicts)
    assert len({(v.untyped_storage().data_ptr(), v.storage_offset()) for v in verdicts}) == len(verdicts)


def test_the_one_kernel_path_dispatches_no_fill(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    guard = FiniteGuard()
    grads = [torch.ones(4), torch.ones(2, 2)]
    _verdict(guard, grads, False)  # the first step groups the gradients and allocates the first slab
    ops = Ops()
    with ops:
        for _ in range(5):
            guard.unscale_(None, grads)
    assert ops.seen.count("_amp_foreach_non_finite_check_and_unscale_") == 5
    assert not {"zeros", "zero_", "fill_", "full", "new_zeros"} & set(ops.seen), ops.seen
