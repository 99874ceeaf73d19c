#!/usr/bin/env python3
"""Which kernels run the experts' weight gradient, grouped and batched, and what they spend.

probe_grouped_gemm.py found the gate/up weight gradient (`dy^T x`, K grouped: ~512 rows an
expert at GLM-4.7-Flash's MoE shapes, D = 2048, 2F = 3072, E = 64, bf16) at 471 TF/s through
`at::_grouped_mm` and 617 as one strided batched cuBLAS GEMM (`torch.bmm`), both at balanced
counts. This names the kernel each launches (torch.profiler: name, grid, duration) and, between
torch.cuda.profiler.start()/stop(), runs each once more for `ncu --profile-from-start off`:

  ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
      --section WarpStateStats --section MemoryWorkloadAnalysis --csv \\
      python3 tests/bench/probe_grouped_kernels.py > ncu.csv

Run on the GPU machine; without CUDA it prints KILN_TEST_SKIPPED and exits 0.
"""
import argparse

import torch

D, F, E = 2048, 1536, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512, help="rows an expert (balanced counts)")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("KILN_TEST_SKIPPED: probe_grouped_kernels needs a CUDA GPU")
        return
    dev, bf = "cuda", torch.bfloat16
    M = E * a.rows
    x = torch.randn(M, D, device=dev, dtype=bf)
    g = torch.randn(M, 2 * F, device=dev, dtype=bf)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * a.rows
    xb, gb = x.view(E, a.rows, D), g.view(E, a.rows, 2 * F)
    ops = {
        "grouped (at::_grouped_mm, K grouped)": lambda: torch._grouped_mm(g.t(), x, offs),
        "batched (torch.bmm)": lambda: torch.bmm(gb.transpose(-2, -1), xb),
    }
    flop = 2.0 * M * D * 2 * F
    for name, f in ops.items():
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.iters):
                f()
            torch.cuda.synchronize()
        kern = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kern.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.device_time
        print(f"{name}: {a.rows} rows an expert, {flop / 1e9:.1f} GFLOP a call")
        for k, (n, us) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
            print(f"  {n // a.iters} launch(es) a call, {us / n:8.1f} us each"
                  f"{f', {flop / (us / a.iters) / 1e6:.0f} TF/s' if n == a.iters else ''}: {k[:150]}")
    for f in ops.values():  # one launch each inside the ncu range
        torch.cuda.profiler.start()
        f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
