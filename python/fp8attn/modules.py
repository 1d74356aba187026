"""nn.Module wrapper of `fp8attn.attention`."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .ops import attention, check_deterministic, check_options, check_softcap, check_window_size, flash_attn_func

__all__ = ["FP8Attention"]

_LAYOUTS = ("bhsd", "bshd")


class FP8Attention(torch.nn.Module):
    """Attention core (no projections): forward(q, k, v) -> O.

    Args (fixed per module; see `fp8attn.attention` for their meaning):
        causal, softmax_scale, delta_mode, precision, block_size, grad_format,
        scaling ("row" or "tile": the FP8 scaling recipe, numerics.md section 9),
        qk_rotation ("none" or "hadamard") and smooth_k (bool): the outlier
        transforms of Q and K (numerics.md section 10);
        window_size ((left, right), FlashAttention's sliding window, section 14:
        -1 = unbounded, causal forces right = 0; on CUDA with scaling="tile",
        scaling="row" raises NotImplementedError naming it there);
        softcap (float, tanh logit capping c tanh(S / c), section 12; 0 = off; on
        CUDA with scaling="tile");
        deterministic (bool: a backward whose dQ, dK, dV repeat bit for bit; CPU
        always, CUDA with scaling="tile"; scaling="row" on CUDA raises
        NotImplementedError naming it at the call; section 9).
        layout: "bhsd" (SDPA layout [batch, heads, seqlen, head_dim], default)
            or "bshd" (flash_attn layout [batch, seqlen, heads, head_dim]);
            O comes back in the same layout.
        layer_name: label of this module's calls in fp8attn.diagnostics records
            (`fp8attn.diagnostics.name_layers(model)` fills it from module names).
    The options are checked here (ValueError / TypeError naming the argument).
    `delta_mode` is a plain attribute and may be switched between steps.
    """

    def __init__(
        self,
        causal: bool = False,
        softmax_scale: Optional[float] = None,
        delta_mode: str = "delta_matching",
        precision: str = "fp8",
        block_size: int = 128,
        grad_format: str = "e4m3",
        layout: str = "bhsd",
        layer_name: Optional[str] = None,
        scaling: str = "row",
        qk_rotation: str = "none",
        smooth_k: bool = False,
        window_size: Tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        deterministic: bool = False,
    ):
        super().__init__()
        check_options(causal=causal, softmax_scale=softmax_scale, delta_mode=delta_mode,
                      precision=precision, block_size=block_size, grad_format=grad_format,
                      layer_name=layer_name, scaling=scaling, qk_rotation=qk_rotation, smooth_k=smooth_k,
                      window_size=window_size, fn="FP8Attention")
        if layout not in _LAYOUTS:
            raise ValueError(f"fp8attn.FP8Attention: argument 'layout': must be one of {_LAYOUTS}, got {layout!r}")
        self.causal = bool(causal)  # checked (check_options): a Python or NumPy bool
        self.softmax_scale = softmax_scale
        self.delta_mode = delta_mode
        self.precision = precision
        self.block_size = block_size
        self.grad_format = grad_format
        self.layout = layout
        self.layer_name = layer_name
        self.scaling = scaling
        self.qk_rotation = qk_rotation
        self.smooth_k = bool(smooth_k)
        self.window_size = check_window_size(window_size, "FP8Attention")
        # The device-independent checks (type, range, smooth_k); the call checks the CUDA rules.
        self.softcap = check_softcap(softcap, smooth_k, "cpu", fn="FP8Attention", scaling=scaling,
                                     precision=precision)
        self.deterministic = check_deterministic(deterministic, "cpu", precision, scaling, fn="FP8Attention")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fn = attention if self.layout == "bhsd" else flash_attn_func
        return fn(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                  delta_mode=self.delta_mode, precision=self.precision, block_size=self.block_size,
                  grad_format=self.grad_format, layer_name=self.layer_name, scaling=self.scaling,
                  qk_rotation=self.qk_rotation, smooth_k=self.smooth_k,
                  window_size=self.window_size, softcap=self.softcap, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        s = (f"causal={self.causal}, delta_mode={self.delta_mode!r}, precision={self.precision!r}, "
             f"block_size={self.block_size}, grad_format={self.grad_format!r}, scaling={self.scaling!r}, "
             f"qk_rotation={self.qk_rotation!r}, smooth_k={self.smooth_k}, layout={self.layout!r}")
        if self.window_size != (-1, -1):
            s += f", window_size={self.window_size}"
        if self.softcap:
            s += f", softcap={self.softcap}"
        if self.deterministic:
            s += ", deterministic=True"
        if self.softmax_scale is not None:
            s += f", softmax_scale={self.softmax_scale}"
        if self.layer_name is not None:
            s += f", layer_name={self.layer_name!r}"
        return s
