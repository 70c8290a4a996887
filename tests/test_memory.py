"""memory_breakdown: the exact parts against sizes worked out by hand, shared storages once, CUDA's peak."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import precisionloop
from precisionloop import BF16AdamW, MemoryBreakdown, Trainer, memory_breakdown

MB = 2**20
LINEAR_BYTES = (16 * 8 + 8) * 4  # Linear(16, 8) in fp32: 544
BATCH = (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3]))


def _trainer(optimizer, model=None, precision="fp32", **kwargs):
    model = model if model is not None else nn.Linear(16, 8)
    return Trainer(model, optimizer(model.parameters()), precision, device="cpu", distributed=None, **kwargs)


def _bytes(breakdown: MemoryBreakdown) -> dict:
    return {name: round(value * MB) for name, value in breakdown.to_dict().items() if value is not None}


def _parts(parameters, buffers=0, gradients=0, state=0):
    return {"parameters_mb": parameters, "buffers_mb": buffers, "gradients_mb": gradients, "optimizer_state_mb": state}


def test_before_any_step_only_the_parameters_count_and_the_cuda_fields_are_none():
    trainer = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    got = trainer.memory_breakdown()
    assert _bytes(got) == _parts(544) and got.parameters_mb == 544 / MB
    assert memory_breakdown(trainer) == got and "memory_breakdown" in precisionloop.__all__
    assert got.peak_mb is None and got.activations_and_workspace_mb is None and got.reserved_mb is None
    assert set(got.to_dict()) == {f.name for f in dataclasses.fields(MemoryBreakdown)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.parameters_mb = 0.0


def test_optimizer_state_and_the_gradients_of_an_open_window():
    # Two micro-batches a step: after one optimizer step and one more micro-batch the window's gradients are present.
    adam = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3), grad_accum_steps=2)
    for _ in range(2):
        adam.step(BATCH)
    stepped = _bytes(adam.memory_breakdown())
    adam.step(BATCH)
    # Per parameter (weight, bias), Adam keeps exp_avg and exp_avg_sq of its size and a float32 step scalar.
    assert stepped == _parts(544, state=2 * LINEAR_BYTES + 2 * 4)
    assert _bytes(adam.memory_breakdown()) == {**stepped, "gradients_mb": 544}
    momentum = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), grad_accum_steps=2)
    for _ in range(3):
        momentum.step(BATCH)
    assert _bytes(momentum.memory_breakdown()) == _parts(544, gradients=544, state=544)  # one momentum_buffer each


def test_plain_sgd_keeps_no_state_and_batch_norm_buffers_count():
    trainer = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1), nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)))
    trainer.step(BATCH)
    # BatchNorm: 8 weights and 8 biases; buffers running mean and var (8 fp32 each) and num_batches_tracked (int64).
    assert _bytes(trainer.memory_breakdown()) == _parts(544 + 2 * 8 * 4, buffers=2 * 8 * 4 + 8)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.embed(x))


class Aliased(nn.Module):
    """Two Parameter objects over one 8 x 16 storage: ``parameters()`` yields both."""

    def __init__(self):
        super().__init__()
        data = torch.randn(8, 16)
        self.a, self.b = nn.Parameter(data), nn.Parameter(data)

    def forward(self, x):
        return x @ self.a.t() + x @ self.b.t()


def test_tied_weights_and_parameters_sharing_a_storage_count_it_once():
    tied = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3), Tied(), grad_accum_steps=2)
    for _ in range(3):
        tied.step((torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4])))
    weight = 10 * 4 * 4
    assert _bytes(tied.memory_breakdown()) == _parts(weight, gradients=weight, state=2 * weight + 4)
    aliased = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), Aliased(), grad_accum_steps=2)
    for _ in range(3):
        aliased.step(BATCH)
    one = 8 * 16 * 4  # the storage once; each parameter has a gradient and a momentum buffer of its own
    assert _bytes(aliased.memory_breakdown()) == _parts(one, gradients=2 * one, state=2 * one)


def _cpu(model):
    """What memory_breakdown reads of a Trainer, for models a Trainer would not take as they are."""
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"))


def test_views_of_one_storage_count_it_once_and_whole():
    model = nn.Module()
    base = torch.zeros(10, 6, dtype=torch.float64)
    model.a, model.b = nn.Parameter(base[:2]), nn.Parameter(base.t())
    model.register_buffer("c", torch.zeros(3, dtype=torch.bfloat16))
    model.register_buffer("d", torch.zeros(3, dtype=torch.bfloat16))
    assert _bytes(memory_breakdown(_cpu(model))) == _parts(10 * 6 * 8, buffers=2 * 3 * 2)


def test_a_dtensor_counts_its_local_shard(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Module()
        model.w = nn.Parameter(distribute_tensor(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Shard(0)]))
        assert _bytes(memory_breakdown(_cpu(model))) == _parts(4 * 6 * 4)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_on_cuda_the_parts_fit_in_the_peak_and_the_reserve():
    torch.cuda.reset_peak_memory_stats()
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16", device="cuda", distributed=None,
                      grad_accum_steps=2)
    for _ in range(3):
        trainer.step((torch.randn(64, 256), torch.randint(0, 10, (64,))))
    got = trainer.memory_breakdown()
    params = (256 * 1024 + 1024 + 1024 * 10 + 10) * 4
    assert round(got.parameters_mb * MB) == round(got.gradients_mb * MB) == params
    assert round(got.optimizer_state_mb * MB) == 2 * params + 4 * 4  # AdamW: two moments and a step per parameter
    parts = got.parameters_mb + got.buffers_mb + got.gradients_mb + got.optimizer_state_mb
    assert parts <= got.peak_mb <= got.reserved_mb
    assert got.activations_and_workspace_mb == pytest.approx(got.peak_mb - parts)
    assert got.activations_and_workspace_mb > 0  # the activations of 64 x 1024 hidden values, at least


def test_pure_bf16_halves_the_parameters_and_gradients_and_keeps_bf16_adam_state():
    trainer = _trainer(lambda ps: BF16AdamW(ps, lr=1e-3), precision="bf16-pure", grad_accum_steps=2)
    for _ in range(3):
        trainer.step(BATCH)
    # BF16AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype and a float32 step per parameter.
    bf16 = LINEAR_BYTES // 2
    assert _bytes(trainer.memory_breakdown()) == _parts(bf16, gradients=bf16, state=2 * bf16 + 2 * 4)


@pytest.mark.parametrize("precision, scalar", [("bf16", 4), ("bf16-pure", 2)])
def test_8bit_optimizer_state_counts_its_codes_scales_and_table(precision, scalar):
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    trainer = _trainer(lambda ps: optim.AdamW8bit(ps, lr=1e-3, bf16_stochastic_round=precision == "bf16-pure"), model,
                       precision)
    trainer.step((torch.randn(4, 64), torch.tensor([0, 1, 2, 0])))
    # The 4096-element weight's two moments are 8-bit: a byte per element, an fp32 scale per block of 256 and a
    # 256-entry fp32 code table each. The smaller tensors' moments are plain, in the parameter's dtype; each of the
    # four parameters has a float32 step.
    quantized = 2 * (4096 + 4096 // 256 * 4 + 256 * 4)
    plain = 2 * (64 + 64 * 3 + 3) * scalar
    assert _bytes(trainer.memory_breakdown())["optimizer_state_mb"] == quantized + plain + 4 * 4
