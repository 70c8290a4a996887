"""Reproduce the seed's study: train a small CNN, then count what fp16 does to one batch's gradients.

    python -m precisionloop.recipes.grad_underflow                      # offline data
    python -m precisionloop.recipes.grad_underflow --data-dir ~/data --download   # FashionMNIST, as the seed

The seed found, on a FashionMNIST CNN, 267,787 nonzero gradients with median 8.3e-4, of which 0.35%
fall below fp16's smallest subnormal (2^-24, about 6e-8) and 0.0004% still do after a loss scale of 65536.
"""

from __future__ import annotations

import argparse
import json
import logging
import math

import torch
from torch import nn
from torch.utils.data import DataLoader

from precisionloop import Trainer
from precisionloop.diagnostics import gradient_underflow
from precisionloop.recipes.data import image_dataset
from precisionloop.recipes.resnet18_bench import check_output, environment

__all__ = ["SEED", "seed_cnn", "main"]

SEED = {"data": "FashionMNIST", "nonzero": 267_787, "median_abs": 8.3e-4, "underflow": 0.0035, "underflow_scaled": 0.000004}


def seed_cnn(classes: int = 10) -> nn.Module:
    """Two conv layers and two linear ones, the usual FashionMNIST CNN."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, classes),
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m precisionloop.recipes.grad_underflow", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=None, help="where FashionMNIST lives (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download FashionMNIST into --data-dir")
    p.add_argument("--epochs", type=int, default=5, help="training epochs before the analysis (default 5)")
    p.add_argument("--max-steps", type=int, default=None, help="stop training after this many steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--scale", type=float, default=65536.0, help="the loss scale to test (default 65536)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the reports here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or not 0 < args.scale < math.inf:
        p.error(f"--epochs must be >= 0, --batch-size >= 1 and --scale a finite number > 0; got {args.epochs}, "
                f"{args.batch_size} and {args.scale}")
    check_output(p, "--json", args.json)
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(args.seed)
    data, source = image_dataset("FashionMNIST", args.data_dir, args.download, offline="digits")
    print(f"data: {source}")
    if args.batch_size > len(data):  # drop_last would leave no batch to train on
        p.error(f"--batch-size {args.batch_size} is larger than the {len(data)} training samples")
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = seed_cnn()
    # fp32 training: the question is what fp16 would do to these gradients.
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=args.lr), "fp32", device=args.device)
    history = trainer.fit(loader, epochs=args.epochs, max_steps=args.max_steps, progress=not args.no_progress)
    if history:
        print(f"trained {trainer.global_step} steps in fp32; last epoch's mean loss {history[-1]['train_loss']:.4f}")

    batch = next(iter(loader))
    trainer.model.zero_grad(set_to_none=True)
    with trainer.policy.backend_flags():
        trainer.compute_loss(trainer.to_device(batch)).backward()
    fp16 = gradient_underflow(trainer.model, torch.float16, args.scale)
    bf16 = gradient_underflow(trainer.model, torch.bfloat16, args.scale)
    print()
    print(fp16)
    print()
    print(bf16)
    print(f"\nsummary: {fp16.nonzero:,} nonzero gradients, median |g| {fp16.median_abs:.2g}; below fp16's floor "
          f"{100 * fp16.underflow:.4f}% unscaled, {100 * fp16.underflow_scaled:.4f}% with loss scale {args.scale:g}; "
          f"bf16 loses {100 * bf16.underflow:.4f}%")
    print(f"seed ({SEED['data']}): {SEED['nonzero']:,} nonzero, median {SEED['median_abs']:.2g}; "
          f"{100 * SEED['underflow']:.2f}% unscaled, {100 * SEED['underflow_scaled']:.4f}% with 65536")
    result = {"data": source, "environment": environment(trainer.device), "steps": trainer.global_step,
              "fp16": fp16.to_dict(), "bf16": bf16.to_dict(), "seed": SEED}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"report written to {args.json}")
    return result


if __name__ == "__main__":
    main()
