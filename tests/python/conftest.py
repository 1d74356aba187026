"""Shared pytest fixtures for the fp8attn Python tests."""
import os
import sys

import pytest
import torch

# Allow running from a source checkout without installing (PYTHONPATH=python also works).
_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (reproducible random inputs)."""
    torch.manual_seed(20240601)
    yield
