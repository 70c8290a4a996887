"""torchrun support: the process group, DDP and FSDP2 wrapping under a precision policy, data sharding."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from . import _compat, keep_fp32 as fp32_modules

__all__ = ["world_size", "rank", "is_main", "barrier"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def resolve(mode: str | None, device: str | torch.device | None) -> tuple[str | None, Any]:
    """The mode (``"ddp"``, ``"fsdp"`` or None) and, with a mode, the device (CUDA: ``LOCAL_RANK``'s unless indexed)
    and the process group started; a ValueError for an unknown mode, or a mode outside torchrun and a process group."""
    if mode not in ("auto", "ddp", "fsdp", None):
        raise ValueError(f"distributed must be 'auto', 'ddp', 'fsdp' or None; got {mode!r}")
    if mode == "auto":
        mode = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 or world_size() > 1 else None  # several processes
    if mode is None:
        return None, device
    if not dist.is_initialized() and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        raise ValueError(f"distributed={mode!r} needs torchrun (RANK and WORLD_SIZE set) or an initialised process "
                         "group; use distributed=None to train in one process")
    local_rank = os.environ.get("LOCAL_RANK")
    device = _compat.resolve_device(device, None if local_rank is None else int(local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so each rank owns its GPU
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return mode, device


def wrap(model: nn.Module, mode: str, compute_dtype: torch.dtype, device: torch.device,
         optimizer: torch.optim.Optimizer) -> nn.Module:
    """DDP-wrap or FSDP2-shard ``model``; under FSDP2 ``optimizer`` is repointed at the sharded parameters by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if optimizer.state:
        raise ValueError("distributed='fsdp' replaces the parameters: build the Trainer before the optimizer has state")
    fused = any(g.get("fused") for g in optimizer.param_groups)
    if fused and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"distributed='fsdp' cannot run a fused {type(optimizer).__name__} (torch has no DTensor rule "
                         "for its kernel); build it with fused=False")
    names = {id(p): n for n, p in model.named_parameters()}
    # fully_shard the fp32 modules (kept ones, affine batch norms) and the root's other children, then the root.
    mesh = init_device_mesh(device.type, (world_size(),))  # the default mesh would take the GPU for a CPU run
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mp = fp32 if fp32_modules.is_kept(model) else MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32)
    children = set(model.children())
    for module in reversed(list(model.modules())):  # bottom-up, as fully_shard wants
        kept = fp32_modules.is_kept(module) or (_compat.is_batch_norm(module) and module.affine)
        if module is not model and (kept or module in children) and any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh, mp_policy=fp32 if kept else mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:  # still the replaced parameters, by whose ids they are named
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) inside the block."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:  # an FSDPModule: a distributed Trainer's model is always one or the other
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def average_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """All-reduce gradients that a no_sync backward left local (DDP); FSDP2 cannot do this after the fact."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise RuntimeError("an accumulation under FSDP ended without a synchronising backward; let fit() close "
                           "epochs, or complete the accumulation before flush()")
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for g in grads:
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
    _compat.foreach_mul_(grads, 1 / world_size())


def shard_loader(loader: Any) -> Any:
    """A plain DataLoader rebuilt over a DistributedSampler; anything else is returned as it is."""
    plain = isinstance(loader, DataLoader) and loader.batch_size is not None
    if not plain or isinstance(loader.sampler, DistributedSampler):
        return loader
    seed = [torch.initial_seed() % 2**31]
    dist.broadcast_object_list(seed, src=0)  # every rank shuffles with the same seed
    sampler = DistributedSampler(loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), seed=seed[0],
                                 drop_last=loader.drop_last)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      persistent_workers=loader.persistent_workers)
