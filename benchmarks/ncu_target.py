"""One attention launch to profile under Nsight Compute (scripts/device_ncu.sh,
scripts/device_ncu_compare.sh).

Runs one implementation on fresh standard-normal BF16 inputs of shape [B, H, S, d]:
`--warmup` calls first, then one more inside the NVTX range "profile" (so ncu can
select it with `--nvtx --nvtx-include profile/`, or with the kernel-name filter and
`--launch-skip <warmup>`). Implementations (`--impl`):
  fp8attn     the FP8 forward (and, with --bwd, the backward in --mode);
  cudnn_bf16  torch SDPA on the cuDNN backend, BF16 (forward, and backward with --bwd);
  cudnn_fp8   cuDNN's per-tensor-scaled FP8 SDPA (benchmarks/cudnn_fp8.py; its
              calibration launches run before the range).
Not a benchmark: the timings of bench_gpu.py are the ones reported.
"""
import argparse
import math
import sys

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x16x4096x128", help="BxHxSxd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="also run the backward")
    ap.add_argument("--mode", default="delta_matching", choices=("stale", "matched_do", "delta_matching"))
    ap.add_argument("--impl", default="fp8attn", choices=("fp8attn", "cudnn_bf16", "cudnn_fp8"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--scaling", default="row", choices=("row", "tile"),
                    help="fp8attn's FP8 recipe (tile: the backward with FP8ATTN_TILE_BWD=1)")
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    tau = 1.0 / math.sqrt(d)

    def profiled(fn):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()

    if args.impl == "fp8attn":
        import os  # noqa: PLC0415

        import fp8attn  # noqa: F401,PLC0415  (registers the ops)
        ops = torch.ops.fp8attn
        if args.scaling == "tile":
            os.environ["FP8ATTN_TILE_BWD"] = "1"  # the tile backward kernels (the default; in case the environment turns them off)

        def step():
            out, lse = ops.fwd(q, k, v, tau, args.causal, "fp8", 128, args.scaling)
            if args.bwd:
                ops.bwd(dout, q, k, v, out, lse, tau, args.causal, "fp8", args.mode, 128, "e4m3", False,
                        args.scaling)
        profiled(step)
    elif args.impl == "cudnn_bf16":
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
        qg, kg, vg = (x.clone().requires_grad_(args.bwd) for x in (q, k, v))

        def step():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=args.causal, scale=tau)
            if args.bwd:
                torch.autograd.grad(o, (qg, kg, vg), dout)
        profiled(step)
    else:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        import cudnn_fp8  # noqa: PLC0415  (benchmarks/cudnn_fp8.py)

        def time_fn(fn, warmup, iters):  # cudnn_fp8.run's timing hook: profile instead of timing
            profiled(fn)
            return 1.0
        res = cudnn_fp8.run(q, k, v, dout, args.causal, time_fn, bwd=args.bwd)
        if res.fwd_ms is None or (args.bwd and res.bwd_ms is None):
            print("cudnn_fp8 did not run:", cudnn_fp8.reason(res))
            return 1
    print("ok", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
