"""benchmarks/bench_train.py runs end to end on CPU (smoke preset, one timed step per
config): a table row and a JSON row per config, positive throughput, the FP8
scopes really convert their linear layers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import fp8attn

ROOT = Path(__file__).resolve().parents[2]
PY_DIR = Path(fp8attn.__file__).resolve().parents[1]


def _bench_train(*args, timeout=300):
    """benchmarks/bench_train.py --device cpu ARGS in a child process importing this fp8attn."""
    env = {"PYTHONPATH": str(PY_DIR), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "FP8ATTN_SOURCE_TREE": os.environ.get("FP8ATTN_SOURCE_TREE", "1")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_train_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench_train("--presets", "smoke", "--warmup", "1", "--steps", "1", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())
    rows = info["rows"]
    assert [r["config"] for r in rows] == ["bf16", "fp8/attn-core", "fp8/attn-core+projections",
                                           "fp8/attn-core+projections+ffn"]
    assert [r["fp8_linear_layers"] for r in rows] == [0, 0, 8, 14]       # smoke: 2 layers x (4 | 4 + 3)
    assert all(r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in rows)
    assert proc.stdout.count("| smoke |") == 4


def test_bench_train_rounds_cpu_smoke(tmp_path):
    """--rounds 2: every config timed twice (interleaved), the per-round numbers kept, the table
    gives the median ratio and its range."""
    out = tmp_path / "bench.json"
    proc = _bench_train("--presets", "smoke", "--configs", "bf16,fp8/attn-core", "--warmup", "1", "--steps", "1",
                        "--rounds", "2", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())
    assert info["rounds"] == 2
    assert [len(r["rounds_tokens_per_s"]) for r in info["rows"]] == [2, 2]
    assert proc.stdout.count("[bench] smoke round") == 2
    fp8_line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| smoke | fp8/attn-core |"))
    assert fp8_line.count("(") == 1 and "x (" in fp8_line  # median ratio, then (min-max)


def test_markdown_median_of_round_ratios():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train

    def row(config, rounds):
        return {"preset": "p", "config": config, "tokens_per_s": bench_train.median(rounds), "ms_per_step": 1.0,
                "peak_mem_gb": None, "rounds_tokens_per_s": rounds}
    # per-round ratios 1.5, 0.5, 1.0 (the bf16 baseline drifts): median 1.00x, range 0.50-1.50
    md = bench_train.markdown([row("bf16", [100.0, 200.0, 100.0]), row("fp8/attn-core", [150.0, 100.0, 100.0])])
    assert "| p | bf16 | 100 | 1.0 | 1.00x | n/a |" in md
    assert "| p | fp8/attn-core | 100 | 1.0 | 1.00x (0.50-1.50) | n/a |" in md
    assert bench_train.median([3.0, 1.0, 2.0, 10.0]) == 2.5


def test_repeated_config_is_refused():
    proc = _bench_train("--presets", "smoke", "--configs", "bf16,bf16,fp8/attn-core", timeout=120)
    assert proc.returncode != 0 and "--configs: each config once" in proc.stderr, proc.stderr[-500:]


def test_parse_configs_scaling_suffixes():
    """fp8/<scope>@row|@tile|@tile-loop pick the recipe (and the varlen loop) per config; without
    a suffix --scaling's; bad names and duplicates are refused naming the argument."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train
    import pytest

    cs = bench_train.parse_configs("bf16,fp8/attn-core,fp8/attn-core@tile,fp8/attn-core@tile-loop",
                                   "delta_matching", "row")
    assert [(c["name"], c["scaling"], c["loop"]) for c in cs] == [
        ("bf16", "row", False), ("fp8/attn-core", "row", False), ("fp8/attn-core@tile", "tile", False),
        ("fp8/attn-core@tile-loop", "tile", True)]
    assert [c["mode"] for c in cs] == ["bf16"] + ["fp8-delta_matching"] * 3
    assert bench_train.parse_configs("fp8/attn-core", "stale", "tile")[0]["scaling"] == "tile"
    for bad in ("fp8/attn-core@tiles", "fp8/nope@tile", "fp8/attn-core,fp8/attn-core"):
        with pytest.raises(ValueError, match="--configs"):
            bench_train.parse_configs(bad, "delta_matching", "row")
    # on the command line: exit status 2 naming the argument, as the other benchmarks
    for args in (["--configs", "fp8/all@bogus"], ["--configs", "fp8/attn-core@tile-loop"]):
        p = _bench_train(*args, timeout=120)
        assert p.returncode == 2 and "--configs" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_varlen_loop_context_restores_the_environment(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train

    monkeypatch.delenv("FP8ATTN_VARLEN_LOOP", raising=False)
    with bench_train.varlen_loop(True):
        assert os.environ["FP8ATTN_VARLEN_LOOP"] == "1"
    assert "FP8ATTN_VARLEN_LOOP" not in os.environ
    monkeypatch.setenv("FP8ATTN_VARLEN_LOOP", "0")
    with bench_train.varlen_loop(True):
        assert os.environ["FP8ATTN_VARLEN_LOOP"] == "1"
    assert os.environ["FP8ATTN_VARLEN_LOOP"] == "0"
    with bench_train.varlen_loop(False):
        assert os.environ["FP8ATTN_VARLEN_LOOP"] == "0"


def test_bench_train_scaling_configs_cpu_smoke(tmp_path):
    """The @row / @tile configs build and train on CPU (the CPU reference of each recipe) and
    record their recipe in the JSON rows."""
    out = tmp_path / "bench.json"
    proc = _bench_train("--presets", "smoke", "--configs", "fp8/attn-core@row,fp8/attn-core@tile", "--packed",
                        "--warmup", "1", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["fp8_scaling"]) for r in rows] == [("fp8/attn-core@row", "row"),
                                                              ("fp8/attn-core@tile", "tile")]
    assert all(r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in rows)


# ----------------------------------------------------------------------------
# torchao float8 baseline (issue 21): torchao/<recipe> configs, n/a without torchao
# ----------------------------------------------------------------------------

def _bt():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train
    return bench_train


def _no_torchao(monkeypatch):
    """`import torchao` (and torchao.float8) raises ImportError, as where it is not installed."""
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)


def test_parse_configs_torchao_recipes():
    """torchao/<recipe> is a bf16-attention config carrying its recipe; an unknown recipe is refused
    naming --configs and the recipes (exit 2 on the command line)."""
    import pytest
    bt = _bt()
    cs = bt.parse_configs("bf16,torchao/tensorwise,torchao/rowwise,torchao/rowwise_with_gw_hp,fp8/attn-core",
                          "delta_matching", "row")
    assert [(c["name"], c["mode"], c["torchao"]) for c in cs] == [
        ("bf16", "bf16", None), ("torchao/tensorwise", "bf16", "tensorwise"), ("torchao/rowwise", "bf16", "rowwise"),
        ("torchao/rowwise_with_gw_hp", "bf16", "rowwise_with_gw_hp"), ("fp8/attn-core", "fp8-delta_matching", None)]
    for bad in ("torchao/rowwize", "torchao/", "torchao/tensorwise@tile"):
        with pytest.raises(ValueError, match=r"--configs: unknown torchao recipe .*tensorwise\|rowwise"):
            bt.parse_configs(bad, "delta_matching", "row")
    with pytest.raises(ValueError, match="--configs: each config once"):
        bt.parse_configs("torchao/rowwise,torchao/rowwise", "delta_matching", "row")
    p = _bench_train("--configs", "bf16,torchao/bogus", timeout=120)
    assert p.returncode == 2 and "unknown torchao recipe 'bogus'" in p.stderr and "Traceback" not in p.stderr, \
        p.stderr[-800:]


def test_torchao_absent_is_na_and_the_others_run(tmp_path, monkeypatch):
    """Without torchao (its import made to fail) a torchao config's row is n/a with the reason, in
    the JSON and under the table, and the other configs are timed as usual (--rounds 1 and 2)."""
    bt = _bt()
    _no_torchao(monkeypatch)
    assert "torchao not importable" in bt.TAO.unavailable(bt.torch.device("cpu"), "rowwise")
    for rounds in ("1", "2"):
        out = tmp_path / f"bench{rounds}.json"
        bt.main(["--device", "cpu", "--presets", "smoke", "--warmup", "1", "--steps", "1", "--rounds", rounds,
                 "--configs", "bf16,torchao/rowwise,fp8/attn-core", "--json", str(out)])
        info = json.loads(out.read_text())
        rows = info["rows"]
        assert [r["config"] for r in rows] == ["bf16", "torchao/rowwise", "fp8/attn-core"]
        assert info["torchao"] is None
        assert rows[1]["tokens_per_s"] is None and "torchao not importable" in rows[1]["na"]
        assert all(r["tokens_per_s"] > 0 and len(r["rounds_tokens_per_s"]) == int(rounds)
                   for r in (rows[0], rows[2]))
        md = bt.markdown(rows)
        assert "| smoke | torchao/rowwise | n/a | n/a | n/a | n/a |" in md
        assert "n/a: smoke torchao/rowwise: torchao not importable" in md


def test_torchao_build_failure_is_na_other_errors_propagate(monkeypatch):
    """An exception while building / warming up a torchao config gives its n/a row (the type and
    message); the same in a fp8attn or bf16 config propagates (without --compile)."""
    import pytest
    bt = _bt()
    args = bt.argparse.Namespace(batch_size=2, seq_len=16, activation_checkpointing="preset", packed=False,
                                 doc_len=8, warmup=1, compile=False, compile_backend="inductor")
    cpu = bt.torch.device("cpu")
    import contextlib

    def boom(*a, **k):
        raise RuntimeError("no float8 today")

    monkeypatch.setattr(bt.TAO, "unavailable", lambda device, recipe: None)
    monkeypatch.setattr(bt.TAO, "convert", boom)
    k_tao, k_fp8 = bt.parse_configs("torchao/tensorwise,fp8/attn-core+projections", "stale", "row")
    c, why = bt.build_or_na("smoke", k_tao, args, cpu, contextlib.nullcontext)
    assert c is None and why == "RuntimeError: no float8 today"
    monkeypatch.setattr(bt.Config, "__init__", lambda self, *a, **k: boom())
    with pytest.raises(RuntimeError, match="no float8 today"):
        bt.build_or_na("smoke", k_fp8, args, cpu, contextlib.nullcontext)
    args.compile = True   # with --compile any config's failure is its n/a
    assert bt.build_or_na("smoke", k_fp8, args, cpu, contextlib.nullcontext) == (None, "RuntimeError: no float8 today")


def test_torchao_converts_the_widest_scope_layers():
    """torchao's conversion (convert_to_float8_training, module_filter_fn from
    model.scope_linear_patterns) swaps exactly the modules fp8attn's widest scope makes FP8Linear
    (same names), for every recipe; the LM head of an untied model stays nn.Linear; the Parameter
    objects are kept (the optimizer built after sees the same weights). No forward needed."""
    import pytest
    if _bt().TAO.version() is None:
        pytest.skip("torchao not importable (optional dependency)")
    import torch
    bt = _bt()
    M = bt.M
    for tie in (True, False):
        fp8 = M.Transformer(M.preset_model_config("smoke", attn_mode="fp8-stale", scope=bt.WIDEST,
                                                  tie_embeddings=tie))
        for recipe in bt.TAO.RECIPES:
            model = M.Transformer(M.preset_model_config("smoke", tie_embeddings=tie))
            params = {n: p for n, p in model.named_parameters()}
            names = bt.TAO.convert(model, M.scope_linear_patterns(bt.WIDEST), recipe, torch.device("cpu"))
            assert names == fp8.fp8_linear_names and len(names) == 14
            swapped = sorted(n for n, m in model.named_modules()
                             if type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao."))
            assert swapped == names
            assert all(type(m) is torch.nn.Linear for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and n not in names)
            assert (model.head is None) == tie and (tie or type(model.head) is torch.nn.Linear)
            assert all(p is params[n] for n, p in model.named_parameters())


def test_bench_train_torchao_cpu_smoke(tmp_path):
    """torchao/<recipe> configs train on the CPU (torchao's emulation), 14 linear layers converted
    on smoke, their recipe and emulation recorded; --compile (aot_eager: no code generation)
    runs every config compiled."""
    import pytest
    if _bt().TAO.version() is None:
        pytest.skip("torchao not importable (optional dependency)")
    out = tmp_path / "bench.json"
    proc = _bench_train("--presets", "smoke", "--configs", "bf16,torchao/tensorwise,torchao/rowwise",
                        "--warmup", "1", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())
    rows = info["rows"]
    assert [(r["config"], r["torchao_recipe"], r["fp8_linear_layers"]) for r in rows] == [
        ("bf16", None, 0), ("torchao/tensorwise", "tensorwise", 14), ("torchao/rowwise", "rowwise", 14)]
    assert [r["torchao_emulated"] for r in rows] == [False, True, True]
    assert all(r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in rows) and info["torchao"]
    proc = _bench_train("--presets", "smoke", "--configs", "bf16,torchao/tensorwise", "--compile",
                        "--compile-backend", "aot_eager", "--warmup", "1", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())
    assert info["compile"] and info["compile_backend"] == "aot_eager"
    assert [r["compile"] for r in info["rows"]] == [True, True] and "torch.compile (aot_eager)" in proc.stdout


def test_rounds_mode(monkeypatch, tmp_path):
    """--rounds-mode auto keeps the configs built unless their FP32 weights, gradients and AdamW
    state (16 bytes a parameter) exceed half the GPU: gpu-1b's six configs on an 80 GB GPU are
    rebuilt every round, gpu-125m's kept; rebuild mode times each config once per round."""
    bt = _bt()
    import torch
    props = type("P", (), {"total_memory": 80 * 2 ** 30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    args = bt.argparse.Namespace(rounds_mode="auto", rounds=2)
    cuda = torch.device("cuda")
    assert bt.rounds_mode("gpu-1b", 6, args, cuda) == "rebuild"
    assert bt.rounds_mode("gpu-1b", 2, args, cuda) == "keep"      # 39 GB of 80
    assert bt.rounds_mode("gpu-125m", 6, args, cuda) == "keep"
    assert bt.rounds_mode("gpu-1b", 6, args, torch.device("cpu")) == "keep"
    assert bt.rounds_mode("gpu-1b", 6, bt.argparse.Namespace(rounds_mode="auto", rounds=1), cuda) == "keep"
    assert bt.rounds_mode("gpu-1b", 6, bt.argparse.Namespace(rounds_mode="keep", rounds=2), cuda) == "keep"
    out = tmp_path / "bench.json"
    proc = _bench_train("--presets", "smoke", "--configs", "bf16,fp8/attn-core", "--rounds", "2",
                        "--rounds-mode", "rebuild", "--warmup", "1", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rounds_mode"], len(r["rounds_tokens_per_s"])) for r in rows] == [("rebuild", 2), ("rebuild", 2)]
    assert proc.stdout.count("(round 2/2)") == 2
