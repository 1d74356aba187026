"""Seed-spread study (issue 6 item 2): one compare run per (attention mode, seed), all
trained concurrently (scripts/seeds_study.sh), aggregated into a table and plots.

    python -m fp8attn.train.seeds aggregate --study DIR [--modes M1,M2,..] [--seeds S1,S2,..] \\
        [--out DIR] [--partial | --at-step N|common]
    python -m fp8attn.train.seeds plan --calib DIR --window-s S --parallel P [--modes ..] [--seeds ..] \\
        [--cal-wall-s S] [--val-batches N] [--max-steps N] [--margin F]

Layout: DIR/<mode>-s<seed>/ is a `python -m fp8attn.train.compare --modes <mode>
--seed <seed> --out DIR/<mode>-s<seed>` run directory (<mode>.jsonl, summary.json,
...). One process per (mode, seed) trains exactly what the multi-mode compare run
trains for that mode: the init is drawn from torch.manual_seed(seed) right before
the model is built and the batch order from PCG64(data_seed), both per mode, so
neither depends on which other modes run in the process
(tests/python/test_seeds_study.py checks the logs are identical on the CPU). On
CUDA the runs are not bit-reproducible (atomics in the backward kernels), but the
init and the batches are the same.

aggregate: writes <out>/seeds.md, seeds.json, seeds_loss.png, seeds_gain.png
(out defaults to the study dir). Without --modes/--seeds they are read from the
<mode>-s<seed> subdirectories; every (mode, seed) cell must be there.
  per mode: final val loss per seed (loss on the fixed val batches after the last
    step), mean and spread (max - min) over the seeds, gap of the mean to the bf16
    mean; max QK-norm gain at the last step per seed (max over layers and channels
    of |g_q|, |g_k|; "n/a" without QK-norm); post-cast dS row-sum residual mean of
    the last diagnostic step per seed (fp8 modes; trainer.py / numerics.md section 5);
  paired differences: within a seed every mode starts from the same weights and
    sees the same batches, so val(mode, seed) - val(ref, seed) is a paired
    difference; per seed, mean, and whether the sign agrees across seeds
    (fp8 modes vs bf16, fp8-stale and fp8-matched_do vs fp8-delta_matching,
    fp8-delta_matching vs fp8-cudnn: fp8attn against the FP8 attention a user would pick instead;
    a recipe variant such as fp8-delta_matching@tile vs bf16 and vs its base mode).
  Recipe variants (compare --modes fp8-delta_matching@tile+hadamard, ...; model.parse_mode)
    are modes of their own (run dirs <variant>-s<seed>); their runs may differ from the
    others only in the model fields their suffixes set.
  Errors (ValueError naming the run): a missing run dir or log, a log without a
  meta line, runs that differ in the training or model configuration (step
  count, lr, batch, model shape, ...: the lr schedule must be the same), runs of
  one seed with different initial weights or data seeds, a log line that is not
  JSON (a cut-off last line: the run was killed while writing), a <mode>-s<seed>
  dir of an unknown mode, --out naming a file. With --partial a missing, cut-short
  (--deadline-s), diverged or non-finite-val run is listed under "problems"
  and left out of the means instead (configuration mismatches stay errors).
  With --at-step N every run is read at training step N instead of at its end:
    the val loss logged at step N (the logs number steps from 0: the val line of
    step N is the loss after N + 1 training steps; the trainer logs val every
    val_every steps and after the last step), the max gain and row-sum residual of the last step
    record <= N; a run that was cut (--deadline-s) after step N counts as
    complete there. All runs share the step count, so at step N every run has had
    the same lr schedule and the same batches (per seed): the paired comparison is
    fair even when the deadline cut the runs at different steps. `common` picks
    the largest val step that every run logged. Errors: N is not a logged val
    step of some run, or no val step is shared.

plan: from a calibration (the same layout, a few steps of every run under the same
concurrency) picks the step count for the training window: per-step time = the
slowest run's mean step time over steps >= 3 (the first steps include warm-up and
start while other processes are still loading) times --margin; runs go in
ceil(runs / parallel) waves; each wave pays the start-up cost (calibration wall
time minus its longest train time) and 5 val evaluations (val_batches forwards,
~1/3 step each). Prints one line "STEPS note" (steps rounded down to a multiple of
10, >= 10, <= --max-steps); exit status 2 and "0 reason" when a calibration run
has no step times.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from .model import ATTN_MODES, CUDNN_MODE, MODE_GRAMMAR, is_mode_name, mode_sort_key, parse_mode
from .report import OPTIMIZER_NAMES, mode_label, read_log

MODE_ORDER = ATTN_MODES   # NOTE: one source of truth: every mode the harness trains, fp8-cudnn included
# Plot color per mode (one each, so no two modes share one; ATTN_MODES order).
MODE_COLORS = dict(zip(ATTN_MODES, ("k", "tab:red", "tab:orange", "tab:blue", "tab:green")))
_DIR_RE = re.compile(r"^(?P<mode>bf16|fp8-[a-z_]+(?:[@+][a-z_]+)*)-s(?P<seed>-?\d+)$")
# Training-config fields every run of a study must share (seed/data_seed differ by design;
# device/threads/progress/saving do not change the numbers).
_SHARED_TRAIN = ("steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup", "weight_decay", "betas",
                 "grad_clip", "diag_every", "val_every", "val_batches", "loss_avg_last")
_SHARED_DATA = ("source", "vocab_size", "train_tokens", "val_tokens")
PAIRS = tuple((m, "bf16") for m in ATTN_MODES if m != "bf16") + (
    ("fp8-stale", "fp8-delta_matching"), ("fp8-matched_do", "fp8-delta_matching"),
    ("fp8-delta_matching", CUDNN_MODE))
CALIB_SKIP = 3   # calibration steps left out of the step time (warm-up, staggered starts)


def run_dir_name(mode: str, seed: int) -> str:
    return f"{mode}-s{seed}"


def _sorted_modes(modes) -> list[str]:
    """MODE_ORDER's order, each mode's recipe variants after it; unknown names last."""
    return sorted(set(modes), key=mode_sort_key)


def _overridden(mode: str) -> set[str]:
    """The ModelConfig fields a recipe variant's suffixes set (model.parse_mode; none for a plain mode)."""
    try:
        return set(parse_mode(mode).overrides())
    except ValueError:
        return set()


def discover(study: Path) -> tuple[list[str], list[int]]:
    """Modes and seeds named by the <mode>-s<seed> subdirectories of `study`."""
    runs = discover_runs(study)
    if not runs:
        raise ValueError(f"seeds: no <mode>-s<seed> run dirs in {study}")
    return _sorted_modes(m for m, _ in runs), sorted({s for _, s in runs})


def discover_runs(study: Path) -> list[tuple[str, int]]:
    """(mode, seed) of every <mode>-s<seed> subdirectory of `study`, in mode order then seed."""
    if not study.exists():
        raise ValueError(f"seeds: study dir {study} does not exist")
    if not study.is_dir():
        raise ValueError(f"seeds: study dir {study} is not a directory")
    found = [m.groupdict() for m in (_DIR_RE.match(p.name) for p in study.iterdir() if p.is_dir()) if m]
    bad = sorted(f"{f['mode']}-s{f['seed']}" for f in found if not is_mode_name(f["mode"]))
    if bad:
        raise ValueError(f"seeds: run dir(s) {', '.join(bad)} in {study} name an unknown mode (expected "
                         f"<mode>-s<seed> with mode one of {', '.join(MODE_ORDER)} or a recipe variant "
                         f"{MODE_GRAMMAR}); move them away or pass --modes/--seeds")
    order = {m: i for i, m in enumerate(_sorted_modes(f["mode"] for f in found))}
    return sorted(((f["mode"], int(f["seed"])) for f in found), key=lambda ms: (order[ms[0]], ms[1]))


def _last(steps: list[dict], key: str):
    """Value of `key` in the last step record that has it (None if none)."""
    return next((r[key] for r in reversed(steps) if r.get(key) is not None), None)


def _run_record(mode: str, seed: int, d: Path, log: dict, at_step: int | None = None) -> dict:
    meta, steps, vals, s = log["meta"], log["steps"], log["vals"], log["summary"]
    t = meta["train"]
    if at_step is not None:
        return _run_record_at(mode, seed, d, log, at_step)
    losses = [r["loss"] for r in steps if "loss" in r and not r.get("diverged")]
    diverged = bool((s or {}).get("diverged")) or any(r.get("diverged") for r in steps)
    complete = s is not None and bool(s.get("complete", s.get("steps_done") == t["steps"])) and not diverged
    final_val = vals[-1]["val_loss"] if vals else None
    if s is not None and s.get("final_val_loss") is not None and final_val is not None \
            and s["final_val_loss"] != final_val \
            and not (math.isnan(s["final_val_loss"]) and math.isnan(final_val)):
        raise ValueError(f"seeds: {d}: summary final_val_loss {s['final_val_loss']} is not the last logged "
                         f"val loss {final_val} (log edited or truncated?)")
    times = [r["step_time_s"] for r in steps if "step_time_s" in r]
    return {
        "mode": mode, "seed": seed, "data_seed": t["data_seed"], "dir": d.name,
        "steps": t["steps"], "steps_done": len(losses), "complete": complete, "diverged": diverged,
        "final_val_loss": final_val, "final_val_step": vals[-1]["step"] if vals else None,
        "final_train_loss": (s or {}).get("final_train_loss"),
        "max_gain_end": _last(steps, "max_gain"), "top4_share_end": _last(steps, "top4_share"),
        "rowsum_post_last": _last(steps, "rowsum_post_mean"), "rowsum_post_mean": (s or {}).get("rowsum_post_mean"),
        "entropy_min_end": (s or {}).get("entropy_min"), "logit_std_max_end": (s or {}).get("logit_std_max"),
        "init_fingerprint": meta["init_fingerprint"], "train_time_s": (s or {}).get("train_time_s"),
        "step_time_median_s": float(np.median(times)) if times else None,
    }


def _run_record_at(mode: str, seed: int, d: Path, log: dict, at_step: int) -> dict:
    """The run read at training step `at_step` (see --at-step in the module docstring)."""
    rec = _run_record(mode, seed, d, log)
    vals = [v for v in log["vals"] if v["step"] == at_step]
    if not vals:
        have = ", ".join(str(v["step"]) for v in log["vals"]) or "none"
        raise ValueError(f"seeds: mode {mode} seed {seed} ({d}) logged no val loss at step {at_step} "
                         f"(val steps: {have})")
    if not math.isfinite(vals[-1]["val_loss"]):
        raise ValueError(f"seeds: mode {mode} seed {seed} ({d}) logged val loss {vals[-1]['val_loss']} at step "
                         f"{at_step} (not finite); pick an earlier --at-step")
    upto = [r for r in log["steps"] if r.get("step", -1) <= at_step]
    diverged = any(r.get("diverged") for r in upto)
    rec.update({"final_val_loss": vals[-1]["val_loss"], "final_val_step": at_step,
                "complete": not diverged, "diverged": diverged, "read_at_step": at_step,
                "final_train_loss": None,
                "max_gain_end": _last(upto, "max_gain"), "top4_share_end": _last(upto, "top4_share"),
                "rowsum_post_last": _last(upto, "rowsum_post_mean")})
    return rec


def common_val_step(study: str | Path, modes: list[str] | None = None, seeds: list[int] | None = None) -> int:
    """Largest val step logged by every (mode, seed) run of `study` (ValueError if none)."""
    study = Path(study)
    if modes is None or seeds is None:
        found_modes, found_seeds = discover(study)
        modes, seeds = modes or found_modes, seeds or found_seeds
    common = None
    for seed in seeds:
        for mode in modes:
            path = study / run_dir_name(mode, seed) / f"{mode}.jsonl"
            if not path.is_file():
                raise ValueError(f"seeds: mode {mode} seed {seed}: {path} is missing")
            steps = {v["step"] for v in read_log(path)["vals"]}
            common = steps if common is None else common & steps
    if not common:
        raise ValueError(f"seeds: the runs in {study} share no val step")
    return max(common)


def load_study(study: str | Path, modes: list[str] | None = None, seeds: list[int] | None = None,
               partial: bool = False, at_step: int | None = None) -> dict:
    """Reads every (mode, seed) run of `study` and checks they form one study.
    Returns {study, modes, seeds, config, runs [record], logs {(mode, seed): read_log},
    problems [str]}. Raises ValueError (see the module docstring)."""
    study = Path(study)
    hint = ""
    if modes is None or seeds is None:
        found_modes, found_seeds = discover(study)
        hint = (f" (every mode x seed of the run dirs: modes {', '.join(modes or found_modes)}, seeds "
                f"{', '.join(map(str, seeds or found_seeds))}; --modes/--seeds pick a subset)")
        modes, seeds = modes or found_modes, seeds or found_seeds
    if not study.is_dir():
        raise ValueError(f"seeds: study dir {study} " + ("is not a directory" if study.exists() else "does not exist"))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: a seed is listed twice in {seeds}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"seeds: a mode is listed twice in {modes}")
    runs, logs, problems, ref = [], {}, [], None
    for seed in seeds:
        for mode in modes:
            d = study / run_dir_name(mode, seed)
            path = d / f"{mode}.jsonl"
            if not path.is_file():
                what = f"run dir {d} is missing" if not d.is_dir() else f"{path} is missing (the run did not start?)"
                if not partial:
                    raise ValueError(f"seeds: mode {mode} seed {seed}: {what}{hint}")
                problems.append(f"{mode} seed {seed}: {what}")
                continue
            log = read_log(path)
            meta = log["meta"]
            if meta is None:
                raise ValueError(f"seeds: {path} has no meta line (not a trainer log?)")
            if meta["mode"] != mode or meta["train"]["seed"] != seed:
                raise ValueError(f"seeds: {path} holds mode {meta['mode']} seed {meta['train']['seed']}, "
                                 f"expected mode {mode} seed {seed}")
            if ref is None:
                ref = (d.name, meta)
            else:
                _check_same_config(ref, d.name, meta)
            rec = _run_record(mode, seed, d, log, at_step)
            if not _ok(rec):
                why = ("diverged" if rec["diverged"] else
                       f"incomplete: {rec['steps_done']}/{rec['steps']} steps" if rec["steps_done"] < rec["steps"]
                       else "no val loss" if rec["final_val_loss"] is None
                       else f"val loss {rec['final_val_loss']} at step {rec['final_val_step']} (not finite)")
                if not partial:
                    raise ValueError(f"seeds: mode {mode} seed {seed} ({d}) is {why}; "
                                     f"use --partial to aggregate the rest")
                problems.append(f"{mode} seed {seed}: {why} (left out of the means)")
            runs.append(rec)
            logs[(mode, seed)] = log
    if not runs:
        raise ValueError(f"seeds: no run of modes {modes} x seeds {seeds} in {study}")
    for seed in seeds:
        mine = [r for r in runs if r["seed"] == seed]
        for key, what in (("init_fingerprint", "initial weights"), ("data_seed", "data seeds")):
            vals = {r[key] for r in mine}
            if len(vals) > 1:
                raise ValueError(f"seeds: the runs of seed {seed} have different {what} ("
                                 + ", ".join(f"{r['mode']}: {r[key]}" for r in mine)
                                 + "); the per-seed comparison is invalid")
    fps = {}
    for r in runs:
        fps.setdefault(r["init_fingerprint"], set()).add(r["seed"])
    for fp, ss in fps.items():
        if len(ss) > 1:
            problems.append(f"seeds {sorted(ss)} start from the same weights (fingerprint {fp})")
    meta = ref[1]
    config = {"model": {k: v for k, v in meta["model"].items() if k != "attn_mode"},
              "train": {k: meta["train"][k] for k in _SHARED_TRAIN if k in meta["train"]},
              "params": meta["params"], "device": meta["device"],
              "data": {k: meta["data"].get(k) for k in _SHARED_DATA},
              "data_seeds": {s: next((r["data_seed"] for r in runs if r["seed"] == s), None) for s in seeds}}
    return {"study": study, "modes": list(modes), "seeds": list(seeds), "config": config, "runs": runs,
            "logs": logs, "problems": problems, "at_step": at_step}


def _check_same_config(ref: tuple[str, dict], name: str, meta: dict) -> None:
    rname, rmeta = ref
    diffs = []
    for k in _SHARED_TRAIN:
        a, b = rmeta["train"].get(k), meta["train"].get(k)
        if a != b:
            diffs.append(f"train.{k}: {rname} has {a}, {name} has {b}")
    # NOTE: a recipe variant (fp8-delta_matching@tile, ...) differs in the fields its name sets.
    mine = {"attn_mode"} | _overridden(rmeta.get("mode", "")) | _overridden(meta.get("mode", ""))
    ma = {k: v for k, v in rmeta["model"].items() if k not in mine}
    mb = {k: v for k, v in meta["model"].items() if k not in mine}
    for k in sorted(set(ma) | set(mb)):
        if ma.get(k) != mb.get(k):
            diffs.append(f"model.{k}: {rname} has {ma.get(k)}, {name} has {mb.get(k)}")
    for k in _SHARED_DATA:
        if rmeta["data"].get(k) != meta["data"].get(k):
            diffs.append(f"data.{k}: {rname} has {rmeta['data'].get(k)}, {name} has {meta['data'].get(k)}")
    if diffs:
        raise ValueError("seeds: the runs differ in their configuration (all runs must share the step count, "
                         "lr schedule, batch and model): " + "; ".join(diffs))


# ---- statistics ---------------------------------------------------------------------


def _ok(r: dict) -> bool:
    return r["complete"] and r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"])


def mode_stats(study: dict) -> dict:
    """{mode: {n, vals {seed: v}, mean, spread, gap_to_bf16, max_gain {seed: v}, rowsum_post {seed: v}}}
    over the complete runs (spread = max - min, None with fewer than 2 seeds)."""
    out = {}
    for mode in study["modes"]:
        rs = [r for r in study["runs"] if r["mode"] == mode]
        vals = {r["seed"]: r["final_val_loss"] for r in rs if _ok(r)}
        v = list(vals.values())
        out[mode] = {"n": len(v), "vals": vals, "mean": float(np.mean(v)) if v else None,
                     "spread": float(max(v) - min(v)) if len(v) >= 2 else None,
                     "max_gain": {r["seed"]: r["max_gain_end"] for r in rs},
                     "rowsum_post": {r["seed"]: r["rowsum_post_last"] for r in rs},
                     "complete": {r["seed"]: r["complete"] for r in rs}}
    base = out.get("bf16", {}).get("mean")
    for s in out.values():
        s["gap_to_bf16"] = None if base is None or s["mean"] is None else s["mean"] - base
    return out


def paired(study: dict, stats: dict) -> list[dict]:
    """Per-seed paired val-loss differences (see the module docstring)."""
    out = []
    # Recipe variants: against bf16 and against their base mode (same seed, same batches).
    variants = [m for m in study["modes"] if _overridden(m)]
    for a, b in PAIRS + tuple(p for m in variants for p in ((m, "bf16"), (m, parse_mode(m).base))):
        if a not in stats or b not in stats:
            continue
        seeds = [s for s in study["seeds"] if s in stats[a]["vals"] and s in stats[b]["vals"]]
        if not seeds:
            continue
        d = {s: stats[a]["vals"][s] - stats[b]["vals"][s] for s in seeds}
        signs = {np.sign(v) for v in d.values()}
        out.append({"a": a, "b": b, "diffs": d, "mean": float(np.mean(list(d.values()))),
                    "same_sign": None if len(d) < 2 else (len(signs) == 1 and 0 not in signs)})
    return out


# ---- output -------------------------------------------------------------------------


def _f(v, spec=".4f"):
    return "n/a" if v is None else format(v, spec)


def markdown(study: dict, stats: dict, pairs: list[dict], plots: list[Path], prov: dict | None = None) -> str:
    seeds, cfg = study["seeds"], study["config"]
    m, t = cfg["model"], cfg["train"]
    any_rowsum = any(v is not None for s in stats.values() for v in s["rowsum_post"].values())
    head = (["mode"] + [f"val s{s}" for s in seeds] + ["mean", "spread (max-min)", "gap to bf16 mean"]
            + [f"max QK gain s{s}" for s in seeds] + ([f"rowsum post s{s}" for s in seeds] if any_rowsum else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in study["modes"]:
        st = stats[mode]
        def cell(seed):
            v = st["vals"].get(seed)
            if v is not None:
                return _f(v)
            r = next((r for r in study["runs"] if r["mode"] == mode and r["seed"] == seed), None)
            if r is None:
                return "missing"
            if r["diverged"]:
                return "diverged"
            if r["complete"]:
                return "no val loss" if r["final_val_loss"] is None else f"val {r['final_val_loss']}"
            return f"cut at {r['steps_done']}"
        row = ([mode_label(mode)] + [cell(s) for s in seeds] + [_f(st["mean"]), _f(st["spread"]), _f(st["gap_to_bf16"], "+.4f")]
               + [_f(st["max_gain"].get(s), ".3f") for s in seeds]
               + ([_f(st["rowsum_post"].get(s), ".3e") for s in seeds] if any_rowsum else []))
        lines.append("| " + " | ".join(row) + " |")
    ptab = []
    if pairs:
        ph = ["comparison"] + [f"s{s}" for s in seeds] + ["mean", "same sign in every seed"]
        ptab = ["| " + " | ".join(ph) + " |", "|" + "---|" * len(ph)]
        for p in pairs:
            ptab.append("| " + " | ".join([f"{p['a']} - {p['b']}"] + [_f(p["diffs"].get(s), "+.4f") for s in seeds]
                                          + [_f(p["mean"], "+.4f"), "n/a (one seed)" if p["same_sign"] is None
                                             else "yes" if p["same_sign"] else "no"]) + " |")
    bspread = (stats.get("bf16") or {}).get("spread")
    ds = cfg["data_seeds"]
    out = [
        f"# Seed spread: {len(study['modes'])} modes x {len(seeds)} seeds",
        "",
        f"Model: {cfg['params'] / 1e6:.1f} M params, d_model {m['d_model']}, {m['n_layers']} layers, "
        f"{m['n_heads']}/{m['n_kv_heads']} q/kv heads, head_dim {m['head_dim']}, QK-norm "
        f"{'on' if m['qk_norm'] else 'off'}, vocab {m['vocab_size']}, fp8 scope {m.get('scope', 'attn-core')}.",
        f"Training: {t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens "
        f"({t['steps'] * t['batch_size'] * t['seq_len'] / 1e6:.1f} M tokens), {OPTIMIZER_NAMES[t.get('optimizer', 'adamw')]} lr {t['lr']} "
        f"(warmup {t['warmup']}, cosine to {t['min_lr_ratio']}x), device {cfg['device']}.",
        f"Seeds (init) {', '.join(map(str, seeds))}; data seeds (batch order) "
        f"{', '.join(str(ds[s]) for s in seeds)}. Within a seed every mode has the same initial weights "
        f"(checked) and the same batches; one process per run, all runs concurrent.",
        "",
        *([_at_step_note(study), ""] if study.get("at_step") is not None else []),
        "## Final val loss per mode" if study.get("at_step") is None else
        f"## Val loss per mode at step {study['at_step']} (after {study['at_step'] + 1} of {t['steps']} training steps)",
        "",
        *lines,
        "",
        "val = loss on the fixed val batches after the last step (or at the --at-step step); spread = max - min over the seeds; "
        "max QK gain = max over layers and channels of |g_q|, |g_k| at the last step; rowsum post = mean "
        "post-cast dS row-sum residual |sum_j dS_ij| / sum_j |dS_ij| of the last diagnostic step (fp8 modes).",
        "",
    ]
    if ptab:
        what = "final val loss" if study.get("at_step") is None else f"val loss at step {study['at_step']}"
        out += [f"## Paired differences of the {what} (same init and batches within a seed)", "", *ptab, ""]
        out += [("Reading: " + (f"the bf16 seed spread ({bspread:.4f}) is the noise of an unpaired comparison "
                                "of the means; " if bspread is not None else "")
                 + ("a paired difference whose sign flips between seeds shows no difference between the modes; "
                    f"with {len(seeds)} seeds a sign that agrees is weak evidence (it happens by chance with "
                    f"probability {0.5 ** (len(seeds) - 1):.2g} when the modes do not differ)." if len(seeds) >= 2
                    else "with one seed there is no seed spread: a paired difference cannot be told from noise.")),
                ""]
    rh = ["run", "steps done", "final train loss", "max QK gain", "top-4 share", "rowsum post last / mean",
          "logit std max", "attn entropy min", "train time (s)"]
    out += ["## Per run" + (", at the end" if study.get("at_step") is None else
                            f" (max QK gain, top-4 share, rowsum post last: at step {study['at_step']}; rowsum post mean and the "
                            "rest: at the end)"), "", "| " + " | ".join(rh) + " |", "|" + "---|" * len(rh)]
    for r in study["runs"]:
        rs = ("n/a" if r["rowsum_post_last"] is None
              else f"{r['rowsum_post_last']:.3e} / {_f(r['rowsum_post_mean'], '.3e')}")
        out.append("| " + " | ".join([
            r["dir"], f"{r['steps_done']}/{r['steps']}" + (" (diverged)" if r["diverged"] else ""),
            _f(r["final_train_loss"]), _f(r["max_gain_end"], ".3f"), _f(r["top4_share_end"], ".3f"), rs,
            _f(r["logit_std_max_end"], ".2f"), _f(r["entropy_min_end"], ".3f"), _f(r["train_time_s"], ".0f")]) + " |")
    out += ["", "logit std max / attn entropy min: over layers, at the last diagnostic step (capture.py); "
            "rowsum post mean: over all diagnostic steps.", ""]
    if prov:
        out += [f"Commit {prov.get('git_commit')}, {prov.get('gpu') or 'CPU'}, torch {prov.get('torch')}; "
                f"command of the first run: `{prov.get('command')}`", ""]
    if study["problems"]:
        out += ["## Problems", ""] + [f"- {p}" for p in study["problems"]] + [""]
    out += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(out)


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    head = np.cumsum(y[:window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(y, np.ones(window) / window, mode="valid")])


def make_plots(study: dict, out_dir: Path) -> list[Path]:
    """seeds_loss.png (train loss per run, val points; below: train loss minus bf16's of the
    same seed) and seeds_gain.png (max QK-norm gain; below: post-cast row-sum residual)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = MODE_COLORS
    styles = ("-", "--", ":", "-.")
    logs = study["logs"]
    n = max((len(l["steps"]) for l in logs.values()), default=0)
    window = max(1, n // 30)

    def style(mode, seed):
        i = study["seeds"].index(seed)
        return dict(color=colors.get(mode), ls=styles[i % len(styles)], lw=1.2)

    paths = []
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for (mode, seed), l in logs.items():
        s = np.array([r["step"] for r in l["steps"] if "loss" in r])
        y = np.array([r["loss"] for r in l["steps"] if "loss" in r])
        if not len(s):
            continue
        st = style(mode, seed)
        ax.plot(s, _smooth(y, window), label=f"{mode} s{seed}", **st)
        if l["vals"]:
            ax.plot([v["step"] for v in l["vals"]], [v["val_loss"] for v in l["vals"]], "o", color=st["color"], ms=3)
        base = logs.get(("bf16", seed))
        if base is not None and mode != "bf16":
            bl = {r["step"]: r["loss"] for r in base["steps"] if "loss" in r}
            pts = [(a, b - bl[a]) for a, b in zip(s, y) if a in bl]
            if pts:
                ps, pd = map(np.array, zip(*pts))
                axd.plot(ps, _smooth(pd, window), label=f"{mode} s{seed}", **st)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"Train loss (moving average over {window} steps), val loss (dots)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
        lo = min(min(v["val_loss"] for v in l["vals"]) for l in logs.values() if l["vals"]) if any(
            l["vals"] for l in logs.values()) else None
        if lo is not None:   # NOTE: the first steps (~ln vocab) would flatten the interesting part
            ax.set_ylim(lo - 0.3, lo + 2.5)
    axd.axhline(0.0, color="k", lw=0.8)
    axd.set_xlabel("step")
    axd.set_ylabel("train loss - bf16 (same seed, same batch)")
    axd.grid(alpha=0.3)
    if axd.get_legend_handles_labels()[0]:
        axd.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "seeds_loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (ax, axr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for (mode, seed), l in logs.items():
        pts = [(r["step"], r["max_gain"]) for r in l["steps"] if r.get("max_gain") is not None]
        if pts:
            ax.plot(*zip(*pts), label=f"{mode} s{seed}", **style(mode, seed))
        post = [(r["step"], r["rowsum_post_mean"]) for r in l["steps"] if r.get("rowsum_post_mean") is not None]
        if post:
            axr.plot(*zip(*post), marker="o", ms=2.5, label=f"{mode} s{seed}", **style(mode, seed))
    ax.set_ylabel("max_c |g| over g_q, g_k, all layers")
    ax.set_title("QK-norm max channel gain" + ("" if ax.get_legend_handles_labels()[0] else " (none logged: no QK-norm)"))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    if axr.get_legend_handles_labels()[0]:
        axr.set_yscale("log")
        axr.legend(fontsize=7, ncol=2)
    axr.set_xlabel("step")
    axr.set_ylabel("post-cast dS row-sum residual (mean)")
    axr.grid(alpha=0.3, which="both")
    fig.tight_layout()
    paths.append(out_dir / "seeds_gain.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _at_step_note(study: dict) -> str:
    """The seeds.md paragraph saying which val step --at-step read and why. The logs number
    the training steps from 0 and the val line of step N is the loss after N + 1 steps, so
    "step 5 of 6" (the old wording) was the end of a 6-step run, not one step short of it."""
    n, total = study["at_step"], study["config"]["train"]["steps"]
    cut = sorted(r["steps_done"] for r in study["runs"] if r["steps_done"] < r["steps"])
    if study.get("at_step_common"):
        why = ("the last val step that every run logged (--at-step common)"
               + (f": {len(cut)} of the {len(study['runs'])} runs stopped before the end (after "
                  f"{cut[0]}{'' if cut[0] == cut[-1] else f'-{cut[-1]}'} steps: a deadline or --stop-after-steps), "
                  "so no later step has a val loss in every run" if cut else ""))
    else:
        why = f"the step given by --at-step {n}"
    return (f"**Read at val step {n}** ({why}): each run's val loss after {n + 1} of the {total} training steps "
            f"({'the end of training' if n + 1 == total else f'{total - n - 1} before the end'}; the logs count steps "
            "from 0), and its gains and residuals from its last step record up to that step. At that step every run "
            "has had the same lr schedule and (per seed) the same batches, so the modes compare fairly.")


def aggregate(study_dir, modes=None, seeds=None, out=None, partial=False, at_step=None) -> dict:
    """Loads the study, writes seeds.md / seeds.json / the two PNGs into `out` (default: the
    study dir); returns {"markdown", "json", "paths"}. at_step: an int, "common" or None
    (see --at-step in the module docstring)."""
    common = at_step == "common"
    if common:
        at_step = common_val_step(study_dir, modes, seeds)
    study = load_study(study_dir, modes, seeds, partial=partial, at_step=at_step)
    study["at_step_common"] = common
    out = Path(out) if out is not None else study["study"]
    if out.exists() and not out.is_dir():
        raise ValueError(f"seeds: --out {out} is a file; expected a directory (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"seeds: --out {out}: cannot create the directory ({exc.strerror})") from None
    stats = mode_stats(study)
    pairs = paired(study, stats)
    plots = make_plots(study, out)
    prov = None
    for r in study["runs"]:
        p = study["study"] / r["dir"] / "provenance.json"
        if p.is_file():
            prov = json.loads(p.read_text())
            break
    md = markdown(study, stats, pairs, plots, prov)
    (out / "seeds.md").write_text(md)
    js = {"study": str(study["study"]), "modes": study["modes"], "seeds": study["seeds"], "config": study["config"],
          "runs": study["runs"], "stats": stats, "pairs": pairs, "problems": study["problems"],
          "complete": not study["problems"], "at_step": study["at_step"], "provenance": prov}
    (out / "seeds.json").write_text(json.dumps(js, indent=1, default=str))
    return {"markdown": md, "json": js, "paths": [out / "seeds.md", out / "seeds.json", *plots]}


# ---- step plan ------------------------------------------------------------------------


def plan_steps(calib_dir, window_s: float, parallel: int, modes=None, seeds=None, cal_wall_s: float | None = None,
               val_batches: int = 8, max_steps: int = 100000, margin: float = 1.1,
               n_runs: int | None = None) -> tuple[int, str]:
    """(steps, note) for the training window (see the module docstring); (0, reason) when a
    calibration run has no usable step times. n_runs: runs of the real training (default:
    those of the calibration)."""
    calib_dir = Path(calib_dir)
    if modes is None or seeds is None:
        # NOTE: the calibration may be a subset of the study (its first wave): take the dirs found.
        try:
            cells = discover_runs(calib_dir)
        except ValueError as exc:
            return 0, str(exc)
        if not cells:
            return 0, f"no <mode>-s<seed> calibration runs in {calib_dir}"
    else:
        cells = [(m, s) for s in seeds for m in modes]
    per_run, train_t = {}, []
    for mode, seed in cells:
        p = calib_dir / run_dir_name(mode, seed) / f"{mode}.jsonl"
        if not p.is_file():
            return 0, f"calibration run {mode} seed {seed} wrote no log ({p})"
        try:
            log = read_log(p)
        except ValueError as exc:
            return 0, f"calibration run {mode} seed {seed}: {exc}"
        dts = [r["step_time_s"] for r in log["steps"] if "step_time_s" in r and r["step"] >= CALIB_SKIP]
        if not dts:
            return 0, f"calibration run {mode} seed {seed} logged no step time at step >= {CALIB_SKIP}"
        per_run[f"{mode}-s{seed}"] = float(np.mean(dts))
        if log["summary"] and log["summary"].get("train_time_s") is not None:
            train_t.append(log["summary"]["train_time_s"])
    n_runs = n_runs or len(per_run)
    waves = math.ceil(n_runs / max(1, parallel))
    slowest = max(per_run, key=per_run.get)
    t_step = per_run[slowest] * margin
    startup = max(5.0, cal_wall_s - max(train_t)) if cal_wall_s is not None and train_t else 15.0
    val_cost = 5 * val_batches * t_step / 3
    per_wave = window_s / waves - startup - val_cost
    steps = int(per_wave / t_step) // 10 * 10
    steps = max(10, min(max_steps, steps))
    note = (f"step time under {min(n_runs, parallel)}-way concurrency: slowest {slowest} "
            f"{per_run[slowest] * 1e3:.0f} ms (fastest {min(per_run.values()) * 1e3:.0f} ms), x{margin} margin; "
            f"{waves} wave(s), start-up {startup:.0f} s, window {window_s:.0f} s, "
            f"planned {waves * (startup + val_cost + steps * t_step):.0f} s")
    return steps, note


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Seed-spread study: aggregate runs, or plan the step count.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aggregate", help="table + plots from <mode>-s<seed> run dirs")
    a.add_argument("--study", required=True)
    a.add_argument("--modes", default=None, help="comma-separated (default: from the run dirs)")
    a.add_argument("--seeds", default=None, help="comma-separated (default: from the run dirs)")
    a.add_argument("--out", default=None, help="default: the study dir")
    a.add_argument("--partial", action="store_true", help="leave missing/cut-short/diverged runs out, list them")
    a.add_argument("--at-step", default=None,
                   help="read every run at this val step instead of at its end: a step index as the logs number "
                        "it (from 0: step N = after N+1 training steps) or 'common' (the largest val step all runs "
                        "logged)")
    p = sub.add_parser("plan", help="step count for a training window from a calibration")
    p.add_argument("--calib", required=True)
    p.add_argument("--window-s", type=float, required=True)
    p.add_argument("--parallel", type=int, required=True)
    p.add_argument("--modes", default=None)
    p.add_argument("--seeds", default=None)
    p.add_argument("--n-runs", type=int, default=None)
    p.add_argument("--cal-wall-s", type=float, default=None)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--margin", type=float, default=1.1)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes is not None else None
    if modes is not None:
        bad = [m for m in modes if not is_mode_name(m)]
        if bad or not modes:
            ap.error(f"--modes: expected comma-separated modes out of {','.join(MODE_ORDER)} or recipe variants "
                     f"{MODE_GRAMMAR}, got {args.modes!r}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds is not None else None
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if seeds is not None and not seeds:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if args.cmd == "plan":
        for name, v, ok, want in (
                ("--window-s", args.window_s, math.isfinite(args.window_s) and args.window_s > 0, "a time > 0"),
                ("--parallel", args.parallel, args.parallel >= 1, "an integer >= 1"),
                ("--n-runs", args.n_runs, args.n_runs is None or args.n_runs >= 1, "an integer >= 1"),
                ("--cal-wall-s", args.cal_wall_s,
                 args.cal_wall_s is None or (math.isfinite(args.cal_wall_s) and args.cal_wall_s >= 0), "a time >= 0"),
                ("--val-batches", args.val_batches, args.val_batches >= 0, "an integer >= 0"),
                ("--max-steps", args.max_steps, args.max_steps >= 10, "an integer >= 10 (the smallest plan)"),
                ("--margin", args.margin, math.isfinite(args.margin) and args.margin > 0, "a factor > 0")):
            if not ok:
                ap.error(f"{name}: expected {want}, got {v}")
        steps, note = plan_steps(args.calib, args.window_s, args.parallel, modes, seeds, args.cal_wall_s,
                                 args.val_batches, args.max_steps, args.margin, args.n_runs)
        print(steps, note)
        return 0 if steps else 2
    at_step = args.at_step
    if at_step is not None and at_step != "common":
        try:
            at_step = int(at_step)
        except ValueError:
            ap.error(f"--at-step: expected an integer step or 'common', got {args.at_step!r}")
        if at_step < 0:
            ap.error(f"--at-step: expected a step >= 0, got {at_step}")
    if at_step is not None and args.partial:
        ap.error("--at-step and --partial exclude each other")
    try:
        res = aggregate(args.study, modes, seeds, args.out, args.partial, at_step)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(res["markdown"])
    print("wrote " + ", ".join(str(p) for p in res["paths"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
