"""GPU tests of qk_rotation="hadamard" and smooth_k on CUDA (docs/numerics.md
section 10): the op applies them around the row kernels with torch ops
(ops.fwd_op / bwd_op, unfused). Checked against the CPU reference with the same
options on the same inputs, every element, with the kernel tolerances of
numerics.md section 6 (check_close of test_cuda.py, whose exact results are the
CPU exact path, unchanged by the options); the CUDA transforms equal the CPU
ones (rotation bit for bit; the mean up to the FP64 summation order); the raw
CUDA op refuses the options naming the argument; and on training-shaped inputs
the CUDA errors drop as the reference's do.

Skips cleanly without a GPU or without the CUDA kernels compiled in.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_cuda_qk_transform.py
"""
import math
import os
import sys

import pytest
import torch

import fp8attn
from fp8attn import qk_transform as qkt

from test_cuda import check_close, make_qkv, randn, seed_of  # noqa: F401 (skips without a GPU)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import recipe_study  # noqa: E402

pytestmark = pytest.mark.gpu

OPTIONS = [("hadamard", False), ("none", True), ("hadamard", True)]
SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (1, 4, 2, 200, 333, 64, 64),
    (2, 6, 2, 257, 129, 128, 128),
    (1, 4, 2, 300, 300, 192, 128),
    (1, 2, 1, 130, 200, 80, 80),   # zero-padded head dim, Hadamard blocks 64 + 16
]


def _run(q, k, v, do, causal, rot, sm, device, precision="fp8"):
    # detach + clone: fresh leaves, the caller's tensors untouched (a .to() that is a no-op
    # would set requires_grad on them, and the next call's q.double() would be no leaf).
    qq, kk, vv = (t.detach().clone().to(device).requires_grad_() for t in (q, k, v))
    o, lse = fp8attn.attention(qq, kk, vv, causal=causal, precision=precision, qk_rotation=rot, smooth_k=sm,
                               return_lse=True)
    o.backward(do.to(device))
    return tuple(t.detach().cpu() for t in (o, lse, qq.grad, kk.grad, vv.grad))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rot,sm", OPTIONS)
def test_cuda_matches_the_reference_with_the_options(shape, causal, rot, sm):
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(*shape, seed=seed_of("qkt", shape, causal, rot, sm))
    k = (k.float() + 3.0 * torch.randn(b, hkv, 1, d)).bfloat16()  # a common key component
    do = randn(b, hq, sq, dv, gen=torch.Generator().manual_seed(seed_of("qkt-do", shape)))
    cuda = _run(q, k, v, do, causal, rot, sm, "cuda")
    cpu = _run(q, k, v, do, causal, rot, sm, "cpu")
    exact = _run(q.double(), k.double(), v.double(), do.double(), causal, "none", False, "cpu", "exact")
    label = f"{shape} causal={causal} {rot} smooth_k={sm}"
    for name, c, r, e in zip(("O", "LSE", "dQ", "dK", "dV"), cuda, cpu, exact):
        assert torch.isfinite(c[torch.isfinite(r)]).all(), f"{label} {name}: NaN"
        check_close(name, c, r, e, label)


@pytest.mark.parametrize("d", [64, 80, 128, 192, 256])
def test_cuda_transforms_equal_the_cpu_ones(d):
    q = torch.randn(2, 4, 100, d)
    k = torch.randn(2, 2, 150, d) + 3.0 * torch.randn(2, 2, 1, d)
    for dt in (torch.bfloat16, torch.float32):
        qc, kc, mc = qkt.transform_qk(q.to(dt), k.to(dt), "hadamard", False)
        qg, kg, mg = qkt.transform_qk(q.to(dt).cuda(), k.to(dt).cuda(), "hadamard", False)
        assert torch.equal(qc, qg.cpu()) and torch.equal(kc, kg.cpu())
        g = torch.randn(2, 2, 150, d)
        dq_c, dk_c = qkt.map_grads_back(g, g, "hadamard", False, dt, dt)
        dq_g, dk_g = qkt.map_grads_back(g.cuda(), g.cuda(), "hadamard", False, dt, dt)
        assert torch.equal(dq_c, dq_g.cpu()) and torch.equal(dk_c, dk_g.cpu())
        # Smoothing: the FP64 sum order may differ; the FP32 mean by at most 1 ulp.
        _, _, mc = qkt.transform_qk(q.to(dt), k.to(dt), "none", True)
        _, _, mg = qkt.transform_qk(q.to(dt).cuda(), k.to(dt).cuda(), "none", True)
        assert torch.allclose(mc, mg.cpu(), rtol=2 ** -23, atol=0)


def test_raw_cuda_op_refuses_the_options_naming_them():
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 2, 16, 16, 64, 64, seed=1))
    with pytest.raises(NotImplementedError, match="'qk_rotation'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "row", "hadamard", False)
    with pytest.raises(NotImplementedError, match="'smooth_k'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "row", "none", True)


def test_cuda_varlen_smooths_per_sequence():
    lens = [100, 37, 200]
    cu = torch.tensor([0, 100, 137, 337], dtype=torch.int32)
    q = torch.randn(337, 4, 64).bfloat16()
    k = torch.cat([torch.randn(n, 2, 64) + 4.0 * torch.randn(1, 2, 64) for n in lens]).bfloat16()
    v = torch.randn(337, 2, 64).bfloat16()
    kw = dict(causal=True, qk_rotation="hadamard", smooth_k=True)
    got = fp8attn.varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), cu.cuda(), **kw).cpu()
    o = 0
    for n in lens:
        one = fp8attn.attention(*(t[o:o + n].transpose(0, 1)[None].cuda() for t in (q, k, v)), **kw)
        assert torch.equal(got[o:o + n], one[0].transpose(0, 1).cpu())
        o += n


@pytest.mark.parametrize("kind,option,ratio", [("training", "hadamard", 0.6), ("common_key", "smooth_k", 0.6)])
def test_cuda_errors_drop_on_training_shaped_inputs(kind, option, ratio):
    g = torch.Generator().manual_seed(1)
    q, k, v, do = recipe_study.inputs(kind, 2048, 2048, 128, g)
    ex = recipe_study.exact(q, k, v, do, 1 / math.sqrt(128), True)
    rot, sm = ("hadamard", False) if option == "hadamard" else ("none", True)
    errs = {}
    for name, (r, s) in (("none", ("none", False)), (option, (rot, sm))):
        o, lse, dq, dk, dv = _run(*(t.bfloat16()[None, None] for t in (q, k, v, do)), True, r, s, "cuda")
        errs[name] = recipe_study.errors(dict(o=o[0, 0], lse=lse[0, 0], dq=dq[0, 0], dk=dk[0, 0], dv=dv[0, 0]), ex)
    for key in ("o", "dq", "dk", "dv"):
        assert errs[option][key] <= ratio * errs["none"][key], (key, errs)


@pytest.mark.parametrize("scaling", ["row", "tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_torch_compile_grads_equal_eager(dtype, scaling, monkeypatch):
    """torch.compile(fullgraph=True) of attention with both options on CUDA tensors (the
    unfused torch path around the kernels, the path the compile zero-gradient bug of
    2026-12-03 was in): the forward and dQ, dK, dV bit for bit eager's, and nonzero.
    The guarded failure: an autograd.Function returning a no-op .to() alias of its
    output gave all-zero gradients under compile for float32 inputs (ops.as_dtype)."""
    monkeypatch.setenv("FP8ATTN_TILE_BWD", "1")   # the tile backward (the default; set in case the environment turns it off)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 200, 64, generator=g).to(dtype).cuda() for _ in range(3))
    k = k + 3.0

    def step(q, k, v):
        o = fp8attn.attention(q, k, v, causal=True, scaling=scaling, qk_rotation="hadamard", smooth_k=True)
        return (o.float() ** 2).sum()

    got_g, want_g = [], []
    for fn, out in ((torch.compile(step, fullgraph=True, backend="aot_eager"), got_g), (step, want_g)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        loss = fn(qq, kk, vv)
        out.append(loss.detach())
        out.extend(torch.autograd.grad(loss, (qq, kk, vv)))
    assert all(torch.isfinite(x).all() and x.abs().max() > 0 for x in want_g[1:])
    assert all(torch.equal(a, b) for a, b in zip(got_g, want_g))
    torch._dynamo.reset()
