"""Would a CUDA-graph-captured guarded optimizer step pay? ResNet18 b32 at argv[1] px, bf16, fused SGD (momentum),
compiled forward/backward (reduce-overhead), in alternating blocks: the hand loop (eager optimizer step, no check);
the hand loop whose check + fused step + verdict row is one captured graph (grads copied into static buffers with
one foreach copy); Trainer.step. A prototype in a benchmark script, not library code."""
import json, os, sys
import torch
from torch import nn
sys.path.insert(0, "benchmarks")
import loop_cost as lc
import precisionloop
from precisionloop.measure import Run, interleaved, paired_ratio, format_ratio, format_time

IMG, ROUNDS = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda")
args = type("A", (), {"model": "resnet18", "image_size": IMG, "device": dev})()
cfg = lc.Config(32, "fused-sgd", True)
flags = precisionloop.get_policy("bf16").backend_flags


def graphed():
    model = lc.bench.build_model("resnet18").to(dev, memory_format=torch.channels_last)
    model.compile(mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    x, y = lc.bench.random_batch(32, IMG, dev)
    x = x.contiguous(memory_format=torch.channels_last)
    params = list(model.parameters())
    static = [torch.zeros_like(p) for p in params]
    found, inv = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    rows = torch.zeros(64, 2, device=dev)
    loss_buf = torch.zeros((), device=dev)
    at = {"i": 0}

    def forward_backward():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def post():
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(static, found, inv)
        opt.grad_scale, opt.found_inf = None, found
        opt.step()
        del opt.grad_scale, opt.found_inf

    with flags():
        for _ in range(3):  # eager steps: momentum buffers exist before capture
            forward_backward(); opt.step(); opt.zero_grad(set_to_none=True)
        for p, s in zip(params, static):
            p.grad = s  # the captured step reads the static buffers
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                post()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            post()
            torch.stack([found[0], loss_buf], out=rows[0])  # the verdict row (fixed slot in the prototype)
        opt.zero_grad(set_to_none=True)

    def step():
        loss = forward_backward()
        torch._foreach_copy_(static, [p.grad for p in params])
        loss_buf.copy_(loss.detach())
        graph.replay()
        opt.zero_grad(set_to_none=True)
    return Run(step, context=flags)


def trainer():
    model = lc.bench.build_model("resnet18")
    t = precisionloop.Trainer(model, lc.OPTIMIZERS["fused-sgd"](model.parameters()), "bf16", device=dev, compile=True,
                              distributed=None)
    b = t.to_device(lc.bench.random_batch(32, IMG, dev))
    return Run(lambda: t.step(b), context=flags)  # flags held, as fit holds them


systems = {"hand": lambda: lc._hand(cfg, args), "hand+captured guarded step": graphed, "Trainer.step (flags held)": trainer}
res = interleaved(systems, rounds=ROUNDS, iters=80, warmup=15, device=dev, blocks=8)
print(f"compiled b32 at {IMG}px, torch {torch.__version__}, {ROUNDS} rounds of 80 steps in 8 blocks")
for n, m in res.items():
    r = paired_ratio(m, res["hand"]) if m.rounds_ms else None
    print(f"  {n:<28} {format_time(m) if m.rounds_ms else '':>28} {format_ratio(r) if r else m.error}", flush=True)
json.dump({n: m.to_dict() for n, m in res.items()}, open(os.path.join(os.environ.get("OUT", "."), f"graphopt-{IMG}px.json"), "w"), indent=1)
