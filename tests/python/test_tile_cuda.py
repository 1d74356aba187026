"""GPU tests of the sm_90a `tile`-recipe kernels (numerics.md section 9): the
quantization kernel (csrc/hopper/quant_tilescale_e4m3_sm90.cu) bit-exact against
the CPU quantize_tilescale op, and the forward (csrc/hopper/fwd_tilescale_e4m3_sm90.cu)
through torch.ops.fp8attn.fwd(..., scaling="tile") against the CPU reference's
`tile` path on the same fresh random inputs, every element, with the tolerances
of numerics.md section 6 (as tests/python/test_cuda.py does for `row`):

    ||cuda - exact|| <= 2 * ||cpu_tile - exact|| + 1e-3 * ||exact||
    ||cuda - cpu_tile|| / ||cpu_tile|| < 2e-2

plus the per-row LSE / O checks of test_cuda.check_rows. Covered: head dims 64,
128, 256, 192/128 (others through the op's zero padding), GQA, causal with
seqlen_q < and > seqlen_k (bottom-right), ragged lengths, seqlen 1, rows that
see no key, training-shaped inputs (test_cuda_fuzz's distributions), NaN
propagation, both consumer orders (FP8ATTN_TILE_PINGPONG). The backward of
`tile` on CUDA raises NotImplementedError naming `scaling` (test_tile.py).

Skips cleanly without a GPU or without the CUDA kernels compiled in.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_tile_cuda.py
"""
import pytest
import torch

from test_cuda import (OPS, check_close, check_rows, f32_scale, make_qkv, poison, quant_input,  # noqa: F401
                       seed_of)  # (skips without a GPU)
from wgmma_bounds import wgmma_lse_bound

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tile_fwd_on(monkeypatch):
    """The CUDA `tile` forward runs by default (FP8ATTN_TILE_FWD unset; docs/architecture.md,
    "Environment variables")."""
    monkeypatch.delenv("FP8ATTN_TILE_FWD", raising=False)


def test_tile_fwd_knob(monkeypatch):
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 1, 130, 130, 64, 64, seed_of("knob")))
    ref, _ = OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")
    for on in ("", "1"):
        monkeypatch.setenv("FP8ATTN_TILE_FWD", on)
        assert torch.equal(OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")[0], ref)
    monkeypatch.setenv("FP8ATTN_TILE_FWD", "0")
    with pytest.raises(NotImplementedError, match="argument 'scaling'.*FP8ATTN_TILE_FWD=0"):
        OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")
    monkeypatch.setenv("FP8ATTN_TILE_FWD", "yes")
    with pytest.raises(ValueError, match="FP8ATTN_TILE_FWD='yes' is not one of 0, 1"):
        OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")
    monkeypatch.setenv("FP8ATTN_TILE_FWD", "1")
    monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", "on")
    with pytest.raises(ValueError, match="FP8ATTN_TILE_PINGPONG='on' is not one of 0, 1"):
        OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")
    monkeypatch.delenv("FP8ATTN_TILE_PINGPONG")
    monkeypatch.setenv("FP8ATTN_TILE_PERSISTENT", "2")
    with pytest.raises(ValueError, match="FP8ATTN_TILE_PERSISTENT='2' is not one of 0, 1"):
        OPS.fwd(q, k, v, 0.125, False, "fp8", 128, "tile")
    OPS.fwd(q, k, v, 0.125, False, "fp8", 128)  # the row recipe never reads them
    monkeypatch.delenv("FP8ATTN_TILE_PERSISTENT")


# ---- quantization: bit-exact against the CPU op -----------------------------------------


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("s", [1, 17, 130, 300])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dim,transposed", [(3, False), (2, False), (2, True)], ids=["row", "tile", "tileT"])
def test_quantize_tilescale_bitexact(d, s, fmt, dim, transposed):
    x = quant_input(2, 3, s, d, seed_of("tq", d, s, fmt, dim))
    x[0, 0, :128, :] = 0.0  # an all-zero token row and tile over all of head_dim (scale 1)
    codes_r, scales_r = OPS.quantize_tilescale(x.float(), dim, 128, fmt)
    codes_c, scales_c = OPS.quantize_tilescale(x.cuda(), dim, 128, fmt, transposed)
    assert codes_c.shape == codes_r.shape and scales_c.shape == scales_r.shape
    assert torch.equal(codes_c.cpu(), codes_r), "FP8 codes differ from the CPU quantize_tilescale"
    assert torch.equal(scales_c.cpu(), scales_r), "scales differ from the CPU quantize_tilescale"
    assert (scales_r == 1.0).any(), "the zero block (scale 1) was not exercised"


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(3, 3, 300, 130), (4, 2, 17, 257), (2, 1, 129, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_tilescale_fwd_fused_bitexact(dqk, dv, hq, hkv, sq, sk, fmt):
    # The forward's one fused launch for Q (per token), K (per tile) and V (per tile,
    # transposed codes): every job of the launch (two launches at 192/128) decodes its
    # CTAs right, same codes and scales as the CPU op; a NaN in V reaches only V's tile.
    tag = ("tqf", dqk, dv, hq, hkv, sq, sk, fmt)
    q = quant_input(2, hq, sq, dqk, seed_of(*tag, "q"))
    k = quant_input(2, hkv, sk, dqk, seed_of(*tag, "k"))
    v = quant_input(2, hkv, sk, dv, seed_of(*tag, "v"))
    v[1, 0, sk - 1, 0] = float("nan")
    ref = OPS.quantize_tilescale_fwd(q.float(), k.float(), v.float(), fmt)
    got = [t.cpu() for t in OPS.quantize_tilescale_fwd(q.cuda(), k.cuda(), v.cuda(), fmt)]
    names = ["q_codes", "q_scales", "k_codes", "k_scales", "v_codes", "v_scales"]
    for name, r, c in zip(names, ref, got):
        assert c.shape == r.shape, name
        assert torch.equal(torch.isnan(c), torch.isnan(r)), name
        assert torch.equal(c.nan_to_num(0.0) if c.is_floating_point() else c,
                           r.nan_to_num(0.0) if r.is_floating_point() else r), f"{name} differ from the CPU op"
    assert torch.isnan(ref[5][1, 0, -1]) and torch.isnan(ref[5]).sum() == 1
    for i in (0, 2, 4):  # the three operands' codes equal the single-operand op's
        x, dim = (q, 3) if i == 0 else ((k, 2) if i == 2 else (v, 2))
        single = OPS.quantize_tilescale(x.cuda(), dim, 128, fmt, i == 4)
        assert torch.equal(single[0].cpu(), got[i]), names[i]


def test_quantize_tilescale_matches_definition():
    # The CPU op itself: the scale of each block is block_scale of its amax (numerics.md
    # section 2) over all of head_dim, per token (dim 3) or per 128 tokens (dim 2).
    x = quant_input(1, 2, 300, 128, seed_of("tq-def")).float()
    _, s_row = OPS.quantize_tilescale(x, 3, 128, "e4m3")
    _, s_tile = OPS.quantize_tilescale(x, 2, 128, "e4m3")
    _, s_blk = OPS.quantize_blockwise(x, 3, 128, "e4m3")  # d = 128: one block per token
    assert torch.equal(s_row, s_blk[..., 0])
    for t in range(3):
        a = x[:, :, 128 * t:128 * (t + 1)].abs().amax(dim=(-1, -2)).double()
        want = torch.where(a > 0, torch.exp2(torch.ceil(torch.log2(a / 448.0)).clamp(-126, 127)), torch.ones_like(a))
        assert torch.equal(s_tile[..., t].double(), want)


def test_quantize_tilescale_padding_and_strides():
    # Transposed codes of the padding tokens are 0 (a NaN tile included); a strided
    # (flash layout) input gives the same codes as a contiguous one.
    x = quant_input(1, 300, 2, 128, seed_of("tq-str")).permute(0, 2, 1, 3)
    assert not x.is_contiguous()
    for dim in (3, 2):
        r = OPS.quantize_tilescale(x.float().contiguous(), dim, 128, "e4m3")
        c = OPS.quantize_tilescale(x.cuda(), dim, 128, "e4m3", dim == 2)
        assert torch.equal(c[0].cpu(), r[0]) and torch.equal(c[1].cpu(), r[1])
    y = x.contiguous()
    y[0, 0, 290, 3] = float("nan")
    codesT, scales = OPS.quantize_tilescale(y.cuda(), 2, 128, "e4m3", True)
    assert torch.isnan(scales[0, 0, 2]) and not torch.isnan(scales[0, 0, :2]).any()
    base = codesT._base  # the kernel's [B, H, D, S_pad] buffer: padding tokens 300..303 are code 0
    assert base is not None and base.shape[-1] == 304 and (base[..., 300:] == 0).all()
    assert ((codesT[0, 0, 256:300] & 0x7F) == 0x7F).all(), "codes of a NaN tile are NaN"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_tilescale_nonfinite(bad):
    x = quant_input(1, 2, 260, 128, seed_of("tq-nf", bad))
    x[0, 1, 140, 5] = bad
    for dim in (3, 2):
        codes_r, scales_r = OPS.quantize_tilescale(x.float(), dim, 128, "e4m3")
        codes_c, scales_c = (t.cpu() for t in OPS.quantize_tilescale(x.cuda(), dim, 128, "e4m3"))
        nan_s = torch.isnan(scales_r)
        assert nan_s.sum() == 1 and torch.equal(torch.isnan(scales_c), nan_s)
        assert torch.equal(scales_c[~nan_s], scales_r[~nan_s])
        # Codes of the NaN block: E4M3 NaN (S.1111.111) whatever the sign; all others equal.
        blk = (0, 1, 140, slice(None)) if dim == 3 else (0, 1, slice(128, 256), slice(None))
        assert torch.equal(codes_c[blk] & 0x7F, torch.full_like(codes_c[blk], 0x7F))
        keep = torch.ones_like(codes_r, dtype=torch.bool)
        keep[blk] = False
        assert torch.equal(codes_c[keep], codes_r[keep])


def test_quantize_tilescale_many_heads_split_launch():
    # batch * heads > 65535 (one linear grid of (tile, b, h) CTAs), same bits.
    x = quant_input(1, 70000, 2, 64, seed_of("tq-many"))
    for dim in (3, 2):
        r = OPS.quantize_tilescale(x.float(), dim, 128, "e4m3")
        c = OPS.quantize_tilescale(x.cuda(), dim, 128, "e4m3", dim == 2)
        assert torch.equal(c[0].cpu(), r[0]) and torch.equal(c[1].cpu(), r[1])


# ---- forward vs the CPU `tile` reference -----------------------------------------------


def tile_cuda_fwd(q, k, v, causal, tau):
    b, hq, sq, _ = q.shape
    poison([((b, hq, sq, v.shape[-1]), torch.bfloat16), ((b, hq, sq), torch.float32)])
    out, lse = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), tau, causal, "fp8", 128, "tile")
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def check_tile_fwd(shape, causal, seed, q=None, k=None, v=None, tau=None, o_rows=True, lse_rows=True):
    b, hq, hkv, sq, sk, d, dv = shape
    if q is None:
        q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, seed)
    tau = f32_scale(d) if tau is None else tau
    out, lse = tile_cuda_fwd(q, k, v, causal, tau)
    o_cpu, l_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128, "tile")
    o_ex, l_ex = OPS.fwd(q.double(), k.double(), v.double(), tau, causal, "exact", 128)
    label = f"tile {shape} causal={causal}"
    assert out.shape == (b, hq, sq, dv) and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    check_close("O", out, o_cpu, o_ex, label)
    check_close("LSE", lse, l_cpu, l_ex, label)
    if o_rows:
        check_rows(out, lse, o_cpu, l_cpu, label, wgmma_lse_bound(q, k, tau, causal, "tile"))
    elif lse_rows:  # the fuzz test's per-row LSE check with this kernel's bound (no per-row O bound)
        fin = torch.isfinite(l_cpu)
        d_lse = (lse.double() - l_cpu.double())[fin].abs()
        tol = 1e-4 * l_cpu.double()[fin].abs().clamp(min=1.0) + wgmma_lse_bound(q, k, tau, causal, "tile")[fin]
        assert (d_lse <= tol).all(), f"{label} LSE: worst |cuda-cpu| / tol = {(d_lse / tol).max().item():.3g}"
    return out, lse


HEAD_DIM_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv)
    (2, 4, 2, 200, 333, 64, 64),
    (2, 6, 2, 333, 200, 128, 128),
    (1, 4, 4, 257, 129, 256, 256),
    (1, 4, 2, 300, 300, 192, 128),
    (1, 2, 1, 640, 640, 128, 128),
    (1, 2, 2, 45, 700, 256, 256),
]


@pytest.mark.parametrize("shape", HEAD_DIM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_head_dims(shape, causal):
    check_tile_fwd(shape, causal, seed_of("thd", shape, causal))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (16, 2), (24, 3)], ids=["gqa1", "gqa3", "gqa8", "gqa8_kv3"])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_gqa(hq, hkv, causal):
    check_tile_fwd((1, hq, hkv, 150, 190, 128, 128), causal, seed_of("tgqa", hq, hkv, causal))


SEQLENS = [(1, 1), (17, 17), (113, 113), (128, 128), (129, 129), (1023, 1023), (2049, 2049),
           (1, 129), (129, 1), (17, 1023), (1023, 17), (129, 2049), (2049, 129), (200, 520), (520, 200)]


@pytest.mark.parametrize("sq,sk", SEQLENS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_seqlens(sq, sk, causal):
    d = 64 if max(sq, sk) > 1024 else 128
    check_tile_fwd((1, 2, 1, sq, sk, d, d), causal, seed_of("tsl", sq, sk, causal))


@pytest.mark.parametrize("d,dv", [(32, 32), (96, 64), (160, 100), (8, 256)])
def test_tile_fwd_padded_head_dims(d, dv):
    # Head dims without their own kernel: zero channels (exact in `tile` too: no
    # block's amax changes).
    check_tile_fwd((1, 4, 2, 150, 260, d, dv), True, seed_of("tpad", d, dv))


def test_tile_fwd_rows_without_keys():
    sq, sk = 300, 100  # causal, seqlen_q > seqlen_k: the first 200 rows see no key
    out, lse = check_tile_fwd((1, 3, 1, sq, sk, 64, 64), True, seed_of("tnokey"))
    blind = sq - sk
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all()
    assert torch.isfinite(lse[:, :, blind:]).all() and out[:, :, blind:].abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_underflowing_score_coefficient(causal):
    # Tiny Q and K: s_Q s_K tau log2(e) underflows FP32 (softmax_tilescale_sm90.cuh NOTE);
    # the masked keys (ragged last tile, causal) must not turn into NaN (-inf * 0).
    q, k, v = make_qkv(1, 2, 1, 150, 200, 128, 128, seed_of("tuflow", causal))
    q, k = (q.float() * 1e-22).bfloat16(), (k.float() * 1e-22).bfloat16()
    out, lse = check_tile_fwd((1, 2, 1, 150, 200, 128, 128), causal, 0, q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_tile_fwd_float32_inputs_and_attention_api():
    q, k, v = make_qkv(1, 4, 2, 190, 270, 128, 128, seed_of("tf32"))
    qf, kf, vf = (t.float() for t in (q, k, v))
    out, lse = check_tile_fwd((1, 4, 2, 190, 270, 128, 128), True, 0, qf, kf, vf)
    assert out.dtype == torch.float32
    import fp8attn
    o_api = fp8attn.attention(q.cuda(), k.cuda(), v.cuda(), causal=True, scaling="tile")
    o_op, _ = OPS.fwd(q.cuda(), k.cuda(), v.cuda(), f32_scale(128), True, "fp8", 128, "tile")
    assert torch.equal(o_api, o_op)
    o_fl = fp8attn.flash_attn_func(q.cuda().transpose(1, 2), k.cuda().transpose(1, 2), v.cuda().transpose(1, 2),
                                   causal=True, scaling="tile")
    assert torch.equal(o_fl.transpose(1, 2), o_op)
    o_row = fp8attn.attention(q.cuda(), k.cuda(), v.cuda(), causal=True)
    assert not torch.equal(o_row, o_op), "scaling='tile' ran the row kernels"


def test_tile_fwd_training_shaped_inputs():
    # The fuzz generator's distributions (tests/python/test_cuda_fuzz.py): channel
    # outliers, a sink key, token-magnitude spread, equal keys, huge / tiny scales.
    from test_cuda_fuzz import DISTRIBUTIONS, Case, make_tensors  # noqa: F401
    for i, dist in enumerate(DISTRIBUTIONS):
        for causal in (False, True):
            d = (64, 128, 192, 256)[i % 4]
            dv = 128 if d == 192 else d
            case = Case(i, seed_of("ttrain", dist, causal), 1, 2, 2, 300, 420, d, dv, causal, dist, 1.0, "e4m3")
            q, k, v, _, tau = make_tensors(case)
            # The per-row LSE check with the measured wgmma model (wgmma_bounds.py, one
            # chain over all of head_dim in this kernel; numerics.md section 7).
            check_tile_fwd((1, 4, 2, 300, 420, d, dv), causal, 0, q, k, v, tau=tau, o_rows=False)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_tile_fwd_nan_never_passes(where):
    # numerics.md sections 2 and 9: non-finite input makes the blocks it feeds NaN.
    # Wherever the reference gives NaN the kernel must too (whole-tile quantization
    # may make it coarser inside a diagonal tile: section 9 "Masking before quantization").
    q, k, v = make_qkv(1, 2, 1, 260, 260, 64, 64, seed_of("tnan", where))
    {"q": q, "k": k, "v": v}[where][0, 0, 200, 7] = float("nan")
    for causal in (False, True):
        out, lse = tile_cuda_fwd(q, k, v, causal, f32_scale(64))
        o_cpu, l_cpu = OPS.fwd(q, k, v, f32_scale(64), causal, "fp8", 128, "tile")
        assert torch.isnan(o_cpu).any(), "the planted NaN did not reach the reference"
        assert torch.isnan(out)[torch.isnan(o_cpu)].all(), f"{where} causal={causal}: NaN was lost in O"
        assert torch.isnan(lse)[torch.isnan(l_cpu)].all(), f"{where} causal={causal}: NaN was lost in LSE"
        fin = ~torch.isnan(o_cpu).any(dim=-1)
        if where == "q":  # only query row 200 is NaN
            assert torch.equal(torch.isnan(out).any(dim=-1), ~fin)
        if causal and where in ("k", "v"):
            # Rows of the first 128-row tile never see key 200: untouched.
            assert torch.isfinite(out[:, :, :128]).all() and torch.isfinite(lse[:, :, :128]).all()


def test_tile_fwd_deterministic_and_split_launch():
    q, k, v = (t.cuda() for t in make_qkv(2, 6, 2, 700, 900, 128, 128, seed_of("tdet")))
    a = OPS.fwd(q, k, v, f32_scale(128), True, "fp8", 128, "tile")
    b = OPS.fwd(q, k, v, f32_scale(128), True, "fp8", 128, "tile")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # One (batch, head) at a time gives the same bits (no cross-CTA state).
    o1, l1 = OPS.fwd(q[1:2, 4:5], k[1:2, 1:2], v[1:2, 1:2], f32_scale(128), True, "fp8", 128, "tile")
    assert torch.equal(a[0][1:2, 4:5], o1) and torch.equal(a[1][1:2, 4:5], l1)


def test_tile_fwd_many_heads_split_launch():
    # num_heads_q > 65535: several launches (launch_sm90.h); every head checked.
    q, k, v = make_qkv(1, 66000, 66000, 3, 5, 64, 64, seed_of("tmany"))
    check_tile_fwd((1, 66000, 66000, 3, 5, 64, 64), False, 0, q, k, v)


def test_tile_fwd_long_rows_small_p_scales():
    # Large logit spread: most P tiles of a row have tiny block scales (the flush of
    # config_sm90.h kPFlushScale and the unit of O across many tiles).
    q, k, v = make_qkv(1, 2, 1, 256, 4096, 64, 64, seed_of("tlong"))
    q = (q.float() * 6).bfloat16()
    check_tile_fwd((1, 2, 1, 256, 4096, 64, 64), False, 0, q, k, v)


# ---- the pingpong order (FP8ATTN_TILE_PINGPONG=1; last in this file) ----------------------
# Same math in the same order per (row, key tile) as the default order: bitwise equal
# outputs, and the reference checks pass.

PINGPONG_SHAPES = HEAD_DIM_SHAPES[:2] + [HEAD_DIM_SHAPES[3], HEAD_DIM_SHAPES[4],
                                         (1, 2, 1, 1, 129, 128, 128), (1, 2, 1, 300, 100, 64, 64),
                                         (1, 3, 1, 129, 2049, 64, 64), (2, 4, 2, 1023, 1023, 128, 128)]


@pytest.mark.parametrize("shape", PINGPONG_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_pingpong(shape, causal, monkeypatch):
    seed = seed_of("tpp", shape, causal)
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, seed)
    monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", "0")
    o0, l0 = tile_cuda_fwd(q, k, v, causal, f32_scale(d))
    monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", "1")
    o1, l1 = check_tile_fwd(shape, causal, seed, q, k, v)
    assert torch.equal(o0, o1) and torch.equal(l0, l1), "the two consumer orders differ"


# ---- the persistent scheduler (FP8ATTN_TILE_PERSISTENT=1; after the pingpong) -------------
# More work tiles than the H200's 132 SMs, so CTAs run several (the barrier phases, the
# pipeline stages and the pingpong turns carry over between them); work tiles without
# keys (causal, seqlen_q > seqlen_k) among them. Bitwise equal to one CTA per work tile.

PERSISTENT_SHAPES = [(4, 40, 8, 130, 200, 128, 128), (3, 24, 8, 400, 150, 64, 64),
                     (2, 30, 10, 260, 390, 192, 128), (2, 40, 40, 257, 300, 256, 256)]


@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_tile_fwd_persistent(shape, causal, monkeypatch):
    seed = seed_of("tps", shape, causal)
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, seed)
    for pp in (("0", "1") if dv <= 128 else ("0",)):
        monkeypatch.setenv("FP8ATTN_TILE_PINGPONG", pp)
        monkeypatch.setenv("FP8ATTN_TILE_PERSISTENT", "0")
        o0, l0 = tile_cuda_fwd(q, k, v, causal, f32_scale(d))
        monkeypatch.setenv("FP8ATTN_TILE_PERSISTENT", "1")
        if pp == "0":
            o1, l1 = check_tile_fwd(shape, causal, seed, q, k, v)
        else:
            o1, l1 = tile_cuda_fwd(q, k, v, causal, f32_scale(d))
        assert torch.equal(o0, o1) and torch.equal(l0, l1), f"persistent != one CTA per tile (pingpong={pp})"
