"""How the stale delta's dS row-sum residual grows with the attention logit scale.

    python -m fp8attn.train.logit_scan --out docs/results/logit_scan

Synthetic inputs (numerics.md sections 4-5): K, V, dO ~ N(0, 1), Q ~ N(0, s^2),
BF16, causal, so the logits q.k / sqrt(head_dim) have standard deviation ~s.
For each scale s and each delta mode the FP8 op runs forward + backward under
`fp8attn.diagnostics.record(keep_raw=True)`; reported: mean and median over rows
of the pre-cast (FP32 dS) and post-cast (FP8 dS) row-sum residuals, the ratios
stale / delta_matching, and the mean attention entropy (nats, exact softmax).

Why it matters for the study design (issue 6 item 3): anything that sharpens
attention (no QK-norm, a high learning rate letting logits grow) should enlarge
the stale delta's error relative to Delta-Matching; this measures by how much.
Outputs: scan.json, scan.md, scan.png under --out.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from . import provenance

DELTA_MODES = ("stale", "matched_do", "delta_matching")


def entropy(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """Mean over rows of the causal softmax entropy (nats), exact FP32 math; GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kk) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    logp = torch.log_softmax(s, -1)
    return float(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).mean())


def scan(scales, *, head_dim=128, seq_len=1024, heads_q=2, heads_kv=1, seed=0, device="cpu") -> list[dict]:
    """One row per scale: {scale, entropy, modes: {delta_mode: {pre_mean, pre_p50, post_mean, post_p50}},
    stale/DM ratios}."""
    import fp8attn
    from fp8attn import diagnostics

    rows = []
    for sc in scales:
        g = torch.Generator().manual_seed(seed)
        q = (torch.randn(1, heads_q, seq_len, head_dim, generator=g) * sc).bfloat16().to(device)
        k = torch.randn(1, heads_kv, seq_len, head_dim, generator=g).bfloat16().to(device)
        v = torch.randn(1, heads_kv, seq_len, head_dim, generator=g).bfloat16().to(device)
        do = torch.randn(1, heads_q, seq_len, head_dim, generator=g).bfloat16().to(device)
        modes = {}
        for m in DELTA_MODES:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            with diagnostics.record(keep_raw=True) as rec:
                fp8attn.attention(qq, kk, vv, causal=True, delta_mode=m).backward(do)
            raw = rec.records[0]["raw"]
            modes[m] = {"pre_mean": float(raw["rowsum_pre"].mean()), "pre_p50": float(raw["rowsum_pre"].median()),
                        "post_mean": float(raw["rowsum_post"].mean()), "post_p50": float(raw["rowsum_post"].median())}
        dm = modes["delta_matching"]
        rows.append({"scale": sc, "entropy": entropy(q, k, 1 / math.sqrt(head_dim)), "modes": modes,
                     "stale/DM": {key: modes["stale"][key] / dm[key] if dm[key] else math.inf for key in dm}})
    return rows


def markdown(rows: list[dict], cfg: dict) -> str:
    lines = [f"Synthetic scan: head_dim {cfg['head_dim']}, seqlen {cfg['seq_len']}, {cfg['heads_q']}/{cfg['heads_kv']} "
             f"q/kv heads, causal, seed {cfg['seed']}, device {cfg['device']}.", "",
             "| logit std | mean entropy (nats) | stale pre (median) | matched_do pre (median) | DM pre (median) "
             "| stale post (median) | DM post (median) | stale/DM post, median / mean |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["modes"]
        lines.append(f"| {r['scale']:g} | {r['entropy']:.2f} | {m['stale']['pre_p50']:.2e} | {m['matched_do']['pre_p50']:.2e} "
                     f"| {m['delta_matching']['pre_p50']:.2e} | {m['stale']['post_p50']:.2e} "
                     f"| {m['delta_matching']['post_p50']:.2e} | {r['stale/DM']['post_p50']:.2f} / {r['stale/DM']['post_mean']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["scale"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in DELTA_MODES:
        line, = a.plot(xs, [r["modes"][m]["post_p50"] for r in rows], "o-", ms=3, label=f"{m} post")
        a.plot(xs, [max(r["modes"][m]["pre_p50"], 1e-12) for r in rows], "x--", ms=3, color=line.get_color(),
               label=f"{m} pre")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("logit std")
    a.set_ylabel("median row-sum residual")
    a.grid(alpha=0.3, which="both")
    a.legend(fontsize=6)
    b.plot(xs, [r["stale/DM"]["post_p50"] for r in rows], "o-", label="median")
    b.plot(xs, [r["stale/DM"]["post_mean"] for r in rows], "s--", label="mean")
    b.set_xscale("log")
    b.set_xlabel("logit std")
    b.set_ylabel("stale / DM post-cast residual")
    b.grid(alpha=0.3, which="both")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Stale-delta dS row-sum residual vs attention logit scale (synthetic).")
    ap.add_argument("--scales", default="0.5,1,2,3,5,8", help="comma-separated logit standard deviations")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads-q", type=int, default=2)
    ap.add_argument("--heads-kv", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        scales = [float(s) for s in a.scales.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--scales: expected comma-separated numbers, got {a.scales!r}")
    if not scales or any(not s > 0 for s in scales):
        ap.error("--scales: need at least one value, all > 0")
    cfg = {"head_dim": a.head_dim, "seq_len": a.seq_len, "heads_q": a.heads_q, "heads_kv": a.heads_kv,
           "seed": a.seed, "device": a.device}
    rows = scan(scales, **{k: v for k, v in cfg.items()})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scan.json").write_text(json.dumps(
        {"provenance": provenance.collect(provenance.module_command("fp8attn.train.logit_scan", argv)),
         "config": cfg, "rows": rows}, indent=1))
    (out / "scan.md").write_text(markdown(rows, cfg))
    plot(rows, out / "scan.png")
    print(markdown(rows, cfg))
    print(f"logit_scan: wrote {out}/scan.json, scan.md, scan.png")


if __name__ == "__main__":
    main()
