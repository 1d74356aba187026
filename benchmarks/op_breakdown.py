"""Where the time of one fp8attn op call goes on the GPU: for each shape, the
`tile` forward and Delta-Matching backward ops (and `row` with --scaling row,tile)
as called, each kernel's CUDA time per call (torch.profiler), their sum, the
wall time per call of back-to-back calls (CUDA events, median of --rounds), and
the host time to issue one call (perf_counter around --iters calls before the
sync). wall - kernels is GPU idle time between kernels (launch gaps, host-bound
issue); host >= wall means the op is host-bound at that shape. With --host, also
where the host time goes: the CPU-side ops and CUDA runtime calls of one op call
(torch.profiler CPU activity, self time per call, largest first).

    python benchmarks/op_breakdown.py --shapes 16x16x1024x128,2x16x8192x128 [--causal]

Prints one markdown table per (shape, causal, op); CUDA only (exits 1 without a GPU).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fp8attn  # noqa: E402,F401  (registers torch.ops.fp8attn)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import kernel_times  # noqa: E402  (benchmarks/, next to this script)

OPS = torch.ops.fp8attn


def parse_shape(s):
    b, h, n, d = (int(x) for x in s.lower().split("x"))
    return b, h, n, d


def kernel_table(fn, reps):
    """[(kernel name, us per call)] of fn's CUDA kernels, largest first."""
    return sorted(((name, us / reps) for name, us in kernel_times(fn, reps)), key=lambda r: -r[1])


def host_table(fn, reps, top=12):
    """[(event name, self CPU us per call, calls per call)] of fn's host-side events
    (aten ops, CUDA runtime / driver API calls), largest self time first."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / reps, e.count / reps) for e in prof.key_averages()
            if e.self_cpu_time_total > 0 and "Synchronize" not in e.key]
    return sorted(rows, key=lambda r: -r[1])[:top]


def wall_and_host_us(fn, iters, rounds):
    fn()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        walls.append(a.elapsed_time(b) * 1e3 / iters)
        hosts.append((t1 - t0) * 1e6 / iters)
    return statistics.median(walls), statistics.median(hosts)


def short(name, n=90):
    return name if len(name) <= n else name[: n - 3] + "..."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16x16x1024x128,2x16x8192x128")
    ap.add_argument("--causal", action="store_true", help="causal only (default: both)")
    ap.add_argument("--scaling", default="tile", help="comma list of row,tile")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="profiled calls per kernel table")
    ap.add_argument("--host", action="store_true", help="also the host-side table (CPU ops, CUDA runtime calls)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("op_breakdown.py: needs a CUDA GPU", file=sys.stderr)
        return 1
    os.environ.setdefault("FP8ATTN_TILE_BWD", "1")
    for shape in args.shapes.split(","):
        b, h, n, d = parse_shape(shape)
        for causal in ((True,) if args.causal else (False, True)):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            tau = d ** -0.5
            for sc in args.scaling.split(","):
                extra = () if sc == "row" else ("tile",)
                o, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, *extra)
                ops = {
                    "fwd": lambda: OPS.fwd(q, k, v, tau, causal, "fp8", 128, *extra),
                    "DM bwd": lambda: OPS.bwd(do, q, k, v, o, lse, tau, causal, "fp8", "delta_matching", 128,
                                              "e4m3", False, *extra),
                }
                for name, fn in ops.items():
                    table = kernel_table(fn, args.reps)
                    wall, host = wall_and_host_us(fn, args.iters, args.rounds)
                    ksum = sum(us for _, us in table)
                    print(f"\n### {shape} causal={causal} {sc} {name}: wall {wall:.1f} us/call, kernels {ksum:.1f} us "
                          f"(idle {wall - ksum:.1f} us), host issue {host:.1f} us/call\n")
                    print("| kernel | us / call | share of wall |")
                    print("|---|---|---|")
                    for kname, us in table:
                        print(f"| {short(kname)} | {us:.1f} | {100 * us / wall:.0f}% |")
                    if args.host:
                        print("\n| host event | self CPU us / call | calls / call |")
                        print("|---|---|---|")
                        for hname, us, n_calls in host_table(fn, args.reps):
                            print(f"| {short(hname)} | {us:.1f} | {n_calls:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
