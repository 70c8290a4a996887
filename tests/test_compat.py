"""Pins each private torch API that precisionloop/_compat.py relies on: that it still exists and does what we use it
for. A torch upgrade that changes one fails here, loudly. These run on the CPU; the ``gpu`` cases on CUDA too."""

import pytest
import torch
from torch import nn


def _with_grads(value=1.0):
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return model


def _scaled(scaler):
    scaler.scale(torch.ones(()))  # the scale tensor exists after the first scale()
    return scaler


def test_grad_scaler_gives_its_scale_as_a_tensor_without_reading_it():
    scale = _scaled(torch.amp.GradScaler("cpu", init_scale=8.0))._get_scale_async()
    assert isinstance(scale, torch.Tensor) and scale.item() == 8.0


def test_a_grad_scalers_update_from_our_own_flag_backs_off_and_grows():
    """torch._amp_update_scale_ on GradScaler's own tensors and settings, as GradScaler.update() calls it."""
    scaler = _scaled(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2))
    torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, torch.ones(()), scaler._growth_factor,
                             scaler._backoff_factor, scaler._growth_interval)
    assert scaler.get_scale() == 4.0
    for _ in range(2):
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, torch.zeros(()), scaler._growth_factor,
                                 scaler._backoff_factor, scaler._growth_interval)
    assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 0


_FP32_EDGES, _FP16_EDGES = [1e-45, -0.0, 3e38, -1.5], [6e-8, -0.0, 65504.0, -1.5]


@pytest.mark.parametrize("device, tensors", [
    ("cpu", [(torch.float32, _FP32_EDGES), (torch.float64, [2.0, -1e-310]), (torch.bfloat16, [-0.0, 1.5])]),
    pytest.param("cuda", [(torch.float32, _FP32_EDGES), (torch.float32, _FP32_EDGES[::-1])], marks=pytest.mark.gpu),
    pytest.param("cuda", [(torch.float16, _FP16_EDGES), (torch.float16, _FP16_EDGES[::-1])], marks=pytest.mark.gpu),
], ids=["cpu", "cuda-fp32", "cuda-fp16"])
def test_the_fused_inf_check_with_a_scale_of_one_keeps_every_bit(device, tensors):
    """GradScaler's fused check, used as a read-only check: each value comes back exactly, subnormals and signed zeros
    included, and a NaN anywhere sets found_inf."""
    grads = [torch.tensor(values, device=device, dtype=dtype) for dtype, values in tensors]
    before = [g.clone() for g in grads]
    found, one = torch.zeros((), device=device), torch.ones((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    assert found.item() == 0.0
    assert all(torch.equal(g, b) and torch.equal(g.signbit(), b.signbit()) for g, b in zip(grads, before))
    grads[-1][0] = float("nan")
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    assert found.item() == 1.0


def test_foreach_inf_norms_find_inf_and_nan_and_read_only():
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = [torch.tensor([1.0, -2.0]), torch.tensor([bad, 3.0], dtype=torch.bfloat16)]
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))])
        assert not torch.isfinite(norms).all() and grads[0].tolist() == [1.0, -2.0]
    assert torch.isfinite(torch.stack(torch._foreach_norm([torch.tensor([3e38]), torch.ones(2)], float("inf")))).all()


def test_tensors_are_grouped_by_device_and_dtype_in_order():
    a, b, c = torch.ones(2), torch.ones(3, dtype=torch.float64), torch.zeros(1)
    groups = torch._C._group_tensors_by_device_and_dtype([[a, b, c]], False)
    cpu = torch.device("cpu")
    assert set(groups) == {(cpu, torch.float32), (cpu, torch.float64)}
    (fp32,), _ = groups[(cpu, torch.float32)]
    assert [t is u for t, u in zip(fp32, (a, c))] == [True, True] and groups[(cpu, torch.float64)][0][0][0] is b


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
                                  lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)], ids=["SGD", "AdamW"])
def test_fused_optimizers_skip_on_the_device_when_found_inf_is_set(make):
    params = list(_with_grads().parameters())
    optimizer = make(params)
    assert optimizer._step_supports_amp_scaling
    before = [p.detach().clone() for p in params]
    optimizer.grad_scale, optimizer.found_inf = None, torch.ones(())
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # skipped on the device
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert not torch.equal(params[0], before[0])
    assert not getattr(torch.optim.SGD(params, lr=0.1), "_step_supports_amp_scaling", False)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_a_default_built_optimizer_switched_to_fused_equals_a_fused_one(cls):
    """What _compat does to run SGD/Adam/AdamW built at their default implementation fused."""
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    kwargs = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.01}
    switched, built = cls(a.parameters(), **kwargs), cls(b.parameters(), fused=True, **kwargs)
    for group in switched.param_groups:
        group["fused"], group["foreach"] = True, False
    switched.defaults["fused"], switched.defaults["foreach"] = True, False
    switched._step_supports_amp_scaling = True
    for _ in range(2):
        for model, optimizer in ((a, switched), (b, built)):
            model(torch.ones(4, 3)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    if cls is torch.optim.SGD:  # torch's device and dtype check ran, though nothing asked for it
        assert switched._need_device_dtype_check_for_fused is False


def test_compile_modes_and_the_error_type_of_a_failed_compile():
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor import list_mode_options

    assert {"default", "reduce-overhead", "max-autotune"} <= set(list_mode_options())
    assert issubclass(TorchDynamoException, Exception)


def test_the_compiled_backwards_autocast_setting_takes_off():
    import torch._functorch.config as config

    if not hasattr(config, "backward_pass_autocast"):
        pytest.skip("this torch has no backward_pass_autocast setting; _compat leaves it alone")
    before = config.backward_pass_autocast
    config.backward_pass_autocast = "off"
    try:
        assert config.backward_pass_autocast == "off"
    finally:
        config.backward_pass_autocast = before


def test_a_compiled_module_holds_the_original_as_orig_mod():
    from torch._dynamo.eval_frame import OptimizedModule

    linear = nn.Linear(2, 2)
    wrapped = torch.compile(linear)
    assert isinstance(wrapped, OptimizedModule) and wrapped._orig_mod is linear
    assert [n for n, _ in wrapped.named_parameters()] == ["_orig_mod.weight", "_orig_mod.bias"]


def test_onednns_bf16_check_and_the_norm_base_class():
    from torch.nn.modules.batchnorm import _NormBase

    assert isinstance(torch.ops.mkldnn._is_mkldnn_bf16_supported(), bool)
    assert isinstance(nn.BatchNorm2d(3), _NormBase) and isinstance(nn.InstanceNorm1d(3), _NormBase)
    assert not isinstance(nn.LayerNorm(3), _NormBase) and not isinstance(nn.GroupNorm(1, 3), _NormBase)


def test_a_sparse_gradients_stored_values():
    embedding = nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    values = embedding.weight.grad._values()
    assert embedding.weight.grad.is_sparse and not values.is_sparse and values.shape == (2, 4)
