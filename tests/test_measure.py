"""precisionloop.measure: interleaved rounds, spread, paired ratios, CPU RSS peaks. CPU only; no timing thresholds."""

import ast
import json
from pathlib import Path

import pytest
import torch

from precisionloop import measure
from precisionloop.measure import Measurement, Run, interleaved, paired_ratio

CPU = torch.device("cpu")


class FakeClock:
    """A clock in seconds that only the steps move."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def synthetic(clock, per_round_ms, calls):
    """A factory whose n-th instance's steps take ``per_round_ms[n]`` ms on ``clock``; ``calls`` counts instances."""
    def factory():
        ms = per_round_ms[len(calls) % len(per_round_ms)]
        calls.append(ms)

        def step():
            clock.now += ms / 1e3

        return step

    return factory


def test_measure_imports_no_other_precisionloop_module():
    tree = ast.parse(Path(measure.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("precisionloop"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("precisionloop") for a in node.names)


def test_rounds_rotate_the_order_and_build_fresh_instances():
    clock, order = FakeClock(), []
    calls = {name: [] for name in "ABC"}
    systems = {name: synthetic(clock, [1.0], calls[name]) for name in "ABC"}
    interleaved(systems, rounds=3, iters=2, warmup=1, device=CPU, timer=clock, on_run=lambda r, n: order.append((r, n)))
    assert order == [(0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"), (2, "C"), (2, "A"), (2, "B")]
    assert {name: len(c) for name, c in calls.items()} == {"A": 3, "B": 3, "C": 3}


def test_median_min_max_spread_and_noisy_flag_from_a_synthetic_timer():
    clock = FakeClock()
    noisy, quiet = [], []
    result = interleaved({"noisy": synthetic(clock, [10.0, 10.0, 13.0], noisy),
                          "quiet": synthetic(clock, [10.0, 10.5, 10.2], quiet)},
                         rounds=3, iters=4, warmup=2, device=CPU, timer=clock)
    n, q = result["noisy"], result["quiet"]
    assert n.rounds_ms == pytest.approx([10.0, 10.0, 13.0]) and q.rounds_ms == pytest.approx([10.0, 10.5, 10.2])
    assert (n.median_ms, n.min_ms, n.max_ms) == pytest.approx((10.0, 10.0, 13.0))
    assert n.spread == pytest.approx(0.3) and n.noisy
    assert q.median_ms == pytest.approx(10.2) and q.spread == pytest.approx(0.5 / 10.2) and not q.noisy
    assert n.settings == {"rounds": 3, "iters": 4, "warmup": 2, "device": "cpu"}
    data = json.loads(json.dumps(n.to_dict()))
    assert data["rounds_ms"] == pytest.approx([10.0, 10.0, 13.0]) and data["noisy"] is True and data["median_ms"] == pytest.approx(10.0)


def test_time_steps_warms_up_untimed():
    clock, steps = FakeClock(), []

    def step():
        steps.append(1)
        clock.now += 0.002 * len(steps)  # the n-th step takes 2n ms

    times = measure.time_steps(step, iters=2, warmup=3, device=CPU, timer=clock)
    assert len(steps) == 5 and times == pytest.approx([8.0, 10.0])
    with pytest.raises(ValueError, match="CUDA"):
        measure.time_steps(step, iters=1, warmup=0, device=torch.device("cuda"), timer=clock)


def test_run_context_and_teardown_wrap_each_instance():
    clock, events = FakeClock(), []

    class Flags:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def factory():
        return Run(lambda: events.append("step"), context=Flags(), teardown=lambda: events.append("teardown"))

    interleaved({"a": factory}, rounds=2, iters=1, warmup=1, device=CPU, timer=clock)
    assert events == ["enter", "step", "step", "exit", "teardown"] * 2


def test_paired_ratio_pairs_rounds_by_index():
    a, b = Measurement("a", [10.0, 20.0, 30.0]), Measurement("b", [20.0, 5.0, 10.0])
    assert paired_ratio(a, b) == pytest.approx((3.0, 0.5, 4.0))  # sorted pairing would say 2.0
    with pytest.raises(ValueError):
        paired_ratio(a, Measurement("c", [1.0]))


def test_a_failing_system_is_an_error_and_the_others_are_measured():
    clock, ok_calls, oom_calls = FakeClock(), [], []

    def oom():
        oom_calls.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    def bad_step():
        def step():
            raise RuntimeError("step broke")
        return step

    result = interleaved({"oom": oom, "ok": synthetic(clock, [5.0], ok_calls), "bad": bad_step},
                         rounds=3, iters=2, warmup=0, device=CPU, timer=clock)
    assert result["oom"].error.startswith("OutOfMemoryError: CUDA out of memory") and result["oom"].median_ms is None
    assert len(oom_calls) == 1  # not rebuilt after failing
    assert result["bad"].error == "RuntimeError: step broke"
    assert result["ok"].error is None and result["ok"].rounds_ms == pytest.approx([5.0] * 3) and len(ok_calls) == 3


def test_formatting_marks_noisy_measurements_and_explains_the_mark():
    quiet, noisy = Measurement("q", [10.5, 10.71, 11.0]), Measurement("n", [10.0, 10.0, 13.0])
    assert measure.format_time(quiet) == "10.71 ms [10.5-11.0]"
    assert measure.format_time(noisy) == "10.00 ms [10.0-13.0]" + measure.NOISY_MARK
    assert measure.format_time(Measurement("e", error="boom")) == "-"
    assert measure.noisy_legend([quiet]) == ""
    assert measure.NOISY_MARK.strip() in measure.noisy_legend([quiet, noisy]) and "10%" in measure.noisy_legend([noisy])
    assert measure.format_ratio((0.98, 0.95, 1.01)) == "0.980x [0.950-1.010]"
    assert measure.format_memory(Measurement("m", peak_mb=45.2, memory_kind="MB RSS")) == "45 MB RSS"
    assert measure.format_memory(Measurement("m")) == "n/a"


def test_cpu_peak_is_resident_set_growth_since_reset():
    measure.reset_memory(CPU)
    if measure.peak_mb(CPU) is None:
        pytest.skip("/proc/self/clear_refs cannot reset the resident-set high-water mark here")
    x = torch.ones(50 * 2**20 // 4)  # 50 MB, every page written
    peak = measure.peak_mb(CPU)
    del x
    assert peak > 30
    assert measure.memory_kind(CPU) == "MB RSS"


def test_memory_kind_labels():
    assert measure.memory_kind(torch.device("cuda")) == "MB"
    assert measure.memory_kind(torch.device("meta")) == "n/a"
    assert measure.memory_kind(CPU) in ("MB RSS", "n/a")


def test_recipe_json_keeps_rounds_for_every_configuration(tmp_path):
    from precisionloop.recipes import resnet18_bench

    out = tmp_path / "bench.json"
    results = resnet18_bench.main(["--device", "cpu", "--model", "resnet18", "--batch-sizes", "2", "--image-size", "32",
                                   "--iters", "2", "--warmup", "1", "--rounds", "2", "--precisions", "fp32", "--json", str(out)])
    data = json.loads(out.read_text())["results"]
    assert {r["system"] for r in data} == {"precisionloop", "hand"} and len(results) == 2
    for r in data:
        assert r["error"] is None and len(r["rounds_ms"]) == 2
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and isinstance(r["noisy"], bool) and r["spread"] >= 0
        assert r["memory_kind"] in ("MB RSS", "n/a") and (r["peak_mb"] is None) == (r["memory_kind"] == "n/a")
        s = r["settings"]
        assert (s["precision"], s["batch_size"], s["system"], s["model"], s["image_size"]) == ("fp32", 2, r["system"], "resnet18", 32)
        assert (s["iters"], s["warmup"], s["rounds"], s["fused"], s["compile"], s["channels_last"]) == (2, 1, 2, False, False, None)
