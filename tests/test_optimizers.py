"""Every optimizer in torch.optim through the Trainer, on the CPU.

For each one torch ships (found by walking ``torch.optim``, so a new one is tested when it appears):
clean fp32, bf16 and fp16 steps match the hand-written torch.amp loop (GradScaler for fp16) bit for
bit, and a step whose gradients hold a NaN or an inf leaves the parameters and the optimizer state as
they were, then training goes on (fp16: with the scale backed off).
LBFGS, whose step takes a closure that re-evaluates the loss, is left out.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")

ALL = sorted(name for name, cls in vars(torch.optim).items()
             if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer)
LEFT_OUT = {"LBFGS"}  # its step takes a closure
STEPPED = [name for name in ALL if name not in LEFT_OUT]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class SparseBag(nn.Module):
    """Logits from a sparse embedding only: SparseAdam takes nothing but sparse gradients."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 3, sparse=True)

    def forward(self, idx):
        return self.emb(idx).mean(dim=1)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "SparseAdam":
        return SparseBag()
    bias = name != "Muon"  # Muon takes 2-D parameters only
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3, bias=bias))


def _batches(name: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = (lambda: torch.randint(0, 12, (5, 2), generator=g)) if name == "SparseAdam" else (
        lambda: torch.randn(5, 6, generator=g))
    return [(inputs(), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    return getattr(torch.optim, name)(model.parameters(), lr=0.05)


def _hand_step(model, optimizer, scaler, batch, dtype) -> None:
    """torch's own recipe: autocast around forward and loss (none for fp32), then backward and step (scaled for fp16)."""
    inputs, targets = batch
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = nn.functional.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def _state(optimizer) -> list:
    """The optimizer's per-parameter state as (key, tensor or value) pairs, in parameter order."""
    return [sorted(optimizer.state[p].items()) for group in optimizer.param_groups for p in group["params"]]


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        a, b = (t.to_dense() if t.is_sparse else t for t in (a, b))
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_discovery_finds_the_optimizers_torch_documents():
    """The walk over torch.optim finds them; if it found nothing, every test below would pass vacuously."""
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "SparseAdam"} <= set(STEPPED)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", STEPPED)
def test_clean_steps_match_the_hand_loop(name, precision):
    batches = _batches(name, 3)
    hand_model = _model(name)
    hand_opt = _optimizer(name, hand_model)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for batch in batches:
        _hand_step(hand_model, hand_opt, scaler, batch, PRECISIONS[precision])

    model = _model(name)
    trainer = Trainer(model, _optimizer(name, model), precision, device="cpu")
    for batch in batches:
        assert trainer.step(batch).stepped
    _assert_same(list(trainer.model.parameters()), list(hand_model.parameters()))
    _assert_same(_state(trainer.optimizer), _state(hand_opt))
    assert trainer.stats.steps == 3 and trainer.stats.skipped == 0
    assert trainer.stats.scale == (scaler.get_scale() if precision == "fp16" else None)


@pytest.mark.parametrize("precision, bad", [("bf16", float("nan")), ("bf16", float("inf")), ("fp16", float("inf"))])
@pytest.mark.parametrize("name", STEPPED)
def test_a_non_finite_gradient_changes_neither_weights_nor_state(name, precision, bad):
    model = _model(name)
    trainer = Trainer(model, _optimizer(name, model), precision, device="cpu")
    first, poisoned, after = _batches(name, 3)
    assert trainer.step(first).stepped  # the state exists (moments, step counts) before the bad step
    weights = copy.deepcopy(list(trainer.model.parameters()))
    state = copy.deepcopy(_state(trainer.optimizer))

    victim = next(iter(trainer.model.parameters()))  # one gradient of the step is non-finite
    handle = victim.register_hook(lambda grad: grad * bad)
    try:
        result = trainer.step(poisoned)
    finally:
        handle.remove()
    assert result.skipped and not result.stepped
    _assert_same(list(trainer.model.parameters()), weights)
    _assert_same(_state(trainer.optimizer), state)
    assert trainer.stats.skipped == 1
    if precision == "fp16":
        assert trainer.stats.scale == 2.0 ** 15  # backed off from GradScaler's 2**16

    assert trainer.step(after).stepped  # training goes on from the weights and state it had
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.stats.steps == 3 and trainer.stats.skipped == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", STEPPED)
def test_resume_from_a_file_continues_exactly(name, precision, tmp_path):
    """Saved after a skip (fp16: the scale backed off), loaded into a fresh Trainer: the next steps are the same."""
    batches = _batches(name, 5)

    def fresh() -> Trainer:
        model = _model(name)
        return Trainer(model, _optimizer(name, model), precision, device="cpu")

    def poisoned_step(t: Trainer, batch) -> None:
        handle = next(iter(t.model.parameters())).register_hook(lambda grad: grad * float("inf"))
        try:
            assert t.step(batch).skipped
        finally:
            handle.remove()

    straight = fresh()
    straight.step(batches[0])
    poisoned_step(straight, batches[1])
    path = straight.save(tmp_path / "ckpt.pt")
    saved_stats = copy.deepcopy(straight.stats)
    for batch in batches[2:]:
        straight.step(batch)

    resumed = fresh()
    resumed.step(batches[4])  # state a load must replace, not merge with
    resumed.load(path)
    assert resumed.stats == saved_stats and saved_stats.skipped == 1
    for batch in batches[2:]:
        resumed.step(batch)
    _assert_same(list(resumed.model.parameters()), list(straight.model.parameters()))
    _assert_same(_state(resumed.optimizer), _state(straight.optimizer))
    assert resumed.stats == straight.stats
