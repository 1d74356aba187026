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
* markdown on synthetic rows: the ratio columns, n/a and skipped cells with their reasons, the
  backward table;
* main: without a GPU a one-line message, exit 1, no --out directory; a failing case is recorded
  and the run goes on.
CPU, a few seconds.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("fp8attn")
import bench_gpu  # noqa: E402
import bench_varlen_gpu as bv  # noqa: E402
from fp8attn.train.data import TokenStream  # noqa: E402
from fp8attn.train.model import document_segments  # noqa: E402
from test_bench_gpu import _run_script  # noqa: E402

INFO = {"gpu": "G", "driver": "D", "torch": "T", "cuda": "C", "cudnn": 1, "date": "now"}


# ---- command line ----------------------------------------------------------------------------


def test_help_is_complete():
    p = _run_script("bench_varlen_gpu.py", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for want in ("FP8ATTN_VARLEN_LOOP=1", "L * (L + 1) / 2", "the diagonal included", "backward 2.5x",
                 "nested_tensor_from_jagged", "CUDNN_ATTENTION", "fp8attn::bwd_varlen", "Exit status",
                 "single / dense (issue target >= 0.9", "--tokens TOKENS", "--dists DISTS", "--kv-heads",
                 "--head-dim", "--bwd", "--loop", "--out OUT"):
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
])
def test_bad_arguments_exit_2(args, want):
    p = _run_script("bench_varlen_gpu.py", *args)
    assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_defaults():
    a = bv.parse_args([])
    assert (a.tokens, a.dists, a.heads, a.kv_heads, a.head_dim) == (["16384", "65536"],
                                                                     ["128", "512", "2048", "corpus"], 16, 16, 128)
    assert not a.bwd and a.loop_max_docs == 512 and a.preset == "gpu-350m"


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


# ---- markdown ------------------------------------------------------------------------------------


def _rows(bwd=False):
    args = bv.parse_args(["--bwd"] if bwd else [])
    ok = bv.new_row(16384, "512", bv.fixed_lengths(16384, 512), args)
    ok.update(single=500.0, single_ms=0.5, loop=100.0, loop_ms=2.5, dense=540.0, dense_ms=0.47, sdpa_varlen=400.0,
              sdpa_varlen_ms=0.62, cudnn_dense=450.0, cudnn_dense_ms=0.55, sdpa_backend="FLASH_ATTENTION",
              single_err=0.0213, single_eq_loop=True)
    if bwd:
        ok.update(single_bwd=300.0, single_bwd_ms=2.0, single_step_ms=2.5, dense_bwd=350.0, dense_bwd_ms=1.7,
                  dense_step_ms=2.2)
    bad = bv.new_row(65536, "128", bv.fixed_lengths(65536, 128), args)
    bad.update(single=200.0, single_ms=1.0, dense=400.0, dense_ms=0.5)
    bad["errors"]["sdpa_varlen"] = "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    bad["skipped"]["loop"] = "1024 documents > --loop-max-docs 512 (--loop forces it)"
    missing = bv.new_row(16384, "corpus", [], args)
    missing["errors"]["corpus"] = "no prepared corpus at data/x"
    return [ok, bad, missing], dict(INFO, args=vars(args))


def test_markdown_ratios_and_na():
    rows, info = _rows()
    md = bv.markdown(rows, info)
    assert "None" not in md and bv.HEAD in md and "single / dense | single / SDPA varlen" in md
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1 and len(table) == 5, md
    assert table[2] == ("| 16384 | fixed 512 | 32 | 512 / 512 | 500 (0.500 ms) | 100 (2.500 ms) | 540 (0.470 ms) | "
                        "400 (0.620 ms) | 450 (0.550 ms) | 0.93 | 1.25 | 0.0213 | yes |")
    assert table[3].startswith("| 65536 | fixed 128 | 512 | 128 / 128 | 200 (1.000 ms) | skipped | 400 (0.500 ms) "
                               "| n/a | n/a | 0.50 | n/a | n/a | n/a |")
    assert table[4].startswith("| 16384 | corpus | 0 | n/a |") and table[4].count("n/a") == 10
    assert "backend FLASH_ATTENTION" in md
    assert "- T=65536, 128, SDPA BF16 varlen: OutOfMemoryError: CUDA out of memory." in md
    assert "- T=65536, 128, fp8 per-seq loop: skipped: 1024 documents > --loop-max-docs 512" in md
    assert "- T=16384, corpus, corpus: no prepared corpus at data/x" in md
    assert "single / dense >= 0.9 at mean length >= 512 in 1 of 1 rows; single faster than SDPA BF16 varlen " \
           "in 1 of 1 rows" in md
    assert "Backward" not in md


def test_markdown_backward_table():
    rows, info = _rows(bwd=True)
    md = bv.markdown(rows, info)
    assert "Backward (= fwd+bwd step minus forward; single: fp8attn::bwd_varlen)." in md
    bwd = [ln for ln in md.splitlines() if ln.startswith("| 16384 | fixed 512")][1]
    assert bwd == ("| 16384 | fixed 512 | 32 | 512 / 512 | 300 (2.000 ms) | 350 (1.700 ms) | n/a | 0.86 | n/a | "
                   "2.500 / 2.200 / n/a |")


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
    monkeypatch.setattr(bv, "env_info", lambda: dict(INFO))

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
    md = (out / "bench_varlen_gpu.md").read_text()
    assert "- T=4096, 128, case: OutOfMemoryError" in md and "- T=4096, corpus, corpus: no prepared corpus" in md
