"""Retrieval probe (RULER-like, built locally from the corpus, no download) on trained checkpoints.

    python -m fp8attn.train.retrieval --run-dir runs/x                 # every <mode>.pt in runs/x
    python -m fp8attn.train.retrieval runs/x/fp8-stale.pt --lengths 256,512 --out runs/x/retrieval

Two tasks, each at several context lengths L (prompt tokens) and needle depths:
  passkey  one needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at
           depth d of real validation text (a window of the prepared corpus's val.bin),
           then the question "What is the pass key? The pass key is"; the answer is
           the 5-digit key.
  mkar     multi-key associative recall: `keys` needles "The value of key WORD is NNNN."
           spread evenly over the filler (the queried one at depth d), the question
           "What is the value of key WORD? The value of key WORD is"; the answer is its
           4-digit value.
Keys, values and words come from a seeded generator, so every mode sees the same prompts.
The filler is cut at token boundaries so that every prompt is exactly L tokens (the
needle text is tokenized on its own, surrounded by newlines).

Decoding: greedy, by full recompute (the model has no KV cache): the answers are a few
tokens, so each new token reruns the forward on prompt + generated tokens (batch = the
samples of one cell, all of length L). A sample scores 1 if the decoded continuation,
stripped, starts with the answer string (exact match), else 0. Models run in the
attention mode they were trained with (the fp8 modes through the fp8attn op: CPU
reference or CUDA kernels), BF16 autocast on CUDA as in training.

Outputs under --out (default <run-dir>/retrieval): retrieval.json (every prompt's
answer and output, scores, provenance), retrieval.md (a table per task: accuracy per
mode x length, averaged over depths), retrieval.png (accuracy vs length per mode and
task). With --run-dir the run's report.md is rebuilt with these included
(report.write_report picks up retrieval/retrieval.md).

Checkpoints of every attention mode (model.ATTN_MODES) are found in --run-dir. One that
cannot run on this device (fp8-cudnn without a CUDA sm_90 GPU, the cuDNN frontend or
head_dim 128: compare's check, as in the kernel probe) is skipped with a one-line reason
("[retrieval] skipped ..."), listed in retrieval.json as {"checkpoint", "mode", "skipped"}
and in the tables as a "(skipped)" row; the others are scored. Named by --modes or given
as a file, such a checkpoint stops the command before any work, naming the argument.

Scores of small models trained for minutes are near 0 for long contexts (and may be at
every length): the probe is for comparing modes on the same checkpoints' lineage,
where Delta-Matching's claim is that FP8 retrieval stays at BF16's.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from . import provenance
from .checkpoint import load_checkpoint
from .model import CUDNN_MODE
from .probe import _autocast, requested_paths, run_dir_checkpoints, runnable
from .report import mode_label
from .trainer import resolve_device

TASKS = ("passkey", "mkar")
_WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "copper", "violet", "harbor", "lantern",
          "meadow", "falcon", "pepper", "marble", "canyon", "willow", "ember", "glacier", "orchid", "saffron")


def _encode(tok, text: str) -> list:
    return tok.encode(text).ids


def build_prompts(tok, val_tokens: np.ndarray, task: str, length: int, depth: float, samples: int,
                  seed: int, keys: int = 4) -> list[dict]:
    """`samples` prompts of exactly `length` tokens: {"ids": [length] int list, "answer": str}.

    val_tokens: the corpus's validation token ids (filler windows start at seeded offsets).
    depth in [0, 1]: where the (queried) needle starts, as a fraction of the filler.
    Raises ValueError when the needles and question leave no room for filler."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a value in [0, 1], got {depth}")
    rng = np.random.default_rng([seed, length, int(round(depth * 1000)), TASKS.index(task)])
    out = []
    for _ in range(samples):
        if task == "passkey":
            key = str(rng.integers(10000, 100000))
            needles = [_encode(tok, f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")]
            query = _encode(tok, "\nWhat is the pass key? The pass key is")
            answer, where = key, [depth]
        else:
            words = rng.choice(len(_WORDS), size=keys, replace=False)
            vals = [str(v) for v in rng.integers(1000, 10000, size=keys)]
            pick = int(rng.integers(keys))
            needles = [_encode(tok, f"\nThe value of key {_WORDS[w]} is {v}.\n") for w, v in zip(words, vals)]
            query = _encode(tok, f"\nWhat is the value of key {_WORDS[words[pick]]}? "
                                 f"The value of key {_WORDS[words[pick]]} is")
            answer = vals[pick]
            # The queried needle at `depth`, the others evenly over the rest of the filler.
            others = [(i + 0.5) / keys for i in range(keys)]
            where = [others[i] for i in range(keys)]
            where[pick] = depth
        n_fill = length - len(query) - sum(len(n) for n in needles)
        if n_fill < 1:
            raise ValueError(f"length {length}: too short for the {task} needles and question "
                             f"({length - n_fill + 1} tokens needed)")
        start = int(rng.integers(0, max(1, len(val_tokens) - n_fill)))
        fill = [int(t) for t in val_tokens[start:start + n_fill]]
        if len(fill) < n_fill:
            raise ValueError(f"the validation split ({len(val_tokens)} tokens) is shorter than the filler "
                             f"({n_fill} tokens) of length {length}")
        # Insert the needles at their positions, deepest last so earlier cuts stay valid.
        ids = list(fill)
        for pos, needle in sorted(zip((int(round(w * n_fill)) for w in where), needles), key=lambda t: -t[0]):
            ids[pos:pos] = needle
        ids += query
        assert len(ids) == length
        out.append({"ids": ids, "answer": answer})
    return out


def min_length(tok, task: str, keys: int = 4) -> int:
    """The shortest prompt `task` fits in with 16 filler tokens (needles + question + 16),
    measured on this tokenizer with sample keys of the same digit counts."""
    if task == "passkey":
        n = len(_encode(tok, "\nThe pass key is 12345. Remember it. 12345 is the pass key.\n"))
        q = len(_encode(tok, "\nWhat is the pass key? The pass key is"))
    else:
        w = max(_WORDS, key=len)
        n = keys * len(_encode(tok, f"\nThe value of key {w} is 1234.\n"))
        q = len(_encode(tok, f"\nWhat is the value of key {w}? The value of key {w} is"))
    return n + q + 16


@torch.no_grad()
def greedy_decode(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation by full recompute: prompts int64 [n, L] -> [n, new_tokens]."""
    device = prompts.device
    seq = prompts
    out = []
    for _ in range(new_tokens):
        with _autocast(device):
            logits = model(seq)
        nxt = logits[:, -1].float().argmax(dim=-1, keepdim=True)
        out.append(nxt)
        seq = torch.cat([seq, nxt], dim=1)
    return torch.cat(out, dim=1)


def score(tok, generated: list, answers: list) -> list:
    """1 where the decoded continuation, stripped, starts with the answer string, else 0."""
    return [int(tok.decode(g).strip().startswith(a)) for g, a in zip(generated, answers)]


def probe_checkpoint(path, *, tok, val_tokens, lengths, depths, tasks=TASKS, samples=4, seed=0, keys=4,
                     device="auto") -> dict:
    """Both tasks on one checkpoint; returns the JSON-ready result."""
    dev = resolve_device(device)
    t0 = time.time()
    model, info = load_checkpoint(path, dev)
    if getattr(model.cfg, "packed", False):
        raise ValueError(f"retrieval: {path} was trained with packed documents; prompts are single rows")
    too_long = [L for L in lengths if L + 16 > model.cfg.max_seq_len]
    if too_long:
        raise ValueError(f"--lengths {too_long}: the model's max_seq_len is {model.cfg.max_seq_len} "
                         "(prompt + 16 answer tokens must fit)")
    cells = []
    for task in tasks:
        for L in lengths:
            for d in depths:
                ps = build_prompts(tok, val_tokens, task, L, d, samples, seed, keys)
                n_new = max(len(_encode(tok, " " + p["answer"])) for p in ps) + 2
                x = torch.tensor([p["ids"] for p in ps], dtype=torch.int64, device=dev)
                gen = greedy_decode(model, x, n_new).cpu().tolist()
                sc = score(tok, gen, [p["answer"] for p in ps])
                cells.append({"task": task, "length": L, "depth": d, "accuracy": float(np.mean(sc)),
                              "samples": [{"answer": p["answer"], "output": tok.decode(g), "correct": c}
                                          for p, g, c in zip(ps, gen, sc)]})
    return {"checkpoint": str(path), "mode": info["mode"], "step": info["step"], "device": str(dev),
            "model_config": info["model_config"], "cells": cells, "time_s": time.time() - t0}


def tables(result: dict) -> str:
    """Markdown: per task, accuracy per mode x length (mean over depths), plus the overall mean."""
    ok = [r for r in result["checkpoints"] if "cells" in r]
    skipped = [r for r in result["checkpoints"] if "skipped" in r]
    notes = [f"{r.get('mode')} skipped: {r['skipped']} (`{Path(r['checkpoint']).name}`, device "
             f"{r.get('device', '?')})" for r in skipped]
    if not ok:
        return "No checkpoint was probed.\n" + "".join(f"\n{n}\n" for n in notes)
    lines = []
    for task in TASKS:
        lengths = sorted({c["length"] for r in ok for c in r["cells"] if c["task"] == task})
        if not lengths:
            continue
        depths = sorted({c["depth"] for r in ok for c in r["cells"] if c["task"] == task})
        n = {c["length"]: len(c["samples"]) for r in ok for c in r["cells"] if c["task"] == task}
        lines += [f"**{task}** (exact match; mean over depths {', '.join(f'{d:g}' for d in depths)}; "
                  f"{max(n.values())} prompts per length and depth)", "",
                  "| mode | " + " | ".join(f"L={L}" for L in lengths) + " | mean |",
                  "|---" * (len(lengths) + 2) + "|"]
        for r in ok:
            accs = [np.mean([c["accuracy"] for c in r["cells"] if c["task"] == task and c["length"] == L])
                    for L in lengths]
            lines.append(f"| {mode_label(r['mode'])} | " + " | ".join(f"{a:.2f}" for a in accs)
                         + f" | {np.mean(accs):.2f} |")
        for r in skipped:
            lines.append(f"| {mode_label(r.get('mode') or '?')} (skipped) | " + " | ".join(["n/a"] * (len(lengths) + 1))
                         + " |")
        lines.append("")
    lines += [n + "\n" for n in notes]
    return "\n".join(lines)


def write_outputs(result: dict, out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "retrieval.json", out / "retrieval.md"]
    files[0].write_text(json.dumps(result, indent=1))
    text = ["## Retrieval probe", "",
            "RULER-like passkey and multi-key associative recall prompts built from the validation "
            "split (`python -m fp8attn.train.retrieval`; greedy decoding by full recompute, exact match).", "",
            tables(result)]
    ok = [r for r in result["checkpoints"] if "cells" in r]
    if ok:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(TASKS), figsize=(5 * len(TASKS), 3.5), squeeze=False)
        for ax, task in zip(axes[0], TASKS):
            for r in ok:
                lengths = sorted({c["length"] for c in r["cells"] if c["task"] == task})
                accs = [np.mean([c["accuracy"] for c in r["cells"] if c["task"] == task and c["length"] == L])
                        for L in lengths]
                if lengths:
                    ax.plot(lengths, accs, marker="o", label=mode_label(r["mode"]))
            ax.set_title(task)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("exact match")
            ax.set_ylim(-0.05, 1.05)
            if ax.get_legend_handles_labels()[0]:   # NOTE: a task left out by --tasks has no lines
                ax.legend(fontsize=7)
        fig.tight_layout()
        png = out / "retrieval.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        files.append(png)
        text += ["![retrieval](retrieval.png)", ""]
    files[1].write_text("\n".join(text))
    return files


def _ints(s: str, name: str) -> list:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated integers, got {s!r}") from None
    if not v or min(v) < 1:
        raise SystemExit(f"--{name}: expected integers >= 1, got {s!r}")
    return v


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Passkey and multi-key associative recall on trained checkpoints.")
    ap.add_argument("ckpt", nargs="*", help="checkpoint files")
    ap.add_argument("--run-dir", help="compare run directory holding <mode>.pt checkpoints")
    ap.add_argument("--modes", default=None, help="comma-separated modes to probe from --run-dir")
    ap.add_argument("--step", type=int, default=None, help="probe <mode>.step<N>.pt instead of <mode>.pt")
    ap.add_argument("--data-root", default=None, help="prepared corpus dir (default: the checkpoint's)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default=None, help="prompt lengths (default: 1/4, 1/2 and all of the "
                                                    "model's max_seq_len minus 16 tokens for the answer)")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--samples", type=int, default=4, help="prompts per task, length and depth")
    ap.add_argument("--keys", type=int, default=4, help="needles per mkar prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="output dir (default <run-dir>/retrieval)")
    a = ap.parse_args(argv)
    a.command = ["python", "-m", "fp8attn.train.retrieval", *(argv if argv is not None else [])]
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise SystemExit(f"--tasks: expected a comma list of {TASKS}, got {a.tasks!r}")
    try:
        depths = [float(x) for x in a.depths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--depths: expected comma-separated numbers in [0, 1], got {a.depths!r}") from None
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise SystemExit(f"--depths: expected comma-separated numbers in [0, 1], got {a.depths!r}")
    if a.samples < 1 or a.keys < 1:
        raise SystemExit("--samples and --keys must be >= 1")
    paths = [Path(p) for p in a.ckpt]
    modes = run_paths = None
    if a.run_dir:
        modes, run_paths = run_dir_checkpoints(a.run_dir, a.modes, a.step)
        paths += run_paths
    if not paths:
        raise SystemExit("retrieval: no checkpoints (give files, or --run-dir with <mode>.pt checkpoints)")
    if not a.out and not a.run_dir:
        raise SystemExit("retrieval: --out is required without --run-dir")
    # NOTE: before anything is read or written: a checkpoint the user named that cannot run here stops
    cannot = runnable(paths, requested_paths(a.ckpt, run_paths or [], modes, "ckpt: checkpoint"), a.device,
                      "retrieval")
    out = Path(a.out or Path(a.run_dir) / "retrieval")
    from tokenizers import Tokenizer
    info0 = torch.load(paths[0], map_location="cpu", weights_only=True)
    root = Path(a.data_root or info0.get("data_root") or "")
    tok_path, val_path = root / "tokenizer.json", root / "val.bin"
    if not tok_path.is_file() or not val_path.is_file():
        raise SystemExit(f"retrieval: {tok_path} / {val_path} not found; pass --data-root (the prepared corpus "
                         "directory the model was trained on)")
    tok = Tokenizer.from_file(str(tok_path))
    val_tokens = np.fromfile(val_path, dtype=np.uint16)
    room = info0["model_config"]["max_seq_len"] - 16
    need = max(min_length(tok, t, a.keys) for t in tasks)
    lengths = _ints(a.lengths, "lengths") if a.lengths else sorted({L for L in (room // 4, room // 2, room)
                                                                      if L >= need})
    if not lengths:
        raise SystemExit(f"retrieval: the model's max_seq_len ({room + 16}) leaves no length that holds the "
                         f"tasks ({need} tokens needed with this tokenizer, plus 16 for the answer)")
    # Explicit --lengths checked once, before any checkpoint is probed (each checkpoint
    # would otherwise fail alone with a traceback). NOTE: against the first checkpoint's
    # max_seq_len; probe_checkpoint checks every checkpoint's own.
    bad = [L for L in lengths if not need <= L <= room]
    if bad:
        raise SystemExit(f"retrieval: argument --lengths: {bad} outside [{need}, {room}]: a prompt must hold the "
                         f"tasks ({need} tokens with this tokenizer and --keys {a.keys}) and leave 16 answer tokens "
                         f"inside the model's max_seq_len ({room + 16})")
    from fp8attn.cudnn_fp8_attention import CudnnFP8Unavailable
    dev = resolve_device(a.device) if cannot else None
    results, failed = [], 0
    for p in paths:
        if p in cannot:
            mode, why = cannot[p]
            print(f"[retrieval] skipped {mode} ({p}): cannot run on {dev}: {why}; the other checkpoints are scored",
                  flush=True)
            results.append({"checkpoint": str(p), "mode": mode, "device": str(dev), "skipped": why})
            continue
        print(f"[retrieval] {p}", flush=True)
        try:
            r = probe_checkpoint(p, tok=tok, val_tokens=val_tokens, lengths=lengths, depths=depths, tasks=tasks,
                                 samples=a.samples, seed=a.seed, keys=a.keys, device=a.device)
        except CudnnFP8Unavailable as exc:
            # NOTE: the static check passed and cuDNN refused the prompts' shape: skipped too (a file or
            # --modes the user named: a failure)
            if Path(p) in requested_paths(a.ckpt, run_paths or [], modes, ""):
                results.append({"checkpoint": str(p), "error": f"{type(exc).__name__}: {exc}"})
                print(f"[retrieval] failed: {exc}", flush=True)
                failed += 1
                continue
            print(f"[retrieval] skipped {p}: {exc}; the other checkpoints are scored", flush=True)
            results.append({"checkpoint": str(p), "mode": CUDNN_MODE, "device": str(resolve_device(a.device)),
                            "skipped": str(exc)})
            cannot[p] = (CUDNN_MODE, str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - NOTE: one bad checkpoint must not lose the others' results
            import traceback
            traceback.print_exc()
            results.append({"checkpoint": str(p), "error": f"{type(exc).__name__}: {exc}"})
            failed += 1
            continue
        means = {t: np.mean([c["accuracy"] for c in r["cells"] if c["task"] == t]) for t in tasks}
        print(f"[retrieval] {r['mode']}: " + ", ".join(f"{t} {m:.2f}" for t, m in means.items())
              + f" ({r['time_s']:.1f} s)", flush=True)
        results.append(r)
    result = {"provenance": provenance.collect(a.command), "tasks": tasks, "lengths": lengths, "depths": depths,
              "samples": a.samples, "keys": a.keys, "seed": a.seed, "checkpoints": results}
    files = write_outputs(result, out)
    if a.run_dir and (Path(a.run_dir) / "report.md").is_file() and (Path(a.run_dir) / "summary.json").is_file():
        from .report import write_report
        modes = json.loads((Path(a.run_dir) / "summary.json").read_text())["modes"]
        files.append(write_report(a.run_dir, modes)[0])
    print(f"[retrieval] wrote {', '.join(str(f) for f in files)}")
    if failed:
        raise SystemExit(f"retrieval: {failed} of {len(paths) - len(cannot)} checkpoints failed (see above)")


if __name__ == "__main__":
    main()
