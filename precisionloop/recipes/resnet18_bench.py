"""Time training steps of a torchvision model or a Transformer stack under each precision policy, with peak memory.

Run ``python -m precisionloop.recipes.resnet18_bench --help`` for the flags. ``Trainer.step`` is timed beside a
hand-written torch.amp loop with the same settings, in interleaved rounds of fresh instances
(:func:`precisionloop.recipes.timing.interleaved`), by the method that fits what is timed (``--method``): on CUDA
compiled steps back to back, eager steps alternating between the systems step by step; on the CPU one system after
the other. Each figure is the median over rounds [min-max], with its speed-up over tf32
(fp32-strict where there is no TF32).
``--model transformer`` times a Linear-heavy decoder stack (:mod:`precisionloop.recipes.models`) on random tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from typing import Callable

import torch
import torchvision
from torch import nn
from tqdm import tqdm

from precisionloop import FP8Policy, PrecisionPolicy, Trainer, autotune, get_policy
from precisionloop.measure import format_memory, format_time, noisy_legend
from precisionloop.policy import has_tf32
from precisionloop.precisions import default_precisions
from precisionloop.recipes import max_batch, models
from precisionloop.recipes.timing import (METHODS, Measurement, Run, choose_method, format_ratio, interleaved,
                                          paired_ratio)
from precisionloop.tuning import Candidate

__all__ = ["TRANSFORMER", "OPTIMIZERS", "Result", "environment", "check_output", "parse_device", "build_model", "make_model", "make_batch",
           "random_batch", "loss_of", "make_optimizer", "hand_loop_step", "policy_for", "compile_for", "graphed",
           "system_factory", "format_table", "format_wrapper_cost", "parse_args", "main"]

TRANSFORMER = "transformer"
OPTIMIZERS = {"sgd": "SGD momentum 0.9", "adamw": "AdamW"}


@dataclasses.dataclass
class Result(Measurement):
    """One system's measurement at one precision and batch size."""

    precision: str = ""
    batch_size: int = 0
    skipped: int = 0

    system = property(lambda self: self.name)


def environment(device: torch.device) -> dict:
    """What the numbers were measured on."""
    cuda = device.type == "cuda"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)",
            "cuda": torch.version.cuda if cuda else None, "cudnn": torch.backends.cudnn.version() if cuda else None}


def check_output(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse, before anything is measured, an output path that cannot be written."""
    parent = os.path.dirname(os.path.abspath(path or "."))
    if path is not None and (os.path.isdir(path) or not os.access(parent, os.W_OK)):
        p.error(f"{flag} {path!r}: not a file path in a writable folder")


def parse_device(p: argparse.ArgumentParser, text: str | None) -> torch.device:
    """``--device``, or CUDA (this rank's GPU under torchrun) when available, else the CPU."""
    try:
        device = torch.device(text or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        p.error(f"--device {text!r} is not a device; use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {text} was requested but CUDA is not available; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return device


def build_model(name: str) -> nn.Module:
    """A randomly initialised torchvision classification model by name."""
    return torchvision.models.get_model(name, weights=None)


def make_model(args: argparse.Namespace) -> nn.Module:
    """The Transformer stack at ``args.sizes``, or the torchvision model ``args.model``."""
    return models.TransformerStack(**args.sizes) if args.model == TRANSFORMER else build_model(args.model)


def make_batch(args: argparse.Namespace, batch_size: int, device: torch.device):
    """A random ``(inputs, targets)`` batch: token ids for the Transformer, else images."""
    if args.model == TRANSFORMER:
        return models.random_tokens(batch_size, args.sizes["seq_len"], args.sizes["vocab"], device)
    return random_batch(batch_size, args.image_size, device)


def random_batch(batch_size: int, image_size: int, device: torch.device, num_classes: int = 1000):
    g = torch.Generator().manual_seed(batch_size)
    inputs = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    return inputs.to(device), torch.randint(0, num_classes, (batch_size,), generator=g).to(device)


def loss_of(args: argparse.Namespace) -> Callable:
    """Next-token cross entropy for the Transformer, else cross entropy."""
    return models.lm_loss if args.model == TRANSFORMER else nn.functional.cross_entropy


def make_optimizer(params, fused: bool, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (or AdamW), fused or not, the same for every system timed."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, fused=fused)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=fused)


def hand_loop_step(model: nn.Module, batch, policy: PrecisionPolicy, device: torch.device, fused: bool,
                   compiled: bool = False, loss_fn: Callable = nn.functional.cross_entropy,
                   optimizer: str = "sgd") -> Callable[[], None]:
    """The canonical torch.amp step, written out by hand, for the wrapper-cost comparison."""
    opt = make_optimizer(model.parameters(), fused, optimizer)
    dtype = policy.compute_dtype
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    inputs, targets = batch

    def step() -> None:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def policy_for(name: str, args: argparse.Namespace) -> PrecisionPolicy:
    policy = get_policy(name, args.device)
    return policy if args.channels_last is None else dataclasses.replace(policy, channels_last=args.channels_last)


def compile_for(policy: PrecisionPolicy, args, device: torch.device) -> bool | str:
    """--compile; and on CUDA, where fp8 is always compiled (eager, torchao's casts make it slower than bf16), every
    precision of a run that times fp8, so that one table compares compiled with compiled."""
    fp8 = isinstance(policy, FP8Policy) or any(get_policy(p).name == "fp8" for p in getattr(args, "precisions", ()))
    return args.compile or (device.type == "cuda" and fp8)


def graphed(policy: PrecisionPolicy, args, device: torch.device) -> bool:
    """Whether the steps replay CUDA graphs (compiled "reduce-overhead", the CUDA default), marked per step."""
    return device.type == "cuda" and compile_for(policy, args, device) in (True, "reduce-overhead", "max-autotune")


def _trainer(policy: PrecisionPolicy, batch_size: int, args, device: torch.device):
    """A fresh model, optimizer and Trainer as every system builds them, and the batch on its device."""
    model = make_model(args)
    trainer = Trainer(model, make_optimizer(model.parameters(), args.fused, args.optimizer), policy, device=device,
                      compile=compile_for(policy, args, device), distributed=args.distributed, loss_fn=loss_of(args))
    return trainer, trainer.to_device(make_batch(args, batch_size, device))


def system_factory(system: str, policy: PrecisionPolicy, batch_size: int, args, device: torch.device,
                   skipped: list[int]) -> Callable[[], Run]:
    """A factory for :func:`interleaved`: "precisionloop" times ``Trainer.step``, "hand" the hand loop on the
    Trainer's prepared model; each instance's skipped steps are appended to ``skipped``."""
    def build() -> Run:
        trainer, batch = _trainer(policy, batch_size, args, device)
        step = lambda: trainer.step(batch)  # noqa: E731
        if system == "hand":
            step = hand_loop_step(trainer.model, batch, policy, device, args.fused, graphed(policy, args, device),
                                  loss_of(args), args.optimizer)
        return Run(step, context=policy.backend_flags, teardown=lambda: skipped.append(trainer.stats.skipped))

    return build


def _measure_config(precision: str, batch_size: int, args, device: torch.device, systems: list[str],
                   on_run=None) -> list[Result]:
    """Time ``systems`` at one precision and batch size in interleaved rounds."""
    policy = policy_for(precision, args)
    skipped: dict[str, list[int]] = {s: [] for s in systems}
    factories = {s: system_factory(s, policy, batch_size, args, device, skipped[s]) for s in systems}
    method, why = choose_method(device, bool(compile_for(policy, args, device)), args.method)
    measured = interleaved(factories, rounds=args.rounds, iters=args.iters, warmup=args.warmup, device=device,
                           on_run=on_run, pipelined=method == "pipelined",
                           blocks=args.iters if method == "alternating" else 1)
    for m in measured.values():  # the run-wide settings every JSON record carries
        m.settings.update(model=args.model, sizes=args.sizes, image_size=args.image_size, fused=args.fused,
                          compile=args.compile or False, channels_last=args.channels_last, optimizer=args.optimizer,
                          why=why)
    return [Result(**vars(m), precision=precision, batch_size=batch_size, skipped=sum(skipped[s]))
            for s, m in measured.items()]


def format_table(results: list[Result], system: str, precisions: list[str], batch_sizes: list[int],
                 baseline: str) -> str:
    """A row block per batch size, a column per precision: time, peak memory, and the change vs ``baseline``."""
    cell = {(r.batch_size, r.precision): r for r in results if r.system == system}
    width = max([24] + [len(format_time(r)) for r in cell.values()])

    def row(name, texts) -> str:
        return f"{name:>11} | " + " | ".join(f"{t:>{width}}" for t in texts)

    lines = [row("batch", precisions)]
    for bs in batch_sizes:
        rs = [cell.get((bs, p)) for p in precisions]
        lines.append(row(str(bs), ["-" if r is None else "error" if r.error else format_time(r) for r in rs]))
        lines.append(row("peak MB", ["" if r is None or r.error else format_memory(r) for r in rs]))
        if any(r is not None and r.reserved_mb is not None for r in rs):
            lines.append(row("reserved MB", ["" if r is None or r.reserved_mb is None else f"{r.reserved_mb:.0f} MB"
                                              for r in rs]))
        base = cell.get((bs, baseline))
        if base is not None and base.median_ms:
            lines.append(row("vs " + baseline, [_versus(r, base) for r in rs]))
    legend = noisy_legend(cell.values())
    return "\n".join(lines + ([legend] if legend else []))


def _versus(r: Result | None, base: Result) -> str:
    """Speed-up of ``r`` over the baseline and its memory change."""
    if r is None or not r.median_ms:
        return ""
    saved = f", mem {100 * (r.peak_mb / base.peak_mb - 1):+.0f}%" if r.peak_mb and base.peak_mb else ""
    return f"{base.median_ms / r.median_ms:.2f}x{saved}"


def format_wrapper_cost(results: list[Result]) -> str:
    """Trainer.step over the hand loop per configuration, from rounds paired in time."""
    hand = {(r.batch_size, r.precision): r for r in results if r.system == "hand" and r.rounds_ms}
    parts = [f"batch {r.batch_size} {r.precision}: {format_ratio(paired_ratio(r, h))} "
             f"({format_time(r)} vs {format_time(h)})" for r in results
             if r.system == "precisionloop" and (h := hand.get((r.batch_size, r.precision))) is not None
             and len(r.rounds_ms) == len(h.rounds_ms)]
    return ("wrapper cost, Trainer.step / hand-written torch.amp loop, per-round ratios (rounds paired in time), "
            "median [min-max]:\n  " + "\n  ".join(parts)) if parts else ""


def _write_plot(results: list[Result], path: str, title: str) -> None:
    """Bars of the step time (min-max whiskers) and the peak memory per precision and batch size."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot needs matplotlib (`pip install precisionloop[plot]`); no plot written to {path}")
        return
    rows = [r for r in results if r.system == "precisionloop" and r.rounds_ms]
    batch_sizes, precisions = sorted({r.batch_size for r in rows}), list(dict.fromkeys(r.precision for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(precisions), 1)
    for i, p in enumerate(precisions):
        got = [next((r for r in rows if (r.precision, r.batch_size) == (p, b)), None) for b in batch_sizes]
        xs = [j + i * width for j in range(len(batch_sizes))]
        medians = [r.median_ms if r else 0 for r in got]
        spread = [[m - (r.min_ms if r else 0) for m, r in zip(medians, got)],
                  [(r.max_ms if r else 0) - m for m, r in zip(medians, got)]]
        axes[0].bar(xs, medians, width, yerr=spread, capsize=3, label=p)
        axes[1].bar(xs, [(r.peak_mb or 0) if r else 0 for r in got], width, label=p)
    for ax, label in zip(axes, ["step time (ms), median and min-max over rounds", "peak memory (MB)"]):
        ax.set_xticks([j + width * (len(precisions) - 1) / 2 for j in range(len(batch_sizes))],
                      [f"batch {b}" for b in batch_sizes])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _run_autotune(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Let the library choose per batch size among --precisions; its choice is reported as system "autotune"."""
    results = []
    for bs in args.batch_sizes:
        model = make_model(args)
        layouts = [None] if args.model == TRANSFORMER else [True, False]
        candidates = [Candidate(p, layout, args.compile or False) for p in args.precisions for layout in layouts]
        print(f"\nautotune at batch {bs} ({len(candidates)} candidates, {args.warmup} + {args.iters} steps each):")
        try:
            chosen = autotune(model, lambda params: make_optimizer(params, args.fused, args.optimizer),
                              make_batch(args, bs, device), candidates=candidates, device=device, steps=args.iters,
                              warmup=args.warmup, rounds=args.rounds, loss_fn=loss_of(args))
        except RuntimeError as e:
            print(e)
            continue
        print(chosen)
        best = next(r.timing for r in chosen.results if r.candidate == chosen.best)
        results.append(Result(**{**vars(best), "name": "autotune"}, precision=chosen.best.label, batch_size=bs))
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m precisionloop.recipes.resnet18_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--model", default="resnet18",
                   help="a torchvision classification model, or 'transformer' for the stack of recipes.models")
    p.add_argument("--size", choices=tuple(models.SIZES), default=None,
                   help="the transformer's size (default reference on CUDA, tiny on the CPU): " + "; ".join(
                       f"{name}: {models.describe(sizes)}" for name, sizes in models.SIZES.items()))
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 32,128 on CUDA, 8 on the CPU; "
                                                      "for the transformer 8 on CUDA, 4 on the CPU)")
    p.add_argument("--precisions", default=None,
                   help=f"comma-separated among {','.join(default_precisions('cuda'))},fp8 (default: those the device "
                        "runs, fp16 left out on the CPU, where its autocast is ~20x slower); fp8 is always timed "
                        "compiled")
    p.add_argument("--iters", type=int, default=None, help="timed steps per round (default 50 on CUDA, 15 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per round (default 15 on CUDA, 2 on the CPU)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, a fresh model and optimizer each (default 3)")
    p.add_argument("--method", choices=("auto", *METHODS), default="auto",
                   help="how a round times its systems (timing.interleaved); auto: pipelined for compiled steps on "
                        "CUDA, alternating step by step for eager ones, alone on the CPU")
    p.add_argument("--image-size", type=int, default=None, help="input side in pixels (default 224 on CUDA, 112 on the CPU)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="force channels_last on or off (default: the policy's choice)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused optimizer for every system (default: on for CUDA)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="sgd (momentum 0.9, lr 0.01) or adamw (lr 3e-4, weight decay 0.01) for every system")
    p.add_argument("--compile", nargs="?", const=True, default=None, metavar="MODE",
                   help="torch.compile the model for every system; bare --compile lets the Trainer pick the mode")
    p.add_argument("--autotune", action="store_true", help="also let precisionloop.autotune choose per batch size")
    p.add_argument("--distributed", choices=("ddp", "fsdp"), default=None,
                   help="under torchrun, wrap the Trainer's model with DDP or FSDP2 (times are per rank)")
    p.add_argument("--no-hand-loop", action="store_true", help="skip the hand-written loop (no wrapper cost)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart here (needs matplotlib)")
    g = p.add_argument_group("--max-batch", "the largest batch that fits per precision (CUDA only)")
    g.add_argument("--max-batch", action="store_true", help="search for it after the speed tables")
    g.add_argument("--max-batch-start", type=int, default=64, help="the first batch tried (default 64)")
    g.add_argument("--max-batch-cap", type=int, default=4096, help="the largest batch tried (default 4096)")
    g.add_argument("--max-batch-resolution", type=int, default=8, help="bisect to this close (default 8)")
    g.add_argument("--max-batch-seconds", type=float, default=None, help="per precision, no new try after this long")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    args.device = device = parse_device(p, args.device)
    cuda, transformer = device.type == "cuda", args.model == TRANSFORMER
    tf32 = has_tf32(device)
    args.baseline = "tf32" if tf32 else default_precisions(device.type)[0]
    native_bf16 = cuda or get_policy("auto", device).name == "bf16"  # emulated bf16 is ~10x slower than fp32
    given = args.precisions or ",".join(n for n in default_precisions(device.type) if (n != "tf32" or tf32)
                                        and (n != "bf16" or native_bf16))
    args.precisions = list(dict.fromkeys(s.strip() for s in given.split(",") if s.strip()))
    for name in args.precisions:
        try:
            get_policy(name)
        except ValueError as e:
            p.error(f"--precisions: {e}")
        if get_policy(name).name == "tf32" and not tf32:  # it would time fp32 again under another name
            p.error(f"--precisions tf32: TF32 needs a CUDA GPU of compute capability 8.0+, not {device}; use fp32")
    try:
        default_bs = ("8" if cuda else "4") if transformer else ("32,128" if cuda else "8")
        args.batch_sizes = [int(s) for s in (args.batch_sizes or default_bs).split(",") if s.strip()]
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    args.iters = args.iters if args.iters is not None else (50 if cuda else 15)
    args.warmup = args.warmup if args.warmup is not None else (15 if cuda else 2)
    if min(args.batch_sizes, default=0) < 1 or args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--batch-sizes, --iters and --rounds must be >= 1 and --warmup >= 0")
    if args.method == "alternating" and args.warmup < 1:
        p.error("--method alternating needs --warmup >= 1")
    args.fused = cuda and args.distributed != "fsdp" if args.fused is None else args.fused  # FSDP2 has no fused SGD
    args.sizes = dict(models.SIZES[args.size or ("reference" if cuda else "tiny")]) if transformer else None
    args.image_size = None if transformer else args.image_size or (224 if cuda else 112)
    if not transformer and args.model not in torchvision.models.list_models(module=torchvision.models):
        p.error(f"--model {args.model!r} is neither {TRANSFORMER!r} nor a torchvision classification model")
    if args.max_batch and not cuda:
        p.error(f"--max-batch searches for the largest batch that fits in a CUDA GPU's memory; the device is {device}")
    check_output(p, "--json", args.json)
    check_output(p, "--plot", args.plot)
    return args


def _max_batch_report(args: argparse.Namespace, device: torch.device) -> str:
    """For each precision, the largest batch a fresh Trainer takes two steps at."""
    def run(precision: str) -> Callable[[int], float]:
        def two_steps(batch_size: int) -> float:
            trainer, batch = _trainer(policy_for(precision, args), batch_size, args, device)
            trainer.step(batch)
            trainer.step(batch)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) / 2**20
        return two_steps

    found: dict[str, max_batch.SearchResult | str] = {}
    for precision in args.precisions:
        try:
            fits = max_batch.recovering(run(precision), max_batch.Allocator.cuda(device))
            found[precision] = max_batch.search(fits, args.max_batch_start, args.max_batch_cap,
                                                args.max_batch_resolution, args.max_batch_seconds)
        except (RuntimeError, ValueError) as e:
            found[precision] = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return max_batch.format_table(found)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    device, env = args.device, environment(args.device)
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)  # under torchrun, rank 0 reports
    inputs = (models.describe(args.sizes) + f", {args.sizes['seq_len']} tokens per sequence"
              if args.model == TRANSFORMER else f"input {args.image_size}x{args.image_size}")
    say(f"precisionloop benchmark: {args.model} training steps ({inputs}; {'fused ' if args.fused else ''}"
        f"{OPTIMIZERS[args.optimizer]}), {env['date']}\n"
        f"device: {env['device_name']} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']}\n"
        f"{args.rounds} rounds of {args.warmup} warm-up + {args.iters} timed steps per system, a fresh model and "
        "optimizer each; median over rounds [min-max]")
    for precision in args.precisions:
        method, why = choose_method(device, bool(compile_for(policy_for(precision, args), args, device)), args.method)
        say(f"timing {precision}: {method} ({why})")
    if not args.compile and compile_for(None, args, device):
        say("every precision is compiled: fp8 always is, and one table compares compiled with compiled")
    systems = ["precisionloop"] + ([] if args.no_hand_loop else ["hand"])
    configs = [(p, bs) for bs in args.batch_sizes for p in args.precisions]
    results = []
    with tqdm(total=len(configs) * args.rounds * len(systems), desc="runs", file=sys.stderr, leave=False,
              disable=int(os.environ.get("RANK", "0")) != 0) as bar:
        for precision, bs in configs:
            results += _measure_config(precision, bs, args, device, systems, on_run=lambda r, name: bar.update())
    if args.autotune:
        results += _run_autotune(args, device)
    say(f"\nprecisionloop Trainer.step (below each block: speed-up and memory change vs {args.baseline}):")
    say(format_table(results, "precisionloop", args.precisions, args.batch_sizes, args.baseline))
    for r in results:
        if r.system == "autotune":
            say(f"autotune's choice at batch {r.batch_size}: {r.precision}, {format_time(r)}, {format_memory(r)}")
    if "hand" in systems:
        say("\nhand-written torch.amp loop, same settings:")
        say(format_table(results, "hand", args.precisions, args.batch_sizes, args.baseline))
        say("\n" + (format_wrapper_cost(results) if device.type == "cuda" else "wrapper cost: not printed on the CPU, "
                     "where a step's time varies between rounds by more than the wrapper adds (see the GPU figures)"))
    if args.max_batch:
        say(_max_batch_report(args, device))
    for r in results:
        if r.error:
            say(f"error: {r.system} {r.precision} batch {r.batch_size}: {r.error.splitlines()[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                       "results": [{**r.to_dict(), "system": r.system} for r in results]}, f, indent=2)
        say(f"results written to {args.json}")
    if args.plot:
        _write_plot(results, args.plot, f"{args.model} on {env['device_name']}")
    return results


if __name__ == "__main__":
    main()
