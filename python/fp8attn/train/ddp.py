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
Backend: gloo on CPU, nccl on CUDA (one GPU per local rank). With one process
torchrun creates no group unless FP8ATTN_DIST=1: then a 1-rank group is made and
the model is wrapped all the same (DDP or FSDP2), which runs the NCCL path on a
single GPU (`FP8ATTN_DIST=1 torchrun --nproc_per_node 1 -m fp8attn.train.compare ...`).

FSDP2 (`--fsdp`): instead of DDP, every transformer block and then the whole
model get torch.distributed.fsdp.fully_shard over a 1-D mesh of all ranks
(parameters, gradients and AdamW state sharded; each block all-gathered for its
forward/backward). Same batches, loss averaging and checks as DDP; parameters
become DTensors, so fingerprints and gain statistics read `full(p)`, and every
rank runs the val loss (FSDP's forward is collective; rank 0 logs it).

clip_grad_norm: the trainer's gradient clipping, with a total norm that does not
depend on the sharding (DDP and FSDP2 compute it bit for bit alike).

Process groups: the trainer makes its subgroups (context-parallel rings) with
new_group and its FSDP2 meshes with device_mesh, which record them, and
shutdown() tears all of them down before the default group (compare.main calls
it in a finally). NOTE: a group still referenced after destroy_process_group keeps
its gloo threads running into the interpreter's exit, which then tears them down
in whatever order it frees things: the suspected cause of rare aborts at the end of
CI's torchrun tests (a non-zero exit after a complete run); see shutdown.
"""
from __future__ import annotations

import gc
import importlib
import math
import os
import sys
import threading
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
    group: bool = False      # a default process group exists (also with one rank)

    @property
    def enabled(self) -> bool:
        return self.group or self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def context() -> DistContext:
    """The current DistContext: from the initialized default process group, else single-process."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), group=True)


def init_from_env(device: str = "auto") -> DistContext:
    """Initializes the default process group when WORLD_SIZE > 1 (torchrun sets
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or under torchrun with one
    process when FP8ATTN_DIST=1 (a 1-rank group: the NCCL path on one GPU);
    otherwise does nothing.

    device: the trainer's --device ("auto" | "cpu" | "cuda"): gloo for CPU, nccl
    (and torch.cuda.set_device(LOCAL_RANK)) for CUDA.
    Raises RuntimeError if torch.distributed or the backend is unavailable;
    ValueError if FP8ATTN_DIST is set to anything but 0, 1 or empty.
    """
    from .. import _env

    # NOTE: FP8ATTN_DIST must be 0, 1 or unset/empty (anything else: ValueError naming it).
    forced = _env.flag("FP8ATTN_DIST", False) and "MASTER_ADDR" in os.environ
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not forced:
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
        # NOTE: imported before the group exists. Imported after it (DDP's constructor
        # imports torch._dynamo, which imports it), the default group's gloo threads
        # outlived destroy_process_group and gc until the interpreter's exit (measured on
        # torch 2.11: 2 pt_gloo_runloop threads per rank); see shutdown.
        # NOTE: importlib, not an import statement: `import torch.x` inside this function
        # made `torch` a local name, and the torch.cuda calls above raised
        # UnboundLocalError on every CUDA init (ruff F823; tests/python/test_static_checks.py).
        importlib.import_module("torch.distributed.nn.functional")
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
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh(device.type, (ctx.world_size,))
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


def _row_sumsq(t: torch.Tensor) -> torch.Tensor:
    """float64 sums of squares of each row (index along dim 0) of `t` (a 0-d `t`
    is one row). The squares of FP32/BF16 values are exact in float64; a row is
    reduced on its own, so its sum does not depend on the rows beside it."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.double().square().reshape(t.shape[0], math.prod(t.shape[1:])).sum(dim=1)


def _gather_row_sums(grads: list, local: list) -> list:
    """The full per-row sums of every sharded gradient: each rank's rows of each
    DTensor (Shard(0) on a 1-D mesh, FSDP2's layout) gathered in mesh order, so the
    result is the vector `_row_sumsq` gives for the full tensor. Unsharded entries
    are returned unchanged. A collective: every rank must call it."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = [isinstance(g, DTensor) for g in grads]
    meshes = {id(g.device_mesh): g.device_mesh for g, s in zip(grads, sharded) if s}
    if len(meshes) != 1:
        raise ValueError(f"clip_grad_norm: the sharded gradients must share one device mesh, got {len(meshes)}")
    (mesh,) = meshes.values()
    for g, s in zip(grads, sharded):
        if s and (mesh.ndim != 1 or tuple(g.placements) != (Shard(0),)):
            raise ValueError(f"clip_grad_norm: a sharded gradient must be Shard(0) on a 1-D mesh "
                             f"(FSDP2), got placements {g.placements} on a {mesh.ndim}-D mesh")
    group, world = mesh.get_group(), mesh.size()
    dev = local[0].device
    counts = torch.tensor([r.numel() if s else 0 for r, s in zip(local, sharded)], dtype=torch.int64, device=dev)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    all_counts = [c.tolist() for c in all_counts]
    n_max = max(sum(c) for c in all_counts)
    mine = torch.zeros(n_max, dtype=torch.float64, device=dev)
    flat = [r for r, s in zip(local, sharded) if s]
    if flat:
        cat = torch.cat(flat)
        mine[:cat.numel()] = cat
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    offsets, out = [0] * world, []
    for i, (g, r, s) in enumerate(zip(grads, local, sharded)):
        if not s:
            out.append(r)
            continue
        pieces = []
        for k in range(world):
            n = all_counts[k][i]
            pieces.append(got[k][offsets[k]:offsets[k] + n])
            offsets[k] += n
        rows = torch.cat(pieces)
        if rows.numel() != (g.shape[0] if g.dim() else 1):
            raise RuntimeError(f"clip_grad_norm: gathered {rows.numel()} rows of a gradient of shape "
                               f"{tuple(g.shape)}")
        out.append(rows)
    return out


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Scales the gradients of `parameters` in place so that their total L2 norm is
    at most `max_norm` (factor min(1, max_norm / (norm + 1e-6)), as
    torch.nn.utils.clip_grad_norm_) and returns the total norm before clipping
    (a float; nan/inf when a gradient is not finite, and then nothing is scaled).

    Unlike torch.nn.utils.clip_grad_norm_, the norm does not depend on how the
    gradients are sharded: it is sqrt of the float64 sum, in one fixed order
    (parameter, then row), of the float64 per-row sums of squares, and under
    FSDP2 (DTensor gradients, Shard(0) on a 1-D mesh) each rank's row sums are
    gathered first, so DDP (full gradients) and FSDP2 compute the same norm bit
    for bit from the same gradients. NOTE: torch's version on DTensors sums the
    shards' FP32 norms, which rounds differently from the norm of the full tensor
    (1-2 ulp at step 0 on the smoke model), and the clip factor passes that
    difference into every weight (tests/python/test_fsdp.py). A collective under
    FSDP2: every rank must call it. Cost: one float64 per gradient row gathered.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    local = [_row_sumsq(g.to_local() if hasattr(g, "to_local") else g) for g in grads]
    if any(hasattr(g, "to_local") for g in grads):
        local = _gather_row_sums(grads, local)
    norm = float(torch.cat(local).sum().sqrt())
    if math.isfinite(norm):
        coef = min(1.0, max_norm / (norm + 1e-6))
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return norm


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


# Every subgroup made by new_group and every mesh made by device_mesh, in creation
# order, until shutdown() destroys them.
_GROUPS: list = []
_MESHES: list = []
SHUTDOWN_TIMEOUT_S = 60.0


def new_group(ranks, **kwargs):
    """dist.new_group(ranks, **kwargs), recorded for shutdown(). A collective over the
    default group: every rank must call it with the same ranks, in the same order
    (a rank outside `ranks` gets GroupMember.NON_GROUP_MEMBER)."""
    grp = dist.new_group(list(ranks), **kwargs)
    _GROUPS.append(grp)
    return grp


def device_mesh(device_type: str, shape: tuple, **kwargs):
    """torch.distributed.device_mesh.init_device_mesh(device_type, shape, **kwargs),
    recorded for shutdown() (with its dimension groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(shape), **kwargs)
    _MESHES.append(mesh)
    return mesh


def live_groups() -> list:
    """The process groups this process still holds (torch's registry; the default group
    included): [] once shutdown() has run."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.distributed.distributed_c10d import _world
    return list(_world.pg_map)


def _mesh_groups(mesh) -> list:
    """The process groups of a DeviceMesh's dimensions (none if it made none)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = []
    for name in getattr(mesh, "_dim_group_names", None) or []:
        try:
            out.append(_resolve_process_group(name))
        except (RuntimeError, ValueError, KeyError):   # already gone
            pass
    return out


def _destroy_all(errors: list) -> None:
    """Destroys the recorded subgroups and mesh groups (newest first), then the default
    group (each attempted; errors appended to `errors`), and drops the references this
    module and the recorded meshes hold to them."""
    doomed = list(_GROUPS)
    for mesh in _MESHES:
        doomed += _mesh_groups(mesh)
    default, done = dist.group.WORLD, set()
    for grp in reversed(doomed):
        if grp is None or grp is default or grp == dist.GroupMember.NON_GROUP_MEMBER or id(grp) in done:
            continue
        done.add(id(grp))
        try:
            if grp in live_groups():
                dist.destroy_process_group(grp)
        except Exception as e:
            errors.append(e)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:
        errors.append(e)
    for mesh in _MESHES:
        if hasattr(mesh, "_pg_registry"):
            mesh._pg_registry.clear()
    _GROUPS.clear()
    _MESHES.clear()


def shutdown(wait: bool = True, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """Tears down every process group of this process: with wait, a barrier first (every
    rank has finished before any tears gloo down), then the subgroups and mesh groups
    (new_group, device_mesh), then the default group; then their references are dropped
    (module lists, the meshes' group registries) and gc.collect() frees them, so none is
    left for the interpreter's exit. Nothing to do without a default group.

    wait=False skips the barrier: after this rank failed, its peers may never reach it.
    The teardown runs in a daemon thread joined for at most timeout_s seconds, so a hung
    barrier (a peer gone) cannot block the exit: then a line on stderr and False. An
    error of the barrier or the teardown is raised after the teardown finished with
    wait; without it (an exit after a failure, whose error is the one to see) it is
    printed on stderr and False returned. True when every group was destroyed.

    NOTE: without the barrier a rank that finishes early tears gloo down while rank 0
    still writes the report, and can abort ("terminate called ..."). The previous
    shutdown (a barrier, then destroy_process_group() alone) left gloo threads running
    into the interpreter's exit on every rank of a 2-rank CPU compare run (DDP, FSDP2
    and context-parallel alike: the default group's threads, 2 pt_gloo_runloop on
    torch 2.11, one gloo_tcp_loop more on 2.15; see init_from_env), and leaves those of
    any group still referenced (a ring's group, a mesh's registry); after this
    shutdown none runs (test_ddp.py::test_shutdown_*)."""
    if not (dist.is_available() and dist.is_initialized()):
        _GROUPS.clear()
        _MESHES.clear()
        return True
    errors = []

    def teardown():
        try:
            if wait:
                dist.barrier()
        except Exception as e:   # the teardown still runs: a peer may have gone
            errors.append(e)
        _destroy_all(errors)
        gc.collect()   # the ProcessGroup objects die here, not at the interpreter's exit

    t = threading.Thread(target=teardown, name="fp8attn-ddp-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"[ddp] shutdown: the process-group teardown did not finish in {timeout_s:g} s; exiting without it",
              file=sys.stderr, flush=True)
        return False
    if errors and wait:
        raise errors[0]
    for e in errors:
        print(f"[ddp] shutdown: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return not errors


def main(argv=None) -> None:
    """Alias of `python -m fp8attn.train.compare`, which runs under torchrun itself."""
    from . import compare

    compare.main(argv)


if __name__ == "__main__":
    main()
