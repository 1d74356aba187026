"""Packed variable-length batches: `varlen_attention`, like flash_attn_varlen_func.

The sequences of a batch are concatenated along the token dim (no padding) and
described by cumulative sequence lengths `cu_seqlens`. Each sequence attends
within itself only. Math: docs/numerics.md section 1 per sequence (bottom-right
causal mask per sequence); section 7: the FP8 block grid restarts at token 0 of
every sequence.

Implementation: two custom ops, opaque to torch.compile, so that
`torch.compile(fullgraph=True)` traces varlen_attention without a graph break:

  fp8attn::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, precision, block_size, delta_mode,
      grad_format, layer_name, scaling="row", qk_rotation="none", smooth_k=False,
      seqused_q=None, seqused_k=None, softcap=0.0, window_left=-1, window_right=-1,
      check=True)
                                -> (out [total_q, Hq, Dv] q.dtype,
                                   lse float32 [Hq, total_q],
                                   lse_t float32 [Hq, total_q] with smooth_k
                                   (LSE' of the smoothed logits), else [0])
  fp8attn::varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
      softmax_scale, causal, precision, delta_mode, block_size, grad_format,
      diagnostics, scaling="row", qk_rotation="none", smooth_k=False, ..., lse_t=None,
      window_left=-1, window_right=-1, check=True)
                                -> (dq, dk, dv like q, k, v;
                       diag float32 [4, Hq, total_q] if diagnostics else [0])

Each reads cu_seqlens on the host (a device sync for CUDA tensors), checks
their values, and loops over the sequences calling the raw ops
torch.ops.fp8attn.fwd / bwd (through ops.fwd_op / bwd_op, which apply
qk_rotation / smooth_k around them on CUDA) on [1, heads, len, head_dim] views
of each sequence's slices: bit-identical to calling `attention` per sequence
(so smooth_k subtracts each sequence's own mean key, numerics.md section 10, and
a sliding window is bottom-right aligned per sequence, section 14). The
outputs start as O = 0, LSE = -inf, zero gradients, so tokens outside every
sequence and empty sequences keep those values. The fake kernels give the
output shapes from the input shapes alone. varlen_fwd is differentiable
(register_autograd; the backward calls varlen_bwd and takes the diagnostics
records). delta_mode, grad_format and layer_name are in varlen_fwd's schema only
for its backward.

Single launch (issue 19): CUDA tensors with scaling="tile" (precision "fp8", no
smooth_k / softcap, qk_rotation only where the quantization fuses it: head_dim_qk
64 / 128 / 192 / 256, numerics.md 10.3; num_heads_q <= 65535) skip the host loop: the
ops call fp8attn::fwd_varlen and fp8attn::bwd_varlen, one launch per kernel for
the whole packed batch, cu_seqlens / seqused read on the device only (no host sync,
no per-sequence launches; hopper/varlen_sm90.h). Their values are then checked
only with check=True (a host sync: they are read there); unchecked bad values are clamped inside
the tensors (never memory outside them) and give unspecified results for the
sequences they describe. cu_seqlens / seqused on the CPU are copied to q's
device. FP8ATTN_VARLEN_LOOP=1 forces the per-sequence loop
(bit-identical forward; an A/B switch). Everything else (CPU tensors, the `row`
recipe, smooth_k, the rotation at padded head dims) loops per sequence as described above.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from . import _env
from . import diagnostics as _diag
from ._lib import HAS_CUDA_KERNELS
from .ops import (_autocast_in, _diag_meta, _err, _flash_compat, _fused_rotation, _half_in, _half_out, _index,
                  _is_empty, bwd_op, check_bool, check_deterministic, check_inputs, check_options, check_softcap,
                  check_window_size, fwd_op, single_backward)

__all__ = ["varlen_attention"]

_FN = "varlen_attention"


# ---- argument checks ---------------------------------------------------------
# Static checks (types, ranks, dtypes, shapes) run in `varlen_attention`, also
# while tracing; the checks of cu_seqlens / max_seqlen values run inside the
# ops, at run time.


def _check_cu_seqlens(name: str, cu) -> None:
    """Static checks of one cu_seqlens argument (no value read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(_err(_FN, name, f"must be a torch.Tensor, got {type(cu).__name__}"))
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(_err(_FN, name, f"dtype must be int32 or int64, got {cu.dtype}"))
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(_err(_FN, name, f"must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}"))
    if cu.device.type == "meta":
        raise ValueError(_err(_FN, name, "is a meta tensor, but its values are read on the host; "
                                         "pass a CPU or CUDA tensor"))


def _check_batch(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    nq, nk = cu_q.shape[0], cu_k.shape[0]
    if nq != nk:
        raise ValueError(_err(_FN, "cu_seqlens_k", f"has length {nk} (batch {nk - 1}), but "
                                                   f"cu_seqlens_q has length {nq} (batch {nq - 1})"))


def _check_max_seqlen_type(name: str, value) -> Optional[int]:
    """Static check of one max_seqlen argument; returns it as an int or None."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(_err(_FN, name, f"must be an int or None, got {type(value).__name__}"))
    # NOTE: clamped into int64 (the ops' schema type): a bound past 2^62 is as loose as any
    # (no sequence is that long) and a negative one is refused by the value check either way.
    return max(-(2**62), min(int(value), 2**62))


def _cu_values(name: str, cu: torch.Tensor, total: int, total_name: str) -> List[int]:
    """Reads one cu_seqlens on the host, checks its values, returns it as a list."""
    _check_cu_seqlens(name, cu)
    # NOTE: a device sync for CUDA tensors; the per-sequence loop needs the
    # lengths as Python ints anyway.
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


def _check_seqused(name: str, t, cu: torch.Tensor) -> None:
    """Static checks of one seqused argument (None or int32/int64 [batch])."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(_err(_FN, name, f"must be a torch.Tensor or None, got {type(t).__name__}"))
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(_err(_FN, name, f"dtype must be int32 or int64, got {t.dtype}"))
    if t.dim() != 1 or t.shape[0] != cu.shape[0] - 1:
        raise ValueError(_err(_FN, name, f"must be 1-D of length batch = {cu.shape[0] - 1}, got shape "
                                         f"{tuple(t.shape)}"))
    if t.device.type == "meta":
        raise ValueError(_err(_FN, name, "is a meta tensor, but its values are read on the host"))


def _spans(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
           seqused_q: Optional[torch.Tensor] = None,
           seqused_k: Optional[torch.Tensor] = None) -> List[Tuple[int, int, int, int]]:
    """Value checks (run inside the ops); returns the (q_begin, q_end, k_begin,
    k_end) token ranges of every sequence: its first seqused_q[b] / seqused_k[b]
    tokens when given (FlashAttention's used lengths), else all of it."""
    cu_q = _cu_values("cu_seqlens_q", cu_seqlens_q, total_q, "total_q")
    cu_k = _cu_values("cu_seqlens_k", cu_seqlens_k, total_k, "total_k")
    _check_batch(cu_seqlens_q, cu_seqlens_k)
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        real = max((cu[b + 1] - cu[b] for b in range(len(cu) - 1)), default=0)
        if value is not None and value < real:
            raise ValueError(_err(_FN, name, f"is {value}, but the longest sequence has {real} tokens"))
    ends = []
    for name, used, cu in (("seqused_q", seqused_q, cu_q), ("seqused_k", seqused_k, cu_k)):
        if used is None:
            ends.append(cu[1:])
            continue
        vals = used.tolist()   # NOTE: a device sync for CUDA tensors, as for cu_seqlens
        for b, u in enumerate(vals):
            if not 0 <= u <= cu[b + 1] - cu[b]:
                raise ValueError(_err(_FN, name, f"entry {b} is {u}, outside [0, {cu[b + 1] - cu[b]}] (the "
                                                 f"length of sequence {b} in cu_seqlens_{name[-1]})"))
        ends.append([cu[b] + u for b, u in enumerate(vals)])
    return [(cu_q[b], ends[0][b], cu_k[b], ends[1][b]) for b in range(len(cu_q) - 1)]


def _seq(t: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """[1, heads, len, head_dim] view of tokens [begin, end) of a packed [total, heads, head_dim]."""
    return t[begin:end].transpose(0, 1).unsqueeze(0)


def _single_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, precision: str,
                   scaling: str, qk_rotation: str, smooth_k: bool, softcap: float) -> bool:
    """Whether a packed batch runs the single-launch CUDA kernels (module
    docstring); FP8ATTN_VARLEN_LOOP=1 forces the per-sequence loop.
    qk_rotation="hadamard" runs there where the dense op fuses it into the
    quantization (ops._fused_rotation, numerics.md 10.3). Past the
    single launch's size limits (totals < 2^30 tokens, padded rows < 2^31:
    csrc/torch/ops_cuda.cpp packed_batch) the loop runs it, as before."""
    if _env.flag("FP8ATTN_VARLEN_LOOP", False):
        return False
    n = cu_seqlens_q.shape[0] - 1
    fits = max(q.shape[0], k.shape[0]) < 2**30 and ((max(q.shape[0], k.shape[0]) + 127) // 128 + n) * 128 < 2**31
    rotation_ok = qk_rotation == "none" or _fused_rotation(q, v, qk_rotation, scaling)
    return (q.is_cuda and HAS_CUDA_KERNELS and precision == "fp8" and scaling == "tile" and rotation_ok
            and not smooth_k and softcap == 0.0 and q.shape[1] <= 65535 and fits)


def _on_device(device: torch.device, *tensors: Optional[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """cu_seqlens / seqused on q's device for the single-launch ops (they read them
    there; the loop accepts CPU ones, so the single launch does too): a copy to the
    device, queued without waiting for the GPU."""
    return [t if t is None or t.device == device else t.to(device, non_blocking=True) for t in tensors]


# ---- the ops -----------------------------------------------------------------


@torch.library.custom_op("fp8attn::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], softmax_scale: float, causal: bool,
    precision: str, block_size: int, delta_mode: str, grad_format: str, layer_name: Optional[str],
    scaling: str = "row", qk_rotation: str = "none", smooth_k: bool = False,
    seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, softcap: float = 0.0,
    window_left: int = -1, window_right: int = -1, check: bool = True, deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of varlen_attention on already checked static arguments (see the
    module docstring); precision is the op-level one ("fp8" or "exact"). check:
    the value checks of cu_seqlens / seqused / max_seqlen on the single-launch
    path (the loop always checks: it reads the values anyway). deterministic: for the
    backward only (varlen_bwd; the forward has no run-to-run variation)."""
    if _single_launch(q, k, v, cu_seqlens_q, precision, scaling, qk_rotation, smooth_k, softcap):
        if check:
            _spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, seqused_q,
                   seqused_k)
        cu_q, cu_k, used_q, used_k = _on_device(q.device, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        out, lse = torch.ops.fp8attn.fwd_varlen(q, k, v, cu_q, cu_k, used_q, used_k, softmax_scale, causal,
                                                block_size, scaling, window_left, window_right, qk_rotation)
        return out, lse, lse.new_empty((0,))
    spans = _spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                   seqused_q, seqused_k)
    total_q, hq, dv = q.shape[0], q.shape[1], v.shape[2]
    # Tokens outside every sequence and sequences with no query, key or head
    # keep these: O = 0, LSE = -inf (numerics.md section 1, a row seeing no key).
    out = q.new_zeros((total_q, hq, dv))
    lse = q.new_full((hq, total_q), float("-inf"), dtype=torch.float32)
    # smooth_k: also LSE' of the smoothed logits, which the backward takes as it is
    # (numerics.md section 10.2: no FP32 round trip through the shift).
    lse_t = lse.clone() if smooth_k else lse.new_empty((0,))
    for qa, qb, ka, kb in spans:
        q_b, k_b, v_b = _seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb)
        if _is_empty(q_b, k_b):
            continue
        o_b, lse_b, lse_tb = fwd_op(q_b, k_b, v_b, softmax_scale, causal, precision, block_size, scaling,
                                    qk_rotation, smooth_k, softcap=softcap, return_lse_t=True,
                                    window=(window_left, window_right))
        out[qa:qb] = o_b[0].transpose(0, 1)
        lse[:, qa:qb] = lse_b[0]
        if smooth_k:
            lse_t[:, qa:qb] = lse_tb[0]
    return out, lse, lse_t


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     precision, block_size, delta_mode, grad_format, layer_name, scaling="row", qk_rotation="none",
                     smooth_k=False, seqused_q=None, seqused_k=None, softcap=0.0, window_left=-1, window_right=-1,
                     check=True, deterministic=False):
    total_q, hq, _ = q.shape
    return (q.new_empty((total_q, hq, v.shape[2])), q.new_empty((hq, total_q), dtype=torch.float32),
            q.new_empty((hq, total_q) if smooth_k else (0,), dtype=torch.float32))


@torch.library.custom_op("fp8attn::varlen_bwd", mutates_args=())
def varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float, causal: bool, precision: str,
    delta_mode: str, block_size: int, grad_format: str, diagnostics: bool, scaling: str = "row",
    qk_rotation: str = "none", smooth_k: bool = False,
    seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, softcap: float = 0.0,
    lse_t: Optional[torch.Tensor] = None, window_left: int = -1, window_right: int = -1, check: bool = True,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of varlen_fwd: dq, dk, dv (zero outside the non-empty sequences)
    and, with diagnostics, diag float32 [4, Hq, total_q] = the bwd op's (delta,
    eps, rowsum_pre, rowsum_post) per token (0 outside the non-empty sequences),
    else an empty [0]. lse_t: varlen_fwd's third output (smooth_k: LSE' of the
    smoothed logits, used as it is instead of lse - shift; None or [0]: recovered
    from lse). deterministic: dQ, dK, dV the same bit for bit from run to run: the
    per-sequence loop of dense backwards with deterministic=True (the single launch
    adds its dQ partials with atomics; numerics.md section 9, "Deterministic backward")."""
    if lse_t is not None and lse_t.numel() == 0:
        lse_t = None
    if not deterministic and _single_launch(q, k, v, cu_seqlens_q, precision, scaling, qk_rotation, smooth_k,
                                            softcap):
        if check:
            _spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_q=seqused_q, seqused_k=seqused_k)
        cu_q, cu_k, used_q, used_k = _on_device(q.device, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        return torch.ops.fp8attn.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, softmax_scale,
                                            causal, delta_mode, block_size, grad_format, diagnostics, scaling,
                                            window_left, window_right, qk_rotation)
    spans = _spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_q=seqused_q, seqused_k=seqused_k)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    diag = q.new_zeros((4, q.shape[1], q.shape[0]) if diagnostics else (0,), dtype=torch.float32)
    for qa, qb, ka, kb in spans:
        q_b, k_b, v_b = _seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb)
        if _is_empty(q_b, k_b):
            continue
        dq_b, dk_b, dv_b, diag_b = bwd_op(
            _seq(dout, qa, qb), q_b, k_b, v_b, _seq(out, qa, qb), lse[:, qa:qb].unsqueeze(0), softmax_scale,
            causal, precision, delta_mode, block_size, grad_format, diagnostics, scaling, qk_rotation, smooth_k,
            softcap=softcap, lse_t=None if lse_t is None else lse_t[:, qa:qb].unsqueeze(0),
            window=(window_left, window_right), deterministic=deterministic)
        dq[qa:qb] = dq_b[0].transpose(0, 1)
        dk[ka:kb] = dk_b[0].transpose(0, 1)
        dv[ka:kb] = dv_b[0].transpose(0, 1)
        if diagnostics:
            diag[:, :, qa:qb] = diag_b[:, 0]
    return dq, dk, dv, diag


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, precision,
                     delta_mode, block_size, grad_format, diagnostics, scaling="row", qk_rotation="none",
                     smooth_k=False, seqused_q=None, seqused_k=None, softcap=0.0, lse_t=None, window_left=-1,
                     window_right=-1, check=True, deterministic=False):
    diag_shape = (4, q.shape[1], q.shape[0]) if diagnostics else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(diag_shape, dtype=torch.float32))


# ---- autograd of varlen_fwd ----------------------------------------------------


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, _max_q, _max_k, scale, causal, precision, block_size, delta_mode, grad_format,
     layer_name) = inputs[:14]
    scaling = inputs[14] if len(inputs) > 14 else "row"
    qk_rotation = inputs[15] if len(inputs) > 15 else "none"
    smooth_k = inputs[16] if len(inputs) > 16 else False
    used_q = inputs[17] if len(inputs) > 17 else None
    used_k = inputs[18] if len(inputs) > 18 else None
    softcap = inputs[19] if len(inputs) > 19 else 0.0
    window = (inputs[20] if len(inputs) > 20 else -1, inputs[21] if len(inputs) > 21 else -1)
    check = inputs[22] if len(inputs) > 22 else True
    deterministic = inputs[23] if len(inputs) > 23 else False
    out, lse, lse_t = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, lse_t)
    ctx.opts = (scale, causal, precision, block_size, delta_mode, grad_format, layer_name, scaling, qk_rotation,
                smooth_k, softcap, window, check, deterministic, len(inputs))
    ctx.mark_non_differentiable(lse, lse_t)


@single_backward(_FN)
def _varlen_backward(ctx, dout, _dlse, _dlse_t):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k, lse_t = ctx.saved_tensors
    (scale, causal, precision, block_size, delta_mode, grad_format, layer_name, scaling, qk_rotation, smooth_k,
     softcap, window, check, deterministic, n_inputs) = ctx.opts
    want_diag = _diag.is_recording()  # False while compiling: the traced backward records nothing
    dq, dk, dv, diag = torch.ops.fp8attn.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal,
                                                    precision, delta_mode, block_size, grad_format, want_diag,
                                                    scaling, qk_rotation, smooth_k, used_q, used_k, softcap, lse_t,
                                                    window[0], window[1], check, deterministic)
    if want_diag:
        # One record per non-empty sequence, in sequence order, as `attention`
        # would record for that sequence alone (eager only: reads cu_seqlens).
        for qa, qb, ka, kb in _spans(cu_q, cu_k, q.shape[0], k.shape[0], seqused_q=used_q, seqused_k=used_k):
            q_b, k_b, v_b = _seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb)
            if _is_empty(q_b, k_b):
                continue
            _diag._record(diag[:, None, :, qa:qb], _diag_meta(q_b, k_b, v_b, causal, precision, delta_mode,
                                                              block_size, grad_format, layer_name, scaling,
                                                              qk_rotation, smooth_k, window))
    return (dq, dk, dv) + (None,) * (n_inputs - 3)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


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
    dropout_p: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    block_table: Optional[torch.Tensor] = None,
    delta_mode: str = "delta_matching",
    precision: str = "fp8",
    block_size: int = 128,
    grad_format: str = "e4m3",
    return_lse: bool = False,
    layer_name: Optional[str] = None,
    scaling: str = "row",
    qk_rotation: str = "none",
    smooth_k: bool = False,
    check: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over a packed batch of variable-length sequences (flash_attn varlen layout).

    Sequence b holds query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key
    tokens [cu_seqlens_k[b], cu_seqlens_k[b+1]), and attends within itself only:
    the result for b is `attention` on those slices alone (numerics.md section 1;
    with causal, the mask is bottom-right aligned per sequence; the FP8 block grid
    starts at token 0 of every sequence, section 7).

    Args:
        q: [total_q, num_heads_q, head_dim_qk], bfloat16, float16, float32 or
            float64 (CUDA: as in `fp8attn.attention`: bfloat16, float16 or
            float32, head dims 1..256; float16 runs as float32, O comes back in
            float16).
        k: [total_k, num_heads_kv, head_dim_qk]; num_heads_q must be a multiple
            of num_heads_kv (GQA).
        v: [total_k, num_heads_kv, head_dim_v].
        cu_seqlens_q, cu_seqlens_k: int32 or int64, 1-D, both of length
            batch + 1, starting at 0, non-decreasing, last entry <= total_q
            (resp. total_k). Tokens past the last entry are outside every
            sequence: their O rows are 0, their LSE is -inf, their dQ/dK/dV are
            0, and whatever they hold (even NaN) reaches no output or gradient.
            Single-launch path (CUDA, scaling="tile", num_heads_q <= 65535,
            totals < 2^30 tokens; module docstring): read on the device only
            (no host sync; CPU ones are copied to q's device); their values are
            checked only with check=True. Otherwise their values are
            read on the host inside the op fp8attn::varlen_fwd (a sync if they
            live on the GPU; no graph break under torch.compile) and always
            checked; each sequence is one fwd / bwd op call, with that op's
            limits (on CUDA: any number of heads, seqlen < 2^30; tensors of
            2^31+ elements). int32 holds totals up to 2^31 - 1 tokens; use
            int64 beyond.
        max_seqlen_q, max_seqlen_k: optional ints; must be >= the longest
            sequence (ValueError otherwise, raised when the op checks the
            values). Upper bounds only: the kernels do not need them.
        check: (single-launch path) check the values of cu_seqlens, seqused
            and max_seqlen on the host (a sync: one small copy of each, in the
            forward and again in the backward), raising the ValueErrors below.
            Default False: no sync; values that break the rules then give
            unspecified results for the sequences they describe, but never a
            read or write outside the tensors or a crash (they are clamped:
            starts into [0, total], ends into [start, total], seqused into
            [0, length]). The per-sequence path always checks.
        causal, softmax_scale, delta_mode, precision, block_size, grad_format,
        layer_name, scaling ("row" or "tile", numerics.md section 9),
        qk_rotation, smooth_k (section 10; smooth_k subtracts each sequence's
        own mean key): as in `fp8attn.attention` (applied to every sequence; the
            same checks: softmax_scale * log2(e) finite in FP32, block_size any
            integer type but bool, layer_name a str or None).
            Zero-length sequences are allowed: a query sequence with no keys
            gives O = 0, LSE = -inf and zero gradients. With diagnostics, each
            non-empty sequence's backward is one record (labelled layer_name),
            in sequence order (eager mode only, as for `attention`).
        return_lse: also return LSE (a bool); return_attn_probs (FlashAttention's
            name) does the same.
        seqused_q, seqused_k: optional int32/int64 [batch] (FlashAttention's used
            lengths): sequence b uses only its first seqused_q[b] query and
            seqused_k[b] key tokens (causal bottom-right on those); its other
            tokens are treated like tokens outside every sequence (O = 0, LSE =
            -inf, zero gradients, their contents reach nothing). Values in [0,
            the sequence's cu_seqlens length], checked when the op runs (read on
            the host like cu_seqlens).
        softcap: logit softcapping as in `fp8attn.attention` (numerics.md section
            12; CPU tensors, and CUDA tensors with scaling="tile", which run it per
            sequence on the dense kernels; scaling="row" on CUDA raises
            NotImplementedError naming it).
        window_size: (left, right), FlashAttention's sliding window as in
            `fp8attn.attention` (numerics.md section 14), bottom-right aligned per
            sequence (on its used lengths with seqused_q / seqused_k); -1 =
            unbounded, causal=True sets right = 0, (-1, 0) is the causal mask.
            A pair of ints (ValueError otherwise); CPU tensors run any window,
            CUDA tensors with scaling="tile" too, and with scaling="row" raise
            NotImplementedError naming window_size for a sequence whose window
            masks more than causal.
        deterministic: a backward whose dQ, dK, dV are the same bit for bit from run
            to run, as `fp8attn.attention`'s: CPU tensors always; CUDA tensors with
            scaling="tile" run the per-sequence loop of deterministic dense backwards
            (the single launch's dQ adds are atomic), slower; CUDA with scaling="row"
            raises NotImplementedError naming it. A non-bool is a TypeError.
        FlashAttention's other arguments (dropout_p,
        alibi_slopes, qv, q_descale /
        k_descale / v_descale, attention_chunk, num_splits, pack_gqa, sm_margin,
        block_table):
            the defaults and equivalent values are accepted (num_splits and
            pack_gqa are scheduling hints that do not change the result);
            anything else raises NotImplementedError naming the argument,
            a malformed value ValueError (as `fp8attn.flash_attn_func`).

    Returns:
        O [total_q, num_heads_q, head_dim_v] in q's dtype; with return_lse also
        LSE float32 [num_heads_q, total_q] (natural log, not differentiable; the
        flash_attn varlen layout).

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype
            (cu_seqlens must be int32/int64), a wrongly typed option (as in
            `fp8attn.attention`: causal / return_lse / check, softmax_scale, layer_name).
        ValueError: wrong rank, mismatched shapes/heads/devices, cu_seqlens_q and
            cu_seqlens_k of different lengths (batch), a cu_seqlens that does
            not start at 0, decreases or exceeds the total token count,
            max_seqlen below the real maximum, a bad option value. The message
            names the argument. The errors that depend on cu_seqlens values
            (start, order, last entry, max_seqlen) come from inside the op
            (on the single-launch path only with check=True), so under
            torch.compile they are raised when the compiled code runs.
        RuntimeError: (in backward) a backward with create_graph=True while an
            input requires grad: double backward is not supported.

    torch.compile(fullgraph=True) traces it (forward and backward) without a
    graph break: the per-sequence loop is inside the custom ops.
    """
    # ---- options and tensors
    window = check_window_size(window_size, _FN)
    if isinstance(causal, (bool, np.bool_)):  # else check_options' TypeError naming causal
        causal, return_attn_probs, window = _flash_compat(
            _FN, causal, dropout_p=dropout_p, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs, qv=qv,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
            num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin, block_table=block_table,
            device_type=q.device.type if isinstance(q, torch.Tensor) else "cpu", softcap_ok=True)
        if isinstance(return_lse, (bool, np.bool_)):
            return_lse = bool(return_lse) or return_attn_probs
    op_precision = check_options(causal=causal, softmax_scale=softmax_scale, delta_mode=delta_mode,
                                 precision=precision, block_size=block_size, grad_format=grad_format,
                                 return_lse=return_lse, layer_name=layer_name, scaling=scaling,
                                 qk_rotation=qk_rotation, smooth_k=smooth_k, fn=_FN)
    causal, return_lse, smooth_k = bool(causal), bool(return_lse), bool(smooth_k)  # checked: NumPy bools too
    block_size = _index(block_size)  # e.g. a numpy integer: the op schema takes a Python int
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(_err(_FN, name, f"must be a torch.Tensor, got {type(t).__name__}"))
        if t.dim() != 3:
            raise ValueError(_err(_FN, name, f"must be 3-D [total_tokens, heads, head_dim], got shape {tuple(t.shape)}"))
    if v.shape[0] != k.shape[0]:
        raise ValueError(_err(_FN, "v", f"total_k {v.shape[0]} != k's total_k {k.shape[0]}"))
    # NOTE: the remaining checks (dtype, device, head_dim, GQA heads) are those of
    # `attention`, run on [1, heads, total, head_dim] views.
    q, k, v = _autocast_in(q, k, v)   # as SDPA under torch.autocast
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    check_inputs(q4, k4, v4, op_precision, fn=_FN)
    cap = check_softcap(softcap, smooth_k, q.device.type, fn=_FN, scaling=scaling, precision=op_precision)

    # ---- cu_seqlens / max_seqlen: static checks here, value checks in the op
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    _check_batch(cu_seqlens_q, cu_seqlens_k)
    _check_seqused("seqused_q", seqused_q, cu_seqlens_q)
    _check_seqused("seqused_k", seqused_k, cu_seqlens_k)
    max_q = _check_max_seqlen_type("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen_type("max_seqlen_k", max_seqlen_k)

    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    in_dtype = q.dtype
    q, k, v = _half_in(q, k, v)
    check = check_bool(check, "check", _FN)
    det = check_deterministic(deterministic, q.device.type, op_precision, scaling, fn=_FN)
    out, lse, _ = torch.ops.fp8attn.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, causal,
                                            op_precision, block_size, delta_mode, grad_format, layer_name,
                                            scaling, qk_rotation, smooth_k, seqused_q, seqused_k, cap,
                                            window[0], window[1], check, det)
    out = _half_out(out, in_dtype)
    return (out, lse) if return_lse else out
