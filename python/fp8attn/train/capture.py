"""Hooks on the attention layers of `model.Transformer` (probes and trainer statistics).

- `CoreCapture`: records every layer's attention-core inputs Q, K, V (after
  QK-norm and RoPE, [B, H, S, D]), output O and, after a backward, the upstream
  gradient dO of O (the tensor the attention op's backward receives).
- `ActivationScales`: per-layer channel scales of Q and K, a QK-norm-free
  counterpart of the QK-norm gains (numerics.md section 5), see `channel_scales`.
- `zero_attention_output`: zeroes one layer's attention-sublayer output (the
  attention-output masking probe, numerics.md section 5).

All work through forward hooks on `Attention.core` / `Attention` modules; the
model code is not changed and the hooks are removed on exit.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

from .model import Transformer, gain_stats


def _cores(model: Transformer):
    """[(layer_name, AttentionCore)] in layer order."""
    return [(blk.attn.layer_name, blk.attn.core) for blk in model.blocks if blk.attn is not None]


class CoreCapture:
    """Context manager recording Q, K, V, O and dO of every attention core.

    After a forward (and backward) inside the context, `records[layer_name]`
    holds detached tensors "q", "k", "v", "o" (as passed to / returned by the
    core, in the compute dtype) and "do" (gradient of O, once a backward ran).
    Only the last call of each layer is kept. Tensors stay on their device
    unless `to_cpu=True`.
    """

    def __init__(self, model: Transformer, to_cpu: bool = False):
        self.model = model
        self.to_cpu = to_cpu
        self.records: Dict[str, Dict[str, torch.Tensor]] = {}
        self._handles = []

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to("cpu", copy=True) if self.to_cpu else t.clone()

    def __enter__(self) -> "CoreCapture":
        for name, core in _cores(self.model):
            def hook(_mod, args, output, name=name):
                q, k, v = args[:3]
                rec = {"q": self._keep(q), "k": self._keep(k), "v": self._keep(v), "o": self._keep(output)}
                self.records[name] = rec
                if output.requires_grad:
                    def grad_hook(g, rec=rec):
                        rec["do"] = self._keep(g)
                    output.register_hook(grad_hook)
            self._handles.append(core.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def channel_scales(x: torch.Tensor) -> torch.Tensor:
    """Channel scales of an attention operand x [..., D]: the RMS over every other
    dim, with the RoPE channel pairs (c, c + D/2) merged (RMS over both, which
    RoPE's rotation leaves unchanged) when D is even. Returns FP32 [D/2] (or [D])."""
    ms = x.detach().float().pow(2).flatten(0, -2).mean(0)
    d = ms.shape[0]
    if d % 2 == 0:
        ms = 0.5 * (ms[: d // 2] + ms[d // 2:])
    return ms.sqrt()


def attention_logit_stats(q: torch.Tensor, k: torch.Tensor, max_queries: int = 256) -> torch.Tensor:
    """How sharp attention is, from a sample of one layer's Q [B, Hq, S, D] and
    K [B, Hkv, S, D] (after QK-norm and RoPE; GQA by head counts): the logits
    S = Q K^T / sqrt(D) of batch row 0, the last `max_queries` queries, every
    query head, causal (bottom-right) mask, in FP32. Returns FP32 [3] on q's
    device (no sync): std of the visible logits (the x-axis of
    fp8attn.train.logit_scan), max logit, and the mean softmax entropy per row in
    nats (log of the number of visible keys for uniform attention, 0 for
    one-hot rows, where row-sum residuals are rounding noise)."""
    q0 = q[0, :, -max_queries:].detach().float()
    k0 = k[0].detach().float().repeat_interleave(q.shape[1] // k.shape[1], dim=0)
    sq, sk = q0.shape[1], k0.shape[1]
    logits = (q0 @ k0.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    rows = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
    visible = torch.arange(sk, device=q.device).unsqueeze(0) <= rows          # [sq, sk]
    vis = visible.expand_as(logits)
    lv = logits[vis]
    logp = torch.log_softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
    ent = -(logp.exp() * logp.masked_fill(~vis, 0.0)).sum(-1)
    return torch.stack([lv.std(unbiased=False), lv.max(), ent.mean()])


class ActivationScales:
    """Context manager: while active, each attention core's forward records
    `channel_scales` of Q and K and `attention_logit_stats` (on the device, no
    sync; the logit statistics only for unpacked batches). `stats()` returns
    {layer: [max_scale, top4_share]} with max_scale = max over channels of the Q
    and K scales and top4_share = the top-4 channels' share of
    sum_c (a_q[c] a_k[c])^2 (the `gain_stats` of the scales); `logit_stats()`
    returns {layer: [logit_std, logit_max, entropy_mean]}."""

    def __init__(self, model: Transformer):
        self.model = model
        self.scales: Dict[str, tuple] = {}
        self.logits: Dict[str, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> "ActivationScales":
        for name, core in _cores(self.model):
            def hook(_mod, args, kwargs, _output, name=name):
                self.scales[name] = (channel_scales(args[0]), channel_scales(args[1]))
                # NOTE: packed documents mask per document; the causal sample would be wrong.
                if kwargs.get("cu_seqlens") is None:
                    self.logits[name] = attention_logit_stats(args[0], args[1])
            self._handles.append(core.register_forward_hook(hook, with_kwargs=True))
        return self

    def logit_stats(self) -> Dict[str, list]:
        return {name: [float(x) for x in t.tolist()] for name, t in self.logits.items()}

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def stats(self) -> Dict[str, list]:
        return {name: list(gain_stats(aq, ak, top_k=4)) for name, (aq, ak) in self.scales.items()}


@contextlib.contextmanager
def zero_attention_output(model: Transformer, layer: int = -1) -> Iterator[None]:
    """Inside the context the attention sublayer of block `layer` (default: the
    last) outputs zeros, i.e. that block's residual stream skips attention."""
    n = len(model.blocks)
    if not -n <= layer < n:
        raise ValueError(f"layer: {layer} out of range for a model with {n} layers")
    blk = model.blocks[layer]
    if blk.attn is None:
        raise ValueError(f"layer: block {layer} has no attention (a Gated DeltaNet layer of arch gdn-hybrid)")
    h = blk.attn.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out))
    try:
        yield
    finally:
        h.remove()
