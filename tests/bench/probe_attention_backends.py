#!/usr/bin/env python3
"""FlashAttention-2 varlen (what kiln and torchtitan run) beside cuDNN's fused attention over the
same packed documents, at GLM-4.7-Flash's attention shapes (20 heads, q/k and v head dim 256,
bf16, causal within each document).

Both are ATen ops of the torch wheel: at::_flash_attention_forward/_backward (FlashAttention-2,
Dao 2023) and at::_cudnn_attention_forward/_backward (cuDNN's SDPA graph; its ragged form takes
the same cu_seqlens; reached here through nested jagged tensors and SDPA, whose autograd formula
calls the backward without a bias, which Python cannot pass to the op itself). For each pack the
probe prints the forward and forward+backward times (CUDA events, median of --iters after
--warmup), the attention FLOP rate (causal: half the square), and the largest difference of each
backend's output and gradients from an fp32 reference on the first document; for packs of equal
documents also both backends through SDPA on a dense [B, H, S, D] view (no ragged offsets); and
what cuDNN's first ragged forward at a new shape costs against its second (an execution plan is
built on first use and meant to be kept).

Run on the GPU machine:  python3 tests/bench/probe_attention_backends.py [--json FILE]
"""
import argparse
import json
import math
import time

import torch

from cuda_timing import median_ms  # tests/bench/cuda_timing.py

H, D = 20, 256


def packs():
    g = torch.Generator().manual_seed(0)
    lens = []
    left = 8192
    while left > 0:  # documents of 64 .. 2048 tokens, 8192 in all
        n = min(left, int(torch.randint(64, 2049, (1,), generator=g)))
        lens.append(n)
        left -= n
    return [("8 x 1024", [1024] * 8), ("32 x 1024", [1024] * 32), ("1 x 8192", [8192]),
            (f"{len(lens)} ragged (64..2048)", lens)]


def flops(lens, backward):
    f = sum(4 * H * D * n * (n + 1) / 2 for n in lens)  # QK^T and PV, causal
    return f * (3.5 if backward else 1.0)  # backward ~2.5x forward (FlashAttention-2's count)


def fa2(q, k, v, cu, mx, scale):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False,
                                                                       scale=scale)
    def bwd(do):
        return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu, cu, mx, mx, 0.0, True, rng, unused,
                                                        scale=scale)
    return out, bwd


def cudnn(q, k, v, cu, mx, scale):
    # Through nested (jagged) tensors and SDPA: ATen's autograd formula calls
    # _cudnn_attention_backward with no bias, which Python cannot pass to the op directly.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    offs = cu.long()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    nj = [torch.nested.nested_tensor_from_jagged(x, offs, max_seqlen=mx).transpose(1, 2) for x in leaves]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(*nj, is_causal=True, scale=scale)
    out = o.transpose(1, 2).values()
    def bwd(do):
        return torch.autograd.grad(out, leaves, do, retain_graph=True)
    return out.detach(), bwd


def dense(backend):
    """SDPA on [B, H, S, D] views of the pack (equal documents only): no ragged offsets."""
    def run(q, k, v, cu, mx, scale):
        from torch.nn.attention import sdpa_kernel
        T = q.shape[0]
        if T % mx or any(int(cu[i + 1] - cu[i]) != mx for i in range(cu.numel() - 1)):
            raise ValueError("documents of different lengths: no dense layout")
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        views = [x.view(T // mx, mx, H, D).transpose(1, 2) for x in leaves]
        with sdpa_kernel([backend]):
            o = torch.nn.functional.scaled_dot_product_attention(*views, is_causal=True, scale=scale)
        out = o.transpose(1, 2).reshape(T, H, D)
        def bwd(do):
            return torch.autograd.grad(out, leaves, do, retain_graph=True)
        return out.detach(), bwd
    return run


def plan_builds(lens_list, scale):
    """Seconds of cuDNN's first forward at a new (documents, longest) shape against its second."""
    rows = []
    for lens in lens_list:
        T, mx = sum(lens), max(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ts = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=scale)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        rows.append({"docs": len(lens), "longest": mx, "first_s": ts[0], "second_s": ts[1]})
        print(f"  cuDNN plan: {len(lens)} documents, longest {mx}: first forward {ts[0] * 1e3:.1f} ms, "
              f"second {ts[1] * 1e3:.2f} ms")
    return rows


def reference(q, k, v, n, scale):
    qf, kf, vf = (x[:n].float().transpose(0, 1).requires_grad_() for x in (q, k, v))
    s = (qf @ kf.transpose(1, 2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return qf, kf, vf, s.softmax(-1) @ vf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    scale = 1.0 / math.sqrt(D)
    rows = []
    for name, lens in packs():
        T, mx = sum(lens), max(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        row = {"pack": name, "tokens": T}
        results = {}
        from torch.nn.attention import SDPBackend
        for bk, fn in (("fa2", fa2), ("cudnn", cudnn), ("fa2_dense", dense(SDPBackend.FLASH_ATTENTION)),
                       ("cudnn_dense", dense(SDPBackend.CUDNN_ATTENTION))):
            try:
                out, bwd = fn(q, k, v, cu, mx, scale)
                grads = bwd(do)
                results[bk] = (out, grads)
                tf = median_ms(lambda: fn(q, k, v, cu, mx, scale), a.warmup, a.iters)
                tfb = median_ms(lambda: fn(q, k, v, cu, mx, scale)[1](do), a.warmup, a.iters)
                row[bk] = {"fwd_ms": tf, "fwd_bwd_ms": tfb, "fwd_tflops": flops(lens, False) / tf / 1e9,
                           "fwd_bwd_tflops": flops(lens, True) / tfb / 1e9}
            except Exception as e:  # noqa: BLE001 - report which backend refused and why
                row[bk] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        if "fa2" in results:
            n = min(lens[0], 1024)  # the first document against fp32
            qf, kf, vf, ref = reference(q, k, v, n, scale)
            ref.backward(do[:n].float().transpose(0, 1))
            want = (ref.transpose(0, 1), qf.grad.transpose(0, 1), kf.grad.transpose(0, 1), vf.grad.transpose(0, 1))
            for bk, (o, g) in results.items():
                row[f"{bk}_vs_fp32_max_abs"] = {nm: (x[:n].float() - w).abs().max().item()
                                                for nm, x, w in zip(("out", "dq", "dk", "dv"), (o,) + tuple(g), want)}
        rows.append(row)
        print(f"{name} (T = {T})")
        for bk in ("fa2", "cudnn", "fa2_dense", "cudnn_dense"):
            r = row[bk]
            line = (f"  {bk:>12}: fwd {r['fwd_ms']:7.3f} ms ({r['fwd_tflops']:3.0f} TF/s), fwd+bwd {r['fwd_bwd_ms']:7.3f} ms "
                    f"({r['fwd_bwd_tflops']:3.0f} TF/s)" if "error" not in r else f"  {bk:>12}: {r['error']}")
            if f"{bk}_vs_fp32_max_abs" in row:
                line += " | max abs vs fp32 (first document): " + ", ".join(
                    f"{k} {v:.1e}" for k, v in row[f"{bk}_vs_fp32_max_abs"].items())
            print(line)
    rows.append({"plans": plan_builds([[1000, 24], [1024] * 8, [900] * 8, [900] * 9, [3000, 5192]], scale)})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
