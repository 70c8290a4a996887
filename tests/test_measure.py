"""precisionloop.measure (interleaved rounds, spread) and precisionloop.recipes.timing (the methods, paired ratios). CPU
only; no timing thresholds."""

import json

import pytest
import torch

from precisionloop import measure
from precisionloop.measure import Measurement, interleaved
from precisionloop.recipes import timing
from precisionloop.recipes.timing import Run, paired_ratio

CPU = torch.device("cpu")


class FakeClock:
    """A clock in seconds that only the steps move; ``reads`` counts how often it was read (a sync, on CUDA)."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self):
        self.reads += 1
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


def test_rounds_rotate_the_order_and_build_fresh_instances():
    clock, order = FakeClock(), []
    calls = {name: [] for name in "ABC"}
    systems = {name: synthetic(clock, [1.0], calls[name]) for name in "ABC"}
    timing.interleaved(systems, rounds=3, iters=2, warmup=1, device=CPU, timer=clock, on_run=lambda *a: order.append(a))
    assert order == [(0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"), (2, "C"), (2, "A"), (2, "B")]
    assert {name: len(c) for name, c in calls.items()} == {"A": 3, "B": 3, "C": 3}


def test_median_min_max_spread_and_noisy_flag_from_a_synthetic_timer():
    clock = FakeClock()
    result = timing.interleaved({"noisy": synthetic(clock, [10.0, 10.0, 13.0], []),
                                 "quiet": synthetic(clock, [10.0, 10.5, 10.2], [])},
                                rounds=3, iters=4, warmup=2, device=CPU, timer=clock)
    n, q = result["noisy"], result["quiet"]
    assert n.rounds_ms == pytest.approx([10.0, 10.0, 13.0]) and q.rounds_ms == pytest.approx([10.0, 10.5, 10.2])
    assert (n.median_ms, n.min_ms, n.max_ms) == pytest.approx((10.0, 10.0, 13.0))
    assert n.spread == pytest.approx(0.3) and n.noisy
    assert q.median_ms == pytest.approx(10.2) and q.spread == pytest.approx(0.5 / 10.2) and not q.noisy
    assert n.settings == {"rounds": 3, "iters": 4, "warmup": 2, "device": "cpu", "method": "alone"}
    assert n.peak_mb is None and n.reserved_mb is None  # no peak off CUDA
    data = json.loads(json.dumps(n.to_dict()))
    assert data["rounds_ms"] == pytest.approx([10.0, 10.0, 13.0]) and data["noisy"] is True
    assert data["median_ms"] == pytest.approx(10.0)


def test_time_steps_and_time_block_warm_up_untimed():
    clock, steps = FakeClock(), []

    def step():
        steps.append(1)
        clock.now += 0.002 * len(steps)  # the n-th step takes 2n ms

    assert measure.time_steps(step, iters=2, warmup=3, device=CPU, timer=clock) == pytest.approx([8.0, 10.0])
    steps.clear()
    assert timing.time_block(step, iters=2, warmup=3, device=CPU, timer=clock) == pytest.approx((8.0 + 10.0) / 2)
    assert len(steps) == 5


def test_run_context_and_teardown_wrap_each_instance():
    clock, events = FakeClock(), []

    class Flags:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def factory():
        return Run(lambda: events.append("step"), context=Flags(), teardown=lambda: events.append("teardown"))

    timing.interleaved({"a": factory}, rounds=2, iters=1, warmup=1, device=CPU, timer=clock)
    assert events == ["enter", "step", "step", "exit", "teardown"] * 2
    events.clear()
    # A context factory (a class too) is called for a fresh context each time.
    timing.interleaved({"a": lambda: Run(lambda: events.append("step"), context=Flags)}, rounds=1, iters=2,
                       warmup=1, device=CPU, timer=clock, blocks=2)
    assert events == ["enter", "step", "exit", "enter", "step", "exit", "enter", "step", "exit"]


def test_paired_ratio_pairs_rounds_by_index():
    a, b = Measurement("a", [10.0, 20.0, 30.0]), Measurement("b", [20.0, 5.0, 10.0])
    assert paired_ratio(a, b) == pytest.approx((3.0, 0.5, 4.0))  # sorted pairing would say 2.0
    with pytest.raises(ValueError):
        paired_ratio(a, Measurement("c", [1.0]))


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_failing_system_is_an_error_and_the_others_are_measured(blocks):
    clock, ok_calls, oom_calls, torn_down = FakeClock(), [], [], []

    def oom():
        oom_calls.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    def bad_step():
        def step():
            raise RuntimeError("step broke")
        return Run(step, teardown=lambda: torn_down.append(1))

    result = timing.interleaved({"oom": oom, "ok": synthetic(clock, [5.0], ok_calls), "bad": bad_step}, rounds=3,
                                iters=2, warmup=0 if blocks == 1 else 1, device=CPU, timer=clock, blocks=blocks)
    assert result["oom"].error.startswith("OutOfMemoryError: CUDA out of memory") and result["oom"].median_ms is None
    assert len(oom_calls) == 1  # not rebuilt after failing
    assert result["bad"].error == "RuntimeError: step broke" and torn_down == [1]
    assert result["ok"].error is None and result["ok"].rounds_ms == pytest.approx([5.0] * 3) and len(ok_calls) == 3


def test_blocks_alternate_the_timed_steps_and_rotate_by_block():
    clock, log = FakeClock(), []

    def system(name):
        def factory():
            return lambda: log.append(name)
        return factory

    got = timing.interleaved({"A": system("A"), "B": system("B")}, rounds=1, iters=4, warmup=1, device=CPU, timer=clock,
                             blocks=4)
    assert log == ["A", "B"] + ["A", "B", "B", "A", "A", "B", "B", "A"]  # warm-ups, then four blocks of one step
    assert got["A"].settings["method"] == "alternating" and got["A"].peak_mb is None


def _drifting(clock, base_ms):
    """A step whose time is ``base_ms`` times a host slowing down with every step taken by anyone."""
    def factory():
        def step():
            clock.steps = getattr(clock, "steps", 0) + 1
            clock.now += base_ms * (1 + 0.05 * clock.steps) / 1e3
        return step
    return factory


def test_alternating_pairs_systems_in_time_so_a_drifting_host_cancels_out():
    clock = FakeClock()
    alone = interleaved({"a": _drifting(clock, 10.0), "b": _drifting(clock, 10.0)}, rounds=2, iters=10, warmup=1,
                        device=CPU, timer=clock)
    clock = FakeClock()
    stepwise = timing.interleaved({"a": _drifting(clock, 10.0), "b": _drifting(clock, 10.0)}, rounds=2, iters=10,
                                  warmup=1, device=CPU, timer=clock, blocks=10)
    assert abs(paired_ratio(stepwise["a"], stepwise["b"])[0] - 1) < abs(paired_ratio(alone["a"], alone["b"])[0] - 1)


class ColdStartSystem:
    """A step that costs ``steady_ms`` on ``clock``, plus ``cold_ms`` when it starts on an idle device: when the
    clock was read (a synchronisation) since this system's last step ended."""

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
    clock = FakeClock()
    a, b = ColdStartSystem(clock, 8.0, 3.0), ColdStartSystem(clock, 10.0, 3.0)
    systems = {"a": a.factory, "b": b.factory}
    stepwise = timing.interleaved(systems, rounds=3, iters=6, warmup=2, device=CPU, timer=clock, blocks=6)
    pipelined = timing.interleaved(systems, rounds=3, iters=6, warmup=2, device=CPU, timer=clock, pipelined=True)
    # Step by step every timed step starts on an idle device and pays the idle start in full ...
    assert stepwise["a"].rounds_ms == pytest.approx([11.0] * 3) and stepwise["b"].rounds_ms == pytest.approx([13.0] * 3)
    # ... back to back only the block's first step does, spread over its 6 steps.
    assert pipelined["a"].rounds_ms == pytest.approx([8.0 + 3.0 / 6] * 3)
    assert pipelined["b"].rounds_ms == pytest.approx([10.0 + 3.0 / 6] * 3)
    assert a.builds == b.builds == 6  # a fresh instance per round under both methods
    assert pipelined["a"].settings["method"] == "pipelined"


@pytest.mark.parametrize("kwargs", [dict(rounds=0), dict(iters=0), dict(warmup=-1), dict(blocks=5),
                                    dict(blocks=2, pipelined=True)])
def test_bad_counts_are_refused_before_anything_is_built(kwargs):
    built = []
    timed = timing.interleaved if "blocks" in kwargs else interleaved
    with pytest.raises(ValueError, match="interleaved needs"):
        timed({"a": lambda: built.append(1) or (lambda: None)}, device=CPU, **{"iters": 4, "warmup": 1, **kwargs})
    assert built == []


def test_formatting_marks_noisy_measurements_and_explains_the_mark():
    quiet, noisy = Measurement("q", [10.5, 10.71, 11.0]), Measurement("n", [10.0, 10.0, 13.0])
    assert measure.format_time(quiet) == "10.71 ms [10.5-11.0]"
    assert measure.format_time(noisy) == "10.00 ms [10.0-13.0] !"
    assert measure.format_time(Measurement("e", error="boom")) == "-"
    assert measure.noisy_legend([quiet]) == "" and "10%" in measure.noisy_legend([quiet, noisy])
    assert timing.format_ratio((0.98, 0.95, 1.01)) == "0.980x [0.950-1.010]"
    assert measure.format_memory(Measurement("m", peak_mb=45.2)) == "45 MB"
    assert measure.format_memory(Measurement("m")) == "n/a"


def test_the_method_is_chosen_by_what_is_timed():
    cuda = torch.device("cuda")
    assert timing.choose_method(cuda, compiled=True)[0] == "pipelined"
    assert timing.choose_method(cuda, compiled=False)[0] == "alternating"
    assert timing.choose_method(CPU, compiled=True)[0] == timing.choose_method(CPU, compiled=False)[0] == "alone"
    assert all(timing.choose_method(d, c)[1] for d in (cuda, CPU) for c in (True, False))  # a reason each
    assert {timing.choose_method(d, c)[0] for d in (cuda, CPU) for c in (True, False)} == set(timing.METHODS)
    assert measure.peak_mb(CPU) is None


@pytest.mark.gpu
def test_on_cuda_a_system_alone_reports_its_peak_and_reserve_of_the_steady_state():
    device = torch.device("cuda")

    def factory():
        model = torch.nn.Linear(256, 256).to(device)
        x = torch.randn(64, 256, device=device)
        return lambda: model(x).sum().backward()

    for pipelined in (False, True):
        got = timing.interleaved({"a": factory}, rounds=2, iters=5, warmup=2, device=device, pipelined=pipelined)["a"]
        assert len(got.rounds_ms) == 2 and all(ms > 0 for ms in got.rounds_ms)
        assert got.reserved_mb >= got.peak_mb > 0
