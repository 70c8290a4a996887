import pytest
import torch
from torch import nn
import copy
import random

import numpy as np
from torch.utils.data import TensorDataset

from precisionloop import BF16AdamW, FP16Policy, Trainer


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_mlp(seed: int = 0, in_features: int = 16, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, classes))


def tiny_cnn(seed: int = 0, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes),
    )


def batches(n: int, batch_size: int = 8, in_features: int = 16, classes: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, in_features, generator=g), torch.randint(0, classes, (batch_size,), generator=g))
        for _ in range(n)
    ]


class ProbeNorm(nn.LayerNorm):
    """A LayerNorm that records, on each call, whether CPU autocast is on and its input's dtype."""

    def __init__(self, features):
        super().__init__(features)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return super().forward(x)


def fp32_only_loss(outputs, targets):
    # Makes autotune's choice deterministic through public surfaces only: a trial whose outputs are
    # not fp32 (the bf16 candidate) fails and is rejected, so the choice is fp32 (tf32=False), while
    # precision="auto" before tuning is a tf32=True policy on the CPU (BF16Policy or FP32Policy(tf32=True)).
    if outputs.dtype != torch.float32:
        raise RuntimeError("this loss runs in fp32 only")
    return nn.functional.cross_entropy(outputs, targets)


def steps_without_host_sync(trainer, batches) -> list:
    """``trainer.step`` on each batch with torch's sync check raising on any host sync (CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return [trainer.step(b) for b in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")


# The backend flags the policies set, through torch's public settings: per-backend ``fp32_precision`` on
# torch >= 2.9 (mixing it with the older ``allow_tf32`` switches raises), ``allow_tf32`` before.
_MATMUL, _CUDNN = torch.backends.cuda.matmul, torch.backends.cudnn
_TF32 = (((_MATMUL, "fp32_precision"), (_CUDNN.conv, "fp32_precision"), (_CUDNN.rnn, "fp32_precision"))
         if hasattr(_MATMUL, "fp32_precision") else ((_MATMUL, "allow_tf32"), (_CUDNN, "allow_tf32")))


def tf32_flags(tf32: bool) -> tuple:
    """The TF32 switches' values for tf32 on or off, as ``read_flags`` returns them."""
    if hasattr(_MATMUL, "fp32_precision"):
        return ("tf32" if tf32 else "ieee",) * 3
    return (tf32, tf32)


def read_flags():
    """(the TF32 switches, cudnn.benchmark), read through torch's public settings."""
    return tuple(getattr(owner, name) for owner, name in _TF32), torch.backends.cudnn.benchmark


def write_flags(tf32, benchmark):
    for (owner, name), value in zip(_TF32, tf32):
        setattr(owner, name, value)
    torch.backends.cudnn.benchmark = benchmark


# A small classifier and its batches, with comparisons of weights and optimizer state: shared by the step,
# skip, checkpoint, loop and bad-input tests.

def net(drop=0.0, out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(drop), nn.Linear(16, out))


def mk(p="fp32", opt=torch.optim.AdamW, drop=0.0, out=3, lr=0.1, **kw):
    m = net(drop, out)
    return m, Trainer(m, opt(m.parameters(), lr=lr), p, device="cpu", **kw)


def batch(seed=1, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


B = batch()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def same_params(model, saved):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), saved, strict=True))


def same_models(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def opt_state(optimizer):
    return copy.deepcopy(optimizer.state_dict())


def same_state(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def unfrozen_late(precision, **kw):
    """Layer 0 frozen when the Trainer is built, then unfrozen and added to the optimizer."""
    m = net()
    for p in m[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    t = Trainer(m, opt, precision, device="cpu", **kw)
    for p in m[0].parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(m[0].parameters())})
    return m, t


class DictTrainer(Trainer):
    calls = 0

    def forward_batch(self, batch):
        DictTrainer.calls += 1
        return self.model(batch["x"]), batch["y"]


def dict_batch(seed):
    x, y = batch(seed)
    return {"x": x, "y": y}


# A one-layer trainer and its batch: shared by the bad-input and checkpoint tests.

X, Y = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0])


def _trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", **{"device": "cpu", **kwargs})


# A dropout MLP with a scheduler and a noisy shuffled loader: shared by the loop and checkpoint tests.

def dataset(n=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


def dropout_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def make_trainer(precision, seed=0, **kwargs):
    model = dropout_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    policy = FP16Policy(growth_interval=4) if precision == "fp16" else precision
    return Trainer(model, opt, policy, device="cpu", scheduler=sched, scheduler_interval="step", **kwargs)


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# The scheduler's interval: "step" after every optimizer step taken, "epoch" at each epoch's end of fit.

def _scheduled(interval, gamma=0.5):
    model = dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    return Trainer(model, opt, "fp32", device="cpu", scheduler=sched, scheduler_interval=interval)


def pure_bf16(model=None, **kw):
    """A Trainer under precision 'bf16-pure' on ``net()`` (or ``model``) with BF16AdamW."""
    model = net() if model is None else model
    return model, Trainer(model, BF16AdamW(model.parameters(), lr=1e-2), "bf16-pure", **{"device": "cpu", **kw})
