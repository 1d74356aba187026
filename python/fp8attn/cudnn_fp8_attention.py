"""cuDNN's per-tensor-scaled FP8 attention: the cuDNN frontend graphs (pip package
nvidia-cudnn-frontend, module `cudnn`, `pygraph.sdpa_fp8` / `sdpa_fp8_backward`,
written against 1.32.0), moved here from benchmarks/cudnn_fp8.py so that the
benchmark and the training harness share them: `Variant` / `VARIANTS`,
`declare_fwd` / `declare_bwd` (GQA: K / V with h_kv heads), `quantize`,
`scale_from_amax`, `load`, `one_line`, ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
DEFAULT_TOL = 0.1
MODE = "fp8-cudnn"          # the training harness's attention mode name
HEAD_DIM = 128              # the one head_dim of cuDNN's FP8 SDPA backward
CAPABILITY = (9, 0)         # sm_90 (Hopper)

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

# The training op's order: first the documented form with Amax_S declared (its
# delayed scaling then tracks P's amax as TE does), then the benchmark's list
# (VARIANTS[0] ran on the H200 in every bench_gpu.py run; without Amax_S the op
# records P's bound 1 as its amax).
TRAIN_VARIANTS = (Variant("bshd", "bounds", True, "e4m3", "e4m3"),) + VARIANTS


# ---- import / handle ---------------------------------------------------------

_STATE = {"cudnn": None, "handle": None, "why": None, "handles": {}}


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
    """The benchmark's handle (one, on the current device), bound to torch's current stream."""
    cudnn = load()
    if _STATE["handle"] is None:
        _STATE["handle"] = cudnn.create_handle()
    if torch.cuda.is_available():  # NOTE: torch's current stream, so CUDA events around execute time it
        cudnn.set_stream(_STATE["handle"], torch.cuda.current_stream().cuda_stream)
    return _STATE["handle"]


def device_handle(device) -> object:
    """The training op's handle for `device` (one per CUDA device: a cuDNN handle is
    bound to the device it was created on), bound to torch's current stream there."""
    cudnn = load()
    dev = torch.device(device)
    key = dev.index if dev.type == "cuda" else dev.type
    if dev.type == "cuda" and key is None:
        key = torch.cuda.current_device()
    handles = _STATE.setdefault("handles", {})
    if key not in handles:
        if dev.type == "cuda":
            with torch.cuda.device(key):
                handles[key] = cudnn.create_handle()
        else:
            handles[key] = cudnn.create_handle()
    if dev.type == "cuda":
        cudnn.set_stream(handles[key], torch.cuda.current_stream(key).cuda_stream)
    return handles[key]


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


def cast_scaled(x: torch.Tensor, scale: torch.Tensor, layout: str, fmt: str = "e4m3") -> torch.Tensor:
    """The FP8 payload clamp(x * scale) of a (B, H, S, d) tensor, stored in `layout`;
    scale is a 0-d FP32 tensor on x's device (no host sync)."""
    out = _empty(layout, *x.shape, fp8_dtype(fmt), x.device)
    lim = fp8_max(fmt)
    out.copy_((x.float() * scale).clamp_(-lim, lim))
    return out


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


def declare_fwd(cudnn, shape, causal: bool, var: Variant, h_kv: Optional[int] = None, **graph_kw):
    """The forward graph up to declaration (no build): (graph, port -> Tensor).
    shape = (B, H, S, d) of Q; h_kv: K / V heads (GQA; default H)."""
    b, h, s, d = shape
    hk = h if h_kv is None else h_kv
    f32, e4m3 = _dt(cudnn, "f32"), _dt(cudnn, "e4m3")
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, **graph_kw)
    dims, st = [b, h, s, d], _strides(var.layout, b, h, s, d)
    kv_dims, kv_st = [b, hk, s, d], _strides(var.layout, b, hk, s, d)
    t = {"q": g.tensor(name="q", dim=dims, stride=st, data_type=e4m3)}
    for n in ("k", "v"):
        t[n] = g.tensor(name=n, dim=kv_dims, stride=kv_st, data_type=e4m3)
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


def declare_bwd(cudnn, shape, causal: bool, var: Variant, h_kv: Optional[int] = None, **graph_kw):
    """The backward graph up to declaration (no build): (graph, port -> Tensor).
    shape = (B, H, S, d) of Q; h_kv: K / V / dK / dV heads (GQA; default H)."""
    b, h, s, d = shape
    hk = h if h_kv is None else h_kv
    f32, e4m3, gdt = _dt(cudnn, "f32"), _dt(cudnn, "e4m3"), _dt(cudnn, var.do_type)
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, **graph_kw)
    dims, st = [b, h, s, d], _strides(var.layout, b, h, s, d)
    kv_dims, kv_st = [b, hk, s, d], _strides(var.layout, b, hk, s, d)
    t = {"q": g.tensor(name="q", dim=dims, stride=st, data_type=e4m3)}
    for n in ("k", "v"):
        t[n] = g.tensor(name=n, dim=kv_dims, stride=kv_st, data_type=e4m3)
    t["o"] = g.tensor(name="o", dim=dims, stride=st, data_type=_dt(cudnn, var.o_type))
    t["dO"] = g.tensor(name="dO", dim=dims, stride=st, data_type=gdt)
    t["stats"] = g.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=f32)
    for n in BWD_SCALARS:
        t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    outs = g.sdpa_fp8_backward(
        **{n: t[n] for n in ("q", "k", "v", "o", "dO", "stats", *BWD_SCALARS)},
        attn_scale=1.0 / math.sqrt(d), name="sdpa_fp8_backward", **_mask_kwargs(cudnn, var, causal))
    for n, x, dd, ss in zip(("dQ", "dK", "dV"), outs[:3], (dims, kv_dims, kv_dims), (st, kv_st, kv_st)):
        x.set_output(True).set_dim(dd).set_stride(ss).set_data_type(gdt)
        t[n] = x
    for n, x in zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), outs[3:7]):
        x.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        t[n] = x
    return g, t
