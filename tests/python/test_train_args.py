"""Trainer CLI (python -m fp8attn.train.compare / probe) on bad values: every one must stop
with a message naming the flag before any data or training work, never train a mode
and crash later, silently ignore the value, or produce NaN from a degenerate config."""
import json

import pytest

from fp8attn.train import compare, probe
from fp8attn.train.model import ModelConfig


def _run(tmp_path, argv):
    args = compare.parse_args(["--preset", "smoke", "--device", "cpu", "--steps", "3",
                               "--text-dir", str(tmp_path / "no-such-dir"), "--data-dir", str(tmp_path / "data"),
                               "--out", str(tmp_path / "run")] + argv)
    return compare.run(args)


@pytest.mark.parametrize("override", [
    "n_kv_heads=0",          # ZeroDivisionError
    "head_dim=0",            # crashed in gain_stats after the model was built
    "d_model=0",             # ZeroDivisionError in the init
    "n_layers=0", "n_layers=-1",   # trained a model without blocks
    "mlp_hidden=0",
    "rope_base=0",           # NaN losses, then a crash formatting them
    "rope_base=nan", "init_std=nan", "init_std=-1", "init_std=0",
    "fp8_block_size=100",    # failed only after the bf16 mode had trained
    "head_dim=300",          # idem (the fp8 op's head_dim limit)
    "fp8_grad_format=e3m4",  # not an FP8 format of the op
])
def test_compare_rejects_bad_model_overrides_before_any_work(tmp_path, override):
    # NOTE: the text dir does not exist, so reaching data preparation would raise RuntimeError.
    with pytest.raises(SystemExit, match="--model"):
        _run(tmp_path, ["--model", override])
    assert not (tmp_path / "run").exists()


def test_model_config_head_dim_limit_only_for_fp8_modes():
    ModelConfig(head_dim=300, n_heads=1, n_kv_heads=1, attn_mode="bf16")
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(head_dim=300, n_heads=1, n_kv_heads=1, attn_mode="fp8-stale")


@pytest.mark.parametrize("save_at", ["0", "-3", "4", "2,99"])
def test_compare_rejects_save_at_outside_the_run(tmp_path, save_at):
    with pytest.raises(SystemExit, match="--save-at"):
        _run(tmp_path, ["--save-at", save_at])


@pytest.mark.parametrize("max_mb", ["0", "-1"])
def test_compare_rejects_non_positive_max_mb(tmp_path, max_mb):
    with pytest.raises(SystemExit, match="--max-mb"):
        _run(tmp_path, ["--max-mb", max_mb])


def test_mode_line_of_a_mode_that_diverged_at_once():
    s = {"mode": "fp8-stale", "final_train_loss": None, "final_val_loss": None, "train_time_s": 1.0,
         "diverged": True}
    line = compare.mode_line(s)     # was: TypeError formatting None with :.4f
    assert "n/a" in line and "DIVERGED" in line


def test_fsdp_without_process_group_is_not_recorded_as_fsdp(tmp_path, text_dir, capsys):
    args = compare.parse_args(["--preset", "smoke", "--device", "cpu", "--steps", "1", "--modes", "bf16",
                               "--text-dir", str(text_dir), "--data-dir", str(tmp_path / "data"),
                               "--out", str(tmp_path / "run"), "--fsdp", "--no-save", "--no-progress",
                               "--val-batches", "1", "--diag-every", "0"])
    compare.run(args)
    assert "--fsdp has no effect" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["fsdp"] is False
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Diagnostics off" in report and "every 0 steps" not in report


@pytest.mark.parametrize("argv, flag", [(["--seq-len", "0"], "--seq-len"), (["--seq-len", "-5"], "--seq-len"),
                                        (["--threads", "-1"], "--threads"), (["--step", "0"], "--step")])
def test_probe_rejects_bad_flags(tmp_path, argv, flag, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(["--run-dir", str(tmp_path)] + argv)
    assert flag in capsys.readouterr().err


def test_compare_rejects_a_repeated_mode(tmp_path):
    with pytest.raises(SystemExit, match="--modes"):
        _run(tmp_path, ["--modes", "bf16,fp8-stale,bf16"])


@pytest.mark.parametrize("argv, flag", [
    (["--run", "a=x", "--run", "a=y"], "--run"),        # the first run was silently dropped
    (["--run", "a=x", "--scan", "/no/such/dir"], "--scan"),
    (["--run", "a=x", "--prior", "/no/such/dir"], "--prior"),
    (["--run", "a=x", "--verdict", "/no/such/file.md"], "--verdict"),
])
def test_results_rejects_bad_flags(argv, flag, capsys):
    from fp8attn.train import results
    with pytest.raises(SystemExit):
        results.parse_args(argv)
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["inf", "nan", "-1"])
def test_compare_rejects_a_non_finite_lr(tmp_path, lr):
    with pytest.raises(SystemExit, match="--lr"):      # inf was accepted: NaN weights after one step
        _run(tmp_path, ["--lr", lr])


def test_probe_names_the_missing_step(tmp_path):
    with pytest.raises(SystemExit, match=r"step7\.pt \(--step 7\)"):
        probe.main(["--run-dir", str(tmp_path), "--step", "7"])


@pytest.mark.parametrize("tool", ["probe", "retrieval"])
@pytest.mark.parametrize("modes,match", [
    ("fp8-stale@TILE", "unknown mode|unknown suffix"),      # was a traceback: FileNotFoundError
    ("fp8-stale@tile,,bf16", "an empty entry"),           # was "no checkpoint RUN/.pt"
    ("fp8-stale+smooth_k+hadamard", "out of order"),
    ("fp8-delta_matching@tile", "no checkpoint"),         # a valid name without its checkpoint
])
def test_checkpoint_tools_name_bad_modes_without_a_traceback(tmp_path, tool, modes, match):
    """probe / retrieval --modes: the compare grammar's messages, as a SystemExit naming --modes
    (a new-user trial, 2026-12-07, got tracebacks)."""
    from fp8attn.train import retrieval
    main = probe.main if tool == "probe" else retrieval.main
    with pytest.raises(SystemExit, match=f"--modes: .*({match})"):
        main(["--run-dir", str(tmp_path), "--modes", modes])


def test_model_override_given_twice_is_refused():
    with pytest.raises(SystemExit, match="--model: head_dim given twice"):   # the last one silently won
        compare.parse_model_overrides(["head_dim=64", "n_heads=2,head_dim=32"])


def test_compare_names_bad_init_from_text_dir_and_device_before_any_work(tmp_path, text_dir):
    """A garbage --init-from file, a missing --text-dir and --device cuda without a GPU ended
    in tracebacks after the data preparation (a break test, 2026-12-03)."""
    bad = tmp_path / "bad.pt"
    bad.write_text("garbage\n")
    base = ["--preset", "smoke", "--modes", "bf16", "--steps", "2", "--data-dir", str(tmp_path / "data"),
            "--out", str(tmp_path / "run"), "--no-progress"]
    with pytest.raises(SystemExit, match=r"--init-from: .*bad.pt is not a readable fp8attn.train.checkpoint/1 "
                                         r"checkpoint"):
        compare.run(compare.parse_args(base + ["--device", "cpu", "--text-dir", str(text_dir),
                                               "--init-from", str(bad)]))
    with pytest.raises(SystemExit, match=r"--text-dir: .*nope is not a directory"):
        compare.run(compare.parse_args(base + ["--device", "cpu", "--text-dir", str(tmp_path / "nope")]))
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--device cuda: no CUDA GPU"):
            compare.run(compare.parse_args(base + ["--device", "cuda", "--text-dir", str(text_dir)]))
    assert not (tmp_path / "data").exists()   # no data work was done


def test_grad_format_reaches_the_attention_backward(monkeypatch):
    """--grad-format e5m2 (issue 23's search): ModelConfig.fp8_grad_format reaches
    fp8attn.attention's grad_format in every fp8 mode's attention call, and changes the
    gradients (E5M2 dO / dS codes) but not the forward; e4m3 stays the default."""
    import torch
    import fp8attn
    from fp8attn.train import model as M

    assert compare.parse_args(["--out", "x"]).grad_format == "e4m3"
    assert compare.parse_args(["--out", "x", "--grad-format", "e5m2"]).grad_format == "e5m2"
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", "x", "--grad-format", "e3m4"])
    seen = []
    real = fp8attn.attention

    def spy(*a, **kw):
        seen.append(kw.get("grad_format"))
        return real(*a, **kw)
    monkeypatch.setattr(fp8attn, "attention", spy)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, logits = {}, {}
    for fmt in ("e4m3", "e5m2"):
        cfg = M.preset_model_config("smoke", attn_mode="fp8-delta_matching", fp8_grad_format=fmt, vocab_size=64,
                                    head_dim=64)
        torch.manual_seed(0)
        model = M.Transformer(cfg)
        out = model(x)
        out.float().square().mean().backward()
        logits[fmt] = out.detach()
        grads[fmt] = model.blocks[0].attn.wq.weight.grad.clone()
    assert set(seen) == {"e4m3", "e5m2"} and seen.count("e5m2") == seen.count("e4m3") > 0
    assert torch.equal(logits["e4m3"], logits["e5m2"])
    assert not torch.equal(grads["e4m3"], grads["e5m2"])
