"""Per-call host cost on this machine (hot loops) of what Trainer.step does beyond the hand loop."""
import timeit, torch, sys
from torch import nn
import torchvision
import precisionloop
from precisionloop import engine as E, loop as L, policy as P, _compat as C
from precisionloop.guard import FiniteGuard
dev = torch.device("cuda")
pol = precisionloop.get_policy("bf16")
m = torchvision.models.resnet18().to(dev)
params = list(m.parameters())
for p in params: p.grad = torch.zeros_like(p)
opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
a, b = torch.zeros((), device=dev), torch.ones((), device=dev)
row = torch.empty(16, 2, device=dev)[3]
x = torch.randn(32, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last); y = torch.zeros(32, dtype=torch.long, device=dev)
batch = (x, y)
blocks = E._VerdictBlocks()
g = FiniteGuard()
grads = [p.grad for p in params]
def flags():
    with pol.backend_flags(): pass
ac = torch.autocast("cuda", dtype=torch.bfloat16)
def ac_enter():
    with ac: pass
def ac_new():
    with torch.autocast("cuda", dtype=torch.bfloat16): pass
def write():
    blocks.write([a, b], 16)
    if blocks._filled == 16: blocks._rows, blocks._filled = None, 0
tests = {
 "stack out=": lambda: torch.stack([a, b], out=row),
 "stack": lambda: torch.stack([a, b]),
 "clone": lambda: b.clone(),
 "copy_ 0-d": lambda: row[0].copy_(b) if False else a.copy_(b),
 "add_ launch": lambda: a.add_(0),
 "write()": write,
 "current_stream_id": lambda: C.current_stream_id(dev),
 "t.device": lambda: a.device,
 "t.dtype": lambda: a.dtype,
 "t.dim()": lambda: a.dim(),
 "unbind 2": lambda: row.unbind(),
 "flags ctx": flags,
 "_read_flags": P._read_flags,
 "autocast new+enter": ac_new,
 "autocast kept enter": ac_enter,
 "grads list 62": lambda: [q for grp in opt.param_groups for p in grp["params"] if (q := p.grad) is not None],
 "_zero_on": lambda: g._zero_on(dev),
 "check kernel 62": lambda: C.non_finite_check_(grads, a, b),
 "to_device": lambda: E.to_device(batch, dev, torch.channels_last),
 "batch_size": lambda: L.batch_size(batch),
 "enable_grad ctx": lambda: torch.enable_grad().__enter__(),
 "StepResult": lambda: E.StepResult(a, due=True, found_inf=b, scale=None, grad_norm=None),
 "fused sgd step": lambda: opt.step(),
 "zero_grad-less": lambda: None,
}
for k, f in tests.items():
    n = 2000
    for _ in range(200): f()
    torch.cuda.synchronize()
    t = min(timeit.repeat(f, number=n, repeat=3)) / n * 1e6
    torch.cuda.synchronize()
    print(f"{k:<24} {t:7.2f} us", flush=True)
