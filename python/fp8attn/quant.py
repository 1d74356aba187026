"""FP8 codecs and block-scaled quantization (math: docs/numerics.md section 2).

Thin wrappers over the ``torch.ops.fp8attn`` quantization ops (CPU kernels in
csrc/torch/ops_quant.cpp), plus their fake (meta) kernels for torch.compile.

Formats (``fmt``): ``"e4m3"`` (the "fn" variant: max 448, no infinities, NaN =
S.1111.111) and ``"e5m2"`` (max 57344, has +-inf). Encoding rounds to nearest
even, keeps subnormals, saturates finite values beyond the max to +-max, keeps
NaN as NaN and maps +-inf to NaN (E4M3) or +-inf (E5M2).

Block scaling: ``x`` is cut into blocks of ``block_size`` consecutive elements
along ``dim``; each block gets the power-of-two scale
``s = 2^ceil(log2(amax / fp8_max))`` (``s = 1`` for an all-zero block, exponent
clamped to [-126, 127]), codes are ``fp8(x / s)`` and the decoded value is
``fp8_decode(code) * s`` (exact). A block holding NaN or +-inf gets a NaN scale
and NaN codes; other blocks are unaffected. If the axis length is not a multiple
of ``block_size`` the last block is shorter (so ``block_size=128`` on a 64-long
axis is numerics.md's ``B = d`` rule).

Every function raises ``ValueError`` naming the argument for a bad dtype, rank,
``dim``, ``block_size``, ``fmt`` or scales shape. Inputs of any strides are
accepted; outputs are contiguous. All four ops have CPU kernels; in a CUDA
build ``quantize_blockwise`` also has a CUDA kernel (bfloat16, rank 4, dim 2 or
3, block_size 128: see csrc/torch/ops_cuda.cpp).
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import _lib  # noqa: F401  (registers torch.ops.fp8attn)
from .ops import check_bool

__all__ = ["FP8_FORMATS", "FP8_MAX", "fp8_encode", "fp8_decode", "quantize_blockwise", "dequantize_blockwise",
           "quantize_tilescale"]

#: Accepted ``fmt`` strings.
FP8_FORMATS = ("e4m3", "e5m2")
#: Largest finite value of each format.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_BLOCK_SIZES = (32, 64, 128)
_FLOAT_IN = (torch.float32, torch.bfloat16, torch.float16)


def fp8_encode(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Encodes a float tensor to FP8 codes (no scaling).

    Args:
        x: float32 tensor of any shape (bfloat16 / float16 are upcast exactly;
            float64 is refused because its cast would round twice).
        fmt: ``"e4m3"`` or ``"e5m2"``.
    Returns:
        uint8 tensor of the shape of ``x``: the FP8 bit patterns (sign in bit 7).
    Raises:
        ValueError: bad dtype, device or ``fmt``.
    """
    _check_args("fp8_encode", x=x, fmt=fmt)
    return torch.ops.fp8attn.fp8_encode(x, fmt)


def fp8_decode(codes: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Decodes FP8 codes to float32 (exact; NaN codes give NaN, E5M2 inf codes +-inf).

    Args:
        codes: uint8 tensor of any shape.
        fmt: ``"e4m3"`` or ``"e5m2"``.
    Returns:
        float32 tensor of the shape of ``codes``.
    Raises:
        ValueError: bad dtype, device or ``fmt``.
    """
    _check_args("fp8_decode", codes=codes, fmt=fmt)
    return torch.ops.fp8attn.fp8_decode(codes, fmt)


def quantize_blockwise(
    x: torch.Tensor, dim: int = -1, block_size: int = 128, fmt: str = "e4m3"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 quantization of ``x`` along ``dim`` (numerics.md section 2).

    Args:
        x: float32 tensor (bfloat16 / float16 upcast exactly) of rank 2 or 4.
        dim: the blocked axis (the matmul's reduction dimension), negative
            values count from the end.
        block_size: B in {32, 64, 128}.
        fmt: ``"e4m3"`` or ``"e5m2"``.
    Returns:
        ``(codes, scales)``: ``codes`` uint8 of the shape of ``x``; ``scales``
        float32 of the shape of ``x`` with ``shape[dim]`` replaced by
        ``ceil(shape[dim] / block_size)``. Element ``i`` along ``dim`` uses
        ``scales[..., i // block_size, ...]``.
    Raises:
        ValueError: bad dtype, device, rank, ``dim``, ``block_size`` or ``fmt``.
    """
    _check_args("quantize_blockwise", x=x, dim=dim, block_size=block_size, fmt=fmt)
    return torch.ops.fp8attn.quantize_blockwise(x, dim, block_size, fmt)


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, dim: int = -1, block_size: int = 128, fmt: str = "e4m3"
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``fp8_decode(codes) * scale`` per block.

    Args:
        codes: uint8 tensor of rank 2 or 4.
        scales: float32 tensor, the shape of ``codes`` with ``shape[dim]``
            replaced by ``ceil(shape[dim] / block_size)``.
        dim, block_size, fmt: as given to :func:`quantize_blockwise`.
    Returns:
        float32 tensor of the shape of ``codes`` (NaN for a block with a NaN scale).
    Raises:
        ValueError: bad dtype, device, rank, ``dim``, ``block_size``, ``fmt`` or
            scales shape.
    """
    _check_args("dequantize_blockwise", codes=codes, scales=scales, dim=dim, block_size=block_size, fmt=fmt)
    return torch.ops.fp8attn.dequantize_blockwise(codes, scales, dim, block_size, fmt)


def quantize_tilescale(
    x: torch.Tensor, dim: int = -1, block_size: int = 128, fmt: str = "e4m3", transposed: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization of an attention operand in the ``tile`` recipe's blockings
    (numerics.md section 9; scale rule and rounding of section 2).

    Args:
        x: [batch, heads, seqlen, head_dim] float32 (bfloat16 / float16 upcast
            exactly) on CPU; bfloat16 with head_dim in {64, 128, 192, 256} on CUDA
            (the ``tile`` quantization kernel).
        dim: ``-1`` / ``3``: one block per token over all of head_dim (Q and dO
            for S and dP); ``-2`` / ``2``: one block per ``block_size`` tokens
            (from token 0, the last one shorter) over all of head_dim (K, V; Q
            and dO of the column products).
        block_size: tokens per tile for ``dim=-2``: 32, 64 or 128 (128 only on CUDA).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        transposed: CUDA only, ``dim=-2``: return the kernel's sequence-contiguous
            copy of the codes (as a transposed view of x's shape); same values.
            Ignored on CPU.
    Returns:
        ``(codes, scales)``: ``codes`` uint8 of x's shape; ``scales`` float32
        ``[batch, heads, seqlen]`` (``dim=-1``) or ``[batch, heads,
        ceil(seqlen / block_size)]`` (``dim=-2``). A block holding NaN or inf
        gets a NaN scale and NaN codes. CPU and CUDA give identical bits.
    Raises:
        ValueError: bad rank, ``dim``, ``block_size``, ``fmt``, device or head_dim.
        TypeError: a non-tensor ``x`` or a wrongly typed argument.
    """
    _check_args("quantize_tilescale", x=x, dim=dim, block_size=block_size, fmt=fmt)
    transposed = check_bool(transposed, "transposed", "quantize_tilescale")
    return torch.ops.fp8attn.quantize_tilescale(x, dim, block_size, fmt, transposed)


def _check_args(fn: str, **args) -> None:
    """Python types of the public quantization functions' arguments (TypeError naming
    the argument; without it torch's op binder raises RuntimeError, or NotImplementedError
    when no argument is a tensor), and one device for codes and scales."""
    for name, val in args.items():
        if name in ("x", "codes", "scales"):
            if not isinstance(val, torch.Tensor):
                raise TypeError(f"fp8attn.{fn}: argument '{name}': must be a torch.Tensor, got {type(val).__name__}")
        elif name == "fmt":
            if not isinstance(val, str):
                raise TypeError(f"fp8attn.{fn}: argument 'fmt': must be a str (\"e4m3\" or \"e5m2\"), got "
                                f"{type(val).__name__}")
        elif isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"fp8attn.{fn}: argument '{name}': must be an int, got {type(val).__name__}")
        elif not -2**63 <= val < 2**63:  # the op schema's int is int64 (its binder's error named no argument)
            raise ValueError(f"fp8attn.{fn}: argument '{name}': out of range (the ops take 64-bit ints; "
                             f"{'dim is an axis of x' if name == 'dim' else 'block_size is 32, 64 or 128'}), "
                             f"got an int of {val.bit_length()} bits")
    if "scales" in args and args["scales"].device != args["codes"].device:
        raise ValueError(f"fp8attn.{fn}: argument 'scales': must be on codes' device {args['codes'].device}, "
                         f"got {args['scales'].device}")


# ---- fake (meta) kernels: shapes and dtypes only, same argument checks ------


def _check_fmt(fmt: str) -> None:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8attn: argument 'fmt': expected \"e4m3\" or \"e5m2\", got {fmt!r}")


def _check_blocking(t: torch.Tensor, name: str, dim: int, block_size: int) -> int:
    rank = t.dim()
    if rank not in (2, 4):
        raise ValueError(f"fp8attn: argument '{name}': expected a rank-2 or rank-4 tensor, got rank {rank}")
    if not -rank <= dim < rank:
        raise ValueError(f"fp8attn: argument 'dim': expected a value in [{-rank}, {rank - 1}], got {dim}")
    if block_size not in _BLOCK_SIZES:
        raise ValueError(f"fp8attn: argument 'block_size': expected 32, 64 or 128, got {block_size}")
    return dim % rank


def _scales_shape(t: torch.Tensor, dim: int, block_size: int) -> list:
    shape = list(t.shape)
    shape[dim] = (shape[dim] + block_size - 1) // block_size
    return shape


@torch.library.register_fake("fp8attn::fp8_encode")
def _fp8_encode_fake(x, fmt):
    _check_fmt(fmt)
    if x.dtype not in _FLOAT_IN:
        raise ValueError(f"fp8attn: argument 'x': expected dtype float32 (or bfloat16 / float16), got {x.dtype}")
    return x.new_empty(x.shape, dtype=torch.uint8)


@torch.library.register_fake("fp8attn::fp8_decode")
def _fp8_decode_fake(codes, fmt):
    _check_fmt(fmt)
    if codes.dtype != torch.uint8:
        raise ValueError(f"fp8attn: argument 'codes': expected dtype uint8, got {codes.dtype}")
    return codes.new_empty(codes.shape, dtype=torch.float32)


@torch.library.register_fake("fp8attn::quantize_blockwise")
def _quantize_blockwise_fake(x, dim, block_size, fmt):
    _check_fmt(fmt)
    if x.dtype not in _FLOAT_IN:
        raise ValueError(f"fp8attn: argument 'x': expected dtype float32 (or bfloat16 / float16), got {x.dtype}")
    d = _check_blocking(x, "x", dim, block_size)
    return (
        x.new_empty(x.shape, dtype=torch.uint8),
        x.new_empty(_scales_shape(x, d, block_size), dtype=torch.float32),
    )


@torch.library.register_fake("fp8attn::dequantize_blockwise")
def _dequantize_blockwise_fake(codes, scales, dim, block_size, fmt):
    _check_fmt(fmt)
    if codes.dtype != torch.uint8:
        raise ValueError(f"fp8attn: argument 'codes': expected dtype uint8, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"fp8attn: argument 'scales': expected dtype float32, got {scales.dtype}")
    d = _check_blocking(codes, "codes", dim, block_size)
    want = _scales_shape(codes, d, block_size)
    if list(scales.shape) != want:
        raise ValueError(f"fp8attn: argument 'scales': expected shape {want}, got {list(scales.shape)}")
    return codes.new_empty(codes.shape, dtype=torch.float32)


@torch.library.register_fake("fp8attn::quantize_tilescale")
def _quantize_tilescale_fake(x, dim, block_size, fmt, transposed=False):
    _check_fmt(fmt)
    if x.dtype not in _FLOAT_IN:
        raise ValueError(f"fp8attn: argument 'x': expected dtype float32 (or bfloat16 / float16), got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"fp8attn: argument 'x': quantize_tilescale takes a rank-4 tensor, got rank {x.dim()}")
    if dim not in (2, 3, -1, -2):
        raise ValueError(f"fp8attn: argument 'dim': quantize_tilescale blocks dim 2 or 3 (or -2, -1), got {dim}")
    if block_size not in _BLOCK_SIZES:
        raise ValueError(f"fp8attn: argument 'block_size': expected 32, 64 or 128, got {block_size}")
    B, H, S, _ = x.shape
    rows = S if dim % 4 == 3 else (S + block_size - 1) // block_size
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((B, H, rows), dtype=torch.float32)


@torch.library.register_fake("fp8attn::quantize_tilescale_fwd")
def _quantize_tilescale_fwd_fake(q, k, v, fmt):
    # The `tile` forward's Q (per token), K and V (per 128-token tile) codes and scales.
    outs = []
    for x, dim in ((q, 3), (k, 2), (v, 2)):
        outs.extend(_quantize_tilescale_fake(x, dim, 128, fmt))
    return tuple(outs)


# NOTE: FP8 rounding has zero derivative almost everywhere. Rather than let
# outputs look differentiable and silently produce no gradient, backward through
# these ops raises; write a straight-through estimator explicitly if you want one.
def _not_differentiable(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"fp8attn.{name} is not differentiable (FP8 rounding has zero gradient almost "
            "everywhere); detach its input or write a straight-through estimator explicitly"
        )
    return backward


def _no_context(ctx, inputs, output):
    pass


for _name in ("fp8_encode", "quantize_blockwise", "dequantize_blockwise", "quantize_tilescale"):
    torch.library.register_autograd(f"fp8attn::{_name}", _not_differentiable(_name), setup_context=_no_context)
