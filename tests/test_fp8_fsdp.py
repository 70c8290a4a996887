"""FP8Policy under FSDP2, on the CPU with two gloo processes and emulated fp8: FSDP2 all-gathers the converted
layers' weights in bf16, each layer casts them to fp8, and training ends where one process ends."""

import os

import pytest
import torch
from torch import nn
from test_distributed import WORLD, run

from precisionloop import BF16Policy, FP8Policy, Trainer
from precisionloop.fp8 import converted_layers

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'precisionloop[fp8]')")

LAYERS = ("0", "2", "4")  # every Linear: the default would skip the first and the last
STEPS = 6
# Measured: after 6 steps FSDP2 over 2 ranks differs from one process by <= 1e-2, while training moves the parameters
# by ~0.1. Each rank scales its half batch's activations and gradients to fp8 by its own amax, and FSDP2's bf16
# param_dtype makes the biases and the layers' outputs bf16, where one process keeps fp32 (torchao's Float8Linear
# ignores CPU autocast). The same 2e-2 as test_distributed's bf16 comparison.
TOL = dict(atol=2e-2, rtol=0)


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def data(n=STEPS, batch_size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 16, generator=g), torch.randint(0, 16, (batch_size,), generator=g))
            for _ in range(n)]


def _trainer(policy, seed=0, distributed="fsdp"):
    model = net(seed)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cpu",
                   distributed=distributed)


def fp8_under_fsdp(rank, out_dir):
    trainer = _trainer(FP8Policy(emulate=True, layers=LAYERS))
    record = {"converted": converted_layers(trainer.model), "stepped": [], "gathered": set()}
    for name in record["converted"]:  # the weight each layer computes with, after FSDP2's all-gather
        trainer.model.get_submodule(name).register_forward_pre_hook(
            lambda m, args: record["gathered"].add((type(m.weight).__name__, m.weight.dtype)))
    for x, y in data():
        n = x.shape[0] // WORLD
        record["stepped"].append(trainer.step((x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])).stepped)
    record["params"] = [p.full_tensor().detach().clone() for p in trainer.model.parameters()]
    trainer.save(os.path.join(out_dir, "fp8-fsdp.pt"))
    if rank == 0:
        torch.save(record, os.path.join(out_dir, "record.pt"))


def test_fp8_under_fsdp_trains_as_one_process_and_its_checkpoint_loads_into_bf16(tmp_path):
    run(fp8_under_fsdp, tmp_path)
    got = torch.load(tmp_path / "record.pt", weights_only=False)
    assert got["converted"] == list(LAYERS) and got["stepped"] == [True] * STEPS
    assert got["gathered"] == {("Parameter", torch.bfloat16)}  # bf16, unsharded; each layer casts it to fp8
    single = _trainer(FP8Policy(emulate=True, layers=LAYERS), distributed=None)
    for batch in data():
        single.step(batch)
    moved = max((p - q).abs().max().item() for p, q in zip(single.model.parameters(), net().parameters()))
    assert moved > 4 * TOL["atol"], moved  # training moved the parameters well beyond the tolerance
    for p, q in zip(single.model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), **TOL)
    # A bf16 Trainer in one process loads the checkpoint: nn.Linear's keys, the same weights.
    bf16 = _trainer(BF16Policy(), seed=3, distributed=None)
    with pytest.warns(UserWarning, match="precision"):  # saved under fp8, loaded under bf16
        bf16.load(tmp_path / "fp8-fsdp.pt")
    assert all(torch.equal(p, q) for p, q in zip(bf16.model.parameters(), got["params"]))
    assert bf16.step(data(1)[0]).stepped
