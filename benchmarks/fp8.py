"""Does fp8 pay, and does autotune know when? bf16 against fp8 at its default layers, and fp8's loss.

    PYTHONPATH=. python benchmarks/fp8.py --part transformer,resnet18 --json fp8.json
    PYTHONPATH=. python benchmarks/fp8.py --part vit_b_16,loss
    PYTHONPATH=. python benchmarks/fp8.py --part speed,loss,transformer --size large

Parts (comma-separated with --part):

- ``speed``: the recipe's Transformer stack at ``--size`` (``reference``: 4 layers, d_model 2048, d_ff
  8192; ``large``: d_model 4096, d_ff 16384, 32 heads, 877M parameters; 8 x 1024 tokens), ``Trainer``
  bf16 compiled against ``Trainer`` ``FP8Policy()`` compiled in interleaved rounds, a fresh instance each,
  pipelined on CUDA (``timing.time_block``); fp8's speed-up, paired per round.
- ``transformer``: the Transformer stack at ``--size``, ``precisionloop.autotune`` over bf16 compiled and
  ``FP8Policy()`` compiled, timed in interleaved rounds (plus its strict-fp32 loss reference); the
  speed-ups are paired per round against bf16 compiled.
- ``vit_b_16``: the same for torchvision's vit_b_16 at batch 128.
- ``resnet18``: the same for ResNet18 at batch 128; fp8 has no layer to convert there.
- ``loss``: 200 steps of the Transformer stack on a fixed synthetic task (noisy bigrams: the next
  token follows a fixed permutation half the time, else is uniform), ``Trainer`` bf16 compiled
  against ``Trainer`` fp8 compiled from the same weights on the same batches; the end loss is the
  mean of the last 20 steps (the task is noisy by design, so one step's loss is not a measurement),
  and fp8's over bf16's; at ``--size``.

Every system is ``Trainer.step`` (autotune's trials too) with AdamW, fused on CUDA.
Needs CUDA with compute capability 8.9+ and torchao for fp8; elsewhere fp8 is declined and said so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
from torch import nn

from precisionloop import FP8Policy, Trainer, autotune, get_policy
from precisionloop import fp8 as fp8_module
from precisionloop.measure import format_memory, format_time
from precisionloop.recipes import models
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.recipes.timing import Measurement, Run, choose_method, format_ratio, interleaved, paired_ratio
from precisionloop.tuning import Candidate

PARTS = ("speed", "transformer", "vit_b_16", "resnet18", "loss")


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, fused=torch.cuda.is_available())


def _model_and_batch(part: str, args, device: torch.device):
    if part == "transformer":
        ref = _sizes(args)
        return _stack(ref), models.random_tokens(args.seq_batch, ref["seq_len"], ref["vocab"], device), models.lm_loss
    torch.manual_seed(0)
    image = 32 if args.tiny else 224
    return bench.build_model(part), bench.random_batch(args.image_batch, image, device), nn.functional.cross_entropy


def _sizes(args) -> dict:
    return models.TINY if args.tiny else models.SIZES[args.size]


def _stack(sizes: dict) -> nn.Module:
    return models.TransformerStack(sizes["layers"], sizes["d_model"], sizes["d_ff"], sizes["heads"], sizes["vocab"],
                                   sizes["seq_len"])


def tune(part: str, args, device: torch.device) -> dict:
    """autotune over bf16 and fp8, both compiled; each candidate's time and its speed-up over bf16 compiled."""
    model, batch, loss_fn = _model_and_batch(part, args, device)
    print(f"\n== {part}: autotune over bf16 and fp8, compiled ({args.rounds} rounds of {args.warmup}+{args.iters} steps)")
    result = autotune(model, adamw, batch, candidates=[Candidate("bf16", compile=True), Candidate("fp8", compile=True)],
                      device=device, loss_fn=loss_fn, steps=args.iters, warmup=args.warmup, rounds=args.rounds,
                      tolerance=args.tolerance)
    base = next(r for r in result.results if r.candidate == Candidate("bf16", compile=True))
    rows = []
    for r in result.results:
        row = {"candidate": r.candidate.label, "timing": Measurement(**vars(r.timing)).to_dict(),
               "rejected": r.rejected, "drift": r.drift, "chosen": r.candidate == result.best}
        if r.timing.rounds_ms and base.timing.rounds_ms and r is not base:
            median, low, high = paired_ratio(r.timing, base.timing)  # candidate / bf16 time, per round
            row["speedup_vs_bf16"] = [1 / median, 1 / high, 1 / low]  # median, min, max
            print(f"  {r.candidate.label}: {format_ratio(tuple(row['speedup_vs_bf16']))} the speed of bf16 compiled"
                  f"{' (CHOSEN)' if row['chosen'] else ''}")
        rows.append(row)
    print(f"  chosen: {result.best.label}")
    return {"part": part, "chosen": result.best.label, "candidates": rows}


def _policies(args, device: torch.device) -> dict:
    """bf16, and ``FP8Policy()`` where it can run (emulated with --tiny); why fp8 was declined is printed."""
    policies = {"bf16": get_policy("bf16"), "fp8": FP8Policy(emulate=args.tiny)}
    try:
        fp8_module.require_torchao()
        fp8_module.check_device(device, emulate=args.tiny)
    except ValueError as e:
        print(f"  fp8 declined, only bf16 runs: {e}")
        del policies["fp8"]
    return policies


def _trainer_factory(policy, args, device: torch.device):
    """A fresh Transformer (seed 0) and Trainer per call, compiled on CUDA, stepping one fixed batch."""
    sizes = _sizes(args)

    def build() -> Run:
        torch.manual_seed(0)
        with device:  # built where it trains: initialising 877M parameters on the host takes seconds
            model = _stack(sizes)
        trainer = Trainer(model, adamw(model.parameters()), policy, device=device, compile=device.type == "cuda",
                          loss_fn=models.lm_loss)
        batch = trainer.to_device(models.random_tokens(args.seq_batch, sizes["seq_len"], sizes["vocab"], device))
        return Run(lambda: trainer.step(batch), context=policy.backend_flags)

    return build


def speed(args, device: torch.device) -> dict:
    """Trainer bf16 compiled against Trainer fp8 compiled, interleaved rounds: fp8's speed-up (bf16 time / fp8 time)."""
    method, why = choose_method(device, compiled=device.type == "cuda")
    sizes = _sizes(args)
    print(f"\n== speed: {models.describe(sizes)}, batch {args.seq_batch} x {sizes['seq_len']} tokens, bf16 against fp8, "
          f"Trainer {'compiled' if device.type == 'cuda' else 'eager'}, {args.rounds} rounds of {args.warmup}+{args.iters} "
          "steps\n"
          f"  timing: {method} (why: {why})")
    policies = _policies(args, device)
    timed = interleaved({name: _trainer_factory(p, args, device) for name, p in policies.items()}, rounds=args.rounds,
                        iters=args.iters, warmup=args.warmup, device=device, pipelined=method == "pipelined")
    for name, m in timed.items():
        reserved = f", reserved {m.reserved_mb:.0f} MB" if m.reserved_mb is not None else ""
        print(f"  {name}: {format_time(m)}, peak {format_memory(m)}{reserved}" + (f"; error: {m.error}" if m.error else ""))
    out = {"sizes": sizes, "model": models.describe(sizes), "batch": args.seq_batch, "method": method,
           "timings": {name: m.to_dict() for name, m in timed.items()}, "speedup_fp8_vs_bf16": None}
    bf16, fp8 = timed["bf16"], timed.get("fp8")
    if fp8 is not None and fp8.rounds_ms and len(fp8.rounds_ms) == len(bf16.rounds_ms):
        median, low, high = paired_ratio(fp8, bf16)  # fp8 time / bf16 time, per round
        out["speedup_fp8_vs_bf16"] = [1 / median, 1 / high, 1 / low]  # median, min, max
        print(f"  fp8 compiled: {format_ratio(tuple(out['speedup_fp8_vs_bf16']))} the speed of bf16 compiled "
              "(per-round ratios, rounds paired in time)")
    return out


def loss_curves(args, device: torch.device) -> dict:
    """bf16 and fp8 Trainers (compiled, fused AdamW) from the same weights on the same noisy-bigram batches."""
    ref = _sizes(args)
    data = models.noisy_bigrams(args.loss_steps, args.seq_batch, ref["seq_len"], ref["vocab"], device)
    torch.manual_seed(0)
    init = _stack(ref).state_dict()
    print(f"\n== loss: {models.describe(ref)}, {args.loss_steps} steps of batch {args.seq_batch} x {ref['seq_len']} "
          f"noisy bigrams, bf16 against fp8, Trainer {'compiled' if device.type == 'cuda' else 'eager'}, the same "
          "weights and batches")
    policies = _policies(args, device)
    curves = {}
    for name, policy in policies.items():
        with device:
            model = _stack(ref)
        model.load_state_dict(init)
        trainer = Trainer(model, adamw(model.parameters()), policy, device=device, compile=device.type == "cuda",
                          loss_fn=models.lm_loss)
        curves[name] = [float(trainer.step(b).loss) for b in data]
        print(f"  {name}: first loss {curves[name][0]:.4f}, skipped {trainer.stats.skipped}")
    tail = min(20, args.loss_steps)
    ends = {k: statistics.fmean(v[-tail:]) for k, v in curves.items()}
    if "fp8" not in ends:
        return {"steps": args.loss_steps, "tail": tail, "end_loss": ends, "relative_gap": None, "ratio": None,
                "sizes": ref, "curves": curves}
    gap = ends["fp8"] / ends["bf16"] - 1
    print(f"== loss over {args.loss_steps} steps, mean of the last {tail}: bf16 {ends['bf16']:.4f}, fp8 {ends['fp8']:.4f}, "
          f"fp8 / bf16 {ends['fp8'] / ends['bf16']:.4f} ({100 * gap:+.2f}%); "
          f"last step: bf16 {curves['bf16'][-1]:.4f}, fp8 {curves['fp8'][-1]:.4f}")
    return {"steps": args.loss_steps, "tail": tail, "end_loss": ends, "relative_gap": gap, "ratio": 1 + gap,
            "sizes": ref, "curves": curves}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="transformer,vit_b_16,resnet18,loss", help=f"comma-separated among {', '.join(PARTS)}")
    p.add_argument("--size", choices=tuple(models.SIZES), default=None,
                   help="the Transformer's size for the speed, transformer and loss parts: " + "; ".join(
                       f"{name}: {models.describe(sizes)}" for name, sizes in models.SIZES.items()) + "; default reference")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seq-batch", type=int, default=8, help="sequences of 1024 tokens per Transformer batch")
    p.add_argument("--image-batch", type=int, default=128)
    p.add_argument("--loss-steps", type=int, default=200)
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="autotune's loss-drift limit against strict fp32 (vit_b_16 memorising one random batch with "
                        "AdamW parts from fp32 by ~0.2 in bf16 within 30 steps: raise it there)")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true",
                   help="a tiny Transformer, 32-px images, emulated fp8 for the loss part: a smoke run (on the CPU); "
                        "its figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny and args.size is not None:
        p.error(f"--tiny runs its own tiny Transformer, so --size {args.size} would be ignored: pass one of the two")
    args.size = args.size or "reference"
    parts = [s.strip() for s in args.part.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad:
        p.error(f"--part {', '.join(bad)}: unknown; valid: {', '.join(PARTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torchao": _torchao_version(), "fp8 recipe": FP8Policy().recipe}
    print(f"fp8 benchmark, {env}")
    report = {"environment": env, "args": vars(args), "parts": {}}
    for part in parts:
        run = {"loss": loss_curves, "speed": speed}.get(part)
        report["parts"][part] = run(args, device) if run else tune(part, args, device)
        if args.json:  # after each part: a later part that fails or times out loses nothing
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    return report


def _torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


if __name__ == "__main__":
    main()
