"""Compiled b32: which part of the Trainer's step costs what, in blocks; image size from argv[1]."""
import sys, json, os
import torch
from torch import nn
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop import _compat
from precisionloop.guard import FiniteGuard
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time
dev = torch.device("cuda")
IMG = int(sys.argv[1]) if len(sys.argv) > 1 else 224
pol = precisionloop.get_policy("bf16")

def hand(bw=False, guard=False, verdict=False):
    model = lc.bench.build_model("resnet18").to("cuda", memory_format=torch.channels_last)
    model.compile(mode="reduce-overhead")
    opt = lc.OPTIMIZERS["fused-sgd"](model.parameters())
    x, y = lc.bench.random_batch(32, IMG, dev)
    x = x.contiguous(memory_format=torch.channels_last)
    g = FiniteGuard(); params = list(model.parameters())
    host = torch.empty(2, pin_memory=True); ev = torch.cuda.Event(); st = {"p": False}
    def body():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if guard:
            if verdict and st["p"]:
                ev.synchronize(); host.tolist()
            found = g.unscale_(opt, [p.grad for p in params if p.grad is not None])
            _compat.step_with_verdict(opt, found)
            if verdict:
                v = torch.stack([found, loss.detach()])
                host.copy_(v, non_blocking=True); ev.record(); st["p"] = True
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    def step():
        torch.compiler.cudagraph_mark_step_begin()
        if bw:
            with _compat.compiled_backward_like_eager():
                body()
        else:
            body()
    return Run(step, context=pol.backend_flags)

def trainer(engine_only=False):
    model = lc.bench.build_model("resnet18")
    t = precisionloop.Trainer(model, lc.OPTIMIZERS["fused-sgd"](model.parameters()), "bf16", device="cuda", compile=True)
    b = t.to_device(lc.bench.random_batch(32, IMG, dev))
    if engine_only == "flags":
        return Run(lambda: t.step(b), context=t.policy.backend_flags)
    if engine_only:
        return Run(lambda: t.engine.step(b), context=t.policy.backend_flags)
    return Run(lambda: t.step(b))

systems = {"hand": hand, "hand+guard": lambda: hand(guard=True),
           "hand+guard+verdict": lambda: hand(guard=True, verdict=True),
           "engine.step": lambda: trainer(True), "Trainer.step in flags": lambda: trainer("flags"), "Trainer.step": trainer}
res = interleaved(systems, rounds=3, iters=80, warmup=15, device=dev, blocks=8)
print(f"compiled b32 at {IMG}px, torch {torch.__version__}")
for n, m in res.items():
    r = paired_ratio(m, res["hand"]) if m.rounds_ms else None
    print(f"  {n:<28} {format_time(m):>28} {format_ratio(r) if r else m.error}", flush=True)
json.dump({n: m.to_dict() for n, m in res.items()}, open(os.path.join(os.environ.get("OUT", "."), f"step-parts-{IMG}px.json"), "w"), indent=1)
