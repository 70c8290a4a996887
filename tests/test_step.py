"""The optimizer step: equal to a hand-written torch.amp loop, what a step returns, the batches it takes, and
an interrupt inside a step."""

import copy
import warnings

import pytest
import torch
from torch import nn
from conftest import B, batches, mk, same_models, tiny_cnn, tiny_mlp

from precisionloop import BF16Policy, FP16Policy, FP32Policy, Trainer, get_policy

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def hand_loop(model, data, dtype, max_grad_norm, init_scale=2.0**16):
    """The canonical torch.amp recipe, written out by hand."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=dtype == torch.float16)
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return scaler


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp16-overflowing"])
def test_equals_hand_written_amp_loop(precision, max_grad_norm):
    data = batches(6)
    init_scale = 2.0**100 if precision == "fp16-overflowing" else 2.0**16
    dtype = DTYPES[precision.split("-")[0]]
    reference = tiny_mlp()
    ref_scaler = hand_loop(reference, data, dtype, max_grad_norm, init_scale)

    model = tiny_mlp()
    policy = {"fp32": FP32Policy(), "bf16": BF16Policy(), "fp16": FP16Policy(init_scale=init_scale)}[precision.split("-")[0]]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy,
                      device="cpu", max_grad_norm=max_grad_norm)
    results = [trainer.step(b) for b in data]

    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    if dtype == torch.float16:
        assert trainer.scaler.get_scale() == ref_scaler.get_scale()
        if precision == "fp16-overflowing":
            assert results[0].skipped and trainer.stats.skipped > 0
    assert all(r.grad_norm is not None for r in results) is (max_grad_norm is not None)


def test_step_result_is_unscaled_undivided_loss():
    (x, y), = batches(1)
    model = tiny_mlp()
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(copy.deepcopy(model)(x), y))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    result = trainer.step((x, y))
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert not result.stepped and not result.skipped and result.grad_norm is None


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, a, b):
        return self.linear(a + b).squeeze(-1)


class RegressionTrainer(Trainer):
    def forward_batch(self, batch):
        return self.model(batch["a"], batch["b"]), batch["y"]

    def compute_loss(self, outputs, targets):
        return nn.functional.mse_loss(outputs, targets)


def test_forward_batch_and_compute_loss_overrides_for_other_batch_shapes():
    model = TwoInputs()
    trainer = RegressionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    batch = {"a": torch.randn(4, 16), "b": torch.randn(4, 16), "y": torch.randn(4)}
    assert trainer.step(batch).stepped


def test_frozen_parameters_may_stay_out_of_the_optimizer():
    model = tiny_mlp()
    model[0].requires_grad_(False)
    trainer = Trainer(model, torch.optim.SGD(model[2].parameters(), lr=0.1), "bf16", device="cpu")
    frozen = model[0].weight.clone()
    assert trainer.step(batches(1)[0]).stepped
    assert torch.equal(model[0].weight, frozen)


def test_no_deprecated_amp_warnings():
    model = tiny_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(), device="cpu")
        trainer.step(batches(1)[0])


class _LossAs(Trainer):
    """Returns the loss in another dtype, and for bf16 shaped (1,)."""

    dtype = torch.bfloat16

    def compute_loss(self, outputs, targets):
        loss = super().compute_loss(outputs, targets).to(self.dtype)
        return loss.reshape(1) if self.dtype == torch.bfloat16 else loss


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "fp32"), (torch.bfloat16, "fp16"), (torch.float64, "fp32")])
def test_the_result_keeps_the_loss_in_the_dtype_it_was_computed_in(dtype, precision):
    model = tiny_mlp()
    trainer = _LossAs(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=2)
    trainer.dtype = dtype
    x, y = batches(1)[0]
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model(x), y).to(dtype).item()
    first, second = trainer.step((x, y)), trainer.step((x, y))
    assert first.loss == second.loss == expected and not first.stepped and second.stepped
    assert trainer.stats.steps == 1 and (second.scale is None) == (precision == "fp32")


def test_to_device_lays_out_image_batches_as_the_policy_says():
    model = tiny_cnn()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), BF16Policy(channels_last=True), device="cpu")
    x, y = torch.randn(2, 3, 4, 4), torch.tensor([1, 0])
    moved = trainer.to_device({"x": x, "y": [y]})
    assert moved["x"].is_contiguous(memory_format=torch.channels_last) and torch.equal(moved["x"], x)
    assert moved["y"][0] is y  # already on the device: left as it is


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_flush_interrupted_before_its_update_drops_the_accumulated_gradients_and_training_goes_on(monkeypatch, precision):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=4,
                      max_grad_norm=1e9)
    data = batches(3)
    trainer.step(data[0])
    before = [p.detach().clone() for p in model.parameters()]

    def interrupted(*args, **kwargs):  # after unscale_, before the optimizer update
        raise KeyboardInterrupt

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.flush()
    monkeypatch.undo()
    assert trainer.flush() is None and trainer.global_step == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    trainer.step(data[1])  # fp16: the scaler must not still hold the dropped step's unscale_
    assert trainer.flush().stepped and trainer.global_step == trainer.stats.steps == 1


def test_step_under_no_grad():
    """step() under torch.no_grad() trains exactly as outside it."""
    m, t = mk()
    with torch.no_grad():
        assert t.step(B).stepped
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
    ref_m, ref = mk()
    ref.step(B)
    assert same_models(m, ref_m)


def test_fp16_step_interrupted_between_unscale_and_update_leaves_the_trainer_usable():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "fp16", device="cpu")
    trainer.step(batches(1)[0])

    def interrupt(*args):
        raise KeyboardInterrupt

    handle = optimizer.register_step_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.step(batches(2)[1])
    handle.remove()
    assert trainer.step(batches(3)[2]).stepped


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_cuda_matches_hand_written_loop(precision):
    data = batches(4)
    reference, model = tiny_mlp().cuda(), tiny_mlp()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": None}[precision]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    policy = get_policy(precision)
    with policy.backend_flags():
        for x, y in data:
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(reference(x.cuda()), y.cuda())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cuda")
    for b in data:
        trainer.step(b)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
