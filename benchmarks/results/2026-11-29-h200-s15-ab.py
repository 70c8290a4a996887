"""Compiled b32 ResNet18 at argv[1] px: the hand loop, Trainer.step with verdicts in blocks (default),
in blocks of one (per-step copy), and the package before the change, in alternating blocks; plus each
system's host time per call (perf_counter around the call only)."""
import json, os, sys, time
import torch
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time

IMG = int(sys.argv[1]) if len(sys.argv) > 1 else 32
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
dev = torch.device("cuda")
before = lc.load_before(".pre/precisionloop_before")
args = type("A", (), {"model": "resnet18", "image_size": IMG, "device": dev})()
cfg = lc.Config(32, "fused-sgd", True)
host = {}

def timed(name, run):
    inner = run.step
    def step():
        t0 = time.perf_counter(); inner(); host.setdefault(name, []).append(time.perf_counter() - t0)
    return Run(step, context=run.context)


def trainer_pc(per_copy):
    model = lc.bench.build_model("resnet18")
    t = precisionloop.Trainer(model, lc.OPTIMIZERS["fused-sgd"](model.parameters()), "bf16", device=dev, compile=True, distributed=None)
    t.engine.verdicts_per_copy = per_copy
    b = t.to_device(lc.bench.random_batch(32, IMG, dev))
    return Run(lambda: t.step(b))

systems = {"hand": lambda: timed("hand", lc._hand(cfg, args)),
           "step (blocks of 16)": lambda: timed("step (blocks of 16)", trainer_pc(16)),
           "step (blocks of 1)": lambda: timed("step (blocks of 1)", trainer_pc(1)),
           "step-before": lambda: timed("step-before", lc._trainer(before, cfg, args, False))}
res = interleaved(systems, rounds=ROUNDS, iters=80, warmup=15, device=dev, blocks=8)
print(f"compiled b32 at {IMG}px, torch {torch.__version__}, {ROUNDS} rounds of 80 steps in 8 blocks")
for n, m in res.items():
    r = paired_ratio(m, res["hand"]) if m.rounds_ms else None
    h = sorted(host.get(n, [0]))
    print(f"  {n:<22} {format_time(m):>28} {format_ratio(r) if r else m.error:>26}   host/call median {1e6*h[len(h)//2]:7.1f} us",
          flush=True)
json.dump({"results": {n: m.to_dict() for n, m in res.items()},
           "host_us_median": {n: 1e6 * sorted(v)[len(v) // 2] for n, v in host.items()}},
          open(os.path.join(os.environ.get("OUT", "."), f"ab-{IMG}px.json"), "w"), indent=1)
