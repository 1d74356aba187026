"""Loads the compiled extension library (`_C*.so`) that registers torch.ops.fp8attn."""
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load() -> str:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not candidates:
        raise ImportError(
            "fp8attn: compiled library _C*.so not found next to the package; "
            "build it with `pip install --no-build-isolation .` (scripts/setup_env.sh)"
        )
    torch.ops.load_library(candidates[0])
    return candidates[0]


LIBRARY_PATH = _load()
HAS_CUDA_KERNELS = hasattr(torch.ops.fp8attn, "fwd") and torch._C._dispatch_has_kernel_for_dispatch_key(
    "fp8attn::fwd", "CUDA"
)
