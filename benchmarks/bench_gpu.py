"""GPU benchmark: fp8attn forward and backward (each delta mode) next to torch
SDPA BF16 (cuDNN and FlashAttention backends) and cuDNN FP8 (per-tensor E4M3,
cuDNN frontend graph API, benchmarks/cudnn_fp8.py), on the same GPU in the same run.

    PYTHONPATH=python python3 benchmarks/bench_gpu.py [--quick | --shapes BxHxSxd,...] [--out DIR]

What is measured, per (shape, causal):
  * time: the median of --iters timed calls (CUDA events around each call)
    after --warmup untimed calls; inputs are fresh standard-normal BF16 (never zeros).
  * TFLOP/s (the usual convention, docs/performance-model.md): forward
    4 * B * H * S * S * d FLOPs, halved for causal; backward 2.5x the forward;
    divided by the median time.
  * fp8attn: the op as called, its FP8 quantization kernels included.
  * --scaling row,tile adds the `tile` recipe's forward (numerics.md section 9):
    the op as called (quantization included) and its attention kernel alone (the
    CUDA time of the fwd_tilescale kernels per call, torch.profiler: compare
    with cuDNN FP8's graph time, which excludes its quantization too);
    tile_pingpong in the list also times the pingpong order
    (FP8ATTN_TILE_PINGPONG=1; the backward's main kernel with
    FP8ATTN_TILE_BWD_PINGPONG=1), tile_persistent the persistent scheduler
    (FP8ATTN_TILE_PERSISTENT=1); the quantization kernels' time and bandwidth;
    a table of its own, ratios to cuDNN BF16 in the same run. Unless --no-bwd,
    also the `tile` backward (bench_tile_bwd), including its two
    Delta-Matching pre-passes side by side (FP8ATTN_TILE_PREPASS_Q=64 and
    128: the kernel time of each, same process).
  * --softcap C (with a tile recipe in --scaling): the `tile` forward and
    Delta-Matching backward again with logit softcapping c = C (numerics.md
    section 12), op and kernel times with and without it in the same run (torch
    SDPA has no softcap; the table compares fp8 tile with itself).
  * cuDNN FP8: the graph execute only (its BF16 -> E4M3 input quantization is
    excluded), after a self-check against SDPA BF16: "bad" when the relative
    Frobenius error of O / dQ / dK / dV exceeds --cudnn-fp8-tol, "n/a" when the
    frontend is missing or no graph variant builds (reason in the log).
  * accuracy table (unless --no-accuracy): ||x - ref||_F / ||ref||_F of
    fp8attn's O and Delta-Matching dQ, dK, dV, and cuDNN FP8's self-check
    numbers, against torch SDPA BF16 on the same inputs, computed by a fixed
    SDPA backend: cuDNN, else flash, else math (the caption names the one used).
  * issue #5's report table (unless --no-extras): the forward's TFLOP/s as a
    share of the FP8 GEMM ceiling measured in the same run (cuBLAS through
    torch._scaled_mm, E4M3 8192^3, per-tensor scales, BF16 out); the
    Delta-Matching pre-pass's share of the DM backward's kernel time
    (torch.profiler, kernels named *prepass*); the bytes autograd saves for the
    backward (unique storages, inputs included) and the peak memory of one
    forward + backward above the inputs, for fp8attn.attention and for SDPA
    BF16 on the cuDNN backend (an O(S^2) buffer would show as GBs).
A shape that fails (out of memory, an unsupported head_dim, any RuntimeError or
ValueError) keeps what was measured, n/a elsewhere and the reason under the
table; the run goes on.
Writes bench_gpu.json and bench_gpu.md under --out and prints the markdown
last: TFLOP/s and the ratio to cuDNN BF16.
Exit status: 0; 1 without a CUDA GPU (nothing written); 2 on a bad argument.
"""
import argparse
import contextlib
import datetime
import gc
import glob
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
# NOTE: in-tree build first, else the installed package (FP8ATTN_SOURCE_TREE=0: sys.path's, as conftest.py)
if os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and glob.glob(os.path.join(_PY, "fp8attn", "_C*.so")):
    sys.path.insert(0, _PY)
import fp8attn  # noqa: E402,F401  (registers torch.ops.fp8attn)

import cudnn_fp8  # noqa: E402  (benchmarks/, next to this script)
from timing import int_at_least, positive_float, time_ms  # noqa: E402

OPS = torch.ops.fp8attn
MODES = ("stale", "matched_do", "delta_matching")

# (B, H, S, d): 16K tokens per batch at d = 128, plus d = 64 / 256 at 8K.
FULL = [(16, 16, 1024, 128), (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128),
        (2, 16, 8192, 64), (2, 16, 8192, 256)]
QUICK = [(4, 16, 4096, 128), (2, 16, 8192, 64), (2, 16, 8192, 256)]



@contextlib.contextmanager
def _env_set(name: str, value: str):
    """os.environ[name] = value inside the block, the previous value (or none) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old

def sdpa_times(backend, q, k, v, dout, causal, warmup, iters):
    """(fwd ms, bwd ms) of torch SDPA with one backend, or (None, None) if unavailable."""
    try:
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([backend]):
            fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup, iters)
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            bwd = time_ms(lambda: torch.autograd.grad(o, (qr, kr, vr), dout, retain_graph=True), warmup, iters)
        return fwd, bwd
    except RuntimeError as e:  # backend refuses the shape
        print(f"  {backend.name}: n/a ({str(e).splitlines()[0][:80]})")
        return None, None


def env_info():
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    try:
        info["driver"] = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        info["driver"] = "unknown"
    return info


def tflops(flops, ms):
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def gemm_ceiling(warmup, iters, n=8192):
    """TFLOP/s of cuBLAS FP8 GEMM n^3 (torch._scaled_mm, E4M3 x E4M3, per-tensor scales 1, BF16 out):
    the FP8 ceiling the forward is reported against. None if _scaled_mm refuses."""
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # NOTE: column-major second operand
        one = torch.ones((), device="cuda")
        ms = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                     warmup, iters)
    except Exception as e:  # noqa: BLE001  (a missing driver or CUDA build, _scaled_mm refusing: n/a)
        print(f"  FP8 GEMM ceiling: n/a ({cudnn_fp8.one_line(e, 120)})")
        return None
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def kernel_times(fn, reps):
    """[(kernel name, CUDA us summed over the `reps` calls)] of fn's CUDA kernels, in
    torch.profiler's key_averages order (torch.profiler over `reps` calls after one warm-up
    call). Totals, not per call: callers sum first and divide by `reps` once."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]


def prepass_share(fn, reps=3):
    """Share (0..1) of fn's CUDA kernel time spent in kernels whose name contains "prepass"
    (kernel_times over `reps` calls)."""
    ev = kernel_times(fn, reps)
    total = sum(us for _, us in ev)
    pre = sum(us for name, us in ev if "prepass" in name)
    return pre / total if total > 0 and pre > 0 else None  # NOTE: no pre-pass kernel found: n/a, not 0%


def kernel_ms(fn, name, reps=5):
    """CUDA time (ms) per call of fn spent in kernels whose name contains `name`
    (kernel_times over `reps` calls); None if none ran."""
    us = sum(t for key, t in kernel_times(fn, reps) if name in key)
    return us / 1e3 / reps if us > 0 else None


def memory_mb(attn, q, k, v, dout):
    """(MiB autograd saves for the backward, peak MiB of one forward + backward above what was
    allocated before) for out = attn(q, k, v) with q, k, v requiring grad. Saved bytes count
    unique storages, the inputs included (both fp8attn and SDPA keep q, k, v)."""
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t
    gc.collect()
    torch.cuda.synchronize()
    # NOTE: base read after the reset: a tensor freed in between (a garbage-collected cycle)
    # would otherwise make the peak look smaller than the base.
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attn(qg, kg, vg)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return sum(storages.values()) / 2 ** 20, peak / 2 ** 20


def fmt_t(x):
    return "n/a" if x is None else f"{x:.0f}"


def fmt_r(x, ref):
    return "" if x is None or ref is None else f" ({x / ref:.2f}x)"


HEAD = ("| B x H x S, d | causal | cuDNN fwd | flash fwd | cuDNN fp8 fwd | fp8 fwd | cuDNN bwd | "
        "flash bwd | cuDNN fp8 bwd | fp8 bwd stale | fp8 bwd matched_do | fp8 bwd DM |")


def fmt_cudnn_fp8(r, which, ref):
    """TFLOP/s (ratio) of the cuDNN FP8 column, or its status: 'bad' (failed the self-check) / 'n/a'."""
    status = (r.get("cudnn_fp8_status") or {}).get(which, "n/a")
    x = r.get(f"cudnn_fp8_{which}")
    if status == "ok":
        return f"{fmt_t(x)}{fmt_r(x, ref)}"  # fmt_t: n/a when no time
    return status


def _cudnn_fp8_note(info) -> str:
    """What the cuDNN fp8 columns hold: the frontend version, or why they are empty."""
    cf = info.get("cudnn_fp8")
    if cf is None:
        return "cuDNN fp8: not run (--no-cudnn-fp8)."
    if cf.get("cudnn_frontend") is None:
        return f"cuDNN fp8: not available ({cf.get('why') or 'no cuDNN frontend'})."
    return (f"cuDNN fp8: cuDNN frontend {cf['cudnn_frontend']} sdpa_fp8 / "
            "sdpa_fp8_backward, per-tensor E4M3 scales, FP8 O / dQ / dK / dV; timed as the graph execute only "
            "(excludes its BF16 -> E4M3 input quantization; fp8attn's numbers include ours); "
            "bad = failed the self-check against SDPA BF16, n/a = not available (see the log).")


def _shape_label(r) -> str:
    return f"{r['B']}x{r['H']}x{r['S']}, {r['d']}"


def _reference_note(rows) -> str:
    """The SDPA backend(s) the accuracy reference used (cudnn_fp8.REFERENCE_BACKENDS order)."""
    used = {}
    for r in rows:
        if r.get("reference"):
            used[r["reference"]] = used.get(r["reference"], 0) + 1
    order = " > ".join(cudnn_fp8.REFERENCE_BACKENDS)
    if not used:
        return f"SDPA backend: none ran ({order}, the first that accepts the shape)"
    if len(used) == 1:
        return f"SDPA backend {next(iter(used))} (order {order}: the first that accepts the shape)"
    per = ", ".join(f"{name} ({n} rows)" for name, n in used.items())
    return f"SDPA backends {per} (order {order}: the first that accepts the shape)"


def markdown(rows, info):
    """The bench_gpu.md text: a caption, a note on the cuDNN FP8 columns, one table row per (shape, causal),
    the reasons of failed rows, and the accuracy table."""
    lines = [f"TFLOP/s on {info['gpu']} (driver {info['driver']}, torch {info['torch']}, cuDNN {info['cudnn']}), "
             f"{info['date']}; (x) = ratio to cuDNN BF16",
             "", _cudnn_fp8_note(info), "", HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    for r in rows:
        cf, cb = r.get("cudnn_fwd"), r.get("cudnn_bwd")
        lines.append(
            f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | {fmt_t(cf)} | "
            f"{fmt_t(r.get('flash_fwd'))} | {fmt_cudnn_fp8(r, 'fwd', cf)} | "
            f"{fmt_t(r.get('fp8_fwd'))}{fmt_r(r.get('fp8_fwd'), cf)} | {fmt_t(cb)} | "
            f"{fmt_t(r.get('flash_bwd'))} | {fmt_cudnn_fp8(r, 'bwd', cb)} | "
            + " | ".join(f"{fmt_t(r.get(f'fp8_bwd_{m}'))}{fmt_r(r.get(f'fp8_bwd_{m}'), cb)}" for m in MODES) + " |")
    if any(r.get("fp8_saved_mb") is not None or r.get("prepass_share") is not None for r in rows):
        ceil = info.get("fp8_gemm_ceiling")
        lines += ["", f"Issue #5 report: FP8 GEMM ceiling {fmt_t(ceil)} TFLOP/s (cuBLAS via torch._scaled_mm, "
                  "E4M3 8192^3, per-tensor scales, same run); DM pre-pass share = the pre-pass kernel's part of "
                  "the Delta-Matching backward's kernel time (torch.profiler); saved = bytes autograd keeps for "
                  "the backward (inputs included), peak = peak memory of one forward + backward above the "
                  "inputs; SDPA = torch SDPA BF16 on the cuDNN backend.", "", REPORT_HEAD,
                  "|" + "---|" * (REPORT_HEAD.count("|") - 1)]
        for r in rows:
            share = r.get("prepass_share")
            of_ceil = None if ceil is None or r.get("fp8_fwd") is None else 100 * r["fp8_fwd"] / ceil
            lines.append(f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | "
                         f"{fmt_t(of_ceil)}{'' if of_ceil is None else '%'} | "
                         f"{'n/a' if share is None else f'{100 * share:.0f}%'} | "
                         f"{fmt_t(r.get('fp8_saved_mb'))} | {fmt_t(r.get('sdpa_saved_mb'))} | "
                         f"{fmt_t(r.get('fp8_peak_mb'))} | {fmt_t(r.get('sdpa_peak_mb'))} |")
    if any(r.get("tile_fwd") is not None for r in rows):
        lines += ["", "scaling=\"tile\" forward (numerics.md section 9), TFLOP/s (x = ratio to cuDNN BF16 above): "
                  "op = the op as called (quantization included); kernel = the fwd_tilescale kernel's CUDA "
                  "time alone (torch.profiler); pingpong = FP8ATTN_TILE_PINGPONG=1, persistent = "
                  "FP8ATTN_TILE_PERSISTENT=1 (op as called); quant = the quant_tilescale kernels' CUDA time per "
                  "call (torch.profiler) and bytes moved / that time; O err = "
                  "||O - O_SDPA|| / ||O_SDPA|| (n/a with --no-accuracy).", "",
                  TILE_HEAD, "|" + "---|" * (TILE_HEAD.count("|") - 1)]
        for r in rows:
            cf = r.get("cudnn_fwd")
            lines.append(f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | {fmt_t(cf)} | "
                         f"{fmt_t(r.get('fp8_fwd'))}{fmt_r(r.get('fp8_fwd'), cf)} | "
                         + " | ".join(f"{fmt_t(r.get(n))}{fmt_r(r.get(n), cf)}"
                                      for n in ("tile_fwd", "tile_fwd_kernel", "tile_fwd_pingpong",
                                                "tile_fwd_persistent"))
                         + f" | {_fmt_quant(r)} | {fmt_e(r.get('tile_fwd_err'))} |")
    if any(r.get("tile_bwd_delta_matching") is not None for r in rows):
        # NOTE: the pre-pass A/B column only where a run measured it (older JSON renders as before).
        pre_ab = any(r.get("tile_bwd_prepass_q64_ms") is not None or r.get("tile_bwd_prepass_q128_ms") is not None
                     for r in rows)
        # The pingpong column likewise (tile_pingpong in --scaling).
        bwd_pp = any(r.get("tile_bwd_kernels_pingpong") is not None for r in rows)
        bwd_det = any(r.get("tile_bwd_deterministic") is not None for r in rows)
        bwd_head = (TILE_BWD_HEAD + (" pre-pass ms v1 / v2 |" if pre_ab else "")
                    + (" tile DM kernels pingpong |" if bwd_pp else "")
                    + (" tile DM deterministic op |" if bwd_det else ""))
        lines += ["", "scaling=\"tile\" backward (FP8ATTN_TILE_BWD=1), TFLOP/s (x = ratio to cuDNN BF16 bwd above): "
                  "op = the op as called (Q / K / V / dO quantization included); kernels = main + pre-pass "
                  "kernels' CUDA time alone (torch.profiler); pre-pass share of the kernels; step = tile fwd + "
                  "DM bwd (ops as called) against cuDNN BF16 fwd + bwd; err = ||dX - dX_SDPA|| / ||dX_SDPA||"
                  + ("; pre-pass v1 / v2 = the pre-pass kernel's CUDA time with FP8ATTN_TILE_PREPASS_Q=64 / 128 "
                     "(64 / 128 queries per CTA)" if pre_ab else "")
                  + ("; kernels pingpong = main kernel with FP8ATTN_TILE_BWD_PINGPONG=1 + pre-pass" if bwd_pp
                     else "")
                  + ("; deterministic op = the DM op as called with deterministic=True" if bwd_det else "")
                  + ".", "",
                  bwd_head, "|" + "---|" * (bwd_head.count("|") - 1)]
        for r in rows:
            cb = r.get("cudnn_bwd")
            mm, pm = r.get("tile_bwd_main_ms"), r.get("tile_bwd_prepass_ms")
            share = "n/a" if mm is None or pm is None else f"{100 * pm / (mm + pm):.0f}%"
            st = _step_ratio(r, "tile_step_ms")
            err = r.get("tile_bwd_err") or {}
            lines.append(f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | {fmt_t(cb)} | "
                         f"{fmt_t(r.get('fp8_bwd_delta_matching'))}{fmt_r(r.get('fp8_bwd_delta_matching'), cb)} | "
                         + " | ".join(f"{fmt_t(r.get(n))}{fmt_r(r.get(n), cb)}"
                                      for n in ("tile_bwd_delta_matching", "tile_bwd_stale", "tile_bwd_kernels"))
                         + f" | {share} | {'n/a' if st is None else f'{st:.2f}x'} | "
                         + " / ".join(fmt_e(err.get(n)) for n in ("dQ", "dK", "dV")) + " |"
                         + (" " + " / ".join(_fmt_ms(r.get(f"tile_bwd_prepass_q{n}_ms")) for n in (64, 128)) + " |"
                            if pre_ab else "")
                         + (f" {fmt_t(r.get('tile_bwd_kernels_pingpong'))}"
                            f"{fmt_r(r.get('tile_bwd_kernels_pingpong'), cb)} |" if bwd_pp else "")
                         + (f" {fmt_t(r.get('tile_bwd_deterministic'))}"
                            f"{fmt_r(r.get('tile_bwd_deterministic'), cb)} |" if bwd_det else ""))
    if any(r.get("softcap") for r in rows):
        caps = sorted({r["softcap"] for r in rows if r.get("softcap")})
        lines += ["", f"scaling=\"tile\" with logit softcapping c = {', '.join(f'{c:g}' for c in caps)} "
                  "(numerics.md section 12; torch SDPA has none), ms: none / softcap and their ratio; op = the op "
                  "as called, kernel(s) = the fwd_tilescale kernel / the DM main + pre-pass kernels' CUDA time "
                  "(torch.profiler); bwd after a forward of the same kind.", "",
                  SOFTCAP_HEAD, "|" + "---|" * (SOFTCAP_HEAD.count("|") - 1)]
        for r in rows:
            mm, pm = r.get("tile_bwd_main_ms"), r.get("tile_bwd_prepass_ms")
            pairs = ((r.get("tile_fwd_ms"), r.get("tile_fwd_softcap_ms")),
                     (r.get("tile_fwd_kernel_ms"), r.get("tile_fwd_softcap_kernel_ms")),
                     (r.get("tile_bwd_delta_matching_ms"), r.get("tile_bwd_softcap_dm_ms")),
                     (None if mm is None or pm is None else mm + pm, r.get("tile_bwd_softcap_kernels_ms")))
            lines.append(f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | "
                         + " | ".join(f"{_fmt_ms(a)} / {_fmt_ms(b)} | "
                                      + ("n/a" if a is None or b is None or a <= 0 else f"{b / a:.2f}")
                                      for a, b in pairs) + " |")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "Failed rows (n/a from the failure on; the run went on):", ""]
        lines += [f"- {_shape_label(r)}, causal {'yes' if r['causal'] else 'no'}: {r['error']}" for r in failed]
    if any("fp8_err" in r for r in rows):
        theirs_note = ("cuDNN fp8 = per-tensor E4M3 (its self-check numbers)" if info.get("cudnn_fp8") is not None
                       else "cuDNN fp8 not run (--no-cudnn-fp8)")
        lines += ["", "Accuracy: ||x - ref|| / ||ref|| (Frobenius) against torch SDPA BF16 on the same inputs, "
                  f"{_reference_note(rows)}; fp8attn = block-scaled E4M3, delta_matching backward; "
                  f"{theirs_note}.", "", ACC_HEAD, "|" + "---|" * (ACC_HEAD.count("|") - 1)]
        for r in rows:
            mine, theirs = r.get("fp8_err") or {}, r.get("cudnn_fp8_info") or {}
            lines.append(f"| {_shape_label(r)} | {'yes' if r['causal'] else 'no'} | "
                         + " | ".join(f"{fmt_e(mine.get(n))} | {fmt_e(theirs.get(n))}" for n in ("O", "dQ", "dK", "dV"))
                         + " |")
    return "\n".join(lines)


TILE_HEAD = ("| B x H x S, d | causal | cuDNN fwd | fp8 row fwd | fp8 tile fwd (op) | tile fwd kernel only | "
             "tile fwd pingpong (op) | tile fwd persistent (op) | tile quant us (TB/s) | tile O err vs SDPA |")


TILE_BWD_HEAD = ("| B x H x S, d | causal | cuDNN bwd | fp8 row DM bwd | tile DM bwd (op) | tile stale bwd (op) | "
                 "tile DM kernels only | pre-pass share | tile step fwd+bwd vs cuDNN | tile dQ / dK / dV err |")


SOFTCAP_HEAD = ("| B x H x S, d | causal | tile fwd op ms | softcap / none | fwd kernel ms | softcap / none | "
                "tile DM bwd op ms | softcap / none | DM kernels ms | softcap / none |")


def _fmt_ms(ms):
    return "n/a" if ms is None else f"{ms:.3f}"


def _fmt_quant(r):
    ms, tbs = r.get("tile_quant_ms"), r.get("tile_quant_tbs")
    return "n/a" if ms is None else f"{1e3 * ms:.0f} ({tbs:.2f})"

REPORT_HEAD = ("| B x H x S, d | causal | fp8 fwd / FP8 GEMM ceiling | DM pre-pass share | saved MiB fp8attn | "
               "saved MiB SDPA | peak MiB fp8attn | peak MiB SDPA |")

ACC_HEAD = ("| B x H x S, d | causal | O fp8attn | O cuDNN fp8 | dQ fp8attn | dQ cuDNN fp8 | dK fp8attn | "
            "dK cuDNN fp8 | dV fp8attn | dV cuDNN fp8 |")


def fmt_e(x):
    return "n/a" if x is None else f"{x:.4f}"


def _shapes_arg(text: str) -> list:
    """'BxHxSxd,...' -> [(B, H, S, d), ...] (argparse type)."""
    out = []
    for part in text.split(","):
        try:
            sh = tuple(int(x) for x in part.lower().split("x"))
        except ValueError:
            sh = ()
        if len(sh) != 4 or min(sh) <= 0:
            raise argparse.ArgumentTypeError(f"expected comma-separated BxHxSxd (four positive integers), "
                                             f"e.g. 1x16x16384x128, got {part!r}")
        out.append(sh)
    return out


def _scalings_arg(text: str) -> tuple:
    """'row,tile' -> ('row', 'tile') (argparse type)."""
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    if not out or any(x not in ("row", "tile", "tile_pingpong", "tile_persistent") for x in out):
        raise argparse.ArgumentTypeError("expected a comma-separated subset of row,tile,tile_pingpong,tile_persistent, "
                                         f"got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (the device script's default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                    help="directory for bench_gpu.json and bench_gpu.md (created; default $OUT, else ./bench_out)")
    ap.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before timing each number (default 3)")
    ap.add_argument("--iters", type=int_at_least(1), default=10,
                    help="timed calls per number; the number is their median CUDA-event time (default 10)")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA baselines")
    ap.add_argument("--no-cudnn-fp8", action="store_true", help="skip the cuDNN FP8 baseline (cuDNN frontend)")
    ap.add_argument("--cudnn-fp8-tol", type=positive_float, default=cudnn_fp8.DEFAULT_TOL,
                    help="largest relative Frobenius error of the cuDNN FP8 self-check (else the column says bad)")
    ap.add_argument("--cudnn-fp8-verbose", action="store_true", help="log every cuDNN FP8 graph variant tried")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the issue #5 report table (FP8 GEMM ceiling, DM pre-pass share, memory)")
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the accuracy table (fp8attn and cuDNN FP8 against SDPA BF16)")
    ap.add_argument("--shapes", default=None, type=_shapes_arg,
                    help="comma-separated BxHxSxd shapes instead of the built-in lists, e.g. 1x16x16384x128")
    ap.add_argument("--scaling", default="row", type=_scalings_arg,
                    help="comma-separated recipes: row (always), tile (adds the tile forward table), "
                         "tile_pingpong (also its pingpong order), tile_persistent (also its persistent scheduler)")
    ap.add_argument("--softcap", type=positive_float, default=None, metavar="C",
                    help="with a tile recipe in --scaling: also time the tile forward and DM backward with logit "
                         "softcapping c = C (a table of their own: with and without softcap, same run)")
    return ap


def new_row(b, h, s, d, causal) -> dict:
    """A row with every number n/a (None), filled in as the measurements succeed."""
    r = {"B": b, "H": h, "S": s, "d": d, "causal": causal}
    for name in ("cudnn", "flash", "cudnn_fp8"):
        r[f"{name}_fwd"] = r[f"{name}_bwd"] = None
    r["cudnn_fp8_fwd_ms"] = r["cudnn_fp8_bwd_ms"] = None
    r["cudnn_fp8_status"] = {"fwd": "n/a", "bwd": "n/a"}
    r["fp8_fwd"] = r["fp8_fwd_ms"] = None
    for name in ("tile_fwd", "tile_fwd_kernel", "tile_fwd_pingpong", "tile_fwd_softcap", "tile_fwd_softcap_kernel"):
        r[name] = r[f"{name}_ms"] = None
    r["softcap"] = r["tile_bwd_softcap_dm_ms"] = r["tile_bwd_softcap_kernels_ms"] = None
    for mode in MODES:
        r[f"fp8_bwd_{mode}"] = r[f"fp8_bwd_{mode}_ms"] = None
    r["prepass_share"] = r["fp8_saved_mb"] = r["fp8_peak_mb"] = r["sdpa_saved_mb"] = r["sdpa_peak_mb"] = None
    return r


def bench_shape(r, args) -> None:
    """Fills row r (new_row) for one (shape, causal); raises on a failure (the caller records it)."""
    b, h, s, d, causal = r["B"], r["H"], r["S"], r["d"], r["causal"]
    gen = torch.Generator(device="cuda").manual_seed(b * 1000003 + s * 7 + d + causal)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    tau = 1.0 / math.sqrt(d)
    fwd_flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    bwd_flops = 2.5 * fwd_flops
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        f_ms, b_ms = (None, None) if args.no_sdpa else sdpa_times(backend, q, k, v, dout, causal,
                                                                   args.warmup, args.iters)
        r[f"{name}_fwd"], r[f"{name}_bwd"] = tflops(fwd_flops, f_ms), tflops(bwd_flops, b_ms)
    # NOTE: one SDPA BF16 reference per shape, for the accuracy table and the cuDNN FP8 self-check.
    ref = None if args.no_accuracy else cudnn_fp8._reference(q, k, v, dout, causal, bwd=not args.no_bwd)
    if not args.no_cudnn_fp8:
        res = cudnn_fp8.run(q, k, v, dout, causal, time_ms, args.warmup, args.iters, bwd=not args.no_bwd,
                            tol=args.cudnn_fp8_tol, verbose=args.cudnn_fp8_verbose, ref=ref)
        r["cudnn_fp8_status"] = {"fwd": res.fwd_status, "bwd": res.bwd_status}
        r["cudnn_fp8_fwd"], r["cudnn_fp8_fwd_ms"] = tflops(fwd_flops, res.fwd_ms), res.fwd_ms
        r["cudnn_fp8_bwd"], r["cudnn_fp8_bwd_ms"] = tflops(bwd_flops, res.bwd_ms), res.bwd_ms
        r["cudnn_fp8_info"] = {**res.info, "fwd_variant": res.fwd_variant, "bwd_variant": res.bwd_variant}
        if res.fwd_status != "ok" or (res.bwd_status != "ok" and not args.no_bwd):
            r["cudnn_fp8_reasons"] = res.reasons
            print(f"  cudnn fp8: fwd {res.fwd_status}, bwd {res.bwd_status} ({cudnn_fp8.reason(res)})")
    f_ms = time_ms(lambda: OPS.fwd(q, k, v, tau, causal, "fp8", 128), args.warmup, args.iters)
    r["fp8_fwd"], r["fp8_fwd_ms"] = tflops(fwd_flops, f_ms), f_ms
    scalings = getattr(args, "scaling", ("row",))
    if any(x.startswith("tile") for x in scalings):
        # NOTE: FP8ATTN_TILE_FWD=1 (the default) runs the CUDA tile forward (docs/architecture.md)
        os.environ["FP8ATTN_TILE_FWD"] = os.environ.get("FP8ATTN_TILE_FWD") or "1"

        def tile_fwd():
            return OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile")
        t_ms = time_ms(tile_fwd, args.warmup, args.iters)
        r["tile_fwd"], r["tile_fwd_ms"] = tflops(fwd_flops, t_ms), t_ms
        k_ms = kernel_ms(tile_fwd, "fwd_tilescale")
        r["tile_fwd_kernel"], r["tile_fwd_kernel_ms"] = tflops(fwd_flops, k_ms), k_ms
        # The Q / K / V quantization launch(es) alone, and their bandwidth: BF16 read once,
        # one code byte per element written, FP32 scales (Q per token, K / V per 128-key tile).
        q_ms = kernel_ms(tile_fwd, "quant_tilescale")
        q_bytes = (3 * (q.numel() + k.numel() + v.numel()) + 4 * q.numel() // q.shape[-1]
                   + 8 * (k.numel() // k.shape[-1] + 127) // 128)
        r["tile_quant_ms"] = q_ms
        r["tile_quant_tbs"] = None if q_ms is None else q_bytes / (q_ms * 1e-3) / 1e12
        if "tile_persistent" in scalings:
            os.environ["FP8ATTN_TILE_PERSISTENT"] = "1"  # read by run_fwd_tile on every call
            try:
                s_ms = time_ms(tile_fwd, args.warmup, args.iters)
            finally:
                del os.environ["FP8ATTN_TILE_PERSISTENT"]
            r["tile_fwd_persistent"], r["tile_fwd_persistent_ms"] = tflops(fwd_flops, s_ms), s_ms
        if "tile_pingpong" in scalings:
            os.environ["FP8ATTN_TILE_PINGPONG"] = "1"  # read by run_fwd_tile on every call
            try:
                p_ms = time_ms(tile_fwd, args.warmup, args.iters)
            finally:
                del os.environ["FP8ATTN_TILE_PINGPONG"]
            r["tile_fwd_pingpong"], r["tile_fwd_pingpong_ms"] = tflops(fwd_flops, p_ms), p_ms
        if ref is not None:
            r["tile_fwd_err"] = cudnn_fp8.rel_fro(tile_fwd()[0], ref.o)
        cap = getattr(args, "softcap", None)
        if cap:
            # The same forward with logit softcapping (numerics.md section 12): op and kernel.
            r["softcap"] = cap

            def tile_fwd_softcap():
                return OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=cap)
            c_ms = time_ms(tile_fwd_softcap, args.warmup, args.iters)
            r["tile_fwd_softcap"], r["tile_fwd_softcap_ms"] = tflops(fwd_flops, c_ms), c_ms
            ck_ms = kernel_ms(tile_fwd_softcap, "fwd_tilescale")
            r["tile_fwd_softcap_kernel"], r["tile_fwd_softcap_kernel_ms"] = tflops(fwd_flops, ck_ms), ck_ms
        if not args.no_bwd:
            bench_tile_bwd(r, args, q, k, v, dout, tau, causal, bwd_flops, ref)
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
    for mode in MODES:
        if args.no_bwd:
            continue
        try:
            b_ms = time_ms(lambda: OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", mode, 128,
                                           "e4m3", False), args.warmup, args.iters)
        except NotImplementedError as e:  # backward kernels not built
            print(f"  fp8 bwd: n/a ({str(e).splitlines()[0][:80]})")
            b_ms = None
        r[f"fp8_bwd_{mode}"], r[f"fp8_bwd_{mode}_ms"] = tflops(bwd_flops, b_ms), b_ms
    if not args.no_extras and r["fp8_bwd_delta_matching"] is not None:
        # NOTE: report-table extras: a failure here leaves n/a cells, not a failed row.
        try:
            r["prepass_share"] = prepass_share(lambda: OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8",
                                                               "delta_matching", 128, "e4m3", False))
        except RuntimeError as e:
            print(f"  pre-pass share: n/a ({cudnn_fp8.one_line(e, 120)})")
        try:
            r["fp8_saved_mb"], r["fp8_peak_mb"] = memory_mb(
                lambda x, y, z: fp8attn.attention(x, y, z, causal=causal, softmax_scale=tau), q, k, v, dout)
        except RuntimeError as e:
            print(f"  fp8attn memory: n/a ({cudnn_fp8.one_line(e, 120)})")
        if not args.no_sdpa:
            def sdpa(x, y, z):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(x, y, z, is_causal=causal, scale=tau)
            try:
                r["sdpa_saved_mb"], r["sdpa_peak_mb"] = memory_mb(sdpa, q, k, v, dout)
            except RuntimeError as e:  # NOTE: the cuDNN backend refuses some shapes; the row stays valid
                print(f"  SDPA memory: n/a ({cudnn_fp8.one_line(e, 120)})")
    # Accuracy next to speed: ||x - ref|| / ||ref|| against SDPA BF16 on the same inputs (the
    # reference of the cuDNN FP8 self-check, the same fixed backend order), O and the
    # Delta-Matching dQ, dK, dV.
    if ref is not None:
        r["reference"] = ref.backend
        r["fp8_err"] = {"O": cudnn_fp8.rel_fro(out, ref.o)}
        if ref.grads is not None:
            g = OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", "delta_matching", 128, "e4m3", False)
            r["fp8_err"].update({n: cudnn_fp8.rel_fro(x, y) for n, x, y in zip(("dQ", "dK", "dV"), g[:3], ref.grads)})


def bench_tile_bwd(r, args, q, k, v, dout, tau, causal, bwd_flops, ref) -> None:
    """The `tile` backward (FP8ATTN_TILE_BWD=1 while timing): the op as called (its Q / K / V / dO
    quantization included) for delta_matching and stale, the main and pre-pass kernels' CUDA time
    (torch.profiler), and the training step fwd + bwd (delta_matching) of the tile op."""
    old = os.environ.get("FP8ATTN_TILE_BWD")
    os.environ["FP8ATTN_TILE_BWD"] = "1"  # read by the op on every call
    try:
        t_out, t_lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile")

        def bwd(mode):
            return lambda: OPS.bwd(dout, q, k, v, t_out, t_lse, tau, causal, "fp8", mode, 128, "e4m3", False,
                                   "tile")
        for mode in ("delta_matching", "stale"):
            ms = time_ms(bwd(mode), args.warmup, args.iters)
            r[f"tile_bwd_{mode}"], r[f"tile_bwd_{mode}_ms"] = tflops(bwd_flops, ms), ms
        # deterministic=True (dQ partials added in a fixed turn order, numerics.md section 9, "Deterministic backward"):
        # the op as called, DM; its cost is this against tile_bwd_delta_matching.
        det_ms = time_ms(lambda: OPS.bwd(dout, q, k, v, t_out, t_lse, tau, causal, "fp8", "delta_matching", 128,
                                         "e4m3", False, "tile", deterministic=True), args.warmup, args.iters)
        r["tile_bwd_deterministic"], r["tile_bwd_deterministic_ms"] = tflops(bwd_flops, det_ms), det_ms
        main_ms = kernel_ms(bwd("delta_matching"), "bwd_tilescale_main")
        pre_ms = kernel_ms(bwd("delta_matching"), "bwd_tilescale_prepass")
        r["tile_bwd_main_ms"], r["tile_bwd_prepass_ms"] = main_ms, pre_ms
        # The two pre-passes side by side (FP8ATTN_TILE_PREPASS_Q, read at every call): v1 64, v2 128
        # queries per CTA; the rows above ran the default.
        for qpc in ("64", "128"):
            with _env_set("FP8ATTN_TILE_PREPASS_Q", qpc):
                r[f"tile_bwd_prepass_q{qpc}_ms"] = kernel_ms(bwd("delta_matching"), "bwd_tilescale_prepass")
        r["tile_bwd_kernels"] = (None if main_ms is None or pre_ms is None
                                 else tflops(bwd_flops, main_ms + pre_ms))
        if "tile_pingpong" in getattr(args, "scaling", ()):
            # The main kernel with the warpgroups' pingpong turns (read by the launch on every call).
            os.environ["FP8ATTN_TILE_BWD_PINGPONG"] = "1"
            try:
                pp_ms = kernel_ms(bwd("delta_matching"), "bwd_tilescale_main")
            finally:
                del os.environ["FP8ATTN_TILE_BWD_PINGPONG"]
            r["tile_bwd_main_pingpong_ms"] = pp_ms
            r["tile_bwd_kernels_pingpong"] = (None if pp_ms is None or pre_ms is None
                                              else tflops(bwd_flops, pp_ms + pre_ms))
        f_ms, b_ms = r.get("tile_fwd_ms"), r.get("tile_bwd_delta_matching_ms")
        r["tile_step_ms"] = None if f_ms is None or b_ms is None else f_ms + b_ms
        cap = getattr(args, "softcap", None)
        if cap:
            # The DM backward with softcap after a softcap forward: the op, and main + pre-pass kernels.
            c_out, c_lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=cap)

            def bwd_softcap():
                return OPS.bwd(dout, q, k, v, c_out, c_lse, tau, causal, "fp8", "delta_matching", 128, "e4m3",
                               False, "tile", softcap=cap)
            r["tile_bwd_softcap_dm_ms"] = time_ms(bwd_softcap, args.warmup, args.iters)
            cm, cp = kernel_ms(bwd_softcap, "bwd_tilescale_main"), kernel_ms(bwd_softcap, "bwd_tilescale_prepass")
            r["tile_bwd_softcap_kernels_ms"] = None if cm is None or cp is None else cm + cp
        if ref is not None and ref.grads is not None:
            g = bwd("delta_matching")()
            r["tile_bwd_err"] = {n: cudnn_fp8.rel_fro(x, y) for n, x, y in zip(("dQ", "dK", "dV"), g[:3], ref.grads)}
    except (RuntimeError, NotImplementedError) as e:
        print(f"  tile bwd: n/a ({cudnn_fp8.one_line(e, 120)})")
    finally:
        if old is None:
            del os.environ["FP8ATTN_TILE_BWD"]
        else:
            os.environ["FP8ATTN_TILE_BWD"] = old


def _step_ratio(r, ours_ms_key):
    """cuDNN BF16 fwd + bwd time over ours (a training step's attention), None where n/a."""
    cf, cb, ours = r.get("cudnn_fwd"), r.get("cudnn_bwd"), r.get(ours_ms_key)
    if cf is None or cb is None or ours is None:
        return None
    b, h, s, d = r["B"], r["H"], r["S"], r["d"]
    fwd_flops = 4.0 * b * h * s * s * d / (2 if r["causal"] else 1)
    base_ms = fwd_flops / (cf * 1e12) * 1e3 + 2.5 * fwd_flops / (cb * 1e12) * 1e3
    return base_ms / ours


def write_results(out: str, stem: str, info: dict, rows: list, md: str) -> None:
    """<out>/<stem>.json ({"env": info, "rows": rows}) and <out>/<stem>.md; prints the markdown
    last (the GPU benchmarks' output rule)."""
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"env": info, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(md + "\n")
    print()
    print(md)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():  # NOTE: before creating --out: a CPU-only run writes nothing
        print("bench_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written",
              file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    info["cudnn_fp8"] = None if args.no_cudnn_fp8 else cudnn_fp8.version_info()
    info["fp8_gemm_ceiling"] = None if args.no_extras else gemm_ceiling(args.warmup, args.iters)
    print("env:", json.dumps(info))

    rows = []
    shapes = args.shapes or (QUICK if args.quick else FULL)
    for (b, h, s, d) in shapes:
        for causal in (False, True):
            r = new_row(b, h, s, d, causal)
            print(f"[{b}x{h}x{s}, d={d}, causal={causal}]")
            try:
                bench_shape(r, args)
            except (RuntimeError, ValueError) as e:  # incl. torch.cuda.OutOfMemoryError, NotImplementedError
                r["error"] = cudnn_fp8.one_line(e, 200)
                print(f"  failed, n/a from here on: {r['error']}")
            print("  " + json.dumps({k2: (round(v2, 1) if isinstance(v2, float) else v2) for k2, v2 in r.items()
                                     if k2 != "cudnn_fp8_reasons"}))
            rows.append(r)
            torch.cuda.empty_cache()  # NOTE: after the except block, which held the failed call's tensors

    write_results(args.out, "bench_gpu", info, rows, markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
