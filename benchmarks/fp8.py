"""Does fp8 pay, and does autotune know when? bf16 against fp8 (its layer sets), and fp8's loss.

    PYTHONPATH=. python benchmarks/fp8.py --part transformer,resnet18 --json fp8.json
    PYTHONPATH=. python benchmarks/fp8.py --part vit_b_16,loss

Parts (comma-separated with --part):

- ``transformer``: the recipe's Transformer stack (4 layers, d_model 2048, d_ff 8192, 8 x 1024 tokens),
  ``precisionloop.autotune`` over bf16 compiled and fp8 compiled. autotune makes fp8 three layer
  sets (``FP8Policy()``'s default layers, every layer fp8 can take, and the per-layer set it
  measured to gain), and times all of them in interleaved rounds (plus its strict-fp32 loss
  reference); the speed-ups are paired per round against bf16 compiled.
- ``vit_b_16``: the same for torchvision's vit_b_16 at batch 128.
- ``resnet18``: the same for ResNet18 at batch 128; fp8 has no layer to convert there.
- ``loss``: 200 steps of the Transformer stack on a fixed synthetic task (noisy bigrams: the next
  token follows a fixed permutation half the time, else is uniform), ``Trainer`` bf16 compiled
  against ``Trainer`` fp8 compiled from the same weights on the same batches; the end loss is the
  mean of the last 20 steps (the task is noisy by design, so one step's loss is not a measurement).

Every system is the library's own step (autotune's trials, ``Trainer.step``) with fused AdamW.
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
from precisionloop.measure import format_ratio, paired_ratio
from precisionloop.recipes import models
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.tuning import Candidate

PARTS = ("transformer", "vit_b_16", "resnet18", "loss")


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
    return models.TINY if args.tiny else models.REFERENCE


def _stack(sizes: dict) -> nn.Module:
    return models.TransformerStack(sizes["layers"], sizes["d_model"], sizes["d_ff"], sizes["heads"], sizes["vocab"],
                                   sizes["seq_len"])


def tune(part: str, args, device: torch.device) -> dict:
    """autotune over bf16 and fp8, both compiled; each candidate's time and its speed-up over bf16 compiled."""
    model, batch, loss_fn = _model_and_batch(part, args, device)
    print(f"\n== {part}: autotune over bf16 and fp8, compiled ({args.rounds} rounds of {args.warmup}+{args.iters} steps)")
    result = autotune(model, adamw, batch, [Candidate("bf16", compile=True), Candidate("fp8", compile=True)],
                      device=device, loss_fn=loss_fn, steps=args.iters, warmup=args.warmup, rounds=args.rounds,
                      tolerance=args.tolerance)
    base = next(r for r in result.results if r.candidate == Candidate("bf16", compile=True))
    rows = []
    for r in result.results:
        row = {"candidate": r.candidate.label, "layers": dict(r.candidate.options).get("layers"),
               "timing": r.timing.to_dict() if r.timing else None, "rejected": r.rejected, "drift": r.drift,
               "chosen": r.candidate == result.best}
        if r.timing is not None and r.timing.rounds_ms and base.timing.rounds_ms and r is not base:
            median, low, high = paired_ratio(r.timing, base.timing)  # candidate / bf16 time, per round
            row["speedup_vs_bf16"] = [1 / median, 1 / high, 1 / low]  # median, min, max
            print(f"  {r.candidate.label}: {format_ratio(tuple(row['speedup_vs_bf16']))} the speed of bf16 compiled"
                  f"{' (CHOSEN)' if row['chosen'] else ''}")
        rows.append(row)
    print(f"  chosen: {result.best.label}")
    return {"part": part, "chosen": result.best.label, "candidates": rows}


def noisy_bigrams(steps: int, batch: int, seq_len: int, vocab: int, device: torch.device, seed: int = 0):
    """``steps`` (inputs, targets) batches: each next token is perm[token] with probability 1/2, else uniform."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq_len + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        follow = torch.rand(batch, seq_len, generator=g) < 0.5
        noise = torch.randint(0, vocab, (batch, seq_len), generator=g)
        for t in range(seq_len):
            ids[:, t + 1] = torch.where(follow[:, t], perm[ids[:, t]], noise[:, t])
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def loss_curves(args, device: torch.device) -> dict:
    """bf16 and fp8 Trainers (compiled, fused AdamW) from the same weights on the same noisy-bigram batches."""
    ref = _sizes(args)
    data = noisy_bigrams(args.loss_steps, args.seq_batch, ref["seq_len"], ref["vocab"], device)
    torch.manual_seed(0)
    init = _stack(ref).state_dict()
    policies = {"bf16": get_policy("bf16"), "fp8": FP8Policy(emulate=args.tiny)}
    try:
        fp8_module.require_torchao()
        fp8_module.check_device(device, emulate=args.tiny)
    except ValueError as e:
        print(f"  fp8 declined, only bf16 runs: {e}")
        del policies["fp8"]
    curves = {}
    for name, policy in policies.items():
        model = _stack(ref)
        model.load_state_dict(init)
        trainer = Trainer(model, adamw(model.parameters()), policy, device=device, compile=device.type == "cuda",
                          loss_fn=models.lm_loss)
        curves[name] = [float(trainer.step(b).loss) for b in data]
        print(f"  {name}: first loss {curves[name][0]:.4f}, skipped {trainer.stats.skipped}")
    tail = min(20, args.loss_steps)
    ends = {k: statistics.fmean(v[-tail:]) for k, v in curves.items()}
    if "fp8" not in ends:
        return {"steps": args.loss_steps, "tail": tail, "end_loss": ends, "relative_gap": None, "curves": curves}
    gap = ends["fp8"] / ends["bf16"] - 1
    print(f"== loss over {args.loss_steps} steps, mean of the last {tail}: bf16 {ends['bf16']:.4f}, fp8 {ends['fp8']:.4f} "
          f"({100 * gap:+.2f}%); last step: bf16 {curves['bf16'][-1]:.4f}, fp8 {curves['fp8'][-1]:.4f}")
    return {"steps": args.loss_steps, "tail": tail, "end_loss": ends, "relative_gap": gap, "curves": curves}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="transformer,vit_b_16,resnet18,loss", help=f"comma-separated among {', '.join(PARTS)}")
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
        report["parts"][part] = loss_curves(args, device) if part == "loss" else tune(part, args, device)
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
