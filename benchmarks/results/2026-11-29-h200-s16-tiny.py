"""Host cost per step on a tiny CUDA model (a 2-layer MLP, batch 32, bf16, fused SGD, eager), where the GPU's
work is negligible and each step's time is the host's: the hand loop, a hand loop with the minimum guard
(zero, non-finite check, fused step taking the verdict, a device skip counter), Trainer.step now (blocks of 16,
blocks of 1) and older packages (.pre/<name>), and fit (an epoch of 50 steps, progress bar on) now and older.
Interleaved rounds, alternating blocks; medians in us and paired ratios."""
import importlib.util, json, os, sys
from pathlib import Path
import torch
from torch import nn
import precisionloop
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
OLD = sys.argv[2].split(",") if len(sys.argv) > 2 else []
dev = torch.device(os.environ.get("DEV", "cuda"))
FIT_STEPS = 50

def load(name):
    init = Path(".pre") / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod

pkgs = {n: load(n) for n in OLD}
def model(): return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
def opt(m): return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)
def batch(): return torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
flags = precisionloop.get_policy("bf16").backend_flags

def hand(guarded):
    m = model(); o = opt(m); x, y = batch()
    params = list(m.parameters())
    found, inv, skips = torch.zeros(1, device=dev), torch.ones(1, device=dev), torch.zeros(1, device=dev)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        if guarded:
            found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, inv)
            o.grad_scale, o.found_inf = None, found
            o.step()
            del o.grad_scale, o.found_inf
            skips.add_(found)
        else:
            o.step()
        o.zero_grad(set_to_none=True)
    return Run(step, context=flags)

def hand_epoch():
    run = hand(False)
    def epoch():
        for _ in range(FIT_STEPS): run.step()
    return Run(epoch, context=flags)

def trainer(pkg, per_copy, fit=False):
    m = model()
    t = pkg.Trainer(m, opt(m), "bf16", device=dev, distributed=None)
    if per_copy is not None and hasattr(t.engine, "verdicts_per_copy"):
        t.engine.verdicts_per_copy = per_copy
    b = t.to_device(batch())
    if fit:
        epoch = [b] * FIT_STEPS
        return Run(lambda: t.fit(epoch, epochs=t.epoch + 1, progress=True))
    return Run(lambda: t.step(b))

def report(res, base, title, scale=1.0):
    print(title)
    for n, m in res.items():
        r = paired_ratio(m, res[base])
        med = sorted(m.rounds_ms)[len(m.rounds_ms) // 2] * 1000 / scale
        lo, hi = min(m.rounds_ms) * 1000 / scale, max(m.rounds_ms) * 1000 / scale
        print(f"  {n:<18} {med:8.1f} us/step [{lo:.1f}-{hi:.1f}]   {format_ratio(r)}", flush=True)

def pairs(res, items, scale=1.0):
    for a, b in items:
        x = [p / q for p, q in zip(res[a].rounds_ms, res[b].rounds_ms)]
        d = [1000 * (p - q) / scale for p, q in zip(res[a].rounds_ms, res[b].rounds_ms)]
        s, ds = sorted(x), sorted(d)
        print(f"  {a} / {b}: {s[len(s)//2]:.3f} [{s[0]:.3f}-{s[-1]:.3f}], {sum(v < 1 for v in x)} of {len(x)} below 1;"
              f" difference {ds[len(ds)//2]:+.1f} us [{ds[0]:+.1f} to {ds[-1]:+.1f}]")

systems = {"hand": lambda: hand(False), "hand+guard": lambda: hand(True),
           "step now/16": lambda: trainer(precisionloop, 16), "step now/1": lambda: trainer(precisionloop, 1),
           "step now/16 flags": lambda: Run(trainer(precisionloop, 16).step, context=flags)}
for n, p in pkgs.items():
    systems[f"step {n}/1"] = (lambda p=p: trainer(p, 1))
    systems[f"step {n}/16"] = (lambda p=p: trainer(p, 16))
res = interleaved(systems, rounds=ROUNDS, iters=400, warmup=50, device=dev, blocks=8)
print(f"tiny MLP b32 bf16 fused SGD eager, torch {torch.__version__}, {ROUNDS} rounds of 400 steps in 8 blocks")
report(res, "hand", "Trainer.step against the hand loop (median of round medians [min-max]):")
pairs(res, [("hand+guard", "hand"), ("step now/16", "hand+guard"), ("step now/1", "step now/16"),
            ("step now/16", "step now/16 flags")]
      + [(f"step now/{k}", f"step {n}/{k}") for n in pkgs for k in (1, 16)])
fsys = {"hand epoch": hand_epoch, "fit now": lambda: trainer(precisionloop, None, True)}
for n, p in pkgs.items():
    fsys[f"fit {n}"] = (lambda p=p: trainer(p, None, True))
fres = interleaved(fsys, rounds=ROUNDS, iters=8, warmup=2, device=dev, blocks=4)
report(fres, "hand epoch", f"fit, epochs of {FIT_STEPS} steps, per step:", scale=FIT_STEPS)
pairs(fres, [("fit now", "hand epoch")] + [("fit now", f"fit {n}") for n in pkgs], scale=FIT_STEPS)
json.dump({"step": {n: m.to_dict() for n, m in res.items()}, "fit": {n: m.to_dict() for n, m in fres.items()}},
          open(os.path.join(os.environ.get("OUT", "."), "tiny.json"), "w"), indent=1)
