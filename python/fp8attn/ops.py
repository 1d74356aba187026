"""The attention op: argument checks, fake kernels, autograd, public functions.

Public functions (all tensors are torch tensors on one device):

  attention(q, k, v, *, causal=False, softmax_scale=None, delta_mode="delta_matching",
            precision="fp8", block_size=128, grad_format="e4m3", return_lse=False,
            layer_name=None, scaling="row", qk_rotation="none", smooth_k=False,
            softcap=0.0, window_size=(-1, -1))
      SDPA layout [batch, heads, seqlen, head_dim].
  flash_attn_func(q, k, v, softmax_scale=None, causal=False, *, ...)
      flash_attn layout [batch, seqlen, heads, head_dim].
  scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
            is_causal=False, scale=None, enable_gqa=False, **fp8_kwargs)
      drop-in for torch.nn.functional.scaled_dot_product_attention.

Math: docs/numerics.md (section 1 exact attention and the bottom-right causal
mask, section 14 the sliding window, section 3 the seven FP8 matmuls, section 4 the delta modes, section 9 the
`tile` scaling recipe, section 10 the Q/K rotation and K smoothing). The ops are
torch.ops.fp8attn.fwd / bwd (schemas in csrc/torch/ops.cpp, docs/architecture.md).

NOTE: autograd of the public functions is a torch.autograd.Function rather
than register_autograd on `fwd`, because the fwd schema does not carry
delta_mode / grad_format, which the backward needs. The raw op
torch.ops.fp8attn.fwd is differentiable too (register_autograd below), with the
default backward options (delta_matching, e4m3).
"""
from __future__ import annotations

import contextlib
import decimal
import functools
import inspect
import math
import operator
from typing import Optional, Tuple, Union

import numpy as np
import torch

from . import _env
from . import _lib
from . import diagnostics as _diag
from . import qk_transform as _qkt

__all__ = [
    "attention",
    "flash_attn_func",
    "scaled_dot_product_attention",
    "DELTA_MODES",
    "PRECISIONS",
    "GRAD_FORMATS",
    "BLOCK_SIZES",
    "SCALINGS",
    "QK_ROTATIONS",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_SOFTMAX_SCALE",
]

# ---- accepted options --------------------------------------------------------

DELTA_MODES = ("stale", "matched_do", "delta_matching")
# "bf16" is an alias of "exact": the non-FP8 path (FP64 accumulation in the CPU
# reference, numerics.md section 1); BF16 only describes the op-boundary tensors.
PRECISIONS = {"fp8": "fp8", "exact": "exact", "bf16": "exact"}
GRAD_FORMATS = ("e4m3", "e5m2")
BLOCK_SIZES = (32, 64, 128)
# FP8 scaling recipes (numerics.md section 9): "row" = 1x128 blocks along each
# matmul's reduction dim (sections 2-3); "tile" = per-row / per-tile scales
# that fold into per-row coefficients (CPU reference and the sm_90a tile kernels).
SCALINGS = ("row", "tile")
# Outlier transforms of Q and K before quantization (numerics.md section 10):
# qk_rotation "hadamard" = incoherent processing (one fixed orthogonal rotation of
# Q and K); smooth_k = subtract the mean key. Fused in the CPU reference; on CUDA
# applied around the kernels with torch ops (unfused).
QK_ROTATIONS = _qkt.QK_ROTATIONS
MAX_HEAD_DIM = 256
# float64 is meant for the exact path (gradcheck); with precision="fp8" it is
# accepted and computed like float32 (FP32 outside the FP8 matmul operands).
# float16 is taken by the public functions (attention, flash_attn_func,
# scaled_dot_product_attention, varlen_attention), which run it as float32 and
# return float16 (_half_in / _half_out); the raw ops read BF16 / FP32 / FP64 only.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Hook for the CUDA kernels: the (head_dim_qk, head_dim_v) pairs and precisions
# they implement. None = no restriction known to this layer (the CUDA op then
# raises its own error).
CUDA_HEAD_DIMS: Optional[frozenset] = None
CUDA_PRECISIONS: Optional[Tuple[str, ...]] = None


def _err(fn: str, arg: str, msg: str) -> str:
    return f"fp8attn.{fn}: argument '{arg}': {msg}"


def fmt_value(x) -> str:
    """x as an argument's error message shows it: a number (Python or NumPy) as str()
    prints it (a float's shortest round-trip form: 1e+300, not 300 digits), except
    that an integer of more than 16 digits prints in %g form with its digit count
    ("1e+600 (an int of 601 digits)": softmax_scale=10**600 printed all 601 digits);
    a tuple or list of up to 8 items prints each item so; anything else as repr(),
    cut when longer than 200 characters."""
    if isinstance(x, (bool, np.bool_)):
        return repr(bool(x))
    if isinstance(x, (float, np.floating)):
        return str(x)
    if isinstance(x, (int, np.integer)):
        n = int(x)
        if abs(n) < 10**16:
            return str(n)
        d = decimal.Decimal(n)   # NOTE: str() of an int past 4300 digits is a ValueError
        mant, exp = f"{d:.6g}".split("e")
        mant = mant.rstrip("0").rstrip(".") if "." in mant else mant
        return f"{mant}e{exp} (an int of {d.adjusted() + 1} digits)"
    if isinstance(x, (tuple, list)) and len(x) <= 8:
        items = ", ".join(fmt_value(v) for v in x)
        return f"[{items}]" if isinstance(x, list) else f"({items}{',' if len(x) == 1 else ''})"
    r = repr(x)
    return r if len(r) <= 200 else f"{r[:120]}... ({len(r)} characters)"


def _shown_real(x, val: float) -> str:
    """A real-number argument x (read as the float val, _real) as its message shows it (in
    the raise only: str() of a SymFloat breaks a torch.compile(fullgraph=True) trace):
    a Python or NumPy number as itself (fmt_value; val is +-inf for an int past float's
    range or a NumPy longdouble past float64's), else (a 0-d tensor) val."""
    return fmt_value(x) if isinstance(x, (int, float, np.integer, np.floating)) else repr(val)


def check_bool(value, arg: str, fn: str = "attention", exc: type = TypeError,
               none_ok: bool = False) -> Optional[bool]:
    """A boolean option as a Python bool: a Python bool or a NumPy bool (numpy.bool_)
    is taken (and None when none_ok, returned as None); anything else (an int, a
    str, a tensor) raises `exc` naming the argument, never read as its truthiness.
    The one check of every boolean option of the public functions (attention,
    flash_attn_func, varlen_attention, the SDPA drop-in, FP8Attention,
    hf.register, ring_attention, quantize_tilescale, the training ModelConfig);
    `exc` keeps each function's documented exception type."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if value is None and none_ok:
        return None
    t = type(value)
    got = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    raise exc(_err(fn, arg, f"must be {'None or ' if none_ok else ''}a bool (Python or NumPy), got {got}"))


def check_options(
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    return_lse: bool = False,
    layer_name: Optional[str] = None,
    scaling: str = "row",
    qk_rotation: str = "none",
    smooth_k: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    fn: str = "attention",
) -> str:
    """Checks the non-tensor options and returns the op-level precision
    ("fp8" or "exact"). Raises TypeError / ValueError naming the argument
    (window_size: check_window_size)."""
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("smooth_k", smooth_k)):
        check_bool(flag, name, fn)
    if softmax_scale is not None:
        if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, (int, float, np.integer, np.floating)):
            raise TypeError(_err(fn, "softmax_scale", f"must be a float or None, got {type(softmax_scale).__name__}"))
        if not _finite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(_err(fn, "softmax_scale", f"must be finite and > 0, got {fmt_value(softmax_scale)}"))
        # NOTE: a Python int compares with a float exactly (float() of 2**2000 would be an OverflowError).
        big = softmax_scale > _SCALE_LIMIT if isinstance(softmax_scale, (int, np.integer)) else None
        if big or (big is None and float(softmax_scale) > _SCALE_LIMIT):  # == not finite(_scale_log2_fp32(...)); plain floats for dynamo
            raise ValueError(_err(fn, "softmax_scale", f"{fmt_value(softmax_scale)} is too large: softmax_scale * "
                                                       f"log2(e) overflows FP32 (the kernels compute it in FP32; "
                                                       f"max {MAX_SOFTMAX_SCALE:.6g})"))
    if delta_mode not in DELTA_MODES:
        raise ValueError(_err(fn, "delta_mode", f"must be one of {DELTA_MODES}, got {delta_mode!r}"))
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(_err(fn, "precision", f"must be one of {tuple(PRECISIONS)}, got {precision!r}"))
    if _index(block_size) not in BLOCK_SIZES:
        raise ValueError(_err(fn, "block_size", f"must be one of {BLOCK_SIZES}, got {fmt_value(block_size)}"))
    if grad_format not in GRAD_FORMATS:
        raise ValueError(_err(fn, "grad_format", f"must be one of {GRAD_FORMATS}, got {grad_format!r}"))
    if layer_name is not None and not isinstance(layer_name, str):
        raise TypeError(_err(fn, "layer_name", f"must be a str or None, got {type(layer_name).__name__}"))
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ValueError(_err(fn, "scaling", f"must be one of {SCALINGS}, got {scaling!r}"))
    if not isinstance(qk_rotation, str) or qk_rotation not in QK_ROTATIONS:
        raise ValueError(_err(fn, "qk_rotation", f"must be one of {QK_ROTATIONS}, got {qk_rotation!r}"))
    check_window_size(window_size, fn)
    return PRECISIONS[precision]


def _causal_window(causal, left: int, right: int) -> Tuple[int, int]:
    """The window passed on with `causal` (FlashAttention's rule: causal=True sets the
    right bound to 0; with no left bound the causal flag alone is the mask, so (-1, -1))."""
    if causal is True:
        return (left, 0) if left >= 0 else (-1, -1)
    return left, right


def check_window_size(window_size, fn: str = "attention") -> Tuple[int, int]:
    """window_size (FlashAttention's sliding window, numerics.md section 14) as a pair
    of Python ints (left, right), each negative bound returned as -1 (unbounded).
    Query i sees key j iff j >= i + seqlen_k - seqlen_q - left (left >= 0) and
    j <= i + seqlen_k - seqlen_q + right (right >= 0). Raises ValueError naming
    window_size unless it is a tuple or list of two ints (Python or NumPy integers;
    not bool) or None: None is unbounded, as -1 (FlashAttention-4's `flash_attn.cute`
    writes an unbounded side as None)."""
    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(w is None or is_int(w) for w in window_size)):
        raise ValueError(_err(fn, "window_size", f"must be a pair of ints or None (left, right), -1 or None = "
                                                 f"unbounded, got {fmt_value(window_size)}"))
    # NOTE: a bound of 2^62 keys reaches every key of any sequence, so larger ones (which
    # the op schema's int64 could not hold) are passed on as 2^62, the same mask.
    left, right = (-1 if w is None else min(int(w), 2**62) for w in window_size)
    return (left if left >= 0 else -1, right if right >= 0 else -1)


def _index(value) -> Optional[int]:
    """value as a Python int if it is an integer (operator.index: int, numpy
    integers, ...) and not a bool, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# NOTE: the kernels form softmax_scale * log2(e) in FP32 (config_sm90.h kLog2e),
# from softmax_scale rounded to FP32; a product that overflows would turn every
# logit into +-inf / NaN.
_LOG2E_FP32 = np.float32(1.4426950408889634)


def _scale_log2_fp32(scale: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(scale) * _LOG2E_FP32)


MAX_SOFTMAX_SCALE = float(np.nextafter(np.float32(np.finfo(np.float32).max) / _LOG2E_FP32, np.float32(np.inf)))
while not math.isfinite(_scale_log2_fp32(MAX_SOFTMAX_SCALE)):
    MAX_SOFTMAX_SCALE = float(np.nextafter(np.float32(MAX_SOFTMAX_SCALE), np.float32(0)))


def _scale_limit() -> float:
    """The largest float64 whose FP32 rounding is <= MAX_SOFTMAX_SCALE: check_options
    compares softmax_scale with it (plain float arithmetic, which torch.compile traces;
    NumPy's errstate is not traceable). Doubles below the midpoint to the next FP32 value
    round down; the midpoint itself rounds to the even one."""
    up = float(np.nextafter(np.float32(MAX_SOFTMAX_SCALE), np.float32(np.inf)))
    mid = (MAX_SOFTMAX_SCALE + up) / 2  # exact in float64
    even = int(np.float32(MAX_SOFTMAX_SCALE).view(np.uint32)) % 2 == 0
    return mid if even else float(np.nextafter(mid, 0.0))


_SCALE_LIMIT = _scale_limit()


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str = "fp8",
                 fn: str = "attention") -> None:
    """Checks q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (SDPA layout).
    Raises TypeError (not a tensor, dtype) or ValueError (device, shape) naming
    the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(_err(fn, name, f"must be a torch.Tensor, got {type(t).__name__}"))
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(_err(fn, name, f"dtype must be bfloat16, float16, float32 or float64, got {t.dtype}"))
        if t.dim() != 4:
            raise ValueError(_err(fn, name, f"must be 4-D [batch, heads, seqlen, head_dim], got shape {tuple(t.shape)}"))
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(_err(fn, name, f"must be on q's device {q.device}, got {t.device}"))
        if t.dtype != q.dtype:
            raise TypeError(_err(fn, name, f"must have q's dtype {q.dtype}, got {t.dtype}"))
    B, Hq, _, D = q.shape
    _, Hkv, Sk, _ = k.shape
    Dv = v.shape[3]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != B:
            raise ValueError(_err(fn, name, f"batch size {t.shape[0]} != q's batch size {B}"))
    if k.shape[3] != D:
        raise ValueError(_err(fn, "k", f"head_dim {k.shape[3]} != q's head_dim {D}"))
    if v.shape[1] != Hkv:
        raise ValueError(_err(fn, "v", f"num_heads {v.shape[1]} != k's num_heads {Hkv}"))
    if v.shape[2] != Sk:
        raise ValueError(_err(fn, "v", f"seqlen {v.shape[2]} != k's seqlen {Sk}"))
    if Hkv == 0 and Hq != 0 or Hkv != 0 and Hq % Hkv != 0:
        raise ValueError(_err(fn, "q", f"num_heads_q {Hq} must be a multiple of num_heads_kv {Hkv} (GQA)"))
    for name, d in (("q", D), ("v", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(_err(fn, name, f"head_dim must be in [1, {MAX_HEAD_DIM}], got {d}"))
    if q.device.type == "cuda":
        _check_cuda(q, k, v, precision, fn)
    elif q.device.type not in ("cpu", "meta"):
        raise ValueError(_err(fn, "q", f"device must be cpu or cuda, got {q.device}"))


def no_autocast(dev: str):
    """autocast off for device type `dev`; a no-op context for meta tensors (no autocast
    there). NOTE: a string test, not torch.amp.is_autocast_available, which dynamo
    cannot trace."""
    return torch.autocast(dev, enabled=False) if dev != "meta" else contextlib.nullcontext()


def _autocast_in(*ts):
    """Q, K, V as torch.autocast gives them to SDPA: while autocast is on for their
    device, float32 / float16 / bfloat16 tensors are cast (differentiably) to the
    autocast dtype (float64 and pre-quantized FP8 inputs are not), so O comes back
    in it as SDPA's does; without autocast (or for non-tensors, left to the argument
    checks) unchanged."""
    t0 = ts[0]
    if not isinstance(t0, torch.Tensor) or t0.device.type == "meta":  # NOTE: no autocast on meta
        return ts
    dev = t0.device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CAST else t for t in ts)


_AUTOCAST_CAST = (torch.float32, torch.float16, torch.bfloat16)   # not float64, not FP8 inputs


def _half_in(*ts: torch.Tensor):
    """float16 inputs as float32 (differentiable casts: gradients come back in float16).
    On CUDA the kernels then read them rounded to bfloat16, as any float32 input
    (numerics.md section 7); FP16's 10-bit mantissa is more than the E4M3 codes keep."""
    return tuple(t.float() if t.dtype == torch.float16 else t for t in ts)


def _half_out(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """O back in float16 for float16 inputs. Exact O is a convex combination of V's rows
    (|O| <= max |V| <= 65504), but the FP8 roundings can take a value just past FP16's
    largest finite 65504: finite values are saturated there (as FlashAttention's O
    stays finite); inf / NaN the inputs brought stay."""
    if dtype != torch.float16:
        return out
    fmax = torch.finfo(torch.float16).max
    return torch.where(torch.isfinite(out), out.clamp(-fmax, fmax), out).half()


def _check_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str, fn: str) -> None:
    """What the CUDA kernels support (hook; see CUDA_HEAD_DIMS / CUDA_PRECISIONS).
    Raises RuntimeError for a GPU that is not compute capability 9.0
    (_lib.check_cuda_device), ValueError for a library without CUDA kernels."""
    _lib.check_cuda_device(q.device)
    if not _lib.HAS_CUDA_KERNELS:
        raise ValueError(_err(fn, "q", "is a CUDA tensor but fp8attn was built without CUDA kernels "
                                       "(rebuild with FP8ATTN_BUILD_CUDA=1, or use CPU tensors)"))
    if q.dtype == torch.float64:
        # NOTE: float32 is rounded to bfloat16 inside the CUDA op (numerics.md section 7).
        raise TypeError(_err(fn, "q", "dtype float64 has no CUDA kernel (CUDA takes bfloat16 or float32; "
                                      "float64 runs on CPU tensors)"))
    if CUDA_PRECISIONS is not None and precision not in CUDA_PRECISIONS:
        raise ValueError(_err(fn, "precision", f"{precision!r} has no CUDA kernel (supported: {CUDA_PRECISIONS})"))
    dims = (q.shape[3], v.shape[3])
    if CUDA_HEAD_DIMS is not None and dims not in CUDA_HEAD_DIMS:
        raise ValueError(_err(fn, "q", f"(head_dim_qk, head_dim_v) = {dims} has no CUDA kernel "
                                       f"(supported: {sorted(CUDA_HEAD_DIMS)})"))


def _is_empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0 or k.shape[2] == 0


# ---- fake (meta) kernels, for torch.compile / FakeTensor ------------------------


def _check_one_device(fn: str, **tensors) -> None:
    """The fake kernels also run when only SOME inputs are meta tensors (the Meta
    key wins the dispatch): a mix of devices is an error there, not meta outputs."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != first.device:
            raise ValueError(_err(fn, name, f"must be on {first_name}'s device {first.device}, got {t.device}"))


@torch.library.register_fake("fp8attn::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, precision, block_size, scaling="row", qk_rotation="none",
              smooth_k=False, softcap=0.0, window_left=-1, window_right=-1):
    _check_one_device("fwd", q=q, k=k, v=v)
    B, Hq, Sq, _ = q.shape
    out = q.new_empty((B, Hq, Sq, v.shape[3]))
    lse = q.new_empty((B, Hq, Sq), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("fp8attn::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, precision, delta_mode, block_size,
              grad_format, diagnostics, scaling="row", qk_rotation="none", smooth_k=False, delta=None,
              softcap=0.0, window_left=-1, window_right=-1, deterministic=False):
    _check_one_device("bwd", q=q, dout=dout, k=k, v=v, out=out, lse=lse,
                      **({} if delta is None else {"delta": delta}))
    B, Hq, Sq, _ = q.shape
    diag_shape = (4, B, Hq, Sq) if diagnostics else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(diag_shape, dtype=torch.float32))


@torch.library.register_fake("fp8attn::fwd_varlen")
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, block_size,
                     scaling="tile", window_left=-1, window_right=-1, qk_rotation="none"):
    _check_one_device("fwd_varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v.shape[2])), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.register_fake("fp8attn::bwd_varlen")
def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale,
                     causal, delta_mode, block_size, grad_format, diagnostics, scaling="tile", window_left=-1,
                     window_right=-1, qk_rotation="none"):
    _check_one_device("bwd_varlen", q=q, dout=dout, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
    diag_shape = (4, q.shape[1], q.shape[0]) if diagnostics else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(diag_shape, dtype=torch.float32))


@torch.library.register_fake("fp8attn::bwd_dm_sums")
def _bwd_dm_sums_fake(dout, q, k, v, lse, softmax_scale, causal, block_size, grad_format, scaling="row",
                      softcap=0.0, window_left=-1, window_right=-1):
    _check_one_device("bwd_dm_sums", q=q, dout=dout, k=k, v=v, lse=lse)
    B, Hq, Sq, _ = q.shape
    return q.new_empty((B, Hq, Sq), dtype=torch.float32), q.new_empty((B, Hq, Sq), dtype=torch.float32)


# ---- forward / backward on the ops -------------------------------------------


def _has_transform(qk_rotation: str, smooth_k: bool) -> bool:
    return qk_rotation != "none" or smooth_k


# The CUDA kernels' head-dim pairs (csrc/hopper/config_sm90.h kKernelHeadDims): a call
# runs on the first pair that holds it, its head dims zero-padded up to the pair's.
_KERNEL_HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))


def _fused_rotation(q: torch.Tensor, v: torch.Tensor, qk_rotation: str, scaling: str) -> bool:
    """Whether the raw CUDA op rotates Q and K inside its quantization (numerics.md 10.3,
    the fused rotation): CUDA tensors, qk_rotation="hadamard", scaling="tile", and a
    head_dim_qk the kernels take unpadded (64, 128, 192 with head_dim_v <= 128, 256);
    not with FP8ATTN_FUSED_ROTATION=0. Elsewhere the rotation runs around the raw op."""
    if not (q.device.type == "cuda" and qk_rotation == "hadamard" and scaling == "tile"):
        return False
    d, dv = q.shape[-1], v.shape[-1]
    pair = next((p for p in _KERNEL_HEAD_DIMS if d <= p[0] and dv <= p[1]), None)
    return pair is not None and pair[0] == d and _env.flag("FP8ATTN_FUSED_ROTATION", True)


def _around_op_inputs(q, k, v, qk_rotation, smooth_k, scaling):
    """(Q', K', mean, rotation the raw op applies, dtype handed to the raw op) of the
    path that applies the transforms around the raw op (numerics.md 10.3): with the fused
    rotation only the smoothing (K - m in FP32, Q read as FP32) runs here and the raw op
    rotates; otherwise qk_transform.transform_qk forms Q', K' here."""
    if _fused_rotation(q, v, qk_rotation, scaling):
        q_t, k_t, mean = _qkt.smooth_only(q, k, smooth_k)
        return q_t, k_t, mean, qk_rotation, q_t.dtype
    q_t, k_t, mean = _qkt.transform_qk(q, k, qk_rotation, smooth_k)
    return q_t, k_t, mean, "none", _unfused_dtype(q)


def _exact_lse_t(q: torch.Tensor, precision: str, smooth_k: bool) -> bool:
    """Whether LSE_t (fwd_op) differs from the public LSE and bwd_op takes it as it is:
    smooth_k on the torch path (always on CUDA; the fp8 path on CPU, numerics.md 10.2)."""
    return smooth_k and (precision == "fp8" or q.device.type == "cuda")


def fwd_op(q, k, v, scale, causal, precision, block_size, scaling="row", qk_rotation="none", smooth_k=False,
           unfused: Optional[bool] = None, softcap: float = 0.0, return_lse_t: bool = False,
           window: Tuple[int, int] = (-1, -1)):
    """torch.ops.fp8attn.fwd with the outlier transforms (numerics.md section 10)
    wherever they run: fused in the CPU reference (the raw op's qk_rotation /
    smooth_k), or, on CUDA (unfused=None picks by device; True forces it, for
    the CPU consistency tests; fp8 path only), applied around the raw op with
    torch ops: Q', K' = qk_transform.transform_qk, then the kernel, then the LSE
    shifted back to that of the untransformed logits. softcap: numerics.md section 12;
    window: (left, right), the sliding window of section 14 (-1 = unbounded), the raw
    op's window_left / window_right. Returns (O, LSE), with return_lse_t (O, LSE, LSE_t): LSE_t the LSE of the
    logits the kernel saw (LSE' of the smoothed logits; LSE itself without
    smooth_k), what the autograd entry points keep for the backward (bwd_op's
    lse_t: no FP32 round trip through the shift, section 10.2; the torch path,
    which equals the fused reference bit for bit, then runs on CPU too)."""
    wl, wr = window
    if not _has_transform(qk_rotation, smooth_k):
        out, lse = torch.ops.fp8attn.fwd(q, k, v, scale, causal, precision, block_size, scaling, softcap=softcap,
                                         window_left=wl, window_right=wr)
        return (out, lse, lse) if return_lse_t else (out, lse)
    if unfused is None:
        unfused = q.device.type == "cuda" or (return_lse_t and _exact_lse_t(q, precision, smooth_k))
    if not unfused:
        out, lse = torch.ops.fp8attn.fwd(q, k, v, scale, causal, precision, block_size, scaling, qk_rotation,
                                         smooth_k, softcap, wl, wr)
        return (out, lse, lse) if return_lse_t else (out, lse)  # rotation only: no shift, LSE_t = LSE
    q_t, k_t, mean, rot, w = _around_op_inputs(q, k, v, qk_rotation, smooth_k, scaling)
    out, lse_t = torch.ops.fp8attn.fwd(q_t.to(w), k_t.to(w), v.to(w), scale, causal, precision, block_size, scaling,
                                       rot, softcap=softcap, window_left=wl, window_right=wr)
    lse = lse_t if mean is None else _qkt.shift_lse(lse_t, q, mean, scale, +1)
    out = as_dtype(out, q.dtype)
    return (out, lse, lse_t) if return_lse_t else (out, lse)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself when it has it, else t.to(dtype).

    NOTE: what an autograd.Function forward returns goes through this, never through a
    bare t.to(dtype): under torch.compile (torch 2.11, every backend, "eager" included)
    a forward returning t.to(dtype) when that is a no-op (an alias of t) got all-zero
    gradients for its inputs, silently (float32 inputs of attention with smooth_k, of
    FP8Linear; a break test, 2026-12-03). Tests: test_qk_transform.py::
    test_torch_compile_fullgraph_with_the_options, test_linear.py::test_compiled_grads_equal_eager."""
    return t if t.dtype == dtype else t.to(dtype)


def _unfused_dtype(q: torch.Tensor):
    """The dtype the unfused path hands the raw op: q's on CUDA (the kernels read
    bfloat16; float32 holding bfloat16 values is rounded exactly), float32 for
    bfloat16 CPU tensors, so that the reference keeps dQ', dK' in FP32 as its
    fused path does (O and dV are rounded once, at the end, either way)."""
    if q.device.type != "cuda" and q.dtype == torch.bfloat16:
        return torch.float32
    return q.dtype


def bwd_op(dout, q, k, v, out, lse, scale, causal, precision, delta_mode, block_size, grad_format, diagnostics,
           scaling="row", qk_rotation="none", smooth_k=False, unfused: Optional[bool] = None, softcap: float = 0.0,
           lse_t: Optional[torch.Tensor] = None, window: Tuple[int, int] = (-1, -1), deterministic: bool = False):
    """torch.ops.fp8attn.bwd with the outlier transforms, as `fwd_op`: the
    unfused path recomputes Q', K' (deterministic), shifts the LSE to that of
    the smoothed logits, runs the raw op and maps dQ', dK' back
    (qk_transform.map_grads_back). lse_t: fwd_op's LSE_t; given, it is used as
    the smoothed logits' LSE as it is (exact) instead of LSE - shift (an FP32
    round trip: off by one ulp of max(|LSE|, |shift|), which overflows P for
    logits past ~1e9, numerics.md section 10.2). window: as in `fwd_op`.
    deterministic: the raw op's (dQ, dK, dV the same bit for bit from run to run).
    Returns (dQ, dK, dV, diag)."""
    wl, wr = window
    if not _has_transform(qk_rotation, smooth_k):
        return torch.ops.fp8attn.bwd(dout, q, k, v, out, lse, scale, causal, precision, delta_mode, block_size,
                                     grad_format, diagnostics, scaling, softcap=softcap, window_left=wl,
                                     window_right=wr, deterministic=deterministic)
    exact_lse_t = lse_t is not None and _exact_lse_t(q, precision, smooth_k)
    if unfused is None:
        unfused = q.device.type == "cuda" or exact_lse_t
    if not unfused:
        return torch.ops.fp8attn.bwd(dout, q, k, v, out, lse, scale, causal, precision, delta_mode, block_size,
                                     grad_format, diagnostics, scaling, qk_rotation, smooth_k, softcap=softcap,
                                     window_left=wl, window_right=wr, deterministic=deterministic)
    q_t, k_t, mean, rot, w = _around_op_inputs(q, k, v, qk_rotation, smooth_k, scaling)
    if exact_lse_t:
        lse = lse_t
    elif mean is not None:
        lse = _qkt.shift_lse(lse, q, mean, scale, -1)
    dq_t, dk_t, dv, diag = torch.ops.fp8attn.bwd(dout.to(w), q_t.to(w), k_t.to(w), v.to(w), out.to(w), lse, scale,
                                                 causal, precision, delta_mode, block_size, grad_format, diagnostics,
                                                 scaling, rot, softcap=softcap, window_left=wl, window_right=wr,
                                                 deterministic=deterministic)
    # The fused rotation's raw op returns dQ and dK_s mapped back through R^T already.
    dq, dk = _qkt.map_grads_back(dq_t, dk_t, "none" if rot != "none" else qk_rotation, smooth_k, q.dtype, k.dtype)
    return dq, dk, dv.to(v.dtype), diag


def _forward(q, k, v, scale, causal, precision, block_size, scaling="row", qk_rotation="none", smooth_k=False,
             softcap=0.0, window=(-1, -1)):
    """(O, LSE, LSE_t) (fwd_op with return_lse_t)."""
    if _is_empty(q, k):
        # Nothing to compute, or no key at all: every row sees no key, so
        # O = 0 and LSE = -inf (numerics.md section 1).
        B, Hq, Sq, _ = q.shape
        out = q.new_zeros((B, Hq, Sq, v.shape[3]))
        lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=torch.float32)
        return out, lse, lse
    return fwd_op(q, k, v, scale, causal, precision, block_size, scaling, qk_rotation, smooth_k, softcap=softcap,
                  return_lse_t=True, window=window)


def _backward(dout, q, k, v, out, lse, scale, causal, precision, delta_mode, block_size,
              grad_format, layer_name, scaling="row", qk_rotation="none", smooth_k=False, softcap=0.0, lse_t=None,
              window=(-1, -1), deterministic=False):
    if _is_empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    want_diag = _diag.is_recording()
    dq, dk, dv, diag = bwd_op(dout, q, k, v, out, lse, scale, causal, precision, delta_mode, block_size,
                              grad_format, want_diag, scaling, qk_rotation, smooth_k, softcap=softcap, lse_t=lse_t,
                              window=window, deterministic=deterministic)
    if want_diag:
        _diag._record(diag, _diag_meta(q, k, v, causal, precision, delta_mode, block_size, grad_format,
                                       layer_name, scaling, qk_rotation, smooth_k, window))
    return dq, dk, dv


def _diag_meta(q, k, v, causal, precision, delta_mode, block_size, grad_format, layer_name,
               scaling="row", qk_rotation="none", smooth_k=False, window=(-1, -1)) -> dict:
    """The non-statistics fields of a diagnostics record of one bwd call on
    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (also used by varlen)."""
    return {
        "layer": layer_name,
        "delta_mode": delta_mode,
        "precision": precision,
        "grad_format": grad_format,
        "block_size": block_size,
        "scaling": scaling,
        "qk_rotation": qk_rotation,
        "smooth_k": smooth_k,
        "causal": causal,
        "window_size": tuple(window),
        "shape": {
            "batch": q.shape[0], "num_heads_q": q.shape[1], "num_heads_kv": k.shape[1],
            "seqlen_q": q.shape[2], "seqlen_k": k.shape[2],
            "head_dim_qk": q.shape[3], "head_dim_v": v.shape[3],
        },
    }


def single_backward(fn: str):
    """Decorator of an autograd backward(ctx, *grads) whose result has no
    derivative: runs it under no_grad, and raises RuntimeError when it runs with
    grad mode on (create_graph=True) while an input or a grad output
    requires grad, i.e. whenever a second derivative through it was asked for.

    NOTE: not torch's once_differentiable, which raises only when a grad output
    requires grad: for a loss linear in O (o.sum()) dO is a constant, no error
    comes, and the second derivative silently comes out zero (or the gradient
    has no graph at all)."""
    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():
                # NOTE: ctx.needs_input_grad, not the saved tensors: a backward may
                # save only derived tensors (FP8 codes) that never require grad.
                if any(ctx.needs_input_grad) or any(isinstance(g, torch.Tensor) and g.requires_grad
                                                    for g in grads):
                    raise RuntimeError(
                        f"fp8attn.{fn}: double backward is not supported: its backward has no derivative, "
                        "but a backward ran with create_graph=True on inputs that require grad (a second "
                        "derivative through it would be wrong; e.g. a Hessian, a jacobian with "
                        "create_graph=True, a gradient penalty through attention); use create_graph=False, "
                        "or an exact "
                        "attention (e.g. torch SDPA) for higher-order gradients")
            with torch.no_grad():
                return backward(ctx, *grads)
        return wrapper
    return wrap


class _AttentionFunction(torch.autograd.Function):
    """O, LSE = attention(Q, K, V); LSE is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, precision, block_size, delta_mode, grad_format, layer_name,
                scaling="row", qk_rotation="none", smooth_k=False, softcap=0.0, window_left=-1, window_right=-1,
                deterministic=False):
        window = (window_left, window_right)
        out, lse, lse_t = _forward(q, k, v, scale, causal, precision, block_size, scaling, qk_rotation, smooth_k,
                                   softcap, window)
        # The backward gets LSE_t, the LSE of the logits the kernel saw (numerics.md section 10.2).
        ctx.save_for_backward(q, k, v, out, lse_t)
        ctx.opts = (scale, causal, precision, delta_mode, block_size, grad_format, layer_name, scaling,
                    qk_rotation, smooth_k, softcap, window, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @single_backward("attention")
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_t = ctx.saved_tensors
        (scale, causal, precision, delta_mode, block_size, grad_format, layer_name, scaling, qk_rotation,
         smooth_k, softcap, window, deterministic) = ctx.opts
        dq, dk, dv = _backward(dout, q, k, v, out, lse_t, scale, causal, precision, delta_mode,
                               block_size, grad_format, layer_name, scaling, qk_rotation, smooth_k, softcap,
                               lse_t=lse_t, window=window, deterministic=deterministic)
        return (dq, dk, dv) + (None,) * 14


# Autograd of the raw op torch.ops.fp8attn.fwd (default backward options).
def _fwd_setup_context(ctx, inputs, output):
    q, k, v, scale, causal, precision, block_size = inputs[:7]
    scaling = inputs[7] if len(inputs) > 7 else "row"
    qk_rotation = inputs[8] if len(inputs) > 8 else "none"
    smooth_k = inputs[9] if len(inputs) > 9 else False
    softcap = inputs[10] if len(inputs) > 10 else 0.0
    window = (inputs[11] if len(inputs) > 11 else -1, inputs[12] if len(inputs) > 12 else -1)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.opts = (scale, causal, precision, block_size, scaling, qk_rotation, smooth_k, softcap, window, len(inputs))
    ctx.mark_non_differentiable(lse)


@single_backward("fwd (the raw op torch.ops.fp8attn.fwd)")
def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    scale, causal, precision, block_size, scaling, qk_rotation, smooth_k, softcap, window, n_inputs = ctx.opts
    lse_t = None
    if _exact_lse_t(q, precision, smooth_k) and not _is_empty(q, k):
        # The raw op returned only the public LSE; LSE - shift is an FP32 round trip
        # (numerics.md section 10.2), so recompute the forward's own LSE' (deterministic;
        # costs one forward, on this raw-op path only).
        lse_t = fwd_op(q, k, v, scale, causal, precision, block_size, scaling, qk_rotation, smooth_k,
                       softcap=softcap, return_lse_t=True, window=window)[2]
    dq, dk, dv = _backward(dout, q, k, v, out, lse, scale, causal, precision, "delta_matching",
                           block_size, "e4m3", None, scaling, qk_rotation, smooth_k, softcap, lse_t=lse_t,
                           window=window)
    return (dq, dk, dv) + (None,) * (n_inputs - 3)


torch.library.register_autograd("fp8attn::fwd", _fwd_backward, setup_context=_fwd_setup_context)


# ---- public functions ---------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    return_lse: bool = False,
    layer_name: Optional[str] = None,
    scaling: str = "row",
    qk_rotation: str = "none",
    smooth_k: bool = False,
    softcap: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
    deterministic: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Block-scaled FP8 attention with a selectable backward delta (numerics.md).

    Args:
        q: [batch, num_heads_q, seqlen_q, head_dim_qk] (SDPA layout), bfloat16,
            float16, float32 or float64 (CUDA: bfloat16, float16 or float32; the
            op rounds float32 to bfloat16 for the kernels and O and the gradients
            come back as float32; float16 runs as float32 and comes back as
            float16).
            Any strides (a non-unit head_dim stride costs a copy). head_dim_qk
            and head_dim_v in [1, 256]; on CUDA a pair without its own kernel
            runs zero-padded to the next one (exact, numerics.md section 7).
        k: [batch, num_heads_kv, seqlen_k, head_dim_qk]; num_heads_q must be a
            multiple of num_heads_kv (GQA: query head h uses kv head
            h // (num_heads_q // num_heads_kv)).
        v: [batch, num_heads_kv, seqlen_k, head_dim_v]; head_dim_v may differ.
        causal: bottom-right aligned mask, query i sees key j iff
            j <= i + seqlen_k - seqlen_q. Rows that see no key give O = 0,
            LSE = -inf and zero gradients.
        softmax_scale: tau; default 1/sqrt(head_dim_qk). Finite and > 0, and
            tau * log2(e) must be finite in FP32 (the kernels form that product
            from tau rounded to FP32): tau <= MAX_SOFTMAX_SCALE (about 2.36e38).
        delta_mode: "delta_matching" (default), "matched_do" or "stale"
            (numerics.md section 4); used by the backward only.
        precision: "fp8" (the seven FP8 matmuls, section 3) or "exact"
            (section 1; "bf16" is an alias of "exact").
        block_size: with scaling="row", the FP8 block length along each matmul's
            reduction dim: 32, 64, 128 (any integer type, e.g. numpy; not a bool;
            CUDA tensors: 128 only, ValueError otherwise)
            (dS of dQ = dS K uses min(block_size, 64) keys: numerics.md section 3).
            With scaling="tile", the tile edge: scales are per tile of
            block_size keys / queries, head_dim is never split (section 9).
            The CUDA kernels take 128 only.
        grad_format: FP8 format of dO and dS: "e4m3" or "e5m2".
        return_lse: also return LSE (a bool).
        layer_name: label of this call in `fp8attn.diagnostics.record()` records
            (a str or None).
        scaling: the FP8 scaling recipe (numerics.md section 9): "row" (default;
            1x128 blocks along each reduction dim, sections 2-3) or "tile" (one
            scale per query row or per tile, folded into per-row coefficients;
            the same accuracy). On CUDA tensors FP8ATTN_TILE_BWD=0 switches
            the "tile" backward kernels off (docs/architecture.md): a backward
            through a "tile" forward then raises NotImplementedError naming
            `scaling` (at backward time). Ignored by precision="exact".
        qk_rotation: "none" (default) or "hadamard": incoherent processing
            (numerics.md section 10). Q and K are rotated by the same fixed
            orthogonal matrix R (a normalized Hadamard transform with a fixed
            sign pattern, block-diagonal in power-of-two blocks when head_dim
            is not a power of two; no state) before quantization, so S is
            unchanged in exact arithmetic while outlier channels are spread
            over the whole block; dQ and dK are mapped back with R^T. Every
            head uses the same R (a GQA group sees one rotation).
        smooth_k: False (default) or True: K smoothing (section 10). The mean
            key of each (batch, kv head) is subtracted from K before
            quantization (softmax is invariant to it, also with causal); the
            gradient through the mean is included and the returned LSE is that
            of the unsmoothed logits. A non-finite key makes the whole (batch,
            kv head) NaN. Both options apply to either scaling and to
            precision="exact" (where they change results only by rounding).
            CPU: fused in the reference; CUDA: applied around the kernels with
            torch ops (unfused: extra memory traffic, Q' and K' rounded to
            bfloat16 for the kernels, dQ' and dK' come back in bfloat16).
        softcap: logit softcapping (numerics.md section 12; FlashAttention's
            softcap): the scaled logits x = softmax_scale * Q K^T become
            softcap * tanh(x / softcap) before the softmax; 0 (default) = off.
            A real number >= 0. CPU tensors run it with either scaling; CUDA
            tensors with scaling="tile" (its kernels, c in
            [1e-6, 1e4]); scaling="row" on CUDA raises
            NotImplementedError naming softcap. Not with smooth_k (ValueError).
        window_size: (left, right), FlashAttention's sliding window
            (numerics.md section 14), bottom-right aligned like causal: query i
            sees key j iff j >= i + seqlen_k - seqlen_q - left (when left >= 0)
            and j <= i + seqlen_k - seqlen_q + right (when right >= 0); a
            negative bound (-1) is unbounded. (-1, -1) (default) is no window,
            (-1, 0) the causal mask; causal=True forces right = 0 (as
            FlashAttention). Rows that see no key give O = 0, LSE = -inf and
            zero gradients; the Delta-Matching delta sums over the keys the
            window lets a row see. A tuple or list of two ints (ValueError
            otherwise). Both scalings, every delta mode, both precisions on CPU
            tensors; CUDA tensors: scaling="tile" runs any window on its kernels;
            scaling="row" raises NotImplementedError naming window_size unless
            the window masks nothing beyond causal (e.g. a bound reaching every
            key), which runs as no window / causal.
        deterministic: a backward whose dQ, dK, dV are the same bit for bit
            from run to run (FlashAttention's `deterministic`). CPU tensors
            always are; CUDA tensors with scaling="tile" order the dQ partials'
            adds (a turn counter per 64-query sub-tile: the key tiles' CTAs add
            one after another, slower); scaling="row" on CUDA raises
            NotImplementedError naming it. A bool (TypeError otherwise).

    Returns:
        O [batch, num_heads_q, seqlen_q, head_dim_v] in q's dtype (contiguous);
        under torch.autocast for q's device, as SDPA: Q, K, V (not float64) are
        cast to the autocast dtype first, and O comes back in it;
        with return_lse also LSE float32 [batch, num_heads_q, seqlen_q] (natural
        log, not differentiable).

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype
            (float64 on CUDA), a wrongly typed option (causal / return_lse /
            smooth_k / deterministic not a bool: every boolean option takes a
            Python bool or a NumPy bool, an int or a str is refused;
            softmax_scale not a number, layer_name not a str or None).
        ValueError: mismatched shapes or devices, a bad option value (incl. a
            softmax_scale too large for FP32, a block_size that is not 32, 64
            or 128, or not 128 on CUDA, a scaling other than "row" / "tile",
            a qk_rotation other than "none" / "hadamard"; smooth_k not a bool
            is a TypeError).
            The message names the argument.
        NotImplementedError: a sliding window on CUDA tensors with
            scaling="row" (window_size); softcap > 0 on CUDA tensors with
            scaling="row" (softcap);
            (in backward) scaling="tile" on CUDA tensors
            with FP8ATTN_TILE_BWD=0;
            precision "exact" on CUDA tensors (the exact reference runs on CPU
            tensors).
        RuntimeError: (in backward) a backward with create_graph=True while an
            input requires grad: double backward is not supported.
    """
    q, k, v = _autocast_in(q, k, v)
    op_precision = check_options(causal=causal, softmax_scale=softmax_scale, delta_mode=delta_mode,
                                 precision=precision, block_size=block_size, grad_format=grad_format,
                                 return_lse=return_lse, layer_name=layer_name, scaling=scaling,
                                 qk_rotation=qk_rotation, smooth_k=smooth_k)
    causal, return_lse, smooth_k = bool(causal), bool(return_lse), bool(smooth_k)  # checked: NumPy bools too
    left, right = check_window_size(window_size)
    check_inputs(q, k, v, op_precision)
    cap = check_softcap(softcap, smooth_k, q.device.type, scaling=scaling, precision=op_precision)
    block_size = _index(block_size)  # e.g. a numpy integer: the op schema takes a Python int
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    in_dtype = q.dtype
    q, k, v = _half_in(q, k, v)
    left, right = _causal_window(causal, left, right)
    deterministic = check_deterministic(deterministic, q.device.type, op_precision, scaling)
    out, lse = _AttentionFunction.apply(q, k, v, scale, causal, op_precision, block_size, delta_mode,
                                        grad_format, layer_name, scaling, qk_rotation, smooth_k, cap, left, right,
                                        deterministic)
    out = _half_out(out, in_dtype)
    return (out, lse) if return_lse else out


# The softcap range the CUDA kernels take (csrc/torch/ops_cuda.cpp cuda_softcap: their
# capped logit is within ~3e-7 c log2(e) of the exact one, a relative error of P of
# ~2e-7 c, 2e-3 at the upper end; the lower end keeps 2 / c x the score coefficients
# far from FP32 overflow).
CUDA_SOFTCAP_RANGE = (1e-6, 1e4)


_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_NORMAL_MIN = float(torch.finfo(torch.float32).tiny)


def check_softcap(softcap, smooth_k: bool, device_type: str, fn: str = "attention", scaling: str = "row",
                  precision: str = "fp8") -> float:
    """softcap as a float (numerics.md section 12): a real number, finite, >= 0 (0 =
    off); not with smooth_k (the mean key shifts the logits before the cap, which
    the cap no longer ignores); precision "fp8": c a normal float32 (the fp8 paths hold
    it in FP32); CUDA tensors with precision "fp8": scaling="tile"
    only (its kernels take it, c in CUDA_SOFTCAP_RANGE; scaling="row" raises
    NotImplementedError naming softcap and saying that scaling="tile" runs it)."""
    if isinstance(softcap, torch.Tensor) and softcap.requires_grad:
        # NOTE: float(tensor) would detach it silently: a learnable cap would get no gradient.
        raise TypeError(_err(fn, "softcap", "is a tensor that requires grad; the cap is a constant here (no "
                                            "gradient flows to it): pass a float"))
    cap = _real(softcap)
    if cap is None:
        raise TypeError(_err(fn, "softcap", f"must be a float, got {type(softcap).__name__}"))
    if not _finite(cap) or cap < 0:
        raise ValueError(_err(fn, "softcap", f"must be finite and >= 0 (0 = off), got "
                                             f"{_shown_real(softcap, cap)}"))
    if cap > 0 and precision == "fp8" and not _F32_NORMAL_MIN <= cap <= _F32_MAX:
        # NOTE: the fp8 path (the CPU reference's and the kernels') holds c in FP32: past FLT_MAX it
        # would be inf (every P NaN), below ~7e-46 it would round to 0 (the cap silently off).
        raise ValueError(_err(fn, "softcap", f"must be 0 or in [{_F32_NORMAL_MIN:.7g}, {_F32_MAX:.7g}] with "
                                             f"precision 'fp8' (the cap is held in float32), got "
                                             f"{_shown_real(softcap, cap)}"))
    if cap > 0 and smooth_k:
        raise ValueError(_err(fn, "softcap", "cannot be combined with smooth_k=True (softcapping is not "
                                             "invariant to the mean-key shift of the logits)"))
    if cap > 0 and device_type == "cuda" and precision == "fp8":
        if scaling != "tile":
            raise NotImplementedError(_err(fn, "softcap", f"the CUDA kernels of scaling={scaling!r} do not take "
                                                          f"logit softcapping (got {_shown_real(softcap, cap)}); "
                                                          "scaling='tile' runs it on CUDA, and CPU tensors run "
                                                          "both recipes"))
        lo, hi = CUDA_SOFTCAP_RANGE
        if not lo <= cap <= hi:
            raise ValueError(_err(fn, "softcap", f"must be 0 or in [{lo:g}, {hi:g}] on CUDA (the kernels' cap has "
                                                 f"a relative error of ~2e-7 c in P; CPU tensors take any c >= 0), "
                                                 f"got {_shown_real(softcap, cap)}"))
    return cap


def _finite(x) -> bool:
    """math.isfinite for a Python float and for one torch.compile traces symbolically
    (dynamic=True makes float arguments SymFloats, which math.isfinite does not take):
    x - x is 0 exactly when x is finite (inf - inf and NaN - NaN are NaN)."""
    return x - x == 0


def _real(x) -> Optional[float]:
    """x as a float if it is a real number (Python, NumPy, or a 0-d floating/integer
    tensor; not bool), else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, torch.Tensor):
        return float(x) if x.dim() == 0 and not x.dtype.is_complex and x.dtype != torch.bool else None
    if not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    try:
        return float(x)
    except OverflowError:  # an int past float's range (2**2000): +-inf, which the callers' range checks name
        return math.inf if x > 0 else -math.inf


def check_deterministic(deterministic, device_type: str, precision: str, scaling: str,
                        fn: str = "attention") -> bool:
    """`deterministic` of attention / varlen_attention as a bool: TypeError naming it for
    a non-bool; NotImplementedError on CUDA tensors with precision "fp8" and scaling
    "row" (its backward adds the dQ partials with atomics, numerics.md section 9,
    "Deterministic backward"); CPU tensors are deterministic for any value."""
    deterministic = check_bool(deterministic, "deterministic", fn)
    if deterministic and device_type == "cuda" and precision == "fp8" and scaling != "tile":
        raise NotImplementedError(_err(fn, "deterministic", "the CUDA backward of scaling='row' adds its dQ "
                                                            "partials with atomics; scaling='tile' runs "
                                                            "deterministic=True on CUDA (CPU tensors always are)"))
    return deterministic


def check_dropout(fn: str, dropout_p) -> None:
    """dropout_p of the drop-ins (FlashAttention's and PyTorch SDPA's): a probability, so
    a real number in [0, 1] (else ValueError naming it: a string, NaN, -0.1); 0 is the
    only one fp8attn runs (any other valid probability: NotImplementedError)."""
    drop = _real(dropout_p)
    if drop is None:
        raise ValueError(_err(fn, "dropout_p", f"must be a float, got {type(dropout_p).__name__}"))
    if not 0.0 <= drop <= 1.0:  # NaN fails both comparisons
        raise ValueError(_err(fn, "dropout_p", f"is a probability: must be in [0, 1], got "
                                               f"{_shown_real(dropout_p, drop)}"))
    if drop != 0.0:
        raise NotImplementedError(_err(fn, "dropout_p", f"dropout is not supported by fp8attn (got "
                                                        f"{_shown_real(dropout_p, drop)})"))


def _flash_compat(fn: str, causal: bool, *, dropout_p, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs, qv, q_descale, k_descale, v_descale, attention_chunk,
                  num_splits, pack_gqa, sm_margin, block_table=None, fp8_inputs=False,
                  device_type="cpu", softcap_ok=False) -> Tuple[bool, bool, Tuple[int, int]]:
    """Checks the FlashAttention arguments fp8attn has no feature for: their
    defaults (and the values FlashAttention treats the same) pass, anything else
    raises naming the argument. Returns (causal, return_attn_probs, window_size):
    two bools and the window (left, right) to pass to `attention`.
    FlashAttention's window rules (hopper/flash_api.cpp): a negative bound is
    unbounded, causal=True sets the right bound to 0; so (-1, -1) is no window and
    (-1, 0) the causal mask, returned as causal=True with window (-1, -1). Bounds
    that reach every key (FA3 sets them to -1) need no rule here: the op's window
    is exact for any bound (numerics.md section 14). Raises ValueError for a
    malformed value, NotImplementedError for a well-formed unsupported one."""
    def unsupported(arg, value, what):
        raise NotImplementedError(_err(fn, arg, f"{what} is not supported by fp8attn (got {fmt_value(value)})"))

    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

    check_dropout(fn, dropout_p)
    left, right = check_window_size(window_size, fn)
    if isinstance(causal, (bool, np.bool_)):
        causal = bool(causal)
    if causal is True:
        right = 0
    if left < 0 and right == 0 and isinstance(causal, bool):  # a non-bool causal is check_options' TypeError
        causal, right = True, -1
    if softcap_ok and isinstance(softcap, torch.Tensor) and softcap.requires_grad:
        cap = 0.0  # check_softcap's TypeError (float() of it would warn first, and detach it)
    else:
        cap = _real(softcap)
        if cap is None:
            raise ValueError(_err(fn, "softcap", f"must be a float, got {type(softcap).__name__}"))
    if cap != 0 and not softcap_ok:
        unsupported("softcap", cap, "logit softcapping (softcap != 0)")
    # flash_attn_func takes pre-quantized FP8 q, k, v with their descales; given with other
    # dtypes a descale has nothing to apply to (varlen_attention takes no FP8 inputs).
    no_fp8 = ("a descale factor for q, k, v that are not pre-quantized FP8 (descales apply to float8_e4m3fn / "
              "float8_e5m2 q, k, v)" if fn == "flash_attn_func" else "pre-quantized FP8 input")
    descales = () if fp8_inputs else (("q_descale", q_descale, no_fp8), ("k_descale", k_descale, no_fp8),
                                      ("v_descale", v_descale, no_fp8))
    for arg, val, what in (("alibi_slopes", alibi_slopes, "ALiBi"), ("qv", qv, "the qv input"),
                           *descales, ("block_table", block_table, "a paged KV cache")):
        if val is not None:
            unsupported(arg, type(val).__name__, what)
    # deterministic: a bool here; its recipe rule is check_deterministic's, which
    # attention and varlen_attention apply (the CPU reference is bitwise deterministic;
    # on CUDA the `tile` backward orders its dQ adds, varlen_attention then loops).
    check_bool(deterministic, "deterministic", fn, ValueError)
    return_attn_probs = check_bool(return_attn_probs, "return_attn_probs", fn, ValueError)
    if not is_int(attention_chunk) or attention_chunk < 0:
        raise ValueError(_err(fn, "attention_chunk", f"must be an int >= 0, got {fmt_value(attention_chunk)}"))
    if attention_chunk != 0:
        unsupported("attention_chunk", attention_chunk, "chunked attention")
    if not is_int(num_splits) or num_splits < 0:
        raise ValueError(_err(fn, "num_splits", f"must be an int >= 0, got {fmt_value(num_splits)}"))
    check_bool(pack_gqa, "pack_gqa", fn, ValueError, none_ok=True)  # None: FlashAttention's default (its heuristic)
    if not is_int(sm_margin) or sm_margin < 0:
        raise ValueError(_err(fn, "sm_margin", f"must be an int >= 0, got {fmt_value(sm_margin)}"))
    if sm_margin != 0:
        unsupported("sm_margin", sm_margin, "leaving SMs free (sm_margin > 0)")
    return causal, return_attn_probs, (left, right)


def _renamed_errors(fn: str, call):
    """call() with fp8attn.attention's error prefix renamed to `fn`'s."""
    try:
        return call()
    except (TypeError, ValueError, NotImplementedError) as exc:
        msg = str(exc).replace("fp8attn.attention:", f"fp8attn.{fn}:")
        if msg == str(exc):
            raise
        raise type(exc)(msg) from None


def _flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    *,
    dropout_p: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    return_lse: bool = False,
    layer_name: Optional[str] = None,
    scaling: str = "row",
    qk_rotation: str = "none",
    smooth_k: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """`attention` in the flash_attn layout, a drop-in for FlashAttention's
    `flash_attn_func` (FlashAttention-3's positional order: q, k, v, softmax_scale,
    causal).

    q [batch, seqlen_q, num_heads_q, head_dim_qk], k [batch, seqlen_k, num_heads_kv,
    head_dim_qk], v [batch, seqlen_k, num_heads_kv, head_dim_v], any strides.
    Returns O [batch, seqlen_q, num_heads_q, head_dim_v], contiguous (as
    FlashAttention's: `out.view(b, s, h * d)` works), in the dtype `attention`
    gives; with return_lse or return_attn_probs also LSE float32 [batch,
    num_heads_q, seqlen_q] (natural log; FlashAttention-3's `(out, softmax_lse)`).
    Other fp8attn arguments (delta_mode, precision, block_size, grad_format,
    scaling "row" | "tile": numerics.md section 9; qk_rotation and smooth_k: section
    10) as in `attention`.

    Positional order: FlashAttention-3's; a call in FlashAttention-2's order (q, k, v,
    dropout_p, softmax_scale, causal) that can be recognized (six positionals, a
    non-bool 5th, a 4th of 0.0, a positional given again by keyword) raises
    TypeError / ValueError saying so; `flash_attn_func(q, k, v, 0.1)` cannot be told
    apart and means softmax_scale=0.1.

    FlashAttention's own arguments: the defaults are accepted, and so are
    values FlashAttention treats the same. `num_splits` and
    `pack_gqa` are scheduling hints that do not change the result; fp8attn keeps its
    own schedule. window_size=(left, right): FlashAttention's sliding window, as
    `attention`'s window_size (numerics.md section 14: bottom-right aligned, a negative
    bound unbounded, causal=True sets the right bound to 0; so (-1, 0) is the causal
    mask and (-1, -1) none); CPU tensors run any window, CUDA tensors with
    scaling="tile" too, and with scaling="row" raise NotImplementedError naming
    window_size for a window that masks more than causal. Not supported, each raising NotImplementedError
    naming the argument:
    dropout_p != 0, softcap != 0 on CUDA tensors with scaling="row" (CPU tensors and
    CUDA tensors with scaling="tile" run it: `attention`'s softcap), alibi_slopes, qv,
    attention_chunk != 0, sm_margin != 0,
    deterministic=True on CUDA tensors with scaling="row" (scaling="tile" and CPU tensors run it:
    `attention`'s deterministic). A malformed value (wrong type, a window_size that is not a pair
    of ints) raises ValueError.

    Pre-quantized FP8 inputs (FlashAttention-3's FP8 forward): q, k, v float8_e4m3fn (or
    float8_e5m2), with optional q_descale / k_descale / v_descale float32 [batch,
    num_heads_kv] (None = 1; q_descale applies to the query heads of each kv head):
    the op runs on x * descale in FP32 (on CUDA rounded to bfloat16 for the kernels,
    which quantize them again with their own block scales) and O comes back in
    bfloat16. Descale factors without FP8 inputs raise NotImplementedError; a wrong
    descale shape, dtype, device or a non-positive or non-finite value ValueError (the
    value check runs in eager mode only: under torch.compile it cannot be traced, and
    the descale enters as x * descale); q, k, v of different dtypes TypeError. FP8
    inputs ignore torch.autocast (as FlashAttention-3's FP8 forward)."""
    fp8_in = any(isinstance(t, torch.Tensor) and t.dtype in _FP8_INPUT_DTYPES for t in (q, k, v))
    causal, return_attn_probs, window = _flash_compat(
        "flash_attn_func", causal, dropout_p=dropout_p, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs, qv=qv,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
        num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin, fp8_inputs=fp8_in,
        device_type=q.device.type if isinstance(q, torch.Tensor) else "cpu", softcap_ok=True)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(_err("flash_attn_func", name, f"must be a 4-D tensor [batch, seqlen, heads, head_dim], got {shape}"))
    if fp8_in:
        q, k, v = _dequantize_fp8_inputs(q, k, v, q_descale, k_descale, v_descale)
    # NOTE: return_lse checked before the `or` (a falsy non-bool, 0 or "", would pass as False).
    want_lse = check_bool(return_lse, "return_lse", "flash_attn_func") or return_attn_probs
    # NOTE: FP8 inputs ignore autocast (FA3's FP8 forward does): the dequantized
    # float32 x * descale must not be cast again (bf16 rounding; inf under float16).
    with no_autocast(q.device.type) if fp8_in else contextlib.nullcontext():
        res = _renamed_errors("flash_attn_func", lambda: attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=softmax_scale,
            delta_mode=delta_mode, precision=precision, block_size=block_size, grad_format=grad_format,
            return_lse=want_lse, layer_name=layer_name, scaling=scaling, qk_rotation=qk_rotation,
            smooth_k=smooth_k, softcap=softcap, window_size=window, deterministic=bool(deterministic)))
    # The op computes O in the SDPA layout; one copy gives FlashAttention's contiguous
    # [b, s, h, d] (O is 1 / (2 seqlen_k) of the forward's FLOPs in bytes: negligible).
    if fp8_in:   # FlashAttention-3's FP8 forward returns O in bfloat16
        res = (res[0].to(torch.bfloat16), res[1]) if want_lse else res.to(torch.bfloat16)
    if want_lse:
        return res[0].transpose(1, 2).contiguous(), res[1]
    return res.transpose(1, 2).contiguous()


_FP8_INPUT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dequantize_fp8_inputs(q, k, v, q_descale, k_descale, v_descale):
    """FlashAttention-3's pre-quantized FP8 inputs: q, k, v float8 (e4m3fn, or e5m2) in the
    flash_attn layout with optional descale factors float32 [batch, num_heads_kv] (None =
    1; q_descale applies to every query head of a kv head's group); returns the FP32
    tensors x * descale the op runs on (numerics.md section 7: on CUDA rounded to bfloat16
    for the kernels, which re-quantize them with their own block scales)."""
    fn = "flash_attn_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FP8_INPUT_DTYPES or t.dtype != q.dtype:
            # NOTE: one format for all three, as FlashAttention-3 (and every other entry point: q, k, v
            # of one dtype); a mixed e4m3 / e5m2 call is a caller's slip, not a format.
            raise TypeError(_err(fn, name, f"pre-quantized FP8 inputs: q, k and v must all be float8_e4m3fn or "
                                           f"all float8_e5m2, got {q.dtype}, {k.dtype}, {v.dtype}"))
    # The shapes the descale broadcast relies on, checked first (as the op would check
    # them: k and v against q); a batch-1 q times a [batch, num_heads_kv] descale would
    # otherwise broadcast to k's batch silently.
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(_err(fn, name, f"batch size {t.shape[0]} != q's batch size {q.shape[0]}"))
    if v.shape[2] != k.shape[2]:
        raise ValueError(_err(fn, "v", f"num_heads_kv {v.shape[2]} != k's num_heads_kv {k.shape[2]}"))
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(_err(fn, "q", f"num_heads_q {q.shape[2]} must be a multiple of num_heads_kv "
                                       f"{k.shape[2]} (GQA)"))
    b, hkv = k.shape[0], k.shape[2]
    out = []
    for name, t, ds in (("q", q, q_descale), ("k", k, k_descale), ("v", v, v_descale)):
        x = t.to(torch.float32)
        if ds is not None:
            arg = f"{name}_descale"
            if not isinstance(ds, torch.Tensor):
                raise TypeError(_err(fn, arg, f"must be a torch.Tensor or None, got {type(ds).__name__}"))
            if ds.dtype != torch.float32 or tuple(ds.shape) != (b, hkv) or ds.device != t.device:
                raise ValueError(_err(fn, arg, f"expected a float32 tensor of shape [batch, num_heads_kv] = "
                                               f"[{b}, {hkv}] on {t.device}, got {ds.dtype} {tuple(ds.shape)} "
                                               f"on {ds.device}"))
            # NOTE: a value check (one host sync); torch.compile cannot guard on it
            # (data-dependent), so compiled code runs without it: the descale enters as
            # x * descale (a NaN / inf descale gives the NaN / inf the caller put in).
            if not torch.compiler.is_compiling() and (not bool(torch.isfinite(ds).all()) or bool((ds <= 0).any())):
                raise ValueError(_err(fn, arg, "must be finite and > 0"))
            s = ds if t.shape[2] == hkv else ds.repeat_interleave(t.shape[2] // hkv, dim=1)
            x = x * s[:, None, :, None]
        out.append(x)
    return tuple(out)


# FlashAttention-2's positional order, (q, k, v, dropout_p, softmax_scale, causal), and
# FlashAttention-3's, (q, k, v, softmax_scale, causal, qv, ...), differ from the 4th
# argument on; flash_attn_func takes FA3's. The public function binds the call itself so
# that FA2-order calls it can recognize get a clear error instead of a wrong softmax_scale
# or Python's bare TypeError.
_FA2_ORDER = ("fp8attn.flash_attn_func takes FlashAttention-3's positional order (q, k, v, softmax_scale, causal); "
              "FlashAttention-2's is (q, k, v, dropout_p, softmax_scale, causal): pass dropout_p, softmax_scale "
              "and causal by keyword")


def flash_attn_func(q, k, v, *args, **kwargs):
    if len(args) > 2:
        raise TypeError(f"fp8attn.flash_attn_func: {len(args) + 3} positional arguments: " + _FA2_ORDER)
    for name, pos in (("softmax_scale", 0), ("causal", 1)):
        if len(args) > pos and name in kwargs:
            raise TypeError(f"fp8attn.flash_attn_func: argument '{name}' given by position and by keyword: "
                            + _FA2_ORDER)
    if len(args) == 2 and not isinstance(args[1], (bool, np.bool_)) and (args[1] is None or _real(args[1]) is not None):
        raise TypeError(f"fp8attn.flash_attn_func: argument 'causal': got {fmt_value(args[1])} by position: "
                        + _FA2_ORDER)
    if args and _real(args[0]) == 0.0:
        raise ValueError(_err("flash_attn_func", "softmax_scale", "must be > 0, got 0.0 by position: " + _FA2_ORDER))
    try:
        bound = _FLASH_SIG.bind(q, k, v, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"fp8attn.flash_attn_func: {exc} (fp8attn and FlashAttention arguments: "
                        f"{', '.join(_FLASH_SIG.parameters)})") from None
    return _flash_attn_func(*bound.args, **bound.kwargs)


_FLASH_SIG = inspect.signature(_flash_attn_func)
flash_attn_func.__signature__ = _FLASH_SIG
flash_attn_func.__doc__ = _flash_attn_func.__doc__


# What scaled_dot_product_attention passes on to `attention` (its fp8_kwargs).
_SDPA_FP8_KWARGS = frozenset(("delta_mode", "precision", "block_size", "grad_format", "layer_name", "scaling",
                              "qk_rotation", "smooth_k", "softcap", "window_size"))


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    **fp8_kwargs,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on 4-D
    [batch, heads, seqlen, head_dim] inputs, computed by `attention`.

    fp8_kwargs: delta_mode, precision, block_size, grad_format, layer_name,
    scaling ("row" or "tile", numerics.md section 9), qk_rotation ("none" or
    "hadamard"), smooth_k (bool; section 10), softcap (section 12) and
    window_size (FlashAttention's sliding window, section 14), as in `attention`; any other keyword (attention's causal / softmax_scale included:
    here they are is_causal / scale) is a TypeError naming it, and errors name
    the arguments as this function calls them.
    Not supported (NotImplementedError): attn_mask, dropout_p != 0, and
    is_causal with seqlen_q != seqlen_k (PyTorch aligns that mask top-left,
    fp8attn bottom-right; call `attention(causal=True)` for the latter).
    Different head counts need enable_gqa=True, as in PyTorch (ValueError).
    """
    fn = "scaled_dot_product_attention"
    if attn_mask is not None:
        raise NotImplementedError(f"fp8attn.{fn}: argument 'attn_mask': masks other than is_causal are not supported")
    check_dropout(fn, dropout_p)
    if "return_lse" in fp8_kwargs:
        raise TypeError(f"fp8attn.{fn}: argument 'return_lse' is not accepted here; use fp8attn.attention")
    for ours, theirs in (("causal", "is_causal"), ("softmax_scale", "scale")):
        if ours in fp8_kwargs:
            raise TypeError(f"fp8attn.{fn}: argument '{ours}' is fp8attn.attention's name; this drop-in takes "
                            f"PyTorch's '{theirs}'")
    unknown = sorted(set(fp8_kwargs) - _SDPA_FP8_KWARGS)
    if unknown:
        raise TypeError(f"fp8attn.{fn}: unexpected argument '{unknown[0]}'; it takes PyTorch's (query, key, value, "
                        f"attn_mask, dropout_p, is_causal, scale, enable_gqa) and fp8attn's "
                        f"{', '.join(sorted(_SDPA_FP8_KWARGS))}")
    # TypeError as torch's SDPA (a string was taken as True; is_causal="yes" with seqlen_q != seqlen_k
    # was the NotImplementedError below)
    is_causal = check_bool(is_causal, "is_causal", fn)
    enable_gqa = check_bool(enable_gqa, "enable_gqa", fn)
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4 and key.dim() == 4:
        if is_causal and query.shape[2] != key.shape[2]:
            raise NotImplementedError(
                f"fp8attn.{fn}: argument 'is_causal': with seqlen_q != seqlen_k PyTorch's mask is top-left "
                "aligned, fp8attn's bottom-right; use fp8attn.attention(causal=True) for the latter")
        if not enable_gqa and query.shape[1] != key.shape[1]:
            raise ValueError(_err(fn, "enable_gqa", f"query has {query.shape[1]} heads and key {key.shape[1]}: "
                                                    "pass enable_gqa=True for grouped-query attention"))
    try:
        return attention(query, key, value, causal=is_causal, softmax_scale=scale, **fp8_kwargs)
    except (TypeError, ValueError) as exc:
        # Name the arguments as this function calls them (attention's q, k, v).
        msg = str(exc).replace("fp8attn.attention:", f"fp8attn.{fn}:")
        for a, b in (("q", "query"), ("k", "key"), ("v", "value"), ("causal", "is_causal"),
                     ("softmax_scale", "scale")):
            msg = msg.replace(f"argument '{a}'", f"argument '{b}'").replace(f"{a}'s ", f"{b}'s ")
        if msg == str(exc):
            raise
        raise type(exc)(msg) from None
