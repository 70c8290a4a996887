"""Host time Trainer.step adds to a hand loop on a tiny CPU model, before and after the host trims.

    PYTHONPATH=. python benchmarks/results/2026-11-29-cpu-host-overhead.py .bench/pre/precisionloop_pretrim

The argument is the package at f9f7245 (``git archive f9f7245 precisionloop``, renamed), imported
under another name so both versions run in one process. Fused SGD, so the skip is decided on the
device path the GPU uses (CPU fused SGD takes ``found_inf``); 5 interleaved repeats of 300 warm-up +
3000 timed steps; the median per system. The Trainer sets and restores the bf16 policy's backend
flags every step; the hand loop sets none (on the CPU they change nothing).
"""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import precisionloop


def load(path):
    spec = importlib.util.spec_from_file_location("precisionloop_before", Path(path) / "__init__.py",
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["precisionloop_before"] = module
    spec.loader.exec_module(module)
    return module


torch.manual_seed(0)
torch.set_num_threads(1)
x, y = torch.randn(2, 8), torch.randn(2, 8)


def model():
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, fused=True)


def loss_fn(out, target):
    return nn.functional.mse_loss(out.float(), target)


def hand():
    m = model()
    opt = sgd(m)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def trainer(package):
    m = model()
    t = package.Trainer(m, sgd(m), "bf16", device="cpu", loss_fn=loss_fn)
    return lambda: t.step((x, y))


def per_step_us(step, n=3000):
    for _ in range(300):
        step()
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e6


before = load(sys.argv[1])
systems = {"hand loop": hand, "Trainer.step, before trims": lambda: trainer(before),
           "Trainer.step": lambda: trainer(precisionloop)}
times = {name: [] for name in systems}
for _ in range(5):
    for name, make in systems.items():
        times[name].append(per_step_us(make()))
base = statistics.median(times["hand loop"])
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, tiny MLP (4 x Linear(8, 8)), bf16 autocast, fused SGD")
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"  {name:<28} {m:7.1f} us  [{min(ts):.1f}-{max(ts):.1f}]  +{m - base:5.1f} us over the hand loop")
