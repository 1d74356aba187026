"""fp8attn.hadamard_triton: the Hadamard rotation of qk_rotation="hadamard" (numerics.md
section 10) in one Triton kernel gives bit for bit the FP32 values of the torch-op path
(fp8attn.qk_transform.rotate / rotate_transposed).

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, in a child
process: the switch is read when the kernel is defined); on a GPU (marked gpu) compiled,
and through the op (the default, on) against the torch ops (FP8ATTN_TRITON_HADAMARD=0)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fp8attn
from fp8attn import qk_transform as qkt

HAS_TRITON = True
try:
    import triton  # noqa: F401
except Exception:  # pragma: no cover
    HAS_TRITON = False

HAS_GPU = torch.cuda.is_available() and fp8attn._lib.HAS_CUDA_KERNELS

# Every block size of hadamard_blocks (1 .. 256), a non-power-of-two head_dim (192 =
# 128 + 64, 80 = 64 + 16, 3 = 2 + 1), row counts that do not fill the last program.
CHILD = textwrap.dedent("""
    import torch
    from fp8attn import hadamard_triton as ht, qk_transform as qkt
    def fused(x, transposed):
        d = x.shape[-1]
        b = qkt.hadamard_blocks(d)
        return ht.rotate_rows(x, qkt.hadamard_signs(d), b, [float(qkt._norm(n, torch.float32)) for n in b],
                              transposed)
    g = torch.Generator().manual_seed(3)
    bad = []
    for d in (1, 2, 3, 4, 8, 16, 32, 64, 80, 128, 192, 256):
        for rows in (1, 17, 40):
            x = torch.randn(rows, 2, d + 5, generator=g)[..., 2:2 + d] * 100   # strided rows
            if not torch.equal(fused(x, False), qkt.rotate(x)):
                bad.append(("rotate", d, rows))
            if not torch.equal(fused(x, True), qkt.rotate_transposed(x)):
                bad.append(("rotate_transposed", d, rows))
    # The comparison tells the two rotations apart (R != R^T in general: signs first or last).
    x = torch.randn(5, 128, generator=g)
    distinct = not torch.equal(fused(x, False), fused(x, True))
    print("BAD", bad, "DISTINCT", distinct)
""")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_equals_torch_ops_bitwise_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    line = res.stdout.strip().splitlines()[-1]
    assert line == "BAD [] DISTINCT True", line


def _ptxas() -> bool:
    return HAS_TRITON and os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                      "ptxas"))


@pytest.mark.skipif(not _ptxas(), reason="needs triton with its bundled ptxas")
def test_kernel_compiles_for_sm90():
    # The interpreter runs the kernel as Python and accepts what the compiler refuses (a
    # non-constexpr global, a constexpr reassigned in an unrolled loop: both happened
    # while writing it); compile it for sm_90 ahead of time, every block size, both orders,
    # with the launch's options (no FMA contraction), no GPU needed.
    from triton.backends.compiler import GPUTarget
    from fp8attn import hadamard_triton as ht
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "s_ptr": "*fp32", "M": "i32", "stride_x": "i32", "stride_y": "i32",
           "norm": "fp32", "N": "constexpr", "ROWS": "constexpr", "SIGNS_FIRST": "constexpr"}
    for n in (1, 2, 16, 64, 128, 256):
        for first in (True, False):
            src = triton.compiler.ASTSource(fn=ht._fwht_rows, signature=sig,
                                            constexprs={"N": n, "ROWS": ht._ROWS, "SIGNS_FIRST": first})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
            assert ".target sm_90" in k.asm["ptx"], (n, first)


def test_switch_is_on_by_default_off_with_0_and_validated(monkeypatch):
    x = torch.randn(4, 64)
    monkeypatch.delenv("FP8ATTN_TRITON_HADAMARD", raising=False)
    assert qkt._triton_rows(x, False) is None          # CPU tensor: torch ops whatever the switch
    if HAS_GPU and HAS_TRITON:
        xc = x.cuda()
        assert qkt._triton_rows(xc, False) is not None     # unset: the Triton kernel
        assert qkt._triton_rows(xc.double(), False) is None  # FP32 only
        monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", "0")
        assert qkt._triton_rows(xc, False) is None         # 0: torch ops
        monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", "yes")
        with pytest.raises(ValueError, match="FP8ATTN_TRITON_HADAMARD"):
            qkt.rotate(x.cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_GPU and HAS_TRITON), reason="needs a CUDA GPU, fp8attn's CUDA kernels and triton")
def test_gpu_kernel_and_op_equal_the_torch_path(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(5)
    for d in (64, 128, 192, 256, 80):
        x = torch.randn(3, 4, 333, d, device="cuda", generator=g) * 30
        monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", "0")
        ref = (qkt.rotate(x), qkt.rotate_transposed(x))
        monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", "1")
        got = (qkt.rotate(x), qkt.rotate_transposed(x))
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), d
    # A leaf that requires grad takes the torch ops (autograd records them): same values, a
    # grad_fn, the gradient g R^T (what context_parallel's transform relies on).
    monkeypatch.delenv("FP8ATTN_TRITON_HADAMARD", raising=False)
    leaf = x.clone().requires_grad_()
    y = qkt.rotate(leaf)
    assert y.grad_fn is not None and torch.equal(y.detach(), ref[0])
    dy = torch.randn(y.shape, device="cuda", generator=g)
    y.backward(dy)
    torch.testing.assert_close(leaf.grad, qkt.rotate_transposed(dy), rtol=1e-5, atol=1e-5)
    # Under torch.compile (fullgraph) the torch ops are traced, not the user kernel: it compiles
    # and gives the eager values (inductor's fused code; tolerance for its FP32 reassociation).
    torch._dynamo.reset()
    comp = torch.compile(qkt.rotate, fullgraph=True)(x)
    torch.testing.assert_close(comp, qkt.rotate(x), rtol=1e-5, atol=1e-5)
    # Through the op (tile recipe, forward and backward): the same outputs with and without it.
    q = torch.randn(1, 8, 700, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 700, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 700, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(1, 8, 700, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", flag)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fp8attn.attention(*leaves, causal=True, scaling="tile", qk_rotation="hadamard", smooth_k=True)
        o.backward(do)
        outs.append([o.detach()] + [t.grad for t in leaves])
    for a, b, name in zip(*outs, ("O", "dQ", "dK", "dV")):
        assert not torch.isnan(a).any(), name
        assert torch.equal(a, b), name


def test_kernel_only_where_nothing_records_or_traces_the_rotation(monkeypatch):
    """_triton_eligible: the kernel has no backward and launches on real data, so it runs
    only where autograd does not record the rotation and no fake / proxy trace is on.
    Guards the fault found in review (2026-12-07): with the kernel on by default,
    context_parallel's transform (which differentiates through rotate) got Q', K' without
    grad_fn, so ring attention with qk_rotation="hadamard" on CUDA dropped dQ and dK
    silently; and a FakeTensor under FakeTensorMode reached the kernel."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("FP8ATTN_TRITON_HADAMARD", raising=False)
    # Stand-ins for an FP32 CUDA tensor (this check runs on machines without a GPU).
    plain = SimpleNamespace(is_cuda=True, dtype=torch.float32, requires_grad=False)
    leaf = SimpleNamespace(is_cuda=True, dtype=torch.float32, requires_grad=True)
    assert qkt._triton_eligible(plain)
    assert not qkt._triton_eligible(leaf)               # autograd would record the rotation
    with torch.no_grad():
        assert qkt._triton_eligible(leaf)               # nothing records it: the kernel
    assert not qkt._triton_eligible(SimpleNamespace(is_cuda=True, dtype=torch.float64, requires_grad=False))
    monkeypatch.setenv("FP8ATTN_TRITON_HADAMARD", "0")
    assert not qkt._triton_eligible(plain)
    monkeypatch.delenv("FP8ATTN_TRITON_HADAMARD")

    # A fake CUDA tensor (no GPU needed) never reaches the kernel; the torch ops give the shape.
    def spy(*a, **k):
        raise AssertionError("the Triton kernel was called on a fake tensor")
    from fp8attn import hadamard_triton as ht
    monkeypatch.setattr(ht, "rotate_rows", spy)
    with FakeTensorMode():
        x = torch.empty(3, 5, 128, device="cuda")
        assert not qkt._triton_eligible(x)
        assert qkt.rotate(x).shape == (3, 5, 128) and qkt.rotate_transposed(x).shape == (3, 5, 128)
    assert not qkt._triton_eligible(x)                  # a FakeTensor outside the mode too
