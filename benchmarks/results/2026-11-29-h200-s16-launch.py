"""This host's cost per CUDA kernel launch and per Python call, in 5 rounds (median [min-max] us)."""
import time, torch
x = torch.zeros(1, device="cuda"); a, b = torch.zeros((), device="cuda"), torch.ones((), device="cuda")
def per(f, n=2000):
    out = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): f()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    s = sorted(out); return f"{s[2]:.1f} [{s[0]:.1f}-{s[-1]:.1f}]"
def noop(): pass
print("launch x.add_(1):", per(lambda: x.add_(1)), "us")
print("torch.stack of two 0-d:", per(lambda: torch.stack([a, b])), "us")
print("python no-op call:", per(noop), "us")
