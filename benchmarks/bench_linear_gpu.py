"""Per-GEMM micro-benchmark (issue 21): one linear layer's training step, forward + backward,
for every linear-layer shape of a trainer preset: BF16 nn.Linear next to fp8attn's FP8Linear
and torchao's float8 Float8Linear (tensorwise and rowwise recipes), on one GPU in one run.

    python3 benchmarks/bench_linear_gpu.py                              # gpu-1b, 4 x 8192 tokens
    python3 benchmarks/bench_linear_gpu.py --preset gpu-350m --json out.json
    python3 benchmarks/bench_linear_gpu.py --compile                    # every variant compiled
    python3 benchmarks/bench_linear_gpu.py --device cpu --preset smoke --warmup 1 --iters 2   # CPU smoke

What is measured:
  * shapes: the nn.Linear layers that fp8attn's widest scope converts
    (fp8attn.train.model.scope_linear_patterns("attn-core+projections+ffn"): Wq, Wk, Wv, Wo
    of the attention layers and the SwiGLU W1, W3 (up / gate) and W2 (down); not the LM
    head), read from the preset's model built on the meta device (linear_shapes): one row
    per distinct (in_features K, out_features N), naming the layers that share it and how
    many the model has (gpu-1b, 24 layers: Wq and Wo 2048 -> 2048, Wk and Wv 2048 -> 512,
    W1 and W3 2048 -> 5632, 48 each; W2 5632 -> 2048, 24). M = tokens per training step =
    batch x seq_len (--batch-size / --seq-len, default the preset's: gpu-1b 4 x 8192 = 32768).
  * and one row "attn.qkv (wq+wk+wv)" (qkv_shape; --no-fused-qkv leaves it out): Wq, Wk, Wv
    on one x as one timed call, K -> N = the three out_features summed (gpu-1b 2048 -> 2048 +
    512 + 512 = 3072), count = the attention layers. fp8attn runs them as the trainer's
    projections scope does, fused (fp8attn.linear.fp8_linear_fused: x quantized once, one
    block-scaled GEMM per pass against [Wq; Wk; Wv], one quantization of the concatenated dY);
    bf16 and torchao run their three layers on the same x (dX summed by autograd). The
    unfused FP8Linear time is the sum of the attn.wq and attn.wk / attn.wv rows' fp8attn
    cells (wq's row + 2 x wk's). The table's total row counts the separate layers; a second
    total line counts this row instead of the attn.wq, attn.wk and attn.wv layers.
  * one timed call = the layer's part of a training step: y = layer(x) under BF16 autocast
    (the trainer's), then y.backward(dY) (dX and dW), the gradients set to None first (as
    the optimizer's zero_grad(set_to_none=True)); weight W [N, K] FP32 (the master weight),
    x [M, K] BF16 requiring grad, dY [M, N] BF16, fresh standard-normal values (W / sqrt(K)).
    FLOPs: 6 M K N (three GEMMs of 2 M K N).
  * time: timing.time_ms, the median of --iters timed calls (CUDA events, a sync after each)
    after --warmup untimed ones. --compile: each variant's layer under torch.compile
    (compiled during the warm-up, outside the timed calls; torchao's process-wide inductor
    min / max patch applied before the first compile, torchao_float8.patch_inductor_up_front).
  * variants:
      bf16                 nn.Linear: cuBLAS BF16 GEMMs (autocast casts W to BF16 per call)
      fp8attn              fp8attn.linear.FP8Linear, backend "scaled_mm" (cuBLASLt block-scaled
                           E4M3 GEMMs, 1x128 / 128x128 scale blocks, its Triton quantizers
                           included; n/a where it cannot run rather than the emulation)
      torchao/<recipe>     torchao's Float8Linear (torchao.float8.convert_to_float8_training,
                           benchmarks/torchao_float8.py): tensorwise and rowwise by default,
                           rowwise_with_gw_hp on request (--variants); torchao is designed to run
                           under torch.compile (eager, its scaling and casts are separate kernels),
                           so its fair numbers are --compile's.
    A variant that cannot run (torchao missing, below compute capability 8.9, an error or
    out of memory) has n/a cells and its reason under the table; the run goes on.
  * table: per shape, each variant's ms and "(x)" = its speed relative to bf16 (bf16 ms / ms,
    > 1 faster); the last row sums count x ms over the shapes: the converted layers' share
    of one training step (recomputation under activation checkpointing not counted).
On the CPU (--device cpu, a smoke run): FP32 inputs without autocast, FP8Linear's emulated
backend, torchao emulated (torchao_float8.py); perf_counter medians; the numbers mean nothing.
Exit status: 0; 1 without a CUDA GPU (unless --device cpu; nothing written); 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn as nn

_HERE = Path(__file__).resolve().parent
_PY = str(_HERE.parent / "python")
# NOTE: in-tree build first, else the installed package (FP8ATTN_SOURCE_TREE=0: sys.path's, as conftest.py)
if (os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and glob.glob(os.path.join(_PY, "fp8attn", "_C*.so"))
        and _PY not in sys.path):
    sys.path.insert(0, _PY)
sys.path.insert(0, str(_HERE))

from fp8attn.train import model as M  # noqa: E402
from timing import int_at_least, time_ms  # noqa: E402
import torchao_float8 as TAO  # noqa: E402

DEFAULT_VARIANTS = ("bf16", "fp8attn", "torchao/tensorwise", "torchao/rowwise")
ALL_VARIANTS = ("bf16", "fp8attn") + tuple(f"torchao/{r}" for r in TAO.RECIPES)


def linear_shapes(preset: str, batch_size: int | None = None, seq_len: int | None = None) -> list[dict]:
    """The distinct linear-layer shapes of `preset`'s model that fp8attn's widest scope converts,
    read from the model built on the meta device (no memory, no init cost): a list of
    {"layers": sorted roles ("attn.wq", ... : the name after blocks.<i>.), "count": how many
    such layers the model has, "M": tokens per step (batch x seq_len, default the preset's),
    "K": in_features, "N": out_features}, in the order of the first block's layers."""
    p = M.PRESETS[preset]
    m_tokens = (batch_size or p["train"]["batch_size"]) * (seq_len or p["train"]["seq_len"])
    with torch.device("meta"):
        model = M.Transformer(M.preset_model_config(preset))
    pats = M.scope_linear_patterns(M.SCOPES[-1])
    import fnmatch  # noqa: PLC0415

    out: dict[tuple, dict] = {}
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and any(fnmatch.fnmatchcase(name, q) for q in pats):
            key = (mod.in_features, mod.out_features)
            role = name.split(".", 2)[2] if name.startswith("blocks.") else name
            row = out.setdefault(key, {"layers": [], "count": 0, "M": m_tokens, "K": key[0], "N": key[1]})
            row["count"] += 1
            if role not in row["layers"]:
                row["layers"].append(role)
    return list(out.values())


def qkv_shape(preset: str, batch_size: int | None = None, seq_len: int | None = None) -> dict:
    """The fused-QKV row of `preset`: {"layers": ["attn.qkv (wq+wk+wv)"], "count": attention
    layers, "M", "K": d_model, "N": the sum of Wq, Wk, Wv's out_features, "parts": [N_q, N_k,
    N_v], "roles": ["attn.wq", "attn.wk", "attn.wv"]}, from the model on the meta device."""
    p = M.PRESETS[preset]
    m_tokens = (batch_size or p["train"]["batch_size"]) * (seq_len or p["train"]["seq_len"])
    with torch.device("meta"):
        model = M.Transformer(M.preset_model_config(preset))
    attn = [blk.attn for blk in model.blocks if blk.attn is not None]
    parts = [attn[0].wq.out_features, attn[0].wk.out_features, attn[0].wv.out_features]
    return {"layers": ["attn.qkv (wq+wk+wv)"], "count": len(attn), "M": m_tokens, "K": attn[0].wq.in_features,
            "N": sum(parts), "parts": parts, "roles": ["attn.wq", "attn.wk", "attn.wv"]}


class QKV(nn.Module):
    """Three projections of one input: fused (fp8attn.linear.fp8_linear_fused on the three
    FP8Linear layers' weights, as the trainer's Attention.qkv) or the three layers called."""

    def __init__(self, layers: list, fused: bool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fused = fused

    def forward(self, x):
        if self.fused:
            from fp8attn.linear import fp8_linear_fused  # noqa: PLC0415
            first = self.layers[0]
            return fp8_linear_fused(x, [m.weight for m in self.layers], [m.bias for m in self.layers],
                                    grad_format=first.grad_format, backend=first.backend)
        return tuple(m(x) for m in self.layers)


def make_qkv(variant: str, k: int, parts: list, device: torch.device) -> nn.Module:
    """The fused-QKV row's module: `variant`'s three layers [parts[i], k] on one input; fp8attn's
    fused (QKV)."""
    return QKV([make_layer(variant, k, n, device) for n in parts], fused=variant == "fp8attn")


def make_layer(variant: str, k: int, n: int, device: torch.device) -> nn.Module:
    """The variant's layer with an FP32 weight [n, k] ~ N(0, 1/k), no bias; ValueError for an
    unknown variant, RuntimeError with the reason where it cannot run on `device`."""
    lin = nn.Linear(k, n, bias=False, device=device)
    with torch.no_grad():
        lin.weight.normal_(0.0, 1.0 / math.sqrt(k))
    if variant == "bf16":
        return lin
    if variant == "fp8attn":
        from fp8attn.linear import FP8Linear  # noqa: PLC0415
        # NOTE: scaled_mm on CUDA (an n/a rather than a timed emulation); the emulation on the CPU
        return FP8Linear.from_linear(lin, backend="scaled_mm" if device.type == "cuda" else "emulated")
    if variant.startswith("torchao/") and variant[8:] in TAO.RECIPES:
        why = TAO.unavailable(device, variant[8:])
        if why is not None:
            raise RuntimeError(why)
        return TAO.float8_linear(lin, variant[8:], device)
    raise ValueError(f"unknown variant {variant!r}; choose from {ALL_VARIANTS}")


def time_variant(variant: str, shape: dict, device: torch.device, warmup: int, iters: int,
                 compile_backend: str | None = None) -> dict:
    """{"ms": median ms of one forward + backward, "tflops"} or {"na": reason} for one shape."""
    m, k, n = shape["M"], shape["K"], shape["N"]
    cuda = device.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    parts = shape.get("parts")
    try:
        layer = make_qkv(variant, k, parts, device) if parts else make_layer(variant, k, n, device)
        fwd = torch.compile(layer, backend=compile_backend) if compile_backend else layer
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dt, generator=g).requires_grad_()
        dy = torch.randn(m, n, device=device, dtype=dt, generator=g)
        dys = dy.split(parts, dim=1) if parts else None
        params = list(layer.parameters())

        def step():
            x.grad = None
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                y = fwd(x)
            if parts:
                torch.autograd.backward(list(y), list(dys))
            else:
                y.backward(dy)

        if cuda:
            ms = time_ms(step, warmup, iters)
        else:
            for _ in range(warmup):
                step()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                ts.append((time.perf_counter() - t0) * 1e3)
            ms = median(ts)
    except Exception as exc:  # noqa: BLE001 (any failure is this cell's n/a, the run goes on)
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        res = {"na": why}
    else:
        res = {"ms": ms, "tflops": 6 * m * k * n / (ms * 1e-3) / 1e12}
    # NOTE: out of the except block: the traceback's tensors are gone before the cache is emptied
    layer = fwd = x = dy = dys = params = None
    if cuda:
        torch.cuda.empty_cache()
    return res


def markdown(rows: list[dict], variants: list[str]) -> str:
    """rows: linear_shapes rows, each with "results": {variant: time_variant's dict}, and
    optionally qkv_shape's row (with "parts"). One line a shape (ms and speed vs bf16), a total
    line (sum of count x ms over the separate layers; n/a if any shape is), with a qkv row a
    second total line counting it in place of its three roles' layers, then the n/a reasons."""
    head = "| layers (count) | M x K -> N | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (2 + len(variants))]
    notes = []

    def cell(ms, base):
        if ms is None:
            return "n/a"
        rel = f" ({base / ms:.2f}x)" if base is not None and ms > 0 else ""
        return f"{ms:.3f}{rel}"

    totals = {v: 0.0 for v in variants}
    qkv = None
    for r in rows:
        res = r["results"]
        base = res.get("bf16", {}).get("ms")
        cells = []
        for v in variants:
            ms = res[v].get("ms")
            if ms is None:
                notes.append(f"n/a: {v} at {'/'.join(r['layers'])} ({r['M']} x {r['K']} -> {r['N']}): {res[v]['na']}")
            cells.append(cell(ms, base))
        if r.get("parts"):
            qkv = r
            size = f"{r['M']} x {r['K']} -> {' + '.join(str(n) for n in r['parts'])}"
        else:
            size = f"{r['M']} x {r['K']} -> {r['N']}"
            for v in variants:
                ms = res[v].get("ms")
                totals[v] = None if ms is None or totals[v] is None else totals[v] + r["count"] * ms
        lines.append(f"| {', '.join(r['layers'])} ({r['count']}) | {size} | " + " | ".join(cells) + " |")
    base = totals.get("bf16")
    lines.append("| all of them, count x ms | per step | " + " | ".join(cell(totals[v], base) for v in variants) + " |")
    if qkv is not None:
        # the separate Wq, Wk, Wv layers' share (count of the qkv row each: one per attention layer)
        # swapped for the qkv row
        by_role = {role: r for r in rows if not r.get("parts") for role in r["layers"]}
        fused = {}
        for v in variants:
            sep = [by_role[role]["results"][v].get("ms") if role in by_role else None for role in qkv["roles"]]
            ms = qkv["results"][v].get("ms")
            fused[v] = (None if totals[v] is None or ms is None or None in sep
                        else totals[v] - qkv["count"] * sum(sep) + qkv["count"] * ms)
        base = fused.get("bf16")
        lines.append("| all of them, attn.qkv for wq, wk, wv | per step | "
                     + " | ".join(cell(fused[v], base) for v in variants) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--preset", default="gpu-1b", choices=sorted(M.PRESETS))
    ap.add_argument("--batch-size", type=int_at_least(1), default=None, help="default: the preset's")
    ap.add_argument("--seq-len", type=int_at_least(1), default=None, help="default: the preset's")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma list of {', '.join(ALL_VARIANTS)} (bf16 first for the ratios)")
    ap.add_argument("--warmup", type=int_at_least(0), default=5)
    ap.add_argument("--iters", type=int_at_least(1), default=20)
    ap.add_argument("--compile", action="store_true", help="torch.compile each variant's layer")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="auto: CUDA (exit 1 without a GPU); cpu: a smoke run")
    ap.add_argument("--no-fused-qkv", action="store_true",
                    help="leave out the attn.qkv row (Wq, Wk, Wv on one x; fp8attn's fused)")
    ap.add_argument("--json", default=None, help="write the environment and rows here")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad or len(set(variants)) != len(variants):
        ap.error(f"--variants: each of {ALL_VARIANTS} at most once, got {args.variants!r}")
    if args.device != "cpu" and not torch.cuda.is_available():
        print("bench_linear_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False; --device cpu for a "
              "smoke run); nothing written", file=sys.stderr)
        return 1
    device = torch.device("cpu" if args.device == "cpu" else "cuda")
    shapes = linear_shapes(args.preset, args.batch_size, args.seq_len)
    if not args.no_fused_qkv:
        shapes.append(qkv_shape(args.preset, args.batch_size, args.seq_len))
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   4 * len(shapes) * len(variants))
        if any(v.startswith("torchao/") for v in variants):
            TAO.patch_inductor_up_front(device)   # every variant compiled alike (torchao_float8.py)
    t_all = time.perf_counter()
    for r in shapes:
        r["results"] = {}
        for v in variants:
            r["results"][v] = time_variant(v, r, device, args.warmup, args.iters,
                                           args.compile_backend if args.compile else None)
            got = r["results"][v]
            print(f"[bench_linear] {'/'.join(r['layers'])} {r['M']} x {r['K']} -> {r['N']} {v}: "
                  + (f"{got['ms']:.3f} ms, {got['tflops']:.0f} TFLOP/s" if "ms" in got else f"n/a ({got['na']})"),
                  flush=True)
    md = markdown(shapes, variants)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "torchao": TAO.version(),
            "preset": args.preset, "warmup": args.warmup, "iters": args.iters, "compile": args.compile,
            "compile_backend": args.compile_backend if args.compile else None, "variants": variants,
            "total_s": time.perf_counter() - t_all, "rows": shapes}
    print()
    print(f"device {info['device']}, torch {info['torch']}, torchao {info['torchao']}, preset {args.preset}, "
          f"{'torch.compile (%s)' % args.compile_backend if args.compile else 'eager'}, median of {args.iters} "
          f"after {args.warmup} warm-up calls; ms of forward + backward, (x) = speed vs bf16")
    print(md)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
