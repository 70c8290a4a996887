"""Train a small image classifier: an ordinary script where --precision (and --keep-fp32) are the only precision lines.

    python recipes/train_classifier.py                        # offline, on data it makes itself
    python recipes/train_classifier.py --precision bf16 --keep-fp32 BatchNorm2d,head   # norms and head in fp32
    python recipes/train_classifier.py --dataset FashionMNIST --data-dir ~/data --download
    python recipes/train_classifier.py --checkpoint-dir ckpt --max-steps 50   # stop early ...
    python recipes/train_classifier.py --checkpoint-dir ckpt --resume ckpt/last.pt   # ... and resume exactly
    torchrun --nproc_per_node=2 recipes/train_classifier.py   # the same script, data-parallel (DDP)

Copy it and change what you like.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, random_split
from torchmetrics.classification import MulticlassAccuracy

from precisionloop import Checkpoints, Trainer, get_policy
from precisionloop.recipes.data import TORCHVISION_DATASETS, image_dataset


def _keep_fp32(text: str) -> tuple:
    """--keep-fp32 "LayerNorm, head": a torch.nn class by its name, else a module-name pattern."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return tuple(getattr(torch.nn, n) if isinstance(getattr(torch.nn, n, None), type) else n for n in names)


def small_cnn(classes: int = 10) -> nn.Module:
    features = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    # Named parts, so that --keep-fp32 can name them: "head" is the classifier.
    return nn.Sequential(OrderedDict(features=features, dropout=nn.Dropout(0.2), head=nn.Linear(64 * 7 * 7, classes)))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="auto", help="fp32, tf32, bf16, fp16 or auto (default)")
    p.add_argument("--keep-fp32", default=None, metavar="NAMES",
                   help="comma-separated modules to run in fp32 under bf16/fp16: torch.nn classes "
                        "(BatchNorm2d, LayerNorm, ...) or module-name patterns (head, features.*)")
    p.add_argument("--dataset", default="FashionMNIST", choices=TORCHVISION_DATASETS)
    p.add_argument("--data-dir", default=None, help="where the torchvision dataset lives; without it, synthetic data")
    p.add_argument("--download", action="store_true", help="download the dataset into --data-dir")
    p.add_argument("--synthetic-size", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--checkpoint-dir", default=None,
                   help="where a checkpoint is saved every 100 steps (the newest 3 kept) and the last state as last.pt")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    data, source = image_dataset(args.dataset, args.data_dir, args.download, synthetic_size=args.synthetic_size)
    n_val = max(1, len(data) // 10)
    train_set, val_set = random_split(data, [len(data) - n_val, n_val], generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256)

    model = small_cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    precision = args.precision
    if args.keep_fp32:
        precision = dataclasses.replace(get_policy(args.precision, args.device), keep_fp32=_keep_fp32(args.keep_fp32))
    trainer = Trainer(model, optimizer, precision=precision, device=args.device)
    say = print if trainer.is_main else (lambda *a: None)  # under torchrun, rank 0 speaks for all
    say(f"data: {source}")
    kept = ", ".join(e if isinstance(e, str) else e.__name__ for e in trainer.policy.keep_fp32)
    say(f"training with {trainer.policy.name} on {trainer.device}" + (f", keeping {kept} in fp32" if kept else "")
        + (f", {trainer.distributed} over {torch.distributed.get_world_size()} processes" if trainer.distributed else ""))
    if args.resume:
        trainer.load(args.resume)
        say(f"resumed from {args.resume} at epoch {trainer.epoch}, step {trainer.global_step}")

    history = trainer.fit(
        train_loader, epochs=args.epochs, val_loader=val_loader,
        metrics={"accuracy": MulticlassAccuracy(num_classes=10, average="micro")},
        max_steps=args.max_steps, progress=not args.no_progress,
        checkpoints=Checkpoints(args.checkpoint_dir, every=100, keep_last=3) if args.checkpoint_dir else None,
    )
    for record in history:
        metrics = f", val loss {record['val_loss']:.4f}, accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""
        say(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}, {record['steps']} steps "
              f"({record['skipped']} skipped), {record['samples_per_s']:.0f} samples/s{metrics}")
    if args.checkpoint_dir:
        path = trainer.save(Path(args.checkpoint_dir) / "last.pt")
        say(f"checkpoint: {path}")
    return history


if __name__ == "__main__":
    main()
