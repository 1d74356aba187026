"""Loads the compiled extension library (`_C*.so`) that registers torch.ops.fp8attn,
and the hardware check of the CUDA path.

HAS_CUDA_KERNELS: the library holds the sm_90a CUDA kernels (a CPU-only build
registers CUDA-key kernels that raise ValueError saying how to rebuild).

The CUDA kernels run on compute capability 9.0 only (sm_90a: Hopper H100 /
H200 / GH200). device_support_error is the pure decision (tested on the CPU);
check_cuda_device raises RuntimeError with it before the ops.py entry points
dispatch, and the C++ ops do the same check at their entry
(csrc/torch/device_check.h) for direct torch.ops.fp8attn calls. At import, a
CUDA build on a machine whose visible GPUs are all unsupported warns once
(DeviceSupportWarning naming each device); it never raises (CPU use works).
"""
import functools
import glob
import os
import warnings
from typing import Optional, Tuple

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORTED_CAPABILITY = (9, 0)


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
if hasattr(torch.ops.fp8attn, "cuda_kernels_built"):
    HAS_CUDA_KERNELS = bool(torch.ops.fp8attn.cuda_kernels_built())
else:  # NOTE: a library built before cuda_kernels_built existed
    HAS_CUDA_KERNELS = hasattr(torch.ops.fp8attn, "fwd") and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fp8attn::fwd", "CUDA")


class DeviceSupportWarning(UserWarning):
    """fp8attn's CUDA kernels cannot run on any visible GPU (warned at import)."""


def device_support_error(name: str, index: int, capability: Tuple[int, int]) -> Optional[str]:
    """None when CUDA device `index` (`name`, compute capability `capability` as
    (major, minor)) runs fp8attn's kernels, else the error message naming it and
    what is supported. Same text as the C++ check (csrc/common/device_support.h)."""
    major, minor = capability
    if (major, minor) == SUPPORTED_CAPABILITY:
        return None
    return (f"fp8attn: CUDA device {index} ({name}, compute capability {major}.{minor}) is not supported: "
            "the CUDA kernels need compute capability 9.0 (sm_90, Hopper: H100 / H200 / GH200); "
            "use CPU tensors for the CPU reference")


@functools.lru_cache(maxsize=None)
def _device_error(index: int) -> Optional[str]:
    return device_support_error(torch.cuda.get_device_name(index), index,
                                tuple(torch.cuda.get_device_capability(index)))


def check_cuda_device(device: torch.device) -> None:
    """Raises RuntimeError (device_support_error's message) if the CUDA `device`
    cannot run the kernels. Cached per device index. Skipped while torch.compile
    traces (the C++ op checks the device again when the graph runs)."""
    if torch.compiler.is_compiling():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    msg = _device_error(index)
    if msg is not None:
        raise RuntimeError(msg)


def warn_if_no_supported_gpu() -> Optional[str]:
    """With a CUDA build and visible GPUs none of which is compute capability 9.0:
    one DeviceSupportWarning naming them; returns its text (else None). Never
    raises: a failing device query only skips the warning.
    NOTE: reading the capabilities initializes torch's CUDA state (as any CUDA
    call would); a CPU-only build or a machine without GPUs does not touch it."""
    if not HAS_CUDA_KERNELS:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        errors = [_device_error(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001  (a broken driver shows at the first CUDA call instead)
        return None
    if not errors or any(e is None for e in errors):
        return None
    text = ("fp8attn: no visible GPU can run this build's CUDA kernels (calls on CUDA tensors will raise "
            "RuntimeError; CPU tensors work): " + "; ".join(e.split(": ", 1)[1] for e in errors))
    warnings.warn(text, DeviceSupportWarning, stacklevel=3)
    return text


warn_if_no_supported_gpu()
