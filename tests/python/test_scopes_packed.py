"""Trainer precision scopes (FP8 projections / FFN) and packed documents.

Scopes: which nn.Linear layers become FP8Linear per scope, the bf16 baseline stays
BF16, every scope starts from the same weights, and the FP8 linear layers really
run. Packed documents: `document_segments` on a hand-made batch, and a packed
batch row computes what its documents compute one by one (logits and, for the
attention-core scope, parameter gradients); the plain causal model does not.
A short comparison run with --scope ...+ffn --packed records both in log and report.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8attn.linear import FP8Linear
from fp8attn.train import compare
from fp8attn.train.model import SCOPES, Attention, ModelConfig, Transformer, document_segments, preset_model_config
from fp8attn.train.report import read_log
from fp8attn.train.trainer import build_model, init_fingerprint


def smoke(mode, scope="attn-core", packed=False):
    return build_model(preset_model_config("smoke", attn_mode=mode, scope=scope, packed=packed), seed=5)


# ---- scopes --------------------------------------------------------------------------


def test_scope_converts_the_right_layers_and_keeps_the_init():
    want = {
        "attn-core": set(),
        "attn-core+projections": {f"blocks.{i}.attn.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")},
    }
    want["attn-core+projections+ffn"] = want["attn-core+projections"] | {
        f"blocks.{i}.mlp.{w}" for i in range(2) for w in ("w1", "w2", "w3")}
    fps = set()
    for scope in SCOPES:
        m = smoke("fp8-delta_matching", scope)
        got = {n for n, mod in m.named_modules() if isinstance(mod, FP8Linear)}
        assert got == want[scope] == set(m.fp8_linear_names), scope
        fps.add(init_fingerprint(m))
        base = smoke("bf16", scope)                  # the bf16 baseline: BF16 everywhere
        assert not any(isinstance(mod, FP8Linear) for mod in base.modules())
        fps.add(init_fingerprint(base))
    assert len(fps) == 1
    with pytest.raises(ValueError, match="scope"):
        ModelConfig(scope="ffn")


@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_fp8_scope_layers_run_in_fp8_within_the_bound(fused, monkeypatch):
    """Every FP8Linear of the +ffn scope, on the activations it sees in the model,
    is within the FP8 bound sqrt(2) rho_E4M3 of F.linear on the same input (and
    clearly not exact); the scopes' logits differ. With Attention.fuse_fp8_qkv, Wq, Wk, Wv
    run fused (Attention.qkv, not their forward), so their outputs are checked from the
    attention's input."""
    monkeypatch.setattr(Attention, "fuse_fp8_qkv", fused)
    import math
    bound = math.sqrt(2) * 2.0 ** -4 / math.sqrt(3)
    toks = torch.randint(1, 512, (2, 64))
    m = smoke("fp8-delta_matching", "attn-core+projections+ffn")
    errs = []

    def hook(mod, inp, out):
        ref = F.linear(inp[0], mod.weight, mod.bias).detach()
        errs.append(float((out.detach() - ref).norm() / ref.norm()))

    def qkv_hook(attn, inp, out):
        assert attn.fused_fp8_qkv()
        for lin, y in zip((attn.wq, attn.wk, attn.wv), attn.qkv(inp[0])):
            hook(lin, inp, y)

    for mod in m.modules():
        if isinstance(mod, FP8Linear):
            mod.register_forward_hook(hook)
        if fused and isinstance(mod, Attention):
            mod.register_forward_hook(qkv_hook)
    m(toks)
    assert len(errs) == 14 and all(0.1 * bound < e <= bound for e in errs), errs
    out = {s: smoke("fp8-delta_matching", s)(toks).detach() for s in SCOPES}
    assert not torch.equal(out[SCOPES[0]], out[SCOPES[1]]) and not torch.equal(out[SCOPES[1]], out[SCOPES[2]])


# ---- packed documents ------------------------------------------------------------------


def test_document_segments_by_hand():
    toks = torch.tensor([[5, 3, 0, 4, 4, 0, 0, 7],
                         [0, 1, 2, 3, 0, 5, 6, 7]])
    cu, pos = document_segments(toks)
    assert cu.tolist() == [0, 3, 6, 7, 8, 9, 13, 16]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 0, 1, 2]]
    cu, pos = document_segments(torch.randint(1, 9, (2, 5)))       # no separator: one document per row
    assert cu.tolist() == [0, 5, 10] and pos.tolist() == [list(range(5))] * 2


def packed_batch():
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(1, 512, (3, 64), generator=g)
    toks[0, [9, 40]] = 0
    toks[1, [0, 63]] = 0
    toks[2, 30] = 0
    return toks


# Tolerances (max |diff| / max |logit| per document): the fp8 path runs the same
# per-document op calls, so only FP32 summation order differs (measured ~6e-7);
# bf16 SDPA with the block-diagonal mask vs plain causal SDPA may round a BF16
# output differently (one BF16 ulp 2^-8 of O; measured 1.9e-3 on logits).
TOL = {"bf16": 2.0 ** -7, "fp8-delta_matching": 1e-5}


@pytest.mark.parametrize("mode,scope", [("bf16", "attn-core"), ("fp8-delta_matching", "attn-core"),
                                        ("fp8-delta_matching", "attn-core+projections+ffn")])
def test_packed_row_equals_documents_one_by_one(mode, scope):
    toks = packed_batch()
    packed = smoke(mode, scope, packed=True)
    plain = smoke(mode, scope, packed=False)
    cu, _ = document_segments(toks)
    lp = packed(toks).detach().flatten(0, 1)
    lu = plain(toks).detach().flatten(0, 1)
    worst, worst_plain = 0.0, 0.0
    s = toks.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        r, c0 = divmod(a, s)
        ld = plain(toks[r:r + 1, c0:c0 + (b - a)])[0].detach()
        scale = float(ld.abs().max())
        worst = max(worst, float((lp[a:b] - ld).abs().max()) / scale)
        worst_plain = max(worst_plain, float((lu[a:b] - ld).abs().max()) / scale)
    assert worst <= TOL[mode], worst
    # the failure it guards against: plain causal rows let documents see each other
    assert worst_plain > 100 * TOL[mode], worst_plain


@pytest.mark.parametrize("mode", ["bf16", "fp8-delta_matching"])
def test_packed_gradients_equal_per_document_gradients(mode):
    """Sum of token losses: packed grads == sum over documents of per-document grads
    (attention-core scope; FP8Linear's wgrad blocks along tokens, which packing regroups)."""
    toks = packed_batch()
    y = torch.randint(1, 512, toks.shape, generator=torch.Generator().manual_seed(4))
    packed = smoke(mode, packed=True)
    F.cross_entropy(packed(toks).flatten(0, 1), y.flatten(), reduction="sum").backward()
    plain = smoke(mode)
    cu, _ = document_segments(toks)
    s = toks.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        r, c0 = divmod(a, s)
        sl = slice(c0, c0 + (b - a))
        F.cross_entropy(plain(toks[r:r + 1, sl])[0], y[r, sl], reduction="sum").backward()
    gp = torch.cat([p.grad.flatten() for p in packed.parameters()])
    gd = torch.cat([p.grad.flatten() for p in plain.parameters()])
    rel = float((gp - gd).norm() / gd.norm())
    assert rel <= TOL[mode], rel


def test_compare_run_records_scope_and_packed(tmp_path, text_dir):
    args = compare.parse_args(["--preset", "smoke", "--modes", "bf16,fp8-delta_matching", "--steps", "3",
                               "--scope", "attn-core+projections+ffn", "--packed", "--diag-every", "2",
                               "--val-every", "3", "--val-batches", "1", "--data-dir", str(tmp_path / "data"),
                               "--text-dir", str(text_dir), "--device", "cpu", "--no-progress",
                               "--out", str(tmp_path / "run")])
    path, table, summaries = compare.run(args)
    by_mode = {s["mode"]: s for s in summaries}
    assert by_mode["fp8-delta_matching"]["scope"] == "attn-core+projections+ffn"
    assert by_mode["bf16"]["scope"] == "bf16"
    assert all(s["packed"] and not s["diverged"] and s["final_val_loss"] > 0 for s in summaries)
    meta = read_log(tmp_path / "run" / "fp8-delta_matching.jsonl")["meta"]
    assert meta["model"]["scope"] == "attn-core+projections+ffn" and meta["model"]["packed"]
    assert "attn-core+projections+ffn" in path.read_text() and "packed documents" in path.read_text()
    assert "| fp8-delta_matching |" in table
