"""GPU tests of qk_rotation="hadamard" and smooth_k on CUDA (docs/numerics.md
section 10): the op applies them around the row kernels with torch ops
(ops.fwd_op / bwd_op, unfused); with scaling="tile" the rotation runs inside the
quantization kernel (the fused rotation, section 10.3), checked against the
path around the op bit for bit and against the reference. Checked against the CPU reference with the same
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


def test_raw_cuda_op_refuses_the_options_naming_them(monkeypatch):
    """The raw CUDA op rotates only inside the `tile` quantization at unpadded head dims
    (numerics.md 10.3) and never smooths; everything else is refused naming the argument."""
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 2, 16, 16, 64, 64, seed=1))
    with pytest.raises(NotImplementedError, match="'qk_rotation'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "row", "hadamard", False)
    with pytest.raises(NotImplementedError, match="'smooth_k'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "row", "none", True)
    with pytest.raises(NotImplementedError, match="'smooth_k'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "tile", "hadamard", True)
    q80, k80, v80 = (t.cuda() for t in make_qkv(1, 2, 2, 16, 16, 80, 80, seed=1))
    with pytest.raises(NotImplementedError, match="'qk_rotation'.*head_dim_qk 80"):
        torch.ops.fp8attn.fwd(q80, k80, v80, 0.125, False, "fp8", 128, "tile", "hadamard", False)
    monkeypatch.setenv("FP8ATTN_FUSED_ROTATION", "0")
    with pytest.raises(NotImplementedError, match="FP8ATTN_FUSED_ROTATION=0"):
        torch.ops.fp8attn.fwd(q, k, v, 0.125, False, "fp8", 128, "tile", "hadamard", False)


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (64, 128), (192, 128), (192, 192), (256, 256),
                                  (128, 64), (256, 200)])
def test_fused_rotation_eligibility_is_the_raw_ops(d, dv):
    """ops._fused_rotation (which path fp8attn.attention takes) says yes exactly where the
    raw CUDA op accepts qk_rotation (its kernel head dims unpadded)."""
    from fp8attn import ops
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 1, 40, 50, d, dv, seed=2))
    try:
        torch.ops.fp8attn.fwd(q, k, v, d ** -0.5, False, "fp8", 128, "tile", "hadamard", False)
        accepted = True
    except NotImplementedError:
        accepted = False
    assert ops._fused_rotation(q, v, "hadamard", "tile") == accepted
    assert accepted == (d in (64, 128, 256) and dv <= d or d == 192 and dv <= 128)


FUSED_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv): every head_dim the fused rotation takes, GQA, ragged tiles
    (1, 4, 2, 200, 333, 64, 64),
    (2, 6, 2, 257, 129, 128, 128),
    (1, 4, 2, 300, 300, 192, 128),
    (1, 2, 1, 130, 260, 256, 256),
]


def _paths(q, k, v, do, causal, sm, monkeypatch, dtype):
    """(O, LSE, dQ, dK, dV) of attention(scaling='tile', hadamard) with the rotation fused
    into the quantization and around the raw op (FP8ATTN_FUSED_ROTATION=1 / 0)."""
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("FP8ATTN_FUSED_ROTATION", fused)
        qq, kk, vv = (t.detach().clone().to(dtype).cuda().requires_grad_() for t in (q, k, v))
        o, lse = fp8attn.attention(qq, kk, vv, causal=causal, scaling="tile", qk_rotation="hadamard",
                                   smooth_k=sm, return_lse=True)
        o.backward(do.to(dtype).cuda())
        out[fused] = tuple(t.detach().cpu() for t in (o, lse, qq.grad, kk.grad, vv.grad))
    return out["1"], out["0"]


def _fused_inputs(shape, *key):
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(*shape, seed=seed_of("fused-rot", shape, *key))
    k = (k.float() + 2.0 * torch.randn(b, hkv, 1, d)).bfloat16()  # a common key component
    q = (q.float() * (1 + 8 * (torch.arange(d) < 2))).bfloat16()  # two outlier channels
    do = randn(b, hq, sq, dv, gen=torch.Generator().manual_seed(seed_of("fused-rot-do", shape)))
    return q, k, v, do


@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sm", [False, True], ids=["rot", "rot+smooth"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_rotation_equals_the_rotation_around_the_op(shape, causal, sm, dtype, monkeypatch):
    """numerics.md 10.3: the quantizer's rotation forms BF16(Q R), BF16(K R) from the
    values the torch / Triton path reads (its operations in its order), so the forward
    (deterministic kernels) is the same bit for bit, and so are dK and dV (no atomics;
    the map-back is the same FP32 arithmetic). dQ sums its partials with atomics in
    either path, in an order that changes from run to run: within one BF16 ulp of its
    largest entry. The failure guarded: a butterfly across the wrong lanes, a sign or
    norm off, an FP32 input read as BF16 before the rotation."""
    q, k, v, do = _fused_inputs(shape, causal, sm)
    fused, around = _paths(q, k, v, do, causal, sm, monkeypatch, dtype)
    label = f"{shape} causal={causal} smooth_k={sm} {dtype}"
    for name, f, a in zip(("O", "LSE", "dQ", "dK", "dV"), fused, around):
        assert not torch.isnan(f).any(), f"{label} {name}: NaN"
        if name == "dQ":
            scale = a.double().abs().max().clamp_min(1e-30)
            assert (f.double() - a.double()).abs().max() <= 2 ** -7 * scale, f"{label} dQ"
        else:
            assert torch.equal(f, a), f"{label} {name}: max diff {(f.double() - a.double()).abs().max()}"


@pytest.mark.parametrize("shape", FUSED_SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_fused_rotation_fp16_is_no_worse_than_around_the_op(shape, monkeypatch):
    """FP16 inputs: the fused path rotates the FP16 values read exactly as FP32 and
    rounds Q' to BF16 once; the path around the op stores Q' in FP16 and the kernels
    round that to BF16 (two roundings). So they differ in the last bits; each output's
    error against float64 attention is no more than 1.1x the other path's (+1e-4)."""
    q, k, v, do = _fused_inputs(shape, "fp16")
    fused, around = _paths(q, k, v, do, True, True, monkeypatch, torch.float16)
    exact = _run(q.double(), k.double(), v.double(), do.double(), True, "none", False, "cpu", "exact")
    for name, f, a, e in zip(("O", "LSE", "dQ", "dK", "dV"), fused, around, exact):
        fin = torch.isfinite(e)  # LSE = -inf where a causal row sees no key (seqlen_q > seqlen_k)
        assert torch.equal(torch.isfinite(f), fin), f"{shape} {name}: non-finite pattern"
        f, a, e = f[fin], a[fin], e[fin]
        err = lambda x: ((x.double() - e).norm() / e.norm()).item()  # noqa: E731
        assert err(f) <= 1.1 * err(a) + 1e-4, (shape, name, err(f), err(a))


@pytest.mark.parametrize("shape", FUSED_SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rot,sm", [("hadamard", False), ("hadamard", True)])
def test_fused_rotation_matches_the_reference(shape, causal, rot, sm):
    """The `tile` CUDA path with the fused rotation against the CPU reference with the same
    options, every element, with the kernel tolerances (check_close)."""
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(*shape, seed=seed_of("fused-ref", shape, causal, rot, sm))
    k = (k.float() + 3.0 * torch.randn(b, hkv, 1, d)).bfloat16()
    do = randn(b, hq, sq, dv, gen=torch.Generator().manual_seed(seed_of("fused-ref-do", shape)))
    res = {}
    for dev in ("cuda", "cpu"):
        qq, kk, vv = (t.detach().clone().to(dev).requires_grad_() for t in (q, k, v))
        o, lse = fp8attn.attention(qq, kk, vv, causal=causal, scaling="tile", qk_rotation=rot, smooth_k=sm,
                                   return_lse=True)
        o.backward(do.to(dev))
        res[dev] = tuple(t.detach().cpu() for t in (o, lse, qq.grad, kk.grad, vv.grad))
    exact = _run(q.double(), k.double(), v.double(), do.double(), causal, "none", False, "cpu", "exact")
    label = f"{shape} causal={causal} tile {rot} smooth_k={sm}"
    for name, c, r, e in zip(("O", "LSE", "dQ", "dK", "dV"), res["cuda"], res["cpu"], exact):
        check_close(name, c, r, e, label)


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
