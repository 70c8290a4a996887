"""Subclass a precision policy for custom hardware, and train with it.

    python recipes/custom_policy.py

`VendorFP16Policy` stands for an accelerator whose autocast and loss scaler live under their own
device type (for example "hpu", "xpu", or a PrivateUse1 backend); here it runs on the CPU so the
script works anywhere. Set AUTOCAST_DEVICE to your backend's device type. `AuditedBF16Policy`
keeps the stock bf16 behaviour and logs where the model runs in reduced precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import nn

from precisionloop import BF16Policy, FP16Policy, Trainer

AUTOCAST_DEVICE = "cpu"
log = logging.getLogger("custom_policy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VendorFP16Policy(FP16Policy):
    """fp16 with loss scaling on a backend that has no TF32/cuDNN flags and no channels_last."""

    name = "vendor-fp16"
    init_scale: float = 2.0**12  # this hardware's gradients are larger; start lower

    def autocast(self, device_type):
        return torch.autocast(AUTOCAST_DEVICE, dtype=torch.float16)

    def make_scaler(self, device_type):
        return torch.amp.GradScaler(AUTOCAST_DEVICE, init_scale=self.init_scale, growth_interval=self.growth_interval)

    def backend_flags(self, device_type="cuda"):
        return contextlib.nullcontext()  # no CUDA flags to set on this hardware

    def prepare_model(self, model):
        return model  # supported by construction; the stock check (and its CPU fp16 warning) does not apply


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditedBF16Policy(BF16Policy):
    """Stock bf16, plus a one-time log of which layers produce bf16 outputs."""

    name = "audited-bf16"

    def prepare_model(self, model):
        model = super().prepare_model(model)
        seen: set[str] = set()
        for layer_name, module in model.named_modules():
            if not list(module.children()):
                module.register_forward_hook(_log_dtype(layer_name, seen))
        return model


def _log_dtype(layer_name: str, seen: set[str]):
    def hook(module, inputs, output):
        if layer_name not in seen and isinstance(output, torch.Tensor):
            seen.add(layer_name)
            log.info("%-4s %-12s -> %s", layer_name, type(module).__name__, output.dtype)
    return hook


def main(steps: int = 30) -> dict[str, float]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    final = {}
    for policy in (VendorFP16Policy(), AuditedBF16Policy()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy, device="cpu")
        x = torch.randn(256, 20)
        y = (x[:, :5].argmax(1))
        for i in range(steps):
            result = trainer.step((x[i % 8 * 32:(i % 8 + 1) * 32], y[i % 8 * 32:(i % 8 + 1) * 32]))
        final[policy.name] = result.loss
        print(f"{policy.name}: loss {result.loss:.4f} after {steps} steps, stats {trainer.stats}")
    return final


if __name__ == "__main__":
    main()
