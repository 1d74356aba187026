"""benchmarks/bench_linear_gpu.py on the CPU (its GPU timings run on the device only): the shape
list is the model's own linear layers (built on the meta device), the CPU smoke run (every
variant timed or n/a with its reason), n/a cells and the total row of the table, torchao
missing, the command line (no GPU: exit 1, nothing written; a bad --variants: exit 2). CPU, seconds."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("fp8attn")
import bench_linear_gpu as bl  # noqa: E402
from fp8attn.train import model as M  # noqa: E402


def test_gpu1b_shapes_are_the_models_linear_layers():
    """gpu-1b's shape list = the (in, out) of every nn.Linear of the model built on the meta device
    except the LM head (which no fp8 config converts), with their counts; M = batch x seq_len of
    the preset (4 x 8192); --batch-size / --seq-len override it."""
    with torch.device("meta"):
        model = M.Transformer(M.preset_model_config("gpu-1b"))
    lins = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert "head" in lins   # untied: the head is a linear layer, left out below
    want = {}
    for n, m in lins.items():
        if n != "head":
            want[(m.in_features, m.out_features)] = want.get((m.in_features, m.out_features), 0) + 1
    shapes = bl.linear_shapes("gpu-1b")
    assert {(r["K"], r["N"]): r["count"] for r in shapes} == want
    assert sum(r["count"] for r in shapes) == len(lins) - 1 == 7 * M.PRESETS["gpu-1b"]["model"]["n_layers"]
    t = M.PRESETS["gpu-1b"]["train"]
    assert {r["M"] for r in shapes} == {t["batch_size"] * t["seq_len"]} == {32768}
    head = lins["head"]
    assert (head.in_features, head.out_features) not in {(r["K"], r["N"]) for r in shapes}
    roles = {layer for r in shapes for layer in r["layers"]}
    assert roles == {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"}
    assert {r["M"] for r in bl.linear_shapes("gpu-1b", batch_size=1, seq_len=4096)} == {4096}


def test_cpu_smoke_run(tmp_path):
    """--device cpu: every shape x variant has a time or an n/a with its reason (torchao's only
    where it is not importable), the table has a row per shape and the total row, the JSON the rows."""
    out = tmp_path / "lin.json"
    assert bl.main(["--device", "cpu", "--preset", "smoke", "--warmup", "0", "--iters", "1", "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    # smoke: 5 distinct shapes and the fused-QKV row
    assert info["variants"] == list(bl.DEFAULT_VARIANTS) and len(info["rows"]) == 6
    assert info["rows"][-1]["parts"] == [128, 64, 64] and info["rows"][-1]["N"] == 256
    have_tao = bl.TAO.version() is not None
    for r in info["rows"]:
        for v, got in r["results"].items():
            if v.startswith("torchao/") and not have_tao:
                assert "torchao not importable" in got["na"]
            else:
                assert got["ms"] > 0, (v, got)
    md = bl.markdown(info["rows"], info["variants"])
    assert md.count("\n| attn.") == 4 and "| all of them, count x ms | per step |" in md
    assert "| attn.qkv (wq+wk+wv) (2) | 512 x 64 -> 128 + 64 + 64 |" in md
    assert "| all of them, attn.qkv for wq, wk, wv | per step |" in md
    assert bl.main(["--device", "cpu", "--preset", "smoke", "--warmup", "0", "--iters", "1", "--variants", "bf16",
                    "--no-fused-qkv", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 5


def test_gpu1b_qkv_row_and_the_fused_layer():
    """gpu-1b's qkv row: 2048 -> 2048 + 512 + 512 = 3072 in 24 attention layers; fp8attn's QKV
    module makes one fp8_linear_fused call (three FP8Linear weights), bf16's three nn.Linear."""
    r = bl.qkv_shape("gpu-1b")
    assert (r["K"], r["N"], r["parts"], r["count"], r["M"]) == (2048, 3072, [2048, 512, 512], 24, 32768)
    assert r["roles"] == ["attn.wq", "attn.wk", "attn.wv"]
    from fp8attn import linear as L
    q = bl.make_qkv("fp8attn", 128, [128, 64, 64], torch.device("cpu"))
    assert q.fused and all(isinstance(m, L.FP8Linear) for m in q.layers)
    x = torch.randn(8, 128)
    ys = q(x)
    assert [tuple(y.shape) for y in ys] == [(8, 128), (8, 64), (8, 64)]
    assert all(torch.equal(y, m(x)) for y, m in zip(ys, q.layers))
    b = bl.make_qkv("bf16", 128, [128, 64, 64], torch.device("cpu"))
    assert not b.fused and all(type(m) is nn.Linear for m in b.layers)


def test_markdown_na_cells_and_totals():
    rows = [{"layers": ["attn.wq", "attn.wo"], "count": 2, "M": 8, "K": 4, "N": 4,
             "results": {"bf16": {"ms": 2.0}, "fp8attn": {"ms": 1.0}, "torchao/rowwise": {"na": "why not"}}},
            {"layers": ["mlp.w2"], "count": 1, "M": 8, "K": 6, "N": 4,
             "results": {"bf16": {"ms": 4.0}, "fp8attn": {"ms": 8.0}, "torchao/rowwise": {"ms": 2.0}}}]
    md = bl.markdown(rows, ["bf16", "fp8attn", "torchao/rowwise"])
    assert "| attn.wq, attn.wo (2) | 8 x 4 -> 4 | 2.000 (1.00x) | 1.000 (2.00x) | n/a |" in md
    assert "| mlp.w2 (1) | 8 x 6 -> 4 | 4.000 (1.00x) | 8.000 (0.50x) | 2.000 (2.00x) |" in md
    # totals: bf16 2*2 + 4 = 8, fp8attn 2*1 + 8 = 10 (0.80x), torchao n/a (a shape is)
    assert "| all of them, count x ms | per step | 8.000 (1.00x) | 10.000 (0.80x) | n/a |" in md
    assert "n/a: torchao/rowwise at attn.wq/attn.wo (8 x 4 -> 4): why not" in md
    # a qkv row (Wq in the first row, Wk / Wv in a second): left out of the first total, and a
    # second total with it in place of one wq + one wk + one wv per attention layer
    rows[1:] = [{"layers": ["attn.wk", "attn.wv"], "count": 2, "M": 8, "K": 4, "N": 2,
                 "results": {"bf16": {"ms": 1.0}, "fp8attn": {"ms": 3.0}}},
                {"layers": ["attn.qkv (wq+wk+wv)"], "count": 1, "M": 8, "K": 4, "N": 8, "parts": [4, 2, 2],
                 "roles": ["attn.wq", "attn.wk", "attn.wv"],
                 "results": {"bf16": {"ms": 4.0}, "fp8attn": {"ms": 2.0}}}]
    md = bl.markdown(rows, ["bf16", "fp8attn"])
    assert "| attn.qkv (wq+wk+wv) (1) | 8 x 4 -> 4 + 2 + 2 | 4.000 (1.00x) | 2.000 (2.00x) |" in md
    # separate: bf16 2*2 + 2*1 = 6, fp8attn 2*1 + 2*3 = 8; fused: bf16 6 - (2+1+1) + 4 = 6, fp8attn 8 - (1+3+3) + 2 = 3
    assert "| all of them, count x ms | per step | 6.000 (1.00x) | 8.000 (0.75x) |" in md
    assert "| all of them, attn.qkv for wq, wk, wv | per step | 6.000 (1.00x) | 3.000 (2.00x) |" in md


def test_torchao_missing_is_na(monkeypatch):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    shape = {"M": 16, "K": 32, "N": 16}
    got = bl.time_variant("torchao/tensorwise", shape, torch.device("cpu"), 0, 1)
    assert "torchao not importable" in got["na"]
    assert bl.time_variant("bf16", shape, torch.device("cpu"), 0, 1)["ms"] > 0


def test_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "sub" / "lin.json"
    assert bl.main(["--json", str(out)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.parent.exists()
    for bad in (["--variants", "bf16,nope"], ["--variants", "bf16,bf16"], ["--iters", "0"], ["--preset", "x"]):
        with pytest.raises(SystemExit) as e:
            bl.main(bad)
        assert e.value.code == 2
    assert "What is measured" in bl.parser().format_help()
