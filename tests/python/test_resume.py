"""Exact resume of the training comparison (compare --deadline-s / --stop-after-steps /
--resume, fp8attn/train/state.py): a run split over several calls ends with the same
weights (bit for bit), the same per-step losses, grad norms, diagnostics and val
losses as an uninterrupted run; an incomplete call still writes summary.json and
report.md; resuming a complete run changes nothing; a call killed after its last
saved state is resumed from that state (the log is truncated to it); a changed
command is refused naming the flag. CPU, smoke preset, real text; ~30 s on 2 cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8attn.train import compare
from fp8attn.train.checkpoint import load_checkpoint
from fp8attn.train.report import read_log
from fp8attn.train.state import load_state, state_path

MODES = ("bf16", "fp8-delta_matching")
STEPS = 6
# NOTE: timing fields differ between runs; everything else in a step line must not.
TIMING = {"step_time_s", "tokens_per_s", "train_time_s"}


def _argv(text_dir: Path, data: Path, out: Path, *extra: str, steps: int = STEPS) -> list:
    return ["--preset", "smoke", "--modes", ",".join(MODES), "--steps", str(steps), "--diag-every", "2",
            "--val-every", "3", "--val-batches", "1", "--data-dir", str(data), "--text-dir", str(text_dir),
            "--device", "cpu", "--no-progress", "--out", str(out), *extra]


def _run(text_dir, data, out, *extra, steps=STEPS):
    return compare.run(compare.parse_args(_argv(text_dir, data, out, *extra, steps=steps)))


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING}


def _assert_same_run(a: Path, b: Path) -> None:
    for mode in MODES:
        la, lb = read_log(a / f"{mode}.jsonl"), read_log(b / f"{mode}.jsonl")
        assert [_strip(r) for r in la["steps"]] == [_strip(r) for r in lb["steps"]], mode
        assert la["vals"] == lb["vals"], mode
        assert _strip(la["meta"]) == _strip(lb["meta"])
        sa, sb = _strip(la["summary"]), _strip(lb["summary"])
        assert sa == sb, mode
        ma, _ = load_checkpoint(a / f"{mode}.pt")
        mb, _ = load_checkpoint(b / f"{mode}.pt")
        da, db = ma.state_dict(), mb.state_dict()
        assert da.keys() == db.keys()
        for k in da:
            assert torch.equal(da[k], db[k]), (mode, k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_dir):
    """An uninterrupted run and the same run split into three calls (2 + 3 + 1 steps)."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "data"
    _run(text_dir, data, root / "full")
    split = root / "split"
    _run(text_dir, data, split, "--stop-after-steps", "2")
    first = {"summary": json.loads((split / "summary.json").read_text()),
             "report": (split / "report.md").read_text(),
             "logs": {m: read_log(split / f"{m}.jsonl") for m in MODES},
             "states": {m: load_state(state_path(split, m), mode=m)["step"] for m in MODES},
             "pts": sorted(p.name for p in split.glob("*.pt"))}
    _run(text_dir, data, split, "--resume", "--stop-after-steps", "3")
    second_states = {m: load_state(state_path(split, m))["step"] for m in MODES}
    _run(text_dir, data, split, "--resume")
    return {"root": root, "data": data, "full": root / "full", "split": split, "first": first,
            "second_states": second_states}


def test_incomplete_call_writes_state_summary_and_report(runs):
    first = runs["first"]
    assert first["summary"]["complete"] is False
    for s in first["summary"]["summaries"]:
        assert s["steps_done"] == 2 < STEPS and s["complete"] is False and not s["diverged"]
    assert "incomplete: 2 steps" in first["report"]
    assert first["states"] == {m: 2 for m in MODES}
    # No final model of an unfinished mode; only the states.
    assert first["pts"] == sorted(f"{m}.state.pt" for m in MODES)
    assert all(len(log["steps"]) == 2 for log in first["logs"].values())
    assert runs["second_states"] == {m: 5 for m in MODES}


def test_split_run_equals_uninterrupted_run(runs):
    _assert_same_run(runs["full"], runs["split"])
    summary = json.loads((runs["split"] / "summary.json").read_text())
    assert summary["complete"] is True
    assert all(s["complete"] and s["steps_done"] == STEPS for s in summary["summaries"])
    # The states of finished modes are removed; the log records where each call resumed.
    assert not list(runs["split"].glob("*.state.pt"))
    lines = [json.loads(l) for l in (runs["split"] / "bf16.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "resume"] == [2, 5]
    assert sum(r["type"] == "summary" for r in lines) == 1
    assert sum(r["type"] == "meta" for r in lines) == 1
    # The fp8 diagnostics accumulators carried over (diag steps 0, 2, 4 span the calls).
    s_full = read_log(runs["full"] / "fp8-delta_matching.jsonl")["summary"]
    assert s_full["rowsum_post_mean"] is not None


def test_resume_of_a_complete_run_is_a_no_op(runs, text_dir):
    split = runs["split"]
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in split.glob("*") if p.suffix in (".jsonl", ".pt")}
    _, _, summaries = _run(text_dir, runs["data"], split, "--resume")
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in split.glob("*") if p.suffix in (".jsonl", ".pt")}
    assert before == after
    assert [s["steps_done"] for s in summaries] == [STEPS] * len(MODES)


def test_killed_call_resumes_from_its_last_state(runs, text_dir, tmp_path):
    """A call killed after it logged steps past its last saved state: the resume drops
    those lines and retrains them from the state, ending equal to the uninterrupted run."""
    out = tmp_path / "killed"
    _run(text_dir, runs["data"], out, "--stop-after-steps", "2")
    saved = {m: state_path(out, m).read_bytes() for m in MODES}
    _run(text_dir, runs["data"], out, "--resume", "--stop-after-steps", "2")
    for m in MODES:                        # as if the second call died before saving its state
        state_path(out, m).write_bytes(saved[m])
        assert len(read_log(out / f"{m}.jsonl")["steps"]) == 4
    _run(text_dir, runs["data"], out, "--resume")
    _assert_same_run(runs["full"], out)


def test_deadline_before_any_step_leaves_modes_unstarted(runs, text_dir, tmp_path):
    out = tmp_path / "deadline"
    path, _, summaries = _run(text_dir, runs["data"], out, "--deadline-s", "1e-6")
    assert path is not None and path.is_file()                   # the report is still written
    assert [s["steps_done"] for s in summaries] == [0, 0]
    assert json.loads((out / "summary.json").read_text())["complete"] is False
    assert not list(out.glob("*.pt"))
    _run(text_dir, runs["data"], out, "--resume")
    _assert_same_run(runs["full"], out)


def test_deadline_stops_after_a_step(runs, text_dir, tmp_path):
    """A real (wall-time) deadline: the first mode stops cleanly after a step with a state
    at that step, the later mode is not started; the log ends in an incomplete summary."""
    out = tmp_path / "deadline2"
    _, _, summaries = _run(text_dir, runs["data"], out, "--deadline-s", "1.5", steps=400)
    done = [s["steps_done"] for s in summaries]
    assert 0 < done[0] < 400 and done[1] == 0, done
    assert all(s["complete"] is False for s in summaries)
    assert load_state(state_path(out, MODES[0]))["step"] == done[0]
    assert not state_path(out, MODES[1]).exists()
    log = read_log(out / f"{MODES[0]}.jsonl")
    assert [r["step"] for r in log["steps"]] == list(range(done[0]))
    assert log["summary"]["complete"] is False


@pytest.mark.parametrize("extra, flag", [
    (["--lr", "3.7e-3"], "--lr"), (["--seed", "7"], "--seed"), (["--data-seed", "7"], "--data-seed"),
    (["--model", "n_layers=1"], "--model"), (["--no-qk-norm"], "--no-qk-norm"),
])
def test_resume_with_a_changed_command_is_refused(runs, text_dir, extra, flag):
    with pytest.raises(SystemExit, match=flag):
        _run(text_dir, runs["data"], runs["split"], "--resume", *extra)


def test_resume_with_changed_steps_modes_or_preset_is_refused(runs, text_dir):
    with pytest.raises(SystemExit, match="--steps"):
        _run(text_dir, runs["data"], runs["split"], "--resume", steps=STEPS + 2)
    argv = _argv(text_dir, runs["data"], runs["split"], "--resume")
    argv[argv.index("--modes") + 1] = "bf16"
    with pytest.raises(SystemExit, match="--modes"):
        compare.run(compare.parse_args(argv))
    argv = _argv(text_dir, runs["data"], runs["split"], "--resume")
    argv[argv.index("--preset") + 1] = "cpu-tiny"
    with pytest.raises(SystemExit, match="--preset"):
        compare.run(compare.parse_args(argv))


def test_resume_without_a_run_and_bad_flags_are_refused(text_dir, tmp_path, runs):
    with pytest.raises(SystemExit, match="--resume"):
        _run(text_dir, runs["data"], tmp_path / "nothing", "--resume")
    for extra, flag in ((["--resume", "--fsdp"], "--resume"), (["--deadline-s", "60", "--fsdp"], "--deadline-s"),
                        (["--deadline-s", "0"], "--deadline-s"), (["--stop-after-steps", "0"], "--stop-after-steps"),
                        (["--state-every", "-1"], "--state-every")):
        with pytest.raises(SystemExit, match=flag):
            _run(text_dir, runs["data"], tmp_path / "x", *extra)


def test_state_every_bounds_the_loss_of_a_crashed_call(runs, text_dir, tmp_path, monkeypatch):
    """--state-every 2, and the call dies in the val loss after the last (6th) step of the
    first mode, whose log already holds all 6 steps: the resume restarts from the state
    after 4 steps, drops the logged steps 5-6, and ends equal to the uninterrupted run."""
    from fp8attn.train import trainer

    out = tmp_path / "crash"
    real, calls = trainer.evaluate, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(trainer, "evaluate", dying)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(text_dir, runs["data"], out, "--state-every", "2")
    monkeypatch.setattr(trainer, "evaluate", real)
    assert load_state(state_path(out, MODES[0]))["step"] == 4
    assert len(read_log(out / f"{MODES[0]}.jsonl")["steps"]) == STEPS
    assert not (out / f"{MODES[1]}.jsonl").exists()
    _run(text_dir, runs["data"], out, "--resume", "--state-every", "2")
    _assert_same_run(runs["full"], out)
    lines = [json.loads(l) for l in (out / f"{MODES[0]}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "resume"] == [4]


def test_a_run_recorded_before_a_field_existed_resumes_with_its_default():
    # run_config.json of an older run has no fp8_qk_rotation / fp8_smooth_k (the options
    # came later, off by default): resuming with the defaults is the same run; turning an
    # option on is refused naming its flag.
    from fp8attn.train.state import config_mismatches

    cur = {"format": "f", "preset": "p", "modes": ["bf16"], "train": {"lr": 1e-3},
           "model": {"fp8_scaling": "row", "fp8_qk_rotation": "none", "fp8_smooth_k": False},
           "data": {}, "world_size": 1}
    old = {**cur, "model": {}}
    assert config_mismatches(old, cur) == []
    on = {**cur, "model": {**cur["model"], "fp8_qk_rotation": "hadamard"}}
    assert any(m.startswith("--qk-rotation") for m in config_mismatches(old, on))
    assert any(m.startswith("--lr") for m in config_mismatches(cur, {**cur, "train": {"lr": 2e-3}}))


def test_split_muon_run_equals_uninterrupted_run(text_dir, tmp_path):
    # The Muon + AdamW state (issue #22 item 2) goes through the training state too.
    data = tmp_path / "data"
    _run(text_dir, data, tmp_path / "full", "--optimizer", "muon")
    split = tmp_path / "split"
    _run(text_dir, data, split, "--optimizer", "muon", "--stop-after-steps", "3")
    assert set(load_state(state_path(split, MODES[0]))["optim"]) == {"muon", "adamw"}
    _run(text_dir, data, split, "--optimizer", "muon", "--resume")
    _assert_same_run(tmp_path / "full", split)
    # and Muon is not AdamW: the same run with AdamW ends elsewhere
    _run(text_dir, data, tmp_path / "adamw")
    la = read_log(tmp_path / "adamw" / "bf16.jsonl")["steps"][-1]["loss"]
    lm = read_log(tmp_path / "full" / "bf16.jsonl")["steps"][-1]["loss"]
    assert la != lm


def test_resume_with_another_optimizer_is_refused(runs, text_dir):
    with pytest.raises(SystemExit, match="--optimizer: train field optimizer saved 'adamw', now 'muon'"):
        _run(text_dir, runs["data"], runs["split"], "--resume", "--optimizer", "muon")
