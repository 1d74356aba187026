"""Comparison report: markdown table + PNG plots from the per-mode JSONL logs.

Table columns (one row per mode):
  final train loss   mean loss of the last `loss_avg_last` steps
  final val loss     loss on the fixed val batches after the last step
  gap to bf16        final val loss - bf16's final val loss
  rowsum post mean/max  post-cast dS row-sum residual r_i = |sum_j dS_ij| / sum_j |dS_ij|
                     (numerics.md section 5): mean over rows (averaged over the
                     diagnostic steps and layers) / max over all of them
  mean |eps|         mean over rows of |delta_i(mode) - delta_i(delta_matching)|
  max QK gain        max over layers and channels of |g_q|, |g_k| at the last step
  top-4 share        max over layers of the top-4 channels' share of sum_c (g_q[c] g_k[c])^2
The bf16 baseline (torch SDPA) has no FP8 backward, so its diagnostics read "n/a";
neither has fp8-cudnn (cuDNN's FP8 SDPA, no fp8attn diagnostics). Row labels: the
mode, fp8-cudnn as MODE_LABELS says (the FP8 attention a user would pick instead),
plus "(diverged)" / "(incomplete: N steps)"; a mode compare skipped (fp8-cudnn where
it cannot run) is a row "<mode> (skipped)" of n/a cells, its reason under the table.
A recipe variant (model.parse_mode, e.g. fp8-delta_matching@tile+hadamard) is a row of
its own name; the line above the table gives every fp8attn mode's scaling and options.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


# Row labels of modes that need more than their name.
MODE_LABELS = {"fp8-cudnn": "fp8-cudnn (cuDNN FP8, delayed scaling)"}


def mode_label(mode: str) -> str:
    return MODE_LABELS.get(mode, mode)


def recipe_line(logs: dict[str, dict]) -> str | None:
    """The report's line on the FP8 attention recipe of each fp8attn mode (recipe variants
    such as fp8-delta_matching@tile+hadamard included), from the logs' meta model configs;
    None without an fp8attn mode."""
    from .model import FP8ATTN_MODES
    parts = []
    for mode, log in logs.items():
        m = (log.get("meta") or {}).get("model") or {}
        if m.get("attn_mode") in FP8ATTN_MODES:
            parts.append(f"{mode} scaling {m.get('fp8_scaling', 'row')}, qk_rotation "
                         f"{m.get('fp8_qk_rotation', 'none')}, smooth_k {'on' if m.get('fp8_smooth_k') else 'off'}")
    return "FP8 attention recipe of the fp8attn modes: " + "; ".join(parts) + "." if parts else None


def cudnn_note(s: dict) -> str:
    """The report's line on an fp8-cudnn row: what it is and how it ran (its summary's "cudnn_fp8")."""
    c = s.get("cudnn_fp8") or {}
    plans = c.get("plans") or []
    how = ""
    if plans:
        p = plans[0]
        gqa = {"native": "cuDNN's native GQA", "repeat": "K / V repeated to the query heads",
               "none": "no GQA"}.get(p.get("gqa"), p.get("gqa"))
        how = (f" Graph variant {p.get('variant')}, {gqa}; self-check against SDPA BF16 at the run's shape: "
               + ", ".join(f"{k} {v:.3f}" for k, v in (p.get("self_check") or {}).items()) + ".")
    ver = (f" cuDNN frontend {c['cudnn_frontend']}, backend {c.get('cudnn_backend')}."
           if c.get("cudnn_frontend") else "")
    return (f"{mode_label('fp8-cudnn')}: cuDNN's FP8 SDPA forward and backward, per-tensor E4M3 with "
            f"TransformerEngine-style delayed scaling (scale = 448 * 2^-margin / max of the last "
            f"{c.get('amax_history_len', '?')} amaxes, margin {c.get('margin', '?')}; the amaxes of Q, K, V, dO "
            f"and those cuDNN returns for P, O, dP, dQ, dK, dV): the FP8 attention a user would pick instead of "
            f"fp8attn. Same FP8 scope otherwise; no fp8attn diagnostics (n/a).{how}{ver}")


# How the reports (this one and seeds.py's) name TrainConfig.optimizer.
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon (hidden matrices) + AdamW"}


def read_log(path: str | Path) -> dict:
    """Parses a trainer JSONL log into {meta, steps, vals, summary}."""
    out = {"meta": None, "steps": [], "vals": [], "summary": None}
    with open(path) as f:
        lines = f.readlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            # NOTE: a run killed while writing (timeout backstop) leaves a cut-off last line.
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({exc.msg} at column {exc.colno})"
                             + ("; it is the last line: cut off when the run was killed while writing?"
                                if i == last else "")) from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object (not a trainer log?)")
        t = r.get("type")
        if t == "meta":
            out["meta"] = r
        elif t == "step":
            out["steps"].append(r)
        elif t == "val":
            out["vals"].append(r)
        elif t == "summary":
            out["summary"] = r
    return out


def _fmt(v, spec=".4f"):
    if v is None:
        return "n/a"
    return format(v, spec)


def markdown_table(summaries: list[dict], skipped: dict | None = None) -> str:
    """One row per summary, then one "(skipped)" row of n/a per mode in `skipped` ({mode: reason})."""
    base = next((s for s in summaries if s["mode"] == "bf16"), None)
    base_val = base["final_val_loss"] if base else None
    head = ("| mode | final train loss | final val loss | gap to bf16 | rowsum post mean / max "
            "| mean abs eps | max QK gain | top-4 share |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        gap = (s["final_val_loss"] - base_val) if (base_val is not None and s["final_val_loss"] is not None) else None
        rowsum = ("n/a" if s.get("rowsum_post_mean") is None
                  else f"{s['rowsum_post_mean']:.2e} / {s['rowsum_post_max']:.2e}")
        mode = mode_label(s["mode"]) + (" (diverged)" if s.get("diverged") else "") + (
            f" (incomplete: {s.get('steps_done')} steps)" if s.get("complete") is False else "")
        lines.append(f"| {mode} | {_fmt(s['final_train_loss'])} | {_fmt(s['final_val_loss'])} | "
                     f"{_fmt(gap, '+.4f')} | {rowsum} | {_fmt(s.get('eps_absmean'), '.2e')} | "
                     f"{_fmt(s.get('max_gain'), '.3f')} | {_fmt(s.get('top4_share'), '.3f')} |")
    for mode in (skipped or {}):
        lines.append(f"| {mode} (skipped) | " + " | ".join(["n/a"] * 7) + " |")
    return "\n".join(lines)


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    k = np.ones(window) / window
    head = np.cumsum(y[:window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(y, k, mode="valid")])


def make_plots(logs: dict[str, dict], out_dir: Path) -> list[Path]:
    """loss.png, qk_gain.png, rowsum.png under out_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    n = max((len(l["steps"]) for l in logs.values()), default=0)
    window = max(1, n // 30)

    fig, (ax, axd) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = logs.get("bf16")
    base_loss = {r["step"]: r["loss"] for r in base["steps"]} if base else {}
    for mode, l in logs.items():
        s = np.array([r["step"] for r in l["steps"]])
        y = np.array([r["loss"] for r in l["steps"]])
        if not len(s):
            continue
        line, = ax.plot(s, _smooth(y, window), label=f"{mode} train", lw=1.3)
        if l["vals"]:
            ax.plot([v["step"] for v in l["vals"]], [v["val_loss"] for v in l["vals"]], "o--",
                    color=line.get_color(), ms=4, lw=0.8, label=f"{mode} val")
        # NOTE: every mode sees the same batch at a given step, so the per-step
        # difference to bf16 is a paired comparison with far less noise than the curves.
        paired = [(st, v - base_loss[st]) for st, v in zip(s, y) if st in base_loss]
        if base and mode != "bf16" and paired:
            ps, pd = map(np.array, zip(*paired))
            axd.plot(ps, _smooth(pd, window), color=line.get_color(), lw=1.3, label=mode)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"Loss (train: moving average over {window} steps)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:   # NOTE: a run stopped before its first step has no lines
        ax.legend(fontsize=7)
    axd.axhline(0.0, color="k", lw=0.8)
    axd.set_xlabel("step")
    axd.set_ylabel("train loss - bf16 (same batch)")
    axd.grid(alpha=0.3)
    if base and len(logs) > 1 and axd.get_legend_handles_labels()[0]:
        axd.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, l in logs.items():
        pts = [(r["step"], r["max_gain"]) for r in l["steps"] if "max_gain" in r]
        if pts:
            ax.plot(*zip(*pts), label=mode, lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel("max_c |g| over g_q, g_k, all layers")
    ax.set_title("QK-norm max channel gain")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # NOTE: no QK-norm -> no gains, no lines
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "qk_gain.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_diag = False
    for mode, l in logs.items():
        post = [(r["step"], r["rowsum_post_mean"]) for r in l["steps"] if r.get("rowsum_post_mean") is not None]
        pre = [(r["step"], r["rowsum_pre_mean"]) for r in l["steps"] if r.get("rowsum_pre_mean") is not None]
        if post:
            any_diag = True
            line, = ax.plot(*zip(*post), label=f"{mode} post-cast", lw=1.3)
            if pre and max(v for _, v in pre) > 0:
                ax.plot(*zip(*pre), "--", color=line.get_color(), lw=0.9, label=f"{mode} pre-cast")
    if any_diag:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean_i |sum_j dS_ij| / sum_j |dS_ij|")
    ax.set_title("dS row-sum residual (mean over rows and layers)")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "rowsum.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_report(run_dir: str | Path, modes: list[str], skipped: dict | None = None) -> tuple[Path, str]:
    """Builds run_dir/report.md (+ PNGs) from run_dir/<mode>.jsonl; returns (path, table).
    skipped: {mode: reason} of the modes compare skipped (default: summary.json's "skipped")."""
    run_dir = Path(run_dir)
    if skipped is None and (run_dir / "summary.json").is_file():
        skipped = json.loads((run_dir / "summary.json").read_text()).get("skipped") or {}
    skipped = {m: r for m, r in (skipped or {}).items() if m not in modes}
    logs = {m: read_log(run_dir / f"{m}.jsonl") for m in modes}
    missing = [m for m, l in logs.items() if l["summary"] is None]
    if missing:
        raise RuntimeError(f"report: no summary in the logs of {missing} (run incomplete?)")
    summaries = [logs[m]["summary"] for m in modes]
    table = markdown_table(summaries, skipped)
    plots = make_plots(logs, run_dir)
    meta = logs[modes[0]]["meta"]
    m, t = meta["model"], meta["train"]
    fps = {s["init_fingerprint"] for s in summaries}
    lines = [
        "# Attention-mode comparison",
        "",
        f"Model: {meta['params'] / 1e6:.2f} M params, d_model {m['d_model']}, {m['n_layers']} layers, "
        f"{m['n_heads']} q heads / {m['n_kv_heads']} kv heads, head_dim {m['head_dim']}, "
        f"QK-norm {'on' if m['qk_norm'] else 'off'}, {'RoPE' if m['rope'] else 'NoPE'}, vocab {m['vocab_size']}.",
        f"Training: {t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens, {OPTIMIZER_NAMES[t.get('optimizer', 'adamw')]} lr {t['lr']} "
        f"(warmup {t['warmup']}, cosine to {t['min_lr_ratio']}x), clip {t['grad_clip']}, device {meta['device']}.",
        f"Data: {meta['data'].get('source')} ({meta['data'].get('train_tokens', 0) / 1e6:.2f} M train tokens, "
        f"{meta['data'].get('val_tokens', 0) / 1e6:.3f} M val tokens), same batch order for every mode.",
        (f"Continued from {t['init_from']} (weights only, fresh optimizer; "
         + ("each mode from its own checkpoint" if len(fps) > 1 else "every mode from the same weights")
         + f", fingerprints {', '.join(sorted(fps))})." if t.get("init_from") else
         f"Same initial weights in every mode: {'yes' if len(fps) == 1 else 'NO'} (fingerprint {', '.join(sorted(fps))})."),
        (f"Diagnostics every {t['diag_every']} steps" if t['diag_every'] else "Diagnostics off (--diag-every 0)")
        + f"; final train loss = mean of the last {t['loss_avg_last']} steps.",
        f"FP8 precision scope of the fp8 modes: {m.get('scope', 'attn-core')} (the bf16 mode is BF16 "
        f"everywhere); {'packed documents (per-document causal attention)' if m.get('packed') else 'plain causal rows'}"
        f"{'; FSDP2' if summaries[0].get('fsdp') else ''}.",
    ] + ([recipe_line(logs)] if recipe_line(logs) else []) + [
        "",
        table,
        "",
    ] + [cudnn_note(s) + "\n" for s in summaries if s["mode"] == "fp8-cudnn"] + [
        f"{mode} skipped: {why.rstrip('.')}.\n" for mode, why in skipped.items()] + [
        "Columns: see fp8attn/train/report.py. NOTE: rows that see fewer than two keys report a "
        "row-sum residual of 0 (docs/numerics.md section 7); the max can still read ~1 on a nearly "
        "one-hot row, whose dS is pure FP32/FP8 rounding noise, so the mean is the informative "
        "number. Wall time per mode: "
        + ", ".join(f"{s['mode']} {s['train_time_s']:.0f} s" for s in summaries) + ".",
        "",
    ] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    # The retrieval probe's tables and plot, when it has run on this run's checkpoints
    # (python -m fp8attn.train.retrieval --run-dir ...).
    retr = run_dir / "retrieval" / "retrieval.md"
    if retr.is_file():
        lines += [retr.read_text().replace("](retrieval.png)", "](retrieval/retrieval.png)"), ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path, table
