"""Gradient accumulation (grad_accum_steps, flush) and gradient clipping on unscaled gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from conftest import B, batches, tiny_mlp, unfrozen_late

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


@pytest.mark.parametrize("accum", [1, 2])
def test_clipping_sees_the_unscaled_gradients_unscaled_once_per_optimizer_step(accum):
    data = batches(accum)
    model, reference = tiny_mlp(), tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", device="cpu", max_grad_norm=1e9,
                      grad_accum_steps=accum)
    result = [trainer.step(b) for b in data][-1]
    for x, y in data:  # the mean gradient of the accumulated batches, in fp16 autocast, without a scaler
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(reference(x), y) / accum
        loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()]))
    assert result.stepped and result.grad_norm == pytest.approx(float(expected), rel=1e-3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_accumulation_equals_one_large_batch(precision):
    (x, y), = batches(1, batch_size=8)
    big, small = tiny_mlp(), tiny_mlp()
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.5), precision, device="cpu").step((x, y))
    trainer = Trainer(small, torch.optim.SGD(small.parameters(), lr=0.5), precision, device="cpu", grad_accum_steps=4)
    results = [trainer.step((x[i:i + 2], y[i:i + 2])) for i in range(0, 8, 2)]
    assert [r.stepped for r in results] == [False, False, False, True]
    tol = dict(atol=1e-6, rtol=1e-5) if precision == "fp32" else dict(atol=2e-3, rtol=1e-2)
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, **tol)


def test_flush_steps_a_partial_accumulation_as_its_mean():
    (x, y), = batches(1, batch_size=6)
    big, small = tiny_mlp(), tiny_mlp()
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.5), "fp32", device="cpu").step((x, y))
    trainer = Trainer(small, torch.optim.SGD(small.parameters(), lr=0.5), "fp32", device="cpu", grad_accum_steps=4)
    assert trainer.flush() is None
    for i in range(0, 6, 2):
        assert not trainer.step((x[i:i + 2], y[i:i + 2])).stepped
    assert trainer.flush().stepped
    assert trainer.flush() is None
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_late_unfrozen_parameter_is_clipped():
    """max_grad_norm clips a late-added parameter's gradient too."""
    m, t = unfrozen_late("fp32", max_grad_norm=0.01)
    ref = copy.deepcopy(m)
    result = t.step(B)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(B[0]), B[1]).backward()
    total = nn.utils.clip_grad_norm_(list(ref.parameters()), 0.01)
    ref_opt.step()
    assert result.grad_norm == pytest.approx(float(total), rel=1e-5)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_an_error_before_the_optimizer_step_puts_the_batch_count_back_to_its_first_micro_batch():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    good = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    with pytest.raises(TypeError, match="expects a batch of"):
        trainer.fit([good, (good[0],), good, good], epochs=1, progress=False)
    # batch 0 was accumulated, to be stepped with the refused batch 1: both are to be trained again
    assert trainer.batch_in_epoch == 0 and trainer.flush() is None and model.weight.grad is None


@pytest.mark.gpu
def test_flush_of_accumulated_gradients_on_cuda():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cuda", grad_accum_steps=2)
    trainer.step(batches(1)[0])
    result = trainer.flush()
    assert result.stepped and trainer.global_step == 1
    assert trainer.fit(batches(3), progress=False)[0]["steps"] == 2  # an epoch that ends with gradients accumulated
