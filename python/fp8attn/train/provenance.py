"""Where a result came from: the exact command, software versions, machine, git commit.

`collect()` is stored in compare's summary.json and in the probe's probe.json;
fp8attn.train.results prints it next to every table.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


def _git_commit() -> str | None:
    """HEAD of the repository this package lives in (suffix '+dirty' with local edits), or
    env FP8ATTN_GIT_COMMIT (a copied tree without .git, e.g. the device machine)."""
    env = os.environ.get("FP8ATTN_GIT_COMMIT")
    if env:
        return env
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def module_command(module: str, argv: list[str] | None) -> str:
    """`python -m <module> <argv>` for a CLI entry point called as main(argv) (argv None = sys.argv[1:])."""
    return shlex.join(["python", "-m", module] + list(sys.argv[1:] if argv is None else argv))


def command_line() -> str:
    """The command that started this process, as `python -m <module> args...` when run with -m."""
    argv = list(sys.argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return shlex.join(["python", "-m", name] + argv[1:])
    return shlex.join(["python"] + argv)


def collect(command: str | None = None) -> dict:
    """command (default: this process's command line) and {time_utc, host, python, torch, cuda, cudnn, gpu, fp8attn_cuda_kernels, git_commit}."""
    import torch

    gpu = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    try:
        from fp8attn import _lib
        cuda_kernels = bool(_lib.HAS_CUDA_KERNELS)
    except Exception:  # noqa: BLE001 - provenance must never fail the run
        cuda_kernels = None
    return {
        "command": command or command_line(),
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": gpu, "fp8attn_cuda_kernels": cuda_kernels, "git_commit": _git_commit(),
    }
