"""Train a small CNN, then count what each format does to one batch's gradients and one step's updates.

    python -m precisionloop.recipes.grad_underflow                      # offline data
    python -m precisionloop.recipes.grad_underflow --data-dir ~/data --download   # FashionMNIST, as the seed
    python -m precisionloop.recipes.grad_underflow --plot underflow.png           # and a picture (matplotlib)

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
from precisionloop.diagnostics import gradient_underflow, lost_updates
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
    p.add_argument("--plot", metavar="PATH", help="write a PNG histogram of the gradients here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or not 0 < args.scale < math.inf:
        p.error(f"--epochs must be >= 0, --batch-size >= 1 and --scale a finite number > 0; got {args.epochs}, "
                f"{args.batch_size} and {args.scale}")
    check_output(p, "--json", args.json)
    check_output(p, "--plot", args.plot)
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

    batch = trainer.to_device(next(iter(loader)))
    reports, grads = _gradient_table(trainer, batch, args.scale)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.step(batch)  # one more Adam step, to see which of its updates bf16 weights would keep
    lost = lost_updates(before, trainer.model, torch.bfloat16)
    print(f"\none Adam step (lr {args.lr:g}): {lost}")
    print(_EXPLAINED.format(source=source))
    fp16 = reports["fp16"]
    print(f"the study this project grew from ({SEED['data']}, its own CNN): {SEED['nonzero']:,} nonzero, median "
          f"{SEED['median_abs']:.2g}; "
          f"{100 * SEED['underflow']:.2f}% unscaled, {100 * SEED['underflow_scaled']:.4f}% with 65536; this run: "
          f"{100 * fp16.underflow:.2f}% and {100 * fp16.underflow_scaled:.4f}%")
    result = {"data": source, "environment": environment(trainer.device), "steps": trainer.global_step,
              **{key: r.to_dict() for key, r in reports.items()}, "lost_updates": lost.to_dict(), "seed": SEED}
    if args.plot:
        _plot(grads[grads > 0].cpu(), args.scale, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"report written to {args.json}")
    return result


_EXPLAINED = """
How to read this: "become 0" is the share of nonzero gradients whose cast to the format is exactly 0, so the update
never sees them; a loss scale multiplies the loss, and so every gradient, before the cast (fp16's GradScaler does,
and divides it out in fp32 afterwards); fp8 training scales each tensor so its largest magnitude maps to the
format's largest value (torchao's tensorwise scaling), so nothing overflows. "rel. error" is the mean relative error
of the values that survive the round trip. The last block is the share of one step's weight updates too small to
change a bf16 weight (under half its spacing): with bf16 weights, keep an fp32 copy (precision="bf16") or round
stochastically when this share is large. The last line compares fp16's figures with those of the study this
project grew from: another small CNN, on FashionMNIST; this run's data: {source}."""


def _gradient_table(trainer: Trainer, batch, scale: float) -> tuple[dict, torch.Tensor]:
    """One batch's gradients counted in each format and printed; the reports and the gradients' magnitudes."""
    trainer.model.zero_grad(set_to_none=True)
    with trainer.autocast():
        loss = trainer.compute_loss(*trainer.forward_batch(batch))
    with trainer.policy.backend_flags(trainer.device.type):  # fp32 as trained: no TF32 in the backward either
        loss.backward()
    reports = {key: gradient_underflow(trainer.model, dtype, s) for key, dtype, s in (
        ("fp16", torch.float16, scale), ("bf16", torch.bfloat16, 1.0),
        ("e4m3", torch.float8_e4m3fn, "tensorwise"), ("e5m2", torch.float8_e5m2, "tensorwise"))}
    print(f"\none batch's gradients: {reports['fp16'].nonzero:,} nonzero values, median |g| "
          f"{reports['fp16'].median_abs:.2g}")
    print(f"  {'format':<30}{'become 0':>10}{'overflow':>10}{'rel. error':>12}")
    for label, key, scaled in (("fp16, as cast", "fp16", False), (f"fp16 x {scale:g} (loss scale)", "fp16", True),
                               ("bf16, as cast", "bf16", False), ("e4m3 x tensorwise", "e4m3", True),
                               ("e5m2 x tensorwise", "e5m2", True)):
        r = reports[key]
        row = (r.underflow_scaled, r.overflow_scaled, r.error_scaled) if scaled else (r.underflow, r.overflow, r.error)
        print(f"  {label:<30}{row[0]:>10.4%}{row[1]:>10.4%}{row[2]:>12.3g}")
    grads = torch.cat([p.grad.detach().float().abs().flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.model.zero_grad(set_to_none=True)
    return reports, grads


def _plot(magnitudes: torch.Tensor, scale: float, path: str) -> None:
    """A histogram of log2 |gradient| with the line below which fp16's cast gives 0, unscaled and scaled."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot needs matplotlib (`pip install precisionloop[plot]`); no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(torch.log2(magnitudes).numpy(), bins=120, color="0.6")
    for label, shift, color in (("fp16", 1.0, "C3"), (f"fp16 x {scale:g}", scale, "C1")):
        floor = math.log2(2.0**-25 / shift)  # below half fp16's smallest subnormal (2^-24) the cast rounds to 0
        ax.axvline(floor, color=color, label=f"{label}: 0 below 2^{floor:.0f}")
    ax.set(xlabel="log2 |gradient|", ylabel="values", title="one batch's gradients and fp16's floor\n(bf16's, 2^-134, "
           "is off the chart; fp8 scales each tensor)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
