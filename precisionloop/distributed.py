"""torchrun support: the process group, DDP and FSDP2 wrapping under a precision policy, data sharding.

It adds to torch.distributed only what the policy decides and what lets one script run on one process or many.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from . import _compat
from . import keep_fp32 as fp32_modules
from .guard import FiniteGuard, GradientGuard, ScalerGuard
from .policy import PrecisionPolicy

log = logging.getLogger(__name__)

MODES = ("auto", "ddp", "fsdp", None)


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if _initialised() else 1


def rank() -> int:
    return dist.get_rank() if _initialised() else 0


def is_main() -> bool:
    return rank() == 0


def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve(mode: str | None, device: torch.device | None) -> tuple[str | None, torch.device | None]:
    """The effective mode ("ddp", "fsdp" or None) and device (None: the caller's default); starts the group if needed.

    Raises:
        ValueError: an unknown mode, or "ddp"/"fsdp" outside torchrun with no process group.
    """
    if mode not in MODES:
        raise ValueError(f"distributed must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}")
    if mode is None:
        return None, device
    if device is not None and device.type == "cuda" and device.index is None and _launched():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" means this rank's GPU
    initialised = _initialised()
    if mode == "auto":
        if not (int(os.environ.get("WORLD_SIZE", "1")) > 1 or (initialised and dist.get_world_size() > 1)):
            return None, device
        mode = "ddp"
    if not initialised and not _launched():
        raise ValueError(f"distributed={mode!r} needs torchrun (RANK and WORLD_SIZE set) or an initialised "
                         "process group; use distributed=None to train in one process")
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    on_cuda = device is not None and device.type == "cuda"
    if on_cuda:  # a bare "cuda" in a group the caller started is its current GPU
        device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # before NCCL starts, so each rank owns its GPU
    if not initialised:
        backend = "nccl" if on_cuda else "gloo"
        dist.init_process_group(backend)
        if dist.get_rank() == 0:
            log.info("initialised the %s process group over %d processes", backend, dist.get_world_size())
    return mode, device


# torch's fused kernels that take FSDP2's DTensors; SGD's and Adagrad's raise "does not have a sharding strategy ..."
FSDP_FUSED = (torch.optim.Adam, torch.optim.AdamW)


def _refuse_state(optimizer: torch.optim.Optimizer) -> None:
    if optimizer.state:
        raise ValueError("distributed='fsdp' replaces the parameters: build the Trainer before the optimizer has state")


def check_optimizer(optimizer: torch.optim.Optimizer, mode: str | None) -> None:
    """Refuse, at construction, an optimizer FSDP2 cannot take: one with state, or a fused one its DTensors would crash.

    Raises:
        ValueError: the optimizer has state, or is fused and not among :data:`FSDP_FUSED`.
    """
    if mode != "fsdp":
        return
    _refuse_state(optimizer)
    if any(g.get("fused") for g in optimizer.param_groups) and type(optimizer) not in FSDP_FUSED:
        raise ValueError(
            f"distributed='fsdp' cannot run a fused {type(optimizer).__name__}: FSDP2 shards parameters into "
            "DTensors, and torch has no DTensor rule for its fused kernel. Fused Adam and AdamW work; for "
            f"{type(optimizer).__name__}, build it with fused=False (the foreach implementation)")


def may_fuse(optimizer: torch.optim.Optimizer, mode: str | None) -> bool:
    """Whether the Trainer may switch a default optimizer to its fused kernel under this mode."""
    return mode != "fsdp" or type(optimizer) in FSDP_FUSED


def is_wrapped(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, (nn.parallel.DistributedDataParallel, FSDPModule))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and inside a ``torch.compile`` wrapper (its names, as checkpoints hold them)."""
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    inner = _compat.compiled_original(model)
    return model if inner is None else inner  # not `or`: an empty Sequential is falsy


def wrap(model: nn.Module, mode: str, policy: PrecisionPolicy, device: torch.device, optimizer: torch.optim.Optimizer) -> nn.Module:
    """DDP-wrap or FSDP2-shard ``model`` (one the user wrapped is returned as it is).

    Under FSDP2, ``policy.prepare_sharding`` readies the model just before it is sharded, the policy's compute
    dtype sets the parameter dtype, and ``optimizer`` is repointed at the sharded parameters by name.

    Raises:
        ValueError: under FSDP2, before anything is sharded: the optimizer has state or holds a tensor that
            is not a parameter of the model, ``prepare_sharding`` refuses the model or drops a name.
    """
    if is_wrapped(model):
        return model  # the user already chose how to distribute it
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    _refuse_state(optimizer)
    # Named before prepare_sharding and fully_shard replace the Parameter objects, to repoint the optimizer.
    names = {id(p): n for n, p in model.named_parameters()}
    held = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if any(n is None for group in held for n in group):
        raise ValueError("distributed='fsdp' repoints the optimizer at the sharded parameters by name, so it must "
                         "hold only parameters of the model")
    model = policy.prepare_sharding(model)
    ready = {n for n, _ in model.named_parameters()}
    missing = [n for group in held for n in group if n not in ready]
    if missing:
        raise ValueError(f"{type(policy).__name__}.prepare_sharding returned a model without parameter(s) "
                         f"{', '.join(missing[:3])} that the optimizer holds; it must keep the parameter names")
    model = _shard(model, policy, device)
    sharded = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, held):
        group["params"] = [sharded[n] for n in group_names]
    return model


def _shard(model: nn.Module, policy: PrecisionPolicy, device: torch.device) -> nn.Module:
    """``fully_shard`` kept modules and affine batch norms (fp32), then each child of the root, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    # The Trainer's device: fully_shard's default mesh takes the machine's accelerator, even for a CPU run.
    mesh = init_device_mesh(device.type, (world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype if policy.compute_dtype != torch.float32 else None,
                              reduce_dtype=torch.float32)
    # Batch norms keep fp32 parameters for their fp32 running statistics (as autocast does); keep_fp32 modules too.
    fp32_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in reversed(list(model.modules())):  # inner modules first: fully_shard goes bottom-up
        kept = fp32_modules.is_kept(module) or (_compat.is_batch_norm(module) and module.affine)
        if kept and module is not model and any(True for _ in module.parameters()):  # the root is sharded last
            fully_shard(module, mesh=mesh, mp_policy=fp32_mp)
    if fp32_modules.is_kept(model):
        mp = fp32_mp  # the whole model runs in fp32 under its kept forward
    for child in model.children():
        if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) inside the block."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def average_gradients(model: nn.Module, params: list[nn.Parameter]) -> None:
    """All-reduce gradients that a no_sync backward left local (DDP); FSDP2 cannot do this after the fact."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise RuntimeError("an accumulation window under FSDP ended without a synchronising backward; "
                           "let fit() close epochs, or make the window complete before flush()")
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
    _compat.foreach_div_(grads, world_size())


def adapt_guard(guard: GradientGuard, mode: str | None, device_type: str) -> GradientGuard:
    """Make a policy's gradient guard agree across ranks: FSDP's sharded scaler, or an all-reduced inf check.

    Under DDP a GradScaler needs nothing more: every rank unscales the same all-reduced gradients."""
    if mode is None:
        return guard
    if isinstance(guard, ScalerGuard) and mode == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        s = guard.scaler
        return ScalerGuard(ShardedGradScaler(device_type, init_scale=s.get_scale(), growth_factor=s.get_growth_factor(),
                                             backoff_factor=s.get_backoff_factor(), growth_interval=s.get_growth_interval()))
    if isinstance(guard, FiniteGuard):
        return FiniteGuard(all_reduce_max=all_reduce_max_)
    return guard


def shard_loader(loader: Any) -> Any:
    """A plain DataLoader rebuilt over a DistributedSampler; anything else is returned as it is."""
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, DistributedSampler) or loader.batch_size is None:
        return loader
    seed = [torch.initial_seed() % 2**31]
    dist.broadcast_object_list(seed, src=0)  # every rank must shuffle with the same seed
    sampler = DistributedSampler(loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), seed=seed[0],
                                 drop_last=loader.drop_last)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False)


def all_reduce_max_(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
