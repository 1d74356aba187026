"""Data-parallel (DDP) training: process group from the torchrun environment, the
model wrapper, rank-strided batches, cross-rank checks; and a DDP entry point.

    torchrun --nproc_per_node 2 -m fp8attn.train.compare --preset smoke --device cpu --out runs/ddp

compare.run initializes the group, prepares the data on rank 0 first, and
writes prints, summary and report on rank 0 only. Semantics (trainer.train_mode
uses the helpers below; with one process every
helper is the identity, so single-process runs are unchanged):
  * every rank draws the same batch order from PCG64(data_seed); at step s rank r
    trains on batch number s * world_size + r of that order (rank-strided), so
    the global batch is world_size * batch_size sequences;
  * DistributedDataParallel averages the gradients, so every rank clips the same
    gradient and takes the same AdamW step; the logged loss is the mean over ranks;
  * only rank 0 writes the JSONL log and the report and runs the val loss;
  * at the end the ranks' parameter fingerprints are gathered; differing ones
    raise RuntimeError.
Backend: gloo on CPU, nccl on CUDA (one GPU per local rank).

FSDP2 (`--fsdp`): instead of DDP, every transformer block and then the whole
model get torch.distributed.fsdp.fully_shard over a 1-D mesh of all ranks
(parameters, gradients and AdamW state sharded; each block all-gathered for its
forward/backward). Same batches, loss averaging and checks as DDP; parameters
become DTensors, so fingerprints and gain statistics read `full(p)`, and every
rank runs the val loss (FSDP's forward is collective; rank 0 logs it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job (rank 0 of 1 without a process group)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def context() -> DistContext:
    """The current DistContext: from the initialized default process group, else single-process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return DistContext()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def init_from_env(device: str = "auto") -> DistContext:
    """Initializes the default process group when WORLD_SIZE > 1 (torchrun sets
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); otherwise does nothing.

    device: the trainer's --device ("auto" | "cpu" | "cuda"): gloo for CPU, nccl
    (and torch.cuda.set_device(LOCAL_RANK)) for CUDA.
    Raises RuntimeError if torch.distributed or the backend is unavailable.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistContext()
    if not dist.is_available():
        raise RuntimeError("fp8attn.train.ddp: WORLD_SIZE > 1 but torch.distributed is not available")
    if not dist.is_initialized():
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if cuda else "gloo"
        if not (dist.is_nccl_available() if cuda else dist.is_gloo_available()):
            raise RuntimeError(f"fp8attn.train.ddp: backend {backend} is not available in this torch build")
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    return context()


def wrap_model(model: torch.nn.Module, ctx: DistContext, device: torch.device,
               fsdp: bool = False) -> torch.nn.Module:
    """model in DistributedDataParallel when distributed (it broadcasts rank 0's
    weights at construction), else model itself.

    fsdp=True (distributed only): FSDP2 instead: fully_shard on each module of
    `model.blocks` (if any) and on `model`, in place; returns `model`. Every rank
    must hold the same initial weights (the trainer seeds the init identically).
    """
    if not ctx.enabled:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (ctx.world_size,))
        for blk in getattr(model, "blocks", []):
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def is_sharded(model: torch.nn.Module) -> bool:
    """True if `model` was wrapped by FSDP2 (fully_shard)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


def full(t):
    """The full (unsharded) tensor of a DTensor (a collective: every rank must
    call it); any other value unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rank_batch(stream, rng: np.random.Generator, batch_size: int, ctx: DistContext):
    """This rank's (x, y) of the next step: draws world_size batches from rng (the
    shared order) and returns number `rank`. With one process: stream.random_batch."""
    if not ctx.enabled:
        return stream.random_batch(rng, batch_size)
    mine = None
    for r in range(ctx.world_size):
        b = stream.random_batch(rng, batch_size)
        if r == ctx.rank:
            mine = b
    return mine


def mean_over_ranks(value: float, ctx: DistContext, device: torch.device) -> float:
    """Mean of a float over the ranks (value itself with one process)."""
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / ctx.world_size


def gather_strings(s: str, ctx: DistContext) -> list:
    """[s of rank 0, s of rank 1, ...] on every rank ([s] with one process)."""
    if not ctx.enabled:
        return [s]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, s)
    return out


def barrier(ctx: DistContext) -> None:
    """Waits for every rank (no-op with one process)."""
    if ctx.enabled:
        dist.barrier()


def shutdown() -> None:
    """Waits for every rank, then destroys the default process group (if any).
    NOTE: without the barrier a rank that finishes early tears gloo down while
    rank 0 still writes the report, and can abort ("terminate called ...")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> None:
    """Alias of `python -m fp8attn.train.compare`, which runs under torchrun itself."""
    from . import compare

    compare.main(argv)


if __name__ == "__main__":
    main()
