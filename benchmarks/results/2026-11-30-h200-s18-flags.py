"""Does setting and restoring the backend flags every step cost more than its Python? ResNet18 b32 bf16 fused SGD."""
import sys, json, time
import torch
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop.measure import Run, interleaved, paired_ratio, format_time, format_ratio

compiled = sys.argv[1] == "compiled"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
args = lc.main.__globals__["argparse"].Namespace(model="resnet18", image_size=224, device=torch.device("cuda"))
cfg = lc.Config(32, "fused-sgd", compiled)
policy = precisionloop.get_policy("bf16")

def hand_flip():
    run = lc._hand(cfg, args)
    def step():
        with policy.backend_flags():
            run.step()
    return Run(step)

def trainer(graph, held):
    run = lc._trainer(precisionloop, cfg, args, False, graph=graph)
    return Run(run.step, context=policy.backend_flags if held else None)

systems = {
    "hand": lambda: lc._hand(cfg, args),
    "hand, flags set+restored per step": hand_flip,
    "step": lambda: trainer(False, False),
    "step, flags held": lambda: trainer(False, True),
    "step+graph": lambda: trainer(True, False),
    "step+graph, flags held": lambda: trainer(True, True),
}
keep = sys.argv[4].split(",") if len(sys.argv) > 4 else None
if keep:
    systems = {k: v for i, (k, v) in enumerate(systems.items()) if str(i) in keep}
t0 = time.time()
m = interleaved(systems, rounds=rounds, iters=40, warmup=10, device=args.device, blocks=5)
out = {"torch": torch.__version__, "config": cfg.label, "systems": {}}
for name, x in m.items():
    r = paired_ratio(x, m["hand"]) if name != "hand" else None
    print(f"{name:<36} {format_time(x):>28}  {format_ratio(r) if r else ''}", flush=True)
    out["systems"][name] = {**x.to_dict(), "vs_hand": r}
# the flags' host cost alone, per set+restore
from precisionloop.policy import _read_flags
ctx = policy.backend_flags()
n = 5000
t = time.perf_counter()
for _ in range(n):
    with ctx:
        pass
out["flags_set_restore_us"] = (time.perf_counter() - t) / n * 1e6
print(f"backend_flags set+restore: {out['flags_set_restore_us']:.1f} us (outside flags {_read_flags()})")
print(f"elapsed {time.time()-t0:.0f} s")
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "/dev/null", "w"), indent=1)
