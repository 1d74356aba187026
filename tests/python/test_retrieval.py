"""The retrieval probe (fp8attn.train.retrieval): prompts, decoding, scoring, CLI.

- prompts are exactly L tokens of real validation text with the needle(s) at the
  requested depth and the answer inside its needle; seeded (same prompts for
  every mode);
- greedy decoding + exact-match scoring give 1.0 with an oracle model that emits
  the answer and 0.0 with one that emits something else (the scorer can fail);
- the CLI on a trained smoke run writes retrieval.json / .md / .png and puts the
  tables into the run's report.md; bad options are refused naming them.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fp8attn
from fp8attn.train import retrieval as R

PY_DIR = Path(fp8attn.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory, text_dir):
    out = tmp_path_factory.mktemp("retr")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", "bf16,fp8-delta_matching",
           "--steps", "3", "--seq-len", "256", "--diag-every", "0", "--val-batches", "1", "--data-dir",
           str(out / "data"), "--text-dir", str(text_dir), "--device", "cpu", "--no-progress", "--out", str(out / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _tok(run):
    from tokenizers import Tokenizer
    root = Path(torch.load(run / "run" / "bf16.pt", map_location="cpu", weights_only=True)["data_root"])
    return Tokenizer.from_file(str(root / "tokenizer.json")), np.fromfile(root / "val.bin", np.uint16)


def _find(seq, sub):
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


@pytest.mark.parametrize("task", R.TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompts(run, task, depth):
    tok, val = _tok(run)
    L = 240
    ps = R.build_prompts(tok, val, task, L, depth, samples=3, seed=1)
    assert ps == R.build_prompts(tok, val, task, L, depth, samples=3, seed=1)       # seeded
    assert ps != R.build_prompts(tok, val, task, L, depth, samples=3, seed=2)
    for p in ps:
        assert len(p["ids"]) == L
        text = tok.decode(p["ids"])
        assert p["answer"] in text
        if task == "passkey":
            needle = tok.encode(f"\nThe pass key is {p['answer']}. Remember it. {p['answer']} is the pass key.\n").ids
            pos = _find(p["ids"], needle)
            query = tok.encode("\nWhat is the pass key? The pass key is").ids
            n_fill = L - len(needle) - len(query)
            assert pos == round(depth * n_fill), (pos, depth, n_fill)
            fill = p["ids"][:pos] + p["ids"][pos + len(needle):L - len(query)]
            assert _find(list(map(int, val)), fill[:32]) >= 0     # real validation text
            assert p["ids"][L - len(query):] == query
        else:
            assert text.count("The value of key") == 4 + 1 and text.rstrip().endswith("is")


class _Oracle(torch.nn.Module):
    """Emits, after each prompt of length L, the given continuation ids (then EOS-ish 0)."""

    def __init__(self, prompts, continuations, vocab):
        super().__init__()
        self.L, self.cont, self.vocab = prompts.shape[1], continuations, vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, seq):
        n, S = seq.shape
        logits = torch.zeros(n, S, self.vocab)
        t = S - self.L
        for i in range(n):
            c = self.cont[i]
            logits[i, -1, c[t] if t < len(c) else 0] = 1.0
        return logits


def test_decode_and_score_can_pass_and_fail(run):
    tok, val = _tok(run)
    ps = R.build_prompts(tok, val, "passkey", 240, 0.5, samples=4, seed=3)
    x = torch.tensor([p["ids"] for p in ps])
    right = [tok.encode(" " + p["answer"] + ".").ids for p in ps]
    wrong = [tok.encode(" 00000.").ids for _ in ps]
    for cont, want in ((right, 1), (wrong, 0)):
        gen = R.greedy_decode(_Oracle(x, cont, tok.get_vocab_size()), x, 8).tolist()
        assert R.score(tok, gen, [p["answer"] for p in ps]) == [want] * 4


def test_cli_on_a_run(run):
    R.main(["--run-dir", str(run / "run"), "--samples", "1", "--depths", "0.5"])
    out = run / "run" / "retrieval"
    res = json.loads((out / "retrieval.json").read_text())
    assert [c["mode"] for c in res["checkpoints"]] == ["bf16", "fp8-delta_matching"]
    for c in res["checkpoints"]:
        assert {x["task"] for x in c["cells"]} == set(R.TASKS)
        assert all(0.0 <= x["accuracy"] <= 1.0 and len(x["samples"]) == 1 for x in c["cells"])
    assert (out / "retrieval.png").is_file()
    report = (run / "run" / "report.md").read_text()
    assert "## Retrieval probe" in report and "| fp8-delta_matching |" in report
    assert "](retrieval/retrieval.png)" in report


@pytest.mark.parametrize("args,msg", [
    (["--depths", "1.5"], "--depths"), (["--tasks", "needle"], "--tasks"), (["--lengths", "0"], "--lengths"),
    (["--samples", "0"], "--samples"),
])
def test_cli_refusals(run, args, msg):
    with pytest.raises(SystemExit, match=msg):
        R.main(["--run-dir", str(run / "run"), *args])


@pytest.mark.parametrize("length", ["20", "100000"])
def test_lengths_outside_the_model_are_refused_up_front(run, length):
    """Too short to hold the tasks or too long for max_seq_len: one argument error naming
    --lengths before any checkpoint is probed (each checkpoint used to fail alone with a
    traceback, the run's report rewritten), nothing written."""
    with pytest.raises(SystemExit, match=r"argument --lengths: \[" + length + r"\] outside"):
        R.main(["--run-dir", str(run / "run"), "--lengths", length, "--out", str(run / "bad")])
    assert not (run / "bad").exists()


def test_fp8_cudnn_checkpoint_is_found_and_skipped_where_it_cannot_run(run, tmp_path, capsys):
    """--run-dir finds fp8-cudnn.pt (break, 2026-12-07: the GPU smoke run's table had no
    fp8-cudnn row); where the mode cannot run (here: the CPU, and the smoke model's head_dim
    32) it is skipped with a one-line reason, listed as skipped, and the others are scored.
    Named with --modes (or given as a file) it is an error naming the argument."""
    from fp8attn.train.checkpoint import load_checkpoint, save_checkpoint
    from fp8attn.train.model import CUDNN_MODE
    d = tmp_path / "run"
    d.mkdir()
    (d / "bf16.pt").symlink_to(run / "run" / "bf16.pt")
    model, info = load_checkpoint(run / "run" / "bf16.pt", attn_mode=CUDNN_MODE)
    save_checkpoint(d / "fp8-cudnn.pt", model, mode=CUDNN_MODE, step=info["step"],
                    train_config=info["train_config"], data_root=info["data_root"])
    args = ["--samples", "1", "--depths", "0.5", "--tasks", "passkey", "--lengths", "120", "--device", "cpu"]
    R.main(["--run-dir", str(d), *args])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("[retrieval] skipped"))
    assert "fp8-cudnn" in line and "needs a CUDA GPU (this run is on cpu)" in line and "head_dim 32" in line
    res = json.loads((d / "retrieval" / "retrieval.json").read_text())
    assert [c["mode"] for c in res["checkpoints"]] == ["bf16", "fp8-cudnn"]
    assert "cells" in res["checkpoints"][0] and "head_dim 32" in res["checkpoints"][1]["skipped"]
    md = (d / "retrieval" / "retrieval.md").read_text()
    assert "| bf16 |" in md and "| fp8-cudnn (cuDNN FP8, delayed scaling) (skipped) | n/a | n/a |" in md
    assert "fp8-cudnn skipped: needs a CUDA GPU" in md
    with pytest.raises(SystemExit, match="--modes fp8-cudnn: cannot run .*head_dim 32"):
        R.main(["--run-dir", str(d), "--modes", "fp8-cudnn", *args, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="checkpoint .*fp8-cudnn.pt: cannot run .*head_dim 32"):
        R.main([str(d / "fp8-cudnn.pt"), *args, "--out", str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
