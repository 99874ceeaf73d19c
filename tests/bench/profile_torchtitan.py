#!/usr/bin/env python3
"""One torchtitan forward+backward between cudaProfilerStart and cudaProfilerStop, for ncu.

The peer of `kiln bench gpu --profile`: the same model, shapes and step as
`../shared/peers/torchtitan/bench_tt.py --variant varlen [--compile]` (built by that script's
own functions, loaded from --peer), warmed up, timed unprofiled (median), then one more step
inside the profiler range. Run it under
  ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
    python3 tests/bench/profile_torchtitan.py --peer PEER/torchtitan --compile > tt.csv
and sum the kernels with tests/bench/ncu_kernel_summary.py tt.csv.
Needs torchtitan importable (PEER/torchtitan/whl installed into PYTHONPATH, as the peer's README says).
"""

import argparse
import statistics
import sys
import time

from torchtitan_peer import load_bench_tt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, help="the folder holding torchtitan's bench_tt.py")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (the headline variant)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    if a.warmup < 1 or a.steps < 1:
        ap.error(f"--warmup {a.warmup} and --steps {a.steps} must be >= 1")
    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_torchtitan: needs a CUDA GPU (ncu profiles GPU kernels)")
    tt = load_bench_tt(a.peer, "profile_torchtitan")
    notes = []
    c = tt.GLM
    tt.apply_shims(notes)
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    torch.manual_seed(0)
    _, model = tt.build_model(c, "varlen", "cuda", notes)
    compile_cfg = None
    if a.compile:
        from types import SimpleNamespace

        from torchtitan.distributed.compile import apply_compile

        compile_cfg = CompileConfig(enable=True)
        apply_compile(model, compile_config=compile_cfg, parallel_dims=SimpleNamespace(tp_enabled=False))
    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_cfg)
    nd, L = c["n_docs"], c["doc_len"]
    T = nd * L
    g = torch.Generator(device="cpu").manual_seed(1)
    stream = torch.randint(0, c["vocab"], (T + 1,), generator=g)
    tokens = stream[:-1].view(1, T).cuda()
    labels = stream[1:].view(1, T).cuda()
    positions = torch.arange(L).repeat(nd).view(1, T).cuda()
    gvt = torch.tensor(float(T), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        pred = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        loss, _ = loss_fn(pred, labels, gvt)
        del pred
        loss.backward()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()
    print(f"profile_torchtitan: varlen{' + torch.compile' if a.compile else ''}, {T} tokens in {nd} documents: "
          f"forward+backward {med:.4f} s (median of {a.steps}, unprofiled), {T / med:.0f} tokens/s; profiled one more; "
          f"notes: {notes}", flush=True)


if __name__ == "__main__":
    main()
