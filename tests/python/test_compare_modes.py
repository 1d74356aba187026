"""Recipe variants of the fp8attn modes in the training comparison (compare --modes
fp8-delta_matching@tile+hadamard+smooth_k; model.parse_mode): the grammar, its canonical
names and every refusal; the per-mode model config; and one tiny CPU run (smoke preset,
split over two calls) in which the variant trains with its own recipe, next to the plain
mode with the global one, under its canonical file names, and resumes. ~20 s on 2 cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8attn.train import compare, probe, results, seeds
from fp8attn.train.checkpoint import load_checkpoint, read_info
from fp8attn.train.model import (MODE_GRAMMAR, ModeSpec, mode_model_config, mode_sort_key, parse_mode,
                                 preset_model_config)
from fp8attn.train.report import read_log

VARIANT = "fp8-delta_matching@tile+hadamard+smooth_k"
MODES = ("bf16", "fp8-delta_matching", VARIANT)


# ---- grammar ----------------------------------------------------------------------------


@pytest.mark.parametrize("name, spec", [
    ("bf16", ModeSpec("bf16")),
    ("fp8-cudnn", ModeSpec("fp8-cudnn")),
    ("fp8-stale", ModeSpec("fp8-stale")),
    ("fp8-delta_matching@row", ModeSpec("fp8-delta_matching", scaling="row")),
    ("fp8-delta_matching@tile", ModeSpec("fp8-delta_matching", scaling="tile")),
    ("fp8-matched_do+hadamard", ModeSpec("fp8-matched_do", qk_rotation="hadamard")),
    ("fp8-stale+smooth_k", ModeSpec("fp8-stale", smooth_k=True)),
    ("fp8-stale+hadamard+smooth_k", ModeSpec("fp8-stale", qk_rotation="hadamard", smooth_k=True)),
    (VARIANT, ModeSpec("fp8-delta_matching", scaling="tile", qk_rotation="hadamard", smooth_k=True)),
])
def test_accepted_names_are_canonical(name, spec):
    got = parse_mode(name)
    assert got == spec and got.name == name
    assert got.is_variant == (name not in ("bf16", "fp8-cudnn", "fp8-stale"))
    assert got.delta_mode == (None if name in ("bf16", "fp8-cudnn") else got.base.removeprefix("fp8-"))


@pytest.mark.parametrize("entry, message", [
    ("fp8-bogus", "unknown mode 'fp8-bogus'; choose from bf16,fp8-stale,fp8-matched_do,fp8-delta_matching,"
                  "fp8-cudnn"),
    ("fp8-bogus@tile", "unknown mode 'fp8-bogus@tile'"),
    ("bf16@tile", "'bf16@tile': bf16 takes no recipe suffixes; they apply to the fp8attn modes fp8-stale, "
                  "fp8-matched_do, fp8-delta_matching only"),
    ("fp8-cudnn+hadamard", "'fp8-cudnn\\+hadamard': fp8-cudnn takes no recipe suffixes"),
    ("fp8-stale@rows", "'fp8-stale@rows': unknown suffix '@rows'; allowed: @row or @tile, \\+hadamard, \\+smooth_k"),
    ("fp8-stale+tile", "unknown suffix '\\+tile'"),
    ("fp8-stale@", "unknown suffix '@'"),
    ("fp8-stale+", "unknown suffix '\\+'"),
    ("fp8-stale@row@tile", "'fp8-stale@row@tile': a scaling suffix \\(@row or @tile\\) given twice"),
    ("fp8-stale+hadamard+hadamard", "\\+hadamard given twice"),
    ("fp8-stale+smooth_k+smooth_k", "\\+smooth_k given twice"),
    ("fp8-stale+smooth_k+hadamard", "suffixes out of order; write 'fp8-stale\\+hadamard\\+smooth_k'"),
    ("fp8-stale+hadamard@tile", "suffixes out of order; write 'fp8-stale@tile\\+hadamard'"),
    ("fp8-stale+smooth_k@row+hadamard", "write 'fp8-stale@row\\+hadamard\\+smooth_k'"),
])
def test_refusals_name_modes_the_entry_and_what_is_allowed(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_mode(entry)
    with pytest.raises(SystemExit, match=message) as exc:
        compare.parse_modes(f"bf16,{entry}")
    assert str(exc.value).startswith("--modes: ") and repr(entry) in str(exc.value)
    if "unknown mode" not in message:   # the message says what is allowed
        assert MODE_GRAMMAR in str(exc.value)


def test_mode_list_keeps_order_and_refuses_repeats_and_duplicate_configurations():
    assert compare.parse_modes(" bf16, fp8-delta_matching ,fp8-delta_matching@tile,") == [
        "bf16", "fp8-delta_matching", "fp8-delta_matching@tile"]
    assert compare.parse_modes(",".join(MODES)) == list(MODES)
    with pytest.raises(SystemExit, match="--modes: unknown or empty mode list"):
        compare.parse_modes(" , ")
    with pytest.raises(SystemExit, match="--modes: a mode is listed twice"):
        compare.parse_modes("fp8-stale@tile,bf16,fp8-stale@tile")
    # Two spellings of one configuration: by the global flags, which a suffix overrides.
    compare.parse_modes("fp8-delta_matching,fp8-delta_matching@tile")     # --scaling row: different
    for modes, flags in (("fp8-delta_matching,fp8-delta_matching@tile", dict(scaling="tile")),
                         ("fp8-delta_matching@row,fp8-delta_matching", {}),
                         ("fp8-stale,fp8-stale+hadamard", dict(qk_rotation="hadamard")),
                         ("fp8-stale@tile+smooth_k,fp8-stale+smooth_k", dict(scaling="tile")),
                         ("fp8-stale+smooth_k,fp8-stale", dict(smooth_k=True))):
        a, b = modes.split(",")
        with pytest.raises(SystemExit, match=f"--modes: '{a}' and '{b}' are the same configuration".replace(
                "+", "\\+")):
            compare.parse_modes(modes, **flags)
    # The same delta mode with another recipe, and other delta modes, are not duplicates.
    compare.parse_modes("fp8-stale,fp8-matched_do,fp8-stale@tile,fp8-stale+smooth_k", scaling="row")


def test_compare_refuses_a_bad_variant_before_any_work(tmp_path):
    # NOTE: the text dir does not exist, so reaching the data preparation would raise.
    args = compare.parse_args(["--preset", "smoke", "--device", "cpu", "--steps", "2", "--out", str(tmp_path / "run"),
                               "--text-dir", str(tmp_path / "none"), "--data-dir", str(tmp_path / "data"),
                               "--scaling", "tile", "--modes", "bf16,fp8-delta_matching,fp8-delta_matching@tile"])
    with pytest.raises(SystemExit, match="--modes: 'fp8-delta_matching' and 'fp8-delta_matching@tile' are the same"):
        compare.run(args)
    args.modes = "bf16@tile"
    with pytest.raises(SystemExit, match="--modes: 'bf16@tile': bf16 takes no recipe suffixes"):
        compare.run(args)
    assert not (tmp_path / "run").exists()


def test_mode_model_config_overrides_only_what_the_suffixes_name():
    run = preset_model_config("smoke", fp8_scaling="tile", fp8_qk_rotation="hadamard")
    plain = mode_model_config(run, "fp8-stale")
    assert (plain.attn_mode, plain.fp8_scaling, plain.fp8_qk_rotation, plain.fp8_smooth_k) == (
        "fp8-stale", "tile", "hadamard", False)
    v = mode_model_config(run, "fp8-stale@row+smooth_k")
    assert (v.attn_mode, v.fp8_scaling, v.fp8_qk_rotation, v.fp8_smooth_k) == ("fp8-stale", "row", "hadamard", True)
    assert mode_model_config(run, "bf16") == preset_model_config("smoke", fp8_scaling="tile",
                                                                 fp8_qk_rotation="hadamard", attn_mode="bf16")
    order = ["fp8-cudnn", VARIANT, "fp8-delta_matching", "fp8-stale@tile", "bf16", "fp8-stale", "fp8-stale@row"]
    assert sorted(order, key=mode_sort_key) == ["bf16", "fp8-stale", "fp8-stale@row", "fp8-stale@tile",
                                                "fp8-delta_matching", VARIANT, "fp8-cudnn"]


def test_seeds_study_takes_variant_run_dirs(tmp_path):
    for d in ("bf16-s1", f"{VARIANT}-s1", "fp8-delta_matching@tile-s2", "fp8-stale-s1"):
        (tmp_path / d).mkdir()
    assert seeds.discover_runs(tmp_path) == [("bf16", 1), ("fp8-stale", 1), ("fp8-delta_matching@tile", 2),
                                            (VARIANT, 1)]
    (tmp_path / "fp8-stale+smooth_k+hadamard-s1").mkdir()   # not canonical: named, not guessed
    with pytest.raises(ValueError, match="fp8-stale\\+smooth_k\\+hadamard-s1 .*unknown mode"):
        seeds.discover_runs(tmp_path)
    # A variant's run differs from the others only in the fields its name sets.
    meta = lambda mode, **kw: {"mode": mode, "train": {}, "data": {},   # noqa: E731
                               "model": {"attn_mode": mode.split("@")[0].split("+")[0], "fp8_scaling": "row",
                                         "fp8_qk_rotation": "none", "fp8_smooth_k": False, "d_model": 64, **kw}}
    seeds._check_same_config(("a", meta("fp8-delta_matching")), "b", meta(VARIANT, fp8_scaling="tile",
                                                                          fp8_qk_rotation="hadamard",
                                                                          fp8_smooth_k=True))
    with pytest.raises(ValueError, match="model.fp8_smooth_k"):
        seeds._check_same_config(("a", meta("fp8-delta_matching")), "b",
                                 meta("fp8-delta_matching@tile", fp8_scaling="tile", fp8_smooth_k=True))
    study = {"modes": ["bf16", "fp8-delta_matching", VARIANT], "seeds": [1]}
    stats = {m: {"vals": {1: v}} for m, v in zip(study["modes"], (3.0, 3.1, 3.05))}
    pairs = {(p["a"], p["b"]): p["mean"] for p in seeds.paired(study, stats)}
    assert pairs[(VARIANT, "bf16")] == pytest.approx(0.05)
    assert pairs[(VARIANT, "fp8-delta_matching")] == pytest.approx(-0.05)


# ---- one tiny run ---------------------------------------------------------------------------


def _argv(text_dir: Path, data: Path, out: Path, *extra: str, modes=MODES) -> list:
    return ["--preset", "smoke", "--modes", ",".join(modes), "--steps", "4", "--diag-every", "2",
            "--val-every", "2", "--val-batches", "1", "--batch-size", "4", "--data-dir", str(data),
            "--text-dir", str(text_dir), "--device", "cpu", "--threads", "2", "--no-progress", "--out", str(out),
            *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, text_dir):
    """The three modes split over two calls (2 + 2 steps); the variant alone, uninterrupted."""
    root = tmp_path_factory.mktemp("modes")
    data, out = root / "data", root / "run"
    compare.run(compare.parse_args(_argv(text_dir, data, out, "--stop-after-steps", "2")))
    first = {"states": sorted(p.name for p in out.glob("*.state.pt")),
             "summary": json.loads((out / "summary.json").read_text())}
    compare.run(compare.parse_args(_argv(text_dir, data, out, "--resume")))
    alone = root / "alone"
    compare.run(compare.parse_args(_argv(text_dir, data, alone, modes=(VARIANT,))))
    return {"root": root, "out": out, "alone": alone, "first": first, "text_dir": text_dir, "data": data}


def test_variant_trains_with_its_own_recipe(run):
    out = run["out"]
    logs = {m: read_log(out / f"{m}.jsonl") for m in MODES}
    for mode, want in (("fp8-delta_matching", ("row", "none", False)), (VARIANT, ("tile", "hadamard", True))):
        m = logs[mode]["meta"]["model"]
        assert logs[mode]["meta"]["mode"] == mode and m["attn_mode"] == "fp8-delta_matching"
        assert (m["fp8_scaling"], m["fp8_qk_rotation"], m["fp8_smooth_k"]) == want
        info = read_info(out / f"{mode}.pt")
        assert info["mode"] == mode and info["model_config"] == m
    # Same init and batches, another FP8 recipe: the losses differ (the override is not ignored)
    # and stay close (both train the same model).
    la, lb = ([r["loss"] for r in logs[m]["steps"]] for m in ("fp8-delta_matching", VARIANT))
    assert len(la) == len(lb) == 4 and la != lb
    assert max(abs(a - b) for a, b in zip(la, lb)) < 0.1
    assert logs[VARIANT]["summary"]["rowsum_post_mean"] is not None    # fp8 diagnostics ran
    s = json.loads((out / "summary.json").read_text())
    assert s["modes"] == list(MODES) and s["complete"] is True
    assert len({x["init_fingerprint"] for x in s["summaries"]}) == 1
    assert s["fp8_recipes"] == {
        "fp8-delta_matching": {"attn_mode": "fp8-delta_matching", "scaling": "row", "qk_rotation": "none",
                               "smooth_k": False},
        VARIANT: {"attn_mode": "fp8-delta_matching", "scaling": "tile", "qk_rotation": "hadamard",
                  "smooth_k": True}}
    report = (out / "report.md").read_text()
    assert f"| {VARIANT} | " in report
    assert (f"FP8 attention recipe of the fp8attn modes: fp8-delta_matching scaling row, qk_rotation none, "
            f"smooth_k off; {VARIANT} scaling tile, qk_rotation hadamard, smooth_k on.") in report


def test_variant_files_use_the_canonical_name_and_resume(run):
    out = run["out"]
    assert run["first"]["states"] == sorted(f"{m}.state.pt" for m in MODES)
    assert run["first"]["summary"]["complete"] is False
    assert sorted(p.name for p in out.glob(f"{VARIANT}*")) == [f"{VARIANT}.jsonl", f"{VARIANT}.pt"]
    assert not list(out.glob("*.state.pt"))
    lines = [json.loads(x) for x in (out / f"{VARIANT}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "resume"] == [2]
    # The split run of the variant equals the variant trained alone in one call (bit for bit on the CPU).
    a, b = read_log(out / f"{VARIANT}.jsonl"), read_log(run["alone"] / f"{VARIANT}.jsonl")
    assert [r["loss"] for r in a["steps"]] == [r["loss"] for r in b["steps"]]
    assert a["vals"] == b["vals"]
    ma, _ = load_checkpoint(out / f"{VARIANT}.pt")
    mb, _ = load_checkpoint(run["alone"] / f"{VARIANT}.pt")
    assert ma.cfg == mb.cfg and ma.cfg.fp8_scaling == "tile"
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
    # A resume with the global flag that a variant overrides changed is still refused, naming it.
    with pytest.raises(SystemExit, match="--resume: .*--scaling"):
        compare.run(compare.parse_args(_argv(run["text_dir"], run["data"], out, "--resume", "--scaling", "tile")))


def test_tools_find_the_variant(run):
    out = run["out"]
    assert [p.name for p in probe.find_checkpoints(out)] == [f"{m}.pt" for m in MODES]
    assert [p.name for p in probe.find_checkpoints(out, [VARIANT])] == [f"{VARIANT}.pt"]
    assert list(results.load_run(out)["logs"]) == list(MODES)


def test_init_from_a_run_dir_continues_the_variant_from_its_own_checkpoint(run):
    from fp8attn.train.trainer import init_fingerprint
    cont = run["root"] / "cont"
    compare.run(compare.parse_args(_argv(run["text_dir"], run["data"], cont, "--init-from", str(run["out"]),
                                         "--steps", "1", "--no-save", modes=("fp8-delta_matching", VARIANT))))
    for mode in ("fp8-delta_matching", VARIANT):
        log = read_log(cont / f"{mode}.jsonl")
        trained, _ = load_checkpoint(run["out"] / f"{mode}.pt")
        assert log["meta"]["init_fingerprint"] == init_fingerprint(trained), mode   # its own <mode>.pt
        assert log["meta"]["model"]["fp8_scaling"] == ("tile" if mode == VARIANT else "row")
