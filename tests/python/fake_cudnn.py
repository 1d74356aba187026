"""A CPU emulation of the cuDNN frontend's per-tensor FP8 SDPA graphs (the attributes of
the `cudnn` module that fp8attn.cudnn_fp8_attention and benchmarks/cudnn_fp8.py touch),
shared by tests/python/test_cudnn_fp8.py (the benchmark) and test_cudnn_fp8_train.py
(the training harness's fp8-cudnn mode).

The contract it emulates: inputs descaled, P quantized to E4M3 with scale_s, O / dP /
dQ / dK / dV quantized with their scales (saturating), every amax taken before the
output scale; GQA when K / V have fewer heads than Q (dK / dV summed over each group).
`bugs` injects wrong results (the self-checks must catch them), `refuse` build
refusals (the fallbacks must take them).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch


def _q8(x: torch.Tensor, scale: float, descale: float) -> torch.Tensor:
    """x * scale rounded to E4M3 (saturating), times descale (the two are separate graph inputs)."""
    return (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * descale


class _T:
    """A graph tensor: a name and the setters the module chains."""

    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type

    def set_output(self, v):
        return self

    def set_dim(self, d):
        self.dim = d
        return self

    def set_stride(self, s):
        self.stride = s
        return self

    def set_data_type(self, t):
        self.data_type = t
        return self


class _Graph:
    def __init__(self, fake, **kw):
        self.fake, self.kw, self._plan_index = fake, kw, 0

    def tensor(self, name, dim, stride, data_type):
        return _T(name, dim, stride, data_type)

    def _op(self, kind, kw, outs):
        self.kind, self.ports = kind, {k: v for k, v in kw.items() if isinstance(v, _T)}
        self.params = {k: v for k, v in kw.items() if not isinstance(v, _T)}
        self.outs = {n: _T(n) for n in outs}
        return list(self.outs.values())

    def sdpa_fp8(self, **kw):
        return self._op("fwd", kw, ("O", "Stats", "Amax_S", "Amax_O"))

    def sdpa_fp8_backward(self, **kw):
        return self._op("bwd", kw, ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"))

    def validate(self):
        if self.params.get("right_bound") == 0 and "bounds" in self.fake.refuse:
            raise RuntimeError("fake: right_bound refused")
        if self.ports["q"].dim[1] != self.ports["k"].dim[1] and "gqa" in self.fake.refuse:
            raise RuntimeError("fake: GQA refused")
        if self.outs.get("Amax_S") is not None and self.outs["Amax_S"].dim is not None \
                and "amax_s" in self.fake.refuse:
            raise RuntimeError("fake: Amax_S output refused")
        self.fake.built.append((self.kind, self.ports["q"].dim, self.ports["k"].dim))

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        pass

    def build_plans(self):
        pass

    def get_plan_name_at_index(self, i):
        return "fake_plan"

    def get_workspace_size(self):
        return 16

    def execute(self, varpack, ws, handle=None):
        self.fake.executed.append((self.kind, {t.name: x for t, x in varpack.items()}))
        by_name = {t.name: x for t, x in varpack.items()}
        x = {**{p: by_name[t.name] for p, t in self.ports.items()},
             **{p: by_name[t.name] for p, t in self.outs.items() if t.name in by_name}}
        sc = {n: x[n].item() for n in x if n.startswith(("scale_", "descale_"))}
        q, k, v = (x[n].float() * sc["descale_" + n] for n in ("q", "k", "v"))
        rep = q.shape[1] // k.shape[1]   # GQA: K / V heads shared by groups of rep query heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        tau = self.params["attn_scale"]
        causal = self.params.get("right_bound") == 0 or self.params.get("use_causal_mask", False)
        if "ignore_flag_mask" in self.fake.bugs and "use_causal_mask" in self.params:
            causal = False
        s = q @ k.transpose(-1, -2) * tau
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - lse)
        pq = _q8(p, sc["scale_s"], sc["descale_s"])
        if self.kind == "fwd":
            o = pq @ v
            x["Amax_O"].fill_(o.abs().max())
            if "Amax_S" in x:
                x["Amax_S"].fill_(p.abs().max())
            scale_o = 1.0 if "drop_scale_o" in self.fake.bugs else sc["scale_o"]
            x["O"].copy_((o * scale_o).clamp(-448, 448))
            x["Stats"].copy_(lse)
            return
        gfmt = x["dQ"].dtype
        do = x["dO"].float() * sc["descale_dO"]
        o = x["o"].float() * sc["descale_o"]
        dv = pq.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        if "bwd_ignores_mask" in self.fake.bugs:  # backward-only: the forward masks, the backward not
            s = q @ k.transpose(-1, -2) * tau
            p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
            pq = _q8(p, sc["scale_s"], sc["descale_s"])
            dv = pq.transpose(-1, -2) @ do
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        x["amax_dP"].fill_(ds.abs().max())
        dsq = _q8(ds, sc["scale_dP"], sc["descale_dP"])
        grads = {"dQ": dsq @ k * tau, "dK": dsq.transpose(-1, -2) @ q * tau, "dV": dv}
        if rep > 1:
            b, hq, s, d = q.shape
            for n in ("dK", "dV"):
                g = grads[n].reshape(b, hq // rep, rep, s, d)
                grads[n] = g[:, :, 0] if "gqa_first_head_only" in self.fake.bugs else g.sum(2)
        lim = torch.finfo(gfmt).max
        for n, g in grads.items():
            x["amax_" + n].fill_(g.abs().max())
            scale = 1.0 if n == "dK" and "drop_scale_dk" in self.fake.bugs else sc["scale_" + n]
            x[n].copy_((g * scale).clamp(-lim, lim))


class FakeCudnn:
    """The attributes of the cudnn module that benchmarks/cudnn_fp8.py touches."""

    def __init__(self, bugs=(), refuse=()):
        self.bugs, self.refuse = set(bugs), set(refuse)
        self.executed = []  # (graph kind, port name -> buffer) of every execute, in order
        self.built = []     # (graph kind, q dims, k dims) of every validated graph
        self.data_type = SimpleNamespace(FLOAT="f32", FP8_E4M3="e4m3", FP8_E5M2="e5m2", BFLOAT16="bf16")
        self.diagonal_alignment = SimpleNamespace(TOP_LEFT="top_left")
        self.heur_mode = SimpleNamespace(A="A", FALLBACK="FALLBACK")
        self.__version__ = "fake"

    def pygraph(self, **kw):
        return _Graph(self, **kw)

    def create_handle(self):
        return object()

    def set_stream(self, handle, stream):
        pass

    def backend_version_string(self):
        return "fake"


def install_for_training(monkeypatch, cfa, **kw) -> FakeCudnn:
    """Installs a FakeCudnn(**kw) as fp8attn.cudnn_fp8_attention's (`cfa`) frontend with
    fresh plan / graph caches, and lets the CPU count as a capable device; returns it."""
    fake = FakeCudnn(**kw)
    monkeypatch.setitem(cfa._STATE, "cudnn", fake)
    monkeypatch.setitem(cfa._STATE, "why", None)
    monkeypatch.setitem(cfa._STATE, "handles", {})
    monkeypatch.setattr(cfa, "_PLANS", {})
    monkeypatch.setattr(cfa, "_TRAIN_GRAPHS", {})
    monkeypatch.setattr(cfa, "device_reason", lambda device: None)
    return fake
