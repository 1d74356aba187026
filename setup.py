"""Builds the fp8attn extension library `fp8attn/_C*.so`.

The library holds the C++ core (FP8 codecs, block quantization, the CPU
reference) and the PyTorch op registrations; it is loaded with
`torch.ops.load_library`, so it has no Python-version-specific entry point.

CUDA sources (csrc/hopper/*.cu, csrc/torch/*_cuda.cpp) are compiled for
sm_90a when FP8ATTN_BUILD_CUDA=1, or automatically when nvcc is present, its
CUDA major matches torch.version.cuda and a GPU is visible. FP8ATTN_BUILD_CUDA=0
forces a CPU-only build.
"""
import glob
import os
import re
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc_major():
    if CUDA_HOME is None:
        return None
    try:
        out = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _want_cuda():
    env = os.environ.get("FP8ATTN_BUILD_CUDA")
    if env:
        # NOTE: e.g. "true" must not silently build a CPU-only library.
        if env not in ("0", "1"):
            raise SystemExit(f"setup.py: environment variable FP8ATTN_BUILD_CUDA={env!r} is not one of 0, 1 "
                             "(or unset / empty: build the CUDA kernels when torch has CUDA, nvcc's major "
                             "version matches torch.version.cuda and a GPU is visible)")
        return env == "1"
    if torch.version.cuda is None or _nvcc_major() != int(torch.version.cuda.split(".")[0]):
        return False
    return torch.cuda.is_available()


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


cpu_sources = _rel(
    glob.glob(os.path.join(ROOT, "csrc/quant/*.cpp"))
    + glob.glob(os.path.join(ROOT, "csrc/reference/*.cpp"))
    + [p for p in glob.glob(os.path.join(ROOT, "csrc/torch/*.cpp")) if not p.endswith("_cuda.cpp")]
)
cuda_sources = _rel(
    glob.glob(os.path.join(ROOT, "csrc/hopper/*.cu")) + glob.glob(os.path.join(ROOT, "csrc/torch/*_cuda.cpp"))
)

build_cuda = _want_cuda()
cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
include_dirs = [os.path.join(ROOT, "csrc")]
# CUTLASS/CuTe headers for the wgmma/TMA kernels: scripts/get_cutlass.sh puts
# them in third_party/cutlass/include (ignored by git); FP8ATTN_CUTLASS_INCLUDE
# overrides. Only the CUDA build needs them.
cutlass = os.environ.get("FP8ATTN_CUTLASS_INCLUDE") or os.path.join(ROOT, "third_party/cutlass/include")
if build_cuda and not os.path.isdir(cutlass) and not os.environ.get("FP8ATTN_CUTLASS_INCLUDE"):
    # NOTE: fetch the pinned headers once (pip download from PyPI); an offline
    # machine must run scripts/get_cutlass.sh elsewhere and copy third_party/.
    subprocess.check_call(["bash", os.path.join(ROOT, "scripts/get_cutlass.sh")])
if build_cuda and not os.path.isdir(os.path.join(cutlass, "cute")):
    raise RuntimeError(f"CUTLASS/CuTe headers not found in {cutlass}: run scripts/get_cutlass.sh "
                       "or set FP8ATTN_CUTLASS_INCLUDE to a CUTLASS include/ folder")
if os.path.isdir(cutlass):
    include_dirs.append(cutlass)

if build_cuda:
    ext = CUDAExtension(
        name="fp8attn._C",
        sources=cpu_sources + cuda_sources,
        include_dirs=include_dirs,
        define_macros=[("FP8ATTN_WITH_CUDA", "1")],
        extra_compile_args={
            "cxx": cxx_flags,
            "nvcc": [
                "-O3",
                "-std=c++17",
                "-gencode=arch=compute_90a,code=sm_90a",
                "--expt-relaxed-constexpr",
                "-lineinfo",
            ],
        },
        py_limited_api=False,
    )
else:
    ext = CppExtension(
        name="fp8attn._C",
        sources=cpu_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
    )

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
