"""Timing of GPU work for the standalone probes in tests/bench (run on the GPU machine)."""
import statistics

import torch


def median_ms(fn, warmup, iters):
    """Median of `iters` CUDA-event timings of fn() in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)
