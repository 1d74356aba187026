"""GPU tests of logit softcapping (numerics.md section 12) on the sm_90a kernels of
the `tile` recipe (numerics.md section 9): the forward
(csrc/hopper/fwd_tilescale_e4m3_sm90.cu), the backward's Delta-Matching pre-pass
and main kernel (bwd_prepass_tilescale_e4m3_sm90.cu, bwd_tilescale_e4m3_sm90.cu)
and bwd_dm_sums, through torch.ops.fp8attn.fwd / bwd / bwd_dm_sums(...,
scaling="tile", softcap=c) on CUDA, against the CPU reference's `tile` path (the
same op on CPU tensors) on the same fresh random inputs, with the tolerances of the
tile CUDA tests (test_tile_cuda.py, test_tile_cuda_bwd.py; numerics.md section 6):

    ||cuda - exact|| <= 2 * ||cpu_tile - exact|| + 1e-3 * ||exact||
    ||cuda - cpu_tile|| / ||cpu_tile|| < 2e-2   (gradients: also per 64-column block,
                                                 with the rare-flip rule)

Inputs: Q and K scaled so that the scaled logits tau S have a standard deviation of
~7 (LOGIT_STD), where the cap matters for c in {3, 20, 50}; each case also checks
that the capped result is far from the uncapped one relative to its error (a kernel
that ignored softcap fails). Head dims 64, 128, 256, 192/128, causal and not, GQA,
seqlen_q != seqlen_k both ways, ragged lengths (1, 77, 129, 300), a sliding window;
the backward in the three delta modes and both grad formats (a subset), the
Delta-Matching invariant on the pre-cap gradient dX' (diagnostics rowsum_pre), NaN
propagation, softcap = 0 bitwise equal to no softcap, both pre-passes, the consumer
orders (a softcap call runs the default order whatever FP8ATTN_TILE_PINGPONG /
_PERSISTENT / _BWD_PINGPONG say: bitwise the default), bwd_dm_sums, the autograd and
varlen paths, and the `row` recipe's refusal naming softcap.

Outputs are poisoned with NaN before each call, so an unwritten element fails.
Skips cleanly without a GPU or without the CUDA kernels.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_softcap_tile_cuda.py
"""
import math
import zlib

import pytest
import torch

from test_cuda import check_close  # noqa: F401 (skips the module without a GPU, as test_tile_cuda.py)
from test_cuda_bwd import OPS, check_grads, f32_scale, needs_gpu, poison_cuda_allocator

pytestmark = [pytest.mark.gpu, needs_gpu]

LOGIT_STD = 7.0   # std of tau * S: Q, K entries ~ N(0, LOGIT_STD) (tau = 1 / sqrt(d))
CAPS = [3.0, 20.0, 50.0]
# The capped result must be this many times farther from the uncapped one than from
# its reference (CPU: at c = 50, LOGIT_STD = 7 the O separation is ~0.06 relative,
# the CUDA-vs-CPU difference a few 1e-3).
MIN_SEPARATION = 4.0


@pytest.fixture(autouse=True)
def _tile_kernels_on(monkeypatch):
    """The CUDA `tile` forward and backward (the defaults), whatever the environment says."""
    monkeypatch.delenv("FP8ATTN_TILE_FWD", raising=False)
    monkeypatch.setenv("FP8ATTN_TILE_BWD", "1")
    for knob in ("FP8ATTN_TILE_PINGPONG", "FP8ATTN_TILE_PERSISTENT", "FP8ATTN_TILE_PREPASS_Q",
                 "FP8ATTN_TILE_BWD_PINGPONG"):
        monkeypatch.delenv(knob, raising=False)


INVARIANT_STD = 2.0  # logits for the Delta-Matching invariant checks (test_softcap_dm_invariant_with_cuda_forward)


def seed_of(*key):
    return zlib.crc32(repr(key).encode())


SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (1, 4, 2, 300, 300, 64, 64),     # GQA, ragged
    (2, 2, 1, 200, 333, 128, 128),   # seqlen_q < seqlen_k
    (1, 2, 2, 257, 390, 256, 256),   # serial consumer order (dv = 256)
    (1, 4, 2, 260, 190, 192, 128),   # two head_dim chunks, seqlen_q > seqlen_k
]
SIDS = ["x".join(map(str, s)) for s in SHAPES]


def make_qkv(shape, seed, std=LOGIT_STD):
    b, hq, hkv, sq, sk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    s = math.sqrt(std)
    q = (torch.randn(b, hq, sq, d, generator=gen) * s).bfloat16()
    k = (torch.randn(b, hkv, sk, d, generator=gen) * s).bfloat16()
    v = torch.randn(b, hkv, sk, dv, generator=gen).bfloat16()
    dout = torch.randn(b, hq, sq, dv, generator=gen).bfloat16()
    return q, k, v, dout


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def cuda_fwd(q, k, v, causal, tau, cap, **kw):
    b, hq, sq, _ = q.shape
    poison_cuda_allocator([((b, hq, sq, v.shape[-1]), torch.bfloat16), ((b, hq, sq), torch.float32)])
    extra = {} if cap is None else {"softcap": cap}
    out, lse = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128, "tile", **extra, **kw)
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def check_fwd(shape, causal, cap, seed, separation=True, **kw):
    q, k, v, _ = make_qkv(shape, seed)
    tau = f32_scale(shape[5])
    out, lse = cuda_fwd(q, k, v, causal, tau, cap, **kw)
    o_cpu, l_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=cap, **kw)
    o_ex, l_ex = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128, softcap=cap, **kw)
    label = f"softcap={cap} {shape} causal={causal} {kw}"
    assert out.shape == o_cpu.shape and lse.shape == l_cpu.shape
    check_close("O", out, o_cpu, o_ex, label)
    check_close("LSE", lse, l_cpu, l_ex, label)
    # A kernel that ignored softcap: its uncapped output is this far from the capped one.
    # (Not where every row sees one key: P = 1 whatever the cap, O is V's rounding.)
    if separation:
        plain = cuda_fwd(q, k, v, causal, tau, None, **kw)[0]
        err, sep = rel(out, o_cpu), rel(plain, out)
        assert sep > MIN_SEPARATION * err, f"{label}: separation from the uncapped O {sep:.4g}, error {err:.4g}"
    return q, k, v, out, lse


# ---- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=SIDS)
def test_softcap_tile_fwd(shape, causal, cap):
    check_fwd(shape, causal, cap, seed_of("scf", shape, causal, cap))


@pytest.mark.parametrize("sq,sk", [(1, 300), (77, 77), (129, 77), (300, 129), (77, 300)])
def test_softcap_tile_fwd_ragged(sq, sk):
    for causal in (False, True):
        check_fwd((1, 2, 1, sq, sk, 64, 64), causal, 20.0, seed_of("scfr", sq, sk, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_tile_fwd_one_key(causal):
    # One key: P = 1 whatever the cap (O is V's FP8 rounding), so the separation
    # check does not apply; LSE is the capped logit itself, |LSE| <= c.
    q, k, v, _ = make_qkv((1, 2, 1, 1, 1, 64, 64), seed_of("scf1", causal))
    tau = f32_scale(64)
    out, lse = cuda_fwd(q, k, v, causal, tau, 3.0)
    o_cpu, l_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=3.0)
    o_ex, l_ex = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128, softcap=3.0)
    check_close("O", out, o_cpu, o_ex, "one key")
    check_close("LSE", lse, l_cpu, l_ex, "one key")
    assert lse.abs().max().item() <= 3.0 + 1e-5


@pytest.mark.parametrize("window", [(64, 0), (5, 5), (0, 129)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_softcap_tile_fwd_window(window):
    for causal in (False, True):
        # (0, 129) with causal is the window (0, 0): one key per row, where the cap changes
        # nothing (the H100 run of 2026-12-07 measured separation 0 there); O, LSE still checked.
        one_key = window[0] == 0 and (causal or window[1] == 0)
        check_fwd((1, 4, 2, 300, 333, 128, 128), causal, 20.0, seed_of("scfw", window, causal),
                  separation=not one_key, window_left=window[0], window_right=window[1])


def test_softcap_zero_is_no_softcap_bitwise():
    q, k, v, _ = make_qkv((1, 4, 2, 300, 333, 128, 128), seed_of("sc0"))
    tau = f32_scale(128)
    for causal in (False, True):
        base = cuda_fwd(q, k, v, causal, tau, None)
        zero = cuda_fwd(q, k, v, causal, tau, 0.0)
        assert torch.equal(base[0], zero[0]) and torch.equal(base[1], zero[1])


@pytest.mark.parametrize("shape", [(2, 40, 8, 300, 420, 128, 128), (1, 30, 10, 260, 390, 192, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_softcap_tile_fwd_ignores_the_order_knobs(shape, monkeypatch):
    # Softcap runs the default consumer order and scheduler (one instantiation per
    # head_dim): FP8ATTN_TILE_PINGPONG / _PERSISTENT change nothing, bit for bit.
    q, k, v, _ = make_qkv(shape, seed_of("scpp", shape))
    tau = f32_scale(shape[5])
    base = cuda_fwd(q, k, v, True, tau, 20.0)
    for pp, ps in (("1", "0"), ("0", "1"), ("1", "1")):
        monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", pp)
        monkeypatch.setenv("FP8ATTN_TILE_PERSISTENT", ps)
        got = cuda_fwd(q, k, v, True, tau, 20.0)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), (pp, ps)


def test_softcap_tile_fwd_nan_in_q_stays_in_its_row():
    # numerics.md section 2: a NaN in q row r makes that row's O and LSE NaN (as the
    # reference), and no other row changes (the row's scale is its own).
    shape = (1, 2, 1, 300, 300, 64, 64)
    q, k, v, _ = make_qkv(shape, seed_of("scnan"))
    tau = f32_scale(64)
    clean = cuda_fwd(q, k, v, False, tau, 20.0)
    q[0, 1, 77, 5] = float("nan")
    out, lse = cuda_fwd(q, k, v, False, tau, 20.0)
    o_cpu, _ = OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", softcap=20.0)
    assert torch.isnan(o_cpu[0, 1, 77]).all()
    assert torch.isnan(out[0, 1, 77]).all() and torch.isnan(lse[0, 1, 77])
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[0, 1, 77] = False
    assert torch.equal(out[keep], clean[0][keep]) and torch.equal(lse[keep], clean[1][keep])


def test_softcap_tile_fwd_nan_outside_the_window():
    # numerics.md section 14: a NaN in a key tile outside every window of a row's
    # 64-row warpgroup never reaches that row (its warpgroup does not read the tile):
    # bitwise the clean run; the capped logits of the other tiles are unchanged.
    sq = sk = 512
    window, key = (5, 5), 260
    q, k, v, _ = make_qkv((1, 2, 1, sq, sk, 64, 64), seed_of("scnanw"))
    tau = f32_scale(64)
    kw = {"window_left": window[0], "window_right": window[1]}
    clean = cuda_fwd(q, k, v, False, tau, 20.0, **kw)
    k[0, 0, key, 3] = float("nan")
    out, lse = cuda_fwd(q, k, v, False, tau, 20.0, **kw)
    o_cpu, _ = OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", softcap=20.0, **kw)
    assert torch.isnan(out)[torch.isnan(o_cpu)].all(), "NaN was lost in O"
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    vis = (j >= i - window[0]) & (j <= i + window[1])
    touch = vis[:, 128 * (key // 128):128 * (key // 128 + 1)].any(dim=1)
    group = torch.zeros(sq, dtype=torch.bool)
    for g0 in range(0, sq, 64):
        group[g0:g0 + 64] = touch[g0:g0 + 64].any()
    safe = ~group
    assert safe.any() and (~safe).any()
    assert torch.equal(out[:, :, safe], clean[0][:, :, safe]) and torch.equal(lse[:, :, safe], clean[1][:, :, safe])
    assert torch.isfinite(out[:, :, safe]).all()


# ---- backward --------------------------------------------------------------------------


def bwd_inputs(shape, causal, cap, seed, std=LOGIT_STD, **kw):
    """CPU-reference `tile` forward O / LSE (both sides) and the CUDA `tile` forward's
    LSE for the kernel (each side's P normalized against its own S; test_tile_cuda_bwd)."""
    q, k, v, dout = make_qkv(shape, seed, std)
    tau = f32_scale(shape[5])
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=cap, **kw)
    lse_cuda = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128, "tile", softcap=cap, **kw)[1]
    return q, k, v, out, lse, dout, lse_cuda


def cuda_bwd(inp, causal, cap, mode, fmt, diagnostics=False, **kw):
    q, k, v, out, lse, dout, lse_cuda = inp
    tau = f32_scale(q.shape[-1])
    poison_cuda_allocator([(q.shape, torch.bfloat16), (k.shape, torch.bfloat16), (v.shape, torch.bfloat16),
                           ((4,) + tuple(lse.shape), torch.float32)])
    dev = [t.cuda() for t in (dout, q, k, v, out)]
    extra = {} if cap is None else {"softcap": cap}
    r = OPS.bwd(*dev, lse_cuda, tau, causal, "fp8", mode, 128, fmt, diagnostics, "tile", **extra, **kw)
    torch.cuda.synchronize()
    return tuple(t.cpu() for t in r)


def check_bwd(shape, causal, cap, mode, fmt, seed, **kw):
    inp = bwd_inputs(shape, causal, cap, seed, **kw)
    q, k, v, out, lse, dout, _ = inp
    tau = f32_scale(q.shape[-1])
    cuda = cuda_bwd(inp, causal, cap, mode, fmt, **kw)
    cpu = OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", mode, 128, fmt, False, "tile", softcap=cap, **kw)
    ex = OPS.bwd(dout.double(), q.double(), k.double(), v.double(), out.double(), lse, tau, causal, "exact", mode,
                 128, fmt, False, softcap=cap, **kw)
    label = f"softcap={cap} bwd {shape} causal={causal} {mode} {fmt} {kw}"
    check_grads(cuda, cpu, ex, label)
    # The same backward without the cap (same O / LSE, so only the chain factor and P
    # change): far from the capped gradients relative to their error.
    plain = cuda_bwd(inp, causal, None, mode, fmt, **kw)
    for name, c, r, p in zip(("dQ", "dK", "dV"), cuda[:3], cpu[:3], plain[:3]):
        err, sep = rel(c, r), rel(p, c)
        assert sep > MIN_SEPARATION * err, f"{label} {name}: separation {sep:.4g}, error {err:.4g}"
    return cuda


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=SIDS)
def test_softcap_tile_bwd(shape, causal):
    cap = CAPS[SHAPES.index(shape) % len(CAPS)]
    check_bwd(shape, causal, cap, "delta_matching", "e4m3", seed_of("scb", shape, causal))


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("mode,fmt", [("stale", "e5m2"), ("matched_do", "e4m3"), ("delta_matching", "e5m2")])
def test_softcap_tile_bwd_modes(mode, fmt, cap):
    check_bwd((1, 4, 2, 300, 333, 128, 128), False, cap, mode, fmt, seed_of("scbm", mode, fmt, cap))


@pytest.mark.parametrize("sq,sk", [(1, 300), (77, 77), (129, 300), (300, 129)])
def test_softcap_tile_bwd_ragged(sq, sk):
    for causal in (False, True):
        check_bwd((1, 2, 1, sq, sk, 64, 64), causal, 20.0, "delta_matching", "e4m3", seed_of("scbr", sq, sk, causal))


def test_softcap_tile_bwd_window():
    for window in ((64, 0), (5, 5)):
        check_bwd((1, 4, 2, 300, 333, 64, 64), False, 20.0, "delta_matching", "e4m3", seed_of("scbw", window),
                  window_left=window[0], window_right=window[1])


def pair_residuals(q, k, v, dout, tau, causal, cap):
    """Mean pre-cast row-sum residual (diagnostics row 2: dX' with softcap) of the
    CUDA `tile` backward after the CUDA `tile` forward, per delta mode; every
    gradient and diagnostic finite."""
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile", softcap=cap)
    res = {}
    for mode in ("stale", "delta_matching"):
        *grads, diag = OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", mode, 128, "e4m3", True, "tile",
                               softcap=cap)
        assert all(torch.isfinite(g).all() for g in grads), mode
        assert torch.isfinite(diag).all(), mode
        res[mode] = diag[2].double().mean().item()
    return res


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_dm_invariant_with_cuda_forward(d, causal):
    # numerics.md section 12: the Delta-Matching invariant holds on dX' = P (dP - delta)
    # (its row sums are zero; dX's, after the cap's derivative, are not), which the
    # pre-cast diagnostics measure; stale stays far above it.
    # NOTE: logits of std 2 (INVARIANT_STD): the diagnostic is relative per row,
    # |sum_j dX'| / sum_j |dX'|, and a near one-hot row (std 7 with c = 50, where the cap
    # barely acts) has sum |dX'| ~ P_2 |dP_1 - dP_2| down at FP32 rounding, so its ratio
    # reads up to 1 from rounding alone: there the CPU reference itself (the oracle, same
    # formulas) gives a mean of 8.7e-4 at d = 64 causal (19 rows above 1e-4), and the kernels
    # matched it (8.6e-4, H100, 2026-12-07). With std 2 the reference gives <= 1e-7 at every
    # d, mask and cap, stale 3e-3 to 1.4e-2.
    q, k, v, dout = (t.cuda() for t in make_qkv((1, 4, 2, 384, 384, d, d), seed_of("scdm", d, causal),
                                                INVARIANT_STD))
    for cap in (3.0, 50.0):
        res = pair_residuals(q, k, v, dout, f32_scale(d), causal, cap)
        assert res["delta_matching"] < 1e-5, (cap, res)
        assert res["stale"] >= 10 * res["delta_matching"], (cap, res)


def test_softcap_tile_bwd_prepass_variants_and_pingpong(monkeypatch):
    # Pre-pass v1 (64 queries per CTA) and v2 (128) with softcap: gradients within the
    # tile tolerance of each other, the Delta-Matching invariant for both;
    # FP8ATTN_TILE_BWD_PINGPONG is ignored with softcap (the default order): dK, dV
    # bitwise, dQ up to the order of its FP32 adds.
    shape = (1, 4, 2, 333, 300, 128, 128)
    inp = bwd_inputs(shape, True, 20.0, seed_of("scbv"), std=INVARIANT_STD)  # NOTE at the invariant test
    runs = {}
    for pq, pp in (("64", "0"), ("128", "0"), ("128", "1")):
        monkeypatch.setenv("FP8ATTN_TILE_PREPASS_Q", pq)
        monkeypatch.setenv("FP8ATTN_TILE_BWD_PINGPONG", pp)
        runs[pq, pp] = cuda_bwd(inp, True, 20.0, "delta_matching", "e4m3", diagnostics=True)
    base = runs["128", "0"]
    assert all(torch.equal(a, b) for a, b in zip(runs["128", "1"][1:3], base[1:3])), "the knob changed dK / dV"
    assert rel(runs["128", "1"][0], base[0]) < 1e-3
    for a, b in zip(runs["64", "0"][:3], base[:3]):
        assert rel(a, b) < 2e-2
    for key, r in runs.items():
        assert r[3][2].double().mean().item() < 1e-5, key


def test_softcap_tile_bwd_nan_in_q():
    # A NaN in q row r: that row's dQ is NaN (as the reference's), every other row's
    # dQ finite and the clean run's up to the order of dq_accum's FP32 adds.
    shape = (1, 2, 1, 300, 300, 64, 64)
    inp = list(bwd_inputs(shape, False, 20.0, seed_of("scbnan")))
    clean = cuda_bwd(tuple(inp), False, 20.0, "delta_matching", "e4m3")
    inp[0] = inp[0].clone()
    inp[0][0, 1, 77, 5] = float("nan")
    tau = f32_scale(64)
    inp[6] = OPS.fwd(inp[0].cuda(), inp[1].cuda(), inp[2].cuda(), tau, False, "fp8", 128, "tile", softcap=20.0)[1]
    got = cuda_bwd(tuple(inp), False, 20.0, "delta_matching", "e4m3")
    assert torch.isnan(got[0][0, 1, 77]).all()
    keep = torch.ones(got[0].shape[:3], dtype=torch.bool)
    keep[0, 1, 77] = False
    assert torch.isfinite(got[0][keep]).all()
    assert rel(got[0][keep], clean[0][keep]) < 1e-3


def test_softcap_tile_bwd_dm_sums():
    # bwd_dm_sums (context parallelism's pre-pass of one key shard, numerics.md
    # section 11) runs the same pre-pass with softcap: the partial sums sum_j P dP_hat
    # and sum_j P of the capped P agree with the CPU reference's.
    shape = (1, 4, 2, 300, 333, 64, 64)
    q, k, v, out, lse, dout, _ = bwd_inputs(shape, False, 20.0, seed_of("scsum"))
    tau = f32_scale(64)
    args = (tau, False, 128, "e4m3", "tile")
    cpu = OPS.bwd_dm_sums(dout, q, k, v, lse, *args, softcap=20.0)
    cuda = OPS.bwd_dm_sums(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), lse.cuda(), *args, softcap=20.0)
    plain = OPS.bwd_dm_sums(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), lse.cuda(), *args)
    for name, c, r, p in zip(("sum_pdp", "sum_p"), cuda, cpu, plain):
        c = c.cpu()
        assert torch.isfinite(c).all(), name
        assert rel(c, r) < 2e-2, (name, rel(c, r))
        assert rel(p.cpu(), r) > 10 * rel(c, r), name   # the uncapped sums are not these


# ---- the public functions on CUDA --------------------------------------------------------


def test_softcap_attention_autograd_on_cuda():
    # fp8attn.attention(scaling="tile", softcap=c) on CUDA: the raw ops' results
    # through autograd, within the tile tolerance of the CPU path.
    import fp8attn
    q, k, v, do = make_qkv((1, 4, 2, 300, 333, 128, 128), seed_of("scag"))
    res = {}
    for dev in ("cpu", "cuda"):
        qg, kg, vg = (t.to(dev).clone().requires_grad_(True) for t in (q, k, v))
        out = fp8attn.attention(qg, kg, vg, causal=True, scaling="tile", softcap=20.0)
        out.backward(do.to(dev))
        res[dev] = [out.detach().cpu()] + [t.grad.cpu() for t in (qg, kg, vg)]
    tau = f32_scale(128)
    raw, _ = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, True, "fp8", 128, "tile", softcap=20.0)
    assert torch.equal(raw.cpu(), res["cuda"][0])
    for name, c, r in zip(("O", "dQ", "dK", "dV"), res["cuda"], res["cpu"]):
        assert torch.isfinite(c.float()).all(), name
        assert rel(c, r) < 3e-2, (name, rel(c, r))


def test_softcap_varlen_on_cuda_runs_per_sequence():
    # varlen_attention with softcap takes the per-sequence loop (the single launch
    # excludes softcap), each sequence the dense `attention` on CUDA bit for bit (O, dK,
    # dV; dQ up to its FP32 adds).
    import fp8attn
    q, k, v, do = make_qkv((1, 4, 2, 330, 330, 64, 64), seed_of("scvl"))
    cu = torch.tensor([0, 77, 206, 330], dtype=torch.int32)
    flat = lambda t: t[0].transpose(0, 1).contiguous().cuda()  # noqa: E731  [total, heads, d]
    qf, kf, vf = (flat(t).requires_grad_() for t in (q, k, v))
    o = fp8attn.varlen_attention(qf, kf, vf, cu, cu, causal=True, scaling="tile", softcap=20.0)
    o.backward(flat(do))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        sl = lambda t: t[:, :, a:b].cuda().clone().requires_grad_()  # noqa: E731
        qs, ks, vs = sl(q), sl(k), sl(v)
        ref = fp8attn.attention(qs, ks, vs, causal=True, scaling="tile", softcap=20.0)
        ref.backward(do[:, :, a:b].cuda())
        assert torch.equal(o[a:b], ref[0].transpose(0, 1))
        assert torch.equal(kf.grad[a:b], ks.grad[0].transpose(0, 1))
        assert torch.equal(vf.grad[a:b], vs.grad[0].transpose(0, 1))
        assert rel(qf.grad[a:b], qs.grad[0].transpose(0, 1)) < 1e-3


# ---- the `row` recipe refuses softcap on CUDA ------------------------------------------------


def test_softcap_row_cuda_refused_naming_tile():
    import fp8attn
    q, k, v, dout = (t.cuda() for t in make_qkv((1, 2, 1, 200, 200, 64, 64), seed_of("scrow")))
    tau = f32_scale(64)
    msg = r"argument 'softcap'.*scaling='row'.*scaling='tile' runs it"
    with pytest.raises(NotImplementedError, match=msg):
        OPS.fwd(q, k, v, tau, False, "fp8", 128, "row", softcap=20.0)
    out, lse = OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", softcap=20.0)
    with pytest.raises(NotImplementedError, match=msg):
        OPS.bwd(dout, q, k, v, out, lse, tau, False, "fp8", "delta_matching", 128, "e4m3", False, "row",
                softcap=20.0)
    with pytest.raises(NotImplementedError, match=msg):
        OPS.bwd_dm_sums(dout, q, k, v, lse, tau, False, 128, "e4m3", "row", softcap=20.0)
    with pytest.raises(NotImplementedError, match=r"argument 'softcap'.*scaling='tile' runs it"):
        fp8attn.attention(q, k, v, softcap=20.0)   # scaling="row" is the default
    for bad in (1e-7, 1e5):   # outside the CUDA range [1e-6, 1e4] (the kernels' cap error ~2e-7 c)
        with pytest.raises(ValueError, match=r"argument 'softcap'.*\[1e-06, 10000\]|argument 'softcap'.*on CUDA"):
            OPS.fwd(q, k, v, tau, False, "fp8", 128, "tile", softcap=bad)
        with pytest.raises(ValueError, match="argument 'softcap'.*on CUDA"):
            fp8attn.attention(q, k, v, scaling="tile", softcap=bad)
