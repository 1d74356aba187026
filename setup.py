"""Builds the fp8attn extension library `fp8attn/_C*.so`.

The library holds the C++ core (FP8 codecs, block quantization, the CPU
reference) and the PyTorch op registrations; it is loaded with
`torch.ops.load_library`, so it has no Python-version-specific entry point.

CUDA sources (csrc/hopper/*.cu, csrc/torch/*_cuda.cpp) are compiled for
sm_90a when FP8ATTN_BUILD_CUDA=1, or automatically when nvcc is present, its
CUDA major matches torch.version.cuda and a GPU is visible. FP8ATTN_BUILD_CUDA=0
forces a CPU-only build.

Build with `pip install --no-build-isolation .` (torch installed first): the
library must be compiled against the torch it runs with, so a build whose
torch is missing or comes from an isolated build environment stops at once.
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_support  # noqa: E402  (tools/build_support.py: linkage probe and checks)

_NO_ISOLATION = ("fp8attn is a PyTorch extension: it must be built against the torch it will run with. "
                 "Install torch first, then build without build isolation: pip install --no-build-isolation .")
try:
    import torch
except ImportError:
    # pip's isolated build env: pyproject.toml lists no torch on purpose (an isolated
    # build would take the newest torch from PyPI, not the user's, and ~3 GB with it).
    raise SystemExit(f"fp8attn: torch is not importable in this build environment. {_NO_ISOLATION}")
if build_support.isolated_build_torch(torch.__file__):
    raise SystemExit(f"fp8attn: torch {torch.__version__} was imported from an isolated build environment "
                     f"({os.path.dirname(torch.__file__)}). {_NO_ISOLATION}")
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


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
# C++20: torch >= 2.12 c10 headers need it (std::strong_ordering, std::bit_width).
cxx_flags = ["-O3", "-std=c++20", "-fvisibility=hidden"]
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
                "-std=c++20",
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


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension plus the libstdc++ linkage probe and check
    (tools/build_support.py says why): before the build, a tiny C++ library is
    linked with the same compiler and link arguments; when it does not need
    libstdc++.so.6, torch's libstdc++ is added to the link line (or the build
    stops, saying what to set); after the build, each library's DT_NEEDED must
    list libstdc++.so.6."""

    def build_extensions(self):
        probe_dir = os.path.join(self.build_temp, "fp8attn-link-probe")
        os.makedirs(probe_dir, exist_ok=True)
        for e in self.extensions:
            e.extra_link_args = list(e.extra_link_args or []) + build_support.libstdcxx_link_args(
                self.compiler, e.extra_link_args or [], e.libraries or [], e.library_dirs or [],
                workdir=probe_dir)
        super().build_extensions()
        for e in self.extensions:
            path = self.get_ext_fullpath(e.name)
            needed = build_support.check_linkage(path)
            print(f"fp8attn build: {os.path.basename(path)} DT_NEEDED: {' '.join(needed)}")


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
