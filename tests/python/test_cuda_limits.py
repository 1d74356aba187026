"""GPU tests at the launch and size limits (issue 16 item 3), marked slow.

gridDim.y / gridDim.z are at most 65535: more batch entries or heads run as
several launches on offset pointers (csrc/hopper/launch_sm90.h; the chunking
itself is tested on the host in tests/cpp/test_cuda_shapes.cpp). Element
offsets are 64-bit, so tensors of 2^31 and more elements work, and sequences
of 1M tokens and more (seqlen < 2^30). Where the CPU reference would take hours
these check against what must be equal instead (the identities, with
negative controls, shown on the CPU reference in test_limits_identities.py):

  - batch x heads >= 65536 (chunks on y, on z, and a GQA group of more than
    65535 query heads): a few (batch, head) slices at the chunk boundaries
    against a call on that slice alone (bitwise: O, LSE, codes, scales, dK,
    dV; dQ to the order of its FP32 atomics), one slice also against the CPU
    reference;
  - a causal 1M-token sequence: its first rows against the same op on the first
    N tokens only (causal: they see no later key), its last keys' dK, dV (stale
    delta) against the op on the last N tokens, the last rows' O, LSE, dQ
    against float64 attention on the GPU, the first-N window against the CPU
    reference;
  - tensors of more than 2^31 elements (quantization, forward, backward, and
    varlen): the slice past element 2^31 against a call on it alone, and
    against float64 attention on the GPU (numerics.md section 6's fp8-vs-exact
    bounds of test_op.py: O, LSE 0.08, gradients 0.15).

Each test needs <= ~50 GB of GPU memory (skips with the reason when less is
free) and runs in well under a minute on an H200.
Run: PYTHONPATH=python python3 -m pytest -q -m slow tests/python/test_cuda_limits.py
"""
import math

import pytest
import torch

import fp8attn
from test_cuda import OPS, check_close, f32_scale, make_qkv, ref_fwd, seed_of  # noqa: F401 (skips without a GPU)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BIG = 1 << 31


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    torch.cuda.empty_cache()
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def need_gb(gb):
    free, _ = torch.cuda.mem_get_info()
    if free < gb * 2**30:
        pytest.skip(f"needs {gb} GB of free GPU memory, {free / 2**30:.1f} GB free")


def cuda_randn(*shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def assert_dq_close(got, want, label):
    """dQ sums FP32 partials of key tiles with atomics, in an order that may
    differ between calls: results agree to a BF16 rounding (2^-8 relative)."""
    assert torch.isfinite(got).all(), f"{label}: non-finite dQ"
    torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-6 * want.abs().max().item(), msg=label)


def exact_rows(q, k, v, tau, row0, sq, causal, dout=None, chunk=1 << 18):
    """Float64 attention of query rows row0 .. row0 + n of one head on the GPU
    (q [n, d]; k, v [Sk, d], all its keys), chunked over keys: O, LSE and, with
    dout, dQ of these rows and dK, dV from these rows (all of dK, dV when these
    are all the queries)."""
    q, k, v = q.double(), k.double(), v.double()
    n, sk = q.shape[0], k.shape[0]
    last = torch.arange(row0, row0 + n, device=q.device) + (sk - sq)  # causal: the last key each row sees

    def scores(j0, j1):
        s = (q @ k[j0:j1].T) * tau
        if causal:
            cols = torch.arange(j0, j1, device=q.device)
            s = s.masked_fill(cols[None, :] > last[:, None], float("-inf"))
        return s

    m = torch.full((n,), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros(n, dtype=torch.float64, device=q.device)
    acc = torch.zeros(n, v.shape[1], dtype=torch.float64, device=q.device)
    for j0 in range(0, sk, chunk):
        s = scores(j0, min(sk, j0 + chunk))
        m_new = torch.maximum(m, s.amax(1))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_new), torch.zeros_like(m))
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(1)
        acc = acc * alpha[:, None] + p @ v[j0:j0 + chunk]
        m = m_new
    o, lse = acc / l[:, None], m + torch.log(l)
    if dout is None:
        return o, lse
    do = dout.double()
    delta = (do * o).sum(1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j0 in range(0, sk, chunk):
        j1 = min(sk, j0 + chunk)
        p = torch.exp(scores(j0, j1) - lse[:, None])
        dv[j0:j1] = p.T @ do
        ds = p * (do @ v[j0:j1].T - delta[:, None])
        dq += tau * (ds @ k[j0:j1])
        dk[j0:j1] = tau * (ds.T @ q)
    return o, lse, dq, dk, dv


# ---- batch x heads >= 65536 ---------------------------------------------------------------

# (batch, heads_q, heads_kv): heads on gridDim.y in whole GQA groups (65530 + 4470
# query heads), batch on gridDim.z (65535 + 4465), and a GQA group of 65536 query
# heads (pieces of one group; the backward main kernel loops over the group).
MANY = [(1, 70000, 7000), (70000, 1, 1), (1, 131072, 2)]


def group_slices(b, hq, hkv):
    """(batch index, kv head) pairs whose slices (a kv head and its query heads)
    straddle the launch chunks; a slice call itself is one launch when its group
    has <= 65535 query heads."""
    if b > 1:
        return [(i, 0) for i in (0, 65534, 65535, b - 1)]
    group = hq // hkv
    if group > 65535:
        return [(0, hkv - 1)]
    return [(0, hk) for hk in (0, 65529 // group, 65535 // group, hkv - 1)]


@pytest.mark.parametrize("b,hq,hkv", MANY, ids=lambda x: str(x))
def test_many_heads_fwd_bwd(b, hq, hkv):
    need_gb(40)
    sq, sk, d = 100, 70, 64
    group = hq // hkv
    q = cuda_randn(b, hq, sq, d, seed=seed_of("many-q", b, hq))
    k = cuda_randn(b, hkv, sk, d, seed=seed_of("many-k", b, hq))
    v = cuda_randn(b, hkv, sk, d, seed=seed_of("many-v", b, hq))
    dout = cuda_randn(b, hq, sq, d, seed=seed_of("many-do", b, hq))
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    # Causal, bottom-right aligned with sq > sk: the first sq - sk query rows see no key
    # (numerics.md section 1: O = 0, LSE = -inf there), every later row is finite.
    blind = sq - sk
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., blind:]).all()
    assert torch.isneginf(lse[..., :blind]).all() and not out[..., :blind, :].any()
    dq, dk, dv, _ = OPS.bwd(dout, q, k, v, out, lse, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    label0 = f"{(b, hq, hkv)}"
    # A kv head with its query heads, alone: every output of theirs.
    for bi, hk in group_slices(b, hq, hkv):
        bs, qs, ks = slice(bi, bi + 1), slice(hk * group, (hk + 1) * group), slice(hk, hk + 1)
        args = (q[bs, qs], k[bs, ks], v[bs, ks])
        o1, l1 = OPS.fwd(*args, tau, True, "fp8", 128)
        label = f"{label0} batch {bi} kv head {hk}"
        assert torch.equal(out[bs, qs], o1), label + ": O"
        assert torch.equal(lse[bs, qs], l1), label + ": LSE"
        g1 = OPS.bwd(dout[bs, qs], *args, o1, l1, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
        assert torch.equal(dk[bs, ks], g1[1]), label + ": dK"
        assert torch.equal(dv[bs, ks], g1[2]), label + ": dV"
        assert_dq_close(dq[bs, qs], g1[0], label + ": dQ")
        del args, o1, l1, g1
    # Single query heads at the chunk boundaries, alone (one launch each): O, LSE
    # and dQ (a query row's dQ needs only its own row and its kv head).
    if b == 1:
        for h in sorted({0, 65534, 65535, 65536, hq - 1} & set(range(hq))):
            hk = h // group
            args = (q[:, h:h + 1], k[:, hk:hk + 1], v[:, hk:hk + 1])
            o1, l1 = OPS.fwd(*args, tau, True, "fp8", 128)
            assert torch.equal(out[:, h:h + 1], o1) and torch.equal(lse[:, h:h + 1], l1), f"{label0} head {h}"
            g1 = OPS.bwd(dout[:, h:h + 1], *args, o1, l1, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
            assert_dq_close(dq[:, h:h + 1], g1[0], f"{label0} head {h}: dQ")
    # A few query heads of the last slice against the CPU reference.
    bi, hk = group_slices(b, hq, hkv)[-1]
    hs, ks = slice(hk * group, hk * group + min(group, 4)), slice(hk, hk + 1)
    qc, kc, vc = q[bi:bi + 1, hs].cpu(), k[bi:bi + 1, ks].cpu(), v[bi:bi + 1, ks].cpu()
    (o_cpu, l_cpu), (o_ex, l_ex) = ref_fwd(qc, kc, vc, True)
    check_close("O", out[bi:bi + 1, hs].cpu(), o_cpu, o_ex, label0 + " vs CPU")
    check_close("LSE", lse[bi:bi + 1, hs].cpu(), l_cpu, l_ex, label0 + " vs CPU")


def test_many_heads_quantize_bitexact():
    need_gb(10)
    b, h, s, d = 2, 35000, 130, 64  # 70000 (b, h) rows on gridDim.z: two launches
    x = cuda_randn(b, h, s, d, seed=seed_of("quant-many"))
    for dim in (3, 2):
        codes, scales = OPS.quantize_blockwise(x, dim, 128, "e4m3")
        for bh in (0, 65534, 65535, 65536, b * h - 1):
            bi, hi = divmod(bh, h)
            xs = x[bi:bi + 1, hi:hi + 1]
            c1, s1 = OPS.quantize_blockwise(xs, dim, 128, "e4m3")
            assert torch.equal(codes[bi:bi + 1, hi:hi + 1], c1) and torch.equal(scales[bi:bi + 1, hi:hi + 1], s1), bh
            cr, sr = OPS.quantize_blockwise(xs.float().cpu(), dim, 128, "e4m3")
            assert torch.equal(c1.cpu(), cr) and torch.equal(s1.cpu(), sr), bh


# ---- 1M tokens ----------------------------------------------------------------------------

S_LONG = 1 << 20
N_WIN = 4224  # 11 * 384: whole 192-row forward tiles and 128-token blocks


def test_causal_1m_tokens_forward():
    need_gb(20)
    hq, hkv, d = 2, 1, 64
    q = cuda_randn(1, hq, S_LONG, d, seed=seed_of("1m-q"))
    k = cuda_randn(1, hkv, S_LONG, d, seed=seed_of("1m-k"))
    v = cuda_randn(1, hkv, S_LONG, d, seed=seed_of("1m-v"))
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # First rows: causal, so they see only the first keys; the block grid starts at
    # token 0 either way: bitwise the op on the first N_WIN tokens.
    w = slice(0, N_WIN)
    o_w, l_w = OPS.fwd(q[:, :, w], k[:, :, w], v[:, :, w], tau, True, "fp8", 128)
    assert torch.equal(out[:, :, w], o_w) and torch.equal(lse[:, :, w], l_w)
    # ... and that window against the CPU reference.
    (o_cpu, l_cpu), (o_ex, l_ex) = ref_fwd(q[:, :, w].cpu(), k[:, :, w].cpu(), v[:, :, w].cpu(), True)
    check_close("O", o_w.cpu(), o_cpu, o_ex, "1M window")
    check_close("LSE", l_w.cpu(), l_cpu, l_ex, "1M window")
    # Last rows (every key): against float64 attention on the GPU.
    n = 256
    for h in range(hq):
        o_ex, l_ex = exact_rows(q[0, h, -n:], k[0, h // (hq // hkv)], v[0, h // (hq // hkv)], tau, S_LONG - n, S_LONG,
                                True)
        assert rel(out[0, h, -n:], o_ex) < 0.08, f"head {h}: O of the last rows"
        assert (lse[0, h, -n:].double() - l_ex).abs().max().item() < 0.02, f"head {h}: LSE of the last rows"


def test_causal_1m_tokens_backward():
    need_gb(20)
    hq, hkv, d = 2, 1, 64
    q = cuda_randn(1, hq, S_LONG, d, seed=seed_of("1mb-q"))
    k = cuda_randn(1, hkv, S_LONG, d, seed=seed_of("1mb-k"))
    v = cuda_randn(1, hkv, S_LONG, d, seed=seed_of("1mb-v"))
    dout = cuda_randn(1, hq, S_LONG, d, seed=seed_of("1mb-do"))
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    # Delta-Matching: dQ of the first rows needs only the first keys (and their
    # own delta, from keys they see): the op on the first N_WIN tokens.
    dq, dk, dv, _ = OPS.bwd(dout, q, k, v, out, lse, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    w = slice(0, N_WIN)
    g_w = OPS.bwd(dout[:, :, w], q[:, :, w], k[:, :, w], v[:, :, w], out[:, :, w], lse[:, :, w], tau, True, "fp8",
                  "delta_matching", 128, "e4m3", False)
    assert_dq_close(dq[:, :, w], g_w[0], "1M dQ, first rows")
    # The last rows' dQ (every key) against float64 on the GPU.
    n = 256
    for h in range(hq):
        *_, dq_ex, _, _ = exact_rows(q[0, h, -n:], k[0, 0], v[0, 0], tau, S_LONG - n, S_LONG, True,
                                     dout=dout[0, h, -n:])
        assert rel(dq[0, h, -n:], dq_ex) < 0.15, f"head {h}: dQ of the last rows"
    del dq, dk, dv, g_w
    # Stale delta (<dO_i, O_i>, per row): dK, dV of the last keys need only the
    # last queries, which see them (given the full LSE and O): the op on the last
    # N_WIN tokens (a 128-aligned start, so the query blocks are the same).
    _, dk, dv, _ = OPS.bwd(dout, q, k, v, out, lse, tau, True, "fp8", "stale", 128, "e4m3", False)
    t = slice(S_LONG - N_WIN, S_LONG)
    assert (S_LONG - N_WIN) % 128 == 0
    g_t = OPS.bwd(dout[:, :, t], q[:, :, t], k[:, :, t], v[:, :, t], out[:, :, t], lse[:, :, t], tau, True, "fp8",
                  "stale", 128, "e4m3", False)
    assert torch.equal(dk[:, :, t], g_t[1]), "1M dK, last keys"
    assert torch.equal(dv[:, :, t], g_t[2]), "1M dV, last keys"


# ---- tensors of more than 2^31 elements -------------------------------------------------

def test_more_than_2pow31_elements_quantize():
    need_gb(30)
    h, s, d = 20, 1 << 21, 64  # 2.7e9 elements; head 19 starts past element 2^31
    x = cuda_randn(1, h, s, d, seed=seed_of("q31"))
    assert x.numel() > BIG and 19 * s * d > BIG
    for dim in (3, 2):
        codes, scales = OPS.quantize_blockwise(x, dim, 128, "e4m3")
        c1, s1 = OPS.quantize_blockwise(x[:, 19:20].clone(), dim, 128, "e4m3")
        assert torch.equal(codes[:, 19:20], c1) and torch.equal(scales[:, 19:20], s1), dim
        # the last 4096 tokens (whole 128-token blocks) against the CPU op
        t = slice(s - 4096, s)
        cr, sr = OPS.quantize_blockwise(x[:, 19:20, t].float().cpu(), dim, 128, "e4m3")
        if dim == 3:
            assert torch.equal(c1[:, :, t].cpu(), cr) and torch.equal(s1[:, :, t].cpu(), sr)
        else:
            assert torch.equal(c1[:, :, t].cpu(), cr) and torch.equal(s1[:, :, -32:].cpu(), sr)
        del codes, scales


def test_more_than_2pow31_elements_fwd_bwd():
    need_gb(50)
    h, sq, sk, d = 20, 192, 1 << 21, 64  # K, V, dK, dV of 2.7e9 elements; head 19 past element 2^31
    q = cuda_randn(1, h, sq, d, seed=seed_of("a31-q"))
    k = cuda_randn(1, h, sk, d, seed=seed_of("a31-k"))
    v = cuda_randn(1, h, sk, d, seed=seed_of("a31-v"))
    dout = cuda_randn(1, h, sq, d, seed=seed_of("a31-do"))
    assert k.numel() > BIG and 19 * sk * d > BIG
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, False, "fp8", 128)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    dq, dk, dv, _ = OPS.bwd(dout, q, k, v, out, lse, tau, False, "fp8", "delta_matching", 128, "e4m3", False)
    for hh in (19, 0):
        s = slice(hh, hh + 1)
        args = (q[:, s], k[:, s].clone(), v[:, s].clone())  # small offsets only
        o1, l1 = OPS.fwd(*args, tau, False, "fp8", 128)
        assert torch.equal(out[:, s], o1) and torch.equal(lse[:, s], l1), f"head {hh}: O / LSE"
        g1 = OPS.bwd(dout[:, s], *args, o1, l1, tau, False, "fp8", "delta_matching", 128, "e4m3", False)
        assert torch.equal(dk[:, s], g1[1]) and torch.equal(dv[:, s], g1[2]), f"head {hh}: dK / dV"
        assert_dq_close(dq[:, s], g1[0], f"head {hh}: dQ")
        del g1, args
    # Head 19 against float64 attention on the GPU.
    o_ex, l_ex, dq_ex, dk_ex, dv_ex = exact_rows(q[0, 19], k[0, 19], v[0, 19], tau, 0, sq, False, dout=dout[0, 19])
    assert rel(out[0, 19], o_ex) < 0.08
    assert (lse[0, 19].double() - l_ex).abs().max().item() < 0.02
    assert rel(dq[0, 19], dq_ex) < 0.15
    assert rel(dk[0, 19], dk_ex) < 0.15
    assert rel(dv[0, 19], dv_ex) < 0.15


def test_varlen_more_than_2pow31_key_elements():
    # A packed batch whose K / V hold 2.7e9 elements: the second sequence starts
    # past element 2^31 of the packed tensors, the first holds 2^31 itself.
    need_gb(60)
    hq, hkv, d = 4, 4, 128
    lens_q, lens_k = [128, 200], [1 << 22, 1 << 20]
    cu_q = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, lens_k[0], sum(lens_k)], dtype=torch.int64, device="cuda")
    q = cuda_randn(sum(lens_q), hq, d, seed=seed_of("vl-q")).requires_grad_()
    k = cuda_randn(sum(lens_k), hkv, d, seed=seed_of("vl-k")).requires_grad_()
    v = cuda_randn(sum(lens_k), hkv, d, seed=seed_of("vl-v")).requires_grad_()
    assert k.numel() > BIG and lens_k[0] * hkv * d >= BIG
    dout = cuda_randn(sum(lens_q), hq, d, seed=seed_of("vl-do"))
    out = fp8attn.varlen_attention(q, k, v, cu_q, cu_k, causal=False)
    out.backward(dout)
    for i in range(2):
        qa, qb = int(cu_q[i]), int(cu_q[i + 1])
        ka, kb = int(cu_k[i]), int(cu_k[i + 1])
        # the sequence alone, as its own contiguous tensors (small offsets)
        qs, ks, vs = (t.detach()[a:b].transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
                      for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        o1 = fp8attn.attention(qs, ks, vs)
        o1.backward(dout[qa:qb].transpose(0, 1).unsqueeze(0))
        assert torch.equal(out[qa:qb].detach(), o1.detach()[0].transpose(0, 1)), f"sequence {i}: O"
        assert torch.equal(k.grad[ka:kb], ks.grad[0].transpose(0, 1)), f"sequence {i}: dK"
        assert torch.equal(v.grad[ka:kb], vs.grad[0].transpose(0, 1)), f"sequence {i}: dV"
        assert_dq_close(q.grad[qa:qb], qs.grad[0].transpose(0, 1), f"sequence {i}: dQ")
        del qs, ks, vs, o1
    assert math.isfinite(out.float().sum().item())
