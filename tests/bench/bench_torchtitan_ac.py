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
With --balance-routing N, the routers' expert biases are first balanced on the pack by N rounds of
the auxiliary-loss-free update at torchtitan's default rate (its _update_expert_bias:
expert_bias_E += 1e-3 * sign(mean load - load), centred), eager, before torch.compile: the peer of
`kiln bench gpu --balance-routing N`, which balances kiln's routers the same way (both random models
route unevenly otherwise, each in its own way, and the experts' grouped GEMMs run faster on even
counts).
Prints the model's expert load max/mean per MoE layer on the pack (averaged over the layers; after
the balancing too, with --balance-routing), then bench_tt's RESULT line (median step time,
tokens/s, peak memory; `expert_load_max_over_mean` summed over the MoE layers).

Usage (GPU machine, torchtitan's wheels on PYTHONPATH as the peer's README says):
  python3 tests/bench/bench_torchtitan_ac.py --peer DIR [--docs 32] [--compile] [--policy full|selective|none]
      [--balance-routing N]
Local smoke test: add --tiny --device cpu.
"""

import argparse

from torchtitan_peer import load_bench_tt


def moe_layers(model):
    """The model's MoE modules (those with torchtitan's load-balancing buffers)."""
    return [m for m in model.modules() if getattr(m, "expert_bias_E", None) is not None]


def pack(c, device):
    """bench_tt.run_variant's varlen pack: the same tokens, positions and document masks."""
    import torch

    nd, L = c["n_docs"], c["doc_len"]
    T = nd * L
    g = torch.Generator(device="cpu").manual_seed(1)
    stream = torch.randint(0, c["vocab"], (T + 1,), generator=g)
    tokens = stream[:-1].view(1, T).to(device)
    positions = torch.arange(L).repeat(nd).view(1, T).to(device)
    return tokens, positions


def balance_routing(model, c, device, rounds, rate=1e-3):
    """`rounds` no-grad forwards of the pack, each followed by torchtitan's expert-bias update
    (torchtitan.components.optimizer's _update_expert_bias at load_balance_coeff = rate; none for
    rounds = 0). Returns the mean over the MoE layers of (busiest expert's load / mean load),
    before and after, and leaves the load counters at zero."""
    import torch

    layers = moe_layers(model)
    if not layers:
        raise SystemExit("bench_torchtitan_ac: --balance-routing: the model has no MoE layer with expert_bias_E")
    tokens, positions = pack(c, device)

    def loads():
        for m in layers:
            m.tokens_per_expert_E.zero_()
        model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        return torch.stack([m.tokens_per_expert_E.clone() for m in layers])  # [L, E]

    def ratio(lo):
        return float((lo.max(1).values / lo.mean(1)).mean())

    with torch.no_grad():
        before = loads()
        for _ in range(rounds):
            lo = loads()
            for m, load in zip(layers, lo):
                delta = rate * torch.sign(load.mean() - load)
                m.expert_bias_E.add_(delta - delta.mean())
        after = loads() if rounds else before  # no rounds: the same routing, not measured again
        for m in layers:
            m.tokens_per_expert_E.zero_()
    return ratio(before), ratio(after)


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
    ap.add_argument("--balance-routing", type=int, default=0, metavar="N",
                    help="rounds of the router-bias balancing update on the pack before timing (0: none)")
    args = ap.parse_args()
    # The arguments first: the peer's import needs torchtitan and takes seconds.
    for name, value, least in (("--docs", args.docs, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--balance-routing", args.balance_routing, 0)):
        if value < least:
            ap.error(f"{name} {value} < {least}")
    tt = load_bench_tt(args.peer, "bench_torchtitan_ac")
    tt.GLM["n_docs"] = args.docs
    tt.TINY["n_docs"] = args.docs
    build = tt.build_model

    def build_with_ac(c, attn, device, notes):
        cfg, model = build(c, attn, device, notes)
        before, after = balance_routing(model, c, device, args.balance_routing)
        notes.append(f"expert load max/mean per layer {before:.2f}" if not args.balance_routing else
                     f"routing balanced by {args.balance_routing} rounds of the expert-bias update: "
                     f"expert load max/mean per layer {before:.2f} -> {after:.2f}")
        print(notes[-1], flush=True)
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
