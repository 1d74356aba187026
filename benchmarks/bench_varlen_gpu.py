"""GPU benchmark: packed variable-length batches, causal within each document (issue 19, item 4):
fp8attn's single-launch varlen path, its per-sequence loop, a dense batch of the same tokens and
torch SDPA BF16, on one GPU in one run.

    PYTHONPATH=python python3 benchmarks/bench_varlen_gpu.py [--tokens 16384,65536]
        [--dists 128,512,2048,corpus] [--kv-heads 16] [--head-dim 128] [--bwd] [--out DIR]

What is measured, per (T total tokens, document-length distribution):
  * documents: fixed length L (T // L documents, a shorter last one if L does not divide T), or
    corpus: the lengths the trainer's --packed mode sees on its corpus (fp8attn.train.data at
    --preset's vocab and cap): rows of the preset's seq_len drawn as the trainer draws them
    (TokenStream.random_batch, numpy default_rng(--seed)), cut by document_segments (an
    <|endoftext|> ends a document, a row end cuts one), rows until T tokens, the last one cut.
    The device has no network: the prepared corpus must be on disk (--corpus DIR, else
    prepare()'s directory under --data-dir); without it the corpus rows are n/a, saying how to
    make and carry it.
  * inputs: fresh standard-normal BF16 q [T, H, d], k / v [T, H_kv, d], int32 cu_seqlens.
  * time: timing.time_ms, the median of --iters timed calls (CUDA events, a sync after each)
    after --warmup untimed ones; the calls as a user makes them (checks, quantization, host
    overhead included).
  * columns: single = fp8attn.varlen_attention(q, k, v, cu, cu, causal=True, scaling="tile");
    loop = the same with FP8ATTN_VARLEN_LOOP=1 (one op call per document from the host),
    skipped above --loop-max-docs documents unless --loop; dense = fp8attn.attention(causal=True,
    scaling="tile") on [T // Lm, H, Lm, d], Lm = round(T / documents) (the issue's reference);
    SDPA varlen = torch SDPA BF16 on nested jagged views of the packed tensors
    (torch.nested.nested_tensor_from_jagged, made in the timed call, is_causal=True; the backend
    torch picks, named where its selector tells); cuDNN dense = SDPA BF16 with
    SDPBackend.CUDNN_ATTENTION on the dense batch (orientation). Checks: single's O against SDPA
    varlen's (relative Frobenius error) and against the loop's (bit-identical).
  * FLOPs count the attended pairs: forward 4 * H * d * sum over documents of L * (L + 1) / 2
    (causal within each document, the diagonal included), backward 2.5x. bench_gpu.py's
    "4*B*H*S*S*d halved for causal" counts S * S / 2 pairs per sequence: the same up to the
    diagonal's S / 2 (factor (S + 1) / S, 0.8% at S = 128). The dense columns use the same
    formula on their own lengths: ratios are of TFLOP/s, like with like.
  * ratios: single / dense (issue target >= 0.9 at mean document length >= 512) and
    single / SDPA varlen (target > 1: faster).
  * --bwd: forward + backward (torch.autograd.grad, fresh randn dO) of single, dense and SDPA
    varlen; backward = that minus the forward (single: fp8attn::bwd_varlen, one launch per
    kernel).
A failing cell (out of memory, an unsupported case: RuntimeError, ValueError) is n/a with its
reason under the table; the run goes on. Writes bench_varlen_gpu.json (everything, with GPU,
driver, torch, CUDA, cuDNN versions, date) and bench_varlen_gpu.md under --out; prints the
markdown last. Exit status: 0; 1 without a CUDA GPU (nothing written); 2 on a bad argument.
"""
import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# NOTE: bench_gpu first: it puts an in-tree fp8attn build ahead of the installed package (as conftest.py).
from bench_gpu import env_info, tflops, write_results
from cudnn_fp8 import one_line, rel_fro
from timing import int_at_least, time_ms
import fp8attn
from fp8attn.train.compare import DATA_MAX_MB
from fp8attn.train.data import DEB_PACKAGE, PreparedData, TokenStream, prepare
from fp8attn.train.model import PRESETS, document_segments

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # NOTE: the CPU tests run bench_case on "cpu" (the fp8attn CPU reference; SDPA's cells n/a)
COLS = ("single", "loop", "dense", "sdpa_varlen", "cudnn_dense")
BWD_COLS = ("single", "dense", "sdpa_varlen")
LABEL = {"single": "fp8 single launch", "loop": "fp8 per-seq loop", "dense": "fp8 dense ref",
         "sdpa_varlen": "SDPA BF16 varlen", "cudnn_dense": "cuDNN BF16 dense"}


# ---- document lengths and FLOPs (pure, CPU-tested) -------------------------------------


def fixed_lengths(total: int, length: int) -> list:
    """total // length documents of `length` tokens, plus the remainder as a shorter last one."""
    return [length] * (total // length) + ([total % length] if total % length else [])


def corpus_lengths(stream: TokenStream, total: int, seed: int, eot_id: int = 0) -> list:
    """Document lengths of packed trainer rows summing to `total`: ceil(total / seq_len) rows drawn
    by TokenStream.random_batch (numpy default_rng(seed)), cut by document_segments; the last cut."""
    rows = -(-total // stream.seq_len)
    x, _ = stream.random_batch(np.random.default_rng(seed), rows)
    lengths = document_segments(x, eot_id)[0].diff().tolist()
    last = int(np.searchsorted(np.cumsum(lengths), total))  # the document holding token total - 1
    return lengths[:last] + [total - sum(lengths[:last])]


def attended_pairs(lengths) -> int:
    """(query, key) pairs a causal mask inside each document attends: sum of L * (L + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in lengths)


def fwd_flops(lengths, heads: int, head_dim: int) -> float:
    """Forward FLOPs: 4 * H * d per attended pair (QK^T and PV, 2 FLOPs per multiply-add)."""
    return 4.0 * heads * head_dim * attended_pairs(lengths)


def corpus_setup(args):
    """(vocab, corpus cap MB, row length, default corpus directory) of the preset, as the trainer's
    compare.py prepares it (the directory name is fp8attn.train.data.prepare's for linux-doc)."""
    vocab, max_mb = PRESETS[args.preset]["model"]["vocab_size"], DATA_MAX_MB.get(args.preset, 32.0)
    seq_len = args.corpus_seq_len or PRESETS[args.preset]["train"]["seq_len"]
    return vocab, max_mb, seq_len, Path(args.data_dir) / f"{DEB_PACKAGE}-bpe{vocab}-{max_mb:g}mb"


def load_corpus(args):
    """(TokenStream of train.bin at the row length, info dict), or (None, reason): never a download."""
    vocab, max_mb, seq_len, default = corpus_setup(args)
    text_dir = args.text_dir or os.environ.get("FP8ATTN_TEXT_DIR")
    path = Path(args.corpus) if args.corpus else default
    cache = Path(args.data_dir) / "cache"
    if (path / "meta.json").exists():
        data = PreparedData(path)
    elif not args.corpus and (text_dir or (cache / DEB_PACKAGE / ".extracted").exists()
                              or any(cache.glob(f"{DEB_PACKAGE}_*.deb"))):
        data = prepare(args.data_dir, vocab, max_mb, text_dir=text_dir)  # offline: the sources are here
    else:
        return None, (f"no prepared corpus at {path} (the device has no network): run `python -m "
                      f"fp8attn.train.data --data-dir data --vocab-size {vocab} --max-mb {max_mb:g}` on a "
                      f"machine with network and carry data/{default.name} "
                      "under data/ (or pass --corpus DIR / --text-dir DIR)")
    info = {k: data.meta.get(k) for k in ("source", "vocab_size", "train_docs", "train_tokens")}
    info.update(dir=str(data.root), seq_len=seq_len, eot_id=data.meta.get("eot_id", 0), preset=args.preset)
    return TokenStream(data.train_path, seq_len), info


# ---- GPU measurements ------------------------------------------------------------------


def _sdpa(q, k, v):
    """Causal torch SDPA, enable_gqa only where the heads differ (not every backend takes the flag)."""
    gqa = {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)


def _nested(tensors, cu64, max_len):
    """Nested jagged views [B, H, j, d] of packed [T, H, d] tensors (max_seqlen given: no host sync)."""
    return [torch.nested.nested_tensor_from_jagged(x, cu64, min_seqlen=1, max_seqlen=max_len).transpose(1, 2)
            for x in tensors]


def sdpa_varlen(q, k, v, cu64, max_len):
    """SDPA BF16 on nested jagged views of packed q, k, v; O packed [T, H, d]."""
    return _sdpa(*_nested((q, k, v), cu64, max_len)).transpose(1, 2).values()


def sdpa_varlen_backend(q, k, v, cu64, max_len) -> str:
    """The SDPA backend torch's jagged selector picks for these inputs (a private helper), else 'torch picks'."""
    try:
        from torch.nested._internal.sdpa import _select_sdp_backend  # noqa: PLC0415
        return _select_sdp_backend(*_nested((q, k, v), cu64, max_len), None, 0.0, True, q.shape[1] != k.shape[1]).name
    except Exception:  # noqa: BLE001  (private API: its absence is not a failure)
        return "torch picks"


def measure(r, col, fn, inputs, flops, args, bwd=False) -> None:
    """r[col] / r[col + '_ms']: fn(*inputs) timed (inputs not requiring grad); with bwd also the
    forward + backward step on copies requiring grad and the backward derived from it. A failure
    leaves n/a and r['errors'][col] = its reason."""
    try:
        ms = time_ms(lambda: fn(*inputs), args.warmup, args.iters)
        r[f"{col}_ms"], r[col] = ms, tflops(flops, ms)
        if bwd:
            leaves = [x.detach().requires_grad_() for x in inputs]
            dout = torch.randn_like(fn(*inputs))
            step = time_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, dout), args.warmup, args.iters)
            r[f"{col}_step_ms"] = step
            r[f"{col}_bwd_ms"] = step - ms if step > ms else None
            r[f"{col}_bwd"] = tflops(2.5 * flops, r[f"{col}_bwd_ms"])
    except (RuntimeError, ValueError, NotImplementedError) as e:  # incl. torch.cuda.OutOfMemoryError
        r["errors"][col] = one_line(e, 200)
        print(f"  {col}: n/a ({r['errors'][col]})")


def bench_case(r, lengths, args) -> None:
    """Fills row r for one (T, distribution) from its document lengths."""
    h, hkv, d, t = args.heads, args.kv_heads, args.head_dim, sum(lengths)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed * 1000003 + t + len(lengths))
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    qkv = (rnd(t, h, d), rnd(t, hkv, d), rnd(t, hkv, d))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=DEVICE)
    flops = fwd_flops(lengths, h, d)

    def single(q, k, v):
        return fp8attn.varlen_attention(q, k, v, cu, cu, causal=True, scaling="tile")
    measure(r, "single", single, qkv, flops, args, args.bwd)
    if args.loop or len(lengths) <= args.loop_max_docs:
        with mock.patch.dict(os.environ, {"FP8ATTN_VARLEN_LOOP": "1"}):  # read at each call; restored after
            measure(r, "loop", single, qkv, flops, args)
            o_loop = single(*qkv) if r["loop"] is not None else None
        if o_loop is not None and r["single"] is not None:
            r["single_eq_loop"] = bool(torch.equal(single(*qkv), o_loop))  # the module docstring: bit-identical
    else:
        r["skipped"]["loop"] = f"{len(lengths)} documents > --loop-max-docs {args.loop_max_docs} (--loop forces it)"
    if not args.no_sdpa:
        cu64, mx = cu.long(), max(lengths)
        r["sdpa_backend"] = sdpa_varlen_backend(*qkv, cu64, mx)
        measure(r, "sdpa_varlen", lambda q, k, v: sdpa_varlen(q, k, v, cu64, mx), qkv, flops, args, args.bwd)
        if r["single"] is not None and r["sdpa_varlen"] is not None:
            r["single_err"] = rel_fro(single(*qkv), sdpa_varlen(*qkv, cu64, mx))
    del qkv
    b, lm = r["dense_B"], r["dense_L"]
    dense, dflops = (rnd(b, h, lm, d), rnd(b, hkv, lm, d), rnd(b, hkv, lm, d)), fwd_flops([lm] * b, h, d)
    measure(r, "dense", lambda q, k, v: fp8attn.attention(q, k, v, causal=True, scaling="tile"), dense, dflops,
            args, args.bwd)
    if not args.no_sdpa:
        def cudnn_dense(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return _sdpa(q, k, v)
        measure(r, "cudnn_dense", cudnn_dense, dense, dflops, args)


def new_row(t, dist, lengths, args) -> dict:
    """A row of one case with every number n/a (None); the dense batch's shape; lengths' statistics."""
    r = {"T": t, "dist": dist, "docs": len(lengths), "H": args.heads, "H_kv": args.kv_heads, "d": args.head_dim,
         "errors": {}, "skipped": {}, "sdpa_backend": None, "single_eq_loop": None, "single_err": None}
    if lengths:
        lm = max(1, round(t / len(lengths)))
        r.update(mean_len=t / len(lengths), max_len=max(lengths), min_len=min(lengths),
                 median_len=float(np.median(lengths)), pairs=attended_pairs(lengths),
                 fwd_flops=fwd_flops(lengths, args.heads, args.head_dim), dense_B=t // lm, dense_L=lm,
                 dense_pairs=attended_pairs([lm] * (t // lm)))
    for c in COLS:
        r[c] = r[f"{c}_ms"] = None
    for c in BWD_COLS if args.bwd else ():
        r[f"{c}_step_ms"] = r[f"{c}_bwd_ms"] = r[f"{c}_bwd"] = None
    return r


# ---- output ------------------------------------------------------------------------------


def _cell(r, col, suffix=""):
    x, ms = r.get(f"{col}{suffix}"), r.get(f"{col}{suffix}_ms")
    if x is None:
        return "skipped" if col in r.get("skipped", {}) else "n/a"
    return f"{x:.0f} ({ms:.3f} ms)"


def _ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def _case(r):
    dist = r["dist"] if r["dist"] == "corpus" else f"fixed {r['dist']}"
    return f"| {r['T']} | {dist} | {r['docs']} | " + (
        f"{r['mean_len']:.0f} / {r['max_len']} |" if r.get("mean_len") is not None else "n/a |")


HEAD = ("| T | documents | count | mean / max len | " + " | ".join(LABEL[c] + " fwd" for c in COLS)
        + " | single / dense | single / SDPA varlen | single O err vs SDPA | single = loop |")
BWD_HEAD = ("| T | documents | count | mean / max len | " + " | ".join(LABEL[c] + " bwd" for c in BWD_COLS)
            + " | single / dense bwd | single / SDPA varlen bwd | fwd+bwd ms single / dense / SDPA |")


def markdown(rows, info) -> str:
    """The bench_varlen_gpu.md text: caption, forward table (TFLOP/s (ms), ratios), the backward table
    with --bwd, the issue targets' summary, and the n/a / skipped reasons."""
    a = info["args"]
    lines = [f"Packed causal attention (per document), H = {a['heads']}, H_kv = {a['kv_heads']}, d = "
             f"{a['head_dim']}, BF16 inputs; TFLOP/s (median ms) on {info['gpu']} (driver {info['driver']}, "
             f"torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}), {info['date']}. FLOPs: 4 * H * d "
             "* sum L (L + 1) / 2 (attended pairs, diagonal included), backward 2.5x; dense ref = fp8attn on "
             "[T // Lm, H, Lm, d], Lm = mean length; SDPA varlen = nested jagged tensors, backend "
             f"{', '.join(sorted({r['sdpa_backend'] for r in rows if r.get('sdpa_backend')})) or 'n/a'}.",
             "", HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    for r in rows:
        err, eq = r.get("single_err"), r.get("single_eq_loop")
        lines.append(_case(r) + " " + " | ".join(_cell(r, c) for c in COLS) + f" | "
                     f"{_ratio(r.get('single'), r.get('dense'))} | {_ratio(r.get('single'), r.get('sdpa_varlen'))} | "
                     f"{'n/a' if err is None else f'{err:.4f}'} | {'n/a' if eq is None else 'yes' if eq else 'NO'} |")
    if a.get("bwd"):
        lines += ["", "Backward (= fwd+bwd step minus forward; single: fp8attn::bwd_varlen).",
                  "", BWD_HEAD, "|" + "---|" * (BWD_HEAD.count("|") - 1)]
        for r in rows:
            steps = " / ".join("n/a" if r.get(f"{c}_step_ms") is None else f"{r[f'{c}_step_ms']:.3f}"
                               for c in BWD_COLS)
            lines.append(_case(r) + " " + " | ".join(_cell(r, c, "_bwd") for c in BWD_COLS) + f" | "
                         f"{_ratio(r.get('single_bwd'), r.get('dense_bwd'))} | "
                         f"{_ratio(r.get('single_bwd'), r.get('sdpa_varlen_bwd'))} | {steps} |")
    t1 = [r for r in rows if (r.get("mean_len") or 0) >= 512 and r.get("single") and r.get("dense")]
    t2 = [r for r in rows if r.get("single") and r.get("sdpa_varlen")]
    lines += ["", f"Issue 19 targets: single / dense >= 0.9 at mean length >= 512 in "
              f"{sum(r['single'] >= 0.9 * r['dense'] for r in t1)} of {len(t1)} rows; single faster than SDPA "
              f"BF16 varlen in {sum(r['single'] > r['sdpa_varlen'] for r in t2)} of {len(t2)} rows."]
    notes = [f"- T={r['T']}, {r['dist']}, {LABEL.get(c, c)}: {kind}{why}" for r in rows
             for kind, d in (("", r.get("errors", {})), ("skipped: ", r.get("skipped", {}))) for c, why in d.items()]
    if notes:
        lines += ["", "n/a and skipped cells (the run went on):", ""] + notes
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------


def _list(ok, what):
    """argparse type: a comma-separated list whose items all pass ok(item)."""
    def parse(text):
        out = [x.strip() for x in text.split(",")]
        if not all(ok(x) for x in out):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return out
    return parse


_POS = lambda x: x.isdigit() and int(x) > 0  # noqa: E731


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_varlen_gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=_list(_POS, "positive integers"), default=["16384", "65536"],
                    help="total tokens T per packed batch (default 16384,65536)")
    ap.add_argument("--dists", type=_list(lambda x: x == "corpus" or _POS(x), "document lengths > 0 or corpus"),
                    default=["128", "512", "2048", "corpus"],
                    help="document lengths: fixed lengths and/or corpus (default 128,512,2048,corpus)")
    ap.add_argument("--heads", type=int_at_least(1), default=16, help="query heads H (default 16)")
    ap.add_argument("--kv-heads", type=int_at_least(1), default=16, help="key / value heads, divides H (default 16)")
    ap.add_argument("--head-dim", type=int_at_least(1), default=128, help="head dim d (default 128)")
    ap.add_argument("--bwd", action="store_true", help="also forward + backward of single, dense, SDPA varlen")
    ap.add_argument("--loop", action="store_true", help="time the per-sequence loop at any number of documents")
    ap.add_argument("--loop-max-docs", type=int_at_least(0), default=512,
                    help="skip the per-sequence loop above this many documents (default 512)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA BF16 columns")
    ap.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before each number (default 3)")
    ap.add_argument("--iters", type=int_at_least(1), default=10,
                    help="timed calls per number; the number is their median CUDA-event time (default 10)")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="corpus row draw and input seed (default 0)")
    ap.add_argument("--preset", default="gpu-350m", choices=sorted(PRESETS),
                    help="trainer preset of the corpus: vocab, corpus cap, row length seq_len (default gpu-350m)")
    ap.add_argument("--corpus-seq-len", type=int_at_least(2), default=None,
                    help="trainer row length (default the preset's seq_len)")
    ap.add_argument("--data-dir", default=str(ROOT / "data"), help="fp8attn.train.data's --data-dir (default <repo>/data)")
    ap.add_argument("--corpus", default=None, help="a prepared corpus directory (meta.json, train.bin)")
    ap.add_argument("--text-dir", default=None, help="prepare the corpus from these text files (offline)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                    help="directory for bench_varlen_gpu.json and .md (created; default $OUT, else ./bench_out)")
    return ap


def parse_args(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        ap.error(f"argument --kv-heads: {args.kv_heads} does not divide --heads {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():  # NOTE: before creating --out: a CPU-only run writes nothing
        print("bench_varlen_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written",
              file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    info.update(args=vars(args),
                knobs={n: os.environ.get(n) for n in ("FP8ATTN_VARLEN_LOOP", "FP8ATTN_TILE_FWD", "FP8ATTN_TILE_BWD")})
    stream, corpus = load_corpus(args) if "corpus" in args.dists else (None, None)
    info["corpus"] = corpus if stream is not None or corpus is None else {"unavailable": corpus}
    print("env:", json.dumps(info, default=str))
    rows = []
    for t in map(int, args.tokens):
        for dist in args.dists:
            lengths = (fixed_lengths(t, int(dist)) if dist != "corpus"
                       else [] if stream is None else corpus_lengths(stream, t, args.seed, corpus["eot_id"]))
            r = new_row(t, dist, lengths, args)
            print(f"[T={t}, {dist}: {len(lengths)} documents]")
            try:
                if stream is None and dist == "corpus":
                    r["errors"]["corpus"] = corpus
                else:
                    bench_case(r, lengths, args)
            except (RuntimeError, ValueError) as e:  # e.g. out of memory making the inputs
                r["errors"]["case"] = one_line(e, 200)
            print("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
            rows.append(r)
            torch.cuda.empty_cache()
    write_results(args.out, "bench_varlen_gpu", info, rows, markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
