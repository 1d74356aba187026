"""The ratio ranges quoted in the prose of each docs/benchmarks.md run section
("Backward Delta-Matching a-bx cuDNN BF16 (stale c-dx); forward e-fx"), and the
backward ranges the README status quotes for a dated run, are the min / max of
the "(x)" ratios of that run's table. CPU, < 1 s."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"

# prose pattern -> table column whose "(x)" ratios it summarizes
CLAIMS = {
    r"Backward Delta-Matching\s+([\d.]+)-([\d.]+)x": "fp8 bwd DM",
    r"\(stale ([\d.]+)-([\d.]+)x\)": "fp8 bwd stale",
    r";\s+forward (?:unchanged \()?([\d.]+)-([\d.]+)x": "fp8 fwd",
}


def sections(text: str):
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return [(p.splitlines()[0], p) for p in parts]


def table_ratios(sec: str) -> dict[str, list[float]]:
    lines = [ln for ln in sec.splitlines() if ln.startswith("|")]
    if not lines or "fp8 bwd DM" not in lines[0]:
        return {}
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cols = {h: [] for h in head}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for h, c in zip(head, cells):
            m = re.search(r"\(([\d.]+)x\)", c)
            if m:
                cols[h].append(float(m.group(1)))
    return cols


def checked():
    out = []
    for title, sec in sections(DOC.read_text()):
        cols = table_ratios(sec)
        prose = sec.split("\n|", 1)[0].replace("\n", " ")
        for pat, col in CLAIMS.items():
            m = re.search(pat, prose)
            if m and cols.get(col):
                out.append((title[:40], col, (float(m.group(1)), float(m.group(2))), cols[col]))
    return out


def test_some_claims_are_checked():
    assert len(checked()) >= 3


@pytest.mark.parametrize("title,col,claim,ratios", checked(), ids=lambda x: str(x)[:30])
def test_quoted_range_is_the_tables_range(title, col, claim, ratios):
    assert claim == (min(ratios), max(ratios)), (title, col, claim, min(ratios), max(ratios))


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
