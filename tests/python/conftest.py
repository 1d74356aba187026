"""Shared pytest fixtures for the fp8attn Python tests."""
import glob
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

# Use the source tree's package when it holds a built library (in-place build,
# `setup.py build_ext --inplace`); otherwise the installed package (pip install .).
# FP8ATTN_SOURCE_TREE=0 keeps the package found on sys.path (PYTHONPATH), e.g. in
# the latest-torch job of scripts/run_tests.sh, whose library is built against
# another torch than an in-place one (benchmarks/bench_{gpu,train}.py follow it too).
_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")
if (os.environ.get("FP8ATTN_SOURCE_TREE", "1") != "0" and glob.glob(os.path.join(_PY, "fp8attn", "_C*.so"))
        and _PY not in sys.path):
    sys.path.insert(0, _PY)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (reproducible random inputs)."""
    torch.manual_seed(20240601)
    yield


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """A directory of real (human-written) text files, >= 100 kB, with no network:
    Debian's license texts, else a few Python stdlib modules (training tests)."""
    out = tmp_path_factory.mktemp("texts")
    lic = Path("/usr/share/common-licenses")
    srcs = sorted(p for p in lic.glob("*") if p.is_file()) if lic.is_dir() else []
    if sum(p.stat().st_size for p in srcs) < 100_000:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        srcs = [stdlib / n for n in ("argparse.py", "typing.py", "dataclasses.py", "inspect.py",
                                     "textwrap.py", "random.py", "statistics.py")]
    for p in srcs:
        shutil.copy(p, out / p.name)
    return out
