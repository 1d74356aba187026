"""Side-by-side Nsight Compute table of attention kernels (scripts/device_ncu_compare.sh).

Input: one or more `ncu --import x.ncu-rep --csv --page raw > <impl>.csv` files
(sections SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats, LaunchStats,
Occupancy, InstructionStats). Prints one markdown row per profiled kernel: time,
warp instructions, issue slots busy, warps active, registers, pipe utilization
(% of peak while the SM is active) and the top warp-stall reasons (average warps
stalled per issued instruction, "selected" left out). Metric names vary across ncu versions, so
missing ones print as "-".
"""
import argparse
import csv
import os
import re
import sys


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return None


def read_rows(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    if len(rows) < 2:  # a header without its units row: nothing was profiled
        return []
    head, units, data = rows[0], rows[1], rows[2:]
    out = []
    for r in data:
        if len(r) != len(head):
            continue
        d = dict(zip(head, r))
        d["_units"] = dict(zip(head, units))
        out.append(d)
    return out


TIME_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def time_us(row):
    v = num(row.get("gpu__time_duration.sum"))
    if v is None:
        return None
    return v * TIME_TO_US.get(row["_units"].get("gpu__time_duration.sum", "ns"), 1e-3)


def short_name(name, width=46):
    """Kernel name without "void", anonymous namespaces, template arguments and parameters."""
    full = name.replace("void ", "").replace("<unnamed>::", "").replace("(anonymous namespace)::", "").strip()
    name = re.split(r"[<(]", full, maxsplit=1)[0].strip() or full or "?"
    name = name.replace("|", "\\|")  # NOTE: a bare | would split the markdown cell
    return name if len(name) <= width else name[: width - 1] + "~"


# (label, metric): % of peak while the SM is active. NOTE: on sm_90 ncu counts wgmma
# in sm__pipe_tensor_cycles_active (the gmma / shared pipe rows read the same).
PIPES = (("tensor", "sm__pipe_tensor_cycles_active"), ("fma", "sm__pipe_fma_cycles_active"),
         ("alu", "sm__pipe_alu_cycles_active"), ("xu (MUFU)", "sm__inst_executed_pipe_xu"),
         ("lsu", "sm__inst_executed_pipe_lsu"), ("uniform", "sm__inst_executed_pipe_uniform"))


def pick(row, metric, suffix=".avg.pct_of_peak_sustained_active"):
    return num(row.get(metric + suffix))


def fmt(x, spec="{:.0f}"):
    return "-" if x is None else spec.format(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="<impl>.csv files (the file stem labels the rows)")
    ap.add_argument("--min-us", type=float, default=20.0, help="hide kernels shorter than this")
    ap.add_argument("--stalls", type=int, default=3)
    a = ap.parse_args()
    print("| impl | kernel | time us | warp inst M | issue busy % | warps active % | regs | "
          + " | ".join(f"{p} %" for p, _ in PIPES) + " | top stalls (warps per issue) |")
    print("|" + "---|" * (7 + len(PIPES) + 1))
    n = 0
    for path in a.csv:
        impl = os.path.splitext(os.path.basename(path))[0]
        for row in read_rows(path):
            t_us = time_us(row)
            if t_us is not None and t_us < a.min_us:
                continue
            inst = num(row.get("smsp__inst_executed.sum"))
            issue = num(row.get("smsp__issue_active.avg.per_cycle_active"))
            issue = None if issue is None else 100 * issue
            warps = num(row.get("sm__warps_active.avg.pct_of_peak_sustained_active"))
            regs = num(row.get("launch__registers_per_thread"))
            pipes = [pick(row, pat) for _, pat in PIPES]
            stalls = []
            for k, v in row.items():
                m = re.match(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$", k)
                if m and m.group(1) != "selected" and num(v):
                    stalls.append((num(v), m.group(1)))
            stalls.sort(reverse=True)
            st = ", ".join(f"{r} {x:.2f}" for x, r in stalls[: a.stalls])
            print(f"| {impl} | {short_name(row.get('Kernel Name', '?'))} | {fmt(t_us)} | "
                  f"{fmt(None if inst is None else inst / 1e6, '{:.1f}')} | {fmt(issue)} | {fmt(warps)} | {fmt(regs)} | "
                  + " | ".join(fmt(p) for p in pipes) + f" | {st} |")
            n += 1
    if n == 0:
        print("no kernel rows found in " + ", ".join(a.csv), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
