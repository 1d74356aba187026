"""The trainer's --context-parallel N under torchrun on the CPU (gloo).

A 2-process run with --context-parallel 2 is one context-parallel group (one data-
parallel replica), so it sees the batches of a one-process run; its step-0 loss
(before any update) is the same computation with the sequence sharded:
  bf16: SDPA of the local queries over all-gathered K/V, the same math up to
        floating-point order (measured 2.4e-7 absolute on 6.75);
  fp8:  the ring (fp8attn.context_parallel), whose forward quantizes P per
        shard (numerics.md section 11): an FP8-rounding-level difference
        (measured 1.6e-3 absolute, 2.3e-4 relative).
Later steps are not compared: AdamW's first update is lr * sign(g) for every
element, so rounding-level gradient differences flip near-zero elements.
Also: a 4-process run (2 groups of 2) against a 2-process DDP run (the same
data-parallel batches), FSDP2 with CP equal to DDP with CP bit for bit, the ranks'
final weights agree (the run checks it), the
summary records the setting, and the flag's refusals.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp8attn
from fp8attn.train.report import read_log

from dist_helpers import free_port

PY_DIR = Path(fp8attn.__file__).resolve().parents[1]
MODES = ("bf16", "fp8-delta_matching", "fp8-stale")


def _run(out: Path, text_dir, nproc: int, *extra, steps: int = 2):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port())] if nproc > 1 else [sys.executable])
    cmd = launch + ["-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", ",".join(MODES),
                    "--steps", str(steps), "--diag-every", "1", "--val-every", "1", "--val-batches", "2",
                    "--data-dir", str(out.parent / "data"), "--text-dir", str(text_dir), "--device", "cpu",
                    "--no-progress", "--no-save", "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _steps(run: Path, mode: str):
    return [r for r in read_log(run / f"{mode}.jsonl")["steps"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_dir):
    base = tmp_path_factory.mktemp("cp_train")
    out = {}
    for name, nproc, extra in (("single", 1, ()), ("cp2", 2, ("--context-parallel", "2")),
                               ("ddp2", 2, ()), ("cp2x2", 4, ("--context-parallel", "2")),
                               ("cp2_fsdp", 2, ("--context-parallel", "2", "--fsdp"))):
        proc = _run(base / name, text_dir, nproc, *extra)
        out[name] = (base / name, proc)
    return out


@pytest.mark.parametrize("name", ["cp2", "cp2x2"])
def test_runs_exit_cleanly_and_record_the_setting(runs, name):
    run, proc = runs[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("report: ") == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["context_parallel"] == 2
    for m in MODES:
        s = read_log(run / f"{m}.jsonl")["summary"]
        assert s["complete"] and s["context_parallel"] == 2
        assert s["final_val_loss"] is not None


@pytest.mark.parametrize("ref,cp", [("single", "cp2"), ("ddp2", "cp2x2")])
@pytest.mark.parametrize("mode", MODES)
def test_step0_matches_the_unsharded_run(runs, ref, cp, mode):
    (r_run, r_proc), (c_run, c_proc) = runs[ref], runs[cp]
    assert r_proc.returncode == 0 and c_proc.returncode == 0, (r_proc.stderr + c_proc.stderr)[-3000:]
    a, b = _steps(r_run, mode)[0], _steps(c_run, mode)[0]
    tol_loss, tol_gn = (1e-5, 1e-4) if mode == "bf16" else (2e-3, 2e-2)
    assert abs(a["loss"] - b["loss"]) <= tol_loss * abs(a["loss"]), (a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= tol_gn * a["grad_norm"], (a["grad_norm"], b["grad_norm"])


def test_fsdp_trains_like_ddp_under_context_parallelism(runs):
    """FSDP2 over the world with CP groups: every step's loss and grad_norm equal DDP's,
    bit for bit (as without CP: test_fsdp.py)."""
    (a_run, a_proc), (b_run, b_proc) = runs["cp2"], runs["cp2_fsdp"]
    assert a_proc.returncode == 0 and b_proc.returncode == 0, b_proc.stderr[-3000:]
    for m in MODES:
        a, b = _steps(a_run, m), _steps(b_run, m)
        assert len(a) == len(b) == 2
        assert [(x["loss"], x["grad_norm"]) for x in a] == [(x["loss"], x["grad_norm"]) for x in b], m


def test_modes_differ_under_context_parallelism(runs):
    """The stale and Delta-Matching rings are different backwards: their step-1 losses differ."""
    run, proc = runs["cp2"]
    assert proc.returncode == 0
    dm, st = _steps(run, "fp8-delta_matching"), _steps(run, "fp8-stale")
    assert dm[0]["loss"] == st[0]["loss"]      # same forward, same init
    assert dm[0]["grad_norm"] != st[0]["grad_norm"]


@pytest.mark.parametrize("nproc,extra,msg", [
    (2, ("--context-parallel", "3"), "world size that 3 divides"),
    (1, ("--context-parallel", "2"), "needs torchrun"),
    (1, ("--context-parallel", "0"), "must be >= 1"),
    (1, ("--context-parallel", "2", "--packed"), "not supported with --packed"),
    (2, ("--context-parallel", "2", "--seq-len", "62"), "multiple of 4"),
])
def test_refusals(tmp_path, text_dir, nproc, extra, msg):
    proc = _run(tmp_path / "run", text_dir, nproc, *extra)
    assert proc.returncode != 0
    assert msg in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
