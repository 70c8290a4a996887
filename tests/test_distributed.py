"""DDP and FSDP2 on the CPU: two processes with gloo, started from pytest, as torchrun would start them."""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import batches, tiny_cnn, tiny_mlp
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from precisionloop import BF16AdamW, BF16Policy, FP16Policy, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")
WORLD = 2
TOL_KEEP = dict(atol=2e-3, rtol=1e-2)  # measured: FSDP2 bf16 vs one process differ by <= 5e-4 (bf16 gradients of half batches)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, scenario, port, out_dir, world=WORLD):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    code = 0
    try:
        (SCENARIOS[scenario] if isinstance(scenario, str) else scenario)(rank, out_dir)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without C++ static teardown: with gloo on torch 2.14 it sometimes aborts ("terminate called
    # without an active exception") after all the work and the group's destruction are done.
    os._exit(code)


def run(scenario, tmp_path, world=WORLD):
    """Run ``scenario`` (a name in SCENARIOS, or a module-level function of another test file) in ``world`` processes."""
    mp.start_processes(_worker, args=(scenario, _free_port(), str(tmp_path), world), nprocs=world, start_method="spawn")


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# (precision, micro-batches, optimizer): BF16AdamW on fp32 weights rounds nothing, so it compares exactly
CASES = (("fp32", 1, _optimizer), ("bf16", 1, _optimizer), ("fp32", 2, _optimizer),
         ("fp32", 1, lambda model: BF16AdamW(model.parameters(), lr=1e-2)))


def _local(batch, rank):
    x, y = batch
    n = x.shape[0] // WORLD
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


# Scenarios, run in each of the two processes -----------------------------------------------


def equals_single(rank, out_dir):
    for mode in ("ddp", "fsdp"):
        for case, (precision, accum, optimizer) in enumerate(CASES):
            model = tiny_mlp()
            trainer = Trainer(model, optimizer(model), precision, device="cpu", distributed=mode, grad_accum_steps=accum)
            for batch in batches(4, batch_size=8):
                x, y = _local(batch, rank)
                for i in range(accum):  # micro-batches of the local share
                    k = x.shape[0] // accum
                    trainer.step((x[i * k:(i + 1) * k], y[i * k:(i + 1) * k]))
            params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in trainer.model.parameters()]
            if rank == 0:
                torch.save(params, os.path.join(out_dir, f"{mode}-{case}.pt"))
    # A conv net with BatchNorm under FSDP2 bf16: norms keep fp32 parameters beside their fp32 statistics.
    cnn = tiny_cnn()
    policy = BF16Policy(channels_last=True)  # FSDP2 needs contiguous parameters: inputs alone go channels_last
    trainer = Trainer(cnn, _optimizer(cnn), policy, device="cpu", distributed="fsdp")
    results = [trainer.step((torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))) for _ in range(2)]
    assert all(r.stepped for r in results) and cnn[1].weight.dtype == torch.float32


def inf_on_one_rank(rank, out_dir):
    outcomes = {}
    for mode in ("ddp", "fsdp"):
        for precision in ("fp16", "bf16"):
            model = tiny_mlp()
            policy = FP16Policy() if precision == "fp16" else precision
            armed = {"on": False}

            def loss_fn(outputs, targets, armed=armed):
                # Only rank 1 produces a non-finite loss, so only its local gradients go bad.
                loss = torch.nn.functional.cross_entropy(outputs, targets)
                return loss * float("inf") if armed["on"] and rank == 1 else loss

            trainer = Trainer(model, _optimizer(model), policy, device="cpu", distributed=mode, loss_fn=loss_fn)
            data = batches(2, batch_size=8)
            trainer.step(_local(data[0], rank))
            before = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in trainer.model.parameters()]
            armed["on"] = True
            result = trainer.step(_local(data[1], rank))
            after = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in trainer.model.parameters()]
            named = trainer.step(_local(data[1], rank)).nonfinite  # a second skip in a row names the parameters
            outcomes[f"{mode}-{precision}"] = (result.skipped, result.scale, all(torch.equal(a, b) for a, b in zip(before, after)),
                                               named)
            # Only rank 1's batch has every target ignored: its loss is NaN, the averaged gradients finite.
            x, y = _local(data[0], rank)
            result = trainer.step((x, torch.full_like(y, -100) if rank == 1 else y))
            outcomes[f"nan-loss-{mode}-{precision}"] = (result.skipped, trainer.stats.skipped)
    torch.save(outcomes, os.path.join(out_dir, f"outcomes-{rank}.pt"))


def _dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


def checkpoint_round_trip(rank, out_dir):
    for mode in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = tiny_mlp()
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16", device="cpu", distributed=mode)
        val = DataLoader(_dataset(), batch_size=16)
        history = trainer.fit(DataLoader(_dataset(), batch_size=8, shuffle=True), epochs=1, max_steps=3, val_loader=val,
                              metrics={"acc": MulticlassAccuracy(num_classes=4)}, progress=True)
        path = os.path.join(out_dir, f"{mode}.pt")
        trainer.save(path)
        trainer.fit(DataLoader(_dataset(), batch_size=8, shuffle=True), epochs=1, progress=False)
        fresh_model = tiny_mlp(seed=5)
        fresh = Trainer(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2), "bf16", device="cpu", distributed=mode)
        fresh.load(path)
        assert fresh.global_step == 3 and fresh.batch_in_epoch == 3
        fresh.fit(DataLoader(_dataset(), batch_size=8, shuffle=True), epochs=1, progress=False)
        same = all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a, b.full_tensor() if hasattr(b, "full_tensor") else b)
                   for a, b in zip(trainer.model.parameters(), fresh.model.parameters()))
        evaluated = trainer.evaluate(val, {"acc": MulticlassAccuracy(num_classes=4)})
        torch.save({"same": same, "steps_per_epoch": history[0]["steps"], "acc": history[0].get("acc"),
                    "evaluated": evaluated["acc"], "final": [p.detach().clone() for p in trainer.model.parameters()]
                    if mode == "ddp" else None}, os.path.join(out_dir, f"{mode}-result-{rank}.pt"))


def _norm_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def fsdp_keep_fp32(rank, out_dir):
    model = _norm_net()
    seen = []  # (weight dtype, input dtype) as the LayerNorm's forward starts; FSDP2's own pre-hook runs first
    model[1].register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    outputs, linear = [], []
    model[1].register_forward_hook(lambda m, args, out: outputs.append(out.dtype))
    model[0].register_forward_pre_hook(lambda m, args: linear.append(m.weight.dtype))
    trainer = Trainer(model, _optimizer(model), BF16Policy(keep_fp32=(torch.nn.LayerNorm,)), device="cpu", distributed="fsdp")
    for batch in batches(4, batch_size=8):
        assert trainer.step(_local(batch, rank)).stepped
    params = [p.full_tensor().detach().clone() for p in trainer.model.parameters()]
    # The root itself kept: FSDP2 shards it, and everything under it, with fp32 parameters.
    root, seen_root = _norm_net(), []
    root[1].register_forward_pre_hook(lambda m, args: seen_root.append((m.weight.dtype, args[0].dtype)))
    Trainer(root, _optimizer(root), BF16Policy(keep_fp32=("*",)), device="cpu", distributed="fsdp").step(
        _local(batches(1, batch_size=8)[0], rank))
    # A model the user wrapped in DDP: its kept modules still run in fp32.
    inner, wrapped = _norm_net(), []
    ddp = torch.nn.parallel.DistributedDataParallel(inner)
    # A kept Linear gives fp32, not bf16; patterns name the modules inside the wrapper, as when the Trainer wraps.
    inner[2].register_forward_hook(lambda m, args, out: wrapped.append(out.dtype))
    Trainer(ddp, _optimizer(ddp), BF16Policy(keep_fp32=("2",)), device="cpu", distributed="ddp").step(
        _local(batches(1, batch_size=8)[0], rank))
    if rank == 0:
        torch.save({"params": params, "seen": seen, "outputs": outputs, "linear": linear, "seen_root": seen_root,
                    "wrapped": wrapped}, os.path.join(out_dir, "fsdp-keep-fp32.pt"))


def fsdp_cpu_beside_an_accelerator(rank, out_dir):
    # As on a GPU host where CUDA was initialised before CUDA_VISIBLE_DEVICES was cleared (torchao's import does
    # so): fully_shard's default mesh follows the machine's accelerator, not the Trainer's device.
    from unittest import mock

    model = tiny_mlp()
    with mock.patch.object(torch._C, "_get_accelerator", lambda: torch.device("cuda")):
        trainer = Trainer(model, _optimizer(model), "bf16", device="cpu", distributed="fsdp")
    assert trainer.step(_local(batches(1, batch_size=8)[0], rank)).stepped
    assert {p.device_mesh.device_type for p in trainer.model.parameters()} == {"cpu"}


def one_process_group(rank, out_dir):
    # A model the script wrapped itself: refused where the policy would change its weights, trained where it would not.
    dist.init_process_group("gloo")  # by the script, as torchvision's and Hugging Face's scripts do
    pure = torch.nn.parallel.DistributedDataParallel(tiny_mlp())
    with pytest.raises(ValueError, match=r"'bf16-pure' would cast 0.weight to torch.bfloat16 .*pass the model unwrapped"):
        Trainer(pure, BF16AdamW(pure.parameters()), "bf16-pure", device="cpu")
    assert {p.dtype for p in pure.parameters()} == {torch.float32}
    cnn = torch.nn.parallel.DistributedDataParallel(tiny_cnn())
    with pytest.raises(ValueError, match="would lay 0.weight out in torch.channels_last"):
        Trainer(cnn, _optimizer(cnn), BF16Policy(channels_last=True), device="cpu")
    ready = torch.nn.parallel.DistributedDataParallel(tiny_mlp().to(torch.bfloat16))
    assert Trainer(ready, BF16AdamW(ready.parameters()), "bf16-pure", device="cpu").step(batches(1)[0]).stepped
    # A load replaces the skip history too: the Trainer that loads acts as a fresh one loading the same file.
    model = tiny_mlp()
    saved = Trainer(model, _optimizer(model), "bf16", device="cpu", distributed="ddp")
    for b in batches(2):
        saved.step(b)
    saved.save(os.path.join(out_dir, "clean.pt"))
    nonfinite = []
    for skips_before in (False, True):
        model = tiny_mlp()
        model[0].weight.register_hook(lambda g: g * float("nan") if armed else g)
        trainer = Trainer(model, _optimizer(model), "bf16", device="cpu", distributed="ddp")
        for armed in (False, skips_before):
            trainer.step(batches(1)[0])
        trainer.load(os.path.join(out_dir, "clean.pt"))
        armed = True
        nonfinite.append(trainer.step(batches(1)[0]).nonfinite)
    assert nonfinite == [(), ()]


SCENARIOS = {f.__name__: f for f in (equals_single, inf_on_one_rank, checkpoint_round_trip, fsdp_keep_fp32,
                                     fsdp_cpu_beside_an_accelerator, one_process_group)}


# The tests ----------------------------------------------------------------------------------


def test_training_equals_one_process_on_the_whole_batch(tmp_path):
    run("equals_single", tmp_path)
    for mode in ("ddp", "fsdp"):
        for case, (precision, accum, optimizer) in enumerate(CASES):
            model = tiny_mlp()
            trainer = Trainer(model, optimizer(model), precision, device="cpu", distributed=None)
            for batch in batches(4, batch_size=8):
                trainer.step(batch)
            tol = dict(atol=1e-5, rtol=1e-4) if precision == "fp32" else dict(atol=2e-2, rtol=2e-2)
            got = torch.load(tmp_path / f"{mode}-{case}.pt")
            for p, q in zip(model.parameters(), got):
                torch.testing.assert_close(p.detach(), q, **tol, msg=f"{mode} case {case}")


def test_fsdp_shards_on_the_trainers_device_not_the_machines_accelerator(tmp_path):
    run("fsdp_cpu_beside_an_accelerator", tmp_path)


def test_inf_or_a_nan_loss_on_one_rank_skips_on_every_rank(tmp_path):
    run("inf_on_one_rank", tmp_path)
    named = {}
    for rank in range(WORLD):
        outcomes = torch.load(tmp_path / f"outcomes-{rank}.pt")
        for key, outcome in outcomes.items():
            if key.startswith("nan-loss"):
                assert outcome == (True, 3), (rank, key)
                continue
            skipped, scale, unchanged, names = outcome
            assert skipped and unchanged, (rank, key)
            assert scale == (2.0**15 if "fp16" in key else None), (rank, key)
            assert names and named.setdefault(key, names) == names, (rank, key)  # the same names on every rank


def test_fit_shards_data_syncs_metrics_and_checkpoints_round_trip(tmp_path):
    run("checkpoint_round_trip", tmp_path)
    for mode in ("ddp", "fsdp"):
        results = [torch.load(tmp_path / f"{mode}-result-{rank}.pt") for rank in range(WORLD)]
        assert all(r["same"] for r in results), f"{mode}: resumed run differs from the uninterrupted one"
        assert results[0]["acc"] == results[1]["acc"], "metrics must be synced across ranks"
        assert results[0]["evaluated"] == results[1]["evaluated"]
    # 64 samples, batch 8, two ranks: 4 steps per epoch, each rank seeing half the data.
    full = torch.load(tmp_path / "ddp-result-0.pt")
    state = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    # The DDP checkpoint loads in a single process too.
    model = tiny_mlp(seed=9)
    single = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16", device="cpu", distributed=None)
    single.load(tmp_path / "ddp.pt")
    assert single.global_step == 3
    val = DataLoader(_dataset(), batch_size=16)
    # The evaluated accuracy under DDP (synced over both halves) equals one process over all of it.
    final_model = tiny_mlp()
    final = Trainer(final_model, torch.optim.AdamW(final_model.parameters(), lr=1e-2), "bf16", device="cpu", distributed=None)
    with torch.no_grad():
        for p, q in zip(final_model.parameters(), full["final"]):
            p.copy_(q)
    assert final.evaluate(val, {"acc": MulticlassAccuracy(num_classes=4)})["acc"] == pytest.approx(full["evaluated"])


def test_fsdp_keeps_fp32_modules_in_fp32_and_equals_one_process(tmp_path):
    run("fsdp_keep_fp32", tmp_path)
    got = torch.load(tmp_path / "fsdp-keep-fp32.pt")
    # The kept LayerNorm is sharded with fp32 parameters and inputs: not the bf16 of the rest of the model.
    assert got["seen"] == [(torch.float32, torch.float32)] * 4 and got["outputs"] == [torch.float32] * 4
    assert got["linear"] == [torch.bfloat16] * 4
    assert got["seen_root"] == [(torch.float32, torch.float32)]  # a kept root: the whole model in fp32
    assert got["wrapped"] == [torch.float32]  # a model the user wrapped still keeps its modules fp32
    model = _norm_net()
    trainer = Trainer(model, _optimizer(model), BF16Policy(keep_fp32=(torch.nn.LayerNorm,)), device="cpu", distributed=None)
    for batch in batches(4, batch_size=8):
        trainer.step(batch)
    for p, q in zip(model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), **TOL_KEEP)


def test_a_process_group_of_one_refuses_wrapped_models_the_policy_would_change_and_loads_replace_skip_history(tmp_path):
    run("one_process_group", tmp_path, world=1)


def test_distributed_modes_need_a_launcher_or_a_group():
    model = tiny_mlp()
    for mode in ("ddp", "fsdp"):
        with pytest.raises(ValueError, match="torchrun"):
            Trainer(model, _optimizer(model), "fp32", device="cpu", distributed=mode)
    with pytest.raises(ValueError, match="'auto'"):
        Trainer(model, _optimizer(model), "fp32", device="cpu", distributed="horovod")
    assert Trainer(model, _optimizer(model), "fp32", device="cpu").is_main  # auto: one process


