#!/usr/bin/env python3
"""torchtitan with activation checkpointing at long packs, the peer of
`kiln bench gpu --tokens 32768 --docs 32 --activation-checkpointing` (issue 14).

Runs the varlen model of the torchtitan peer's benchmark (../shared/peers/torchtitan/bench_tt.py:
torchtitan 0.3.0's DeepSeek-V3 code at GLM-4.7-Flash shapes, 4 layers, bf16, the same FLOP count
and MFU formula) with DOCS documents of 1024 tokens in one packed micro-batch, and torchtitan's
own activation-checkpointing policy applied before torch.compile, in torchtitan's order:
  --policy full       FullAC (torchtitan.distributed.activation_checkpoint): every block recomputed
                      in the backward (the default)
  --policy selective  SelectiveAC: per op, the outputs of attention, all-to-alls, the
                      compute-intensive ops and every second matmul saved, the rest recomputed
  --policy none       no checkpointing
Prints bench_tt's RESULT line (median step time, tokens/s, peak memory).

Usage (GPU machine, torchtitan's wheels on PYTHONPATH as the peer's README says):
  python3 tests/bench/bench_torchtitan_ac.py --peer DIR [--docs 32] [--compile] [--policy full|selective|none]
Local smoke test: add --tiny --device cpu.
"""

import argparse

from torchtitan_peer import load_bench_tt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, help="folder holding bench_tt.py")
    ap.add_argument("--docs", type=int, default=32, help="documents of 1024 tokens in the pack")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--policy", choices=("full", "selective", "none"), default="full",
                    help="torchtitan's activation-checkpointing policy on every block")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    # The arguments first: the peer's import needs torchtitan and takes seconds.
    for name, value, least in (("--docs", args.docs, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            ap.error(f"{name} {value} < {least}")
    tt = load_bench_tt(args.peer, "bench_torchtitan_ac")
    tt.GLM["n_docs"] = args.docs
    tt.TINY["n_docs"] = args.docs
    build = tt.build_model

    def build_with_ac(c, attn, device, notes):
        cfg, model = build(c, attn, device, notes)
        if args.policy != "none":
            from torchtitan.distributed import activation_checkpoint as ac

            policy = ac.FullAC if args.policy == "full" else ac.SelectiveAC
            policy(policy.Config()).apply(model)
            notes.append(f"torchtitan {policy.__name__} on every block")
        return cfg, model

    tt.build_model = build_with_ac
    tt.run_variant(argparse.Namespace(variant="varlen", compile=args.compile, tiny=args.tiny, device=args.device,
                                      warmup=args.warmup, steps=args.steps))


if __name__ == "__main__":
    main()
