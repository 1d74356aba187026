"""Packed variable-length batches: `varlen_attention`, like flash_attn_varlen_func.

The sequences of a batch are concatenated along the token dim (no padding) and
described by cumulative sequence lengths `cu_seqlens`. Each sequence attends
within itself only. Math: docs/numerics.md section 1 per sequence (bottom-right
causal mask per sequence); section 7: the FP8 block grid restarts at token 0 of
every sequence.

Implementation: one differentiable `fp8attn.attention` call per sequence on
[1, heads, len, head_dim] views of its slices; autograd flows through
torch.split / torch.cat. Simple and bit-identical to per-sequence calls; a
single-launch varlen kernel is future work.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from .ops import _err, attention, check_inputs, check_options

__all__ = ["varlen_attention"]

_FN = "varlen_attention"


# ---- argument checks ---------------------------------------------------------


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, total_name: str) -> List[int]:
    """Validates one cu_seqlens tensor and returns it as a Python list."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(_err(_FN, name, f"must be a torch.Tensor, got {type(cu).__name__}"))
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(_err(_FN, name, f"dtype must be int32 or int64, got {cu.dtype}"))
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(_err(_FN, name, f"must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}"))
    if cu.device.type == "meta":
        raise ValueError(_err(_FN, name, "is a meta tensor, but its values are read on the host; "
                                         "pass a CPU or CUDA tensor"))
    # NOTE: read on the host (a device sync for CUDA tensors); the per-sequence
    # loop needs the lengths as Python ints anyway.
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(_err(_FN, name, f"must start at 0, got {vals[0]}"))
    for b in range(len(vals) - 1):
        if vals[b + 1] < vals[b]:
            raise ValueError(_err(_FN, name, f"must be non-decreasing, but entry {b + 1} ({vals[b + 1]}) "
                                             f"< entry {b} ({vals[b]})"))
    if vals[-1] > total:
        raise ValueError(_err(_FN, name, f"last entry {vals[-1]} exceeds {total_name} = {total}"))
    return vals


def _check_max_seqlen(name: str, value, lengths: List[int]) -> None:
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(_err(_FN, name, f"must be an int or None, got {type(value).__name__}"))
    real = max(lengths, default=0)
    if value < real:
        raise ValueError(_err(_FN, name, f"is {value}, but the longest sequence has {real} tokens"))


# ---- public function ---------------------------------------------------------


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    return_lse: bool = False,
    layer_name: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over a packed batch of variable-length sequences (flash_attn varlen layout).

    Sequence b holds query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key
    tokens [cu_seqlens_k[b], cu_seqlens_k[b+1]), and attends within itself only:
    the result for b is `attention` on those slices alone (numerics.md section 1;
    with causal, the mask is bottom-right aligned per sequence; the FP8 block grid
    starts at token 0 of every sequence, section 7).

    Args:
        q: [total_q, num_heads_q, head_dim_qk], bfloat16, float32 or float64.
        k: [total_k, num_heads_kv, head_dim_qk]; num_heads_q must be a multiple
            of num_heads_kv (GQA).
        v: [total_k, num_heads_kv, head_dim_v].
        cu_seqlens_q, cu_seqlens_k: int32 or int64, 1-D, both of length
            batch + 1, starting at 0, non-decreasing, last entry <= total_q
            (resp. total_k). Tokens past the last entry are outside every
            sequence: their O rows are 0, their LSE is -inf, their dQ/dK/dV are
            0, and whatever they hold (even NaN) reaches no output or gradient.
            Read on the host (a sync if they live on the GPU).
        max_seqlen_q, max_seqlen_k: optional ints; must be >= the longest
            sequence (ValueError otherwise). Informative only.
        causal, softmax_scale, delta_mode, precision, block_size, grad_format,
        layer_name: as in `fp8attn.attention` (applied to every sequence).
            Zero-length sequences are allowed: a query sequence with no keys
            gives O = 0, LSE = -inf and zero gradients. With diagnostics, each
            non-empty sequence's backward is one record (labelled layer_name).
        return_lse: also return LSE.

    Returns:
        O [total_q, num_heads_q, head_dim_v] in q's dtype; with return_lse also
        LSE float32 [num_heads_q, total_q] (natural log, not differentiable; the
        flash_attn varlen layout).

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype
            (cu_seqlens must be int32/int64), a wrongly typed option.
        ValueError: wrong rank, mismatched shapes/heads/devices, cu_seqlens_q and
            cu_seqlens_k of different lengths (batch), a cu_seqlens that does
            not start at 0, decreases or exceeds the total token count,
            max_seqlen below the real maximum, a bad option value. The message
            names the argument.
    """
    # ---- options and tensors
    op_precision = check_options(causal=causal, softmax_scale=softmax_scale, delta_mode=delta_mode,
                                 precision=precision, block_size=block_size, grad_format=grad_format, fn=_FN)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(_err(_FN, name, f"must be a torch.Tensor, got {type(t).__name__}"))
        if t.dim() != 3:
            raise ValueError(_err(_FN, name, f"must be 3-D [total_tokens, heads, head_dim], got shape {tuple(t.shape)}"))
    if v.shape[0] != k.shape[0]:
        raise ValueError(_err(_FN, "v", f"total_k {v.shape[0]} != k's total_k {k.shape[0]}"))
    # NOTE: the remaining checks (dtype, device, head_dim, GQA heads) are those of
    # `attention`, run on [1, heads, total, head_dim] views.
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    check_inputs(q4, k4, v4, op_precision, fn=_FN)

    # ---- cu_seqlens / max_seqlen
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "total_q")
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "total_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(_err(_FN, "cu_seqlens_k", f"has length {len(cu_k)} (batch {len(cu_k) - 1}), but "
                                                   f"cu_seqlens_q has length {len(cu_q)} (batch {len(cu_q) - 1})"))
    lens_q = [cu_q[b + 1] - cu_q[b] for b in range(len(cu_q) - 1)]
    lens_k = [cu_k[b + 1] - cu_k[b] for b in range(len(cu_k) - 1)]
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)

    # ---- per-sequence attention
    # NOTE: torch.split (one autograd node) rather than per-sequence slicing, so
    # the backward assembles dQ/dK/dV in one cat instead of summing batch
    # full-size zero tensors. The tail (outside every sequence) gets zero grads.
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    tail_q, tail_k = q.shape[0] - cu_q[-1], k.shape[0] - cu_k[-1]
    q_parts = torch.split(q, lens_q + [tail_q], dim=0)
    k_parts = torch.split(k, lens_k + [tail_k], dim=0)
    v_parts = torch.split(v, lens_k + [tail_k], dim=0)
    outs, lses = [], []
    for b in range(len(lens_q)):
        # Zero-length sequences go through `attention` too (its empty path gives
        # O = 0, LSE = -inf, zero grads) so the output always stays in the graph.
        o_b, lse_b = attention(
            q_parts[b].transpose(0, 1).unsqueeze(0), k_parts[b].transpose(0, 1).unsqueeze(0),
            v_parts[b].transpose(0, 1).unsqueeze(0), causal=causal, softmax_scale=scale,
            delta_mode=delta_mode, precision=precision, block_size=block_size,
            grad_format=grad_format, return_lse=True, layer_name=layer_name)
        outs.append(o_b.squeeze(0).transpose(0, 1))  # [len_q, Hq, Dv]
        lses.append(lse_b.squeeze(0))                # [Hq, len_q]
    if not outs:
        # batch == 0: one empty call keeps the output connected to q/k/v.
        o_b, lse_b = attention(q4[:, :, :0], k4[:, :, :0], v4[:, :, :0], softmax_scale=scale,
                               precision=precision, block_size=block_size, return_lse=True)
        outs.append(o_b.squeeze(0).transpose(0, 1))
        lses.append(lse_b.squeeze(0))
    # Tokens outside every sequence: O = 0, LSE = -inf (never computed from q).
    hq, dv = q.shape[1], v.shape[2]
    outs.append(q.new_zeros((tail_q, hq, dv)))
    lses.append(q.new_full((hq, tail_q), float("-inf"), dtype=torch.float32))
    out = torch.cat(outs, dim=0)
    lse = torch.cat(lses, dim=1)
    return (out, lse) if return_lse else out
