"""GPU tests of sliding windows (numerics.md section 14) on the sm_90a kernels of
the `tile` recipe (numerics.md section 9): the forward
(csrc/hopper/fwd_tilescale_e4m3_sm90.cu), the backward's Delta-Matching pre-pass
and main kernel (bwd_prepass_tilescale_e4m3_sm90.cu, bwd_tilescale_e4m3_sm90.cu),
through torch.ops.fp8attn.fwd / bwd / bwd_dm_sums(..., scaling="tile",
window_left, window_right) on CUDA, against the CPU reference's `tile` path (the
same op on CPU tensors) on the same fresh random inputs, every element, with the
tolerances of the tile CUDA tests (test_tile_cuda.py, test_tile_cuda_bwd.py;
numerics.md section 6):

    ||cuda - exact|| <= 2 * ||cpu_tile - exact|| + 1e-3 * ||exact||
    ||cuda - cpu_tile|| / ||cpu_tile|| < 2e-2   (gradients: also per 64-column block)

Windows (64, 0), (100, 100), (0, 129), (129, 5), (0, 0), (300, -1) (left only),
(-1, 40) (right only), each with causal False and True (causal sets right = 0),
over seqlen_q < and > seqlen_k, GQA, ragged lengths (not multiples of 128) and
head dims 64, 128, 256, 192/128. Also: rows that see no key give O = 0, LSE =
-inf and dQ = 0, keys no row sees dK = dV = 0 (exact zeros); (-1, 0) is causal
bit for bit and a window reaching every key is no window; both consumer orders
(FP8ATTN_TILE_PINGPONG) and the persistent scheduler give the default order's
bits (they hand over the key tiles a warpgroup does not see); both pre-passes
(FP8ATTN_TILE_PREPASS_Q) give the same gradients; a NaN in a key tile outside
the windows of a row's whole 64-row warpgroup never reaches that row's O (the
kernels quantize and read whole tiles: a NaN at a masked position of a tile a
warpgroup reads may reach its rows, section 14's note on partially visible
tiles); the `row` recipe still refuses sliding windows on CUDA.

Outputs are poisoned with NaN before each call, so an unwritten element fails.
The fixture sets FP8ATTN_TILE_BWD=1 (the default; csrc/torch/ops_cuda.cpp
tile_bwd_enabled), so a knob left in the environment changes nothing. Skips cleanly without a GPU or without the CUDA kernels.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_window_tile_cuda.py
"""
import zlib

import pytest
import torch

from test_cuda import check_close  # noqa: F401 (skips the module without a GPU, as test_tile_cuda.py)
from test_tile_cuda_bwd import cuda_pair_residuals
from test_cuda_bwd import OPS, check_grads, f32_scale, needs_gpu, poison_cuda_allocator

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.fixture(autouse=True)
def _tile_kernels_on(monkeypatch):
    """The CUDA `tile` forward and backward (the defaults), whatever the environment says."""
    monkeypatch.delenv("FP8ATTN_TILE_FWD", raising=False)
    monkeypatch.setenv("FP8ATTN_TILE_BWD", "1")
    for knob in ("FP8ATTN_TILE_PINGPONG", "FP8ATTN_TILE_PERSISTENT", "FP8ATTN_TILE_PREPASS_Q"):
        monkeypatch.delenv(knob, raising=False)


def seed_of(*key):
    return zlib.crc32(repr(key).encode())


WINDOWS = [(64, 0), (100, 100), (0, 129), (129, 5), (0, 0), (300, -1), (-1, 40)]
WIDS = [f"w{left}_{right}" for left, right in WINDOWS]

SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (1, 4, 2, 300, 300, 64, 64),     # GQA, ragged
    (2, 2, 1, 200, 333, 128, 128),   # seqlen_q < seqlen_k
    (1, 3, 1, 333, 200, 64, 64),     # seqlen_q > seqlen_k (rows that see no key)
    (1, 2, 2, 257, 390, 256, 256),   # serial consumer order (dv = 256)
    (1, 4, 2, 260, 190, 192, 128),   # two head_dim chunks
]
SIDS = ["x".join(map(str, s)) for s in SHAPES]


def window_kw(window):
    return {"window_left": window[0], "window_right": window[1]}


def visible(sq, sk, window, causal):
    """[sq, sk] bool: query i sees key j (numerics.md section 14, after effective_window)."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    off = sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def make_qkv(shape, seed):
    b, hq, hkv, sq, sk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).bfloat16()
    k = torch.randn(b, hkv, sk, d, generator=gen).bfloat16()
    v = torch.randn(b, hkv, sk, dv, generator=gen).bfloat16()
    dout = torch.randn(b, hq, sq, dv, generator=gen).bfloat16()
    return q, k, v, dout


def cuda_fwd(q, k, v, causal, window, tau):
    b, hq, sq, _ = q.shape
    poison_cuda_allocator([((b, hq, sq, v.shape[-1]), torch.bfloat16), ((b, hq, sq), torch.float32)])
    out, lse = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128, "tile", **window_kw(window))
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def check_fwd(shape, causal, window, seed):
    q, k, v, _ = make_qkv(shape, seed)
    b, hq, hkv, sq, sk, d, dv = shape
    tau = f32_scale(d)
    out, lse = cuda_fwd(q, k, v, causal, window, tau)
    o_cpu, l_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", **window_kw(window))
    o_ex, l_ex = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128, **window_kw(window))
    label = f"tile {shape} causal={causal} window={window}"
    assert out.shape == (b, hq, sq, dv) and lse.shape == (b, hq, sq)
    check_close("O", out, o_cpu, o_ex, label)
    check_close("LSE", lse, l_cpu, l_ex, label)
    # Rows that see no key: exact zeros and -inf (section 1), the others finite.
    blind = ~visible(sq, sk, window, causal).any(dim=1)
    assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind])), label
    assert torch.isneginf(lse[:, :, blind]).all(), label
    assert torch.isfinite(lse[:, :, ~blind]).all(), label
    return q, k, v, out, lse


# ---- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS, ids=WIDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=SIDS)
def test_window_tile_fwd(shape, causal, window):
    check_fwd(shape, causal, window, seed_of("wtf", shape, causal, window))


@pytest.mark.parametrize("sq,sk,window", [
    (300, 100, (0, 0)),     # rows 0..199 see no key (a whole CTA, and a CTA with one blind warpgroup)
    (100, 300, (0, 0)),     # one key per row; keys 0..199 unseen
    (1, 1000, (50, 0)),     # one row, keys [949, 1000): key tile 7 only
    (1000, 1, (-1, 3)),     # one key (off = -999): rows 996.. see it, the 7 CTAs before none
    (700, 700, (5, 5)),     # a window narrower than a tile: middle ranges, one or two tiles per warpgroup
    (513, 1025, (130, 129)),
])
def test_window_tile_fwd_edges(sq, sk, window):
    for causal in (False, True):
        check_fwd((1, 2, 1, sq, sk, 64, 64), causal, window, seed_of("wtfe", sq, sk, window, causal))


def test_window_tile_fwd_causal_is_the_window_minus1_0():
    q, k, v, _ = make_qkv((1, 4, 2, 333, 300, 128, 128), seed_of("wtc"))
    tau = f32_scale(128)
    causal = cuda_fwd(q, k, v, True, (-1, -1), tau)
    for window, c in (((-1, 0), False), ((-1, 5), True), ((1000, 0), False), ((299, 0), False)):
        got = cuda_fwd(q, k, v, c, window, tau)
        assert torch.equal(got[0], causal[0]) and torch.equal(got[1], causal[1]), (window, c)
    none = cuda_fwd(q, k, v, False, (-1, -1), tau)
    got = cuda_fwd(q, k, v, False, (299, 332), tau)  # reaches every key of every row
    assert torch.equal(got[0], none[0]) and torch.equal(got[1], none[1])


PP_SHAPES = [(2, 40, 8, 300, 420, 128, 128), (2, 24, 8, 420, 300, 64, 64), (1, 30, 10, 260, 390, 192, 128)]


@pytest.mark.parametrize("shape", PP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", [(64, 0), (0, 129), (129, 5), (5, 5), (300, -1)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_tile_fwd_pingpong_and_persistent(shape, window, monkeypatch):
    # The hand-over of key tiles a warpgroup does not see, before and after its own
    # ([m_begin, m_end) inside the CTA's [kt0, kt1)), in the pingpong turns and
    # across the persistent scheduler's work tiles: bitwise the default order.
    q, k, v, _ = make_qkv(shape, seed_of("wtpp", shape, window))
    tau = f32_scale(shape[5])
    base = cuda_fwd(q, k, v, False, window, tau)
    for pp, ps in (("1", "0"), ("0", "1"), ("1", "1")):
        monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", pp)
        monkeypatch.setenv("FP8ATTN_TILE_PERSISTENT", ps)
        got = cuda_fwd(q, k, v, False, window, tau)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), (pp, ps)


def warpgroup_misses(sq, sk, window, causal, keys):
    """[sq] bool: rows whose whole 64-row warpgroup (the forward kernel's unit) sees
    no key of the key tiles holding `keys`."""
    vis = visible(sq, sk, window, causal)
    tiles = {kk // 128 for kk in keys}
    touch = torch.zeros(sq, dtype=torch.bool)
    for t in tiles:
        touch |= vis[:, 128 * t:128 * (t + 1)].any(dim=1)
    group = torch.zeros(sq, dtype=torch.bool)
    for g0 in range(0, sq, 64):
        group[g0:g0 + 64] = touch[g0:g0 + 64].any()
    return ~group


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("window,key", [((64, 0), 10), ((0, 129), 500), ((5, 5), 260)],
                         ids=["left", "right", "middle"])
def test_window_tile_fwd_nan_outside_the_window(where, window, key):
    # numerics.md sections 2 and 14: a NaN in a key tile outside every window of a
    # row's warpgroup never reaches that row (its CTA or warpgroup does not read the
    # tile: bitwise the clean run); where the reference is NaN, the kernel is too.
    sq = sk = 512
    q, k, v, _ = make_qkv((1, 2, 1, sq, sk, 64, 64), seed_of("wtnan", where, window))
    tau = f32_scale(64)
    clean = cuda_fwd(q, k, v, False, window, tau)
    {"k": k, "v": v}[where][0, 0, key, 3] = float("nan")
    out, lse = cuda_fwd(q, k, v, False, window, tau)
    o_cpu, _ = OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", **window_kw(window))
    assert torch.isnan(o_cpu).any(), "the planted NaN did not reach the reference"
    assert torch.isnan(out)[torch.isnan(o_cpu)].all(), "NaN was lost in O"
    safe = warpgroup_misses(sq, sk, window, False, [key])
    assert safe.any() and (~safe).any(), "the case must have rows on both sides"
    assert torch.equal(out[:, 0, safe], clean[0][:, 0, safe]) and torch.equal(lse[:, 0, safe], clean[1][:, 0, safe])
    assert torch.isfinite(out[:, 0, safe]).all()
    # Query head 1 reads the same K / V head (GQA 2:1): the same rule.
    assert torch.equal(out[:, 1, safe], clean[0][:, 1, safe])


# ---- backward --------------------------------------------------------------------------


def bwd_inputs(shape, causal, window, seed):
    """CPU-reference `tile` forward O / LSE (both sides) and the CUDA `tile` forward's
    LSE for the kernel (each side's P normalized against its own S; test_tile_cuda_bwd)."""
    q, k, v, dout = make_qkv(shape, seed)
    tau = f32_scale(shape[5])
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", **window_kw(window))
    lse_cuda = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128, "tile", **window_kw(window))[1]
    return q, k, v, out, lse, dout, lse_cuda


def cuda_bwd(inp, causal, window, mode, fmt, diagnostics=False):
    q, k, v, out, lse, dout, lse_cuda = inp
    tau = f32_scale(q.shape[-1])
    poison_cuda_allocator([(q.shape, torch.bfloat16), (k.shape, torch.bfloat16), (v.shape, torch.bfloat16),
                           ((4,) + tuple(lse.shape), torch.float32)])
    dev = [t.cuda() for t in (dout, q, k, v, out)]
    r = OPS.bwd(*dev, lse_cuda, tau, causal, "fp8", mode, 128, fmt, diagnostics, "tile", **window_kw(window))
    torch.cuda.synchronize()
    return tuple(t.cpu() for t in r)


def check_bwd(shape, causal, window, mode, fmt, seed):
    inp = bwd_inputs(shape, causal, window, seed)
    q, k, v, out, lse, dout, _ = inp
    tau = f32_scale(q.shape[-1])
    cuda = cuda_bwd(inp, causal, window, mode, fmt)
    cpu = OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", mode, 128, fmt, False, "tile", **window_kw(window))
    ex = OPS.bwd(dout.double(), q.double(), k.double(), v.double(), out.double(), lse, tau, causal, "exact", mode,
                 128, fmt, False, **window_kw(window))
    label = f"tile bwd {shape} causal={causal} window={window} {mode} {fmt}"
    check_grads(cuda, cpu, ex, label)
    # Rows that see no key: dQ = 0; keys no row sees: dK = dV = 0 (exact zeros).
    vis = visible(shape[3], shape[4], window, causal)
    blind_q, blind_k = ~vis.any(dim=1), ~vis.any(dim=0)
    assert (cuda[0][:, :, blind_q] == 0).all(), f"{label}: dQ of rows that see no key"
    assert (cuda[1][:, :, blind_k] == 0).all() and (cuda[2][:, :, blind_k] == 0).all(), f"{label}: dK / dV of unseen keys"
    return cuda


@pytest.mark.parametrize("window", WINDOWS, ids=WIDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=SIDS)
def test_window_tile_bwd(shape, causal, window):
    check_bwd(shape, causal, window, "delta_matching", "e4m3", seed_of("wtb", shape, causal, window))


@pytest.mark.parametrize("mode", ["stale", "matched_do"])
@pytest.mark.parametrize("window", [(64, 0), (0, 129), (5, 5)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_tile_bwd_other_modes(mode, window):
    check_bwd((1, 4, 2, 300, 333, 128, 128), False, window, mode, "e5m2", seed_of("wtbm", mode, window))


@pytest.mark.parametrize("sq,sk,window", [(300, 100, (0, 0)), (100, 300, (0, 0)), (700, 700, (5, 5)),
                                          (1, 1000, (50, 0)), (513, 1025, (130, 129))])
def test_window_tile_bwd_edges(sq, sk, window):
    for causal in (False, True):
        check_bwd((1, 2, 1, sq, sk, 64, 64), causal, window, "delta_matching", "e4m3",
                  seed_of("wtbe", sq, sk, window, causal))


@pytest.mark.parametrize("window", [(64, 0), (0, 129), (5, 5), (300, -1)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_tile_bwd_prepass_variants_and_pingpong(window, monkeypatch):
    # Pre-pass v1 (64 queries per CTA) and v2 (128) walk the key tiles
    # [kt_begin, kt_end) of their queries, the main kernel's pingpong order the same
    # query tiles as the default: dK, dV bitwise equal across the orders (dQ adds
    # its partials in whatever order they land: FP32 rounding), v1 and v2 within
    # the tile tolerance of each other (their delta sums round differently).
    shape = (1, 4, 2, 333, 300, 128, 128)
    inp = bwd_inputs(shape, False, window, seed_of("wtbv", window))
    runs = {}
    for pq, pp in (("64", "0"), ("128", "0"), ("128", "1")):
        monkeypatch.setenv("FP8ATTN_TILE_PREPASS_Q", pq)
        monkeypatch.setenv("FP8ATTN_TILE_BWD_PINGPONG", pp)
        runs[pq, pp] = cuda_bwd(inp, False, window, "delta_matching", "e4m3")
    base = runs["128", "0"]
    assert all(torch.equal(a, b) for a, b in zip(runs["128", "1"][1:3], base[1:3])), "pingpong changed dK / dV"
    rel_dq = (runs["128", "1"][0].double() - base[0].double()).norm() / base[0].double().norm()
    assert rel_dq < 1e-3, rel_dq
    for a, b in zip(runs["64", "0"][:3], base[:3]):
        rel = (a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)
        assert rel < 2e-2, rel


@pytest.mark.parametrize("window", [(64, 0), (100, 100), (0, 129)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_tile_dm_invariant_with_cuda_forward(window):
    # The training pairing with a window (numerics.md section 14, Delta-Matching):
    # the invariant sum_j dS_ij = 0 over the row's visible keys holds to the bound of
    # the unwindowed pairing (test_tile_cuda_bwd: 1e-6), stale stays far above it.
    gen = torch.Generator().manual_seed(seed_of("wtdm", window))
    q, k, v, dout = (torch.randn(1, h, 384, 128, generator=gen).bfloat16().cuda() for h in (4, 2, 2, 4))
    res = cuda_pair_residuals(q, k, v, dout, f32_scale(128), False, **window_kw(window))
    assert res["delta_matching"] < 1e-6, res
    assert res["stale"] >= 100 * res["delta_matching"], res


def test_window_tile_bwd_causal_is_the_window_minus1_0():
    # dK, dV bitwise; dQ adds its FP32 partials in whatever order they land (the
    # same run twice differs by that reassociation only).
    shape = (1, 4, 2, 333, 300, 128, 128)
    inp = bwd_inputs(shape, True, (-1, -1), seed_of("wtbc"))
    causal = cuda_bwd(inp, True, (-1, -1), "delta_matching", "e4m3")
    for window, c in (((-1, 0), False), ((-1, 7), True), ((299, 0), False)):
        got = cuda_bwd(inp, c, window, "delta_matching", "e4m3")
        assert torch.equal(got[1], causal[1]) and torch.equal(got[2], causal[2]), (window, c)
        rel_dq = (got[0].double() - causal[0].double()).norm() / causal[0].double().norm()
        assert rel_dq < 1e-3, (window, c, rel_dq)


@pytest.mark.parametrize("window", [(64, 0), (0, 129), (5, 5)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_tile_bwd_dm_sums(window):
    # bwd_dm_sums (context parallelism's pre-pass of one key shard, numerics.md
    # section 11) runs the same `tile` pre-pass with the window: the partial sums
    # sum_j P dP_hat and sum_j P agree with the CPU reference's.
    shape = (1, 4, 2, 300, 333, 64, 64)
    q, k, v, out, lse, dout, _ = bwd_inputs(shape, False, window, seed_of("wtsum", window))
    tau = f32_scale(64)
    args = (tau, False, 128, "e4m3", "tile")
    cpu = OPS.bwd_dm_sums(dout, q, k, v, lse, *args, **window_kw(window))
    cuda = OPS.bwd_dm_sums(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), lse.cuda(), *args, **window_kw(window))
    for name, c, r in zip(("sum_pdp", "sum_p"), cuda, cpu):
        c, r = c.cpu().double(), r.double()
        assert torch.isfinite(c).all(), name
        rel = (c - r).norm() / r.norm().clamp(min=1e-30)
        assert rel < 2e-2, (name, rel.item())
    blind = ~visible(300, 333, window, False).any(dim=1)
    assert (cuda[1].cpu()[:, :, blind] == 0).all()


# ---- the `row` recipe still refuses ------------------------------------------------------


def test_window_row_cuda_refused_naming_tile():
    q, k, v, dout = (t.cuda() for t in make_qkv((1, 2, 1, 200, 200, 64, 64), seed_of("wrow")))
    tau = f32_scale(64)
    with pytest.raises(NotImplementedError, match=r"argument 'window_size'.*scaling='row'.*scaling='tile' runs them"):
        OPS.fwd(q, k, v, tau, False, "fp8", 128, "row", window_left=16, window_right=0)
    out, lse = OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", window_left=16, window_right=0)
    with pytest.raises(NotImplementedError, match=r"argument 'window_size'.*scaling='row'"):
        OPS.bwd(dout, q, k, v, out, lse, tau, False, "fp8", "delta_matching", 128, "e4m3", False, "row",
                window_left=16, window_right=0)
