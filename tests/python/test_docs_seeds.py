"""The seed-spread numbers quoted in docs/results_verdict.md (and the generated
docs/results.md) are the committed aggregate docs/runs/h200-seeds-2026-11-29/seeds.json.
CPU, no training, < 1 s."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "runs" / "h200-seeds-2026-11-29"


def _table(text: str) -> dict[str, list[str]]:
    start = text.index("| mode | val s1234 | val s1235 |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_verdict_seed_table_matches_seeds_json():
    js = json.loads((RUN / "seeds.json").read_text())
    for doc in ("results_verdict.md", "results.md"):
        rows = _table((ROOT / "docs" / doc).read_text())
        assert set(rows) == set(js["modes"]), doc
        for mode, st in js["stats"].items():
            v1, v2, mean, gap, gains, rowsum = rows[mode]
            assert (v1, v2) == tuple(f"{st['vals'][s]:.4f}" for s in ("1234", "1235")), (doc, mode)
            assert mean == f"{st['mean']:.4f}" and gap == f"{st['gap_to_bf16']:+.4f}", (doc, mode)
            assert gains == " / ".join(f"{st['max_gain'][s]:.3f}" for s in ("1234", "1235")), (doc, mode)
            if mode != "bf16":
                want = " / ".join(re.sub(r"e-0(\d)", r"e-\1", f"{st['rowsum_post'][s]:.2e}") for s in ("1234", "1235"))
                assert rowsum == want, (doc, mode)


def test_verdict_peak_memory_is_the_logged_one():
    # summary.txt logs the training peak in MiB; the verdict once quoted it as "113 GB".
    summary = (RUN / "summary.txt").read_text()
    mib = re.search(r"training:.*GPU peak (\d+) MiB", summary).group(1)
    verdict = (ROOT / "docs" / "results_verdict.md").read_text()
    assert f"{int(mib):,} MiB" in verdict
    assert "113 GB" not in verdict


def test_readme_does_not_call_the_seed_study_unrun():
    readme = (ROOT / "README.md").read_text()
    assert "h200-seeds-2026-11-29" in readme and "not yet run on the H200)" not in readme
