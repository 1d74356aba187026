"""cuDNN's per-tensor-scaled FP8 attention (the baseline a user would pick instead of
fp8attn): the cuDNN frontend graphs (pip package nvidia-cudnn-frontend, module
`cudnn`, `pygraph.sdpa_fp8` / `sdpa_fp8_backward`, written against 1.32.0) and,
for training, an autograd op with TransformerEngine-style delayed scaling.

Two users:
  * benchmarks/cudnn_fp8.py (bench_gpu.py's "cuDNN fp8" columns and the probe)
    imports the graph code from here: `Variant` / `VARIANTS`, `declare_fwd` /
    `declare_bwd`, `quantize`, `scale_from_amax`, `load`, `one_line`, ...
  * the training harness's attention mode "fp8-cudnn" (fp8attn.train.model):
    `cudnn_fp8_attention(q, k, v, state)` with a `DelayedScalingState` module per
    attention layer.

The training op (`cudnn_fp8_attention`): BF16 Q [B, Hq, S, d], K / V [B, Hkv, S, d]
in, BF16 O out (causal by default). Inside, per-tensor E4M3 everywhere: Q, K, V
and dO are cast by torch with the layer's delayed scales (saturating, as TE
casts), P (softmax), O, dP, dQ, dK, dV are quantized by cuDNN with the scales
passed to its graphs; O and dQ / dK / dV come back in FP8 and are dequantized to
BF16 at the op boundary (an FP8-input, BF16-output forward is Blackwell-only).
Graphs are built once per (B, Hq, Hkv, S, d, causal, device) and cached
(`plan_for`); a build is accepted only after a self-check against torch SDPA
BF16 on random inputs of that shape (relative Frobenius error of O, dQ, dK, dV
<= `DEFAULT_TOL`, the benchmark's rule: a wrong-but-fast baseline is worse than
none). GQA (Hkv < Hq): cuDNN's native GQA first (the frontend declares K / V /
dK / dV with Hkv heads and reduces dK / dV over the group), else K and V
repeated to Hq heads in BF16 before quantization (dK / dV summed over each
group in FP32); `plan_info` says which one a shape got.

Delayed scaling (TransformerEngine's DelayedScaling recipe, its defaults:
amax_history_len 1024, margin 0, amax_compute_algo "max"; facts from TE's docs
and recipe kernel, re-implemented here):
  * one FP32 scale per tensor t in TENSORS = q, k, v, s (P), o, dO, dP, dQ, dK, dV,
    payload = x * scale_t, descale = 1 / scale_t;
  * an amax history [history_len, 10]: row 0 collects the current step's amaxes
    (Q, K, V, dO measured by torch on the BF16 tensors; S, O, dP, dQ, dK, dV
    returned by cuDNN, which reduces them before applying the output scale, i.e.
    in true units); a repeated forward of the same step (activation checkpointing's
    recompute) takes the max with what row 0 holds;
  * after the layer's backward (every amax of the step is in): amax_t = max over
    the whole history (NaN entries ignored: TE reduces with fmaxf), scale_t =
    fp8_max_t * 2^-margin / amax_t if amax_t is finite and > 0, else the previous
    scale (so an inf amax freezes scale_t while it stays in the window, as in TE);
    a scale that overflows FP32 (tiny amax) becomes FP32's max (newer TE); then
    the history rolls by -1 (row 0 moves to the end) and row 0 is zeroed;
  * first step: scales start at 1 (TE's initial scale), except P's, which starts at
    448 = E4M3's max / 1 (P <= 1 a priori; with scale 1 the many P entries below
    E4M3's 2^-9 would flush to zero on the first step). With scale 1, dO / dP /
    gradients of a first step underflow (as in TE); the first steps' amaxes fix
    the scales from step 2 (dP's) and 3 (dQ / dK / dV's, measured on a scaled dP);
  * only a forward with grad enabled on a module in training mode records (a
    no_grad validation forward uses the scales and leaves the state alone).
fp8_max: E4M3 448 for every tensor (dO / dQ / dK / dV in E5M2, 57344, if the graph
variant is an E5M2 one). Differences to TE: E4M3 in the backward too (TE's default
HYBRID format has E5M2 there), no amax reduction across ranks (under DDP the buffers
are rank 0's, broadcast by DDP at every forward), P's first scale.

Availability (`unavailable_reason`): cuDNN's FP8 SDPA backward exists on sm_90 at
head_dim 128 only (the frontend: "hidden_dim shoud be equal to 128"); the op needs
a CUDA device, the frontend, causal self-attention without packed documents or
context parallelism. The harness skips the mode with the reason elsewhere.
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


def _declare_inputs(cudnn, shape, var: Variant, h_kv: Optional[int], scalars, graph_kw):
    """What both graphs start with: the FP8 graph, its E4M3 Q [B, H, S, d] and K / V
    [B, h_kv, S, d] (var.layout strides) and the FP32 scalars `scalars`. Returns
    (graph, port -> Tensor, (Q's dims, strides), (K / V's dims, strides))."""
    b, h, s, d = shape
    hk = h if h_kv is None else h_kv
    f32, e4m3 = _dt(cudnn, "f32"), _dt(cudnn, "e4m3")
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, **graph_kw)
    dims, st = [b, h, s, d], _strides(var.layout, b, h, s, d)
    kv_dims, kv_st = [b, hk, s, d], _strides(var.layout, b, hk, s, d)
    t = {"q": g.tensor(name="q", dim=dims, stride=st, data_type=e4m3)}
    for n in ("k", "v"):
        t[n] = g.tensor(name=n, dim=kv_dims, stride=kv_st, data_type=e4m3)
    for n in scalars:
        t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    return g, t, (dims, st), (kv_dims, kv_st)


def declare_fwd(cudnn, shape, causal: bool, var: Variant, h_kv: Optional[int] = None, **graph_kw):
    """The forward graph up to declaration (no build): (graph, port -> Tensor).
    shape = (B, H, S, d) of Q; h_kv: K / V heads (GQA; default H)."""
    b, h, s, d = shape
    f32 = _dt(cudnn, "f32")
    g, t, (dims, st), _ = _declare_inputs(cudnn, shape, var, h_kv, FWD_SCALARS, graph_kw)
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
    f32, gdt = _dt(cudnn, "f32"), _dt(cudnn, var.do_type)
    g, t, (dims, st), (kv_dims, kv_st) = _declare_inputs(cudnn, shape, var, h_kv, BWD_SCALARS, graph_kw)
    t["o"] = g.tensor(name="o", dim=dims, stride=st, data_type=_dt(cudnn, var.o_type))
    t["dO"] = g.tensor(name="dO", dim=dims, stride=st, data_type=gdt)
    t["stats"] = g.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=f32)
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


# ---- delayed scaling -----------------------------------------------------------

TENSORS = ("q", "k", "v", "s", "o", "dO", "dP", "dQ", "dK", "dV")
IDX = {n: i for i, n in enumerate(TENSORS)}
FWD_TENSORS = ("q", "k", "v", "s", "o")
BWD_TENSORS = ("dO", "dP", "dQ", "dK", "dV")
GRAD_TENSORS = ("dO", "dQ", "dK", "dV")      # in the variant's do_type (dP is E4M3)
DEFAULT_HISTORY_LEN = 1024                   # TE DelayedScaling(amax_history_len=1024)
DEFAULT_MARGIN = 0                           # TE DelayedScaling(margin=0)
FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny      # smallest normal FP32
# Bounds of the delayed-scaling knobs: a margin past MAX_MARGIN makes 448 * 2^-margin
# leave FP32's normal range (scale 0, descale inf: NaN training); a history past
# MAX_HISTORY_LEN is an allocation error, not a recipe (TE's default is 1024).
MAX_MARGIN = 64
MAX_HISTORY_LEN = 1 << 20


def initial_scales() -> torch.Tensor:
    """[10] FP32: 1 for every tensor (TE's initial scale) except P's: E4M3_MAX (P <= 1)."""
    s = torch.ones(len(TENSORS), dtype=torch.float32)
    s[IDX["s"]] = E4M3_MAX
    return s


def fp8_maxes(grad_format: str = "e4m3", device=None) -> torch.Tensor:
    """[10] FP32: each tensor's FP8 max (E4M3 448; dO / dQ / dK / dV in grad_format)."""
    m = torch.full((len(TENSORS),), E4M3_MAX, dtype=torch.float32, device=device)
    for n in GRAD_TENSORS:
        m[IDX[n]] = fp8_max(grad_format)
    return m


def update_scales(history: torch.Tensor, scale: torch.Tensor, fp8_max_t: torch.Tensor,
                  margin: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update (TransformerEngine's rule, "max" algorithm):
    (rolled history, new scales) from history [N, T] (row 0: the step that just
    ended), scale [T] (the scales it used) and fp8_max_t [T].
    amax = max over the N rows, NaN ignored; scale = fp8_max * 2^-margin / amax when
    amax is finite and > 0, else the old scale; clamped to FP32's normal range; the history is
    rolled by -1 (row 0 to the end) and row 0 zeroed. Pure (returns new tensors)."""
    h = torch.where(torch.isnan(history), torch.zeros_like(history), history)
    amax = h.amax(dim=0)
    cand = fp8_max_t.to(amax) * (2.0 ** -float(margin)) / amax
    ok = torch.isfinite(amax) & (amax > 0)
    # NOTE: clamped to FP32's normal range both ways: a scale of 0 would make the descale inf.
    new_scale = torch.where(ok, cand, scale.to(amax)).clamp(min=FLT_MIN, max=FLT_MAX)
    rolled = torch.roll(history, shifts=-1, dims=0).clone()
    rolled[0].zero_()
    return rolled, new_scale


class DelayedScalingState(nn.Module):
    """The delayed-scaling state of one attention layer (buffers, so checkpoints
    save it): amax_history [history_len, 10] and scale [10] over TENSORS.

    Loading a state_dict without these keys (a checkpoint of another attention
    mode) keeps the fresh state; one with another history length keeps row 0
    and the most recent rows that fit (zeros for the rows it lacks)."""

    def __init__(self, history_len: int = DEFAULT_HISTORY_LEN, margin: int = DEFAULT_MARGIN):
        super().__init__()
        if isinstance(history_len, bool) or not isinstance(history_len, int) or not 1 <= history_len <= MAX_HISTORY_LEN:
            raise ValueError(f"history_len must be an int in [1, {MAX_HISTORY_LEN}], got {history_len!r}")
        if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= MAX_MARGIN:
            raise ValueError(f"margin must be an int in [0, {MAX_MARGIN}], got {margin!r}")
        self.history_len, self.margin = history_len, margin
        self.register_buffer("amax_history", torch.zeros(history_len, len(TENSORS), dtype=torch.float32))
        self.register_buffer("scale", initial_scales())

    def extra_repr(self) -> str:
        return f"history_len={self.history_len}, margin={self.margin}"

    @torch.no_grad()
    def record(self, names, amaxes: torch.Tensor) -> None:
        """Row 0 of `names` <- max(row 0, amaxes) (amaxes: [len(names)] on the state's device)."""
        idx = torch.tensor([IDX[n] for n in names], device=self.amax_history.device)
        cur = self.amax_history[0, idx]
        self.amax_history[0, idx] = torch.maximum(cur, amaxes.to(cur))

    @torch.no_grad()
    def update(self, fp8_max_t: Optional[torch.Tensor] = None) -> None:
        """The end-of-step update (update_scales), in place."""
        if fp8_max_t is None:
            fp8_max_t = fp8_maxes(device=self.scale.device)
        hist, scale = update_scales(self.amax_history, self.scale, fp8_max_t.to(self.scale.device), self.margin)
        self.amax_history.copy_(hist)
        self.scale.copy_(scale)

    def amax_window(self) -> dict:
        """{tensor: max of its history (NaN ignored)} (host sync; for logs and tests)."""
        h = torch.where(torch.isnan(self.amax_history), torch.zeros_like(self.amax_history), self.amax_history)
        return dict(zip(TENSORS, h.amax(0).tolist()))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        hk, sk = prefix + "amax_history", prefix + "scale"
        if hk not in state_dict and sk not in state_dict:
            return      # NOTE: a checkpoint of another mode: a fresh state, as on a first step
        saved = state_dict.get(hk)
        if saved is not None and saved.dim() == 2 and saved.shape[1] == len(TENSORS) \
                and saved.shape[0] != self.history_len:
            n, keep = self.history_len, torch.zeros(self.history_len, len(TENSORS), dtype=saved.dtype)
            keep[0] = saved[0]
            tail = min(n - 1, saved.shape[0] - 1)
            if tail > 0:
                keep[n - tail:] = saved[saved.shape[0] - tail:]
            state_dict = dict(state_dict)
            state_dict[hk] = keep
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


# ---- plans: built and self-checked graphs per shape -------------------------------

class CudnnFP8Unavailable(RuntimeError):
    """The cuDNN FP8 op cannot run here (the message says why)."""


@dataclass
class Plan:
    """The built forward and backward graphs of one (B, Hq, Hkv, S, d, causal, device)."""
    fwd: _Built
    bwd: _Built
    var: Variant
    gqa: str                  # "none" (Hq == Hkv), "native" (cuDNN's GQA) or "repeat" (K / V repeated)
    shape: tuple              # (B, Hq, Hkv, S, d)
    causal: bool
    check: dict = field(default_factory=dict)   # self-check: rel. Frobenius errors of O, dQ, dK, dV

    @property
    def h_graph(self) -> int:
        """K / V heads in the graphs."""
        return self.shape[2] if self.gqa == "native" else self.shape[1]

    def info(self) -> dict:
        return {"shape": list(self.shape), "causal": self.causal, "variant": self.var.label(), "gqa": self.gqa,
                "fwd_plan": self.fwd.plan, "bwd_plan": self.bwd.plan,
                "self_check": {k: round(v, 5) for k, v in self.check.items()}}


_PLANS: dict = {}         # (B, Hq, Hkv, S, d, causal, device str) -> Plan or the reason string
_TRAIN_GRAPHS: dict = {}  # (B, Hq, Hkv_graph, S, d, causal, Variant, kind, device str) -> _Built or reason


def _dev_key(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def _build(kind: str, shape, h_kv: int, causal: bool, var: Variant, device):
    key = (*shape, h_kv, causal, var, kind, _dev_key(device))
    if key not in _TRAIN_GRAPHS:
        cudnn = load()
        try:
            declare = declare_fwd if kind == "fwd" else declare_bwd
            g, t = declare(cudnn, shape, causal, var, h_kv=h_kv, handle=device_handle(device))
            _TRAIN_GRAPHS[key] = _finish(cudnn, g, t)
        except Exception as e:  # noqa: BLE001  (cudnnGraphNotSupportedError, ValueError, RuntimeError, ...)
            _TRAIN_GRAPHS[key] = f"{kind} build: {one_line(e, 120)}"
    return _TRAIN_GRAPHS[key]


def plan_for(b: int, hq: int, hkv: int, s: int, d: int, causal: bool = True, device="cuda",
             self_check: bool = True, tol: float = DEFAULT_TOL) -> Plan:
    """The cached Plan of a shape: the first (GQA handling, TRAIN_VARIANTS entry) whose
    graphs build and pass `check_plan` (native GQA before repeated K / V). Raises
    CudnnFP8Unavailable with every attempt's reason when none does (cached too)."""
    key = (b, hq, hkv, s, d, bool(causal), _dev_key(device))
    if key not in _PLANS:
        if load() is None:
            raise CudnnFP8Unavailable(f"no cuDNN frontend: {_STATE['why']} (pip install nvidia-cudnn-frontend)")
        reasons = []
        for gqa in (("native", "repeat") if hq != hkv else ("none",)):
            h_graph = hkv if gqa == "native" else hq
            for var in TRAIN_VARIANTS:
                label = f"{var.label()}, gqa {gqa}"
                built = [_build(kind, (b, hq, s, d), h_graph, causal, var, device) for kind in ("fwd", "bwd")]
                bad = [x for x in built if isinstance(x, str)]
                if bad:
                    reasons.append(f"[{label}] {bad[0]}")
                    continue
                plan = Plan(built[0], built[1], var, gqa, (b, hq, hkv, s, d), bool(causal))
                if self_check:
                    try:
                        plan.check = check_plan(plan, device)
                    except Exception as e:  # noqa: BLE001  (a runtime error inside execute)
                        reasons.append(f"[{label}] self-check run: {one_line(e, 120)}")
                        continue
                    if not all(v <= tol for v in plan.check.values()):
                        reasons.append(f"[{label}] self-check vs SDPA BF16: rel. Frobenius errors "
                                       + ", ".join(f"{n} {v:.3f}" for n, v in plan.check.items()) + f" > {tol}")
                        continue
                _PLANS[key] = plan
                break
            if key in _PLANS:
                break
        else:
            _PLANS[key] = (f"no cuDNN FP8 SDPA graph built and passed the self-check at B {b}, Hq {hq}, "
                           f"Hkv {hkv}, S {s}, d {d}, causal {causal}: " + "; ".join(reasons))
    got = _PLANS[key]
    if isinstance(got, str):
        raise CudnnFP8Unavailable(got)
    return got


def plan_info() -> list:
    """Plan.info() of every shape built so far (for run summaries)."""
    return [p.info() for p in _PLANS.values() if isinstance(p, Plan)]


def _ports(values: dict, device) -> dict:
    """Port name -> a [1, 1, 1, 1] FP32 view of one buffer (rows of 16 bytes), filled
    from 0-d tensors in one op (no host sync)."""
    names = list(values)
    buf = torch.zeros(len(names), 4, dtype=torch.float32, device=device)
    buf[:, 0] = torch.stack([values[n].reshape(()).float() for n in names])
    return {n: buf[i, :1].view(1, 1, 1, 1) for i, n in enumerate(names)}


def _outs(names, device) -> dict:
    buf = torch.full((len(names), 4), float("nan"), dtype=torch.float32, device=device)
    return {n: buf[i, :1].view(1, 1, 1, 1) for i, n in enumerate(names)}


def _execute(built: _Built, pack: dict, device) -> None:
    ws = torch.empty(max(built.workspace, 1), device=device, dtype=torch.uint8)
    built.graph.execute({built.t[n]: x for n, x in pack.items() if n in built.t}, ws, handle=device_handle(device))


class _CudnnFP8Fn(torch.autograd.Function):
    """BF16 Q, K, V -> BF16 O through the plan's graphs with the state's delayed scales."""

    @staticmethod
    def forward(ctx, q, k, v, state: DelayedScalingState, plan: Plan, record: bool):
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        dev, lay = q.device, plan.var.layout
        sc = state.scale.detach().clone()   # NOTE: this step's scales (the update runs after the backward)
        desc = 1.0 / sc
        amax_in = torch.stack([q.abs().amax(), k.abs().amax(), v.abs().amax()]).float()
        rep = hq // hkv if plan.gqa == "repeat" else 1
        kk, vv = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)
        i = IDX
        q8 = cast_scaled(q, sc[i["q"]], lay)
        k8 = cast_scaled(kk, sc[i["k"]], lay)
        v8 = cast_scaled(vv, sc[i["v"]], lay)
        o8 = _empty(lay, b, hq, s, d, fp8_dtype(plan.var.o_type), dev)
        stats = torch.empty(b, hq, s, 1, device=dev, dtype=torch.float32)
        pack = {"q": q8, "k": k8, "v": v8, "o": o8, "stats": stats,
                **_ports({"descale_q": desc[i["q"]], "descale_k": desc[i["k"]], "descale_v": desc[i["v"]],
                          "descale_s": desc[i["s"]], "scale_s": sc[i["s"]], "scale_o": sc[i["o"]]}, dev),
                **_outs(("amax_s", "amax_o"), dev)}
        _execute(plan.fwd, pack, dev)
        from .ops import as_dtype   # NOTE: never a bare .to() as a Function's output (test_autograd_aliasing)
        o = as_dtype(o8.float() * desc[i["o"]], torch.bfloat16)
        if record:
            # NOTE: without a declared Amax_S the bound of P (<= 1) stands in for its amax
            amax_s = pack["amax_s"].reshape(()) if "amax_s" in plan.fwd.t else torch.ones((), device=dev)
            state.record(FWD_TENSORS, torch.cat([amax_in, torch.stack([amax_s, pack["amax_o"].reshape(())])]))
        ctx.save_for_backward(q8, k8, v8, o8, stats, sc)
        ctx.state, ctx.plan, ctx.record, ctx.rep = state, plan, record, rep
        return o

    @staticmethod
    def backward(ctx, do):
        q8, k8, v8, o8, stats, sc = ctx.saved_tensors
        plan, state, rep = ctx.plan, ctx.state, ctx.rep
        b, hq, hkv, s, d = plan.shape
        dev, lay, fmt = do.device, plan.var.layout, plan.var.do_type
        desc = 1.0 / sc
        i = IDX
        amax_do = do.abs().amax().float()
        do8 = cast_scaled(do, sc[i["dO"]], lay, fmt)
        hg = plan.h_graph
        dq8 = _empty(lay, b, hq, s, d, fp8_dtype(fmt), dev)
        dk8, dv8 = (_empty(lay, b, hg, s, d, fp8_dtype(fmt), dev) for _ in range(2))
        pack = {"q": q8, "k": k8, "v": v8, "o": o8, "stats": stats, "dO": do8, "dQ": dq8, "dK": dk8, "dV": dv8,
                **_ports({"descale_q": desc[i["q"]], "descale_k": desc[i["k"]], "descale_v": desc[i["v"]],
                          "descale_o": desc[i["o"]], "descale_dO": desc[i["dO"]], "descale_s": desc[i["s"]],
                          "descale_dP": desc[i["dP"]], "scale_s": sc[i["s"]], "scale_dQ": sc[i["dQ"]],
                          "scale_dK": sc[i["dK"]], "scale_dV": sc[i["dV"]], "scale_dP": sc[i["dP"]]}, dev),
                **_outs(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), dev)}
        _execute(plan.bwd, pack, dev)
        dq = dq8.float() * desc[i["dQ"]]
        dk = dk8.float() * desc[i["dK"]]
        dv = dv8.float() * desc[i["dV"]]
        if rep > 1:   # NOTE: repeat_interleave's backward: the group of kv head j is q heads j*rep .. j*rep+rep-1
            dk = dk.reshape(b, hkv, rep, s, d).sum(2)
            dv = dv.reshape(b, hkv, rep, s, d).sum(2)
        if ctx.record:
            state.record(BWD_TENSORS, torch.stack([amax_do] + [pack[n].reshape(()) for n in
                                                               ("amax_dP", "amax_dQ", "amax_dK", "amax_dV")]))
            state.update(fp8_maxes(fmt, dev))
        return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16), None, None, None


def check_plan(plan: Plan, device, steps: int = 3, seed: int = 0) -> dict:
    """The plan's self-check: `steps` forward + backward passes of the op on the same
    random BF16 inputs of the plan's shape with a fresh one-step state (history 1,
    so step 3 has every scale from step 2's amaxes), then the relative Frobenius
    errors of the last O, dQ, dK, dV against torch SDPA BF16 (math on the CPU; K / V
    repeated for GQA)."""
    b, hq, hkv, s, d = plan.shape
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, s, d, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn(b, hq, s, d, device=device, dtype=torch.bfloat16, generator=gen)
    state = DelayedScalingState(history_len=1).to(device)
    for _ in range(steps):
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        with torch.enable_grad():
            o = _CudnnFP8Fn.apply(qg, kg, vg, state, plan, True)
            grads = torch.autograd.grad(o, (qg, kg, vg), do)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    rep = hq // hkv
    with torch.enable_grad():
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1), is_causal=plan.causal)
        ref_g = torch.autograd.grad(ref, (qr, kr, vr), do)
    errs = {"O": rel_fro(o, ref)}
    errs.update({n: rel_fro(g, r) for n, g, r in zip(("dQ", "dK", "dV"), grads, ref_g)})
    return errs


# ---- availability and the op ------------------------------------------------------

def device_reason(device) -> Optional[str]:
    """Why `device` cannot run the op (not a CUDA device of compute capability 9.0), or None."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"needs a CUDA GPU (this run is on {dev.type})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    cc = tuple(torch.cuda.get_device_capability(dev))
    if cc != CAPABILITY:
        return (f"cuDNN's FP8 SDPA backward runs on sm_90 (Hopper) only, this GPU "
                f"({torch.cuda.get_device_name(dev)}) is sm_{cc[0]}{cc[1]}")
    return None


def unavailable_reason(device, head_dim: int, *, packed: bool = False, context_parallel: int = 1,
                       shape: Optional[tuple] = None, causal: bool = True) -> Optional[str]:
    """Why the op cannot train here, or None. Checks, all reported together: a CUDA
    device of compute capability 9.0, head_dim 128, no packed documents, no context
    parallelism, the cuDNN frontend; then, with shape = (B, Hq, Hkv, S, d), that a
    plan builds and passes its self-check (plan_for) at that shape."""
    dev = torch.device(device)
    reasons = [r for r in (device_reason(dev),) if r]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"unavailable_reason: head_dim must be an int, got {head_dim!r}")
    if head_dim != HEAD_DIM:
        reasons.append(f"head_dim {head_dim}: cuDNN's FP8 SDPA backward supports head_dim {HEAD_DIM} only "
                       "(presets gpu-125m / gpu-350m / gpu-1b, or --model head_dim=128)")
    if packed:
        reasons.append("--packed: per-document masks are not implemented for fp8-cudnn")
    if context_parallel > 1:
        reasons.append("--context-parallel: not implemented for fp8-cudnn")
    if not causal:
        reasons.append("only causal attention is implemented")
    if load() is None:
        reasons.append(f"no cuDNN frontend: {_STATE['why']} (pip install nvidia-cudnn-frontend)")
    if reasons:
        return "; ".join(reasons)
    if shape is not None:
        try:
            plan_for(*shape, causal=causal, device=dev)
        except CudnnFP8Unavailable as e:
            return str(e)
    return None


def cudnn_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: DelayedScalingState, *,
                        causal: bool = True) -> torch.Tensor:
    """Causal attention through cuDNN's FP8 SDPA with the delayed scales of `state`:
    q [B, Hq, S, d], k / v [B, Hkv, S, d] (cast to BF16), returns O [B, Hq, S, d] in
    BF16 (differentiable). Records amaxes and updates `state` (after the backward)
    only when grad is enabled and state.training. Raises CudnnFP8Unavailable (with
    the reason) where the op cannot run, TypeError for a non-tensor q / k / v or a
    state that is not a DelayedScalingState, ValueError for bad shapes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"cudnn_fp8_attention: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(state, DelayedScalingState):
        raise TypeError(f"cudnn_fp8_attention: argument 'state' must be a DelayedScalingState, got "
                        f"{type(state).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"cudnn_fp8_attention: q [B, Hq, S, d], k / v [B, Hkv, S, d], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    if hkv < 1 or s < 1 or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or hq % hkv:
        raise ValueError(f"cudnn_fp8_attention: self-attention with S >= 1 and Hq a multiple of Hkv >= 1, got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    why = unavailable_reason(q.device, d, causal=causal)
    if why is not None:
        raise CudnnFP8Unavailable(f"{MODE}: {why}")
    record = torch.is_grad_enabled() and state.training
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        plan = plan_for(b, hq, hkv, s, d, causal=causal, device=q.device)   # built once per shape
        return _CudnnFP8Fn.apply(qb, kb, vb, state, plan, record)
