"""Median CUDA-event time of a callable: the one timing rule of the GPU benchmarks
(bench_gpu.py, cudnn_fp8.py)."""
import torch


def time_ms(fn, warmup, iters):
    """Median wall time of fn() in ms over `iters` calls after `warmup` calls, CUDA
    events around each call (the device is synchronized after each)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
