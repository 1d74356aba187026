"""No silent fallbacks (CPU tests): every FP8ATTN_* environment knob with a bad
value is an error naming it and the accepted values (before: FP8ATTN_FUSED_QUANT,
FP8ATTN_DIST and FP8ATTN_BUILD_CUDA took any value, a misspelt one meaning the
default), and every knob the sources read is in the table of
docs/architecture.md. The C++ knobs (FP8ATTN_FWD_KERNEL, the FP8ATTN_TILE_* ones)
are parsed by csrc/common/env_choice.h (C++ unit tests in tests/cpp/test_env_choice.cpp;
GPU tests in test_cuda.py / test_tile_cuda*.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8attn import _env

ROOT = Path(__file__).resolve().parents[2]


# ---- the parsing -------------------------------------------------------------------------


def test_choice_and_flag(monkeypatch):
    monkeypatch.delenv("FP8ATTN_TEST_KNOB", raising=False)
    assert _env.choice("FP8ATTN_TEST_KNOB", ("a", "b"), "a") == "a"
    assert _env.flag("FP8ATTN_TEST_KNOB", True) is True and _env.flag("FP8ATTN_TEST_KNOB", False) is False
    monkeypatch.setenv("FP8ATTN_TEST_KNOB", "")
    assert _env.choice("FP8ATTN_TEST_KNOB", ("a", "b"), "b") == "b"
    monkeypatch.setenv("FP8ATTN_TEST_KNOB", "b")
    assert _env.choice("FP8ATTN_TEST_KNOB", ("a", "b"), "a") == "b"
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv("FP8ATTN_TEST_KNOB", value)
        assert _env.flag("FP8ATTN_TEST_KNOB", not want) is want
    for bad in ("true", "yes", "off", " 1", "01", "2"):
        monkeypatch.setenv("FP8ATTN_TEST_KNOB", bad)
        with pytest.raises(ValueError, match=rf"FP8ATTN_TEST_KNOB={re.escape(repr(bad))} is not one of 0, 1"):
            _env.flag("FP8ATTN_TEST_KNOB", True)


# ---- the Python-side knobs ---------------------------------------------------------------


def test_fused_quant_knob(monkeypatch):
    """FP8ATTN_FUSED_QUANT: 0 / 1 / unset; anything else fails at the first
    quantization (before: any value but "0" silently meant on), also on the CPU."""
    import fp8attn.linear as L

    x = torch.randn(3, 256)
    monkeypatch.setattr(L, "FUSED_QUANT", None)       # the default: the environment decides
    ref = L.quantize_1x128(x)
    for ok in ("0", "1", ""):
        monkeypatch.setenv("FP8ATTN_FUSED_QUANT", ok)
        got = L.quantize_1x128(x)
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
    monkeypatch.setenv("FP8ATTN_FUSED_QUANT", "off")
    with pytest.raises(ValueError, match="FP8ATTN_FUSED_QUANT='off' is not one of 0, 1"):
        L.quantize_1x128(x)
    with pytest.raises(ValueError, match="FP8ATTN_FUSED_QUANT"):
        L.fp8_linear(x, torch.randn(128, 256), backend="emulated")
    monkeypatch.setattr(L, "FUSED_QUANT", False)      # an explicit override does not read it
    L.quantize_1x128(x)


def test_dist_knob(monkeypatch):
    from fp8attn.train import ddp

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for ok in ("0", ""):
        monkeypatch.setenv("FP8ATTN_DIST", ok)
        assert ddp.init_from_env("cpu") == ddp.DistContext()
    monkeypatch.setenv("FP8ATTN_DIST", "yes")
    with pytest.raises(ValueError, match="FP8ATTN_DIST='yes' is not one of 0, 1"):
        ddp.init_from_env("cpu")


def test_text_dir_knob_names_the_variable(monkeypatch, tmp_path):
    from fp8attn.train import data

    monkeypatch.setenv("FP8ATTN_TEXT_DIR", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="environment variable FP8ATTN_TEXT_DIR: .*missing is not a directory"):
        data.prepare(tmp_path / "data")


def test_build_cuda_knob():
    """setup.py stops at once for FP8ATTN_BUILD_CUDA other than 0, 1 or empty
    (before: "true" or "yes" silently built a CPU-only library)."""
    env = dict(os.environ, FP8ATTN_BUILD_CUDA="true")
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "FP8ATTN_BUILD_CUDA='true' is not one of 0, 1" in proc.stderr, proc.stderr[-2000:]


# ---- every knob is documented ------------------------------------------------------------

_READ = [
    re.compile(r'getenv\("(FP8ATTN_[A-Z0-9_]+)"\)'),                                   # C++
    re.compile(r'env_choice\("(FP8ATTN_[A-Z0-9_]+)"'),                                 # C++ (env_choice.h)
    re.compile(r'environ(?:\.get\(|\[)"(FP8ATTN_[A-Z0-9_]+)"'),                        # Python
    re.compile(r'_env\.(?:flag|choice)\("(FP8ATTN_[A-Z0-9_]+)"'),                      # Python (_env.py)
    re.compile(r'\$\{(FP8ATTN_[A-Z0-9_]+)[:}-]'),                                      # shell
]


def knobs_in_sources() -> set:
    names = set()
    files = [ROOT / "setup.py"] + [p for d in ("csrc", "python", "scripts") for p in (ROOT / d).rglob("*")
                                   if p.suffix in (".cu", ".cuh", ".h", ".cpp", ".py", ".sh")]
    for p in files:
        text = p.read_text(errors="replace")
        for rx in _READ:
            names.update(rx.findall(text))
    return names


def test_every_knob_is_in_the_architecture_table():
    found = knobs_in_sources()
    # The scan sees the knobs this change is about (it would pass vacuously otherwise).
    assert {"FP8ATTN_FWD_KERNEL", "FP8ATTN_TILE_PINGPONG", "FP8ATTN_FUSED_QUANT", "FP8ATTN_DIST",
            "FP8ATTN_BUILD_CUDA"} <= found, found
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Environment variables"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| ")]
    table = {m for cell in first_cells for m in re.findall(r"`(FP8ATTN_[A-Z0-9_]+)`", cell)}
    assert found <= table, f"not in docs/architecture.md's table: {sorted(found - table)}"
