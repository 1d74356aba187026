"""One fp8attn launch to profile under Nsight Compute (scripts/device_ncu.sh).

Runs the FP8 forward (and, with --bwd, the backward in one delta mode) on fresh
standard-normal BF16 inputs of shape [B, H, S, d]: `--warmup` calls first, then
one more, so ncu selects the last launch with the kernel-name filter and
`--launch-skip <warmup>`. Not a benchmark: the
timings of bench_gpu.py are the ones reported.
"""
import argparse
import math

import torch

import fp8attn  # noqa: F401  (registers the ops)

OPS = torch.ops.fp8attn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x16x4096x128", help="BxHxSxd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="also run the backward")
    ap.add_argument("--mode", default="delta_matching", choices=("stale", "matched_do", "delta_matching"))
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    tau = 1.0 / math.sqrt(d)
    for _ in range(args.warmup + 1):
        out, lse = OPS.fwd(q, k, v, tau, args.causal, "fp8", 128)
        if args.bwd:
            OPS.bwd(dout, q, k, v, out, lse, tau, args.causal, "fp8", args.mode, 128, "e4m3", False)
    torch.cuda.synchronize()
    print("ok", args)


if __name__ == "__main__":
    main()
