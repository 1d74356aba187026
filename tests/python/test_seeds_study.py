"""Seed-spread study (scripts/seeds_study.sh, fp8attn/train/seeds.py).

- One compare process per (mode, seed) trains exactly what the multi-mode compare
  run trains for that mode (same init, same batches, same logged numbers on the
  CPU), whatever the other modes of the process and the global RNG state.
- `seeds aggregate` on real smoke runs (2 modes x 2 seeds): the table numbers are
  the logged val losses, their mean, spread and gaps; paired differences; the
  files it writes.
- Bad input is refused with a message naming the run: a missing run dir,
  mismatched step counts, a cut-short run (listed with --partial instead).
- `seeds plan` on synthetic calibration logs.
CPU, smoke preset, real text; ~15 s on 2 cores.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8attn.train import compare, seeds
from fp8attn.train.report import read_log

MODES = ("bf16", "fp8-delta_matching")
SEEDS = (7, 8)
STEPS = 6
TIMING = {"step_time_s", "tokens_per_s", "train_time_s"}


def _run(text_dir: Path, data: Path, out: Path, modes: str, seed: int, *extra: str, steps: int = STEPS):
    argv = ["--preset", "smoke", "--modes", modes, "--steps", str(steps), "--diag-every", "2",
            "--val-every", "3", "--val-batches", "1", "--seed", str(seed), "--data-seed", str(seed + 100),
            "--data-dir", str(data), "--text-dir", str(text_dir), "--device", "cpu", "--threads", "1",
            "--no-progress", "--no-save", "--out", str(out), *extra]
    return compare.run(compare.parse_args(argv))


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING}


@pytest.fixture(scope="module")
def study(tmp_path_factory, text_dir):
    """A study dir of one compare run per (mode, seed), plus a 2-mode run of seed 7."""
    root = tmp_path_factory.mktemp("seeds")
    data = root / "data"
    # NOTE: bf16 second, so its process state (global RNG, threads, caches) differs from the single run.
    _run(text_dir, data, root / "multi", ",".join(reversed(MODES)), SEEDS[0])
    for seed in SEEDS:
        for mode in MODES:
            torch.manual_seed(999 + seed)      # a different global RNG state before every run
            torch.rand(17)
            _run(text_dir, data, root / "study" / seeds.run_dir_name(mode, seed), mode, seed)
    return root


def test_one_process_per_mode_equals_the_multi_mode_run(study):
    for mode in MODES:
        a = read_log(study / "multi" / f"{mode}.jsonl")
        b = read_log(study / "study" / seeds.run_dir_name(mode, SEEDS[0]) / f"{mode}.jsonl")
        assert a["meta"]["init_fingerprint"] == b["meta"]["init_fingerprint"]
        assert len(a["steps"]) == STEPS
        assert [_strip(r) for r in a["steps"]] == [_strip(r) for r in b["steps"]], mode
        assert a["vals"] == b["vals"], mode
    # Another seed: other weights and other batches.
    b7 = read_log(study / "study" / seeds.run_dir_name("bf16", SEEDS[0]) / "bf16.jsonl")
    b8 = read_log(study / "study" / seeds.run_dir_name("bf16", SEEDS[1]) / "bf16.jsonl")
    assert b8["meta"]["init_fingerprint"] != b7["meta"]["init_fingerprint"]
    assert b8["meta"]["train"]["data_seed"] != b7["meta"]["train"]["data_seed"]
    assert b8["steps"][0]["loss"] != b7["steps"][0]["loss"]


def test_aggregate_table_matches_the_logs(study, tmp_path):
    out = tmp_path / "agg"
    res = seeds.aggregate(study / "study", out=out)
    js = res["json"]
    assert js["modes"] == list(MODES) and js["seeds"] == list(SEEDS) and js["problems"] == []
    vals = {(m, s): read_log(study / "study" / seeds.run_dir_name(m, s) / f"{m}.jsonl")["vals"][-1]["val_loss"]
            for m in MODES for s in SEEDS}
    for m in MODES:
        st = js["stats"][m]
        v = [vals[(m, s)] for s in SEEDS]
        assert st["n"] == 2
        assert st["mean"] == pytest.approx(np.mean(v), abs=1e-12)
        assert st["spread"] == pytest.approx(max(v) - min(v), abs=1e-12)
        assert st["spread"] > 0                     # two seeds really differ
    bmean = np.mean([vals[("bf16", s)] for s in SEEDS])
    dm = js["stats"]["fp8-delta_matching"]
    assert dm["gap_to_bf16"] == pytest.approx(dm["mean"] - bmean, abs=1e-12)
    assert js["stats"]["bf16"]["gap_to_bf16"] == 0.0
    # The end-of-run gain and residual are the last logged ones.
    log = read_log(study / "study" / seeds.run_dir_name("fp8-delta_matching", 8) / "fp8-delta_matching.jsonl")
    run = next(r for r in js["runs"] if r["mode"] == "fp8-delta_matching" and r["seed"] == 8)
    assert run["max_gain_end"] == log["steps"][-1]["max_gain"]
    assert run["rowsum_post_last"] == [r for r in log["steps"] if "rowsum_post_mean" in r][-1]["rowsum_post_mean"]
    assert run["rowsum_post_last"] is not None and run["data_seed"] == 108
    # Paired difference per seed.
    pair = next(p for p in js["pairs"] if p["a"] == "fp8-delta_matching" and p["b"] == "bf16")
    for s in SEEDS:
        assert pair["diffs"][s] == pytest.approx(vals[("fp8-delta_matching", s)] - vals[("bf16", s)], abs=1e-12)
    # The markdown row carries the same numbers.
    row = next(l for l in res["markdown"].splitlines() if l.startswith("| fp8-delta_matching |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == [f"{vals[('fp8-delta_matching', 7)]:.4f}", f"{vals[('fp8-delta_matching', 8)]:.4f}",
                          f"{dm['mean']:.4f}", f"{dm['spread']:.4f}"]
    assert cells[5] == f"{dm['mean'] - bmean:+.4f}"
    for name in ("seeds.md", "seeds.json", "seeds_loss.png", "seeds_gain.png"):
        assert (out / name).stat().st_size > 500
    assert (out / "seeds_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "seeds.json").read_text())["stats"]["bf16"]["n"] == 2


def test_missing_run_dir_is_a_clear_error(study, tmp_path):
    s = tmp_path / "study"
    shutil.copytree(study / "study", s)
    shutil.rmtree(s / seeds.run_dir_name("bf16", 8))
    with pytest.raises(ValueError, match=r"mode bf16 seed 8: run dir .*bf16-s8 is missing"):
        seeds.load_study(s)
    with pytest.raises(ValueError, match="missing"):
        seeds.load_study(s, modes=list(MODES), seeds=[7, 8, 9])
    # --partial: the rest is aggregated, the gap listed.
    res = seeds.aggregate(s, partial=True, out=tmp_path / "agg")
    assert res["json"]["stats"]["bf16"]["n"] == 1 and res["json"]["stats"]["bf16"]["spread"] is None
    assert any("bf16 seed 8" in p for p in res["json"]["problems"])
    assert "| bf16 | " in res["markdown"] and "missing" in res["markdown"]
    assert seeds.main(["aggregate", "--study", str(tmp_path / "nothing")]) == 2


def test_mismatched_step_counts_are_refused(study, text_dir, tmp_path):
    s = tmp_path / "study"
    shutil.copytree(study / "study", s)
    shutil.rmtree(s / seeds.run_dir_name("bf16", 8))
    _run(text_dir, study / "data", s / seeds.run_dir_name("bf16", 8), "bf16", 8, steps=STEPS - 2)
    with pytest.raises(ValueError, match=r"train\.steps: bf16-s7 has 6, bf16-s8 has 4"):
        seeds.load_study(s)
    with pytest.raises(ValueError, match=r"train\.steps"):
        seeds.load_study(s, partial=True)   # NOTE: a different lr schedule is never aggregated


def test_cut_short_run_is_refused_or_listed(study, text_dir, tmp_path):
    s = tmp_path / "study"
    shutil.copytree(study / "study", s)
    shutil.rmtree(s / seeds.run_dir_name("fp8-delta_matching", 7))
    _run(text_dir, study / "data", s / seeds.run_dir_name("fp8-delta_matching", 7), "fp8-delta_matching", 7,
         "--stop-after-steps", "3")
    with pytest.raises(ValueError, match=r"fp8-delta_matching seed 7 .* incomplete: 3/6 steps"):
        seeds.load_study(s)
    st = seeds.load_study(s, partial=True)
    stats = seeds.mode_stats(st)
    assert stats["fp8-delta_matching"]["n"] == 1 and list(stats["fp8-delta_matching"]["vals"]) == [8]


def test_seeds_with_different_init_within_a_seed_are_refused(study, tmp_path):
    s = tmp_path / "study"
    shutil.copytree(study / "study", s)
    # Pretend the seed-8 bf16 run is seed 7's (relabel its dir and meta): other weights than fp8 seed 7.
    shutil.rmtree(s / "bf16-s7")
    shutil.move(s / "bf16-s8", s / "bf16-s7")
    p = s / "bf16-s7" / "bf16.jsonl"
    lines = p.read_text().splitlines()
    meta = json.loads(lines[0])
    meta["train"]["seed"] = 7
    p.write_text("\n".join([json.dumps(meta)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="seed 7 have different initial weights"):
        seeds.load_study(s, seeds=[7])


def _fake_log(path: Path, mode: str, seed: int, dts: list[float], train_time: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    recs = [{"type": "meta", "mode": mode, "train": {"seed": seed}}]
    recs += [{"type": "step", "step": i, "loss": 5.0, "step_time_s": dt} for i, dt in enumerate(dts)]
    recs.append({"type": "summary", "mode": mode, "train_time_s": train_time})
    (path / f"{mode}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_plan_uses_the_slowest_run_after_warm_up(tmp_path):
    cal = tmp_path / "cal"
    # Warm-up steps 0-2 are slow and left out; fp8 is the slowest at 0.2 s/step.
    _fake_log(cal / "bf16-s1", "bf16", 1, [5.0, 1.0, 1.0] + [0.1] * 10, 8.0)
    _fake_log(cal / "fp8-stale-s1", "fp8-stale", 1, [5.0, 1.0, 1.0] + [0.2] * 10, 9.0)
    steps, note = seeds.plan_steps(cal, window_s=200.0, parallel=8, cal_wall_s=19.0, val_batches=3, margin=1.0)
    # start-up 19 - 9 = 10 s, val 5 x 3 x 0.2 / 3 = 1 s: (200 - 10 - 1) / 0.2 = 945 -> 940
    assert steps == 940, note
    assert "fp8-stale-s1" in note and "200 ms" in note
    # Two waves (parallel 1): each gets half the window.
    steps2, _ = seeds.plan_steps(cal, window_s=200.0, parallel=1, cal_wall_s=19.0, val_batches=3, margin=1.0)
    assert steps2 == 440    # (100 - 10 - 1) / 0.2 = 445 -> 440
    assert seeds.plan_steps(cal, 200.0, 8, max_steps=300)[0] == 300
    assert seeds.plan_steps(cal, 1.0, 8)[0] == 10
    # A calibration run without step times: 0 and the reason.
    _fake_log(cal / "fp8-stale-s2", "fp8-stale", 2, [5.0], 1.0)
    _fake_log(cal / "bf16-s2", "bf16", 2, [5.0, 1.0, 1.0, 0.1], 1.0)
    steps3, why = seeds.plan_steps(cal, 200.0, 8)
    assert steps3 == 0 and "fp8-stale seed 2" in why
    assert seeds.main(["plan", "--calib", str(cal), "--window-s", "200", "--parallel", "8"]) == 2


def test_at_step_reads_every_run_at_a_shared_val_step(study, text_dir, tmp_path):
    """A deadline-cut run is compared at the last val step every run logged (same lr schedule
    and batches there); a step the cut run never reached is refused, naming it."""
    s = tmp_path / "study"
    shutil.copytree(study / "study", s)
    shutil.rmtree(s / seeds.run_dir_name("fp8-delta_matching", 7))
    _run(text_dir, study / "data", s / seeds.run_dir_name("fp8-delta_matching", 7), "fp8-delta_matching", 7,
         "--stop-after-steps", "4")
    val_steps = {(m, sd): [v["step"] for v in read_log(s / seeds.run_dir_name(m, sd) / f"{m}.jsonl")["vals"]]
                 for m in MODES for sd in SEEDS}
    shared = set.intersection(*(set(v) for v in val_steps.values()))
    assert shared and max(shared) < STEPS - 1, val_steps      # the cut run lacks the final val step
    at = seeds.common_val_step(s)
    assert at == max(shared)
    res = seeds.aggregate(s, out=tmp_path / "agg", at_step="common")
    stats = res["json"]["stats"]
    for m in MODES:
        for sd in SEEDS:
            logged = {v["step"]: v["val_loss"] for v in
                      read_log(s / seeds.run_dir_name(m, sd) / f"{m}.jsonl")["vals"]}
            assert stats[m]["vals"][sd] == logged[at]
        assert stats[m]["n"] == 2
    assert res["json"]["at_step"] == at and not res["json"]["problems"]
    assert f"at step {at}" in res["markdown"]
    assert (f"**Read at val step {at}** (the last val step that every run logged (--at-step common): 1 of the "
            f"{len(MODES) * len(SEEDS)} runs stopped before the end (after 4 steps") in res["markdown"]
    assert f"after {at + 1} of the {STEPS} training steps" in res["markdown"]
    d = stats["fp8-delta_matching"]["vals"][7] - stats["bf16"]["vals"][7]
    pair = next(p for p in res["json"]["pairs"] if (p["a"], p["b"]) == ("fp8-delta_matching", "bf16"))
    assert pair["diffs"][7] == pytest.approx(d)
    # The strict read (at the end) still refuses the cut run; a step it never logged is an error.
    with pytest.raises(ValueError, match="incomplete"):
        seeds.load_study(s)
    with pytest.raises(ValueError, match=r"fp8-delta_matching seed 7 .* no val loss at step"):
        seeds.aggregate(s, out=tmp_path / "agg2", at_step=STEPS - 1)
    with pytest.raises(SystemExit):
        seeds.main(["aggregate", "--study", str(s), "--at-step", "x"])
    with pytest.raises(SystemExit):
        seeds.main(["aggregate", "--study", str(s), "--at-step", "common", "--partial"])
