"""The accuracy table of issue #18 item 4: fp8attn's FP8 attention (both scaling recipes x
the outlier transforms of docs/numerics.md section 10), cuDNN's per-tensor FP8 SDPA and
SDPA BF16 against an exact float64 reference, on Gaussian and training-shaped inputs at
long sequence lengths, with the speed cost of each option, in one run on one GPU.

    PYTHONPATH=python python benchmarks/accuracy_gpu.py [--seqlens 1024,4096,16384,65536]
        [--inputs gaussian,training,common_key,outlier_v] [--variants row/none,tile/both,...]
        [--heads 8] [--heads-kv 2] [--speed-seqlen N] [--out DIR] [--allow-nan]
    python benchmarks/accuracy_gpu.py --device cpu --seqlens 256 --heads 2   # CPU smoke, seconds

Shape: batch 1, `--heads` query heads (default 8), `--heads-kv` kv heads (default
heads // 4, i.e. 2: GQA, query head h uses kv head h // (heads / heads_kv)), head_dim 128
(the one head_dim of cuDNN's FP8 backward), causal (bottom-right; seqlen_q = seqlen_k, so
also top-left), softmax_scale 1 / sqrt(head_dim), every seqlen of `--seqlens`. Q, K, V, dO
are BF16 on the device.

Inputs (scripts/recipe_study.py `inputs`, drawn in float64 on the CPU and rounded to BF16;
kv head j draws its K, V and the Q / dO rows of its heads / heads_kv query heads from
torch.Generator().manual_seed(seed + 1000 j), the query heads being consecutive blocks of
seqlen rows, so with one head this is recipe_study's input exactly):
  * gaussian: Q, K, V, dO i.i.d. N(0, 1).
  * training (training-shaped): Q and K N(0, 1) with channels 0-3 x4 in both (channel
    outliers shared by Q and K, as grown QK-norm gains make them); Q plus 2 sqrt(d) / 4 u
    and key 0 set to 16 u (u a random unit vector of the kv head), a sink key with logit
    ~ +8 for every query; then every token's row of Q, K, V, dO times 2^(N(0,1)/2)
    (token-magnitude spread); dO times 1e-4 (small loss gradients).
  * common_key: Gaussian, plus one vector of norm 4 sqrt(d) added to every key (a
    component shared by all keys: |logits| ~ 3 carried by it).
  * outlier_v: Gaussian with V's channel 0 x16 (an outlier channel of V, which neither
    Q / K transform touches).

Variants (`--variants`, default all):
  * fp8attn `{row,tile}/{none,hadamard,smooth_k,both}`: fp8attn.attention(scaling=...,
    qk_rotation="hadamard" for hadamard / both, smooth_k=True for smooth_k / both,
    delta_mode="delta_matching", return_lse=True), backward by autograd. On CUDA its
    kernels (the transforms run around them with torch ops), on CPU the package's CPU
    reference.
  * cudnn-fp8: cuDNN's FP8 SDPA through the frontend graphs of benchmarks/cudnn_fp8.py
    (the first graph variant of cudnn_fp8.VARIANTS that builds; named in the note):
    per-tensor E4M3 with current scaling, i.e. every scale from this call's own amax
    (Q, K, V, dO from the BF16 inputs, O / dP / dQ / dK / dV from calibration runs with
    scale 1, P at 448): delayed scaling at its best. O, dQ, dK, dV are the graphs' E4M3
    outputs (Hopper's FP8 graphs write FP8), dequantized. LSE = the graph's Stats output. GQA:
    K and V repeated to the query heads in BF16, dK / dV summed over each group in FP32.
    CUDA only.
  * sdpa-bf16: torch.nn.functional.scaled_dot_product_attention in BF16 (enable_gqa), on
    CUDA the first of the cuDNN, flash, memory-efficient backends that takes the shape
    (named in the note); LSE n/a (SDPA returns none).
  * ref-f64: the float64 reference again with another query chunk (a sanity row: errors
    ~1e-16, the comparison itself).
A variant that raises (unsupported option, missing cuDNN frontend, out of memory) gets
"n/a (reason)" in its row; the run goes on.

Reference (`exact_reference`): exact attention and its gradients in float64 from the same
BF16 inputs, on the device, per (batch, kv head, query head) and per chunk of `--ref-chunk`
query rows against all the keys the chunk sees (never the whole S): O, LSE and dQ of a chunk
are final after it, delta_i = <dO_i, O_i> from the exact O, dK and dV accumulate over the
chunks and the query heads of the group. Memory per chunk: ~3 chunk x seqlen_k float64
matrices (1.5 GiB at 64K keys and chunk 1024).

Errors (over all heads): relative Frobenius ||X - X_ref||_F / ||X_ref||_F for O, dQ, dK, dV;
LSE: rms absolute error (natural log) over the rows whose reference LSE is finite
(recipe_study's `errors`). A NaN or inf anywhere in an output shows as nan / inf in the table;
the run then exits 1 unless --allow-nan.

Speed (unless --speed-seqlen 0): forward + backward (autograd.grad of the op as called, its
quantization and the transforms included) of every selected variant on Gaussian inputs at
--speed-seqlen (default: the largest of --seqlens <= 16384): median of --iters (default 10)
calls after --warmup calls, CUDA events around each call (CPU: wall clock); ratio to the
`none` option of the same scaling and to sdpa-bf16. cudnn-fp8: its forward and backward
graph executes only (the BF16 -> E4M3 quantization excluded).

Writes accuracy.md and accuracy.json under --out (JSON: non-finite numbers as the strings
"nan" / "inf" / "-inf"), prints the versions first and the markdown last.
Exit status: 0; 1 a non-finite error (without --allow-nan); 2 a bad argument; 3 --device cuda
without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parents[1]
_PY = str(_ROOT / "python")
# NOTE: in-tree build first, else the installed package (FP8ATTN_SOURCE_TREE=0: sys.path's), as bench_gpu.py
if os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and glob.glob(os.path.join(_PY, "fp8attn", "_C*.so")) \
        and _PY not in sys.path:
    sys.path.insert(0, _PY)
for _p in (str(_ROOT / "benchmarks"), str(_ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import fp8attn  # noqa: E402

import cudnn_fp8  # noqa: E402  (benchmarks/cudnn_fp8.py: the cuDNN FP8 graphs)
import recipe_study  # noqa: E402  (scripts/recipe_study.py: the input generator, OPTIONS)
from timing import int_at_least, time_ms  # noqa: E402

F64 = torch.float64
INPUTS = ("gaussian", "training", "common_key", "outlier_v")
OUTLIER_V_CHANNEL, OUTLIER_V_GAIN = 0, 16.0
SCALINGS = ("row", "tile")
OPTIONS = {name: (rot, sm) for name, rot, sm in recipe_study.OPTIONS}   # none, hadamard, smooth_k, both
FP8_VARIANTS = tuple(f"{sc}/{opt}" for sc in SCALINGS for opt in OPTIONS)
VARIANTS = FP8_VARIANTS + ("cudnn-fp8", "sdpa-bf16", "ref-f64")
KEYS = ("o", "lse", "dq", "dk", "dv")
LABELS = {"o": "O", "lse": "LSE", "dq": "dQ", "dk": "dK", "dv": "dV"}
DEFAULT_SEQLENS = (1024, 4096, 16384, 65536)
SDPA_CUDA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
# Tests set this to run the cudnn-fp8 variant on CPU tensors against an emulated frontend
# (tests/python/fake_cudnn.py); a real run needs a CUDA device.
CUDNN_ON_CPU = False


class Unavailable(Exception):
    """A variant that cannot run here (the message says why)."""


# ---- inputs --------------------------------------------------------------------------

def make_inputs(kind: str, seqlen: int, heads: int, heads_kv: int, head_dim: int, seed: int,
                device) -> tuple:
    """BF16 q [1, heads, seqlen, head_dim], k / v [1, heads_kv, seqlen, head_dim] and
    dO [1, heads, seqlen, head_dim] on `device` (module docstring, "Inputs")."""
    if kind not in INPUTS:
        raise ValueError(f"input kind must be one of {INPUTS}, got {kind!r}")
    group = heads // heads_kv
    bf = torch.bfloat16
    q = torch.empty(1, heads, seqlen, head_dim, dtype=bf, device=device)
    do = torch.empty_like(q)
    k = torch.empty(1, heads_kv, seqlen, head_dim, dtype=bf, device=device)
    v = torch.empty_like(k)
    for j in range(heads_kv):
        g = torch.Generator().manual_seed(seed + 1000 * j)
        base = "gaussian" if kind == "outlier_v" else kind
        qj, kj, vj, doj = recipe_study.inputs(base, group * seqlen, seqlen, head_dim, g)  # float64, BF16 values
        if kind == "outlier_v":
            vj[:, OUTLIER_V_CHANNEL] *= OUTLIER_V_GAIN      # a power of two: still BF16 values
        q[0, j * group:(j + 1) * group] = qj.view(group, seqlen, head_dim).to(device=device, dtype=bf)
        do[0, j * group:(j + 1) * group] = doj.view(group, seqlen, head_dim).to(device=device, dtype=bf)
        k[0, j], v[0, j] = kj.to(device=device, dtype=bf), vj.to(device=device, dtype=bf)
        del qj, kj, vj, doj
    return q, k, v, do


# ---- the chunked float64 reference -----------------------------------------------------

def exact_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *, causal: bool,
                    softmax_scale: Optional[float] = None, chunk: int = 1024) -> dict:
    """Exact attention and its gradients in float64, chunked over queries.

    q [B, Hq, Sq, d], k [B, Hkv, Sk, d], v [B, Hkv, Sk, dv], dO [B, Hq, Sq, dv] (any float
    dtype; read as float64; Hq a multiple of Hkv, query head h uses kv head h // (Hq / Hkv));
    causal: bottom-right, query i sees key j iff j <= i + Sk - Sq (a row that sees no key:
    O = 0, LSE = -inf, zero gradients); softmax_scale tau (default 1 / sqrt(d)).
    Returns float64 tensors on q's device: o [B, Hq, Sq, dv], lse [B, Hq, Sq] (natural log),
    dq [B, Hq, Sq, d], dk [B, Hkv, Sk, d], dv [B, Hkv, Sk, dv].
    Per (batch, kv head, query head) and chunk of `chunk` query rows: S = tau Q_c K^T over
    the keys the chunk sees, LSE, P, O_c = P V, delta = rowsum(dO_c o O_c), dS = P o (dO_c V^T
    - delta), dQ_c = tau dS K; dK += tau dS^T Q_c, dV += P^T dO_c. Peak extra memory ~3 chunk
    x Sk float64 matrices."""
    B, Hq, Sq, d = q.shape
    Hkv, Sk, dv_ = k.shape[1], k.shape[2], v.shape[3]
    if Hq % Hkv or k.shape[0] != B or v.shape[:3] != k.shape[:3] or do.shape != (B, Hq, Sq, dv_):
        raise ValueError(f"exact_reference: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"dO {tuple(do.shape)}")
    if chunk < 1:
        raise ValueError(f"exact_reference: chunk must be >= 1, got {chunk}")
    tau = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    group = Hq // Hkv
    out = {"o": torch.zeros(B, Hq, Sq, dv_, dtype=F64, device=dev),
           "lse": torch.full((B, Hq, Sq), -math.inf, dtype=F64, device=dev),
           "dq": torch.zeros(B, Hq, Sq, d, dtype=F64, device=dev),
           "dk": torch.zeros(B, Hkv, Sk, d, dtype=F64, device=dev),
           "dv": torch.zeros(B, Hkv, Sk, dv_, dtype=F64, device=dev)}
    for b in range(B):
        for hk in range(Hkv):
            kk, vv = k[b, hk].to(F64), v[b, hk].to(F64)
            dk_acc, dv_acc = out["dk"][b, hk], out["dv"][b, hk]
            for h in range(hk * group, (hk + 1) * group):
                qh, doh = q[b, h].to(F64), do[b, h].to(F64)
                for i0 in range(0, Sq, chunk):
                    i1 = min(i0 + chunk, Sq)
                    kend = Sk if not causal else max(0, min(Sk, i1 + Sk - Sq))
                    if kend == 0:
                        continue   # no row of the chunk sees a key: O = 0, LSE = -inf, dQ = 0
                    qc, doc, kc, vc = qh[i0:i1], doh[i0:i1], kk[:kend], vv[:kend]
                    s = (qc @ kc.T).mul_(tau)
                    if causal:
                        rows = torch.arange(i0, i1, device=dev)[:, None] + (Sk - Sq)
                        s.masked_fill_(torch.arange(kend, device=dev)[None, :] > rows, -math.inf)
                    lse = torch.logsumexp(s, 1)
                    p = s.sub_(torch.where(torch.isfinite(lse), lse, 0.0)[:, None]).exp_()  # masked: exp(-inf) = 0
                    del s
                    o = p @ vc
                    delta = (doc * o).sum(1)
                    ds = (doc @ vc.T).sub_(delta[:, None]).mul_(p)
                    out["o"][b, h, i0:i1] = o
                    out["lse"][b, h, i0:i1] = lse
                    out["dq"][b, h, i0:i1] = (ds @ kc).mul_(tau)
                    dk_acc[:kend].addmm_(ds.T, qc, alpha=tau)
                    dv_acc[:kend].addmm_(p.T, doc)
                    del p, ds, o
    return out


# ---- errors --------------------------------------------------------------------------

def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F in float64 (nan / inf when x is; nan when ref is zero)."""
    den = ref.norm().item()
    num = (x.to(F64) - ref).norm().item()
    return num / den if den > 0 else float("nan")


def lse_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """rms of x - ref over the rows whose reference LSE is finite (natural log units)."""
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return float("nan")
    return (x.to(F64)[fin] - ref[fin]).pow(2).mean().sqrt().item()


def errors(got: dict, ref: dict) -> dict:
    """{o, lse, dq, dk, dv: error} of `got` (tensors of the reference's shapes; a missing
    or None entry: None, i.e. n/a) against `ref` (exact_reference): relative Frobenius over
    all heads, LSE rms absolute."""
    res = {}
    for key in KEYS:
        x = got.get(key)
        if x is None:
            res[key] = None
        elif tuple(x.shape) != tuple(ref[key].shape):
            raise ValueError(f"errors: {key} has shape {tuple(x.shape)}, the reference {tuple(ref[key].shape)}")
        else:
            res[key] = lse_rms(x, ref[key]) if key == "lse" else rel_fro(x, ref[key])
    return res


# ---- variants ------------------------------------------------------------------------

one_line = cudnn_fp8.one_line   # an exception as one short line (the n/a reasons)


def run_fp8attn(q, k, v, do, causal: bool, scaling: str, option: str) -> dict:
    """fp8attn.attention forward (O, LSE) and Delta-Matching backward (dQ, dK, dV)."""
    rot, smooth = OPTIONS[option]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = fp8attn.attention(qg, kg, vg, causal=causal, scaling=scaling, qk_rotation=rot, smooth_k=smooth,
                               delta_mode="delta_matching", return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
    return {"o": o.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _sdpa_backends(device) -> list:
    """[(name, context factory)] in the order tried (CPU: torch's own choice)."""
    if torch.device(device).type != "cuda":
        return [("cpu (torch's choice)", None)]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return [(n, (lambda n=n: sdpa_kernel([getattr(SDPBackend, n)]))) for n in SDPA_CUDA_BACKENDS]


def _sdpa_fwd_bwd(q, k, v, do, causal, ctx):
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    with (ctx() if ctx is not None else contextlib.nullcontext()):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=gqa)
        grads = torch.autograd.grad(o, (qg, kg, vg), do)
    return o.detach(), grads


def _sdpa_pick(q, k, v, do, causal):
    """(backend name, context factory, (o, grads)) of the first SDPA backend that runs."""
    refused = []
    for name, ctx in _sdpa_backends(q.device):
        try:
            return name, ctx, _sdpa_fwd_bwd(q, k, v, do, causal, ctx)
        except RuntimeError as e:   # "No available kernel" / the backend refuses the shape
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            refused.append(f"{name}: {one_line(e, 80)}")
    raise Unavailable("no SDPA backend ran: " + "; ".join(refused))


def run_sdpa_bf16(q, k, v, do, causal: bool) -> dict:
    name, _ctx, (o, (dq, dk, dv)) = _sdpa_pick(q, k, v, do, causal)
    return {"o": o, "lse": None, "dq": dq, "dk": dk, "dv": dv, "note": f"backend {name}; LSE n/a (SDPA returns none)"}


def _cudnn_case(q, k, v, do, causal):
    """(case, fwd _Built, bwd _Built, variant label, group, O, (dQ, dK, dV)) of cuDNN FP8 on
    these inputs: K / V repeated to the query heads (group = Hq / Hkv), the first graph variant
    of cudnn_fp8.VARIANTS whose forward and backward build (VARIANTS[0] in every bench_gpu.py
    run on the H200), forward and backward run once after their calibration runs. O and the
    gradients are the graphs' E4M3 outputs dequantized to FP32 [B, Hq, S, d] (dK / dV per
    query head, not yet summed over the group)."""
    if q.device.type != "cuda" and not CUDNN_ON_CPU:
        raise Unavailable(f"cuDNN FP8 needs a CUDA GPU (this run is on {q.device.type})")
    if cudnn_fp8.load() is None:
        raise Unavailable(f"no cuDNN frontend: {cudnn_fp8._STATE['why']} (pip install nvidia-cudnn-frontend)")
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(group, 1) if group > 1 else x for x in (k, v))
    shape = tuple(q.shape)
    reasons = []
    for var in cudnn_fp8.VARIANTS:
        fb = cudnn_fp8._built("fwd", shape, causal, var)
        bb = cudnn_fp8._built("bwd", shape, causal, var)
        bad = [x for x in (fb, bb) if isinstance(x, str)]
        if bad:
            reasons.append(f"[{var.label()}] {bad[0]}")
            continue
        case = cudnn_fp8._Case(q, kk, vv, do, var)
        o = case.run_fwd(fb)
        grads = case.run_bwd(bb)
        return case, fb, bb, var.label(), group, o, grads
    raise Unavailable("no cuDNN FP8 graph variant built: " + "; ".join(reasons))


def run_cudnn_fp8(q, k, v, do, causal: bool) -> dict:
    case, _fb, _bb, label, group, o, (dq, dk, dv) = _cudnn_case(q, k, v, do, causal)
    if group > 1:
        b, hq, s, d = dk.shape
        dk = dk.reshape(b, hq // group, group, s, d).sum(2)
        dv = dv.reshape(b, hq // group, group, s, dv.shape[3]).sum(2)
    lse = case.fwd_pack["stats"][..., 0].clone()
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "note": f"graph variant {label}"}


def run_variant(name: str, q, k, v, do, causal: bool, ref_chunk: int) -> dict:
    """Outputs {o, lse, dq, dk, dv[, note]} of one variant (lse None: n/a). Raises
    Unavailable (or whatever the variant raises) when it cannot run."""
    if name in FP8_VARIANTS:
        sc, opt = name.split("/")
        return run_fp8attn(q, k, v, do, causal, sc, opt)
    if name == "sdpa-bf16":
        return run_sdpa_bf16(q, k, v, do, causal)
    if name == "cudnn-fp8":
        return run_cudnn_fp8(q, k, v, do, causal)
    if name == "ref-f64":
        other = max(1, ref_chunk // 2 - 1)   # NOTE: another chunk (not dividing the default 1024)
        out = exact_reference(q, k, v, do, causal=causal, chunk=other)
        out["note"] = f"float64 reference recomputed with query chunk {other}"
        return out
    raise ValueError(f"unknown variant {name!r}")


# ---- speed ---------------------------------------------------------------------------

def speed_fn(name: str, q, k, v, do, causal: bool) -> tuple:
    """(callable timed as one forward + backward, note) of a variant on these inputs."""
    if name in FP8_VARIANTS:
        sc, opt = name.split("/")
        rot, smooth = OPTIONS[opt]
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def fn():
            o = fp8attn.attention(qg, kg, vg, causal=causal, scaling=sc, qk_rotation=rot, smooth_k=smooth,
                                  delta_mode="delta_matching")
            return torch.autograd.grad(o, (qg, kg, vg), do)
        return fn, "op as called (quantization, transforms included)"
    if name == "sdpa-bf16":
        backend, ctx, _ = _sdpa_pick(q, k, v, do, causal)
        return (lambda: _sdpa_fwd_bwd(q, k, v, do, causal, ctx)), f"backend {backend}"
    if name == "cudnn-fp8":
        case, fb, bb, label, *_ = _cudnn_case(q, k, v, do, causal)
        fwd = cudnn_fp8._launcher(fb, case.fwd_pack, case.fwd_ws)
        bwd = cudnn_fp8._launcher(bb, case.bwd_pack, case.bwd_ws)

        def fn():
            fwd()
            bwd()
        return fn, f"graph executes only (quantization excluded), {label}"
    raise Unavailable(f"{name} is not timed")


def wall_ms(fn: Callable, warmup: int, iters: int) -> float:
    """Median wall-clock ms of fn() over `iters` calls after `warmup` (CPU tensors)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def speed_table(variants, seqlen, args, device) -> list:
    """[{variant, ms, note, reason}] at `seqlen` on Gaussian inputs, plus the ratios."""
    q, k, v, do = make_inputs("gaussian", seqlen, args.heads, args.heads_kv, args.head_dim, args.seed, device)
    timer = time_ms if torch.device(device).type == "cuda" else wall_ms
    rows = []
    for name in variants:
        if name == "ref-f64":
            continue
        row = {"variant": name, "seqlen": seqlen, "ms": None, "note": "", "reason": None}
        try:
            fn, row["note"] = speed_fn(name, q, k, v, do, not args.non_causal)
            row["ms"] = timer(fn, args.warmup, args.iters)
        except Exception as e:  # noqa: BLE001  (an unsupported option, OOM, a missing frontend: n/a)
            row["reason"] = one_line(e)
        print(f"[speed] S={seqlen} {name}: " + (f"{row['ms']:.3f} ms" if row["ms"] is not None
                                                 else f"n/a ({row['reason']})"), flush=True)
        rows.append(row)
        _free(device)
    by = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        base = f"{r['variant'].split('/')[0]}/none" if r["variant"] in FP8_VARIANTS else None
        r["vs_none"] = _ratio(r["ms"], by.get(base)) if base else None
        r["vs_none_of"] = base
        r["vs_sdpa_bf16"] = _ratio(r["ms"], by.get("sdpa-bf16")) if r["variant"] != "sdpa-bf16" else None
    del q, k, v, do
    return rows


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---- the run -------------------------------------------------------------------------

def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def accuracy_rows(args, device) -> list:
    """One row per (input, seqlen, variant): {input, seqlen, variant, errors, status, reason, note}."""
    rows = []
    causal = not args.non_causal
    for seqlen in args.seqlens:
        for kind in args.inputs:
            t0 = time.time()
            q, k, v, do = make_inputs(kind, seqlen, args.heads, args.heads_kv, args.head_dim, args.seed, device)
            t1 = time.time()
            ref = exact_reference(q, k, v, do, causal=causal, chunk=args.ref_chunk)
            _sync(device)
            print(f"[acc] {kind} S={seqlen}: inputs {t1 - t0:.1f} s, float64 reference {time.time() - t1:.1f} s",
                  flush=True)
            for name in args.variants:
                row = {"input": kind, "seqlen": seqlen, "variant": name, "errors": dict.fromkeys(KEYS),
                       "status": "ok", "reason": None, "note": ""}
                t2 = time.time()
                try:
                    got = run_variant(name, q, k, v, do, causal, args.ref_chunk)
                    row["note"] = got.pop("note", "")
                    row["errors"] = errors(got, ref)
                    del got
                except Exception as e:  # noqa: BLE001  (the variant's n/a: its reason in the row)
                    row["status"], row["reason"] = "n/a", one_line(e)
                _sync_quiet(device, row)
                row["seconds"] = round(time.time() - t2, 3)
                if row["status"] == "ok" and not all(x is None or math.isfinite(x) for x in row["errors"].values()):
                    row["status"] = "non-finite"
                print(f"[acc] {kind} S={seqlen} {name}: " + _cells(row), flush=True)
                rows.append(row)
                _free(device)
            del q, k, v, do, ref
            _free(device)
    return rows


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _sync_quiet(device, row) -> None:
    try:
        _sync(device)
    except Exception as e:  # noqa: BLE001  (a sticky CUDA error from inside a variant)
        row["status"], row["reason"] = "n/a", f"synchronize: {one_line(e)}"


def fmt(x) -> str:
    """An error as a table cell: n/a, nan, inf, 0, 4 decimals, or 2 significant digits below 1e-3."""
    if x is None:
        return "n/a"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.4f}" if abs(x) >= 1e-3 else f"{x:.1e}"


def _cells(row) -> str:
    if row["status"] == "n/a":
        return f"n/a ({row['reason']})"
    return " ".join(f"{LABELS[key]} {fmt(row['errors'][key])}" for key in KEYS)


def _note(row) -> str:
    if row["status"] == "n/a":
        return f"n/a ({row['reason']})".replace("|", "/")
    return ("NON-FINITE; " if row["status"] == "non-finite" else "") + row["note"].replace("|", "/")


INPUT_DOC = {
    "gaussian": "Q, K, V, dO i.i.d. N(0, 1)",
    "training": "Q, K N(0, 1) with channels 0-3 x4 in both; a sink key (key 0 = 16 u, Q + 2 sqrt(d) / 4 u: "
                "logit ~ +8 for every query); every token row of Q, K, V, dO x 2^(N(0,1)/2); dO x 1e-4",
    "common_key": f"Gaussian plus one vector of norm {recipe_study.COMMON_KEY:g} sqrt(d) added to every key",
    "outlier_v": f"Gaussian with V channel {OUTLIER_V_CHANNEL} x{OUTLIER_V_GAIN:g}",
}


def markdown(info: dict, rows: list, speed: list) -> str:
    s = info["settings"]
    v = info["versions"]
    lines = [
        "# fp8attn accuracy vs exact float64 (benchmarks/accuracy_gpu.py)", "",
        f"Versions: torch {v.get('torch')}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, "
        f"cuDNN frontend {v.get('cudnn_frontend')}, GPU {v.get('gpu') or 'none (CPU)'}, "
        f"fp8attn CUDA kernels {v.get('fp8attn_cuda_kernels')}, git {v.get('git_commit')}, "
        f"{v.get('time_utc')} UTC.", "",
        f"Command: `{v.get('command')}`", "",
        f"Shape: batch 1, {s['heads']} query heads, {s['heads_kv']} kv heads"
        f"{' (GQA)' if s['heads'] != s['heads_kv'] else ''}, head_dim {s['head_dim']}, "
        f"{'causal' if s['causal'] else 'not causal'}, seqlen_q = seqlen_k, softmax_scale 1/sqrt(head_dim), "
        f"BF16 inputs on {s['device']}, seed {s['seed']} (kv head j: seed + 1000 j). fp8attn: "
        "delta_mode delta_matching, E4M3.", "",
        "Inputs (scripts/recipe_study.py `inputs`, float64 rounded to BF16):", "",
    ]
    lines += [f"* {kind}: {INPUT_DOC[kind]}" for kind in s["inputs"]]
    lines += ["", "Errors against exact float64 attention (chunked over queries on the device): relative "
              "Frobenius ||X - X_ref|| / ||X_ref|| over all heads for O, dQ, dK, dV; LSE: rms absolute error "
              "(natural log) over rows with a finite reference LSE.", "",
              "| inputs | seqlen | variant | O | LSE | dQ | dK | dV | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [fmt(r["errors"][key]) for key in KEYS]
        lines.append(f"| {r['input']} | {r['seqlen']} | {r['variant']} | " + " | ".join(cells) + f" | {_note(r)} |")
    if speed:
        lines += ["", f"Speed: forward + backward at seqlen {speed[0]['seqlen']} (Gaussian inputs, same shape), "
                      f"median of {s['iters']} calls after {s['warmup']} "
                      f"({'CUDA events' if s['device'] == 'cuda' else 'wall clock'}); "
                      "ratio = time / time of the named variant (> 1: slower).", "",
                  "| variant | fwd+bwd ms | vs none (same scaling) | vs sdpa-bf16 | note |",
                  "|---|---|---|---|---|"]
        for r in speed:
            ms = f"{r['ms']:.3f}" if r["ms"] is not None else "n/a"
            vn = f"{r['vs_none']:.2f}x" if r["vs_none"] is not None else "n/a"
            vs = f"{r['vs_sdpa_bf16']:.2f}x" if r["vs_sdpa_bf16"] is not None else "n/a"
            note = f"n/a ({r['reason']})" if r["reason"] else r["note"]
            lines.append(f"| {r['variant']} | {ms} | {vn} | {vs} | {note.replace('|', '/')} |")
    bad = [r for r in rows if r["status"] == "non-finite"]
    if bad:
        lines += ["", "NON-FINITE outputs (nan / inf errors): " + ", ".join(
            f"{r['input']} {r['seqlen']} {r['variant']}" for r in bad)]
    return "\n".join(lines) + "\n"


def _jsonable(x):
    """Non-finite floats as strings (strict JSON), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def versions(argv) -> dict:
    from fp8attn.train import provenance
    info = provenance.collect(command=shlex.join(["python", "benchmarks/accuracy_gpu.py", *argv]))
    fe = cudnn_fp8.version_info()
    info["cudnn_frontend"] = fe.get("cudnn_frontend") or f"none ({fe.get('why')})"
    if fe.get("cudnn_backend"):
        info["cudnn_frontend_backend"] = fe["cudnn_backend"]
    return info


def _int_list(text: str) -> list:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return vals


def _name_list(choices):
    def parse(text: str) -> list:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"expected distinct names from {', '.join(choices)}; got {text!r}")
        return names
    return parse


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="accuracy_gpu.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Exit status: 0; 1 a non-finite error (without --allow-nan); "
                                        "2 a bad argument; 3 --device cuda without a CUDA GPU.")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default) or cpu (smoke: the package's CPU reference; cuDNN FP8 n/a)")
    ap.add_argument("--seqlens", type=_int_list, default=list(DEFAULT_SEQLENS),
                    help="comma-separated seqlens (default 1024,4096,16384,65536)")
    ap.add_argument("--inputs", type=_name_list(INPUTS), default=list(INPUTS),
                    help=f"comma-separated input kinds (default {','.join(INPUTS)})")
    ap.add_argument("--variants", type=_name_list(VARIANTS), default=list(VARIANTS),
                    help=f"comma-separated variants (default all: {','.join(VARIANTS)})")
    ap.add_argument("--heads", type=int_at_least(1), default=8, help="query heads (default 8)")
    ap.add_argument("--heads-kv", type=int_at_least(1), default=None,
                    help="kv heads (default max(1, heads // 4): 2 for 8 heads); must divide --heads")
    ap.add_argument("--head-dim", type=int_at_least(1), default=128, help="head_dim (default 128)")
    ap.add_argument("--non-causal", action="store_true", help="no causal mask (default: causal)")
    ap.add_argument("--seed", type=int, default=1, help="input seed (default 1, as recipe_study.py)")
    ap.add_argument("--ref-chunk", type=int_at_least(1), default=1024,
                    help="query rows per chunk of the float64 reference (default 1024)")
    ap.add_argument("--speed-seqlen", type=int_at_least(0), default=None,
                    help="seqlen of the speed table (default: the largest of --seqlens <= 16384, else the "
                         "smallest; 0: no speed table)")
    ap.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before timing (default 3)")
    ap.add_argument("--iters", type=int_at_least(1), default=10, help="timed calls, median taken (default 10)")
    ap.add_argument("--out", default=None, help="directory for accuracy.md and accuracy.json")
    ap.add_argument("--allow-nan", action="store_true", help="exit 0 even when an output is NaN / inf")
    args = ap.parse_args(argv)
    if args.heads_kv is None:
        args.heads_kv = max(1, args.heads // 4)
    if args.heads % args.heads_kv:
        ap.error(f"--heads-kv {args.heads_kv} must divide --heads {args.heads}")
    if args.speed_seqlen is None:
        small = [s for s in args.seqlens if s <= 16384]
        args.speed_seqlen = max(small) if small else min(args.seqlens)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("accuracy_gpu.py: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--device cpu runs the CPU smoke", file=sys.stderr)
        return 3
    device = torch.device(args.device)
    vers = versions(argv)
    print("versions: " + ", ".join(f"{k} {vers.get(k)}" for k in
                                   ("torch", "cuda", "cudnn", "cudnn_frontend", "gpu", "fp8attn_cuda_kernels",
                                    "git_commit", "time_utc")), flush=True)
    settings = {"device": args.device, "heads": args.heads, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
                "causal": not args.non_causal, "seed": args.seed, "seqlens": args.seqlens, "inputs": args.inputs,
                "variants": args.variants, "ref_chunk": args.ref_chunk, "speed_seqlen": args.speed_seqlen,
                "warmup": args.warmup, "iters": args.iters, "fp8attn_delta_mode": "delta_matching",
                "input_kinds": {k: INPUT_DOC[k] for k in args.inputs}}
    t0 = time.time()
    rows = accuracy_rows(args, device)
    speed = speed_table(args.variants, args.speed_seqlen, args, device) if args.speed_seqlen else []
    info = {"versions": vers, "settings": settings, "rows": rows, "speed": speed,
            "seconds": round(time.time() - t0, 1)}
    md = markdown(info, rows, speed)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "accuracy.md").write_text(md)
        (out / "accuracy.json").write_text(json.dumps(_jsonable(info), indent=1) + "\n")
    print()
    print(md, end="")
    print(f"({info['seconds']} s)")
    bad = [r for r in rows if r["status"] == "non-finite"]
    if bad and not args.allow_nan:
        print(f"accuracy_gpu.py: {len(bad)} row(s) with a NaN / inf output (exit 1; --allow-nan to accept)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
