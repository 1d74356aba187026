"""Median CUDA-event time of a callable: the one timing rule of the GPU benchmarks
(bench_gpu.py, cudnn_fp8.py)."""
import argparse

import torch


def int_at_least(low):
    """argparse type: an int >= low (e.g. --iters 0 would leave no time to take a median of)."""
    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    return parse


def positive_float(text):
    """argparse type: a finite float > 0 (tolerances)."""
    value = float(text)
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def time_ms(fn, warmup, iters):
    """Median wall time of fn() in ms over `iters` (>= 1) calls after `warmup` calls,
    CUDA events around each call (the device is synchronized after each).
    Raises ValueError if iters < 1."""
    if iters < 1:
        raise ValueError(f"time_ms: iters must be >= 1, got {iters}")
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
