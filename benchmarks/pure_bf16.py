"""Pure bf16 against mixed bf16 on the recipe's Transformer (peak memory, final loss) and against fp32 on digits.

    PYTHONPATH=. python benchmarks/pure_bf16.py transformer --steps 500 --json out.json
    PYTHONPATH=. python benchmarks/pure_bf16.py digits --json out.json

Both precisions start from the same initial weights (the same seed; ``bf16-pure`` casts them to bf16) and see
the same batches. Mixed bf16 trains with torch's AdamW, pure bf16 with ``precisionloop.BF16AdamW``, which rounds
stochastically; the hyperparameters are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from precisionloop import BF16AdamW, Trainer
from precisionloop.measure import peak_mb, reset_memory
from precisionloop.recipes import data, models

MB = 2**20


def optimizer_for(precision: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """precisionloop's stochastic-rounding AdamW for ``bf16-pure``; torch's AdamW for the others."""
    adamw = BF16AdamW if precision == "bf16-pure" else torch.optim.AdamW
    return adamw(params, lr=lr, weight_decay=weight_decay)


def transformer_run(precision: str, args: argparse.Namespace, device: torch.device) -> dict:
    """``args.steps`` steps over noisy-bigram batches, a new one each step; the losses, the peak and the breakdown."""
    reset_memory(device)
    torch.manual_seed(args.seed)
    model = models.TransformerStack(**args.sizes)
    trainer = Trainer(model, optimizer_for(precision, model.parameters(), args.lr, 0.01), precision, device=device,
                      loss_fn=models.lm_loss, distributed=None)
    # A task the model cannot memorise (each next token follows a fixed permutation half the time): the loss
    # settles at the noise's entropy, so the two final losses compare learning, not memorising.
    batches = models.noisy_bigrams(args.steps, args.batch, args.sizes["seq_len"], args.sizes["vocab"], seed=args.seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warm, results = min(50, args.steps // 2), []  # the steady state starts after BF16AdamW's compile
    began = time.perf_counter()
    for i, batch in enumerate(batches):
        if i == warm:
            sync()
            steady_from = time.perf_counter()
        results.append(trainer.step(batch))
    sync()
    seconds, steady_ms = time.perf_counter() - began, 1000 * (time.perf_counter() - steady_from) / (args.steps - warm)
    losses = [float(r.loss) for r in results]
    tail = losses[-args.tail:]
    return {"precision": precision, "final_loss": sum(tail) / len(tail), "first_loss": losses[0],
            "skipped": trainer.stats.skipped, "peak_mb": peak_mb(device) if device.type == "cuda" else None, "seconds": seconds,
            "steady_step_ms": steady_ms,
            "breakdown_mb": trainer.memory_breakdown().to_dict(), "losses": losses}


def digits_split(seed: int, test_fraction: float = 1 / 6) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits (the recipe's 28x28 version), split once by a seeded permutation."""
    digits = data.sklearn_digits()
    if digits is None:
        raise SystemExit("the digits benchmark needs scikit-learn")
    x, y = digits.tensors
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(len(y) * (1 - test_fraction))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def digits_run(precision: str, args: argparse.Namespace, device: torch.device) -> dict:
    """A small MLP trained ``args.epochs`` epochs on digits; its test accuracy in percent."""
    train, test = digits_split(args.seed)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    trainer = Trainer(model, optimizer_for(precision, model.parameters(), args.lr, 0.01), precision, device=device,
                      distributed=None)
    loader = DataLoader(train, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    history = trainer.fit(loader, epochs=args.epochs, progress=False)
    x, y = (t.to(device) for t in test.tensors)
    model.eval()
    with torch.no_grad(), trainer.autocast():
        correct = (model(x).argmax(dim=1) == y).sum().item()
    return {"precision": precision, "accuracy": 100.0 * correct / len(y), "test_size": len(y),
            "train_loss": history[-1]["train_loss"], "skipped": sum(h["skipped"] for h in history)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=("transformer", "digits"))
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--steps", type=int, default=500, help="transformer: optimizer steps per precision")
    p.add_argument("--batch", type=int, default=None, help="default 4 (transformer) or 64 (digits)")
    p.add_argument("--tail", type=int, default=20, help="transformer: the final loss is the mean of this many last steps")
    p.add_argument("--epochs", type=int, default=30, help="digits: epochs per precision")
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (transformer) or 1e-3 (digits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="transformer: the recipe's tiny sizes (the CPU's default)")
    p.add_argument("--json", metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.which == "transformer":
        args.sizes = dict(models.TINY if args.tiny or device.type != "cuda" else models.REFERENCE)
        args.batch, args.lr = args.batch or 4, args.lr or 3e-4
        runs = []
        for precision in ("bf16", "bf16-pure"):
            r = transformer_run(precision, args, device)
            runs.append(r)
            print(f"{r['precision']:>9}: final loss (mean of the last {args.tail}) {r['final_loss']:.4f} from "
                  f"{r['first_loss']:.4f}, peak {r['peak_mb'] or float('nan'):.0f} MB, {r['skipped']} skipped, "
                  f"{r['seconds']:.1f} s, steady step {r['steady_step_ms']:.2f} ms; parts MB: "
                  f"{json.dumps({k: round(v, 1) for k, v in r['breakdown_mb'].items() if v is not None})}", flush=True)
        mixed, pure = runs
        summary = {"sizes": args.sizes, "batch": args.batch, "steps": args.steps,
                   "loss_change_pct": 100 * (pure["final_loss"] / mixed["final_loss"] - 1),
                   "steady_step_ratio": pure["steady_step_ms"] / mixed["steady_step_ms"]}
        if mixed["peak_mb"]:
            summary["peak_saving_pct"] = 100 * (1 - pure["peak_mb"] / mixed["peak_mb"])
    else:
        args.batch, args.lr = args.batch or 64, args.lr or 1e-3
        runs = []
        for precision in ("fp32", "bf16-pure"):
            r = digits_run(precision, args, device)
            runs.append(r)
            print(f"{r['precision']:>9}: test accuracy {r['accuracy']:.2f}% of {r['test_size']}, "
                  f"last epoch's loss {r['train_loss']:.4f}, {r['skipped']} skipped", flush=True)
        summary = {"accuracy_change_points": runs[1]["accuracy"] - runs[0]["accuracy"], "epochs": args.epochs}
    print("summary:", json.dumps({k: round(v, 2) if isinstance(v, float) and math.isfinite(v) else v
                                  for k, v in summary.items()}))
    out = {"which": args.which, "device": str(device), "torch": torch.__version__, "summary": summary, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
