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
    assert n.settings == {"rounds": 3, "iters": 4, "warmup": 2, "device": "cpu", "method": "alone"}
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


@pytest.mark.parametrize("warmup, steps_before_reset", [(0, 0), (1, 1), (2, 1), (5, 4)])
def test_the_peak_counters_restart_after_the_first_step_and_before_the_last_warm_up_step(monkeypatch, warmup,
                                                                                         steps_before_reset):
    events = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: events.append("reset"))
    measure._warm_up(lambda: events.append("step"), warmup, torch.device("cuda"))
    # The first step's one-off memory (cuDNN's trials, the optimizer state) is never in the peak.
    assert events == ["step"] * steps_before_reset + ["reset"] + ["step"] * (warmup - steps_before_reset)


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


def test_blocks_alternate_the_timed_steps_and_rotate():
    clock, log = FakeClock(), []

    def factory(name):
        def build():
            log.append(f"build {name}")
            return lambda: log.append(name)
        return build

    interleaved({"A": factory("A"), "B": factory("B")}, rounds=2, iters=4, warmup=1, blocks=2, device=CPU, timer=clock)
    round0 = ["build A", "A", "build B", "B", "A", "A", "B", "B", "B", "B", "A", "A"]
    round1 = ["build B", "B", "build A", "A", "B", "B", "A", "A", "A", "A", "B", "B"]
    assert log == round0 + round1


def _drifting(clock, base_ms, count):
    """A factory whose steps take ``base_ms`` on a host that slows by 10% of its first speed with every step run."""
    def factory():
        def step():
            count.append(1)
            clock.now += base_ms * (1 + 0.1 * len(count)) / 1e3
        return step
    return factory


def test_blocks_pair_systems_in_time_so_a_drifting_host_cancels_out():
    """B costs 1.1x A on a host that keeps slowing down. Runs one after the other see the drift; blocks do not."""
    def ratio(blocks):
        clock, count = FakeClock(), []
        result = interleaved({"A": _drifting(clock, 10.0, count), "B": _drifting(clock, 11.0, count)},
                             rounds=3, iters=10, warmup=1, blocks=blocks, device=CPU, timer=clock)
        return paired_ratio(result["B"], result["A"])

    assert ratio(10)[0] == pytest.approx(1.1)
    assert ratio(10)[1] == pytest.approx(1.1) and ratio(10)[2] == pytest.approx(1.1)
    solo = ratio(1)
    assert solo[2] - solo[1] > 0.5  # the same systems measured one after the other: rounds disagree wildly


def test_blocks_a_failing_system_is_torn_down_and_the_others_are_measured():
    clock, torn = FakeClock(), []

    def bad():
        calls = []

        def step():
            calls.append(1)
            if len(calls) > 2:  # warm-up passes, the second timed block fails
                raise RuntimeError("step broke")
        return Run(step, teardown=lambda: torn.append("bad"))

    def ok():
        return Run(lambda: None, teardown=lambda: torn.append("ok"))

    result = interleaved({"bad": bad, "ok": ok}, rounds=2, iters=2, warmup=1, blocks=2, device=CPU, timer=clock)
    assert result["bad"].error == "RuntimeError: step broke" and result["bad"].rounds_ms == []
    assert result["ok"].error is None and len(result["ok"].rounds_ms) == 2
    assert torn == ["bad", "ok", "ok"]  # the failed one at once, then once per round for the other
    assert result["ok"].settings["blocks"] == 2


def test_blocks_must_fit_in_the_timed_steps():
    with pytest.raises(ValueError, match="blocks=5"):
        interleaved({"a": lambda: (lambda: None)}, iters=4, warmup=0, blocks=5, device=CPU)
    with pytest.raises(ValueError, match="blocks=0"):
        interleaved({"a": lambda: (lambda: None)}, iters=4, warmup=0, blocks=0, device=CPU)


def test_blocks_cpu_peak_counts_a_systems_memory_and_not_the_others():
    measure.reset_memory(CPU)
    if measure.peak_mb(CPU) is None:
        pytest.skip("/proc/self/clear_refs cannot reset the resident-set high-water mark here")

    def holder(held_mb, step_mb):
        def build():
            held = torch.ones(held_mb * 2**20 // 4)

            def step():
                tmp = torch.ones(step_mb * 2**20 // 4)
                return held[0] + tmp[-1]
            return step
        return build

    result = interleaved({"small": holder(40, 20), "big": holder(160, 1)}, rounds=1, iters=2, warmup=1, blocks=2,
                         device=CPU)
    small, big = result["small"].peak_mb, result["big"].peak_mb
    assert 30 < small < 120  # its own 40 MB and its step's 20 MB, not the other system's 160 MB
    assert big > 120 and result["small"].memory_kind == "MB RSS"


def test_blocks_enter_a_context_factory_once_per_block_and_refuse_a_one_shot_context():
    import contextlib

    clock, events = FakeClock(), []

    @contextlib.contextmanager
    def flags():
        events.append("enter")
        yield
        events.append("exit")

    result = interleaved({"a": lambda: Run(lambda: events.append("step"), context=flags)}, rounds=1, iters=2, warmup=1,
                         blocks=2, device=CPU, timer=clock)
    assert result["a"].error is None
    assert events == ["enter", "step", "exit"] * 3  # the warm-up, then each of the two blocks
    one_shot = interleaved({"a": lambda: Run(lambda: None, context=flags())}, rounds=1, iters=2, warmup=1, blocks=2,
                           device=CPU, timer=clock)
    assert one_shot["a"].error.startswith("TypeError: with blocks > 1 a Run's context is entered once per block")


def test_blocks_count_memory_the_process_keeps_for_everyone_as_a_run_alone_would(monkeypatch):
    """CUDA's accounting, on a fake allocator: a workspace the first system's warm-up allocates and the
    process keeps (cuBLAS's, say) is in use during every later run, so both systems' peaks count it."""
    mem = {"used": 0.0, "top": 0.0}

    def use(mb):
        mem["used"] += mb
        mem["top"] = max(mem["top"], mem["used"])

    def system(own, transient):
        def build():
            use(own)

            def step():
                if "workspace" not in mem:
                    mem["workspace"] = True
                    use(64.0)  # kept for the process's life
                use(transient)
                use(-transient)
            return Run(step, teardown=lambda: use(-own))
        return build

    def fake_time_steps(step, *, iters, warmup, device, timer=None):
        for _ in range(warmup):
            step()
        mem["top"] = mem["used"]  # as torch.cuda.reset_peak_memory_stats after the warm-up
        for _ in range(iters):
            step()
        return [1.0] * iters

    monkeypatch.setattr(measure, "reset_memory", lambda device: None)
    monkeypatch.setattr(measure, "time_steps", fake_time_steps)
    monkeypatch.setattr(measure, "_resident_mb", lambda device: mem["used"])
    monkeypatch.setattr(measure, "_block_peak_mb", lambda device, base: mem["top"])
    result = interleaved({"a": system(100.0, 10.0), "b": system(300.0, 30.0)}, rounds=2, iters=2, warmup=1, blocks=2,
                         device=torch.device("cuda"))
    # Alone, a would peak at its 100 + 10 and b at 300 + 30, each plus the 64 MB workspace.
    assert result["a"].peak_mb == pytest.approx(174.0) and result["b"].peak_mb == pytest.approx(394.0)
    assert result["a"].memory_kind == "MB" and mem["used"] == pytest.approx(64.0)  # both torn down


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_failed_instance_is_released_before_the_next_system_is_built(blocks):
    """Out of memory in one system must not leave its model alive while the others run (their peaks, more OOMs)."""
    import gc
    import weakref

    refs, alive_at_build = [], []

    class Model:
        pass

    def failing():
        model = Model()
        refs.append(weakref.ref(model))

        def step():
            step.calls += 1
            if step.calls > 1:  # the warm-up step passes, the first timed one fails
                raise RuntimeError("CUDA out of memory (pretend)")
        step.calls, step.model = 0, model  # the step holds the model, as a real one would
        return step

    def on_run(r, name):
        gc.collect()
        alive_at_build.append((r, name, [ref() is not None for ref in refs]))

    result = interleaved({"fails": failing, "ok": lambda: (lambda: None)}, rounds=2, iters=2, warmup=1, blocks=blocks,
                         device=CPU, timer=FakeClock(), on_run=on_run)
    assert result["fails"].error == "RuntimeError: CUDA out of memory (pretend)"
    later = [alive for r, name, alive in alive_at_build if name == "ok" and (blocks == 1 or r > 0)]
    assert later and not any(any(alive) for alive in later), alive_at_build


def test_blocks_a_raising_teardown_is_that_systems_error_and_the_others_are_torn_down_and_kept():
    torn = []

    def bad():
        return Run(lambda: None, teardown=lambda: (torn.append("bad"), 1 / 0))

    def ok():
        return Run(lambda: None, teardown=lambda: torn.append("ok"))

    result = interleaved({"bad": bad, "ok": ok}, rounds=2, iters=2, warmup=1, blocks=2, device=CPU, timer=FakeClock())
    assert result["bad"].error == "ZeroDivisionError: division by zero"
    assert result["ok"].error is None and len(result["ok"].rounds_ms) == 2
    assert torn == ["bad", "ok", "ok"]


def test_a_context_class_is_a_factory_of_contexts():
    for blocks in (1, 2):
        result = interleaved({"a": lambda: Run(lambda: None, context=torch.no_grad)}, rounds=1, iters=2, warmup=1,
                             blocks=blocks, device=CPU, timer=FakeClock())
        assert result["a"].error is None and len(result["a"].rounds_ms) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"blocks": 2.0}, "whole numbers"),
    ({"iters": 4.5}, "whole numbers"),
    ({"blocks": 2, "warmup": 0}, "needs warmup >= 1"),
    ({"warmup": -1}, "warmup >= 0"),
])
def test_bad_counts_are_refused_before_anything_is_built(kwargs, message):
    built = []
    args = {"rounds": 1, "iters": 4, "warmup": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        interleaved({"a": lambda: built.append(1) or (lambda: None)}, device=CPU, **args)
    assert built == []


class SyncingClock(FakeClock):
    """A clock that, like reading the time after ``torch.cuda.synchronize``, waits for the device: reading it idles it."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return self.now


class ColdStartSystem:
    """A step that costs ``steady_ms`` on ``clock``, plus ``cold_ms`` when it starts on an idle device.

    The device is idle when the clock was read (a synchronisation) since this system's last step ended, or
    when nothing ran yet: the penalty a step started on an idle GPU pays and a step queued behind another does not.
    """

    def __init__(self, clock, steady_ms, cold_ms):
        self.clock, self.steady_ms, self.cold_ms = clock, steady_ms, cold_ms
        self.builds = 0

    def factory(self):
        self.builds += 1
        reads_at_last_end = [None]

        def step():
            cold = reads_at_last_end[0] != self.clock.reads
            self.clock.now += (self.steady_ms + (self.cold_ms if cold else 0.0)) / 1e3
            reads_at_last_end[0] = self.clock.reads

        return step


def test_pipelined_recovers_the_steady_state_that_step_by_step_alternation_over_reports():
    clock = SyncingClock()
    a, b = ColdStartSystem(clock, 8.0, 3.0), ColdStartSystem(clock, 10.0, 3.0)
    systems = {"a": a.factory, "b": b.factory}
    stepwise = interleaved(systems, rounds=3, iters=6, warmup=2, device=CPU, timer=clock, blocks=6)
    pipelined = interleaved(systems, rounds=3, iters=6, warmup=2, device=CPU, timer=clock, pipelined=True)
    # Step by step every timed step starts on an idle device and pays the idle start in full ...
    assert stepwise["a"].rounds_ms == pytest.approx([11.0] * 3) and stepwise["b"].rounds_ms == pytest.approx([13.0] * 3)
    # ... back to back only the block's first step does, spread over its 6 steps.
    assert pipelined["a"].rounds_ms == pytest.approx([8.0 + 3.0 / 6] * 3)
    assert pipelined["b"].rounds_ms == pytest.approx([10.0 + 3.0 / 6] * 3)
    assert a.builds == b.builds == 6  # a fresh instance per round under both methods
    assert pipelined["a"].settings["method"] == "pipelined" and stepwise["a"].settings["method"] == "alternating"


def test_time_block_is_the_blocks_time_over_its_steps_after_an_untimed_warm_up():
    clock, steps = FakeClock(), []

    def step():
        steps.append(1)
        clock.now += 0.002 * len(steps)  # the n-th step takes 2n ms

    assert measure.time_block(step, iters=2, warmup=3, device=CPU, timer=clock) == pytest.approx((8.0 + 10.0) / 2)
    assert len(steps) == 5
    with pytest.raises(ValueError, match="CUDA"):
        measure.time_block(step, iters=1, warmup=0, device=torch.device("cuda"), timer=clock)


def test_pipelined_runs_each_system_alone_and_refuses_blocks():
    clock, order = FakeClock(), []
    calls = {name: [] for name in "AB"}
    systems = {name: synthetic(clock, [1.0, 2.0], calls[name]) for name in "AB"}
    got = interleaved(systems, rounds=2, iters=3, warmup=1, device=CPU, timer=clock, pipelined=True,
                      on_run=lambda r, n: order.append((r, n)))
    assert order == [(0, "A"), (0, "B"), (1, "B"), (1, "A")]
    assert got["A"].rounds_ms == pytest.approx([1.0, 2.0]) and got["A"].reserved_mb is None  # no CUDA: no reserve
    with pytest.raises(ValueError, match="pipelined"):
        interleaved(systems, iters=4, warmup=1, device=CPU, blocks=2, pipelined=True)


def test_the_method_is_chosen_by_what_is_timed_and_described_by_name():
    cuda = torch.device("cuda")
    assert measure.choose_method(cuda, compiled=True)[0] == "pipelined"
    assert measure.choose_method(cuda, compiled=False)[0] == "alternating"
    assert measure.choose_method(CPU, compiled=True)[0] == measure.choose_method(CPU, compiled=False)[0] == "alone"
    assert all(measure.choose_method(d, c)[1] for d in (cuda, CPU) for c in (True, False))  # a reason each
    assert measure.method_of(1) == "alone" and measure.method_of(5) == "alternating"
    assert measure.method_of(1, pipelined=True) == "pipelined"
    text = measure.describe_method("pipelined", iters=50)
    assert text.startswith("pipelined:") and "back to back" in text and "/ 50" in text
    assert measure.describe_method("alternating", iters=50, blocks=50).endswith(
        "alternates their timed steps step by step; a round's figure is the median of its timed steps")
    assert "in 5 blocks" in measure.describe_method("alternating", iters=50, blocks=5)
    assert measure.describe_method("alone", iters=3).startswith("alone: each round runs the systems one after the other")
    with pytest.raises(ValueError, match="steady"):
        measure.describe_method("steady", iters=3)


@pytest.mark.gpu
def test_pipelined_on_cuda_reports_the_reserved_peak_of_the_steady_state():
    device = torch.device("cuda")

    def factory():
        model = torch.nn.Linear(256, 256).to(device)
        x = torch.randn(64, 256, device=device)
        return lambda: model(x).sum().backward()

    got = interleaved({"a": factory}, rounds=2, iters=5, warmup=2, device=device, pipelined=True)["a"]
    assert len(got.rounds_ms) == 2 and all(ms > 0 for ms in got.rounds_ms)
    assert got.reserved_mb >= got.peak_mb > 0 and got.to_dict()["reserved_mb"] == got.reserved_mb
