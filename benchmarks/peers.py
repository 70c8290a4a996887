"""precisionloop against Lightning Fabric and HF Accelerate, in one process, on one device.

    PYTHONPATH=. python benchmarks/peers.py --batch-sizes 32,128 --json peers.json

Each system trains the same torchvision model on the same random batch with the same SGD
(momentum 0.9; fused on CUDA unless --no-fused), timed by the recipe's own timer. Every system runs with TF32 and cudnn.benchmark on, so the peers
get the flags precisionloop's tf32/bf16/fp16 policies use; channels_last is each system's default
(the peers' default is NCHW). A peer that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch
from torch import nn
from tqdm import tqdm

from precisionloop import FP32Policy
from precisionloop.autotune import peak_mb, reset_memory, time_steps
from precisionloop.recipes import resnet18_bench as bench

FABRIC = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


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


def measure_peer(peer: str, precision: str, batch_size: int, args) -> bench.Result:
    device = args.device
    reset_memory(device)
    model = bench.build_model(args.model).to(device)
    batch = bench.random_batch(batch_size, args.image_size, device)
    step = PEERS[peer](model, batch, precision, device, args.fused)
    with FP32Policy(tf32=True).backend_flags():
        times = time_steps(step, iters=args.iters, warmup=args.warmup, device=device)
    return bench.Result(peer, precision, batch_size, statistics.median(times), *bench.deciles(times), peak_mb=peak_mb(device))


def available(peer: str) -> bool:
    try:
        __import__({"fabric": "lightning.fabric", "accelerate": "accelerate"}[peer])
        return True
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> list[bench.Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default="fabric,accelerate")
    parser.add_argument("--peer-precisions", default="fp32,bf16,fp16",
                        help="precisions to run the peers at (fp32 means their TF32 fp32)")
    known, rest = parser.parse_known_args(argv)
    args = bench.parse_args(rest)
    env = bench.environment(args.device)
    print(f"peers benchmark, {env['date']} | {env['device_name']} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']}")
    print(f"{args.model}, input {args.image_size}x{args.image_size}, {'fused ' if args.fused else ''}SGD momentum 0.9, "
          f"{args.warmup} warm-up + {args.iters} timed steps, median")
    peers = [p for p in known.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            parser.error(f"--peers: unknown peer {p!r}; valid: {', '.join(PEERS)}")
    missing = [p for p in peers if not available(p)]
    for p in missing:
        print(f"note: {p} is not installed; skipped")
    peers = [p for p in peers if p not in missing]
    peer_precisions = [p for p in known.peer_precisions.split(",") if p]

    configs = [("ours", s, p, bs) for bs in args.batch_sizes for p in args.precisions for s in ("precisionloop", "hand")]
    configs += [("peer", peer, p, bs) for bs in args.batch_sizes for p in peer_precisions for peer in peers]
    results = []
    for kind, system, precision, bs in tqdm(configs, desc="configurations", file=sys.stderr, leave=False):
        try:
            if kind == "ours":
                results.append(bench.measure(system, precision, bench.policy_for(precision, args), bs, args, args.device))
            else:
                results.append(measure_peer(system, precision, bs, args))
        except Exception as e:  # one failing system must not lose the others' numbers
            results.append(bench.Result(system, precision, bs, None, None, None, None, error=f"{type(e).__name__}: {e}"))
            torch.cuda.empty_cache() if args.device.type == "cuda" else None

    systems = ["precisionloop", "hand", *peers]
    print("\nmedian ms / peak MB (fp32 column: strict fp32 for precisionloop and hand, TF32 fp32 for the peers):")
    for system in systems:
        print(f"\n{system}:")
        print(bench.format_table(results, system, list(dict.fromkeys(args.precisions + peer_precisions)), args.batch_sizes))
    ours = {(r.batch_size, r.precision): r for r in results if r.system == "precisionloop" and not r.error}
    print("\nprecisionloop step time / peer step time (lower is better):")
    for r in results:
        mine = ours.get((r.batch_size, "tf32" if r.precision == "fp32" else r.precision))
        if r.system in peers and not r.error and mine is not None:
            print(f"  batch {r.batch_size:>4} {r.precision}: vs {r.system:<10} {mine.median_ms / r.median_ms:.2f}x "
                  f"({mine.median_ms:.2f} vs {r.median_ms:.2f} ms; {mine.peak_mb or 0:.0f} vs {r.peak_mb or 0:.0f} MB)")
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
