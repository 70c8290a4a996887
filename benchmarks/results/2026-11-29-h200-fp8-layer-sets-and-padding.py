"""Experiment: fp8 padding and layer sets on the reference Transformer, same process, interleaved."""
import contextlib, dataclasses, sys, json
import torch
from precisionloop import BF16Policy, FP8Policy, Trainer
from precisionloop import fp8 as fp8mod
from precisionloop.fp8_tuning import choose_fp8_layers
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time
from precisionloop.recipes import models

dev = torch.device("cuda")
ref = models.REFERENCE
real_config = fp8mod.config

@contextlib.contextmanager
def pad(flag):
    fp8mod.config = lambda r, e: dataclasses.replace(real_config(r, e), pad_inner_dim=flag)
    try:
        yield
    finally:
        fp8mod.config = real_config

def stack():
    torch.manual_seed(0)
    return models.TransformerStack(ref["layers"], ref["d_model"], ref["d_ff"], ref["heads"], ref["vocab"], ref["seq_len"])

batch = models.random_tokens(8, ref["seq_len"], ref["vocab"], dev)
everything = tuple(n for n, m in stack().named_modules() if isinstance(m, torch.nn.Linear))
mlp_head = tuple(n for n in everything if ".mlp." in n or n == "head")

if "layers" in sys.argv:
    model = stack().to(dev)
    with pad(False):
        choice = choose_fp8_layers(model, batch, lambda m, b: m(b[0]), dev, iters=20, warmup=10, rounds=3)
    print(choice, flush=True)

def factory(policy, padded):
    def build():
        model = stack()
        with pad(padded):
            t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), policy, device=dev,
                        compile=True, loss_fn=models.lm_loss)
        b = t.to_device(batch)
        return Run(lambda: t.step(b))
    return build

systems = {
    "bf16": factory(BF16Policy(), True),
    "fp8 default pad": factory(FP8Policy(), True),
    "fp8 default nopad": factory(FP8Policy(), False),
    "fp8 all nopad": factory(FP8Policy(layers=everything), False),
    "fp8 mlp+head nopad": factory(FP8Policy(layers=mlp_head), False),
}
with torch._dynamo.config.patch(recompile_limit=64):
    res = interleaved(systems, rounds=3, iters=20, warmup=10, device=dev)
base = res["bf16"]
for k, m in res.items():
    r = paired_ratio(base, m) if m.rounds_ms else None
    print(f"{k:22} {format_time(m):30} {m.peak_mb or 0:8.0f} MB  speed-up {format_ratio(r) if r else m.error}", flush=True)
