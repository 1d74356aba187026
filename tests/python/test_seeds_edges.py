"""Hostile inputs to `python -m fp8attn.train.seeds` (aggregate and plan): every bad input
is a clear error naming the run / argument and what was expected, never a traceback and
never a silently wrong table. Synthetic trainer logs (no training); CPU, ~5 s.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fp8attn.train import seeds
from fp8attn.train.model import ATTN_MODES
from fp8attn.train.report import read_log

STEPS = 20
VAL_EVERY = 5


def _meta(mode: str, seed: int) -> dict:
    return {"type": "meta", "mode": mode,
            "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                      "qk_norm": True, "attn_mode": mode, "scope": "attn-core"},
            "train": {"steps": STEPS, "batch_size": 2, "seq_len": 16, "lr": 1e-3, "min_lr_ratio": 0.1, "warmup": 2,
                      "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0, "seed": seed,
                      "data_seed": seed + 100, "diag_every": 2, "val_every": VAL_EVERY, "val_batches": 1,
                      "loss_avg_last": 4},
            "params": 12345, "init_fingerprint": f"fp{seed}", "device": "cpu",
            "data": {"source": "synthetic", "vocab_size": 256, "train_tokens": 1000, "val_tokens": 100}}


def _write(study: Path, mode: str, seed: int, val=None, steps_done: int = STEPS, diverge_at: int | None = None,
           summary_val="last") -> Path:
    """One run dir <mode>-s<seed>; val(step) gives the val loss (default: a smooth curve that
    depends on mode and seed)."""
    val = val or (lambda st: 5.0 - 0.01 * st + 0.001 * seed + 0.002 * ATTN_MODES.index(mode))
    d = study / seeds.run_dir_name(mode, seed)
    d.mkdir(parents=True, exist_ok=True)
    recs, vals = [_meta(mode, seed)], []
    diverged = False
    for st in range(steps_done):
        if diverge_at is not None and st == diverge_at:
            recs.append({"type": "step", "step": st, "loss": float("nan"), "grad_norm": float("nan"),
                         "lr": 1e-3, "diverged": True})
            diverged = True
            break
        r = {"type": "step", "step": st, "loss": 5.0 - 0.01 * st, "step_time_s": 0.1, "max_gain": 1.1,
             "top4_share": 0.1}
        if mode != "bf16" and st % 2 == 0:
            r["rowsum_post_mean"] = 1e-2
        recs.append(r)
        if (st + 1) % VAL_EVERY == 0 or st + 1 == STEPS:
            vals.append(val(st))
            recs.append({"type": "val", "step": st, "val_loss": vals[-1]})
    done = sum(1 for r in recs if r["type"] == "step" and not r.get("diverged"))
    recs.append({"type": "summary", "mode": mode, "steps_done": done,
                 "complete": diverged or done == STEPS, "diverged": diverged,
                 "final_train_loss": 4.9, "final_val_loss": (vals[-1] if vals else None) if summary_val == "last"
                 else summary_val, "train_time_s": 2.0})
    (d / f"{mode}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


def _study(root: Path, modes=("bf16", "fp8-stale"), seed_list=(1, 2)) -> Path:
    s = root / "study"
    for sd in seed_list:
        for m in modes:
            _write(s, m, sd)
    return s


def test_good_study_aggregates(tmp_path):
    s = _study(tmp_path)
    res = seeds.aggregate(s, out=tmp_path / "out")
    st = res["json"]["stats"]
    assert st["bf16"]["n"] == 2 and st["fp8-stale"]["n"] == 2
    assert res["json"]["pairs"][0]["same_sign"] is True


def test_truncated_last_line_names_the_file_and_line(tmp_path, capsys):
    s = _study(tmp_path)
    p = s / "fp8-stale-s2" / "fp8-stale.jsonl"
    text = p.read_text()
    p.write_text(text[:-30])                      # killed while writing the summary line
    n = len(text[:-30].splitlines())
    with pytest.raises(ValueError, match=rf"{p}: line {n} is not valid JSON.*last line"):
        read_log(p)
    assert seeds.main(["aggregate", "--study", str(s), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and f"line {n}" in err and "Traceback" not in err


def test_truncated_calibration_log_gives_no_plan(tmp_path):
    cal = _study(tmp_path)
    p = cal / "bf16-s1" / "bf16.jsonl"
    p.write_text(p.read_text()[:-10])
    steps, why = seeds.plan_steps(cal, 100.0, 4)
    assert steps == 0 and "bf16 seed 1" in why and str(p) in why


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    s = _study(tmp_path)
    f = tmp_path / "afile"
    f.write_text("x")
    assert seeds.main(["aggregate", "--study", str(s), "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--out {f} is a file" in err


def test_study_that_is_a_file_is_not_called_missing(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        seeds.load_study(f)
    with pytest.raises(ValueError, match="is not a directory"):
        seeds.load_study(f, modes=["bf16"], seeds=[1])


def test_junk_dir_with_an_unknown_mode_is_named(tmp_path):
    s = _study(tmp_path)
    (s / "fp8-bogus-s9").mkdir()
    (s / "notes").mkdir()                          # not <mode>-s<seed>: ignored
    (s / "bf16-sX").mkdir()
    with pytest.raises(ValueError, match="fp8-bogus-s9 .*unknown mode"):
        seeds.load_study(s)
    # Named explicitly, the rest of the study still aggregates.
    assert seeds.load_study(s, modes=["bf16", "fp8-stale"], seeds=[1, 2])["problems"] == []


def test_missing_cell_of_discovered_study_says_where_modes_and_seeds_came_from(tmp_path):
    s = _study(tmp_path)
    _write(s, "bf16", 3)                           # seed 3 has no fp8-stale run
    with pytest.raises(ValueError, match=r"fp8-stale seed 3.*modes bf16, fp8-stale, seeds 1, 2, 3"):
        seeds.load_study(s)


def test_nan_final_val_loss_is_not_called_an_edited_log(tmp_path):
    s = _study(tmp_path)
    _write(s, "fp8-stale", 2, val=lambda st: float("nan") if st == STEPS - 1 else 4.0)
    with pytest.raises(ValueError, match=r"fp8-stale seed 2 .*val loss nan .*not finite.*--partial"):
        seeds.load_study(s)
    st = seeds.load_study(s, partial=True)
    assert any("fp8-stale seed 2" in p and "not finite" in p for p in st["problems"])
    stats = seeds.mode_stats(st)
    assert stats["fp8-stale"]["n"] == 1 and math.isfinite(stats["fp8-stale"]["mean"])
    md = seeds.aggregate(s, out=tmp_path / "o", partial=True)["markdown"]
    row = next(line for line in md.splitlines() if line.startswith("| fp8-stale |"))
    assert "val nan" in row and "cut at" not in row


def test_nan_val_loss_at_step_is_refused_not_averaged(tmp_path):
    s = _study(tmp_path)
    _write(s, "fp8-stale", 1, val=lambda st: float("nan") if st == 9 else 4.0 - 0.01 * st)
    with pytest.raises(ValueError, match=r"fp8-stale seed 1 .*val loss nan at step 9"):
        seeds.aggregate(s, out=tmp_path / "o", at_step=9)
    ok = seeds.aggregate(s, out=tmp_path / "o3", at_step=4)["json"]["stats"]
    assert all(math.isfinite(v["mean"]) for v in ok.values())


def test_diverged_run_counts_only_finished_steps(tmp_path):
    s = _study(tmp_path)
    _write(s, "fp8-stale", 1, diverge_at=12)
    st = seeds.load_study(s, partial=True)
    rec = next(r for r in st["runs"] if r["dir"] == "fp8-stale-s1")
    assert rec["diverged"] and rec["steps_done"] == 12          # the summary's steps_done
    assert rec["steps_done"] == read_log(s / "fp8-stale-s1" / "fp8-stale.jsonl")["summary"]["steps_done"]
    assert any("fp8-stale seed 1: diverged" in p for p in st["problems"])


def test_one_seed_has_no_sign_agreement(tmp_path):
    s = _study(tmp_path, seed_list=(1,))
    res = seeds.aggregate(s, out=tmp_path / "o")
    assert res["json"]["pairs"][0]["same_sign"] is None
    assert "n/a (one seed)" in res["markdown"]
    assert "probability 1 " not in res["markdown"] and "with 1 seeds" not in res["markdown"]


def test_at_step_heading_does_not_claim_the_rowsum_mean_is_at_that_step(tmp_path):
    s = _study(tmp_path)
    md = seeds.aggregate(s, out=tmp_path / "o", at_step=9)["markdown"]
    head = next(line for line in md.splitlines() if line.startswith("## Per run"))
    assert "rowsum post mean and the rest: at the end" in head


def test_at_step_note_says_which_val_step_and_why(tmp_path):
    """The --at-step note named the 0-based log step "of" the step count ("Read at step 19 of
    20" for the end of a 20-step run, which reads as one step short) and said the deadline had
    cut the runs whether it had or not (a new user's trial)."""
    s = _study(tmp_path)
    md = seeds.aggregate(s, out=tmp_path / "end", at_step=STEPS - 1)["markdown"]
    assert f" of {STEPS}**" not in md
    assert (f"**Read at val step {STEPS - 1}** (the step given by --at-step {STEPS - 1}): each run's val loss "
            f"after {STEPS} of the {STEPS} training steps (the end of training; the logs count steps from 0)") in md
    assert "deadline" not in md
    assert f"## Val loss per mode at step {STEPS - 1} (after {STEPS} of {STEPS} training steps)" in md
    # common: a cut run -> the last val step all runs have, and why
    _write(s, "fp8-stale", 2, steps_done=13)
    md = seeds.aggregate(s, out=tmp_path / "common", at_step="common")["markdown"]
    assert ("**Read at val step 9** (the last val step that every run logged (--at-step common): 1 of the 4 runs "
            "stopped before the end (after 13 steps: a deadline or --stop-after-steps), so no later step has a val loss in every run): "
            f"each run's val loss after 10 of the {STEPS} training steps ({STEPS - 10} before the end;") in md


@pytest.mark.parametrize("argv, what", [
    (["--seeds", ","], "--seeds"),
    (["--seeds", "1,x"], "--seeds"),
    (["--modes", "bf16,fp8-foo"], "--modes"),
    (["--modes", ","], "--modes"),
    (["--at-step", "-1"], "--at-step"),
])
def test_bad_aggregate_arguments_name_the_argument(tmp_path, capsys, argv, what):
    s = _study(tmp_path)
    with pytest.raises(SystemExit) as e:
        seeds.main(["aggregate", "--study", str(s), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert what in err and "Traceback" not in err


@pytest.mark.parametrize("argv, what", [
    (["--margin", "0"], "--margin"),
    (["--window-s", "nan"], "--window-s"),
    (["--window-s", "-5"], "--window-s"),
    (["--parallel", "0"], "--parallel"),
    (["--n-runs", "-3"], "--n-runs"),
    (["--max-steps", "0"], "--max-steps"),
])
def test_bad_plan_arguments_name_the_argument(tmp_path, capsys, argv, what):
    cal = _study(tmp_path)
    base = {"--window-s": "100", "--parallel": "4"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as e:
        seeds.main(["plan", "--calib", str(cal), *flat])
    assert e.value.code == 2
    assert what in capsys.readouterr().err


def test_every_attention_mode_aggregates_fp8_cudnn_included(tmp_path, capsys):
    """The seed study takes every mode of model.ATTN_MODES (break, 2026-12-07: fp8-cudnn-s<seed>
    run dirs were refused as an unknown mode and --modes fp8-cudnn as a bad argument): its row
    carries compare's label, its paired difference to bf16 is there, every mode has its own
    plot color."""
    from fp8attn.train.model import CUDNN_MODE
    s = _study(tmp_path, modes=("bf16", "fp8-delta_matching", CUDNN_MODE))
    assert seeds.discover(s) == (["bf16", "fp8-delta_matching", CUDNN_MODE], [1, 2])
    res = seeds.aggregate(s, out=tmp_path / "out")
    assert res["json"]["stats"][CUDNN_MODE]["n"] == 2
    pairs = {(p["a"], p["b"]) for p in res["json"]["pairs"]}
    assert (CUDNN_MODE, "bf16") in pairs and ("fp8-delta_matching", CUDNN_MODE) in pairs
    assert "| fp8-cudnn (cuDNN FP8, delayed scaling) | " in res["markdown"]
    assert len({seeds.MODE_COLORS[m] for m in ATTN_MODES}) == len(ATTN_MODES)
    assert seeds.main(["aggregate", "--study", str(s), "--modes", f"bf16,{CUDNN_MODE}", "--out",
                       str(tmp_path / "o2")]) == 0
