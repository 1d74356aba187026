"""GPU benchmark: sliding-window attention (FlashAttention's window_size = (left, right), numerics.md
section 14; issue #20 item 1): fp8attn's `tile` recipe next to cuDNN BF16's sliding window (cuDNN
frontend graph API) and FlexAttention BF16, with full causal cuDNN BF16 (torch SDPA) for context, on
one GPU in one run.

    PYTHONPATH=python python3 benchmarks/bench_window_gpu.py [--shapes 1x16x32768x128]
        [--windows 4095:0,2047:0,-1:0] [--kv-heads H_kv] [--bwd] [--out DIR] [--json PATH]

(a window list that starts with a negative bound needs the = form: --windows=-1:0,4095:0.)

What is measured, per (shape B x H x S x d, window (left, right)):
  * window: FlashAttention's, bottom-right aligned: query i sees key j iff
        j >= i + (Sk - Sq) - left   (when left >= 0)   and   j <= i + (Sk - Sq) + right   (when right >= 0),
    a negative bound unbounded; (4095, 0) = causal local attention over the last 4096 keys (the row's
    own key included), (-1, 0) = full causal. Here Sq = Sk = S.
  * inputs: fresh standard-normal BF16 q [B, H, S, d], k / v / dO [B, H_kv, S, d] (--kv-heads: GQA).
  * time: timing.time_ms, the median of --iters timed calls (CUDA events, a sync after each) after
    --warmup untimed ones. fwd+bwd = one training step of attention: the forward and
    torch.autograd.grad (cuDNN: the forward graph's execute, then the backward graph's).
  * FLOPs count the (query, key) pairs the window lets a row see (the diagonal included):
        pairs = sum over rows i < Sq of max(0, min(Sk, i + Sk - Sq + R + 1) - max(0, i + Sk - Sq - L))
    (L = left, R = right; an unbounded left bound drops the max(0, ...) term's shift: lower end 0; an
    unbounded right bound makes the upper end Sk), summed in closed form by visible_pairs(). For
    Sq = Sk = S: causal window (L, 0), L < S: pairs = S (L + 1) - L (L + 1) / 2; full causal:
    S (S + 1) / 2; no mask: S^2. Forward 4 * B * H * d * pairs (QK^T and PV, 2 FLOPs per
    multiply-add), fwd+bwd 3.5x that (backward 2.5x). bench_gpu.py's causal count S^2 / 2 leaves out
    the diagonal's S / 2 pairs (0.003% at S = 32768).
  * columns:
      fp8 tile (op)   fp8attn.attention(q, k, v, window_size=(left, right), scaling="tile") as called
                      (its Q / K / V quantization kernels included); fwd+bwd with the Delta-Matching
                      backward (the default delta_mode; dO quantization included).
      fp8 kernel      the same calls' attention kernels alone: the CUDA time per call of the kernels
                      named *fwd_tilescale* (+ *bwd_tilescale*: main and pre-pass), torch.profiler
                      (bench_gpu.kernel_ms): comparable with the cuDNN graph time, which has no
                      quantization to do.
      cuDNN window    cuDNN BF16 SDPA through the cuDNN frontend (pip nvidia-cudnn-frontend, module
                      cudnn, written against 1.32.0): pygraph.sdpa (generate_stats=True: the training
                      forward) and sdpa_backward, the window as diagonal_band_left_bound = left + 1
                      (cuDNN's left bound counts the visible keys left of and on the diagonal: it keeps
                      key j of row i iff j > i - bound) and diagonal_band_right_bound = right
                      (keeps j <= i + bound; 0 = causal), diagonal_alignment TOP_LEFT when Sq = Sk
                      (the same mask as BOTTOM_RIGHT there), else BOTTOM_RIGHT. Timed: the graphs'
                      execute only (outputs preallocated). n/a with the reason when the frontend is
                      missing or no plan builds.
      Flex            torch.nn.attention.flex_attention, torch.compile(dynamic=False), BF16, the
                      window as a mask_mod on a create_block_mask block mask (made once per shape and
                      window, outside the timed call; 128 x 128 blocks, the blocks wholly outside the
                      window skipped); enable_gqa with --kv-heads.
      SDPA causal     torch SDPA BF16, SDPBackend.CUDNN_ATTENTION, is_causal=True: full causal, the
                      window's upper bound on work, once per shape (its TFLOP/s count the causal pairs;
                      its forward is timed on inputs not requiring grad, as torch runs it in inference;
                      not self-checked: no window to map).
  * self-check (before any number; a failing column says "bad", never a number): on a small shape
    (B = 1, the same H / H_kv / d, S = 1024) and windows of the same kind (left capped at 255 and at
    63, right at 255), each column's O (with --bwd also dQ, dK, dV) against a float32 reference, torch
    SDPA (math backend) with an explicit boolean mask of the rule above on the GPU: relative Frobenius
    error <= --tol (BF16 columns, default 0.02) or --fp8-tol (fp8attn, default 0.1), AND closer to
    the reference of the checked window than to the reference of every window one off in a bound
    (left +- 1, right +- 1): an off-by-one mapping fails even where it would pass the tolerance. The
    distance between those references ("off-by-one" in the checks table) is the check's power. Also
    reported: each BF16 column's O against fp8attn's (FP8: ~3-5e-2 expected). Then, at the benchmark
    shape itself, a spot check of O: batch 0, the first and last query heads, the first and last 64
    rows and 128 rows around the first row the left bound cuts (S / 2 without one), against
    float32 softmax(Q K^T / sqrt(d) + mask) V computed for those rows at full length (same tolerances;
    it catches a plan that fails at length, not an off-by-one: one key in 4096 moves O by ~1e-3).
A failing cell (out of memory, an unsupported case, a frontend or compile error) is n/a with its
reason under the tables; the run goes on. Writes bench_window_gpu.json (everything, with GPU,
driver, torch, CUDA, cuDNN, cuDNN frontend versions, date) and bench_window_gpu.md under --out
(--json PATH: the JSON there too); prints the markdown last, its last table the summary: TFLOP/s
and fp8attn's ratio to cuDNN BF16's window and to FlexAttention, forward and fwd+bwd.
Exit status: 0; 1 without a CUDA GPU (nothing written); 2 on a bad argument.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# NOTE: bench_gpu first: it puts an in-tree fp8attn build ahead of the installed package (as conftest.py).
from bench_gpu import _shapes_arg, env_info, kernel_ms, tflops, write_results
from cudnn_fp8 import bound_fwd_bwd, frontend, one_line, rel_fro
from timing import int_at_least, positive_float, time_ms
import fp8attn
from fp8attn import cudnn_fp8_attention as cfa

DEVICE = "cuda"  # NOTE: the CPU tests run bench_case on "cpu" (fp8attn's CPU reference; the others n/a)
STEM = "bench_window_gpu"
DEFAULT_SHAPES = [(1, 16, 32768, 128)]
DEFAULT_WINDOWS = [(4095, 0), (2047, 0), (-1, 0)]
CHECK_SEQ = 1024
CHECK_LEFTS = (255, 63)   # the check's left bounds (capped): a longer and a shorter window
CHECK_RIGHT = 255
COLS = ("fp8", "fp8_kernel", "cudnn", "flex", "sdpa_causal")
CHECKED = ("fp8", "cudnn", "flex")     # the columns the self-check covers (fp8_kernel: fp8's calls)
LABEL = {"fp8": "fp8 tile (op)", "fp8_kernel": "fp8 kernel", "cudnn": "cuDNN BF16 window",
         "flex": "Flex BF16", "sdpa_causal": "SDPA cuDNN causal"}
_BIG = 1 << 30            # an unbounded window bound in the Flex mask (S < 2^29)
SPOT_ROWS = 128           # rows per block of the benchmark-shape spot check


# ---- windows and FLOPs (pure, CPU-tested) -----------------------------------------------


def normalize_window(sq: int, sk: int, left: int, right: int) -> tuple:
    """(left, right) with every negative bound -1 and the bounds that reach every key of every row
    -1 too (FlashAttention 3's rule, fp8attn's effective_window: left >= Sk - 1, right >= Sq - 1);
    the mask is unchanged."""
    left = -1 if left < 0 or left >= sk - 1 else left
    right = -1 if right < 0 or right >= sq - 1 else right
    return left, right


def visible_keys(i: int, sq: int, sk: int, left: int, right: int) -> tuple:
    """The keys [lo, hi) row i sees (empty when hi <= lo): the rule of the module docstring."""
    off = sk - sq
    lo = 0 if left < 0 else max(0, i + off - left)
    hi = sk if right < 0 else min(sk, i + off + right + 1)
    return lo, hi


def _clip_sum(n: int, sk: int) -> int:
    """sum of clip(x, 0, sk) over the integers 0 <= x < n (0 for n <= 0)."""
    if n <= 0:
        return 0
    if n - 1 <= sk:
        return n * (n - 1) // 2
    return sk * (sk + 1) // 2 + (n - 1 - sk) * sk


def visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Number of (query, key) pairs the window lets the rows see: sum over i < sq of
    max(0, hi_i - lo_i) with hi_i = clip(i + a, 0, sk), lo_i = clip(i + b, 0, sk),
    a = sk - sq + right + 1 (sk for an unbounded right), b = sk - sq - left (0 for an unbounded left).
    a > b whenever both bounds are set (a - b = left + right + 1), so hi_i >= lo_i and the sum is
    F(a) - F(b), F(c) = sum_i clip(i + c, 0, sk) = _clip_sum(c + sq) - _clip_sum(c)."""
    off = sk - sq

    def f(c):
        return _clip_sum(c + sq, sk) - _clip_sum(c, sk)
    upper = sq * sk if right < 0 else f(off + right + 1)
    lower = 0 if left < 0 else f(off - left)
    return max(0, upper - lower)


def fwd_flops(b: int, h: int, d: int, pairs: int) -> float:
    """Forward FLOPs: 4 * B * H * d per visible pair (QK^T and PV, 2 FLOPs per multiply-add)."""
    return 4.0 * b * h * d * pairs


def window_mask(sq: int, sk: int, left: int, right: int, device="cpu", rows=None) -> torch.Tensor:
    """The boolean [sq, sk] mask of the window (True = visible), built from the rule directly;
    rows (a list of query indices): only those rows, [len(rows), sk]."""
    i = (torch.arange(sq, device=device) if rows is None else torch.tensor(rows, device=device))[:, None]
    j = torch.arange(sk, device=device)[None, :]
    m = torch.ones(i.shape[0], sk, dtype=torch.bool, device=device)
    if left >= 0:
        m &= j >= i + (sk - sq) - left
    if right >= 0:
        m &= j <= i + (sk - sq) + right
    return m


def cudnn_mask_kwargs(cudnn, sq: int, sk: int, left: int, right: int) -> dict:
    """The cuDNN frontend's sdpa / sdpa_backward mask arguments of the window (normalized first):
    diagonal_band_left_bound = left + 1 (cuDNN keeps key j of row i iff j + bound > i: `bound` keys,
    the diagonal's included), diagonal_band_right_bound = right (keeps j <= i + bound), the
    alignment TOP_LEFT when sq == sk (the same mask as BOTTOM_RIGHT there), else BOTTOM_RIGHT
    (FlashAttention's). No bound: {} (no mask)."""
    left, right = normalize_window(sq, sk, left, right)
    kw = {}
    if left >= 0:
        kw["diagonal_band_left_bound"] = left + 1
    if right >= 0:
        kw["diagonal_band_right_bound"] = right
    if kw:
        kw["diagonal_alignment"] = (cudnn.diagonal_alignment.TOP_LEFT if sq == sk
                                    else cudnn.diagonal_alignment.BOTTOM_RIGHT)
    return kw


def flex_offsets(sq: int, sk: int, left: int, right: int) -> tuple:
    """(lo, hi): the Flex mask_mod keeps key j of row i iff i + lo <= j <= i + hi (bounds +-2^30
    when unbounded)."""
    off = sk - sq
    return (off - left if left >= 0 else -_BIG), (off + right if right >= 0 else _BIG)


def make_mask_mod(bounds: torch.Tensor):
    """FlexAttention mask_mod reading the window's (lo, hi) offsets from a captured int32 tensor
    (one function and tensor per device, rewritten in place per window: no recompile per window)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + bounds[0]) & (kv_idx <= q_idx + bounds[1])
    return mask_mod


def check_windows(s: int, left: int, right: int) -> list:
    """The self-check's windows at S = CHECK_SEQ for a benchmark window: left capped at each of
    CHECK_LEFTS, right at CHECK_RIGHT, normalized; unbounded stays unbounded; deduplicated."""
    cr = right if right < 0 else min(right, CHECK_RIGHT)
    lefts = [-1] if left < 0 else [min(left, c) for c in CHECK_LEFTS]
    out = []
    for cl in lefts:
        w = normalize_window(s, s, cl, cr)
        if w not in out:
            out.append(w)
    return out


def neighbors(left: int, right: int) -> list:
    """The windows one off in a set bound (left +- 1, right +- 1; bounds stay >= 0)."""
    out = []
    for dl, dr in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        if (dl and left < 0) or (dr and right < 0):
            continue
        w = (left + dl, right + dr)
        if min(x for x, dx in zip(w, (dl, dr)) if dx) >= 0:
            out.append(w)
    return out


def judge(errs: dict, nb_errs: dict, tol: float):
    """(status, reason) of a self-check: 'ok' when every quantity's error to the checked window's
    reference is <= tol and smaller than its error to every off-by-one window's reference;
    else 'bad' and why. errs: {quantity: err}; nb_errs: {window label: {quantity: err}}."""
    for name, e in errs.items():
        if not (e <= tol):  # NOTE: catches NaN
            return "bad", f"{name} error {e:.3g} > tol {tol:g}"
        for w, ne in nb_errs.items():
            if not (e < ne[name]):
                return "bad", f"{name} closer to window {w}'s reference ({ne[name]:.3g}) than to its own ({e:.3g})"
    return "ok", ""


# ---- the columns --------------------------------------------------------------------------


class Column:
    """fwd() -> O and step() -> (dQ, dK, dV) (a forward + backward) as the timed calls."""

    def __init__(self, fwd, step):
        self.fwd, self.step = fwd, step


def fp8_column(q, k, v, dout, leaves, window) -> Column:
    def fwd():
        return fp8attn.attention(q, k, v, window_size=window, scaling="tile")

    def step():
        return torch.autograd.grad(fp8attn.attention(*leaves, window_size=window, scaling="tile"), leaves, dout)
    return Column(fwd, step)


def sdpa_causal_column(q, k, v, dout, leaves, window=None) -> Column:
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}

    def fwd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    def step():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, **gqa)
        return torch.autograd.grad(o, leaves, dout)
    return Column(fwd, step)


_FLEX = {}


def _flex():
    """(compiled flex_attention, create_block_mask), imported and compiled once."""
    if "fns" not in _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415
        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if isinstance(getattr(cfg, name, None), int):  # NOTE: the check and benchmark shapes each compile
                setattr(cfg, name, max(getattr(cfg, name), 64))
        _FLEX["fns"] = (torch.compile(flex_attention, dynamic=False), create_block_mask)
    return _FLEX["fns"]


def flex_column(q, k, v, dout, leaves, window) -> Column:
    flex, create_block_mask = _flex()
    dev = str(q.device)
    if dev not in _FLEX:
        bounds = torch.zeros(2, dtype=torch.int32, device=q.device)
        _FLEX[dev] = (bounds, make_mask_mod(bounds))
    bounds, mask_mod = _FLEX[dev]
    sq, sk = q.shape[2], k.shape[2]
    # NOTE: written in place: the columns run one window at a time (check, then timing)
    bounds.copy_(torch.tensor(flex_offsets(sq, sk, *window), dtype=torch.int32))
    bm = create_block_mask(mask_mod, None, None, sq, sk, device=q.device)
    gqa = q.shape[1] != k.shape[1]

    def fwd():
        return flex(q, k, v, block_mask=bm, enable_gqa=gqa)

    def step():
        return torch.autograd.grad(flex(*leaves, block_mask=bm, enable_gqa=gqa), leaves, dout)
    return Column(fwd, step)


_CUDNN_GRAPHS = {}


def _cudnn_graphs(cudnn, b, h, hkv, s, d, window, bwd):
    """Built (cached) BF16 forward (and backward) graphs: {'fwd': _Built, 'bwd': _Built or None}."""
    key = (b, h, hkv, s, d, tuple(window), bwd)
    if key in _CUDNN_GRAPHS:
        return _CUDNN_GRAPHS[key]
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    dims, st = [b, h, s, d], [h * s * d, s * d, d, 1]
    kv_dims, kv_st = [b, hkv, s, d], [hkv * s * d, s * d, d, 1]
    stats_dims, stats_st = [b, h, s, 1], [h * s, s, 1, 1]
    mask = cudnn_mask_kwargs(cudnn, s, s, *window)
    tau = 1.0 / math.sqrt(d)

    def graph():
        return cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32,
                             handle=cfa._handle())
    g = graph()
    t = {"q": g.tensor(name="q", dim=dims, stride=st, data_type=bf16)}
    for n in ("k", "v"):
        t[n] = g.tensor(name=n, dim=kv_dims, stride=kv_st, data_type=bf16)
    o, stats = g.sdpa(q=t["q"], k=t["k"], v=t["v"], attn_scale=tau, generate_stats=True, name="sdpa", **mask)
    o.set_output(True).set_dim(dims).set_stride(st).set_data_type(bf16)
    stats.set_output(True).set_dim(stats_dims).set_stride(stats_st).set_data_type(f32)
    t.update(o=o, stats=stats)
    out = {"fwd": cfa._finish(cudnn, g, t), "bwd": None, "mask": {k: str(x) for k, x in mask.items()}}
    if bwd:
        g = graph()
        t = {n: g.tensor(name=n, dim=dims, stride=st, data_type=bf16) for n in ("q", "o", "dO")}
        for n in ("k", "v"):
            t[n] = g.tensor(name=n, dim=kv_dims, stride=kv_st, data_type=bf16)
        t["stats"] = g.tensor(name="stats", dim=stats_dims, stride=stats_st, data_type=f32)
        dq, dk, dv = g.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                                     attn_scale=tau, name="sdpa_backward", **mask)
        dq.set_output(True).set_dim(dims).set_stride(st).set_data_type(bf16)
        for x in (dk, dv):
            x.set_output(True).set_dim(kv_dims).set_stride(kv_st).set_data_type(bf16)
        t.update(dQ=dq, dK=dk, dV=dv)
        out["bwd"] = cfa._finish(cudnn, g, t)
    _CUDNN_GRAPHS[key] = out
    return out


def cudnn_column(q, k, v, dout, leaves, window, bwd=True) -> Column:
    """cuDNN BF16 window graphs bound to these tensors (outputs preallocated): fwd() executes the
    forward graph, step() the forward and then the backward graph."""
    cudnn = frontend()
    b, h, s, d = q.shape
    hkv = k.shape[1]
    gr = _cudnn_graphs(cudnn, b, h, hkv, s, d, window, bwd)
    o = torch.empty_like(q)
    stats = torch.empty(b, h, s, 1, device=q.device, dtype=torch.float32)
    fb = gr["fwd"]
    fpack = {fb.t["q"]: q, fb.t["k"]: k, fb.t["v"]: v, fb.t["o"]: o, fb.t["stats"]: stats}
    if not bwd:
        return Column(*bound_fwd_bwd(fb, fpack, o))
    bb = gr["bwd"]
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    bpack = {bb.t["q"]: q, bb.t["k"]: k, bb.t["v"]: v, bb.t["o"]: o, bb.t["dO"]: dout, bb.t["stats"]: stats,
             bb.t["dQ"]: grads[0], bb.t["dK"]: grads[1], bb.t["dV"]: grads[2]}
    return Column(*bound_fwd_bwd(fb, fpack, o, bb, bpack, grads))


MAKERS = {"fp8": fp8_column, "cudnn": cudnn_column, "flex": flex_column, "sdpa_causal": sdpa_causal_column}


def _make(col, q, k, v, dout, leaves, window, bwd):
    if col == "cudnn":
        return cudnn_column(q, k, v, dout, leaves, window, bwd)
    return MAKERS[col](q, k, v, dout, leaves, window)


# ---- self-check ---------------------------------------------------------------------------


def _inputs(b, h, hkv, s, d, seed, bwd):
    """BF16 standard-normal q, k, v, dO on DEVICE and the leaves (copies requiring grad) for step()."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, dout = rnd(b, h, s, d), rnd(b, hkv, s, d), rnd(b, hkv, s, d), rnd(b, h, s, d)
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v)) if bwd else None
    return q, k, v, dout, leaves


def reference(q, k, v, dout, window, bwd):
    """float32 torch SDPA (math backend) with the window's explicit boolean mask: (O, grads or None)."""
    s_q, s_k, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    mask = window_mask(s_q, s_k, *window, device=q.device)
    qf, kf, vf = (x.detach().float().requires_grad_(bwd) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1),
                                           attn_mask=mask)
    grads = torch.autograd.grad(o, (qf, kf, vf), dout.float()) if bwd else None
    return o.detach(), grads


_CHECKS = {}


def self_check(col, h, hkv, d, window, args) -> dict:
    """The self-check of one column at one check window (cached per (column, H, H_kv, d, window, bwd)):
    {'window', 'status', 'reason', 'err': {O, dQ, dK, dV}, 'neighbors': {label: {...}},
     'off_by_one': smallest reference-to-neighbor distance per quantity, 'vs_fp8': O err to fp8attn's}."""
    key = (col, h, hkv, d, tuple(window), args.bwd)
    if key in _CHECKS:
        return _CHECKS[key]
    s = CHECK_SEQ
    q, k, v, dout, leaves = _inputs(1, h, hkv, s, d, 7 + h + 3 * hkv + d, args.bwd)
    refs = _check_refs(q, k, v, dout, window, args.bwd, (h, hkv, d))
    c = _make(col, q, k, v, dout, leaves, window, args.bwd)
    outs = {"O": c.fwd().clone()}
    if args.bwd:
        outs.update(zip(("dQ", "dK", "dV"), (g.clone() for g in c.step())))
    err = {n: rel_fro(x, refs[tuple(window)][n]) for n, x in outs.items()}
    nb = {str(w): {n: rel_fro(x, refs[w][n]) for n, x in outs.items()} for w in neighbors(*window)}
    status, reason = judge(err, nb, args.fp8_tol if col == "fp8" else args.tol)
    res = {"window": list(window), "S": s, "status": status, "reason": reason, "err": err, "neighbors": nb,
           "off_by_one": {n: min((rel_fro(refs[w][n], refs[tuple(window)][n]) for w in neighbors(*window)),
                                 default=None) for n in outs}}
    if col == "fp8":
        _CHECKS[("fp8_o", h, hkv, d, tuple(window))] = outs["O"]
    else:
        o8 = _CHECKS.get(("fp8_o", h, hkv, d, tuple(window)))
        res["vs_fp8"] = None if o8 is None else rel_fro(outs["O"], o8)
    _CHECKS[key] = res
    return res


_REFS = {}


def _check_refs(q, k, v, dout, window, bwd, key):
    """{window: {O, dQ, dK, dV}} for the checked window and its off-by-one neighbors (cached)."""
    out = {}
    for w in [tuple(window)] + neighbors(*window):
        rk = (key, w, bwd)
        if rk not in _REFS:
            o, grads = reference(q, k, v, dout, w, bwd)
            _REFS[rk] = {"O": o, **(dict(zip(("dQ", "dK", "dV"), grads)) if grads else {})}
        out[w] = _REFS[rk]
    return out


# ---- measurements ---------------------------------------------------------------------------


def _record_error(r, col, e):
    r["errors"][col] = one_line(e, 200)
    print(f"  {col}: n/a ({r['errors'][col]})")


def run_checks(r, col, h, hkv, d, window, args) -> bool:
    """Runs the column's self-checks for the row's window; records them; False when the column
    failed one ('bad') or could not run ('n/a', reason recorded)."""
    try:
        for cw in check_windows(CHECK_SEQ, *window):
            res = self_check(col, h, hkv, d, cw, args)
            r["checks"].setdefault(col, []).append(res)
            if res["status"] != "ok":
                r["status"][col] = "bad"
                r["errors"][col] = f"self-check at S={CHECK_SEQ}, window {tuple(cw)}: {res['reason']}"
                print(f"  {col}: bad ({r['errors'][col]})")
                return False
    except Exception as e:  # noqa: BLE001  (a frontend / compile / CUDA error: n/a, the run goes on)
        _record_error(r, col, e)
        return False
    return True


def measure(r, col, c: Column, flops, args, kernels=False) -> None:
    """r[f'{col}_fwd(_ms)'] and with --bwd r[f'{col}_step(_ms)'] (+ _bwd_ms = step - fwd); kernels:
    also the fp8 kernels' CUDA time (r['fp8_kernel_*'])."""
    ms = time_ms(c.fwd, args.warmup, args.iters)
    r[f"{col}_fwd_ms"], r[f"{col}_fwd"] = ms, tflops(flops, ms)
    if kernels:
        k_ms = kernel_ms(c.fwd, "fwd_tilescale")
        r["fp8_kernel_fwd_ms"], r["fp8_kernel_fwd"] = k_ms, tflops(flops, k_ms)
    if args.bwd:
        step = time_ms(c.step, args.warmup, args.iters)
        r[f"{col}_step_ms"], r[f"{col}_step"] = step, tflops(3.5 * flops, step)
        r[f"{col}_bwd_ms"] = step - ms if step > ms else None
        if kernels:
            kf, kb = kernel_ms(c.step, "fwd_tilescale"), kernel_ms(c.step, "bwd_tilescale")
            k_step = None if kf is None or kb is None else kf + kb
            r["fp8_kernel_step_ms"], r["fp8_kernel_step"] = k_step, tflops(3.5 * flops, k_step)


def bench_sdpa_causal(info_row, shape, args) -> None:
    """Full causal SDPA cuDNN BF16 on the shape (once per shape): info_row gets sdpa_causal_*."""
    b, h, hkv, s, d = shape
    q, k, v, dout, leaves = _inputs(b, h, hkv, s, d, 1000003 * b + 7 * s + d, args.bwd)
    flops = fwd_flops(b, h, d, visible_pairs(s, s, -1, 0))
    try:
        measure(info_row, "sdpa_causal", sdpa_causal_column(q, k, v, dout, leaves), flops, args)
    except Exception as e:  # noqa: BLE001
        _record_error(info_row, "sdpa_causal", e)


def spot_rows(s: int, left: int) -> list:
    """Rows of the benchmark-shape spot check: the rows within SPOT_ROWS / 2 of the first row, of the
    row where the left bound starts cutting keys (left; S / 2 without a left bound) and of the end."""
    half = SPOT_ROWS // 2
    rows = set()
    for c in (0, left if 0 <= left < s else s // 2, s):
        rows.update(range(max(0, c - half), min(s, c + half)))
    return sorted(rows)


def spot_reference(q, k, v, window, rows, heads):
    """float32 O of batch 0, query heads `heads`, query rows `rows` at full length: softmax of the
    masked logits (the window's rule) times V, computed directly ([len(heads), len(rows), S] logits)."""
    rep = q.shape[1] // k.shape[1]
    tau = 1.0 / math.sqrt(q.shape[-1])
    idx = torch.tensor(rows, device=q.device)
    qs = q[0, heads][:, idx].float()
    kh, vh = (x[0, [h // rep for h in heads]].float() for x in (k, v))
    logits = (qs @ kh.transpose(-1, -2)) * tau
    mask = window_mask(q.shape[2], k.shape[2], *window, device=q.device, rows=rows)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ vh


def spot_error(o, ref, rows, heads) -> float:
    """Relative Frobenius error of O's spot-check rows (batch 0, `heads`) against spot_reference."""
    return rel_fro(o[0, heads][:, torch.tensor(rows, device=o.device)], ref)


def bench_case(r, args) -> None:
    """Fills row r (new_row) for one (shape, window), column by column: the self-checks at S = 1024,
    the spot check of O at the benchmark shape, then the timings."""
    b, h, hkv, s, d, window = r["B"], r["H"], r["H_kv"], r["S"], r["d"], tuple(r["window_eff"])
    q, k, v, dout, leaves = _inputs(b, h, hkv, s, d, 1000003 * b + 7 * s + d, args.bwd)
    rows, heads = spot_rows(s, window[0]), sorted({0, h - 1})
    ref = spot_reference(q, k, v, window, rows, heads)
    for col in CHECKED:
        if col in args.skip:
            r["status"][col] = "skipped"
            continue
        if not run_checks(r, col, h, hkv, d, window, args):
            continue
        try:
            c = _make(col, q, k, v, dout, leaves, window, args.bwd)
            err = r["spot"][col] = spot_error(c.fwd(), ref, rows, heads)
            tol = args.fp8_tol if col == "fp8" else args.tol
            if not (err <= tol):
                r["status"][col] = "bad"
                r["errors"][col] = (f"spot check at the benchmark shape (O of {len(heads)} heads x {len(rows)} rows "
                                    f"against float32): error {err:.3g} > tol {tol:g}")
                print(f"  {col}: bad ({r['errors'][col]})")
                continue
            measure(r, col, c, r["fwd_flops"], args, kernels=(col == "fp8"))
            r["status"][col] = "ok"
            if col == "cudnn":
                gr = _CUDNN_GRAPHS[(b, h, hkv, s, d, window, args.bwd)]
                r["cudnn_mask"] = gr["mask"]
                r["cudnn_plans"] = {"fwd": gr["fwd"].plan, "bwd": gr["bwd"].plan if gr["bwd"] else None}
        except Exception as e:  # noqa: BLE001  (OOM, a frontend or compile error: n/a, the run goes on)
            _record_error(r, col, e)
        finally:
            if DEVICE == "cuda":
                torch.cuda.synchronize()


def new_row(shape, window, args) -> dict:
    """A row of one (shape, window) with every number n/a (None)."""
    b, h, hkv, s, d = shape
    eff = normalize_window(s, s, *window)
    pairs = visible_pairs(s, s, *eff)
    r = {"B": b, "H": h, "H_kv": hkv, "S": s, "d": d, "window": list(window), "window_eff": list(eff),
         "pairs": pairs, "keys_per_row": pairs / s, "fwd_flops": fwd_flops(b, h, d, pairs),
         "status": {c: "n/a" for c in CHECKED}, "errors": {}, "checks": {}, "spot": {}}
    for c in COLS:
        r[f"{c}_fwd"] = r[f"{c}_fwd_ms"] = None
        if args.bwd:
            r[f"{c}_step"] = r[f"{c}_step_ms"] = None
    return r


# ---- output ------------------------------------------------------------------------------


def _shape(r) -> str:
    heads = f"{r['H']}" if r["H"] == r["H_kv"] else f"{r['H']}/{r['H_kv']}"
    return f"{r['B']}x{heads}x{r['S']}, {r['d']}"


def window_label(w) -> str:
    left, right = w
    if (left, right) == (-1, 0):
        return "(-1, 0) causal"
    if (left, right) == (-1, -1):
        return "(-1, -1) none"
    return f"({left}, {right})"


def _status(r, col):
    if col in ("fp8_kernel",):
        col = "fp8"
    return (r.get("status") or {}).get(col, "n/a") if col in CHECKED else "n/a"


def _cell(r, col, kind):
    x, ms = r.get(f"{col}_{kind}"), r.get(f"{col}_{kind}_ms")
    if x is None:
        st = _status(r, col)
        return st if st in ("bad", "skipped") else "n/a"
    return f"{x:.0f} ({ms:.3f} ms)"


def _ratio(r, a, b, kind):
    x, y = r.get(f"{a}_{kind}"), r.get(f"{b}_{kind}")
    return "n/a" if x is None or y is None else f"{x / y:.2f}"


def _e(x):
    return "n/a" if x is None else f"{x:.4f}"


def _errs(chk, names):
    e = chk.get("err") or {}
    return " / ".join(_e(e.get(n)) for n in names)


FWD_HEAD = ("| shape B x H x S, d | window (left, right) | keys / row | fp8 tile (op) | fp8 fwd kernel | "
            "cuDNN BF16 window | Flex BF16 | fp8 / cuDNN | fp8 kernel / cuDNN | fp8 / Flex | "
            "SDPA cuDNN causal (context) |")
STEP_HEAD = ("| shape B x H x S, d | window (left, right) | keys / row | fp8 tile (op) | fp8 kernels | "
             "cuDNN BF16 window | Flex BF16 | fp8 / cuDNN | fp8 kernels / cuDNN | fp8 / Flex | "
             "SDPA cuDNN causal (context) |")
CHECK_HEAD = ("| shape B x H x S, d | window | check window | fp8 err | cuDNN err | Flex err | "
              "cuDNN O vs fp8 | Flex O vs fp8 | off-by-one distance |")
SPOT_HEAD = "| shape B x H x S, d | window | fp8 O err | cuDNN O err | Flex O err |"
SUMMARY_HEAD = ("| shape | window | fp8 fwd | cuDNN fwd | fp8 / cuDNN fwd | fp8 / Flex fwd | fp8 fwd+bwd | "
                "cuDNN fwd+bwd | fp8 / cuDNN fwd+bwd | fp8 / Flex fwd+bwd |")


def _sep(head):
    return "|" + "---|" * (head.count("|") - 1)


def _tflops_only(r, col, kind):
    x = r.get(f"{col}_{kind}")
    if x is None:
        st = _status(r, col)
        return st if st in ("bad", "skipped") else "n/a"
    return f"{x:.0f}"


def markdown(rows, info) -> str:
    """The bench_window_gpu.md text: caption, forward table, fwd+bwd table (--bwd), the self-checks,
    the n/a / bad reasons, and the summary table last."""
    a = info["args"]
    fe = info.get("cudnn_frontend") or {}
    fe_text = (f"cuDNN frontend {fe['cudnn_frontend']} (backend {fe.get('cudnn_backend', '?')})"
               if fe.get("cudnn_frontend") else f"cuDNN frontend n/a ({fe.get('why', 'not loaded')})")
    q = "dQ / dK / dV" if a.get("bwd") else ""
    lines = [f"Sliding-window attention, BF16 inputs; TFLOP/s (median ms) on {info['gpu']} (driver "
             f"{info['driver']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}, {fe_text}), "
             f"{info['date']}; median of {a['iters']} calls after {a['warmup']} warm-ups. FLOPs: 4 * B * H * d * "
             "visible pairs (the window's (query, key) pairs, diagonal included), fwd+bwd 3.5x. fp8 tile (op) = "
             "fp8attn.attention(window_size=..., scaling=\"tile\") as called (quantization included), "
             "Delta-Matching backward; fp8 kernel(s) = its attention kernels' CUDA time alone (torch.profiler); "
             "cuDNN BF16 window = cuDNN frontend sdpa / sdpa_backward graphs (diagonal_band_left_bound = left + 1, "
             "diagonal_band_right_bound = right), graph execute only; Flex BF16 = compiled flex_attention with a "
             "sliding-window block mask; SDPA cuDNN causal = torch SDPA BF16 is_causal (full causal, counted over "
             "the causal pairs). Ratios are of TFLOP/s (same FLOPs: inverse time ratios). bad = failed the "
             "self-check (no number), n/a = could not run (reasons below).",
             "", "Forward:", "", FWD_HEAD, _sep(FWD_HEAD)]
    for r in rows:
        lines.append(f"| {_shape(r)} | {window_label(r['window_eff'])} | {r['keys_per_row']:.0f} | "
                     + " | ".join(_cell(r, c, "fwd") for c in ("fp8", "fp8_kernel", "cudnn", "flex"))
                     + f" | {_ratio(r, 'fp8', 'cudnn', 'fwd')} | {_ratio(r, 'fp8_kernel', 'cudnn', 'fwd')} | "
                     f"{_ratio(r, 'fp8', 'flex', 'fwd')} | {_cell(r, 'sdpa_causal', 'fwd')} |")
    if a.get("bwd"):
        lines += ["", "Forward + backward (one training step of attention; fp8 kernels = fwd_tilescale + "
                  "bwd_tilescale kernels; backward alone = step minus forward, in the JSON):", "",
                  STEP_HEAD, _sep(STEP_HEAD)]
        for r in rows:
            lines.append(f"| {_shape(r)} | {window_label(r['window_eff'])} | {r['keys_per_row']:.0f} | "
                         + " | ".join(_cell(r, c, "step") for c in ("fp8", "fp8_kernel", "cudnn", "flex"))
                         + f" | {_ratio(r, 'fp8', 'cudnn', 'step')} | {_ratio(r, 'fp8_kernel', 'cudnn', 'step')} | "
                         f"{_ratio(r, 'fp8', 'flex', 'step')} | {_cell(r, 'sdpa_causal', 'step')} |")
    names = ("O", "dQ", "dK", "dV") if a.get("bwd") else ("O",)
    lines += ["", f"Self-checks (B = 1, S = {CHECK_SEQ}, the same H / H_kv / d): relative Frobenius error of "
              f"O{' / ' + q if q else ''} against float32 SDPA with "
              f"the window's boolean mask (tol {a['tol']:g} BF16, {a['fp8_tol']:g} fp8attn; and closer to it than "
              "to every off-by-one window's reference); off-by-one distance = the smallest distance from the "
              "reference to an off-by-one window's (O), the check's power.", "", CHECK_HEAD, _sep(CHECK_HEAD)]
    for r in rows:
        ch = r.get("checks") or {}
        for i in range(max([len(ch.get(c) or []) for c in CHECKED] + [0])):
            got = {c: (ch[c][i] if len(ch.get(c) or []) > i else None) for c in CHECKED}
            one = next(x for x in got.values() if x is not None)
            cells = ["n/a" if x is None else _errs(x, names) + ("" if x["status"] == "ok" else " (bad)")
                     for x in got.values()]
            lines.append(f"| {_shape(r)} | {window_label(r['window_eff'])} | {window_label(one['window'])} | "
                         + " | ".join(cells) + f" | {_e((got['cudnn'] or {}).get('vs_fp8'))} | "
                         f"{_e((got['flex'] or {}).get('vs_fp8'))} | {_e((one.get('off_by_one') or {}).get('O'))} |")
    spots = [r for r in rows if r.get("spot")]
    if spots:
        lines += ["", "Spot check at the benchmark shape: O of batch 0, the first and last query heads, the first "
                  "and last 64 rows and 128 rows around the left bound's first cut row (S / 2 without one), "
                  "against float32 softmax(QK^T) V with the window's mask: relative Frobenius error.", "",
                  SPOT_HEAD, _sep(SPOT_HEAD)]
        for r in spots:
            lines.append(f"| {_shape(r)} | {window_label(r['window_eff'])} | "
                         + " | ".join(_e(r["spot"].get(c)) for c in CHECKED) + " |")
    notes = [f"- {_shape(r)}, window {window_label(r['window_eff'])}, {LABEL.get(c, c)}: {why}"
             for r in rows for c, why in r.get("errors", {}).items()]
    notes += [f"- {k}: {why}" for k, why in (info.get("errors") or {}).items()]
    if notes:
        lines += ["", "n/a and bad cells (the run went on):", ""] + notes
    lines += ["", "Summary: TFLOP/s over the visible pairs; fp8 = fp8attn tile op as called, cuDNN = cuDNN BF16 "
              "sliding window (graph execute), Flex = FlexAttention BF16."
              + ("" if a.get("bwd") else " Forward only (no --bwd)."), "", SUMMARY_HEAD, _sep(SUMMARY_HEAD)]
    for r in rows:
        lines.append(f"| {_shape(r)} | {window_label(r['window_eff'])} | {_tflops_only(r, 'fp8', 'fwd')} | "
                     f"{_tflops_only(r, 'cudnn', 'fwd')} | {_ratio(r, 'fp8', 'cudnn', 'fwd')} | "
                     f"{_ratio(r, 'fp8', 'flex', 'fwd')} | {_tflops_only(r, 'fp8', 'step')} | "
                     f"{_tflops_only(r, 'cudnn', 'step')} | {_ratio(r, 'fp8', 'cudnn', 'step')} | "
                     f"{_ratio(r, 'fp8', 'flex', 'step')} |")
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------


def _windows_arg(text: str) -> list:
    """'4095:0,2047:0,-1:0' -> [(4095, 0), (2047, 0), (-1, 0)] (argparse type); 'causal' = -1:0,
    'none' = -1:-1; a negative bound is written -1."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        alias = {"causal": (-1, 0), "none": (-1, -1)}
        try:
            w = alias[part] if part in alias else tuple(int(x) for x in part.split(":"))
        except ValueError:
            w = ()
        if len(w) != 2 or any(x < -1 for x in w):
            raise argparse.ArgumentTypeError(f"expected comma-separated LEFT:RIGHT windows (ints >= -1, -1 = "
                                             f"unbounded) or causal / none, e.g. 4095:0,causal, got {part!r}")
        if w not in out:
            out.append(w)
    return out


def _skip_arg(text: str) -> tuple:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    if any(x not in CHECKED + ("sdpa_causal",) for x in out):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(CHECKED + ('sdpa_causal',))}, "
                                         f"got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_window_gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shapes_arg, default=DEFAULT_SHAPES,
                    help="comma-separated BxHxSxd (H = query heads; default 1x16x32768x128)")
    ap.add_argument("--windows", type=_windows_arg, default=DEFAULT_WINDOWS,
                    help="comma-separated LEFT:RIGHT windows, -1 = unbounded, causal = -1:0 "
                         "(default 4095:0,2047:0,-1:0; a list starting with -1 needs --windows=...)")
    ap.add_argument("--kv-heads", type=int_at_least(1), default=None,
                    help="key / value heads H_kv (GQA; divides every shape's H; default H)")
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward (and self-check the gradients)")
    ap.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before each number (default 3)")
    ap.add_argument("--iters", type=int_at_least(1), default=10,
                    help="timed calls per number; the number is their median CUDA-event time (default 10)")
    ap.add_argument("--tol", type=positive_float, default=0.02,
                    help="largest relative Frobenius error of a BF16 column's self-check (default 0.02)")
    ap.add_argument("--fp8-tol", type=positive_float, default=0.1,
                    help="largest relative Frobenius error of fp8attn's self-check (default 0.1)")
    ap.add_argument("--skip", type=_skip_arg, default=(),
                    help="columns not to run: comma-separated subset of fp8,cudnn,flex,sdpa_causal")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                    help=f"directory for {STEM}.json and .md (created; default $OUT, else ./bench_out)")
    ap.add_argument("--json", default=None, help=f"also write the JSON to this path (default only <out>/{STEM}.json)")
    return ap


def parse_args(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    for (_, h, _, _) in args.shapes:
        if args.kv_heads is not None and h % args.kv_heads:
            ap.error(f"argument --kv-heads: {args.kv_heads} does not divide H = {h} of a shape")
    for (_, _, s, _) in args.shapes:
        if s >= _BIG // 2:
            ap.error(f"argument --shapes: S = {s} is too long for this benchmark (< {_BIG // 2})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():  # NOTE: before creating --out: a CPU-only run writes nothing
        print(f"{STEM}.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    info.update(args={k: v for k, v in vars(args).items()}, cudnn_frontend=cfa.version_info(),
                fp8attn_cuda_kernels=bool(getattr(fp8attn._lib, "HAS_CUDA_KERNELS", False)),
                knobs={n: os.environ.get(n) for n in ("FP8ATTN_TILE_FWD", "FP8ATTN_TILE_BWD", "FP8ATTN_TILE_PINGPONG",
                                                      "FP8ATTN_TILE_PERSISTENT", "FP8ATTN_TILE_PREPASS_Q")})
    print("env:", json.dumps(info, default=str))
    rows = []
    for (b, h, s, d) in args.shapes:
        shape = (b, h, args.kv_heads or h, s, d)
        causal = {"errors": {}}
        if "sdpa_causal" not in args.skip:
            print(f"[{b}x{h}x{s}, d={d}: SDPA cuDNN causal]")
            bench_sdpa_causal(causal, shape, args)
        for window in args.windows:
            r = new_row(shape, window, args)
            print(f"[{b}x{h}/{shape[2]}x{s}, d={d}, window {tuple(window)} -> {tuple(r['window_eff'])}: "
                  f"{r['keys_per_row']:.0f} keys / row]")
            for k2, v2 in causal.items():
                if k2.startswith("sdpa_causal"):
                    r[k2] = v2
            if "sdpa_causal" in causal["errors"]:
                r["errors"]["sdpa_causal"] = causal["errors"]["sdpa_causal"]
            try:
                bench_case(r, args)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory making the inputs)
                r["errors"]["case"] = one_line(e, 200)
                print(f"  failed: {r['errors']['case']}")
            print("  " + json.dumps({k2: (round(v2, 3) if isinstance(v2, float) else v2) for k2, v2 in r.items()
                                     if k2 != "checks"}, default=str))
            rows.append(r)
            torch.cuda.empty_cache()
    write_results(args.out, STEM, info, rows, markdown(rows, info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": info, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
