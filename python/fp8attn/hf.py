"""Hugging Face transformers integration: fp8attn as an `attn_implementation`.

    import fp8attn.hf
    fp8attn.hf.register()                                    # name "fp8attn", precision "fp8"
    model = LlamaForCausalLM(config)                         # config built with
                                                             # attn_implementation="fp8attn"
    # or: model.set_attn_implementation("fp8attn")

`register(name, **fp8_kwargs)` adds an attention function to transformers'
AttentionInterface (and the SDPA mask builder under the same name to its
AttentionMaskInterface, see below). The function follows HF's
`sdpa_attention_forward` semantics and computes attention with
`fp8attn.attention` (numerics.md section 1 for the mask, section 3 for the FP8
matmuls, section 4 for delta_mode).

Masks. HF builds no mask at all for an attention name it has no mask builder
for (it would then silently ignore padding), so `register` also registers
transformers' `sdpa_mask` under `name`. That builder returns None when the mask
is purely causal (no padding), and a boolean [batch, 1, seqlen_q, seqlen_k]
mask (True = attend) otherwise. Supported here:
  * attention_mask None: as HF's SDPA path: causal (module.is_causal, or an
    `is_causal` kwarg) when seqlen_q > 1, else (one decode query) no mask. When
    causal with seqlen_k > seqlen_q (a pre-filled static cache) the keys are cut
    to the first seqlen_q, as HF's SDPA path does.
  * a mask (bool, or additive float with 0 = attend) that is exactly the
    bottom-right causal pattern (key j visible to query i iff
    j <= i + seqlen_k - seqlen_q), or that masks nothing: computed with
    causal=True / False; the same over the first n keys only (a static KV
    cache's filled prefix, its unused slots masked for every row, in prefill
    and decode): the keys are cut to those n first.
  * anything else (real padding, sliding windows, packed sequences):
    NotImplementedError.
Dropout > 0 in training, softcap, sliding_window, attention sinks (s_aux) and
position_bias raise NotImplementedError.

Dtypes: with precision "fp8" Q/K/V are cast to bfloat16 (as the trainer does),
except float16, which the op takes as it is (it runs float16 as float32); O goes
back to the query's dtype; with "exact" float16 is computed in float32.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .ops import attention, check_options

__all__ = ["register", "make_attention_function", "FP8_OPTIONS"]

# fp8attn.attention options that register() forwards (layer_name comes from the module).
# NOTE: "scaling" here is fp8attn's FP8 scaling recipe ("row" / "tile",
# numerics.md section 9); HF's per-call `scaling` argument stays the softmax scale.
FP8_OPTIONS = ("delta_mode", "precision", "block_size", "grad_format", "scaling", "qk_rotation", "smooth_k")

# HF attention kwargs this integration cannot honour when set (not None / not False).
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def _classify_mask(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> Optional[Tuple[bool, int]]:
    """(causal, n_keys) if `mask` lets every row see only the first n_keys keys, either all
    of them (causal False) or exactly the bottom-right causal pattern over them (causal
    True); None for anything else (padding, per-row patterns). n_keys < seqlen_k is a static
    KV cache's unused tail (HF masks those slots in decode and prefill). mask: bool (True =
    attend) or additive float (0 = attend; a masked entry must be -inf or below -1e4),
    broadcastable to [batch, heads, seqlen_q, seqlen_k]."""
    if mask.dim() < 2 or mask.shape[-2:] != (seqlen_q, seqlen_k):
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    # An additive mask must really remove what it masks.
    if mask.dtype != torch.bool and not bool((mask[~allowed] < -1e4).all()):
        return None
    if bool(allowed.all()):
        return False, seqlen_k
    used = allowed.reshape(-1, seqlen_q, seqlen_k).any(dim=0).any(dim=0)   # keys any row sees
    n = int(used.sum())
    if n == 0 or not bool(used[:n].all()):
        return None
    head = allowed[..., :n]
    if bool(head.all()):
        return False, n
    i = torch.arange(seqlen_q, device=mask.device)[:, None]
    j = torch.arange(n, device=mask.device)[None, :]
    if not bool((head == (j <= i + (n - seqlen_q))).all()):
        return None
    return True, n


def make_attention_function(**fp8_kwargs) -> Callable:
    """The HF attention function (without registering it); see `register`."""
    check_options(fn="hf.register", **fp8_kwargs)
    precision = fp8_kwargs.get("precision", "fp8")

    def fp8attn_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        scaling: Optional[float] = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> Tuple[torch.Tensor, None]:
        """query [b, Hq, Sq, D], key/value [b, Hkv, Sk, D(v)] (GQA by head counts).
        Returns (O [b, Sq, Hq, Dv] contiguous, in query's dtype, None)."""
        for name in _UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None and kwargs.get(name) is not False:
                raise NotImplementedError(f"fp8attn.hf: argument '{name}' is not supported")
        if dropout > 0 and (module is None or module.training):
            raise NotImplementedError(f"fp8attn.hf: argument 'dropout': attention dropout ({dropout}) is not "
                                      "supported; set the config's attention_dropout to 0")
        seqlen_q, seqlen_k = query.shape[2], key.shape[2]
        if attention_mask is None:
            is_causal = kwargs.get("is_causal")
            if is_causal is None:
                is_causal = getattr(module, "is_causal", True)
            causal = bool(is_causal) and seqlen_q > 1
            if causal and seqlen_k > seqlen_q:
                # NOTE: HF passes no mask here only for a prefill into an empty static cache
                # (the tail keys are unused slots); its SDPA path cuts them off, so do we.
                key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
        else:
            kind = _classify_mask(attention_mask, seqlen_q, seqlen_k)
            if kind is None:
                raise NotImplementedError(
                    "fp8attn.hf: argument 'attention_mask': only causal or no masking (over all keys or over a "
                    "static cache's filled prefix) is supported (got a mask with padding or another pattern); "
                    "pass batches without padding")
            causal, n_keys = kind
            if n_keys < seqlen_k:  # a static cache's unused slots: cut off (as with no mask above)
                key, value = key[:, :, :n_keys], value[:, :, :n_keys]
        dtype = query.dtype
        if precision == "fp8":
            work = torch.float16 if dtype == torch.float16 else torch.bfloat16
        else:
            work = torch.float32 if dtype == torch.float16 else dtype
        layer_idx = getattr(module, "layer_idx", None)
        out = attention(query.to(work), key.to(work), value.to(work), causal=causal, softmax_scale=scaling,
                        layer_name=None if layer_idx is None else f"layer{layer_idx}", **fp8_kwargs)
        return out.to(dtype).transpose(1, 2).contiguous(), None

    return fp8attn_attention_forward


def register(name: str = "fp8attn", **fp8_kwargs) -> Callable:
    """Registers fp8attn with transformers as `attn_implementation=name`.

    Args:
        name: the attention implementation name (default "fp8attn"). Register
            several names for several option sets (e.g. "fp8attn_exact" with
            precision="exact").
        fp8_kwargs: delta_mode, precision, block_size, grad_format, scaling
            (the FP8 scaling recipe "row" / "tile", numerics.md section 9; not
            HF's per-call `scaling`, which stays the softmax scale),
            qk_rotation ("none" / "hadamard") and smooth_k (bool; the
            outlier transforms of numerics.md section 10), as in
            `fp8attn.attention` (checked here; ValueError naming the option).

    Returns the registered function
    fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
    -> (attn_output [batch, seqlen_q, num_heads_q, head_dim_v], None).

    Raises ImportError without transformers, TypeError for an option that is
    not one of FP8_OPTIONS. The function itself raises NotImplementedError for
    padding masks, dropout in training and the other unsupported features
    listed in the module docstring.
    """
    bad = sorted(set(fp8_kwargs) - set(FP8_OPTIONS))
    if bad:
        raise TypeError(f"fp8attn.hf.register: unexpected option(s) {bad}; accepted: {FP8_OPTIONS}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fp8attn.hf.register needs transformers with AttentionInterface "
                          "(pip install transformers)") from e
    fn = make_attention_function(**fp8_kwargs)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return fn
