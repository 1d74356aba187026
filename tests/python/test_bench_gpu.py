"""benchmarks/bench_gpu.py and the command line of benchmarks/cudnn_fp8.py on the CPU.

* bench_gpu.markdown: the --softcap table (tile with and without softcap);
  the cuDNN fp8 note and the accuracy caption never print
  "None" (--no-cudnn-fp8, frontend missing); the caption names the SDPA backend
  of the accuracy reference; a failed row shows n/a cells and its reason, and the
  table still parses (test_docs_benchmarks.table_ratios).
* bench_gpu.main: without a GPU a one-line message, exit 1, no --out directory;
  a shape that fails (OOM, unsupported head_dim) is recorded and the run goes on
  (json and md written); --help is complete; bad arguments exit 2.
* cudnn_fp8._reference: a fixed SDPA backend order (cuDNN, flash, math), the
  backend used is named.
* cudnn_fp8.py's CLI: argparse (--help, unknown flags, malformed shape), and a
  one-line message with a non-zero exit, no traceback, without the frontend or a GPU.
CPU, a few seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("fp8attn")
import bench_gpu  # noqa: E402
import cudnn_fp8 as cf  # noqa: E402
from test_docs_benchmarks import table_ratios  # noqa: E402

INFO = {"gpu": "G", "driver": "D", "torch": "T", "cudnn": 1, "date": "now"}


def _row(causal=False, **kw):
    r = bench_gpu.new_row(2, 16, 8192, 128, causal)
    r.update(cudnn_fwd=600.0, cudnn_bwd=500.0, flash_fwd=300.0, flash_bwd=250.0, fp8_fwd=450.0,
             **{f"fp8_bwd_{m}": 250.0 for m in bench_gpu.MODES})
    r.update(kw)
    return r


def _run_script(script, *args):
    # NOTE: the child must import the fp8attn this process imported (in-tree build
    # or the installed package, as CI has it), not whatever python/ holds.
    import fp8attn

    py_dir = Path(fp8attn.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(py_dir), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(ROOT))


# ---- markdown ----------------------------------------------------------------------


@pytest.mark.parametrize("cudnn_fp8_info,want", [
    (None, "cuDNN fp8: not run (--no-cudnn-fp8)"),
    ({"cudnn_frontend": None, "why": "import cudnn failed (ModuleNotFoundError: x)"},
     "cuDNN fp8: not available (import cudnn failed (ModuleNotFoundError: x))"),
    ({"cudnn_frontend": "1.32.0"}, "cuDNN fp8: cuDNN frontend 1.32.0 sdpa_fp8"),
])
def test_captions_never_print_none(cudnn_fp8_info, want):
    rows = [_row(fp8_err={"O": 0.02, "dQ": 0.03, "dK": 0.03, "dV": 0.02}, reference="CUDNN_ATTENTION")]
    md = bench_gpu.markdown(rows, dict(INFO, cudnn_fp8=cudnn_fp8_info))
    assert want in md
    assert "None" not in md, md
    acc = [ln for ln in md.splitlines() if ln.startswith("Accuracy:")]
    assert len(acc) == 1
    if cudnn_fp8_info is None:
        assert "cuDNN fp8 not run (--no-cudnn-fp8)" in acc[0]


def test_accuracy_caption_names_the_reference_backend():
    err = {"O": 0.02}
    one = bench_gpu.markdown([_row(fp8_err=err, reference="CUDNN_ATTENTION"),
                              _row(True, fp8_err=err, reference="CUDNN_ATTENTION")], dict(INFO, cudnn_fp8=None))
    assert "SDPA backend CUDNN_ATTENTION (order CUDNN_ATTENTION > FLASH_ATTENTION > MATH" in one
    mixed = bench_gpu.markdown([_row(fp8_err=err, reference="CUDNN_ATTENTION"),
                                _row(True, fp8_err=err, reference="MATH")], dict(INFO, cudnn_fp8=None))
    assert "SDPA backends CUDNN_ATTENTION (1 rows), MATH (1 rows)" in mixed
    assert "(cuDNN)" not in one + mixed  # the old caption named cuDNN whatever SDPA had picked


def test_failed_row_is_na_with_its_reason():
    ok = _row(fp8_err={"O": 0.02}, reference="FLASH_ATTENTION")
    failed = bench_gpu.new_row(2, 16, 8192, 256, True)
    failed.update(cudnn_fwd=600.0, error="OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB")
    md = bench_gpu.markdown([ok, failed], dict(INFO, cudnn_fp8={"cudnn_frontend": "1.32.0"}))
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    main = table[:4]
    assert len({ln.count("|") for ln in main}) == 1
    assert main[3].startswith("| 2x16x8192, 256 | yes | 600 |") and main[3].count("| n/a ") >= 9, main[3]
    assert "- 2x16x8192, 256, causal yes: OutOfMemoryError: CUDA out of memory." in md
    assert table_ratios(md)["fp8 fwd"] == [0.75]          # the failed row has no ratio, the table parses
    acc = [ln for ln in table if ln.startswith("| 2x16x8192, 256")][1]
    assert acc.count("n/a") == 8


# ---- main ---------------------------------------------------------------------------


def test_issue5_report_table():
    rows = [_row(prepass_share=0.19, fp8_saved_mb=1536.0, sdpa_saved_mb=1540.5, fp8_peak_mb=2100.0,
                 sdpa_peak_mb=2050.0),
            _row(causal=True, prepass_share=None, fp8_fwd=None)]
    md = bench_gpu.markdown(rows, dict(INFO, cudnn_fp8=None, fp8_gemm_ceiling=1300.0))
    assert "FP8 GEMM ceiling 1300 TFLOP/s" in md and bench_gpu.REPORT_HEAD in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| 2x16x8192, 128 |")]
    assert len(lines) == 4, md  # speed table + report table, two rows each
    assert lines[2] == "| 2x16x8192, 128 | no | 35% | 19% | 1536 | 1540 | 2100 | 2050 |"  # 450 / 1300
    assert lines[3] == "| 2x16x8192, 128 | yes | n/a | n/a | n/a | n/a | n/a | n/a |"
    assert "(x)" not in "\n".join(lines[2:])  # NOTE: test_docs_benchmarks reads every "(x)" of a section
    md = bench_gpu.markdown(rows, dict(INFO, cudnn_fp8=None, fp8_gemm_ceiling=None))
    assert "FP8 GEMM ceiling n/a TFLOP/s" in md and "| 2x16x8192, 128 | no | n/a | 19% |" in md
    assert "Issue #5 report" not in bench_gpu.markdown([_row()], dict(INFO, cudnn_fp8=None))  # --no-extras


def test_softcap_table():
    # --softcap C: the tile forward / DM backward with and without softcap, ms and the ratio;
    # no table without it, n/a where a number is missing; the speed tables still parse.
    rows = [_row(softcap=20.0, tile_fwd_ms=1.0, tile_fwd_softcap_ms=1.5, tile_fwd_kernel_ms=0.8,
                 tile_fwd_softcap_kernel_ms=1.4, tile_bwd_delta_matching_ms=3.0, tile_bwd_softcap_dm_ms=3.3,
                 tile_bwd_main_ms=2.0, tile_bwd_prepass_ms=0.5, tile_bwd_softcap_kernels_ms=3.0),
            _row(causal=True, softcap=20.0, tile_fwd_ms=0.6, tile_fwd_softcap_ms=None)]
    md = bench_gpu.markdown(rows, dict(INFO, cudnn_fp8=None))
    assert bench_gpu.SOFTCAP_HEAD in md and "logit softcapping c = 20 " in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| 2x16x8192, 128 |")]
    assert lines[-2] == ("| 2x16x8192, 128 | no | 1.000 / 1.500 | 1.50 | 0.800 / 1.400 | 1.75 | 3.000 / 3.300 | 1.10 "
                         "| 2.500 / 3.000 | 1.20 |"), lines[-2]
    assert lines[-1] == ("| 2x16x8192, 128 | yes | 0.600 / n/a | n/a | n/a / n/a | n/a | n/a / n/a | n/a "
                         "| n/a / n/a | n/a |"), lines[-1]
    assert table_ratios(md)["fp8 fwd"] == [0.75, 0.75]
    assert bench_gpu.SOFTCAP_HEAD not in bench_gpu.markdown([_row()], dict(INFO, cudnn_fp8=None))
    assert bench_gpu.parser().parse_args(["--softcap", "30"]).softcap == 30.0
    assert bench_gpu.parser().parse_args([]).softcap is None


def test_gemm_ceiling_without_a_gpu_is_none(capsys):
    if torch.cuda.is_available():
        pytest.skip("measures for real on a GPU")
    assert bench_gpu.gemm_ceiling(0, 1, n=256) is None
    assert "FP8 GEMM ceiling: n/a" in capsys.readouterr().out


def test_no_gpu_is_a_message_and_exit_1_before_the_out_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "never"
    assert bench_gpu.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing written"]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_no_gpu_subprocess_has_no_traceback(tmp_path):
    p = _run_script("bench_gpu.py", "--out", str(tmp_path / "never"))
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "never").exists()


def test_failed_shapes_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_gpu, "env_info", lambda: dict(INFO))
    monkeypatch.setattr(cf, "version_info", lambda: {"cudnn_frontend": "fake"})
    monkeypatch.setattr(bench_gpu, "gemm_ceiling", lambda warmup, iters: 1000.0)

    def fake_bench(r, args):
        r["cudnn_fwd"] = 100.0
        if r["d"] == 256 and r["causal"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore text")
        if r["d"] == 96:
            raise ValueError("fp8attn: argument 'q': head_dim 96 has no CUDA kernel")
        r["fp8_fwd"] = 50.0
    monkeypatch.setattr(bench_gpu, "bench_shape", fake_bench)
    out = tmp_path / "out"
    assert bench_gpu.main(["--out", str(out), "--shapes", "1x2x128x256,1x2x128x96,1x2x128x64"]) == 0
    rows = json.loads((out / "bench_gpu.json").read_text())["rows"]
    assert [(r["d"], r["causal"], r.get("error")) for r in rows] == [
        (256, False, None),
        (256, True, "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"),
        (96, False, "ValueError: fp8attn: argument 'q': head_dim 96 has no CUDA kernel"),
        (96, True, "ValueError: fp8attn: argument 'q': head_dim 96 has no CUDA kernel"),
        (64, False, None), (64, True, None)]
    assert rows[1]["cudnn_fwd"] == 100.0 and rows[1]["fp8_fwd"] is None   # kept what was measured
    md = (out / "bench_gpu.md").read_text()
    assert "- 1x2x128, 96, causal no: ValueError" in md and "- 1x2x128, 256, causal yes: OutOfMemoryError" in md


def test_help_is_complete():
    p = _run_script("bench_gpu.py", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for want in ("4 * B * H * S * S * d FLOPs, halved for causal; backward 2.5x the forward",
                 "median of --iters timed calls (CUDA events", "its FP8 quantization kernels included",
                 "BF16 -> E4M3 input quantization is excluded", "accuracy table",
                 "cuDNN, else flash, else math", "Exit status",
                 "--out OUT directory for bench_gpu.json and bench_gpu.md",
                 "--warmup WARMUP untimed calls", "--iters ITERS timed calls per number"):
        assert want in text, want


@pytest.mark.parametrize("args,want", [(["--bogus"], "unrecognized arguments: --bogus"),
                                       (["--shapes", "1x2x3"], "argument --shapes: expected"),
                                       (["--iters", "ten"], "argument --iters"),
                                       (["--iters", "0"], "argument --iters: must be an integer >= 1"),
                                       (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
                                       (["--cudnn-fp8-tol", "-1"], "argument --cudnn-fp8-tol: must be a finite"),
                                       (["--softcap", "0"], "argument --softcap: must be a finite")])
def test_bad_arguments_exit_2(args, want):
    p = _run_script("bench_gpu.py", *args)
    assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr


# ---- the accuracy reference ------------------------------------------------------------


def test_reference_backend_is_fixed_and_named(monkeypatch):
    q, k, v, do = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(4))
    ref = cf._reference(q, k, v, do, True, bwd=True)
    # CPU: cuDNN refuses, flash (torch's CPU flash kernel) takes it
    assert ref.backend == "FLASH_ATTENTION" and ref.refused[0].startswith("CUDNN_ATTENTION: RuntimeError")
    monkeypatch.setattr(cf, "REFERENCE_BACKENDS", ("MATH",))
    math_ref = cf._reference(q, k, v, do, True, bwd=True)
    assert math_ref.backend == "MATH" and not math_ref.refused
    assert cf.rel_fro(ref.o, math_ref.o) < 0.02
    assert all(cf.rel_fro(a, b) < 0.02 for a, b in zip(ref.grads, math_ref.grads))
    # only the listed backends: none of them accepting the inputs is an error, not torch's own pick
    monkeypatch.setattr(cf, "REFERENCE_BACKENDS", ("CUDNN_ATTENTION",))
    with pytest.raises(RuntimeError):
        cf._reference(q, k, v, do, True, bwd=False)


# ---- cudnn_fp8.py's command line ----------------------------------------------------------


def test_cudnn_fp8_cli_help_and_bad_arguments():
    p = _run_script("cudnn_fp8.py", "--help")
    assert p.returncode == 0 and "usage: cudnn_fp8.py" in p.stdout and "--every" in p.stdout and "BxHxSxd" in p.stdout
    p = _run_script("cudnn_fp8.py", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr and "Traceback" not in p.stderr
    for bad in ("2x16x8192", "2x16xaxb", "2x16x0x128"):
        p = _run_script("cudnn_fp8.py", bad)
        errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
        assert p.returncode == 2 and len(errors) == 1 and "argument shape: expected BxHxSxd" in errors[0], p.stderr
        assert "Traceback" not in p.stderr


def test_cudnn_fp8_cli_without_frontend_or_gpu(monkeypatch, capsys):
    monkeypatch.setitem(cf._STATE, "cudnn", None)
    monkeypatch.setitem(cf._STATE, "why", "import cudnn failed (ModuleNotFoundError: No module named 'cudnn')")
    assert cf.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cudnn_fp8.py: no cuDNN frontend: import cudnn failed"), err
    # the frontend present, no GPU
    monkeypatch.setitem(cf._STATE, "cudnn", object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cf.main(["1x2x128x64"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cudnn_fp8.py: needs a CUDA GPU (torch.cuda.is_available() is False)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_cudnn_fp8_cli_subprocess_has_no_traceback():
    p = _run_script("cudnn_fp8.py")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
