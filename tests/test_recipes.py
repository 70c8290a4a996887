"""The recipes and benchmark scripts: tiny runs on the CPU, their argument checks, and the CUDA benchmark."""

import contextlib
import dataclasses
import json
import weakref

import pytest
import torch
from torch import nn

from precisionloop.recipes import max_batch, resnet18_bench


TINY = ["--batch-sizes", "2,3", "--iters", "2", "--warmup", "1", "--image-size", "32", "--device", "cpu"]


def test_benchmark_recipe_tiny_cpu_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    resnet18_bench.main([*TINY, "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    text = capsys.readouterr().out
    assert "precisionloop benchmark: resnet18" in text and "torch" in text
    assert "fp16 left out on the CPU" in text
    assert "wrapper cost" in text and ("MB RSS" in text or "n/a" in text)  # CPU peak: RSS growth where /proc allows
    data = json.loads(out.read_text())
    got = {(r["system"], r["precision"], r["batch_size"]) for r in data["results"]}
    assert got == {(s, p, b) for s in ("precisionloop", "hand") for p in ("fp32", "bf16") for b in (2, 3)}
    assert all((r["peak_mb"] is None) == (r["memory_kind"] == "n/a") and r["median_ms"] > 0 for r in data["results"])
    assert all(r["settings"]["method"] == "alone" and r["reserved_mb"] is None for r in data["results"])
    assert "timing: alone: each round runs the systems one after the other" in text
    assert data["environment"]["torch"]


def test_benchmark_recipe_cpu_run_has_no_tf32_column_and_compares_with_fp32(capsys):
    resnet18_bench.main([*TINY, "--batch-sizes", "2", "--rounds", "1", "--no-hand-loop"])
    text = capsys.readouterr().out
    table = text.split("precisionloop Trainer.step", 1)[1].splitlines()
    assert table[0].endswith("speed-up and memory change vs fp32):")
    assert [c.strip() for c in table[1].split("|")] == ["batch", "fp32", "bf16"]  # TF32 is fp32 on the CPU
    vs = next(line for line in table if line.strip().startswith("vs "))
    assert vs.split("|")[0].strip() == "vs fp32" and vs.split("|")[1].strip().startswith("1.00x")
    assert "tf32" not in text
    assert "each round runs the systems one after the other" in text and "one system at a time" not in text


@pytest.mark.parametrize("precisions", ["tf32", "fp32,tf32,bf16"])
def test_benchmark_recipe_refuses_tf32_on_the_cpu_before_measuring(precisions, monkeypatch, capsys):
    measured = []
    monkeypatch.setattr(resnet18_bench, "measure", lambda *a, **k: measured.append(a) or [])
    with pytest.raises(SystemExit) as info:
        resnet18_bench.main([*TINY, "--precisions", precisions])
    assert info.value.code == 2 and measured == []
    err = capsys.readouterr().err
    assert "--precisions tf32: TF32 needs a CUDA GPU of compute capability 8.0+, and the CPU has none" in err
    assert "use fp32" in err


def _cuda_of(monkeypatch, capability):
    """parse_args sees cuda:0 of ``capability`` (no GPU needed: nothing is run on it)."""
    import torch

    monkeypatch.setattr(resnet18_bench, "_parse_device", lambda p, text: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_benchmark_recipe_baseline_is_tf32_only_on_cuda_with_tf32(monkeypatch, capsys):
    _cuda_of(monkeypatch, (8, 0))
    args = resnet18_bench.parse_args([])
    assert args.precisions == ["fp32", "tf32", "bf16", "fp16"] and args.baseline == "tf32"
    _cuda_of(monkeypatch, (7, 5))
    args = resnet18_bench.parse_args([])
    assert args.precisions == ["fp32", "bf16", "fp16"] and args.baseline == "fp32"
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--precisions", "tf32"])
    assert "and cuda:0 (compute capability 7.5) has none (tf32 would run as fp32); use fp32" in capsys.readouterr().err


def test_benchmark_recipe_times_the_trainer_step(monkeypatch):
    from precisionloop import Trainer

    calls = []
    original = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self, batch: calls.append(1) or original(self, batch))
    resnet18_bench.main([*TINY, "--batch-sizes", "2", "--precisions", "bf16", "--no-hand-loop"])
    # Three rounds (the default) of one warm-up and two timed steps, all through Trainer.step; then the memory
    # table's two steps (on the CPU no warm-up).
    assert len(calls) == 3 * 3 + 2


def test_benchmark_recipe_blocks_time_both_systems_side_by_side(tmp_path, capsys):
    out = tmp_path / "blocks.json"
    resnet18_bench.main([*TINY, "--batch-sizes", "2", "--precisions", "bf16", "--rounds", "2", "--iters", "4",
                         "--blocks", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "each round builds the systems side by side and alternates their timed steps in 2 blocks" in text
    assert resnet18_bench.parse_args(["--device", "cpu"]).blocks == 1  # the CPU default: one system at a time
    data = json.loads(out.read_text())
    assert {r["system"] for r in data["results"]} == {"precisionloop", "hand"}
    for r in data["results"]:
        assert r["error"] is None and len(r["rounds_ms"]) == 2 and r["settings"]["blocks"] == 2



def test_benchmark_recipe_prints_where_the_memory_goes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    resnet18_bench.main([*TINY, "--precisions", "fp32,bf16", "--rounds", "1", "--iters", "1", "--warmup", "0",
                         "--no-hand-loop", "--json", str(out)])
    text = capsys.readouterr().out
    table = text.split("where the memory goes (batch 3), MB", 1)[1].splitlines()  # the largest batch size
    assert table[1].split() == ["|", "fp32", "|", "bf16"]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in table[2:] if "|" in line}
    assert list(rows) == ["parameters", "buffers", "gradients", "optimizer state"]  # the CUDA-only rows left out
    # torchvision's ResNet18 has 11,689,512 fp32 parameters: 44.59 MB; SGD's momentum and the gradients match them.
    assert all([c.strip() for c in rows[name]] == ["44.6", "44.6"] for name in ("parameters", "gradients",
                                                                                 "optimizer state"))
    assert "measured on CUDA" in text
    memory = json.loads(out.read_text())["memory"]
    assert memory["batch_size"] == 3 and round(memory["bf16"]["parameters_mb"] * 2**20) == 11_689_512 * 4
    assert memory["fp32"]["peak_mb"] is None and memory["fp32"]["reserved_mb"] is None


def test_memory_table_checks_the_breakdown_against_the_timed_peak():
    from precisionloop import MemoryBreakdown
    from precisionloop.recipes.memory_report import format_memory_table
    parts = MemoryBreakdown(40.0, 0.0, 40.0, 40.0, peak_mb=1020.0, activations_and_workspace_mb=900.0, reserved_mb=2e3)
    table = format_memory_table({"bf16": parts, "fp16": "error: out of memory"}, 128, {"bf16": 1000.0, "fp16": 9.0})
    timed = next(line for line in table.splitlines() if line.strip().startswith("timed peak"))
    assert timed.split("|")[1].split() == ["1000.0", "(+2.0%)"] and timed.split("|")[2].strip() == ""
    assert "timed peak" not in format_memory_table({"bf16": parts}, 128)
    wide = format_memory_table({"fp32": dataclasses.replace(parts, peak_mb=140968.0)}, 6400, {"fp32": 140968.0})
    assert len({line.index("|") for line in wide.splitlines() if "|" in line}) == 1  # one column, aligned
    assert len({len(line) for line in wide.splitlines() if "|" in line}) == 1


def test_the_timed_peak_check_leaves_out_steps_that_replay_cuda_graphs():
    args = resnet18_bench.parse_args([*TINY, "--compile"])
    cuda = torch.device("cuda")
    assert not resnet18_bench.graphed("bf16", args, torch.device("cpu"))
    assert resnet18_bench.graphed("bf16", args, cuda)  # compile=True is reduce-overhead on CUDA
    args.compile = "default"
    assert not resnet18_bench.graphed("bf16", args, cuda)
    args.compile = False
    assert not resnet18_bench.graphed("bf16", args, cuda)


@pytest.mark.parametrize("argv, message", [
    (["--precisions", "fp4"], "fp4"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", "a,b"], "--batch-sizes"),
    (["--iters", "0"], "--iters"),
    (["--model", "resnet19"], "resnet18"),
    (["--blocks", "0"], "--blocks must be >= 1"),
    (["--iters", "2", "--blocks", "3"], "--blocks (3) cannot exceed --iters (2)"),
    (["--blocks", "2", "--warmup", "0"], "--blocks 2 needs --warmup >= 1"),
])
def test_benchmark_recipe_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        resnet18_bench.main(["--device", "cpu", *argv])
    assert info.value.code != 0
    err = capsys.readouterr().err + str(info.value.code)
    assert message in err


TINY_TRANSFORMER = ["--model", "transformer", "--device", "cpu", "--layers", "1", "--d-model", "32", "--d-ff", "64",
                    "--heads", "2", "--seq-len", "8", "--vocab", "64", "--batch-sizes", "2"]


def test_benchmark_recipe_times_a_transformer(tmp_path, capsys):
    import math

    out = tmp_path / "bench.json"
    resnet18_bench.main([*TINY_TRANSFORMER, "--rounds", "1", "--iters", "2", "--warmup", "1",
                         "--precisions", "fp32,bf16", "--image-size", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert "precisionloop benchmark: transformer" in text and "1 layers, d_model 32, d_ff 64, 2 heads" in text
    assert "--image-size is ignored for --model transformer" in text and "tiny Transformer by default" in text
    data = json.loads(out.read_text())["results"]
    got = {(r["system"], r["precision"], r["batch_size"]) for r in data}
    assert got == {(s, p, 2) for s in ("precisionloop", "hand") for p in ("fp32", "bf16")}
    for r in data:
        assert r["error"] is None and len(r["rounds_ms"]) == 1 and all(math.isfinite(t) and t > 0 for t in r["rounds_ms"])
        assert math.isfinite(r["median_ms"]) and r["skipped"] == 0
        s = r["settings"]
        assert (s["model"], s["layers"], s["d_model"], s["d_ff"], s["heads"], s["seq_len"], s["vocab"]) == (
            "transformer", 1, 32, 64, 2, 8, 64)
        assert s["image_size"] is None and s["channels_last"] is None and s["optimizer"] == "sgd"


def test_benchmark_recipe_times_compiled_steps_pipelined_and_eager_ones_step_by_step_on_cuda(monkeypatch):
    import torch

    from precisionloop.recipes import timing

    _cuda_of(monkeypatch, (9, 0))
    cuda = torch.device("cuda", 0)
    args = resnet18_bench.parse_args([])
    assert args.method == "auto" and args.blocks == args.iters == 50
    assert timing.method_for(args, cuda, compiled=False)[0] == "alternating"
    assert timing.method_for(args, cuda, compiled=True)[0] == "pipelined"
    assert timing.interleaved_kwargs("pipelined", args) == {"blocks": 1, "pipelined": True}
    assert timing.interleaved_kwargs("alternating", args) == {"blocks": 50, "pipelined": False}
    text = timing.describe(args, cuda, {"tf32": False, "bf16": False, "fp8": True})
    eager, compiled = text.splitlines()
    assert eager.startswith("timing [tf32, bf16]: alternating:") and "step by step" in eager and "why: eager" in eager
    assert compiled.startswith("timing [fp8]: pipelined:") and "back to back" in compiled and "why: compiled" in compiled
    one = timing.describe(args, cuda, {"bf16": True})
    assert one.startswith("timing: pipelined:") and "\n" not in one
    blocks = resnet18_bench.parse_args(["--blocks", "5"])  # --blocks alone asks for alternation, compiled or not
    assert blocks.method == "alternating" and timing.method_for(blocks, cuda, compiled=True) == ("alternating", timing.ASKED)
    assert "in 5 blocks" in timing.describe(blocks, cuda, {"bf16": True})
    forced = resnet18_bench.parse_args(["--method", "pipelined"])
    assert forced.blocks == 1 and timing.method_for(forced, cuda, compiled=False)[0] == "pipelined"


def test_benchmark_recipe_says_which_method_timed_it_and_records_it(tmp_path, capsys):
    out = tmp_path / "bench.json"
    resnet18_bench.main([*TINY, "--batch-sizes", "2", "--precisions", "bf16", "--rounds", "1", "--method", "pipelined",
                         "--no-memory-table", "--json", str(out)])
    text = capsys.readouterr().out
    assert "timing: pipelined: each round runs the systems one after the other" in text
    assert "why: asked for on the command line" in text and "where the memory goes" not in text
    results = json.loads(out.read_text())["results"]
    assert {r["settings"]["method"] for r in results} == {"pipelined"} and all(r["error"] is None for r in results)


@pytest.mark.parametrize("argv, message", [
    (["--method", "pipelined", "--blocks", "5"], "--method pipelined times each alone"),
    (["--method", "alternating", "--blocks", "1"], "--method alternating needs --blocks >= 2"),
])
def test_benchmark_recipe_refuses_blocks_with_a_method_that_times_systems_alone(argv, message, capsys):
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--device", "cpu", "--iters", "6", *argv])
    assert message in capsys.readouterr().err


def test_benchmark_recipe_transformer_large_size_is_877m_parameters(monkeypatch):
    from precisionloop.recipes import models

    _cuda_of(monkeypatch, (9, 0))
    args = resnet18_bench.parse_args(["--model", "transformer", "--size", "large", "--heads", "64"])
    assert (args.layers, args.d_model, args.d_ff, args.heads, args.seq_len) == (4, 4096, 16384, 64, 1024)
    assert "add fp8 to --precisions" in " ".join(args.notes)
    assert models.parameter_count(**models.LARGE) == 876_838_912
    assert models.describe(models.LARGE) == "4 layers, d_model 4096, d_ff 16384, 32 heads, 877M parameters"


def test_benchmark_recipe_transformer_cpu_defaults_are_tiny_and_reference_on_cuda(monkeypatch):
    from precisionloop.recipes import models

    args = resnet18_bench.parse_args(["--model", "transformer", "--device", "cpu"])
    assert {k: getattr(args, k) for k in models.TINY} == models.TINY and args.batch_sizes == [4]
    assert args.image_size is None and args.precisions == ["fp32", "bf16"]
    _cuda_of(monkeypatch, (9, 0))
    args = resnet18_bench.parse_args(["--model", "transformer"])
    assert {k: getattr(args, k) for k in models.REFERENCE} == models.REFERENCE and args.batch_sizes == [8]
    assert resnet18_bench.parse_args(["--device", "cpu", "--layers", "3"]).notes[0].startswith("--layers only apply")


def test_benchmark_recipe_transformer_trains_with_the_same_loss_in_both_systems():
    import torch

    from precisionloop import Trainer
    from precisionloop.recipes import models

    args = resnet18_bench.parse_args([*TINY_TRANSFORMER, "--optimizer", "adamw"])
    batch = resnet18_bench.make_batch(args, 2, args.device)
    assert batch[0].shape == batch[1].shape == (2, 8) and torch.equal(batch[0][:, 1:], batch[1][:, :-1])
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


def test_transformer_stack_shapes_and_linear_sizes():
    import torch
    from torch import nn

    from precisionloop.recipes.models import TransformerStack, random_tokens

    model = TransformerStack(layers=3, d_model=48, d_ff=96, heads=4, vocab=50, seq_len=16)
    inputs, targets = random_tokens(5, 16, 50, "cpu")
    assert inputs.shape == targets.shape == (5, 16) and int(inputs.max()) < 50
    assert model(inputs).shape == (5, 16, 50) and model(inputs[:, :7]).shape == (5, 7, 50)
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 3 * 6 + 1 and type(model.head) is nn.Linear
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # nothing fp8 would skip
    for i in range(3):
        for proj in ("q", "k", "v", "out"):
            assert linears[f"blocks.{i}.attn.{proj}"] == (48, 48)
        assert linears[f"blocks.{i}.mlp.0"] == (48, 96) and linears[f"blocks.{i}.mlp.2"] == (96, 48)
    assert linears["head"] == (48, 50)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    from precisionloop.recipes.models import parameter_count

    assert parameter_count(3, 48, 96, 4, 50, 16) == sum(p.numel() for p in model.parameters())
    causal = model(inputs)[:, :4]
    changed = inputs.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 50
    assert torch.allclose(model(changed)[:, :4], causal, atol=1e-5)  # a position sees no later token
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        TransformerStack(layers=1, d_model=30, d_ff=8, heads=4)


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1"),
    (["--d-model", "30", "--heads", "4"], "--d-model (30) must be divisible by --heads (4)"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--vocab", "1"], "--vocab must be >= 2"),
    (["--seq-len", "-3"], "--seq-len must be >= 1"),
    (["--d-ff", "x"], "--d-ff: invalid int value"),
    (["--optimizer", "lamb"], "--optimizer: invalid choice"),
])
def test_benchmark_recipe_rejects_bad_transformer_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        resnet18_bench.main(["--device", "cpu", "--model", "transformer", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _load_script(name):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_train_classifier_runs_offline_and_resumes(tmp_path, capsys):
    script = _load_script("train_classifier")
    common = ["--precision", "bf16", "--device", "cpu", "--synthetic-size", "320", "--batch-size", "32", "--no-progress"]
    history = script.main([*common, "--epochs", "2", "--max-steps", "5", "--checkpoint-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "synthetic images made in-process" in out
    assert history[-1]["complete"] is False and (tmp_path / "last.pt").is_file()
    history = script.main([*common, "--epochs", "2", "--resume", str(tmp_path / "last.pt")])
    assert [h["epoch"] for h in history] == [1, 2] and history[0]["complete"] and history[-1]["complete"]
    assert 0.0 <= history[-1]["accuracy"] <= 1.0 and history[-1]["val_loss"] < history[0]["train_loss"]
    assert "resumed from" in capsys.readouterr().out


def test_train_classifier_keeps_named_modules_in_fp32(tmp_path, capsys, monkeypatch):
    import torch

    from precisionloop.keep_fp32 import is_kept

    script = _load_script("train_classifier")
    made = []

    class Recording(script.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(script, "Trainer", Recording)
    assert [n for n, _ in script.small_cnn().named_children()] == ["features", "dropout", "head"]
    history = script.main(["--precision", "bf16", "--keep-fp32", "BatchNorm2d,head", "--device", "cpu",
                           "--synthetic-size", "160", "--batch-size", "32", "--epochs", "1", "--max-steps", "2",
                           "--no-progress", "--checkpoint-dir", str(tmp_path)])
    assert "training with bf16 on cpu, keeping BatchNorm2d, head in fp32" in capsys.readouterr().out
    assert history[-1]["steps"] == 2 and history[-1]["skipped"] == 0
    assert [n for n, m in made[0].model.named_modules() if is_kept(m)] == ["features.1", "features.5", "head"]
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["precision"] == "bf16" and state["keep_fp32"] == ["torch.nn.modules.batchnorm.BatchNorm2d", "head"]
    with pytest.raises(ValueError, match="'haed'"):  # a typo is an error, not a silent no-op
        script.main(["--precision", "bf16", "--keep-fp32", "haed", "--device", "cpu", "--synthetic-size", "64"])


def test_train_classifier_missing_dataset_says_how_to_get_it(tmp_path):
    script = _load_script("train_classifier")
    with pytest.raises(SystemExit, match="--download"):
        script.main(["--data-dir", str(tmp_path), "--device", "cpu"])


def test_custom_policy_recipe_trains_with_both_policies():
    script = _load_script("custom_policy")
    losses = script.main(steps=20)
    assert set(losses) == {"vendor-fp16", "audited-bf16"}
    assert all(loss < 1.0 for loss in losses.values())


def test_grad_underflow_recipe_tiny_run(tmp_path, capsys):
    from precisionloop.recipes import grad_underflow

    out = tmp_path / "u.json"
    result = grad_underflow.main(["--epochs", "1", "--max-steps", "3", "--device", "cpu", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert "data: " in text and "offline" in text
    assert "below fp16's floor" in text and "seed (FashionMNIST)" in text
    saved = json.loads(out.read_text())
    assert saved["steps"] == 3 and saved["fp16"]["nonzero"] > 0 and saved["bf16"]["underflow"] == 0
    assert saved["fp16"]["dtype"] == "float16" and result["fp16"]["scale"] == 65536.0


def _benchmark_script(name):
    """A script of benchmarks/ (not a package) imported as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_peers_script_runs_and_skips_missing_peers(tmp_path, capsys):
    import importlib.util

    peers = _benchmark_script("peers")
    out = tmp_path / "peers.json"
    results = peers.main([*TINY, "--batch-sizes", "2", "--precisions", "fp32,bf16", "--peer-precisions", "bf16",
                          "--json", str(out)])
    text = capsys.readouterr().out
    ours = [r for r in results if r.system in ("precisionloop", "hand")]
    assert len(ours) == 4 and all(r.error is None for r in ours)
    for peer, module in (("fabric", "lightning.fabric"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            assert f"{peer} is not installed; skipped" in text
        else:
            assert any(r.system == peer and r.error is None for r in results)
    assert json.loads(out.read_text())["results"]


def test_fp8_script_times_bf16_against_fp8_and_compares_their_losses_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the script trains on CUDA wherever there is one
    fp8 = _benchmark_script("fp8")
    out = tmp_path / "fp8.json"
    report = fp8.main(["--tiny", "--part", "speed,loss", "--loss-steps", "3", "--rounds", "2", "--iters", "2",
                       "--warmup", "1", "--seq-batch", "2", "--json", str(out)])
    speed, loss = report["parts"]["speed"], report["parts"]["loss"]
    assert speed["method"] == "alone" and set(speed["timings"]) == {"bf16", "fp8"}  # fp8 emulated with --tiny
    assert all(len(t["rounds_ms"]) == 2 and t["error"] is None for t in speed["timings"].values())
    ratios = [f / b for b, f in zip(speed["timings"]["bf16"]["rounds_ms"], speed["timings"]["fp8"]["rounds_ms"])]
    assert speed["speedup_fp8_vs_bf16"] == pytest.approx([2 / sum(ratios), 1 / max(ratios), 1 / min(ratios)])
    assert loss["ratio"] == pytest.approx(loss["end_loss"]["fp8"] / loss["end_loss"]["bf16"])
    assert len(loss["curves"]["bf16"]) == len(loss["curves"]["fp8"]) == 3
    assert "timing: alone:" in capsys.readouterr().out
    assert json.loads(out.read_text())["parts"]["speed"]["sizes"]["d_model"] == 64


def test_fp8_script_refuses_tiny_with_a_size_it_would_ignore(capsys):
    fp8 = _benchmark_script("fp8")
    for size in ("large", "reference"):
        with pytest.raises(SystemExit):
            fp8.main(["--tiny", "--size", size, "--part", "speed"])
        assert f"--size {size} would be ignored" in capsys.readouterr().err


def test_loop_cost_script_runs_on_the_cpu_step_by_step(tmp_path, capsys):
    loop_cost = _benchmark_script("loop_cost")
    out = tmp_path / "loop_cost.json"
    report = loop_cost.main(["--device", "cpu", "--image-size", "16", "--configs", "0", "--rounds", "1", "--iters", "2",
                             "--warmup", "1", "--fit-steps", "2", "--fit-epochs", "2", "--json", str(out)])
    systems = report["configs"][0]["systems"]
    assert set(systems) == {"hand", "step", "hand (epochs)", "fit"}
    assert all(s["error"] is None and len(s["rounds_ms"]) == 1 for s in systems.values())
    assert systems["step"]["vs_hand"] is not None and systems["fit"]["vs_hand"] is not None
    assert json.loads(out.read_text())["configs"][0]["config"]["batch_size"] == 32
    assert "bf16 b32 fused-sgd eager" in capsys.readouterr().out


def test_the_loader_mode_times_fit_beside_the_resident_step_and_a_hand_loop(tmp_path, capsys, monkeypatch):
    from precisionloop import Trainer

    out = tmp_path / "loader.json"
    fits = []
    original = Trainer.fit
    monkeypatch.setattr(Trainer, "fit", lambda self, *a, **k: fits.append(k["device_feed"]) or original(self, *a, **k))
    rows = resnet18_bench.main(["--loader", "--device", "cpu", "--precisions", "bf16", "--batch-sizes", "2",
                                "--image-size", "32", "--images", "4", "--workers", "0", "--rounds", "1",
                                "--json", str(out)])
    text = capsys.readouterr().out
    assert "over a DataLoader" in text and "fit / hand loop" in text and "the slower bound" in text
    assert "the device feed does nothing" in text  # on the CPU: no twin without the feed
    data = json.loads(out.read_text())["loader"]
    assert len(data) == len(rows) == 8 and len(fits) == 2 * 2  # per image dtype: a warm-up epoch and one round
    systems = ("loader alone", "resident step", "hand loop", "fit")
    assert {(r["images"], r["system"], r["pin_memory"]) for r in data} == {
        (i, s, False) for i in ("float32", "uint8") for s in systems}
    for r in data:
        assert r["precision"] == "bf16" and r["batch_size"] == 2 and r["steps"] == 2 and len(r["rounds_ms"]) == 1
        assert r["median_ms"] > 0 and r["img_per_s"] == pytest.approx(1000 * 2 / r["median_ms"])
        waits = r["system"] in ("hand loop", "fit")
        assert (r["data_fraction"] is not None) == waits and (not waits or 0 <= r["data_fraction"] <= 1)


def test_the_loader_mode_times_a_peer_over_the_same_loader_by_its_own_clock(capsys):
    from precisionloop.recipes import loader_bench

    seen = []

    def peers(args, precision, loader):
        def epoch():
            seen.append(len(list(loader)))  # the same loader, a whole epoch of it
            return loader_bench.Timed(seconds=0.5, data_fraction=0.25)
        return {"peer fit": (epoch, contextlib.nullcontext)}

    args = resnet18_bench.parse_args(["--loader", "--device", "cpu", "--precisions", "bf16", "--batch-sizes", "2",
                                      "--image-size", "32", "--images", "4", "--workers", "0", "--rounds", "2",
                                      "--image-dtypes", "uint8"])
    rows = {r.system: r for r in loader_bench.main(args, peers=peers)}
    assert seen == [2, 2, 2]  # a warm-up epoch, then one per round
    assert rows["peer fit"].rounds_ms == [250.0, 250.0] and rows["peer fit"].data_fraction == 0.25  # 0.5 s / 2 steps
    assert "fit / peer fit" in capsys.readouterr().out


def test_lightning_flags_read_the_legacy_way_inside_and_restore_every_setting_after():
    from precisionloop import get_policy

    script = _benchmark_script("lightning_fit")  # imports no Lightning
    settings = script._flag_settings()
    before = [getattr(owner, name) for owner, name in settings]
    with get_policy("tf32").backend_flags():  # per-backend settings, under which the legacy read raises
        inside = [getattr(owner, name) for owner, name in settings]
        with script.lightning_flags(tf32=False, benchmark=False):
            assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.benchmark is False
        assert [getattr(owner, name) for owner, name in settings] == inside
    assert [getattr(owner, name) for owner, name in settings] == before


def test_the_lightning_fit_benchmark_runs_beside_fit_on_the_same_loader(capsys):
    pytest.importorskip("lightning", reason="the Lightning benchmark needs lightning (pip install lightning)")
    script = _benchmark_script("lightning_fit")
    rows = script.main(["--device", "cpu", "--precisions", "bf16", "--batch-sizes", "2", "--image-size", "32",
                        "--images", "4", "--workers", "0", "--rounds", "1", "--image-dtypes", "uint8"])
    timed = {r.system: r.rounds_ms for r in rows}
    assert {"Lightning fit", "Lightning fit, channels_last", "fit", "hand loop"} <= set(timed)
    assert all(len(ms) == 1 and ms[0] > 0 for ms in timed.values())
    assert "fit / Lightning fit, channels_last" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="on the CPU Lightning trains 16-mixed as bf16-mixed"):
        script.main(["--device", "cpu", "--precisions", "bf16,fp16"])


def test_the_loader_mode_with_compile_compiles_every_system_it_builds(capsys, monkeypatch):
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw["mode"])))
    resnet18_bench.main(["--loader", "--compile", "--device", "cpu", "--precisions", "bf16", "--batch-sizes", "2",
                         "--image-size", "32", "--images", "4", "--workers", "0", "--rounds", "1",
                         "--image-dtypes", "uint8"])
    assert "steps compiled (the Trainer's mode) for every system" in capsys.readouterr().out
    assert compiled == [("ResNet", "default")] * 3  # the resident step's, the hand loop's and fit's Trainers


@pytest.mark.parametrize("flags, message", [
    (["--workers", "2"], "--workers only apply with --loader"),
    (["--image-dtypes", "uint8"], "--image-dtypes only apply with --loader"),
    (["--loader", "--pin-memory", "on"], "pinned memory is for copies to CUDA; on cpu use off"),
    (["--loader", "--model", "transformer"], "--model transformer is not for it"),
    (["--loader", "--images", "1"], "--images (1) must hold at least one batch of 8"),
    (["--loader", "--workers", "-1"], "--workers must be >= 0"),
    (["--loader", "--image-dtypes", "float16"], "--image-dtypes takes float32 and/or uint8"),
    (["--loader", "--iters", "5", "--no-hand-loop"], "--iters, --no-hand-loop: not for --loader"),
    (["--loader", "--plot", "x.png"], "--plot: not for --loader"),
    (["--loader", "--warmup", "0", "--method", "pipelined", "--no-memory-table"],
     "--warmup, --method, --no-memory-table: not for --loader"),
])
def test_the_loader_mode_refuses_bad_arguments_before_measuring(flags, message, capsys):
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


# Bad arguments, refused at parsing (unchecked, each ran its timings or training first, then failed and lost
# the results, or ran something else than asked) ------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--precisions", "bf16,bf16"], "names bf16 twice"),
    (["--precisions", "fp32,float32"], "names fp32 twice"),
    (["--precisions", " "], "names none"),
    (["--image-size", "0"], "--image-size must be >= 16, got 0"),
    (["--batch-sizes="], "--batch-sizes takes positive integers"),
    (["--device", "mps"], "the benchmark runs on cuda, cuda:N or cpu"),
    (["--precisions", "fp16", "--autotune"], "--autotune chooses among"),
])
def test_the_recipe_refuses_bad_arguments_before_measuring(flags, message, capsys):
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("where", ["dir", "missing"])
def test_every_script_refuses_a_json_path_it_could_not_write(where, tmp_path, capsys):
    from precisionloop.recipes import grad_underflow

    path = str(tmp_path) if where == "dir" else str(tmp_path / "missing" / "out.json")
    for main in (lambda a: resnet18_bench.parse_args(["--device", "cpu", *a]), lambda a: grad_underflow.main(["--device", "cpu", *a]),
                 lambda a: _benchmark_script("loop_cost").main(["--device", "cpu", *a])):
        with pytest.raises(SystemExit):
            main(["--json", path])
        assert "--json" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--fit-steps", "-1"], "--fit-steps must be >= 1"),
    (["--fit-epochs", "0"], "--fit-epochs must be >= 1"),
    (["--configs", "-2"], "--configs takes indices 0-"),
    (["--configs", "a"], "--configs takes indices 0-"),
    (["--device", "mps"], "the benchmark runs on cuda, cuda:N or cpu"),
])
def test_loop_cost_refuses_bad_arguments_before_timing(flags, message, capsys):
    with pytest.raises(SystemExit):
        _benchmark_script("loop_cost").main(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_grad_underflow_refuses_a_scale_that_is_not_finite(capsys):
    from precisionloop.recipes import grad_underflow

    for scale in ("nan", "inf"):
        with pytest.raises(SystemExit):
            grad_underflow.main(["--device", "cpu", "--scale", scale])
        assert "--scale a finite number > 0" in capsys.readouterr().err


def test_peers_pair_their_fp32_with_ours_on_the_cpu(monkeypatch):
    peers = _benchmark_script("peers")
    assert peers._group("fp32", peers.bench.parse_args(TINY)) == "fp32"  # no TF32 on the CPU: our fp32 is theirs
    _cuda_of(monkeypatch, (9, 0))
    args = peers.bench.parse_args([])
    assert peers._group("fp32", args) == "tf32" and peers._group("bf16", args) == "bf16"


def test_peers_time_each_peer_at_its_default_layout_and_in_channels_last(monkeypatch):
    import torch

    peers = _benchmark_script("peers")
    seen = {}

    def fake_peer(model, batch, precision, device, fused):
        conv = model.conv1.weight
        seen[len(seen)] = (conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous(),
                           batch[0].is_contiguous(memory_format=torch.channels_last) and not batch[0].is_contiguous())
        return lambda: None

    monkeypatch.setitem(peers.PEERS, "fake", fake_peer)
    assert peers.peer_systems(["fake"], ["default", "channels_last"]) == [("fake", "fake", False),
                                                                          ("fake+channels_last", "fake", True)]
    args = peers.bench.parse_args(TINY)
    results = peers.measure_group(2, "bf16", args, peers.peer_systems(["fake"], list(peers.LAYOUTS)), ["bf16"],
                                  on_run=lambda r, n: None)
    assert {r.system for r in results} == {"precisionloop", "hand", "fake", "fake+channels_last"}
    assert all(r.error is None and r.settings["method"] == "alone" for r in results)
    assert set(seen.values()) == {(False, False), (True, True)}  # one NCHW instance per round, one channels_last
    with pytest.raises(SystemExit):
        peers.main(["--device", "cpu", "--peer-layouts", "nhwc"])


def test_peers_refuses_an_unknown_peer_precision_and_skips_a_group_with_no_system(capsys):
    peers = _benchmark_script("peers")
    with pytest.raises(SystemExit):
        peers.main(["--device", "cpu", "--peer-precisions", "xx"])
    assert "--peer-precisions: unknown 'xx'" in capsys.readouterr().err
    assert peers.measure_group(2, "fp16", peers.bench.parse_args([*TINY, "--precisions", "bf16"]), [], ["fp16"],
                               on_run=lambda r, n: None) == []


@pytest.mark.gpu
def test_benchmark_recipe_on_cuda(tmp_path):
    import json

    from precisionloop.recipes import resnet18_bench

    out = tmp_path / "bench.json"
    resnet18_bench.main(["--batch-sizes", "4", "--iters", "3", "--warmup", "2", "--image-size", "64", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {r["precision"] for r in results} == {"fp32", "tf32", "bf16", "fp16"}
    assert all(r["peak_mb"] > 0 and r["median_ms"] > 0 and r["error"] is None for r in results)


# --max-batch: the search against a fake "fits", the recovery against a fake allocator and fake out-of-memory errors.

def _fits_below(limit, peak_per_item=2.0, seen=None):
    def fits(batch):
        if seen is not None:
            seen.append(batch)
        return batch * peak_per_item if batch <= limit else None
    return fits


@pytest.mark.parametrize("limit", [1, 7, 8, 63, 64, 65, 100, 1000, 2047])
def test_max_batch_search_finds_the_largest_fit_to_the_resolution(limit):
    seen = []
    got = max_batch.search(_fits_below(limit, seen=seen), start=64, cap=4096, resolution=8)
    best = limit if limit < 8 else limit // 8 * 8  # bisected batches are multiples of 8; start and cap as they are
    if limit >= 64:
        best = max(best, 64)
    assert got.largest == (best if best >= 8 or limit >= 64 else None)
    assert got.stopped == "resolved" and got.smallest_failed > (got.largest or 0)
    assert (got.smallest_failed - (got.largest or 0)) <= 8
    assert got.peak_mb == (None if got.largest is None else 2.0 * got.largest)
    assert [b for b, _ in got.tries] == seen and len(set(seen)) == len(seen)  # no batch tried twice
    assert seen[0] == 64 and all(b <= 4096 for b in seen)


def test_max_batch_search_doubles_then_bisects_and_stops_at_the_cap():
    got = max_batch.search(_fits_below(700), start=64, cap=4096, resolution=16)
    assert got.tries == ((64, True), (128, True), (256, True), (512, True), (1024, False), (768, False),
                         (640, True), (704, False), (672, True), (688, True))
    assert got.largest == 688 and got.smallest_failed == 704
    capped = max_batch.search(_fits_below(10**6), start=64, cap=1000, resolution=8)
    assert capped.stopped == "cap" and capped.largest == 1000 and capped.tries[-1] == (1000, True)
    assert max_batch.describe(capped) == ">= 1000 (the cap)"


def test_max_batch_search_stops_at_its_time_limit():
    ticks = iter(range(100))
    got = max_batch.search(_fits_below(700), start=64, cap=4096, resolution=16, seconds=2.5, clock=lambda: next(ticks))
    assert got.stopped == "time" and got.largest == 256 and len(got.tries) == 3
    assert max_batch.describe(got) == ">= 256 (time limit)"


@pytest.mark.parametrize("bad", [dict(start=0), dict(cap=32, start=64), dict(resolution=0), dict(start=1.5)])
def test_max_batch_search_refuses_sizes_that_make_no_search(bad):
    with pytest.raises(ValueError):
        max_batch.search(_fits_below(10), **{"start": 64, "cap": 4096, "resolution": 8, **bad})


class _FakeDevice:
    """An allocator whose allocated bytes are those of the live _Block objects; the cache and the peak are counted."""

    def __init__(self):
        self.blocks = weakref.WeakSet()
        self.emptied = self.resets = 0
        self.allocator = max_batch.Allocator(lambda: sum(b.size for b in self.blocks), self._empty, self._reset)

    def _empty(self):
        self.emptied += 1

    def _reset(self):
        self.resets += 1

    def block(self, size):
        block = _Block(size)
        self.blocks.add(block)
        return block


class _Block:
    def __init__(self, size):
        self.size = size


def test_max_batch_recovery_drops_what_a_failed_try_held_in_its_frames_and_cycles():
    device = _FakeDevice()
    kept = device.block(5)  # allocated before the search: the baseline

    def run(batch):
        activations = [device.block(1) for _ in range(batch)]  # held by this frame, then by the traceback
        cycle = {"block": device.block(3)}
        cycle["self"] = cycle  # freed only by the garbage collector
        if batch > 4:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {batch}")
        return float(len(activations))

    fits = max_batch.recovering(run, device.allocator)
    assert fits(4) == 4.0 and fits(5) is None and fits(3) == 3.0
    assert device.allocator.allocated() == 5 and kept.size == 5
    assert device.emptied == device.resets == 4  # before the first try, then after each
    got = max_batch.search(fits, start=1, cap=64, resolution=1)
    assert got.largest == 4 and got.smallest_failed == 5


def test_max_batch_recovery_raises_when_a_try_leaves_memory_behind_and_passes_other_errors():
    device = _FakeDevice()
    leaked = []

    def run(batch):
        leaked.append(device.block(batch))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="7.0 MB is still allocated after the try at batch 7 .out of memory."):
        max_batch.recovering(run, max_batch.Allocator(lambda: sum(b.size for b in device.blocks) * 2**20,
                                                      lambda: None, lambda: None))(7)

    def broken(batch):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        max_batch.recovering(broken, _FakeDevice().allocator)(1)
    assert max_batch.recovering(lambda b: (_ for _ in ()).throw(RuntimeError("CUDNN_STATUS_ALLOC_FAILED")),
                                _FakeDevice().allocator)(1) is None


def test_max_batch_is_refused_off_cuda_with_a_clear_message(capsys):
    with pytest.raises(SystemExit):
        resnet18_bench.parse_args(["--device", "cpu", "--max-batch"])
    assert "--max-batch searches for the largest batch that fits in a CUDA GPU's memory" in capsys.readouterr().err


def test_max_batch_table_names_each_precision_its_batch_and_peak():
    args = resnet18_bench.parse_args(["--device", "cpu"])
    results = {"fp32": max_batch.search(_fits_below(100), 64, 4096, 8), "bf16": max_batch.search(_fits_below(10**5), 64, 256, 8),
               "fp16": "error: 3.0 MB is still allocated after the try at batch 8"}
    text = max_batch.format_table(results, args)
    assert "96 (< 104)" in text and "192" in text and ">= 256 (the cap)" in text and "512" in text
    assert "fp16 | error: 3.0 MB is still allocated" in text
    assert "search time in all" in text
    assert "max_batch" in vars(args) and args.max_batch is False


@pytest.mark.gpu
def test_max_batch_recovery_on_cuda_returns_the_allocator_to_its_baseline():
    device = torch.device("cuda")
    allocator = max_batch.cuda_allocator(device)

    def run(batch):
        held = [torch.empty(batch * 2**20, dtype=torch.uint8, device=device) for _ in range(4)]  # 4 x batch MB
        if batch > 64:
            torch.empty(2**50, dtype=torch.uint8, device=device)  # a petabyte: out of memory, with `held` in the frame
        assert sum(t.numel() for t in held) == 4 * batch * 2**20
        return torch.cuda.max_memory_allocated(device) / 2**20

    fits = max_batch.recovering(run, allocator)
    baseline = torch.cuda.memory_allocated(device)
    assert fits(128) is None and torch.cuda.memory_allocated(device) == baseline
    assert fits(64) >= 4 * 64 and torch.cuda.memory_allocated(device) == baseline
    got = max_batch.search(fits, start=16, cap=1024, resolution=8)
    assert got.largest == 64 and got.smallest_failed == 72


@pytest.mark.gpu
def test_the_loader_mode_on_cuda_times_fit_with_and_without_the_feed_pinned_and_not(tmp_path):
    out = tmp_path / "loader.json"
    resnet18_bench.main(["--loader", "--precisions", "bf16", "--batch-sizes", "4", "--image-size", "32", "--images", "8",
                         "--workers", "2", "--rounds", "1", "--json", str(out)])
    data = json.loads(out.read_text())["loader"]
    assert {(r["system"], r["pin_memory"]) for r in data} >= {("fit", True), ("fit, no feed", True),
                                                              ("fit", False), ("fit, no feed", False)}
    assert all(r["median_ms"] > 0 for r in data)
