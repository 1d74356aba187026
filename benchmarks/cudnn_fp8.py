"""cuDNN FP8 attention baseline for bench_gpu.py: per-tensor-scaled E4M3
SDPA forward and backward through the cuDNN frontend graph API
(pip package nvidia-cudnn-frontend, `cudnn.pygraph.sdpa_fp8` /
`sdpa_fp8_backward`, written against 1.32.0). The graph declarations, variants,
quantization helpers and the frontend import live in the package
(fp8attn.cudnn_fp8_attention, also behind the training harness's fp8-cudnn mode)
and are re-exported here; this file keeps the benchmark's calibration, self-check,
timing and the probe.

    res = run(q, k, v, dout, causal, time_fn)   # BF16 (B, H, S, d) inputs
    res.fwd_ms, res.bwd_ms                        # None unless built, run and checked

Recipe (the usual per-tensor "delayed scaling"):
  * Q, K, V, dO: descale = amax / 448 from the BF16 tensor, payload = x / descale
    in E4M3 (the quantization is outside the timed region).
  * P (softmax probabilities, <= 1): scale_s = 448, descale_s = 1 / 448.
  * O, dP, dQ, dK, dV: calibration runs with scale 1 read cuDNN's amax outputs,
    then scale = 448 / amax (O: one forward; dP first, then dQ / dK / dV, since
    dQ / dK depend on the quantized dP). With scale 1 an amax reads the same
    whether cuDNN measures it before or after scaling.
Timed: graph.execute only (median of time_fn, like the other columns).

Self-check on every call (bench_gpu.py: once per shape and mask): dequantized O
(and dQ, dK, dV) against torch SDPA BF16 on the same BF16 inputs (the first of
the backends cuDNN, flash, math that accepts them: `_reference`; the one used is
Result.info["reference"]), relative Frobenius error ||x - ref||_F / ||ref||_F; above `tol` the result is "bad" (no number):
a wrong-but-fast baseline is worse than none. Graph variants (layout, mask
attributes, Amax_S declared or not, O / dO types) are tried in order until one
builds and passes; everything that fails returns None with a one-line reason.
"""
from __future__ import annotations

import glob
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from timing import positive_float, time_ms as _time_ms  # benchmarks/timing.py

# NOTE: the graph code lives in the package (fp8attn.cudnn_fp8_attention, shared with the
# training harness's fp8-cudnn mode); in-tree build first, else the installed package
# (FP8ATTN_SOURCE_TREE=0: sys.path's), as bench_gpu.py.
_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
if os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and glob.glob(os.path.join(_PY, "fp8attn", "_C*.so")) \
        and _PY not in sys.path:
    sys.path.insert(0, _PY)
from fp8attn.cudnn_fp8_attention import (  # noqa: E402,F401  (re-exported: bench_gpu.py, tests)
    BWD_SCALARS, DEFAULT_TOL, E4M3_MAX, E5M2_MAX, FWD_SCALARS, VARIANTS, Variant, _Built, _dt, _empty,
    _finish, _handle, _mask_kwargs, _scalar_buf, _STATE, _strides, _sync, declare_bwd, declare_fwd,
    fp8_dtype, fp8_max, load, one_line, quantize, rel_fro, scale_from_amax, version_info)


@dataclass
class Result:
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    fwd_status: str = "n/a"  # "ok" | "bad" | "n/a"
    bwd_status: str = "n/a"
    fwd_variant: Optional[str] = None
    bwd_variant: Optional[str] = None
    info: dict = field(default_factory=dict)  # rel. Frobenius errors, plan names, host us per call
    reasons: list = field(default_factory=list)  # one line per failed attempt


# ---- graph cache (the benchmark's own; the training op keeps its plans in the package) ----

_GRAPHS: dict = {}     # (B, H, S, d, causal, Variant, "fwd" | "bwd") -> _Built or the reason string
_GRAPH_ERRORS: dict = {}  # same key -> the full exception text of a failed build (the probe prints it)
_PREFERRED: list = []  # variants that worked before, tried first


def _built(kind: str, shape, causal: bool, var: Variant):
    """Cached build: _Built, or the one-line reason it failed."""
    key = (*shape, causal, var, kind)
    if key not in _GRAPHS:
        cudnn = load()
        try:
            declare = declare_fwd if kind == "fwd" else declare_bwd
            g, t = declare(cudnn, shape, causal, var, handle=_handle())
            _GRAPHS[key] = _finish(cudnn, g, t)
        except Exception as e:  # noqa: BLE001  (cudnnGraphNotSupportedError, ValueError, RuntimeError, ...)
            _GRAPHS[key] = f"{kind} build: {one_line(e)}"
            _GRAPH_ERRORS[key] = f"{type(e).__name__}: {e}"[:3000]
    return _GRAPHS[key]


def _execute(built: _Built, pack: dict, ws: torch.Tensor) -> None:
    built.graph.execute(_varpack(built, pack), ws, handle=_handle())


def _varpack(built: _Built, pack: dict) -> dict:
    """graph Tensor -> buffer for the ports this graph declares."""
    return {built.t[n]: x for n, x in pack.items() if n in built.t}


def _launcher(built: _Built, pack: dict, ws: torch.Tensor) -> Callable:
    """The timed call: execute only, variant pack and handle prepared once."""
    varpack, handle, g = _varpack(built, pack), _handle(), built.graph
    return lambda: g.execute(varpack, ws, handle=handle)


def frontend():
    """The cuDNN frontend module; RuntimeError naming why when it cannot be imported."""
    cudnn = load()
    if cudnn is None:
        raise RuntimeError(f"cuDNN frontend unavailable: {_STATE.get('why') or 'import cudnn failed'}")
    return cudnn


def bound_fwd_bwd(fb: _Built, fpack: dict, o: torch.Tensor, bb: _Built = None, bpack: dict = None, grads=None):
    """A built forward graph (and backward graph) bound to preallocated buffers, for timing:
    (fwd, step) with fwd() executing the forward and returning o, step() the forward then the
    backward and returning grads (None without bb). fpack / bpack: graph Tensor -> buffer; the
    workspaces are allocated here, once."""
    handle = _handle()

    def workspace(built):
        return torch.empty(max(built.workspace, 1), device=o.device, dtype=torch.uint8)
    ws_f = workspace(fb)

    def fwd():
        fb.graph.execute(fpack, ws_f, handle=handle)
        return o
    if bb is None:
        return fwd, None
    ws_b = workspace(bb)

    def step():
        fb.graph.execute(fpack, ws_f, handle=handle)
        bb.graph.execute(bpack, ws_b, handle=handle)
        return grads
    return fwd, step


def host_us(fn: Callable, device="cuda", n: int = 5) -> float:
    """Host microseconds per fn() call, back to back without a sync (the launch
    overhead the CUDA-event timing includes when it exceeds the kernel time)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / n * 1e6


# ---- one variant, forward and backward ---------------------------------------

class _Case:
    """Buffers of one (shape, causal, variant): quantized inputs, outputs, scales."""

    def __init__(self, q, k, v, dout, var: Variant):
        self.var = var
        self.shape = tuple(q.shape)
        self.dev = q.device
        self.ins = {}
        for name, x in (("q", q), ("k", k), ("v", v)):
            self.ins[name], self.ins["descale_" + name] = quantize(x, var.layout)
        self.dout = dout
        self.fwd_pack = None
        self.o_scale = 1.0

    def run_fwd(self, fb: _Built):
        """Calibrate scale_o, then one real forward; returns the dequantized O in FP32."""
        b, h, s, d = self.shape
        lay, odt = self.var.layout, (torch.bfloat16 if self.var.o_type == "bf16" else fp8_dtype(self.var.o_type))
        o = _empty(lay, b, h, s, d, odt, self.dev)
        stats = torch.empty(b, h, s, 1, device=self.dev, dtype=torch.float32)
        pack = {"q": self.ins["q"], "k": self.ins["k"], "v": self.ins["v"], "o": o, "stats": stats,
                "amax_o": _scalar_buf(float("nan"), self.dev), "amax_s": _scalar_buf(float("nan"), self.dev)}
        for n in ("descale_q", "descale_k", "descale_v"):
            pack[n] = _scalar_buf(self.ins[n], self.dev)
        pack["scale_s"], pack["descale_s"] = _scalar_buf(E4M3_MAX, self.dev), _scalar_buf(1.0 / E4M3_MAX, self.dev)
        pack["scale_o"] = _scalar_buf(1.0, self.dev)
        ws = torch.empty(max(fb.workspace, 1), device=self.dev, dtype=torch.uint8)
        _execute(fb, pack, ws)
        _sync(self.dev)
        amax_o_cal = pack["amax_o"].item()
        if self.var.o_type != "bf16":  # NOTE: a BF16 O is not scaled
            self.o_scale = scale_from_amax(amax_o_cal, self.var.o_type)
            pack["scale_o"].fill_(self.o_scale)
            _execute(fb, pack, ws)
            _sync(self.dev)
        self.fwd_pack, self.fwd_ws = pack, ws
        # NOTE: the calibration amax (scale 1) and the final one; equal when cuDNN measures before scaling
        self.amax = {"amax_o": (amax_o_cal, pack["amax_o"].item()), "amax_s": pack["amax_s"].item()}
        return o.float() / self.o_scale

    def run_bwd(self, bb: _Built):
        """Calibrate scale_dP, then scale_dQ/dK/dV, then one real backward; returns FP32 (dQ, dK, dV)."""
        b, h, s, d = self.shape
        lay, fmt = self.var.layout, self.var.do_type
        fp = self.fwd_pack
        dO, descale_dO = quantize(self.dout, lay, fmt)
        grads = {n: _empty(lay, b, h, s, d, fp8_dtype(fmt), self.dev) for n in ("dQ", "dK", "dV")}
        pack = {"q": fp["q"], "k": fp["k"], "v": fp["v"], "o": fp["o"], "stats": fp["stats"], "dO": dO, **grads}
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s"):
            pack[n] = fp[n]
        pack["descale_o"] = _scalar_buf(1.0 / self.o_scale, self.dev)
        pack["descale_dO"] = _scalar_buf(descale_dO, self.dev)
        for n in ("scale_dQ", "scale_dK", "scale_dV", "scale_dP", "descale_dP"):
            pack[n] = _scalar_buf(1.0, self.dev)
        for n in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"):
            pack[n] = _scalar_buf(float("nan"), self.dev)
        ws = torch.empty(max(bb.workspace, 1), device=self.dev, dtype=torch.uint8)
        _execute(bb, pack, ws)  # calibration 1: dP
        _sync(self.dev)
        amax_dp_cal = pack["amax_dP"].item()
        scale_dp = scale_from_amax(amax_dp_cal, "e4m3")
        pack["scale_dP"].fill_(scale_dp)
        pack["descale_dP"].fill_(1.0 / scale_dp)
        _execute(bb, pack, ws)  # calibration 2: dQ / dK / dV with dP scaled
        _sync(self.dev)
        self.grad_scale, cal = {}, {}
        for n in ("dQ", "dK", "dV"):
            cal[n] = pack["amax_" + n].item()
            self.grad_scale[n] = scale_from_amax(cal[n], fmt)
            pack["scale_" + n].fill_(self.grad_scale[n])
        _execute(bb, pack, ws)
        _sync(self.dev)
        self.amax["amax_dP"] = (amax_dp_cal, pack["amax_dP"].item())
        self.amax.update({"amax_" + n: (cal[n], pack["amax_" + n].item()) for n in ("dQ", "dK", "dV")})
        self.bwd_pack, self.bwd_ws = pack, ws
        return tuple(grads[n].float() / self.grad_scale[n] for n in ("dQ", "dK", "dV"))


# The accuracy reference's SDPA backends, in order of preference (the first one
# that accepts the inputs is used, and named in the result).
# NOTE: a fixed order, not torch's own choice, which may change between versions
# and shapes: numbers of different runs must be against the same reference.
REFERENCE_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "MATH")


@dataclass
class Reference:
    o: torch.Tensor
    grads: Optional[tuple]  # (dQ, dK, dV), None without bwd
    backend: str            # the SDPBackend name used ("CUDNN_ATTENTION", ...)
    refused: list = field(default_factory=list)  # one line per backend that refused


def _reference(q, k, v, dout, causal, bwd: bool) -> Reference:
    """torch SDPA BF16 O and (dQ, dK, dV) (None without bwd) on the same inputs,
    computed by the first of REFERENCE_BACKENDS that accepts them (cuDNN, then
    flash, then math). Raises the last error if none does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    refused = []
    for name in REFERENCE_BACKENDS:
        qr, kr, vr = (x.detach().clone().requires_grad_(bwd) for x in (q, k, v))
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                grads = torch.autograd.grad(o, (qr, kr, vr), dout) if bwd else None
        except RuntimeError as e:  # "No viable backend ..." / the backend refuses the shape
            if name == REFERENCE_BACKENDS[-1] or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            refused.append(f"{name}: {one_line(e)}")
            continue
        return Reference(o.detach(), grads, name, refused)
    raise AssertionError("unreachable")


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool,
        time_fn: Callable, warmup: int = 3, iters: int = 10, bwd: bool = True, tol: float = DEFAULT_TOL,
        verbose: bool = False, variants=None, ref: Optional[Reference] = None) -> Result:
    """Build (cached), self-check and time cuDNN FP8 SDPA on BF16 (B, H, S, d) inputs.
    time_fn(fn, warmup, iters) -> ms. ref: `_reference` of these inputs (with the
    backward when bwd), if the caller already has it. Never raises: failures land
    in Result.reasons."""
    res = Result()
    try:
        _run(res, q, k, v, dout, causal, time_fn, warmup, iters, bwd, tol, verbose, variants, ref)
    except Exception as e:  # noqa: BLE001  (OOM, a runtime error inside execute, ...)
        res.reasons.append(f"unexpected: {one_line(e)}")
        for which in ("fwd", "bwd"):
            if getattr(res, which + "_status") == "ok" and getattr(res, which + "_ms") is None:
                setattr(res, which + "_status", "n/a")
    try:
        _sync(q.device)
    except Exception as e:  # noqa: BLE001  (a sticky CUDA error from inside cuDNN)
        res.reasons.append(f"synchronize: {one_line(e)}")
    return res


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"    cudnn-fp8: {msg}", flush=True)


def _run(res, q, k, v, dout, causal, time_fn, warmup, iters, bwd, tol, verbose, variants, ref=None):
    if load() is None:
        res.reasons.append(_STATE["why"])
        return
    if q.dim() != 4 or not (q.shape == k.shape == v.shape == dout.shape):
        res.reasons.append(f"shape: needs equal (B, H, S, d) Q/K/V/dO, got {tuple(q.shape)} {tuple(k.shape)}")
        return
    shape = tuple(q.shape)
    order = list(variants) if variants is not None else [x for x in _PREFERRED] + [x for x in VARIANTS
                                                                               if x not in _PREFERRED]
    if ref is None:
        ref = _reference(q, k, v, dout, causal, bwd)
    ref_o, ref_g = ref.o, ref.grads
    res.info["reference"] = ref.backend
    fwd_case = None
    bwd_done = not bwd
    for var in order:
        if fwd_case is not None and bwd_done:
            break
        bb = None
        if fwd_case is not None:  # NOTE: only the backward is still missing: skip variants whose backward
            bb = _built("bwd", shape, causal, var)  # does not build before running their forward
            if isinstance(bb, str):
                res.reasons.append(f"[{var.label()}] {bb}")
                _log(verbose, res.reasons[-1])
                continue
        fb = _built("fwd", shape, causal, var)
        if isinstance(fb, str):
            res.reasons.append(f"[{var.label()}] {fb}")
            _log(verbose, res.reasons[-1])
            continue
        case = _Case(q, k, v, dout, var)
        o = case.run_fwd(fb)
        err = rel_fro(o, ref_o)
        _log(verbose, f"[{var.label()}] fwd plan {fb.plan}: rel err O {err:.4f}, amax {case.amax}")
        if not err <= tol:
            res.reasons.append(f"[{var.label()}] fwd self-check: rel Frobenius error of O {err:.4f} > {tol}")
            if res.fwd_status == "n/a":
                res.fwd_status, res.info["O"] = "bad", err
            continue
        if fwd_case is None:
            fwd_case = case
            res.fwd_status, res.fwd_variant, res.info["O"] = "ok", var.label(), err
            res.info["fwd_plan"] = fb.plan
            fn = _launcher(fb, case.fwd_pack, case.fwd_ws)
            res.fwd_ms = time_fn(fn, warmup, iters)
            res.info["fwd_host_us"] = host_us(fn, q.device)
        if bwd_done:
            continue
        bb = bb or _built("bwd", shape, causal, var)
        if isinstance(bb, str):
            res.reasons.append(f"[{var.label()}] {bb}")
            _log(verbose, res.reasons[-1])
            continue
        grads = case.run_bwd(bb)
        errs = {n: rel_fro(g, r) for n, g, r in zip(("dQ", "dK", "dV"), grads, ref_g)}
        _log(verbose, f"[{var.label()}] bwd plan {bb.plan}: rel err "
                      + ", ".join(f"{n} {e:.4f}" for n, e in errs.items()) + f", amax {case.amax}")
        if not all(e <= tol for e in errs.values()):
            res.reasons.append(f"[{var.label()}] bwd self-check: rel Frobenius errors "
                               + ", ".join(f"{n} {e:.4f}" for n, e in errs.items()) + f" (tol {tol})")
            if res.bwd_status == "n/a":
                res.bwd_status = "bad"
                res.info.update(errs)
            continue
        res.bwd_status, res.bwd_variant = "ok", var.label()
        res.info.update(errs)
        res.info["bwd_plan"] = bb.plan
        fn = _launcher(bb, case.bwd_pack, case.bwd_ws)
        res.bwd_ms = time_fn(fn, warmup, iters)
        res.info["bwd_host_us"] = host_us(fn, q.device)
        bwd_done = True
        if var not in _PREFERRED:
            _PREFERRED.insert(0, var)
    if fwd_case is not None and fwd_case.var not in _PREFERRED:
        _PREFERRED.append(fwd_case.var)


def reason(res: Result) -> str:
    """The last failure line, for the benchmark log."""
    return res.reasons[-1] if res.reasons else ""


def probe(shape=(2, 16, 8192, 128), tol=DEFAULT_TOL, every: bool = False, device="cuda", time_fn=None) -> int:
    """The variants in order, causal and not, forward and backward, with full build
    errors, until one passes both (every=True: all of them): which declaration this
    machine's cuDNN takes. Exit status 0 when some variant passed forward and
    backward for both masks."""
    print("versions:", version_info(), "torch", torch.__version__, "cuDNN (torch)", torch.backends.cudnn.version())
    if load() is None:
        return 1
    if device == "cuda":
        print("gpu:", torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability())
    b, h, s, d = shape
    ok_all = True
    for causal in (False, True):
        gen = torch.Generator(device=device).manual_seed(1234 + causal)
        q, k, v, dout = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        fwd_flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        print(f"== {b}x{h}x{s}x{d} causal={causal}")
        fwd_ok = bwd_ok = None
        for var in VARIANTS:
            res = run(q, k, v, dout, causal, time_fn or _time_ms, 2, 5, bwd=True, tol=tol, verbose=True, variants=[var])
            for kind in ("fwd", "bwd"):
                err = _GRAPH_ERRORS.get((*shape, causal, var, kind))
                if err:
                    print(f"    {kind} build error (full):\n      " + err.replace("\n", "\n      "))
            for line in res.reasons:
                print("    reason:", line)
            tf = {k2: (None if ms is None else round(f * fwd_flops / (ms * 1e-3) / 1e12))
                  for k2, ms, f in (("fwd", res.fwd_ms, 1.0), ("bwd", res.bwd_ms, 2.5))}
            print(f"  [{var.label()}] fwd {res.fwd_status} {tf['fwd']} TFLOP/s, bwd {res.bwd_status} {tf['bwd']} TFLOP/s,"
                  f" info {res.info}")
            if res.fwd_status == "ok" and fwd_ok is None:
                fwd_ok = var.label()
            if res.bwd_status == "ok" and bwd_ok is None:
                bwd_ok = var.label()
            if fwd_ok and bwd_ok and not every:
                break
        print(f"  FIRST WORKING causal={causal}: fwd {fwd_ok}, bwd {bwd_ok}")
        ok_all = ok_all and fwd_ok is not None and bwd_ok is not None
        del q, k, v, dout
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok_all else 2


# ---- command line: the probe ---------------------------------------------------

def _shape_arg(text: str) -> tuple:
    """'BxHxSxd' -> (B, H, S, d), four positive integers (argparse type)."""
    import argparse  # noqa: PLC0415
    parts = text.lower().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected BxHxSxd, four positive integers (e.g. 2x16x8192x128), got {text!r}")
    return shape


def main(argv=None) -> int:
    """python3 benchmarks/cudnn_fp8.py [BxHxSxd] [--every] [--tol T]: the probe.
    Exit status: probe's (0 / 2), 1 without the frontend or a GPU, 2 on a bad argument."""
    import argparse  # noqa: PLC0415
    ap = argparse.ArgumentParser(
        prog="cudnn_fp8.py",
        description="Probe which cuDNN FP8 SDPA graph variant this machine's cuDNN builds and runs: "
                    "forward and backward, causal and not, each self-checked against torch SDPA BF16 "
                    "(relative Frobenius error <= --tol) and timed (median of CUDA-event times). "
                    "Full build errors are printed. Needs a CUDA GPU and the cuDNN frontend "
                    "(pip install nvidia-cudnn-frontend).",
        epilog="Exit status: 0 some variant passed forward and backward for both masks, 2 none did "
               "(or a bad argument), 1 no frontend or no GPU.")
    ap.add_argument("shape", nargs="?", type=_shape_arg, default=(2, 16, 8192, 128),
                    help="BxHxSxd of the BF16 Q, K, V, dO (default 2x16x8192x128)")
    ap.add_argument("--every", action="store_true", help="try every variant, not only up to the first that passes")
    ap.add_argument("--tol", type=positive_float, default=DEFAULT_TOL,
                    help=f"largest relative Frobenius error of the self-check (default {DEFAULT_TOL})")
    args = ap.parse_args(argv)
    if load() is None:
        print(f"cudnn_fp8.py: no cuDNN frontend: {_STATE['why']} (pip install nvidia-cudnn-frontend)",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("cudnn_fp8.py: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    return probe(args.shape, tol=args.tol, every=args.every)


if __name__ == "__main__":
    sys.exit(main())
