"""--arch gdn-hybrid: Gated DeltaNet layers (fla-core) between the GQA attention layers.

CPU: the delta-rule recurrence runs fla-core's PyTorch reference
(`naive_chunk_gated_delta_rule`, chunk 64); CUDA would run its Triton kernel
`chunk_gated_delta_rule` (not run here). Checked:
- the layer pattern (an attention layer after every gdn_ratio GDN layers);
- the mixer's recurrence equals the formula of the GatedDeltaNet docstring evaluated
  step by step here in FP64, and fla-core's recurrent reference (so the chunked call
  gets its arguments in the right order: the two references order g and beta
  differently);
- causality (a later token never changes an earlier output);
- a compare run trains both modes, the fp8 diagnostics cover the attention layers only,
  and context parallelism / packed rows / too few layers are refused.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8attn
from fp8attn.train import model as M

pytest.importorskip("fla")
pytestmark = pytest.mark.filterwarnings("ignore:Triton is not supported")
PY_DIR = Path(fp8attn.__file__).resolve().parents[1]


def _cfg(**kw):
    return M.preset_model_config("smoke", arch="gdn-hybrid", **kw)


def test_layer_pattern():
    m = M.Transformer(M.preset_model_config("smoke", arch="gdn-hybrid", n_layers=8, gdn_ratio=3))
    assert [b.attn is not None for b in m.blocks] == [False, False, False, True] * 2
    assert [b.gdn is not None for b in m.blocks] == [True, True, True, False] * 2
    assert len(m.qk_gains()) == 2
    assert all(b.attn is not None and b.gdn is None for b in M.Transformer(M.preset_model_config("smoke")).blocks)
    with pytest.raises(ValueError, match="n_layers >= 4"):
        _cfg(gdn_ratio=3)
    with pytest.raises(ValueError, match="packed"):
        _cfg(gdn_ratio=1, packed=True)
    with pytest.raises(ValueError, match="arch"):
        M.preset_model_config("smoke", arch="mamba")


def _recurrence_fp64(q, k, v, g, beta):
    """S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t / sqrt(d)."""
    B, T, H, D = q.shape
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    S = torch.zeros(B, H, D, D, dtype=torch.float64)
    eye = torch.eye(D, dtype=torch.float64)
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t][..., None, None]
        a = g[:, t].exp()[..., None, None]
        S = a * S @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * vt[..., :, None] * kt[..., None, :]
        out[:, t] = (S @ q[:, t][..., None])[..., 0] * D ** -0.5
    return out


def test_delta_rule_core_matches_the_formula():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    torch.manual_seed(0)
    B, T, H, D = 2, 70, 2, 8          # T not a multiple of the chunk size 64
    q, k = (F.normalize(torch.randn(B, T, H, D), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D)
    g = -torch.rand(B, T, H) * 0.5
    beta = torch.rand(B, T, H)
    o, _ = M._fla_naive()(q, k, v, g, beta, chunk_size=64)
    ref = _recurrence_fp64(q, k, v, g, beta)
    assert (o.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    o2, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    assert (o2.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    # The failure the argument order guards against: g and beta swapped.
    bad, _ = M._fla_naive()(q, k, v, beta, g, chunk_size=64)
    assert (bad.double() - ref).abs().max().item() > 0.1 * ref.abs().max().item()


def test_mixer_is_causal_and_trains():
    torch.manual_seed(1)
    cfg = _cfg(gdn_ratio=1)
    mix = M.GatedDeltaNet(cfg)
    x = torch.randn(2, 40, cfg.d_model, requires_grad=True)
    y = mix(x)
    x2 = x.detach().clone()
    x2[:, 25:] += torch.randn(2, 15, cfg.d_model)
    y2 = mix(x2)
    assert torch.equal(y[:, :25], y2[:, :25])
    assert not torch.allclose(y[:, 25:], y2[:, 25:])
    y.square().mean().backward()
    for n, p in mix.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_compare_run(tmp_path, text_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", "bf16,fp8-delta_matching",
           "--arch", "gdn-hybrid", "--model", "gdn_ratio=1", "--steps", "3", "--diag-every", "1", "--val-batches",
           "1", "--data-dir", str(tmp_path / "data"), "--text-dir", str(text_dir), "--device", "cpu",
           "--no-progress", "--no-save", "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("bf16", "fp8-delta_matching"):
        lines = [json.loads(l) for l in (tmp_path / "run" / f"{mode}.jsonl").read_text().splitlines()]
        steps = [r for r in lines if r.get("type") == "step"]
        assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
        meta = [r for r in lines if r.get("type") == "meta"][0]
        assert meta["model"]["arch"] == "gdn-hybrid" and meta["model"]["gdn_ratio"] == 1
        if mode != "bf16":
            assert sorted(steps[0]["diag"]) == ["layer1"]     # the one attention layer (layer0 is GDN)
    bad = subprocess.run(cmd[:-2] + ["--out", str(tmp_path / "r2"), "--model", "n_layers=1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "n_layers >= 2" in bad.stderr + bad.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla-core's Triton kernel)")
def test_cuda_mixer_under_autocast_matches_the_cpu_reference():
    """The CUDA path under BF16 autocast, as the trainer calls it: fla-core's Triton
    `chunk_gated_delta_rule` where fla-core allows its backward, else its PyTorch reference on
    the GPU (M._gdn_triton_refusal: fla-core 0.6 refuses Triton 3.4-3.7.0 on Hopper, the device
    image's 3.6.0). The RMSNorm output x is FP32 under autocast while the projections and the
    convolution give BF16, and the Triton kernel refuses mixed operands ("Both operands must be
    same dtype", the 2026-12-07 device smoke run). Forward and backward run, and the output
    matches the same mixer on the CPU (fla's PyTorch reference, FP32) to BF16 accuracy."""
    torch.manual_seed(2)
    cfg = _cfg(gdn_ratio=1)
    mix = M.GatedDeltaNet(cfg)
    x = torch.randn(2, 150, cfg.d_model)
    ref = mix(x).detach()
    mix_c = mix.cuda()
    xc = x.cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mix_c(xc)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(xc.grad).all() and xc.grad.abs().sum() > 0
    err = (y.float().cpu() - ref).norm() / ref.norm()
    assert err < 3e-2, err
