"""Every ratio range "a-bx" in the prose of a docs/benchmarks.md run section is
either the min / max of the "(x)" ratios of that section's table (the rows and
column the sentence names: CLAIMS), or listed in NOT_TABLE_RANGES with what it
refers to instead (another run, the end-to-end table). The backward ranges the
README status quotes for a dated run are that run's. Where a run's raw
bench_gpu.json is kept (docs/benchmarks/<run>/bench_gpu.json) its table is the
JSON's; a section without one says so. CPU, < 1 s."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
RAW = ROOT / "docs" / "benchmarks"

FWD = ("fp8 fwd",)
BWD = ("fp8 bwd stale", "fp8 bwd matched_do", "fp8 bwd DM")


def _all(row):
    return True


def _d(*dims):
    return lambda row: row["d"] in dims


def _seq(s):
    return lambda row: row["S"] == s


# (prose pattern with (lo)-(hi) group pairs, [(columns, row filter) per pair])
CLAIMS = [
    (r"Backward Delta-Matching\s+([\d.]+)-([\d.]+)x", [(("fp8 bwd DM",), _all)]),
    (r"\(stale ([\d.]+)-([\d.]+)x\)", [(("fp8 bwd stale",), _all)]),
    (r";\s+forward (?:unchanged \()?([\d.]+)-([\d.]+)x", [(FWD, _all)]),
    (r"cuDNN FP8 ([\d.]+)-([\d.]+)x / ([\d.]+)-([\d.]+)x", [(("cuDNN fp8 fwd",), _all), (("cuDNN fp8 bwd",), _all)]),
    (r"cuDNN FP8 ([\d.]+)-([\d.]+)x\s+forward, ([\d.]+)-([\d.]+)x\s+backward",
     [(("cuDNN fp8 fwd",), _all), (("cuDNN fp8 bwd",), _all)]),
    (r"reaches\s+([\d.]+)-([\d.]+)x\s+cuDNN BF16\s+forward\s+and\s+([\d.]+)-([\d.]+)x\s+backward",
     [(("cuDNN fp8 fwd",), _all), (("cuDNN fp8 bwd",), _all)]),
    (r"forward [\d.]+-[\d.]+x \(([\d.]+)-([\d.]+)x at 1024 tokens", [(FWD, _seq(1024))]),
    (r"d = 256 delta_matching ([\d.]+)-([\d.]+)x", [(("fp8 bwd DM",), _d(256))]),
    (r"the one piece below it \(([\d.]+)-([\d.]+)x\)", [(FWD, _d(256))]),
    (r"forward [\d.]+x, backward ([\d.]+)-([\d.]+)x\)", [(BWD, _d(256))]),
    (r"the forward reaches ([\d.]+)-([\d.]+)x here", [(FWD, _d(64, 128))]),
    (r"the delta_matching backward ([\d.]+)-([\d.]+)x", [(("fp8 bwd DM",), _d(64, 128))]),
    (r"the forward is at ([\d.]+)-([\d.]+)x cuDNN BF16", [(FWD, _all)]),
    (r"the backward at ([\d.]+)-([\d.]+)x", [(BWD, _all)]),
    # the `tile` tables (merged into the rows by bench_rows)
    (r"tile DM backward as called is at ([\d.]+)-([\d.]+)x", [(("tile DM bwd (op)",), _all)]),
    (r"its kernels alone at ([\d.]+)-([\d.]+)x", [(("tile DM kernels only",), _all)]),
    (r"training step \(tile forward \+ DM backward\) at ([\d.]+)-([\d.]+)x",
     [(("tile step fwd+bwd vs cuDNN",), _all)]),
    (r"tile\s+forward is unchanged: the op at ([\d.]+)-([\d.]+)x", [(("fp8 tile fwd (op)",), _all)]),
    (r"its kernel alone at ([\d.]+)-([\d.]+)x", [(("tile fwd kernel only",), _all)]),
]

# (section date, range) -> what the range refers to, if not this section's table.
NOT_TABLE_RANGES = {
    ("2026-12-04 19:18", "0.48-0.54x"): "the v4 tile DM backward (op) of the 2026-12-04 04:07 run",
    ("2026-12-04 04:07", "0.46-0.55x"): "the v2 tile DM backward (op) in the 2026-12-02 07:06 run",
    ("2026-12-04 04:07", "0.48-0.76x"): "the v2 tile DM kernels alone in the 2026-12-02 07:06 run",
    ("2026-12-02 18:09", "0.40-0.50x"): "the section's `tile` backward table (tile DM bwd (op) column)",
    ("2026-12-02 18:09", "0.82-1.28x"): "the section's `tile` forward table (tile fwd (op) column)",
    ("2026-11-30 02:24", "0.82-1.37x"): "bench_train single timings of earlier sections (end-to-end)",
    ("2026-11-30 01:05", "0.82-1.00x"): "gpu-50m attention-core end-to-end in the 2026-11-29 calls",
    ("2026-11-29 22:16", "0.42-0.54x"): "fp8attn forward / cuDNN FP8 forward (ratio of two columns)",
    ("2026-11-29 22:16", "0.38-0.43x"): "fp8attn DM backward / cuDNN FP8 backward (ratio of two columns)",
    ("2026-11-29 18:18", "0.31-0.47x"): "the 16:08 run's Delta-Matching backward (checked there)",
    ("2026-11-29 16:08", "0.14-0.15x"): "the d = 256 backward before this run",
    ("2026-11-29 16:08", "0.24-0.35x"): "end-to-end linear scopes before the fused quantizers",
    ("2026-11-29 16:08", "0.48-0.72x"): "end-to-end linear scopes (the bench_train table)",
}

RANGE = re.compile(r"(\d+\.\d+)-(\d+\.\d+)x")


def sections(text: str):
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return [(p.splitlines()[0], p) for p in parts]


def bench_rows(sec: str) -> list[dict]:
    """The rows of the section's bench_gpu tables: the main one (with "fp8 bwd DM"), merged
    per (shape, causal) with every later table of the same rows (the `tile` forward and
    backward tables): {"S": seqlen, "d": head_dim, "causal": str, column: ratio or None}.
    A cell's ratio is "(r x)" or a bare "r x" (the step column)."""
    lines = sec.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("|") and "fp8 bwd DM" in ln:
            break
    else:
        return []
    rows: dict[tuple, dict] = {}
    while i < len(lines):
        if not (lines[i].startswith("| B x H x S") and i + 1 < len(lines) and lines[i + 1].startswith("|---")):
            i += 1
            continue
        head = [c.strip() for c in lines[i].strip("|").split("|")]
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            cells = [c.strip() for c in lines[i].strip("|").split("|")]
            i += 1
            m = re.match(r"(\d+)x(\d+)x(\d+), (\d+)", cells[0])
            if not m:
                continue
            row = rows.setdefault((cells[0], cells[1]), {"S": int(m.group(3)), "d": int(m.group(4)),
                                                           "causal": cells[1], "cells": {}})
            row["cells"].update(zip(head, cells))
            for h, c in zip(head[2:], cells[2:]):
                r = re.search(r"\(([\d.]+)x\)", c) or re.fullmatch(r"([\d.]+)x", c)
                row.setdefault(h, float(r.group(1)) if r else None)
    return list(rows.values())


def table_ratios(sec: str) -> dict[str, list[float]]:
    cols: dict[str, list[float]] = {}
    for row in bench_rows(sec):
        for h, v in row.items():
            if isinstance(v, float):
                cols.setdefault(h, []).append(v)
    return cols


def prose_of(sec: str) -> str:
    return " ".join(ln for ln in sec.splitlines() if not ln.startswith("|"))


def checked():
    """(section, claim text, quoted (lo, hi), the table's ratios it must span)."""
    out = []
    for title, sec in sections(DOC.read_text()):
        rows = bench_rows(sec)
        if not rows:
            continue
        prose = prose_of(sec)
        for pat, groups in CLAIMS:
            for m in re.finditer(pat, prose):
                for n, (cols, keep) in enumerate(groups):
                    vals = [r[c] for r in rows if keep(r) for c in cols if r.get(c) is not None]
                    claim = (float(m.group(2 * n + 1)), float(m.group(2 * n + 2)))
                    out.append((title[:16], m.group(0), claim, vals))
    return out


def all_ranges():
    """(section date, range text) of every "a-bx" in the prose of a section with a table."""
    out = []
    for title, sec in sections(DOC.read_text()):
        if bench_rows(sec):
            out += [(title[:16], m.group(0)) for m in RANGE.finditer(prose_of(sec))]
    return out


def test_some_claims_are_checked():
    assert len(checked()) >= 30


@pytest.mark.parametrize("title,text,claim,ratios", checked(), ids=lambda x: str(x)[:30])
def test_quoted_range_is_the_tables_range(title, text, claim, ratios):
    assert ratios, (title, text, "no table values for this claim")
    assert claim == (min(ratios), max(ratios)), (title, text, claim, min(ratios), max(ratios))


def test_every_prose_range_is_checked_or_explained():
    claimed = set()
    for title, text, _, _ in checked():
        claimed |= {(title, m.group(0)) for m in RANGE.finditer(text)}
    loose = [r for r in all_ranges() if r not in claimed and r not in NOT_TABLE_RANGES]
    assert not loose, f"ranges neither checked against their table (CLAIMS) nor explained (NOT_TABLE_RANGES): {loose}"
    stale = [k for k in NOT_TABLE_RANGES if k not in all_ranges()]
    assert not stale, f"NOT_TABLE_RANGES entries no longer in the doc: {stale}"


def test_claim_check_catches_the_01_05_contradiction():
    # The case issue #16 item 8 found: "cuDNN FP8 1.15-1.56x" over a column whose
    # minimum is 0.98x (16x16x1024 causal). The check must see that text as wrong.
    sec = dict(sections(DOC.read_text()))
    title = next(t for t in sec if t.startswith("2026-11-30 01:05"))
    bad = sec[title].replace("cuDNN FP8 0.98-1.56x", "cuDNN FP8 1.15-1.56x")
    assert bad != sec[title]
    fwd = [r["cuDNN fp8 fwd"] for r in bench_rows(bad) if r["cuDNN fp8 fwd"] is not None]
    m = re.search(CLAIMS[3][0], prose_of(bad))
    assert (float(m.group(1)), float(m.group(2))) != (min(fwd), max(fwd)) and min(fwd) == 0.98


# ---- raw JSON --------------------------------------------------------------------


def _run_dir(title: str) -> Path:
    """docs/benchmarks/<YYYY-MM-DD>T<HHMM>/ for a section titled "YYYY-MM-DD HH:MM UTC: ..."."""
    m = re.match(r"(\d{4}-\d\d-\d\d) (\d\d):(\d\d) UTC", title)
    return RAW / f"{m.group(1)}T{m.group(2)}{m.group(3)}" if m else RAW / "none"


def test_each_table_has_its_raw_json_or_says_it_has_none():
    for title, sec in sections(DOC.read_text()):
        if not bench_rows(sec):
            continue
        raw = _run_dir(title) / "bench_gpu.json"
        if not raw.exists():
            assert "Raw JSON: not kept" in sec, f"{title[:40]}: no {raw.relative_to(ROOT)} and no 'Raw JSON: not kept'"


# Columns bench_gpu.py printed once and no longer does (the older tables keep them):
# "fp8 fwd mma" (FP8ATTN_FWD_KERNEL=mma; the mma.sync forward was removed on 2026-12-07).
RETIRED_COLUMNS = ("fp8 fwd mma",)


def _data_rows_without_retired_columns(sec: str) -> list[str]:
    """The "| <B>x..." table rows of a section, each without the cells of RETIRED_COLUMNS
    (found by the header of the table the row belongs to)."""
    out, drop = [], []
    for ln in sec.splitlines():
        if not ln.startswith("|") or ln.startswith("|---"):
            continue
        cells = ln.strip()[1:-1].split("|")
        if not re.match(r"\| \d+x", ln):  # a header
            names = [c.strip() for c in cells]
            drop = sorted((names.index(c) for c in RETIRED_COLUMNS if c in names), reverse=True)
            continue
        for i in drop:
            del cells[i]
        out.append("|" + "|".join(cells) + "|")
    return out


def test_tables_with_raw_json_match_it():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    for title, sec in sections(DOC.read_text()):
        raw = _run_dir(title) / "bench_gpu.json"
        if not bench_rows(sec) or not raw.exists():
            continue
        data = json.loads(raw.read_text())
        md = bench_gpu.markdown(data["rows"], data["env"])
        want = [ln for ln in md.splitlines() if ln.startswith("|") and re.match(r"\| \d+x", ln)]
        got = _data_rows_without_retired_columns(sec)
        for ln in want:
            assert ln in got, f"{title[:40]}: table row from {raw.name} not in the doc: {ln}"


def test_readme_backward_ranges_are_the_cited_runs():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"delta_matching ([\d.]+)-([\d.]+)x cuDNN BF16, stale ([\d.]+)-([\d.]+)x "
                  r"\((\d{4}-\d\d-\d\d \d\d:\d\d)\)", readme)
    assert m, "README status: backward ranges with the run's date"
    secs = [sec for title, sec in sections(DOC.read_text()) if title.startswith(m.group(5) + " UTC")]
    assert len(secs) == 1, m.group(5)
    cols = table_ratios(secs[0])
    for lo, hi, col in ((1, 2, "fp8 bwd DM"), (3, 4, "fp8 bwd stale")):
        claim = (float(m.group(lo)), float(m.group(hi)))
        assert claim == (min(cols[col]), max(cols[col])), (col, claim)


def test_softcap_run_cudnn_drift_is_the_raw_jsons():
    """The 09:22 softcap section compares its cuDNN BF16 baseline with the 00:56 run's
    (same shapes, same H100 image): the quoted percentage ranges are those of the two raw
    JSONs, row by row (forward and backward separately). It once said "3 to 16%" where the
    forward ratios run 3-22% (the 16x16x1024 causal row was left out)."""
    secs = [sec for title, sec in sections(DOC.read_text()) if title.startswith("2026-12-07 09:22 UTC")]
    assert len(secs) == 1
    m = re.search(r"cuDNN BF16 ran (\d+) to (\d+)% faster forward\s+and (\d+) to (\d+)% backward\s+in this process",
                  secs[0])
    assert m, "09:22 section: the cuDNN BF16 drift against 00:56, forward and backward"
    old = json.loads((RAW / "2026-12-07T0056" / "bench_gpu.json").read_text())["rows"]
    new = json.loads((RAW / "2026-12-07T0922" / "bench_gpu.json").read_text())["rows"]
    key = lambda r: (r["B"], r["H"], r["S"], r["d"], r["causal"])  # noqa: E731
    by_old = {key(r): r for r in old}
    for lo, hi, col in ((1, 2, "cudnn_fwd"), (3, 4, "cudnn_bwd")):
        pct = [round(100 * (r[col] / by_old[key(r)][col] - 1)) for r in new]
        assert (int(m.group(lo)), int(m.group(hi))) == (min(pct), max(pct)), (col, pct)
