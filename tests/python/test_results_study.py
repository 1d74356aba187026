"""Issue 6 tooling: checkpoints, hooks, the kernel and masking probes, the results page.

One module fixture trains the smoke model a few steps in bf16 and fp8-stale on
real text (no network; see conftest.text_dir) and saves checkpoints; the tests
probe those. CPU only (the reference op); each test well under 30 s on 2 cores.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fp8attn.train import compare, probe, results
from fp8attn.train.capture import ActivationScales, CoreCapture, channel_scales, zero_attention_output
from fp8attn.train.checkpoint import load_checkpoint, save_checkpoint
from fp8attn.train.model import preset_model_config
from fp8attn.train.trainer import build_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, text_dir) -> Path:
    """8 steps of the smoke preset in bf16 and fp8-stale, checkpoints at step 4 and the end."""
    out = tmp_path_factory.mktemp("study")
    args = compare.parse_args(["--preset", "smoke", "--modes", "bf16,fp8-stale", "--steps", "8",
                               "--diag-every", "2", "--val-every", "4", "--val-batches", "2",
                               "--save-at", "4", "--data-dir", str(out / "data"), "--text-dir", str(text_dir),
                               "--device", "cpu", "--no-progress", "--out", str(out)])
    compare.run(args)
    return out


def _tokens(vocab: int, b: int = 2, s: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, s + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# ---- checkpoints -----------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    cfg = preset_model_config("smoke", attn_mode="fp8-stale", qk_norm=False)
    model = build_model(cfg, seed=3)
    with torch.no_grad():  # move off the init so a silent re-init would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_checkpoint(tmp_path / "m.pt", model, mode="fp8-stale", step=7, train_config={"lr": 0.1},
                           data_root="data/x", init_fingerprint="abc")
    loaded, info = load_checkpoint(path)
    assert info["mode"] == "fp8-stale" and info["step"] == 7 and info["data_root"] == "data/x"
    assert info["model_config"] == cfg.to_dict() and info["train_config"] == {"lr": 0.1}
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    x, _ = _tokens(cfg.vocab_size)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    # The attention mode can be switched on load; the weights stay.
    other, _ = load_checkpoint(path, attn_mode="bf16")
    assert other.cfg.attn_mode == "bf16" and torch.equal(other.embed.weight, model.embed.weight)
    torch.save({"state_dict": sd}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not an"):
        load_checkpoint(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


def test_trainer_writes_checkpoints_that_reproduce_the_val_loss(run_dir):
    for mode in ("bf16", "fp8-stale"):
        final, mid = run_dir / f"{mode}.pt", run_dir / f"{mode}.step4.pt"
        assert final.is_file() and mid.is_file()
        log = [json.loads(line) for line in (run_dir / f"{mode}.jsonl").open()]
        summary = log[-1]
        assert summary["type"] == "summary" and summary["checkpoint"] == final.name
        model, info = load_checkpoint(final)
        assert info["step"] == 8 and info["mode"] == mode
        # The saved weights give the logged final val loss (same fixed val batches).
        r = probe.probe_checkpoint(final, device="cpu", batch_size=2)   # masking: the run's val batches
        assert r["masking"]["base"] == pytest.approx(summary["final_val_loss"], rel=1e-6)
        _, mid_info = load_checkpoint(mid)
        assert mid_info["step"] == 4
        # Q/K channel scales are logged at the diagnostic steps for every mode (no QK-norm needed).
        scales = [r for r in log if r.get("type") == "step" and "act_scales" in r]
        assert [r["step"] for r in scales] == [0, 2, 4, 6]
        assert set(scales[0]["act_scales"]) == {"layer0", "layer1"}


# ---- hooks -------------------------------------------------------------------------


def test_core_capture_records_qkv_and_the_gradient_of_o():
    cfg = preset_model_config("smoke", attn_mode="bf16")
    model = build_model(cfg, seed=1)
    x, y = _tokens(cfg.vocab_size)
    with CoreCapture(model) as cap:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    assert list(cap.records) == ["layer0", "layer1"]
    r = cap.records["layer1"]
    assert r["q"].shape == (2, cfg.n_heads, 64, cfg.head_dim)
    assert r["k"].shape == r["v"].shape == (2, cfg.n_kv_heads, 64, cfg.head_dim)
    assert r["do"].shape == r["o"].shape == r["q"].shape
    # dO is the gradient of O: the attention output projection's weight gradient is dO-based,
    # dL/dWo = (dY)^T O_flat, and dO = dY Wo, so <dO, O> summed equals <dL/dWo, Wo>.
    wo = model.blocks[1].attn.wo.weight
    o_flat = r["o"].transpose(1, 2).reshape(2 * 64, -1)
    do_flat = r["do"].transpose(1, 2).reshape(2 * 64, -1)
    assert float((do_flat * o_flat).sum()) == pytest.approx(float((wo.grad * wo.detach()).sum()), rel=1e-4, abs=1e-9)
    # Hooks are gone after the context.
    assert not model.blocks[1].attn.core._forward_hooks


def test_channel_scales_merge_rope_pairs():
    x = torch.zeros(2, 3, 5, 8)
    x[..., 0] = 3.0          # channel 0 pairs with channel 4
    x[..., 4] = 4.0
    x[..., 1] = 2.0
    s = channel_scales(x)
    assert s.shape == (4,)
    assert torch.allclose(s, torch.tensor([math.sqrt((9 + 16) / 2), math.sqrt(2.0), 0.0, 0.0]))
    # RoPE's rotation of a pair leaves its scale unchanged.
    c, sn = math.cos(0.7), math.sin(0.7)
    rot = torch.stack([x[..., 0] * c - x[..., 4] * sn, x[..., 0] * sn + x[..., 4] * c], -1)
    y = x.clone()
    y[..., 0], y[..., 4] = rot[..., 0], rot[..., 1]
    assert torch.allclose(channel_scales(y), s)
    cfg = preset_model_config("smoke", qk_norm=False)
    model = build_model(cfg, seed=2)
    with ActivationScales(model) as sc:
        model(_tokens(cfg.vocab_size)[0])
    st = sc.stats()
    assert set(st) == {"layer0", "layer1"}
    assert all(v[0] > 0 and 4 / (cfg.head_dim // 2) <= v[1] <= 1 for v in st.values())


def test_zero_attention_output_equals_a_zeroed_output_projection():
    cfg = preset_model_config("smoke")
    model = build_model(cfg, seed=4).eval()
    x, _ = _tokens(cfg.vocab_size)
    with torch.no_grad():
        base = model(x)
        with zero_attention_output(model, -1):
            masked = model(x)
        again = model(x)
        model.blocks[-1].attn.wo.weight.zero_()
        ref = model(x)
    assert torch.equal(again, base)            # the hook is removed on exit
    assert not torch.equal(masked, base)
    assert torch.allclose(masked, ref, atol=1e-6)
    with pytest.raises(ValueError, match="layer"):
        with zero_attention_output(model, 5):
            pass


# ---- probes --------------------------------------------------------------------------


def test_kernel_probe_stale_residual_far_above_delta_matching(run_dir):
    r = probe.probe_checkpoint(run_dir / "fp8-stale.pt", device="cpu", batch_size=2, val_batches=1)
    k = r["kernel"]
    assert set(k["layers"]) == {"layer0", "layer1"}
    st, md, dm = (k["all"][m] for m in ("stale", "matched_do", "delta_matching"))
    assert st["rows"] == dm["rows"] == 2 * 2 * 4 * 64      # layers x batch x heads x seqlen
    # Delta-Matching: row sums of the FP32 dS vanish to FP32 rounding, eps == 0 by definition.
    # (Medians: a nearly one-hot row is rounding noise with a residual up to 1 in any mode.)
    assert dm["rowsum_pre"]["p50"] < 1e-5
    assert dm["eps"]["absmax"] == 0.0
    # The failure it guards against: the stale delta leaves row sums orders of magnitude larger.
    assert st["rowsum_pre"]["p50"] > 100 * dm["rowsum_pre"]["p50"]
    assert st["rowsum_pre"]["mean"] > 1e-3 and st["eps"]["absmax"] > 0
    assert md["rowsum_pre"]["p50"] > 10 * dm["rowsum_pre"]["p50"]
    # After the FP8 cast DM is still cleaner than stale.
    rat = k["ratios"]["stale/delta_matching"]
    assert rat["pre_p50"] > 100 and rat["post"] > 1.0 and rat["post_p50"] > 1.0


def test_masking_probe_last_layer_matters_after_training(run_dir):
    r = probe.probe_checkpoint(run_dir / "bf16.pt", device="cpu", batch_size=2, mask_layers="all")
    assert set(r["masking"]["layers"]) == {"0", "1"}
    inc = r["masking"]["layers"]["1"]["increase"]
    assert math.isfinite(inc) and inc > 0
    assert r["masking"]["layers"]["1"]["loss"] == pytest.approx(r["masking"]["base"] + inc)


def test_probe_cli_and_results_page(run_dir, tmp_path):
    probe.main(["--run-dir", str(run_dir), "--batch-size", "2", "--val-batches", "1", "--device", "cpu"])
    pj = json.loads((run_dir / "probe" / "probe.json").read_text())
    assert [c["mode"] for c in pj["checkpoints"]] == ["bf16", "fp8-stale"]
    assert pj["provenance"]["command"].startswith("python")
    for f in ("probe.md", "probe_rowsum.png", "probe_eps.png"):
        assert (run_dir / "probe" / f).stat().st_size > 0
    out = tmp_path / "docs" / "results.md"
    results.main(["--run", f"smoke={run_dir}", "--prior", str(REPO / "docs/runs/gpu-50m-h200-2026-11-29"),
                  "--out", str(out)])
    text = out.read_text()
    for section in ("## Verdict", "## 1. Kernel probe", "## 2. Training comparison", "## 3. Configurations tried",
                    "## 4. Channel-gain growth", "## 5. Attention-output masking probe", "## 6. Prior evidence",
                    "## 7. Versions"):
        assert section in text
    assert "3.3879" in text                        # the gpu-50m DM val loss, read from its summary.json
    assert "--preset smoke" in text                 # the exact command of the run
    figs = sorted(p.name for p in (tmp_path / "docs" / "results").iterdir())
    assert figs == sorted([f"smoke-{n}.png" for n in ("loss", "rowsum", "gains", "probe_rowsum", "probe_eps")]
                          + ["smoke-probe.md"])
    for name in figs:                               # every figure is linked from the page
        assert f"results/{name}" in text


def test_results_page_reads_a_run_cut_short(run_dir, tmp_path):
    cut = tmp_path / "cut"
    cut.mkdir()
    lines = (run_dir / "fp8-stale.jsonl").read_text().splitlines()
    (cut / "fp8-stale.jsonl").write_text("\n".join(lines[:6]) + "\n")   # meta + first steps, no summary
    n_steps = sum(json.loads(line)["type"] == "step" for line in lines[:6])
    (cut / "bf16.jsonl").write_text((run_dir / "bf16.jsonl").read_text())
    run = results.load_run(cut)
    assert not run["complete"]
    s = {x["mode"]: x for x in run["summaries"]}
    assert s["fp8-stale"]["incomplete"] and s["fp8-stale"]["steps_done"] == n_steps >= 3
    text = results.build({"cut": run}, [], tmp_path / "r.md", tmp_path / "figs", None)
    assert "INCOMPLETE" in text and "cut short" in text
    (cut / "provenance.json").write_text((run_dir / "provenance.json").read_text())
    text = results.build({"cut": results.load_run(cut)}, [], tmp_path / "r.md", tmp_path / "figs", None)
    assert "--preset smoke" in text               # the command survives a run cut short


def test_compare_model_overrides():
    assert compare.parse_model_overrides(["head_dim=256", "n_heads=2,n_kv_heads=1"]) == \
        {"head_dim": 256, "n_heads": 2, "n_kv_heads": 1}
    with pytest.raises(SystemExit, match="--model"):
        compare.parse_model_overrides(["vocab_size=3"])
    with pytest.raises(SystemExit, match="--model"):
        compare.parse_model_overrides(["head_dim=big"])


def test_probe_cli_keeps_good_results_when_one_checkpoint_fails(run_dir, tmp_path):
    bad = tmp_path / "fp8-matched_do.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="1 of 2 checkpoints failed"):
        probe.main(["--ckpt", str(run_dir / "fp8-stale.pt"), "--ckpt", str(bad), "--batch-size", "1",
                    "--val-batches", "1", "--device", "cpu", "--out", str(tmp_path / "p")])
    pj = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert pj["checkpoints"][0]["mode"] == "fp8-stale" and "kernel" in pj["checkpoints"][0]
    assert "error" in pj["checkpoints"][1]
    assert "probe failed" in (tmp_path / "p" / "probe.md").read_text()


def test_logit_scan_stale_error_grows_with_logit_scale(tmp_path):
    from fp8attn.train import logit_scan
    rows = logit_scan.scan([1.0, 8.0], head_dim=64, seq_len=256, heads_q=2, heads_kv=1, seed=0)
    lo, hi = rows
    assert hi["entropy"] < lo["entropy"]                              # sharper attention
    for r in rows:
        assert r["modes"]["delta_matching"]["pre_p50"] < 1e-5           # DM: zero row sums to FP32 rounding
        assert r["modes"]["stale"]["pre_p50"] > 100 * r["modes"]["delta_matching"]["pre_p50"]
    assert hi["modes"]["stale"]["pre_p50"] > 3 * lo["modes"]["stale"]["pre_p50"]
    assert hi["stale/DM"]["post_p50"] > lo["stale/DM"]["post_p50"] > 1.0
    logit_scan.main(["--scales", "1,4", "--head-dim", "32", "--seq-len", "128", "--out", str(tmp_path / "s")])
    assert json.loads((tmp_path / "s" / "scan.json").read_text())["provenance"]["command"].startswith(
        "python -m fp8attn.train.logit_scan")
    out = tmp_path / "r.md"
    results.main(["--scan", str(tmp_path / "s"), "--out", str(out)])
    assert "logit scale" in out.read_text() and (tmp_path / "r" / "logit_scan-0.png").is_file()


def test_kernel_probe_refuses_packed_checkpoints(tmp_path):
    cfg = preset_model_config("smoke", attn_mode="fp8-stale", packed=True)
    path = save_checkpoint(tmp_path / "p.pt", build_model(cfg, seed=0), mode="fp8-stale", step=1,
                           data_root=str(tmp_path))
    with pytest.raises(ValueError, match="packed"):
        probe.probe_checkpoint(path, device="cpu")


def test_attention_logit_stats_uniform_and_one_hot():
    # Uniform attention (Q = 0): logit std 0, entropy = mean_i log(i + 1) over the
    # causal rows. One-hot attention (huge aligned logits on the diagonal): entropy
    # ~ 0 and a large max logit. These are the numbers that tell a collapsed run.
    from fp8attn.train.capture import attention_logit_stats
    s, d = 16, 8
    k = torch.randn(1, 2, s, d)
    st = attention_logit_stats(torch.zeros(1, 4, s, d), k)
    want = torch.log(torch.arange(1, s + 1, dtype=torch.float32)).mean()
    assert st[0].item() == 0.0 and abs(st[2].item() - want.item()) < 1e-5
    q = torch.zeros(1, 2, s, s)
    q[0, :, torch.arange(s), torch.arange(s)] = 1000.0
    kk = torch.zeros(1, 1, s, s)
    kk[0, 0, torch.arange(s), torch.arange(s)] = 1.0
    st1 = attention_logit_stats(q, kk)
    assert st1[2].item() < 1e-6 and st1[1].item() > 100
    assert torch.isfinite(st1).all()


def test_trainer_logs_attention_logit_stats(tmp_path, text_dir):
    from fp8attn.train.report import read_log
    out = tmp_path / "run"
    compare.main(["--preset", "smoke", "--modes", "bf16", "--steps", "3", "--diag-every", "1",
                  "--val-every", "3", "--val-batches", "1", "--device", "cpu", "--no-progress", "--no-save",
                  "--data-dir", str(tmp_path / "data"), "--text-dir", str(text_dir), "--out", str(out)])
    log = read_log(out / "bf16.jsonl")
    st = log["steps"][-1]["attn_logits"]
    assert set(st) == {"layer0", "layer1"} and all(len(v) == 3 and v[2] > 0 for v in st.values())
    assert log["summary"]["entropy_min"] == min(v[2] for v in st.values())


def test_recipe_study_captured_activations_table(run_dir):
    """scripts/recipe_study.py --captured (issue #18 item 4 (b)): the captured Q, K, V are the
    ones the model attends with, under the float64 reference's assumptions (causal, tau =
    1 / sqrt(head_dim), GQA head map): exact attention of them reproduces the model's own
    O to its BF16 rounding. A wrong assumption fails that (shown: the non-causal O, and tau
    doubled). The error table then has every layer x recipe x option, each error finite
    and in (0, 0.5) (FP8 is lossy, never exact, and not garbage)."""
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    import recipe_study as rs
    ckpt = run_dir / "bf16.pt"
    heads = list(rs.captured_heads(ckpt, n_heads=2))
    assert [(name, h) for name, h, *_ in heads] == [("layer0", 0), ("layer0", 1), ("layer1", 0), ("layer1", 1)]
    for name, h, q, k, v, do, o in heads:
        tau = 1 / math.sqrt(q.shape[1])
        # The bf16 mode attends in BF16 (inputs and O rounded: ~2^-9 relative each): measured
        # 2.6e-3; the wrong assumptions give 0.85 (non-causal) and 0.08-0.49 (tau doubled):
        # at least 4x the bound.
        assert rs.rel(rs.exact(q, k, v, do, tau, True)["o"], o) < 2 ** -7, (name, h)
        assert rs.rel(rs.exact(q, k, v, do, tau, False)["o"], o) > 2 ** -5, (name, h)
        assert rs.rel(rs.exact(q, k, v, do, 2 * tau, True)["o"], o) > 2 ** -5, (name, h)
    table = rs.captured_table(ckpt, n_heads=1)
    assert list(table) == ["layer0", "layer1"]
    for name, res in table.items():
        assert set(res) == {(sc, opt) for sc in ("row", "tile") for opt, _, _ in rs.OPTIONS}
        for cfg, errs in res.items():
            assert set(errs) == {"o", "lse", "dq", "dk", "dv"}
            assert all(math.isfinite(e) and 0 < e < 0.5 for e in errs.values()), (name, cfg, errs)


# ---- the fp8-cudnn mode in the downstream tools --------------------------------------


def _with_cudnn_checkpoint(run_dir: Path, d: Path, modes=("bf16",)) -> Path:
    """A run dir `d` with the fixture run's `modes` (links) and an fp8-cudnn.pt / .jsonl: the
    bf16 weights saved as a checkpoint of mode fp8-cudnn (smoke: head_dim 32, so fp8-cudnn
    cannot run here whatever the machine), its log the bf16 log with the mode renamed."""
    from fp8attn.train.model import CUDNN_MODE
    d.mkdir(parents=True, exist_ok=True)
    for m in modes:
        for ext in (".pt", ".jsonl"):
            (d / f"{m}{ext}").symlink_to(run_dir / f"{m}{ext}")
    model, info = load_checkpoint(run_dir / "bf16.pt", attn_mode=CUDNN_MODE)
    save_checkpoint(d / f"{CUDNN_MODE}.pt", model, mode=CUDNN_MODE, step=info["step"],
                    train_config=info["train_config"], data_root=info["data_root"])
    recs = [json.loads(line) for line in (run_dir / "bf16.jsonl").open()]
    for r in recs:
        if "mode" in r:
            r["mode"] = CUDNN_MODE
    (d / f"{CUDNN_MODE}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


def test_find_checkpoints_and_load_run_include_fp8_cudnn(run_dir, tmp_path):
    """Every mode of model.ATTN_MODES is found (break, 2026-12-07: the GPU smoke run's
    fp8-cudnn.pt and fp8-cudnn.jsonl were silently left out of probe / retrieval / results)."""
    from fp8attn.train.model import ATTN_MODES
    d = _with_cudnn_checkpoint(run_dir, tmp_path / "run", modes=("bf16", "fp8-stale"))
    assert [p.name for p in probe.find_checkpoints(d)] == ["bf16.pt", "fp8-stale.pt", "fp8-cudnn.pt"]
    for m in ATTN_MODES:                                 # the order is model.ATTN_MODES'
        (tmp_path / "all" / f"{m}.pt").parent.mkdir(exist_ok=True)
        (tmp_path / "all" / f"{m}.pt").write_bytes(b"")
    assert [p.stem for p in probe.find_checkpoints(tmp_path / "all")] == list(ATTN_MODES)
    run = results.load_run(d)
    assert [s["mode"] for s in run["summaries"]] == ["bf16", "fp8-stale", "fp8-cudnn"]
    text = results.build({"r": run}, [], tmp_path / "r.md", tmp_path / "figs", None)
    assert "fp8-cudnn (cuDNN FP8, delayed scaling) val" in text        # findings: compare's row label
    assert "| fp8-cudnn (cuDNN FP8, delayed scaling) |" in text         # the training table's row
    assert "fp8-cudnn - bf16" in text                                   # its gap in the stress table


def test_probe_skips_an_fp8_cudnn_checkpoint_it_cannot_run(run_dir, tmp_path, capsys):
    """On a device where fp8-cudnn cannot run, probe says why in one line, records the
    checkpoint as skipped and probes the others (no failure); named with --modes it stops."""
    d = _with_cudnn_checkpoint(run_dir, tmp_path / "run")
    probe.main(["--run-dir", str(d), "--batch-size", "1", "--val-batches", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("[probe] skipped"))
    assert "fp8-cudnn" in line and "head_dim 32" in line and "needs a CUDA GPU (this run is on cpu)" in line
    pj = json.loads((d / "probe" / "probe.json").read_text())
    assert [c["mode"] for c in pj["checkpoints"]] == ["bf16", "fp8-cudnn"]
    assert "kernel" in pj["checkpoints"][0] and "head_dim 32" in pj["checkpoints"][1]["skipped"]
    md = (d / "probe" / "probe.md").read_text()
    assert "## fp8-cudnn (cuDNN FP8, delayed scaling): skipped" in md
    run = results.load_run(d)
    text = results.build({"r": run}, [], tmp_path / "r.md", tmp_path / "figs", None)
    assert "probe skipped `" in text and "probe failed" not in text
    with pytest.raises(SystemExit, match="--modes fp8-cudnn: cannot run .*head_dim 32"):
        probe.main(["--run-dir", str(d), "--modes", "bf16,fp8-cudnn", "--device", "cpu", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--ckpt .*fp8-cudnn.pt: cannot run .*head_dim 32"):
        probe.main(["--ckpt", str(d / "fp8-cudnn.pt"), "--device", "cpu", "--out", str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
