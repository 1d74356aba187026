"""Probes on trained checkpoints: the FP8 kernel on real activations, and attention masking.

    python -m fp8attn.train.probe --run-dir runs/x            # every <mode>.pt in runs/x
    python -m fp8attn.train.probe --ckpt runs/x/fp8-stale.pt --out runs/x/probe

Kernel probe (issue 6 deliverable 1; numerics.md sections 4-5). For each
checkpoint: one batch of real validation text goes through the model (in the
attention mode it was trained with) and one real backward; hooks on every
layer's attention core (capture.CoreCapture) keep Q, K, V (after QK-norm and
RoPE) and dO, the upstream gradient of the attention output O. Then, per layer
and per delta mode (stale, matched_do, delta_matching), the FP8 op
(`fp8attn.attention`, precision "fp8", causal) runs forward + backward on
exactly those tensors under `fp8attn.diagnostics.record(keep_raw=True)`, giving
per-row values of
  rowsum_pre   |sum_j dS_ij| / sum_j |dS_ij| of the FP32 dS (before the FP8 cast)
  rowsum_post  the same of the decoded FP8 dS (operand of matmul #6, 64-key blocks)
  eps          delta_i(mode) - delta_i(delta_matching)
  eps_rel      |eps_i| / (||dO_i|| ||O_i||) (scale-free: the loss's 1/tokens
               factor in dO cancels)
summarized per layer and over all layers (mean, quantiles, max) together with
the ratios stale / delta_matching and matched_do / delta_matching of the mean
residuals. Works with the CPU reference op and the CUDA kernels alike.

Masking probe (deliverable 5; numerics.md section 5): validation loss of the
checkpoint as trained, and with the attention-sublayer output of the last
layer (`--mask-layers all`: of each layer in turn) set to zero
(capture.zero_attention_output); reported as the loss increase.

Outputs under --out (default <run-dir>/probe): probe.json (everything above +
provenance), probe.md (tables), probe_rowsum.png, probe_eps.png.

Checkpoints of every attention mode (model.ATTN_MODES) and recipe variant (e.g.
fp8-delta_matching@tile+hadamard) are probed in the mode and recipe they were trained
with. One that cannot run on this device (fp8-cudnn without a CUDA sm_90 GPU,
the cuDNN frontend or head_dim 128: compare's check, trainer.checkpoint_unavailable_reason)
is skipped with a one-line reason ("[probe] skipped ...") and listed in probe.json as
{"checkpoint", "mode", "skipped": reason}; the others are probed. Named by --modes or
--ckpt, such a checkpoint stops the command before any work, naming the argument.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import provenance
from .capture import CoreCapture, zero_attention_output
from .checkpoint import load_checkpoint, read_info
from .data import TokenStream
from .model import ATTN_MODES, CUDNN_MODE, is_mode_name, mode_sort_key, parse_mode
from .report import mode_label
from .trainer import checkpoint_unavailable_reason, evaluate, resolve_device

DELTA_MODES = ("stale", "matched_do", "delta_matching")
_QUANTS = (0.5, 0.9, 0.99)
_EPS_QUANTS = (0.01, 0.1, 0.5, 0.9, 0.99)


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def capture_activations(model, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, float]:
    """Forward + backward of the mean next-token cross-entropy on (x, y), int64
    [B, S] on the model's device, with autocast BF16 on CUDA (as in training).
    Returns ({layer_name: {"q","k","v","o","do"}}, loss). Parameter grads are
    cleared afterwards."""
    device = next(model.parameters()).device
    model.eval()
    with CoreCapture(model) as cap:
        with _autocast(device):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
    model.zero_grad(set_to_none=True)
    missing = [name for name, r in cap.records.items() if "do" not in r]
    if missing or not cap.records:
        raise RuntimeError(f"probe: no dO captured for layers {missing or 'any'}")
    return cap.records, float(loss.detach())


def _summary(values: torch.Tensor, quants=_QUANTS) -> dict:
    v = values.double()
    if v.numel() == 0:
        return {"mean": None, "max": None}
    out = {"mean": float(v.mean()), "max": float(v.max())}
    qs = torch.quantile(v, torch.tensor(quants, dtype=torch.float64)) if v.numel() <= 16_000_000 else None
    for q, val in zip(quants, qs.tolist() if qs is not None else [None] * len(quants)):
        out[f"p{int(round(q * 100)):02d}"] = val
    return out


def _row_stats(rows: dict) -> dict:
    """Statistics of the raw per-row values {rowsum_pre, rowsum_post, eps, eps_rel, delta}."""
    eps = rows["eps"].double()
    e = {"mean": float(eps.mean()), "absmean": float(eps.abs().mean()), "absmax": float(eps.abs().max())}
    qs = torch.quantile(eps, torch.tensor(_EPS_QUANTS, dtype=torch.float64)).tolist()
    e.update({f"p{int(round(q * 100)):02d}": v for q, v in zip(_EPS_QUANTS, qs)})
    return {"rows": int(eps.numel()),
            "rowsum_pre": _summary(rows["rowsum_pre"]), "rowsum_post": _summary(rows["rowsum_post"]),
            "eps": e, "eps_rel": _summary(rows["eps_rel"]),
            "delta_absmean": float(rows["delta"].double().abs().mean())}


def probe_layer(rec: dict, delta_mode: str, *, layer_name: str, block_size: int = 128,
                grad_format: str = "e4m3") -> dict:
    """Runs the FP8 op forward + backward with delta_mode on one layer's captured
    tensors (Q, K, V, dO cast to BF16, the op contract) and returns the raw
    per-row tensors (CPU float32) of the rows that see >= 1 key:
    {rowsum_pre, rowsum_post, eps, eps_rel, delta}."""
    import fp8attn
    from fp8attn import diagnostics

    q, k, v = (rec[n].to(torch.bfloat16).detach().requires_grad_(True) for n in ("q", "k", "v"))
    do = rec["do"].to(torch.bfloat16)
    with diagnostics.record(keep_raw=True) as drec:
        o = fp8attn.attention(q, k, v, causal=True, precision="fp8", delta_mode=delta_mode,
                              block_size=block_size, grad_format=grad_format, layer_name=layer_name)
        o.backward(do)
    if len(drec.records) != 1:
        raise RuntimeError(f"probe: expected 1 diagnostics record for {layer_name}, got {len(drec.records)}")
    raw = drec.records[0]["raw"]
    mask = diagnostics.row_sees_key_mask(q.shape[2], k.shape[2], True, q.device)
    norms = (do.float().norm(dim=-1) * o.detach().float().norm(dim=-1))[..., mask].reshape(-1).cpu()
    eps = raw["eps"]
    eps_rel = torch.where(norms > 0, eps.abs() / norms.clamp_min(1e-30), torch.zeros_like(eps))
    return {"rowsum_pre": raw["rowsum_pre"], "rowsum_post": raw["rowsum_post"], "eps": eps,
            "eps_rel": eps_rel, "delta": raw["delta"]}


def kernel_probe(records: dict, delta_modes=DELTA_MODES, block_size: int = 128,
                 grad_format: str = "e4m3") -> dict:
    """{"layers": {layer: {delta_mode: stats}}, "all": {delta_mode: stats},
    "ratios": {"stale/delta_matching": {"pre", "post", "pre_p50", "post_p50"}, ...}
    (ratios of the mean and of the median residuals over all layers; per layer under
    "layer_ratios")}. NOTE: the median is the robust one: a nearly one-hot row has a
    dS of pure rounding noise and a residual of up to 1 in every mode."""
    layers, pooled = {}, {m: [] for m in delta_modes}
    for name, rec in records.items():
        layers[name] = {}
        for m in delta_modes:
            rows = probe_layer(rec, m, layer_name=name, block_size=block_size, grad_format=grad_format)
            layers[name][m] = _row_stats(rows)
            pooled[m].append(rows)
    all_stats = {m: _row_stats({k: torch.cat([r[k] for r in pooled[m]]) for k in pooled[m][0]})
                 for m in delta_modes}

    def ratios(stats):
        out = {}
        if "delta_matching" not in stats:
            return out
        dm = stats["delta_matching"]
        for m in delta_modes:
            if m == "delta_matching":
                continue
            r = {}
            for key in ("pre", "post"):
                for stat, suffix in (("mean", ""), ("p50", "_p50")):
                    a, b = stats[m][f"rowsum_{key}"].get(stat), dm[f"rowsum_{key}"].get(stat)
                    r[key + suffix] = None if a is None or b is None else (a / b if b else math.inf)
            out[f"{m}/delta_matching"] = r
        return out

    return {"layers": layers, "all": all_stats, "ratios": ratios(all_stats),
            "layer_ratios": {name: ratios(s) for name, s in layers.items()}}


def masking_probe(model, batches, layers="last") -> dict:
    """Validation loss as trained ("base") and with one layer's attention output
    zeroed: {"base": float, "layers": {index: {"loss": float, "increase": float}}}.
    layers: "last", "all", or a list of block indices (of attention blocks: with
    arch gdn-hybrid "last" / "all" mean the attention layers)."""
    device = next(model.parameters()).device
    n = len(model.blocks)
    attn = [i for i, b in enumerate(model.blocks) if b.attn is not None]   # gdn-hybrid: attention layers only
    idx = [attn[-1]] if layers == "last" else attn if layers == "all" else [i % n for i in layers]
    base = evaluate(model, batches, device, lambda: _autocast(device))
    out = {"base": base, "layers": {}}
    for i in idx:
        with zero_attention_output(model, i):
            loss = evaluate(model, batches, device, lambda: _autocast(device))
        out["layers"][str(i)] = {"loss": loss, "increase": loss - base}
    model.eval()
    return out


def probe_checkpoint(path, *, device="auto", data_root=None, batch_size=4, seq_len=None,
                     val_batches=None, mask_batch_size=None, mask_layers="last",
                     delta_modes=DELTA_MODES) -> dict:
    """Both probes on one checkpoint; returns the JSON-ready result.

    batch_size: sequences of the kernel-probe capture batch (the first of the fixed
    val batches). The masking probe uses val_batches x mask_batch_size sequences,
    by default the training run's val batches (so its base loss is the logged
    final val loss)."""
    dev = resolve_device(device)
    t0 = time.time()
    model, info = load_checkpoint(path, dev)
    if getattr(model.cfg, "packed", False):
        raise ValueError(f"probe: {path} was trained with packed documents; the kernel probe runs one "
                         "causal call per row and does not support packed (varlen) checkpoints yet")
    root = Path(data_root or info.get("data_root") or "")
    val_path = root / "val.bin"
    if not val_path.is_file():
        raise FileNotFoundError(f"probe: validation tokens {val_path} not found; pass --data-root "
                                f"(the prepared corpus directory the model was trained on)")
    tc = info["train_config"]
    seq_len = seq_len or tc.get("seq_len") or model.cfg.max_seq_len
    val_batches = val_batches or tc.get("val_batches") or 8
    mask_batch_size = mask_batch_size or tc.get("batch_size") or batch_size
    stream = TokenStream(val_path, seq_len)
    x, y = stream.fixed_batches(1, batch_size)[0]
    records, loss = capture_activations(model, x.to(dev), y.to(dev))
    kern = kernel_probe(records, delta_modes, block_size=model.cfg.fp8_block_size)
    del records
    mask = masking_probe(model, stream.fixed_batches(val_batches, mask_batch_size), mask_layers)
    return {"checkpoint": str(path), "mode": info["mode"], "step": info["step"],
            "model_config": info["model_config"], "train_config": info["train_config"],
            "data_root": str(root), "device": str(dev),
            "capture": {"batch_size": batch_size, "seq_len": seq_len, "loss": loss},
            "kernel": kern, "masking": mask, "masking_val_batches": val_batches,
            "masking_batch_size": mask_batch_size,
            "time_s": time.time() - t0}


# ---- report -------------------------------------------------------------------


def _e(v, spec=".2e"):
    return "n/a" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    """probe.md: per checkpoint, the all-layer kernel table, the per-layer table and masking."""
    lines = ["# Kernel and masking probes", ""]
    for ck in result["checkpoints"]:
        if "error" in ck:
            lines += [f"## {Path(ck['checkpoint']).name}: probe failed", "", f"`{ck['error']}`", ""]
            continue
        if "skipped" in ck:
            lines += [f"## {mode_label(ck.get('mode') or '?')}: skipped", "",
                      f"`{Path(ck['checkpoint']).name}` cannot run on {ck.get('device', 'this device')}: "
                      f"{ck['skipped']}", ""]
            continue
        k = ck["kernel"]
        c = ck["capture"]
        lines += [f"## {mode_label(ck['mode'])} (step {ck['step']})", "",
                  f"Capture: {c['batch_size']} x {c['seq_len']} validation tokens, loss {c['loss']:.4f}; "
                  f"device {ck['device']}; checkpoint `{Path(ck['checkpoint']).name}`.", "",
                  "All layers (per-row values pooled):", "",
                  "| delta mode | rows | pre mean | pre p50 / p99 | post mean | post p50 / p99 "
                  "| eps p01 / p50 / p99 | mean abs eps | eps_rel p50 / p99 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for m, s in k["all"].items():
            e, r = s["eps"], s["eps_rel"]
            lines.append(f"| {m} | {s['rows']} | {_e(s['rowsum_pre']['mean'])} "
                         f"| {_e(s['rowsum_pre'].get('p50'))} / {_e(s['rowsum_pre'].get('p99'))} "
                         f"| {_e(s['rowsum_post']['mean'])} "
                         f"| {_e(s['rowsum_post'].get('p50'))} / {_e(s['rowsum_post'].get('p99'))} "
                         f"| {_e(e['p01'])} / {_e(e['p50'])} / {_e(e['p99'])} | {_e(e['absmean'])} "
                         f"| {_e(r.get('p50'))} / {_e(r.get('p99'))} |")
        rat = k["ratios"]
        if rat:
            lines += ["", "Residual ratios to delta_matching (all layers), of the means / of the medians: " + "; ".join(
                f"{name}: pre {v['pre']:.3g}x / {v['pre_p50']:.3g}x, post {v['post']:.3g}x / {v['post_p50']:.3g}x"
                for name, v in rat.items()), ""]
        modes = list(k["all"])
        lines += ["Per layer (mean residual pre -> post-cast):", "",
                  "| layer | " + " | ".join(modes) + " | stale/DM post |",
                  "|---|" + "---|" * (len(modes) + 1)]
        for name, per in k["layers"].items():
            cells = [f"{_e(per[m]['rowsum_pre']['mean'])} -> {_e(per[m]['rowsum_post']['mean'])}" for m in modes]
            lr = k["layer_ratios"][name].get("stale/delta_matching", {}).get("post")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {'n/a' if lr is None else format(lr, '.2f')} |")
        mk = ck["masking"]
        lines += ["", f"Masking probe ({ck['masking_val_batches']} val batches x {ck.get('masking_batch_size')} x "
                  f"{c['seq_len']} tokens): base val loss {mk['base']:.4f}; "
                  + ", ".join(f"layer {i} zeroed {v['increase']:+.4f}" for i, v in mk["layers"].items()), ""]
    return "\n".join(lines)


def make_plots(result: dict, out_dir: Path) -> list[Path]:
    """probe_rowsum.png (mean residual per layer, pre/post, per delta mode; one panel per
    checkpoint) and probe_eps.png (eps_rel p50/p99 per layer)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cks = [ck for ck in result["checkpoints"] if "kernel" in ck]   # not the failed or skipped ones
    paths = []
    if not cks:
        return paths
    for fname, draw in (("probe_rowsum.png", "rowsum"), ("probe_eps.png", "eps")):
        fig, axes = plt.subplots(1, len(cks), figsize=(4.2 * len(cks), 3.8), squeeze=False, sharey=True)
        for ax, ck in zip(axes[0], cks):
            layers = list(ck["kernel"]["layers"])
            xs = np.arange(len(layers))
            for m in ck["kernel"]["all"]:
                per = [ck["kernel"]["layers"][n][m] for n in layers]
                if draw == "rowsum":
                    line, = ax.plot(xs, [max(p["rowsum_post"]["mean"], 1e-12) for p in per], "o-", ms=3,
                                    label=f"{m} post")
                    ax.plot(xs, [max(p["rowsum_pre"]["mean"], 1e-12) for p in per], "x--", ms=3,
                            color=line.get_color(), label=f"{m} pre")
                elif m != "delta_matching":
                    line, = ax.plot(xs, [max(p["eps_rel"].get("p99") or 0, 1e-12) for p in per], "o-", ms=3,
                                    label=f"{m} p99")
                    ax.plot(xs, [max(p["eps_rel"].get("p50") or 0, 1e-12) for p in per], "x--", ms=3,
                            color=line.get_color(), label=f"{m} p50")
            ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xlabel("layer")
            ax.set_title(f"{mode_label(ck['mode'])} ckpt, step {ck['step']}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
        axes[0][0].set_ylabel("mean_i |sum_j dS_ij| / sum_j |dS_ij|" if draw == "rowsum"
                              else "|eps_i| / (|dO_i| |O_i|)")
        axes[0][-1].legend(fontsize=6)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_outputs(result: dict, out_dir: str | os.PathLike) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(result, indent=1))
    (out_dir / "probe.md").write_text(markdown(result))
    return [out_dir / "probe.json", out_dir / "probe.md"] + make_plots(result, out_dir)


# ---- CLI ----------------------------------------------------------------------

def parse_modes_arg(text: str | None) -> list[str] | None:
    """--modes of the checkpoint tools (probe, retrieval): None for all present, else the
    mode names (model.parse_mode: attention modes and recipe variants); SystemExit naming
    --modes for an empty entry or a name that does not parse (the grammar message)."""
    if not text:
        return None
    modes = [m.strip() for m in text.split(",")]
    for m in modes:
        if not m:
            raise SystemExit(f"--modes: an empty entry in {text!r}")
        try:
            parse_mode(m)
        except ValueError as exc:
            raise SystemExit(f"--modes: {exc}") from None
    return modes


def run_dir_checkpoints(run_dir, modes_text: str | None, step: int | None):
    """(modes, paths) of the checkpoint tools' --run-dir / --modes / --step: the modes
    (parse_modes_arg, None for all present) and their checkpoints (find_checkpoints);
    SystemExit, no traceback, for a bad --modes or a named mode without its checkpoint."""
    modes = parse_modes_arg(modes_text)
    try:
        return modes, find_checkpoints(run_dir, modes, step)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None


def find_checkpoints(run_dir: str | os.PathLike, modes=None, step: int | None = None) -> list[Path]:
    """<run_dir>/<mode>.pt (or <mode>.step<step>.pt) for the given modes (default: all present),
    in the order of model.ATTN_MODES (bf16, stale, matched_do, delta_matching, cudnn), each
    mode's recipe variants (model.parse_mode, e.g. fp8-delta_matching@tile) after it."""
    run_dir = Path(run_dir)
    suffix = ".pt" if step is None else f".step{step}.pt"
    found = []
    names = modes
    if not modes:
        stems = {p.name[:-len(suffix)] for p in run_dir.glob(f"*{suffix}")} if run_dir.is_dir() else set()
        names = sorted(set(ATTN_MODES) | {n for n in stems if is_mode_name(n)}, key=mode_sort_key)
    for m in names:
        p = run_dir / f"{m}{suffix}"
        if p.is_file():
            found.append(p)
        elif modes:
            raise FileNotFoundError(f"--modes: no checkpoint {p}")
    return found


def runnable(paths, requested: dict, device, tool: str) -> dict:
    """{path: (mode, why it cannot run on `device`)} for the checkpoints among `paths` whose
    model cannot run there (trainer.checkpoint_unavailable_reason: fp8-cudnn where compare
    would skip it); the caller skips those. requested: {path: the argument that named it
    ("--modes fp8-cudnn", "--ckpt", ...)}: such a checkpoint that cannot run is a SystemExit
    naming the argument, before any work. A file whose header cannot be read, or a device
    that cannot be resolved, is left to the load (its error is the checkpoint's)."""
    try:
        dev = resolve_device(device)
    except ValueError:
        return {}
    out = {}
    for p in paths:
        try:
            info = read_info(p)
        except (OSError, ValueError):
            continue
        why = checkpoint_unavailable_reason(info["model_config"], dev)
        if why is None:
            continue
        mode = info.get("mode") or info["model_config"].get("attn_mode")
        if p in requested:
            arg = requested[p]
            raise SystemExit(f"{tool}: argument {arg}: cannot run on {dev}"
                             + ("" if arg.endswith(f" {mode}") else f" ({mode})") + f": {why}")
        out[p] = (mode, why)
    return out


def requested_paths(paths_given, run_paths, modes, given_arg: str) -> dict:
    """{path: argument} for the checkpoints the user named: files given (`given_arg`, e.g.
    "--ckpt"), and those of --run-dir chosen by --modes ("--modes <mode>"); the rest of
    --run-dir (every mode present) are not requested one by one."""
    out = {Path(p): f"{given_arg} {p}" for p in paths_given}
    for m, p in zip(modes or [], run_paths):   # NOTE: find_checkpoints gives one path per mode, in order
        out.setdefault(p, f"--modes {m}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Kernel probe (dS row sums, eps) and attention masking "
                                             "probe on trained checkpoints.")
    ap.add_argument("--run-dir", help="compare run directory holding <mode>.pt checkpoints")
    ap.add_argument("--ckpt", action="append", default=[], help="checkpoint file (repeatable)")
    ap.add_argument("--modes", default=None, help="comma-separated modes to probe from --run-dir")
    ap.add_argument("--step", type=int, default=None, help="probe <mode>.step<N>.pt instead of <mode>.pt")
    ap.add_argument("--data-root", default=None, help="prepared corpus dir (default: the checkpoint's)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences in the kernel-probe batch")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the training seq_len")
    ap.add_argument("--val-batches", type=int, default=None,
                    help="val batches of the masking probe (default: the training run's)")
    ap.add_argument("--mask-batch-size", type=int, default=None,
                    help="sequences per masking-probe batch (default: the training batch size)")
    ap.add_argument("--mask-layers", default="last", choices=["last", "all"])
    ap.add_argument("--delta-modes", default=",".join(DELTA_MODES))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="output dir (default <run-dir>/probe)")
    a = ap.parse_args(argv)
    if not a.run_dir and not a.ckpt:
        ap.error("give --run-dir or --ckpt")
    if not a.out and not a.run_dir:
        ap.error("--out is required with --ckpt only")
    # NOTE: `is not None`, not truthiness: --seq-len 0 must not silently mean "the default".
    for flag in ("batch_size", "val_batches", "mask_batch_size", "seq_len", "step"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(a, flag)}")
    if a.threads < 0:
        ap.error(f"--threads: must be >= 0 (0 = all cores), got {a.threads}")
    bad = [m for m in a.delta_modes.split(",") if m not in DELTA_MODES]
    if bad:
        ap.error(f"--delta-modes: unknown {bad}; choose from {DELTA_MODES}")
    a.command = provenance.module_command("fp8attn.train.probe", argv)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    from fp8attn.cudnn_fp8_attention import CudnnFP8Unavailable
    if a.threads:
        torch.set_num_threads(a.threads)
    paths = [Path(p) for p in a.ckpt]
    modes = run_paths = None
    if a.run_dir:
        modes, run_paths = run_dir_checkpoints(a.run_dir, a.modes, a.step)
        paths += run_paths
    if not paths:
        want = "<mode>.pt" if a.step is None else f"<mode>.step{a.step}.pt (--step {a.step})"
        raise SystemExit(f"probe: no checkpoints {want} found in {a.run_dir}")
    requested = requested_paths(a.ckpt, run_paths or [], modes, "--ckpt")
    cannot = runnable(paths, requested, a.device, "probe")
    out = Path(a.out or Path(a.run_dir) / "probe")
    results, failed = [], 0
    for p in paths:
        if p in cannot:
            mode, why = cannot[p]
            dev = resolve_device(a.device)
            print(f"[probe] skipped {mode} ({p}): cannot run on {dev}: {why}; the other checkpoints are probed",
                  flush=True)
            results.append({"checkpoint": str(p), "mode": mode, "device": str(dev), "skipped": why})
            continue
        print(f"[probe] {p}", flush=True)
        try:
            r = probe_checkpoint(p, device=a.device, data_root=a.data_root, batch_size=a.batch_size,
                             seq_len=a.seq_len, val_batches=a.val_batches, mask_batch_size=a.mask_batch_size,
                             mask_layers=a.mask_layers,
                             delta_modes=tuple(a.delta_modes.split(",")))
        except CudnnFP8Unavailable as exc:
            if p not in requested:
                # NOTE: the static check passed and cuDNN refused the probe's shape: skipped as well
                # (a checkpoint the user named is a failure instead, below)
                print(f"[probe] skipped {p}: {exc}; the other checkpoints are probed", flush=True)
                results.append({"checkpoint": str(p), "mode": CUDNN_MODE, "device": str(resolve_device(a.device)),
                                "skipped": str(exc)})
                cannot[p] = (CUDNN_MODE, str(exc))
                continue
            results.append({"checkpoint": str(p), "error": f"{type(exc).__name__}: {exc}"})
            print(f"[probe] failed: {exc}", flush=True)
            failed += 1
            continue
        except Exception as exc:  # noqa: BLE001 - NOTE: one bad checkpoint must not lose the others' results
            import traceback
            traceback.print_exc()
            results.append({"checkpoint": str(p), "error": f"{type(exc).__name__}: {exc}"})
            failed += 1
            continue
        rat = r["kernel"]["ratios"].get("stale/delta_matching")
        print(f"[probe] {r['mode']}: capture loss {r['capture']['loss']:.4f}"
              + (f", stale/DM residual (mean; median) pre {rat['pre']:.3g}x; {rat['pre_p50']:.3g}x, "
                 f"post {rat['post']:.3g}x; {rat['post_p50']:.3g}x" if rat else "")
              + f", last-layer masking {list(r['masking']['layers'].values())[-1]['increase']:+.4f}"
              + f" ({r['time_s']:.1f} s)", flush=True)
        results.append(r)
        # NOTE: written after every checkpoint, so a run cut short keeps what finished.
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe.json").write_text(json.dumps({"provenance": provenance.collect(a.command),
                                                    "checkpoints": results}, indent=1))
    result = {"provenance": provenance.collect(a.command), "checkpoints": results}
    files = write_outputs(result, out)
    print(f"[probe] wrote {', '.join(str(f) for f in files)}")
    if failed:
        raise SystemExit(f"probe: {failed} of {len(paths) - len(cannot)} checkpoints failed (see above)")


if __name__ == "__main__":
    main()
