#!/usr/bin/env python3
"""Which of the GPU ops kiln's default mode calls give a row the same bits whatever the batch.

The default mode's train/rollout log-prob gap (docs/benchmarks.md) comes from ops whose result
for one token depends on how many other tokens share the call: a rollout decode step runs its
GEMMs at M = 32 rows, the trainer at M = 8192. This probe measures, on GLM-4.7-Flash's shapes,
for each op the trainer and the engine share (torch.mm / cuBLAS, torch._grouped_mm, FlashAttention
varlen), the fraction of rows whose bits change when the op runs on a smaller batch, under the
cuBLAS settings a process can choose (the default; no reduced-precision reductions; a cuBLASLt
workspace too small for split-K, as vLLM's batch-invariant mode sets it on Hopper).

Run on the GPU machine:  python3 tests/bench/probe_batch_invariance.py
(It re-runs itself in a child process for the workspace variant: the variables must be set
before the first cuBLAS call.)
"""
import argparse
import json
import os
import subprocess
import sys

import torch

# (name, N, K) of y[M, N] = x[M, K] w[N, K]^T at GLM-4.7-Flash's widths (model/glm4_moe_lite)
LINEARS = [
    ("q_a", 768, 2048), ("q_b", 20 * 256, 768), ("kv_a", 576, 2048), ("kv_b", 20 * (192 + 256), 512),
    ("o_proj", 2048, 20 * 256), ("dense_gate_up", 2 * 10240, 2048), ("dense_down", 2048, 10240),
    ("shared_gate_up", 2 * 1536, 2048), ("shared_down", 2048, 1536), ("lm_head", 154880, 2048),
]
SMALL_M = [1, 2, 8, 17, 32, 64, 128, 256, 1024]
BIG_M = 8192


def frac_rows_differ(a, b):
    return (a != b).any(dim=-1).float().mean().item(), (a.float() - b.float()).abs().max().item()


def probe_linears(gen):
    out = {}
    for name, n, k in LINEARS:
        w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
        x = torch.randn(BIG_M, k, generator=gen, device="cuda").bfloat16()
        ref = x @ w.t()
        cells = {}
        for m in SMALL_M:
            # the first m rows alone, and the last m rows alone (another offset in the batch)
            f0, d0 = frac_rows_differ(x[:m] @ w.t(), ref[:m])
            f1, d1 = frac_rows_differ(x[-m:].contiguous() @ w.t(), ref[-m:])
            cells[m] = {"rows_differ": max(f0, f1), "max_abs": max(d0, d1)}
        out[name] = cells
    return out


def probe_grouped(gen):
    """torch._grouped_mm over 64 experts: the rows of expert 0 in a big batch vs in a small one."""
    if not hasattr(torch, "_grouped_mm"):
        return {"skipped": "torch._grouped_mm missing"}
    e, d, f = 64, 2048, 1536
    out = {}
    for name, n, k in (("experts_gate_up", 2 * f, d), ("experts_down", d, f)):
        w = (torch.randn(e, n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
        big_counts = torch.full((e,), BIG_M * 4 // e, dtype=torch.int32)
        rows = int(big_counts.sum())
        x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
        offs = torch.cumsum(big_counts, 0).to(torch.int32).cuda()
        ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        cells = {}
        for per in (1, 2, 4, 16, 64):
            small_counts = torch.full((e,), per, dtype=torch.int32)
            # take each expert's first `per` rows of the big batch
            starts = torch.cumsum(big_counts, 0) - big_counts
            idx = torch.cat([torch.arange(s, s + per) for s in starts.tolist()]).cuda()
            small = torch._grouped_mm(x[idx].contiguous(), w.transpose(-2, -1),
                                      offs=torch.cumsum(small_counts, 0).to(torch.int32).cuda())
            fr, dm = frac_rows_differ(small, ref[idx])
            cells[per] = {"rows_differ": fr, "max_abs": dm}
        out[name] = cells
    return out


def probe_attention(gen):
    """FlashAttention varlen (the op kiln's kernels/attention.cpp calls): the last query of each
    sequence computed in the packed causal forward vs as a decode step against its keys."""
    h, dqk, dv, b, length = 20, 256, 256, 32, 288
    q = torch.randn(b * length, h, dqk, generator=gen, device="cuda").bfloat16()
    k = torch.randn(b * length, h, dqk, generator=gen, device="cuda").bfloat16()
    v = torch.randn(b * length, h, dv, generator=gen, device="cuda").bfloat16()
    cu = torch.arange(0, (b + 1) * length, length, dtype=torch.int32, device="cuda")
    scale = (192 + 64) ** -0.5
    full = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, True, False,
                                                   scale=scale)[0]
    last = torch.arange(length - 1, b * length, length, device="cuda")
    cu_q = torch.arange(0, b + 1, dtype=torch.int32, device="cuda")
    dec = torch.ops.aten._flash_attention_forward(q[last].contiguous(), k, v, cu_q, cu, 1, length, 0.0, True,
                                                  False, scale=scale)[0]
    one = torch.ops.aten._flash_attention_forward(q[last[:1]].contiguous(), k[:length], v[:length], cu_q[:2],
                                                  cu[:2], 1, length, 0.0, True, False, scale=scale)[0]
    f_dec, d_dec = frac_rows_differ(dec.flatten(1), full[last].flatten(1))
    f_one, d_one = frac_rows_differ(one.flatten(1), dec[:1].flatten(1))
    return {"decode_vs_packed": {"rows_differ": f_dec, "max_abs": d_dec},
            "decode_batch1_vs_batch32": {"rows_differ": f_one, "max_abs": d_one}}


def probe_trainer_ops(gen):
    """The other GEMMs of the trainer's packed forward: the router's fp32 [64 x 2048] and the
    log-prob head's bf16 GEMM with fp32 output [154880 x 2048] (lm_logits), and FlashAttention
    over one document packed with 27 others vs alone."""
    out = {}
    w = torch.randn(64, 2048, generator=gen, device="cuda") / 2048 ** 0.5
    x = torch.randn(BIG_M, 2048, generator=gen, device="cuda")
    ref = x @ w.t()
    out["router_fp32"] = {m: dict(zip(("rows_differ", "max_abs"), frac_rows_differ(x[:m] @ w.t(), ref[:m])))
                          for m in SMALL_M}
    wh = (torch.randn(154880, 2048, generator=gen, device="cuda") / 2048 ** 0.5).bfloat16()
    xh = torch.randn(4096, 2048, generator=gen, device="cuda").bfloat16()
    refh = torch.mm(xh, wh.t(), out_dtype=torch.float32)
    out["lm_head_fp32_out"] = {m: dict(zip(("rows_differ", "max_abs"),
                                           frac_rows_differ(torch.mm(xh[:m], wh.t(), out_dtype=torch.float32), refh[:m])))
                               for m in SMALL_M if m <= 1024}
    h, d, length, b = 20, 256, 288, 28
    q = torch.randn(b * length, h, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(b * length, h, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(b * length, h, d, generator=gen, device="cuda").bfloat16()
    cu = torch.arange(0, (b + 1) * length, length, dtype=torch.int32, device="cuda")
    full = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, True, False, scale=0.0625)[0]
    one = torch.ops.aten._flash_attention_forward(q[-length:].contiguous(), k[-length:].contiguous(), v[-length:].contiguous(),
                                                  cu[:2], cu[:2], length, length, 0.0, True, False, scale=0.0625)[0]
    fr, dm = frac_rows_differ(one.flatten(1), full[-length:].flatten(1))
    out["flash_prefill_alone_vs_packed"] = {"rows_differ": fr, "max_abs": dm}
    return out


def run(variant):
    if variant == "no_reduced_precision_reduction":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if variant == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"variant": variant, "linears": probe_linears(gen)}
    if variant == "default":
        res["grouped_mm"] = probe_grouped(gen)
        res["flash_attention"] = probe_attention(gen)
        res["trainer_ops"] = probe_trainer_ops(gen)
    return res


def show(res):
    print(f"== {res['variant']}")
    print(f"  {'op':16s} " + " ".join(f"M={m:<5d}" for m in SMALL_M) + "   (fraction of rows whose bits differ from M=8192's)")
    for name, cells in res["linears"].items():
        print(f"  {name:16s} " + " ".join(f"{cells[str(m)]['rows_differ'] if str(m) in cells else cells[m]['rows_differ']:<7.2f}" for m in SMALL_M))
    if "grouped_mm" in res:
        for name, cells in res["grouped_mm"].items():
            if name == "skipped":
                print("  grouped_mm skipped:", cells)
                continue
            print(f"  {name:16s} " + " ".join(f"{p}/expert {c['rows_differ']:.2f}" for p, c in cells.items()))
    for name, cells in res.get("trainer_ops", {}).items():
        if "rows_differ" in cells:
            print(f"  {name}: rows differ {cells['rows_differ']:.2f}, max |diff| {cells['max_abs']:.2e}")
        else:
            print(f"  {name:16s} " + " ".join(f"M={m}:{c['rows_differ']:.2f}" for m, c in cells.items()))
    if "flash_attention" in res:
        for name, c in res["flash_attention"].items():
            print(f"  flash {name}: rows differ {c['rows_differ']:.2f}, max |diff| {c['max_abs']:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.variant:  # a child: one variant, JSON on stdout
        print(json.dumps(run(a.variant)))
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    results = []
    for variant, env in (("default", {}), ("no_reduced_precision_reduction", {}), ("cublaslt", {}),
                         ("lt_workspace_1k", {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8"})):
        p = subprocess.run([sys.executable, __file__, "--variant", variant], env={**os.environ, **env},
                           capture_output=True, text=True)
        if p.returncode:
            print(f"== {variant}: failed\n{p.stderr[-2000:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["env"] = env
        results.append(r)
        show(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
