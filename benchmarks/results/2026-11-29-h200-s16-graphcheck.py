"""Does the captured guarded step (check + fused SGD + skip) update exactly as the eager one? ResNet18 at 32 px, eager
forward/backward, bf16, fused SGD (momentum); NaN gradients at steps 5 and 6; weights and momentum compared."""
import copy, torch
from torch import nn
import torchvision
torch.manual_seed(0)
torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False  # both copies get the same gradients
dev = torch.device("cuda")
base = torchvision.models.resnet18().to(dev, memory_format=torch.channels_last)
x = torch.randn(32, 3, 32, 32, device=dev).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 1000, (32,), device=dev)
armed = {"on": False}

def setup(model):
    model.fc.weight.register_hook(lambda g: torch.full_like(g, float("nan")) if armed["on"] else g)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

def fb(model):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()

def guarded(opt, grads, found, inv):
    found.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    opt.grad_scale, opt.found_inf = None, found
    opt.step()
    del opt.grad_scale, opt.found_inf

ma, mb = base, copy.deepcopy(base)
oa, ob = setup(ma), setup(mb)
fa, fbuf, inv = torch.zeros(1, device=dev), torch.zeros(1, device=dev), torch.ones(1, device=dev)
pa, pb = list(ma.parameters()), list(mb.parameters())
for _ in range(3):  # eager steps on both: momentum buffers exist
    for m, o in ((ma, oa), (mb, ob)):
        fb(m); o.step(); o.zero_grad(set_to_none=True)
static = [torch.zeros_like(p) for p in pb]
for p, s in zip(pb, static):
    p.grad = s
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):  # warm-up before capture: two steps with zero gradients
        guarded(ob, static, fbuf, inv)
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):  # recorded, not run
    guarded(ob, static, fbuf, inv)
ob.zero_grad(set_to_none=True)
zeros = [torch.zeros_like(p) for p in pa]
for p, z in zip(pa, zeros):
    p.grad = z
for _ in range(2):  # the same two zero-gradient steps on A
    guarded(oa, zeros, fa, inv)
oa.zero_grad(set_to_none=True)
skips = []
for i in range(1, 13):
    armed["on"] = i in (5, 6)
    fb(ma); guarded(oa, [p.grad for p in pa], fa, inv); skips.append(fa.item()); oa.zero_grad(set_to_none=True)
    fb(mb); torch._foreach_copy_(static, [p.grad for p in pb]); g.replay(); ob.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print("skipped (eager):", skips)
wd = max((p - q).abs().max().item() for p, q in zip(pa, pb))
md = max((oa.state[p]["momentum_buffer"] - ob.state[q]["momentum_buffer"]).abs().max().item() for p, q in zip(pa, pb))
print(f"max |weight difference| {wd:.3g}, max |momentum difference| {md:.3g}")
