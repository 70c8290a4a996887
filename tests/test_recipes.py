import json

import pytest

from precisionloop.recipes import resnet18_bench

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
    assert got == {(s, p, b) for s in ("precisionloop", "hand") for p in ("fp32", "tf32", "bf16") for b in (2, 3)}
    assert all((r["peak_mb"] is None) == (r["memory_kind"] == "n/a") and r["median_ms"] > 0 for r in data["results"])
    assert data["environment"]["torch"]


def test_benchmark_recipe_times_the_trainer_step(monkeypatch):
    from precisionloop import Trainer

    calls = []
    original = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self, batch: calls.append(1) or original(self, batch))
    resnet18_bench.main([*TINY, "--batch-sizes", "2", "--precisions", "bf16", "--no-hand-loop"])
    assert len(calls) == 3 * 3  # three rounds (the default) of one warm-up and two timed steps, all through Trainer.step


@pytest.mark.parametrize("argv, message", [
    (["--precisions", "fp8"], "fp8"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", "a,b"], "--batch-sizes"),
    (["--iters", "0"], "--iters"),
    (["--model", "resnet19"], "resnet18"),
])
def test_benchmark_recipe_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        resnet18_bench.main(["--device", "cpu", *argv])
    assert info.value.code != 0
    err = capsys.readouterr().err + str(info.value.code)
    assert message in err


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

    from precisionloop.fp32_modules import is_kept

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


def test_peers_script_runs_and_skips_missing_peers(tmp_path, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "peers.py"
    spec = importlib.util.spec_from_file_location("peers_script", path)
    peers = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = peers
    spec.loader.exec_module(peers)
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
