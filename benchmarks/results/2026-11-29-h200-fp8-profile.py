"""Where does the fp8 step's time go? Reference Transformer, bf16 vs fp8, Trainer vs hand loop; kernel categories."""
import collections, json, os, sys, time
import torch
from precisionloop import BF16Policy, FP8Policy, Trainer
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time
from precisionloop.recipes import models

dev = torch.device("cuda")
ref = models.REFERENCE
batch = models.random_tokens(8, ref["seq_len"], ref["vocab"], dev)
OUT = os.environ.get("OUT", ".")

def stack():
    torch.manual_seed(0)
    return models.TransformerStack(ref["layers"], ref["d_model"], ref["d_ff"], ref["heads"], ref["vocab"], ref["seq_len"])

everything = tuple(n for n, m in stack().named_modules() if isinstance(m, torch.nn.Linear))

def trainer(policy, mode=True):
    def build():
        model = stack()
        t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), policy, device=dev,
                    compile=mode, loss_fn=models.lm_loss)
        b = t.to_device(batch)
        return Run(lambda: t.step(b))
    return build

def hand(fp8, mode=None):
    def build():
        model = stack().to(dev)
        if fp8:
            from torchao.float8 import convert_to_float8_training
            convert_to_float8_training(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        model.compile(mode=mode)
        x, y = batch
        def step():
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", torch.bfloat16):
                loss = models.lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Run(step)
    return build

def categorize(name):
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n: return "attention"
    if ("e4m3" in n or "f8" in n or "fp8" in n or "scaled_mm" in n) and ("gemm" in n or "nvjet" in n or "cutlass" in n or "sm90" in n or "xmma" in n): return "fp8 gemm"
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "sm90" in n or "xmma" in n or "cublas" in n: return "gemm"
    if "adam" in n or "multi_tensor" in n: return "optimizer"
    if n.startswith("triton"): return "triton (fused elementwise/reductions)"
    if "memcpy" in n or "memset" in n: return "memcpy/memset"
    return "other"

def profile(name, factory, steps=5):
    run = factory()
    step = run.step if hasattr(run, "step") else run
    for _ in range(12):
        step()
    torch.cuda.synchronize()
    from torch.profiler import profile as prof, ProfilerActivity
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    cats = collections.Counter(); kernels = collections.Counter(); counts = collections.Counter()
    for e in p.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t and e.device_type.name == "CUDA":
            cats[categorize(e.key)] += t / steps / 1e3
            kernels[e.key] += t / steps / 1e3
            counts[e.key] += e.count / steps
    total = sum(cats.values())
    print(f"\n== {name}: wall {wall:.2f} ms/step, GPU kernels {total:.2f} ms/step, kernels/step {sum(counts.values()):.0f}", flush=True)
    for c, t in cats.most_common():
        print(f"   {c:40} {t:7.2f} ms  {100*t/total:5.1f}%")
    for k, t in kernels.most_common(14):
        print(f"     {t:7.3f} ms x{counts[k]:4.0f}  [{categorize(k)}] {k[:110]}")
    return {"wall_ms": wall, "gpu_ms": total, "categories": dict(cats), "top": [[k, t, counts[k]] for k, t in kernels.most_common(40)]}

which = sys.argv[1] if len(sys.argv) > 1 else "time,profile"
result = {}
if "time" in which:
    systems = {
        "trainer bf16": trainer(BF16Policy()),
        "trainer fp8 default": trainer(FP8Policy()),
        "trainer fp8 all": trainer(FP8Policy(layers=everything)),
        "hand bf16 reduce-overhead": hand(False, "reduce-overhead"),
        "hand fp8 reduce-overhead (torchao all layers, no pad)": hand(True, "reduce-overhead"),
    }
    with torch._dynamo.config.patch(recompile_limit=64):
        res = interleaved(systems, rounds=3, iters=15, warmup=8, device=dev)
    for base_name, group in (("trainer bf16", [k for k in res if k.startswith("trainer")]),
                             ("hand bf16 reduce-overhead", ["hand fp8 reduce-overhead (torchao all layers, no pad)", "trainer bf16", "trainer fp8 default", "trainer fp8 all"])):
        for k in [base_name] + [g for g in group if g != base_name]:
            m = res[k]
            r = paired_ratio(res[base_name], m) if m.rounds_ms else None
            print(f"{k:45} {format_time(m):30} {m.peak_mb or 0:8.0f} MB  vs {base_name}: {format_ratio(r) if r else m.error}", flush=True)
    result["time"] = {k: {"rounds_ms": m.rounds_ms, "peak_mb": m.peak_mb} for k, m in res.items()}
if "profile" in which:
    with torch._dynamo.config.patch(recompile_limit=64):
        result["profile"] = {
            "bf16 (hand, default mode)": profile("bf16 hand default-mode", hand(False)),
            "fp8 all (hand, default mode)": profile("fp8 torchao all, hand default-mode", hand(True)),
            "fp8 default (Trainer, default mode)": profile("fp8 Trainer default layers, compile='default'", trainer(FP8Policy(), "default")),
        }
json.dump(result, open(os.path.join(OUT, "prof_fp8.json"), "w"), indent=1)
