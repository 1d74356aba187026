"""End-to-end training throughput: the BF16 model (cuDNN SDPA) vs fp8attn with each
FP8 precision scope and vs torchao's float8 linear layers, on the trainer's GPU presets,
in one run.

    python benchmarks/bench_train.py                       # CUDA: gpu-50m, gpu-125m
    python benchmarks/bench_train.py --presets gpu-1b --seq-len 8192   # 1.2 B, checkpointed
    python benchmarks/bench_train.py --device cpu --presets smoke --warmup 1 --steps 2   # CPU smoke
    python benchmarks/bench_train.py --presets gpu-125m --packed --rounds 3 \
        --configs bf16,fp8/attn-core@row,fp8/attn-core@tile,fp8/attn-core@tile-loop  # packed A/B
    python benchmarks/bench_train.py --presets gpu-1b --rounds 2 --warmup 2 --steps 4 \
        --configs bf16,fp8/attn-core+projections+ffn@tile,torchao/tensorwise,torchao/rowwise

Per (preset, config) it builds the trainer's model (fp8attn.train.model), the
trainer's AdamW (FP32 master weights, BF16 autocast on CUDA), and times full
training steps (forward, cross-entropy, backward, grad clip, optimizer step) on
random tokens after `--warmup` untimed steps; CUDA is synchronized around the
timed steps. With `--rounds R` (R > 1) every config of a preset is timed in R
interleaved rounds (order rotated each round), kept built between them, or rebuilt
(same seed) and warmed up again in every round where the configs' FP32 weights,
gradients and AdamW state would not fit the GPU together (`--rounds-mode`, auto:
gpu-1b's 19.5 GB per config); tokens/s is the median
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
                                of the single launch (the A/B of issue 19);
  torchao/<recipe>              the bf16 model (cuDNN SDPA attention, BF16 autocast, FP32
                                master weights, the same AdamW) with the linear layers of
                                the widest scope (Wq, Wk, Wv, Wo and the SwiGLU W1, W2, W3:
                                model.scope_linear_patterns) swapped for torchao's float8
                                training Float8Linear (convert_to_float8_training, recipe
                                tensorwise, rowwise or rowwise_with_gw_hp; torchao_float8.py):
                                the FP8 linear layers a user would pick instead of FP8Linear
                                (issue 21). The LM head stays BF16 as in every fp8 config
                                (torchao's own guidance leaves the output layer, and layers
                                whose dims are not multiples of 16, in high precision; the
                                embedding is no linear layer). torchao is optional: without
                                it, or on a GPU below compute capability 8.9, the row says
                                n/a with the reason and the other configs run; on the CPU it
                                runs emulated (emulate=True). Any error while building or
                                warming up a torchao config (with --compile: any config)
                                also gives an n/a row.
`--compile`: torch.compile(model) for every config alike (default off; each config
compiles during its warm-up, so give --warmup >= 2; with a torchao config in the run,
torchao's process-wide inductor min / max patch is applied before the first compile).
torchao's float8 is designed to run under torch.compile (eager, its scaling and casts are
separate unfused kernels), so the fair torchao-vs-fp8attn comparison runs with --compile
for all configs.
Prints a markdown table (tokens/s, ms/step, speed relative to bf16, peak memory; an n/a
config's reason under it) and writes everything to `--json`.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchao_float8 as TAO  # noqa: E402 (benchmarks/torchao_float8.py; torchao itself imported on use)

SCOPES = M.SCOPES
WIDEST = SCOPES[-1]   # the torchao configs convert this scope's linear layers


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
    """--configs: a list of {name, mode, scope, scaling, loop, torchao} (module docstring's
    names; torchao: the recipe of a torchao/<recipe> config, else None); ValueError naming
    --configs for an unknown or repeated name or an unknown torchao recipe."""
    out = []
    for c in text.split(","):
        if c == "bf16":
            out.append({"name": c, "mode": "bf16", "scope": "attn-core", "scaling": "row", "loop": False,
                        "torchao": None})
            continue
        if c.startswith("torchao/"):
            if c[8:] not in TAO.RECIPES:
                raise ValueError(f"--configs: unknown torchao recipe {c[8:]!r} in {c!r}; use torchao/<"
                                 f"{'|'.join(TAO.RECIPES)}>")
            out.append({"name": c, "mode": "bf16", "scope": "attn-core", "scaling": "row", "loop": False,
                        "torchao": c[8:]})
            continue
        base, _, variant = c.partition("@")
        if not (base.startswith("fp8/") and base[4:] in SCOPES) or variant not in ("", "row", "tile", "tile-loop"):
            raise ValueError(f"--configs: unknown config {c!r}; use bf16, fp8/<{'|'.join(SCOPES)}>"
                             f"[@row|@tile|@tile-loop] or torchao/<{'|'.join(TAO.RECIPES)}>")
        out.append({"name": c, "mode": f"fp8-{delta_mode}", "scope": base[4:],
                    "scaling": variant.split("-")[0] if variant else scaling, "loop": variant == "tile-loop",
                    "torchao": None})
    names = [c["name"] for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--configs: each config once, got {text!r}")
    return out


class Config:
    """One (preset, config) model with its optimizer and inputs, built and warmed up on `device`.

    `peak_mem_gb`: peak memory above what was allocated before it was built (its own
    parameters, optimizer state and step activations; other configs kept alive by
    --rounds do not count): over the build, the warm-up and, with --rounds 1 or
    rounds mode "rebuild", the timed steps; with --rounds > 1 kept alive over the build
    and the warm-up only (None with --warmup 0, when no step would be counted)."""

    def __init__(self, preset: str, attn_mode: str, scope: str, args, device: torch.device, ctx_factory,
                 scaling: str = "row", loop: bool = False, name: str | None = None, torchao: str | None = None):
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
        # NOTE: initialised on the device itself (its generator; every config the same weights):
        # gpu-1b's 1.2 B parameters take ~20 s to initialise on two CPU cores
        with torch.device(device):
            self.model = M.Transformer(cfg)
        linear_names = self.model.fp8_linear_names
        if torchao is not None:
            # NOTE: before the optimizer (same Parameter objects either way)
            linear_names = TAO.convert(self.model, M.scope_linear_patterns(WIDEST), torchao, device)
        self.tc = TrainConfig(lr=p["train"]["lr"], device=device.type)
        self.opt = make_optimizer(self.model, self.tc)
        self.fwd = torch.compile(self.model, backend=args.compile_backend) if args.compile else self.model
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
                    "attn_mode": attn_mode,
                    "scope": scope if attn_mode != "bf16" else ("bf16" if torchao is None else "projections+ffn"),
                    "fp8_scaling": scaling if attn_mode != "bf16" else None, "varlen_loop": loop,
                    "torchao_recipe": torchao, "torchao_emulated": torchao is not None and not self.cuda,
                    "compile": args.compile,
                    "params": self.model.num_params(), "batch_size": self.batch, "seq_len": self.seq,
                    "packed": args.packed, "fp8_linear_layers": len(linear_names),
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
            logits = self.fwd(self.x)
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
        del self.model, self.opt, self.fwd
        if self.cuda:
            torch.cuda.empty_cache()


def na_row(preset: str, k: dict, reason: str) -> dict:
    """The table / JSON row of a config that could not run: no numbers, the reason."""
    return {"preset": preset, "config": k["name"], "attn_mode": k["mode"], "torchao_recipe": k["torchao"],
            "na": reason, "tokens_per_s": None, "ms_per_step": None, "peak_mem_gb": None, "final_loss": None,
            "rounds_tokens_per_s": []}


def build_or_na(preset: str, k: dict, args, device: torch.device, ctx_factory):
    """(Config, None), or (None, reason) for a torchao config that cannot run here: torchao
    unavailable (torchao_float8.unavailable), or any exception while building or warming it
    up (its memory freed before the next config); with --compile the same for every config
    (a compiler failure is the compiler's). Otherwise errors of the other configs propagate."""
    if k["torchao"] is not None:
        why = TAO.unavailable(device, k["torchao"])
        if why is not None:
            return None, why
    try:
        return Config(preset, k["mode"], k["scope"], args, device, ctx_factory, k["scaling"], k["loop"], k["name"],
                      k["torchao"]), None
    except Exception as exc:  # noqa: BLE001
        if k["torchao"] is None and not args.compile:
            raise
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    # NOTE: out of the except block, so the traceback (and the half-built model it holds) is gone
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None, why


STATE_BYTES_PER_PARAM = 16   # FP32 weight + gradient + AdamW's two moments


def rounds_mode(preset: str, n_configs: int, args, device: torch.device) -> str:
    """How --rounds R > 1 keeps the configs: "keep" (all built once, kept alive) or "rebuild"
    (each config built, warmed up, timed and freed in every round). --rounds-mode auto: keep
    unless the configs' FP32 weights, gradients and AdamW state, 16 bytes a parameter each,
    exceed half the GPU's memory together (the rest for the steps' activations): gpu-1b's
    1.22 B parameters hold 19.5 GB per config."""
    if args.rounds_mode != "auto":
        return args.rounds_mode
    if device.type != "cuda" or args.rounds == 1:
        return "keep"
    with torch.device("meta"):
        params = M.Transformer(M.preset_model_config(preset)).num_params()
    need = n_configs * params * STATE_BYTES_PER_PARAM
    total = torch.cuda.get_device_properties(device).total_memory
    if need <= total / 2:
        return "keep"
    print(f"[bench] {preset}: {n_configs} configs x {params * STATE_BYTES_PER_PARAM / 2 ** 30:.1f} GB of FP32 "
          f"weights, gradients and AdamW state exceed half of the GPU's {total / 2 ** 30:.0f} GB: every round "
          "rebuilds each config (--rounds-mode rebuild)", flush=True)
    return "rebuild"


def bench_preset(preset: str, configs, args, device: torch.device, ctx_factory) -> list[dict]:
    """Rows of one preset, in --configs order. --rounds 1: each config built, warmed up, timed
    and freed in turn. --rounds R > 1, the order of the configs rotated every round, so clock
    or thermal drift during the run falls on every config alike; tokens/s is the median over
    the rounds, and "vs bf16" the median of the per-round ratios. Mode "keep" (rounds_mode):
    all configs built first and kept alive, then R rounds of --steps timed steps per config;
    "rebuild": in every round each config is built (same seed: the same weights), warmed up,
    timed and freed, as with --rounds 1 (peak memory: the largest over its rounds). A config
    that cannot run (build_or_na) gives an n/a row and is left out of the rounds."""
    mode = rounds_mode(preset, len(configs), args, device)
    names = [k["name"] for k in configs]
    per = {n: [] for n in names}
    done = {}   # name -> result row (or n/a row)
    if args.rounds == 1 or mode == "rebuild":
        for r in range(args.rounds):
            for k in [configs[(r + j) % len(configs)] for j in range(len(configs))]:
                if done.get(k["name"], {}).get("na"):
                    continue
                t0 = time.perf_counter()
                c, why = build_or_na(preset, k, args, device, ctx_factory)
                if c is None:
                    # NOTE: a config that ran in an earlier round keeps those rounds' numbers
                    done.setdefault(k["name"], na_row(preset, k, why))
                    print(f"[bench] {preset} {k['name']}: n/a ({why})", flush=True)
                    continue
                dt = c.time_steps(args.steps)
                peak = c.peak_gb()  # NOTE: nothing else allocated since its build
                prev = done.get(k["name"], {}).get("peak_mem_gb")
                c.row["peak_mem_gb"] = peak if prev is None or peak is None else max(peak, prev)
                per[k["name"]].append(c.batch * c.seq / dt)
                done[k["name"]] = c.result(list(per[k["name"]]))
                c.free()
                print(f"[bench] {preset} {k['name']}{f' (round {r + 1}/{args.rounds})' if args.rounds > 1 else ''}: "
                      f"{c.batch * c.seq / dt:,.0f} tokens/s, {dt * 1e3:.1f} ms/step "
                      f"({time.perf_counter() - t0:.1f} s incl. build and warm-up)", flush=True)
        return [{**done[n], "rounds_mode": mode} if args.rounds > 1 else done[n] for n in names]
    built = {}
    for k in configs:
        c, why = build_or_na(preset, k, args, device, ctx_factory)
        if c is None:
            done[k["name"]] = na_row(preset, k, why)
            print(f"[bench] {preset} {k['name']}: n/a ({why})", flush=True)
        else:
            built[k["name"]] = c
    live = list(built)
    for r in range(args.rounds):
        for n in [live[(r + j) % len(live)] for j in range(len(live))]:
            c = built[n]
            per[n].append(c.batch * c.seq / c.time_steps(args.steps))
        print(f"[bench] {preset} round {r + 1}/{args.rounds}: "
              + ", ".join(f"{n} {per[n][-1]:,.0f}" for n in live) + " tokens/s", flush=True)
    for n, c in built.items():
        done[n] = {**c.result(per[n]), "rounds_mode": mode}
        c.free()
    return [done[n] for n in names]


def markdown(rows: list[dict]) -> str:
    """Table: median tokens/s; "vs bf16" = the median of per-round ratios to the same preset's bf16
    row (one round: the plain ratio), with their min-max over the rounds when there are several.
    A row with "na" has n/a cells; the reasons follow the table, one line each."""
    lines = ["| preset | config | tokens/s | ms/step | vs bf16 | peak mem GB |", "|---|---|---|---|---|---|"]
    base = {r["preset"]: r for r in rows if r["config"] == "bf16" and not r.get("na")}
    notes = []
    for r in rows:
        if r.get("na"):
            lines.append(f"| {r['preset']} | {r['config']} | n/a | n/a | n/a | n/a |")
            notes.append(f"n/a: {r['preset']} {r['config']}: {r['na']}")
            continue
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
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--presets", default=None, help="comma list (default: gpu-50m,gpu-125m on CUDA, smoke on CPU)")
    ap.add_argument("--configs", default="bf16," + ",".join(f"fp8/{s}" for s in SCOPES),
                    help="comma list of bf16, fp8/<scope>[@row|@tile|@tile-loop] and torchao/<recipe> "
                         f"(recipes: {', '.join(TAO.RECIPES)})")
    ap.add_argument("--delta-mode", default="delta_matching", choices=["stale", "matched_do", "delta_matching"])
    ap.add_argument("--scaling", default="row", choices=["row", "tile"],
                    help="scaling recipe of the fp8 configs without an @ suffix (numerics.md section 9)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per config (per round)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="R > 1: all configs of a preset kept alive and timed in R interleaved rounds (median)")
    ap.add_argument("--rounds-mode", default="auto", choices=["auto", "keep", "rebuild"],
                    help="with --rounds > 1: keep every config built, or rebuild each in every round (auto: "
                         "rebuild when the configs' weights, gradients and AdamW state exceed half the GPU)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--packed", action="store_true",
                    help="packed documents (per-document causal attention; random separators)")
    ap.add_argument("--doc-len", type=int, default=512, help="mean document length with --packed")
    ap.add_argument("--activation-checkpointing", default="preset", choices=["preset", "on", "off"],
                    help="recompute each block in backward (default: as the preset sets it; gpu-1b: on)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile(model) for every config (default off; torchao float8 is meant to run "
                         "compiled, so compare torchao with fp8attn with --compile)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend with --compile (aot_eager: a CPU smoke without code generation)")
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
    if args.compile:
        # NOTE: every config compiles its own model (the same forward code objects): room for
        # all of them before dynamo would fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   8 * len(configs) * len(presets))
        if any(k["torchao"] for k in configs):
            TAO.patch_inductor_up_front(device)   # every config compiled alike (torchao_float8.py)
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
            "packed": args.packed, "compile": args.compile, "rounds_mode": args.rounds_mode,
            "compile_backend": args.compile_backend if args.compile else None,
            "torchao": TAO.version() if any(k["torchao"] for k in configs) else None,   # only imported if used
            "total_s": time.perf_counter() - t_all, "rows": rows}
    print()
    print(f"device {info['device']}, torch {info['torch']}, bf16 attention: {bf16_attn}, "
          f"fp8 delta mode {args.delta_mode}, scaling {args.scaling} (unless @), {args.warmup} warm-up + {args.steps} timed steps per config"
          f"{' x %d interleaved rounds (median)' % args.rounds if args.rounds > 1 else ''}"
          f"{', packed documents (mean length %d)' % args.doc_len if args.packed else ''}"
          f"{', torch.compile (%s)' % args.compile_backend if args.compile else ', eager'}"
          f"{', rounds mode %s' % args.rounds_mode if args.rounds > 1 else ''}"
          f"{', torchao %s' % info['torchao'] if any(k['torchao'] for k in configs) else ''}")
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
