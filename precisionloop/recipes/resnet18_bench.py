"""Time training steps of a torchvision model or a Transformer stack under each precision policy, with peak memory.

Run ``python -m precisionloop.recipes.resnet18_bench --help`` for the flags. The Trainer's own
``step`` is what is timed; a hand-written torch.amp loop with identical settings runs beside it
in the same process, and the ratio of the two is the wrapper's cost. Each configuration is timed
in several interleaved rounds (``precisionloop.measure.interleaved``), a fresh model and optimizer
each round, by the method that fits what is timed (``--method``, ``precisionloop.recipes.timing``): on
CUDA compiled steps run back to back in one timed block per system and round (pipelined), eager steps
alternate between the two systems step by step; on the CPU the systems run one after the other; the
header says which ran and why. Each is reported as the median over rounds with the rounds' min-max
spread, and beside it its speed-up over tf32 (over strict fp32 on a device without TF32: the CPU, or a
GPU below compute capability 8.0, where tf32 is refused because it would time fp32 again). After the speed
tables, a table per precision says where the memory goes at the largest batch size
(``precisionloop.memory_breakdown``, read during a step): parameters, buffers, gradients and optimizer state
exactly; on CUDA also the peak, what it holds beyond those (activations and workspace) and the allocator's reserve.

``--model transformer`` times a Linear-heavy decoder stack (``precisionloop.recipes.models``) on
random tokens instead of a torchvision model on random images: on CUDA by default the reference
4 layers of d_model 2048 and d_ff 8192 on 8 x 1024 tokens, on the CPU a tiny one; ``--size large`` is
4 layers of d_model 4096, d_ff 16384 and 32 heads (877M parameters), a size at which fp8 matmuls pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import datetime
import difflib
import json
import sys
from typing import Callable

import torch
import torchvision
from torch import nn
from tqdm import tqdm

from precisionloop._compat import compile_modes
from precisionloop import FP8Policy, MemoryBreakdown, Trainer, autotune, get_policy
from precisionloop.tuning import default_candidates, tunable_precisions
from precisionloop.measure import (Measurement, Run, format_memory, format_ratio, format_time, interleaved, memory_kind,
                                   noisy_legend, paired_ratio, reset_memory)
from precisionloop.policy import PrecisionPolicy
from precisionloop.prepare import compile_mode
from precisionloop.recipes import loader_bench, max_batch, models, timing
from precisionloop.recipes.memory_report import format_memory_table, memory_legend

ALL_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
BASELINE = "tf32"  # the "vs" row's reference where TF32 exists; strict fp32 elsewhere (parse_args sets args.baseline)
TRANSFORMER = "transformer"
TRANSFORMER_SIZES = ("layers", "d_model", "d_ff", "heads", "seq_len", "vocab")  # flags --layers, --d-model, ...
OPTIMIZERS = {"sgd": "SGD momentum 0.9", "adamw": "AdamW"}


@dataclasses.dataclass
class Result:
    """One configuration (system, precision, batch size): the median over rounds of per-round median step times."""

    system: str
    precision: str
    batch_size: int
    median_ms: float | None
    min_ms: float | None = None
    max_ms: float | None = None
    spread: float | None = None
    noisy: bool = False
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    peak_mb: float | None = None
    memory_kind: str = "n/a"
    skipped: int = 0
    error: str | None = None
    settings: dict = dataclasses.field(default_factory=dict)
    reserved_mb: float | None = None

    @classmethod
    def from_measurement(cls, m: Measurement, precision: str, batch_size: int, skipped: int = 0, **settings) -> "Result":
        """The Result for a measured system; ``settings`` are added to the measurement's own."""
        return cls(m.name, precision, batch_size, m.median_ms, m.min_ms, m.max_ms, m.spread, m.noisy, list(m.rounds_ms),
                   m.peak_mb, m.memory_kind, skipped, m.error,
                   {**m.settings, "system": m.name, "precision": precision, "batch_size": batch_size, **settings},
                   m.reserved_mb)


def environment(device: torch.device) -> dict:
    """What the numbers were measured on."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU ({torch.get_num_threads()} threads)"


def build_model(name: str) -> nn.Module:
    """A randomly initialised torchvision classification model by name."""
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see torchvision.models.list_models()"
        raise SystemExit(f"--model {name!r} is not a torchvision classification model{hint}")
    return torchvision.models.get_model(name, weights=None)


def make_model(args: argparse.Namespace) -> nn.Module:
    """The model ``args`` name: the Transformer stack at its sizes, or a torchvision model."""
    if args.model == TRANSFORMER:
        return models.TransformerStack(**{k: getattr(args, k) for k in TRANSFORMER_SIZES})
    return build_model(args.model)


def make_batch(args: argparse.Namespace, batch_size: int, device: torch.device):
    """A random ``(inputs, targets)`` batch for the model: token ids for the Transformer, else images."""
    if args.model == TRANSFORMER:
        return models.random_tokens(batch_size, args.seq_len, args.vocab, device)
    return random_batch(batch_size, args.image_size, device)


def loss_of(args: argparse.Namespace) -> Callable:
    """The loss every system uses: next-token cross entropy over (batch * seq, vocab) for the Transformer."""
    return models.lm_loss if args.model == TRANSFORMER else nn.functional.cross_entropy


def make_optimizer(params, fused: bool, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (or AdamW, ``kind="adamw"``), the same for every system timed."""
    extra = {"fused": True} if fused else {}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, **extra)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, **extra)


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


def random_batch(batch_size: int, image_size: int, device: torch.device, num_classes: int = 1000):
    g = torch.Generator(device="cpu").manual_seed(batch_size)
    inputs = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    targets = torch.randint(0, num_classes, (batch_size,), generator=g)
    return inputs.to(device), targets.to(device)


def system_factory(system: str, policy: PrecisionPolicy, batch_size: int, args, device: torch.device,
                   skipped: list[int]) -> Callable[[], Run]:
    """A factory for :func:`precisionloop.measure.interleaved`: a fresh model, optimizer and Trainer per call.

    ``system`` is "precisionloop" (``Trainer.step`` itself is timed) or "hand" (the hand loop, on the
    Trainer's prepared model). Each run's skipped-step count is appended to ``skipped``.
    """
    compile = compile_for(policy, args, device)

    def build() -> Run:
        model = make_model(args)
        trainer = Trainer(model, make_optimizer(model.parameters(), args.fused, args.optimizer), policy, device=device,
                          compile=compile, distributed=args.distributed, loss_fn=loss_of(args))
        batch = trainer.to_device(make_batch(args, batch_size, device))
        if system == "precisionloop":
            step = lambda: trainer.step(batch)  # noqa: E731
        else:  # on the Trainer's prepared model: for fp8, torchao's converted layers
            step = hand_loop_step(trainer.model, batch, policy, device, args.fused, compiled=bool(compile),
                                  loss_fn=loss_of(args), optimizer=args.optimizer)
        return Run(step, context=policy.backend_flags, teardown=lambda: skipped.append(trainer.stats.skipped))

    return build


def compile_for(policy: PrecisionPolicy, args, device: torch.device):
    """--compile, except that fp8 is always timed compiled on CUDA: eager, torchao's casts make it slower than bf16."""
    return args.compile or (device.type == "cuda" and isinstance(policy, FP8Policy))


def settings_of(args) -> dict:
    """The run-wide settings every configuration's JSON record carries."""
    settings = {"model": args.model, "image_size": args.image_size, "fused": args.fused, "compile": args.compile or False,
                "channels_last": args.channels_last, "distributed": args.distributed, "optimizer": args.optimizer}
    if args.model == TRANSFORMER:
        settings.update({k: getattr(args, k) for k in TRANSFORMER_SIZES})
    return settings


def measure(precision: str, batch_size: int, args, device: torch.device, systems: list[str], on_run=None) -> list[Result]:
    """Time ``systems`` ("precisionloop", "hand") at one precision and batch size in interleaved rounds."""
    policy = policy_for(precision, args)
    skipped: dict[str, list[int]] = {s: [] for s in systems}
    factories = {s: system_factory(s, policy, batch_size, args, device, skipped[s]) for s in systems}
    compiled = compile_for(policy, args, device) or False
    method, why = timing.method_for(args, device, bool(compiled))
    measured = interleaved(factories, rounds=args.rounds, iters=args.iters, warmup=args.warmup, device=device,
                           on_run=on_run, **timing.interleaved_kwargs(method, args))
    settings = {**settings_of(args), "compile": compiled, "method_why": why}  # per row: fp8 differs
    return [Result.from_measurement(m, precision, batch_size, sum(skipped[s]), **settings)
            for s, m in measured.items()]


def format_table(results: list[Result], system: str, precisions: list[str], batch_sizes: list[int],
                 baseline: str = BASELINE) -> str:
    """A row block per batch size, a column per precision: time (median [min-max] over rounds), peak memory, and the
    speed-up and memory change vs ``baseline`` when it was measured."""
    cell = {(r.batch_size, r.precision): r for r in results if r.system == system}
    width = max([24] + [len(format_time(r)) for r in cell.values()])
    kinds = {r.memory_kind for r in cell.values() if r.memory_kind != "n/a"}
    mem_label = f"peak {kinds.pop() if len(kinds) == 1 else 'MB'}"
    label = max(9, len(mem_label))

    def row(name, texts) -> str:
        return f"{name:>{label}} | " + " | ".join(f"{t:>{width}}" for t in texts)

    lines = [row("batch", precisions)]
    for bs in batch_sizes:
        rs = [cell.get((bs, p)) for p in precisions]
        lines.append(row(str(bs), ["-" if r is None else "error" if r.error else format_time(r) for r in rs]))
        lines.append(row(mem_label, ["" if r is None or r.error else format_memory(r) for r in rs]))
        if any(r is not None and r.reserved_mb is not None for r in rs):
            lines.append(row("reserved MB", ["" if r is None or r.reserved_mb is None else f"{r.reserved_mb:.0f} MB"
                                              for r in rs]))
        base = cell.get((bs, baseline))
        if base is not None and not base.error:
            lines.append(row("vs " + baseline, [_versus(r, base) for r in rs]))
    legend = noisy_legend(cell.values())
    return "\n".join(lines + ([legend] if legend else []) + memory_legend(cell.values()))


def _versus(r: Result | None, base: Result) -> str:
    """Speed-up of ``r`` over the baseline and its memory change."""
    if r is None or r.error or not r.median_ms:
        return ""
    saved = f", mem {100 * (r.peak_mb / base.peak_mb - 1):+.0f}%" if r.peak_mb and base.peak_mb else ""
    return f"{base.median_ms / r.median_ms:.2f}x{saved}"


def format_wrapper_cost(results: list[Result]) -> str:
    """Trainer.step over the hand loop per configuration, from rounds paired in time (median [min-max] of the ratios)."""
    hand = {(r.batch_size, r.precision): r for r in results if r.system == "hand" and not r.error}
    parts = []
    for r in results:
        h = hand.get((r.batch_size, r.precision))
        if r.system == "precisionloop" and h is not None and not r.error and len(r.rounds_ms) == len(h.rounds_ms):
            parts.append(f"batch {r.batch_size} {r.precision}: {format_ratio(paired_ratio(r, h))} "
                         f"({format_time(r)} vs {format_time(h)})")
    if not parts:
        return ""
    return ("wrapper cost, Trainer.step / hand-written torch.amp loop, per-round ratios (rounds paired in time), "
            "median [min-max]:\n  " + "\n  ".join(parts))


def write_plot(results: list[Result], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot needs matplotlib, which is not installed; `pip install precisionloop[plot]`. No plot written to {path}.")
        return
    rows = [r for r in results if r.system == "precisionloop" and not r.error]
    batch_sizes = sorted({r.batch_size for r in rows})
    precisions = list(dict.fromkeys(r.precision for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(precisions), 1)
    for i, p in enumerate(precisions):
        xs = [j + i * width for j in range(len(batch_sizes))]
        by_bs = {r.batch_size: r for r in rows if r.precision == p}
        got = [by_bs.get(b) for b in batch_sizes]
        medians = [r.median_ms if r else 0 for r in got]
        spread = [[m - (r.min_ms if r else 0) for m, r in zip(medians, got)], [(r.max_ms if r else 0) - m for m, r in zip(medians, got)]]
        axes[0].bar(xs, medians, width, yerr=spread, capsize=3, label=p)
        axes[1].bar(xs, [(r.peak_mb or 0) if r else 0 for r in got], width, label=p)
    kinds = {r.memory_kind for r in rows if r.memory_kind != "n/a"}
    memory = f"peak memory ({kinds.pop() if len(kinds) == 1 else 'MB'})"
    for ax, label in zip(axes, ["step time (ms), median and min-max over rounds", memory]):
        ax.set_xticks([j + width * (len(precisions) - 1) / 2 for j in range(len(batch_sizes))], [f"batch {b}" for b in batch_sizes])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m precisionloop.recipes.resnet18_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--model", default="resnet18",
                   help="any torchvision classification model, or 'transformer' for the Linear-heavy stack of "
                        "precisionloop.recipes.models (default resnet18)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated, images or sequences per batch (default 32,128 on CUDA, 8 on the CPU; "
                        "for the transformer 8 on CUDA, 4 on the CPU)")
    p.add_argument("--precisions", default=None,
                   help=f"comma-separated among {','.join(ALL_PRECISIONS)},fp8 (default {','.join(ALL_PRECISIONS)} on "
                        "CUDA of compute capability 8.0+, fp32,bf16,fp16 on older GPUs, fp32,bf16 on the CPU); "
                        "tf32 needs CUDA compute capability 8.0+ (elsewhere it is fp32, so it is refused); fp8 needs "
                        "torchao and CUDA compute capability 8.9+, and is always timed compiled")
    p.add_argument("--iters", type=int, default=None, help="timed steps per configuration and round (default 50 on CUDA, 6 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first in each round, for cudnn.benchmark to settle (default 15 on CUDA, 2 on the CPU)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per configuration, a fresh model and optimizer each, the systems' order rotated "
                        "each round; the median over rounds is reported with the min-max spread (default 3)")
    timing.add_flags(p)
    p.add_argument("--image-size", type=int, default=None, help="input side in pixels (default 224 on CUDA, 112 on the CPU; not for the transformer)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="force channels_last on or off (default: the policy's choice, on for CUDA)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused optimizer for every system (default: on for CUDA); fused optimizers let a skipped step be "
                        "decided on the device, so neither the Trainer nor GradScaler needs a host sync per step")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="sgd (momentum 0.9, lr 0.01) or adamw (lr 3e-4, weight decay 0.01) for every system (default sgd)")
    p.add_argument("--compile", nargs="?", const=True, default=None, metavar="MODE",
                   help="torch.compile the model for every system; bare --compile lets the Trainer pick the mode")
    p.add_argument("--autotune", action="store_true",
                   help="also let precisionloop.autotune pick a configuration per batch size and time it")
    p.add_argument("--distributed", choices=("ddp", "fsdp"), default=None,
                   help="under torchrun, wrap the Trainer's model with DDP or FSDP2 (times are per rank)")
    p.add_argument("--no-hand-loop", action="store_true", help="skip the hand-written loop (no wrapper-cost figures)")
    p.add_argument("--memory-table", action=argparse.BooleanOptionalAction, default=True,
                   help="end with the table of where the memory goes (default on; off saves compiling one more model "
                        "per precision)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart here (needs matplotlib)")
    loader_bench.add_arguments(p)
    t = p.add_argument_group("--model transformer", "sizes of the Transformer stack (defaults: the reference on CUDA, "
                             "a tiny stack on the CPU)")
    t.add_argument("--size", choices=tuple(models.SIZES), default=None,
                   help="a named size, each flag below overriding its part: " + "; ".join(
                       f"{name}: {models.describe(sizes)}" for name, sizes in models.SIZES.items()))
    for name in TRANSFORMER_SIZES:
        t.add_argument("--" + name.replace("_", "-"), type=int, default=None, dest=name,
                       help=f"default {models.REFERENCE[name]} on CUDA, {models.TINY[name]} on the CPU")
    max_batch.add_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    parsed = argparse.Namespace(**vars(args))  # the flags as given, before the defaults below fill them in
    device = _parse_device(p, args.device)
    cuda = device.type == "cuda"
    args.device = device
    args.notes = []
    names = _precision_args(p, args, device)
    if args.autotune:
        tunable = tunable_precisions(device)
        if not any(n in tunable for n in names):
            p.error(f"--autotune chooses among {', '.join(tunable)} on {device.type}; --precisions names none of them")
    check_output(p, "--json", args.json)
    if args.fused is None:
        # FSDP2's sharded parameters have no fused-SGD kernel (the Trainer refuses one): foreach there.
        args.fused = cuda and args.distributed != "fsdp"
    if isinstance(args.compile, str) and args.compile not in compile_modes():
        p.error(f"--compile {args.compile!r} is not a torch.compile mode; valid: {', '.join(compile_modes())}")
    transformer = args.model == TRANSFORMER
    default_bs = ("8" if cuda else "4") if transformer else ("32,128" if cuda else "8")
    args.batch_sizes = _ints(p, "--batch-sizes", default_bs if args.batch_sizes is None else args.batch_sizes)
    args.iters = args.iters if args.iters is not None else (50 if cuda else 6)
    args.warmup = args.warmup if args.warmup is not None else (15 if cuda else 2)
    for flag, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    timing.settle(p, args, cuda)
    if transformer:
        _transformer_args(p, args, cuda)
    else:
        _image_args(p, args, cuda)
    if not cuda:
        args.notes.append(_cpu_note(args))
    max_batch.check_arguments(p, args)
    loader_bench.settle(p, args, parsed)
    return args


def has_tf32(device: torch.device) -> bool:
    """Whether ``device`` has TF32 math: CUDA of compute capability 8.0 or higher. Elsewhere tf32 is plain fp32."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _precision_args(p: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    """Settle --precisions and the "vs" baseline (tf32, or fp32 without TF32); policy name -> the spelling given."""
    tf32 = has_tf32(device)
    args.baseline = BASELINE if tf32 else "fp32"
    if args.precisions is None:
        defaults = [n for n in ALL_PRECISIONS if (n != "tf32" or tf32) and (n != "fp16" or device.type == "cuda")]
        args.precisions = ",".join(defaults)
        if device.type != "cuda":
            args.notes.append("fp16 left out on the CPU by default: its autocast is ~20x slower than fp32 there (ask with --precisions)")
    args.precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if not args.precisions:
        p.error(f"--precisions names none; valid: {', '.join(ALL_PRECISIONS)} (comma-separated)")
    names = {}
    for name in args.precisions:
        try:
            policy_name = get_policy(name).name
        except ValueError as e:
            p.error(f"--precisions: {e}")
        if policy_name in names:  # an alias of one given before (fp32 and float32) would measure it twice
            p.error(f"--precisions names {policy_name} twice ({names[policy_name]!r} and {name!r})")
        if policy_name == "tf32" and not tf32:  # it would time fp32 a second time under another name
            where = "the CPU" if device.type == "cpu" else (
                f"{device} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})")
            p.error(f"--precisions tf32: TF32 needs a CUDA GPU of compute capability 8.0+, and {where} has none "
                    "(tf32 would run as fp32); use fp32")
        names[policy_name] = name
    return names


def _image_args(p: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """Settle --image-size for a torchvision model; the Transformer's size flags do not apply to it."""
    args.image_size = args.image_size if args.image_size is not None else (224 if cuda else 112)
    if args.image_size < 16:
        p.error(f"--image-size must be >= 16, got {args.image_size}")
    given = ["--" + k.replace("_", "-") for k in TRANSFORMER_SIZES if getattr(args, k) is not None]
    given += ["--size"] if args.size is not None else []
    if given:
        args.notes.append(f"{', '.join(given)} only apply to --model {TRANSFORMER}; ignored for {args.model}")


def _transformer_args(p: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """Fill the Transformer's sizes from the device's defaults and check them; image flags do not apply."""
    defaults = models.SIZES[args.size] if args.size else models.REFERENCE if cuda else models.TINY
    for name in TRANSFORMER_SIZES:
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
        if getattr(args, name) < models.MINIMUM[name]:
            p.error(f"--{name.replace('_', '-')} must be >= {models.MINIMUM[name]}, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if args.image_size is not None:
        args.notes.append(f"--image-size is ignored for --model {TRANSFORMER} (its inputs are token ids)")
    if args.channels_last is not None:
        args.notes.append(f"--channels-last does not apply to --model {TRANSFORMER} (no 2-D convolutions); ignored")
    if args.size == "large" and cuda and "fp8" not in args.precisions:
        args.notes.append("--size large is where fp8 pays: add fp8 to --precisions to time it")
    args.image_size = args.channels_last = None


def _parse_device(p: argparse.ArgumentParser, text: str | None) -> torch.device:
    """--device, or CUDA (this rank's GPU under torchrun) when available, else the CPU."""
    try:
        device = torch.device(text) if text else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    except RuntimeError:
        p.error(f"--device {text!r} is not a device; use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {text} was requested but CUDA is not available; use --device cpu")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {text}: the benchmark runs on cuda, cuda:N or cpu")
    return device


def _cpu_note(args: argparse.Namespace) -> str:
    """What a CPU run's figures are."""
    rss = ("peak memory is the growth of the process's resident set (RSS) from building the model to its last step"
           if memory_kind(args.device) == "MB RSS" else "peak memory n/a (/proc/self/clear_refs is not usable here)")
    if args.model == TRANSFORMER:
        ref = models.REFERENCE
        inputs = (f"a tiny Transformer by default, to stay seconds (the reference, {ref['layers']} layers of d_model "
                  f"{ref['d_model']}, d_ff {ref['d_ff']}, 8 x {ref['seq_len']} tokens, is the CUDA default; "
                  f"ask with --layers, --d-model, ...)")
    else:
        inputs = f"{args.image_size}x{args.image_size} inputs"
    return f"CPU run: {inputs} and {args.iters} timed steps per round; wall-clock medians; {rss}"


def check_output(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse, before anything is measured, an output path that cannot be written (results would be lost at the end)."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        p.error(f"{flag} {path!r}: {'is a directory' if os.path.isdir(path) else 'its folder does not exist or is not writable'}; "
                "give a file path in a writable folder")


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        p.error(f"{flag} takes comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{flag} takes positive integers, got {text!r}")
    return values


def run_autotune(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Let the library choose per batch size; report the chosen candidate as system "autotune"."""
    results = []
    for bs in args.batch_sizes:
        model = make_model(args)
        candidates = [c for c in default_candidates(model, device, compile=bool(args.compile)) if c.precision in args.precisions]
        print(f"\nautotune at batch {bs} ({len(candidates)} candidates, {args.warmup} + {args.iters} steps each):")
        try:
            chosen = autotune(model, lambda params: make_optimizer(params, args.fused, args.optimizer),
                              make_batch(args, bs, device), candidates, device=device, steps=args.iters,
                              warmup=args.warmup, loss_fn=loss_of(args))
        except RuntimeError as e:
            print(e)
            continue
        best = next(r for r in chosen.results if r.candidate == chosen.best)
        results.append(Result("autotune", chosen.best.label, bs, best.median_ms, peak_mb=best.peak_mb,  # autotune's own timing
                              memory_kind=memory_kind(device) if best.peak_mb is not None else "n/a",
                              settings={"system": "autotune", "precision": chosen.best.label, "batch_size": bs,
                                        "iters": args.iters, "warmup": args.warmup, **settings_of(args)}))
    return results


def policy_for(name: str, args: argparse.Namespace) -> PrecisionPolicy:
    policy = get_policy(name, args.device)
    if args.channels_last is not None:
        policy = dataclasses.replace(policy, channels_last=args.channels_last)
    return policy


def header(args: argparse.Namespace, env: dict) -> str:
    """What is timed, on what, how: the report's first lines."""
    optimizer = f"{'fused ' if args.fused else ''}{OPTIMIZERS[args.optimizer]}"
    if args.model == TRANSFORMER:
        with torch.device("meta"):
            params = sum(p.numel() for p in make_model(args).parameters())
        inputs = (f"{args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, {args.heads} heads, vocab {args.vocab} "
                  f"({f'{params / 1e6:.1f}M' if params >= 100_000 else f'{params:,}'} parameters), "
                  f"sequences of {args.seq_len} random tokens")
        layout = "n/a"
    else:
        inputs = f"input {args.image_size}x{args.image_size}"
        layout = "policy default" if args.channels_last is None else args.channels_last
    return (f"precisionloop benchmark: {args.model} training steps (forward, backward, {optimizer}), {env['date']}\n"
            f"device: {env['device_name']} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']}\n"
            f"{inputs}, {args.rounds} rounds of {args.warmup} warm-up + {args.iters} timed steps per system, "
            f"a fresh model and optimizer each; median over rounds of the rounds' figures [min-max]"
            f" | channels_last: {layout}\n"
            + timing.describe(args, args.device, {p: bool(compile_for(policy_for(p, args), args, args.device))
                                                  for p in args.precisions}))


def graphed(precision: str, args, device: torch.device) -> bool:
    """Whether ``precision``'s steps replay CUDA graphs, where neither the breakdown's peak nor the timed one holds
    the activations (so the two are not compared)."""
    mode = compile_mode(compile_for(policy_for(precision, args), args, device), device)
    return device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")


def memory_of(precision: str, batch_size: int, args, device: torch.device) -> MemoryBreakdown:
    """The memory breakdown of a fresh Trainer at ``precision``, as the timed systems build it, read during a step.

    On CUDA, ``--warmup`` steps (one at least) run first; then the cache they leave is emptied and the peak
    restarted, so the peak and the reserve are those of steady-state steps, alike for every precision and mode.
    Then two steps: the breakdown is read in the second, between its backward and its optimizer step (the engine's
    hook that fit's underflow telemetry uses), so the gradients and the first step's optimizer state are present.
    """
    policy = policy_for(precision, args)
    reset_memory(device)
    model = make_model(args)
    trainer = Trainer(model, make_optimizer(model.parameters(), args.fused, args.optimizer), policy, device=device,
                      compile=compile_for(policy, args, device), distributed=args.distributed, loss_fn=loss_of(args))
    batch = trainer.to_device(make_batch(args, batch_size, device))
    if device.type == "cuda":  # elsewhere only the exact parts are read, and they need no warm-up
        for _ in range(max(args.warmup, 1)):
            trainer.step(batch)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what only the warm-up needed (cuDNN's trials); CUDA-graph pools in use stay
        torch.cuda.reset_peak_memory_stats(device)
    seen: list[MemoryBreakdown] = []
    trainer.step(batch)
    trainer.engine.probe = lambda step: seen.append(trainer.memory_breakdown())
    trainer.step(batch)
    trainer.engine.probe = None
    return seen[0]


def memory_breakdowns(args, device: torch.device) -> dict[str, MemoryBreakdown | str]:
    """``memory_of`` per precision at the largest batch size; an error's first line where one failed."""
    got: dict[str, MemoryBreakdown | str] = {}
    for precision in args.precisions:
        try:
            got[precision] = memory_of(precision, max(args.batch_sizes), args, device)
        except (RuntimeError, ValueError) as e:  # out of memory, a policy this device cannot run
            got[precision] = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return got


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    if args.loader:
        return loader_bench.main(args)
    device: torch.device = args.device
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)  # under torchrun, rank 0 reports
    env = environment(device)
    say(header(args, env))
    for note in args.notes:
        say(f"note: {note}")
    systems = ["precisionloop"] + ([] if args.no_hand_loop else ["hand"])
    configs = [(p, bs) for bs in args.batch_sizes for p in args.precisions]
    results = []
    with tqdm(total=len(configs) * args.rounds * len(systems), desc="runs", file=sys.stderr, leave=False,
              disable=int(os.environ.get("RANK", "0")) != 0) as bar:
        for precision, bs in configs:
            results += measure(precision, bs, args, device, systems, on_run=lambda r, name: bar.update())
    if args.autotune:
        results += run_autotune(args, device)
    say("\nprecisionloop Trainer.step, median ms [min-max over rounds], peak memory "
        f"(below each block: speed-up and memory change vs {args.baseline}):")
    say(format_table(results, "precisionloop", args.precisions, args.batch_sizes, args.baseline))
    tuned = [r for r in results if r.system == "autotune"]
    for r in tuned:
        say(f"autotune's choice at batch {r.batch_size}: {r.precision}, {r.median_ms:.2f} ms / {format_memory(r)} "
            "(autotune's own timing)")
    if "hand" in systems:
        say("\nhand-written torch.amp loop, same settings:")
        say(format_table(results, "hand", args.precisions, args.batch_sizes, args.baseline))
        say("\n" + format_wrapper_cost(results))
    memory = memory_breakdowns(args, device) if args.memory_table else {}
    timed_peaks = {r.precision: r.peak_mb for r in results if r.system == "precisionloop" and r.memory_kind == "MB"
                   and r.batch_size == max(args.batch_sizes) and r.peak_mb and not graphed(r.precision, args, device)}
    if memory:
        say(format_memory_table(memory, max(args.batch_sizes), timed_peaks))
    if args.max_batch:
        say(max_batch.report(args, device))
    for r in results:
        if r.error:
            say(f"error: {r.system} {r.precision} batch {r.batch_size}: {r.error.splitlines()[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                       "results": [dataclasses.asdict(r) for r in results],
                       "memory": {"batch_size": max(args.batch_sizes), "timed_peaks_mb": timed_peaks,
                                  **{p: b.to_dict() if isinstance(b, MemoryBreakdown) else b for p, b in memory.items()}}},
                      f, indent=2)
        say(f"results written to {args.json}")
    if args.plot:
        write_plot(results, args.plot, f"{args.model} on {env['device_name']}")
    return results


if __name__ == "__main__":
    main()
