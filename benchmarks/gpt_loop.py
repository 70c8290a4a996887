"""What precisionloop's Trainer costs where the host bounds the step: a compiled GPT that reads its loss every step.

    PYTHONPATH=. python benchmarks/gpt_loop.py --json gpt_loop.json
    PYTHONPATH=. python benchmarks/gpt_loop.py --before path/to/old/precisionloop   # also an older copy, same process

nanoGPT's shakespeare-char shape (6 layers, 6 heads, 384 wide, block 256, vocab 65, no dropout) trains on one
device-resident batch of 64 x 256 random tokens under bf16 autocast with fused AdamW and clipping at 1.0. Each step
reads its loss on the host, as a script logging every iteration does, so the host's time before a step's first kernel
is not hidden behind the step before. Systems: ``hand``, nanoGPT's step written out (under the bf16 policy's backend
flags); ``trainer``, ``Trainer.step(batch).loss``; with --before, ``trainer-before``. Timed by ``timing.interleaved``,
a fresh instance per system and round (compiled on CUDA: back to back; eager on CUDA: alternating step by step; off
CUDA: alone; --method picks another); the cost is each round's ratio to ``hand``, paired in time.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loop_cost import load_before  # the sibling script
import precisionloop
from precisionloop.measure import format_time, noisy_legend
from precisionloop.recipes.timing import METHODS, Run, choose_method, format_ratio, interleaved, paired_ratio
from precisionloop.recipes import resnet18_bench as bench

VOCAB = 65  # shakespeare-char's characters


class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, each added to the residual stream; no biases."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(),
                                 nn.Linear(4 * width, width, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, the blocks, a final LayerNorm and a head tied to the token embedding."""

    def __init__(self, layers: int, width: int, heads: int, block: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() == 2:  # a small init, so the tied head starts near a uniform guess
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))  # logits only: the loss is the loop's


def flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _model_and_optimizer(args) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every system starts from the same weights
    model = GPT(args.layers, args.width, args.heads, args.block).to(args.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True)


def _hand(args, batch) -> Run:
    model, optimizer = _model_and_optimizer(args)
    if args.mode != "none":
        model.compile(mode=args.mode)
    x, y = batch

    def step() -> float:
        if args.mode == "reduce-overhead":  # the last step's graph outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = flat_cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    # The Trainer's TF32 and cudnn flags, so the two loops differ only in the loop (fp32 sets none: the script's own).
    flags = precisionloop.get_policy(args.precision, args.device).backend_flags
    return Run(step, context=functools.partial(flags, args.device.type))


def _trainer(package, args, batch) -> Run:
    """``package.Trainer``'s step; only arguments both this and an older package take, no subclass."""
    model, optimizer = _model_and_optimizer(args)
    trainer = package.Trainer(model, optimizer, args.precision, device=args.device, max_grad_norm=1.0, distributed=None,
                              compile=False if args.mode == "none" else args.mode, loss_fn=flat_cross_entropy)
    return Run(lambda: trainer.step(batch).loss)  # .loss reads the loss on the host


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--rounds", 4), ("--iters", 50), ("--warmup", 10), ("--layers", 6), ("--width", 384),
                          ("--heads", 6), ("--batch", 64), ("--block", 256)):
        p.add_argument(flag, type=int, default=default, help=f"default {default}")
    p.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "none"),
                   help="torch.compile's mode for both loops (nanoGPT's torch.compile(model) is default); none: eager")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="fp32: the script turns TF32 on at its top, as nanoGPT does, and trains without autocast")
    p.add_argument("--method", default="auto", choices=("auto", *METHODS),
                   help="how steps are timed; auto: timing.choose_method's (compiled on CUDA: pipelined). The loop "
                        "reads its loss every step, so alternating hides no host time and moves drift alike")
    p.add_argument("--before", default=None, help="path to an older precisionloop package directory")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    # The warm-up must hold the compile and, under reduce-overhead, the CUDA graphs' warm-up and recording steps.
    lows = {f: 1 for f in ("rounds", "iters", "layers", "width", "heads", "batch", "block")}
    lows["warmup"] = {"none": 0, "default": 1, "reduce-overhead": 3}[args.mode]
    for flag, low in lows.items():
        if getattr(args, flag) < low:  # before any timing, so nothing measured is lost
            p.error(f"--{flag} must be >= {low} (--mode {args.mode}), got {getattr(args, flag)}")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    bench.check_output(p, "--json", args.json)
    args.device = bench.parse_device(p, args.device)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.precision == "fp32":  # what the script does at its top; the Trainer's "fp32" leaves it so
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    before = load_before(args.before) if args.before else None
    tokens = torch.randint(VOCAB, (args.batch, args.block + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1].contiguous().to(args.device), tokens[:, 1:].contiguous().to(args.device))  # next tokens
    systems = {"hand": lambda: _hand(args, batch), "trainer": lambda: _trainer(precisionloop, args, batch)}
    if before is not None:
        systems["trainer-before"] = lambda: _trainer(before, args, batch)
    method = choose_method(args.device, args.mode != "none", args.method)[0]
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    print(f"GPT {args.layers} layers x {args.width} wide, {args.heads} heads, batch {args.batch} x {args.block}, {args.precision},"
          f" compile {args.mode}, on {name}: steps timed {method}", flush=True)
    timings = interleaved(systems, rounds=args.rounds, iters=args.iters, warmup=args.warmup, device=args.device,
                          pipelined=method == "pipelined", blocks=args.iters if method == "alternating" else 1)
    report = {"torch": torch.__version__, "device": name, "args": vars(args) | {"device": str(args.device)},
              "systems": {}}
    for system, m in timings.items():
        paired = system != "hand" and m.rounds_ms and len(m.rounds_ms) == len(timings["hand"].rounds_ms)
        ratio = paired_ratio(m, timings["hand"]) if paired else None  # rounds lost to an error pair with none
        print(f"  {system:<16} {format_time(m):>28}  {format_ratio(ratio) + ' vs hand' if ratio else ''}"
              f"{'error: ' + m.error.strip().splitlines()[0][:160] if m.error else ''}", flush=True)
        report["systems"][system] = {**m.to_dict(), "vs_hand": ratio}
    if noisy_legend(timings.values()):
        print(noisy_legend(timings.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
