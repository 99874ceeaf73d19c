#!/usr/bin/env python3
"""Where the routed experts' grouped GEMMs lose against a dense GEMM, at GLM-4.7-Flash's MoE
shapes (D = 2048 hidden, F = 1536 expert width, E = 64 experts, top-4, 8192 tokens a pack: M =
32768 routed rows), bf16.

kiln runs the experts as two `at::_grouped_mm` calls (kernels/moe.cpp: gate/up `[M, D] x [E, D,
2F]`, down `[M, F] x [E, F, D]`, weights stored `[E, out, in]` as in HF checkpoints and used
through a transposed view); autograd adds, for each, the input gradient (a grouped GEMM with the
weight untransposed) and the weight gradient (`x^T grad`, grouped along K by the same offsets).
For each of the six GEMMs the probe times (CUDA events, median of --iters after --warmup) and
prints TFLOP/s for:
  - the routed counts of a random top-4 routing (what the benchmark's step sees),
  - perfectly balanced counts (M / E rows each),
  - one dense GEMM of the same total FLOPs and the same operand layouts (torch.mm: cuBLAS),
  - at balanced counts, the experts as the batch of one strided batched GEMM (torch.bmm: cuBLAS),
    where the expert is a coordinate of one operand descriptor rather than a pointer per group
    (the layout of a contiguous grouped GEMM over rows padded to the tile),
so the gap splits into what balance costs and what the grouping itself costs. Also the forward
with weights stored `[E, in, out]` (no transposed view), to see whether the operand layout
matters to the grouped kernel.

Run on the GPU machine:  python3 tests/bench/probe_grouped_gemm.py [--json FILE]
"""
import argparse
import json

import torch

from cuda_timing import median_ms  # tests/bench/cuda_timing.py

D, F, E, K = 2048, 1536, 64, 4


def counts_random(tokens, gen):
    scores = torch.rand(tokens, E, generator=gen)
    top = scores.topk(K, dim=1).indices.flatten()
    return torch.bincount(top, minlength=E)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("KILN_TEST_SKIPPED: probe_grouped_gemm needs a CUDA GPU")
        return
    dev, bf = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    M = a.tokens * K
    routed = counts_random(a.tokens, gen)
    balanced = torch.full((E,), M // E, dtype=torch.long)
    print(f"probe_grouped_gemm: {torch.cuda.get_device_name()}, torch {torch.__version__}, M = {M} rows "
          f"({a.tokens} tokens x top-{K}), E = {E}, D = {D}, F = {F}")
    print(f"routed counts: min {int(routed.min())}, max {int(routed.max())}, mean {M / E:.0f}")

    w1 = torch.randn(E, 2 * F, D, device=dev, dtype=bf) * 0.02  # [E, 2F, D]
    w2 = torch.randn(E, D, F, device=dev, dtype=bf) * 0.02      # [E, D, F]
    x = torch.randn(M, D, device=dev, dtype=bf)
    act = torch.randn(M, F, device=dev, dtype=bf)
    g1 = torch.randn(M, 2 * F, device=dev, dtype=bf)
    g2 = torch.randn(M, D, device=dev, dtype=bf)
    w1_io = w1.transpose(1, 2).contiguous()  # [E, D, 2F]
    w2_io = w2.transpose(1, 2).contiguous()  # [E, F, D]

    rows = []

    def add(name, flops, fn_routed, fn_bal, fn_dense, fn_batched):
        t_r = median_ms(fn_routed, a.warmup, a.iters) / 1e3
        t_b = median_ms(fn_bal, a.warmup, a.iters) / 1e3
        t_d = median_ms(fn_dense, a.warmup, a.iters) / 1e3
        t_x = median_ms(fn_batched, a.warmup, a.iters) / 1e3
        r = {"gemm": name, "gflop": flops / 1e9, "routed_ms": t_r * 1e3, "balanced_ms": t_b * 1e3,
             "dense_ms": t_d * 1e3, "batched_ms": t_x * 1e3, "routed_tflops": flops / t_r / 1e12,
             "balanced_tflops": flops / t_b / 1e12, "dense_tflops": flops / t_d / 1e12,
             "batched_tflops": flops / t_x / 1e12}
        rows.append(r)
        print(f"  {name:<34} {r['gflop']:7.1f} GFLOP  routed {r['routed_ms']:6.3f} ms {r['routed_tflops']:5.0f} TF/s"
              f"  balanced {r['balanced_ms']:6.3f} ms {r['balanced_tflops']:5.0f}  dense {r['dense_ms']:6.3f} ms "
              f"{r['dense_tflops']:5.0f}  batched {r['batched_ms']:6.3f} ms {r['batched_tflops']:5.0f}")

    offs_r = torch.cumsum(routed, 0).to(device=dev, dtype=torch.int32)
    offs_b = torch.cumsum(balanced, 0).to(device=dev, dtype=torch.int32)
    gm = torch._grouped_mm
    f_gu = 2.0 * M * D * 2 * F
    f_dn = 2.0 * M * F * D
    # dense stand-ins: the same FLOPs as one [M, in] x [in, out] GEMM with the same operand layouts
    wd1 = w1.reshape(E * 2 * F, D)[: 2 * F]  # [2F, D]
    wd2 = w2.reshape(E * D, F)[:D]           # [D, F]
    # batched stand-ins at balanced counts: [E, M/E, *] views of the same rows
    xb, actb, g1b, g2b = (t.view(E, M // E, t.size(1)) for t in (x, act, g1, g2))
    bmm = torch.bmm
    print("GEMM                                  work        grouped, routed counts      grouped, balanced      one dense GEMM"
          "      batched, balanced")
    add("gate/up forward  x W1^T", f_gu, lambda: gm(x, w1.transpose(-2, -1), offs_r),
        lambda: gm(x, w1.transpose(-2, -1), offs_b), lambda: torch.mm(x, wd1.t()),
        lambda: bmm(xb, w1.transpose(-2, -1)))
    add("gate/up forward, W stored [E,D,2F]", f_gu, lambda: gm(x, w1_io, offs_r), lambda: gm(x, w1_io, offs_b),
        lambda: torch.mm(x, w1_io[0]),
        lambda: bmm(xb, w1_io))
    add("gate/up dX  g W1", f_gu, lambda: gm(g1, w1, offs_r), lambda: gm(g1, w1, offs_b), lambda: torch.mm(g1, wd1),
        lambda: bmm(g1b, w1))
    add("gate/up dW  g^T x (K grouped)", f_gu, lambda: gm(g1.t(), x, offs_r), lambda: gm(g1.t(), x, offs_b),
        lambda: torch.mm(g1.t(), x), lambda: bmm(g1b.transpose(-2, -1), xb))
    add("down forward  a W2^T", f_dn, lambda: gm(act, w2.transpose(-2, -1), offs_r),
        lambda: gm(act, w2.transpose(-2, -1), offs_b), lambda: torch.mm(act, wd2.t()),
        lambda: bmm(actb, w2.transpose(-2, -1)))
    add("down dX  g W2", f_dn, lambda: gm(g2, w2, offs_r), lambda: gm(g2, w2, offs_b), lambda: torch.mm(g2, wd2),
        lambda: bmm(g2b, w2))
    add("down dW  g^T a (K grouped)", f_dn, lambda: gm(g2.t(), act, offs_r), lambda: gm(g2.t(), act, offs_b),
        lambda: torch.mm(g2.t(), act), lambda: bmm(g2b.transpose(-2, -1), actb))
    six = [r for r in rows if "stored" not in r["gemm"]]
    tot = {k: sum(r[k] for r in six) for k in ("gflop", "routed_ms", "balanced_ms", "dense_ms", "batched_ms")}
    print(f"  the six of one layer: {tot['gflop']:.0f} GFLOP, routed {tot['routed_ms']:.3f} ms "
          f"({tot['gflop'] / tot['routed_ms']:.0f} TF/s), balanced {tot['balanced_ms']:.3f} ms "
          f"({tot['gflop'] / tot['balanced_ms']:.0f}), dense {tot['dense_ms']:.3f} ms ({tot['gflop'] / tot['dense_ms']:.0f}), "
          f"batched {tot['batched_ms']:.3f} ms ({tot['gflop'] / tot['batched_ms']:.0f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M,
                       "routed_min": int(routed.min()), "routed_max": int(routed.max()), "rows": rows,
                       "layer_total": tot}, f, indent=1)


if __name__ == "__main__":
    main()
