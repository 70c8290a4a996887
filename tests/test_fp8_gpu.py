"""fp8 with real fp8 matmuls: CUDA compute capability 8.9+ and torchao; skipped, with a reason, elsewhere."""

import math
import socket
import warnings

import pytest
import torch

from precisionloop import BF16Policy, FP8Policy, Trainer
from precisionloop.fp8 import converted_layers, default_layers
from precisionloop.recipes import models

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'precisionloop[fp8]')")
if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 matmuls need CUDA compute capability 8.9+", allow_module_level=True)

SIZES = dict(layers=2, d_model=256, d_ff=1024, heads=4, vocab=512, seq_len=128)


def stack(seed=0):
    torch.manual_seed(seed)
    return models.TransformerStack(**SIZES)


def tokens(n, seed=1):
    return [models.random_tokens(4, SIZES["seq_len"], SIZES["vocab"], "cuda", seed=seed + i) for i in range(n)]


def trainer_for(policy, seed=0, compile=True, **kwargs):
    model = stack(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), policy, device="cuda",
                   compile=compile, loss_fn=models.lm_loss, **kwargs)


def test_fp8_policy_converts_the_default_layers_and_trains_like_bf16():
    fp8_trainer, bf16_trainer = trainer_for(FP8Policy()), trainer_for(BF16Policy())
    converted = set(converted_layers(fp8_trainer.model))
    assert converted == set(default_layers(stack()))
    assert "head" not in converted and "blocks.0.attn.q" not in converted and len(converted) == 4 * 2 + 2 * 2 - 1
    data = tokens(3)
    losses = {name: [float(t.step(b).loss) for _ in range(10) for b in data]
              for name, t in (("fp8", fp8_trainer), ("bf16", bf16_trainer))}
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    assert losses["fp8"][-1] < 0.9 * losses["fp8"][0]  # it learns the three batches
    # Same weights, same batches: fp8's loss tracks bf16's (fp8 rounding is coarser: a loose bound).
    assert abs(losses["fp8"][-1] - losses["bf16"][-1]) < 0.05 * losses["bf16"][0]
    assert fp8_trainer.stats.skipped == 0


def test_fp8_checkpoint_loads_into_bf16_on_cuda(tmp_path):
    trainer = trainer_for(FP8Policy())
    for b in tokens(2):
        trainer.step(b)
    trainer.save(tmp_path / "fp8.pt")
    resumed = trainer_for(BF16Policy(), seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the precision-mismatch warning is expected
        resumed.load(tmp_path / "fp8.pt")
    mine, theirs = trainer.model.state_dict(), resumed.model.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert resumed.step(tokens(1, seed=9)[0]).stepped


def test_uncompiled_fp8_on_cuda_warns_once():
    with pytest.warns(UserWarning, match="slower than bf16"):
        trainer = trainer_for(FP8Policy(), compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert math.isfinite(float(trainer.step(tokens(1)[0]).loss))
    assert not [w for w in caught if "slower than bf16" in str(w.message)]


def test_fsdp2_trains_fp8_layers_on_one_gpu_and_its_checkpoint_loads_into_bf16(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager fp8 is slower than bf16: said, and expected here
            trainer = trainer_for(FP8Policy(), compile=False, distributed="fsdp")
        assert converted_layers(trainer.model) == list(default_layers(stack()))
        assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
        data = tokens(2)
        losses = [float(trainer.step(b).loss) for _ in range(6) for b in data]
        assert torch.isfinite(torch.tensor(losses)).all() and losses[-1] < losses[0] and trainer.stats.skipped == 0
        trainer.save(tmp_path / "fsdp_fp8.pt")
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in trainer.model.state_dict().items()}
        assert list(full) == list(stack().state_dict())  # nn.Linear's keys
        plain = trainer_for(BF16Policy(), seed=3)  # one process, no torchao layer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # saved under fp8, loaded under bf16: said, and expected
            plain.load(tmp_path / "fsdp_fp8.pt")
        assert all(torch.equal(plain.model.state_dict()[k], v) for k, v in full.items())
    finally:
        dist.destroy_process_group()
