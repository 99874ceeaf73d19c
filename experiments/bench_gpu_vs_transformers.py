#!/usr/bin/env python3
"""kiln vs transformers on one CUDA GPU, in the same run, on the same shapes and tokens count.

Runs `kiln bench gpu` (bf16 training path, log-probs, rollout, weight sync; see
experiments/bench_gpu.hpp), then transformers' Glm4MoeLiteForCausalLM built from the config.json
kiln wrote (GLM-4.7-Flash dimensions, same layer count), bf16, sdpa attention, grouped_mm
experts, forward+backward of the same number of tokens (`docs` rows of tokens/docs, which is
the packed micro-batch's attention pattern: causal within each document), and prints both side
by side. MFU for both uses kiln's FLOP count of that micro-batch against the GEMM rate kiln
measured in the same run.

    python3 experiments/bench_gpu_vs_transformers.py --kiln build/experiments/kiln --out OUT
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def median_seconds(fn, warmup, steps):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def run_transformers(config_dir, tokens, docs, steps, warmup):
    import torch
    import transformers
    from transformers import AutoConfig, Glm4MoeLiteForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    cfg.use_cache = False
    with torch.device("cuda"):
        model = Glm4MoeLiteForCausalLM(cfg)
    model.to(torch.bfloat16)
    model.train()
    n = tokens // docs
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (docs, n), device="cuda", generator=g)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    torch.cuda.reset_peak_memory_stats()
    fb = median_seconds(step, warmup, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    model.zero_grad(set_to_none=True)

    def logprobs():  # the usual Python-engine way: full logits, fp32 log_softmax, gather
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])

    lpt = median_seconds(logprobs, warmup, steps)
    return {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "train_step_s": fb,
        "train_tokens_per_s": tokens / fb,
        "peak_memory_gib": peak,
        "log_probs_time_s": lpt,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True, help="path of the kiln executable")
    ap.add_argument("--out", required=True, help="directory for kiln.json, transformers.json, summary.md")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    kiln_json = os.path.join(a.out, "kiln.json")
    cmd = [a.kiln, "bench", "gpu", "--layers", str(a.layers), "--tokens", str(a.tokens), "--docs", str(a.docs),
           "--steps", str(a.steps), "--json", kiln_json, "--config-dir", os.path.join(a.out, "model")]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"kiln bench gpu failed with exit code {r.returncode}")
    k = json.load(open(kiln_json))
    t = run_transformers(os.path.join(a.out, "model"), a.tokens, a.docs, a.steps, a.warmup)
    peak = k["gemm_bf16_tflops"] * 1e12
    t["mfu"] = k["model_tflop_per_step"] * 1e12 / t["train_step_s"] / peak
    json.dump(t, open(os.path.join(a.out, "transformers.json"), "w"), indent=2)

    rows = [
        ("train tokens/s (fwd+bwd)", f"{t['train_tokens_per_s']:.0f}", f"{k['train_tokens_per_s']:.0f}",
         f"{k['train_tokens_per_s'] / t['train_tokens_per_s']:.2f}x"),
        ("MFU vs measured bf16 GEMM", f"{100 * t['mfu']:.1f}%", f"{100 * k['mfu']:.1f}%", ""),
        ("peak memory GiB (fwd+bwd)", f"{t['peak_memory_gib']:.1f}", f"{k['peak_memory_gib']:.1f}",
         f"{t['peak_memory_gib'] / k['peak_memory_gib']:.2f}x less"),
        ("log_probs_time s", f"{t['log_probs_time_s']:.3f}", f"{k['log_probs_time_s']:.3f}",
         f"{t['log_probs_time_s'] / k['log_probs_time_s']:.2f}x"),
        ("update_weights_time s (checked)", "-", f"{k['update_weights_time_s']:.4f}",
         f"{k['update_weights_gbs']:.0f} GB/s"),
        ("update_weights unchecked", "-", f"{k['update_weights_nocheck_time_s']:.4f}",
         f"{k['update_weights_nocheck_gbs']:.0f} GB/s"),
        ("plain D2D copy, same bytes", "-", f"{k['plain_copy_time_s']:.4f}", f"{k['plain_copy_gbs']:.0f} GB/s"),
        ("train/rollout |logprob diff| mean", "-", f"{k['train_rollout_logprob_abs_diff_mean']:.2e}",
         f"max {k['train_rollout_logprob_abs_diff_max']:.2e}"),
        ("trainer step incl. AdamW tokens/s", "-", f"{k['trainer_step_tokens_per_s']:.0f}",
         f"peak {k['trainer_step_peak_memory_gib']:.1f} GiB"),
    ]
    head = (f"GLM-4.7-Flash dims, {a.layers} layers, bf16, {a.tokens} tokens ({a.docs} x {a.tokens // a.docs}); "
            f"measured limits: bf16 GEMM {k['gemm_bf16_tflops']:.0f} TFLOP/s, D2D copy {k['copy_read_write_gbs']:.0f} "
            f"GB/s read+write; transformers {t['transformers_version']}, torch {t['torch_version']}")
    lines = [head, "", "| metric | transformers | kiln | kiln vs transformers / note |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {m} | {x} | {y} | {z} |" for m, x, y, z in rows]
    md = "\n".join(lines)
    open(os.path.join(a.out, "summary.md"), "w").write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
