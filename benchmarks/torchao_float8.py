"""torchao's float8 training linear layers (`torchao.float8`) as the FP8 baseline a user
would pick instead of fp8attn's FP8Linear (issue 21): availability, the recipe configs and
the layer conversion, shared by bench_train.py (its torchao/<recipe> configs) and
bench_linear_gpu.py (its per-GEMM columns).

torchao is an optional dependency: nothing here imports it at module import, and every
entry point says why it cannot run (a sentence for an n/a row) rather than raising.

Recipes (torchao 0.18, `Float8LinearConfig.from_recipe_name`):
  tensorwise          dynamic per-tensor scaling: one FP32 scale per tensor and cast
                      (amax over the whole tensor), x and W in E4M3, dY in E5M2,
                      cuBLAS tensorwise torch._scaled_mm (the forward GEMM with fast
                      accumulation); torchao's default.
  rowwise             dynamic axiswise scaling: one scale per row along each GEMM's
                      reduction dim, E4M3 for x, W and dY, scales floored to powers of
                      two; rowwise torch._scaled_mm.
  rowwise_with_gw_hp  rowwise for y and dX (W tensorwise for dX); the weight gradient
                      dW = dY^T x in high precision (BF16 here).
compared with fp8attn's FP8Linear: 1x128 activation / gradient blocks and 128x128 weight
tiles, E4M3 everywhere, cuBLASLt block-scaled GEMMs (docs/numerics.md section 8).

Hardware: FP8 torch._scaled_mm needs CUDA compute capability >= 8.9 (Ada, Hopper and
later); below it the configs are n/a. On the CPU they run with torchao's `emulate=True`
(the scaled GEMMs as FP32 matmuls of the dequantized FP8 operands), so CPU smoke runs
exercise the conversion, the casts and autograd; their timings mean nothing.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

import torch
import torch.nn as nn

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)   # FP8 torch._scaled_mm (sm_89, sm_90, ...)


def _float8():
    """The torchao.float8 module (ImportError when torchao is missing or broken)."""
    import torchao.float8 as f8  # noqa: PLC0415 (optional dependency, imported on use)
    return f8


def unavailable(device: torch.device, recipe: str) -> str | None:
    """None when torchao's float8 training with `recipe` can run on `device` (CPU: emulated),
    else the reason, one sentence: torchao not importable, a torchao without the recipe, or a
    CUDA device below compute capability 8.9. ValueError for a recipe not in RECIPES."""
    if recipe not in RECIPES:
        raise ValueError(f"torchao recipe must be one of {RECIPES}, got {recipe!r}")
    try:
        f8 = _float8()
    except Exception as exc:  # noqa: BLE001 (ImportError, or a torchao broken against this torch)
        return f"torchao not importable ({type(exc).__name__}: {str(exc)[:160]})"
    names = [r.value for r in f8.Float8LinearRecipeName]
    if recipe not in names:
        return f"torchao {_version()} has no float8 recipe {recipe!r} (it has {names})"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            return (f"torchao float8 needs CUDA compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                    f"(FP8 torch._scaled_mm); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    elif device.type != "cpu":
        return f"torchao float8: device {device.type!r} not supported here (CUDA, or the CPU emulated)"
    return None


def _version() -> str:
    try:
        import torchao  # noqa: PLC0415
        return str(getattr(torchao, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "unknown"


def version() -> str | None:
    """torchao.__version__, or None when it is not importable."""
    try:
        _float8()
    except Exception:  # noqa: BLE001
        return None
    return _version()


def linear_config(recipe: str, device: torch.device):
    """torchao's Float8LinearConfig of `recipe`; on a non-CUDA device with emulate=True."""
    cfg = _float8().Float8LinearConfig.from_recipe_name(recipe)
    return cfg if device.type == "cuda" else dataclasses.replace(cfg, emulate=True)


def convert(model: nn.Module, include: Iterable[str], recipe: str, device: torch.device) -> list[str]:
    """Swaps the nn.Linear submodules whose qualified names match a glob of `include` for
    torchao Float8Linear (torchao.float8.convert_to_float8_training with a module_filter_fn;
    same Parameter objects, so build the optimizer after). Returns the sorted names of the
    converted modules. Every other module (the LM head among them) stays as it is."""
    pats = list(include)

    def want(mod: nn.Module, fqn: str) -> bool:
        return type(mod) is nn.Linear and any(fnmatch.fnmatchcase(fqn, p) for p in pats)

    targets = sorted(n for n, m in model.named_modules() if want(m, n))
    _float8().convert_to_float8_training(model, module_filter_fn=want, config=linear_config(recipe, device))
    left = [n for n in targets if type(model.get_submodule(n)) is nn.Linear]
    if left:
        raise RuntimeError(f"torchao convert_to_float8_training left {left[:4]} unconverted")
    return targets


def float8_linear(lin: nn.Linear, recipe: str, device: torch.device) -> nn.Module:
    """One nn.Linear as a torchao Float8Linear of `recipe` (the same Parameter objects)."""
    holder = nn.Sequential(lin)
    convert(holder, ["0"], recipe, device)
    return holder[0]


def patch_inductor_up_front(device: torch.device) -> bool:
    """torchao's convert_to_float8_training patches inductor's Triton min / max codegen for
    the whole process (a numerically identical tl.where form that avoids a Triton FP8 store
    miscompile) the first time it runs. Converting a throwaway layer here applies it before
    anything is compiled, so that in a --compile run every config (torchao's or not) is
    compiled alike. Returns whether torchao ran (False when it is not importable)."""
    if unavailable(device, "tensorwise") is not None:
        return False
    float8_linear(nn.Linear(16, 16, bias=False), "tensorwise", device)
    return True
