"""Inclusive host time per step of Trainer.step's parts (wrapped with perf_counter), eager, host-bound."""
import sys, time, functools, collections, statistics
import torch
from torch import nn
import precisionloop
from precisionloop import engine as E, guard as G, policy as P, _compat as C, loop as L, trainer as T
sys.path.insert(0, "benchmarks")
import loop_cost as lc
model_name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
acc = collections.defaultdict(float)
def wrap(owner, name, label=None):
    f = getattr(owner, name); label = label or f"{getattr(owner, '__name__', owner)}.{name}"
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter_ns() - t
    setattr(owner, name, w)
targets = [(T.Trainer, "step"), (T.Trainer, "to_device"), (T.Trainer, "forward_batch"), (T.Trainer, "_loss_parts") if hasattr(T.Trainer, "_loss_parts") else None,
           (L, "batch_size"), (P._BackendFlags, "__enter__"), (P._BackendFlags, "__exit__"),
           (E.StepEngine, "step"), (E.StepEngine, "_step"), (E.StepEngine, "optimizer_step"), (E.StepEngine, "_book"),
           (E.StepEngine, "_unscale_and_clip"), (E._VerdictBlocks, "write"), (E._VerdictBlocks, "copy_if_full"),
           (E._VerdictBlocks, "copy_stranded"), (G.FiniteGuard, "unscale_"), (G.FiniteGuard, "step"),
           (C, "step_with_verdict"), (G._FirstStepCheck, "needs_host"), (torch.optim.SGD, "step"),
           (torch.optim.Optimizer, "zero_grad"), (torch.Tensor, "backward"), (P.PrecisionPolicy, "autocast")]
for t in targets:
    if t: wrap(*t)
def build():
    torch.manual_seed(0)
    if model_name == "tiny":
        m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(31)], nn.Linear(64, 10))
        return m, (torch.randn(32, 64, device=dev), torch.randint(0, 10, (32,), device=dev))
    return lc.bench.build_model("resnet18"), lc.bench.random_batch(32, 224, dev)
def trainer_step():
    m, batch = build()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)
    t = precisionloop.Trainer(m, opt, "bf16", device=dev, distributed=None)
    b = t.to_device(batch)
    return lambda: t.step(b), None
def hand_step():
    m, (x, y) = build()
    m = m.to(dev, memory_format=torch.channels_last) if x.dim() == 4 else m.to(dev)
    if x.dim() == 4: x = x.contiguous(memory_format=torch.channels_last)
    o = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)
    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(m(x), y)
        loss.backward(); o.step(); o.zero_grad(set_to_none=True)
    return step, precisionloop.get_policy("bf16").backend_flags
N = 300
for r in range(2):
  for name, make in (("hand", hand_step), ("trainer", trainer_step)):
    f, ctx = make()
    import contextlib
    with (ctx() if ctx else contextlib.nullcontext()):
        for _ in range(30): f()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        acc.clear()
        wall = time.perf_counter_ns()
        for _ in range(N): f()
        wall = time.perf_counter_ns() - wall
        torch.cuda.synchronize() if dev.type == "cuda" else None
    print(f"{model_name} {name} round {r}: wall {wall / N / 1e3:.1f} us/step")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<40} {v / N / 1e3:8.1f} us")
