"""README.md's first-run note (the newcomer commands create .venv/ and download PyTorch
with its CUDA libraries: a new user's trial found no word of it) quotes the figures
scripts/setup_env.sh measured and states, for the torch that script pins."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_first_run_note_matches_setup_env():
    readme = (ROOT / "README.md").read_text()
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    section = readme[readme.index("## Newcomer commands"):readme.index("```bash")]
    pin = re.search(r'FP8ATTN_TORCH:-torch==(\d+\.\d+)\.\*', setup).group(1)
    assert f"PyTorch {pin}" in section
    assert "downloads about 3 GB" in section and "~5 GB on disk" in section and "few minutes" in section
    assert "a ~3 GB download, ~5 GB on disk" in setup     # the message the set-up prints
    assert "100 s" in section and "100 s" in setup       # the measured set-up time, quoted from there
