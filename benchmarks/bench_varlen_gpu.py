"""GPU benchmark: packed variable-length batches, causal within each document (issue 19, item 4):
fp8attn's single-launch varlen path, its per-sequence loop, a dense batch of the same tokens, torch
SDPA BF16 and cuDNN BF16's ragged (THD) attention through the cuDNN frontend, on one GPU in one run.

    PYTHONPATH=python python3 benchmarks/bench_varlen_gpu.py [--tokens 16384,65536]
        [--dists 128,512,2048,corpus] [--kv-heads 16] [--head-dim 128] [--bwd] [--out DIR]

(the cuDNN varlen column needs the cuDNN frontend importable: on the device, after
scripts/device_common.sh's install_cudnn_frontend, keep its PYTHONPATH entry:
PYTHONPATH=python:$PYTHONPATH.)

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
    overhead included; cuDNN varlen: its graphs' execute, below).
  * columns: single = fp8attn.varlen_attention(q, k, v, cu, cu, causal=True, scaling="tile");
    loop = the same with FP8ATTN_VARLEN_LOOP=1 (one op call per document from the host),
    skipped above --loop-max-docs documents unless --loop; dense = fp8attn.attention(causal=True,
    scaling="tile") on [T // Lm, H, Lm, d], Lm = round(T / documents) (the issue's reference);
    SDPA varlen = torch SDPA BF16 on nested jagged views of the packed tensors
    (torch.nested.nested_tensor_from_jagged, made in the timed call, is_causal=True; the backend
    torch picks, named where its selector tells); cuDNN dense = SDPA BF16 with
    SDPBackend.CUDNN_ATTENTION on the dense batch (orientation); cuDNN varlen = cuDNN BF16 SDPA on
    the packed tensors themselves, the baseline a user compares against: the cuDNN frontend's
    pygraph.sdpa (generate_stats=True: the training forward) and, with --bwd, sdpa_backward (pip
    nvidia-cudnn-frontend, module cudnn, written against 1.32.0; built once per (T, distribution):
    the lengths are runtime tensors, the graph's S_max = the longest document). The packed [T, H, d]
    tensors are declared as logical [B, H, S_max, d] with their own strides (token H * d, head d)
    and ragged offsets ([B + 1, 1, 1, 1] int64 ELEMENT offsets: cu_seqlens * H * d for Q / O / dO /
    dQ, cu_seqlens * H_kv * d for K / V / dK / dV), seq_len_q = seq_len_kv = the document lengths
    ([B, 1, 1, 1] int32) with use_padding_mask=True, causal as diagonal_alignment TOP_LEFT and
    diagonal_band_right_bound 0 (per document; equal q / kv lengths: the same as bottom-right), the
    softmax stats padded [B, H, S_max, 1] FP32, the backward's max_total_seq_len_q / kv = T rounded
    up to 64. Timed: the graphs' execute only (outputs preallocated; lengths and offsets made once
    per batch outside the timed call, as a training step makes them once for all its layers). n/a
    with the reason when the frontend is missing or no plan builds (--no-cudnn-varlen skips it).
    Checks: single's O against SDPA varlen's and cuDNN varlen's (relative Frobenius error; FP8
    against BF16: a few 1e-2 expected) and against the loop's (bit-identical).
  * cuDNN varlen's self-check, before its numbers (a failing check makes the cells "bad", no
    number): on T = 2000 tokens of the run's document lengths capped at 512 (the last one cut:
    >= 4 documents of unequal lengths), fresh standard-normal inputs, its O (with --bwd also dQ,
    dK, dV) against float32 torch SDPA causal computed document by document (math backend, one call
    per document): relative Frobenius error < --tol (default 0.02).
  * FLOPs count the attended pairs: forward 4 * H * d * sum over documents of L * (L + 1) / 2
    (causal within each document, the diagonal included), backward 2.5x. bench_gpu.py's
    "4*B*H*S*S*d halved for causal" counts S * S / 2 pairs per sequence: the same up to the
    diagonal's S / 2 (factor (S + 1) / S, 0.8% at S = 128). The dense columns use the same
    formula on their own lengths: ratios are of TFLOP/s, like with like.
  * ratios: single / dense (issue target >= 0.9 at mean document length >= 512), single / SDPA
    varlen (target > 1: faster) and single / cuDNN varlen.
  * --bwd: forward + backward (torch.autograd.grad, fresh randn dO) of single, dense and SDPA
    varlen, and cuDNN varlen's forward then backward graph; backward = that minus the forward
    (single: fp8attn::bwd_varlen, one launch per kernel).
A failing cell (out of memory, an unsupported case: RuntimeError, ValueError; cuDNN varlen: any
frontend error) is n/a with its reason under the table; the run goes on. Writes
bench_varlen_gpu.json (everything, with GPU, driver, torch, CUDA, cuDNN, cuDNN frontend versions,
date) and bench_varlen_gpu.md under --out; prints the markdown last. Exit status: 0; 1 without a
CUDA GPU (nothing written); 2 on a bad argument.
"""
import argparse
import json
import math
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
from cudnn_fp8 import bound_fwd_bwd, frontend, one_line, rel_fro
from timing import int_at_least, positive_float, time_ms
import fp8attn
from fp8attn import cudnn_fp8_attention as cfa
from fp8attn.train.compare import DATA_MAX_MB
from fp8attn.train.data import DEB_PACKAGE, PreparedData, TokenStream, prepare
from fp8attn.train.model import PRESETS, document_segments

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # NOTE: the CPU tests run bench_case on "cpu" (the fp8attn CPU reference; SDPA's cells n/a)
COLS = ("single", "loop", "dense", "sdpa_varlen", "cudnn_varlen", "cudnn_dense")
BWD_COLS = ("single", "dense", "sdpa_varlen", "cudnn_varlen")
LABEL = {"single": "fp8 single launch", "loop": "fp8 per-seq loop", "dense": "fp8 dense ref",
         "sdpa_varlen": "SDPA BF16 varlen", "cudnn_varlen": "cuDNN BF16 varlen", "cudnn_dense": "cuDNN BF16 dense"}
CHECK_TOKENS = 2000   # the cuDNN varlen self-check's T (not a multiple of 64 or 128: a shorter last document)
CHECK_MAX_LEN = 512   # its documents: the run's lengths capped at this (>= 4 documents)
GRADS = ("dQ", "dK", "dV")


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


# ---- cuDNN BF16 varlen: the frontend's ragged (THD) graphs ------------------------------


def cu_seqlens(lengths, device=None) -> torch.Tensor:
    """int32 [B + 1] prefix sums of the document lengths (cu_seqlens), on `device` (default DEVICE)."""
    return torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device or DEVICE)


def check_lengths(lengths, total: int = CHECK_TOKENS, cap: int = CHECK_MAX_LEN) -> list:
    """The cuDNN self-check's document lengths: the run's lengths in order (cycled if they sum to less),
    each capped at `cap`, until `total` tokens, the last one cut."""
    out, used, i = [], 0, 0
    while used < total:
        n = min(lengths[i % len(lengths)], cap, total - used)
        out.append(n)
        used, i = used + n, i + 1
    return out


def thd_layout(b: int, heads: int, s_max: int, d: int) -> tuple:
    """(dims, strides) the frontend declares for a packed [T, heads, d] tensor: logical
    [B, heads, S_max, d] with the packed tensor's own strides (token heads * d, head d, element 1);
    the batch stride (S_max * heads * d) is never stepped: each sequence starts at its ragged offset."""
    return [b, heads, s_max, d], [s_max * heads * d, d, heads * d, 1]


def ragged_offsets(cu: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The ragged offset tensor of a packed [T, heads, head_dim] tensor: [B + 1, 1, 1, 1] int64,
    sequence b's first ELEMENT cu[b] * heads * head_dim (its token offset times the token stride;
    int64: cuDNN >= 9.6 takes 64-bit offsets)."""
    return (cu.to(torch.int64) * (heads * head_dim)).reshape(-1, 1, 1, 1)


def seq_lens(cu: torch.Tensor) -> torch.Tensor:
    """The per-sequence lengths [B, 1, 1, 1] int32 (seq_len_q = seq_len_kv here) of cu_seqlens."""
    return (cu[1:] - cu[:-1]).to(torch.int32).reshape(-1, 1, 1, 1)


def _round64(n: int) -> int:
    return -(-n // 64) * 64


# the ragged offsets each port reads: q's heads' (H * d elements per token) or k / v's (H_kv * d)
OFFSET_OF = {"q": "q", "o": "q", "dO": "q", "dQ": "q", "k": "kv", "v": "kv", "dK": "kv", "dV": "kv"}


def declare_ragged(cudnn, b: int, h: int, hkv: int, s_max: int, d: int, total: int, bwd: bool = False,
                   handle=None) -> tuple:
    """The cuDNN frontend graph (declared, not built) of causal BF16 SDPA on packed q / o [T, h, d],
    k / v [T, hkv, d] (T = total tokens, B documents of at most s_max): the forward (sdpa, O and
    the softmax stats for the backward: generate_stats=True) or, bwd, the backward (sdpa_backward).
    Every packed port is declared with thd_layout and a ragged offset tensor of its own ([B + 1, 1, 1,
    1] int64, bound to ragged_offsets of q's or k / v's heads: OFFSET_OF; o and dO share one, as in
    the frontend's tests); seq_len_q / seq_len_kv [B, 1, 1, 1] int32 with use_padding_mask=True;
    causal = diagonal_alignment TOP_LEFT, diagonal_band_right_bound 0 (per sequence: with equal q / kv
    lengths the same mask as BOTTOM_RIGHT); the stats padded [B, h, s_max, 1] FP32, not ragged (the
    frontend's torch op keeps the backward's stats padded too). The backward's
    max_total_seq_len_q / kv = T rounded up to 64 (sizes its ragged dQ / dK / dV accumulators, as
    the frontend's tests round it). Returns (graph, {port name: graph tensor})."""
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    i32, i64 = cudnn.data_type.INT32, cudnn.data_type.INT64
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32,
                      **({} if handle is None else {"handle": handle}))
    qd, qs = thd_layout(b, h, s_max, d)
    kd, ks = thd_layout(b, hkv, s_max, d)
    sd, ss = [b, h, s_max, 1], [h * s_max, s_max, 1, 1]
    lay = {n: (qd, qs) for n in ("q", "o", "dO", "dQ")}
    lay.update({n: (kd, ks) for n in ("k", "v", "dK", "dV")})

    def index(name, n, dt):
        return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt)
    t = {"seq_q": index("seq_len_q", b, i32), "seq_kv": index("seq_len_kv", b, i32)}
    ports = ("q", "k", "v", "o", "dO", "dQ", "dK", "dV") if bwd else ("q", "k", "v", "o")
    offs = {n: index(f"ragged_{n}", b + 1, i64) for n in ports if n != "dO"}
    offs["dO"] = offs.get("o")
    t.update({f"off_{n}": x for n, x in offs.items() if n != "dO"})
    for n in ("q", "k", "v") + (("o", "dO") if bwd else ()):
        t[n] = g.tensor(name=n, dim=lay[n][0], stride=lay[n][1], data_type=bf16)
        t[n].set_ragged_offset(offs[n])
    mask = dict(use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
                diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    tau = 1.0 / math.sqrt(d)
    if not bwd:
        o, stats = g.sdpa(q=t["q"], k=t["k"], v=t["v"], attn_scale=tau, generate_stats=True, name="sdpa_varlen",
                          **mask)
        outs = {"o": o}
        stats.set_output(True).set_dim(sd).set_stride(ss).set_data_type(f32)
        t["stats"] = stats
    else:
        t["stats"] = g.tensor(name="stats", dim=sd, stride=ss, data_type=f32)
        dq, dk, dv = g.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                                     attn_scale=tau, max_total_seq_len_q=_round64(total),
                                     max_total_seq_len_kv=_round64(total), name="sdpa_varlen_backward", **mask)
        outs = {"dQ": dq, "dK": dk, "dV": dv}
    for n, x in outs.items():
        x.set_output(True).set_dim(lay[n][0]).set_stride(lay[n][1]).set_data_type(bf16)
        x.set_ragged_offset(offs[n])
        t[n] = x
    return g, t


def reference_varlen(q, k, v, cu, dout=None) -> tuple:
    """The self-check's reference: float32 causal attention document by document (torch SDPA, math
    backend, one call per document; K / V heads repeated for GQA) on packed q [T, H, d], k / v
    [T, H_kv, d] (every token in a document: cu[-1] == T). (O packed [T, H, d], (dQ, dK, dV) packed
    for dout [T, H, d], else None)."""
    rep = q.shape[1] // k.shape[1]
    leaves = [x.detach().float().requires_grad_(dout is not None) for x in (q, k, v)]
    bounds = [int(x) for x in cu.tolist()]
    if bounds[-1] != q.shape[0]:
        raise ValueError(f"reference_varlen: cu_seqlens ends at {bounds[-1]}, not at T = {q.shape[0]}")
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for a, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (x[a:e].transpose(0, 1).unsqueeze(0) for x in leaves)
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
    o = torch.cat(outs)
    grads = torch.autograd.grad(o, leaves, dout.float()) if dout is not None else None
    return o.detach(), grads


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


class Column:
    """fwd() -> O and step() -> (dQ, dK, dV) (forward then backward) as the timed calls."""

    def __init__(self, fwd, step=None):
        self.fwd, self.step = fwd, step


_CUDNN_GRAPHS = {}


def cudnn_varlen_graphs(cudnn, b, h, hkv, s_max, d, total, bwd) -> dict:
    """The built forward (and with bwd backward) ragged graphs, cached per (B, H, H_kv, S_max, d, T,
    bwd): once per (T, distribution), the lengths being runtime tensors. {'fwd': _Built, 'bwd': ...}."""
    key = (b, h, hkv, s_max, d, total, bwd)
    if key not in _CUDNN_GRAPHS:
        handle = cfa._handle()
        out = {"fwd": cfa._finish(cudnn, *declare_ragged(cudnn, b, h, hkv, s_max, d, total, False, handle)),
               "bwd": None}
        if bwd:
            out["bwd"] = cfa._finish(cudnn, *declare_ragged(cudnn, b, h, hkv, s_max, d, total, True, handle))
        _CUDNN_GRAPHS[key] = out
    return _CUDNN_GRAPHS[key]


def _pack(built, ports: dict, offs: dict) -> dict:
    """The variant pack of a built graph: each port's tensor (ports), each ragged offset port
    (off_<port>) the offsets of its port's heads (offs['q'] or offs['kv']: OFFSET_OF)."""
    return {x: offs[OFFSET_OF[n[4:]]] if n.startswith("off_") else ports[n] for n, x in built.t.items()}


def cudnn_varlen_column(q, k, v, cu, max_len: int, dout=None) -> Column:
    """cuDNN BF16 varlen bound to packed q [T, H, d], k / v [T, H_kv, d] and cu_seqlens (every token in
    a document): the lengths and ragged offsets made here, once per batch (not in the timed calls),
    outputs and workspaces preallocated; fwd() executes the forward graph, step() (dout given) the
    forward and then the backward graph."""
    cudnn = frontend()
    t, h, d = q.shape
    hkv, b = k.shape[1], cu.numel() - 1
    gr = cudnn_varlen_graphs(cudnn, b, h, hkv, max_len, d, t, dout is not None)
    lens = seq_lens(cu)
    o = torch.empty_like(q)
    stats = torch.empty(b, h, max_len, 1, device=q.device, dtype=torch.float32)
    ports = {"q": q, "k": k, "v": v, "o": o, "stats": stats, "seq_q": lens, "seq_kv": lens}
    offs = {"q": ragged_offsets(cu, h, d), "kv": ragged_offsets(cu, hkv, d)}
    fb, bb = gr["fwd"], gr["bwd"]
    if dout is None:
        return Column(*bound_fwd_bwd(fb, _pack(fb, ports, offs), o))
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    bpack = _pack(bb, dict(ports, dO=dout, dQ=grads[0], dK=grads[1], dV=grads[2]), offs)
    return Column(*bound_fwd_bwd(fb, _pack(fb, ports, offs), o, bb, bpack, grads))


_CHECKS = {}


def cudnn_self_check(lengths, h: int, hkv: int, d: int, bwd: bool, tol: float) -> dict:
    """cuDNN varlen against reference_varlen on the check's lengths (check_lengths: the run's, capped
    at CHECK_MAX_LEN, T = CHECK_TOKENS), fresh standard-normal BF16 inputs: relative Frobenius error of
    O (and with bwd dQ, dK, dV); 'ok' when every one is < tol, else 'bad' and why. Cached per (check
    lengths, H, H_kv, d, bwd, tol). A frontend / build error propagates (the column is n/a)."""
    cl = check_lengths(lengths)
    key = (tuple(cl), h, hkv, d, bwd, tol)
    if key in _CHECKS:
        return _CHECKS[key]
    t = sum(cl)
    gen = torch.Generator(device=DEVICE).manual_seed(20261207 + 7 * t + len(cl))
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, dout = rnd(t, h, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, h, d)
    cu = cu_seqlens(cl)
    c = cudnn_varlen_column(q, k, v, cu, max(cl), dout if bwd else None)
    ref_o, ref_g = reference_varlen(q, k, v, cu, dout if bwd else None)
    outs = {"O": c.fwd().clone()}
    refs = {"O": ref_o}
    if bwd:
        outs.update(zip(GRADS, (x.clone() for x in c.step())))
        refs.update(zip(GRADS, ref_g))
    err = {n: rel_fro(x, refs[n]) for n, x in outs.items()}
    bad = [n for n, e in err.items() if not (e < tol)]  # NOTE: catches NaN
    res = {"T": t, "docs": len(cl), "min_len": min(cl), "max_len": max(cl), "err": err, "tol": tol,
           "status": "bad" if bad else "ok",
           "reason": f"{bad[0]} error {err[bad[0]]:.3g} >= tol {tol:g}" if bad else ""}
    _CHECKS[key] = res
    return res


def measure_column(r, col, c: Column, flops, args) -> None:
    """r[col] / r[col + '_ms'] from c.fwd; with --bwd also the step (c.step) and the backward derived
    from it, as measure() names them."""
    ms = time_ms(c.fwd, args.warmup, args.iters)
    r[f"{col}_ms"], r[col] = ms, tflops(flops, ms)
    if args.bwd:
        step = time_ms(c.step, args.warmup, args.iters)
        r[f"{col}_step_ms"] = step
        r[f"{col}_bwd_ms"] = step - ms if step > ms else None
        r[f"{col}_bwd"] = tflops(2.5 * flops, r[f"{col}_bwd_ms"])


def bench_cudnn_varlen(r, qkv, cu, lengths, flops, args, single=None) -> None:
    """The cuDNN BF16 varlen column of row r: the self-check first ('bad', no number, when it fails),
    then single's O against cuDNN's at the benchmark size (r['single_err_cudnn']) and the timings.
    A frontend / build / run error leaves n/a with its reason; the run goes on."""
    col = "cudnn_varlen"
    try:
        chk = r["cudnn_check"] = cudnn_self_check(lengths, args.heads, args.kv_heads, args.head_dim, args.bwd,
                                                  args.tol)
        if chk["status"] != "ok":
            r["bad"].append(col)
            r["errors"][col] = f"self-check at T={chk['T']} ({chk['docs']} documents): {chk['reason']}"
            print(f"  {col}: bad ({r['errors'][col]})")
            return
        dout = torch.randn_like(qkv[0]) if args.bwd else None
        c = cudnn_varlen_column(*qkv, cu, max(lengths), dout)
        o = c.fwd().clone()
        if single is not None and r.get("single") is not None:
            r["single_err_cudnn"] = rel_fro(single(*qkv), o)
        del o
        measure_column(r, col, c, flops, args)
    except Exception as e:  # noqa: BLE001  (no frontend, no plan, a cuDNN / CUDA error: n/a, the run goes on)
        r["errors"][col] = one_line(e, 200)
        print(f"  {col}: n/a ({r['errors'][col]})")


def bench_case(r, lengths, args) -> None:
    """Fills row r for one (T, distribution) from its document lengths."""
    h, hkv, d, t = args.heads, args.kv_heads, args.head_dim, sum(lengths)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed * 1000003 + t + len(lengths))
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    qkv = (rnd(t, h, d), rnd(t, hkv, d), rnd(t, hkv, d))
    cu = cu_seqlens(lengths)
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
    if args.no_cudnn_varlen:
        r["skipped"]["cudnn_varlen"] = "--no-cudnn-varlen"
    else:
        bench_cudnn_varlen(r, qkv, cu, lengths, flops, args, single)
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
         "errors": {}, "skipped": {}, "bad": [], "sdpa_backend": None, "single_eq_loop": None, "single_err": None,
         "single_err_cudnn": None, "cudnn_check": None}
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
        return "bad" if col in r.get("bad", ()) else "skipped" if col in r.get("skipped", {}) else "n/a"
    return f"{x:.0f} ({ms:.3f} ms)"


def _ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def _e(x):
    return "n/a" if x is None else f"{x:.4f}"


def _dist(r):
    return r["dist"] if r["dist"] == "corpus" else f"fixed {r['dist']}"


def _case(r):
    return f"| {r['T']} | {_dist(r)} | {r['docs']} | " + (
        f"{r['mean_len']:.0f} / {r['max_len']} |" if r.get("mean_len") is not None else "n/a |")


HEAD = ("| T | documents | count | mean / max len | " + " | ".join(LABEL[c] + " fwd" for c in COLS)
        + " | single / dense | single / SDPA varlen | single / cuDNN varlen | single O err vs SDPA | "
        "single O err vs cuDNN | single = loop |")
BWD_HEAD = ("| T | documents | count | mean / max len | " + " | ".join(LABEL[c] + " bwd" for c in BWD_COLS)
            + " | single / dense bwd | single / SDPA varlen bwd | single / cuDNN varlen bwd | "
            "fwd+bwd ms single / dense / SDPA / cuDNN |")
CHECK_HEAD = "| T | documents | check: documents (min / max len) | O err | dQ err | dK err | dV err | status |"


def _frontend(info) -> str:
    fe = info.get("cudnn_frontend") or {}
    return (f"cuDNN frontend {fe['cudnn_frontend']} (backend {fe.get('cudnn_backend', '?')})"
            if fe.get("cudnn_frontend") else f"cuDNN frontend n/a ({fe.get('why', 'not loaded')})")


def markdown(rows, info) -> str:
    """The bench_varlen_gpu.md text: caption, forward table (TFLOP/s (ms), ratios), the backward table
    with --bwd, cuDNN varlen's self-checks, the issue targets' summary, and the n/a / bad / skipped
    reasons."""
    a = info["args"]
    lines = [f"Packed causal attention (per document), H = {a['heads']}, H_kv = {a['kv_heads']}, d = "
             f"{a['head_dim']}, BF16 inputs; TFLOP/s (median ms) on {info['gpu']} (driver {info['driver']}, "
             f"torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}, {_frontend(info)}), {info['date']}. "
             "FLOPs: 4 * H * d * sum L (L + 1) / 2 (attended pairs, diagonal included), backward 2.5x; dense ref = "
             "fp8attn on [T // Lm, H, Lm, d], Lm = mean length; SDPA varlen = nested jagged tensors, backend "
             f"{', '.join(sorted({r['sdpa_backend'] for r in rows if r.get('sdpa_backend')})) or 'n/a'}; "
             "cuDNN varlen = cuDNN frontend sdpa / sdpa_backward graphs on the packed (THD) layout (ragged offsets, "
             "per-document seq_len_q / seq_len_kv, padding mask, causal), graph execute only (lengths and offsets "
             "made once per batch, outside the timed call). bad = failed its self-check (no number).",
             "", HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    for r in rows:
        eq = r.get("single_eq_loop")
        lines.append(_case(r) + " " + " | ".join(_cell(r, c) for c in COLS) + f" | "
                     f"{_ratio(r.get('single'), r.get('dense'))} | {_ratio(r.get('single'), r.get('sdpa_varlen'))} | "
                     f"{_ratio(r.get('single'), r.get('cudnn_varlen'))} | {_e(r.get('single_err'))} | "
                     f"{_e(r.get('single_err_cudnn'))} | {'n/a' if eq is None else 'yes' if eq else 'NO'} |")
    if a.get("bwd"):
        lines += ["", "Backward (= fwd+bwd step minus forward; single: fp8attn::bwd_varlen; cuDNN varlen: the "
                  "forward graph's execute then the backward graph's).",
                  "", BWD_HEAD, "|" + "---|" * (BWD_HEAD.count("|") - 1)]
        for r in rows:
            steps = " / ".join("n/a" if r.get(f"{c}_step_ms") is None else f"{r[f'{c}_step_ms']:.3f}"
                               for c in BWD_COLS)
            lines.append(_case(r) + " " + " | ".join(_cell(r, c, "_bwd") for c in BWD_COLS) + f" | "
                         f"{_ratio(r.get('single_bwd'), r.get('dense_bwd'))} | "
                         f"{_ratio(r.get('single_bwd'), r.get('sdpa_varlen_bwd'))} | "
                         f"{_ratio(r.get('single_bwd'), r.get('cudnn_varlen_bwd'))} | {steps} |")
    checked = [r for r in rows if r.get("cudnn_check")]
    if checked:
        lines += ["", f"cuDNN varlen self-check, before its timings: its O{' / dQ / dK / dV' if a.get('bwd') else ''} "
                  "against float32 torch SDPA causal document by document (math backend), on the run's document "
                  f"lengths capped at {CHECK_MAX_LEN} and cut at T = {CHECK_TOKENS} tokens (fresh standard-normal "
                  f"inputs); relative Frobenius error, < {a['tol']:g} or bad.", "", CHECK_HEAD,
                  "|" + "---|" * (CHECK_HEAD.count("|") - 1)]
        for r in checked:
            c = r["cudnn_check"]
            lines.append(f"| {r['T']} | {_dist(r)} | {c['T']}: {c['docs']} ({c['min_len']} / {c['max_len']}) | "
                         + " | ".join(_e(c["err"].get(n)) for n in ("O",) + GRADS) + f" | {c['status']} |")
    t1 = [r for r in rows if (r.get("mean_len") or 0) >= 512 and r.get("single") and r.get("dense")]
    t2 = [r for r in rows if r.get("single") and r.get("sdpa_varlen")]
    t3 = [r for r in rows if r.get("single") and r.get("cudnn_varlen")]
    lines += ["", f"Issue 19 targets: single / dense >= 0.9 at mean length >= 512 in "
              f"{sum(r['single'] >= 0.9 * r['dense'] for r in t1)} of {len(t1)} rows; single faster than SDPA "
              f"BF16 varlen in {sum(r['single'] > r['sdpa_varlen'] for r in t2)} of {len(t2)} rows. Single faster "
              f"than cuDNN BF16 varlen in {sum(r['single'] > r['cudnn_varlen'] for r in t3)} of {len(t3)} rows."]
    notes = [f"- T={r['T']}, {r['dist']}, {LABEL.get(c, c)}: {kind}{why}" for r in rows
             for kind, d in (("", r.get("errors", {})), ("skipped: ", r.get("skipped", {}))) for c, why in d.items()]
    if notes:
        lines += ["", "n/a, bad and skipped cells (the run went on):", ""] + notes
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
    ap.add_argument("--bwd", action="store_true",
                    help="also forward + backward of single, dense, SDPA varlen, cuDNN varlen")
    ap.add_argument("--loop", action="store_true", help="time the per-sequence loop at any number of documents")
    ap.add_argument("--loop-max-docs", type=int_at_least(0), default=512,
                    help="skip the per-sequence loop above this many documents (default 512)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA BF16 columns")
    ap.add_argument("--no-cudnn-varlen", action="store_true",
                    help="skip the cuDNN BF16 varlen column (the cuDNN frontend's ragged graphs)")
    ap.add_argument("--tol", type=positive_float, default=0.02,
                    help="largest relative Frobenius error of cuDNN varlen's self-check (default 0.02)")
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
    info.update(args=vars(args), cudnn_frontend=None if args.no_cudnn_varlen else cfa.version_info(),
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
