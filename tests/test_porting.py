"""What porting a real script runs into: models that compute their own loss, the user's TF32 choice, tf32 where
there is none, and the precision "auto" chose shown where a user looks."""

import types
import warnings

import pytest
import torch
from torch import nn

from precisionloop import Trainer, get_policy


class OwnLoss(nn.Module):
    """A model whose forward(inputs, targets) returns (logits, loss), as nanoGPT's GPT does."""

    def __init__(self, kind: str = "tuple"):
        super().__init__()
        self.kind, self.head = kind, nn.Linear(8, 4)

    def forward(self, inputs, targets=None):
        logits = self.head(inputs)
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        if self.kind == "dict":
            return {"logits": logits, "loss": loss}
        if self.kind == "object":
            return types.SimpleNamespace(logits=logits, loss=loss)
        return logits, loss


BATCH = (torch.randn(4, 8), torch.randint(0, 4, (4,)))


@pytest.mark.parametrize("kind", ["tuple", "dict", "object"])
def test_a_model_returning_its_own_loss_is_refused_naming_compute_loss(kind):
    model = OwnLoss(kind)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    before = model.head.weight.detach().clone()
    with pytest.raises(ValueError, match="give it the targets in forward_batch") as info:
        trainer.step(BATCH)
    assert "def forward_batch(self, batch)" in str(info.value) and "def compute_loss(self, outputs, targets)" in str(info.value)
    assert torch.equal(model.head.weight, before) and trainer.global_step == 0


@pytest.mark.parametrize("loss_fn", [lambda out, y: out[1], lambda out, y: out])
def test_a_loss_fn_returning_none_or_a_tuple_names_compute_loss(loss_fn):
    model = OwnLoss()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", loss_fn=loss_fn)
    with pytest.raises(ValueError, match="targets never reached the model.*give it the targets in forward_batch"):
        trainer.step(BATCH)


@pytest.mark.parametrize("kind", ["tuple", "object"])
def test_the_documented_compute_loss_override_trains_a_model_with_its_own_loss(kind):
    class OwnLossTrainer(Trainer):
        def forward_batch(self, batch):
            inputs, targets = batch
            return self.model(inputs, targets), targets

        def compute_loss(self, outputs, targets):
            return outputs[1] if kind == "tuple" else outputs.loss

    torch.manual_seed(0)
    model = OwnLoss(kind)
    trainer = OwnLossTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), "bf16", device="cpu")
    losses = [trainer.step(BATCH).loss for _ in range(20)]
    assert losses[-1] < losses[0] / 2
    assert trainer.evaluate([BATCH])["val_loss"] == pytest.approx(losses[-1], rel=0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tf32 exists on this machine's GPU")
def test_tf32_on_a_device_without_it_is_refused_and_auto_never_picks_it():
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="TF32 needs a CUDA GPU of compute capability 8.0\\+, and the CPU has none"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "tf32", device="cpu")
    assert get_policy("auto", "cpu").name in ("bf16", "fp32")


def test_the_progress_bar_names_the_precision(capsys):
    model = nn.Linear(8, 4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto", device="cpu")
    trainer.fit([BATCH], epochs=1, progress=True)
    assert f"epoch 1/1 {trainer.policy.name}" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_policy_that_overrides_the_users_tf32_warns_once_naming_fp32():
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    conv = nn.Conv2d(3, 4, 3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's defaults are nobody's choice: no warning for a conv model
            Trainer(conv, torch.optim.SGD(conv.parameters(), lr=0.1), "fp32-strict")
        matmul.allow_tf32 = True  # what a script does at its top
        model = nn.Linear(8, 4)
        with pytest.warns(UserWarning, match="precision='fp32' is one") as record:
            trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32-strict")
        assert len(record) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            trainer.step((torch.randn(4, 8), torch.randint(0, 4, (4,))))  # once, at construction
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "tf32")
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
        assert (matmul.fp32_precision if new_api else matmul.allow_tf32) in ("tf32", True)  # restored after the step
    finally:
        if new_api:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


def test_bf16_on_a_cpu_without_native_bf16_warns_and_fp16_there_suggests_fp32(monkeypatch):
    from precisionloop import _compat

    monkeypatch.setattr(_compat, "cpu_bf16_native", lambda: False)
    model = nn.Linear(8, 4)
    with pytest.warns(UserWarning, match="precision 'bf16': this CPU has no native bf16.*precision='fp32'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    with pytest.warns(UserWarning, match="fp16 autocast on the CPU.*consider precision='fp32'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", device="cpu")
    monkeypatch.setattr(_compat, "cpu_bf16_native", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
