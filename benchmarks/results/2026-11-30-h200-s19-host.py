"""Host cost of Trainer.step beyond the hand loop, in microseconds: a tiny many-parameter model (host-bound,
low noise) and ResNet18 b32 eager; plus cProfile of Trainer.step's own functions."""
import sys, json, cProfile, pstats, io, contextlib, argparse
import torch
from torch import nn
import precisionloop
from precisionloop import _compat
from precisionloop.guard import FiniteGuard
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time
sys.path.insert(0, "benchmarks")
import loop_cost as lc

p = argparse.ArgumentParser()
p.add_argument("--model", default="tiny")
p.add_argument("--iters", type=int, default=300)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--profile", action="store_true")
p.add_argument("--systems", default="hand,check,step,held")
args = p.parse_args()
dev = torch.device("cuda")
pol = precisionloop.get_policy("bf16")

def build():
    torch.manual_seed(0)
    if args.model == "tiny":  # 62 parameters, as ResNet18, almost no compute
        m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(31)], nn.Linear(64, 10))
        return m, (torch.randn(32, 64, device=dev), torch.randint(0, 10, (32,), device=dev))
    m = lc.bench.build_model("resnet18")
    return m, lc.bench.random_batch(32, 224, dev)

def opt(m):
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)

def hand(check=False):
    m, (x, y) = build()
    m = m.to(dev, memory_format=torch.channels_last) if x.dim() == 4 else m.to(dev)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    o = opt(m); params = list(m.parameters()); g = FiniteGuard()
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        if check:
            found = g.unscale_(o, [q.grad for q in params if q.grad is not None])
            g.step(o, found)
        else:
            o.step()
        o.zero_grad(set_to_none=True)
    return Run(step, context=pol.backend_flags)

def trainer(held=False):
    m, batch = build()
    t = precisionloop.Trainer(m, opt(m), "bf16", device=dev, distributed=None)
    b = t.to_device(batch)
    return Run(lambda: t.step(b), context=pol.backend_flags if held else None)

SYS = {"hand": hand, "check": lambda: hand(True), "step": trainer, "held": lambda: trainer(True)}
systems = {k: SYS[k] for k in args.systems.split(",")}
if args.profile:
    for name in ("hand", "step"):
        run = systems[name]()
        prof = cProfile.Profile()
        ctx = run.context() if run.context else contextlib.nullcontext()
        with ctx:
            for _ in range(30): run.step()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(200): run.step()
            torch.cuda.synchronize()
            prof.disable()
        s = io.StringIO(); st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(25)
        if name == "step":
            st.sort_stats("cumulative").print_stats("precisionloop|contextlib", 40)
        print(f"=== cProfile {args.model} {name} x200 ===\n" + s.getvalue(), flush=True)
res = interleaved(systems, rounds=args.rounds, iters=args.iters, warmup=30, device=dev, blocks=args.iters)
out = {}
for k, mm in res.items():
    r = paired_ratio(mm, res["hand"]) if k != "hand" else None
    print(f"{args.model} {k:6} {format_time(mm):>30} rounds_us={[round(v*1000,1) for v in mm.rounds_ms]}"
          f" {format_ratio(r) if r else ''}", flush=True)
    out[k] = mm.rounds_ms
print(json.dumps({args.model: out}))
