"""How long ``precisionloop.diagnostics.precision_report`` takes on the recipe's Transformer and on ResNet18.

    PYTHONPATH=. python benchmarks/precision_report_time.py --json out.json

Each model is trained under bf16 for a few steps first, then reported on one batch; the time is the report's
wall clock, the first call included (nothing is compiled). The report's table for each model is printed too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from precisionloop import Trainer
from precisionloop.diagnostics import precision_report
from precisionloop.recipes import models, resnet18_bench


def run(name: str, device: torch.device) -> dict:
    torch.manual_seed(0)
    if name == "resnet18":
        model, loss_fn = resnet18_bench.build_model("resnet18"), None
        batch = resnet18_bench.random_batch(128, 224, device)
    else:
        sizes = models.SIZES[name.split("-")[1]] if device.type == "cuda" else models.TINY
        model, loss_fn = models.TransformerStack(**sizes), models.lm_loss
        batch = models.random_tokens(4 if device.type == "cuda" else 2, sizes["seq_len"], sizes["vocab"], device, seed=0)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), "bf16", device=device,
                      loss_fn=loss_fn, distributed=None)
    for _ in range(3):
        trainer.step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    report = precision_report(trainer, batch)
    seconds = time.perf_counter() - began
    print(f"{name}: {len(report.rows)} rows in {seconds:.2f} s\n{report}\n", flush=True)
    return {"model": name, "seconds": seconds, "report": report.to_dict()}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="transformer-large,resnet18")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = [run(name, device) for name in args.models.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", "runs": out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
