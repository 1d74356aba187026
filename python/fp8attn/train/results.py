"""Builds docs/results.md (issue 6) from compare run directories and their probes.

    python -m fp8attn.train.results \\
        --run "stress-h200=runs/study/stress" \\
        --prior docs/runs/gpu-50m-h200-2026-11-29 --prior docs/runs/cpu-tiny-2026-11-29 \\
        --verdict docs/results_verdict.md --out docs/results.md --fig-dir docs/results

--run LABEL=DIR (repeatable): a `python -m fp8attn.train.compare` run directory
(<mode>.jsonl logs, recipe variants such as fp8-delta_matching@tile included; summary.json;
a run cut short is read from its logs) with an
optional `probe/` subdirectory (`python -m fp8attn.train.probe`). Its figures
are drawn into --fig-dir as <LABEL>-*.png.
--prior DIR (repeatable): an earlier run kept in docs/runs/ (summary.json,
report.md, optional provenance.json with the command and machine); shown as
prior evidence with its existing figures.
--scan DIR (repeatable): a `python -m fp8attn.train.logit_scan` output (scan.json,
scan.md, scan.png): stale residual vs attention logit scale on synthetic inputs,
shown with the stress-configuration section.
--verdict FILE: hand-written markdown placed under "Verdict" (kept across
regenerations); without it the section says the verdict is pending.

Sections follow the issue's deliverables: kernel probe, training comparison,
stress configurations tried, channel-gain growth, masking probe, prior
evidence, versions. Every table names the command that produced its numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from . import provenance
from .model import ATTN_MODES, CUDNN_MODE, is_mode_name, mode_sort_key
from .report import markdown_table, make_plots, mode_label, read_log

MODE_ORDER = ATTN_MODES   # NOTE: one source of truth: every mode the harness trains, fp8-cudnn included


# ---- loading --------------------------------------------------------------------


def load_run(run_dir: str | os.PathLike) -> dict:
    """{dir, logs {mode: read_log}, summaries [..], summary_json (or None), probe (or None),
    complete (bool)}. Modes whose log has no summary (a run cut short) get one built from
    the log: steps_done, final train loss (mean of the last 20 steps), last val loss,
    "incomplete": True."""
    run_dir = Path(run_dir)
    # NOTE: MODE_ORDER's order, each mode's recipe variants (fp8-delta_matching@tile, ...) after it.
    names = {p.name[:-len(".jsonl")] for p in run_dir.glob("*.jsonl")} if run_dir.is_dir() else set()
    logs = {m: read_log(run_dir / f"{m}.jsonl") for m in sorted((n for n in names if is_mode_name(n)),
                                                                key=mode_sort_key)}
    if not logs:
        raise FileNotFoundError(f"results: no <mode>.jsonl logs in {run_dir}")
    summaries = []
    for m, log in logs.items():
        s = log["summary"]
        if s is None or s.get("complete") is False:   # NOTE: a call stopped by --deadline-s (compare --resume)
            losses = [r["loss"] for r in log["steps"] if "loss" in r]
            s = {"mode": m, "steps_done": len(losses), "incomplete": True,
                 "diverged": any(r.get("diverged") for r in log["steps"]),
                 "final_train_loss": float(np.mean(losses[-20:])) if losses else None,
                 "final_val_loss": log["vals"][-1]["val_loss"] if log["vals"] else None,
                 "init_fingerprint": log["meta"]["init_fingerprint"] if log["meta"] else None}
        summaries.append(s)
    sj = run_dir / "summary.json"
    probe = run_dir / "probe" / "probe.json"
    prov = run_dir / "provenance.json"
    return {"dir": run_dir, "logs": logs, "summaries": summaries,
            "provenance": json.loads(prov.read_text()) if prov.is_file() else None,
            "summary_json": json.loads(sj.read_text()) if sj.is_file() else None,
            "probe": json.loads(probe.read_text()) if probe.is_file() else None,
            "complete": sj.is_file() and all(log["summary"] and log["summary"].get("complete", True)
                                             for log in logs.values())}


def load_prior(prior_dir: str | os.PathLike) -> dict:
    """{dir, summary_json, header (Model/Training/Data lines of report.md), provenance (or {})}."""
    d = Path(prior_dir)
    sj = json.loads((d / "summary.json").read_text())
    header = []
    if (d / "report.md").is_file():
        header = [ln for ln in (d / "report.md").read_text().splitlines()
                  if ln.startswith(("Model:", "Training:", "Data:"))]
    prov = json.loads((d / "provenance.json").read_text()) if (d / "provenance.json").is_file() else {}
    return {"dir": d, "summary_json": sj, "header": header, "provenance": prov}


# ---- figures --------------------------------------------------------------------


def _layer_series(log: dict, key: str) -> dict:
    """{layer: (steps, max_values, share_values)} from the step records' `key`
    ("gains": QK-norm gains, every step; "act_scales": Q/K channel scales, diag steps)."""
    series = {}
    for r in log["steps"]:
        for layer, (mx, share) in (r.get(key) or {}).items():
            s = series.setdefault(layer, ([], [], []))
            s[0].append(r["step"])
            s[1].append(mx)
            s[2].append(share)
    return series


def gains_plot(logs: dict, path: Path) -> Path | None:
    """Per-layer channel-gain growth (issue 6 deliverable 4): one column per mode; rows
    max gain and top-4 share for the QK-norm gains (when the model has QK-norm) and for
    the Q/K channel scales (capture.ActivationScales). Lines colored by layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [(k, lab) for k, lab in (("gains", "QK-norm gain"), ("act_scales", "Q/K channel scale"))
             if any(_layer_series(log, k) for log in logs.values())]
    if not kinds:
        return None
    modes = list(logs)
    fig, axes = plt.subplots(2 * len(kinds), len(modes), figsize=(3.6 * len(modes), 2.6 * 2 * len(kinds)),
                             squeeze=False, sharex=True, sharey="row")
    for col, mode in enumerate(modes):
        for kr, (key, label) in enumerate(kinds):
            series = _layer_series(logs[mode], key)
            cmap = plt.get_cmap("viridis", max(2, len(series)))
            ax_max, ax_share = axes[2 * kr][col], axes[2 * kr + 1][col]
            for i, (layer, (st, mx, sh)) in enumerate(series.items()):
                ax_max.plot(st, mx, color=cmap(i), lw=1.0, label=layer)
                ax_share.plot(st, sh, color=cmap(i), lw=1.0)
            ax_max.set_title(f"{mode}", fontsize=9)
            if col == 0:
                ax_max.set_ylabel(f"max {label}", fontsize=8)
                ax_share.set_ylabel(f"top-4 share ({label})", fontsize=7)
            for ax in (ax_max, ax_share):
                ax.grid(alpha=0.3)
                ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    axes[0][-1].legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def draw_run_figures(label: str, run: dict, fig_dir: Path) -> dict:
    """Writes <label>-loss/rowsum/gains.png (+ the probe figures) into fig_dir;
    returns {name: path}."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in make_plots(run["logs"], Path(tmp)):
            if p.stem == "qk_gain":   # NOTE: max over layers only; gains_plot shows every layer
                continue
            dst = fig_dir / f"{label}-{p.name}"
            shutil.move(str(p), dst)
            out[p.stem] = dst
    g = gains_plot(run["logs"], fig_dir / f"{label}-gains.png")
    if g:
        out["gains"] = g
    if run["probe"]:
        # Drawn again from probe.json, so a run kept without its PNGs still gets them.
        from . import probe
        with tempfile.TemporaryDirectory() as tmp:
            for p in probe.make_plots(run["probe"], Path(tmp)):
                dst = fig_dir / f"{label}-{p.name}"
                shutil.move(str(p), dst)
                out[p.stem] = dst
        out["probe_md"] = fig_dir / f"{label}-probe.md"
        out["probe_md"].write_text(probe.markdown(run["probe"]))
    return out


# ---- markdown -------------------------------------------------------------------


def _e(v, spec=".2e"):
    return "n/a" if v is None else format(v, spec)


def _config_line(meta: dict) -> str:
    m, t = meta["model"], meta["train"]
    return (f"{meta['params'] / 1e6:.1f} M params, d_model {m['d_model']}, {m['n_layers']} layers, "
            f"{m['n_heads']}/{m['n_kv_heads']} q/kv heads, head_dim {m['head_dim']}, "
            f"QK-norm {'on' if m['qk_norm'] else 'off'}, {'RoPE' if m['rope'] else 'NoPE'}, "
            f"fp8 scope {m.get('scope', 'attn-core')}{', packed documents' if m.get('packed') else ''}; "
            f"{t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens, lr {t['lr']} "
            f"(warmup {t['warmup']}), seed {t['seed']}, device {meta['device']}")


def _run_meta(run: dict) -> dict:
    return next(log["meta"] for log in run["logs"].values() if log["meta"])


def _provenance(run: dict) -> dict:
    return (run["summary_json"] or {}).get("provenance") or run.get("provenance") or {}


def _command(run: dict) -> str:
    return _provenance(run).get("command") or "(not recorded)"


def _gap(summaries: list[dict], mode: str) -> float | None:
    by = {s["mode"]: s for s in summaries}
    if "bf16" not in by or mode not in by:
        return None
    a, b = by[mode].get("final_val_loss"), by["bf16"].get("final_val_loss")
    return None if a is None or b is None else a - b


def _rel(path: Path, out: Path) -> str:
    return os.path.relpath(path, out.parent)


def _probed(run: dict) -> list[dict]:
    """The probe's checkpoint results without the failed and the skipped ones."""
    return [ck for ck in (run["probe"] or {}).get("checkpoints", []) if "kernel" in ck]


def _probe_failures(run: dict) -> list[str]:
    """One markdown line per checkpoint the probe failed on or skipped (a mode that cannot
    run on the probe's device: fp8-cudnn), shown, not dropped silently."""
    out = []
    for ck in (run["probe"] or {}).get("checkpoints", []):
        if "error" in ck:
            out.append(f"- probe failed on `{ck.get('checkpoint', '?')}`: {ck['error']}")
        elif "skipped" in ck:
            out.append(f"- probe skipped `{ck.get('checkpoint', '?')}` ({mode_label(ck.get('mode') or '?')}): "
                       f"cannot run on {ck.get('device', 'the probe device')}: {ck['skipped']}")
    return out


def _final_layer_gains(log: dict, key: str) -> dict:
    s = _layer_series(log, key)
    return {layer: (mx[-1], sh[-1]) for layer, (_, mx, sh) in s.items()}


def build(runs: dict, priors: list[dict], out: Path, fig_dir: Path, verdict: str | None,
          command: str | None = None, scans: list[Path] = ()) -> str:
    figs = {label: draw_run_figures(label, run, fig_dir) for label, run in runs.items()}
    L = ["# Results: the Delta-Matching evidence at small scale (issue 6)", "",
         f"Generated by `{command or provenance.command_line()}` from the run directories below; "
         "each table names the command that produced its numbers. Definitions: "
         "[numerics.md](numerics.md) sections 4-5; row-sum residual r_i = |sum_j dS_ij| / sum_j |dS_ij|, "
         "eps_i = delta_i(mode) - delta_i(delta_matching).", ""]

    L += ["## Verdict", "", verdict.strip() if verdict else
          "_Pending: written by hand after the GPU study (pass `--verdict FILE`)._", ""]

    # Findings in numbers.
    L += ["## Findings in numbers", ""]
    for label, run in runs.items():
        ss = run["summaries"]
        parts = [f"{mode_label(s['mode'])} val {_e(s.get('final_val_loss'), '.4f')}"
                 + (f" (gap to bf16 {_gap(ss, s['mode']):+.4f})" if _gap(ss, s["mode"]) is not None
                    and s["mode"] != "bf16" else "")
                 + (" DIVERGED" if s.get("diverged") else "") + (" INCOMPLETE" if s.get("incomplete") else "")
                 for s in ss]
        L.append(f"- **{label}**: " + "; ".join(parts) + ".")
        if run["probe"]:
            for ck in _probed(run):
                r = ck["kernel"]["ratios"].get("stale/delta_matching")
                if r:
                    L.append(f"  - kernel probe on the {mode_label(ck['mode'])} checkpoint: stale/DM dS row-sum residual "
                             f"{r['pre']:.3g}x pre-cast, {r['post']:.3g}x post-cast (ratio of the means; "
                             f"of the medians {r['pre_p50']:.3g}x and {r['post_p50']:.3g}x).")
    for p in priors:
        ss = p["summary_json"]["summaries"]
        L.append(f"- prior **{p['dir'].name}**: " + "; ".join(
            f"{mode_label(s['mode'])} val {_e(s.get('final_val_loss'), '.4f')}" for s in ss) + ".")
    L.append("")

    # 1. Kernel probe.
    L += ["## 1. Kernel probe on real activations", "",
          "Q, K, V (after QK-norm/RoPE) and dO captured with hooks from one real forward/backward of "
          "each checkpoint on validation text, then the FP8 op run per layer in each delta mode "
          "(`python -m fp8attn.train.probe`). pre = FP32 dS, post = decoded FP8 dS; "
          "eps_rel = |eps_i| / (|dO_i| |O_i|). The median is the robust statistic: a nearly one-hot "
          "row has a dS of pure rounding noise and a residual up to 1 in every mode, which can dominate the mean.", ""]
    for label, run in runs.items():
        pr = run["probe"]
        if not pr:
            L += [f"**{label}**: no probe.", ""]
            continue
        L += [f"### {label}", "", f"Command: `{pr['provenance']['command']}`", "",
              "| checkpoint | delta mode | pre mean / median | post mean / median | post p99 | eps_rel p50 / p99 | stale/DM post mean (per layer min-max) |",
              "|---|---|---|---|---|---|---|"]
        for ck in _probed(run):
            k = ck["kernel"]
            lr = [v["stale/delta_matching"]["post"] for v in k["layer_ratios"].values() if "stale/delta_matching" in v]
            for m, s in k["all"].items():
                cell = f"{min(lr):.2f}-{max(lr):.2f}" if (lr and m == "stale") else ""
                L.append(f"| {mode_label(ck['mode'])} step {ck['step']} | {m} "
                         f"| {_e(s['rowsum_pre']['mean'])} / {_e(s['rowsum_pre'].get('p50'))} "
                         f"| {_e(s['rowsum_post']['mean'])} / {_e(s['rowsum_post'].get('p50'))} "
                         f"| {_e(s['rowsum_post'].get('p99'))} "
                         f"| {_e(s['eps_rel'].get('p50'))} / {_e(s['eps_rel'].get('p99'))} | {cell} |")
        L.append("")
        if _probe_failures(run):
            L += _probe_failures(run) + [""]
        for name in ("probe_rowsum", "probe_eps"):
            if name in figs[label]:
                L.append(f"![{label} {name}]({_rel(figs[label][name], out)})")
        if "probe_md" in figs[label]:
            L += ["", f"Per-layer tables: [{figs[label]['probe_md'].name}]({_rel(figs[label]['probe_md'], out)}).", ""]

    # 2. Training comparison.
    L += ["## 2. Training comparison (same init, same data order)", ""]
    for label, run in runs.items():
        meta = _run_meta(run)
        L += [f"### {label}", "", f"Config: {_config_line(meta)}.", "", f"Command: `{_command(run)}`", "",
              markdown_table(run["summaries"], (run["summary_json"] or {}).get("skipped")), ""]
        if not run["complete"]:
            L += ["NOTE: this run was cut short; rows marked incomplete are read from the logs.", ""]
        if "loss" in figs[label]:
            L += [f"![{label} loss]({_rel(figs[label]['loss'], out)}) "
                  f"![{label} rowsum]({_rel(figs[label]['rowsum'], out)})", ""]

    # 3. Stress configurations tried.
    L += ["## 3. Configurations tried (stress search)", "",
          f"| run | model / training | stale - bf16 | DM - bf16 | matched_do - bf16 | {CUDNN_MODE} - bf16 | diverged |",
          "|---|---|---|---|---|---|---|"]

    def gaps(ss):
        return " | ".join(_e(_gap(ss, m), "+.4f") for m in ("fp8-stale", "fp8-delta_matching", "fp8-matched_do",
                                                            CUDNN_MODE))
    for label, run in runs.items():
        ss = run["summaries"]
        div = ", ".join(s["mode"] for s in ss if s.get("diverged")) or "none"
        L.append(f"| {label} | {_config_line(_run_meta(run))} | {gaps(ss)} | {div} |")
    for p in priors:
        ss = p["summary_json"]["summaries"]
        div = ", ".join(s["mode"] for s in ss if s.get("diverged")) or "none"
        desc = " ".join(h.split(":", 1)[1].strip() for h in p["header"][:2])
        L.append(f"| {p['dir'].name} (prior) | {desc} | {gaps(ss)} | {div} |")
    L.append("")

    for i, d in enumerate(scans):
        d = Path(d)
        sj = json.loads((d / "scan.json").read_text())
        lo, hi = sj["rows"][0], sj["rows"][-1]
        L += ["### Stale residual vs attention logit scale (synthetic inputs)" if i == 0 else "", "",
              "The FP8 op on Gaussian Q/K/V/dO with the logit standard deviation set by the scale of Q "
              "(`fp8attn.train.logit_scan`): how the stale delta's error relative to Delta-Matching depends on "
              "how sharp attention is (no QK-norm and a high learning rate let logits grow). Here the stale/DM "
              f"post-cast residual (median) goes from {lo['stale/DM']['post_p50']:.2f}x at logit std "
              f"{lo['scale']:g} to {hi['stale/DM']['post_p50']:.2f}x at {hi['scale']:g}.",
              "", f"Command: `{sj['provenance']['command']}`", "", (d / "scan.md").read_text().strip(), ""]
        if (d / "scan.png").is_file():
            dst = fig_dir / f"logit_scan-{i}.png"
            fig_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(d / "scan.png", dst)
            L += [f"![logit scan]({_rel(dst, out)})", ""]

    # 4. Channel gains.
    L += ["## 4. Channel-gain growth", "",
          "Max over channels of the QK-norm gains |g_q|, |g_k| per layer and the top-4 channels' share of "
          "sum_c (g_q[c] g_k[c])^2 (models with QK-norm); for every model also the same statistics of the "
          "Q/K channel scales (RMS over tokens and heads of each RoPE channel pair of Q and K, "
          "`fp8attn.train.capture.ActivationScales`), which is defined without QK-norm too.", ""]
    for label, run in runs.items():
        L += [f"### {label}", "", "| mode | final max QK gain (layer) | its top-4 share | final max Q/K scale (layer) | its top-4 share |",
              "|---|---|---|---|---|"]
        for mode, log in run["logs"].items():
            cells = []
            for key in ("gains", "act_scales"):
                fg = _final_layer_gains(log, key)
                if fg:
                    layer = max(fg, key=lambda n: fg[n][0])
                    cells += [f"{fg[layer][0]:.3f} ({layer})", f"{fg[layer][1]:.3f}"]
                else:
                    cells += ["n/a", "n/a"]
            L.append(f"| {mode_label(mode)} | " + " | ".join(cells) + " |")
        L.append("")
        if "gains" in figs[label]:
            L += [f"![{label} gains]({_rel(figs[label]['gains'], out)})", ""]

    # 5. Masking.
    L += ["## 5. Attention-output masking probe", "",
          "Validation loss increase when a layer's attention-sublayer output is zeroed "
          "(`capture.zero_attention_output`).", "",
          "| run | checkpoint | base val loss | last layer zeroed: increase | all layers (if probed): max increase (layer) |",
          "|---|---|---|---|---|"]
    for label, run in runs.items():
        for ck in _probed(run):
            mk = ck["masking"]
            last = str(ck["model_config"]["n_layers"] - 1)
            inc = mk["layers"].get(last, {}).get("increase")
            allc = ""
            if len(mk["layers"]) > 1:
                i, v = max(mk["layers"].items(), key=lambda kv: kv[1]["increase"])
                allc = f"{v['increase']:+.4f} (layer {i})"
            L.append(f"| {label} | {mode_label(ck['mode'])} step {ck['step']} | {mk['base']:.4f} | {_e(inc, '+.4f')} | {allc} |")
    L.append("")

    # 6. Prior evidence.
    L += ["## 6. Prior evidence (earlier runs in docs/runs)", ""]
    for p in priors:
        prov = p["provenance"]
        L += [f"### {p['dir'].name}", ""] + [f"{h}  " for h in p["header"]] + [""]
        if prov:
            L += [f"Command: `{prov.get('command', 'n/a')}`; machine: {prov.get('machine', 'n/a')}.", ""]
            if prov.get("note"):
                L += [prov["note"], ""]
        L += [markdown_table(p["summary_json"]["summaries"]), ""]
        imgs = [f for f in ("loss.png", "qk_gain.png", "rowsum.png") if (p["dir"] / f).is_file()]
        L += [" ".join(f"![{p['dir'].name} {f}]({_rel(p['dir'] / f, out)})" for f in imgs), ""]

    # 7. Versions.
    L += ["## 7. Versions", "", "| run | git commit | torch | CUDA | cuDNN | GPU | fp8attn CUDA kernels | when (UTC) |",
          "|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        pv = _provenance(run) or (run["probe"] or {}).get("provenance") or {}
        L.append(f"| {label} | {pv.get('git_commit')} | {pv.get('torch')} | {pv.get('cuda')} | {pv.get('cudnn')} "
                 f"| {pv.get('gpu') or 'none (CPU)'} | {pv.get('fp8attn_cuda_kernels')} | {pv.get('time_utc')} |")
    for p in priors:
        prov = p["provenance"]
        L.append(f"| {p['dir'].name} | {prov.get('git_commit', 'n/a')} | {prov.get('versions', 'see docs/runs/README.md')} "
                 "| | | | | |")
    L.append("")
    return "\n".join(L)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Build docs/results.md from run directories.")
    ap.add_argument("--run", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--prior", action="append", default=[], metavar="DIR")
    ap.add_argument("--scan", action="append", default=[], metavar="DIR", help="logit_scan output dir")
    ap.add_argument("--verdict", default=None, help="markdown file with the hand-written verdict")
    ap.add_argument("--out", default="docs/results.md")
    ap.add_argument("--fig-dir", default=None, help="default: <out without .md>/ (e.g. docs/results/)")
    a = ap.parse_args(argv)
    runs = {}
    for item in a.run:
        label, sep, d = item.partition("=")
        if not sep or not label or not d or "/" in label:
            ap.error(f"--run: expected LABEL=DIR with a LABEL free of '/', got {item!r}")
        if label in runs:
            # NOTE: a repeated label would silently drop the earlier run (and share its figures).
            ap.error(f"--run: label {label!r} given twice ({runs[label]} and {d})")
        runs[label] = d
    a.runs = runs
    for flag, paths in (("--scan", a.scan), ("--prior", a.prior)):
        for d in paths:
            if not Path(d).is_dir():
                ap.error(f"{flag}: {d} is not a directory")
    if a.verdict and not Path(a.verdict).is_file():
        ap.error(f"--verdict: {a.verdict} is not a file")
    if not runs and not a.prior and not a.scan:
        ap.error("give at least one --run, --prior or --scan")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    fig_dir = Path(a.fig_dir) if a.fig_dir else out.with_suffix("")
    runs = {label: load_run(d) for label, d in a.runs.items()}
    priors = [load_prior(d) for d in a.prior]
    verdict = Path(a.verdict).read_text() if a.verdict else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build(runs, priors, out, fig_dir, verdict,
                         provenance.module_command("fp8attn.train.results", argv), a.scan))
    print(f"results: {out} (figures in {fig_dir})")


if __name__ == "__main__":
    main()
