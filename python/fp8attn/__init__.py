"""fp8attn: block-scaled FP8 attention with Delta-Matching backward.

Public API:
    attention(q, k, v, *, causal, softmax_scale, delta_mode, precision, block_size,
              grad_format, return_lse, layer_name, scaling, qk_rotation, smooth_k,
              window_size, softcap, deterministic)        SDPA layout [B, H, S, D]
    flash_attn_func(q, k, v, softmax_scale, causal, *, ...)   flash layout [B, S, H, D]
    scaled_dot_product_attention(query, key, value, ...)  drop-in for F.sdpa
    FP8Attention                                          nn.Module
    varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)  packed [total, H, D]
    diagnostics.record()                                  backward diagnostics context
    fp8_encode, fp8_decode, quantize_blockwise, dequantize_blockwise,
    quantize_tilescale                                    (fp8attn.quant)
Math contract: docs/numerics.md.
"""
from . import _lib  # noqa: F401  (registers torch.ops.fp8attn)
from . import diagnostics
from .modules import FP8Attention
from .ops import (
    BLOCK_SIZES,
    DELTA_MODES,
    GRAD_FORMATS,
    PRECISIONS,
    attention,
    flash_attn_func,
    scaled_dot_product_attention,
)
from .varlen import varlen_attention  # noqa: F401  (packed variable-length batches)

# NOTE: importing quant also registers the fake kernels and autograd guards of the quantization ops.
from .quant import dequantize_blockwise, fp8_decode, fp8_encode, quantize_blockwise, quantize_tilescale

__version__ = "0.1.0"

__all__ = [
    "attention",
    "flash_attn_func",
    "scaled_dot_product_attention",
    "varlen_attention",
    "FP8Attention",
    "diagnostics",
    "DELTA_MODES",
    "PRECISIONS",
    "GRAD_FORMATS",
    "BLOCK_SIZES",
    "fp8_encode",
    "fp8_decode",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_tilescale",
]
