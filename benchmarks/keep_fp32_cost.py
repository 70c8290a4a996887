"""What keeping modules in fp32 costs: a model under bf16 with and without ``keep_fp32``, in interleaved rounds.

    PYTHONPATH=. python benchmarks/keep_fp32_cost.py --model vit_b_16 --batch-size 128 --keep LayerNorm

Both systems are ``Trainer.step`` with the same fused AdamW; only the policy differs. Reported: the
median step time over rounds with its spread, the ratio paired in time, and peak memory. With
--explain, also the graphs and graph breaks torch.compile's dynamo finds in one forward of the kept model.
"""

from __future__ import annotations

import argparse
import json

import torch

from precisionloop import BF16Policy, Trainer
from precisionloop.measure import format_memory, format_time
from precisionloop.recipes import resnet18_bench as bench
from precisionloop.recipes.timing import Run, format_ratio, interleaved, paired_ratio


def _entries(text: str) -> tuple:
    """keep_fp32 entries from comma-separated names: a ``torch.nn`` class by its name (``"LayerNorm, head"``), else
    a module-name pattern."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return tuple(getattr(torch.nn, n) if isinstance(getattr(torch.nn, n, None), type) else n for n in names)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_b_16")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--keep", default="LayerNorm", help="comma-separated keep_fp32 entries")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--explain", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policies = {"bf16": BF16Policy(), f"bf16 keep_fp32={args.keep}": BF16Policy(keep_fp32=_entries(args.keep))}

    def factory(policy):
        def build() -> Run:
            model = bench.build_model(args.model)
            trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda"), policy,
                              device=device, distributed=None)
            batch = trainer.to_device(bench.random_batch(args.batch_size, args.image_size, device))
            return Run(lambda: trainer.step(batch))
        return build

    timings = interleaved({name: factory(policy) for name, policy in policies.items()}, rounds=args.rounds,
                          iters=args.iters, warmup=args.warmup, device=device)
    base, kept = timings.values()
    print(f"{args.model} batch {args.batch_size} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {args.rounds} rounds of {args.warmup}+{args.iters} steps, fused AdamW")
    for name, m in timings.items():
        print(f"  {name:<40} {format_time(m):>28}  {format_memory(m):>10}")
    ratio = paired_ratio(kept, base)
    print(f"  keep_fp32 / plain bf16: {format_ratio(ratio)}")
    report = {"model": args.model, "batch_size": args.batch_size, "torch": torch.__version__,
              "systems": {k: m.to_dict() for k, m in timings.items()}, "ratio": ratio}
    if args.explain:
        model = bench.build_model(args.model).to(device)
        policy = policies[list(policies)[1]]
        model = policy.prepare_model(model)
        x = bench.random_batch(2, args.image_size, device)[0]
        with policy.autocast(device.type):
            explained = torch._dynamo.explain(model)(x)
        print(f"  dynamo on the kept model: {explained.graph_count} graph(s), {explained.graph_break_count} graph break(s)")
        report["graphs"], report["graph_breaks"] = explained.graph_count, explained.graph_break_count
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
