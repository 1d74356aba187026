"""The interpreter of the shell scripts: one variable, PYTHON (default python3), for every
Python step of the device scripts (scripts/device_common.sh sets it; a new user's trial:
seeds_study.sh ran `python3` from PATH with no way to pick another interpreter, as did the
other device scripts), setup_env.sh (the venv's base) and get_cutlass.sh (pip).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
DEVICE_SCRIPTS = sorted(p for p in SCRIPTS.glob("*.sh")
                        if re.search(r"^source .*/device_common\.sh", p.read_text(), re.M))
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash")


def _code_lines(path: Path):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.lstrip().startswith("#"):
            yield i, line


def test_the_device_scripts_are_the_expected_ones():
    names = {p.name for p in DEVICE_SCRIPTS}
    assert {"seeds_study.sh", "results_study.sh", "device_all.sh", "device_ab.sh"} <= names, names


@pytest.mark.parametrize("script", [p.name for p in DEVICE_SCRIPTS] + ["device_common.sh", "get_cutlass.sh"])
def test_no_python3_or_torchrun_from_path(script):
    """Every Python step goes through "$PYTHON" (torchrun as `"$PYTHON" -m torch.distributed.run`)."""
    bad = [f"{script}:{i}: {line.strip()}" for i, line in _code_lines(SCRIPTS / script)
           if re.search(r"(?<![\w/.$-])(python3|torchrun)(?=\s)", line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("script", [p.name for p in DEVICE_SCRIPTS])
def test_device_scripts_source_the_common_setup_before_any_python_step(script):
    lines = list(_code_lines(SCRIPTS / script))
    src = next(i for i, line in lines if "device_common.sh" in line and "source" in line)
    first = min((i for i, line in lines if "$PYTHON" in line), default=None)
    assert first is None or first > src


def test_python_header_docs():
    for name in ("seeds_study.sh", "device_common.sh", "device_all.sh", "results_study.sh", "setup_env.sh",
                 "get_cutlass.sh"):
        header = "".join(line for line in (SCRIPTS / name).read_text().splitlines(True)[:110] if line.startswith("#"))
        assert "PYTHON" in header and "python3" in header, name


def _bash(cmd: str, tmp_path: Path, **env):
    e = {**os.environ, "OUT": str(tmp_path / "out"), **env}
    return subprocess.run([BASH, "-c", f"source scripts/device_common.sh && {cmd}"], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120)


def test_device_common_uses_and_exports_python(tmp_path):
    r = _bash("device_setup x && torch_versions && bash -c 'echo child=$PYTHON'", tmp_path,
              PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    assert f"python {sys.version.split()[0]} torch" in r.stdout
    assert f"child={sys.executable}" in r.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    r = subprocess.run([BASH, "-c", "source scripts/device_common.sh && echo default=$PYTHON"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert "default=python3" in r.stdout, r.stdout + r.stderr


def test_a_missing_interpreter_is_named(tmp_path):
    r = _bash("echo not reached", tmp_path, PYTHON=str(tmp_path / "nope"))
    assert r.returncode == 2 and "not reached" not in r.stdout
    assert f"PYTHON={tmp_path / 'nope'}: no such interpreter" in r.stderr


@pytest.mark.slow
def test_seeds_study_runs_every_python_step_with_python(tmp_path):
    """The CPU trial of seeds_study.sh end to end (~20 s on 2 cores) with a python3 on PATH
    that fails and records its calls, and PYTHON a wrapper of this interpreter."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python3", "python", "torchrun"):
        (fake / name).write_text(f"#!/bin/sh\necho \"{name} $*\" >> {calls}\nexit 1\n")
        (fake / name).chmod(0o755)
    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/sh\necho \"PYTHON\" >> {calls}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": str(wrapper),
           "OUT": str(tmp_path / "out"), "SEEDS_DIR": str(tmp_path / "study"), "SEEDS_TOTAL_S": "90",
           "SEEDS_STEPS": "4", "SEEDS_MODES": "bf16", "SEEDS_SEEDS": "1",
           "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([BASH, "scripts/seeds_study.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = calls.read_text().split("\n")
    assert "PYTHON" in seen and not any(s.startswith(("python", "torchrun")) for s in seen), seen
    assert (tmp_path / "out" / "seeds.md").is_file()
