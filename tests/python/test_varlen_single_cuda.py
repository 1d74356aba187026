"""GPU tests of the single-launch packed-batch path (issue 19; csrc/hopper/varlen_sm90.h):
`varlen_attention` on CUDA tensors with scaling="tile" runs fp8attn::fwd_varlen and
fp8attn::bwd_varlen, one launch per kernel for the whole packed batch (metadata,
quantization, the tile forward / pre-pass / main backward / dQ convert, gap
clearing), cu_seqlens read on the device only.

What is checked, on fresh random inputs, every element:
  - the forward is bit-identical to the per-sequence loop (FP8ATTN_VARLEN_LOOP=1:
    one dense `fwd` call per sequence, whose kernels test_tile_cuda.py checks
    against the CPU reference), over sequence lengths 0, 1, 127, 128, 129 and
    several tiles, seqlen_q != seqlen_k per sequence, GQA, causal both ways,
    sliding windows, every kernel head_dim (64, 128, 192/128, 256, and a padded
    96), seqused_q / seqused_k, int64 cu_seqlens, more than 1024 sequences (the
    metadata kernel's scan rounds), float32 / float16 inputs;
  - against the CPU reference's `tile` path (numerics.md section 6 tolerance);
  - tokens outside every sequence: O = 0, LSE = -inf, NaN stored there reaches
    nothing (outputs are poisoned with NaN first, so an unwritten row fails);
  - no host sync with check=False (torch.cuda.set_sync_debug_mode("error")),
    check=True raises the value errors, and cu_seqlens that break the rules
    (decreasing, past the total, negative) neither crash nor corrupt the context;
  - torch.compile(fullgraph=True) traces it, new cu_seqlens values do not
    recompile;
  - the backward (fp8attn::bwd_varlen, one launch per kernel) equals the
    per-sequence loop's gradients (dK / dV bitwise; dQ to the dQ reduce-add's
    run-to-run tolerance) over the same head dims, windows, seqused, GQA, the
    three delta modes, > 1024 sequences; its diagnostics too; tokens outside
    every sequence get zero gradients.
Skips cleanly without a GPU or without the CUDA kernels.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_varlen_single_cuda.py
"""
import random

import pytest
import torch

import fp8attn
from test_cuda import check_close  # noqa: F401 (skips the module without a GPU, as test_tile_cuda.py)
from test_cuda_bwd import needs_gpu, poison_cuda_allocator

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for knob in ("FP8ATTN_TILE_FWD", "FP8ATTN_TILE_BWD", "FP8ATTN_TILE_PINGPONG", "FP8ATTN_TILE_PERSISTENT",
                 "FP8ATTN_VARLEN_LOOP"):
        monkeypatch.delenv(knob, raising=False)


def cu(lens, dtype=torch.int32):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device="cuda")


def packed(lens_q, lens_k, hq=4, hkv=2, d=128, dv=None, tail_q=0, tail_k=0, dtype=torch.bfloat16, seed=0):
    dv = d if dv is None else dv
    g = torch.Generator(device="cpu").manual_seed(seed)
    tq, tk = sum(lens_q) + tail_q, sum(lens_k) + tail_k
    q = torch.randn(tq, hq, d, generator=g).to(dtype).cuda()
    k = torch.randn(tk, hkv, d, generator=g).to(dtype).cuda()
    v = torch.randn(tk, hkv, dv, generator=g).to(dtype).cuda()
    return q, k, v


def fwd(q, k, v, cq, ck, loop, monkeypatch, **kw):
    """O, LSE of varlen_attention with the single-launch path (loop=False) or
    the per-sequence loop; outputs start as NaN (poisoned allocator)."""
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "1" if loop else "0")
    poison_cuda_allocator([((q.shape[0], q.shape[1], v.shape[2]), torch.bfloat16),
                           ((q.shape[1], q.shape[0]), torch.float32)])
    kw.setdefault("scaling", "tile")
    out, lse = fp8attn.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    torch.cuda.synchronize()
    return out, lse


def assert_same_as_loop(q, k, v, cq, ck, monkeypatch, **kw):
    o1, l1 = fwd(q, k, v, cq, ck, False, monkeypatch, **kw)
    o2, l2 = fwd(q, k, v, cq, ck, True, monkeypatch, **kw)
    assert not torch.isnan(o1).any() and not torch.isnan(l1).any(), "NaN (an unwritten row?)"
    assert o1.shape == o2.shape and o1.dtype == o2.dtype and o1.is_contiguous()
    assert torch.equal(o1, o2), f"O differs from the per-sequence loop: max |d| {(o1.float() - o2.float()).abs().max()}"
    assert torch.equal(l1, l2), "LSE differs from the per-sequence loop"
    return o1, l1


LENS = [
    ([130, 0, 257, 9, 64], [200, 12, 257, 0, 64]),          # empty sides, seqlen_q != seqlen_k
    ([1, 127, 128, 129, 1], [1, 127, 128, 129, 300]),      # tile edges
    ([700, 5, 384], [700, 900, 2]),                        # several tiles, keys far past queries
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", range(len(LENS)))
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (96, 96)])
def test_fwd_bitwise_as_per_sequence(causal, lens, dims, monkeypatch):
    lens_q, lens_k = LENS[lens]
    q, k, v = packed(lens_q, lens_k, d=dims[0], dv=dims[1], tail_q=3, tail_k=2, seed=lens)
    cq, ck = cu(lens_q), cu(lens_k)
    q[-3:] = float("nan")  # outside every sequence
    k[-2:] = float("nan")
    out, lse = assert_same_as_loop(q, k, v, cq, ck, monkeypatch, causal=causal)
    assert (out[-3:] == 0).all() and (lse[:, -3:] == float("-inf")).all()


@pytest.mark.parametrize("window", [(64, 0), (100, 100), (0, 129), (300, -1), (-1, 40), (5, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_windows_bitwise_as_per_sequence(window, causal, monkeypatch):
    lens_q, lens_k = [300, 1, 513, 0, 200], [250, 40, 513, 7, 600]
    q, k, v = packed(lens_q, lens_k, hq=4, hkv=1, d=128, seed=11)
    assert_same_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=causal, window_size=window)


def test_fwd_seqused_int64_and_gqa(monkeypatch):
    lens = [300, 129, 0, 600, 50]
    q, k, v = packed(lens, lens, hq=8, hkv=2, d=128, tail_q=10, tail_k=10, seed=3)
    used_q = torch.tensor([200, 129, 0, 1, 50], device="cuda")
    used_k = torch.tensor([300, 5, 0, 600, 0], device="cuda", dtype=torch.int32)
    cq, ck = cu(lens, torch.int64), cu(lens, torch.int64)
    out, lse = assert_same_as_loop(q, k, v, cq, ck, monkeypatch, causal=True, seqused_q=used_q, seqused_k=used_k)
    # Unused query tokens are outside every sequence: O = 0, LSE = -inf.
    assert (out[200:300] == 0).all() and (lse[:, 200:300] == float("-inf")).all()


def test_fwd_many_sequences(monkeypatch):
    # > 1024 sequences: the metadata kernel's scan runs several rounds.
    rng = random.Random(5)
    lens_q = [rng.choice([0, 1, 3, 17, 64, 130]) for _ in range(2100)]
    lens_k = [n if rng.random() < 0.7 else rng.choice([0, 9, 200]) for n in lens_q]
    q, k, v = packed(lens_q, lens_k, hq=2, hkv=1, d=64, seed=9)
    assert_same_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fwd_float_inputs(dtype, monkeypatch):
    lens = [200, 77, 300]
    q, k, v = packed(lens, lens, d=128, dtype=dtype, seed=4)
    out, _ = assert_same_as_loop(q, k, v, cu(lens), cu(lens), monkeypatch, causal=True)
    assert out.dtype == dtype


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_against_cpu_reference(causal, monkeypatch):
    lens_q, lens_k = [130, 0, 257, 9], [200, 12, 257, 300]
    q, k, v = packed(lens_q, lens_k, d=128, seed=21)
    cq, ck = cu(lens_q), cu(lens_k)
    out, lse = fwd(q, k, v, cq, ck, False, monkeypatch, causal=causal)
    o_cpu, l_cpu = fp8attn.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cq.cpu(), ck.cpu(), causal=causal,
                                            scaling="tile", return_lse=True)
    o_ex, l_ex = fp8attn.varlen_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), cq.cpu(), ck.cpu(),
                                          causal=causal, precision="exact", return_lse=True)
    check_close("O", out.cpu(), o_cpu, o_ex, f"varlen causal={causal}")
    check_close("LSE", lse.cpu(), l_cpu, l_ex, f"varlen causal={causal}")


def test_no_host_sync_and_checks(monkeypatch):
    lens = [300, 0, 129]
    q, k, v = packed(lens, lens, d=64, seed=2)
    cq = cu(lens)
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "0")
    fp8attn.varlen_attention(q, k, v, cq, cq, causal=True, scaling="tile")  # warm-up (allocator, lazy init)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8attn.varlen_attention(q, k, v, cq, cq, causal=True, scaling="tile")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # check=True: the value errors of the loop path (one sync).
    bad = torch.tensor([0, 300, 200, 429], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fp8attn.varlen_attention(q, k, v, bad, cq, scaling="tile", check=True)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fp8attn.varlen_attention(q, k, v, cq, cq, 100, None, scaling="tile", check=True)
    with pytest.raises(TypeError, match="check"):
        fp8attn.varlen_attention(q, k, v, cq, cq, scaling="tile", check=1)


@pytest.mark.parametrize("cu_bad", [[0, 300, 200, 429], [0, 5000, 6000, 7000], [-50, 10, 429, 429],
                                    [0, 2**31 - 1, 0, -(2**31)]])
def test_unchecked_bad_cu_seqlens_stay_inside(cu_bad, monkeypatch):
    # Unchecked values that break the rules: clamped inside the tensors (no crash,
    # no illegal address: the CUDA context still works afterwards).
    lens = [300, 0, 129]
    q, k, v = packed(lens, lens, d=64, seed=8)
    bad = torch.tensor(cu_bad, device="cuda", dtype=torch.int64)
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "0")
    out = fp8attn.varlen_attention(q, k, v, bad, bad, causal=True, scaling="tile")
    torch.cuda.synchronize()
    assert out.shape == (q.shape[0], 4, 64)
    assert torch.isfinite(torch.ones(3, device="cuda").sum())  # the context is alive


def test_torch_compile_no_recompile(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "0")
    lens_a, lens_b = [300, 0, 129], [100, 200, 129]
    q, k, v = packed(lens_a, lens_a, d=64, seed=6)

    def f(q, k, v, cq, ck):
        return fp8attn.varlen_attention(q, k, v, cq, ck, causal=True, scaling="tile")

    g = torch.compile(f, fullgraph=True)
    out_a = g(q, k, v, cu(lens_a), cu(lens_a))
    with torch._dynamo.config.patch(error_on_recompile=True):
        out_b = g(q, k, v, cu(lens_b), cu(lens_b))
    assert torch.equal(out_a, f(q, k, v, cu(lens_a), cu(lens_a)))
    assert torch.equal(out_b, f(q, k, v, cu(lens_b), cu(lens_b)))


def grads(q, k, v, cq, ck, dout, loop, monkeypatch, **kw):
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "1" if loop else "0")
    poison_cuda_allocator([(tuple(t.shape), torch.bfloat16) for t in (q, k, v)])
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kw.setdefault("scaling", "tile")
    fp8attn.varlen_attention(qq, kk, vv, cq, ck, **kw).backward(dout)
    torch.cuda.synchronize()
    return qq.grad, kk.grad, vv.grad


def assert_grads_as_loop(q, k, v, cq, ck, monkeypatch, **kw):
    """dQ, dK, dV of the single launch (forward and backward) against the
    per-sequence loop: dK / dV bitwise (one CTA owns a key tile and walks its
    query tiles in order), dQ to the reduce-add order's rounding."""
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(1))
    dout = dout.to(torch.bfloat16).cuda()
    dq1, dk1, dv1 = grads(q, k, v, cq, ck, dout, False, monkeypatch, **kw)
    dq2, dk2, dv2 = grads(q, k, v, cq, ck, dout, True, monkeypatch, **kw)
    for name, g in (("dQ", dq1), ("dK", dk1), ("dV", dv1)):
        assert not torch.isnan(g).any(), f"{name}: NaN (an unwritten row?)"
    assert torch.equal(dk1, dk2), f"dK differs: max |d| {(dk1.float() - dk2.float()).abs().max()}"
    assert torch.equal(dv1, dv2), f"dV differs: max |d| {(dv1.float() - dv2.float()).abs().max()}"
    rel = (dq1.float() - dq2.float()).norm() / dq2.float().norm().clamp(min=1e-30)
    assert rel.item() < 1e-3, f"dQ: ||single - loop|| / ||loop|| = {rel.item():.3g}"
    return dq1, dk1, dv1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", range(len(LENS)))
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_bwd_as_per_sequence(causal, lens, dims, monkeypatch):
    lens_q, lens_k = LENS[lens]
    q, k, v = packed(lens_q, lens_k, d=dims[0], dv=dims[1], tail_q=3, tail_k=2, seed=30 + lens)
    q[-3:] = float("nan")
    k[-2:] = float("nan")
    dq, dk, dv = assert_grads_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=causal)
    assert (dq[-3:] == 0).all() and (dk[-2:] == 0).all() and (dv[-2:] == 0).all()


@pytest.mark.parametrize("window", [(64, 0), (0, 129), (-1, 40), (5, 5)])
def test_bwd_windows_seqused_gqa(window, monkeypatch):
    lens_q, lens_k = [300, 1, 513, 0, 200], [250, 40, 513, 7, 600]
    q, k, v = packed(lens_q, lens_k, hq=8, hkv=2, d=128, seed=12)
    used_q = torch.tensor([300, 1, 400, 0, 20], device="cuda")
    used_k = torch.tensor([250, 0, 513, 7, 100], device="cuda")
    assert_grads_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, window_size=window, seqused_q=used_q,
                         seqused_k=used_k)


@pytest.mark.parametrize("mode", ["stale", "matched_do", "delta_matching"])
def test_bwd_delta_modes_and_many_sequences(mode, monkeypatch):
    rng = random.Random(17)
    lens_q = [rng.choice([0, 1, 3, 17, 64, 130]) for _ in range(1300)]
    lens_k = [n if rng.random() < 0.7 else rng.choice([0, 9, 200]) for n in lens_q]
    q, k, v = packed(lens_q, lens_k, hq=2, hkv=1, d=64, seed=19)
    assert_grads_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=True, delta_mode=mode)


def test_bwd_diagnostics_as_per_sequence(monkeypatch):
    # The raw ops: diag [4, Hq, total_q] (delta, eps, rowsum_pre, rowsum_post) of
    # the single launch against the loop's, on the rows of sequences with keys.
    lens_q, lens_k = [300, 129, 5], [250, 129, 400]
    q, k, v = packed(lens_q, lens_k, d=128, tail_q=4, seed=23)
    cq, ck = cu(lens_q), cu(lens_k)
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], device="cuda").to(torch.bfloat16)
    res = []
    for loop in ("0", "1"):
        monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", loop)
        out, lse, _ = torch.ops.fp8attn.varlen_fwd(q, k, v, cq, ck, None, None, 128 ** -0.5, True, "fp8", 128,
                                                   "delta_matching", "e4m3", None, "tile")
        res.append(torch.ops.fp8attn.varlen_bwd(dout, q, k, v, out, lse, cq, ck, 128 ** -0.5, True, "fp8",
                                                "delta_matching", 128, "e4m3", True, "tile"))
    d1, d2 = res[0][3], res[1][3]
    assert d1.shape == d2.shape == (4, q.shape[1], q.shape[0])
    assert torch.isfinite(d1).all()
    n = sum(lens_q)
    assert torch.equal(d1[0, :, :n], d2[0, :, :n]), "delta differs"
    rel = (d1[:, :, :n] - d2[:, :, :n]).norm() / d2[:, :, :n].norm()
    assert rel.item() < 1e-5, f"diagnostics: {rel.item():.3g}"
    assert (d1[:, :, n:] == 0).all()


def test_cpu_cu_seqlens_are_taken(monkeypatch):
    # cu_seqlens / seqused on the CPU with CUDA q (the loop always took them): copied to
    # q's device, the same bits as device ones (O; dK / dV; dQ to the reduce-add order).
    lens = [300, 0, 129]
    q, k, v = packed(lens, lens, d=64, seed=31)
    used = torch.tensor([200, 0, 129])
    o1, l1 = fwd(q, k, v, cu(lens).cpu(), cu(lens).cpu(), False, monkeypatch, causal=True, seqused_q=used)
    o2, l2 = fwd(q, k, v, cu(lens), cu(lens), False, monkeypatch, causal=True, seqused_q=used.cuda())
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    dout = torch.randn(q.shape[0], 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    g1 = grads(q, k, v, cu(lens).cpu(), cu(lens).cpu(), dout, False, monkeypatch, causal=True, seqused_q=used)
    g2 = grads(q, k, v, cu(lens), cu(lens), dout, False, monkeypatch, causal=True, seqused_q=used.cuda())
    assert torch.equal(g1[1], g2[1]) and torch.equal(g1[2], g2[2])
    assert ((g1[0].float() - g2[0].float()).norm() / g2[0].float().norm()).item() < 1e-3


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_rotation_single_launch_as_per_sequence(dims, monkeypatch):
    """qk_rotation="hadamard" in the single launch (the quantization rotates the packed
    rows, numerics.md 10.3) against the per-sequence loop (the dense op's fused
    rotation): forward bit for bit, dK / dV bit for bit, dQ to the reduce-adds' order.
    Tokens outside every sequence hold NaN: never read, zero gradients."""
    lens_q, lens_k = LENS[0]
    q, k, v = packed(lens_q, lens_k, d=dims[0], dv=dims[1], tail_q=3, tail_k=2, seed=40)
    q[-3:] = float("nan")
    k[-2:] = float("nan")
    from fp8attn import varlen as _varlen
    assert _varlen._single_launch(q, k, v, cu(lens_q), "fp8", "tile", "hadamard", False, 0.0)
    for causal in (False, True):
        assert_same_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=causal, qk_rotation="hadamard")
        dq, dk, dv = assert_grads_as_loop(q, k, v, cu(lens_q), cu(lens_k), monkeypatch, causal=causal,
                                          qk_rotation="hadamard")
        assert (dq[-3:] == 0).all() and (dk[-2:] == 0).all() and (dv[-2:] == 0).all()


def test_rotation_at_padded_head_dims_and_smoothing_loop(monkeypatch):
    """The single launch takes the rotation only where the quantization fuses it, and
    never smooth_k (per-sequence means): the loop runs those."""
    from fp8attn import varlen as _varlen
    q, k, v = packed([100, 50], [100, 50], d=96, dv=96, seed=41)
    assert not _varlen._single_launch(q, k, v, cu([100, 50]), "fp8", "tile", "hadamard", False, 0.0)
    q, k, v = packed([100, 50], [100, 50], d=128, dv=128, seed=41)
    assert not _varlen._single_launch(q, k, v, cu([100, 50]), "fp8", "tile", "hadamard", True, 0.0)
    monkeypatch.setenv("FP8ATTN_FUSED_ROTATION", "0")
    assert not _varlen._single_launch(q, k, v, cu([100, 50]), "fp8", "tile", "hadamard", False, 0.0)
