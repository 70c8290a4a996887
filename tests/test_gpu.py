"""Behaviour on a CUDA device; skipped, with a reason, on machines without one."""

import copy

import pytest
import torch
from conftest import batches, steps_without_host_sync, tiny_cnn, tiny_mlp, read_flags, tf32_flags, write_flags
from torch import nn

from precisionloop import BF16Policy, FP16Policy, Trainer, get_policy
from precisionloop import policy as policy_mod

pytestmark = pytest.mark.gpu


class CudaProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_cnn()
        self.seen = []

    def forward(self, x):
        out = self.net[0](x)
        self.seen.append(dict(dtype=out.dtype, input_channels_last=x.is_contiguous(memory_format=torch.channels_last)
                              and not x.is_contiguous(), tf32=read_flags()[0], benchmark=torch.backends.cudnn.benchmark))
        return self.net[1:](out)


@pytest.mark.parametrize("precision, dtype", [("tf32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cuda_autocast_flags_and_channels_last(precision, dtype):
    model = CudaProbe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cuda")
    before = read_flags()
    x = torch.randn(4, 3, 16, 16)
    assert trainer.step((x, torch.tensor([0, 1, 2, 3]))).stepped
    seen = model.seen[-1]
    assert seen["dtype"] == dtype and seen["input_channels_last"]
    assert seen["tf32"] == tf32_flags(True) and seen["benchmark"] is True
    assert read_flags() == before
    assert model.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())


def test_auto_picks_bf16_on_a_native_bf16_gpu():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("this GPU has no native bf16")
    policy = get_policy("auto", "cuda")
    assert isinstance(policy, BF16Policy) and "compute capability" in policy.note


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_cuda_matches_hand_written_loop(precision):
    data = batches(4)
    reference, model = tiny_mlp().cuda(), tiny_mlp()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": None}[precision]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    policy = get_policy(precision)
    with policy.backend_flags():
        for x, y in data:
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(reference(x.cuda()), y.cuda())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cuda")
    for b in data:
        trainer.step(b)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_inf_skips_with_fused_and_foreach_adam(fused):
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    trainer = Trainer(model, optimizer, FP16Policy(), device="cuda", scheduler=scheduler,
                      scheduler_interval="step" if scheduler is not None else None)
    data = batches(2)
    trainer.step(data[0])
    before = copy.deepcopy(model.state_dict())
    armed["on"] = True
    result = trainer.step(data[1])
    assert result.skipped and result.scale == 2.0**15
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optimizer.param_groups[0]["lr"] == 0.005


def test_benchmark_recipe_on_cuda(tmp_path):
    import json

    from precisionloop.recipes import resnet18_bench

    out = tmp_path / "bench.json"
    resnet18_bench.main(["--batch-sizes", "4", "--iters", "3", "--warmup", "2", "--image-size", "64", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {r["precision"] for r in results} == {"fp32", "tf32", "bf16", "fp16"}
    assert all(r["peak_mb"] > 0 and r["median_ms"] > 0 and r["error"] is None for r in results)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_fused_optimizer_steps_without_host_sync(precision):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), precision, device="cuda",
                      max_grad_norm=1.0)
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    trainer.step(data[0])  # the first step creates optimizer state and scaler tensors
    results = steps_without_host_sync(trainer, data[1:])
    assert all(r.stepped for r in results)
    assert trainer.stats.steps == 4


def test_cuda_verdict_is_booked_by_stats_and_the_skip_limit_still_fires():
    model = tiny_mlp()
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), "bf16", device="cuda",
                      max_consecutive_skips=2)
    data = batches(2)
    assert trainer.step(data[0]).skipped
    trainer.step(data[1])  # both verdicts still on the device, in the first block
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row"):
        _ = trainer.stats


def _fused_trainer_with_nans(scheduled: bool = False):
    """A bf16 Trainer on CUDA with fused SGD whose first layer's gradients are NaN while ``armed["on"]``.

    Returns (model, armed, trainer); with ``scheduled``, a LambdaLR that lowers the LR each step.
    """
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k)) if scheduled else None
    return model, armed, Trainer(model, optimizer, "bf16", device="cuda", scheduler=scheduler,
                      scheduler_interval="step" if scheduler is not None else None)


def _verdict_run(scheduled: bool, n: int = 40):
    """n fused bf16 steps on CUDA with NaN gradients at steps 5, 17 and 18 (1-based); the stats booked after each."""
    _, armed, trainer = _fused_trainer_with_nans(scheduled)
    optimizer = trainer.optimizer
    data = [(x.cuda(), y.cuda()) for x, y in batches(n, seed=3)]
    results, booked, lrs = [trainer.step(data[0])], [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(data[1:], start=2):
            armed["on"] = i in (5, 17, 18)
            results.append(trainer.step(batch))
            booked.append(trainer.engine.stats.steps)
            lrs.append(optimizer.param_groups[0]["lr"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer, results, booked, lrs


def test_cuda_each_verdict_is_booked_at_the_next_step_without_a_sync_and_each_result_keeps_its_own():
    trainer, results, booked, _ = _verdict_run(scheduled=False)
    assert booked == list(range(1, 40))  # each step booked by the next, with no host sync in between
    assert [r.skipped for r in results] == [i in (5, 17, 18) for i in range(1, 41)]  # read after all 40 steps
    losses = [r.loss for r in results]
    stats = trainer.stats
    assert (stats.steps, stats.skipped, trainer.engine.last_loss) == (40, 3, losses[-1])


def test_cuda_a_scheduler_books_each_step_at_the_next_so_the_lr_follows_real_steps():
    trainer, results, booked, lrs = _verdict_run(scheduled=True)
    assert booked == list(range(1, 40))  # each step booked by the next
    taken = [sum(r.stepped for r in results[:i]) for i in range(1, 40)]  # steps really taken before step i + 1
    assert lrs == pytest.approx([0.1 / (1 + t) for t in taken])
    assert trainer.stats.steps == 40 and trainer.stats.skipped == 3


def _stream_run(streams):
    """Fused bf16 steps on CUDA, step i on streams[i % len] (None: the default); NaN gradients at steps 3, 6 and 7."""
    model, armed, trainer = _fused_trainer_with_nans()
    data = [(x.cuda(), y.cuda()) for x, y in batches(40, seed=5)]
    torch.cuda.synchronize()
    results, last = [], torch.cuda.current_stream()
    for i, batch in enumerate(data):
        armed["on"] = i in (3, 6, 7)
        stream = streams[i % len(streams)] or torch.cuda.current_stream()
        stream.wait_stream(last)  # the weights the last step wrote, as any program that switches streams must
        with torch.cuda.stream(stream):
            results.append(trainer.step(batch))
        last = stream
    stats = trainer.stats  # read on the default stream, which waited for none of the side streams
    return model, [(r.loss, r.skipped) for r in results], (stats.steps, stats.skipped)


def test_cuda_steps_on_side_streams_book_the_same_verdicts_as_on_one_stream():
    reference = _stream_run([None])
    one_side = _stream_run([torch.cuda.Stream()])
    alternating = _stream_run([torch.cuda.Stream(), None, torch.cuda.Stream()])
    torch.cuda.synchronize()
    for model, results, stats in (one_side, alternating):
        assert stats == reference[2] == (40, 3)
        assert results == reference[1]
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference[0].parameters()))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs; run on the two-GPU machine")
def test_a_trainer_on_the_second_gpu_waits_for_its_verdicts_copy_on_that_gpus_stream(monkeypatch):
    # The copy runs on the rows' device's stream; an event recorded on the current device's (cuda:0) would not
    # wait for it, and the rows could be read before they land.
    recorded, record = [], torch.cuda.Event.record

    def record_where(self, stream=None):
        recorded.append(None if stream is None else stream.device)
        return record(self, stream)

    monkeypatch.setattr(torch.cuda.Event, "record", record_where)
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), "bf16", device="cuda:1")
    assert torch.cuda.current_device() == 0
    for batch in batches(10):
        trainer.step(batch)
    assert trainer.stats.steps == 10 and trainer.stats.skipped == 0
    assert recorded and set(recorded) == {torch.device("cuda", 1)}, recorded


def test_compiled_with_cuda_graphs_matches_eager_and_still_skips():
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    eager_model, graph_model = tiny_mlp(), tiny_mlp()
    armed = {"on": False}
    graph_model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed["on"] else g)
    eager = Trainer(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1, fused=True), FP16Policy(), device="cuda")
    graphed = Trainer(graph_model, torch.optim.SGD(graph_model.parameters(), lr=0.1, fused=True), FP16Policy(), device="cuda",
                      compile=True)
    assert graphed.compile_mode == "reduce-overhead"
    results = [(eager.step(b), graphed.step(b)) for b in data[:3]]
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-3, rtol=1e-2)
    assert [r.loss for r, _ in results] == pytest.approx([r.loss for _, r in results], rel=1e-2)
    before = copy.deepcopy(graph_model.state_dict())
    armed["on"] = True
    result = graphed.step(data[3])
    assert result.skipped and result.scale == 2.0**15
    assert all(torch.equal(v, before[k]) for k, v in graph_model.state_dict().items())


def test_autotune_on_cuda_prints_its_table(capsys):
    from precisionloop import autotune

    model = tiny_cnn()
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    result = autotune(model, lambda p: torch.optim.SGD(p, lr=0.05, fused=True), batch, device="cuda", steps=3, warmup=2)
    out = capsys.readouterr().out
    assert "CHOSEN" in out and result.best.label in out
    assert {r.candidate.precision for r in result.results} == {"fp32", "tf32", "bf16", "fp16"}
    assert all(r.peak_mb is not None for r in result.results if r.rejected is None)


def test_trainer_autotune_on_cuda_trains_with_its_choice(capsys):
    model = tiny_cnn()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, fused=True), "auto", device="cuda", autotune=True)
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    assert trainer.step(batch).stepped and "CHOSEN" in capsys.readouterr().out
    assert trainer.policy.name in {"fp32", "tf32", "bf16", "fp16"} and trainer.step(batch).stepped


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)],
                         ids=["AdamW()", "SGD(momentum)"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_default_optimizers_step_without_host_sync_and_still_skip(make, precision):
    model = tiny_mlp()
    armed = {"on": False}
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    optimizer = make(model.parameters())
    trainer = Trainer(model, optimizer, precision, device="cuda")
    assert optimizer.param_groups[0]["fused"] is True  # the default implementation was swapped for the fused one
    data = [(x.cuda(), y.cuda()) for x, y in batches(5)]
    trainer.step(data[0])  # creates optimizer state (and SGD's momentum buffers, decided on the host once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.step(data[1])
        armed["on"] = True
        weights = copy.deepcopy(model.state_dict())
        state = copy.deepcopy(optimizer.state_dict()["state"])
        skipped = trainer.step(data[2])
        after_weights = copy.deepcopy(model.state_dict())  # device copies: compared after the sync check
        after_state = copy.deepcopy(optimizer.state_dict()["state"])
        armed["on"] = False
        trainer.step(data[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    unchanged = all(torch.equal(v, weights[k]) for k, v in after_weights.items())
    same_state = all(torch.equal(v, state[i][k]) for i, s in after_state.items() for k, v in s.items()
                     if isinstance(v, torch.Tensor))
    assert unchanged and same_state  # a non-finite gradient reached neither the weights nor the optimizer state
    assert skipped.skipped and trainer.stats.skipped == 1
    model2 = tiny_mlp()
    kept = Trainer(model2, make(model2.parameters()), precision, device="cuda", fuse_optimizer=False)
    assert kept.optimizer.param_groups[0]["fused"] is None  # left as given when asked


def test_default_optimizer_fused_equals_torch_fused():
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    a, b = tiny_mlp(), tiny_mlp()
    ta = Trainer(a, torch.optim.AdamW(a.parameters(), lr=1e-2), "bf16", device="cuda")
    tb = Trainer(b, torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True), "bf16", device="cuda")
    for batch in data:
        ta.step(batch)
        tb.step(batch)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_flush_of_an_open_window_on_cuda():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cuda", grad_accum_steps=2)
    trainer.step(batches(1)[0])
    result = trainer.flush()
    assert result.stepped and trainer.global_step == 1
    assert trainer.fit(batches(3), progress=False)[0]["steps"] == 2  # an epoch that ends on an open window


class _LossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.linear(x), y)


class _LossTrainer(Trainer):
    def compute_loss(self, batch):
        return self.model(*batch)


def test_compiled_model_returning_its_loss_trains_through_fit():
    model = _LossModel()
    trainer = _LossTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="cuda", compile=True)
    record = trainer.fit([(x.cuda(), y.cuda()) for x, y in batches(6)], progress=False)[0]
    assert record["steps"] == 6 and 0 < record["train_loss"] < 10  # CUDA-graph outputs were not read after a replay
