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
