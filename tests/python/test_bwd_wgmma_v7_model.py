"""Index algebra of the wgmma backward main kernel, v7 (CPU only).

csrc/hopper/bwd_wgmma_e4m3_blockscale_sm90.cu (docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md, "v7"):
- frag_pos: per-column floats stored in fragment order, so a thread's float2
  pairs of columns 8j + 2t + {0, 1} for j = 2J, 2J + 1 are one float4
  (frag_ld4 reads a + 8j + 4t). Checked: a permutation within every 16
  columns, and every float4 / float2 read lands on the intended columns.
- wg_mask_main: the masks of non-interior tile pairs with per-thread bounds
  (qlim, lo_r, constant C per column) must equal TileGeom::visible per element.
The column / row permutations and frag_pos are taken from the kernel source
(their C expressions are valid Python on non-negative ints); the mask bounds
are a model of wg_mask_main. Each check is also run on a broken variant and
must fail there (the failure it guards against).
"""
import pathlib
import re

import pytest

# The wgmma fragment helpers live in csrc/hopper/wgmma_sm90.cuh (shared by the row and
# tile backwards since 2026-12-02); the kernel file is searched too.
_HOPPER = pathlib.Path(__file__).resolve().parents[2] / "csrc/hopper"
SRCS = (_HOPPER / "wgmma_sm90.cuh", _HOPPER / "bwd_wgmma_e4m3_blockscale_sm90.cu")


def _c_func(name):
    text = "\n".join(p.read_text() for p in SRCS)
    m = re.search(r"int " + name + r"\(int (\w)\) \{[^\n]*\n?\s*return ([^;]+);", text)
    assert m, name
    arg, expr = m.group(1), m.group(2)
    return eval("lambda " + arg + ": " + expr)  # noqa: S307 (C int expression, & | << >> + *)


q_of_col = _c_func("q_of_col")
k_of_row = _c_func("k_of_row")
frag_pos = _c_func("frag_pos")


def frag_errors(fp):
    errs = 0
    for base in range(0, 128, 16):
        errs += sorted(fp(c) for c in range(base, base + 16)) != list(range(base, base + 16))
    for t in range(4):
        for j in range(0, 16, 2):  # frag_ld4(a, j, t): a + 8j + 4t .. + 3
            want = [8 * j + 2 * t, 8 * j + 2 * t + 1, 8 * (j + 1) + 2 * t, 8 * (j + 1) + 2 * t + 1]
            errs += [fp(c) for c in want] != [8 * j + 4 * t + k for k in range(4)]
    return errs


def test_frag_pos_permutation_and_float4_reads():
    assert frag_errors(frag_pos) == 0
    # broken variant (t and jb swapped): must be caught
    assert frag_errors(lambda c: (c & ~15) | ((c & 6) >> 1) | ((c >> 3) & 1) << 2 | (c & 1) << 3) > 0


INT_MAX, INT_MIN = 0x7FFFFFFF, -0x80000000


def mask_mismatches(n0, m0, sq, sk, causal, ge=lambda c, lo: c >= lo):
    off = sk - sq
    bad = 0
    for warp in range(8):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            qlim = sq - m0 - 4 * t
            lo = []
            for r in range(2):
                key = n0 + k_of_row(warp * 16 + g + 8 * r)
                lo.append(INT_MAX if key >= sk else (key - off - m0 - 4 * t if causal else INT_MIN))
            for j in range(16):
                for e in range(4):
                    ql = q_of_col(8 * j + 2 * t + (e & 1))
                    kl = k_of_row(warp * 16 + g + 8 * (e >> 1))
                    key, qi = n0 + kl, m0 + ql
                    visible = key < sk and qi < sq and (not causal or key <= qi + off)
                    c = 16 * (j >> 1) + 2 * (j & 1) + (e & 1)
                    assert 4 * t + c == ql
                    bad += visible != (c < qlim and ge(c, lo[e >> 1]))
    return bad


SHAPES = [(1, 1), (77, 200), (128, 128), (200, 333), (333, 200), (300, 100), (100, 300), (640, 1000)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_mask_bounds_equal_visible(sq, sk, causal):
    for n0 in range(0, sk, 128):
        for m0 in range(0, sq, 128):
            assert mask_mismatches(n0, m0, sq, sk, causal) == 0, (n0, m0)


def test_mask_bounds_off_by_one_is_caught():
    # the diagonal tile of a causal square shape has keys == queries: c > lo drops them
    assert mask_mismatches(0, 0, 128, 128, True, ge=lambda c, lo: c > lo) > 0
