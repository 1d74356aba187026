"""Clear hardware errors (CPU tests): the CUDA path runs on compute capability
9.0 only; the decision (fp8attn._lib.device_support_error, the same text as the
C++ check in csrc/common/device_support.h) names any other GPU and what is
supported; with the capability query mocked, the Python entry points raise
RuntimeError before dispatch, and import warns once when no visible GPU
qualifies (never raises). A CPU-only build answers CUDA tensors with a
ValueError saying how to rebuild (before: torch's "Could not run ... 'CUDA'
backend"). GPU tests: test_cuda.py (this H200 passes the check, import does not
warn, the CPU-only ops name their argument on CUDA tensors).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import fp8attn
from fp8attn import _lib, ops


# ---- hardware check ----------------------------------------------------------------------

OTHER_GPUS = [("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA L40S", (8, 9)), ("NVIDIA B200", (10, 0)),
              ("NVIDIA GeForce RTX 5090", (12, 0)), ("Tesla V100-SXM2-32GB", (7, 0))]


def test_device_support_decision():
    assert _lib.device_support_error("NVIDIA H100 80GB HBM3", 0, (9, 0)) is None
    assert _lib.device_support_error("NVIDIA H200", 3, (9, 0)) is None
    for name, cap in OTHER_GPUS:
        msg = _lib.device_support_error(name, 1, cap)
        assert f"CUDA device 1 ({name}, compute capability {cap[0]}.{cap[1]}) is not supported" in msg
        assert "compute capability 9.0 (sm_90, Hopper: H100 / H200 / GH200)" in msg


@pytest.fixture
def fake_gpus(monkeypatch):
    """Mocks torch's device queries: install(list of (name, capability))."""
    def install(gpus, available=True):
        _lib._device_error.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: gpus[i][1])
    yield install
    _lib._device_error.cache_clear()


def _cuda_like(device: str, shape=(1, 2, 16, 64)):
    """Stands in for a CUDA tensor (none can be made without a GPU): what _check_cuda reads."""
    return types.SimpleNamespace(device=torch.device(device), shape=shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("name,cap", OTHER_GPUS)
def test_cuda_entry_refuses_other_gpus(fake_gpus, monkeypatch, name, cap):
    """On a GPU that is not sm_90 the Python entry points raise RuntimeError naming
    the device before dispatch (the C++ ops do the same for direct torch.ops calls):
    never a launch failure or garbage; and that ahead of the build check."""
    fake_gpus([("NVIDIA H200", (9, 0)), (name, cap)])
    monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", True)
    q = _cuda_like("cuda:1")
    with pytest.raises(RuntimeError, match=re.escape(f"CUDA device 1 ({name}, compute capability")):
        ops._check_cuda(q, q, q, "fp8", "attention")
    ops._check_cuda(_cuda_like("cuda:0"), q, q, "fp8", "attention")   # the H200 next to it is fine
    monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", False)
    with pytest.raises(RuntimeError, match="is not supported"):
        ops._check_cuda(q, q, q, "fp8", "attention")


def test_cpu_only_build_on_a_supported_gpu_says_so(fake_gpus, monkeypatch):
    fake_gpus([("NVIDIA H100 80GB HBM3", (9, 0))])
    monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", False)
    q = _cuda_like("cuda:0")
    with pytest.raises(ValueError, match="built without CUDA kernels"):
        ops._check_cuda(q, q, q, "fp8", "attention")


def test_import_warning(fake_gpus, monkeypatch):
    """A CUDA build on a machine whose visible GPUs are all unsupported: one
    DeviceSupportWarning naming each of them; none with one H100/H200 among them,
    without GPUs, for a CPU-only build, or when the query itself fails."""
    monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", True)
    fake_gpus([OTHER_GPUS[0], OTHER_GPUS[2]])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        text = _lib.warn_if_no_supported_gpu()
    assert [x.category for x in w] == [_lib.DeviceSupportWarning]
    assert str(w[0].message) == text
    assert "NVIDIA A100-SXM4-80GB, compute capability 8.0" in text and "NVIDIA B200, compute capability 10.0" in text
    assert "CPU tensors work" in text
    cases = [([OTHER_GPUS[0], ("NVIDIA H200", (9, 0))], True, True), ([], True, True),
             ([OTHER_GPUS[0]], False, True), ([OTHER_GPUS[0]], True, False)]
    for gpus, available, built in cases:
        fake_gpus(gpus, available)
        monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", built)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert _lib.warn_if_no_supported_gpu() is None
        assert not w, (gpus, available, built)

    def broken(i=0):
        raise RuntimeError("CUDA driver initialization failed")
    fake_gpus([OTHER_GPUS[0]])
    monkeypatch.setattr(_lib, "HAS_CUDA_KERNELS", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert _lib.warn_if_no_supported_gpu() is None


def test_import_without_gpu_does_not_warn():
    code = ("import warnings, sys\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import fp8attn\n"
            "sys.exit(7 if any(x.category.__name__ == 'DeviceSupportWarning' for x in w) else 0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(fp8attn.__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- a CPU-only build and CUDA tensors ---------------------------------------------------

_CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _op_calls():
    q = torch.randn(1, 1, 4, 64).bfloat16()
    lse = torch.zeros(1, 1, 4)
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    return {
        "fwd": ("q", (q, q, q, 0.125, False, "fp8", 128)),
        "bwd": ("dout", (q, q, q, q, q, lse, 0.125, False, "fp8", "delta_matching", 128, "e4m3", False)),
        "fp8_encode": ("x", (q.float(), "e4m3")),
        "fp8_decode": ("codes", (codes, "e4m3")),
        "quantize_blockwise": ("x", (q, -1, 128, "e4m3")),
        "dequantize_blockwise": ("codes", (codes, torch.ones(1, 1), -1, 128, "e4m3")),
    }


@pytest.mark.skipif(_lib.HAS_CUDA_KERNELS, reason="a CUDA build: its CUDA kernels are tested on the GPU")
@pytest.mark.parametrize("op", list(_op_calls()))
def test_cpu_only_build_answers_cuda_calls_clearly(op):
    """Every op's CUDA-key kernel in a CPU-only build (called here by redispatching
    CPU tensors to the CUDA key: what a CUDA tensor reaches) raises ValueError
    naming the op and argument, saying the library has no CUDA kernels and how to
    rebuild; before, torch's "Could not run 'fp8attn::fwd' with arguments from
    the 'CUDA' backend" NotImplementedError. cuda_kernels_built() tells the builds apart."""
    assert torch.ops.fp8attn.cuda_kernels_built() is False
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8attn::{op}", "CUDA")
    arg, args = _op_calls()[op]
    with pytest.raises(ValueError, match=rf"fp8attn\.{op}: argument '{arg}': .*built without CUDA kernels"
                                         r".*FP8ATTN_BUILD_CUDA=1 pip install --no-build-isolation"):
        getattr(torch.ops.fp8attn, op).default.redispatch(_CUDA_KEY, *args)
