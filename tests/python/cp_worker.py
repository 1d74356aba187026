"""One rank of a context-parallel test run (tests/python/test_context_parallel.py).

Usage: python cp_worker.py RANK WORLD INIT_FILE OUT_DIR CASE_JSON

Every rank builds the same full inputs from the case's seed, takes its shards,
and saves (torch.save, OUT_DIR/rank{RANK}.pt) its local results:
  o, lse           ring_attention forward (autograd path)
  dq, dk, dv       its backward for dO (the case's delta_mode)
  g_<mode>         (dq, dk, dv) of the ring backward of each delta mode run on the
                   unsharded forward's O and LSE (saved by the test, sharded here)
  naive            (dq, dk, dv): every key shard running the op's own
                   Delta-Matching backward (local renormalization and delta)
  sums_<mode>      (sum_j P' dP_hat, sum_j P', delta) over all key shards, P' =
                   exp(S - lse used by that mode's main pass): the global dS row sums
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import fp8attn  # noqa: F401
from fp8attn import context_parallel as cp


def main():
    rank, world, init_file, out_dir, case_json = sys.argv[1:6]
    rank, world = int(rank), int(world)
    case = json.loads(case_json)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    B, Hq, Hkv, S, D = case["batch"], case["heads_q"], case["heads_kv"], case["seqlen"], case["head_dim"]
    causal, layout, scaling, mode = case["causal"], case["layout"], case["scaling"], case["delta_mode"]
    block = case.get("block_size", 128)
    ref = torch.load(os.path.join(out_dir, "inputs.pt"))
    q, k, v, do, o_ref, lse_ref = (ref[n] for n in ("q", "k", "v", "do", "o", "lse"))
    sh = lambda t: cp.shard(t, layout=layout, block_size=block, rank=rank, world_size=world)  # noqa: E731
    ql, kl, vl, dol = (sh(t).requires_grad_(t is not do) for t in (q, k, v, do))
    scale = D ** -0.5
    res = {}
    o, lse = cp.ring_attention(ql, kl, vl, causal=causal, delta_mode=mode, scaling=scaling, layout=layout,
                               block_size=block, return_lse=True)
    o.backward(dol)
    res.update(o=o.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad)

    # The ring backward on the unsharded forward's O and LSE, every delta mode.
    ring = cp._Ring(None, layout, ql.shape[2], ql.device, block)
    qd, kd, vd, dod = ql.detach(), kl.detach(), vl.detach(), dol.detach()
    o_sh = sh(o_ref)
    lse_sh = cp.shard(lse_ref.unsqueeze(-1), layout=layout, block_size=block, rank=rank,
                      world_size=world).squeeze(-1).contiguous()
    for m in ("stale", "matched_do", "delta_matching"):
        res["g_" + m] = cp._ring_backward(ring, dod, qd, kd, vd, o_sh, lse_sh, scale, causal, m, block, "e4m3",
                                          scaling)
    # Global dS row sums of each mode's main pass: sum_j P' (dP_hat - delta) = A - delta * L.
    pdp, psum = cp.ring_dm_sums(ring, qd, kd, vd, dod, lse_sh, scale, causal, block, "e4m3", scaling)
    delta, lse_b = cp.global_delta(pdp, psum, lse_sh)
    a, l_ = cp.ring_dm_sums(ring, qd, kd, vd, dod, lse_b, scale, causal, block, "e4m3", scaling)
    res["sums_delta_matching"] = (a, l_, delta)
    stale = (dod.float() * o_sh.float()).sum(-1)
    res["sums_stale"] = (pdp, psum, stale)

    # The naive ring: each key shard's pair runs the op's own Delta-Matching backward.
    q_split = ring.split(rank, qd.shape[2])
    dq = torch.zeros_like(qd)
    dk_acc, dv_acc = torch.zeros_like(kd), torch.zeros_like(vd)
    cur_k, cur_v = kd, vd
    for step in range(world):
        src = ring.source(step)
        for qo, qn, ko, kn, pc in cp._pairs(ring, q_split, ring.split(src, cur_k.shape[2]), causal):
            g = torch.ops.fp8attn.bwd(dod.narrow(2, qo, qn), qd.narrow(2, qo, qn), cur_k.narrow(2, ko, kn),
                                      cur_v.narrow(2, ko, kn), o_sh.narrow(2, qo, qn),
                                      lse_sh.narrow(2, qo, qn).contiguous(), scale, pc, "fp8", "delta_matching",
                                      block, "e4m3", False, scaling)
            dq.narrow(2, qo, qn).add_(g[0])
            dk_acc.narrow(2, ko, kn).add_(g[1])
            dv_acc.narrow(2, ko, kn).add_(g[2])
        n = ring.local_lens[ring.source(step + 1)]
        reqs, bufs = ring.exchange([cur_k, cur_v, dk_acc, dv_acc],
                                   [cp._with_len(t.shape, 2, n) for t in (kd, vd, kd, vd)])
        for r in reqs:
            r.wait()
        cur_k, cur_v, dk_acc, dv_acc = bufs
    res["naive"] = (dq, dk_acc, dv_acc)

    # The outlier transforms around the ring (global mean key), end to end.
    if case.get("transforms"):
        qt, kt, vt = (sh(t).requires_grad_() for t in (q, k, v))
        ot, lt = cp.ring_attention(qt, kt, vt, causal=causal, scaling=scaling, layout=layout, block_size=block,
                                   return_lse=True, qk_rotation="hadamard", smooth_k=True)
        ot.backward(dod)
        res["transforms"] = (ot.detach(), lt, qt.grad, kt.grad, vt.grad)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
