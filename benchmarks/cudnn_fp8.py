"""cuDNN FP8 attention baseline for bench_gpu.py: per-tensor-scaled E4M3
SDPA forward and backward through the cuDNN frontend graph API
(pip package nvidia-cudnn-frontend, `cudnn.pygraph.sdpa_fp8` /
`sdpa_fp8_backward`, written against 1.32.0).

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

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from timing import positive_float, time_ms as _time_ms  # benchmarks/timing.py

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
DEFAULT_TOL = 0.1

FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
               "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


@dataclass(frozen=True)
class Variant:
    """One way to declare the graphs; tried in VARIANTS order."""
    layout: str = "bshd"      # storage of Q/K/V/O/dO/dQ/dK/dV: "bshd" (B, S, H, d) or "bhsd"
    mask: str = "bounds"      # causal as right_bound=0 ("bounds") or use_causal_mask=True ("flag")
    amax_s_out: bool = False  # declare the deprecated Amax_S output (older backends wanted it)
    o_type: str = "e4m3"      # forward O: "e4m3" (scaled) or "bf16" (Blackwell only)
    do_type: str = "e4m3"     # backward dO / dQ / dK / dV: "e4m3" or "e5m2"

    def label(self) -> str:
        return (f"{self.layout}/{self.mask}/amax_s={'out' if self.amax_s_out else 'virtual'}"
                f"/O={self.o_type}/dO={self.do_type}")


# NOTE: the first entry is the documented 1.32 form; the rest are fallbacks for
# backends that reject it (the probe in .wt/cudnnfp8.sh reports which one ran).
# No BF16-O entry: the frontend refuses it below Blackwell ("sdpa fp8 forward
# with HALF/BFLOAT16 output is only supported on Blackwell"), checked deviceless.
VARIANTS = (
    Variant("bshd", "bounds", False, "e4m3", "e4m3"),
    Variant("bshd", "flag", True, "e4m3", "e4m3"),
    Variant("bhsd", "bounds", False, "e4m3", "e4m3"),
    Variant("bhsd", "flag", True, "e4m3", "e4m3"),
    Variant("bshd", "flag", True, "e4m3", "e5m2"),
)


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


# ---- import / handle ---------------------------------------------------------

_STATE = {"cudnn": None, "handle": None, "why": None}
_GRAPHS: dict = {}     # (B, H, S, d, causal, Variant, "fwd" | "bwd") -> _Built or the reason string
_GRAPH_ERRORS: dict = {}  # same key -> the full exception text of a failed build (the probe prints it)
_PREFERRED: list = []  # variants that worked before, tried first


def one_line(e: BaseException, width: int = 160) -> str:
    """An exception as one line: its type and the first `width` characters of its first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:width] if text else ''}"


def load():
    """The cudnn module, or None with _STATE['why'] set."""
    if _STATE["cudnn"] is None and _STATE["why"] is None:
        try:
            import cudnn  # noqa: PLC0415
            _STATE["cudnn"] = cudnn
        except Exception as e:  # noqa: BLE001  (missing wheel, missing libcudnn, ...)
            _STATE["why"] = f"import cudnn failed ({one_line(e)})"
    return _STATE["cudnn"]


def version_info() -> dict:
    cudnn = load()
    if cudnn is None:
        return {"cudnn_frontend": None, "why": _STATE["why"]}
    info = {"cudnn_frontend": getattr(cudnn, "__version__", "?")}
    try:
        info["cudnn_backend"] = cudnn.backend_version_string()
    except Exception as e:  # noqa: BLE001
        info["cudnn_backend"] = one_line(e)
    return info


def _handle():
    cudnn = load()
    if _STATE["handle"] is None:
        _STATE["handle"] = cudnn.create_handle()
    if torch.cuda.is_available():  # NOTE: torch's current stream, so CUDA events around execute time it
        cudnn.set_stream(_STATE["handle"], torch.cuda.current_stream().cuda_stream)
    return _STATE["handle"]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- layouts and quantization ------------------------------------------------

def _strides(layout: str, b: int, h: int, s: int, d: int) -> list:
    """Element strides of a logical (B, H, S, d) tensor stored in `layout`."""
    if layout == "bshd":
        return [s * h * d, d, h * d, 1]
    if layout == "bhsd":
        return [h * s * d, s * d, d, 1]
    raise ValueError(layout)


def _empty(layout: str, b: int, h: int, s: int, d: int, dtype, device="cuda") -> torch.Tensor:
    """A (B, H, S, d) view whose storage is `layout`."""
    if layout == "bshd":
        return torch.empty(b, s, h, d, device=device, dtype=dtype).transpose(1, 2)
    return torch.empty(b, h, s, d, device=device, dtype=dtype)


def fp8_dtype(name: str):
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]


def fp8_max(name: str) -> float:
    return {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}[name]


def scale_from_amax(amax: float, fmt: str = "e4m3") -> float:
    """scale = max / amax (payload = x * scale); 1 for a zero / non-finite amax."""
    return fp8_max(fmt) / amax if math.isfinite(amax) and amax > 0 else 1.0


def quantize(x: torch.Tensor, layout: str, fmt: str = "e4m3"):
    """(payload view (B, H, S, d) stored in `layout`, descale) of a BF16 (B, H, S, d) tensor;
    descale = amax / max, payload = clamp(x / descale) in the FP8 format."""
    amax = x.abs().amax().float().item()
    descale = 1.0 / scale_from_amax(amax, fmt)
    out = _empty(layout, *x.shape, fp8_dtype(fmt), x.device)
    lim = fp8_max(fmt)
    out.copy_((x.float() / descale).clamp_(-lim, lim))
    return out, descale


def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F in FP32 (inf when ref is zero or x is not finite)."""
    x, ref = x.float(), ref.float()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 and math.isfinite(num) else float("inf")


def _scalar_buf(value: float, device="cuda") -> torch.Tensor:
    return torch.full((1, 1, 1, 1), float(value), device=device, dtype=torch.float32)


# ---- graphs ------------------------------------------------------------------

@dataclass
class _Built:
    graph: object
    t: dict            # port name -> graph Tensor
    workspace: int
    plan: str


def _mask_kwargs(cudnn, var: Variant, causal: bool) -> dict:
    if not causal:
        return {}
    if var.mask == "bounds":
        return {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0}
    return {"use_causal_mask": True}


def _finish(cudnn, g, t: dict) -> _Built:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    try:
        plan = g.get_plan_name_at_index(g._plan_index)  # NOTE: private index; the name is only logged
    except Exception:  # noqa: BLE001
        plan = "?"
    return _Built(g, t, int(g.get_workspace_size()), plan)


def _dt(cudnn, name: str):
    return {"e4m3": cudnn.data_type.FP8_E4M3, "e5m2": cudnn.data_type.FP8_E5M2,
            "bf16": cudnn.data_type.BFLOAT16, "f32": cudnn.data_type.FLOAT}[name]


def declare_fwd(cudnn, shape, causal: bool, var: Variant, **graph_kw):
    """The forward graph up to declaration (no build): (graph, port -> Tensor)."""
    b, h, s, d = shape
    f32, e4m3 = _dt(cudnn, "f32"), _dt(cudnn, "e4m3")
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, **graph_kw)
    dims, st = [b, h, s, d], _strides(var.layout, b, h, s, d)
    t = {n: g.tensor(name=n, dim=dims, stride=st, data_type=e4m3) for n in ("q", "k", "v")}
    for n in FWD_SCALARS:
        t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], **{n: t[n] for n in FWD_SCALARS},
        generate_stats=True, attn_scale=1.0 / math.sqrt(d), name="sdpa_fp8", **_mask_kwargs(cudnn, var, causal))
    o.set_output(True).set_dim(dims).set_stride(st).set_data_type(_dt(cudnn, var.o_type))
    stats.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    t.update(o=o, stats=stats, amax_o=amax_o)
    if var.amax_s_out:
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        t["amax_s"] = amax_s
    return g, t


def declare_bwd(cudnn, shape, causal: bool, var: Variant, **graph_kw):
    """The backward graph up to declaration (no build): (graph, port -> Tensor)."""
    b, h, s, d = shape
    f32, e4m3, gdt = _dt(cudnn, "f32"), _dt(cudnn, "e4m3"), _dt(cudnn, var.do_type)
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, **graph_kw)
    dims, st = [b, h, s, d], _strides(var.layout, b, h, s, d)
    t = {n: g.tensor(name=n, dim=dims, stride=st, data_type=e4m3) for n in ("q", "k", "v")}
    t["o"] = g.tensor(name="o", dim=dims, stride=st, data_type=_dt(cudnn, var.o_type))
    t["dO"] = g.tensor(name="dO", dim=dims, stride=st, data_type=gdt)
    t["stats"] = g.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=f32)
    for n in BWD_SCALARS:
        t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    outs = g.sdpa_fp8_backward(
        **{n: t[n] for n in ("q", "k", "v", "o", "dO", "stats", *BWD_SCALARS)},
        attn_scale=1.0 / math.sqrt(d), name="sdpa_fp8_backward", **_mask_kwargs(cudnn, var, causal))
    for n, x in zip(("dQ", "dK", "dV"), outs[:3]):
        x.set_output(True).set_dim(dims).set_stride(st).set_data_type(gdt)
        t[n] = x
    for n, x in zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), outs[3:7]):
        x.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        t[n] = x
    return g, t


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
