"""Static checks over the repository's Python (package, tests, benchmarks, scripts) with
ruff's pyflakes rules for faults that only show when a line runs: undefined names (F821),
a name used before a local binding of it (F823: `import torch.x` inside a function makes
`torch` local to all of it), undefined __all__ entries (F822), redefinitions that shadow
(F811), `is` against literals (F632), repeated dict keys (F601), always-true asserts
(F631), return/yield outside functions (F704, F706), misplaced except (F707) and syntax
errors (E9). The rule that caught the fault of 2026-12-07 (ddp.init_from_env raising
UnboundLocalError on every CUDA run, while the CPU path passed) is F823;
test_rules_catch_the_fault_they_guard_against shows it is caught.
ruff is installed by scripts/setup_env.sh; the tests skip where it is not installed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = "F821,F822,F823,F811,F632,F601,F631,F704,F706,F707,E9"
TREES = ("python", "tests", "benchmarks", "scripts")


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (scripts/setup_env.sh installs it)")
    return [exe, "check", "--no-cache", "--isolated", "--select", RULES, "--output-format", "concise"]


def test_repository_python_has_no_pyflakes_faults():
    trees = [str(ROOT / t) for t in TREES if (ROOT / t).is_dir()]
    r = subprocess.run(_ruff() + trees, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff --select {RULES}:\n{r.stdout}{r.stderr}"


def test_rules_catch_the_fault_they_guard_against(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n\n\n"
        "def init(device):\n"
        "    cuda = device == 'auto' and torch.cuda.is_available()\n"
        "    import torch.distributed.nn.functional  # noqa: F401\n"
        "    return cuda\n\n\n"
        "def other():\n"
        "    return undefined_name\n"
    )
    r = subprocess.run(_ruff() + [str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "F823" in r.stdout and "F821" in r.stdout, r.stdout
