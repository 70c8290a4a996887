"""Pins every private torch API behind precisionloop._compat: a torch upgrade that changes one fails here, loudly.

These run on the CPU (torch 2.14 in CI) and on CUDA (torch 2.11).
"""

import pytest
import torch
from torch import nn

from precisionloop import _compat


def _grad_model():
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model


def test_scaler_found_inf_reads_the_verdict_of_unscale():
    model = _grad_model()
    model.weight.grad[0, 0] = float("inf")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    found = _compat.scaler_found_inf(scaler, optimizer)
    assert isinstance(found, torch.Tensor) and found.item() == 1.0
    assert torch.equal(model.bias.grad, torch.full_like(model.bias, 0.25))  # unscaled by 1/4


def test_scaler_scale_tensor_is_the_scale_on_the_device():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists after the first scale()
    scale = _compat.scaler_scale_tensor(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 8.0 == scaler.get_scale()


def test_group_by_device_and_dtype_keeps_each_dtype_apart_in_order():
    a, b, c = torch.ones(2), torch.ones(3, dtype=torch.float64), torch.zeros(1)
    groups = _compat.group_by_device_and_dtype([a, b, c])
    assert set(groups) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64)}
    assert [t is u for t, u in zip(groups[(torch.device("cpu"), torch.float32)][0][0], (a, c))] == [True, True]
    assert groups[(torch.device("cpu"), torch.float64)][0][0][0] is b


def test_fused_optimizers_take_the_verdict_on_the_device():
    params = list(_grad_model().parameters())
    assert _compat.skips_on_device(torch.optim.SGD(params, lr=0.1, fused=True))
    assert _compat.skips_on_device(torch.optim.AdamW(params, lr=0.1, fused=True))
    assert not _compat.skips_on_device(torch.optim.SGD(params, lr=0.1))
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    before = [p.detach().clone() for p in params]
    _compat.step_with_verdict(optimizer, torch.ones(()))
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # skipped on the device
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    _compat.step_with_verdict(optimizer, torch.zeros(()))
    assert not torch.equal(params[0], before[0])


def test_foreach_arithmetic():
    tensors = [torch.ones(2), torch.full((3,), 4.0)]
    _compat.foreach_mul_(tensors, 3.0)
    _compat.foreach_div_(tensors, 2.0)
    assert tensors[0].tolist() == [1.5, 1.5] and tensors[1].tolist() == [6.0] * 3


def test_compile_modes_and_errors():
    modes = _compat.compile_modes()
    assert {"default", "reduce-overhead", "max-autotune"} <= set(modes)
    types = _compat.compile_error_types()
    assert all(isinstance(t, type) and issubclass(t, BaseException) for t in types)


def test_cpu_bf16_native_is_a_bool():
    assert isinstance(_compat.cpu_bf16_native(), bool)


def test_is_batch_norm():
    assert _compat.is_batch_norm(nn.BatchNorm2d(3)) and _compat.is_batch_norm(nn.InstanceNorm1d(3))
    assert not _compat.is_batch_norm(nn.LayerNorm(3)) and not _compat.is_batch_norm(nn.GroupNorm(1, 3))


def test_dense_values_of_a_sparse_gradient():
    embedding = nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    values = _compat.dense_values(embedding.weight.grad)
    assert not values.is_sparse and values.shape[-1] == 4
    dense = torch.ones(3)
    assert _compat.dense_values(dense) is dense


def test_use_fused_implementation_matches_a_fused_constructor():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    switched = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    _compat.use_fused_implementation(switched)
    built = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, fused=True)
    assert _compat.skips_on_device(switched) and switched.param_groups[0]["fused"] is True
    for _ in range(2):
        for model, optimizer in ((a, switched), (b, built)):
            model(torch.ones(4, 3)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_compiled_backward_like_eager_sets_and_restores_the_setting():
    import torch._functorch.config as config

    if not hasattr(config, "backward_pass_autocast"):
        pytest.skip("this torch has no backward_pass_autocast setting; the context manager is a no-op")
    before = config.backward_pass_autocast
    with _compat.compiled_backward_like_eager():
        assert config.backward_pass_autocast == "off"
    assert config.backward_pass_autocast == before
    with pytest.raises(RuntimeError):
        with _compat.compiled_backward_like_eager():
            raise RuntimeError("boom")
    assert config.backward_pass_autocast == before


def test_forget_unscale_lets_the_next_step_unscale_again():
    model = _grad_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)
    _compat.forget_unscale(scaler)
    scaler.unscale_(optimizer)  # no "already been called" error


def test_compiled_original_finds_the_module_torch_compile_wrapped():
    """Pins dynamo's OptimizedModule and its _orig_mod: checkpoints name parameters without that prefix."""
    linear = nn.Linear(2, 2)
    wrapped = torch.compile(linear)
    assert _compat.compiled_original(wrapped) is linear
    assert _compat.compiled_original(linear) is None
    assert [n for n, _ in wrapped.named_parameters()] == ["_orig_mod.weight", "_orig_mod.bias"]


def test_non_finite_any_sets_found_and_leaves_the_gradients_alone():
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = [torch.tensor([1.0, 2.0]), torch.tensor([bad, 3.0], dtype=torch.bfloat16), torch.zeros(0)]
        found = torch.zeros(())
        _compat.non_finite_any_(grads, found)
        assert found.item() == 1.0 and grads[0].tolist() == [1.0, 2.0]
    clean, found = [torch.tensor([4.0, -1e38]), torch.tensor([3e38])], torch.zeros(())
    before = [g.clone() for g in clean]
    _compat.non_finite_any_(clean, found)  # large finite values are no inf: norms are maxima, not sums
    assert found.item() == 0.0 and all(torch.equal(g, b) for g, b in zip(clean, before))


def _spy_on_the_fused_check(monkeypatch) -> list:
    calls, fused = [], torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a: calls.append(len(a[0])) or fused(*a))
    return calls


_FP32_EDGES, _FP16_EDGES = [1e-45, -0.0, 3e38, -1.5], [6e-8, -0.0, 65504.0, -1.5]


@pytest.mark.parametrize("device, tensors", [
    ("cpu", [(torch.float32, _FP32_EDGES), (torch.float64, [2.0, -1e-310])]),
    pytest.param("cuda", [(torch.float32, _FP32_EDGES), (torch.float32, _FP32_EDGES[::-1])], marks=pytest.mark.gpu),
    pytest.param("cuda", [(torch.float16, _FP16_EDGES), (torch.float16, _FP16_EDGES[::-1])], marks=pytest.mark.gpu),
], ids=["cpu", "cuda-fp32", "cuda-fp16"])
def test_small_gradients_take_the_fused_check_in_one_launch_and_keep_every_bit(monkeypatch, device, tensors):
    """GradScaler's fused check with a scale of one writes back each value exactly, subnormals and signed zeros
    included (on the CPU several times faster than the inf-norms; on CUDA one launch instead of theirs)."""
    calls = _spy_on_the_fused_check(monkeypatch)
    grads = [torch.tensor(values, device=device, dtype=dtype) for dtype, values in tensors]
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    _compat.non_finite_any_(grads, found)
    assert calls == [2] and found.item() == 0.0
    assert all(torch.equal(g, b) and torch.equal(g.signbit(), b.signbit()) for g, b in zip(grads, before))
    grads[-1][0] = float("nan")
    _compat.non_finite_any_(grads, found)
    assert found.item() == 1.0


def test_non_finite_any_off_the_cpu_and_cuda_reads_the_norms(monkeypatch):
    """Other backends may lack the fused check's kernel: they keep the read-only norms (meta tensors stand in)."""
    used = []
    monkeypatch.setattr(_compat, "norms_non_finite_", lambda grads, found: used.append("norms"))
    monkeypatch.setattr(_compat, "fused_non_finite_", lambda grads, found: used.append("fused"))
    _compat.non_finite_any_([torch.ones(3, device="meta")], torch.zeros((), device="meta"))
    _compat.non_finite_any_([torch.ones(3)], torch.zeros(()))
    assert used == ["norms", "fused"]


@pytest.mark.gpu
def test_non_finite_any_on_cuda_checks_large_or_bf16_gradients_by_their_norms(monkeypatch):
    calls = _spy_on_the_fused_check(monkeypatch)
    monkeypatch.setattr(_compat, "FUSED_CHECK_MAX_ELEMENTS", 8)
    fp64 = torch.tensor([5e-324, 1e308, 1 / 3, 1.0], device="cuda", dtype=torch.float64)  # beyond fp32's range
    for grads in ([torch.ones(9, device="cuda")], [torch.ones(2, device="cuda", dtype=torch.bfloat16)], [fp64]):
        found = torch.zeros((), device="cuda")
        _compat.non_finite_any_(grads, found)
        assert found.item() == 0.0
        grads[0][-1] = float("inf")
        _compat.non_finite_any_(grads, found)
        assert found.item() == 1.0
    assert calls == []  # none took the fused check: its CUDA kernel takes no bf16, and flags 1e308 in fp64 as inf
    assert fp64[:3].tolist() == [5e-324, 1e308, 1 / 3]


def test_non_finite_any_on_the_cpu_under_a_float64_default_and_for_complex_gradients():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the fused check takes its scale in fp32 only
    try:
        found = torch.zeros((), dtype=torch.float32)
        _compat.non_finite_any_([torch.tensor([1.0, float("inf")])], found)
        assert found.item() == 1.0
    finally:
        torch.set_default_dtype(previous)
    for bad, expected in ((complex(1, 2), 0.0), (complex(float("nan"), 0), 1.0)):  # the fused check takes no complex
        found = torch.zeros(())
        _compat.non_finite_any_([torch.tensor([bad, 1j]), torch.ones(2)], found)
        assert found.item() == expected
