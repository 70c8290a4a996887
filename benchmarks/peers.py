"""precisionloop against Lightning Fabric and HF Accelerate, in one process, on one device.

    PYTHONPATH=. python benchmarks/peers.py --batch-sizes 32,128 --json peers.json

Each system trains the same torchvision model on the same random batch with the same SGD
(momentum 0.9; fused on CUDA unless --no-fused). The systems compared with each other (per batch
size and precision: precisionloop, the hand loop, and each peer; a peer's TF32 fp32 goes with our
tf32, or with our fp32 on a device without TF32) are timed together by
``precisionloop.recipes.timing.interleaved``: --rounds rounds, a fresh model and optimizer per system and
round, the order rotated each round; the median over rounds is reported with its min-max spread,
and ratios pair the rounds in time. Every peer runs with TF32 and cudnn.benchmark on, so the peers
get the flags precisionloop's tf32/bf16/fp16 policies use.

Each peer runs twice in the same rounds (``--peer-layouts``): at its default layout (NCHW) as
``fabric``, and as an expert user writes it, model and inputs in channels_last, as
``fabric+channels_last`` (likewise for Accelerate). precisionloop and the hand loop run in their
policy's layout (channels_last for conv models on CUDA). The ratios name the peer system they are
against. A peer that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from torch import nn
from tqdm import tqdm

from precisionloop import FP32Policy
from precisionloop.measure import format_memory, format_time
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.recipes.timing import Run, format_ratio, interleaved, paired_ratio

FABRIC = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


CHANNELS_LAST = "+channels_last"
LAYOUTS = ("default", "channels_last")


def fabric_step(model: nn.Module, batch, precision: str, device: torch.device, fused: bool):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1, precision=FABRIC[precision])
    optimizer = bench.make_optimizer(model.parameters(), fused)
    model, optimizer = fabric.setup(model, optimizer)
    return _peer_loop(model, optimizer, [t.to(fabric.device) for t in batch], fabric.backward)


def accelerate_step(model: nn.Module, batch, precision: str, device: torch.device, fused: bool):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # Accelerate keeps one process-wide state; reset it so each precision gets a fresh Accelerator.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=ACCELERATE[precision], cpu=device.type != "cuda")
    optimizer = bench.make_optimizer(model.parameters(), fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    return _peer_loop(model, optimizer, [t.to(accelerator.device) for t in batch], accelerator.backward)


def _peer_loop(model, optimizer, batch, backward):
    """Each peer's documented step: its wrapped model and optimizer, and its own backward."""
    inputs, targets = batch

    def step() -> None:
        loss = nn.functional.cross_entropy(model(inputs), targets)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


PEERS = {"fabric": fabric_step, "accelerate": accelerate_step}


def peer_factory(peer: str, precision: str, batch_size: int, args, channels_last: bool = False):
    """A factory for ``interleaved``: a fresh model and optimizer set up by ``peer``, timed under TF32 flags.

    ``channels_last``: the model and the inputs are put in channels_last before the peer sets them up.
    """
    device = args.device

    def build() -> Run:
        layout = torch.channels_last if channels_last else torch.contiguous_format
        model = bench.build_model(args.model).to(device, memory_format=layout)
        inputs, targets = bench.random_batch(batch_size, args.image_size, device)
        batch = (inputs.contiguous(memory_format=layout), targets)
        return Run(PEERS[peer](model, batch, precision, device, args.fused), context=FP32Policy(tf32=True).backend_flags)

    return build


def peer_systems(peers: list[str], layouts: list[str]) -> list[tuple[str, str, bool]]:
    """(system name, peer, channels_last) for each peer in each layout: "fabric", "fabric+channels_last", ..."""
    return [(peer + (CHANNELS_LAST if layout == "channels_last" else ""), peer, layout == "channels_last")
            for peer in peers for layout in layouts]


def _group(precision: str, args) -> str:
    """The precision of ours a peer is compared with: their fp32 is TF32 fp32, so it goes with our tf32, or with our
    fp32 on a device without TF32 (the recipe's baseline there)."""
    return args.baseline if precision == "fp32" else precision


def measure_group(bs: int, key: str, args, peers: list[tuple[str, str, bool]], peer_precisions: list[str],
                  on_run) -> list[bench.Result]:
    """Time, interleaved, every system that is compared at batch ``bs`` and our precision ``key`` (none: nothing)."""
    factories, precision_of, skipped = {}, {}, {}
    if key in args.precisions:
        policy = bench.policy_for(key, args)
        for system in ("precisionloop", "hand"):
            skipped[system] = []
            factories[system] = bench.system_factory(system, policy, bs, args, args.device, skipped[system])
            precision_of[system] = key
    for p in peer_precisions:
        if _group(p, args) == key:
            for name, peer, channels_last in peers:
                factories[name] = peer_factory(peer, p, bs, args, channels_last)
                precision_of[name] = p
    if not factories:  # a peer precision of ours not asked for, and the peers not installed (fp16 on the CPU)
        return []
    method = method_of(args)
    measured = interleaved(factories, rounds=args.rounds, iters=args.iters, warmup=args.warmup, device=args.device,
                           on_run=on_run, pipelined=method == "pipelined",
                           blocks=args.iters if method == "alternating" else 1)
    return [bench.Result(**vars(m), precision=precision_of[name], batch_size=bs, skipped=sum(skipped.get(name, [])))
            for name, m in measured.items()]


def method_of(args) -> str:
    """--method where given; else each system alone in its rounds, as the published peer figures were timed."""
    return "alone" if args.method == "auto" else args.method


def available(peer: str) -> bool:
    try:
        __import__({"fabric": "lightning.fabric", "accelerate": "accelerate"}[peer])
        return True
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> list[bench.Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Every other flag is the recipe's (--rounds, --iters, --warmup, --batch-sizes, "
                                            "--precisions, --device, --json, ...): python -m precisionloop.recipes.resnet18_bench --help")
    parser.add_argument("--peers", default="fabric,accelerate")
    parser.add_argument("--peer-precisions", default="fp32,bf16,fp16",
                        help="precisions to run the peers at (fp32 means their TF32 fp32)")
    parser.add_argument("--peer-layouts", default=",".join(LAYOUTS),
                        help="layouts to run each peer in, comma-separated: default (theirs, NCHW) and channels_last "
                             "(model and inputs); default both, in the same rounds")
    known, rest = parser.parse_known_args(argv)
    args = bench.parse_args(rest)
    env = bench.environment(args.device)
    print(f"peers benchmark, {env['date']} | {env['device_name']} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']}")
    print(f"{args.model}, input {args.image_size}x{args.image_size}, {'fused ' if args.fused else ''}SGD momentum 0.9, "
          f"{args.rounds} interleaved rounds (a fresh model and optimizer each) of {args.warmup} warm-up + {args.iters} "
          "timed steps; median over rounds of the rounds' figures [min-max]\n"
          f"timing: {method_of(args)}")
    peers = [p for p in known.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            parser.error(f"--peers: unknown peer {p!r}; valid: {', '.join(PEERS)}")
    missing = [p for p in peers if not available(p)]
    for p in missing:
        print(f"note: {p} is not installed; skipped")
    peers = [p for p in peers if p not in missing]
    layouts = [s.strip() for s in known.peer_layouts.split(",") if s.strip()]
    if not layouts or any(s not in LAYOUTS for s in layouts):
        parser.error(f"--peer-layouts {known.peer_layouts!r}: give one or both of {', '.join(LAYOUTS)}")
    peers = peer_systems(peers, layouts)
    peer_precisions = [p.strip() for p in known.peer_precisions.split(",") if p.strip()]
    for p in peer_precisions:
        if p not in FABRIC:
            parser.error(f"--peer-precisions: unknown {p!r}; valid: {', '.join(FABRIC)} (fp32 means their TF32 fp32)")

    keys = list(dict.fromkeys(args.precisions + [_group(p, args) for p in peer_precisions]))
    results = []
    with tqdm(desc="runs", file=sys.stderr, leave=False) as bar:
        for bs in args.batch_sizes:
            for key in keys:
                results += measure_group(bs, key, args, peers, peer_precisions, on_run=lambda r, name: bar.update())

    systems = ["precisionloop", "hand", *(name for name, _, _ in peers)]
    print("\nmedian ms [min-max over rounds], peak memory (fp32 column: strict fp32 for precisionloop and hand, "
          "TF32 fp32 for the peers):")
    for system in systems:
        print(f"\n{system}:")
        columns = list(dict.fromkeys(args.precisions + peer_precisions))
        print(bench.format_table(results, system, columns, args.batch_sizes, args.baseline))
    ours = {(r.batch_size, r.precision): r for r in results if r.system == "precisionloop" and not r.error}
    print("\nprecisionloop step time / peer step time (lower is better), per-round ratios paired in time, median [min-max];"
          f" each against the peer system named: a bare name is the peer at its default layout (NCHW), {CHANNELS_LAST} "
          "the peer with its model and inputs in channels_last; precisionloop in its policy's layout "
          f"(channels_last: {'policy default' if args.channels_last is None else args.channels_last}):")
    for r in results:
        mine = ours.get((r.batch_size, _group(r.precision, args)))
        if r.system in systems[2:] and not r.error and mine is not None and len(mine.rounds_ms) == len(r.rounds_ms):
            print(f"  batch {r.batch_size:>4} {r.precision}: vs {r.system:<25} {format_ratio(paired_ratio(mine, r))} "
                  f"({format_time(mine)} vs {format_time(r)}; {format_memory(mine)} vs {format_memory(r)})")
    print("\n" + bench.format_wrapper_cost(results))
    for r in results:
        if r.error:
            print(f"error: {r.system} {r.precision} batch {r.batch_size}: {r.error.splitlines()[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
        print(f"results written to {args.json}")
    return results


if __name__ == "__main__":
    main()
