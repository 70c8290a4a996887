"""``fit`` over a real DataLoader, beside the resident step and a hand loop over it.

    PYTHONPATH=. python benchmarks/loader_bench.py --precisions bf16 --batch-sizes 128 --json loader.json

The images are synthetic and in memory (``--images``, 224x224 on CUDA), each batch gathered from them at once
by the DataLoader's workers (``--workers``), as float32 or as uint8 normalised on the device (a Trainer whose
``forward_batch`` normalises), with pinned memory or without. For each precision and batch size, and each of
these loaders, the systems are (compiled for all with ``--compile``); every other flag is the recipe's
(``python -m precisionloop.recipes.resnet18_bench --help``):

- ``loader alone``: the DataLoader iterated, nothing sent to the device;
- ``resident step``: ``Trainer.step`` on one batch already on the device (no data moves);
- ``hand loop``: a torch.amp loop written out by hand over the loader;
- ``fit``: ``Trainer.fit`` over the loader.

Each system is built once per loader, runs one untimed epoch, then one timed epoch per round, the systems'
order rotated by the round. The report gives ms per step (median [min-max] over rounds), images per second,
and for ``fit`` and the hand loop the share of the epoch spent waiting for the loader (``data_fraction``): so a
user sees whether a change of precision can matter for their input pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from precisionloop import Trainer
from precisionloop.measure import format_time
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.recipes.timing import format_ratio, paired_ratio

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, on the 0-1 scale
IMAGE_DTYPES = {"float32": torch.float32, "uint8": torch.uint8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This benchmark's flags, and the recipe's for the rest."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Every other flag is the recipe's.")
    p.add_argument("--images", type=int, default=None,
                   help="synthetic images held in memory (default 2048 on CUDA, 4 batches of the largest on the CPU)")
    p.add_argument("--workers", type=int, default=min(6, os.cpu_count() or 1), help="DataLoader workers")
    p.add_argument("--pin-memory", choices=("both", "on", "off"), default=None,
                   help="DataLoader pin_memory: both (the CUDA default), on, or off (the CPU's only choice)")
    p.add_argument("--image-dtypes", default="float32,uint8",
                   help="float32 (normalised on the host) and/or uint8 (normalised on the device); default both")
    own, rest = p.parse_known_args(argv)
    args = bench.parse_args(rest)
    if args.model == bench.TRANSFORMER or args.distributed or args.autotune:
        p.error("the loader benchmark times a torchvision model on one process, without autotune")
    cuda = args.device.type == "cuda"
    args.images = own.images or (2048 if cuda else 4 * max(args.batch_sizes))
    args.workers, pin = own.workers, own.pin_memory or ("both" if cuda else "off")
    if pin != "off" and not cuda:
        p.error(f"--pin-memory {pin}: pinned memory is for copies to CUDA; on {args.device} use off")
    args.pin_memory = {"both": [True, False], "on": [True], "off": [False]}[pin]
    args.image_dtypes = [s.strip() for s in own.image_dtypes.split(",") if s.strip()]
    if args.images < max(args.batch_sizes) or args.workers < 0 or not set(args.image_dtypes) <= set(IMAGE_DTYPES):
        p.error("need --images of at least one batch, --workers >= 0, --image-dtypes among float32 and uint8")
    return args


def normalizer(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 images to normalised float32 ones, ImageNet's mean and std held on ``device``."""
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (MEAN, STD))
    return lambda images: images.float().div_(255).sub_(mean).div_(std)


class NormalizingTrainer(Trainer):
    """A Trainer over uint8 images, normalised on the device."""

    def forward_batch(self, batch):
        inputs, targets = batch
        if not hasattr(self, "normalize"):
            self.normalize = normalizer(self.device)
        x = self.normalize(inputs)
        if x.is_cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.model(x), targets


class InMemoryImages(Dataset):
    """Images and labels in memory; indexed by a list of indices (a ``BatchSampler``), it gathers a batch at once."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, indices):
        return self.images[indices], self.labels[indices]


def synthetic_images(n: int, size: int, dtype: torch.dtype, classes: int = 1000) -> InMemoryImages:
    """Random uint8 images, or the same normalised to float32 on the host as a torchvision pipeline would."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    if dtype == torch.float32:
        images = normalizer(torch.device("cpu"))(images)
    return InMemoryImages(images, torch.randint(0, classes, (n,), generator=g))


def make_loader(data: InMemoryImages, batch_size: int, workers: int, pin_memory: bool) -> DataLoader:
    """A shuffling DataLoader of full batches; its workers live across epochs, so an epoch does not start them."""
    sampler = BatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(1)), batch_size, drop_last=True)
    return DataLoader(data, sampler=sampler, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                      persistent_workers=workers > 0)


@dataclasses.dataclass(frozen=True)
class Timed:
    """What a system that times its own epoch returns: a peer's ``fit``, whose setup per call is no part of an epoch."""

    seconds: float
    data_fraction: float | None = None


@dataclasses.dataclass
class Row:
    """One system over one loader: per-round ms per step, and the share of each round spent waiting for input."""

    precision: str
    batch_size: int
    images: str
    pin_memory: bool
    system: str
    steps: int
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    data_fractions: list[float] = dataclasses.field(default_factory=list)
    noisy: bool = False

    @property
    def median_ms(self) -> float:
        return statistics.median(self.rounds_ms)

    @property
    def min_ms(self) -> float:
        return min(self.rounds_ms)

    @property
    def max_ms(self) -> float:
        return max(self.rounds_ms)

    @property
    def img_per_s(self) -> float:
        return 1000 * self.batch_size / self.median_ms

    @property
    def data_fraction(self) -> float | None:
        return statistics.median(self.data_fractions) if self.data_fractions else None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "img_per_s": self.img_per_s, "data_fraction": self.data_fraction}


OURS = ("loader alone", "resident step", "hand loop", "fit")
"""The systems :func:`build_systems` makes; any other in a table is a peer's."""


def _hand_loop(model: nn.Module, optimizer, loader: DataLoader, dtype: torch.dtype, device: torch.device,
               memory_format: torch.memory_format, transform, graphed: bool) -> Callable[[], float]:
    """One epoch of the torch.amp loop a user writes, timing its own wait on the loader; returns that share.

    ``graphed``: the model replays CUDA graphs (compiled ``reduce-overhead``), so each step is marked as a new one.
    """
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def epoch() -> float:
        began, waited, batches = time.perf_counter(), 0.0, iter(loader)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - asked
            if batch is None:
                break
            inputs, targets = (t.to(device, non_blocking=True) for t in batch)
            inputs = (transform(inputs) if transform else inputs).contiguous(memory_format=memory_format)
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = nn.functional.cross_entropy(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return waited / (time.perf_counter() - began)

    return epoch


def build_systems(args, precision: str, batch_size: int, data: InMemoryImages, loader: DataLoader) -> dict:
    """Each system's epoch: a function that runs it and returns the share spent waiting for input (or None)."""
    device = args.device
    policy = bench.policy_for(precision, args)
    uint8 = data.images.dtype == torch.uint8
    transform = normalizer(device) if uint8 else None
    steps = len(loader)

    def trainer() -> Trainer:
        model = bench.make_model(args)
        return (NormalizingTrainer if uint8 else Trainer)(
            model, bench.make_optimizer(model.parameters(), args.fused, args.optimizer), policy, device=device,
            compile=bench.compile_for(policy, args, device))

    def loader_alone() -> None:
        for _ in loader:
            pass

    resident = trainer()
    batch = resident.to_device(data[list(range(batch_size))])

    def resident_step() -> None:
        for _ in range(steps):
            resident.step(batch)

    hand = trainer()  # the hand loop runs on the Trainer's prepared model (its layout) with its own optimizer
    hand_epoch = _hand_loop(hand.model, bench.make_optimizer(hand.model.parameters(), args.fused, args.optimizer),
                            loader, policy.compute_dtype, device, policy.memory_format(hand.model), transform,
                            graphed=bench.graphed(policy, args, device))
    systems = {"loader alone": loader_alone, "resident step": resident_step, "hand loop": hand_epoch}
    fitted = trainer()
    systems["fit"] = lambda: fitted.fit(loader, epochs=fitted.epoch + 1, progress=False)[-1]["data_fraction"]
    contexts = {"hand loop": policy.backend_flags}  # the Trainer sets the policy's flags itself; the loader needs none
    return {name: (run, contexts.get(name, contextlib.nullcontext)) for name, run in systems.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_loader(args, precision: str, batch_size: int, data: InMemoryImages, pin_memory: bool,
                   peers: Callable | None = None) -> list[Row]:
    """Every system over one loader: an untimed epoch each, then ``args.rounds`` rounds of one timed epoch each.

    ``peers(args, precision, loader)``, where given, adds systems (name: (epoch, context)) over the same loader.
    """
    loader = make_loader(data, batch_size, args.workers, pin_memory)
    systems = build_systems(args, precision, batch_size, data, loader)
    systems.update(peers(args, precision, loader) if peers else {})
    images = "uint8" if data.images.dtype == torch.uint8 else "float32"
    rows = {name: Row(precision, batch_size, images, pin_memory, name, len(loader)) for name in systems}
    order = list(systems)
    for r in range(args.rounds + 1):  # round 0 warms every system up (cuDNN's choice, the workers, the caches)
        for name in order[r % len(order):] + order[:r % len(order)]:
            run, context = systems[name]
            sync(args.device)
            began = time.perf_counter()
            with context():
                fraction = run()
            sync(args.device)
            seconds = time.perf_counter() - began
            if isinstance(fraction, Timed):
                seconds, fraction = fraction.seconds, fraction.data_fraction
            if r:
                rows[name].rounds_ms.append(1000 * seconds / len(loader))
                if fraction is not None:
                    rows[name].data_fractions.append(fraction)
    del systems, loader
    gc.collect()  # the loader's workers end here, and the Trainers (held in cycles) free the device's memory
    return list(rows.values())


def format_rows(rows: list[Row]) -> str:
    """A table per precision and batch size: a row per loader and system; then fit against its bounds and the feed."""
    lines = []
    for precision, batch_size in dict.fromkeys((r.precision, r.batch_size) for r in rows):
        block = [r for r in rows if (r.precision, r.batch_size) == (precision, batch_size)]
        width = max(len(r.system) for r in block)
        lines += [f"\n{precision}, batch {batch_size} ({block[0].steps} steps an epoch), median [min-max] over rounds:",
                  f"{'images':>7}  {'memory':>8}  {'system':<{width}} | {'ms/step':>24} | {'img/s':>7} | waiting for input"]
        for r in block:
            data = f"{r.data_fraction:.0%}" if r.data_fraction is not None else ""
            lines.append(f"{r.images:>7}  {'pinned' if r.pin_memory else 'unpinned':>8}  {r.system:<{width}} | "
                         f"{format_time(r):>24} | {r.img_per_s:>7.0f} | {data}")
        lines += _versus(block)
    return "\n".join(lines)


def _versus(block: list[Row]) -> list[str]:
    """fit over the hand loop, over its bound (the slower of the loader alone and the resident step), and the feed."""
    lines = []
    for images, pin in dict.fromkeys((r.images, r.pin_memory) for r in block):
        got = {r.system: r for r in block if (r.images, r.pin_memory) == (images, pin)}
        fit, hand = got["fit"], got["hand loop"]
        bound = max(got["loader alone"], got["resident step"], key=lambda r: r.median_ms)
        parts = [f"fit / hand loop {format_ratio(paired_ratio(fit, hand))}",
                 f"fit / {bound.system} (the slower bound) {format_ratio(paired_ratio(fit, bound))}"]
        parts += [f"fit / {name} {format_ratio(paired_ratio(fit, row))}" for name, row in got.items() if name not in OURS]
        lines.append(f"  {images} {'pinned' if pin else 'unpinned'}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    """Run the benchmark with ``argv`` (``sys.argv`` by default)."""
    return run(parse_args(argv))


def run(args: argparse.Namespace, peers: Callable | None = None) -> list[Row]:
    """Run the benchmark with parsed ``args``; ``peers``: see :func:`measure_loader`."""

    env = bench.environment(args.device)
    print(f"precisionloop benchmark: {args.model} over a DataLoader, {env['date']}\n"
          f"device: {env['device_name']} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']}\n"
          f"{args.images} synthetic images {args.image_size}x{args.image_size} in memory, {args.workers} workers, "
          f"{'fused ' if args.fused else ''}{bench.OPTIMIZERS[args.optimizer]}, {_steps_kind(args)}; {args.rounds} "
          "round(s) of one timed epoch per system after an untimed one, the systems' order rotated each round")
    rows: list[Row] = []
    quiet = logging.getLogger("precisionloop.loop")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # fit's warning about the wait for input: the table gives the share itself
    try:
        for name in args.image_dtypes:
            data = synthetic_images(args.images, args.image_size, IMAGE_DTYPES[name])
            for precision in args.precisions:
                for batch_size in args.batch_sizes:
                    for pin in args.pin_memory:
                        measured = measure_loader(args, precision, batch_size, data, pin, peers)
                        rows += measured
                        print(format_rows(measured), flush=True)  # each loader as it is done, the file too
                        _write(args.json, env, args, rows)
            del data
    finally:
        quiet.setLevel(level)
    if args.json:
        print(f"results written to {args.json}")
    return rows


def _steps_kind(args: argparse.Namespace) -> str:
    if not args.compile:
        return "eager steps"
    mode = args.compile if isinstance(args.compile, str) else "the Trainer's mode"
    return f"steps compiled ({mode}) for every system"


def _write(path: str | None, env: dict, args: argparse.Namespace, rows: list[Row]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                       "loader": [r.to_dict() for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
