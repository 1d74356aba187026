"""Backward diagnostics of the FP8 attention (numerics.md section 5), free when off.

Usage::

    with fp8attn.diagnostics.record() as rec:
        loss = model(x).sum()
        loss.backward()
    for r in rec.records:          # one dict per attention backward call
        print(r["layer"], r["delta_mode"], r["eps_absmax"], r["rowsum_pre_mean"])
    rec.summary()                  # per (layer, delta_mode) aggregates

While a `record()` context is active (checked when the backward runs), every
attention backward asks the kernel for the per-row diagnostics
diag = (delta, eps, rowsum_pre, rowsum_post), each float32 [batch, num_heads_q,
seqlen_q], and appends their statistics to `rec.records`. Outside any context
the backward passes diagnostics=False and computes nothing extra.

Definitions (numerics.md section 5):
  delta        delta_i used by the selected delta mode
  eps          delta_i(mode) - delta_i(delta_matching)  (0 for delta_matching)
  rowsum_pre   |sum_j dS_ij| / sum_j |dS_ij| on the FP32 dS (0 for an all-zero row)
  rowsum_post  the same on the decoded FP8 dS (the operand of matmul #6: dS codes
               times their scales, blocks of min(block_size, 64) keys)
Statistics are taken only over rows that see at least one key (with causal and
seqlen_q > seqlen_k the first rows see none and carry no information).

Per-layer attribution: pass `layer_name=` to `fp8attn.attention`, or set
`FP8Attention(layer_name=...)`, or call `name_layers(model)` once to name every
FP8Attention submodule after its qualified module name.

NOTE: records are taken in eager mode only. Inside a torch.compile'd graph the
backward is traced once, so it cannot switch diagnostics per call; there
`is_recording()` reads False and nothing is recorded.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["DiagnosticsRecord", "record", "is_recording", "name_layers", "row_sees_key_mask", "diag_stats"]

# NOTE: a plain global guarded by a lock, not thread-local state: CUDA backward
# runs on autograd's device threads, not on the thread that entered record().
_lock = threading.Lock()
_active: List["DiagnosticsRecord"] = []

_STAT_NAMES = ("delta", "eps", "rowsum_pre", "rowsum_post")


class DiagnosticsRecord:
    """Per-call backward statistics collected while a `record()` context is active.

    Attributes:
        records: list of dicts, one per attention backward call, in call order.
            Keys: layer (str or None), delta_mode, precision, grad_format,
            block_size, scaling ("row" / "tile"), qk_rotation ("none" /
            "hadamard"), smooth_k (bool), causal, shape (dict of batch, num_heads_q, num_heads_kv,
            seqlen_q, seqlen_k, head_dim_qk, head_dim_v), rows (number of rows
            seeing >= 1 key), delta_mean, delta_absmax, eps_mean, eps_absmean,
            eps_absmax, rowsum_pre_mean, rowsum_pre_max, rowsum_post_mean,
            rowsum_post_max (Python floats), and with keep_raw=True also raw:
            dict name -> float32 CPU tensor of the per-row values of those rows.
    """

    def __init__(self, keep_raw: bool = False):
        self.keep_raw = keep_raw
        self.records: List[Dict[str, Any]] = []

    def clear(self) -> None:
        self.records.clear()

    def by_layer(self) -> Dict[Optional[str], List[Dict[str, Any]]]:
        """Records grouped by layer name (None for unnamed calls)."""
        out: Dict[Optional[str], List[Dict[str, Any]]] = {}
        for r in self.records:
            out.setdefault(r["layer"], []).append(r)
        return out

    def summary(self) -> Dict[Tuple[Optional[str], str], Dict[str, float]]:
        """Aggregates per (layer, delta_mode): calls, rows, row-weighted means of
        the *_mean / eps_absmean stats and the max of the *max stats."""
        out: Dict[Tuple[Optional[str], str], Dict[str, float]] = {}
        for r in self.records:
            s = out.setdefault((r["layer"], r["delta_mode"]), {"calls": 0, "rows": 0})
            s["calls"] += 1
            n_old, n = s["rows"], r["rows"]
            s["rows"] = n_old + n
            for key, val in r.items():
                if not isinstance(val, float):
                    continue
                if key.endswith("max"):
                    s[key] = max(s.get(key, val), val)
                elif n_old + n > 0:
                    s[key] = (s.get(key, 0.0) * n_old + val * n) / (n_old + n)
        return out


@contextlib.contextmanager
def record(keep_raw: bool = False) -> Iterator[DiagnosticsRecord]:
    """Context manager: while active, every attention backward records its
    diagnostics into the yielded `DiagnosticsRecord`. Contexts may nest; each
    active one receives every record."""
    rec = DiagnosticsRecord(keep_raw=keep_raw)
    with _lock:
        _active.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _active.remove(rec)


def is_recording() -> bool:
    """True when a `record()` context is active (always False while compiling)."""
    if torch.compiler.is_compiling() or _is_tracing():
        return False
    return bool(_active)


def _is_tracing() -> bool:
    # NOTE: AOT autograd traces the backward of a register_autograd op (the raw
    # fwd op, varlen_fwd) outside dynamo, where is_compiling() reads False; the
    # fake / proxy dispatch modes of that trace are active, so test for those.
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY))


def name_layers(model: torch.nn.Module, overwrite: bool = False) -> int:
    """Sets `layer_name` of every FP8Attention submodule of `model` to its
    qualified name (e.g. "blocks.3.attn"), unless already set and not
    `overwrite`. Returns the number of modules named."""
    from .modules import FP8Attention

    count = 0
    for name, mod in model.named_modules():
        if isinstance(mod, FP8Attention) and (overwrite or mod.layer_name is None):
            mod.layer_name = name or type(model).__name__
            count += 1
    return count


def row_sees_key_mask(seqlen_q: int, seqlen_k: int, causal: bool, device=None,
                      window_size: Tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Bool [seqlen_q]: query row i sees at least one key. With the bottom-right
    masks of numerics.md sections 1 and 14 (diagonal key i + seqlen_k - seqlen_q): causal,
    row i sees key j iff j <= diagonal; a sliding window (left, right) (-1 =
    unbounded; causal forces right = 0), iff diagonal - left <= j <= diagonal + right."""
    i = torch.arange(seqlen_q, device=device)
    if seqlen_k == 0:
        return torch.zeros(seqlen_q, dtype=torch.bool, device=device)
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    diag = i + (seqlen_k - seqlen_q)
    hi = (diag + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(i, seqlen_k - 1)
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    return lo <= hi


def diag_stats(diag: torch.Tensor, seqlen_k: int, causal: bool,
               window_size: Tuple[int, int] = (-1, -1)) -> Dict[str, Any]:
    """Statistics of a bwd diag tensor float32 [4, batch, num_heads_q, seqlen_q]
    (delta, eps, rowsum_pre, rowsum_post) over the rows that see >= 1 key
    (causal / window_size: the call's mask, numerics.md sections 1 and 14)."""
    seqlen_q = diag.shape[-1]
    mask = row_sees_key_mask(seqlen_q, seqlen_k, causal, diag.device, window_size)
    rows = diag[..., mask].reshape(4, -1).double()
    n = rows.shape[1]
    if n == 0:
        stats = {k: 0.0 for k in _stat_keys()}
    else:
        delta, eps, pre, post = rows
        vals = torch.stack([
            delta.mean(), delta.abs().max(),
            eps.mean(), eps.abs().mean(), eps.abs().max(),
            pre.mean(), pre.max(), post.mean(), post.max(),
        ]).tolist()  # one device sync per call
        stats = dict(zip(_stat_keys(), vals))
    stats["rows"] = int(n)
    return stats


def _stat_keys() -> Tuple[str, ...]:
    return ("delta_mean", "delta_absmax", "eps_mean", "eps_absmean", "eps_absmax",
            "rowsum_pre_mean", "rowsum_pre_max", "rowsum_post_mean", "rowsum_post_max")


def _record(diag: torch.Tensor, meta: Dict[str, Any]) -> None:
    """Called by the op's backward with the diag tensor of one call."""
    with _lock:
        targets = list(_active)
    if not targets:
        return
    entry = dict(meta)
    window = meta.get("window_size", (-1, -1))
    entry.update(diag_stats(diag, meta["shape"]["seqlen_k"], meta["causal"], window))
    raw = None
    if any(t.keep_raw for t in targets):
        mask = row_sees_key_mask(diag.shape[-1], meta["shape"]["seqlen_k"], meta["causal"], diag.device, window)
        sel = diag[..., mask].reshape(4, -1).float().cpu()
        raw = dict(zip(_STAT_NAMES, sel.unbind(0)))
    for t in targets:
        t.records.append(dict(entry, raw=raw) if t.keep_raw else dict(entry))
