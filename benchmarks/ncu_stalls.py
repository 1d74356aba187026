"""Summarize an Nsight Compute source-page CSV (SASS view) by warp-stall samples.

Input: `ncu --import x.ncu-rep --page source --csv --print-source sass > x.csv`.
Prints markdown: total samples, the stall reasons summed over the kernel, the
opcodes with the most samples (and their top reasons), and the top SASS lines
in program order context. Column names vary across ncu versions, so columns are
found by substring ("Warp Stall Sampling (All", "stall_*" / "Stall ..." reasons).
"""
import argparse
import collections
import csv
import sys


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    lines = open(a.csv, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"#"') or l.startswith('"Address"')
                  or "Source" in l and "Address" in l), None)
    if start is None:
        print("no SASS table found; first lines:\n" + "\n".join(lines[:10]))
        return 1
    rows = list(csv.DictReader(lines[start:]))
    cols = list(rows[0].keys()) if rows else []
    all_col = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    if all_col is None:
        print("no 'Warp Stall Sampling (All Samples)' column; columns: " + ", ".join(cols))
        return 1
    src_col = next((c for c in cols if c.strip() == "Source"), cols[1] if len(cols) > 1 else cols[0])
    reason_cols = [c for c in cols if c.lower().startswith("stall") or "stall_" in c.lower()]
    reason_cols = [c for c in reason_cols if "Sampling" not in c]
    total = sum(num(r[all_col]) for r in rows)
    print(f"# {a.csv}: {len(rows)} SASS lines, {total:.0f} warp-stall samples\n")
    if reason_cols:
        agg = {c: sum(num(r[c]) for r in rows) for c in reason_cols}
        print("## stall reasons (whole kernel)\n\n| reason | samples | share |\n|---|---|---|")
        for c, v in sorted(agg.items(), key=lambda kv: -kv[1])[:16]:
            if v > 0:
                print(f"| {c} | {v:.0f} | {v / max(total, 1):.1%} |")
        print()
    by_op = collections.defaultdict(float)
    op_reasons = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        op = r[src_col].strip().split(" ")[0] if r[src_col].strip() else "?"
        if op.startswith("@"):
            parts = r[src_col].strip().split(" ")
            op = parts[1] if len(parts) > 1 else op
        op = op.split(".")[0]
        by_op[op] += num(r[all_col])
        for c in reason_cols:
            op_reasons[op][c] += num(r[c])
    print("## opcodes by samples\n\n| opcode | samples | share | top reasons |\n|---|---|---|---|")
    for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]:
        tops = ", ".join(f"{c} {n / max(v, 1):.0%}" for c, n in op_reasons[op].most_common(3) if n > 0)
        print(f"| {op} | {v:.0f} | {v / max(total, 1):.1%} | {tops} |")
    print(f"\n## top {a.top} SASS lines\n\n| # | samples | share | instruction | top reasons |\n|---|---|---|---|---|")
    idx = sorted(range(len(rows)), key=lambda i: -num(rows[i][all_col]))[:a.top]
    for i in sorted(idx):
        r = rows[i]
        v = num(r[all_col])
        tops = ", ".join(f"{c} {num(r[c]):.0f}" for c in sorted(reason_cols, key=lambda c: -num(r[c]))[:2]
                         if num(r[c]) > 0)
        print(f"| {i} | {v:.0f} | {v / max(total, 1):.1%} | `{r[src_col].strip()[:90]}` | {tops} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
