"""memory_breakdown: the exact parts against sizes worked out by hand, tied and aliased weights once, CUDA's peak."""

import dataclasses

import pytest
import torch
from torch import nn

import precisionloop
from precisionloop import MemoryBreakdown, Trainer, memory_breakdown

MB = 2**20
# Linear(16, 8): a 16 x 8 weight and 8 biases, fp32 (4 bytes each).
LINEAR_BYTES = (16 * 8 + 8) * 4  # 544
BATCH = (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3]))


def _trainer(optimizer, model=None, **kwargs):
    model = model if model is not None else nn.Linear(16, 8)
    return Trainer(model, optimizer(model.parameters()), "fp32", device="cpu", distributed=None, **kwargs)


def _bytes(breakdown: MemoryBreakdown) -> dict:
    return {name: round(value * MB) for name, value in breakdown.to_dict().items() if value is not None}


def test_before_any_step_only_the_parameters_count():
    trainer = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    got = trainer.memory_breakdown()
    assert _bytes(got) == {"parameters_mb": 544, "buffers_mb": 0, "gradients_mb": 0, "optimizer_state_mb": 0}
    assert got.parameters_mb == 544 / 2**20
    assert memory_breakdown(trainer) == got and precisionloop.memory_breakdown is memory_breakdown
    assert "memory_breakdown" in precisionloop.__all__


def test_the_cuda_only_fields_are_none_on_the_cpu():
    trainer = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    trainer.step(BATCH)
    got = trainer.memory_breakdown()
    assert got.peak_mb is None and got.activations_and_workspace_mb is None and got.reserved_mb is None
    assert set(got.to_dict()) == {f.name for f in dataclasses.fields(MemoryBreakdown)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.parameters_mb = 0.0


def test_adam_after_a_step():
    # A window of two micro-batches: after the first optimizer step and one more micro-batch, the gradients of the
    # open window are present as well as the state the step made.
    trainer = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3), grad_accum_steps=2)
    for _ in range(2):
        trainer.step(BATCH)
    stepped = _bytes(trainer.memory_breakdown())
    trainer.step(BATCH)
    open_window = _bytes(trainer.memory_breakdown())
    # Per parameter (weight, bias), Adam keeps exp_avg and exp_avg_sq of its size and a float32 step scalar.
    adam_state = 2 * LINEAR_BYTES + 2 * 4  # 1096
    assert stepped == {"parameters_mb": 544, "buffers_mb": 0, "gradients_mb": 0, "optimizer_state_mb": adam_state}
    assert open_window == {**stepped, "gradients_mb": 544}  # one fp32 gradient per parameter


def test_sgd_with_momentum_after_a_step():
    trainer = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), grad_accum_steps=2)
    for _ in range(3):
        trainer.step(BATCH)
    # One momentum_buffer per parameter, of its size; no step counter.
    assert _bytes(trainer.memory_breakdown()) == {"parameters_mb": 544, "buffers_mb": 0, "gradients_mb": 544,
                                                  "optimizer_state_mb": 544}


def test_plain_sgd_keeps_no_state_and_batch_norm_buffers_count():
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8))
    trainer = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1), model)
    trainer.step(BATCH)
    got = _bytes(trainer.memory_breakdown())
    # Parameters: the Linear's 544 bytes and BatchNorm's 8 weights and 8 biases. Buffers: running mean and var
    # (8 fp32 each) and num_batches_tracked (one int64).
    assert got == {"parameters_mb": 544 + 2 * 8 * 4, "buffers_mb": 2 * 8 * 4 + 8, "gradients_mb": 0,
                   "optimizer_state_mb": 0}


class Tied(nn.Module):
    """An embedding of 10 x 4 and an output layer with the same weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.embed(x))


def test_tied_weights_count_once():
    trainer = _trainer(lambda ps: torch.optim.Adam(ps, lr=1e-3), Tied(), grad_accum_steps=2)
    tokens = (torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))
    for _ in range(3):
        trainer.step(tokens)
    weight = 10 * 4 * 4  # one 10 x 4 fp32 weight, 160 bytes
    assert _bytes(trainer.memory_breakdown()) == {"parameters_mb": weight, "buffers_mb": 0, "gradients_mb": weight,
                                                  "optimizer_state_mb": 2 * weight + 4}


class Aliased(nn.Module):
    """Two parameters over one 8 x 16 storage (two Parameter objects, so ``parameters()`` yields both)."""

    def __init__(self):
        super().__init__()
        data = torch.randn(8, 16)
        self.a, self.b = nn.Parameter(data), nn.Parameter(data)

    def forward(self, x):
        return x @ self.a.t() + x @ self.b.t()


def test_parameters_sharing_a_storage_count_once():
    model = Aliased()
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()
    trainer = _trainer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), model, grad_accum_steps=2)
    for _ in range(3):
        trainer.step(BATCH)
    one = 8 * 16 * 4  # 512 bytes
    # The storage once; each parameter has a gradient and a momentum buffer of its own.
    assert _bytes(trainer.memory_breakdown()) == {"parameters_mb": one, "buffers_mb": 0, "gradients_mb": 2 * one,
                                                  "optimizer_state_mb": 2 * one}


def test_a_view_counts_its_whole_storage_once():
    from precisionloop.memory import _storage_bytes

    base = torch.zeros(10, 6, dtype=torch.float64)
    assert _storage_bytes([base[:2], base.t(), base[5], "not a tensor"]) == {torch.device("cpu"): 10 * 6 * 8}
    assert _storage_bytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]) == {
        torch.device("cpu"): 2 * 3 * 2}


def test_a_dtensor_counts_its_local_shard(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from precisionloop.memory import _storage_bytes

    if dist.is_initialized():
        pytest.skip("a process group is already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard = nn.Parameter(distribute_tensor(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Shard(0)]))
        assert _storage_bytes([shard]) == {torch.device("cpu"): 4 * 6 * 4}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_on_cuda_the_parts_fit_in_the_peak_and_the_reserve():
    torch.cuda.reset_peak_memory_stats()
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16", device="cuda", distributed=None,
                      grad_accum_steps=2)
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    for _ in range(3):
        trainer.step(batch)
    got = trainer.memory_breakdown()
    params = (256 * 1024 + 1024 + 1024 * 10 + 10) * 4
    # AdamW: exp_avg and exp_avg_sq of each parameter's size and a float32 step, per parameter (4 of them).
    assert round(got.parameters_mb * MB) == round(got.gradients_mb * MB) == params
    assert round(got.optimizer_state_mb * MB) == 2 * params + 4 * 4
    parts = got.parameters_mb + got.buffers_mb + got.gradients_mb + got.optimizer_state_mb
    assert parts <= got.peak_mb <= got.reserved_mb
    assert got.activations_and_workspace_mb == pytest.approx(got.peak_mb - parts)
    assert got.activations_and_workspace_mb > 0  # the activations of 64 x 1024 hidden values, at least


def test_pure_bf16_halves_the_parameters_and_gradients_and_keeps_bf16_adam_state():
    optim = pytest.importorskip("torchao.optim")
    model = nn.Linear(16, 8)
    trainer = Trainer(model, optim._AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True), "bf16-pure",
                      device="cpu", distributed=None, grad_accum_steps=2)
    for _ in range(3):
        trainer.step(BATCH)
    # 136 parameters in bf16 (2 bytes each): weights 272 bytes, gradients 272. torchao's AdamW keeps exp_avg and
    # exp_avg_sq in the parameter's dtype (2 x 272) and a float32 step scalar per parameter (2 x 4).
    bf16 = LINEAR_BYTES // 2  # 272
    assert _bytes(trainer.memory_breakdown()) == {"parameters_mb": bf16, "buffers_mb": 0, "gradients_mb": bf16,
                                                  "optimizer_state_mb": 2 * bf16 + 2 * 4}


@pytest.mark.parametrize("precision, scalar", [("bf16", 4), ("bf16-pure", 2)])
def test_8bit_optimizer_state_counts_its_codes_scales_and_table(precision, scalar):
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = optim.AdamW8bit(model.parameters(), lr=1e-3, bf16_stochastic_round=precision == "bf16-pure")
    trainer = Trainer(model, opt, precision, device="cpu", distributed=None)
    trainer.step((torch.randn(4, 64), torch.tensor([0, 1, 2, 0])))
    # The 4096-element weight's two moments are 8-bit: one byte per element, an fp32 scale per block of 256 and
    # a 256-entry fp32 code table each. The smaller tensors' moments are plain, in the parameter's dtype
    # (`scalar` bytes); each of the four parameters has a float32 step.
    quantized = 2 * (4096 + 4096 // 256 * 4 + 256 * 4)
    plain = 2 * (64 + 64 * 3 + 3) * scalar
    assert _bytes(trainer.memory_breakdown())["optimizer_state_mb"] == quantized + plain + 4 * 4
