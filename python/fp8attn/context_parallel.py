"""Context parallelism: FP8 ring attention with a global Delta-Matching delta.

The sequence axis of Q, K, V is split into contiguous chunks held by the ranks of
a ``torch.distributed`` process group. The forward rotates K and V around the
ring and merges the partial outputs with their LSE; the backward runs two rings:

1. the Delta-Matching pre-pass: every rank sums, over every key shard, the FP32
   row sums ``sum_j P_ij dP_hat_ij`` and ``sum_j P_ij`` of its query rows
   (``torch.ops.fp8attn.bwd_dm_sums``, P from the global LSE), and forms the
   global ``delta_i = (sum P dP_hat) / (sum P)`` and the backward-consistent
   ``LSE'_i = LSE_i + ln(sum P)`` (numerics.md sections 4 and 11);
2. the main pass: K, V and their FP32 dK, dV accumulators travel around the ring;
   each (query chunk, key chunk) pair runs ``torch.ops.fp8attn.bwd`` with that
   delta and LSE' (``delta=``), so ``sum_j dS_ij = 0`` over the whole sequence to
   FP32 rounding, exactly as without sharding.

``delta_mode="stale"`` keeps the local ``<dO_i, O_i>`` of a conventional ring
backward (with the merged O: given the same O it equals the unsharded stale
backward; the ring's own O differs from the unsharded one by FP8 rounding, which
the stale delta carries into dQ / dK, ~1-3% measured, no further from exact than
the unsharded op), and ``"matched_do"`` its dO-only fix; only Delta-Matching
needs the extra ring (and its gradients follow the unsharded ones to ~1e-6).

Every call first all-gathers each rank's shapes, dtype and options and checks them
on every rank (a mismatch is the same ValueError on all ranks, not a hang or a gloo
abort), and that the local lengths are those of ``layout`` for their total. Shards
cut with another layout but the same lengths cannot be detected (the results are
then wrong): cut them with ``shard`` and the same layout / block_size.

A ring backward that called the op's own Delta-Matching backward per key shard
would renormalize P over that shard's keys only and use a shard-local delta:
its dS rows would no longer sum to zero (tests/python/test_context_parallel.py
shows the residual it leaves).

Layouts (``layout=``): ``"zigzag"`` (default; causal load balance as in
Megatron's and torch's context parallelism): the sequence is cut into
``2 * world_size`` chunks and rank r holds chunks r and ``2 * world_size - 1 -
r``, in that order; ``"contiguous"``: ``world_size`` chunks, rank r holds chunk
r. Chunk boundaries are multiples of ``block_size`` where the length allows
(``chunk_bounds``), so the FP8 block grid of every chunk is the unsharded
one's. Uneven lengths are allowed (chunks may differ in length, even be empty).

Causal masking is global: a query chunk sees earlier key chunks whole, its own
chunk causally and later chunks not at all.

Limits (errors name the argument): precision "fp8" only (the exact reference
backward recomputes LSE from the local keys), no diagnostics. ``qk_rotation`` and
``smooth_k`` run around the ring (the smoothing mean is global: an all-reduce).
CPU tensors run on the CPU reference
(gloo), CUDA tensors on the kernels (NCCL; not yet run on a multi-GPU machine).
Communication: point-to-point ``batch_isend_irecv``; the next K/V transfer is
posted before the current chunk pairs are computed, and the dK/dV accumulator of
the current shard arrives while they are computed (both overlapped with compute).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import ops as _ops

__all__ = ["chunk_bounds", "local_chunks", "positions", "shard", "unshard", "ring_attention"]

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"fp8attn.context_parallel: argument 'layout': expected one of {LAYOUTS}, got {layout!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chunk_bounds(seqlen: int, num_chunks: int, block_size: int = 128) -> List[int]:
    """Cut points ``[0, c_1, ..., seqlen]`` of ``num_chunks`` contiguous chunks.

    The sequence is counted in units of ``block_size`` tokens (the last unit may
    be shorter) and the units are spread as evenly as possible (earlier chunks
    get the extra ones), so every cut but ``seqlen`` is a multiple of
    ``block_size``. Chunks are empty when there are fewer units than chunks.
    """
    if not _is_int(seqlen) or seqlen < 0:
        raise ValueError(f"fp8attn.context_parallel: argument 'seqlen': expected an int >= 0, got "
                         f"{_ops.fmt_value(seqlen)}")
    if not _is_int(num_chunks) or num_chunks < 1:
        raise ValueError(f"fp8attn.context_parallel: argument 'num_chunks': expected an int >= 1, got "
                         f"{_ops.fmt_value(num_chunks)}")
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"fp8attn.context_parallel: argument 'block_size': expected an int >= 1 (the chunk "
                         f"alignment), got {_ops.fmt_value(block_size)}")
    units = -(-seqlen // block_size)
    base, extra = divmod(units, num_chunks)
    cuts, u = [0], 0
    for c in range(num_chunks):
        u += base + (1 if c < extra else 0)
        cuts.append(min(seqlen, u * block_size))
    return cuts


def local_chunks(rank: int, world_size: int, layout: str = "zigzag") -> Tuple[int, ...]:
    """The global chunk ids rank ``rank`` holds, in the order of its local tensor."""
    _check_layout(layout)
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"fp8attn.context_parallel: argument 'world_size': expected an int >= 1, got "
                         f"{_ops.fmt_value(world_size)}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"fp8attn.context_parallel: argument 'rank': expected an int in [0, {world_size}), "
                         f"got {_ops.fmt_value(rank)}")
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _num_chunks(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def _group_info(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fp8attn.context_parallel: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"fp8attn.context_parallel: argument 'group': expected a torch.distributed ProcessGroup "
                        f"or None (the world), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"fp8attn.context_parallel: argument 'group': this process (global rank "
                         f"{dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 2, block_size: int = 128,
          rank: Optional[int] = None, world_size: Optional[int] = None) -> torch.Tensor:
    """This rank's part of a full-sequence tensor ``x`` (sequence along ``dim``).

    ``rank`` / ``world_size`` default to the group's; give both to shard without a
    process group (tests, data loaders); one without the other is a ValueError. Returns a contiguous tensor holding the
    rank's chunks (``local_chunks``) concatenated along ``dim``. ``block_size``: the
    chunk alignment of ``chunk_bounds`` (pass ring_attention's ``chunk_align``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8attn.context_parallel.shard: argument 'x': expected a torch.Tensor, got "
                        f"{type(x).__name__}")
    if (rank is None) != (world_size is None):
        given, missing = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise ValueError(f"fp8attn.context_parallel.shard: argument '{missing}': give it with '{given}' "
                         f"(both, or neither to use the group's)")
    if rank is None:
        rank, world_size = _group_info(group)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"fp8attn.context_parallel.shard: argument 'dim': expected an int in "
                         f"[{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {_ops.fmt_value(dim)}")
    local_chunks(rank, world_size, layout)   # checks rank, world_size, layout
    cuts = chunk_bounds(x.shape[dim], _num_chunks(world_size, layout), block_size)
    parts = [x.narrow(dim, cuts[c], cuts[c + 1] - cuts[c]) for c in local_chunks(rank, world_size, layout)]
    return torch.cat(parts, dim=dim).contiguous()


def positions(seqlen: int, rank: int, world_size: int, *, layout: str = "zigzag", block_size: int = 128,
              device=None) -> torch.Tensor:
    """Global token positions (int64) of rank ``rank``'s local tokens, in local order
    (for RoPE on sharded sequences); ``block_size`` as in ``shard``."""
    cuts = chunk_bounds(seqlen, _num_chunks(world_size, layout), block_size)
    return torch.cat([torch.arange(cuts[c], cuts[c + 1], device=device)
                      for c in local_chunks(rank, world_size, layout)])


def unshard(local: torch.Tensor, seqlen: int, group=None, *, layout: str = "zigzag", dim: int = 2,
            block_size: int = 128) -> torch.Tensor:
    """The full-sequence tensor from every rank's ``shard`` (an all-gather; not differentiable).

    ``seqlen`` is the full sequence length (the chunk bounds follow from it).
    """
    rank, world_size = _group_info(group)
    n = _num_chunks(world_size, layout)
    cuts = chunk_bounds(seqlen, n, block_size)
    lens = [sum(cuts[c + 1] - cuts[c] for c in local_chunks(r, world_size, layout)) for r in range(world_size)]
    # Every rank's shape first (one small all-gather), so that a mismatch anywhere is
    # the same ValueError on every rank (not one rank raising while the others wait).
    meta = torch.tensor(list(local.shape) + [-1] * (8 - local.dim()), dtype=torch.int64, device=local.device)
    metas = [torch.empty_like(meta) for _ in range(world_size)]
    dist.all_gather(metas, meta, group=group)
    for r, m in enumerate(metas):
        shape = [int(x) for x in m.tolist() if x >= 0]
        want = list(local.shape)
        want[dim] = lens[r]
        if shape != want:
            raise ValueError(f"fp8attn.context_parallel.unshard: argument 'local': rank {r} holds shape "
                             f"{tuple(shape)}, expected {tuple(want)} for seqlen {seqlen} (layout {layout}, "
                             f"block_size {block_size}, {world_size} ranks)")
    m = max(lens)
    pad = list(local.shape)
    pad[dim] = m
    buf = local.new_zeros(pad)
    buf.narrow(dim, 0, lens[rank]).copy_(local)
    gathered = [torch.empty_like(buf) for _ in range(world_size)]
    dist.all_gather(gathered, buf.contiguous(), group=group)
    chunks = [None] * n
    for r in range(world_size):
        off = 0
        for c in local_chunks(r, world_size, layout):
            L = cuts[c + 1] - cuts[c]
            chunks[c] = gathered[r].narrow(dim, off, L)
            off += L
    return torch.cat(chunks, dim=dim)


# ---- the ring -----------------------------------------------------------------


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_consistent(fn, group, rank, world, q, k, v, opts: dict) -> List[int]:
    """All-gathers every rank's shapes, dtype and options and checks them on every rank:
    the same options, the same shapes but for the sequence length, and local lengths
    that are those of the layout for their total (chunk_bounds). Returns the local
    lengths. Raises ValueError naming the argument, on every rank alike."""
    import struct
    f2i = lambda x: struct.unpack("<q", struct.pack("<d", float(x)))[0]   # noqa: E731  exact float compare
    fields = [("q", q.shape[0]), ("q", q.shape[1]), ("q", q.shape[3]), ("k", k.shape[1]), ("k", k.shape[3]),
              ("v", v.shape[1]), ("v", v.shape[3]), ("q", _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1),
              ("k", k.shape[0]), ("v", v.shape[0])]
    fields += [(n, f2i(x) if isinstance(x, float) else int(x)) for n, x in opts.items()]
    mine = torch.tensor([q.shape[2]] + [x for _, x in fields], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    for i, (name, _) in enumerate(fields):
        vals = [r[i + 1] for r in rows]
        if len(set(vals)) > 1:
            what = "an option" if name in opts else "a shape or dtype (all but the sequence length)"
            raise ValueError(f"{fn}: argument '{name}': {what} differs across the ranks of the group "
                             f"(per rank: {vals}); every rank must call with the same")
    lens = [r[0] for r in rows]
    layout = LAYOUTS[opts["layout"]]
    cuts = chunk_bounds(sum(lens), _num_chunks(world, layout), opts["chunk_align"])
    want = [sum(cuts[c + 1] - cuts[c] for c in local_chunks(r, world, layout)) for r in range(world)]
    if lens != want:
        raise ValueError(f"{fn}: argument 'q': the ranks hold {lens} tokens, but the {layout} layout of "
                         f"{sum(lens)} tokens over {world} ranks (chunk_align {opts['chunk_align']}) gives "
                         f"{want} (shard with fp8attn.context_parallel.shard and the same layout / block_size)")
    return lens


class _Ring:
    """K/V shards of every rank: chunk ids and lengths, and the P2P rotation."""

    def __init__(self, group, layout: str, local_len: int, device: torch.device, block_size: int,
                 local_lens: Optional[List[int]] = None):
        self.group = group
        self._block = block_size
        self.rank, self.world = _group_info(group)
        self.layout = layout
        self.chunks = [local_chunks(r, self.world, layout) for r in range(self.world)]
        if local_lens is None:
            # Every rank's chunk lengths (uneven shards): one small all-gather.
            mine = torch.tensor([local_len], dtype=torch.int64, device=device)
            allv = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(allv, mine, group=group)
            local_lens = [int(t.item()) for t in allv]
        self.local_lens = list(local_lens)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else \
            (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else \
            (self.rank - 1) % self.world

    def source(self, step: int) -> int:
        """The rank whose K/V shard this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world

    def split(self, src: int, total: int) -> List[Tuple[int, int, int]]:
        """(chunk id, offset, length) of rank ``src``'s local tensor of ``total`` tokens.

        Chunk lengths: the local tensor is cut like ``shard`` cut it; the lengths
        follow from the global length, the sum of every rank's local length.
        """
        seqlen = sum(self.local_lens)
        cuts = chunk_bounds(seqlen, _num_chunks(self.world, self.layout), self._block)
        out, off = [], 0
        for c in self.chunks[src]:
            L = cuts[c + 1] - cuts[c]
            out.append((c, off, L))
            off += L
        if off != total:
            raise ValueError(f"fp8attn.context_parallel: rank {src} holds {total} tokens, expected {off} for the "
                             f"{self.layout} layout of {seqlen} tokens over {self.world} ranks with block_size "
                             f"{self._block} (shard with fp8attn.context_parallel.shard)")
        return out

    def exchange(self, send: Sequence[torch.Tensor], recv_shapes: Sequence[torch.Size], tag: int = 0):
        """Posts send-to-next / receive-from-prev of each tensor (tags tag, tag + 1, ...:
        the K/V and the dK/dV transfers of the backward are in flight together);
        returns (requests, buffers)."""
        bufs = [torch.empty(s, dtype=t.dtype, device=t.device) for t, s in zip(send, recv_shapes)]
        if self.world == 1:
            for b, t in zip(bufs, send):
                b.copy_(t)
            return [], bufs
        p2p = []
        for i, (t, b) in enumerate(zip(send, bufs)):
            p2p.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag + i))
            p2p.append(dist.P2POp(dist.irecv, b, self.prev, self.group, tag + i))
        return dist.batch_isend_irecv(p2p), bufs


def _pairs(ring: _Ring, q_split, kv_split, causal: bool):
    """(q offset, q length, k offset, k length, causal) of every chunk pair to compute."""
    for a, qo, ql in q_split:
        for b, ko, kl in kv_split:
            if ql == 0 or kl == 0:
                continue
            if not causal or b < a:
                yield qo, ql, ko, kl, False
            elif b == a:
                yield qo, ql, ko, kl, True


def _with_len(shape: torch.Size, dim: int, n: int) -> torch.Size:
    s = list(shape)
    s[dim] = n
    return torch.Size(s)


def _merge(o_acc, lse_acc, o, lse):
    """Merges a partial (O, LSE) into the FP32 running pair (in place on the accumulators' slices)."""
    new = torch.logaddexp(lse_acc, lse)
    finite = new > -math.inf
    w_old = torch.where(finite, torch.exp(lse_acc - new), torch.zeros_like(new))
    w_new = torch.where(finite, torch.exp(lse - new), torch.zeros_like(new))
    o_acc.mul_(w_old.unsqueeze(-1)).add_(o.float() * w_new.unsqueeze(-1))
    lse_acc.copy_(new)


def _kv_ring(ring, k, v):
    """The K/V shards this rank holds, one ring step after the other: yields (step, source
    rank, K, V); the next step's transfer is posted before the caller computes on the
    current one (overlapped) and waited for when the caller comes back."""
    cur_k, cur_v = k, v
    for step in range(ring.world):
        reqs, nxt = [], None
        if step + 1 < ring.world:
            n = ring.local_lens[ring.source(step + 1)]
            reqs, nxt = ring.exchange([cur_k, cur_v], [_with_len(k.shape, 2, n), _with_len(v.shape, 2, n)])
        yield step, ring.source(step), cur_k, cur_v
        for r in reqs:
            r.wait()
        if nxt is not None:
            cur_k, cur_v = nxt


def _ring_forward(ring, q, k, v, scale, causal, block_size, scaling, softcap=0.0):
    Sq = q.shape[2]
    q_split = ring.split(ring.rank, Sq)
    o_acc = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=torch.float32, device=q.device)
    lse_acc = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    for _, src, cur_k, cur_v in _kv_ring(ring, k, v):
        for qo, ql, ko, kl, pc in _pairs(ring, q_split, ring.split(src, cur_k.shape[2]), causal):
            o, lse = torch.ops.fp8attn.fwd(q.narrow(2, qo, ql), cur_k.narrow(2, ko, kl), cur_v.narrow(2, ko, kl),
                                           scale, pc, "fp8", block_size, scaling, softcap=softcap)
            _merge(o_acc.narrow(2, qo, ql), lse_acc.narrow(2, qo, ql), o, lse)
    return o_acc, lse_acc


def ring_dm_sums(ring, q, k, v, dout, lse, scale, causal, block_size, grad_format, scaling, softcap=0.0):
    """The Delta-Matching pre-pass ring: global (sum_j P dP_hat, sum_j P) of this rank's rows (FP32)."""
    q_split = ring.split(ring.rank, q.shape[2])
    pdp = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    psum = torch.zeros_like(pdp)
    for _, src, cur_k, cur_v in _kv_ring(ring, k, v):
        for qo, ql, ko, kl, pc in _pairs(ring, q_split, ring.split(src, cur_k.shape[2]), causal):
            s1, s2 = torch.ops.fp8attn.bwd_dm_sums(
                dout.narrow(2, qo, ql), q.narrow(2, qo, ql), cur_k.narrow(2, ko, kl), cur_v.narrow(2, ko, kl),
                lse.narrow(2, qo, ql).contiguous(), scale, pc, block_size, grad_format, scaling, softcap=softcap)
            pdp.narrow(2, qo, ql).add_(s1)
            psum.narrow(2, qo, ql).add_(s2)
    return pdp, psum


def global_delta(pdp: torch.Tensor, psum: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """delta = pdp / psum and LSE' = lse + ln(psum) (rows with psum = 0 keep delta = pdp and lse)."""
    pos = psum > 0
    delta = torch.where(pos, pdp / torch.where(pos, psum, torch.ones_like(psum)), pdp)
    lse_b = torch.where(pos, lse + torch.log(torch.where(pos, psum, torch.ones_like(psum))), lse)
    return delta, lse_b


def _ring_backward(ring, dout, q, k, v, out, lse, scale, causal, delta_mode, block_size, grad_format, scaling,
                   softcap=0.0):
    Sq = q.shape[2]
    q_split = ring.split(ring.rank, Sq)
    dm = delta_mode == "delta_matching"
    if dm:
        pdp, psum = ring_dm_sums(ring, q, k, v, dout, lse, scale, causal, block_size, grad_format, scaling, softcap)
        delta, lse_b = global_delta(pdp, psum, lse)
    else:
        delta, lse_b = None, lse
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # The dK/dV accumulators follow their K/V shard around the ring, one step behind:
    # the accumulator of the shard held at step t arrives (from the rank that held it
    # at t - 1) while step t's pairs are computed into local buffers; after the last
    # step each goes home (the next rank owns the shard this rank holds then).
    pending = None
    for step, src, cur_k, cur_v in _kv_ring(ring, k, v):
        n = ring.local_lens[ring.source(step + 1)]   # the shard whose accumulator arrives next
        dk_loc = torch.zeros(cur_k.shape, dtype=torch.float32, device=k.device)
        dv_loc = torch.zeros(cur_v.shape, dtype=torch.float32, device=v.device)
        for qo, ql, ko, kl, pc in _pairs(ring, q_split, ring.split(src, cur_k.shape[2]), causal):
            sl = (2, qo, ql)
            extra = {} if delta is None else {"delta": delta.narrow(*sl).contiguous()}
            dq_p, dk_p, dv_p, _ = torch.ops.fp8attn.bwd(
                dout.narrow(*sl), q.narrow(*sl), cur_k.narrow(2, ko, kl), cur_v.narrow(2, ko, kl),
                out.narrow(*sl), lse_b.narrow(*sl).contiguous(), scale, pc, "fp8", delta_mode, block_size,
                grad_format, False, scaling, softcap=softcap, **extra)
            dq.narrow(*sl).add_(dq_p.float())
            dk_loc.narrow(2, ko, kl).add_(dk_p.float())
            dv_loc.narrow(2, ko, kl).add_(dv_p.float())
        if pending is not None:
            for r in pending[0]:
                r.wait()
            dk_loc.add_(pending[1][0])
            dv_loc.add_(pending[1][1])
        pending = ring.exchange([dk_loc, dv_loc], [_with_len(k.shape, 2, n), _with_len(v.shape, 2, n)], tag=2)
    for r in pending[0]:
        r.wait()
    dk, dv = pending[1]
    return dq, dk, dv


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; every rank's output is the total, so the gradient of each
    rank's input is the sum of the upstream gradients over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _transform_qk(q, k, group, qk_rotation: str, smooth_k: bool, seqlen: int):
    """Q', K' of numerics.md section 10 on a sharded sequence, differentiable (torch ops,
    as fp8attn.qk_transform does around the CUDA kernels): the mean key of smooth_k is the
    global one (FP64 sums all-reduced over the group / seqlen, then FP32), so every shard
    subtracts the same vector; the gradient through it is global too. Returns (q', k',
    mean or None)."""
    from . import qk_transform as qkt
    qw, kw = q.float(), k.float()
    mean = None
    if smooth_k:
        total = _AllReduceSum.apply(kw.double().sum(dim=2, keepdim=True), group)
        mean = (total / max(seqlen, 1)).float()
        kw = kw - mean
    if qk_rotation == "hadamard":
        qw, kw = qkt.rotate(qw), qkt.rotate(kw)
    return qw.to(q.dtype), kw.to(k.dtype), mean


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, scale, causal, delta_mode, block_size, grad_format, scaling, align,
                softcap=0.0, local_lens=None):
        ring = _Ring(group, layout, q.shape[2], q.device, align, local_lens)
        o, lse = _ring_forward(ring, q, k, v, scale, causal, block_size, scaling, softcap)
        out = _ops.as_dtype(o, q.dtype)  # NOTE: not o.to(): ops.as_dtype (torch.compile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.opts = (scale, causal, delta_mode, block_size, grad_format, scaling, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @_ops.single_backward("context_parallel.ring_attention")
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, delta_mode, block_size, grad_format, scaling, softcap = ctx.opts
        dq, dk, dv = _ring_backward(ctx.ring, dout.contiguous().to(q.dtype), q, k, v, out, lse, scale, causal,
                                    delta_mode, block_size, grad_format, scaling, softcap)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 11


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    scaling: str = "row",
    layout: str = "zigzag",
    return_lse: bool = False,
    qk_rotation: str = "none",
    smooth_k: bool = False,
    chunk_align: Optional[int] = None,
    softcap: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
):
    """FP8 attention over a sequence sharded across ``group`` (numerics.md section 11).

    Args:
        q: this rank's shard [batch, num_heads_q, seqlen_q_local, head_dim_qk]
            (``shard(Q_full, group, layout=layout, block_size=block_size)``),
            bfloat16, float16 (runs as float32) or float32 (CPU also float64);
            CUDA: as ``fp8attn.attention``.
        k, v: the shards of K [batch, num_heads_kv, seqlen_local, head_dim_qk]
            and V [..., head_dim_v], same layout; GQA as in ``fp8attn.attention``.
            Q and K/V share the sequence (self-attention: seqlen_q = seqlen_k).
        group: the context-parallel process group (default: the world).
        causal: a global causal mask over the unsharded sequence.
        softmax_scale: tau; default 1/sqrt(head_dim_qk).
        delta_mode: "delta_matching" (default: the delta summed over every key
            shard, section 11), "matched_do" or "stale" (local <dO, O>).
        precision: "fp8" only.
        block_size, grad_format, scaling: as in ``fp8attn.attention``.
        layout: "zigzag" (default) or "contiguous" (see the module docstring).
        chunk_align: the alignment the shards were cut with (``shard(...,
            block_size=chunk_align)``); default block_size, which keeps every
            chunk on the unsharded FP8 block grid. Another alignment is as
            correct (each chunk's grid starts at its first token, as for a
            sequence of its own) and rounds differently.
        return_lse: also return this rank's LSE rows (float32, natural log).
        qk_rotation, smooth_k: the outlier transforms of numerics.md section 10,
            applied around the ring with torch ops (as on CUDA): Q' = Q R,
            K' = (K - m) R with m the mean key over the whole sequence (an
            all-reduce), gradients mapped back through both; with return_lse the
            LSE is that of the untransformed logits.
        softcap: logit softcapping as in ``fp8attn.attention`` (numerics.md
            section 12; CPU tensors, and CUDA tensors with scaling="tile"), in
            every shard's calls and pre-pass.
        window_size: FlashAttention's sliding window as in ``fp8attn.attention``;
            the ring takes only the windows that mean no window ((-1, -1), any
            negative bounds) or the causal mask ((-1, 0), or any window with
            causal=True and no left bound). A sliding window raises
            NotImplementedError naming window_size (a global window over the
            shards is not implemented yet; unsharded calls take it).

    Returns:
        O: this rank's shard of the output, [batch, num_heads_q, seqlen_local,
        head_dim_v] in q's dtype (and LSE with return_lse).

    Raises:
        RuntimeError: torch.distributed not initialized.
        ValueError: bad option values, shards that do not match ``layout`` and
            ``block_size`` for the total length, q and k of different lengths.
        NotImplementedError: precision other than "fp8"; a sliding window
            (window_size).
        TypeError: as ``fp8attn.attention`` for dtypes and option types.
    """
    fn = "fp8attn.context_parallel.ring_attention"
    _check_layout(layout)
    name = "context_parallel.ring_attention"
    _ops.check_options(causal=causal, softmax_scale=softmax_scale, delta_mode=delta_mode, precision=precision,
                       block_size=block_size, grad_format=grad_format, return_lse=return_lse, layer_name=None,
                       scaling=scaling, qk_rotation=qk_rotation, smooth_k=smooth_k, fn=name)
    causal, return_lse, smooth_k = bool(causal), bool(return_lse), bool(smooth_k)  # checked: NumPy bools too
    if precision != "fp8":
        raise NotImplementedError(f"{fn}: argument 'precision': only \"fp8\" is implemented (the exact backward "
                                  f"recomputes LSE from one shard's keys), got {precision!r}")
    left, right = _ops.check_window_size(window_size, name)
    if causal is True:
        right = 0
    if left >= 0 or right > 0:
        raise NotImplementedError(f"{fn}: argument 'window_size': a sliding window over the sharded sequence is not "
                                  f"implemented (got {_ops.fmt_value(tuple(window_size))}, causal={causal}); the "
                                  "unsharded fp8attn.attention takes it")
    causal = causal or right == 0
    q, k, v = _ops._autocast_in(q, k, v)   # as SDPA under torch.autocast
    _ops.check_inputs(q, k, v, precision, fn=name)
    cap = _ops.check_softcap(softcap, smooth_k, q.device.type, fn=name, scaling=scaling, precision=precision)
    rank, world = _group_info(group)   # RuntimeError when torch.distributed is not initialized
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: argument 'k': self-attention shards: seqlen of q ({q.shape[2]}) and k "
                         f"({k.shape[2]}) must match")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    align = int(block_size) if chunk_align is None else chunk_align
    if not _is_int(align) or align < 1:
        raise ValueError(f"{fn}: argument 'chunk_align': expected an int >= 1, got {_ops.fmt_value(chunk_align)}")
    # The first collective: every rank's shapes, dtype and options, compared on every rank,
    # so that a mismatch is one ValueError everywhere instead of a hang or a gloo abort.
    local_lens = _check_consistent(fn, group, rank, world, q, k, v, dict(
        causal=bool(causal), layout=LAYOUTS.index(layout), softmax_scale=scale,
        delta_mode=_ops.DELTA_MODES.index(delta_mode), block_size=int(block_size),
        grad_format=_ops.GRAD_FORMATS.index(grad_format), scaling=_ops.SCALINGS.index(scaling),
        qk_rotation=_ops.QK_ROTATIONS.index(qk_rotation), smooth_k=bool(smooth_k), chunk_align=align,
        softcap=cap))
    dtype = q.dtype
    if dtype == torch.float16:  # as the public functions: float16 runs as float32 (ops._half_in)
        q, k, v = _ops._half_in(q, k, v)
    mean = None
    if qk_rotation != "none" or smooth_k:
        n_total = torch.tensor([k.shape[2]], dtype=torch.int64, device=k.device)
        dist.all_reduce(n_total, group=group)
        q_in = q
        q, k, mean = _transform_qk(q, k, group, qk_rotation, smooth_k, int(n_total.item()))
    out, lse = _RingAttention.apply(q, k, v, group, layout, scale, bool(causal), delta_mode, int(block_size),
                                    grad_format, scaling, align, cap, local_lens)
    if mean is not None and return_lse:   # the LSE of the unsmoothed logits (section 10)
        from . import qk_transform as qkt
        lse = qkt.shift_lse(lse, q_in.detach(), mean.detach(), scale, +1)
    if dtype == torch.float16:
        out = _ops._half_out(out, dtype)
    return (out, lse) if return_lse else out
