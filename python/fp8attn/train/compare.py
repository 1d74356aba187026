"""Runs the same training once per attention mode and writes a comparison report.

    python -m fp8attn.train.compare --preset cpu-tiny \
        --modes bf16,fp8-stale,fp8-matched_do,fp8-delta_matching --steps 300 --out runs/cpu-tiny

Recipe variants (an A/B of FP8 recipes in one run: same init, same batch order): an
fp8attn mode (fp8-stale, fp8-matched_do, fp8-delta_matching) may be listed as
`<mode>[@row|@tile][+hadamard][+smooth_k]`, e.g.
    --modes bf16,fp8-delta_matching,fp8-delta_matching@tile,fp8-delta_matching@tile+hadamard+smooth_k
The suffixes override --scaling / --qk-rotation / --smooth-k for that entry only (an
entry without them uses the flags); the delta mode is the base mode's. The name is the
mode's name everywhere (<mode>.jsonl, <mode>.pt, summary.json, report rows) and must be
canonical: suffixes in the order @scaling, +hadamard, +smooth_k, each at most once (another
order is refused, naming the canonical spelling). Refused too: suffixes on bf16 / fp8-cudnn,
unknown suffixes, and two entries of the same configuration (fp8-delta_matching with
--scaling tile next to fp8-delta_matching@tile). Each mode's own recipe is in its log's
meta model config, in summary.json ("fp8_recipes") and in report.md.

Mode fp8-cudnn (cuDNN's FP8 SDPA with TransformerEngine-style delayed scaling, the
row "what a user would pick instead"; fp8attn.cudnn_fp8_attention) runs only on a
CUDA sm_90 GPU at head_dim 128 with the cuDNN frontend (pip install
nvidia-cudnn-frontend), without --packed / --context-parallel, and once its graphs
built and passed their self-check at the run's shape. Elsewhere it is skipped: the
reason is printed ("[compare] fp8-cudnn skipped: ..."), the other modes run, and the
report lists the mode as skipped with the reason (summary.json "skipped"). Its
delayed scaling: --model cudnn_amax_history_len=N (default 1024, TE's), cudnn_margin=M.

Data parallel: `torchrun --nproc_per_node N -m fp8attn.train.compare ...` (DDP,
gloo on CPU / nccl on CUDA; see ddp.py); rank 0 prepares data and writes logs.
`--fsdp` shards with FSDP2 instead of DDP. `--context-parallel N` shards every sequence
over groups of N ranks (trainer.setup_context_parallel; the groups are data-parallel).

Precision scope of the fp8 modes: `--scope attn-core` (default: only the
attention core is FP8), `attn-core+projections` (+ QKV and output projections
as FP8Linear), `attn-core+projections+ffn` (+ the SwiGLU FFN); the bf16 mode is
BF16 everywhere. `--packed`: per-document causal attention inside each batch row
(documents split at <|endoftext|>; see model.py).

Writes <out>/provenance.json (command, versions; first), <out>/<mode>.jsonl
(trainer log per mode), <out>/<mode>.pt (final model, unless --no-save; see
checkpoint.py), <out>/summary.json (with the provenance), <out>/report.md, loss.png, qk_gain.png, rowsum.png; prints the table
and, last, the report path. Model shape overrides: --model KEY=VALUE (e.g. the
stress configuration of scripts/results_study.sh: --model head_dim=256,n_heads=2,n_kv_heads=1).
Every mode gets the same initial weights (checked), the same batches and the
same hyper-parameters; only model.attn_mode (and a recipe variant's fp8_* fields) differs.

Split runs (GPU time comes in calls of limited length): `--deadline-s S` stops
every mode cleanly after the step that would otherwise cross S seconds of wall
time since the command started, and writes its full training state
<out>/<mode>.state.pt (model, AdamW state, step, batch-order and global RNG
states, summary accumulators; see state.py); modes not reached are left
unstarted. The summary then says steps_done < steps ("complete": false), and
summary.json ("complete": false) and report.md are still written. `--resume`
continues every mode from its state (appending to its log; a complete mode is
skipped, an unstarted one starts), so a run split over any number of calls ends
with the same weights and loss curve as an uninterrupted one (bit for bit on the
CPU with the same thread count). The flags that define the run (preset, modes,
steps, lr, seeds, batch/seq, model, data, world size) are recorded in
<out>/run_config.json and a --resume with different ones is refused, naming the
flag. `--state-every K` also saves the state every K steps (a call killed from
outside then loses at most K steps). Not with --fsdp (refused). Testing:
`--stop-after-steps N` stops each mode after N steps of this call (deterministic split).
"""
from __future__ import annotations

import argparse
import argparse as _argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from . import ddp, provenance, state
from .data import prepare
from .model import (ATTN_MODES, CUDNN_MODE, FP8ATTN_MODES, MODE_GRAMMAR, PRESETS, SCOPES, ModelConfig,
                    mode_model_config, parse_mode, preset_model_config)

# The modes a plain run trains. NOTE: fp8-cudnn (cuDNN FP8 SDPA) is CPU-tested against an
# emulated frontend only; it joins the default once its GPU tests have passed on the H200.
DEFAULT_MODES = tuple(m for m in ATTN_MODES if m != CUDNN_MODE)
from .report import write_report
from .trainer import OPTIMIZERS, StopRule, TrainConfig, cudnn_unavailable_reason, resolve_device, train_mode

# Corpus cap (MB of text) per preset: enough tokens for the preset's run.
DATA_MAX_MB = {"smoke": 1.0, "cpu-tiny": 10.0, "gpu-50m": 32.0, "gpu-125m": 32.0, "gpu-350m": 32.0, "gpu-1b": 32.0}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Compare attention modes on the same training run.")
    ap.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated subset of {','.join(ATTN_MODES)} (default {','.join(DEFAULT_MODES)}: "
                         f"{CUDNN_MODE} is opt-in until its GPU path has run on the H200); an fp8attn mode may "
                         f"also be listed as a recipe variant {MODE_GRAMMAR} (e.g. fp8-delta_matching@tile+hadamard), "
                         "whose suffixes override --scaling / --qk-rotation / --smooth-k for that entry only; "
                         "suffixes in that order, each at most once")
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--diag-every", type=int, default=10, help="diagnostics cadence in steps (0 = off)")
    ap.add_argument("--val-every", type=int, default=None, help="default: steps // 5")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-seed", type=int, default=4321)
    ap.add_argument("--no-qk-norm", action="store_true", help="drop QK-RMSNorm")
    ap.add_argument("--nope", action="store_true", help="no positional encoding (instead of RoPE)")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="override a ModelConfig field of the preset, e.g. --model head_dim=256 "
                         "--model n_heads=2 (repeatable; comma-separated pairs also accepted)")
    ap.add_argument("--save-at", default="", help="comma-separated step counts after which each mode's "
                                                   "model is also saved (<mode>.step<N>.pt)")
    ap.add_argument("--no-save", action="store_true", help="do not save the final model (<mode>.pt)")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--text-dir", default=None, help="train on text files from here instead of linux-doc")
    ap.add_argument("--max-mb", type=float, default=None, help="corpus cap in MB (default per preset)")
    ap.add_argument("--scope", default="attn-core", choices=list(SCOPES),
                    help="which matmuls the fp8 modes run in FP8 (the bf16 mode stays BF16)")
    ap.add_argument("--scaling", default="row", choices=["row", "tile"],
                    help="FP8 scaling recipe of the fp8 modes' attention core (docs/numerics.md section 9; "
                         "both run on the CPU reference and on the CUDA kernels; tile's are the faster)")
    ap.add_argument("--qk-rotation", default="none", choices=["none", "hadamard"],
                    help="rotate Q and K by a fixed Hadamard transform before FP8 quantization in the fp8 modes "
                         "(incoherent processing, docs/numerics.md section 10; unfused on CUDA)")
    ap.add_argument("--grad-format", default="e4m3", choices=["e4m3", "e5m2"],
                    help="FP8 format of the fp8 modes' attention-backward gradient codes (dO, dS; "
                         "docs/numerics.md sections 2-3): e5m2 trades mantissa for range (issue 23's "
                         "search: a larger dO mismatch for the stale delta)")
    ap.add_argument("--smooth-k", action="store_true",
                    help="subtract the mean key before FP8 quantization in the fp8 modes (K smoothing, "
                         "docs/numerics.md section 10; unfused on CUDA)")
    ap.add_argument("--arch", default="gqa", choices=["gqa", "gdn-hybrid"],
                    help="gqa (every layer attention) or gdn-hybrid: Gated DeltaNet layers (fla-core) with an "
                         "attention layer every --model gdn_ratio+1 (default 3: GDN, GDN, GDN, attention)")
    ap.add_argument("--activation-checkpointing", default=None, choices=["on", "off"],
                    help="recompute each transformer block in backward (default: the preset's; gpu-1b: on)")
    ap.add_argument("--packed", action="store_true",
                    help="per-document causal attention from <|endoftext|> separators in each row")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP under torchrun")
    ap.add_argument("--context-parallel", type=int, default=1, metavar="N",
                    help="under torchrun: shard each sequence over groups of N ranks (zigzag; fp8 modes: ring "
                         "attention with a global Delta-Matching delta, bf16: SDPA over all-gathered K/V); the "
                         "groups are data-parallel (world / N); seq_len a multiple of 2N; not with --packed")
    ap.add_argument("--init-from", default="", metavar="PATH",
                    help="start from trained weights (fresh optimizer and LR schedule): a run directory (each mode "
                         "from its own <mode>.pt) or one checkpoint file (every mode from it); with --seq-len, "
                         "--lr and --model rope_base=... a long-context continuation")
    ap.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                    help="adamw, or muon: torch.optim.Muon on the hidden weight matrices (update RMS matched to "
                         "AdamW's, same LR schedule) with AdamW on embeddings, head, norms and gains")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", required=True, help="run directory, e.g. runs/cpu-tiny")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall-time budget of this call in seconds: stop each mode after the step that "
                         "would cross it, save <mode>.state.pt, mark the run incomplete (continue with --resume)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out from its saved states (same flags required)")
    ap.add_argument("--state-every", type=int, default=0,
                    help="also save each mode's training state every K steps (0 = only when stopping)")
    ap.add_argument("--stop-after-steps", type=int, default=None, help=_argparse.SUPPRESS)  # testing
    args = ap.parse_args(argv)
    args.command = provenance.module_command("fp8attn.train.compare", argv)  # recorded in summary.json
    return args


# ModelConfig fields `--model` may set (the others have their own flags or are set from the data).
_OVERRIDABLE = {"d_model": int, "n_layers": int, "n_heads": int, "n_kv_heads": int, "head_dim": int,
                "mlp_hidden": int, "rope_base": float, "fp8_block_size": int, "init_std": float, "gdn_ratio": int,
                "cudnn_amax_history_len": int, "cudnn_margin": int}


def parse_model_overrides(items: list[str]) -> dict:
    """["head_dim=256", "n_heads=2,n_kv_heads=1"] -> {"head_dim": 256, "n_heads": 2, "n_kv_heads": 1}.
    Raises SystemExit naming --model for an unknown field or a bad value."""
    out = {}
    for item in items:
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, sep, val = pair.partition("=")
            key = key.strip()
            if not sep or key not in _OVERRIDABLE:
                raise SystemExit(f"--model: expected KEY=VALUE with KEY in {sorted(_OVERRIDABLE)}, got {pair!r}")
            if key in out:
                raise SystemExit(f"--model: {key} given twice")
            try:
                out[key] = _OVERRIDABLE[key](val)
            except ValueError:
                raise SystemExit(f"--model: {key} needs {'an int' if _OVERRIDABLE[key] is int else 'a float'}, "
                                 f"got {val!r}") from None
    return out


def parse_modes(text: str, scaling: str = "row", qk_rotation: str = "none", smooth_k: bool = False) -> list[str]:
    """The --modes list: canonical mode names (model.parse_mode: attention modes and recipe
    variants of the fp8attn modes), in the order given. scaling / qk_rotation / smooth_k:
    the run's --scaling / --qk-rotation / --smooth-k, which a variant's suffixes override.
    Raises SystemExit naming --modes for an empty list, an entry that does not parse (the
    entry, what is allowed), a repeated entry, or two entries of the same configuration."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise SystemExit(f"--modes: unknown or empty mode list {text!r}; choose from {','.join(ATTN_MODES)}")
    specs = []
    for m in modes:
        try:
            specs.append(parse_mode(m))
        except ValueError as exc:
            raise SystemExit(f"--modes: {exc}") from None
    if len(set(modes)) != len(modes):
        # NOTE: a repeated mode would train again and overwrite its own log and checkpoint.
        raise SystemExit(f"--modes: a mode is listed twice in {text!r}")
    seen = {}
    for spec in specs:
        key = (spec.base,)
        if spec.base in FP8ATTN_MODES:
            key += (spec.scaling or scaling, spec.qk_rotation or qk_rotation,
                    smooth_k if spec.smooth_k is None else spec.smooth_k)
        if key in seen:
            raise SystemExit(f"--modes: {seen[key]!r} and {spec.name!r} are the same configuration ({spec.base}, "
                             f"scaling {key[1]}, qk_rotation {key[2]}, smooth_k {key[3]} with --scaling {scaling}, "
                             f"--qk-rotation {qk_rotation}{', --smooth-k' if smooth_k else ''}); list it once")
        seen[key] = spec.name
    return modes


def mode_recipes(modes: list[str], model_cfg: ModelConfig) -> dict:
    """{mode: its FP8 attention recipe} of the fp8attn modes (variants included):
    {"attn_mode", "scaling", "qk_rotation", "smooth_k"} of mode_model_config."""
    out = {}
    for m in modes:
        c = mode_model_config(model_cfg, m)
        if c.attn_mode in FP8ATTN_MODES:
            out[m] = {"attn_mode": c.attn_mode, "scaling": c.fp8_scaling, "qk_rotation": c.fp8_qk_rotation,
                      "smooth_k": c.fp8_smooth_k}
    return out


def model_configs(preset: str, modes: list[str], fields: dict):
    """The preset's ModelConfig with `fields`, checked for every mode before any training
    (an invalid fp8 configuration must not surface after the bf16 mode has trained).
    Raises SystemExit naming --model for an invalid configuration."""
    try:
        cfg = preset_model_config(preset, **fields)
        for mode in modes:
            mode_model_config(cfg, mode)
    except ValueError as exc:
        raise SystemExit(f"--model: invalid model configuration: {exc}") from None
    return cfg


def skip_unavailable_modes(modes: list[str], model_cfg: ModelConfig, cfg: TrainConfig, say=print):
    """(modes that can run, {skipped mode: reason}): fp8-cudnn is dropped where it cannot
    run (no CUDA sm_90 device, head_dim != 128, no cuDNN frontend, --packed,
    --context-parallel, or its graphs fail to build / self-check at the run's shape),
    saying why; every other mode runs everywhere."""
    skipped = {}
    if CUDNN_MODE in modes:
        why = cudnn_unavailable_reason(ModelConfig(**{**model_cfg.to_dict(), "attn_mode": CUDNN_MODE}), cfg,
                                       resolve_device(cfg.device))
        why = agreed_reason(why)
        if why is not None:
            skipped[CUDNN_MODE] = why
            rest = [m for m in modes if m != CUDNN_MODE]
            say(f"[compare] {CUDNN_MODE} skipped: {why}" + ("; the other modes run" if rest else ""), flush=True)
    return [m for m in modes if m not in skipped], skipped


def agreed_reason(why):
    """Under torchrun, one decision for every rank: the mode is skipped on all ranks if any
    rank cannot run it (ranks training different modes would average unrelated gradients),
    the reason naming each such rank; without a process group, `why` itself."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return why
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, why)
    bad = [(r, w) for r, w in enumerate(reasons) if w is not None]
    if not bad:
        return None
    if len(bad) == len(reasons) and len({w for _, w in bad}) == 1:
        return bad[0][1]  # every rank, the same reason
    return "; ".join(f"rank {r}: {w}" for r, w in bad)


def mode_line(s: dict) -> str:
    """One progress line per finished mode (a mode that diverged at once has no losses)."""
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"
    part = "" if s.get("complete", True) else f" (incomplete: {s.get('steps_done')} steps done)"
    return (f"[compare] {s['mode']}{part}: train loss {fmt(s['final_train_loss'])}, val loss {fmt(s['final_val_loss'])}, "
            f"{s['train_time_s']:.0f} s" + (" (DIVERGED)" if s.get("diverged") else ""))


def run(args) -> tuple[Path, str, list[dict]]:
    """Trains every mode (or continues them, --resume) and writes logs, summary.json and
    report.md; returns (report path, table, summaries); (None, "", summaries) on a
    non-zero DDP rank. Raises SystemExit naming the flag for a bad or changed flag."""
    t_begin = time.time()
    modes = parse_modes(args.modes, args.scaling, args.qk_rotation, args.smooth_k)
    for flag in ("steps", "batch_size", "seq_len", "val_batches"):
        val = getattr(args, flag)
        if val is not None and val < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be >= 1, got {val}")
    deadline_s, stop_after = getattr(args, "deadline_s", None), getattr(args, "stop_after_steps", None)
    resume, state_every = getattr(args, "resume", False), getattr(args, "state_every", 0) or 0
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise SystemExit(f"--deadline-s: must be finite and > 0, got {deadline_s}")
    if stop_after is not None and stop_after < 1:
        raise SystemExit(f"--stop-after-steps: must be >= 1, got {stop_after}")
    if state_every < 0:
        raise SystemExit(f"--state-every: must be >= 0, got {state_every}")
    if args.fsdp:
        for flag, on in (("--resume", resume), ("--deadline-s", deadline_s is not None),
                         ("--state-every", state_every > 0), ("--stop-after-steps", stop_after is not None)):
            if on:
                raise SystemExit(f"{flag}: not supported with --fsdp (the sharded AdamW state is not gathered "
                                 f"into the training state); use DDP (no --fsdp) or one process")
    init_from = getattr(args, "init_from", "") or ""
    init_missing = {}   # fp8-cudnn's missing checkpoint: an error only if the mode is not skipped (below)
    if init_from:
        from .checkpoint import FORMAT, check_intact
        from .trainer import init_checkpoint
        init_saved = {}   # mode -> (checkpoint, its model_config, its tokenizer_sha1): checked after data prep
        for m in modes:
            try:
                ck = init_checkpoint(init_from, m)
            except FileNotFoundError as exc:
                why = str(exc).removeprefix("init_from: ")   # the trainer's own prefix, not twice
                if m == CUDNN_MODE:   # NOTE: a run whose fp8-cudnn was skipped has no fp8-cudnn.pt
                    init_missing[m] = f"--init-from: {why}"
                    continue
                raise SystemExit(f"--init-from: {why}") from None
            # A file that is not a checkpoint is named here, before any work (it was a
            # torch.load traceback after the data preparation).
            try:
                obj = torch.load(ck, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001  (any unreadable file: pickle, zip, EOF errors)
                raise SystemExit(f"--init-from: {ck} is not a readable {FORMAT} checkpoint "
                                 f"({type(exc).__name__})") from None
            try:
                check_intact(ck)   # NOTE: torch.load does not check the zip CRCs
            except ValueError as exc:
                raise SystemExit(f"--init-from: {exc}") from None
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise SystemExit(f"--init-from: {ck} is not an {FORMAT} checkpoint")
            if not isinstance(obj.get("model_config"), dict):
                raise SystemExit(f"--init-from: {ck} holds no model_config (not a complete checkpoint)")
            init_saved[m] = (ck, obj["model_config"], obj.get("tokenizer_sha1"))
            del obj
    if args.fsdp and getattr(args, "optimizer", "adamw") == "muon":
        raise SystemExit("--optimizer muon: not supported with --fsdp (Muon orthogonalizes whole matrices; "
                         "FSDP2 shards them); use DDP (no --fsdp) or one process")
    cp_n = getattr(args, "context_parallel", 1)
    if cp_n < 1:
        raise SystemExit(f"--context-parallel: must be >= 1, got {cp_n}")
    if cp_n > 1 and args.packed:
        raise SystemExit("--context-parallel: not supported with --packed")
    for flag in ("warmup", "diag_every", "val_every", "threads"):
        val = getattr(args, flag)
        if val is not None and val < 0:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be >= 0, got {val}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr: must be finite and > 0, got {args.lr}")
    preset = PRESETS[args.preset]
    model_overrides = parse_model_overrides(args.model)
    if args.max_mb is not None and not args.max_mb > 0:
        raise SystemExit(f"--max-mb: must be > 0, got {args.max_mb}")
    try:
        save_at = tuple(sorted({int(x) for x in args.save_at.split(",") if x.strip()}))
    except ValueError:
        raise SystemExit(f"--save-at: expected comma-separated integers, got {args.save_at!r}") from None
    tp = dict(preset["train"])
    for key in ("steps", "batch_size", "seq_len", "lr", "warmup"):
        if getattr(args, key) is not None:
            tp[key] = getattr(args, key)
    bad_at = [n for n in save_at if not 1 <= n <= tp["steps"]]
    if bad_at:
        # NOTE: a step outside the run would silently never be saved.
        raise SystemExit(f"--save-at: step counts must be in [1, {tp['steps']}] (the run's steps), got {bad_at}")
    tp["warmup"] = min(tp["warmup"], max(1, tp["steps"] // 10)) if args.warmup is None else tp["warmup"]
    cfg = TrainConfig(**tp, diag_every=args.diag_every, val_batches=args.val_batches, seed=args.seed,
                      data_seed=args.data_seed, device=args.device, threads=args.threads,
                      progress=not args.no_progress, fsdp=args.fsdp,
                      val_every=args.val_every or max(1, tp["steps"] // 5),
                      loss_avg_last=max(3, min(20, tp["steps"] // 10)),
                      save_final=not args.no_save, save_at=save_at,
                      optimizer=getattr(args, "optimizer", "adamw"), init_from=str(init_from),
                      context_parallel=cp_n)

    ac = getattr(args, "activation_checkpointing", None)
    if ac is not None:
        model_overrides = {**model_overrides, "activation_checkpointing": ac == "on"}
    model_overrides = {**model_overrides, "arch": getattr(args, "arch", "gqa")}
    if cp_n > 1 and model_overrides["arch"] != "gqa":
        raise SystemExit(f"--context-parallel: not supported with --arch {model_overrides['arch']}")
    model_fields = {**model_overrides, "qk_norm": not args.no_qk_norm, "rope": not args.nope,
                    "scope": args.scope, "packed": args.packed, "fp8_scaling": args.scaling,
                    "fp8_qk_rotation": args.qk_rotation, "fp8_smooth_k": args.smooth_k,
                    "fp8_grad_format": getattr(args, "grad_format", "e4m3"),
                    "max_seq_len": max(cfg.seq_len, preset["model"]["max_seq_len"])}
    model_configs(args.preset, modes, model_fields)   # NOTE: fail before any data or training work
    # After every other flag check (their tests pass a missing --text-dir on purpose).
    text_dir = getattr(args, "text_dir", None)
    if text_dir and not os.path.isdir(text_dir):
        raise SystemExit(f"--text-dir: {text_dir} is not a directory")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available to torch (torch.cuda.is_available() is False); "
                         "use --device cpu or auto")

    ctx = ddp.init_from_env(args.device)  # no-op unless started by torchrun with WORLD_SIZE > 1
    say = print if ctx.is_main else (lambda *a, **k: None)
    if cp_n > 1 and (not ctx.enabled or ctx.world_size % cp_n):
        raise SystemExit(f"--context-parallel {cp_n}: needs torchrun with a world size that {cp_n} divides, got "
                         f"{ctx.world_size if ctx.enabled else 'no process group'}")
    if cp_n > 1 and cfg.seq_len % (2 * cp_n):
        raise SystemExit(f"--context-parallel {cp_n}: seq_len {cfg.seq_len} must be a multiple of {2 * cp_n} "
                         "(equal zigzag chunks)")
    modes, skipped = skip_unavailable_modes(modes, preset_model_config(args.preset, **model_fields), cfg, say)
    if not modes:
        raise SystemExit("--modes: nothing to run: " + "; ".join(f"{m} skipped: {r}" for m, r in skipped.items()))
    if CUDNN_MODE in init_missing and CUDNN_MODE in modes:
        raise SystemExit(init_missing[CUDNN_MODE])
    if init_from:
        init_saved = {m: v for m, v in init_saved.items() if m in modes}
    if args.fsdp and not ctx.enabled:
        # NOTE: FSDP2 needs a process group; a plain one-process run trains unsharded.
        say("[compare] NOTE: --fsdp has no effect without a process group (start with torchrun); "
            "training unsharded", flush=True)
    model_vocab = preset["model"]["vocab_size"]
    t_data = time.time()

    def prepare_data():
        return prepare(args.data_dir, vocab_size=model_vocab,
                       max_mb=args.max_mb or DATA_MAX_MB.get(args.preset, 32.0), text_dir=args.text_dir)

    # NOTE: rank 0 builds the corpus; the other ranks then load what it wrote.
    data = prepare_data() if ctx.is_main else None
    ddp.barrier(ctx)
    if data is None:
        data = prepare_data()
    # NOTE: a tiny corpus can give fewer BPE merges than asked; size the model to the tokenizer.
    model_cfg = model_configs(args.preset, modes, {**model_fields, "vocab_size": data.meta["vocab_size"]})
    if init_from:
        # NOTE: another architecture is named here, before any training (it was a
        # ValueError traceback from inside the first mode's training).
        from .trainer import INIT_FROM_FREE, init_arch_mismatches
        for m, (ck, saved, tok) in init_saved.items():
            # NOTE: same vocab_size is not the same tokenizer (byte-level BPE pads every corpus
            # to the size asked); checkpoints written before tokenizer_sha1 existed say None.
            if tok is not None and tok != data.tokenizer_sha1():
                raise SystemExit(f"--init-from: {ck} was trained with another tokenizer (sha1 {tok[:12]}, this "
                                 f"corpus's {data.tokenizer_sha1()[:12]} in {data.root}): its token ids mean "
                                 "other strings; continue on the same --text-dir / --data-dir")
            bad = init_arch_mismatches(mode_model_config(model_cfg, m).to_dict(), saved)
            if bad:
                raise SystemExit(f"--init-from: {ck} has another architecture: " + "; ".join(bad)
                                 + f" (a continuation may change only {', '.join(INIT_FROM_FREE)})")
    out = Path(args.out)
    run_cfg = state.run_config(preset=args.preset, modes=modes, train_config=cfg.to_dict(),
                               model_config=model_cfg.to_dict(), data_meta=data.meta,
                               world_size=ctx.world_size if ctx.enabled else 1)
    if resume:
        saved_cfg = state.read_run_config(out)
        if saved_cfg is None:
            raise SystemExit(f"--resume: {out} holds no run to resume ({state.RUN_CONFIG} is missing); "
                             f"start it without --resume")
        bad = state.config_mismatches(saved_cfg, json.loads(json.dumps(run_cfg)))
        if bad:
            raise SystemExit("--resume: the command differs from the saved run in " + out.as_posix() + ": "
                             + "; ".join(bad))
    ddp.barrier(ctx)   # NOTE: every rank has checked before rank 0 writes anything
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            state.write_run_config(out, run_cfg)
        # NOTE: written first, so a run cut short still names its command and versions.
        (out / "provenance.json").write_text(json.dumps(provenance.collect(getattr(args, "command", None)), indent=1))
    dev = resolve_device(cfg.device)
    say(f"[compare] preset {args.preset} on {dev}: {len(modes)} modes x {cfg.steps} steps x "
          f"{cfg.batch_size} x {cfg.seq_len} tokens, fp8 scope {args.scope}"
          f"{', packed documents' if args.packed else ''}{', FSDP2' if args.fsdp and ctx.enabled else ''} -> {out}",
        flush=True)
    t_data = time.time() - t_data
    stop = None
    if deadline_s is not None or stop_after is not None:
        stop = StopRule(deadline=None if deadline_s is None else t_begin + deadline_s, max_steps=stop_after)
    summaries, t0 = [], time.time()
    for mode in modes:
        summaries.append(train_mode(mode, model_cfg, cfg, data, out / f"{mode}.jsonl", stop=stop,
                                    resume=resume, state_every=state_every))
        say(mode_line(summaries[-1]), flush=True)
    complete = all(s.get("complete", True) for s in summaries)
    if not complete:
        say("[compare] run INCOMPLETE (" + ", ".join(f"{s['mode']} {s['steps_done']}/{cfg.steps}"
                                                      for s in summaries) + " steps); continue with --resume",
            flush=True)
    t_train = time.time() - t0
    say(f"[compare] data preparation {t_data:.0f} s, training of {len(modes)} modes {t_train:.0f} s", flush=True)
    fps = {s["init_fingerprint"] for s in summaries}
    # NOTE: --init-from a run directory continues each mode from its own weights (the
    # continuation's point); from scratch or from one checkpoint, all modes start alike.
    per_mode_init = bool(cfg.init_from) and Path(cfg.init_from).is_dir()
    if len(fps) != 1 and not per_mode_init:
        raise RuntimeError(f"modes started from different weights (fingerprints {fps}); the comparison is invalid")
    if not ctx.is_main:
        return None, "", summaries
    (out / "summary.json").write_text(json.dumps({"preset": args.preset, "modes": modes, "skipped": skipped,
                                                  "complete": complete,
                                                  "fp8_recipes": mode_recipes(modes, model_cfg),
                                                  "steps": cfg.steps, "scope": args.scope,
                                                  "packed": args.packed, "fsdp": bool(args.fsdp and ctx.enabled),
                                                  "context_parallel": cp_n,
                                                  "data_time_s": t_data, "train_time_s": t_train,
                                                  "summaries": summaries,
                                                  "provenance": provenance.collect(getattr(args, "command", None))},
                                                 indent=1))
    path, table = write_report(out, modes, skipped=skipped)
    return path, table, summaries


def main(argv=None) -> None:
    args = parse_args(argv)
    ok = False
    try:
        path, table, _ = run(args)
        ok = True
    finally:
        # NOTE: every process group torn down on every exit (a group left to the interpreter's
        # exit aborted it now and then); the barrier only after success: after a failure
        # the peers may never reach it (ddp.shutdown bounds the teardown at 60 s).
        ddp.shutdown(wait=ok)
    if path is None:  # a non-zero DDP rank: rank 0 prints
        return
    print()
    print(table)
    print()
    print(f"report: {path}")


if __name__ == "__main__":
    main()
