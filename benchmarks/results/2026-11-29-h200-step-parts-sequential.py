"""Where the compiled/eager b32 wrapper cost comes from: hand loop variants vs Trainer variants."""
import sys, json, statistics, time, collections
import torch
from torch import nn
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop import _compat
from precisionloop.guard import FiniteGuard
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time

class A: pass
args = A(); args.model = "resnet18"; args.image_size = 224; args.device = torch.device("cuda")

def hand_variant(config, guard=False, book=False, sync=False):
    model = lc.bench.build_model("resnet18").to("cuda", memory_format=torch.channels_last)
    if config.compile:
        model.compile(mode="reduce-overhead")
    opt = lc.OPTIMIZERS[config.optimizer](model.parameters())
    x, y = lc.bench.random_batch(config.batch_size, 224, args.device)
    x = x.contiguous(memory_format=torch.channels_last)
    g = FiniteGuard()
    params = [p for grp in opt.param_groups for p in grp["params"]]
    host = torch.empty(2, pin_memory=True); ev = torch.cuda.Event(); state = {"pending": False}
    def step():
        if config.compile:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if guard:
            if sync and state["pending"]:
                ev.synchronize(); host.tolist()
            grads = [p.grad for p in params if p.grad is not None]
            found = g.unscale_(opt, grads)
            with _compat.device_verdict(opt, found):
                opt.step()
            if book:
                v = torch.cat([found.reshape(1), loss.detach().reshape(1).float()])
                host.copy_(v, non_blocking=True); ev.record(); state["pending"] = True
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return Run(step, context=precisionloop.get_policy("bf16").backend_flags())

def trainer_variant(config, patch=None):
    model = lc.bench.build_model("resnet18")
    opt = lc.OPTIMIZERS[config.optimizer](model.parameters())
    t = precisionloop.Trainer(model, opt, "bf16", device="cuda", compile=config.compile, distributed=None)
    batch = t.to_device(lc.bench.random_batch(config.batch_size, 224, args.device))
    eng = t.engine
    if patch == "nobook":
        eng._book_later = lambda verdict: None
    if patch == "lag3":
        q = collections.deque()
        orig_book = eng._book_later
        def book(verdict):
            h = torch.empty(verdict.shape, pin_memory=True); e = torch.cuda.Event()
            h.copy_(verdict, non_blocking=True); e.record(); q.append((h, e))
            while len(q) > 3 or (q and q[0][1].query()):
                h0, e0 = q.popleft(); e0.synchronize(); h0.tolist()
        eng._book_later = book
    if patch == "flags-outside":
        return Run(lambda: t.engine.step(batch), context=t.policy.backend_flags())
    return Run(lambda: t.step(batch))

def prof(name, run, steps=30):
    from torch.profiler import profile, ProfilerActivity
    for _ in range(15): run.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(steps): run.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in ev) / steps / 1e3
    # union of kernel intervals per step
    iv = sorted((e.time_range.start, e.time_range.end) for e in ev)
    tot, cur_s, cur_e = 0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None: tot += cur_e - cur_s
            cur_s, cur_e = s, e
        else: cur_e = max(cur_e, e)
    if cur_e is not None: tot += cur_e - cur_s
    print(f"  profile {name}: wall {wall:.2f} ms/step (profiled), kernel sum {busy:.2f} ms, kernel union {tot/steps/1e3:.2f} ms, kernels/step {len(ev)/steps:.0f}", flush=True)

configs = [lc.Config(32, "fused-sgd", True), lc.Config(32, "fused-sgd", False)]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
out = {}
for c in configs:
    with precisionloop.get_policy("bf16").backend_flags():
        prof("hand " + c.label, hand_variant(c))
        prof("step " + c.label, trainer_variant(c))
    systems = {
        "hand": lambda c=c: hand_variant(c),
        "hand+guard": lambda c=c: hand_variant(c, guard=True),
        "hand+guard+book+sync": lambda c=c: hand_variant(c, guard=True, book=True, sync=True),
        "step": lambda c=c: trainer_variant(c),
        "step-nobook": lambda c=c: trainer_variant(c, "nobook"),
        "step-lag3": lambda c=c: trainer_variant(c, "lag3"),
        "engine.step, flags outside": lambda c=c: trainer_variant(c, "flags-outside"),
    }
    res = interleaved(systems, rounds=rounds, iters=60, warmup=15, device=args.device)
    print(c.label, flush=True)
    for n, m in res.items():
        r = paired_ratio(m, res["hand"]) if m.rounds_ms else None
        print(f"  {n:<28} {format_time(m):>28} {format_ratio(r) if r else m.error}", flush=True)
    out[c.label] = {n: m.to_dict() for n, m in res.items()}
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gap.json"), "w"), indent=1)
