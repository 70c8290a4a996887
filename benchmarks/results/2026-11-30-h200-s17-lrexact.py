"""Are fused SGD/Adam/AdamW steps with a float LR bit-identical to the same steps with a 0-d fp32/fp64 device tensor LR?"""
import torch
torch.manual_seed(0)
dev = "cuda"
def run(cls, lr, kw, steps=5):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in (7, 1000, 33)]
    opt = cls(ps, lr=lr, fused=True, **kw)
    for s in range(steps):
        for p in ps: p.grad = torch.randn_like(p) * (s + 1)
        opt.step()
    return torch.cat([p.detach().flatten() for p in ps])
for cls, kw in [(torch.optim.SGD, dict(momentum=0.9, weight_decay=1e-4)), (torch.optim.SGD, dict(momentum=0.9, nesterov=True)),
                (torch.optim.SGD, {}), (torch.optim.Adam, dict(weight_decay=1e-2)), (torch.optim.AdamW, {}),
                (torch.optim.Adam, dict(amsgrad=True))]:
    for lr in (0.01, 0.1, 1e-3 / 3):
        a = run(cls, lr, kw)
        for dt in (torch.float32, torch.float64):
            try:
                b = run(cls, torch.tensor(lr, dtype=dt, device=dev), kw)
                print(cls.__name__, kw, lr, dt, "max diff", (a - b).abs().max().item(), "equal", torch.equal(a, b))
            except Exception as e:
                print(cls.__name__, kw, lr, dt, "ERROR", type(e).__name__, str(e)[:150])
