"""benchmarks/bench_train.py runs end to end on CPU (smoke preset, one timed step per
config): a table row and a JSON row per config, positive throughput, the FP8
scopes really convert their linear layers."""
import json
import subprocess
import sys
from pathlib import Path

import fp8attn

ROOT = Path(__file__).resolve().parents[2]
PY_DIR = Path(fp8attn.__file__).resolve().parents[1]


def test_bench_train_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = {"PYTHONPATH": str(PY_DIR), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cpu",
                           "--presets", "smoke", "--warmup", "1", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())
    rows = info["rows"]
    assert [r["config"] for r in rows] == ["bf16", "fp8/attn-core", "fp8/attn-core+projections",
                                           "fp8/attn-core+projections+ffn"]
    assert [r["fp8_linear_layers"] for r in rows] == [0, 0, 8, 14]       # smoke: 2 layers x (4 | 4 + 3)
    assert all(r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in rows)
    assert proc.stdout.count("| smoke |") == 4
