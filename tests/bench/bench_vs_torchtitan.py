#!/usr/bin/env python3
"""kiln beside torchtitan compiled on one CUDA GPU, alternated, in one invocation (issue 14).

Runs ROUNDS rounds; each round times `kiln bench gpu` (forward+backward of one packed
micro-batch at GLM-4.7-Flash shapes, bf16) and then torchtitan's DeepSeek-V3 code at the same
shapes with torch.compile (tests/bench/bench_torchtitan_ac.py --policy none: the peer's
bench_tt.py model, varlen FlashAttention-2, the same FLOP count and MFU formula), each in its own
process, with the routing of each side's random model as it is and, with --balance-routing N,
with both sides' routers balanced by the same N rounds of the auxiliary-loss-free bias update
(kiln bench gpu --balance-routing, bench_torchtitan_ac.py --balance-routing). Alternating keeps
drift of the GPU's clocks from favouring one side. Prints a table of every run (tokens/s, MFU,
peak GiB, expert load max/mean summed over the MoE layers) and kiln / torchtitan per routing,
and writes it as JSON with --out.

    python3 tests/bench/bench_vs_torchtitan.py --kiln build/experiments/kiln --peer PEER_DIR \\
        [--layers 4] [--tokens 8192] [--docs 8] [--rounds 2] [--balance-routing 300] [--out FILE]

PEER_DIR holds the peer's bench_tt.py; torchtitan's wheels must be importable (PYTHONPATH).
`--layers` other than 4 is refused: bench_tt.py builds 4 layers (1 dense + 3 MoE).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_kiln(args, balance):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [args.kiln, "bench", "gpu", "--layers", str(args.layers), "--tokens", str(args.tokens), "--docs",
           str(args.docs), "--steps", str(args.steps), "--forward-backward-only", "--json", out]
    if balance:
        cmd += ["--balance-routing", str(balance)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"failed": f"exit {p.returncode}: {p.stderr.strip()[-400:]}"}
    j = json.load(open(out))
    os.remove(out)
    return {"tokens_per_s": j["train_tokens_per_s"], "mfu": j["mfu"], "peak_gib": j["peak_memory_gib"],
            "load": j["expert_load_max_over_mean"], "load_per_layer": j["expert_load_max_over_mean_per_layer"],
            "gemm_tflops": j["gemm_bf16_tflops"]}


def run_torchtitan(args, balance):
    cmd = [sys.executable, os.path.join(HERE, "bench_torchtitan_ac.py"), "--peer", args.peer, "--docs", str(args.docs),
           "--compile", "--policy", "none", "--steps", str(args.steps)]
    if balance:
        cmd += ["--balance-routing", str(balance)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    result = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    if p.returncode != 0 or result is None:
        return {"failed": f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}"}
    per_layer = next((n for n in result.get("notes", []) if "expert load max/mean per layer" in n), "")
    return {"tokens_per_s": result["tokens_per_s"], "peak_gib": result.get("peak_timed_GiB"),
            "load": result.get("expert_load_max_over_mean"), "note": per_layer,
            "tflops": result["achieved_tflops"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kiln", required=True, help="the kiln executable (built with CUDA)")
    ap.add_argument("--peer", required=True, help="folder holding the peer's bench_tt.py")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (median)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--balance-routing", type=int, default=0, metavar="N",
                    help="also run both sides with their routers balanced by N update rounds (0: only as they are)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--out", help="write every run as JSON here")
    args = ap.parse_args()
    if args.layers != 4:
        ap.error(f"--layers {args.layers}: the peer's bench_tt.py builds 4 layers (1 dense + 3 MoE); give 4")
    if args.tokens != 1024 * args.docs:
        ap.error(f"--tokens {args.tokens} with --docs {args.docs}: the peer packs documents of 1024 tokens, "
                 f"so --tokens must be 1024 x --docs ({1024 * args.docs})")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if not os.access(args.kiln, os.X_OK):
        ap.error(f"--kiln {args.kiln} is not an executable")
    if not os.path.isfile(os.path.join(args.peer, "bench_tt.py")):
        ap.error(f"--peer {args.peer} holds no bench_tt.py")

    routings = [0] + ([args.balance_routing] if args.balance_routing > 0 else [])
    runs = []
    for r in range(args.rounds):
        for balance in routings:
            # kiln first in even rounds, torchtitan first in odd ones
            order = [("kiln", run_kiln), ("torchtitan", run_torchtitan)]
            for side, fn in (order if r % 2 == 0 else order[::-1]):
                res = fn(args, balance)
                res.update(side=side, round=r + 1, routing="balanced" if balance else "as initialised")
                runs.append(res)
                print(json.dumps(res), flush=True)

    print(f"\n{'round':>5} {'routing':>15} {'side':>11} {'tokens/s':>10} {'peak GiB':>9} {'load max/mean':>14}")
    for x in runs:
        if "failed" in x:
            print(f"{x['round']:>5} {x['routing']:>15} {x['side']:>11}  failed: {x['failed'].splitlines()[-1]}")
            continue
        print(f"{x['round']:>5} {x['routing']:>15} {x['side']:>11} {x['tokens_per_s']:>10.0f} "
              f"{x['peak_gib'] or 0:>9.1f} {x['load'] or 0:>14.2f}")
    for routing in ("as initialised", "balanced"):
        k = [x["tokens_per_s"] for x in runs if x["routing"] == routing and x["side"] == "kiln" and "failed" not in x]
        t = [x["tokens_per_s"] for x in runs if x["routing"] == routing and x["side"] == "torchtitan" and "failed" not in x]
        if k and t:
            print(f"routing {routing}: kiln {statistics.mean(k):.0f} / torchtitan compiled {statistics.mean(t):.0f} "
                  f"tokens/s = {statistics.mean(k) / statistics.mean(t):.3f}x (means of {len(k)} and {len(t)} runs)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    sys.exit(1 if any("failed" in x for x in runs) else 0)


if __name__ == "__main__":
    main()
