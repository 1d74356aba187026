"""The trainer's --optimizer switch (issue #22 item 2): AdamW, or torch.optim.Muon
on the hidden weight matrices with AdamW on the rest (trainer.make_optimizer)."""
import json

import pytest
import torch

from fp8attn.train import compare
from fp8attn.train.model import ModelConfig
from fp8attn.train.trainer import MuonAdamW, TrainConfig, build_model, make_optimizer, muon_params


def _model(tie=False):
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      mlp_hidden=64, max_seq_len=16, attn_mode="bf16", tie_embeddings=tie)
    return build_model(cfg, 0)


@pytest.mark.parametrize("tie", [False, True])
def test_muon_gets_exactly_the_hidden_matrices(tie):
    model = _model(tie)
    hidden, rest = muon_params(model)
    ids = [id(p) for p in hidden] + [id(p) for p in rest]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each parameter once
    names = {id(p): n for n, p in model.named_parameters()}
    assert hidden and all(p.dim() == 2 for p in hidden)
    assert not any(names[id(p)].startswith(("embed", "head")) for p in hidden)
    assert any(names[id(p)].startswith("embed") for p in rest)
    assert all(p.dim() < 2 or names[id(p)].startswith(("embed", "head")) for p in rest)
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-2))
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    assert len(opt.param_groups) == len(opt.muon.param_groups) + len(opt.adamw.param_groups)


def test_muon_step_orthogonalizes_and_state_round_trips():
    torch.manual_seed(0)
    model = _model()
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-2, weight_decay=0.0))
    hidden, _ = muon_params(model)
    before = [p.detach().clone() for p in hidden]
    x = torch.randint(0, 97, (2, 16))
    model(x).float().square().mean().backward()
    opt.step()
    # Muon's update of a matrix is its gradient (momentum) orthogonalized: the singular
    # values of the gradient's leading directions come out alike (Newton-Schulz pushes
    # them towards one), while the gradient's own spread widely.
    upd = hidden[0].detach() - before[0]
    sv_u = torch.linalg.svdvals(upd.double())
    sv_g = torch.linalg.svdvals(hidden[0].grad.double())
    half = len(sv_u) // 2
    assert (sv_u[:half] / sv_u[0]).min() > 0.5, sv_u
    assert (sv_g[:half] / sv_g[0]).min() < 0.5 * (sv_u[:half] / sv_u[0]).min(), sv_g
    state = opt.state_dict()
    opt2 = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-2, weight_decay=0.0))
    opt2.load_state_dict(state)
    for a, b in zip(opt.muon.state.values(), opt2.muon.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    with pytest.raises(ValueError, match="another --optimizer"):
        opt2.load_state_dict(make_optimizer(model, TrainConfig()).state_dict())
    with pytest.raises(ValueError, match="optimizer: expected one of"):
        make_optimizer(model, TrainConfig(optimizer="sgd"))


def test_compare_trains_with_muon(tmp_path, text_dir):
    out = tmp_path / "run"
    compare.main(["--preset", "smoke", "--device", "cpu", "--modes", "bf16,fp8-delta_matching", "--steps", "6",
                  "--optimizer", "muon", "--text-dir", str(text_dir), "--data-dir", str(tmp_path / "data"),
                  "--out", str(out), "--no-progress", "--no-save", "--diag-every", "3"])
    for mode in ("bf16", "fp8-delta_matching"):
        rows = [json.loads(x) for x in (out / f"{mode}.jsonl").read_text().splitlines() if x.strip()]
        meta = next(r for r in rows if r.get("type") == "meta")
        assert meta["train"]["optimizer"] == "muon"
        losses = [r["loss"] for r in rows if r.get("type") == "step"]
        assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert "Muon (hidden matrices) + AdamW" in (out / "report.md").read_text()


def test_muon_with_fsdp_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--optimizer muon: not supported with --fsdp"):
        compare.main(["--preset", "smoke", "--optimizer", "muon", "--fsdp", "--out", str(tmp_path / "x")])
