"""Training loop for one attention mode, logging everything the comparison needs.

Precision: on CUDA the parameters and AdamW state stay FP32 ("master weights")
and the forward/backward runs under torch.autocast(bfloat16); on CPU
everything is FP32. In both cases the attention core sees BF16 Q/K/V (see
model.attention_backend).

Reproducibility across modes: the model is built right after
torch.manual_seed(seed) and the attention mode adds no parameters (fp8-cudnn adds
buffers: its delayed-scaling state, outside the fingerprint), so every
mode starts from identical weights (`init_fingerprint` is logged and checked by
the comparison runner); batch offsets come from numpy's PCG64(data_seed), so
every mode sees the same batches in the same order; val loss uses the same
fixed val batches.

JSONL log (one object per line, field "type"):
  meta    mode, model/train config, param count, init_fingerprint, device, data meta
  step    step, loss, lr, grad_norm, step_time_s, tokens_per_s,
          max_gain / top4_share (max over layers) and gains {layer: [max_gain, top4_share]},
          every diag_every steps (all modes): act_scales {layer: [max_scale, top4_share]},
          the same statistics of the Q/K channel scales (capture.ActivationScales;
          defined with or without QK-norm), and attn_logits {layer: [logit_std,
          logit_max, entropy_mean]} (capture.attention_logit_stats; unpacked runs);
          the summary keeps logit_std_max / entropy_min of the last such step,
          every diag_every steps for fp8 modes: diag {layer: stats} and the
          aggregates eps_absmean, eps_absmax, rowsum_pre_mean/max, rowsum_post_mean/max
          (fp8attn.diagnostics, numerics.md section 5; means over rows, max over rows)
  val     step, val_loss
  summary final numbers (see `train_mode` return value)

Checkpoints (checkpoint.py): `<log stem>.pt` after the last step (save_final)
and `<log stem>.step<N>.pt` after step N for N in save_at, rank 0 only.

Split runs (state.py; compare --deadline-s / --stop-after-steps / --resume):
with a StopRule the loop stops cleanly after a step when the wall-clock deadline
would be passed by the next step (or after max_steps steps in this call), writes
the full training state to `<log stem>.state.pt` (model, AdamW state, step,
batch-order RNG, global RNGs, summary accumulators) and ends the log with a
summary whose "complete" is False (steps_done < steps). resume=True loads that
state, truncates the log to the saved step (dropping the incomplete summary and
any lines a killed call wrote after its last state) and appends from there: the
weights and per-step losses equal those of an uninterrupted run (bit for bit on
the CPU with the same thread count). A mode whose log already ends in a complete
summary is not trained again (its summary is returned). The state file is
removed once the mode completes. FSDP2 is not supported (the sharded AdamW state
is not gathered); compare refuses the combination.

Data parallel (torchrun, see ddp.py): when a process group is initialized the
model is wrapped in DistributedDataParallel, rank r trains on every
world_size-th batch of the shared order (offset r), the logged loss is the mean
over ranks, tokens_per_s counts all ranks, only rank 0 writes the log and runs
the val loss, and the summary adds world_size and final_fingerprints (one per
rank; differing ones raise RuntimeError). One process: unchanged. With
TrainConfig.fsdp (compare --fsdp) the model is sharded with FSDP2 instead of
DDP (ddp.wrap_model): parameters are DTensors, read through ddp.full() for the
fingerprints and gain statistics, and every rank runs the val loss.
Gradient clipping (ddp.clip_grad_norm, all cases): the total norm is computed
from float64 per-row sums of squares, gathered across FSDP2's shards, so it does
not depend on the sharding: with 2 ranks on the CPU, DDP and FSDP2 train bit for
bit alike (tests/python/test_fsdp.py says why torch's clip_grad_norm_ did not).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import ddp
from .capture import ActivationScales
from .checkpoint import save_checkpoint
from .state import load_state, restore_rngs, save_state, state_path
from .data import PreparedData, TokenStream
from .model import CUDNN_MODE, ModelConfig, Transformer, gain_stats, is_scaling_state_key, mode_model_config


@dataclass
class TrainConfig:
    """Optimization and logging settings (same for every mode of a comparison)."""
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1      # cosine decays to lr * min_lr_ratio
    warmup: int = 30
    weight_decay: float = 0.1      # on matrices only (norm/QK gains are not decayed)
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 1234               # model init
    data_seed: int = 4321          # batch order
    diag_every: int = 10           # record fp8attn backward diagnostics every k steps (0 = never)
    val_every: int = 100           # val loss every k steps (and at the last step)
    val_batches: int = 8
    loss_avg_last: int = 20        # "final train loss" = mean of the last k steps
    device: str = "auto"           # "auto" | "cpu" | "cuda"
    threads: int = 0               # CPU threads (0 = all cores)
    progress: bool = True
    fsdp: bool = False             # FSDP2 (fully_shard) instead of DDP when distributed (ddp.py)
    save_final: bool = True        # write the final model next to the log (checkpoint.py)
    save_at: tuple = ()            # also after these step counts
    optimizer: str = "adamw"       # "adamw" | "muon" (make_optimizer)
    init_from: str = ""            # "" = fresh init; else a run dir (<mode>.pt per mode) or one checkpoint
    context_parallel: int = 1      # ranks per context-parallel group (sequence sharded; setup_context_parallel)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StopRule:
    """When a call of a split run stops early (compare --deadline-s / --stop-after-steps).

    deadline: absolute time.time() after which no step may end (None = none); a
    step is not started when 1.5 x the last step time would cross it (the last
    step of this mode, else of the previous mode: step_time_s, kept here).
    max_steps: at most this many steps per mode in this call (None = no limit)."""
    deadline: float | None = None
    max_steps: int | None = None
    step_time_s: float = 0.0

    def stop_now(self, steps_this_call: int, last_dt: float) -> bool:
        """True if the next step must not run."""
        if self.max_steps is not None and steps_this_call >= self.max_steps:
            return True
        if last_dt:
            self.step_time_s = last_dt
        return self.deadline is not None and time.time() + 1.5 * (last_dt or self.step_time_s) > self.deadline


def log_is_complete(summary: dict | None, steps: int) -> bool:
    """True if a log's summary line marks the mode finished (all steps or diverged).
    Logs written before resume support have no "complete" field: steps_done decides."""
    if not summary:
        return False
    if "complete" in summary:
        return bool(summary["complete"])
    return bool(summary.get("diverged")) or summary.get("steps_done") == steps


def _truncate_log(path: Path, step: int) -> None:
    """Keeps the meta line and the step/val lines of steps < `step` (drops summaries and
    whatever a call wrote after its last saved state); adds a "resume" line."""
    keep = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        t = r.get("type")
        if t == "meta" or (t in ("step", "val") and r.get("step", step) < step) or (
                t == "resume" and r.get("step", step) < step):
            keep.append(line)
    keep.append(json.dumps({"type": "resume", "step": step}))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(keep) + "\n")
    tmp.replace(path)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(name)


def init_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and bytes (name order): equal iff same init.
    fp8-cudnn's delayed-scaling buffers are state, not weights: left out."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if is_scaling_state_key(name):
            continue
        h.update(name.encode())
        h.update(ddp.full(p).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def build_model(model_cfg: ModelConfig, seed: int) -> Transformer:
    """The model for model_cfg with weights drawn from torch.manual_seed(seed) (FP32, CPU)."""
    torch.manual_seed(seed)
    return Transformer(model_cfg)


# ModelConfig fields a continuation may change (context length, RoPE base, the init-only
# init_std, the attention backend and its FP8 options, activation checkpointing); every
# other field must match the checkpoint's.
INIT_FROM_FREE = ("max_seq_len", "rope_base", "init_std", "attn_mode", "scope", "packed", "fp8_block_size",
                  "fp8_scaling", "fp8_qk_rotation", "fp8_smooth_k", "fp8_grad_format", "activation_checkpointing",
                  "cudnn_amax_history_len", "cudnn_margin")


def init_checkpoint(init_from: str | os.PathLike, mode: str) -> Path:
    """The checkpoint a mode starts from: <init_from>/<mode>.pt for a run directory
    (each mode continues its own run), else init_from itself (one file for every mode).
    Raises FileNotFoundError naming the path."""
    from .checkpoint import checkpoint_path
    p = Path(init_from)
    ck = checkpoint_path(p, mode) if p.is_dir() else p
    if not ck.is_file():
        raise FileNotFoundError(f"init_from: no checkpoint {ck}" + (f" (mode {mode}'s, in run directory {p})"
                                                                    if p.is_dir() else ""))
    return ck


def init_arch_mismatches(mine: dict, theirs: dict) -> list[str]:
    """The ModelConfig fields outside INIT_FROM_FREE where a run's config (`mine`, a
    ModelConfig.to_dict()) and a checkpoint's saved one (`theirs`) differ, as
    "field saved -> wanted" strings ([] = the checkpoint can initialise the run)."""
    # NOTE: a field the checkpoint predates reads as its default (as load_checkpoint's
    # ModelConfig(**saved) does), so older checkpoints of the same architecture continue.
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    saved = {k: theirs.get(k, defaults.get(k)) for k in mine}
    return [f"{k} {saved[k]!r} -> {mine[k]!r}" for k in mine if k not in INIT_FROM_FREE and saved[k] != mine[k]]


def load_init_weights(model: Transformer, path: str | os.PathLike) -> dict:
    """Loads a training checkpoint's weights (checkpoint.py format) into `model`: weights
    only (the optimizer starts fresh), for a continuation at a new seq_len / LR / RoPE
    base. Every ModelConfig field outside INIT_FROM_FREE must equal the checkpoint's
    (ValueError naming them). Returns the checkpoint's info (mode, step, configs)."""
    from .checkpoint import FORMAT, check_intact
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"init_from: {path} is not an {FORMAT} checkpoint")
    check_intact(path)
    bad = init_arch_mismatches(model.cfg.to_dict(), obj["model_config"])
    if bad:
        raise ValueError(f"init_from: {path} has another architecture: " + "; ".join(bad) +
                         f" (a continuation may change only {', '.join(INIT_FROM_FREE)})")
    model.load_state_dict(obj["state_dict"])
    return {k: v for k, v in obj.items() if k != "state_dict"}


def cudnn_unavailable_reason(model_cfg: ModelConfig, cfg: TrainConfig, device, build: bool = True) -> str | None:
    """Why mode fp8-cudnn cannot train this run on `device` (None: it can): the static
    checks of fp8attn.cudnn_fp8_attention.unavailable_reason and, with build, the
    graphs built and self-checked at the run's attention shape (batch_size, n_heads,
    n_kv_heads, seq_len, head_dim)."""
    from fp8attn import cudnn_fp8_attention as cfa
    c = model_cfg
    shape = (cfg.batch_size, c.n_heads, c.n_kv_heads, cfg.seq_len, c.head_dim) if build else None
    return cfa.unavailable_reason(device, c.head_dim, packed=c.packed, context_parallel=cfg.context_parallel,
                                  shape=shape)


def checkpoint_unavailable_reason(model_config: dict, device) -> str | None:
    """Why a trained model (a checkpoint's model_config dict) cannot run on `device`
    (None: it can), for the tools that run checkpoints (probe, retrieval). Only fp8-cudnn
    has such limits; they are compare's (cudnn_unavailable_reason: a CUDA sm_90 device,
    head_dim 128, the cuDNN frontend, no packed documents) without the graph build, whose
    shape is the tool's (a build that fails there raises CudnnFP8Unavailable)."""
    if model_config.get("attn_mode") != CUDNN_MODE:
        return None
    return cudnn_unavailable_reason(ModelConfig(**model_config), TrainConfig(), torch.device(device), build=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over cfg.warmup steps, then cosine to lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


OPTIMIZERS = ("adamw", "muon")


class MuonAdamW:
    """torch.optim.Muon on the hidden weight matrices, torch.optim.AdamW on the
    rest, stepped together (the split of the Muon papers and of the Delta-Matching
    study: Muon for the 2-D weights inside the blocks; AdamW for the token
    embedding, the output head, norms and QK-norm gains). The optimizer interface
    the trainer uses: param_groups (every group of both, for the LR schedule),
    zero_grad, step, state_dict / load_state_dict ({"muon": ..., "adamw": ...})."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list:
        return self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError("optimizer state: expected a Muon + AdamW state ({'muon', 'adamw'}), got keys "
                             f"{sorted(state)}; was the run started with another --optimizer?")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def muon_params(model: torch.nn.Module) -> tuple[list, list]:
    """(hidden matrices, the rest): the 2-D parameters other than the token
    embedding and the output head, and everything else."""
    io = {id(model.embed.weight)} | ({id(model.head.weight)} if getattr(model, "head", None) is not None else set())
    hidden, rest = [], []
    for p in model.parameters():
        (hidden if p.dim() == 2 and id(p) not in io else rest).append(p)
    return hidden, rest


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW (cfg.optimizer "adamw": weight decay on matrices only), or MuonAdamW
    ("muon"): torch.optim.Muon on the hidden matrices with the same lr and weight
    decay, its update scaled to AdamW's RMS (adjust_lr_fn="match_rms_adamw", so one
    LR schedule serves both), AdamW on the embedding, head (decayed) and the 1-D
    parameters (not decayed)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {cfg.optimizer!r}")
    if cfg.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=cfg.lr, betas=cfg.betas, fused=None)
    hidden, rest = muon_params(model)
    muon = torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=cfg.betas, fused=None)
    return MuonAdamW(muon, adamw)


def layer_gain_stats(model: Transformer) -> dict:
    """{layer: [max_gain, top4_share]} for every attention layer with QK-norm."""
    return {name: list(gain_stats(ddp.full(gq), ddp.full(gk), top_k=4)) for name, gq, gk in model.qk_gains()}


_DIAG_KEYS = ("eps_absmean", "eps_absmax", "rowsum_pre_mean", "rowsum_pre_max",
              "rowsum_post_mean", "rowsum_post_max")


def summarize_diag(rec) -> tuple[dict, dict]:
    """(per-layer stats, aggregate over layers) from a fp8attn DiagnosticsRecord.

    Means are row-weighted means over every recorded call, maxima are maxima.
    """
    per_layer = {}
    for (layer, _mode), s in rec.summary().items():
        per_layer[str(layer)] = {k: s[k] for k in _DIAG_KEYS if k in s}
    agg = {}
    rows = {str(layer): s["rows"] for (layer, _), s in rec.summary().items()}
    total = sum(rows.values())
    for k in _DIAG_KEYS:
        vals = [(per_layer[l][k], rows[l]) for l in per_layer if k in per_layer[l]]
        if not vals:
            continue
        if k.endswith("max"):
            agg[k] = max(v for v, _ in vals)
        elif total > 0:
            agg[k] = sum(v * n for v, n in vals) / total
    return per_layer, agg


@torch.no_grad()
def evaluate(model, batches, device, autocast, cp_ctx=None) -> float:
    """Mean val loss over `batches`. With context parallelism (cp_ctx) every rank of the
    group must call it: each takes its shard of the rows and the local means (equal token
    counts) are averaged over the group."""
    model.eval()
    tot = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        if cp_ctx is not None:
            x, y = cp_ctx.shard(x), cp_ctx.shard(y)
        with autocast():
            logits = model(x)
        tot += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    model.train()
    if cp_ctx is not None:
        import torch.distributed as dist
        t = torch.tensor([tot], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=cp_ctx.group)
        tot = float(t.item()) / cp_ctx.world_size
    return tot / len(batches)


def setup_context_parallel(cfg: "TrainConfig", model_cfg: ModelConfig, dctx: ddp.DistContext):
    """(cp_ctx, data-parallel context) for cfg.context_parallel = N > 1: the world's ranks in
    consecutive groups of N (rank r: group r // N, place r % N in it), each group one
    context-parallel ring over one sequence, the groups data-parallel (rank_batch over
    world / N). Gradients are averaged over the whole world by DDP / FSDP2: each rank's
    backward gives the gradient of the sum of its group's local losses through its own
    tokens (the ring returns dK/dV to their owners); every local loss is a mean over an
    equal share of the group's tokens, so DDP's average over all world ranks is the
    gradient of each group's mean loss, averaged over the groups.
    N = 1: (None, dctx). Raises ValueError for a world that N does not divide, a seq_len
    that is not a multiple of 2N (equal zigzag chunks), packed rows."""
    n = cfg.context_parallel
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"context_parallel: expected an int >= 1, got {n!r}")
    if n == 1:
        return None, dctx
    if not dctx.enabled or dctx.world_size % n:
        raise ValueError(f"context_parallel: {n} ranks per group needs a torchrun world that {n} divides, "
                         f"got world_size {dctx.world_size}")
    if cfg.seq_len % (2 * n):
        raise ValueError(f"context_parallel: seq_len {cfg.seq_len} must be a multiple of 2 * {n} "
                         "(equal zigzag chunks)")
    if model_cfg.packed:
        raise ValueError("context_parallel: not supported with --packed")
    from .model import ContextParallel
    mine = None
    for g in range(dctx.world_size // n):   # every rank creates every group (new_group is collective)
        grp = ddp.new_group(range(g * n, (g + 1) * n))   # recorded: ddp.shutdown destroys it
        if g == dctx.rank // n:
            mine = grp
    cp_ctx = ContextParallel(mine, dctx.rank % n, n)
    dp = ddp.DistContext(rank=dctx.rank // n, world_size=dctx.world_size // n, local_rank=dctx.local_rank,
                         local_world_size=dctx.local_world_size, group=True)
    return cp_ctx, dp


def train_mode(mode: str, model_cfg: ModelConfig, cfg: TrainConfig, data: PreparedData,
               log_path: str | os.PathLike, *, stop: StopRule | None = None, resume: bool = False,
               state_every: int = 0) -> dict:
    """Trains one model with attention mode `mode`; writes the JSONL log; returns the summary.
    `mode` is a mode name of model.parse_mode: an attn_mode, or a recipe variant such as
    "fp8-delta_matching@tile+hadamard", whose suffixes override model_cfg's fp8_scaling /
    fp8_qk_rotation / fp8_smooth_k (the meta line's model config is the mode's own).

    stop: stop early and save the training state (see StopRule; module docstring).
    resume: continue from `<log stem>.state.pt` if it exists; a mode whose log is
    complete returns its logged summary without training; with neither, trains
    from scratch. state_every: also save the state every k steps (0 = only at a
    stop), so a call killed from outside loses at most k steps.

    Summary keys: mode, steps_done, complete, diverged, final_train_loss (mean of the last
    loss_avg_last steps), final_val_loss, rowsum_post_mean / rowsum_post_max /
    rowsum_pre_mean / eps_absmean (means over the diagnostic steps, max for *_max;
    None for bf16), max_gain / top4_share (final step, max over layers),
    init_fingerprint, train_time_s, tokens_per_s.
    """
    from tqdm import tqdm

    dctx = ddp.context()
    if (stop is not None or resume or state_every) and cfg.fsdp and dctx.enabled:
        raise ValueError("fsdp: saving or resuming a training state is not supported with FSDP2")
    if state_every < 0:
        raise ValueError(f"state_every: must be >= 0, got {state_every}")
    log_path = Path(log_path)
    spath = state_path(log_path.parent, log_path.stem)
    saved = None
    if resume:
        if log_path.is_file():
            from .report import read_log
            prev = read_log(log_path)
            if log_is_complete(prev["summary"], cfg.steps):
                return prev["summary"]
        if spath.is_file() and log_path.is_file():
            saved = load_state(spath, mode=mode)
            if not 0 <= saved["step"] <= cfg.steps:
                raise ValueError(f"resume: {spath} is at step {saved['step']}, outside the run's {cfg.steps} steps")
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        # NOTE: ranks on one host share its cores.
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // dctx.local_world_size))
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    model_cfg = mode_model_config(model_cfg, mode)   # NOTE: a recipe variant sets its fp8_* fields
    if mode == CUDNN_MODE:
        # NOTE: compare skips the mode where it cannot run; a direct call is told why here
        why = cudnn_unavailable_reason(model_cfg, cfg, device)
        if why is not None:
            raise ValueError(f"{CUDNN_MODE}: {why}")
    model = build_model(model_cfg, cfg.seed)
    if cfg.init_from:
        load_init_weights(model, init_checkpoint(cfg.init_from, mode))
    fingerprint = init_fingerprint(model)
    if saved is not None:
        if saved["init_fingerprint"] != fingerprint:
            raise ValueError(f"resume: {spath} started from other initial weights "
                             f"({saved['init_fingerprint']} != {fingerprint}); was the model config changed?")
        model.load_state_dict(saved["model"])
    model.to(device)
    cp_ctx, dp_ctx = setup_context_parallel(cfg, model_cfg, dctx)
    model.set_context_parallel(cp_ctx)
    train_model = ddp.wrap_model(model, dctx, device, fsdp=cfg.fsdp)   # `model` itself with one process
    opt = make_optimizer(model, cfg)
    if saved is not None:
        opt.load_state_dict(saved["optim"])
    use_autocast = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_autocast)

    train = TokenStream(data.train_path, cfg.seq_len)
    val_batches = TokenStream(data.val_path, cfg.seq_len).fixed_batches(cfg.val_batches, cfg.batch_size)
    rng = np.random.Generator(np.random.PCG64(cfg.data_seed))
    start = 0
    acc = {"losses": [], "diag_aggs": [], "val_loss": None, "last_gains": {}, "last_logits": {},
           "train_time_s": 0.0}
    if saved is not None:
        rng = restore_rngs(saved)
        start, acc = saved["step"], saved["acc"]
    fp8 = mode.startswith("fp8-")
    if fp8:
        from fp8attn import diagnostics

    log_path = log_path if dctx.is_main else Path(os.devnull)
    if dctx.is_main:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if saved is not None:
            _truncate_log(log_path, start)
        elif spath.exists():
            spath.unlink()      # NOTE: a state of an earlier run must not be resumed into this one
    losses, diag_aggs, val_loss, last_gains, diverged = (acc["losses"], acc["diag_aggs"], acc["val_loss"],
                                                         acc["last_gains"], False)
    last_logits: dict = acc["last_logits"]  # {layer: [logit_std, logit_max, entropy_mean]} of the last diag step
    t_start = time.time() - acc["train_time_s"]     # NOTE: wall time accumulates over the calls
    steps_this_call, last_dt, stopped = 0, 0.0, False
    tokens_per_step = cfg.batch_size * cfg.seq_len * dp_ctx.world_size

    def save(path, step):
        """Checkpoint (rank 0 writes). NOTE: under FSDP2 every rank must take part in
        gathering the full parameters (ddp.full is a collective)."""
        sd = {k: ddp.full(v) for k, v in model.state_dict().items()} if ddp.is_sharded(model) else None
        if not dctx.is_main:
            return None
        return save_checkpoint(path, model, mode=mode, step=step, train_config=cfg.to_dict(),
                               data_root=str(data.root), init_fingerprint=fingerprint, state_dict=sd,
                               tokenizer_sha1=data.tokenizer_sha1())

    def save_train_state(step):
        """Full training state after `step` steps (rank 0 writes; every rank holds the same)."""
        if not dctx.is_main:
            return None
        a = {"losses": losses, "diag_aggs": diag_aggs, "val_loss": val_loss, "last_gains": last_gains,
             "last_logits": last_logits, "train_time_s": time.time() - t_start}
        return save_state(spath, mode=mode, step=step, init_fingerprint=fingerprint,
                          model_state=model.state_dict(), optim_state=opt.state_dict(), data_rng=rng, acc=a,
                          train_config=cfg.to_dict(), model_config=model_cfg.to_dict())

    def must_stop():
        """The stop decision, taken on rank 0 and shared (ranks' clocks differ slightly)."""
        if stop is None:
            return False
        want = stop.stop_now(steps_this_call, last_dt)
        if dctx.enabled and stop.deadline is not None:
            want = ddp.mean_over_ranks(1.0 if (want and dctx.is_main) else 0.0, dctx, device) > 0
        return want

    with open(log_path, "a" if saved is not None else "w") as log:
        def write(obj):
            log.write(json.dumps(obj) + "\n")
            log.flush()

        if saved is None:
            write({"type": "meta", "mode": mode, "model": model_cfg.to_dict(), "train": cfg.to_dict(),
                   "params": model.num_params(), "init_fingerprint": fingerprint, "device": str(device),
                   "torch": torch.__version__, "data": {k: v for k, v in data.meta.items() if k != "val_paths"}})
        # NOTE: a tqdm bar only on a terminal; in a log file (CI) a plain line every 10 %.
        tty = sys.stderr.isatty()
        progress = cfg.progress and dctx.is_main
        bar = tqdm(range(start, cfg.steps), desc=f"{mode:>18}", disable=not (progress and tty),
                   mininterval=1.0, file=sys.stderr, dynamic_ncols=True, initial=start, total=cfg.steps)
        line_every = max(1, cfg.steps // 10) if progress and not tty else 0
        for step in bar:
            if must_stop():
                stopped = True
                # NOTE: a call that stops before its first step keeps the state it resumed from.
                if steps_this_call:
                    save_train_state(step)
                break
            t0 = time.time()
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = ddp.rank_batch(train, rng, cfg.batch_size, dp_ctx)
            if cp_ctx is not None:   # this rank's zigzag chunks of every row
                x, y = cp_ctx.shard(x), cp_ctx.shard(y)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            want_scales = cfg.diag_every > 0 and step % cfg.diag_every == 0
            want_diag = fp8 and want_scales
            # The diagnostics context must cover backward(): the op reads it there.
            with (diagnostics.record() if want_diag else contextlib.nullcontext()) as rec:
                with autocast(), (ActivationScales(model) if want_scales else contextlib.nullcontext()) as scales:
                    logits = train_model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
            grad_norm = ddp.clip_grad_norm(model.parameters(), cfg.grad_clip)   # NOTE: sharding-independent
            loss_v = ddp.mean_over_ranks(float(loss.detach()), dctx, device)
            if not math.isfinite(loss_v) or not math.isfinite(grad_norm):
                diverged = True
                write({"type": "step", "step": step, "loss": loss_v, "grad_norm": grad_norm,
                       "lr": lr, "diverged": True})
                break
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = last_dt = time.time() - t0
            steps_this_call += 1
            losses.append(loss_v)
            last_gains = layer_gain_stats(model)
            rec_line = {"type": "step", "step": step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm,
                        "step_time_s": dt, "tokens_per_s": tokens_per_step / dt, "gains": last_gains}
            if last_gains:
                rec_line["max_gain"] = max(v[0] for v in last_gains.values())
                rec_line["top4_share"] = max(v[1] for v in last_gains.values())
            if scales is not None and scales.scales:
                rec_line["act_scales"] = scales.stats()
            if scales is not None and scales.logits:
                rec_line["attn_logits"] = last_logits = scales.logit_stats()
            if rec is not None and rec.records:
                per_layer, agg = summarize_diag(rec)
                rec_line["diag"] = per_layer
                rec_line.update(agg)
                diag_aggs.append(agg)
            write(rec_line)
            # NOTE: FSDP's forward is collective, so every rank evaluates; rank 0 logs.
            if (dctx.is_main or ddp.is_sharded(model) or cp_ctx is not None) and (
                    (step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps):
                val_loss = evaluate(model, val_batches, device, autocast, cp_ctx)
                write({"type": "val", "step": step, "val_loss": val_loss})
            if (step + 1) in cfg.save_at:
                save(log_path.with_name(f"{log_path.stem}.step{step + 1}.pt"), step + 1)
            if state_every and (step + 1) % state_every == 0 and step + 1 < cfg.steps:
                save_train_state(step + 1)
            bar.set_postfix(loss=f"{loss_v:.3f}", val=f"{val_loss:.3f}" if val_loss else "-")
            if line_every and ((step + 1) % line_every == 0 or step + 1 == cfg.steps):
                print(f"[train] {mode} step {step + 1}/{cfg.steps} loss {loss_v:.3f} "
                      f"val {val_loss if val_loss is None else round(val_loss, 3)} "
                      f"{time.time() - t_start:.0f} s", file=sys.stderr, flush=True)
        bar.close()

        train_time = time.time() - t_start
        k = min(cfg.loss_avg_last, len(losses))

        def mean_of(key):
            v = [a[key] for a in diag_aggs if key in a]
            return float(np.mean(v)) if v else None

        def max_of(key):
            v = [a[key] for a in diag_aggs if key in a]
            return float(np.max(v)) if v else None

        summary = {
            "type": "summary", "mode": mode, "steps_done": len(losses),
            "complete": diverged or (not stopped and len(losses) == cfg.steps), "diverged": diverged,
            "final_train_loss": float(np.mean(losses[-k:])) if k else None,
            "final_val_loss": val_loss,
            "rowsum_post_mean": mean_of("rowsum_post_mean"), "rowsum_post_max": max_of("rowsum_post_max"),
            "rowsum_pre_mean": mean_of("rowsum_pre_mean"), "rowsum_pre_max": max_of("rowsum_pre_max"),
            "eps_absmean": mean_of("eps_absmean"),
            "max_gain": max((v[0] for v in last_gains.values()), default=None),
            "top4_share": max((v[1] for v in last_gains.values()), default=None),
            "logit_std_max": max((v[0] for v in last_logits.values()), default=None),
            "entropy_min": min((v[2] for v in last_logits.values()), default=None),
            "init_fingerprint": fingerprint, "train_time_s": train_time,
            "scope": model_cfg.scope if fp8 else "bf16", "packed": model_cfg.packed, "fsdp": ddp.is_sharded(model),
            "tokens_per_s": tokens_per_step * len(losses) / train_time if losses else None,
        }
        if dctx.enabled:
            summary["world_size"] = dctx.world_size
            summary["final_fingerprints"] = ddp.gather_strings(init_fingerprint(model), dctx)
        if cp_ctx is not None:
            summary["context_parallel"] = cp_ctx.world_size
        if mode == CUDNN_MODE:
            from fp8attn import cudnn_fp8_attention as cfa
            summary["cudnn_fp8"] = {"amax_history_len": model_cfg.cudnn_amax_history_len,
                                    "margin": model_cfg.cudnn_margin, **cfa.version_info(),
                                    "plans": [p for p in cfa.plan_info() if p["shape"][1:] == [
                                        model_cfg.n_heads, model_cfg.n_kv_heads, cfg.seq_len, model_cfg.head_dim]]}
        if summary["complete"] and dctx.is_main and spath.exists():
            spath.unlink()      # NOTE: a finished mode needs no state (it can be ~600 MB)
        if cfg.save_final and losses and summary["complete"]:
            ckpt = save(log_path.with_suffix(".pt"), len(losses))
            if ckpt is not None:
                summary["checkpoint"] = ckpt.name
        write(summary)
    if dctx.enabled and len(set(summary["final_fingerprints"])) != 1:
        raise RuntimeError(f"DDP ranks ended with different parameters {summary['final_fingerprints']}")
    return summary
