"""The Hadamard rotation of `qk_rotation="hadamard"` (docs/numerics.md section 10) as one
Triton kernel per head_dim block, for FP32 CUDA tensors: each row is read once, rotated
in registers and written once. The torch-op path (fp8attn.qk_transform.rotate) does one
pass over the tensor per butterfly stage (7 at head_dim 128) plus the sign and norm
multiplies, which made the unfused transforms cost ~2.3x the op's time at 16K tokens
(docs/results.md section 9).

Bit for bit the torch path's values: the same operations in the same order on FP32
(times the signs, the butterflies h = 1, 2, 4, ... each an FP32 add and subtract of the
pair (j, j + h) inside every 2h-group, times 1/sqrt(n) rounded to FP32; the transposed
rotation signs last). tests/python/test_hadamard_triton.py checks it in Triton's
interpreter on the CPU (every head_dim block size, odd row counts, strided rows) and on
a GPU.

Switch: qk_transform.rotate / rotate_transposed use it for FP32 CUDA tensors in eager
mode by default (H100, 2026-12-07: the op with qk_rotation="hadamard" at 16K tokens
1.23x of the op without it, against 1.98x with the torch ops; the same errors to four
digits); FP8ATTN_TRITON_HADAMARD=0 keeps the torch ops; under torch.compile the torch ops
are traced. Without triton: the torch ops.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
    _HAVE_TRITON = True
except Exception:  # pragma: no cover - triton missing
    _HAVE_TRITON = False

_ROWS = 16           # rows per program


def available() -> bool:
    """True when triton imports."""
    return _HAVE_TRITON


if _HAVE_TRITON:
    @triton.jit
    def _fwht_rows(x_ptr, y_ptr, s_ptr, M, stride_x, stride_y, norm, N: tl.constexpr, ROWS: tl.constexpr,
                   SIGNS_FIRST: tl.constexpr):
        """Rows [ROWS pid, ROWS pid + ROWS) of x (N contiguous channels each, row stride
        stride_x) -> y: signs first (x R) or last (g R^T), FWHT, times norm."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, N)
        live = rows[:, None] < M
        # NOTE: 64-bit offsets: rows x stride passes 2^31 elements at 2^24 rows of head_dim 128.
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=live, other=0.0)
        signs = tl.load(s_ptr + cols)[None, :]
        if SIGNS_FIRST:
            x = x * signs
        for st in tl.static_range(0, 8):  # butterfly stages of blocks up to 256 = 2^8 channels
            if (1 << st) < N:
                # h = 2^st: [row, group of 2h, pair member (0: j, 1: j + h), j], the member axis last
                y = tl.permute(tl.reshape(x, (ROWS, N // (2 << st), 2, 1 << st)), (0, 1, 3, 2))
                a, b = tl.split(y)
                x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))
        x = x * norm
        if not SIGNS_FIRST:
            x = x * signs
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], x, mask=live)


def rotate_rows(x: torch.Tensor, signs: torch.Tensor, blocks, norms, transposed: bool) -> torch.Tensor:
    """x R (transposed: x R^T) along the last dim for an FP32 tensor x (any leading shape;
    copied to contiguous rows when it is not). signs: the [head_dim] FP32 sign vector on
    x's device; blocks: qk_transform.hadamard_blocks(head_dim); norms: each block's
    1/sqrt(n) as a Python float (the FP32 value). Returns a new contiguous tensor."""
    if not _HAVE_TRITON:
        raise RuntimeError("fp8attn.hadamard_triton: triton is not importable")
    if x.dtype != torch.float32:
        raise TypeError(f"fp8attn.hadamard_triton.rotate_rows: argument 'x': expected float32, got {x.dtype}")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m > 0:
        o = 0
        # NOTE: Triton launches on the current device; x may live on another GPU.
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # CPU: interpreter
            for n, norm in zip(blocks, norms):
                _fwht_rows[(triton.cdiv(m, _ROWS),)](x2[:, o:], y[:, o:], signs[o:o + n], m, x2.stride(0),
                                                     y.stride(0), norm, N=n, ROWS=_ROWS,
                                                     SIGNS_FIRST=not transposed,
                                                     enable_fp_fusion=False)  # no FMA: the torch ops' roundings
                o += n
    return y.reshape(x.shape)
