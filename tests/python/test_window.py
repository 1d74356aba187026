"""Sliding windows (FlashAttention's window_size, numerics.md section 14) through the
op layer on CPU tensors: attention, flash_attn_func, varlen_attention, FP8Attention,
scaled_dot_product_attention, the raw ops, torch.compile, diagnostics and the
context-parallel ring's refusal. (The HF integration's sliding-window layers:
test_hf.py; the reference itself: tests/cpp/test_reference_window.cpp.)

- the float64 exact path equals torch's SDPA with an explicit boolean mask built
  from the definition (query i sees key j iff i + Sk - Sq - left <= j <= i + Sk -
  Sq + right, -1 unbounded, causal forcing right = 0), O and every gradient to
  ~1e-12, every element; rows that see no key give O = 0, LSE = -inf, zero grads;
- the fp8 path (both recipes, every delta mode) within the FP8 error budget of
  test_op.py against that;
- (-1, -1) is no window and (-1, 0) causal bit for bit, a window reaching every key
  is no window, causal with (L, R) is (L, 0);
- malformed windows raise ValueError naming window_size; on CUDA tensors a real
  window raises NotImplementedError naming window_size with scaling='row' and
  runs with scaling='tile' (runs where a GPU is; the tile kernels' window tests:
  test_window_tile_cuda.py);
- torch.compile(fullgraph=True) traces a windowed call and equals eager.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fp8attn
from fp8attn import diagnostics

from compile_helpers import assert_compiled_matches_eager

# The bounds the sweeps use: unbounded, 0, 1, small, across 64- / 128-key tiles.
BOUNDS = (-1, 0, 1, 5, 100, 129, 200)


def window_mask(sq, sk, window, causal=False):
    """Bool [sq, sk]: the mask from its definition (numerics.md section 14)."""
    left, right = window
    if causal:
        right = 0
    diag = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        m &= j <= diag + right
    if left >= 0:
        m &= j >= diag - left
    return m


def sdpa_ref(q, k, v, mask, scale):
    """float64 attention by torch SDPA with an explicit boolean mask (SDPA layout,
    GQA); rows whose mask is all False give O = 0 (and no gradient), as fp8attn's
    rows that see no key (SDPA itself would give NaN there, so those rows are given
    every key and then multiplied by 0)."""
    rows = mask.any(-1)
    safe = mask | ~rows[:, None]
    g = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=safe,
                                       scale=scale)
    return o * rows[:, None].to(o.dtype)


def lse_ref(q, k, mask, scale):
    g = q.shape[1] // k.shape[1]
    s = scale * q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)
    return torch.logsumexp(s.masked_fill(~mask, -math.inf), -1)


def make(b=1, hq=4, hkv=2, sq=150, sk=150, d=16, dv=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, dv, generator=g).to(dtype)
    do = torch.randn(b, hq, sq, dv, generator=g).to(dtype)
    return q, k, v, do


def fwd_bwd(fn, q, k, v, do):
    """O, (q, k, v) grads of fn(q, k, v) for the incoming gradient do."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    if isinstance(o, tuple):
        o, lse = o
    else:
        lse = None
    o.backward(do.to(o.dtype))
    return o.detach(), lse, q.grad, k.grad, v.grad


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---- exact path against SDPA with the mask ---------------------------------------


@pytest.mark.parametrize("sq,sk", [(150, 150), (90, 260), (260, 90)])
@pytest.mark.parametrize("left", BOUNDS)
@pytest.mark.parametrize("right", BOUNDS)
def test_exact_equals_masked_sdpa(sq, sk, left, right):
    q, k, v, do = make(sq=sq, sk=sk, seed=sq + 3 * left + 7 * right)
    scale = 0.3
    mask = window_mask(sq, sk, (left, right))
    got = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, softmax_scale=scale, precision="exact",
                                                    window_size=(left, right), return_lse=True), q, k, v, do)
    want = fwd_bwd(lambda q, k, v: sdpa_ref(q, k, v, mask, scale), q, k, v, do)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got[:1] + got[2:], want[:1] + want[2:]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)   # NaN fails
    lse = got[1]
    want_lse = lse_ref(q, k, mask, scale)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=1e-6, atol=1e-6)  # FP32 LSE
    empty = ~mask.any(-1)
    assert torch.isneginf(lse[..., empty]).all()
    assert (got[0][..., empty, :] == 0).all() and (got[2][..., empty, :] == 0).all()
    unseen = ~mask.any(0)
    assert (got[3][..., unseen, :] == 0).all() and (got[4][..., unseen, :] == 0).all()


@pytest.mark.parametrize("window", [(9, 17), (9, -1), (-1, 4)])
def test_exact_causal_with_a_window_is_right_bound_zero(window):
    """causal=True forces the right bound to 0 (FlashAttention's rule)."""
    q, k, v, do = make(sq=70, sk=110, seed=5)
    mask = window_mask(70, 110, window, causal=True)
    got = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, causal=True, precision="exact", window_size=window),
                  q, k, v, do)
    want = fwd_bwd(lambda q, k, v: sdpa_ref(q, k, v, mask, 0.25), q, k, v, do)
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- fp8 path within the FP8 error budget ---------------------------------------

SIGMA = {"e4m3": 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2))),
         "e5m2": 2.0**-2 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))}


def fp8_budget(name, delta_mode):
    """test_op.py's model (numerics.md section 7, "FP8 error budget"), E4M3."""
    e4 = SIGMA["e4m3"] ** 2
    var = {"O": 4 * e4, "dV": 4 * e4, "dQ": 6 * e4, "dK": 6 * e4}[name]
    if delta_mode == "stale" and name in ("dQ", "dK"):
        var += e4
    return math.sqrt(var)


@pytest.mark.parametrize("scaling", ["row", "tile"])
@pytest.mark.parametrize("delta_mode", ["delta_matching", "matched_do", "stale"])
@pytest.mark.parametrize("window,sq,sk", [((100, 0), 300, 300), ((129, 129), 200, 330), ((64, 30), 330, 200)])
def test_fp8_within_the_error_budget(scaling, delta_mode, window, sq, sk):
    # 1.12 x the budget, as test_op.py::test_fp8_error_budget (measured / model 0.85-1.05 here;
    # rows of 64-259 keys).
    q, k, v, do = make(b=1, hq=2, hkv=1, sq=sq, sk=sk, d=64, dv=64, dtype=torch.bfloat16, seed=sum(window))
    kw = dict(window_size=window, scaling=scaling, return_lse=True)
    f8 = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, delta_mode=delta_mode, block_size=64, **kw),
                 q, k, v, do)
    ex = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, precision="exact", **kw), q, k, v, do)
    for name, a, e in zip(("O", "dQ", "dK", "dV"), f8[:1] + f8[2:], ex[:1] + ex[2:]):
        assert torch.isfinite(a).all(), name
        bound = 1.12 * fp8_budget(name, delta_mode)
        assert 0.25 * bound < rel_err(a, e) < bound, (name, rel_err(a, e), bound)
    seen = torch.isfinite(ex[1])
    assert torch.equal(seen, torch.isfinite(f8[1]))
    assert rel_err(f8[1][seen], ex[1][seen]) < 0.01


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_window_with_the_outlier_transforms_and_softcap(scaling):
    """Windows compose with qk_rotation / smooth_k (section 10: exact in exact arithmetic,
    smooth_k's mean over all keys is one shift per row, which every window's softmax
    ignores) and softcap (section 12: the cap before the mask)."""
    q, k, v, do = make(sq=100, sk=130, seed=21)
    window, scale = (30, 4), 0.25
    mask = window_mask(100, 130, window)
    want = fwd_bwd(lambda q, k, v: sdpa_ref(q, k, v, mask, scale), q, k, v, do)
    got = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, precision="exact", window_size=window, scaling=scaling,
                                                    qk_rotation="hadamard", smooth_k=True), q, k, v, do)
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    cap = 2.0

    def capped(q, k, v):
        g = q.shape[1] // k.shape[1]
        x = scale * q @ k.repeat_interleave(g, 1).transpose(-1, -2)
        x = (cap * torch.tanh(x / cap)).masked_fill(~mask, -math.inf)
        return torch.softmax(x, -1) @ v.repeat_interleave(g, 1)

    want = fwd_bwd(capped, q, k, v, do)
    got = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, precision="exact", window_size=window, softcap=cap),
                  q, k, v, do)
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # fp8 with the transforms: finite, close to exact
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    f8 = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, window_size=window, scaling=scaling,
                                                   qk_rotation="hadamard", smooth_k=True), qb, kb, vb, dob)
    ex = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, window_size=window, precision="exact"), qb, kb, vb, dob)
    for name, a, e in zip(("O", "dQ", "dK", "dV"), f8[:1] + f8[2:], ex[:1] + ex[2:]):
        assert torch.isfinite(a).all() and rel_err(a, e) < 1.25 * fp8_budget(name, "delta_matching"), name


# ---- identities, bit for bit ----------------------------------------------------


@pytest.mark.parametrize("precision,scaling", [("exact", "row"), ("fp8", "row"), ("fp8", "tile")])
@pytest.mark.parametrize("sq,sk", [(100, 100), (60, 140), (140, 60)])
def test_windows_that_mean_no_window_or_causal(precision, scaling, sq, sk):
    q, k, v, do = make(sq=sq, sk=sk, dtype=torch.bfloat16, seed=sq)

    def run(causal, window):
        return fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, causal=causal, precision=precision,
                                                         scaling=scaling, block_size=32, window_size=window,
                                                         return_lse=True), q, k, v, do)

    plain, causal = run(False, (-1, -1)), run(True, (-1, -1))
    assert not torch.equal(plain[0], causal[0])   # the masks differ on these inputs
    cases = [((-1, -1), False, plain), ((-5, -100), False, plain), ([-1, -1], False, plain),
             ((-1, 0), False, causal), ((-7, 0), False, causal), ((-1, 37), True, causal),
             ((sk - 1, sq - 1), False, plain), ((sk + 10, 10**6), False, plain), ((2**80, 2**70), False, plain),
             ((sk - 1, 0), False, causal),
             ((sk - 1, 5), True, causal)]
    for window, c, want in cases:
        got = run(c, window)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (window, c)
    # causal with a window (L, R) is the window (L, 0)
    for a, b in zip(run(True, (23, 9)), run(False, (23, 0))):
        assert torch.equal(a, b)


# ---- the drop-ins ---------------------------------------------------------------


def test_flash_attn_func_takes_the_window():
    q, k, v, do = make(b=2, sq=90, sk=120, dtype=torch.bfloat16, seed=3)
    for window, causal in (((30, 10), False), ((30, 10), True), ((-1, 7), False)):
        a = fwd_bwd(lambda q, k, v: fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            causal=causal, window_size=window).transpose(1, 2),
                    q, k, v, do)
        b = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, causal=causal, window_size=window), q, k, v, do)
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)
        assert torch.isfinite(a[0].float()).all() and a[2].abs().sum() > 0
    # exact, against the masked SDPA
    q, k, v, do = make(b=2, sq=90, sk=120, seed=4)
    got = fwd_bwd(lambda q, k, v: fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          window_size=(30, 10), precision="exact").transpose(1, 2),
                  q, k, v, do)
    want = fwd_bwd(lambda q, k, v: sdpa_ref(q, k, v, window_mask(90, 120, (30, 10)), 0.25), q, k, v, do)
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sdpa_drop_in_and_module_take_the_window():
    q, k, v, do = make(sq=80, sk=80, dtype=torch.bfloat16, seed=6)
    ref = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, window_size=(20, 3), scaling="tile"), q, k, v, do)
    sdpa = fwd_bwd(lambda q, k, v: fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                                        window_size=(20, 3), scaling="tile"),
                   q, k, v, do)
    mod = fp8attn.FP8Attention(window_size=(20, 3), scaling="tile")
    assert mod.window_size == (20, 3) and "window_size=(20, 3)" in repr(mod)
    modr = fwd_bwd(mod, q, k, v, do)
    bshd = fp8attn.FP8Attention(window_size=[20, 3], scaling="tile", layout="bshd")
    modb = fwd_bwd(lambda q, k, v: bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
                   q, k, v, do)
    for got in (sdpa, modr, modb):
        for a, b in zip(got, ref):
            assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_window_is_per_sequence(causal):
    """Each sequence is `attention` on its own slices with the window bottom-right
    aligned to it (bit for bit); with seqused, aligned to the used lengths."""
    g = torch.Generator().manual_seed(11)
    lq, lk = [50, 0, 33, 140], [70, 12, 20, 140]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cq[-1]), 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(int(ck[-1]), 2, 32, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(q.shape, generator=g).bfloat16()
    window = (25, 6)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fp8attn.varlen_attention(qs, ks, vs, cq, ck, causal=causal, window_size=window, return_lse=True)
    o.backward(do)
    for b in range(4):
        qa, qb, ka, kb = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qb == qa:
            continue
        t = [x[a:z].transpose(0, 1).unsqueeze(0).clone().requires_grad_()
             for x, a, z in ((q, qa, qb), (k, ka, kb), (v, ka, kb))]
        ob, lb = fp8attn.attention(*t, causal=causal, window_size=window, return_lse=True)
        ob.backward(do[qa:qb].transpose(0, 1).unsqueeze(0))
        assert torch.equal(o[qa:qb], ob[0].transpose(0, 1)) and torch.equal(lse[:, qa:qb], lb[0])
        assert torch.equal(qs.grad[qa:qb], t[0].grad[0].transpose(0, 1))
        assert torch.equal(ks.grad[ka:kb], t[1].grad[0].transpose(0, 1))
        assert torch.equal(vs.grad[ka:kb], t[2].grad[0].transpose(0, 1))
    # exact, against the masked SDPA per sequence (sequence 3: 140 x 140)
    q3, k3, v3 = (x[a:z].transpose(0, 1).unsqueeze(0).double() for x, a, z in
                  ((q, int(cq[3]), int(cq[4])), (k, int(ck[3]), int(ck[4])), (v, int(ck[3]), int(ck[4]))))
    oe = fp8attn.varlen_attention(q.double(), k.double(), v.double(), cq, ck, causal=causal, window_size=window,
                                  precision="exact")
    want = sdpa_ref(q3, k3, v3, window_mask(140, 140, window, causal), 32 ** -0.5)
    torch.testing.assert_close(oe[int(cq[3]):].transpose(0, 1).unsqueeze(0), want, rtol=1e-12, atol=1e-12)


def test_varlen_window_with_seqused():
    g = torch.Generator().manual_seed(12)
    cu = torch.tensor([0, 60, 130], dtype=torch.int32)
    used_q, used_k = torch.tensor([40, 70], dtype=torch.int32), torch.tensor([60, 25], dtype=torch.int32)
    q, k, v = (torch.randn(130, 2, 16, generator=g).bfloat16() for _ in range(3))
    o = fp8attn.varlen_attention(q, k, v, cu, cu, window_size=(10, 2), seqused_q=used_q, seqused_k=used_k)
    for b in range(2):
        a = int(cu[b])
        t = [x[a:a + int(n)].transpose(0, 1).unsqueeze(0) for x, n in ((q, used_q[b]), (k, used_k[b]), (v, used_k[b]))]
        ob = fp8attn.attention(*t, window_size=(10, 2))
        assert torch.equal(o[a:a + int(used_q[b])], ob[0].transpose(0, 1))
        assert (o[a + int(used_q[b]):int(cu[b + 1])] == 0).all()


# ---- arguments ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, (1, 2, 3), (1.0, 2), ("a", 1), (True, 0), None, "16,0", (1,), torch.tensor([1, 2])])
def test_malformed_windows_raise_value_error_naming_it(bad):
    q, k, v, _ = make(sq=8, sk=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fp8attn.attention: argument 'window_size'"):
        fp8attn.attention(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match=r"fp8attn.FP8Attention: argument 'window_size'"):
        fp8attn.FP8Attention(window_size=bad)
    with pytest.raises(ValueError, match=r"fp8attn.flash_attn_func: argument 'window_size'"):
        fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_size=bad)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fp8attn.varlen_attention: argument 'window_size'"):
        fp8attn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                 window_size=bad)
    with pytest.raises(ValueError, match=r"argument 'window_size'"):
        fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, window_size=bad)


def test_none_bounds_are_unbounded():
    """FlashAttention-4 (flash_attn.cute) writes an unbounded side as None: the same as -1
    (and (None, None) is no window), in every entry point (a break test's finding: it was
    a ValueError)."""
    q, k, v, _ = make(sq=40, sk=40, dtype=torch.float32)
    for w, same in (((None, None), (-1, -1)), ((None, 3), (-1, 3)), ((7, None), (7, -1)), ([None, 0], (-1, 0))):
        assert torch.equal(fp8attn.attention(q, k, v, window_size=w), fp8attn.attention(q, k, v, window_size=same))
        qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
        assert torch.equal(fp8attn.flash_attn_func(qb, kb, vb, window_size=w),
                           fp8attn.flash_attn_func(qb, kb, vb, window_size=same))
        assert fp8attn.FP8Attention(window_size=w).window_size == same
    assert torch.equal(fp8attn.attention(q, k, v, window_size=(None, None)), fp8attn.attention(q, k, v))


def test_numpy_integer_bounds_are_ints():
    np = pytest.importorskip("numpy")
    q, k, v, _ = make(sq=40, sk=40, dtype=torch.float32)
    a = fp8attn.attention(q, k, v, window_size=(np.int64(7), np.int32(2)))
    assert torch.equal(a, fp8attn.attention(q, k, v, window_size=(7, 2)))


def test_raw_ops_take_the_window_last_with_defaults():
    """window_left / window_right are the last schema arguments, default -1: older
    positional calls keep their meaning; fwd's autograd passes the window on."""
    q, k, v, do = make(sq=50, sk=50, dtype=torch.float32, seed=8)
    o0, l0 = torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 32)
    o1, l1 = torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 32, "row", "none", False, 0.0, -1, -1)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    ow, lw = torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 32, window_left=9, window_right=2)
    want = fp8attn.attention(q, k, v, softmax_scale=0.25, block_size=32, window_size=(9, 2), return_lse=True)
    assert torch.equal(ow, want[0]) and torch.equal(lw, want[1])
    dq, dk, dv, _ = torch.ops.fp8attn.bwd(do, q, k, v, ow, lw, 0.25, False, "fp8", "delta_matching", 32, "e4m3",
                                          False, window_left=9, window_right=2)
    g = fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, softmax_scale=0.25, block_size=32, window_size=(9, 2)),
                q, k, v, do)
    assert torch.equal(dq, g[2]) and torch.equal(dk, g[3]) and torch.equal(dv, g[4])
    # the raw fwd op's own autograd
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    torch.ops.fp8attn.fwd(qs, ks, vs, 0.25, False, "fp8", 32, "row", "none", False, 0.0, 9, 2)[0].backward(do)
    assert torch.equal(qs.grad, g[2]) and torch.equal(ks.grad, g[3]) and torch.equal(vs.grad, g[4])


def test_diagnostics_count_the_rows_that_see_a_key():
    q, k, v, do = make(sq=120, sk=40, dtype=torch.float32, seed=9)
    with diagnostics.record() as rec:
        fwd_bwd(lambda q, k, v: fp8attn.attention(q, k, v, window_size=(5, 3)), q, k, v, do)
    (r,) = rec.records
    assert r["window_size"] == (5, 3)
    rows = int(window_mask(120, 40, (5, 3)).any(-1).sum())
    assert 0 < rows < 120 and r["rows"] == rows * q.shape[0] * q.shape[1]
    assert r["rowsum_pre_mean"] < 1e-5   # Delta-Matching over the window's keys


def test_ring_attention_refuses_a_window_naming_it():
    from fp8attn import context_parallel as cp
    q, k, v, _ = make(sq=32, sk=32, dtype=torch.float32)
    for window, causal in (((16, 0), False), ((-1, 4), False), ((3, 9), True)):
        with pytest.raises(NotImplementedError, match=r"ring_attention: argument 'window_size'"):
            cp.ring_attention(q, k, v, causal=causal, window_size=window)
    with pytest.raises(ValueError, match="window_size"):
        cp.ring_attention(q, k, v, window_size=(1, 2, 3))


# ---- torch.compile ---------------------------------------------------------------


def test_torch_compile_fullgraph_with_a_window():
    torch._dynamo.reset()
    q, k, v, _ = make(b=1, hq=4, hkv=2, sq=48, sk=64, d=16, dtype=torch.bfloat16, seed=10)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    cuk = torch.tensor([0, 30, 64], dtype=torch.int32)

    def step(q, k, v):
        a = fp8attn.attention(q, k, v, window_size=(12, 3), scaling="tile", block_size=32)
        b = fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                    window_size=(7, 5))
        c = fp8attn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cuk,
                                     window_size=(4, 4))
        return (a.float() ** 2).sum() + b.float().sum() + (c.float() ** 3).sum()

    for g in assert_compiled_matches_eager(step, q, k, v):
        assert torch.isfinite(g.float()).all()
    torch._dynamo.reset()


# ---- CUDA: refused with a clear error (needs no kernel) ---------------------------


def _cuda_ok():
    if not torch.cuda.is_available() or not fp8attn._lib.HAS_CUDA_KERNELS:
        return False
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _cuda_ok(), reason="needs an sm_90 GPU and the CUDA kernels")
def test_cuda_window_is_refused_naming_window_size(monkeypatch):
    # scaling='row' (the default): the CUDA kernels take no sliding window and say
    # that scaling='tile' does; scaling='tile' runs it (forward and backward; the
    # kernels' own tests: tests/python/test_window_tile_cuda.py).
    monkeypatch.setenv("FP8ATTN_TILE_BWD", "1")
    q, k, v, do = make(b=1, hq=2, hkv=2, sq=64, sk=64, d=64, dv=64, dtype=torch.float32)
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    for fn in (lambda w, c: fp8attn.attention(q, k, v, window_size=w, causal=c),
               lambda w, c: fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    window_size=w, causal=c)):
        for w, c in (((16, 0), False), ((-1, 8), False), ((8, 8), True)):
            with pytest.raises(NotImplementedError,
                               match=r"argument 'window_size'.*scaling='row' do not take sliding.*scaling='tile' runs"):
                fn(w, c)
        # windows that mask nothing beyond causal run (and equal no window / causal)
        assert torch.equal(fn((63, 63), False), fn((-1, -1), False))
        assert torch.equal(fn((-1, 0), False), fn((-1, -1), True))
        assert torch.equal(fn((100, 5), True), fn((-1, -1), True))
    for w, c in (((16, 0), False), ((-1, 8), False), ((8, 8), True)):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = fp8attn.attention(qg, kg, vg, window_size=w, causal=c, scaling="tile")
        o.backward(do.cuda().to(o.dtype))
        o_cpu = fp8attn.attention(q.cpu(), k.cpu(), v.cpu(), window_size=w, causal=c, scaling="tile")
        rel = (o.detach().cpu().double() - o_cpu.double()).norm() / o_cpu.double().norm()
        assert rel < 2e-2, (w, c, rel.item())
        assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg)), (w, c)
