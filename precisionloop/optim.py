"""AdamW for bf16 weights with no fp32 master copy: the update in fp32, rounded to bf16 stochastically."""

from __future__ import annotations

import functools

import torch


def _round(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, up or down at random with the odds of its distance to each: unbiased on average."""
    # A random 16-bit number added below bf16's last bit carries into it with probability (the cut bits) / 2**16.
    bits = x.view(torch.int32) + torch.randint_like(x, 0, 1 << 16, dtype=torch.int32)
    return (bits & -(1 << 16)).view(torch.float32).to(torch.bfloat16)


def _update(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf):
    """AdamW on each parameter in fp32, bf16 tensors stored rounded stochastically; none where ``found_inf`` > 0."""
    skip = None if found_inf is None else found_inf > 0  # GradScaler sums the flags of several devices
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step.add_(1 if skip is None else (~skip).float())
        g = g.float() if grad_scale is None else g.float() / grad_scale
        m32 = m.float().lerp(g, 1 - beta1)
        v32 = v.float().lerp(g * g, 1 - beta2)
        denom = v32.sqrt() / (1 - beta2**step).sqrt() + eps
        p32 = p.float() * (1 - lr * weight_decay) - lr / (1 - beta1**step) * m32 / denom
        for t, t32 in ((p, p32), (m, m32), (v, v32)):
            new = _round(t32) if t.dtype == torch.bfloat16 else t32
            t.copy_(new if skip is None else torch.where(skip, t, new))


@functools.cache
def _compiled_update():
    """``_update`` as one graph for all the parameters (eager, each one's update is about twenty kernel launches);
    made on first use, so that importing precisionloop does not load torch.compile."""
    return torch.compile(_update, dynamic=False)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for ``precision="bf16-pure"``: the update runs in fp32 and each bf16 weight is rounded stochastically.

    Rounded up or down with the odds of its distance to each, a bf16 weight keeps on average the updates that
    rounding to nearest loses; the moments, kept in the parameter's dtype, are rounded alike, and an fp32 parameter
    (a ``keep_fp32`` module's) is updated in fp32. On CUDA a group's update is compiled on the first step; like
    torch's fused optimizers, it skips a step on the device. ``params``, ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are :class:`torch.optim.AdamW`'s; its other options only at their defaults.
    """

    bf16_stochastic_round = True  # what precision "bf16-pure" asks of an optimizer
    _step_supports_amp_scaling = True  # step reads GradScaler's grad_scale and found_inf attributes

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        torch.optim.AdamW([torch.empty(0)], lr, betas, eps, weight_decay)  # torch's checks of these, its messages
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _refuse_options(self, group: dict) -> None:
        for name, default in torch.optim.AdamW([torch.empty(0)]).defaults.items():  # the options its state_dict holds
            if name not in self.defaults and group.get(name, default) != default:
                raise ValueError(f"BF16AdamW has no {name}={group[name]!r}: leave it at {default!r}, "
                                 "or use torch.optim.AdamW.")

    def add_param_group(self, param_group: dict) -> None:
        self._refuse_options(param_group)
        super().add_param_group(param_group)
        if any(p.dtype == torch.float16 for p in param_group["params"]):
            self.param_groups.pop()  # the optimizer as it was
            raise ValueError("BF16AdamW cannot update fp16 weights (their moments underflow): use bf16 weights "
                             "or torch.optim.AdamW.")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        if any(p.grad is not None and p.grad.is_sparse for group in self.param_groups for p in group["params"]):
            raise ValueError("BF16AdamW cannot use a parameter's sparse gradient: make it dense, "
                             "or use torch.optim.SparseAdam.")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            if not params:
                continue
            states = [self.state[p] for p in params]
            tensors = [params, [p.grad for p in params], [s["exp_avg"] for s in states],
                       [s["exp_avg_sq"] for s in states]]
            if hasattr(params[0], "to_local"):  # FSDP2: the update is elementwise, so each rank updates its shard
                tensors = [[t.to_local() for t in ts] for ts in tensors]
            update = _compiled_update() if params[0].is_cuda else _update
            # The hyperparameters as fp32 tensors on the device: a new value (a scheduler's lr or momentum) is an
            # input, not a recompile, and no copy from the host (torch.full passes it to its kernel).
            hyper = [torch.full((), float(v), dtype=torch.float32, device=params[0].device)
                     for v in (group["lr"], *group["betas"], group["eps"], group["weight_decay"])]
            update(*tensors, [s["step"] for s in states], *hyper, getattr(self, "grad_scale", None),
                   getattr(self, "found_inf", None))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        for group in state_dict["param_groups"]:
            self._refuse_options(group)
        super().load_state_dict(state_dict)
        for p, state in self.state.items():  # torch's load leaves each step where it was saved
            state["step"] = state["step"].to(p.device)
