#!/usr/bin/env python3
"""transformers' `generate` with its static cache on the shapes of `kiln bench rollout --device cuda`.

The baseline of issue 13's rollout table (docs/benchmarks.md, "Rollout decode on the H200"): a
random-weight Glm4MoeLiteForCausalLM at GLM-4.7-Flash dimensions (tests/fixtures/
make_glm47_flash_checkpoint.py's flash_config: hidden 2048, MLA 20 heads, 64 routed experts top-4
+ 1 shared, vocabulary 154880) with --layers decoder layers (the first dense), bf16, SDPA
attention, grouped-GEMM experts, on GPU 0. For each context P and batch B: B random prompts of P
tokens, `generate(..., cache_implementation="static", do_sample=True, top_k=0, temperature=1,
max_new_tokens=min_new_tokens=N)` (no early stop), and the median time between two consecutive
calls of a logits processor that synchronises the GPU: one decode step (forward over the static
cache, sampling, generate's own host work). torch.compile is off (generate would otherwise
compile the decode step of a static cache) unless --compile.

    python3 tests/bench/bench_rollout_transformers.py --layers 4 --contexts 1024 8192 \\
        --batch-sizes 1 32 128 256 --new-tokens 32 [--json OUT.jsonl]

Prints a table: context, batch, decode step (ms), generated tokens/s, the prefill's seconds, or
OOM when the shape does not fit (the static cache holds per-head keys and values: 20 KB per token
and layer). Exits 2 when transformers or a GPU is missing.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="let generate torch.compile the static-cache decode step")
    ap.add_argument("--json", default=None, help="also write one JSON object per shape here")
    a = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, LogitsProcessor, LogitsProcessorList
        from make_glm47_flash_checkpoint import flash_config
    except ImportError as e:
        print(f"bench_rollout_transformers: transformers with Glm4MoeLite is needed: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_rollout_transformers: no CUDA device", file=sys.stderr)
        return 2

    class StepClock(LogitsProcessor):
        """Called once per generated token, after that step's forward: the GPU time line."""

        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return scores

    cfg = flash_config(Glm4MoeLiteConfig, a.layers)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Glm4MoeLiteForCausalLM(cfg)
    model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    print(f"bench_rollout_transformers: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{a.layers} layers, bf16, {a.new_tokens} new tokens, compile {'on' if a.compile else 'off'}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    print(f"{'context':>8} {'batch':>6} {'step':>10} {'tok/s':>10} {'prefill_s':>10}", flush=True)
    out = open(a.json, "w") if a.json else None

    def run(P, B):
        ids = torch.randint(3, cfg.vocab_size, (B, P), device="cuda")
        clock = StepClock()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                           min_new_tokens=a.new_tokens, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                           cache_implementation="static", disable_compile=not a.compile,
                           logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
        steps = [b - c for b, c in zip(clock.t[1:], clock.t[:-1])]
        return statistics.median(steps), clock.t[0] - t0

    run(64, 2)  # warm-up: kernels, allocator
    for P in a.contexts:
        for B in a.batch_sizes:
            row = {"context": P, "batch": B, "new_tokens": a.new_tokens, "layers": a.layers, "compile": a.compile,
                   "transformers": transformers.__version__}
            try:
                step, prefill = run(P, B)
                row.update(step_s=step, tokens_per_s=B / step, prefill_s=prefill)
                print(f"{P:>8} {B:>6} {step * 1e3:>8.2f}ms {B / step:>10.0f} {prefill:>10.2f}", flush=True)
            except torch.OutOfMemoryError:
                row.update(oom=True)
                print(f"{P:>8} {B:>6} {'OOM':>10} {'-':>10} {'-':>10}", flush=True)
            torch.cuda.empty_cache()
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
