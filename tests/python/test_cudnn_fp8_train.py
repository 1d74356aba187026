"""The training harness's fp8-cudnn mode (cuDNN FP8 SDPA with delayed scaling) on the CPU.

* compare skips the mode where it cannot run (here: the CPU), says why, runs the other
  modes, lists it as skipped in report.md / summary.json; --modes fp8-cudnn alone stops.
* --model cudnn_amax_history_len / cudnn_margin; the report's row label and note.
* The model keeps the per-layer scaling state as buffers (outside the weights'
  fingerprint), checkpoints round-trip it, checkpoints move between modes.
* A whole compare run with tests/python/fake_cudnn.py standing in for cuDNN: the mode
  trains, its state is in the checkpoint, the report describes it.
* GPU (marked gpu; skipped without CUDA sm_90 and the frontend): a tiny head_dim-128
  model trains a few steps in fp8-cudnn with a finite loss close to bf16's.
CPU: ~20 s on 2 cores.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8attn import cudnn_fp8_attention as cfa  # noqa: E402
from fp8attn.train import compare  # noqa: E402
from fp8attn.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from fp8attn.train.model import CUDNN_MODE, ModelConfig, preset_model_config  # noqa: E402
from fp8attn.train.report import markdown_table, mode_label  # noqa: E402
from fp8attn.train.trainer import build_model, init_fingerprint  # noqa: E402

from fake_cudnn import install_for_training  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    return lambda **kw: install_for_training(monkeypatch, cfa, **kw)


def _gpu_ready():
    """None where the GPU test can run (CUDA sm_90 and the frontend), else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return cfa.unavailable_reason("cuda", 128)


# ---- compare, report ------------------------------------------------------------------

def _compare(tmp_path, text_dir, modes, *extra):
    args = compare.parse_args(["--preset", "smoke", "--modes", modes, "--steps", "3", "--val-batches", "1",
                               "--diag-every", "2", "--data-dir", str(tmp_path / "data"), "--text-dir", str(text_dir),
                               "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run"), *extra])
    return compare.run(args)


def test_compare_skips_fp8_cudnn_on_the_cpu_and_runs_the_rest(tmp_path, text_dir, capsys):
    _, table, summaries = _compare(tmp_path, text_dir, "bf16,fp8-cudnn")
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("[compare] fp8-cudnn skipped: "))
    assert "needs a CUDA GPU (this run is on cpu)" in line and "head_dim 32" in line and "the other modes run" in line
    assert [s["mode"] for s in summaries] == ["bf16"]
    assert "| fp8-cudnn (skipped) | n/a |" in table
    report = (tmp_path / "run" / "report.md").read_text()
    assert "fp8-cudnn skipped: needs a CUDA GPU (this run is on cpu); head_dim 32" in report
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["modes"] == ["bf16"] and "head_dim 32" in summary["skipped"]["fp8-cudnn"]
    with pytest.raises(SystemExit, match="--modes: nothing to run: fp8-cudnn skipped: needs a CUDA GPU"):
        _compare(tmp_path / "b", text_dir, "fp8-cudnn")


def test_fp8_cudnn_is_opt_in_until_validated_on_the_gpu():
    """A plain compare run trains bf16 and the three fp8attn modes; fp8-cudnn only when named
    (its GPU path has not run on the H200 yet: compare.DEFAULT_MODES' NOTE)."""
    args = compare.parse_args(["--out", "unused"])
    assert args.modes.split(",") == ["bf16", "fp8-stale", "fp8-matched_do", "fp8-delta_matching"]
    assert CUDNN_MODE in compare.parse_args(["--out", "unused", "--modes", f"bf16,{CUDNN_MODE}"]).modes.split(",")


def _agree_worker(rank, world, init_file, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        why = None if rank == 0 else "needs a CUDA GPU (test: rank 1 only)"
        Path(out_dir, f"{rank}.txt").write_text(repr(compare.agreed_reason(why)))
        Path(out_dir, f"none{rank}.txt").write_text(repr(compare.agreed_reason(None)))
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_agree_on_skipping_fp8_cudnn(tmp_path):
    """Under torchrun every rank takes one decision: where one rank cannot run fp8-cudnn, all
    skip it, naming that rank (break test, 2026-12-04: rank 0 trained bf16 while rank 1
    trained fp8-cudnn, DDP averaging their gradients). Without a process group the local
    reason is the answer."""
    assert compare.agreed_reason("x") == "x" and compare.agreed_reason(None) is None
    import torch.multiprocessing as mp  # noqa: PLC0415
    mp.spawn(_agree_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        assert (tmp_path / f"{r}.txt").read_text() == repr("rank 1: needs a CUDA GPU (test: rank 1 only)")
        assert (tmp_path / f"none{r}.txt").read_text() == "None"


def test_model_overrides_for_the_scaling_state():
    assert compare.parse_model_overrides(["cudnn_amax_history_len=16,cudnn_margin=1"]) == {
        "cudnn_amax_history_len": 16, "cudnn_margin": 1}
    with pytest.raises(SystemExit, match="--model: cudnn_amax_history_len needs an int"):
        compare.parse_model_overrides(["cudnn_amax_history_len=1.5"])
    with pytest.raises(ValueError, match=r"cudnn_amax_history_len must be an int in \[1, 1048576\], got 0"):
        ModelConfig(cudnn_amax_history_len=0)
    with pytest.raises(ValueError, match=r"cudnn_margin must be an int in \[0, 64\], got -1"):
        ModelConfig(cudnn_margin=-1)
    # the upper bounds (break test, 2026-12-04: margin 200 trained to NaN, 1e13 rows were accepted)
    with pytest.raises(ValueError, match="cudnn_margin must be an int in"):
        ModelConfig(cudnn_margin=200)
    with pytest.raises(ValueError, match="cudnn_amax_history_len must be an int in"):
        ModelConfig(cudnn_amax_history_len=10 ** 13)


def test_report_rows_and_labels():
    base = {"final_train_loss": 5.0, "final_val_loss": 5.1, "train_time_s": 1.0}
    rows = [dict(base, mode="bf16"), dict(base, mode="fp8-cudnn", final_val_loss=5.2)]
    table = markdown_table(rows, {"fp8-x": "why"})
    body = [l for l in table.splitlines()[2:]]
    assert body[1].startswith(f"| {mode_label('fp8-cudnn')} | 5.0000 | 5.2000 | +0.1000 | n/a |")
    assert mode_label("fp8-cudnn") == "fp8-cudnn (cuDNN FP8, delayed scaling)" and mode_label("bf16") == "bf16"
    assert body[2] == "| fp8-x (skipped) | " + " | ".join(["n/a"] * 7) + " |"


# ---- the model, checkpoints, a whole run with the emulated backend ---------------------------

def test_model_holds_the_state_as_buffers_outside_the_fingerprint(tmp_path):
    cfg = preset_model_config("smoke", head_dim=128, attn_mode=CUDNN_MODE, cudnn_amax_history_len=8)
    m = build_model(cfg, seed=5)
    keys = [k for k in m.state_dict() if "cudnn_fp8" in k]
    assert keys == [f"blocks.{i}.attn.core.cudnn_fp8.{n}" for i in range(2) for n in ("amax_history", "scale")]
    assert m.blocks[0].attn.core.cudnn_fp8.amax_history.shape == (8, 10)
    bf = build_model(ModelConfig(**{**cfg.to_dict(), "attn_mode": "bf16"}), seed=5)
    assert init_fingerprint(m) == init_fingerprint(bf) and m.num_params() == bf.num_params()
    # checkpoint round trip of the state
    st = m.blocks[1].attn.core.cudnn_fp8
    st.record(["q", "dK"], torch.tensor([3.0, 0.5]))
    st.update()
    p = save_checkpoint(tmp_path / "c.pt", m, mode=CUDNN_MODE, step=1)
    back, info = load_checkpoint(p)
    assert info["mode"] == CUDNN_MODE
    got = back.blocks[1].attn.core.cudnn_fp8
    assert torch.equal(got.amax_history, st.amax_history) and torch.equal(got.scale, st.scale)
    # across modes: the state is dropped (bf16) / fresh (a checkpoint without it)
    as_bf16, _ = load_checkpoint(p, attn_mode="bf16")
    assert not any("cudnn_fp8" in k for k in as_bf16.state_dict())
    q = save_checkpoint(tmp_path / "b.pt", bf, mode="bf16", step=1)
    as_cudnn, _ = load_checkpoint(q, attn_mode=CUDNN_MODE)
    assert torch.equal(as_cudnn.blocks[1].attn.core.cudnn_fp8.scale, cfa.initial_scales())
    # switching in place
    bf.with_attn_mode(CUDNN_MODE)
    assert set(bf.state_dict()) == set(m.state_dict())
    bf.with_attn_mode("fp8-stale")
    assert not any("cudnn_fp8" in k for k in bf.state_dict())


def test_compare_run_with_the_emulated_backend(fake, tmp_path, text_dir, capsys):
    """fp8-cudnn trains end to end (trainer, checkpoint, report) where the backend works:
    the emulation stands in for cuDNN on the CPU. head_dim 128, GQA 4:2 (native)."""
    fake()
    _, table, summaries = _compare(tmp_path, text_dir, "bf16,fp8-cudnn", "--model", "head_dim=128",
                                   "--model", "cudnn_amax_history_len=4")
    assert "skipped" not in capsys.readouterr().out
    by = {s["mode"]: s for s in summaries}
    assert set(by) == {"bf16", "fp8-cudnn"} and by["fp8-cudnn"]["init_fingerprint"] == by["bf16"]["init_fingerprint"]
    assert math.isfinite(by["fp8-cudnn"]["final_val_loss"])
    assert abs(by["fp8-cudnn"]["final_val_loss"] - by["bf16"]["final_val_loss"]) < 0.1
    assert by["fp8-cudnn"]["rowsum_post_mean"] is None                 # no fp8attn diagnostics
    c = by["fp8-cudnn"]["cudnn_fp8"]
    assert c["amax_history_len"] == 4 and c["cudnn_frontend"] == "fake"
    assert [p["gqa"] for p in c["plans"]] == ["native"] and c["plans"][0]["shape"] == [8, 4, 2, 64, 128]
    assert f"| {mode_label('fp8-cudnn')} |" in table
    report = (tmp_path / "run" / "report.md").read_text()
    assert "TransformerEngine-style delayed scaling" in report and "last 4 amaxes" in report
    assert "the FP8 attention a user would pick instead of fp8attn" in report and "cuDNN's native GQA" in report
    # the trained state is in the checkpoint: 3 steps of amaxes in a 4-row history
    model, _ = load_checkpoint(tmp_path / "run" / "fp8-cudnn.pt")
    hist = model.blocks[0].attn.core.cudnn_fp8.amax_history
    assert hist[0].abs().sum() == 0 and (hist[1:, :5] > 0).all() and (hist[-1] > 0).all() and (model.blocks[0].attn.core.cudnn_fp8.scale != 1).any()
    log = [json.loads(l) for l in (tmp_path / "run" / "fp8-cudnn.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["type"] == "step"] == [0, 1, 2]


# ---- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_tiny_model_trains_close_to_bf16():
    """fp8-cudnn trains the tiny model along BF16's loss curve on 8 distinct batches.

    Not on a few batches repeated (memorization at this LR is chaotic: one different update
    sends the curve elsewhere). fp8-cudnn's first step runs at scale 1 (empty amax history, TE's
    initial scale, cudnn_fp8_attention's docstring), where dO / dP / the gradients underflow, so
    its early steps trail BF16 and the curves meet again once the history holds the amaxes.
    Measured on an H100 (2026-12-07): 2 batches x 4 at lr 3e-3 moved fp8-cudnn 0.80 from BF16 at
    step 3 (fp8attn's modes <= 0.07); on 8 distinct batches the largest step gap was 0.10 (step 5)
    and the final losses 6.347 vs 6.351."""
    why = _gpu_ready()
    if why:
        pytest.skip(f"fp8-cudnn: {why}")
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128,
                      mlp_hidden=512, max_seq_len=256, cudnn_amax_history_len=16)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 512, (4, 257), generator=g) for _ in range(8)]   # 8 steps, 8 batches
    losses = {}
    for mode in ("bf16", CUDNN_MODE):
        model = build_model(ModelConfig(**{**cfg.to_dict(), "attn_mode": mode}), seed=3).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[mode] = []
        for x in data:
            x = x.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[mode].append(float(loss.detach()))
    print("losses:", losses)
    assert all(math.isfinite(v) for v in losses[CUDNN_MODE])
    assert max(abs(a - b) for a, b in zip(losses["bf16"], losses[CUDNN_MODE])) < 0.25, losses
    assert abs(losses["bf16"][-1] - losses[CUDNN_MODE][-1]) < 0.05, losses
    assert losses[CUDNN_MODE][-1] < losses[CUDNN_MODE][0] - 0.3
