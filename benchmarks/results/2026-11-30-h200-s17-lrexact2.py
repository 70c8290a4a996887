"""How often does an fp32-tensor LR change a fused step's result against the float LR it rounds? And is the rounded
float LR bit-identical to the tensor? Adam/AdamW/SGD, 4096 elements, 60 steps, LRs that are not fp32 numbers."""
import torch
dev = "cuda"
def run(cls, lrs, kw, as_tensor):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096, device=dev))
    lr0 = torch.tensor(lrs[0], dtype=torch.float32, device=dev) if as_tensor else lrs[0]
    opt = cls([p], lr=lr0, fused=True, **kw)
    out = []
    for s, lr in enumerate(lrs):
        if as_tensor: opt.param_groups[0]["lr"].fill_(lr)
        else: opt.param_groups[0]["lr"] = lr
        p.grad = torch.randn_like(p)
        opt.step()
        out.append(p.detach().clone())
    return out
f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))
for cls, kw in [(torch.optim.Adam, {}), (torch.optim.AdamW, dict(weight_decay=1e-2)), (torch.optim.SGD, dict(momentum=0.9))]:
    for base in (1e-3, 3e-4, 0.1):
        lrs = [base / (1 + 0.37 * i) for i in range(60)]
        t = run(cls, lrs, kw, True)
        f = run(cls, lrs, kw, False)
        r = run(cls, [f32(x) for x in lrs], kw, False)
        first = next((i for i, (a, b) in enumerate(zip(t, f)) if not torch.equal(a, b)), None)
        print(f"{cls.__name__} {kw} lr {base}/(1+0.37i): tensor vs float first differs at step {first}; "
              f"max diff at end {(t[-1] - f[-1]).abs().max().item():.3g}; tensor vs fp32-rounded float equal at every step: "
              f"{all(torch.equal(a, b) for a, b in zip(t, r))}")
