"""torch.compile'd steps: same numerics as eager (the backward without autocast too), skips and scaling unchanged,
clear errors."""

import copy

import pytest
import torch
from torch import nn
from conftest import batches, tiny_mlp

from precisionloop import FP16Policy, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_step_matches_eager(precision):
    data = batches(4)
    eager_model, compiled_model = tiny_mlp(), tiny_mlp()
    eager = Trainer(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9), precision, device="cpu")
    compiled = Trainer(compiled_model, torch.optim.SGD(compiled_model.parameters(), lr=0.1, momentum=0.9), precision,
                       device="cpu", compile=True)
    for b in data:
        eager.step(b)
        compiled.step(b)
    tol = dict(atol=1e-5, rtol=1e-4) if precision == "fp32" else dict(atol=2e-2, rtol=2e-2)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q, **tol)
    assert list(compiled.state_dict()["model"]) == list(eager.state_dict()["model"])


def test_compiled_fp16_skips_and_backs_off():
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16Policy(init_scale=256.0, growth_interval=2),
                      device="cpu", compile="default")
    data = batches(4)
    trainer.step(data[0])
    before = copy.deepcopy(model.state_dict())
    armed["on"] = True
    result = trainer.step(data[1])
    assert result.skipped and result.scale == 128.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    armed["on"] = False
    assert [trainer.step(b).scale for b in data[2:]] == [128.0, 256.0]


class _Fp32Head(nn.Module):
    """Its head runs with autocast off, as a user's own fp32 region: under a bf16 autocast backward, its gradients
    would be recast (measured: weights differ from eager by ~4e-4 after three steps, 0 when run like eager)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())


def test_the_compiled_backward_runs_without_autocast_as_the_eager_one():
    models = []
    for compile in (False, "default"):
        torch._dynamo.reset()
        model = _Fp32Head()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), "bf16", device="cpu", compile=compile)
        for b in batches(3):
            trainer.step(b)
        models.append(model)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6)


def test_bad_compile_mode_is_rejected_at_construction():
    model = tiny_mlp()
    with pytest.raises(RuntimeError, match="reduce-overhead"):  # torch's own error, naming the modes
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cpu", compile="fastest")


@torch.library.custom_op("precisionloop_test::untraceable", mutates_args=())
def _untraceable(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_untraceable.register_fake
def _(x):
    raise RuntimeError("this op cannot be traced")


class _Untraceable(torch.nn.Module):
    """Runs eagerly, but torch.compile cannot trace it: its fake (meta) implementation raises."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.linear(_untraceable(x))


def test_compile_failure_is_an_error_not_a_silent_fallback():
    # Public APIs only (torch.library), so the same failure reaches every torch version's compile path.
    torch._dynamo.reset()
    model = _Untraceable()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", compile="default")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="compile=False") as info:
        trainer.step(batches(1)[0])
    assert "cannot be traced" in str(info.value) or "cannot be traced" in str(info.value.__cause__)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    plain = _Untraceable()
    eager = Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "fp32", device="cpu")
    assert eager.step(batches(1)[0]).stepped  # the model itself is fine eagerly
    torch._dynamo.reset()


@pytest.mark.gpu
def test_compiled_with_cuda_graphs_matches_eager_and_still_skips():
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    eager_model, graph_model = tiny_mlp(), tiny_mlp()
    armed = {"on": False}
    graph_model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    eager = Trainer(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1, fused=True), FP16Policy(), device="cuda")
    graphed = Trainer(graph_model, torch.optim.SGD(graph_model.parameters(), lr=0.1, fused=True), FP16Policy(), device="cuda",
                      compile=True)
    results = [(eager.step(b), graphed.step(b)) for b in data[:3]]
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-3, rtol=1e-2)
    assert [r.loss for r, _ in results] == pytest.approx([r.loss for _, r in results], rel=1e-2)
    before = copy.deepcopy(graph_model.state_dict())
    armed["on"] = True
    result = graphed.step(data[3])
    assert result.skipped and result.scale == 2.0**15
    assert all(torch.equal(v, before[k]) for k, v in graph_model.state_dict().items())


class _LossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.linear(x), y)


class _LossTrainer(Trainer):
    def forward_batch(self, batch):
        return self.model(*batch), None

    def compute_loss(self, outputs, targets):
        return outputs


@pytest.mark.gpu
def test_compiled_model_returning_its_loss_trains_through_fit():
    model = _LossModel()
    trainer = _LossTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cuda", compile=True)
    record = trainer.fit([(x.cuda(), y.cuda()) for x, y in batches(6)], progress=False)[0]
    assert record["steps"] == 6 and 0 < record["train_loss"] < 10  # CUDA-graph outputs were not read after a replay
