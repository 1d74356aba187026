"""benchmarks/bench_varlen_gpu.py on the CPU (its GPU measurements run on the device only).

* the command line: --help names what is measured; bad values exit 2 (argparse), no traceback;
* document lengths: fixed lengths and the corpus sampler (the trainer's packed rows: sums to T,
  reproducible from the seed, each length in [1, seq_len], equal to document_segments of the
  rows TokenStream.random_batch draws), on a synthetic token file and, where a prepared corpus is
  on disk under <repo>/data, on the real one; a missing corpus is a reason, never a download;
* the FLOP counter: a hand-computed case, and one document of length S against bench_gpu.py's
  causal count (4 * H * S * S * d / 2: this one adds the diagonal's S / 2 pairs);
* bench_case's plumbing on CPU tensors (fp8attn's CPU reference; SDPA's cells n/a with a reason,
  the FP8ATTN_VARLEN_LOOP knob restored), with a fake timer;
* cuDNN BF16 varlen (the frontend's ragged graphs): the ragged offsets and lengths, checked by
  addressing packed tensors the way the graph declares them (logical [B, H, S_max, d] with the
  packed strides, each sequence from its element offset); the self-check's lengths; its per-document
  float32 reference against a block-diagonal causal mask; the column's plumbing on the CPU with a
  fake column that addresses the tensors through those offsets (ok, a number, single's O vs it),
  and with token instead of element offsets (caught: "bad", no number); graphs built once per key;
  the frontend missing: n/a with the reason, the run goes on; where the frontend is importable, its
  own validation and graph analyzer read the declared forward / backward graphs (no GPU needed) as
  ragged, padded, causal, element offsets on every packed port;
* markdown on synthetic rows: the ratio columns, n/a, bad and skipped cells with their reasons, the
  backward table, the cuDNN self-check table;
* main: without a GPU a one-line message, exit 1, no --out directory; a failing case is recorded
  and the run goes on.
CPU, a few seconds.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("fp8attn")
import bench_gpu  # noqa: E402
import bench_varlen_gpu as bv  # noqa: E402
from fp8attn.train.data import TokenStream  # noqa: E402
from fp8attn.train.model import document_segments  # noqa: E402
from test_bench_gpu import _run_script  # noqa: E402

INFO = {"gpu": "G", "driver": "D", "torch": "T", "cuda": "C", "cudnn": 1, "date": "now",
        "cudnn_frontend": {"cudnn_frontend": "1.32.0", "cudnn_backend": "9.19.0"}}


def _table(md, head):
    """The markdown table starting at the line `head` (its header, separator and rows)."""
    lines = md.splitlines()
    out = []
    for ln in lines[lines.index(head):]:
        if not ln.startswith("|"):
            break
        out.append(ln)
    return out


# ---- command line ----------------------------------------------------------------------------


def test_help_is_complete():
    p = _run_script("bench_varlen_gpu.py", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for want in ("FP8ATTN_VARLEN_LOOP=1", "L * (L + 1) / 2", "the diagonal included", "backward 2.5x",
                 "nested_tensor_from_jagged", "CUDNN_ATTENTION", "fp8attn::bwd_varlen", "Exit status",
                 "single / dense (issue target >= 0.9", "--tokens TOKENS", "--dists DISTS", "--kv-heads",
                 "--head-dim", "--bwd", "--loop", "--out OUT", "ragged offsets", "ELEMENT offsets",
                 "cu_seqlens * H * d", "cu_seqlens * H_kv * d", "use_padding_mask=True", "generate_stats=True",
                 "sdpa_backward", "single / cuDNN varlen", "install_cudnn_frontend", "--no-cudnn-varlen",
                 "--tol TOL", "T = 2000 tokens", "capped at 512"):
        assert want in text, want


@pytest.mark.parametrize("args,want", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tokens", "0"], "argument --tokens: expected comma-separated positive integers"),
    (["--tokens", "16384,abc"], "argument --tokens: expected"),
    (["--dists", "128,zipf"], "argument --dists: expected comma-separated document lengths"),
    (["--dists", "-5"], "argument --dists: expected"),
    (["--kv-heads", "3"], "argument --kv-heads: 3 does not divide --heads 16"),
    (["--head-dim", "0"], "argument --head-dim: must be an integer >= 1"),
    (["--iters", "0"], "argument --iters: must be an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (["--preset", "nope"], "argument --preset: invalid choice"),
    (["--tol", "0"], "argument --tol: must be a finite number > 0"),
])
def test_bad_arguments_exit_2(args, want):
    p = _run_script("bench_varlen_gpu.py", *args)
    assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_defaults():
    a = bv.parse_args([])
    assert (a.tokens, a.dists, a.heads, a.kv_heads, a.head_dim) == (["16384", "65536"],
                                                                     ["128", "512", "2048", "corpus"], 16, 16, 128)
    assert not a.bwd and a.loop_max_docs == 512 and a.preset == "gpu-350m"
    assert a.tol == 0.02 and not a.no_cudnn_varlen


# ---- document lengths ---------------------------------------------------------------------------


def test_fixed_lengths():
    assert bv.fixed_lengths(16384, 512) == [512] * 32
    assert bv.fixed_lengths(1000, 300) == [300, 300, 300, 100]   # the last one cut
    assert bv.fixed_lengths(100, 128) == [100]


def _token_file(tmp_path, n=50_000, seed=1):
    """A synthetic uint16 token stream: documents of 1..3000 tokens, each ended by <|endoftext|> (0)."""
    rng = np.random.default_rng(seed)
    parts = []
    while sum(map(len, parts)) < n:
        parts.append(np.append(rng.integers(1, 500, size=int(rng.integers(0, 3000))), 0))
    path = tmp_path / "train.bin"
    np.concatenate(parts)[:n].astype(np.uint16).tofile(path)
    return path


@pytest.mark.parametrize("total,seq_len", [(16384, 4096), (16384, 1000), (5000, 4096), (1, 64)])
def test_corpus_lengths_are_the_trainers_packed_documents(tmp_path, total, seq_len):
    stream = TokenStream(_token_file(tmp_path), seq_len)
    got = bv.corpus_lengths(stream, total, seed=7)
    assert sum(got) == total and min(got) >= 1 and max(got) <= seq_len
    assert got == bv.corpus_lengths(stream, total, seed=7)            # the seed fixes it
    # the same rows the trainer would draw, cut by its document_segments; all but the last kept whole
    rows = -(-total // seq_len)
    x, _ = stream.random_batch(np.random.default_rng(7), rows)
    whole = document_segments(x)[0].diff().tolist()
    assert got[:-1] == whole[:len(got) - 1] and 1 <= got[-1] <= whole[len(got) - 1]


def test_corpus_lengths_depend_on_the_seed(tmp_path):
    stream = TokenStream(_token_file(tmp_path), 4096)
    assert bv.corpus_lengths(stream, 65536, 0) != bv.corpus_lengths(stream, 65536, 1)


def test_corpus_on_the_real_data():
    """The prepared training corpus (python -m fp8attn.train.data at gpu-350m's vocab), if on disk."""
    args = bv.parse_args([])
    _, _, seq_len, path = bv.corpus_setup(args)
    if not (path / "meta.json").exists():
        pytest.skip(f"no prepared corpus at {path} (not in the repository; make it with `python -m "
                    "fp8attn.train.data --data-dir data --vocab-size 32768 --max-mb 32`, needs network once)")
    stream, info = bv.load_corpus(args)
    assert info["seq_len"] == seq_len == 4096 and info["eot_id"] == 0 and info["train_tokens"] > 10 ** 6
    for total in (16384, 65536):
        lengths = bv.corpus_lengths(stream, total, 0, info["eot_id"])
        assert sum(lengths) == total and 1 <= min(lengths) and max(lengths) <= seq_len
        assert lengths == bv.corpus_lengths(stream, total, 0, info["eot_id"])
        assert len(lengths) > total // seq_len   # rows hold several documents (real separators)


def test_missing_corpus_is_a_reason_not_a_download(tmp_path, monkeypatch):
    def no_prepare(*a, **k):
        raise AssertionError("prepare() would download")
    monkeypatch.setattr(bv, "prepare", no_prepare)
    monkeypatch.delenv("FP8ATTN_TEXT_DIR", raising=False)
    stream, why = bv.load_corpus(bv.parse_args(["--data-dir", str(tmp_path)]))
    assert stream is None
    assert "python -m fp8attn.train.data --data-dir data --vocab-size 32768 --max-mb 32" in why
    assert "carry data/linux-doc-6.1-bpe32768-32mb" in why


def test_prepared_corpus_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    _token_file(d).rename(d / "train.bin")
    (d / "meta.json").write_text(json.dumps({"source": "x", "vocab_size": 500, "eot_id": 0, "train_tokens": 50000}))
    stream, info = bv.load_corpus(bv.parse_args(["--corpus", str(d), "--corpus-seq-len", "1024"]))
    assert info["seq_len"] == 1024 and info["dir"] == str(d) and sum(bv.corpus_lengths(stream, 3000, 0)) == 3000


# ---- FLOPs --------------------------------------------------------------------------------------


def test_flops_hand_computed():
    assert bv.attended_pairs([1, 2, 3]) == 1 + 3 + 6
    assert bv.fwd_flops([1, 2, 3], heads=2, head_dim=4) == 4 * 2 * 4 * 10
    assert bv.fwd_flops([128] * 128, 16, 128) == 4 * 16 * 128 * 128 * (128 * 129 // 2)


@pytest.mark.parametrize("s", [128, 1000, 16384])
def test_one_document_is_bench_gpus_causal_count_plus_the_diagonal_half(s):
    h, d = 16, 128
    assert "4 * B * H * S * S * d FLOPs, halved for causal" in " ".join(bench_gpu.__doc__.split())
    bench_gpu_causal = 4.0 * 1 * h * s * s * d / 2          # bench_gpu.bench_shape, B = 1
    assert bv.fwd_flops([s], h, d) == bench_gpu_causal + 4.0 * h * d * s / 2
    assert bv.fwd_flops([s], h, d) / bench_gpu_causal == pytest.approx((s + 1) / s)


# ---- bench_case on the CPU (plumbing) ----------------------------------------------------------


def test_bench_case_on_cpu(monkeypatch):
    monkeypatch.setattr(bv, "DEVICE", "cpu")
    monkeypatch.setattr(bv, "time_ms", lambda fn, warmup, iters: (fn(), 2.0)[1])
    monkeypatch.delenv("FP8ATTN_VARLEN_LOOP", raising=False)
    args = bv.parse_args(["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--bwd"])
    lengths = bv.fixed_lengths(80, 32)
    r = bv.new_row(80, "32", lengths, args)
    assert (r["dense_B"], r["dense_L"], r["pairs"]) == (2, 27, 2 * 528 + 16 * 17 // 2)
    bv.bench_case(r, lengths, args)
    assert "FP8ATTN_VARLEN_LOOP" not in os.environ
    assert r["single_ms"] == r["loop_ms"] == r["dense_ms"] == 2.0
    assert r["single"] == pytest.approx(bv.fwd_flops(lengths, 2, 16) / 2e-3 / 1e12)
    assert r["dense"] == pytest.approx(bv.fwd_flops([27, 27], 2, 16) / 2e-3 / 1e12)
    assert r["single_eq_loop"] is True and r["single_step_ms"] == 2.0 and r["single_bwd"] is None
    # CPU: SDPA's causal jagged path and the cuDNN backend refuse; n/a with the reason, the run went on
    assert r["sdpa_varlen"] is None and r["errors"]["sdpa_varlen"] and r["errors"]["cudnn_dense"]
    assert r["single_err"] is None


def test_loop_skipped_above_the_limit(monkeypatch):
    monkeypatch.setattr(bv, "DEVICE", "cpu")
    monkeypatch.setattr(bv, "time_ms", lambda fn, warmup, iters: 1.0)
    args = bv.parse_args(["--heads", "1", "--kv-heads", "1", "--head-dim", "16", "--loop-max-docs", "3", "--no-sdpa"])
    r = bv.new_row(64, "16", bv.fixed_lengths(64, 16), args)
    bv.bench_case(r, bv.fixed_lengths(64, 16), args)
    assert r["loop"] is None and r["skipped"]["loop"].startswith("4 documents > --loop-max-docs 3")
    args.loop = True
    r = bv.new_row(64, "16", bv.fixed_lengths(64, 16), args)
    bv.bench_case(r, bv.fixed_lengths(64, 16), args)
    assert r["loop_ms"] == 1.0 and not r["skipped"]


# ---- cuDNN BF16 varlen: ragged offsets, reference, plumbing ----------------------------------------


def test_ragged_offsets_and_lengths_hand_computed():
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    off = bv.ragged_offsets(cu, heads=2, head_dim=4)
    assert off.shape == (4, 1, 1, 1) and off.dtype == torch.int64 and off.flatten().tolist() == [0, 24, 56, 96]
    lens = bv.seq_lens(cu)
    assert lens.shape == (3, 1, 1, 1) and lens.dtype == torch.int32 and lens.flatten().tolist() == [3, 4, 5]
    assert bv.thd_layout(3, 2, 5, 4) == ([3, 2, 5, 4], [40, 4, 8, 1])
    assert bv.cu_seqlens([3, 4, 5], "cpu").tolist() == [0, 3, 7, 12]
    # 64-bit: T * H * d past 2^31 (256K tokens x 64 heads x 128) stays exact
    big = torch.tensor([0, 1 << 18], dtype=torch.int32)
    assert bv.ragged_offsets(big, 64, 128).flatten().tolist() == [0, (1 << 18) * 64 * 128]


def _ragged_view(x, offsets, lengths, b, max_len):
    """Document b of packed x [T, heads, d] as the ragged graph addresses it: the logical [heads, L_b, d]
    slice of [B, heads, S_max, d] with thd_layout's strides, starting at ELEMENT offsets[b] of x's storage
    (the batch stride never stepped)."""
    _, strides = bv.thd_layout(len(lengths), x.shape[1], max_len, x.shape[2])
    return torch.as_strided(x, (x.shape[1], lengths[b], x.shape[2]), strides[1:], x.storage_offset() + offsets[b])


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (3, 1)])
def test_the_ragged_addressing_reaches_each_document(h, hkv):
    """The declared layout + ragged_offsets address exactly the packed tensor's documents, for q's heads
    and for k / v's; token offsets (no H * d factor) would not."""
    lengths, d = [5, 1, 12, 7], 8
    cu = bv.cu_seqlens(lengths, "cpu")
    lens = bv.seq_lens(cu).flatten().tolist()
    for heads in (h, hkv):
        x = torch.randn(sum(lengths), heads, d)
        offs = bv.ragged_offsets(cu, heads, d).flatten().tolist()
        for b in range(len(lengths)):
            a, e = int(cu[b]), int(cu[b + 1])
            assert torch.equal(_ragged_view(x, offs, lens, b, max(lengths)), x[a:e].transpose(0, 1))
        tokens = cu.long().tolist()
        assert not torch.equal(_ragged_view(x, tokens, lens, 2, max(lengths)), x[6:18].transpose(0, 1))


@pytest.mark.parametrize("lengths,want", [
    ([128] * 512, [128] * 15 + [80]),
    ([512] * 128, [512, 512, 512, 464]),
    ([2048] * 32, [512, 512, 512, 464]),
    ([100], [100] * 20),                               # a short run: its lengths cycled
    ([700, 3, 40], [512, 3, 40] * 3 + [335]),          # capped, cycled, the last one cut
])
def test_check_lengths(lengths, want):
    got = bv.check_lengths(lengths)
    assert got == want and sum(got) == bv.CHECK_TOKENS == 2000 and max(got) <= bv.CHECK_MAX_LEN


@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2), (3, 1)])
def test_reference_is_block_diagonal_causal_attention(h, hkv):
    """reference_varlen (one SDPA call per document) = one float64 SDPA over the packed batch with the
    block-diagonal causal mask, O and dQ / dK / dV."""
    lengths, d = [5, 1, 12, 7], 8
    t = sum(lengths)
    g = torch.Generator().manual_seed(h * 10 + hkv)
    q, k, v, dout = (torch.randn(t, n, d, generator=g) for n in (h, hkv, hkv, h))
    o, grads = bv.reference_varlen(q, k, v, bv.cu_seqlens(lengths, "cpu"), dout)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(t)
    mask = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    qq, kk, vv = (x.transpose(0, 1)[None] for x in leaves)
    ref = F.scaled_dot_product_attention(qq, kk.repeat_interleave(h // hkv, 1), vv.repeat_interleave(h // hkv, 1),
                                         attn_mask=mask)[0].transpose(0, 1)
    want = torch.autograd.grad(ref, leaves, dout.double())
    assert o.dtype == torch.float32 and torch.allclose(o.double(), ref, atol=1e-5)
    for got, w in zip(grads, want):
        assert got.shape == w.shape and torch.allclose(got.double(), w, atol=1e-4)
    assert bv.reference_varlen(q, k, v, bv.cu_seqlens(lengths, "cpu"))[1] is None
    with pytest.raises(ValueError, match="cu_seqlens ends at 24, not at T = 25"):
        bv.reference_varlen(q, k, v, bv.cu_seqlens(lengths[:-1] + [6], "cpu"))


def _fake_cudnn_column(offsets=bv.ragged_offsets):
    """A CPU stand-in for cudnn_varlen_column that does what the ragged graph is told: reads q / k / v
    and writes O (and reads dO) through thd_layout + `offsets` + seq_lens (float32 math per document,
    BF16 out; dQ / dK / dV by autograd through the same views)."""
    def column(q, k, v, cu, max_len, dout=None):
        h, hkv = q.shape[1], k.shape[1]
        lens = bv.seq_lens(cu).flatten().tolist()
        oq, okv = (offsets(cu, n, q.shape[2]).flatten().tolist() for n in (h, hkv))
        o = torch.zeros_like(q)

        def attend(leaves):
            outs = []
            for b in range(len(lens)):
                qb = _ragged_view(leaves[0], oq, lens, b, max_len)
                kb, vb = (_ragged_view(x, okv, lens, b, max_len).repeat_interleave(h // hkv, 0) for x in leaves[1:])
                outs.append(F.scaled_dot_product_attention(qb[None], kb[None], vb[None], is_causal=True)[0])
            return outs

        def fwd():
            for b, ob in enumerate(attend([x.float() for x in (q, k, v)])):
                _ragged_view(o, oq, lens, b, max_len).copy_(ob)
            return o

        def step():
            fwd()
            leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
            outs = attend(leaves)
            douts = [_ragged_view(dout.float(), oq, lens, b, max_len) for b in range(len(lens))]
            return tuple(x.to(torch.bfloat16) for x in torch.autograd.grad(outs, leaves, douts))
        return bv.Column(fwd, step if dout is not None else None)
    return column


@pytest.fixture
def cpu_case(monkeypatch):
    """bench_case on the CPU: DEVICE cpu, a fake timer (2 ms a call), empty cuDNN caches, no SDPA."""
    monkeypatch.setattr(bv, "DEVICE", "cpu")
    monkeypatch.setattr(bv, "time_ms", lambda fn, warmup, iters: (fn(), 2.0)[1])
    monkeypatch.setattr(bv, "_CHECKS", {})
    monkeypatch.setattr(bv, "_CUDNN_GRAPHS", {})

    def run(argv, lengths):
        args = bv.parse_args(["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--no-sdpa"] + argv)
        r = bv.new_row(sum(lengths), "corpus", lengths, args)
        bv.bench_case(r, lengths, args)
        return r, args
    return run


@pytest.mark.parametrize("bwd", [False, True])
def test_cudnn_varlen_column_plumbing_on_cpu(cpu_case, monkeypatch, bwd):
    monkeypatch.setattr(bv, "cudnn_varlen_column", _fake_cudnn_column())
    lengths = [50, 7, 33, 30]
    r, args = cpu_case(["--bwd"] if bwd else [], lengths)
    chk = r["cudnn_check"]
    assert chk["status"] == "ok" and (chk["T"], chk["min_len"], chk["max_len"]) == (2000, 7, 50), chk
    assert set(chk["err"]) == ({"O", "dQ", "dK", "dV"} if bwd else {"O"}) and max(chk["err"].values()) < 0.01
    assert "cudnn_varlen" not in r["errors"] and not r["bad"]
    assert r["cudnn_varlen_ms"] == 2.0 and r["cudnn_varlen"] == pytest.approx(bv.fwd_flops(lengths, 2, 16) / 2e-3 / 1e12)
    assert 0.003 < r["single_err_cudnn"] < 0.1                     # FP8 single against BF16
    if bwd:
        assert r["cudnn_varlen_step_ms"] == 2.0 and r["cudnn_varlen_bwd"] is None   # step == fwd: no backward time
    md = bv.markdown([r], dict(INFO, args=vars(args)))
    check = _table(md, bv.CHECK_HEAD)
    assert len(check) == 3 and check[2].startswith("| 120 | corpus | 2000: 67 (7 / 50) | ") and check[2].endswith(" | ok |")
    assert (check[2].count("n/a") == 0) if bwd else (check[2].count("n/a") == 3)


def test_token_offsets_are_caught_by_the_self_check(cpu_case, monkeypatch):
    """Offsets in tokens (no H * d factor) read and write the wrong rows: 'bad', no number, the reason."""
    monkeypatch.setattr(bv, "cudnn_varlen_column", _fake_cudnn_column(lambda cu, heads, d: cu.long().reshape(-1, 1, 1, 1)))
    r, args = cpu_case([], [512, 512])
    assert r["cudnn_check"]["status"] == "bad" and r["cudnn_check"]["err"]["O"] > 0.5
    assert r["cudnn_varlen"] is None and r["bad"] == ["cudnn_varlen"] and r["single_err_cudnn"] is None
    assert r["errors"]["cudnn_varlen"].startswith("self-check at T=2000 (4 documents): O error ")
    assert r["single"] is not None                                     # the other columns unaffected
    md = bv.markdown([r], dict(INFO, args=vars(args)))
    table = [ln for ln in md.splitlines() if ln.startswith("| 1024 | corpus | 2 |")]
    assert table[0].split(" | ")[8] == "bad" and " | bad |" in _table(md, bv.CHECK_HEAD)[2]
    assert "- T=1024, corpus, cuDNN BF16 varlen: self-check at T=2000 (4 documents): O error" in md


def test_missing_frontend_is_na_with_the_reason(cpu_case, monkeypatch):
    monkeypatch.setattr(bv.cfa, "load", lambda: None)
    monkeypatch.setitem(bv.cfa._STATE, "why", "import cudnn failed (ModuleNotFoundError: No module named 'cudnn')")
    r, args = cpu_case([], [64, 64])
    assert r["errors"]["cudnn_varlen"] == ("RuntimeError: cuDNN frontend unavailable: import cudnn failed "
                                           "(ModuleNotFoundError: No module named 'cudnn')")
    assert r["cudnn_varlen"] is None and not r["bad"] and r["cudnn_check"] is None and r["single"] is not None
    r2, _ = cpu_case(["--no-cudnn-varlen"], [64, 64])
    assert r2["skipped"] == {"cudnn_varlen": "--no-cudnn-varlen"} and "cudnn_varlen" not in r2["errors"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the frontend without a GPU")
def test_frontend_without_a_gpu_is_na_not_a_crash(cpu_case):
    try:
        import cudnn  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cuDNN frontend not importable here: {type(e).__name__}: {e}")
    r, _ = cpu_case([], [64, 64])
    assert r["cudnn_varlen"] is None and r["errors"]["cudnn_varlen"] and r["single"] is not None


def test_graphs_are_built_once_per_key(monkeypatch):
    built = []
    monkeypatch.setattr(bv, "_CUDNN_GRAPHS", {})
    monkeypatch.setattr(bv, "declare_ragged", lambda cudnn, *a: (built.append(a), ("graph", {}))[1])
    monkeypatch.setattr(bv.cfa, "_finish", lambda cudnn, g, t: "built")
    monkeypatch.setattr(bv.cfa, "_handle", lambda: "handle")
    for _ in range(3):
        assert bv.cudnn_varlen_graphs(None, 4, 2, 1, 512, 16, 2000, True) == {"fwd": "built", "bwd": "built"}
    assert built == [(4, 2, 1, 512, 16, 2000, False, "handle"), (4, 2, 1, 512, 16, 2000, True, "handle")]
    assert bv.cudnn_varlen_graphs(None, 4, 2, 1, 512, 16, 2000, False) == {"fwd": "built", "bwd": None}
    assert len(built) == 3


def test_pack_binds_each_offset_port_to_its_heads_offsets():
    built = types.SimpleNamespace(t={"q": "Tq", "dO": "TdO", "seq_q": "Ts", "off_q": "Oq", "off_o": "Oo",
                                     "off_k": "Ok", "off_v": "Ov", "off_dQ": "OdQ", "off_dK": "OdK", "off_dV": "OdV"})
    pack = bv._pack(built, {"q": "q", "dO": "dO", "seq_q": "lens"}, {"q": "OFF_Q", "kv": "OFF_KV"})
    assert pack == {"Tq": "q", "TdO": "dO", "Ts": "lens", "Oq": "OFF_Q", "Oo": "OFF_Q", "OdQ": "OFF_Q",
                    "Ok": "OFF_KV", "Ov": "OFF_KV", "OdK": "OFF_KV", "OdV": "OFF_KV"}


def test_cudnn_frontend_reads_the_ragged_graphs():
    """Where the cuDNN frontend is installed (it declares and validates graphs without a GPU): every
    packed port of the declared forward / backward graphs has the thd_layout dims / strides and a
    [B + 1, 1, 1, 1] int64 ragged offset in elements (multiplier 1), bound to its heads' offsets; the
    stats are padded; the frontend's graph analyzer reads the graphs as ragged (THD), padded, causal
    top-left with the declared B / H / H_kv / S_max / d, the backward's packed totals T rounded to 64."""
    try:
        import cudnn  # noqa: PLC0415
        from cudnn.sdpa import graph_analyzer  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001  (not installed, no libcudnn, another version's layout)
        pytest.skip(f"cuDNN frontend not importable here: {type(e).__name__}: {e}")
    b, h, hkv, s_max, d, t = 5, 4, 2, 512, 128, 2000
    for bwd in (False, True):
        g, ten = bv.declare_ragged(cudnn, b, h, hkv, s_max, d, t, bwd)
        ports = ("q", "k", "v", "o", "dO", "dQ", "dK", "dV") if bwd else ("q", "k", "v", "o")
        for n in ports:
            heads = h if bv.OFFSET_OF[n] == "q" else hkv
            assert [ten[n].get_dim(), ten[n].get_stride()] == list(bv.thd_layout(b, heads, s_max, d)), n
            off = ten[n].ragged_offset
            assert off is ten[f"off_{'o' if n == 'dO' else n}"] and ten[n].get_ragged_offset_multiplier() == 1, n
            assert off.get_dim() == [b + 1, 1, 1, 1] and off.get_data_type() == cudnn.data_type.INT64, n
        assert ten["stats"].ragged_offset is None and ten["stats"].get_dim() == [b, h, s_max, 1]
        for n in ("seq_q", "seq_kv"):
            assert ten[n].get_dim() == [b, 1, 1, 1] and ten[n].get_data_type() == cudnn.data_type.INT32
        try:
            g.validate()
            facts = graph_analyzer.analyze(g)
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"this frontend cannot analyze graphs without a GPU: {type(e).__name__}: {e}")
        if not hasattr(facts, "thd"):
            pytest.skip("this frontend's analyzer has no thd fact")
        assert facts.invalid is None and facts.thd and facts.padded and facts.packed_layout
        assert facts.causal and not facts.bottom_right and facts.right_bound == 0 and facts.window_left is None
        assert (facts.b, facts.h_q, facts.h_kv, facts.s_q, facts.s_kv, facts.d_qk) == (b, h, hkv, s_max, s_max, d)
        assert facts.scale == pytest.approx(d ** -0.5) and facts.is_backward == bwd
        if bwd:
            assert facts.max_total_seq_len_q == facts.max_total_seq_len_kv == 2048
        else:
            assert facts.wants_stats


# ---- markdown ------------------------------------------------------------------------------------


def _rows(bwd=False):
    args = bv.parse_args(["--bwd"] if bwd else [])
    ok = bv.new_row(16384, "512", bv.fixed_lengths(16384, 512), args)
    ok.update(single=500.0, single_ms=0.5, loop=100.0, loop_ms=2.5, dense=540.0, dense_ms=0.47, sdpa_varlen=400.0,
              sdpa_varlen_ms=0.62, cudnn_varlen=625.0, cudnn_varlen_ms=0.4, cudnn_dense=450.0, cudnn_dense_ms=0.55,
              sdpa_backend="FLASH_ATTENTION", single_err=0.0213, single_err_cudnn=0.0467, single_eq_loop=True)
    ok["cudnn_check"] = {"T": 2000, "docs": 4, "min_len": 464, "max_len": 512, "status": "ok", "reason": "",
                         "err": dict(O=0.0031, **({"dQ": 0.0052, "dK": 0.0061, "dV": 0.0043} if bwd else {}))}
    if bwd:
        ok.update(single_bwd=300.0, single_bwd_ms=2.0, single_step_ms=2.5, dense_bwd=350.0, dense_bwd_ms=1.7,
                  dense_step_ms=2.2, cudnn_varlen_bwd=400.0, cudnn_varlen_bwd_ms=1.5, cudnn_varlen_step_ms=1.9)
    bad = bv.new_row(65536, "128", bv.fixed_lengths(65536, 128), args)
    bad.update(single=200.0, single_ms=1.0, dense=400.0, dense_ms=0.5)
    bad["errors"]["sdpa_varlen"] = "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    bad["skipped"]["loop"] = "1024 documents > --loop-max-docs 512 (--loop forces it)"
    bad["cudnn_check"] = {"T": 2000, "docs": 16, "min_len": 80, "max_len": 128, "status": "bad",
                          "reason": "O error 0.71 >= tol 0.02", "err": {"O": 0.71}}
    bad["bad"].append("cudnn_varlen")
    bad["errors"]["cudnn_varlen"] = "self-check at T=2000 (16 documents): O error 0.71 >= tol 0.02"
    missing = bv.new_row(16384, "corpus", [], args)
    missing["errors"]["corpus"] = "no prepared corpus at data/x"
    return [ok, bad, missing], dict(INFO, args=vars(args))


def test_markdown_ratios_and_na():
    rows, info = _rows()
    md = bv.markdown(rows, info)
    assert "None" not in md and bv.HEAD in md and "single / dense | single / SDPA varlen | single / cuDNN varlen" in md
    assert "cuDNN frontend 1.32.0 (backend 9.19.0)" in md and "graph execute only" in md
    table = _table(md, bv.HEAD)
    assert len({ln.count("|") for ln in table}) == 1 and len(table) == 5, md
    assert table[2] == ("| 16384 | fixed 512 | 32 | 512 / 512 | 500 (0.500 ms) | 100 (2.500 ms) | 540 (0.470 ms) | "
                        "400 (0.620 ms) | 625 (0.400 ms) | 450 (0.550 ms) | 0.93 | 1.25 | 0.80 | 0.0213 | 0.0467 | yes |")
    assert table[3] == ("| 65536 | fixed 128 | 512 | 128 / 128 | 200 (1.000 ms) | skipped | 400 (0.500 ms) "
                        "| n/a | bad | n/a | 0.50 | n/a | n/a | n/a | n/a | n/a |")
    assert table[4].startswith("| 16384 | corpus | 0 | n/a |") and table[4].count("n/a") == 13
    assert "backend FLASH_ATTENTION" in md
    assert "- T=65536, 128, SDPA BF16 varlen: OutOfMemoryError: CUDA out of memory." in md
    assert "- T=65536, 128, fp8 per-seq loop: skipped: 1024 documents > --loop-max-docs 512" in md
    assert "- T=65536, 128, cuDNN BF16 varlen: self-check at T=2000 (16 documents): O error 0.71 >= tol 0.02" in md
    assert "- T=16384, corpus, corpus: no prepared corpus at data/x" in md
    assert "single / dense >= 0.9 at mean length >= 512 in 1 of 1 rows; single faster than SDPA BF16 varlen " \
           "in 1 of 1 rows. Single faster than cuDNN BF16 varlen in 0 of 1 rows." in md
    check = _table(md, bv.CHECK_HEAD)
    assert check[2:] == ["| 16384 | fixed 512 | 2000: 4 (464 / 512) | 0.0031 | n/a | n/a | n/a | ok |",
                         "| 65536 | fixed 128 | 2000: 16 (80 / 128) | 0.7100 | n/a | n/a | n/a | bad |"]
    assert "its O against float32 torch SDPA causal document by document" in md and "< 0.02 or bad" in md
    assert "Backward" not in md


def test_markdown_backward_table():
    rows, info = _rows(bwd=True)
    md = bv.markdown(rows, info)
    assert "Backward (= fwd+bwd step minus forward; single: fp8attn::bwd_varlen; cuDNN varlen: the forward " \
           "graph's execute then the backward graph's)." in md
    bwd = _table(md, bv.BWD_HEAD)
    assert len({ln.count("|") for ln in bwd}) == 1 and len(bwd) == 5
    assert bwd[2] == ("| 16384 | fixed 512 | 32 | 512 / 512 | 300 (2.000 ms) | 350 (1.700 ms) | n/a | 400 (1.500 ms) | "
                      "0.86 | n/a | 0.75 | 2.500 / 2.200 / n/a / 1.900 |")
    assert bwd[3] == ("| 65536 | fixed 128 | 512 | 128 / 128 | n/a | n/a | n/a | bad | n/a | n/a | n/a | "
                      "n/a / n/a / n/a / n/a |")
    assert "its O / dQ / dK / dV against" in md
    assert _table(md, bv.CHECK_HEAD)[2] == ("| 16384 | fixed 512 | 2000: 4 (464 / 512) | 0.0031 | 0.0052 | 0.0061 | "
                                            "0.0043 | ok |")


def test_markdown_without_the_frontend():
    rows, info = _rows()
    info["cudnn_frontend"] = {"cudnn_frontend": None, "why": "import cudnn failed (ModuleNotFoundError: x)"}
    for r in rows:
        r["cudnn_check"] = None
    md = bv.markdown(rows, info)
    assert "cuDNN frontend n/a (import cudnn failed (ModuleNotFoundError: x))" in md and bv.CHECK_HEAD not in md
    info["cudnn_frontend"] = None                                   # --no-cudnn-varlen
    assert "cuDNN frontend n/a (not loaded)" in bv.markdown(rows, info)


# ---- main --------------------------------------------------------------------------------------------


def test_no_gpu_is_a_message_and_exit_1_before_the_out_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "never"
    assert bv.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench_varlen_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written"]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_no_gpu_subprocess_has_no_traceback(tmp_path):
    p = _run_script("bench_varlen_gpu.py", "--out", str(tmp_path / "never"))
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "never").exists()


def test_failed_cases_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bv, "env_info", lambda: {k: v for k, v in INFO.items() if k != "cudnn_frontend"})
    monkeypatch.setattr(bv.cfa, "version_info", lambda: {"cudnn_frontend": None, "why": "import cudnn failed"})

    def fake_case(r, lengths, args):
        if r["dist"] == "128":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore")
        r["single"], r["single_ms"] = 100.0, 1.0
    monkeypatch.setattr(bv, "bench_case", fake_case)
    out = tmp_path / "out"
    assert bv.main(["--out", str(out), "--tokens", "4096", "--dists", "128,512,corpus",
                    "--data-dir", str(tmp_path / "no-data")]) == 0
    got = json.loads((out / "bench_varlen_gpu.json").read_text())
    rows = got["rows"]
    assert [(r["dist"], r["docs"], sorted(r["errors"])) for r in rows] == [
        ("128", 32, ["case"]), ("512", 8, []), ("corpus", 0, ["corpus"])]
    assert rows[0]["errors"]["case"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert rows[1]["single"] == 100.0 and "unavailable" in got["env"]["corpus"]
    assert "FP8ATTN_VARLEN_LOOP" in got["env"]["knobs"]
    assert got["env"]["cudnn_frontend"] == {"cudnn_frontend": None, "why": "import cudnn failed"}
    md = (out / "bench_varlen_gpu.md").read_text()
    assert "cuDNN frontend n/a (import cudnn failed)" in md
    assert "- T=4096, 128, case: OutOfMemoryError" in md and "- T=4096, corpus, corpus: no prepared corpus" in md
