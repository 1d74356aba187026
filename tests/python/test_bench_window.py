"""benchmarks/bench_window_gpu.py on the CPU (its GPU measurements run on the device only).

* the visible-pair count (the FLOP count): the closed form against a brute-force count, row by row
  and from the boolean mask, over windows with unbounded, zero, small and large bounds and
  seqlen_q != seqlen_k both ways; the docstring's closed forms for causal windows;
* the window's masks: window_mask (the self-check's reference) equals fp8attn's own window on its
  exact CPU path (numerics.md section 14, FlashAttention's rule); the Flex mask_mod equals
  window_mask; the cuDNN frontend arguments (left bound + 1, right bound, alignment), and where the
  frontend is installed its own reading of them (its graph analyzer, no GPU needed);
* the self-check: judge's rules, the check windows and their off-by-one neighbours; bench_case on
  CPU tensors (fp8attn's CPU reference, FlexAttention eager, cuDNN n/a with a reason), and an
  off-by-one Flex mask caught as "bad" with no number;
* the command line: --help names what is measured; bad values exit 2 (argparse), no traceback;
* markdown on synthetic rows (ratios, bad / n/a / skipped cells, the summary table last), the JSON;
* main: without a GPU a one-line message, exit 1, no --out directory; a failing case is recorded
  and the run goes on.
CPU, a few seconds.
"""
from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

fp8attn = pytest.importorskip("fp8attn")
import bench_window_gpu as bw  # noqa: E402
from test_bench_gpu import _run_script  # noqa: E402

INFO = {"gpu": "G", "driver": "D", "torch": "T", "cuda": "C", "cudnn": 1, "date": "now",
        "cudnn_frontend": {"cudnn_frontend": "1.32.0", "cudnn_backend": "9.19"}}
WINDOWS = [(-1, 0), (0, 0), (3, 0), (3, 2), (-1, -1), (5, -1), (0, 7), (-1, 3), (40, 0), (200, 3), (63, 64)]
LENGTHS = [(1, 1), (7, 7), (64, 64), (130, 130), (7, 64), (64, 7), (130, 64), (33, 130)]


# ---- visible pairs (the FLOP count) -----------------------------------------------------------


def _brute_pairs(sq, sk, left, right):
    """Pairs by the rule itself, key by key (module docstring)."""
    off = sk - sq
    return sum(1 for i in range(sq) for j in range(sk)
               if (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right))


@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_visible_pairs_against_brute_force(sq, sk):
    for left, right in WINDOWS:
        want = _brute_pairs(sq, sk, left, right)
        assert bw.visible_pairs(sq, sk, left, right) == want, (left, right)
        assert int(bw.window_mask(sq, sk, left, right).sum()) == want
        assert sum(max(0, hi - lo) for lo, hi in (bw.visible_keys(i, sq, sk, left, right) for i in range(sq))) == want
        rows = list(range(0, sq, 3))
        assert torch.equal(bw.window_mask(sq, sk, left, right, rows=rows), bw.window_mask(sq, sk, left, right)[rows])
        # normalizing changes no mask
        assert bw.visible_pairs(sq, sk, *bw.normalize_window(sq, sk, left, right)) == want


@pytest.mark.parametrize("s", [1, 100, 4096, 32768])
def test_closed_forms_of_the_docstring(s):
    for left in (0, 1, 255, 2047, 4095):
        if left < s:
            assert bw.visible_pairs(s, s, left, 0) == s * (left + 1) - left * (left + 1) // 2
    assert bw.visible_pairs(s, s, -1, 0) == s * (s + 1) // 2
    assert bw.visible_pairs(s, s, -1, -1) == s * s
    doc = " ".join(bw.__doc__.split())
    for want in ("pairs = S (L + 1) - L (L + 1) / 2", "S (S + 1) / 2", "fwd+bwd 3.5x", "4 * B * H * d * pairs"):
        assert want in doc, want


def test_the_issue_case_4k_window_at_32k():
    s = 32768
    assert bw.visible_pairs(s, s, 4095, 0) == 125_831_168       # 32768 * 4096 - 4095 * 4096 / 2
    assert bw.fwd_flops(1, 16, 128, 125_831_168) == 4.0 * 16 * 128 * 125_831_168
    # about 23% of full causal's work
    assert bw.visible_pairs(s, s, 4095, 0) / bw.visible_pairs(s, s, -1, 0) == pytest.approx(0.2344, abs=1e-4)


def test_normalize_window():
    assert bw.normalize_window(1024, 1024, 4095, 0) == (-1, 0)
    assert bw.normalize_window(1024, 1024, 1023, 0) == (-1, 0)
    assert bw.normalize_window(1024, 1024, 1022, 0) == (1022, 0)
    assert bw.normalize_window(1024, 1024, 5, 1023) == (5, -1)
    assert bw.normalize_window(100, 300, 299, 99) == (-1, -1) and bw.normalize_window(100, 300, 298, 98) == (298, 98)
    assert bw.normalize_window(64, 64, -7, -2) == (-1, -1)


# ---- the masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk", [(48, 48), (20, 48), (48, 20)])
@pytest.mark.parametrize("window", [(-1, 0), (0, 0), (3, 0), (3, 2), (5, -1), (-1, 3)])
def test_window_mask_is_fp8attns_window(sq, sk, window):
    """The self-check's reference mask is fp8attn's window_size (its exact CPU path, FP64)."""
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, generator=g) for n in (sq, sk, sk))
    mask = bw.window_mask(sq, sk, *window)
    if not mask.any(dim=1).all():   # rows with no key: fp8attn gives 0, SDPA NaN; compare the others
        rows = mask.any(dim=1)
    else:
        rows = torch.ones(sq, dtype=torch.bool)
    ours = fp8attn.attention(q, k, v, window_size=window, precision="exact")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(ours[:, :, rows], ref[:, :, rows], atol=1e-12, rtol=0)
    assert (ours[:, :, ~rows] == 0).all()


@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 64), (64, 40), (1, 5)])
def test_flex_mask_mod_is_window_mask(sq, sk):
    bounds = torch.zeros(2, dtype=torch.int32)
    mask_mod = bw.make_mask_mod(bounds)
    i = torch.arange(sq, dtype=torch.int32)[:, None]
    j = torch.arange(sk, dtype=torch.int32)[None, :]
    for window in WINDOWS:
        bounds.copy_(torch.tensor(bw.flex_offsets(sq, sk, *window), dtype=torch.int32))
        assert torch.equal(mask_mod(0, 0, i, j), bw.window_mask(sq, sk, *window)), window


FAKE_CUDNN = types.SimpleNamespace(diagonal_alignment=types.SimpleNamespace(TOP_LEFT="TL", BOTTOM_RIGHT="BR"))


def test_cudnn_mask_arguments():
    kw = bw.cudnn_mask_kwargs
    assert kw(FAKE_CUDNN, 32768, 32768, 4095, 0) == {"diagonal_band_left_bound": 4096, "diagonal_band_right_bound": 0,
                                                     "diagonal_alignment": "TL"}
    assert kw(FAKE_CUDNN, 1024, 1024, 255, 0)["diagonal_band_left_bound"] == 256
    assert kw(FAKE_CUDNN, 1024, 1024, 0, 0)["diagonal_band_left_bound"] == 1     # the diagonal alone
    assert kw(FAKE_CUDNN, 1024, 1024, -1, 0) == {"diagonal_band_right_bound": 0, "diagonal_alignment": "TL"}
    assert kw(FAKE_CUDNN, 1024, 1024, 4095, 0) == {"diagonal_band_right_bound": 0, "diagonal_alignment": "TL"}
    assert kw(FAKE_CUDNN, 1024, 1024, -1, -1) == {}
    assert kw(FAKE_CUDNN, 512, 1024, 63, 2) == {"diagonal_band_left_bound": 64, "diagonal_band_right_bound": 2,
                                                "diagonal_alignment": "BR"}


def test_cudnn_frontend_reads_the_bounds_as_flash_attentions_window():
    """Where the cuDNN frontend is installed (it declares graphs without a GPU): its own graph
    analyzer reads diagonal_band_left_bound = left + 1 as the window's left bound `left`."""
    try:
        import cudnn
        from cudnn.sdpa import graph_analyzer
    except Exception as e:  # noqa: BLE001  (not installed, no libcudnn, another version's layout)
        pytest.skip(f"cuDNN frontend not importable here: {type(e).__name__}: {e}")
    b, h, s, d = 1, 2, 1024, 128
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    for window in ((255, 0), (63, 0), (-1, 0)):
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32)
        dims, st = [b, h, s, d], [h * s * d, s * d, d, 1]
        q, k, v = (g.tensor(name=n, dim=dims, stride=st, data_type=bf16) for n in "qkv")
        o, stats = g.sdpa(q=q, k=k, v=v, attn_scale=0.1, generate_stats=True,
                          **bw.cudnn_mask_kwargs(cudnn, s, s, *window))
        o.set_output(True).set_dim(dims).set_stride(st).set_data_type(bf16)
        stats.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
        try:
            g.validate()
            facts = graph_analyzer.analyze(g)
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"this frontend cannot analyze graphs without a GPU: {type(e).__name__}: {e}")
        if not hasattr(facts, "window_left"):
            pytest.skip("this frontend's analyzer has no window_left")
        assert facts.window_left == (None if window[0] < 0 else window[0]) and facts.right_bound == 0


# ---- the self-check's rules -----------------------------------------------------------------------


def test_check_windows_and_neighbors():
    assert bw.check_windows(1024, 4095, 0) == [(255, 0), (63, 0)]
    assert bw.check_windows(1024, 100, 0) == [(100, 0), (63, 0)]
    assert bw.check_windows(1024, 31, 0) == [(31, 0)]
    assert bw.check_windows(1024, -1, 0) == [(-1, 0)]
    assert bw.check_windows(1024, 3, 2) == [(3, 2)]
    assert bw.check_windows(1024, 4095, 4095) == [(255, 255), (63, 255)]
    assert bw.neighbors(63, 0) == [(62, 0), (64, 0), (63, 1)]
    assert bw.neighbors(0, 0) == [(1, 0), (0, 1)]
    assert bw.neighbors(-1, 0) == [(-1, 1)]
    assert bw.neighbors(-1, -1) == []
    assert bw.neighbors(3, 2) == [(2, 2), (4, 2), (3, 1), (3, 3)]


def test_judge():
    nb = {"(62, 0)": {"O": 0.05, "dQ": 0.06}, "(64, 0)": {"O": 0.04, "dQ": 0.07}}
    assert bw.judge({"O": 0.003, "dQ": 0.005}, nb, 0.02) == ("ok", "")
    status, why = bw.judge({"O": 0.03, "dQ": 0.005}, nb, 0.02)
    assert status == "bad" and why == "O error 0.03 > tol 0.02"
    status, why = bw.judge({"O": float("nan")}, nb, 0.02)
    assert status == "bad" and "nan" in why
    status, why = bw.judge({"O": 0.045, "dQ": 0.005}, nb, 0.1)    # within tol, but nearer window (64, 0)'s
    assert status == "bad" and why.startswith("O closer to window (64, 0)'s reference (0.04)")
    assert bw.judge({"O": 0.01}, {}, 0.02) == ("ok", "")


# ---- bench_case on CPU tensors (plumbing) -------------------------------------------------------------


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench_window_gpu on the CPU: DEVICE cpu, S = 128 checks, a fake timer, no profiler, FlexAttention
    eager (its CPU path), empty check caches; returns a row-maker."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setattr(bw, "DEVICE", "cpu")
    monkeypatch.setattr(bw, "CHECK_SEQ", 128)
    monkeypatch.setattr(bw, "time_ms", lambda fn, warmup, iters: (fn(), 2.0)[1])
    monkeypatch.setattr(bw, "kernel_ms", lambda fn, name, reps=5: None)
    monkeypatch.setattr(bw, "_FLEX", {"fns": (flex_attention, create_block_mask)})
    for cache in ("_CHECKS", "_REFS", "_CUDNN_GRAPHS"):
        monkeypatch.setattr(bw, cache, {})
    monkeypatch.setattr(bw.cfa, "load", lambda: None)   # no cuDNN frontend: n/a with the reason
    warnings.filterwarnings("ignore", message=".*flex_attention.*")

    def run(argv, shape=(1, 4, 2, 256, 16)):
        args = bw.parse_args(argv)
        rows = []
        for w in args.windows:
            r = bw.new_row(shape, w, args)
            bw.bench_case(r, args)
            rows.append(r)
        return rows, args
    return run


def test_bench_case_on_cpu(cpu_bench):
    rows, args = cpu_bench(["--windows", "31:0,causal,3:2", "--kv-heads", "2"])
    for r in rows:
        assert r["status"] == {"fp8": "ok", "cudnn": "n/a", "flex": "ok"}, r["errors"]
        assert r["errors"]["cudnn"].startswith("RuntimeError: cuDNN frontend unavailable")
        assert r["fp8_fwd_ms"] == r["flex_fwd_ms"] == 2.0 and r["cudnn_fwd"] is None
        assert r["fp8_fwd"] == pytest.approx(bw.fwd_flops(1, 4, 16, r["pairs"]) / 2e-3 / 1e12)
        assert r["spot"]["fp8"] < 0.1 and r["spot"]["flex"] < 0.01
        for chk in r["checks"]["fp8"] + r["checks"]["flex"]:
            assert chk["status"] == "ok" and chk["S"] == 128
            # the check has power: an off-by-one window's reference is far from the right one's
            assert chk["off_by_one"]["O"] > 5 * args.tol
        assert 0.01 < r["checks"]["flex"][0]["vs_fp8"] < 0.1        # BF16 against FP8
    assert [r["pairs"] for r in rows] == [bw.visible_pairs(256, 256, *w) for w in ((31, 0), (-1, 0), (3, 2))]


def test_bench_case_backward_on_cpu(cpu_bench):
    rows, args = cpu_bench(["--windows", "40:0", "--bwd", "--skip", "flex,cudnn"])
    r = rows[0]
    assert r["status"] == {"fp8": "ok", "cudnn": "skipped", "flex": "skipped"}
    chk = r["checks"]["fp8"][0]
    assert set(chk["err"]) == {"O", "dQ", "dK", "dV"} and max(chk["err"].values()) < args.fp8_tol
    assert r["fp8_step_ms"] == 2.0 and r["fp8_step"] == pytest.approx(3.5 * r["fwd_flops"] / 2e-3 / 1e12)
    md = bw.markdown(rows, dict(INFO, args=vars(args)))
    assert "| 1x4/2x256, 16 | (40, 0) | 38 | " in md and "skipped" in md       # 256 * 41 - 40 * 41 / 2 pairs


@pytest.mark.parametrize("tol,why", [(None, "O error 0.1"), ("0.5", "O closer to window (32, 0)'s reference")])
def test_an_off_by_one_mask_is_caught(cpu_bench, monkeypatch, tol, why):
    """A Flex mask one key too wide on the left (the classic left-bound slip) fails its self-check:
    'bad', no number, the reason recorded; fp8attn's column is unaffected. At the default tolerance
    the error says so; at a tolerance too loose for that, the off-by-one rule still does."""
    right = bw.flex_offsets
    monkeypatch.setattr(bw, "flex_offsets", lambda sq, sk, left, rt: right(sq, sk, left + 1 if left >= 0 else left, rt))
    rows, args = cpu_bench(["--windows", "31:0"] + (["--tol", tol] if tol else []))
    r = rows[0]
    assert r["status"]["flex"] == "bad" and r["flex_fwd"] is None and r["status"]["fp8"] == "ok"
    assert r["errors"]["flex"].startswith("self-check at S=128, window (31, 0): " + why), r["errors"]["flex"]
    md = bw.markdown(rows, dict(INFO, args=vars(args)))
    summary = md.splitlines()[-1]
    assert summary.startswith("| 1x4/2x256, 16 | (31, 0) | ") and summary.count("bad") == 0  # Flex: ratios only
    assert "(bad)" in md and "Flex BF16: self-check at S=128, window (31, 0): O" in md
    assert _table(md, bw.FWD_HEAD)[2].split(" | ")[6] == "bad"


# ---- command line ------------------------------------------------------------------------------------


def test_help_is_complete():
    p = _run_script("bench_window_gpu.py", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for want in ("diagonal_band_left_bound = left + 1", "diagonal_band_right_bound = right", "create_block_mask",
                 "CUDNN_ATTENTION", "fwd_tilescale", "Delta-Matching", "off-by-one", "Exit status",
                 "--shapes SHAPES", "--windows WINDOWS", "--kv-heads", "--bwd", "--warmup", "--iters", "--json JSON",
                 "--out OUT", "--skip"):
        assert want in text, want


@pytest.mark.parametrize("args,want", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--windows", "4095"], "argument --windows: expected comma-separated LEFT:RIGHT windows"),
    (["--windows", "a:b"], "argument --windows: expected"),
    (["--windows=-2:0"], "argument --windows: expected"),
    (["--windows", "1:2:3"], "argument --windows: expected"),
    (["--shapes", "1x16x0x128"], "argument --shapes: expected comma-separated BxHxSxd"),
    (["--kv-heads", "3"], "argument --kv-heads: 3 does not divide H = 16"),
    (["--kv-heads", "0"], "argument --kv-heads: must be an integer >= 1"),
    (["--iters", "0"], "argument --iters: must be an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (["--tol", "0"], "argument --tol: must be a finite number > 0"),
    (["--skip", "fp8,bogus"], "argument --skip: expected a comma-separated subset"),
])
def test_bad_arguments_exit_2(args, want):
    p = _run_script("bench_window_gpu.py", *args)
    assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_defaults_and_parsing():
    a = bw.parse_args([])
    assert a.shapes == [(1, 16, 32768, 128)] and a.windows == [(4095, 0), (2047, 0), (-1, 0)]
    assert a.kv_heads is None and not a.bwd and (a.warmup, a.iters) == (3, 10) and a.json is None
    a = bw.parse_args(["--windows=-1:0,causal,none,3:2", "--shapes", "2x8x4096x64,1x16x8192x128", "--kv-heads", "4",
                       "--bwd", "--skip", "flex", "--json", "x.json"])
    assert a.windows == [(-1, 0), (-1, -1), (3, 2)] and a.shapes == [(2, 8, 4096, 64), (1, 16, 8192, 128)]
    assert a.kv_heads == 4 and a.bwd and a.skip == ("flex",) and a.json == "x.json"


# ---- markdown and JSON ---------------------------------------------------------------------------------


def _rows(bwd=False):
    args = bw.parse_args(["--bwd"] if bwd else [])
    shape = (1, 16, 16, 32768, 128)
    ok = bw.new_row(shape, (4095, 0), args)
    ok.update(fp8_fwd=400.0, fp8_fwd_ms=1.2, fp8_kernel_fwd=600.0, fp8_kernel_fwd_ms=0.8, cudnn_fwd=500.0,
              cudnn_fwd_ms=0.96, flex_fwd=250.0, flex_fwd_ms=1.92, sdpa_causal_fwd=550.0, sdpa_causal_fwd_ms=3.9,
              status={"fp8": "ok", "cudnn": "ok", "flex": "ok"}, spot={"fp8": 0.04, "cudnn": 0.003, "flex": 0.003})
    chk = {"window": [255, 0], "S": 1024, "status": "ok", "err": {"O": 0.04}, "off_by_one": {"O": 0.06}}
    ok["checks"] = {"fp8": [chk], "cudnn": [dict(chk, err={"O": 0.003}, vs_fp8=0.04)],
                    "flex": [dict(chk, err={"O": 0.0031}, vs_fp8=0.041)]}
    if bwd:
        ok.update(fp8_step=300.0, fp8_step_ms=5.6, cudnn_step=400.0, cudnn_step_ms=4.2, flex_step=200.0,
                  flex_step_ms=8.4, fp8_kernel_step=350.0, fp8_kernel_step_ms=4.8)
    bad = bw.new_row(shape, (-1, 0), args)
    bad.update(fp8_fwd=500.0, fp8_fwd_ms=4.4, status={"fp8": "ok", "cudnn": "bad", "flex": "skipped"})
    bad["errors"]["cudnn"] = "self-check at S=1024, window (-1, 0): O error 0.5 > tol 0.02"
    bad["errors"]["sdpa_causal"] = "RuntimeError: No available kernel"
    return [ok, bad], dict(INFO, args=vars(args))


def _table(md, head):
    lines = md.splitlines()
    i = lines.index(head)
    out = []
    for ln in lines[i:]:
        if not ln.startswith("|"):
            break
        out.append(ln)
    return out


def test_markdown_forward():
    rows, info = _rows()
    md = bw.markdown(rows, info)
    assert "None" not in md and "cuDNN frontend 1.32.0 (backend 9.19)" in md
    fwd = _table(md, bw.FWD_HEAD)
    assert len({ln.count("|") for ln in fwd}) == 1 and len(fwd) == 4
    assert fwd[2] == ("| 1x16x32768, 128 | (4095, 0) | 3840 | 400 (1.200 ms) | 600 (0.800 ms) | 500 (0.960 ms) | "
                      "250 (1.920 ms) | 0.80 | 1.20 | 1.60 | 550 (3.900 ms) |")
    assert fwd[3] == ("| 1x16x32768, 128 | (-1, 0) causal | 16384 | 500 (4.400 ms) | n/a | bad | skipped | n/a | "
                      "n/a | n/a | n/a |")
    assert bw.STEP_HEAD not in md and "Forward only (no --bwd)." in md
    chk = _table(md, bw.CHECK_HEAD)
    assert chk[2] == ("| 1x16x32768, 128 | (4095, 0) | (255, 0) | 0.0400 | 0.0030 | 0.0031 | 0.0400 | 0.0410 | "
                      "0.0600 |") and len(chk) == 3
    assert "- 1x16x32768, 128, window (-1, 0) causal, cuDNN BF16 window: self-check at S=1024" in md
    assert "- 1x16x32768, 128, window (-1, 0) causal, SDPA cuDNN causal: RuntimeError: No available kernel" in md
    # the summary table is printed last
    lines = md.splitlines()
    assert lines[-4] == bw.SUMMARY_HEAD
    assert lines[-2] == "| 1x16x32768, 128 | (4095, 0) | 400 | 500 | 0.80 | 1.60 | n/a | n/a | n/a | n/a |"
    assert lines[-1] == "| 1x16x32768, 128 | (-1, 0) causal | 500 | bad | n/a | n/a | n/a | bad | n/a | n/a |"


def test_markdown_backward():
    rows, info = _rows(bwd=True)
    md = bw.markdown(rows, info)
    step = _table(md, bw.STEP_HEAD)
    assert step[2] == ("| 1x16x32768, 128 | (4095, 0) | 3840 | 300 (5.600 ms) | 350 (4.800 ms) | 400 (4.200 ms) | "
                       "200 (8.400 ms) | 0.75 | 0.88 | 1.50 | n/a |")
    assert md.splitlines()[-2] == ("| 1x16x32768, 128 | (4095, 0) | 400 | 500 | 0.80 | 1.60 | 300 | 400 | 0.75 | "
                                   "1.50 |")
    assert "O / dQ / dK / dV" in md


# ---- main --------------------------------------------------------------------------------------------


def test_no_gpu_is_a_message_and_exit_1_before_the_out_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "never"
    assert bw.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench_window_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written"]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_no_gpu_subprocess_has_no_traceback(tmp_path):
    p = _run_script("bench_window_gpu.py", "--bwd", "--out", str(tmp_path / "never"))
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "never").exists()


def test_failed_cases_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bw, "env_info", lambda: {k: v for k, v in INFO.items() if k != "cudnn_frontend"})
    monkeypatch.setattr(bw.cfa, "version_info", lambda: {"cudnn_frontend": None, "why": "import cudnn failed"})

    def fake_causal(row, shape, args):
        row["sdpa_causal_fwd"], row["sdpa_causal_fwd_ms"] = 550.0, 3.9

    def fake_case(r, args):
        if r["window"] == [2047, 0]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore")
        r["fp8_fwd"], r["fp8_fwd_ms"], r["status"]["fp8"] = 100.0, 1.0, "ok"
    monkeypatch.setattr(bw, "bench_sdpa_causal", fake_causal)
    monkeypatch.setattr(bw, "bench_case", fake_case)
    out, js = tmp_path / "out", tmp_path / "elsewhere.json"
    assert bw.main(["--out", str(out), "--json", str(js), "--shapes", "1x16x4096x128,1x16x8192x128"]) == 0
    got = json.loads((out / "bench_window_gpu.json").read_text())
    assert json.loads(js.read_text()) == got
    rows = got["rows"]
    assert [(r["S"], r["window"], sorted(r["errors"])) for r in rows] == [
        (s, w, ["case"] if w == [2047, 0] else []) for s in (4096, 8192) for w in ([4095, 0], [2047, 0], [-1, 0])]
    assert rows[1]["errors"]["case"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert all(r["sdpa_causal_fwd"] == 550.0 for r in rows) and rows[0]["fp8_fwd"] == 100.0
    assert got["env"]["cudnn_frontend"]["why"] == "import cudnn failed" and "FP8ATTN_TILE_FWD" in got["env"]["knobs"]
    md = (out / "bench_window_gpu.md").read_text()
    assert "cuDNN frontend n/a (import cudnn failed)" in md
    assert "- 1x16x4096, 128, window (2047, 0), case: OutOfMemoryError" in md
