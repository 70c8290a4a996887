"""The recipes and benchmark scripts: tiny runs on the CPU, their argument checks, and the CUDA benchmark."""

import contextlib
import importlib.util
import json
import types
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from precisionloop import Trainer
from precisionloop.recipes import grad_underflow, max_batch, models, resnet18_bench

ROOT = Path(__file__).parent.parent
TINY = ["--batch-sizes", "2", "--iters", "1", "--warmup", "1", "--rounds", "2", "--image-size", "32", "--device", "cpu"]
TINY_TRANSFORMER = ["--model", "transformer", "--batch-sizes", "2", "--iters", "1", "--warmup", "1", "--rounds", "2",
                    "--device", "cpu"]


def _script(folder, name):
    """A script of recipes/ or benchmarks/ (not packages) imported as a module; its folder first on the path."""
    monkeypatched = str(ROOT / folder)
    if monkeypatched not in sys.path:
        sys.path.insert(0, monkeypatched)  # lightning_fit imports its sibling loader_bench
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _cuda_of(monkeypatch, capability):
    """parse_args sees cuda:0 of ``capability`` (no GPU needed: nothing is run on it)."""
    monkeypatch.setattr(resnet18_bench, "parse_device", lambda p, text: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


# The recipe --------------------------------------------------------------------------------------------------

def test_the_cpu_default_times_what_this_cpu_runs_natively(monkeypatch):
    monkeypatch.setattr(resnet18_bench, "get_policy", lambda spec, device=None: types.SimpleNamespace(name="fp32"))
    assert resnet18_bench.parse_args(["--device", "cpu"]).precisions == ["fp32"]  # no TF32, fp16, emulated bf16


def test_the_recipe_times_trainer_step_beside_the_hand_loop_on_the_cpu(tmp_path, capsys, monkeypatch):
    steps = []
    original = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self, batch: steps.append(1) or original(self, batch))
    out = tmp_path / "bench.json"
    resnet18_bench.main([*TINY, "--precisions", "fp32,bf16", "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    text = capsys.readouterr().out
    assert "precisionloop benchmark: resnet18" in text and "timing bf16: alone" in text
    assert "wrapper cost: not printed on the CPU" in text  # a CPU step varies by more than the wrapper adds
    table = text.split("precisionloop Trainer.step", 1)[1].splitlines()
    assert [c.strip() for c in table[1].split("|")] == ["batch", "fp32", "bf16"]
    assert any(line.strip().startswith("vs fp32 |") for line in table)
    data = json.loads(out.read_text())
    assert {(r["system"], r["precision"]) for r in data["results"]} == {
        (s, p) for s in ("precisionloop", "hand") for p in ("fp32", "bf16")}
    for r in data["results"]:
        assert r["batch_size"] == 2 and len(r["rounds_ms"]) == 2 and r["median_ms"] > 0 and r["error"] is None
        assert r["peak_mb"] is None and r["settings"]["method"] == "alone" and r["skipped"] == 0
    assert len(steps) == 2 * 2 * 2  # fp32 and bf16, two rounds of a warm-up and a timed step: all Trainer.step
    assert data["environment"]["torch"] == torch.__version__


def test_the_recipe_times_a_transformer_with_the_same_loss_in_both_systems(capsys):
    results = resnet18_bench.main([*TINY_TRANSFORMER, "--precisions", "fp32", "--optimizer", "adamw"])
    assert "2 layers, d_model 64" in capsys.readouterr().out and {r.system for r in results} == {"precisionloop", "hand"}
    args = resnet18_bench.parse_args([*TINY_TRANSFORMER, "--optimizer", "adamw"])
    batch = resnet18_bench.make_batch(args, 2, args.device)
    assert torch.equal(batch[0][:, 1:], batch[1][:, :-1])  # the targets are the next tokens
    losses = {}
    for system in ("trainer", "hand"):
        torch.manual_seed(0)
        model = resnet18_bench.make_model(args)
        policy = resnet18_bench.policy_for("fp32", args)
        if system == "trainer":
            trainer = Trainer(model, resnet18_bench.make_optimizer(model.parameters(), False, "adamw"), policy,
                              device="cpu", loss_fn=resnet18_bench.loss_of(args))
            step = lambda: trainer.step(batch)  # noqa: E731
        else:
            step = resnet18_bench.hand_loop_step(model, batch, policy, args.device, False,
                                                 loss_fn=resnet18_bench.loss_of(args), optimizer="adamw")
        for _ in range(3):
            step()
        losses[system] = models.lm_loss(model(batch[0]), batch[1]).item()
    assert losses["trainer"] == pytest.approx(losses["hand"], rel=1e-4)


def test_the_recipe_reports_autotunes_choice(capsys):
    results = resnet18_bench.main([*TINY_TRANSFORMER, "--precisions", "fp32,bf16", "--autotune", "--no-hand-loop"])
    tuned = [r for r in results if r.system == "autotune"]
    assert len(tuned) == 1 and tuned[0].precision in ("fp32", "bf16") and len(tuned[0].rounds_ms) == 2
    text = capsys.readouterr().out
    assert "CHOSEN" in text and f"autotune's choice at batch 2: {tuned[0].precision}" in text


def test_the_baseline_is_tf32_only_on_cuda_with_tf32(monkeypatch, capsys):
    _cuda_of(monkeypatch, (8, 0))
    args = resnet18_bench.parse_args([])
    assert args.precisions == ["fp32-strict", "tf32", "bf16", "fp16"] and args.baseline == "tf32"
    assert (args.batch_sizes, args.iters, args.warmup, args.image_size) == ([32, 128], 50, 15, 224)
    _cuda_of(monkeypatch, (7, 5))
    args = resnet18_bench.parse_args(["--model", "transformer"])
    assert args.precisions == ["fp32-strict", "bf16", "fp16"] and args.baseline == "fp32-strict"
    assert args.sizes == models.REFERENCE and args.batch_sizes == [8] and args.image_size is None
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--precisions", "tf32"])
    assert "TF32 needs a CUDA GPU of compute capability 8.0+" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--precisions", "tf32"], "TF32 needs a CUDA GPU"),
    (["--precisions", "fp9"], "--precisions"),
    (["--batch-sizes", "a"], "--batch-sizes takes comma-separated integers"),
    (["--batch-sizes", "0"], "must be >= 1"),
    (["--model", "resnet19"], "nor a torchvision classification model"),
    (["--max-batch"], "--max-batch searches for the largest batch that fits in a CUDA GPU's memory"),
    (["--json", "/nonexistent/out.json"], "--json"),
    (["--device", "cuda:x"], "--device"),
    (["--size", "huge"], "invalid choice"),
])
def test_the_recipe_refuses_bad_arguments_before_measuring(flags, message, capsys):
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_transformer_stack_shapes_sizes_and_causality():
    model = models.TransformerStack(layers=3, d_model=48, d_ff=96, heads=4, vocab=50, seq_len=16)
    inputs, targets = models.random_tokens(5, 16, 50, "cpu")
    assert inputs.shape == targets.shape == (5, 16) and model(inputs).shape == (5, 16, 50)
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 3 * 6 + 1 and all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert linears["blocks.0.attn.q"] == (48, 48) and linears["blocks.2.mlp.0"] == (48, 96)
    changed = inputs.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 50
    assert torch.allclose(model(changed)[:, :4], model(inputs)[:, :4], atol=1e-5)  # no position sees a later token
    assert models.describe(models.LARGE) == "4 layers, d_model 4096, d_ff 16384, 32 heads, 877M parameters"


# --max-batch: the search against a fake "fits", the recovery against a fake allocator -------------------------

def _fits_below(limit, seen=None):
    def fits(batch):
        if seen is not None:
            seen.append(batch)
        return batch * 2.0 if batch <= limit else None
    return fits


@pytest.mark.parametrize("limit", [1, 7, 63, 64, 65, 1000, 2047])
def test_max_batch_search_finds_the_largest_fit_to_the_resolution(limit):
    seen = []
    got = max_batch.search(_fits_below(limit, seen), start=64, cap=4096, resolution=8)
    best = max(limit // 8 * 8, 64) if limit >= 64 else (limit // 8 * 8 or None)
    assert got.largest == best and got.stopped == "resolved" and got.smallest_failed - (got.largest or 0) <= 8
    assert got.peak_mb == (None if best is None else 2.0 * best)
    assert [b for b, _ in got.tries] == seen and len(set(seen)) == len(seen) and seen[0] == 64


def test_max_batch_search_doubles_then_bisects_and_stops_at_the_cap_or_in_time():
    got = max_batch.search(_fits_below(700), start=64, cap=4096, resolution=16)
    assert got.tries == ((64, True), (128, True), (256, True), (512, True), (1024, False), (768, False),
                         (640, True), (704, False), (672, True), (688, True))
    assert max_batch.describe(got) == "688 (< 704)"
    capped = max_batch.search(_fits_below(10**6), start=64, cap=1000, resolution=8)
    assert capped.stopped == "cap" and max_batch.describe(capped) == ">= 1000 (the cap)"
    ticks = iter(range(100))
    timed = max_batch.search(_fits_below(700), start=64, cap=4096, resolution=16, seconds=2.5, clock=lambda: next(ticks))
    assert timed.stopped == "time" and max_batch.describe(timed) == ">= 256 (time limit)"
    with pytest.raises(ValueError):
        max_batch.search(_fits_below(10), start=64, cap=32)
    table = max_batch.format_table({"fp32": got, "fp16": "error: out of time"})
    assert "688 (< 704)" in table and "1376" in table and "fp16 | error: out of time" in table


class _Block:
    def __init__(self, size):
        self.size = size


def test_max_batch_recovery_frees_what_a_failed_try_held_and_refuses_a_leak():
    blocks, counts = weakref.WeakSet(), {"emptied": 0}
    allocator = max_batch.Allocator(lambda: sum(b.size for b in blocks) * 2**20,
                                    lambda: counts.update(emptied=counts["emptied"] + 1), lambda: None)

    def block(size):
        blocks.add(b := _Block(size))
        return b

    kept = block(5)  # allocated before the search: the baseline

    def run(batch):
        activations = [block(1) for _ in range(batch)]  # held by this frame, then by the traceback
        cycle = {"block": block(3)}
        cycle["self"] = cycle  # freed only by the garbage collector
        if batch > 4:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {batch}")
        return float(len(activations))

    fits = max_batch.recovering(run, allocator)
    assert fits(4) == 4.0 and fits(5) is None and kept.size == 5 and counts["emptied"] == 3
    assert max_batch.search(fits, start=1, cap=64, resolution=1).largest == 4
    leaked = []
    with pytest.raises(RuntimeError, match="7.0 MB is still allocated after the try at batch 7"):
        max_batch.recovering(lambda b: leaked.append(block(b)) or 1.0, allocator)(7)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        max_batch.recovering(lambda b: (_ for _ in ()).throw(RuntimeError("shape mismatch")), allocator)(1)


# The other recipes ----------------------------------------------------------------------------------------------

def test_train_classifier_runs_offline_keeps_modules_in_fp32_and_resumes(tmp_path, capsys):
    script = _script("recipes", "train_classifier")
    common = ["--precision", "bf16", "--device", "cpu", "--synthetic-size", "160", "--batch-size", "32", "--no-progress"]
    history = script.main([*common, "--keep-fp32", "BatchNorm2d,head", "--epochs", "2", "--max-steps", "3",
                           "--checkpoint-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "synthetic images made in-process" in out and "keeping BatchNorm2d, head in fp32" in out
    assert history[-1]["complete"] is False and (tmp_path / "last.pt").is_file()
    history = script.main([*common, "--keep-fp32", "BatchNorm2d,head", "--epochs", "2",
                           "--resume", str(tmp_path / "last.pt")])
    assert [h["epoch"] for h in history] == [1, 2] and 0.0 <= history[-1]["accuracy"] <= 1.0
    assert "resumed from" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--download"):
        script.main(["--data-dir", str(tmp_path), "--device", "cpu"])


def test_custom_policy_recipe_trains_with_both_policies():
    losses = _script("recipes", "custom_policy").main(steps=20)
    assert set(losses) == {"vendor-fp16", "audited-bf16"} and all(loss < 1.0 for loss in losses.values())


def test_grad_underflow_recipe_tiny_run(tmp_path, capsys):
    out = tmp_path / "u.json"
    result = grad_underflow.main(["--epochs", "1", "--max-steps", "3", "--device", "cpu", "--no-progress",
                                  "--json", str(out)])
    printed = capsys.readouterr().out
    assert "e4m3 x tensorwise" in printed and "How to read this" in printed and "this run:" in printed
    saved = json.loads(out.read_text())
    assert saved["steps"] == 4 and saved["fp16"]["nonzero"] > 0 and saved["bf16"]["underflow"] == 0
    assert saved["e4m3"]["overflow_scaled"] == 0 and saved["e5m2"]["scale"] == "tensorwise"
    assert 0 <= saved["lost_updates"]["lost"] <= 1 and result["fp16"]["scale"] == 65536.0
    with pytest.raises(SystemExit):
        grad_underflow.main(["--device", "cpu", "--scale", "inf"])


# The benchmarks ---------------------------------------------------------------------------------------------

def test_peers_script_runs_and_skips_missing_peers(tmp_path, capsys):
    peers = _script("benchmarks", "peers")
    results = peers.main([*TINY, "--precisions", "bf16", "--peer-precisions", "bf16", "--json", str(tmp_path / "p.json")])
    text = capsys.readouterr().out
    assert {r.system for r in results} >= {"precisionloop", "hand"} and all(r.error is None for r in results)
    for peer, module in (("fabric", "lightning"), ("accelerate", "accelerate")):
        assert (f"{peer} is not installed; skipped" in text) == (importlib.util.find_spec(module) is None)


def test_fp8_script_times_bf16_against_fp8_and_compares_their_losses_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the script trains on CUDA wherever there is one
    report = _script("benchmarks", "fp8").main(["--tiny", "--part", "speed,loss", "--loss-steps", "3", "--rounds", "2",
                                                "--iters", "1", "--warmup", "1", "--seq-batch", "2"])
    speed, loss = report["parts"]["speed"], report["parts"]["loss"]
    assert speed["method"] == "alone" and set(speed["timings"]) == {"bf16", "fp8"}  # fp8 emulated with --tiny
    assert all(len(t["rounds_ms"]) == 2 and t["error"] is None for t in speed["timings"].values())
    assert loss["ratio"] == pytest.approx(loss["end_loss"]["fp8"] / loss["end_loss"]["bf16"])


def test_loop_cost_script_runs_on_the_cpu(capsys):
    report = _script("benchmarks", "loop_cost").main(
        ["--device", "cpu", "--model", "mobilenet_v3_small", "--image-size", "16", "--configs", "0", "--rounds", "1",
         "--iters", "1", "--warmup", "0", "--fit-steps", "1", "--fit-epochs", "1"])
    systems = report["configs"][0]["systems"]
    assert set(systems) == {"hand", "step", "hand (epochs)", "fit"}
    assert all(s["error"] is None for s in systems.values()) and systems["fit"]["vs_hand"] is not None


LOADER = ["--device", "cpu", "--precisions", "fp32", "--batch-sizes", "2", "--image-size", "32", "--images", "4",
          "--workers", "0", "--rounds", "1"]


def test_the_loader_benchmark_times_fit_beside_the_resident_step_and_a_hand_loop(tmp_path, capsys):
    out = tmp_path / "loader.json"
    rows = _script("benchmarks", "loader_bench").main([*LOADER, "--json", str(out)])
    assert "fit / hand loop" in capsys.readouterr().out
    data = json.loads(out.read_text())["loader"]
    assert len(data) == len(rows) == 8 and {(r["images"], r["system"]) for r in data} == {
        (i, s) for i in ("float32", "uint8") for s in ("loader alone", "resident step", "hand loop", "fit")}
    for r in data:
        assert r["steps"] == 2 and len(r["rounds_ms"]) == 1 and r["median_ms"] > 0
        assert (r["data_fraction"] is not None) == (r["system"] in ("hand loop", "fit"))


def test_the_loader_benchmark_normalises_uint8_images_on_the_device_in_forward_batch():
    loader_bench = _script("benchmarks", "loader_bench")
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    trainer = loader_bench.NormalizingTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    outputs, _ = trainer.forward_batch((images, torch.tensor([0, 1])))
    assert torch.allclose(outputs, model(loader_bench.normalizer(torch.device("cpu"))(images)))
    assert trainer.step((images, torch.tensor([0, 1]))).stepped


def test_the_loader_benchmark_times_a_peer_over_the_same_loader_by_its_own_clock(capsys):
    loader_bench = _script("benchmarks", "loader_bench")
    seen = []

    def peers(args, precision, loader):
        def epoch():
            seen.append(len(list(loader)))  # the same loader, a whole epoch of it
            return loader_bench.Timed(seconds=0.5, data_fraction=0.25)
        return {"peer fit": (epoch, contextlib.nullcontext)}

    args = loader_bench.parse_args([*LOADER, "--rounds", "2", "--image-dtypes", "uint8"])
    rows = {r.system: r for r in loader_bench.run(args, peers=peers)}
    assert seen == [2, 2, 2]  # a warm-up epoch, then one per round
    assert rows["peer fit"].rounds_ms == [250.0, 250.0] and rows["peer fit"].data_fraction == 0.25
    assert "fit / peer fit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        loader_bench.parse_args([*LOADER, "--pin-memory", "on"])


def test_the_lightning_fit_benchmark_runs_beside_fit_on_the_same_loader(capsys):
    pytest.importorskip("lightning", reason="the Lightning benchmark needs lightning (pip install lightning)")
    rows = _script("benchmarks", "lightning_fit").main([*LOADER, "--image-dtypes", "uint8"])
    assert {"Lightning fit", "Lightning fit, channels_last", "fit", "hand loop"} <= {r.system for r in rows}


@pytest.mark.gpu
def test_the_recipe_on_cuda(tmp_path):
    out = tmp_path / "bench.json"
    resnet18_bench.main(["--batch-sizes", "4", "--iters", "3", "--warmup", "2", "--image-size", "64", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {r["precision"] for r in results} == {"fp32-strict", "tf32", "bf16", "fp16"}
    assert all(r["peak_mb"] > 0 and r["median_ms"] > 0 and r["error"] is None for r in results)


@pytest.mark.gpu
def test_max_batch_recovery_on_cuda_returns_the_allocator_to_its_baseline():
    device = torch.device("cuda")

    def run(batch):
        held = [torch.empty(batch * 2**20, dtype=torch.uint8, device=device) for _ in range(4)]  # noqa: F841
        if batch > 64:
            torch.empty(2**50, dtype=torch.uint8, device=device)  # a petabyte: out of memory, with `held` in the frame
        return torch.cuda.max_memory_allocated(device) / 2**20

    fits = max_batch.recovering(run, max_batch.Allocator.cuda(device))
    baseline = torch.cuda.memory_allocated(device)
    assert fits(128) is None and torch.cuda.memory_allocated(device) == baseline
    got = max_batch.search(fits, start=16, cap=1024, resolution=8)
    assert got.largest == 64 and got.smallest_failed == 72


def test_a_run_that_times_fp8_on_cuda_compiles_every_precision():
    from precisionloop import BF16Policy

    args = types.SimpleNamespace(compile=None, precisions=["bf16", "fp8"])
    assert resnet18_bench.compile_for(BF16Policy(), args, torch.device("cuda", 0))  # like with like: both compiled
    assert not resnet18_bench.compile_for(BF16Policy(), types.SimpleNamespace(compile=None, precisions=["bf16"]),
                                          torch.device("cuda", 0))
    assert not resnet18_bench.compile_for(BF16Policy(), args, torch.device("cpu"))
