"""Outlier transforms of Q and K before quantization, with torch ops
(docs/numerics.md section 10): `qk_rotation="hadamard"` (incoherent processing:
Q' = Q R, K' = K R with one fixed orthogonal R) and `smooth_k=True` (K' = K - m,
m the mean key per batch and kv head).

The CPU reference (csrc/reference/attention_ref.cpp, csrc/reference/qk_transform.h)
is the oracle; this module is how the op applies the same rules around the CUDA
kernels, which have no fused transform yet: the transforms run as separate torch
ops in FP32 (the rotation of FP32 CUDA tensors as one Triton kernel in eager mode,
fp8attn.hadamard_triton; FP8ATTN_TRITON_HADAMARD=0 turns it off) (extra memory traffic: Q and K are read and written once more in the
forward and the backward, dQ and dK once more in the backward). The operations
and their order are those of the reference, so on the same inputs they give the
same FP32 values (tests/python/test_qk_transform.py checks it bit for bit on the
CPU).

Tensors are in the SDPA layout: q [batch, num_heads_q, seqlen_q, head_dim],
k [batch, num_heads_kv, seqlen_k, head_dim].
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from . import _env

__all__ = ["QK_ROTATIONS", "hadamard_blocks", "hadamard_signs", "hadamard_matrix", "rotate", "rotate_transposed",
           "key_mean", "lse_shift", "shift_lse", "transform_qk", "map_grads_back"]

QK_ROTATIONS = ("none", "hadamard")

_M64 = (1 << 64) - 1


def hadamard_blocks(d: int) -> List[int]:
    """Hadamard block sizes of head_dim d: the powers of two of d's binary
    representation, largest first (192 -> [128, 64], 80 -> [64, 16]);
    numerics.md section 10."""
    return [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]


def _sign(c: int) -> float:
    """Top bit of the c-th SplitMix64 output (seed 0) -> -1 / +1 (numerics.md section 10)."""
    z = ((c + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return -1.0 if z >> 63 else 1.0


# The sign of every channel up to the largest head_dim (256), computed once (a
# plain constant, so torch.compile traces hadamard_signs without a cache wrapper).
_SIGNS = tuple(_sign(c) for c in range(256))


def hadamard_signs(d: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The fixed sign of each of the d <= 256 channels, [d] of +-1."""
    return torch.tensor(_SIGNS[:d], dtype=dtype, device=device)


def _norm(n: int, dtype) -> torch.Tensor:
    # 1/sqrt(n) in FP64 rounded to the working dtype (as the reference's hadamard_norm).
    return torch.tensor(1.0 / math.sqrt(n), dtype=torch.float64).to(dtype)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard transform along the last dim (a power of
    two), butterflies h = 1, 2, 4, ... as the reference's fwht."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def _check_head_dim_input(fn: str, arg: str, x) -> None:
    """x: a floating tensor whose last dim (head_dim) is in [1, 256], as the library's."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fp8attn.qk_transform.{fn}: argument '{arg}': expected a floating-point tensor, got {got}")
    if x.dim() == 0 or not 1 <= x.shape[-1] <= 256:
        raise ValueError(f"fp8attn.qk_transform.{fn}: argument '{arg}': head_dim (the last dim) must be in "
                         f"[1, 256], got shape {tuple(x.shape)}")


def _check_rotation(fn: str, qk_rotation) -> None:
    if qk_rotation not in QK_ROTATIONS:
        raise ValueError(f"fp8attn.qk_transform.{fn}: argument 'qk_rotation': expected one of {QK_ROTATIONS}, "
                         f"got {qk_rotation!r}")


def _triton_eligible(x) -> bool:
    """True when the rotation of x may run as the Triton kernel: an FP32 CUDA tensor, in
    eager mode, unless FP8ATTN_TRITON_HADAMARD=0. Never when autograd would record the
    rotation (grad mode on and x requires grad: the kernel has no backward, so a caller
    that differentiates through rotate, as context_parallel's transform does, gets the
    torch ops), under torch.compile (dynamo traces the torch ops; inductor fuses them), or
    under a fake / proxy dispatch mode or on a FakeTensor (AOT traces outside dynamo,
    shape propagation: no kernel launch on fake data)."""
    if not (x.is_cuda and x.dtype == torch.float32 and _env.flag("FP8ATTN_TRITON_HADAMARD", True)):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if torch.compiler.is_compiling():
        return False
    keys = torch._C._TorchDispatchModeKey
    if any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY)):
        return False
    from torch._subclasses.fake_tensor import FakeTensor   # noqa: PLC0415
    return not isinstance(x, FakeTensor)


def _triton_rows(x: torch.Tensor, transposed: bool) -> Optional[torch.Tensor]:
    """x R (or x R^T) by fp8attn.hadamard_triton when _triton_eligible(x) (the same FP32
    values as the torch ops below); else None."""
    if not _triton_eligible(x):
        return None
    from . import hadamard_triton as _ht  # noqa: PLC0415 (triton imported on use)
    if not _ht.available():
        return None
    d = x.shape[-1]
    blocks = hadamard_blocks(d)
    return _ht.rotate_rows(x, hadamard_signs(d, x.dtype, x.device), blocks,
                           [float(_norm(n, x.dtype)) for n in blocks], transposed)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x R along the last dim (head_dim), in x's dtype (the working precision):
    per block, times the signs, FWHT, times 1/sqrt(n) (FP32 CUDA tensors in eager mode:
    the same values from one Triton kernel, fp8attn.hadamard_triton, unless
    FP8ATTN_TRITON_HADAMARD=0). Raises TypeError for a non-floating x, ValueError for
    head_dim outside [1, 256]."""
    _check_head_dim_input("rotate", "x", x)
    fused = _triton_rows(x, False)
    if fused is not None:
        return fused
    d = x.shape[-1]
    s = hadamard_signs(d, x.dtype, x.device)
    x = x * s
    out, o = [], 0
    for n in hadamard_blocks(d):
        out.append(_fwht(x[..., o:o + n]) * _norm(n, x.dtype).to(x.device))
        o += n
    return torch.cat(out, dim=-1)


def rotate_transposed(g: torch.Tensor) -> torch.Tensor:
    """g R^T along the last dim: per block, FWHT, times 1/sqrt(n), times the signs
    (errors as rotate's)."""
    _check_head_dim_input("rotate_transposed", "g", g)
    fused = _triton_rows(g, True)
    if fused is not None:
        return fused
    d = g.shape[-1]
    out, o = [], 0
    for n in hadamard_blocks(d):
        out.append(_fwht(g[..., o:o + n]) * _norm(n, g.dtype).to(g.device))
        o += n
    return torch.cat(out, dim=-1) * hadamard_signs(d, g.dtype, g.device)


def hadamard_matrix(d: int, dtype=torch.float64) -> torch.Tensor:
    """R itself, [d, d] (x' = x @ R); for tests and emulations."""
    return rotate(torch.eye(d, dtype=dtype))


def key_mean(k: torch.Tensor, dtype) -> torch.Tensor:
    """The mean key of each (batch, kv head): [batch, num_heads_kv, 1, head_dim]
    in `dtype`, from the FP64 sum over the keys of k read in `dtype`. Zeros when
    seqlen_k = 0."""
    n = k.shape[2]
    if n == 0:
        return k.new_zeros((*k.shape[:2], 1, k.shape[3]), dtype=dtype)
    return (k.to(dtype).double().sum(dim=2, keepdim=True) / n).to(dtype)


def lse_shift(q: torch.Tensor, mean: torch.Tensor, softmax_scale: float, dtype) -> torch.Tensor:
    """shift_i = tau <q_i, m> per query row, [batch, num_heads_q, seqlen_q]:
    the smoothed logits are S' = S - shift_i (numerics.md section 10). FP64
    dot product of q read in `dtype` with the mean, returned in FP64 (fp8 path:
    tau rounded to FP32 first; the callers round the shift to their dtype)."""
    group = q.shape[1] // mean.shape[1]
    m = mean.repeat_interleave(group, dim=1).double()          # [B, Hq, 1, d]
    u = (q.to(dtype).double() * m).sum(dim=-1)
    tau = float(torch.tensor(softmax_scale, dtype=torch.float32)) if dtype == torch.float32 else softmax_scale
    return tau * u


def working_dtype(precision: str):
    """FP32 on the fp8 path, FP64 on the exact path (the reference's W)."""
    return torch.float64 if precision == "exact" else torch.float32


def transform_qk(q: torch.Tensor, k: torch.Tensor, qk_rotation: str, smooth_k: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """fp8 path: Q', K' computed in FP32 and returned in q's / k's dtype (the
    kernels' input: rounded to it when it is bfloat16), and the FP32 mean key
    [batch, num_heads_kv, 1, head_dim] (None without smooth_k)."""
    _check_rotation("transform_qk", qk_rotation)
    w = torch.float32
    qw, kw = q.to(w), k.to(w)
    mean = key_mean(k, w) if smooth_k else None
    if mean is not None:
        kw = kw - mean
    if qk_rotation == "hadamard":
        qw, kw = rotate(qw), rotate(kw)
    return qw.to(q.dtype), kw.to(k.dtype), mean


def smooth_only(q: torch.Tensor, k: torch.Tensor, smooth_k: bool
                ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The inputs of the raw CUDA op that rotates inside its quantization (numerics.md
    10.3): q and k themselves without smooth_k; with it Q read as FP32 and K_s = K - m
    in FP32 (transform_qk's values before its rotation), and the FP32 mean key."""
    if not smooth_k:
        return q, k, None
    w = torch.float32
    mean = key_mean(k, w)
    return q.to(w), k.to(w) - mean, mean


def shift_lse(lse: torch.Tensor, q: torch.Tensor, mean: torch.Tensor, softmax_scale: float, sign: int
              ) -> torch.Tensor:
    """fp8 path: lse + sign * shift_i (FP32 add of the FP32-rounded shift), -inf
    rows kept: sign +1 turns the LSE of the smoothed logits into that of S,
    -1 back."""
    new = lse + sign * lse_shift(q, mean, softmax_scale, torch.float32).float()
    return torch.where(lse == float("-inf"), lse, new)


def map_grads_back(dq_t: torch.Tensor, dk_t: torch.Tensor, qk_rotation: str, smooth_k: bool,
                   q_dtype, k_dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8 path: dQ = dQ' R^T and dK = dK' R^T minus its mean over the keys
    (the gradient through the mean key), in FP32, returned in q's / k's dtype."""
    _check_rotation("map_grads_back", qk_rotation)
    w = torch.float32
    dq, dk = dq_t.to(w), dk_t.to(w)
    if qk_rotation == "hadamard":
        dq, dk = rotate_transposed(dq), rotate_transposed(dk)
    if smooth_k and dk.shape[2] > 0:
        dk = dk - (dk.double().sum(dim=2, keepdim=True) / dk.shape[2]).to(w)
    return dq.to(q_dtype), dk.to(k_dtype)
