"""ResNet18 b32 at argv[1] px, compiled (argv[3]=="compiled") or eager: the hand loop, Trainer.step now in blocks
of 16 and of 1 (the scheduler's path), and older packages (.pre/<name>, blocks of 1 where they have blocks), in
alternating blocks; paired per-round ratios printed, JSON under $OUT."""
import importlib.util, json, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time

IMG, ROUNDS, COMPILED = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "compiled"
OLD = sys.argv[4].split(",") if len(sys.argv) > 4 else []
dev = torch.device("cuda")

def load(name):
    init = Path(".pre") / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod

pkgs = {n: load(n) for n in OLD}
args = type("A", (), {"model": "resnet18", "image_size": IMG, "device": dev})()
cfg = lc.Config(32, "fused-sgd", COMPILED)

def trainer(pkg, per_copy):
    model = lc.bench.build_model("resnet18")
    t = pkg.Trainer(model, lc.OPTIMIZERS["fused-sgd"](model.parameters()), "bf16", device=dev, compile=COMPILED,
                    distributed=None)
    if per_copy is not None and hasattr(t.engine, "verdicts_per_copy"):
        t.engine.verdicts_per_copy = per_copy
    b = t.to_device(lc.bench.random_batch(32, IMG, dev))
    return Run(lambda: t.step(b))

systems = {"hand": lambda: lc._hand(cfg, args),
           "now/16": lambda: trainer(precisionloop, 16),
           "now/1": lambda: trainer(precisionloop, 1)}
for n, p in pkgs.items():
    systems[f"{n}/1"] = (lambda p=p: trainer(p, 1))
res = interleaved(systems, rounds=ROUNDS, iters=80, warmup=15, device=dev, blocks=8)
mode = "compiled" if COMPILED else "eager"
print(f"{mode} b32 at {IMG}px, torch {torch.__version__}, {ROUNDS} rounds of 80 steps in 8 blocks")
names = list(res)
for n in names:
    m = res[n]
    r = paired_ratio(m, res["hand"]) if m.rounds_ms else None
    print(f"  {n:<16} {format_time(m):>28} {format_ratio(r) if r else m.error:>26}", flush=True)
def pr(a, b):
    x = [p / q for p, q in zip(res[a].rounds_ms, res[b].rounds_ms)]
    s = sorted(x)
    return f"{a} / {b}: {s[len(s)//2]:.3f} [{s[0]:.3f}-{s[-1]:.3f}], {sum(v < 1 for v in x)} of {len(x)} below 1"
for a, b in [("now/16", "now/1")] + [(x, f"{n}/1") for n in pkgs for x in ("now/1", "now/16")]:
    print("  " + pr(a, b))
json.dump({n: m.to_dict() for n, m in res.items()},
          open(os.path.join(os.environ.get("OUT", "."), f"ab2-{mode}-{IMG}px.json"), "w"), indent=1)
