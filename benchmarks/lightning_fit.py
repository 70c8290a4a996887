"""precisionloop's ``fit`` beside Lightning's ``Trainer.fit`` over the same DataLoader, in one process.

    PYTHONPATH=. python benchmarks/lightning_fit.py --precisions bf16 --batch-sizes 128 --image-dtypes uint8 --json lightning-fit.json

Every flag is ``resnet18_bench --loader``'s (``--images``, ``--workers``, ``--pin-memory``, ``--image-dtypes``,
``--compile``, ...). Beside that mode's systems (the loader alone, the resident step, a hand loop, ``fit`` with and
without the device feed) it times Lightning's ``Trainer.fit`` on the same loader in the same rounds, twice: at its
default layout (NCHW) and with the model and inputs in channels_last, as an expert user writes it; with ``--compile``
its model is compiled in the same mode as precisionloop's. Lightning runs at
``bf16-mixed``, ``16-mixed`` or ``32-true`` with the backend flags of precisionloop's policy (TF32 but for fp32,
cudnn.benchmark), with the same model, fused SGD and on-device normalisation of uint8 images (in
``on_after_batch_transfer``). Lightning gets the same DataLoader wrapped as a plain iterable (:class:`Batches`),
so that it does not shut the persistent workers down after each ``fit`` call. Each round builds a new ``lightning.Trainer`` for one epoch over the same
``LightningModule``; the epoch is timed from ``on_train_epoch_start`` to ``on_train_epoch_end`` (the device
synchronised at both), so Lightning's setup per ``fit`` call is not counted. ``fit``'s epoch is timed around the
whole call, its setup included.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import warnings

import torch
from torch import nn

from precisionloop import normalize_uint8
from precisionloop.prepare import compile_mode
from precisionloop.recipes import loader_bench
from precisionloop.recipes import resnet18_bench as bench

LIGHTNING = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning_systems(args, precision: str, loader) -> dict:
    """Lightning's ``Trainer.fit`` over ``loader``, NCHW and channels_last: name -> (epoch, backend-flags context)."""
    import lightning as L

    class EpochTimer(L.Callback):
        seconds = float("nan")

        def on_train_epoch_start(self, trainer, module):
            loader_bench._sync(args.device)
            self.began = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            loader_bench._sync(args.device)
            self.seconds = time.perf_counter() - self.began

    policy = bench.policy_for(precision, args)
    mode = compile_mode(bench.compile_for(policy, args, args.device), args.device)

    class Classifier(L.LightningModule):
        def __init__(self, channels_last: bool, transform):
            super().__init__()
            self.model, self.transform = bench.make_model(args), transform
            self.layout = torch.channels_last if channels_last else torch.contiguous_format
            self.model.to(memory_format=self.layout)
            if mode is not None:
                self.model.compile(mode=mode)

        def on_train_batch_start(self, batch, batch_idx):
            if mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs: each step is a new one
                torch.compiler.cudagraph_mark_step_begin()

        def on_after_batch_transfer(self, batch, dataloader_idx):
            inputs, targets = batch
            inputs = self.transform(inputs) if self.transform else inputs
            return inputs.contiguous(memory_format=self.layout), targets

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.cross_entropy(self.model(inputs), targets)

        def configure_optimizers(self):
            return bench.make_optimizer(self.parameters(), args.fused, args.optimizer)

    uint8 = loader.dataset.images.dtype == torch.uint8
    transform = normalize_uint8(loader_bench.MEAN, loader_bench.STD) if uint8 else None
    tf32 = precision != "fp32"  # as precisionloop's policies: strict fp32, TF32 for the others

    def system(channels_last: bool):
        module, timer = Classifier(channels_last, transform), EpochTimer()

        def epoch() -> loader_bench.Timed:
            trainer = L.Trainer(accelerator=args.device.type, devices=1, precision=LIGHTNING[precision], max_epochs=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
            trainer.fit(module, Batches(loader))
            return loader_bench.Timed(timer.seconds)

        return epoch, functools.partial(lightning_flags, tf32)

    return {"Lightning fit": system(False), "Lightning fit, channels_last": system(True)}


class Batches:
    """The DataLoader as a plain iterable, for Lightning.

    At the end of each ``fit`` call Lightning shuts a DataLoader's persistent workers down, which a run of one call
    over many epochs pays once; here the next system's epoch, or Lightning's own, would pay it each round. Handed
    this, Lightning leaves the workers to the DataLoader, as ``fit`` and the hand loop do.
    """

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


@contextlib.contextmanager
def lightning_flags(tf32: bool):
    """TF32 and cudnn.benchmark as precisionloop's policies set them, through the API Lightning reads.

    Lightning asks ``torch.get_float32_matmul_precision()``, which raises under the per-backend settings that
    precisionloop's policies use; so for Lightning the same flags are set the older way, and restored after.
    """
    cudnn = torch.backends.cudnn
    saved = torch.get_float32_matmul_precision(), cudnn.benchmark, cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    cudnn.benchmark, cudnn.allow_tf32 = True, tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        cudnn.benchmark, cudnn.allow_tf32 = saved[1], saved[2]


def main(argv: list[str] | None = None) -> list[loader_bench.Row]:
    args = bench.parse_args(["--loader", *(sys.argv[1:] if argv is None else argv)])
    if any(p not in LIGHTNING for p in args.precisions):
        raise SystemExit(f"--precisions: Lightning runs {', '.join(LIGHTNING)}, got {','.join(args.precisions)}")
    try:
        import lightning  # noqa: F401
    except ImportError:
        raise SystemExit("Lightning is not installed: pip install lightning") from None
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its banner per Trainer ("GPU available", ...)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # its advice on workers, per fit
        return loader_bench.main(args, peers=lightning_systems)


if __name__ == "__main__":
    main()
