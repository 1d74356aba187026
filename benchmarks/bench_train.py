"""End-to-end training throughput: the BF16 model (cuDNN SDPA) vs fp8attn with each
FP8 precision scope, on the trainer's GPU presets, in one run.

    python benchmarks/bench_train.py                       # CUDA: gpu-50m, gpu-125m
    python benchmarks/bench_train.py --presets gpu-1b --seq-len 8192   # 1.2 B, checkpointed
    python benchmarks/bench_train.py --device cpu --presets smoke --warmup 1 --steps 2   # CPU smoke
    python benchmarks/bench_train.py --presets gpu-125m --packed --rounds 3 \
        --configs bf16,fp8/attn-core@row,fp8/attn-core@tile,fp8/attn-core@tile-loop  # packed A/B

Per (preset, config) it builds the trainer's model (fp8attn.train.model), the
trainer's AdamW (FP32 master weights, BF16 autocast on CUDA), and times full
training steps (forward, cross-entropy, backward, grad clip, optimizer step) on
random tokens after `--warmup` untimed steps; CUDA is synchronized around the
timed steps. With `--rounds R` (R > 1) every config of a preset stays built and is
timed in R interleaved rounds (order rotated each round); tokens/s is the median
and "vs bf16" the median (and min-max) of the per-round ratios, which keeps
clock and thermal drift out of the comparison. Throughput does not depend on the token values, so no corpus is
needed. Configs:
  bf16                          BF16 everywhere, attention by F.scaled_dot_product_attention
                                restricted to the cuDNN backend on CUDA (the recorded
                                `bf16_attention` says whether GQA ran natively or with
                                K/V repeated, or whether cuDNN was unavailable);
  fp8/<scope>                   fp8attn (delta mode `--delta-mode`, scaling recipe `--scaling`)
                                with scope attn-core, attn-core+projections,
                                attn-core+projections+ffn (FP8Linear through cuBLASLt
                                block-scaled GEMMs);
  fp8/<scope>@row, @tile        the same with that scaling recipe (numerics.md section 9),
                                so both recipes can be timed in one run;
  fp8/<scope>@tile-loop         `tile` with FP8ATTN_VARLEN_LOOP=1 around its steps: with
                                --packed, varlen_attention's per-document loop instead
                                of the single launch (the A/B of issue 19).
Prints a markdown table (tokens/s, ms/step, speed relative to bf16, peak memory)
and writes everything to `--json`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from statistics import median
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# NOTE: prefer the in-tree package only when it holds a build (like tests/python/conftest.py);
# otherwise the installed fp8attn (pip install .) is used; FP8ATTN_SOURCE_TREE=0: sys.path's.
if (os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and list((ROOT / "python" / "fp8attn").glob("_C*.so"))
        and str(ROOT / "python") not in sys.path):
    sys.path.insert(0, str(ROOT / "python"))

from fp8attn.train import model as M  # noqa: E402
from fp8attn.train.trainer import TrainConfig, make_optimizer  # noqa: E402

SCOPES = M.SCOPES


def cudnn_attention_context(device: torch.device):
    """(context factory, description) for the BF16 baseline's attention on `device`.

    Probes cuDNN SDPA once with a GQA call: native enable_gqa if it runs, else K/V
    repeated per query head (patched into the model's attention_backend), else the
    default SDPA dispatch (described as such)."""
    if device.type != "cuda":
        return contextlib.nullcontext, "sdpa (cpu default)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 256, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 256, 64, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return (lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])), "cudnn (native GQA)"
    except RuntimeError:
        pass
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1),
                                           is_causal=True)
    except RuntimeError as e:
        print(f"[bench] cuDNN SDPA unavailable ({str(e)[:120]}); bf16 uses the default SDPA", flush=True)
        return contextlib.nullcontext, "sdpa default (cuDNN unavailable)"
    original = M.attention_backend

    def repeated(q, k, v, *, mode, **options):
        if mode == "bf16" and q.shape[1] != k.shape[1]:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        return original(q, k, v, mode=mode, **options)

    @contextlib.contextmanager
    def ctx():
        M.attention_backend = repeated
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                yield
        finally:
            M.attention_backend = original

    return ctx, "cudnn (K/V repeated for GQA)"


@contextlib.contextmanager
def varlen_loop(on: bool):
    """FP8ATTN_VARLEN_LOOP=1 inside (read by varlen_attention at every call), restored after."""
    if not on:
        yield
        return
    old = os.environ.get("FP8ATTN_VARLEN_LOOP")
    os.environ["FP8ATTN_VARLEN_LOOP"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FP8ATTN_VARLEN_LOOP"]
        else:
            os.environ["FP8ATTN_VARLEN_LOOP"] = old


def parse_configs(text: str, delta_mode: str, scaling: str) -> list[dict]:
    """--configs: a list of {name, mode, scope, scaling, loop} (module docstring's names);
    ValueError naming --configs for an unknown or repeated name."""
    out = []
    for c in text.split(","):
        if c == "bf16":
            out.append({"name": c, "mode": "bf16", "scope": "attn-core", "scaling": "row", "loop": False})
            continue
        base, _, variant = c.partition("@")
        if not (base.startswith("fp8/") and base[4:] in SCOPES) or variant not in ("", "row", "tile", "tile-loop"):
            raise ValueError(f"--configs: unknown config {c!r}; use bf16 or fp8/<{'|'.join(SCOPES)}>"
                             "[@row|@tile|@tile-loop]")
        out.append({"name": c, "mode": f"fp8-{delta_mode}", "scope": base[4:],
                    "scaling": variant.split("-")[0] if variant else scaling, "loop": variant == "tile-loop"})
    names = [c["name"] for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--configs: each config once, got {text!r}")
    return out


class Config:
    """One (preset, config) model with its optimizer and inputs, built and warmed up on `device`.

    `peak_mem_gb`: peak memory above what was allocated before it was built (its own
    parameters, optimizer state and step activations; other configs kept alive by
    --rounds do not count): over the build, the warm-up and, with --rounds 1, the
    timed steps; with --rounds > 1 over the build and the warm-up only (None with
    --warmup 0, when no step would be counted)."""

    def __init__(self, preset: str, attn_mode: str, scope: str, args, device: torch.device, ctx_factory,
                 scaling: str = "row", loop: bool = False, name: str | None = None):
        p = M.PRESETS[preset]
        self.batch = args.batch_size or p["train"]["batch_size"]
        self.seq = args.seq_len or p["train"]["seq_len"]
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        ac = {} if args.activation_checkpointing == "preset" else \
            {"activation_checkpointing": args.activation_checkpointing == "on"}
        cfg = M.preset_model_config(preset, attn_mode=attn_mode, scope=scope, packed=args.packed,
                                    max_seq_len=max(self.seq, p["model"]["max_seq_len"]), fp8_scaling=scaling, **ac)
        self.loop = loop
        torch.manual_seed(0)
        self.model = M.Transformer(cfg).to(device)
        self.tc = TrainConfig(lr=p["train"]["lr"], device=device.type)
        self.opt = make_optimizer(self.model, self.tc)
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randint(1, cfg.vocab_size, (self.batch, self.seq), generator=g).to(device)
        self.y = torch.randint(1, cfg.vocab_size, (self.batch, self.seq), generator=g).to(device)
        if args.packed:
            # documents of random length (mean args.doc_len tokens) separated by <|endoftext|>
            eot = torch.rand(self.batch, self.seq, generator=g) < 1.0 / args.doc_len
            x = torch.where(eot.to(device), torch.zeros_like(x), x)
        self.x = x
        # NOTE: packed bf16 attention takes an explicit block-diagonal mask, which the
        # cuDNN-only restriction may not accept: it uses SDPA's default dispatch.
        self.ctx = ctx_factory if attn_mode == "bf16" and not args.packed else contextlib.nullcontext
        self.row = {"preset": preset, "config": name or ("bf16" if attn_mode == "bf16" else f"fp8/{scope}"),
                    "attn_mode": attn_mode, "scope": scope if attn_mode != "bf16" else "bf16",
                    "fp8_scaling": scaling if attn_mode != "bf16" else None, "varlen_loop": loop,
                    "params": self.model.num_params(), "batch_size": self.batch, "seq_len": self.seq,
                    "packed": args.packed, "fp8_linear_layers": len(self.model.fp8_linear_names),
                    "activation_checkpointing": cfg.activation_checkpointing}
        self.loss = None
        self.base = base
        for _ in range(args.warmup):
            self.step()
        self.row["peak_mem_gb"] = self.peak_gb() if args.warmup > 0 else None

    def peak_gb(self):
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - self.base) / 2 ** 30

    def step(self):
        with varlen_loop(self.loop), self.ctx(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            logits = self.model(self.x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        self.opt.step()
        self.loss = loss.detach()

    def time_steps(self, n: int) -> float:
        """Seconds per training step over n steps (CUDA synchronized around them)."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    def result(self, tokens_per_s: list) -> dict:
        """The table / JSON row: median tokens/s over the rounds (each round's kept)."""
        tps = median(tokens_per_s)
        return {**self.row, "ms_per_step": self.batch * self.seq / tps * 1e3, "tokens_per_s": tps,
                "final_loss": float(self.loss), "rounds_tokens_per_s": tokens_per_s}

    def free(self):
        del self.model, self.opt
        if self.cuda:
            torch.cuda.empty_cache()


def bench_preset(preset: str, configs, args, device: torch.device, ctx_factory) -> list[dict]:
    """Rows of one preset. --rounds 1: each config built, warmed up, timed and freed in
    turn. --rounds R > 1: all configs built first (kept alive), then R rounds of
    --steps timed steps per config, the order rotated every round, so clock or
    thermal drift during the run falls on every config alike; tokens/s is the median
    over the rounds, and "vs bf16" the median of the per-round ratios."""
    rows = []
    def build(k):
        return Config(preset, k["mode"], k["scope"], args, device, ctx_factory, k["scaling"], k["loop"], k["name"])

    if args.rounds == 1:
        for k in configs:
            t0 = time.perf_counter()
            c = build(k)
            dt = c.time_steps(args.steps)
            c.row["peak_mem_gb"] = c.peak_gb()  # NOTE: nothing else allocated since its build
            rows.append(c.result([c.batch * c.seq / dt]))
            c.free()
            print(f"[bench] {preset} {rows[-1]['config']}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, "
                  f"{dt * 1e3:.1f} ms/step ({time.perf_counter() - t0:.1f} s incl. build and warm-up)", flush=True)
        return rows
    built = [build(k) for k in configs]
    per = [[] for _ in built]
    for r in range(args.rounds):
        for i in [(r + k) % len(built) for k in range(len(built))]:
            per[i].append(built[i].batch * built[i].seq / built[i].time_steps(args.steps))
        print(f"[bench] {preset} round {r + 1}/{args.rounds}: "
              + ", ".join(f"{c.row['config']} {x[-1]:,.0f}" for c, x in zip(built, per)) + " tokens/s", flush=True)
    for c, x in zip(built, per):
        rows.append(c.result(x))
        c.free()
    return rows


def markdown(rows: list[dict]) -> str:
    """Table: median tokens/s; "vs bf16" = the median of per-round ratios to the same preset's bf16
    row (one round: the plain ratio), with their min-max over the rounds when there are several."""
    lines = ["| preset | config | tokens/s | ms/step | vs bf16 | peak mem GB |", "|---|---|---|---|---|---|"]
    base = {r["preset"]: r for r in rows if r["config"] == "bf16"}
    for r in rows:
        b = base.get(r["preset"])
        if b is None:
            rel = "n/a"
        else:
            ratios = [x / y for x, y in zip(r["rounds_tokens_per_s"], b["rounds_tokens_per_s"])]
            rel = f"{median(ratios):.2f}x"
            if len(ratios) > 1 and r is not b:
                rel += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        mem = "n/a" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f}"
        lines.append(f"| {r['preset']} | {r['config']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                     f"{rel} | {mem} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--presets", default=None, help="comma list (default: gpu-50m,gpu-125m on CUDA, smoke on CPU)")
    ap.add_argument("--configs", default="bf16," + ",".join(f"fp8/{s}" for s in SCOPES),
                    help="comma list of bf16 and fp8/<scope>")
    ap.add_argument("--delta-mode", default="delta_matching", choices=["stale", "matched_do", "delta_matching"])
    ap.add_argument("--scaling", default="row", choices=["row", "tile"],
                    help="scaling recipe of the fp8 configs without an @ suffix (numerics.md section 9)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per config (per round)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="R > 1: all configs of a preset kept alive and timed in R interleaved rounds (median)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--packed", action="store_true",
                    help="packed documents (per-document causal attention; random separators)")
    ap.add_argument("--doc-len", type=int, default=512, help="mean document length with --packed")
    ap.add_argument("--activation-checkpointing", default="preset", choices=["preset", "on", "off"],
                    help="recompute each block in backward (default: as the preset sets it; gpu-1b: on)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        raise SystemExit("--warmup must be >= 0, --steps and --rounds >= 1")
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          (args.device if args.device != "auto" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    presets = (args.presets or ("gpu-50m,gpu-125m" if device.type == "cuda" else "smoke")).split(",")
    for pr in presets:
        if pr not in M.PRESETS:
            raise SystemExit(f"--presets: unknown preset {pr!r}; choose from {sorted(M.PRESETS)}")
    try:
        configs = parse_configs(args.configs, args.delta_mode, args.scaling)
    except ValueError as exc:
        ap.error(str(exc))   # exit status 2, as a bad argument of the other benchmarks
    if not args.packed and any(k["loop"] for k in configs):
        ap.error("--configs: @tile-loop needs --packed (it times varlen_attention's per-document loop)")
    ctx_factory, bf16_attn = cudnn_attention_context(device)
    if args.packed:
        bf16_attn = "sdpa default dispatch with a block-diagonal causal mask (packed)"
    t_all = time.perf_counter()
    rows = []
    for pr in presets:
        rows += bench_preset(pr, configs, args, device, ctx_factory)
    table = markdown(rows)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "bf16_attention": bf16_attn,
            "delta_mode": args.delta_mode, "scaling": args.scaling, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
            "packed": args.packed,
            "total_s": time.perf_counter() - t_all, "rows": rows}
    print()
    print(f"device {info['device']}, torch {info['torch']}, bf16 attention: {bf16_attn}, "
          f"fp8 delta mode {args.delta_mode}, scaling {args.scaling} (unless @), {args.warmup} warm-up + {args.steps} timed steps per config"
          f"{' x %d interleaved rounds (median)' % args.rounds if args.rounds > 1 else ''}"
          f"{', packed documents (mean length %d)' % args.doc_len if args.packed else ''}")
    if args.rounds > 1:
        print("tokens/s: median over the rounds; vs bf16: median (min-max) of the per-round ratios, so it need "
              "not equal the ratio of the two medians")
    print(table)
    print(f"total {info['total_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
