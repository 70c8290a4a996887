"""precisionloop's ``fit`` beside Lightning's ``Trainer.fit`` over the same DataLoader, in one process.

    PYTHONPATH=. python benchmarks/lightning_fit.py --precisions bf16 --batch-sizes 128 --image-dtypes uint8 --json lightning-fit.json

Every flag is ``loader_bench.py``'s (``--images``, ``--workers``, ``--pin-memory``, ``--image-dtypes``,
``--compile``, ...). Beside its systems (the loader alone, the resident step, a hand loop, ``fit``) it times Lightning's ``Trainer.fit`` on the same loader in the same rounds, twice: at its
default layout (NCHW) and with the model and inputs in channels_last, as an expert user writes it; with
``--compile`` its model is compiled in precisionloop's mode. Lightning runs at ``bf16-mixed``, ``16-mixed`` or
``32-true`` with the TF32 and cudnn.benchmark settings of precisionloop's policy, the same model and fused SGD, and
uint8 images normalised on the device (in ``on_after_batch_transfer``).

Each round calls ``fit`` on a new ``lightning.Trainer`` for one epoch of the same ``LightningModule``, timed from
``on_train_epoch_start`` to ``on_train_epoch_end`` with the device synchronised at both, so that its setup per
call is left out (its epoch's iterator is made just before); ``fit``'s epoch is timed around the whole call.
Lightning gets the DataLoader as a plain iterable (:class:`Batches`): it would shut the persistent workers down
after each call. Its own teardown still moves the model to the CPU and empties the CUDA cache after each call, so
its first steps each round, and the next system's, allocate afresh, and compiled ones record their CUDA graphs
again: against Lightning under ``--compile``.
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

import loader_bench  # the sibling script
from precisionloop.recipes import resnet18_bench as bench

LIGHTNING = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning_systems(args, precision: str, loader) -> dict:
    """Lightning's ``Trainer.fit`` over ``loader``, NCHW and channels_last: name -> (epoch, backend-flags context)."""
    import lightning as L

    policy = bench.policy_for(precision, args)
    compile = bench.compile_for(policy, args, args.device)  # the Trainer's choice for True: CUDA graphs on CUDA
    mode = ("reduce-overhead" if args.device.type == "cuda" else "default") if compile is True else compile or None
    uint8 = loader.dataset.images.dtype == torch.uint8
    transform = loader_bench.normalizer(args.device) if uint8 else None
    tf32 = getattr(policy, "tf32", True)
    benchmark = tf32 if policy.cudnn_benchmark is None else policy.cudnn_benchmark
    classifier, clock = _lightning_classes(args, mode)

    def system(channels_last: bool):
        module, timer = classifier(channels_last, transform), clock()

        def epoch() -> loader_bench.Timed:
            trainer = L.Trainer(accelerator=args.device.type, devices=1, precision=LIGHTNING[precision], max_epochs=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
            trainer.fit(module, Batches(loader))
            return loader_bench.Timed(timer.seconds)

        return epoch, functools.partial(lightning_flags, tf32, benchmark)

    return {"Lightning fit": system(False), "Lightning fit, channels_last": system(True)}


def _lightning_classes(args, mode: str | None) -> tuple[type, type]:
    """The LightningModule and the epoch clock, made here: Lightning is imported only when the benchmark runs."""
    import lightning as L

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

    class Clock(L.Callback):
        """The epoch from ``on_train_epoch_start`` to ``on_train_epoch_end``, the device synchronised at both."""

        seconds = float("nan")

        def on_train_epoch_start(self, trainer, module):
            loader_bench.sync(args.device)
            self.began = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            loader_bench.sync(args.device)
            self.seconds = time.perf_counter() - self.began

    return Classifier, Clock


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
def lightning_flags(tf32: bool | None, benchmark: bool | None):
    """TF32 and cudnn.benchmark as precisionloop's policy sets them (None: as they are), through the API Lightning
    reads.

    Lightning asks ``torch.get_float32_matmul_precision()``, which raises once the per-backend ``fp32_precision``
    settings (precisionloop's policies use them) have been set; so for Lightning the same flags are set the older
    way, and every setting read here, per backend where torch has them, is put back after.
    """
    saved = [(owner, name, getattr(owner, name)) for owner, name in _flag_settings()]
    if tf32 is not None:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _flag_settings() -> list[tuple[object, str]]:
    """The TF32 and cudnn.benchmark settings to restore: the per-backend ones (the generic first), else the legacy."""
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision"):
        owners = (b, b.cuda.matmul, b.mkldnn, getattr(b.mkldnn, "matmul", None), b.cudnn, b.cudnn.conv, b.cudnn.rnn)
        found = [(o, "fp32_precision") for o in owners if o is not None and hasattr(o, "fp32_precision")]
    else:
        found = [(b.cuda.matmul, "allow_tf32"), (b.cudnn, "allow_tf32")]
    return found + [(b.cudnn, "benchmark")]


def main(argv: list[str] | None = None) -> list[loader_bench.Row]:
    """Run the benchmark with ``loader_bench.py``'s flags (``sys.argv`` by default); returns its rows."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nThe flags below are loader_bench.py's.\n")
    args = loader_bench.parse_args(argv)
    if any(p not in LIGHTNING for p in args.precisions):
        raise SystemExit(f"--precisions: Lightning runs {', '.join(LIGHTNING)}, got {','.join(args.precisions)}")
    if args.device.type == "cpu" and "fp16" in args.precisions:  # it would train bf16 and call it fp16
        raise SystemExit("--precisions fp16: on the CPU Lightning trains 16-mixed as bf16-mixed; leave fp16 out there")
    try:
        import lightning  # noqa: F401
    except ImportError:
        raise SystemExit("Lightning is not installed: pip install lightning") from None
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its banner per Trainer ("GPU available", ...)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # its advice on workers, per fit
        return loader_bench.run(args, peers=lightning_systems)


if __name__ == "__main__":
    main()
