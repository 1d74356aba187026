"""Shared pytest fixtures for the fp8attn Python tests."""
import glob
import os
import sys

import pytest
import torch

# Use the source tree's package when it holds a built library (in-place build,
# `setup.py build_ext --inplace`); otherwise the installed package (pip install .).
_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")
if glob.glob(os.path.join(_PY, "fp8attn", "_C*.so")) and _PY not in sys.path:
    sys.path.insert(0, _PY)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (reproducible random inputs)."""
    torch.manual_seed(20240601)
    yield
