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
    j <= i + seqlen_k - seqlen_q), a bottom-right sliding-window pattern (key j
    visible iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q
    + right, either bound possibly absent), or that masks nothing: computed with
    causal=True / window_size=(left, right) / neither; the same over the first n
    keys only (a static KV cache's filled prefix, its unused slots masked for
    every row, in prefill and decode): the keys are cut to those n first.
  * anything else (real padding, packed sequences): NotImplementedError.
Sliding windows (models whose config has `sliding_window`: Mistral, Qwen2 with
use_sliding_window, Gemma 2's local layers; HF passes the layer's
`sliding_window` W): HF's masks let a causal query see keys q - W < k <= q, i.e.
fp8attn's window_size (W - 1, 0) (FlashAttention's convention, which HF's
flash-attention integration uses too); the mask, when HF builds one, is
classified as above, and with no mask (the window reaches every key) the window
is applied as (W - 1, 0) (causal) or (W, W) (bidirectional, HF's |q - k| <= W).
CPU tensors, and CUDA tensors with scaling "tile" (the register's options); with
scaling "row" on CUDA the op raises NotImplementedError naming window_size for a
window that masks more than causal.
Logit softcapping (Gemma 2's attn_logit_softcapping: HF passes `softcap`) goes to
the op's `softcap` (numerics.md section 12): CPU tensors, and CUDA tensors with
scaling "tile"; with scaling "row" on CUDA the op raises NotImplementedError
naming softcap. Dropout > 0 in training, attention sinks (s_aux) and position_bias
raise NotImplementedError.

Dtypes: with precision "fp8" Q/K/V are cast to bfloat16 (as the trainer does),
except float16, which the op takes as it is (it runs float16 as float32); O goes
back to the query's dtype; with "exact" float16 is computed in float32.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .ops import attention, check_bool, check_options, fmt_value

__all__ = ["register", "make_attention_function", "FP8_OPTIONS"]

# fp8attn.attention options that register() forwards (layer_name comes from the module).
# NOTE: "scaling" here is fp8attn's FP8 scaling recipe ("row" / "tile",
# numerics.md section 9); HF's per-call `scaling` argument stays the softmax scale.
FP8_OPTIONS = ("delta_mode", "precision", "block_size", "grad_format", "scaling", "qk_rotation", "smooth_k",
               "deterministic")

# HF attention kwargs this integration cannot honour when set (not None / not False).
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")


def _window_mask(seqlen_q: int, seqlen_k: int, window: Tuple[int, int], device) -> torch.Tensor:
    """Bool [seqlen_q, seqlen_k]: the bottom-right window mask of numerics.md section 14
    (key j visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
    seqlen_q + right; -1 = unbounded)."""
    left, right = window
    diag = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def _classify_mask(mask: torch.Tensor, seqlen_q: int,
                   seqlen_k: int) -> Optional[Tuple[bool, int, Tuple[int, int]]]:
    """(causal, n_keys, window_size) if `mask` lets the rows see only keys among the
    first n_keys, in exactly the bottom-right pattern of fp8attn.attention over them:
    all of them (causal False, window (-1, -1)), the causal mask (causal True, window
    (-1, -1)), or a sliding window (causal False, window (left, right); HF's sliding
    window layers, e.g. Mistral, Qwen2 with use_sliding_window, Gemma 2's local layers,
    whose causal sliding window of W tokens is (W - 1, 0)); None for anything else
    (padding, other per-row patterns). n_keys < seqlen_k: keys no row sees are cut off
    (a static KV cache's unused tail, masked by HF in decode and prefill); the pattern
    is then judged against the first n_keys keys. mask: bool (True = attend) or additive
    float (0 = attend; a masked entry must be -inf or below -1e4), broadcastable to
    [batch, heads, seqlen_q, seqlen_k]; the same pattern for every batch row and head."""
    if mask.dim() < 2 or mask.shape[-2:] != (seqlen_q, seqlen_k):
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    # An additive mask must really remove what it masks.
    if mask.dtype != torch.bool and not bool((mask[~allowed] < -1e4).all()):
        return None
    if bool(allowed.all()):
        return False, seqlen_k, (-1, -1)
    used = allowed.reshape(-1, seqlen_q, seqlen_k).any(dim=0).any(dim=0)   # keys any row sees
    if not bool(used.any()):
        return None
    n = int(torch.nonzero(used)[-1]) + 1
    head = allowed[..., :n]
    if bool(head.all()):
        return False, n, (-1, -1)
    # The window bounds the first (batch, head) pattern implies, then the whole mask
    # checked against the pattern of those bounds.
    rows = head.reshape(-1, seqlen_q, n)[0]
    seen = rows.any(dim=1)
    i = torch.arange(seqlen_q, device=mask.device)
    j = torch.arange(n, device=mask.device)
    first = torch.where(rows, j[None, :], n).min(dim=1).values
    last = torch.where(rows, j[None, :], -1).max(dim=1).values
    diag = i + (n - seqlen_q)
    cut_right = seen & (last < n - 1)   # rows whose visible keys end before the last key
    cut_left = seen & (first > 0)
    right = int((last - diag)[cut_right].max()) if bool(cut_right.any()) else -1
    left = int((diag - first)[cut_left].max()) if bool(cut_left.any()) else -1
    if (bool(cut_right.any()) and right < 0) or (bool(cut_left.any()) and left < 0):
        return None  # a bound on the far side of the diagonal: not a window
    if not bool((head == _window_mask(seqlen_q, n, (left, right), mask.device)).all()):
        return None
    if left < 0 and right == 0:
        return True, n, (-1, -1)
    return False, n, (left, right)


def make_attention_function(**fp8_kwargs) -> Callable:
    """The HF attention function (without registering it); see `register`."""
    # deterministic's type here; its recipe rule (check_deterministic) needs the device: per call.
    check_bool(fp8_kwargs.get("deterministic", False), "deterministic", "hf.register")
    check_options(fn="hf.register", **{k: v for k, v in fp8_kwargs.items() if k != "deterministic"})
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
        sliding_window = kwargs.get("sliding_window")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"fp8attn.hf: argument 'sliding_window': must be None or an int >= 1, got "
                             f"{fmt_value(sliding_window)}")
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
            # HF's sliding window of W tokens (masking_utils: a causal query sees keys
            # q - W < k <= q; bidirectional |q - k| <= W) as fp8attn's window_size;
            # its flash-attention integration passes (W - 1, W - 1) with causal, i.e.
            # (W - 1, 0). (HF builds no mask only where the window reaches every key.)
            window = (-1, -1)
            if sliding_window is not None:
                window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
        else:
            if attention_mask.dim() < 2 or tuple(attention_mask.shape[-2:]) != (seqlen_q, seqlen_k):
                # NOTE: e.g. HF's decode step of a sliding_window=1 layer passes a [.., 1, 1] mask
                # with several cached keys (found by a break test): say so, not "padding".
                raise NotImplementedError(
                    f"fp8attn.hf: argument 'attention_mask': its last two dims must be (seqlen_q, seqlen_k) = "
                    f"({seqlen_q}, {seqlen_k}) so that fp8attn can read which keys each query sees, got shape "
                    f"{list(attention_mask.shape)}")
            kind = _classify_mask(attention_mask, seqlen_q, seqlen_k)
            if kind is None:
                raise NotImplementedError(
                    "fp8attn.hf: argument 'attention_mask': only causal, sliding-window or no masking (over all "
                    "keys or over a static cache's filled prefix) is supported (got a mask with padding or "
                    "another pattern); pass batches without padding")
            causal, n_keys, window = kind
            if n_keys < seqlen_k:  # a static cache's unused slots: cut off (as with no mask above)
                key, value = key[:, :, :n_keys], value[:, :, :n_keys]
        dtype = query.dtype
        if precision == "fp8":
            work = torch.float16 if dtype == torch.float16 else torch.bfloat16
        else:
            work = torch.float32 if dtype == torch.float16 else dtype
        layer_idx = getattr(module, "layer_idx", None)
        # NOTE: None and 0.0 are "off" (FlashAttention's convention and HF's flash path);
        # HF's eager path would compute 0 tanh(x / 0) for a config's attn_logit_softcapping = 0.0.
        softcap = kwargs.get("softcap")
        out = attention(query.to(work), key.to(work), value.to(work), causal=causal, softmax_scale=scaling,
                        layer_name=None if layer_idx is None else f"layer{layer_idx}", window_size=window,
                        softcap=0.0 if softcap is None else softcap, **fp8_kwargs)
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
            outlier transforms of numerics.md section 10), deterministic (bool:
            a bitwise run-to-run reproducible backward; on CUDA with
            scaling="tile", numerics.md section 9), as in `fp8attn.attention`
            (checked here; ValueError naming the option, TypeError for a
            non-bool deterministic; the recipe rule of deterministic is checked
            per call, where the device is known).

    Returns the registered function
    fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
    -> (attn_output [batch, seqlen_q, num_heads_q, head_dim_v], None).

    Raises ImportError without transformers, TypeError for an option that is
    not one of FP8_OPTIONS. The function itself raises NotImplementedError for
    padding masks, dropout in training and the other unsupported features
    listed in the module docstring.
    """
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"fp8attn.hf.register: argument 'name': must be a non-empty str (the "
                        f"attn_implementation name), got {name!r}")
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
