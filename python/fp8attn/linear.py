"""FP8 linear layers with DeepSeek-V3-style block scaling (`FP8Linear`, `fp8_linear`).

y = x W^T + b for x [..., K] (in_features K), W [N, K] (out_features N). The
three GEMMs of a linear layer run on block-scaled FP8 operands, each operand
blocked along the GEMM's own reduction dimension (docs/numerics.md section 2,
the 1x128 rule; section 8 for the linear layer):

| GEMM | product | reduce over | operand blocks |
|---|---|---|---|
| forward | y = x W^T | K | x: 1x128 per token along K; W: 128x128 tiles |
| dgrad | dx = dy W | N | dy: 1x128 per token along N; W: the same 128x128 tiles, transposed |
| wgrad | dW = dy^T x | tokens M | dy: 1x128 per output channel along M; x: 1x128 per input channel along M |

128x128 weight tiles are the same blocks whichever way W is read, so the
forward's quantized W (codes and scales) serves dgrad transposed. dy and x are
re-quantized along the token dim for wgrad. x and W are E4M3; dy is
`grad_format` (E4M3 default, E5M2 selectable). Scales are FP32 powers of two:
s = 2^ceil(log2(amax / fp8_max)), exponent clamped to [-126, 127], s = 1 for an
all-zero block, NaN for a block holding NaN or +-inf (section 2), so the
quantizer here gives the same codes and scales as `fp8attn.quantize_blockwise`
(tested bit for bit). A short last block (K not a multiple of 128) is a shorter
block, as in the reference; that equals zero padding to 128.

Quantizers: on CUDA one fused Triton kernel per quantization
(fp8attn/quant_fp8_block128_triton.py; bit-identical to the torch ops used on
CPU; FP8ATTN_FUSED_QUANT=0 or `FUSED_QUANT = False` selects the torch ops; any
FP8ATTN_FUSED_QUANT other than 0, 1 or empty is a ValueError). With
"scaled_mm" the forward quantizes x along K and, when W needs a gradient, x^T
along the tokens from the same read, and saves only the FP8 x^T (and the
weight codes) for backward; backward quantizes dy both ways from one read.

Backends:
  "scaled_mm"  CUDA: cuBLASLt block-scaled GEMMs through
               torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 /
               BlockWise128x128 (sm_90, CUDA >= 12.9). Requires E4M3 for both
               operands (cuBLASLt's DeepSeek recipe; so grad_format "e4m3"), K, N
               and the token count M multiples of 128 (M is zero-padded up to one
               if needed: padded rows add nothing). FP32 accumulation; outputs
               in the autocast dtype (or x's dtype).
  "emulated"   any device: the same quantized operands, dequantized exactly to
               FP32 and multiplied with an FP32 matmul. Numerically the same
               products as "scaled_mm" up to FP32 summation order.
  "auto"       "scaled_mm" where its conditions hold, else "emulated" (the
               reason is warned once per reason).
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Iterable, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _env
from . import quant_fp8_block128_triton as _TQ
from .ops import as_dtype, no_autocast as _no_autocast, single_backward

__all__ = ["FP8Linear", "fp8_linear", "convert_to_fp8_linear", "quantize_1x128", "quantize_128x128",
           "dequantize_1x128", "dequantize_128x128", "scaled_mm_available", "BACKENDS"]

BACKENDS = ("auto", "scaled_mm", "emulated")
_FMT = {"e4m3": (torch.float8_e4m3fn, 448.0, 9), "e5m2": (torch.float8_e5m2, 57344.0, 16)}
# fp8_max = 0.875 * 2^p for both formats (448 = 0.875 * 2^9, 57344 = 0.875 * 2^16).
_BLOCK = 128
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Fused Triton quantizers for CUDA tensors (fp8attn/quant_fp8_block128_triton.py):
# same codes and scales as the torch ops below. None: environment variable
# FP8ATTN_FUSED_QUANT decides at each call (1 / unset: on, 0: off, anything else
# a ValueError naming it); True / False override it (tests, benchmarks).
FUSED_QUANT: Optional[bool] = None


def _fused(t: torch.Tensor) -> bool:
    """True when `t` is quantized by the fused Triton kernels (CUDA, triton present).
    Raises ValueError for a bad FP8ATTN_FUSED_QUANT (also for CPU tensors)."""
    on = _env.flag("FP8ATTN_FUSED_QUANT", True) if FUSED_QUANT is None else FUSED_QUANT
    return on and t.is_cuda and _TQ.available()


def _err(arg: str, msg: str) -> str:
    return f"fp8attn.linear: argument '{arg}': {msg}"


def _fmt(fmt: str, arg: str = "fmt"):
    if not isinstance(fmt, str) or fmt not in _FMT:
        raise ValueError(_err(arg, f"expected \"e4m3\" or \"e5m2\", got {fmt!r}"))
    return _FMT[fmt]


# ----------------------------------------------------------------------------
# Quantizers (numerics.md section 2): torch ops (CPU, and CUDA without triton),
# fused Triton kernels on CUDA (bit-identical; tests/python/test_linear.py)
# ----------------------------------------------------------------------------

def _scale_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP32 power-of-two block scales from FP32 block amax (exact, vectorized).

    With amax = m 2^ea (m in [0.5, 1)) and fp8_max = 0.875 2^p, amax / 2^e <= fp8_max
    iff e >= ea - p + [m > 0.875]; the smallest such e, clamped to [-126, 127].
    """
    _, _, p = _FMT[fmt]
    m, ea = torch.frexp(amax)
    e = (ea - p + (m > 0.875).to(ea.dtype)).clamp(-126, 127)
    # NOTE: 2^e built from its bit pattern: exact for every e in [-126, 127].
    s = ((e + 127).to(torch.int32) << 23).view(torch.float32)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


_NAN_CODE = 0x7F  # S=0 NaN in E4M3 (S.1111.111) and E5M2 (S.11111.11)


def _canonical_nan_codes(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """codes (fp8), s: the block scales, broadcastable to codes: every code of a
    NaN-scale block -> 0x7F.

    NOTE: x / NaN is NaN, but its sign (and so the code 0x7F or 0xFF) depends on
    the hardware's NaN propagation; one fixed code makes the codes the same on every
    device and in the fused kernels. Either way the block decodes to NaN."""
    nanb = torch.isnan(s)
    # NOTE: the CPU shortcut reads a value (a data-dependent branch), which
    # torch.compile(fullgraph=True) cannot trace; compiled code takes the where().
    if codes.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(nanb.any()):
        return codes
    u = codes.view(torch.uint8)
    return torch.where(nanb, torch.full_like(u, _NAN_CODE), u).view(codes.dtype)


def quantize_1x128(x: torch.Tensor, fmt: str = "e4m3") -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 128 consecutive elements along the last dim of a 2-D tensor.

    Args:
        x: [R, C] float32 / bfloat16 / float16 (any strides), CPU or CUDA.
        fmt: "e4m3" or "e5m2".
    Returns:
        (codes, scales): codes [R, C] torch.float8_e4m3fn / float8_e5m2, contiguous;
        scales [R, ceil(C / 128)] float32 (decode: x ~= codes.float() * scale).
        The last block is shorter when C % 128 != 0 (same as zero padding).
        A block holding NaN or +-inf: scale NaN, every code 0x7F (a NaN code).
        CUDA tensors go through one fused Triton kernel (pass x.t() to quantize
        the transpose: the transpose is fused too), with the same codes and scales.
    Raises:
        ValueError: rank != 2, non-float dtype or bad fmt.
    Math: docs/numerics.md section 2 (same codes and scales as
    fp8attn.quantize_blockwise(x, dim=-1, block_size=128, fmt) outside NaN blocks).
    """
    dt, _, _ = _fmt(fmt)
    if x.dim() != 2:
        raise ValueError(_err("x", f"expected a 2-D tensor, got shape {tuple(x.shape)}"))
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(_err("x", f"dtype must be float32, bfloat16 or float16, got {x.dtype}"))
    if _fused(x):
        return _TQ.quantize_1x128(x, fmt)
    return _quantize_1x128_torch(x, fmt)


def _quantize_1x128_torch(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_1x128 with torch ops (no argument checks)."""
    dt, _, _ = _FMT[fmt]
    r, c = x.shape
    nb = -(-c // _BLOCK)
    # NOTE: contiguous first: elementwise ops keep an input's strides, and a
    # transposed input would give column-major codes, which cuBLASLt refuses for A.
    xf = x.float().contiguous()
    if c % _BLOCK:
        xf = F.pad(xf, (0, nb * _BLOCK - c))
    xb = xf.reshape(r, nb, _BLOCK)
    # NOTE: amax propagates NaN; +-inf gives an inf amax; both give a NaN scale.
    amax = xb.abs().amax(dim=-1)
    s = _scale_from_amax(amax, fmt)
    codes = _canonical_nan_codes((xb / s.unsqueeze(-1)).to(dt), s.unsqueeze(-1)).reshape(r, nb * _BLOCK)
    if c % _BLOCK:
        codes = codes[:, :c].contiguous()
    return codes, s


def quantize_128x128(w: torch.Tensor, fmt: str = "e4m3") -> Tuple[torch.Tensor, torch.Tensor]:
    """128x128 tiles of a 2-D tensor (the weight recipe), one FP32 scale per tile.

    Args:
        w: [R, C] float32 / bfloat16 / float16, CPU or CUDA.
        fmt: "e4m3" or "e5m2".
    Returns:
        (codes [R, C] fp8 dtype, scales [ceil(R / 128), ceil(C / 128)] float32).
        Edge tiles are smaller when R or C is not a multiple of 128. A tile holding
        NaN or +-inf: scale NaN, codes 0x7F. CUDA: one fused Triton kernel (same result).
    Raises:
        ValueError: rank != 2, non-float dtype or bad fmt.
    Math: docs/numerics.md section 2 with a 2-D block (section 8).
    """
    dt, _, _ = _fmt(fmt)
    if w.dim() != 2:
        raise ValueError(_err("w", f"expected a 2-D tensor, got shape {tuple(w.shape)}"))
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(_err("w", f"dtype must be float32, bfloat16 or float16, got {w.dtype}"))
    if _fused(w):
        return _TQ.quantize_128x128(w, fmt)
    return _quantize_128x128_torch(w, fmt)


def _quantize_128x128_torch(w: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_128x128 with torch ops (no argument checks)."""
    dt, _, _ = _FMT[fmt]
    r, c = w.shape
    nr, nc = -(-r // _BLOCK), -(-c // _BLOCK)
    wf = w.float().contiguous()
    if r % _BLOCK or c % _BLOCK:
        wf = F.pad(wf, (0, nc * _BLOCK - c, 0, nr * _BLOCK - r))
    wb = wf.reshape(nr, _BLOCK, nc, _BLOCK)
    amax = wb.abs().amax(dim=(1, 3))
    s = _scale_from_amax(amax, fmt)
    sb = s[:, None, :, None]
    codes = _canonical_nan_codes((wb / sb).to(dt), sb).reshape(nr * _BLOCK, nc * _BLOCK)
    if r % _BLOCK or c % _BLOCK:
        codes = codes[:r, :c].contiguous()
    return codes, s


def dequantize_1x128(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 values of `quantize_1x128` output (exact: power-of-two scales)."""
    r, c = codes.shape
    s = scales.repeat_interleave(_BLOCK, dim=1)[:, :c]
    return codes.float() * s


def dequantize_128x128(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 values of `quantize_128x128` output (exact)."""
    r, c = codes.shape
    s = scales.repeat_interleave(_BLOCK, dim=0).repeat_interleave(_BLOCK, dim=1)[:r, :c]
    return codes.float() * s


# ----------------------------------------------------------------------------
# GEMM backends
# ----------------------------------------------------------------------------

def scaled_mm_available() -> bool:
    """True when torch.nn.functional.scaled_mm with DeepSeek block scaling can run here:
    a CUDA device of compute capability 9.0 and a torch built with CUDA >= 12.9."""
    if not torch.cuda.is_available() or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    if torch.cuda.get_device_capability() != (9, 0):
        return False
    cu = torch.version.cuda or "0.0"
    major, minor = (int(v) for v in cu.split(".")[:2])
    return (major, minor) >= (12, 9)


def _l4_major(s: torch.Tensor) -> torch.Tensor:
    """128x128 scales [tiles_outer, tiles_k] -> the cuBLASLt layout [L4, tiles_outer] with
    strides (1, L4), L4 = tiles_k rounded up to 4 (zero padded)."""
    pad = (-s.shape[1]) % 4
    if pad:
        s = F.pad(s, (0, pad))
    return s.contiguous().t()


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """1x128 scales [rows, K/128] -> the same values with strides (1, rows)."""
    return s.t().contiguous().t()


@torch.library.custom_op("fp8attn::blockwise_scaled_mm", mutates_args=())
def _blockwise_scaled_mm(a: torch.Tensor, sa: torch.Tensor, b_codes: torch.Tensor, sb: torch.Tensor,
                         b_tiles: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] FP8 codes with 1x128 scales sa [M, K/128] times B^T, b_codes [Nout, K] FP8
    codes with 128x128 scales sb [Nout/128, K/128] (b_tiles) or 1x128 scales [Nout, K/128]:
    [M, Nout] in out_dtype. On CUDA one cuBLASLt block-scaled GEMM
    (torch.nn.functional.scaled_mm, FP32 accumulation); on other devices the same product
    of the dequantized operands in FP32 (the emulation; exact operands, FP32 sums).

    A custom op so that torch.compile(fullgraph=True) traces FP8Linear: dynamo cannot
    trace torch._scaled_mm_v2 itself (torch 2.11: "Attempted to call function marked as
    skipped", found on the H200 2026-12-03)."""
    if a.is_cuda:
        b_scales, b_kind = ((_l4_major(sb), F.ScalingType.BlockWise128x128) if b_tiles
                            else (_outer_major(sb), F.ScalingType.BlockWise1x128))
        return F.scaled_mm(a, b_codes.t(), _outer_major(sa), F.ScalingType.BlockWise1x128,
                           b_scales, b_kind, output_dtype=out_dtype)
    with _no_autocast(a.device.type):   # FP32 products whatever autocast is on around the op
        bf = dequantize_128x128(b_codes, sb) if b_tiles else dequantize_1x128(b_codes, sb)
        return (dequantize_1x128(a, sa) @ bf.t()).to(out_dtype)


@_blockwise_scaled_mm.register_fake
def _(a, sa, b_codes, sb, b_tiles, out_dtype):
    return a.new_empty((a.shape[0], b_codes.shape[0]), dtype=out_dtype)


def _gemm_1x128_128x128(a: torch.Tensor, sa: torch.Tensor, b_codes: torch.Tensor, sb: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] row-major codes (1x128 scales sa [M, K/128]) times B^T where
    b_codes [Nout, K] row-major codes with 128x128 scales sb [Nout/128, K/128]: [M, Nout]."""
    return _blockwise_scaled_mm(a, sa, b_codes, sb, True, out_dtype)


def _gemm_1x128_1x128(a: torch.Tensor, sa: torch.Tensor, b_codes: torch.Tensor, sb: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] codes (1x128 scales [M, K/128]) times B^T, b_codes [Nout, K] codes (1x128
    scales [Nout, K/128]): [M, Nout]."""
    return _blockwise_scaled_mm(a, sa, b_codes, sb, False, out_dtype)


_WARNED: set = set()


def _scaled_mm_blocker(x2: torch.Tensor, weight: torch.Tensor, grad_format: str) -> Optional[str]:
    """Why the scaled_mm backend cannot run this call (None if it can)."""
    if x2.device.type != "cuda":
        return "inputs are not on CUDA"
    if not scaled_mm_available():
        return "torch.nn.functional.scaled_mm block scaling needs an sm_90 GPU and CUDA >= 12.9"
    n, k = weight.shape
    if k % _BLOCK or n % _BLOCK:
        return f"in_features ({k}) and out_features ({n}) must be multiples of 128"
    if grad_format != "e4m3":
        return "cuBLASLt block scaling takes E4M3 operands only (grad_format 'e5m2')"
    return None


def _resolve_backend(backend: str, x2: torch.Tensor, weight: torch.Tensor, grad_format: str) -> str:
    if backend == "emulated":
        return backend
    why = _scaled_mm_blocker(x2, weight, grad_format)
    if backend == "scaled_mm":
        if why:
            raise ValueError(_err("backend", f"'scaled_mm' cannot run: {why}"))
        return backend
    if why and x2.device.type == "cuda" and why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"fp8attn.linear: using the emulated FP8 GEMM on CUDA: {why}", stacklevel=3)
    return "emulated" if why else "scaled_mm"


def _direct(dt: torch.dtype) -> torch.dtype:
    """Output dtype to ask the 1x128 x 128x128 GEMM for: BF16 and FP32 as asked (both
    measured on the H200), else FP32 (converted afterwards)."""
    return dt if dt in (torch.bfloat16, torch.float32) else torch.float32


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % _BLOCK
    return F.pad(t, (0, 0, 0, pad)) if pad else t


# Operands of the scaled_mm GEMMs: t [M, C] with M zero-padded to mp (a multiple of
# 128, cuBLASLt's rule); scales come back in (or are later copied to) the layout
# cuBLASLt wants. CUDA: fused kernels (no padded copy of t, no separate transpose).

def _q_rows(t: torch.Tensor, fmt: str, mp: int):
    """1x128 blocks along C: (codes [mp, C], scales [mp, C/128])."""
    if _fused(t):
        return _TQ.quantize_1x128(t, fmt, rows_out=mp, outer_major=True)
    return _quantize_1x128_torch(_pad_rows(t), fmt)


def _q_cols(t: torch.Tensor, fmt: str, mp: int):
    """1x128 blocks along the tokens, i.e. of t^T: (codes [C, mp], scales [C, mp/128])."""
    if _fused(t):
        return _TQ.quantize_1x128(t.t(), fmt, cols_out=mp, outer_major=True)
    return _quantize_1x128_torch(_pad_rows(t).t(), fmt)


def _q_rows_cols(t: torch.Tensor, fmt: str, mp: int):
    """_q_rows and _q_cols of t; on CUDA from one read of t (C % 128 == 0)."""
    if _fused(t):
        return _TQ.quantize_1x128_dual(t, fmt, rows_out=mp, outer_major=True)
    return (*_q_rows(t, fmt, mp), *_q_cols(t, fmt, mp))


def _check_tensor_arg(name: str, t, x: Optional[torch.Tensor] = None) -> None:
    """TypeError unless t is a float32 / bfloat16 / float16 tensor; ValueError when x is
    given and t is not on x's device (each naming the argument)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(_err(name, f"must be a torch.Tensor, got {type(t).__name__}"))
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(_err(name, f"dtype must be float32, bfloat16 or float16, got {t.dtype}"))
    if x is not None and t.device != x.device:
        raise ValueError(_err(name, f"must be on x's device {x.device}, got {t.device}"))


def _scaled_mm_backward(dy, gf, m, wq, ws, xtq, xts, need_dx, need_dw, x_dtype):
    """(dx, dw) of the cuBLASLt path (None where not needed) from dy [m, N] and the saved
    weight codes / tiles (wq, ws) and x^T codes / scales (xtq, xts). dgrad reduces over N:
    dy 1x128 along N, W^T codes reuse the forward tiles; wgrad reduces over tokens: dy^T
    and x^T quantized along the tokens (numerics.md section 8)."""
    mp = m + (-m) % _BLOCK
    dx = dw = None
    if need_dx and need_dw:
        gq, gs, gtq, gts = _q_rows_cols(dy, gf, mp)
    elif need_dx:
        gq, gs = _q_rows(dy, gf, mp)
    elif need_dw:
        gtq, gts = _q_cols(dy, gf, mp)
    if need_dx:
        dx = _gemm_1x128_128x128(gq, gs, wq.t().contiguous(), ws.t(), _direct(x_dtype))[:m]
    if need_dw:
        dw = _gemm_1x128_1x128(gtq, gts, xtq, xts, torch.float32)
    return dx, dw


class _FP8LinearFn(torch.autograd.Function):
    """x2 [M, K], weight [N, K], bias [N] or None -> y [M, N] (see module docstring).

    Saved for backward: the forward's weight codes and tile scales (dgrad reuses
    them, transposed) and, with the scaled_mm backend, x^T already quantized along
    the tokens for wgrad (FP8, half the bytes of a BF16 x; only when the weight
    needs a gradient) instead of x itself. The emulated backend saves x."""

    @staticmethod
    def forward(ctx, x2, weight, bias, grad_format, backend, out_dtype, need_wgrad):
        dev = x2.device.type
        m = x2.shape[0]
        xtq = xts = None
        with _no_autocast(dev):
            wq, ws = quantize_128x128(weight, "e4m3")
            if backend == "scaled_mm":
                # NOTE: cuBLASLt wants M % 128 == 0 here; zero rows add nothing.
                mp = m + (-m) % _BLOCK
                if need_wgrad:
                    # wgrad's x^T operand (blocks along tokens) from the same read of x.
                    xq, xs, xtq, xts = _q_rows_cols(x2, "e4m3", mp)
                else:
                    xq, xs = _q_rows(x2, "e4m3", mp)
                # NOTE: without bias cuBLASLt writes BF16 / FP32 directly (no FP32 y pass).
                y = _gemm_1x128_128x128(xq, xs, wq, ws, _direct(out_dtype) if bias is None else torch.float32)[:m]
            else:
                xq, xs = quantize_1x128(x2, "e4m3")
                y = dequantize_1x128(xq, xs) @ dequantize_128x128(wq, ws).t()
            if bias is not None:
                y = y + bias.float()
        if backend == "scaled_mm":
            ctx.save_for_backward(wq, ws, xtq, xts)
        else:
            ctx.save_for_backward(wq, ws, x2)
        ctx.m = m
        ctx.has_bias = bias is not None
        ctx.grad_format, ctx.backend = grad_format, backend
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return as_dtype(y, out_dtype)  # NOTE: not y.to(): ops.as_dtype (torch.compile)

    @staticmethod
    @single_backward("FP8Linear")
    def backward(ctx, dy):
        x_dt, w_dt, b_dt = ctx.dtypes
        gf = ctx.grad_format
        m = ctx.m
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _no_autocast(dy.device.type):
            dx = dw = db = None
            if ctx.backend == "scaled_mm":
                dx, dw = _scaled_mm_backward(dy, gf, m, *ctx.saved_tensors, need_dx, need_dw, x_dt)
            else:
                wq, ws, x2 = ctx.saved_tensors
                if need_dx:
                    gq, gs = quantize_1x128(dy, gf)
                    dx = dequantize_1x128(gq, gs) @ dequantize_128x128(wq, ws)
                if need_dw:
                    gtq, gts = quantize_1x128(dy.t(), gf)
                    xtq, xts = quantize_1x128(x2.t(), "e4m3")
                    dw = dequantize_1x128(gtq, gts) @ dequantize_1x128(xtq, xts).t()
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.sum(0, dtype=torch.float32).to(b_dt)
        return (None if dx is None else dx.to(x_dt), None if dw is None else dw.to(w_dt), db,
                None, None, None, None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               grad_format: str = "e4m3", backend: str = "auto") -> torch.Tensor:
    """y = x W^T + b with block-scaled FP8 GEMMs in forward and both backward GEMMs.

    Args:
        x: [..., K] float32 / bfloat16 / float16 (CPU or CUDA).
        weight: [N, K] float (the FP32 master weight, or BF16).
        bias: [N] or None (added in FP32).
        grad_format: "e4m3" (default) or "e5m2": format of dy in dgrad and wgrad.
        backend: "auto" | "scaled_mm" | "emulated" (module docstring).
    Returns:
        y [..., N]: the autocast dtype when autocast is on for x's device, else x's dtype.
        Gradients: dx in x's dtype, dW in weight's dtype, db in bias's dtype.
    Raises:
        TypeError: x, weight or bias not a tensor, or not float32 / bfloat16 / float16.
        ValueError: bad grad_format / backend, shape mismatch, weight or bias not on
            x's device, backend="scaled_mm" where it cannot run (the message says why).
        RuntimeError: (in backward) a backward with create_graph=True while an input
            requires grad: double backward is not supported.
    Math: docs/numerics.md sections 2 and 8 (module docstring table).
    """
    _fmt(grad_format, "grad_format")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(_err("backend", f"expected one of {BACKENDS}, got {backend!r}"))
    _check_tensor_arg("x", x)
    _check_tensor_arg("weight", weight, x)
    if bias is not None:
        _check_tensor_arg("bias", bias, x)
    if weight.dim() != 2:
        raise ValueError(_err("weight", f"expected [out_features, in_features], got shape {tuple(weight.shape)}"))
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(_err("x", f"last dim {tuple(x.shape)[-1:]} must equal in_features {weight.shape[1]}"))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(_err("bias", f"expected shape ({weight.shape[0]},), got {tuple(bias.shape)}"))
    dev = x.device.type
    # NOTE: is_autocast_enabled raises for meta tensors (no autocast there).
    autocast_on = dev != "meta" and torch.is_autocast_enabled(dev)
    out_dtype = torch.get_autocast_dtype(dev) if autocast_on else x.dtype
    lead = x.shape[:-1]
    # NOTE: the row count is explicit: reshape(-1, 0) is ambiguous for in_features 0.
    x2 = x.reshape(lead.numel(), x.shape[-1])
    if out_dtype != x2.dtype and x2.is_floating_point() and x2.element_size() > torch.empty((), dtype=out_dtype).element_size():
        # NOTE: under autocast nn.Linear computes (and saves for wgrad) its input in the
        # autocast dtype; do the same so the saved activation is BF16, not FP32
        # (half the memory). The extra BF16 rounding is far below the FP8 one.
        x2 = x2.to(out_dtype)
    if x2.numel() == 0 or weight.numel() == 0:
        # No product to quantize (no rows, or in_features / out_features 0): the exact
        # result (zeros, + bias), still connected to x, weight and bias so that every
        # parameter gets a (zero) gradient, as with nn.Linear.
        y = x2.float() @ weight.float().t()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype).reshape(*lead, weight.shape[0])
    be = _resolve_backend(backend, x2, weight, grad_format)
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    y = _FP8LinearFn.apply(x2, weight, bias, grad_format, be, out_dtype, need_wgrad)
    return y.reshape(*lead, weight.shape[0])


class FP8Linear(nn.Linear):
    """Drop-in nn.Linear whose GEMMs (forward, dgrad, wgrad) run in block-scaled FP8.

    Same parameters (weight [out_features, in_features], optional bias) and
    state_dict as nn.Linear; see `fp8_linear` for shapes, dtypes, backends and
    errors. `grad_format` and `backend` are plain attributes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, grad_format: str = "e4m3", backend: str = "auto"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _fmt(grad_format, "grad_format")
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(_err("backend", f"expected one of {BACKENDS}, got {backend!r}"))
        self.grad_format, self.backend = grad_format, backend

    @classmethod
    def from_linear(cls, lin: nn.Linear, *, grad_format: str = "e4m3", backend: str = "auto") -> "FP8Linear":
        """An FP8Linear sharing `lin`'s Parameter objects (no copy, no RNG use)."""
        if not isinstance(lin, nn.Linear):
            raise TypeError(_err("lin", f"must be an nn.Linear, got {type(lin).__name__}"))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        _fmt(grad_format, "grad_format")
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(_err("backend", f"expected one of {BACKENDS}, got {backend!r}"))
        new.grad_format, new.backend = grad_format, backend
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, grad_format=self.grad_format, backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", grad_format={self.grad_format}, backend={self.backend}"


def convert_to_fp8_linear(model: nn.Module, include: Union[str, Iterable[str], Callable[[str], bool]] = "*",
                          exclude: Union[str, Iterable[str], None] = None, *,
                          grad_format: str = "e4m3", backend: str = "auto") -> list:
    """Replaces nn.Linear submodules (not already FP8Linear) by FP8Linear in place.

    Args:
        model: any nn.Module.
        include: glob pattern(s) on the qualified module name (e.g. "blocks.*.attn.w?"),
            or a callable name -> bool.
        exclude: glob pattern(s) of names to leave alone.
        grad_format, backend: passed to every new FP8Linear.
    Returns:
        The sorted list of converted module names (empty if none matched: then a
        UserWarning names the patterns and a few nn.Linear names of the model).
    Raises:
        TypeError: model not an nn.Module, include / exclude of another type.
        ValueError: model itself a matching nn.Linear (use FP8Linear.from_linear),
            bad grad_format / backend.
    The parameters are shared, not copied: optimizer state and weight tying survive;
    a module used under several names is converted under each (one FP8Linear for all).
    Subclasses of nn.Linear that match are left alone with a UserWarning naming them.
    """
    def as_match(p, arg):
        if p is None:
            return lambda n: False
        if callable(p):
            return p
        pats = [p] if isinstance(p, str) else (list(p) if isinstance(p, (list, tuple, set, frozenset)) else None)
        if pats is None or not all(isinstance(q, str) for q in pats):
            raise TypeError(_err(arg, f"expected a glob pattern, a list of them or a callable, got {p!r}"))
        return lambda n: any(fnmatch.fnmatchcase(n, q) for q in pats)

    if not isinstance(model, nn.Module):
        raise TypeError(_err("model", f"must be an nn.Module, got {type(model).__name__}"))
    _fmt(grad_format, "grad_format")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(_err("backend", f"expected one of {BACKENDS}, got {backend!r}"))
    inc, exc = as_match(include, "include"), as_match(exclude, "exclude")
    # NOTE: remove_duplicate=False: a module used in several places (nn.Sequential(s, s),
    # a shared projection) is converted at every name; all of them get the same
    # FP8Linear (below), so the sharing survives too.
    targets = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
               if type(m) is nn.Linear and inc(n) and not exc(n)]
    # NOTE: subclasses of nn.Linear (e.g. nn.MultiheadAttention's out_proj, whose
    # weight the parent reads directly) may not route through forward(): they are
    # left alone, but said so rather than skipped silently.
    skipped = sorted(n for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and type(m) is not nn.Linear
                     and not isinstance(m, FP8Linear) and inc(n) and not exc(n))
    if skipped:
        warnings.warn(f"fp8attn.linear.convert_to_fp8_linear: left {len(skipped)} nn.Linear subclass module(s) "
                      f"unconverted (their parent may bypass forward()): {skipped[:8]}", stacklevel=2)
    if any(n == "" for n, _ in targets):
        # NOTE: a module cannot replace itself in place (setattr(model, "", ...) would
        # add a stray child and leave the model an nn.Linear).
        raise ValueError(_err("model", "is itself an nn.Linear and cannot be converted in place; "
                                       "use FP8Linear.from_linear(model)"))
    if not targets and include is not None and not callable(include):
        # NOTE: the patterns match the whole qualified name (fnmatch): "layers.*" does not match
        # an HF model's "model.layers.0.mlp.up_proj". Converting nothing is never what was asked.
        some = [n for n, m in model.named_modules() if type(m) is nn.Linear][:4]
        done = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and inc(n) and not exc(n)]
        if done and not some:  # a second call on a converted model: say so, not "check your patterns"
            warnings.warn(f"fp8attn.linear.convert_to_fp8_linear: include={include!r} (exclude={exclude!r}) "
                          f"matched {len(done)} module(s) that are FP8Linear already (e.g. {done[:4]}) and no "
                          f"nn.Linear: nothing left to convert", stacklevel=2)
        else:
            warnings.warn(f"fp8attn.linear.convert_to_fp8_linear: include={include!r} (exclude={exclude!r}) "
                          f"matched no nn.Linear module, so nothing was converted; patterns match the whole "
                          f"qualified name (e.g. '*.mlp.*'); some nn.Linear names here: {some}", stacklevel=2)
    new = {}
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(lin) not in new:
            new[id(lin)] = FP8Linear.from_linear(lin, grad_format=grad_format, backend=backend)
        setattr(parent, child, new[id(lin)])
    return sorted(n for n, _ in targets)


# ----------------------------------------------------------------------------
# Fused projections sharing one input (the attention's Wq, Wk, Wv):
# x quantized once, one GEMM per pass against the concatenated weights
# ----------------------------------------------------------------------------

__all__ += ["fp8_linear_fused"]

_FUSED_ARGS = 7   # non-tensor-list arguments of _FP8FusedLinearFn.forward before *params


class _FP8FusedLinearFn(torch.autograd.Function):
    """x2 [M, K], weights W_i [N_i, K] (i < n), biases b_i [N_i] or None -> y [M, sum N_i],
    y[:, part i] = x W_i^T + b_i (docs/numerics.md section 8, fused projections).

    Forward: x quantized once (1x128 along K; with the scaled_mm backend also x^T along
    the tokens for wgrad, from the same read); each W_i quantized in its own 128x128 tiles
    (the tiles of FP8Linear(W_i); N_i % 128 == 0 on scaled_mm, so the concatenated codes
    and scales are the tiles of [W_0; W_1; ...]); one GEMM. Backward: dy of all parts
    (one [M, sum N_i] tensor) quantized once along N (dgrad) and along the tokens (wgrad):
    dx = one GEMM, dW = one GEMM whose row blocks are the dW_i. Saved: the weight codes
    and scales and x^T's FP8 codes once (scaled_mm) or x (emulated)."""

    @staticmethod
    def forward(ctx, x2, grad_format, backend, out_dtype, need_wgrad, n_parts, has_bias, *params):
        weights, biases = params[:n_parts], params[n_parts:]
        ns = [w.shape[0] for w in weights]
        dev = x2.device.type
        m = x2.shape[0]
        xtq = xts = None
        with _no_autocast(dev):
            q = [quantize_128x128(w, "e4m3") for w in weights]
            wq = torch.cat([c for c, _ in q], 0)
            if backend == "scaled_mm":
                # NOTE: every N_i % 128 == 0 (_scaled_mm_blocker): the per-weight tiles
                # are the tiles of the concatenation, so their scales stack too.
                ws = torch.cat([s for _, s in q], 0)
                mp = m + (-m) % _BLOCK
                if need_wgrad:
                    xq, xs, xtq, xts = _q_rows_cols(x2, "e4m3", mp)
                else:
                    xq, xs = _q_rows(x2, "e4m3", mp)
                y = _gemm_1x128_128x128(xq, xs, wq, ws, _direct(out_dtype) if not has_bias else torch.float32)[:m]
            else:
                # NOTE: any N_i: each weight dequantized with its own (edge) tiles.
                ws = torch.cat([dequantize_128x128(c, s) for c, s in q], 0)   # FP32 W_i values
                xq, xs = quantize_1x128(x2, "e4m3")
                y = dequantize_1x128(xq, xs) @ ws.t()
            if has_bias:
                y = y + torch.cat([torch.zeros(n, dtype=torch.float32, device=x2.device) if b is None
                                   else b.float() for b, n in zip(biases, ns)])
        if backend == "scaled_mm":
            ctx.save_for_backward(wq, ws, xtq, xts)
        else:
            ctx.save_for_backward(ws, x2)
        ctx.m, ctx.ns = m, ns
        ctx.grad_format, ctx.backend = grad_format, backend
        ctx.x_dtype = x2.dtype
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.b_dtypes = [None if b is None else b.dtype for b in biases]
        return as_dtype(y, out_dtype)  # NOTE: not y.to(): ops.as_dtype (torch.compile)

    @staticmethod
    @single_backward("fp8_linear_fused")
    def backward(ctx, dy):
        gf, m, ns = ctx.grad_format, ctx.m, ctx.ns
        n = len(ns)
        need = ctx.needs_input_grad
        need_dx = need[0]
        need_w = need[_FUSED_ARGS:_FUSED_ARGS + n]
        need_dw = any(need_w)
        dx = dw = None
        with _no_autocast(dy.device.type):
            if ctx.backend == "scaled_mm":
                # NOTE: every N_i % 128 == 0: the 1x128 blocks of dy along N never straddle
                # two parts, so these are the codes and scales of each dy_i on its own; dx is
                # one GEMM over all sum N_i (the products summed in FP32, rounded once).
                dx, dw = _scaled_mm_backward(dy, gf, m, *ctx.saved_tensors, need_dx, need_dw, ctx.x_dtype)
            else:
                wd, x2 = ctx.saved_tensors
                if need_dx:
                    # dy_i quantized on its own (1x128 along N_i), as FP8Linear(W_i) does
                    gd = torch.cat([dequantize_1x128(*quantize_1x128(g, gf)) for g in dy.split(ns, 1)], 1)
                    dx = gd @ wd
                if need_dw:
                    # blocks along the tokens: per output channel, so dy^T of all parts at once
                    gtq, gts = quantize_1x128(dy.t(), gf)
                    xtq, xts = quantize_1x128(x2.t(), "e4m3")
                    dw = dequantize_1x128(gtq, gts) @ dequantize_1x128(xtq, xts).t()
            dws = [None] * n if dw is None else [
                d.to(dt) if nd else None for d, dt, nd in zip(dw.split(ns, 0), ctx.w_dtypes, need_w)]
            dbs = [None if (bt is None or not nd) else g.sum(0, dtype=torch.float32).to(bt)
                   for g, bt, nd in zip(dy.split(ns, 1), ctx.b_dtypes, need[_FUSED_ARGS + n:])]
        return (None if dx is None else dx.to(ctx.x_dtype),) + (None,) * (_FUSED_ARGS - 1) + tuple(dws) + tuple(dbs)


def fp8_linear_fused(x: torch.Tensor, weights, biases=None, *, grad_format: str = "e4m3",
                     backend: str = "auto") -> tuple:
    """(x W_0^T + b_0, x W_1^T + b_1, ...) for several weights on the same input (the
    attention's Wq, Wk, Wv): `fp8_linear(x, W_i, b_i)` for every i, fused.

    x is quantized once and each pass is one block-scaled GEMM against the concatenated
    weights [W_0; W_1; ...] (N = sum N_i): forward y = x [W_0; W_1; ...]^T split into the
    parts; backward one quantization of the concatenated dy, dx = one GEMM (the parts'
    products summed in FP32, rounded once), dW = one GEMM split back into the dW_i.
    Same quantized operands as the separate calls (x, every W_i's tiles, dy_i along N_i
    and along the tokens), so y and every dW_i are the separate results up to FP32
    summation order; dx differs only in that rounding (docs/numerics.md section 8).
    The weights stay separate tensors (parameters and state_dicts unchanged); each step
    concatenates their FP8 codes (scaled_mm) or dequantized values (emulated).

    Args:
        x: [..., K] float32 / bfloat16 / float16 (CPU or CUDA).
        weights: a non-empty list / tuple of [N_i, K] float tensors.
        biases: None, or a list of the same length of [N_i] tensors or None.
        grad_format, backend: as `fp8_linear`; "auto" / "scaled_mm" need every N_i, K and
            the format to meet the scaled_mm rules (else emulated / ValueError).
    Returns:
        A tuple of y_i [..., N_i] (views into one [..., sum N_i] output, so autograd
        refuses in-place changes to them: y_i.clone() first, or use the results out of
        place as the trainer does), dtypes as `fp8_linear`. Gradients: dx in x's dtype, dW_i / db_i in W_i's / b_i's dtype.
    Raises:
        TypeError / ValueError: as `fp8_linear` (naming weights[i] / biases[i]), weights
            not a non-empty list or tuple, biases of another length, in_features differing.
        RuntimeError: (in backward) double backward, as `fp8_linear`.
    """
    _fmt(grad_format, "grad_format")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(_err("backend", f"expected one of {BACKENDS}, got {backend!r}"))
    if not isinstance(weights, (list, tuple)) or not weights:
        got = (f"a tensor of shape {tuple(weights.shape)} (wrap it in a list)" if isinstance(weights, torch.Tensor)
               else repr(weights) if isinstance(weights, (list, tuple)) else type(weights).__name__)
        raise TypeError(_err("weights", f"expected a non-empty list or tuple of tensors, got {got}"))
    weights = list(weights)
    if biases is None:
        biases = [None] * len(weights)
    elif not isinstance(biases, (list, tuple)) or len(biases) != len(weights):
        raise ValueError(_err("biases", f"expected None or a list of {len(weights)} tensors / None"))
    biases = list(biases)
    _check_tensor_arg("x", x)
    for kind, ts in (("weights", weights), ("biases", biases)):
        for i, t in enumerate(ts):
            if not (t is None and kind == "biases"):
                _check_tensor_arg(f"{kind}[{i}]", t, x)
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2:
            raise ValueError(_err(f"weights[{i}]", f"expected [out_features, in_features], got shape {tuple(w.shape)}"))
        if w.shape[1] != weights[0].shape[1]:
            raise ValueError(_err(f"weights[{i}]", f"in_features {w.shape[1]} differs from weights[0]'s "
                                                  f"{weights[0].shape[1]}"))
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(_err(f"biases[{i}]", f"expected shape ({w.shape[0]},), got {tuple(b.shape)}"))
    if x.dim() < 1 or x.shape[-1] != weights[0].shape[1]:
        raise ValueError(_err("x", f"last dim {tuple(x.shape)[-1:]} must equal in_features {weights[0].shape[1]}"))
    dev = x.device.type
    autocast_on = dev != "meta" and torch.is_autocast_enabled(dev)
    out_dtype = torch.get_autocast_dtype(dev) if autocast_on else x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])
    if x2.numel() == 0 or any(w.numel() == 0 for w in weights) or dev == "meta":
        # nothing to fuse (empty products; meta tensors): the separate calls' exact results
        return tuple(fp8_linear(x, w, b, grad_format=grad_format, backend=backend)
                     for w, b in zip(weights, biases))
    if out_dtype != x2.dtype and x2.element_size() > torch.empty((), dtype=out_dtype).element_size():
        x2 = x2.to(out_dtype)   # as fp8_linear: the autocast dtype's activation is saved
    bes = {_resolve_backend(backend, x2, w, grad_format) for w in weights}
    be = "scaled_mm" if bes == {"scaled_mm"} else "emulated"
    need_wgrad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
    has_bias = any(b is not None for b in biases)
    ns = [w.shape[0] for w in weights]
    y = _FP8FusedLinearFn.apply(x2, grad_format, be, out_dtype, need_wgrad, len(weights), has_bias,
                                *weights, *(biases if has_bias else []))
    return tuple(y.reshape(*lead, sum(ns)).split(ns, dim=-1))
