"""How the benchmark recipe times each configuration: the ``--method`` and ``--blocks`` flags, and the header's words.

By default (``--method auto``) the method follows what is timed (``precisionloop.measure.choose_method``):
compiled steps on CUDA are pipelined, eager steps on CUDA alternate step by step, and off CUDA the systems
run one after the other. ``--blocks`` without ``--method`` asks for alternation in that many blocks everywhere.
"""

from __future__ import annotations

import argparse

import torch

from precisionloop import measure

CHOICES = ("auto", *measure.METHODS)
ASKED = "asked for on the command line"


def add_flags(p: argparse.ArgumentParser) -> None:
    """--method and --blocks."""
    p.add_argument("--method", choices=CHOICES, default="auto",
                   help="how each round times its systems: pipelined (each system alone, its timed steps back to back, "
                        "one synchronisation at the end; ms per step = block time / --iters), alternating (the "
                        "systems side by side, their timed steps alternating in --blocks blocks) or alone (one system "
                        "after the other, the median step). Default auto: pipelined for compiled steps on CUDA (fp8 "
                        "included), alternating step by step for eager steps on CUDA, alone on the CPU")
    p.add_argument("--blocks", type=int, default=None,
                   help="with --method alternating (implied when --blocks is given alone): the blocks each round's "
                        "timed steps are split into, the round's systems built side by side (default --iters: step by "
                        "step); --blocks 1 means --method alone")


def settle(p: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """Check --method and --blocks against --iters and --warmup, and settle ``args.blocks`` (needs them set)."""
    if args.blocks is not None and args.method == "auto":
        args.method = "alternating" if args.blocks > 1 else "alone"
    elif args.blocks is not None and args.method in ("pipelined", "alone") and args.blocks != 1:
        p.error(f"--blocks {args.blocks} alternates systems side by side; --method {args.method} times each alone: "
                "give one of the two")
    if args.blocks is None:
        # Step by step on CUDA: at batch 32 the host bounds the eager step, and its speed drifts within a second;
        # blocks of 10 steps left the wrapper cost 0.96-1.20x from run to run, alternating every step 1.02-1.07x.
        args.blocks = args.iters if args.method == "alternating" or (args.method == "auto" and cuda) else 1
    if args.blocks < 1:
        p.error(f"--blocks must be >= 1, got {args.blocks}")
    if args.blocks > args.iters:
        p.error(f"--blocks ({args.blocks}) cannot exceed --iters ({args.iters}): each block needs a timed step")
    if args.method == "alternating" and args.blocks == 1:
        p.error("--method alternating needs --blocks >= 2 (or leave --blocks out: step by step)")
    if args.blocks > 1 and args.warmup < 1:
        p.error(f"--blocks {args.blocks} needs --warmup >= 1 (what each system holds is read after its warm-up); "
                "or pass --blocks 1")


def method_for(args: argparse.Namespace, device: torch.device, compiled: bool) -> tuple[str, str]:
    """(method, why) for one configuration: the one asked for, or the one chosen by what is timed."""
    if args.method != "auto":
        return args.method, ASKED
    method, why = measure.choose_method(device, compiled)
    if method == "alternating" and args.blocks == 1:  # the auto default off CUDA, or --blocks 1
        return "alone", why
    return method, why


def interleaved_kwargs(method: str, args: argparse.Namespace) -> dict:
    """The ``blocks`` and ``pipelined`` arguments of ``measure.interleaved`` for ``method``."""
    return {"blocks": args.blocks if method == "alternating" else 1, "pipelined": method == "pipelined"}


def describe(args: argparse.Namespace, device: torch.device, compiled: dict[str, bool]) -> str:
    """The header's words: each method used, the precisions it times (``compiled``: precision -> compiled?), and why."""
    groups: dict[tuple[str, str], list[str]] = {}
    for precision, is_compiled in compiled.items():
        groups.setdefault(method_for(args, device, is_compiled), []).append(precision)
    parts = []
    for (method, why), precisions in groups.items():
        text = measure.describe_method(method, iters=args.iters, blocks=args.blocks)
        scope = "" if len(groups) == 1 else f" [{', '.join(precisions)}]"
        parts.append(f"timing{scope}: {text} (why: {why})")
    return "\n".join(parts)
