"""benchmarks/ncu_compare.py (the Nsight Compute side-by-side table of
scripts/device_ncu_compare.sh) on hand-made raw-page CSVs, on the CPU.

* times are converted from the unit the units row names (ms, us, ns), so a
  2.48 ms kernel prints 2480 us and is not hidden by --min-us;
* issue slots busy = 100 x smsp__issue_active per active cycle; pipes are read
  from their own metric (an absent metric prints "-", not 0);
* stall reasons are sorted, "selected" (issuing, not a stall) is left out;
* a file without kernel rows fails with exit 1 and says so.
"""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ncu_compare.py"

COLS = ["ID", "Kernel Name", "gpu__time_duration.sum", "smsp__inst_executed.sum",
        "smsp__issue_active.avg.per_cycle_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__registers_per_thread", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
        "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]


def _write(path, unit, rows):
    with open(path, "w", newline="") as f:
        f.write("==PROF== a line ncu prints before the table\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(COLS)
        w.writerow(["", "", unit, "inst", "", "%", "register/thread", "%", "%", "inst", "inst", "inst"])
        for r in rows:
            w.writerow(r)


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_units_issue_pipes_and_stalls(tmp_path):
    ms = tmp_path / "ours.csv"
    _write(ms, "ms", [["0", "void ns::<unnamed>::fwd_kernel<128, 128, 3>(Params)", "2.480128", "933292424", "0.541",
                       "18.5", "168", "31.1", "33.2", "1.0", "1.056", "1.104"],
                      ["1", "tiny_kernel(int)", "0.004", "1000", "0.1", "5", "16", "0", "0", "1", "0.1", "0.2"]])
    us = tmp_path / "base.csv"
    _write(us, "us", [["0", "cudnn_sm90_flash_fprop", "1411.872", "537060072", "0.546", "18.7", "168", "54.6", "",
                       "1.0", "0.66", "1.05"]])
    r = _run(ms, us)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("| ours") or l.startswith("| base")]
    assert len(lines) == 2, r.stdout  # the 4 us kernel is below --min-us 20
    ours = [c.strip() for c in lines[0].strip("|").split("|")]
    assert ours[1] == "ns::fwd_kernel" and ours[2] == "2480" and ours[3] == "933.3"
    assert ours[4] == "54" and ours[5] == "18" and ours[6] == "168" and ours[7] == "31"
    assert ours[-1] == "long_scoreboard 1.10, wait 1.06", ours  # sorted, "selected" left out
    base = [c.strip() for c in lines[1].strip("|").split("|")]
    assert base[2] == "1412" and base[10] == "-"  # us unit; the empty XU cell is "-", not 0


def test_no_rows_fails(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== no kernels were profiled\n")
    header_only = tmp_path / "header_only.csv"
    header_only.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n')
    for f in (empty, header_only):
        r = _run(f)
        assert r.returncode == 1 and "no kernel rows" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_odd_kernel_names(tmp_path):
    odd = tmp_path / "odd.csv"
    _write(odd, "us", [["0", "(lambda)#1", "100", "10", "0.5", "10", "32", "1", "1", "1", "0.1", "0.1"],
                       ["1", "a|b<int>(x)", "100", "10", "0.5", "10", "32", "1", "1", "1", "0.1", "0.1"]])
    r = _run(odd)
    assert r.returncode == 0, r.stderr
    rows = [l for l in r.stdout.splitlines() if l.startswith("| odd")]
    assert "| odd | (lambda)#1 |" in rows[0]  # no empty cell when the name starts with "("
    assert "a\\|b" in rows[1] and rows[1].count(" | ") == rows[0].count(" | ")  # an escaped | keeps the columns
