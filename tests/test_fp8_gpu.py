"""fp8 with real fp8 matmuls: CUDA compute capability 8.9+ and torchao; skipped, with a reason, elsewhere."""

import json
import math
import warnings

import pytest
import torch
from torch import nn

from precisionloop import BF16Policy, FP8Policy, Trainer, autotune
from precisionloop import fp8 as fp8_module
from precisionloop.recipes import models
from precisionloop.tuning import Candidate

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'precisionloop[fp8]')")
if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 matmuls need CUDA compute capability 8.9+", allow_module_level=True)

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

SIZES = dict(layers=2, d_model=256, d_ff=1024, heads=4, vocab=512, seq_len=128)


def stack(seed=0):
    torch.manual_seed(seed)
    return models.TransformerStack(**SIZES)


def tokens(n, seed=1):
    return [models.random_tokens(4, SIZES["seq_len"], SIZES["vocab"], "cuda", seed=seed + i) for i in range(n)]


def trainer_for(policy, seed=0, compile=True):
    model = stack(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), policy, device="cuda",
                   compile=compile, loss_fn=models.lm_loss)


def test_fp8_policy_converts_the_default_layers_and_trains_like_bf16():
    fp8_trainer, bf16_trainer = trainer_for(FP8Policy()), trainer_for(BF16Policy())
    converted = {n for n, m in fp8_trainer.model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(fp8_module.default_layers(stack()))
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


def test_autotune_declines_fp8_on_a_model_without_convertible_layers(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.01), batch,
                      [Candidate("bf16", compile=True), Candidate("fp8", compile=True)], device="cuda", steps=2,
                      warmup=1, rounds=2)
    assert "fp8 +compile(auto) declined: no nn.Linear layer" in capsys.readouterr().out
    assert all(r.candidate.precision != "fp8" for r in result.results) and result.best.precision == "bf16"


def test_autotune_times_fp8_at_its_default_layers_and_at_every_layer():
    model = stack()
    batch = models.random_tokens(8, SIZES["seq_len"], SIZES["vocab"], "cuda")
    result = autotune(model, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), batch,
                      [Candidate("bf16", compile=True), Candidate("fp8", compile=True)], device="cuda",
                      loss_fn=models.lm_loss, steps=3, warmup=2, rounds=2)
    fp8_rows = [r for r in result.results if r.candidate.precision == "fp8"]
    assert {r.candidate.policy(torch.device("cuda")).layers is None for r in fp8_rows} == {True, False}
    assert fp8_rows and all(r.rejected is None and r.timing.rounds_ms for r in fp8_rows)
    assert all(r.skipped == 0 for r in result.results)


def test_recipe_times_the_transformer_in_bf16_and_fp8(tmp_path):
    from precisionloop.recipes import resnet18_bench

    out = tmp_path / "bench.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    resnet18_bench.main(["--model", "transformer", *flags, "--precisions", "bf16,fp8", "--batch-sizes", "4",
                         "--iters", "3", "--warmup", "2", "--rounds", "2", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    fp8_rows = [r for r in results if r["precision"] == "fp8"]
    assert fp8_rows and all(r["error"] is None and r["median_ms"] > 0 and r["settings"]["compile"] for r in fp8_rows)


def test_fsdp2_all_gathers_fp8_weights_on_one_gpu(tmp_path):
    import socket

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        model = stack()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager fp8 is slower than bf16: said once, expected here
            trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), FP8Policy(),
                              device="cuda", distributed="fsdp", loss_fn=models.lm_loss)
        weights = [m.weight for m in trainer.model.modules() if fp8_module.is_float8_linear(m)]
        assert len(weights) == len(fp8_module.default_layers(stack()))
        assert all(isinstance(w, DTensor) and isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor)
                   for w in weights)
        data = tokens(2)
        losses = [float(trainer.step(b).loss) for _ in range(6) for b in data]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        assert trainer.stats.skipped == 0 and trainer.engine.after_step is not None  # scales precomputed per step
        path = trainer.save(tmp_path / "fsdp_fp8.pt")
        saved = torch.load(path, weights_only=True)["model"]
        assert {type(v) for v in saved.values()} == {torch.Tensor}  # no torchao subclass on disk
        plain = trainer_for(BF16Policy(), seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # precision mismatch, expected
            plain.load(path)
        assert all(torch.equal(plain.model.state_dict()[k].cpu(), v) for k, v in saved.items())
    finally:
        dist.destroy_process_group()
