"""The results page (python -m fp8attn.train.results) must say what it compares: the
FP8 scope and packing of each run, and the checkpoints its probe failed on (an empty
table with no reason read as "no data")."""
import pytest

from fp8attn.train import compare, probe, results


def test_results_page_names_scope_packed_and_probe_failures(tmp_path, text_dir):
    run = tmp_path / "run"
    compare.run(compare.parse_args([
        "--preset", "smoke", "--device", "cpu", "--steps", "2", "--modes", "bf16,fp8-stale",
        "--scope", "attn-core+projections", "--packed", "--diag-every", "0", "--val-batches", "1",
        "--text-dir", str(text_dir), "--data-dir", str(tmp_path / "data"), "--no-progress", "--out", str(run)]))
    with pytest.raises(SystemExit, match="checkpoints failed"):     # packed checkpoints: refused by the probe
        probe.main(["--run-dir", str(run), "--device", "cpu", "--batch-size", "1", "--val-batches", "1"])
    text = results.build({"packed": results.load_run(run)}, [], tmp_path / "r.md", tmp_path / "figs", None)
    assert "fp8 scope attn-core+projections, packed documents" in text
    assert text.count("probe failed on") == 2 and "packed" in text.split("probe failed on")[1]
