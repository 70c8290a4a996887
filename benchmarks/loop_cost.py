"""What precisionloop's step and loop cost beyond a hand-written loop, in interleaved rounds.

    PYTHONPATH=. python benchmarks/loop_cost.py --json loop_cost.json
    PYTHONPATH=. python benchmarks/loop_cost.py --before path/to/old/precisionloop   # also an older copy, same process
    PYTHONPATH=. python benchmarks/loop_cost.py --profile                            # where the host time goes

For each configuration the hand loop (autocast, backward, optimizer step, no skip check),
``Trainer.step`` and ``Trainer.fit`` (epochs of --fit-steps batches, progress bar on; per-step
time = epoch time / steps) train the same model on the same device-resident batch, timed by
``timing.interleaved``: eager steps alternating step by step or in --blocks blocks, compiled steps on CUDA
back to back (pipelined), fit epoch by epoch. The cost is the per-round ratio to the hand loop, paired in time.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import dataclasses
import importlib.util
import io
import json
import pstats
import sys
from pathlib import Path

import torch
from torch import nn

import precisionloop
from precisionloop.measure import format_time
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.recipes.timing import Run, choose_method, format_ratio, interleaved, paired_ratio

OPTIMIZERS = {
    "fused-sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


@dataclasses.dataclass(frozen=True)
class Config:
    batch_size: int
    optimizer: str
    compile: bool
    precision: str = "bf16"

    @property
    def label(self) -> str:
        return f"{self.precision} b{self.batch_size} {self.optimizer}{' compiled' if self.compile else ' eager'}"


DEFAULT_CONFIGS = [Config(32, "fused-sgd", False), Config(128, "fused-sgd", False), Config(32, "fused-sgd", True),
                   Config(128, "adamw", False), Config(128, "sgd", False), Config(128, "fused-sgd", True)]


def _hand(config: Config, args) -> Run:
    model = bench.build_model(args.model).to(args.device, memory_format=torch.channels_last)
    if config.compile:
        model.compile(mode="reduce-overhead")
    optimizer = OPTIMIZERS[config.optimizer](model.parameters())
    inputs, targets = bench.random_batch(config.batch_size, args.image_size, args.device)
    inputs = inputs.contiguous(memory_format=torch.channels_last)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.precision]

    def step() -> None:
        if config.compile:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(args.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Run(step, context=precisionloop.get_policy(config.precision).backend_flags)  # fp32: torch's defaults


def _trainer(package, config: Config, args, fit: bool) -> Run:
    """``package.Trainer``'s step or fit epoch."""
    model = bench.build_model(args.model)
    optimizer = OPTIMIZERS[config.optimizer](model.parameters())
    trainer = package.Trainer(model, optimizer, config.precision, device=args.device, compile=config.compile,
                              distributed=None)
    batch = trainer.to_device(bench.random_batch(config.batch_size, args.image_size, args.device))
    if not fit:
        return Run(lambda: trainer.step(batch))
    epoch = [batch] * args.fit_steps

    def run_epoch() -> None:
        trainer.fit(epoch, epochs=trainer.epoch + 1, progress=True)

    return Run(run_epoch)


def _hand_epoch(config: Config, args) -> Run:
    """The hand loop over as many steps as one fit epoch, so the two are timed alike."""
    run = _hand(config, args)

    def epoch() -> None:
        for _ in range(args.fit_steps):
            run.step()

    return Run(epoch, context=run.context)


def systems(config: Config, args, before, fit: bool) -> dict:
    """The hand loop, this package's Trainer and, with --before, the older one's."""
    kind = "fit" if fit else "step"
    out = {"hand": lambda: (_hand_epoch if fit else _hand)(config, args),
           kind: lambda: _trainer(precisionloop, config, args, fit)}
    if before is not None:
        out[f"{kind}-before"] = lambda: _trainer(before, config, args, fit)
    return out


def load_before(path: str):
    """An older copy of the package, imported under another name so both run in one process."""
    init = Path(path) / "__init__.py"
    spec = importlib.util.spec_from_file_location("precisionloop_before", init, submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["precisionloop_before"] = module
    spec.loader.exec_module(module)
    return module


def profile(run: Run, what: str, args, steps: int = 60, warmup: int | None = None,
            filter_name: str | None = None) -> str:
    """cProfile of ``steps`` calls of ``run.step`` after a warm-up: the host's time per function."""
    sync = torch.cuda.synchronize if args.device.type == "cuda" else (lambda: None)
    profiler = cProfile.Profile()
    context = run.context if run.context is not None else contextlib.nullcontext()
    with context() if callable(context) else context:  # the hand loop's backend flags
        for _ in range(args.warmup if warmup is None else warmup):
            run.step()
        sync()
        profiler.enable()
        for _ in range(steps):
            run.step()
        sync()
        profiler.disable()
    if args.profile_dir:  # the raw stats, to compare two profiles function by function
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(Path(args.profile_dir) / (what.split(",")[0].replace(" ", "-") + ".pstats"))
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(14)
    if filter_name:
        stats.sort_stats("cumulative").print_stats(filter_name, 14)  # the package's own functions
    return f"--- cProfile, {what} x{steps} ---\n" + out.getvalue()


def profiles(config: Config, args, before, fit: bool) -> list[str]:
    """The hand loop's profile, then each package's ``Trainer.step``; with ``fit``, this package's fit epochs alone."""
    if fit:
        return [profile(_trainer(precisionloop, config, args, True), f"precisionloop Trainer.fit epochs of "
                        f"{args.fit_steps}, {config.label}", args, steps=5, warmup=2, filter_name="precisionloop")]
    out = [profile(_hand(config, args), f"hand loop, {config.label}", args)]
    for package in [before, precisionloop] if before is not None else [precisionloop]:
        out.append(profile(_trainer(package, config, args, False), f"{package.__name__} Trainer.step, {config.label}",
                           args, filter_name=package.__name__))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=None,
                   help="alternating blocks per round (timing.interleaved); default: step by step (fit: epoch by "
                        "epoch), at most --iters (fit: --fit-epochs); 1 runs the systems one after the other")
    p.add_argument("--iters", type=int, default=40, help="timed steps (fit: timed epochs) per round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--fit-steps", type=int, default=100,
                   help="batches per timed fit epoch (each fit call also pays per-epoch work: the progress bar, the "
                        "RNG snapshot, the record; a short epoch spreads it over few steps)")
    p.add_argument("--fit-epochs", type=int, default=3, help="timed fit epochs per round")
    p.add_argument("--configs", default=None, help="comma-separated labels' indices into the default list (0-based)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="train every configuration in this precision (fp32: the hand loop at torch's default flags)")
    p.add_argument("--before", default=None, help="path to an older precisionloop package directory")
    p.add_argument("--no-fit", action="store_true", help="time the step systems only")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the hand loop and Trainer.step (and --before's) for the first configuration")
    p.add_argument("--profile-fit", action="store_true", help="cProfile Trainer.fit epochs for the first configuration")
    p.add_argument("--profile-dir", default=None, help="also write each profile's raw pstats file here")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default=None, help="default: cuda (the cost that matters is on a GPU)")
    args = p.parse_args(argv)
    for flag, value, low in (("--blocks", args.blocks, 1), ("--rounds", args.rounds, 1), ("--iters", args.iters, 1),
                             ("--warmup", args.warmup, 0), ("--fit-steps", args.fit_steps, 1),
                             ("--fit-epochs", args.fit_epochs, 1), ("--image-size", args.image_size, 16)):
        if value is not None and value < low:  # before any timing, so nothing measured is lost
            p.error(f"{flag} must be >= {low}, got {value}")
    bench.check_output(p, "--json", args.json)
    args.device = bench.parse_device(p, args.device)
    indices = [] if args.configs is None else [s.strip() for s in args.configs.split(",")]
    if not all(i.isdigit() and int(i) < len(DEFAULT_CONFIGS) for i in indices):
        p.error(f"--configs takes indices 0-{len(DEFAULT_CONFIGS) - 1} into: "
                + "; ".join(f"{i} {c.label}" for i, c in enumerate(DEFAULT_CONFIGS)))
    configs = DEFAULT_CONFIGS if args.configs is None else [DEFAULT_CONFIGS[int(i)] for i in indices]
    configs = [dataclasses.replace(c, precision=args.precision or c.precision) for c in configs]
    before = load_before(args.before) if args.before else None
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    report = {"torch": torch.__version__, "device": name, "configs": []}
    for i, config in enumerate(configs):
        for fit, wanted in ((False, args.profile), (True, args.profile_fit)):
            if wanted and i == 0:
                print("\n".join(profiles(config, args, before, fit=fit)), flush=True)
        # Compiled steps on CUDA are timed back to back (a step begun on an idle GPU pays its launch in series);
        # eager ones step by step, or in --blocks blocks.
        pipelined = args.blocks is None and choose_method(args.device, config.compile)[0] == "pipelined"
        blocks = 1 if pipelined else min(args.blocks or args.iters, args.iters)
        timings = interleaved(systems(config, args, before, fit=False), rounds=args.rounds, iters=args.iters,
                              warmup=args.warmup, device=args.device, pipelined=pipelined, blocks=blocks)
        method = timings[next(iter(timings))].settings["method"]
        print(f"\n{config.label}: steps timed {method}" + (f" in {blocks} blocks" if blocks > 1 else ""), flush=True)
        fits = {} if args.no_fit else interleaved(systems(config, args, before, fit=True), rounds=args.rounds,
                                                  iters=args.fit_epochs, warmup=2, device=args.device,
                                                  blocks=min(args.blocks or args.fit_epochs, args.fit_epochs))
        for name, m in fits.items():  # per-epoch times to per-step times
            m.rounds_ms = [t / args.fit_steps for t in m.rounds_ms]
            timings["hand (epochs)" if name == "hand" else name] = m
        entry = {"config": dataclasses.asdict(config), "systems": {}}
        for name, m in timings.items():
            base = timings["hand (epochs)"] if name.startswith("fit") else timings["hand"]
            ratio = paired_ratio(m, base) if m.rounds_ms and base.rounds_ms and not name.startswith("hand") else None
            print(f"  {name:<18} {format_time(m):>28}  {format_ratio(ratio) + ' vs hand' if ratio else ''}"
                  f"{'error: ' + m.error.strip().splitlines()[0][:160] if m.error else ''}", flush=True)
            entry["systems"][name] = {**m.to_dict(), "vs_hand": ratio}
        report["configs"].append(entry)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
