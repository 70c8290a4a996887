"""Models with Hugging Face's conventions (keyword batches, an output with ``loss`` and ``logits``) train, evaluate
and hand back their outputs with no subclass; float64 inputs are named for what they are."""

import collections
import weakref

import pytest
import torch
from torch import nn

from precisionloop import Trainer


class Output(collections.OrderedDict):
    """Like transformers' ModelOutput: a mapping whose fields are attributes too."""

    __getattr__ = collections.OrderedDict.get


class TinyLM(nn.Module):
    """forward(input_ids, labels=None), computing the shifted loss itself only when given labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(11, 16), nn.Linear(16, 11)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(loss=loss, logits=logits)


def lm_batch(seed, labels=True):
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **({"labels": ids.clone()} if labels else {})}


def test_a_keyword_batch_trains_on_the_models_own_loss_as_a_hand_written_loop_does():
    model, reference = TinyLM(), TinyLM()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16", device="cpu")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for seed in range(3):
        result = trainer.step(lm_batch(seed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(**lm_batch(seed)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert result.stepped and result.loss == loss.item()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_evaluate_reports_the_models_loss_and_gives_metrics_its_logits_and_labels():
    seen = []

    class Metric:
        def to(self, device):
            return self

        def reset(self):
            seen.clear()

        def update(self, predictions, targets):
            seen.append((predictions.shape, targets.shape))

        def compute(self):
            return torch.tensor(float(len(seen)))

    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    result = trainer.evaluate([lm_batch(1)], metrics={"m": Metric()})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert result["val_loss"] == pytest.approx(model(**lm_batch(1)).loss.item())
    assert seen == [(torch.Size([4, 6, 11]), torch.Size([4, 6]))]


def test_a_loss_fn_gets_the_logits_and_the_labels():
    calls = []

    def loss_fn(logits, labels):
        calls.append((logits.shape, labels.shape))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", loss_fn=loss_fn)
    assert trainer.step(lm_batch(1)).stepped
    assert calls == [(torch.Size([4, 6, 11]), torch.Size([4, 6]))]


def test_a_batch_without_labels_is_refused_saying_so():
    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    with pytest.raises(ValueError, match="logits but no loss.*'labels'.*nothing was changed"):
        trainer.step(lm_batch(1, labels=False))
    assert all(p.grad is None for p in model.parameters()) and trainer.global_step == 0


@pytest.mark.parametrize("device, compile", [("cpu", False), ("cpu", True),
                                             pytest.param("cuda", True, marks=pytest.mark.gpu)])  # CUDA graphs
def test_the_outputs_of_a_step_are_kept_only_when_asked(device, compile):
    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device=device, compile=compile)
    assert trainer.step(lm_batch(1)).outputs is None
    first = trainer.step(lm_batch(1), outputs=True).outputs
    kept = first.logits.clone()
    trainer.step(lm_batch(2), outputs=True)
    assert not first.logits.requires_grad and torch.equal(first.logits, kept)  # not overwritten by the next step
    assert first.logits.shape == (4, 6, 11)


def test_float64_inputs_are_named_with_the_fix():
    model = nn.Linear(8, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu")
    with pytest.raises(TypeError, match=r"float64.*\.float\(\)"):
        trainer.step((torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])))
    assert trainer.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))).stepped


def test_a_transformers_causal_lm_built_from_a_config_trains_with_no_subclass():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16", device="cpu")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [trainer.step({"input_ids": ids, "labels": ids}).loss for _ in range(5)]
    assert losses[-1] < losses[0]
    assert trainer.evaluate([{"input_ids": ids, "labels": ids}])["val_loss"] < losses[0]


def test_a_step_not_asked_for_its_outputs_frees_them_before_the_backward():
    """Memory as before outputs could be kept: the forward's outputs (a language model's logits) are not held."""
    seen = {}
    model = TinyLM()
    model.head.register_forward_hook(lambda module, args, out: seen.update(logits=weakref.ref(out)))
    model.head.weight.register_hook(lambda grad: seen.update(alive=seen["logits"]() is not None))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    trainer.step(lm_batch(1))
    assert seen["alive"] is False
