"""GPU tests of the sm_90a quantization and forward kernels and of the CUDA op
wiring (csrc/torch/ops_cuda.cpp), end to end through torch.ops.fp8attn on CUDA
against the CPU reference op on the same inputs (docs/numerics.md section 6):

    ||cuda - exact|| <= 2 * ||cpu_fp8 - exact|| + 1e-3 * ||exact||
    ||cuda - cpu_fp8|| / ||cpu_fp8|| < 2e-2

for O and LSE of the forward (and dQ, dK, dV of forward + backward on CUDA),
over head dims 64, 128, 256, 192/128, GQA ratios 1, 3, 8, causal or not,
seqlen_q != seqlen_k both ways, seqlens 1 ... 2049, rows that see no key,
non-contiguous inputs and dO. Outputs are poisoned with NaN before each call
(an unwritten element fails); NaN never passes; the forward is bitwise
deterministic; the quantization kernels are bit-exact against the CPU
quantize_blockwise op; the Delta-Matching invariant holds in-kernel on the
CUDA forward's outputs. The backward kernels themselves are tested in
isolation by tests/python/test_cuda_bwd.py.

Skips cleanly without a GPU or without the CUDA kernels compiled in.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_cuda.py
"""
import math
import os
import re
import zlib

import pytest
import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn)
from wgmma_bounds import wgmma_lse_bound

pytestmark = pytest.mark.gpu

HAS_CUDA_KERNELS = fp8attn._lib.HAS_CUDA_KERNELS  # NOTE: a CPU-only build registers CUDA-key error kernels too
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if not HAS_CUDA_KERNELS:
    pytest.skip("fp8attn was built without CUDA kernels (FP8ATTN_BUILD_CUDA=1)", allow_module_level=True)

OPS = torch.ops.fp8attn


# ---- helpers ---------------------------------------------------------------------------


def f32_scale(d):
    """Default softmax scale, rounded to FP32 as the op stores it (same on every path)."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def seed_of(*key):
    return zlib.crc32(repr(key).encode())


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16()


def make_qkv(b, hq, hkv, sq, sk, d, dv, seed):
    """Fresh standard-normal BF16 Q, K, V (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return randn(b, hq, sq, d, gen=gen), randn(b, hkv, sk, d, gen=gen), randn(b, hkv, sk, dv, gen=gen)


def poison(shapes):
    """Leaves NaN-filled blocks of these sizes in the CUDA caching allocator so
    outputs allocated next start as NaN (an unwritten element then fails)."""
    blocks = [torch.full(s, float("nan"), device="cuda", dtype=dt) for s, dt in shapes]
    torch.cuda.synchronize()
    del blocks


def cuda_fwd(q, k, v, causal, tau=None):
    tau = f32_scale(q.shape[-1]) if tau is None else tau
    b, hq, sq, _ = q.shape
    poison([((b, hq, sq, v.shape[-1]), torch.bfloat16), ((b, hq, sq), torch.float32)])
    out, lse = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128)
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def ref_fwd(q, k, v, causal):
    tau = f32_scale(q.shape[-1])
    cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
    exact = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128)
    return cpu, exact


def check_close(name, c, r, e, label):
    """numerics.md section 6 on one output (finite entries; non-finite ones must match)."""
    c, r, e = c.double(), r.double(), e.double()
    assert not torch.isnan(c).any(), f"{label} {name}: NaN (unwritten element or bad arithmetic)"
    # Rows that see no key: LSE = -inf on every path, at the same places.
    fin = torch.isfinite(r)
    assert torch.equal(torch.isfinite(c), fin), f"{label} {name}: non-finite pattern differs from the reference"
    assert torch.equal(c[~fin], r[~fin]), f"{label} {name}: non-finite values differ"
    c, r, e = c[fin], r[fin], e[fin]
    if c.numel() == 0:
        return
    ne = e.norm().item()
    err_cuda = (c - e).norm().item()
    err_cpu = (r - e).norm().item()
    rel_cpu = (c - r).norm().item() / max(r.norm().item(), 1e-30)
    assert err_cuda <= 2 * err_cpu + 1e-3 * ne, (
        f"{label} {name}: ||cuda-exact||={err_cuda:.4g} > 2*||cpu-exact||={2 * err_cpu:.4g} + 1e-3*||exact||={1e-3 * ne:.4g}"
    )
    assert rel_cpu < 2e-2, f"{label} {name}: ||cuda-cpu||/||cpu|| = {rel_cpu:.4g}"


def check_fwd(shape, causal, seed, q=None, k=None, v=None):
    b, hq, hkv, sq, sk, d, dv = shape
    if q is None:
        q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, seed)
    out, lse = cuda_fwd(q, k, v, causal)
    (o_cpu, l_cpu), (o_ex, l_ex) = ref_fwd(q, k, v, causal)
    label = f"{shape} causal={causal}"
    assert out.shape == (b, hq, sq, dv) and out.dtype == torch.bfloat16
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    check_close("O", out, o_cpu, o_ex, label)
    check_close("LSE", lse, l_cpu, l_ex, label)
    check_rows(out, lse, o_cpu, l_cpu, label,
               wgmma_lse_bound(q, k, f32_scale(d), causal) if wgmma_fwd_active(d, dv) else None)
    return out, lse


def wgmma_fwd_active(d, dv):
    """True when the CUDA forward runs the wgmma kernel (fwd_wgmma_e4m3_blockscale_sm90.cu) at
    (d, dv) itself: (d, dv) in {(64, 64), (128, 128), (256, 256), (192, 128)} (the `row` recipe's
    one forward kernel since the mma.sync one was removed on 2026-12-07)."""
    return (d, dv) in ((64, 64), (128, 128), (256, 256), (192, 128))


def check_rows(out, lse, o_cpu, l_cpu, label, s_bound=None):
    """Per-row checks that a norm over all rows would hide (a wrong mask on a few rows).
    - LSE: both paths take the FP32 log-sum-exp of the same S (the same bit-exact
      FP8 Q, K codes and scales; LSE never sees the quantized P), so they differ
      only by summation order and exp/log rounding, ~1e-6 relative: allow 1e-4
      (one key too many or too few moves LSE by log(1 + P_j), far more).
      On the wgmma kernel S itself carries the FP8 tensor-core accumulation
      error, and LSE moves with it by at most s_bound per row
      (wgmma_bounds.wgmma_lse_bound, numerics.md section 7): it is added to the allowance.
    - O rows: FP8 rounding flips of single P values (a different exp()) and the
      coarser V scale of diagonal tiles move a row by a few percent at most;
      a wrong key moves a short row by tens of percent: allow 0.25 relative."""
    fin = torch.isfinite(l_cpu)
    d_lse = (lse.double() - l_cpu.double())[fin].abs()
    tol = 1e-4 * l_cpu.double()[fin].abs().clamp(min=1.0)
    if s_bound is not None:
        tol = tol + s_bound[fin]
    assert (d_lse <= tol).all(), f"{label} LSE: max |cuda-cpu| = {d_lse.max().item():.3g}"
    oc, orf = out.double(), o_cpu.double()
    rn = orf.norm(dim=-1)
    rel = (oc - orf).norm(dim=-1)[rn > 0] / rn[rn > 0]
    if rel.numel():
        assert rel.max().item() < 0.25, f"{label} O: worst row ||cuda-cpu||/||cpu|| = {rel.max().item():.3g}"


# ---- quantization kernels: bit-exact against the CPU op -----------------------------------


def quant_input(b, h, s, d, seed):
    """Standard-normal values times a per-(token, 128-channel) magnitude spread over
    many binades, plus an all-zero block, so the scales vary and the zero rule is hit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, s, d, generator=gen)
    x = x * torch.exp2(torch.randint(-30, 30, (b, h, s, 1), generator=gen).float())
    x[0, 0, : min(s, 128), : min(d, 128)] = 0.0  # all-zero row and channel blocks (scale 1)
    x[-1, -1, 0, :] = torch.randn(d, generator=gen) * 1e-39  # BF16 subnormals: clamped scale exponent
    if s > 1:
        # Exact round-to-nearest-even ties of both formats after scaling (the amax 448
        # fixes the scale to 1 for E4M3), down into the FP8 subnormals, and signed zeros.
        i = torch.arange(d)
        tie = (1 + (2 * (i % 16) + 1) / 32.0) * torch.exp2(-(i // 16).float() * 2 - 1)
        x[0, -1, 1, :] = tie * torch.where(i % 3 == 0, -1.0, 1.0)
        x[0, -1, 1, 0] = 448.0
        x[0, -1, 1, 1:4] = torch.tensor([-0.0, 0.0, -0.0])
    return x.bfloat16()


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("s", [1, 17, 130, 300])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [3, 2])
def test_quantize_bitexact(d, s, fmt, dim):
    x = quant_input(2, 3, s, d, seed_of("q", d, s, fmt, dim))
    codes_r, scales_r = OPS.quantize_blockwise(x.float(), dim, 128, fmt)
    codes_c, scales_c = OPS.quantize_blockwise(x.cuda(), dim, 128, fmt)
    assert codes_c.shape == codes_r.shape and scales_c.shape == scales_r.shape
    assert torch.equal(codes_c.cpu(), codes_r), "FP8 codes differ from the CPU quantize_blockwise"
    assert torch.equal(scales_c.cpu(), scales_r), "block scales differ from the CPU quantize_blockwise"
    assert (scales_r == 1.0).any(), "the zero block (scale 1) was not exercised"


@pytest.mark.parametrize("dim", [3, 2])
def test_quantize_strided_input(dim):
    # A [B, S, H, D] tensor seen as [B, H, S, D] (the flash layout): same codes.
    x = quant_input(2, 300, 4, 128, seed_of("strided", dim)).permute(0, 2, 1, 3)
    assert not x.is_contiguous()
    codes_r, scales_r = OPS.quantize_blockwise(x.float().contiguous(), dim, 128, "e4m3")
    codes_c, scales_c = OPS.quantize_blockwise(x.cuda(), dim, 128, "e4m3")
    assert torch.equal(codes_c.cpu(), codes_r) and torch.equal(scales_c.cpu(), scales_r)


@pytest.mark.parametrize("dim", [3, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_nonfinite_block(dim, bad):
    # numerics.md section 2: a non-finite value makes its whole block NaN (scale
    # and codes), never a saturated finite value, and no other block changes.
    x = quant_input(1, 2, 260, 128, seed_of("nf", dim, bad))
    x[0, 1, 140, 5] = bad
    codes_r, scales_r = OPS.quantize_blockwise(x.float(), dim, 128, "e4m3")
    codes_c, scales_c = (t.cpu() for t in OPS.quantize_blockwise(x.cuda(), dim, 128, "e4m3"))
    nan_s = torch.isnan(scales_r)
    assert nan_s.sum() == 1 and torch.equal(torch.isnan(scales_c), nan_s)
    assert torch.equal(scales_c[~nan_s], scales_r[~nan_s])
    # Codes of the NaN block: E4M3 NaN (S.1111.111) whatever the sign.
    blk = (0, 1, 140, slice(0, 128)) if dim == 3 else (0, 1, slice(128, 256), 5)
    assert torch.equal(codes_c[blk] & 0x7F, torch.full_like(codes_c[blk], 0x7F))
    keep = torch.ones_like(codes_r, dtype=torch.bool)
    keep[blk] = False
    assert torch.equal(codes_c[keep], codes_r[keep])


# ---- forward vs the CPU reference ---------------------------------------------------------

HEAD_DIM_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (2, 4, 2, 200, 333, 64, 64),
    (2, 6, 2, 333, 200, 128, 128),
    (1, 4, 4, 257, 129, 256, 256),
    (1, 4, 2, 300, 300, 192, 128),
]


@pytest.mark.parametrize("shape", HEAD_DIM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_head_dims(shape, causal):
    check_fwd(shape, causal, seed_of("hd", shape, causal))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (16, 2), (24, 3)], ids=["gqa1", "gqa3", "gqa8", "gqa8_kv3"])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_gqa(hq, hkv, causal):
    check_fwd((1, hq, hkv, 150, 190, 128, 128), causal, seed_of("gqa", hq, hkv, causal))


SEQLENS = [(1, 1), (17, 17), (113, 113), (128, 128), (129, 129), (1023, 1023), (2049, 2049),
           (1, 129), (129, 1), (17, 1023), (1023, 17), (129, 2049), (2049, 129)]


@pytest.mark.parametrize("sq,sk", SEQLENS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_seqlens(sq, sk, causal):
    d = 64 if max(sq, sk) > 1024 else 128  # keeps the CPU reference quick on the long ones
    check_fwd((1, 2, 1, sq, sk, d, d), causal, seed_of("sl", sq, sk, causal))


def test_fwd_rows_without_keys():
    # causal with seqlen_q > seqlen_k: query i sees no key when i + sk - sq < 0.
    sq, sk = 300, 100
    out, lse = check_fwd((1, 3, 1, sq, sk, 64, 64), True, seed_of("nokey"))
    blind = sq - sk
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all()
    assert torch.isfinite(lse[:, :, blind:]).all() and out[:, :, blind:].abs().sum() > 0


def test_fwd_no_keys_at_all():
    q = torch.randn(1, 2, 5, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 2, 0, 64, dtype=torch.bfloat16, device="cuda")
    out, lse = OPS.fwd(q, k, k, 0.125, False, "fp8", 128)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_fwd_noncontiguous_inputs_match_contiguous():
    # Flash layout [B, S, H, D] viewed as [B, H, S, D]: bitwise the same result.
    gen = torch.Generator().manual_seed(seed_of("nc"))
    q, k, v = (torch.randn(2, 190, h, 128, generator=gen).bfloat16().cuda() for h in (4, 2, 2))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    a = OPS.fwd(qt, kt, vt, 0.1, True, "fp8", 128)
    b = OPS.fwd(qt.contiguous(), kt.contiguous(), vt.contiguous(), 0.1, True, "fp8", 128)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_more_query_tiles_than_sms_equals_one_head_at_a_time(d, causal):
    # More (query tile, head, batch) work tiles than 2x the SMs, so the CTAs run
    # in several waves (and would share SMs under a persistent scheduler), and
    # causal with seqlen_q > seqlen_k gives tiles whose rows see no key: O and
    # LSE bitwise equal to calling the op on one (batch, head) at a time.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b, hq, hkv, sk = 2, 8, 2, 700
    rows = 192 if d == 64 else 128  # query rows per CTA of the default schedule (v11 at d = 64, v3 at 128)
    sq = rows * (2 * sms // (b * hq) + 2) - 37  # ragged last query tile
    assert b * hq * -(-sq // rows) > 2 * sms
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, d, seed_of(f"persist{d}{causal}")))
    out, lse = OPS.fwd(q, k, v, f32_scale(d), causal, "fp8", 128)
    assert torch.isfinite(out).all()
    for bi in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            o1, l1 = OPS.fwd(q[bi:bi + 1, h:h + 1], k[bi:bi + 1, hk:hk + 1], v[bi:bi + 1, hk:hk + 1],
                             f32_scale(d), causal, "fp8", 128)
            assert torch.equal(out[bi:bi + 1, h:h + 1], o1), (bi, h)
            assert torch.equal(lse[bi:bi + 1, h:h + 1], l1), (bi, h)
    if causal:  # rows with no visible key: O = 0, LSE = -inf
        assert torch.isneginf(lse[:, :, : sq - sk]).all() and (out[:, :, : sq - sk] == 0).all()


def test_fwd_deterministic():
    q, k, v = (t.cuda() for t in make_qkv(2, 6, 2, 700, 900, 128, 128, seed_of("det")))
    a = OPS.fwd(q, k, v, f32_scale(128), True, "fp8", 128)
    b = OPS.fwd(q, k, v, f32_scale(128), True, "fp8", 128)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_fwd_nan_never_passes(where):
    # numerics.md section 2: non-finite input makes the blocks it feeds NaN.
    # Wherever the reference gives NaN the kernel must too (it may be coarser:
    # see docs/kernels/fwd_e4m3_blockscale_sm90.md on V blocks in diagonal tiles).
    q, k, v = make_qkv(1, 2, 1, 260, 260, 64, 64, seed_of("nan", where))
    {"q": q, "k": k, "v": v}[where][0, 0, 200, 7] = float("nan")
    for causal in (False, True):
        out, lse = cuda_fwd(q, k, v, causal)
        o_cpu, l_cpu = OPS.fwd(q, k, v, f32_scale(64), causal, "fp8", 128)
        assert torch.isnan(o_cpu).any(), "the planted NaN did not reach the reference"
        assert torch.isnan(out)[torch.isnan(o_cpu)].all(), f"{where} causal={causal}: NaN was lost in O"
        assert torch.isnan(lse)[torch.isnan(l_cpu)].all(), f"{where} causal={causal}: NaN was lost in LSE"
        if causal and where in ("k", "v"):
            # Rows of the first 128-row tile never see key 200: untouched.
            assert torch.isfinite(out[:, :, :128]).all() and torch.isfinite(lse[:, :, :128]).all()


def test_fwd_softmax_scale_and_large_logits():
    # Large logits (tau * |S| ~ 100s) must not overflow exp: the running max works.
    shape = (1, 2, 2, 200, 300, 128, 128)
    q, k, v = make_qkv(*shape, seed=seed_of("big"))
    q = (q.float() * 8).bfloat16()
    out, lse = cuda_fwd(q, k, v, False)
    (o_cpu, l_cpu), (o_ex, l_ex) = ref_fwd(q, k, v, False)
    check_close("O", out, o_cpu, o_ex, "large logits")
    check_close("LSE", lse, l_cpu, l_ex, "large logits")


# ---- the forward kernel on awkward shapes (the wgmma kernel; CPU reference as the oracle) ----
# NOTE: until 2026-12-07 this also ran the mma.sync forward (FP8ATTN_FWD_KERNEL=mma) on the
# same inputs and compared the two kernels; that kernel was removed (code at f7729f9).

KERNEL_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv): partial tiles, GQA, Sq > Sk and Sq < Sk, several key tiles
    (1, 4, 2, 200, 333, 64, 64),
    (2, 6, 3, 333, 200, 128, 128),
    (1, 2, 1, 45, 700, 128, 128),
    (1, 4, 1, 700, 45, 64, 64),
    (1, 2, 2, 640, 640, 128, 128),
    # two head_dim blocks (fwd_wgmma_d2_kernel): 64- and 128-wide second block
    (1, 4, 2, 200, 333, 256, 256),
    (1, 2, 1, 333, 200, 256, 256),
    (1, 6, 3, 45, 700, 192, 128),
    (1, 2, 2, 300, 300, 192, 128),
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_kernel_shapes(shape, causal, monkeypatch):
    # The reference checks of check_fwd (O, LSE, per-row LSE with the wgmma bound)
    # with the default schedule.
    seed = seed_of("kernels", shape, causal)
    q, k, v = make_qkv(*shape, seed)
    monkeypatch.delenv("FP8ATTN_FWD_KERNEL", raising=False)
    check_fwd(shape, causal, seed, q, k, v)


# ---- the wgmma forward's consumer schedules (FP8ATTN_FWD_KERNEL, head_dim <= 128) ----------
# pingpong (v3, default at d = 128), serial (v1), serial3 (v11: three consumer
# warpgroups, 192-row query tiles, default at d = 64), overlap (v2). Same math in the same
# order per (row, key tile): the P V partial of an output channel does not depend
# on how many channels one wgmma computes, so the outputs are bitwise equal.

SCHEDULES = ["wgmma_pingpong", "wgmma_serial", "wgmma_serial3", "wgmma_overlap"]
SCHEDULE_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (1, 4, 2, 200, 333, 64, 64),     # 192-row tile + a ragged one, GQA
    (1, 2, 1, 45, 700, 64, 64),      # one query tile, 2 and 3 warpgroups without rows
    (1, 4, 1, 700, 45, 64, 64),      # causal: rows without keys in whole warpgroups
    (2, 3, 3, 385, 385, 128, 128),   # 385 = 2 * 192 + 1: a tile with one row
    (1, 2, 2, 640, 1000, 128, 128),  # several key tiles, stages reused
]


@pytest.mark.parametrize("shape", SCHEDULE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_schedules_agree_bitwise(shape, causal, monkeypatch):
    seed = seed_of("schedules", shape, causal)
    q, k, v = make_qkv(*shape, seed)
    outs = {}
    for sched in SCHEDULES:
        monkeypatch.setenv("FP8ATTN_FWD_KERNEL", sched)
        outs[sched] = check_fwd(shape, causal, seed, q, k, v)
    o0, l0 = outs[SCHEDULES[0]]
    for sched in SCHEDULES[1:]:
        o1, l1 = outs[sched]
        assert torch.equal(o1, o0), f"{sched} O differs from {SCHEDULES[0]}"
        assert torch.equal(l1, l0), f"{sched} LSE differs from {SCHEDULES[0]}"


NONFINITE_V_CASES = [
    # (seqlen_q, seqlen_k, key, value, rows finite under every schedule, rows finite under v1 / v11)
    # Sq = Sk: key 200 is in key tile 1, which rows < 128 never see; v11's 192-row CTA
    # holds rows 0-191, yet its warpgroups of rows 0-127 skip tile 1.
    (260, 260, 200, float("nan"), 128, 128),
    # Sk - Sq = 64: rows 0-63 see key tile 0 only, rows >= 64 also tile 1, rows >= 86
    # key 150. Pingpong / overlap run every key tile of the CTA in both warpgroups, so
    # rows 0-63 may turn NaN there (numerics.md section 7, "CUDA kernels quantize whole
    # tiles"; not pinned here); the serial schedules skip tile 1 for them.
    (300, 364, 150, float("inf"), 0, 64),
]


@pytest.mark.parametrize("case", NONFINITE_V_CASES, ids=lambda c: f"sq{c[0]}-sk{c[1]}")
@pytest.mark.parametrize("sched", SCHEDULES)
def test_fwd_schedule_nonfinite_v_stays_in_its_key_tile(sched, case, monkeypatch):
    # A non-finite V value is never lost (rows the reference makes NaN are NaN), never
    # reaches LSE, and stays out of rows that see no key of its 128-key tile, as far as
    # the schedule promises (last two case fields).
    sq, sk, key, value, finite_all, finite_serial = case
    monkeypatch.setenv("FP8ATTN_FWD_KERNEL", sched)
    serial = sched in ("wgmma_serial", "wgmma_serial3")
    for d in (64, 128):
        q, k, v = make_qkv(1, 2, 1, sq, sk, d, d, seed_of("nonfinite-v", sched, d, sq, sk))
        v[0, 0, key, 7] = value
        out, lse = cuda_fwd(q, k, v, True)
        o_cpu, _ = OPS.fwd(q, k, v, f32_scale(d), True, "fp8", 128)
        assert torch.isnan(o_cpu).any(), "the planted value did not reach the reference"
        assert torch.isnan(out)[torch.isnan(o_cpu)].all(), f"{sched} d={d}: NaN was lost in O"
        assert torch.isfinite(lse).all(), f"{sched} d={d}: V reached LSE"
        rows = finite_serial if serial else finite_all
        assert torch.isfinite(out[:, :, :rows]).all(), f"{sched} d={d}: rows < {rows} ran key {key}'s tile"


def cuda_kernel_names(fn):
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# FP8ATTN_FWD_KERNEL value -> the kVariant template argument of fwd_wgmma_kernel<d, dv, kVariant>
# (kSerial 1, kOverlap 2, kPingpong 3, kSerial3 4); None: the default per head_dim.
SCHEDULE_VARIANT = {"wgmma_serial": 1, "wgmma_overlap": 2, "wgmma_pingpong": 3, "wgmma_serial3": 4, None: None}
DEFAULT_VARIANT = {64: 4, 128: 3}


@pytest.mark.parametrize("sched", list(SCHEDULE_VARIANT), ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_fwd_schedule_env_launches_that_schedule(sched, d, monkeypatch):
    # Guards the tests above: a schedule name that did not reach the launcher
    # would make "bitwise equal" trivially true.
    if sched is None:
        monkeypatch.delenv("FP8ATTN_FWD_KERNEL", raising=False)
    else:
        monkeypatch.setenv("FP8ATTN_FWD_KERNEL", sched)
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 1, 300, 300, d, d, seed_of("sched-env", d)))
    names = cuda_kernel_names(lambda: OPS.fwd(q, k, v, f32_scale(d), False, "fp8", 128))
    want = SCHEDULE_VARIANT[sched] or DEFAULT_VARIANT[d]
    fwd = [n for n in names if "fwd_wgmma_kernel" in n]
    pat = re.compile(rf"fwd_wgmma_kernel<\s*{d}\s*,\s*{d}\s*,\s*{want}\s*>")
    assert len(fwd) == 1 and pat.search(fwd[0]), (sched, d, fwd)


@pytest.mark.parametrize("value", ["wgmma_serial_3", "mma"])
def test_fwd_unknown_kernel_env_is_an_error(value, monkeypatch):
    # A misspelt FP8ATTN_FWD_KERNEL must not silently run the default kernel; "mma" (the
    # mma.sync forward, removed on 2026-12-07) is no value any more.
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 1, 100, 100, 64, 64, seed_of("env-typo")))
    monkeypatch.setenv("FP8ATTN_FWD_KERNEL", value)
    with pytest.raises((RuntimeError, ValueError), match=f"FP8ATTN_FWD_KERNEL='{value}'"):
        OPS.fwd(q, k, v, f32_scale(64), False, "fp8", 128)
    monkeypatch.setenv("FP8ATTN_FWD_KERNEL", "")  # empty = unset: the default
    out, _ = OPS.fwd(q, k, v, f32_scale(64), False, "fp8", 128)
    assert torch.isfinite(out).all()


def test_this_gpu_is_supported_and_import_does_not_warn():
    # The device check passes on the H200 (sm_90) on both sides; the import-time
    # warning (fp8attn._lib.warn_if_no_supported_gpu) stays silent in a fresh process.
    import subprocess
    import sys

    fp8attn._lib.check_cuda_device(torch.device("cuda", 0))
    assert fp8attn._lib.warn_if_no_supported_gpu() is None
    code = ("import warnings, sys\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import fp8attn\n"
            "sys.exit(7 if any(x.category.__name__ == 'DeviceSupportWarning' for x in w) else 0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(fp8attn.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_only_ops_on_cuda_name_the_argument():
    # fp8_encode / fp8_decode / dequantize_blockwise have CPU kernels only: a
    # ValueError naming the argument, not torch's "Could not run ... 'CUDA' backend".
    x = torch.randn(4, 128, device="cuda")
    with pytest.raises(ValueError, match="fp8attn.fp8_encode: argument 'x': expected a CPU tensor"):
        OPS.fp8_encode(x, "e4m3")
    with pytest.raises(ValueError, match="fp8attn.fp8_decode: argument 'codes': expected a CPU tensor"):
        OPS.fp8_decode(torch.zeros(4, dtype=torch.uint8, device="cuda"), "e4m3")
    with pytest.raises(ValueError, match="fp8attn.dequantize_blockwise: argument 'codes': expected a CPU tensor"):
        OPS.dequantize_blockwise(torch.zeros(1, 128, dtype=torch.uint8, device="cuda"),
                                 torch.ones(1, 1, device="cuda"), -1, 128, "e4m3")


# ---- argument errors (no kernel launch) -------------------------------------------------


def _dev(*ts):
    return [t.cuda() for t in ts]


def test_errors_name_the_argument():
    q, k, v = _dev(*make_qkv(1, 4, 2, 64, 64, 64, 64, seed=1))
    with pytest.raises(ValueError, match="block_size"):
        OPS.fwd(q, k, v, 0.125, False, "fp8", 64)
    with pytest.raises(NotImplementedError, match="precision"):
        OPS.fwd(q, k, v, 0.125, False, "exact", 128)
    with pytest.raises(ValueError, match="precision"):
        OPS.fwd(q, k, v, 0.125, False, "fp16", 128)
    # float32 is rounded to BF16 and head_dims up to 256 are zero-padded
    # (test_cuda_head_dims.py); float64 and head_dim 257 are errors.
    with pytest.raises(TypeError, match="'q'"):
        OPS.fwd(q.double(), k.double(), v.double(), 0.125, False, "fp8", 128)
    q257 = torch.randn(1, 4, 64, 257, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        OPS.fwd(q257, q257[:, :2], q257[:, :2], 0.125, False, "fp8", 128)
    with pytest.raises(ValueError, match="'k'"):
        OPS.fwd(q, k.cpu(), v, 0.125, False, "fp8", 128)
    with pytest.raises(ValueError, match="num_heads_kv"):
        OPS.fwd(q, k[:, :1].expand(1, 3, 64, 64), v[:, :1].expand(1, 3, 64, 64), 0.125, False, "fp8", 128)
    with pytest.raises(ValueError, match="softmax_scale"):
        OPS.fwd(q, k, v, float("nan"), False, "fp8", 128)
    out, lse = OPS.fwd(q, k, v, 0.125, False, "fp8", 128)
    with pytest.raises(ValueError, match="delta_mode"):
        OPS.bwd(q, q, k, v, out, lse, 0.125, False, "fp8", "nope", 128, "e4m3", False)
    with pytest.raises(ValueError, match="grad_format"):
        OPS.bwd(q, q, k, v, out, lse, 0.125, False, "fp8", "stale", 128, "e3m4", False)
    with pytest.raises(ValueError, match="lse"):
        OPS.bwd(q, q, k, v, out, lse[:, :1], 0.125, False, "fp8", "stale", 128, "e4m3", False)
    with pytest.raises(ValueError, match="dout"):
        OPS.bwd(q[:, :, :10], q, k, v, out, lse, 0.125, False, "fp8", "stale", 128, "e4m3", False)


# ---- forward + backward on CUDA vs the CPU reference ------------------------------------


def _bwd_available():
    # An empty problem: raises NotImplementedError without the backward kernels,
    # launches nothing with them.
    q = torch.zeros(1, 1, 0, 64, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 0, device="cuda")
    try:
        OPS.bwd(q, q, q, q, q, lse, 0.125, False, "fp8", "delta_matching", 128, "e4m3", False)
    except NotImplementedError:
        return False
    return True


needs_bwd = pytest.mark.skipif(not _bwd_available(), reason="CUDA backward kernels not built")


def full_pipeline(q, k, v, dout, causal, mode, fmt="e4m3", diagnostics=False, shared_fwd=False):
    """CUDA fwd + bwd vs CPU fwd + bwd (fp8) and the exact path; returns the three
    (dq, dk, dv, diag). shared_fwd: the CUDA backward gets the CPU forward's O, LSE
    (isolates the backward's diagnostics from the forward's rounding flips)."""
    tau = f32_scale(q.shape[-1])
    dout_cpu = dout.cpu()
    o_cpu, l_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
    cpu = OPS.bwd(dout_cpu, q, k, v, o_cpu, l_cpu, tau, causal, "fp8", mode, 128, fmt, diagnostics)
    o_ex, l_ex = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128)
    exact = OPS.bwd(dout_cpu.double(), q.double(), k.double(), v.double(), o_ex, l_ex, tau, causal, "exact",
                    mode, 128, fmt, False)
    qc, kc, vc = _dev(q, k, v)
    dc = dout if dout.is_cuda else dout.cuda()
    if shared_fwd:
        o_c, l_c = o_cpu.cuda(), l_cpu.cuda()
    else:
        o_c, l_c = OPS.fwd(qc, kc, vc, tau, causal, "fp8", 128)
    poison([(q.shape, torch.bfloat16), (k.shape, torch.bfloat16), (v.shape, torch.bfloat16),
            ((4,) + tuple(l_c.shape), torch.float32)])
    cuda = OPS.bwd(dc, qc, kc, vc, o_c, l_c, tau, causal, "fp8", mode, 128, fmt, diagnostics)
    torch.cuda.synchronize()
    return tuple(t.cpu() for t in cuda), cpu, exact


def check_grads(cuda, cpu, exact, label):
    for name, c, r, e in zip(("dQ", "dK", "dV"), cuda[:3], cpu[:3], exact[:3]):
        assert torch.isfinite(c).all(), f"{label} {name}: non-finite values (unwritten or NaN)"
        if e.double().norm().item() < 1e-6 * math.sqrt(e.numel()):
            # Degenerate (one visible key per row gives dS = 0 exactly): only tiny values.
            assert c.double().abs().max().item() < 1e-3, f"{label} {name}: expected ~0"
            continue
        check_close(name, c, r, e, label)


BWD_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (1, 4, 2, 200, 333, 64, 64),
    (1, 6, 2, 333, 200, 128, 128),
    (1, 2, 1, 257, 129, 256, 256),
    (1, 4, 2, 300, 300, 192, 128),
    (1, 8, 1, 129, 1023, 128, 128),
]


@needs_bwd
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_bwd_pipeline(shape, causal):
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(*shape, seed=seed_of("bw", shape, causal))
    dout = randn(b, hq, sq, dv, gen=torch.Generator().manual_seed(seed_of("do", shape)))
    cuda, cpu, exact = full_pipeline(q, k, v, dout, causal, "delta_matching")
    check_grads(cuda, cpu, exact, f"{shape} causal={causal}")


@needs_bwd
def test_bwd_noncontiguous_dout():
    shape = (1, 4, 2, 190, 250, 128, 128)
    q, k, v = make_qkv(*shape, seed=seed_of("ncdo"))
    gen = torch.Generator().manual_seed(seed_of("ncdo2"))
    dout_flash = torch.randn(1, 190, 4, 128, generator=gen).bfloat16().cuda()  # [B, S, H, D]
    dout = dout_flash.transpose(1, 2)
    assert not dout.is_contiguous()
    cuda, cpu, exact = full_pipeline(q, k, v, dout, True, "stale")
    check_grads(cuda, cpu, exact, "non-contiguous dO")


@needs_bwd
@pytest.mark.parametrize("mode", ["stale", "matched_do", "delta_matching"])
def test_bwd_diagnostics_vs_reference(mode):
    # diag = (delta, eps, rowsum_pre, rowsum_post) of the CUDA backward vs the CPU
    # backward, both fed the CPU forward's O and LSE. Tolerances:
    #  - delta: the same FP8 operands (bit-exact quantization) and the same O/LSE,
    #    so only the FP32 summation order and exp() differ: ~1e-6 relative; 1e-3.
    #  - eps = delta(mode) - delta_dm is ~1e-2 of delta (the FP8 mismatch itself),
    #    so those ~1e-6 errors are ~1e-4 of eps: the op tolerance 2e-2. For
    #    delta_matching eps is exactly 0 on both paths.
    #  - rowsum_pre = |sum_j dS_ij| / sum_j |dS_ij|: for stale / matched_do it is
    #    |eps_i| / sum_j |dS_ij| (sum_j P_ij = 1), hence 2e-2 like eps; for DM it
    #    is FP32 rounding noise, so only its size is checked (< 1e-5).
    #  - rowsum_post: a sum of many FP8 rounding errors of dS; FP32 rounding
    #    differences flip single roundings, which moves single rows but not the
    #    mean over rows: means within 20%.
    shape = (1, 4, 2, 384, 384, 128, 128)
    q, k, v = make_qkv(*shape, seed=seed_of("diag", mode))
    dout = randn(1, 4, 384, 128, gen=torch.Generator().manual_seed(seed_of("diagdo", mode)))
    cuda, cpu, _ = full_pipeline(q, k, v, dout, True, mode, diagnostics=True, shared_fwd=True)
    dc, dr = cuda[3].double(), cpu[3].double()
    assert dc.shape == (4, 1, 4, 384) and torch.isfinite(dc).all()
    assert (dc[0] - dr[0]).norm() < 1e-3 * dr[0].norm(), "delta"
    if mode == "delta_matching":
        assert torch.equal(dc[1], torch.zeros_like(dc[1])), "eps must vanish for delta_matching"
        assert dc[2].mean() < 1e-5 and dr[2].mean() < 1e-5
    else:
        assert (dc[1] - dr[1]).norm() < 2e-2 * dr[1].norm(), "eps"
        assert (dc[2] - dr[2]).norm() < 2e-2 * dr[2].norm(), "rowsum_pre"
    post_c, post_r = dc[3].mean().item(), dr[3].mean().item()
    assert abs(post_c - post_r) <= 0.2 * post_r + 1e-7, ("rowsum_post", post_c, post_r)


@needs_bwd
@pytest.mark.parametrize("sq,sk,causal", [(512, 512, False), (512, 640, True), (512, 512, True)])
def test_delta_matching_invariant_on_cuda_forward(sq, sk, causal):
    # numerics.md section 6 on the CUDA forward's O and LSE: the DM pre-cast mean
    # row-sum residual < 1e-5, and stale >= 10x larger on the same inputs (the
    # mismatch DM removes: stale's delta = <dO, O> ignores that O came from
    # P_hat V_hat, so its dS rows do not sum to zero).
    # NOTE: a row that sees exactly ONE key (causal with sq == sk: row 0) has
    # dS = P (dP - delta) = 0 up to rounding, so its residual |sum dS| / sum |dS|
    # is 0/0-like: ~1 as soon as the backward's exp(S - LSE) of that key is not
    # exactly 1, i.e. whenever LSE is not bitwise the backward's own S (any
    # forward but the CPU reference's). Such rows are excluded from the mean.
    b, hq, hkv, d = 1, 4, 2, 128
    q, k, v = _dev(*make_qkv(b, hq, hkv, sq, sk, d, d, seed=seed_of("inv", sq, sk, causal)))
    dout = torch.randn(b, hq, sq, d, device="cuda").bfloat16()
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
    rows = torch.arange(sq, device="cuda")
    keys_seen = (rows + (sk - sq) + 1).clamp(max=sk) if causal else torch.full_like(rows, sk)
    res = {}
    for mode in ("stale", "delta_matching"):
        diag = OPS.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", mode, 128, "e4m3", True)[3]
        assert torch.isfinite(diag).all()
        res[mode] = diag[2][..., keys_seen > 1].mean().item()
        res[mode + "_one_key_rows"] = diag[2][..., keys_seen == 1].tolist()
    assert res["delta_matching"] < 1e-5, res
    assert res["stale"] >= 10 * res["delta_matching"], res
    # Absolute floor (numerics.md section 6; STALE_RESIDUAL_FLOOR of test_cuda_bwd.py):
    # the ratio alone passes if every residual collapses.
    assert res["stale"] > 1e-3, res


@needs_bwd
def test_bwd_nan_never_passes():
    shape = (1, 2, 1, 200, 200, 64, 64)
    q, k, v = make_qkv(*shape, seed=seed_of("bnan"))
    dout = randn(1, 2, 200, 64, gen=torch.Generator().manual_seed(5))
    dout[0, 1, 150, 3] = float("nan")
    tau = f32_scale(64)
    o, l = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    cpu = OPS.bwd(dout, q, k, v, o, l, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    qc, kc, vc, dc, oc, lc = _dev(q, k, v, dout, o, l)
    cuda = [t.cpu() for t in OPS.bwd(dc, qc, kc, vc, oc, lc, tau, True, "fp8", "delta_matching", 128, "e4m3",
                                     False)[:3]]
    for name, c, r in zip(("dQ", "dK", "dV"), cuda, cpu[:3]):
        assert torch.isnan(r).any(), f"{name}: the planted NaN did not reach the reference"
        assert torch.isnan(c)[torch.isnan(r)].all(), f"{name}: NaN was lost"


@needs_bwd
def test_diag_rowsum_rules_cuda():
    """numerics.md section 7 on CUDA: rows that see < 2 keys report a row-sum
    residual of 0; a row whose dS is non-finite (NaN in K) reports NaN."""
    gen = torch.Generator().manual_seed(seed_of("diag-rules"))
    q, k, v, do = (randn(1, 2, 200, 64, gen=gen).cuda() for _ in range(4))
    o, lse = OPS.fwd(q, k, v, f32_scale(64), True, "fp8", 128)
    for mode in ("stale", "matched_do", "delta_matching"):
        diag = OPS.bwd(do, q, k, v, o, lse, f32_scale(64), True, "fp8", mode, 128, "e4m3", True)[3]
        assert (diag[2:, :, :, 0] == 0).all(), mode
        assert torch.isfinite(diag).all(), mode
    k_nan = k.clone()
    k_nan[0, :, 5, 0] = float("nan")
    o, lse = OPS.fwd(q, k_nan, v, f32_scale(64), False, "fp8", 128)
    diag = OPS.bwd(do, q, k_nan, v, o, lse, f32_scale(64), False, "fp8", "delta_matching", 128, "e4m3", True)[3]
    assert torch.isnan(diag[2]).all() and torch.isnan(diag[3]).all()
