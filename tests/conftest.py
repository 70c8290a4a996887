import pytest
import torch
from torch import nn


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
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


def read_flags():
    """The backend flags the policies set, as (the TF32 switches, cudnn.benchmark), read through torch's public API."""
    from precisionloop import policy

    *tf32, benchmark = [getattr(owner, name) for owner, name in policy._FLAGS]
    return tuple(tf32), benchmark


def write_flags(tf32, benchmark):
    from precisionloop import policy

    for (owner, name), value in zip(policy._FLAGS, (*tf32, benchmark)):
        setattr(owner, name, value)


def tf32_flags(tf32: bool):
    """The TF32 switches' values for tf32 on or off, as ``read_flags`` returns them."""
    from precisionloop import policy

    return policy._tf32_values(tf32)


class _RecordingOwner:
    """Stands in for a torch.backends object and records each write to it."""

    def __init__(self, owner, index, writes):
        self.__dict__.update(_owner=owner, _index=index, _writes=writes)

    def __getattr__(self, name):
        return getattr(self._owner, name)

    def __setattr__(self, name, value):
        self._writes.append((self._index, value))
        setattr(self._owner, name, value)


def count_flag_writes(monkeypatch):
    """The list every backend-flag write of the policies is appended to, as (flag index, value)."""
    from precisionloop import policy

    writes = []
    monkeypatch.setattr(policy, "_FLAGS", tuple((_RecordingOwner(owner, i, writes), name)
                                                for i, (owner, name) in enumerate(policy._FLAGS)))
    return writes
