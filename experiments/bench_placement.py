#!/usr/bin/env python3
"""What placing actors in `kiln node` processes costs: the same experiment (the built-in default
unless --set says otherwise) in one process, then with the rollout engine, the reference and
the trainer moved into processes one after another. Reports the median seconds per step of
each phase from metrics.jsonl, the wall time per step, and whether the learning curve is the
same (staleness 0 and a fixed seed: it must be bit-identical).

Usage: bench_placement.py --kiln build/experiments/kiln [--steps 30] [--out DIR] [--set key=value ...]
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile

PLACEMENTS = [
    ("one process", []),
    ("engine in a node", ["placement.mode=multi_process"]),
    ("engine + reference in nodes", ["placement.mode=multi_process", "placement.reference=process"]),
    ("engine + reference + trainer in nodes",
     ["placement.mode=multi_process", "placement.reference=process", "placement.trainer=process"]),
]
PHASES = ["rollout_time", "ref_logprob_time", "actor_train_time", "update_weights_time"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be >= 3 (step 1 warms up; wall time per step needs two more)")
    out = args.out or tempfile.mkdtemp(prefix="kiln-bench-placement-")
    rows, curves = [], {}
    for name, keys in PLACEMENTS:
        d = os.path.join(out, name.replace(" ", "_").replace("+", "and"))
        shutil.rmtree(d, ignore_errors=True)
        cmd = [args.kiln, "run", "--set", f"run.steps={args.steps}", "--set", f"run.output_dir={d}",
               "--set", "logging.plot=false", "--set", "logging.progress=false"]
        for kv in keys + args.sets:
            cmd += ["--set", kv]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"{name}: kiln run failed ({p.returncode}): {p.stderr[-500:]}")
        m = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
        # Wall time per step from the elapsed clock (start-up excluded), steps 2.. (step 1 warms up).
        wall = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(m[1:], m[2:])]
        rows.append((name, [statistics.median(r[k] for r in m[1:]) for k in PHASES], statistics.median(wall)))
        curves[name] = [(r["reward_mean"], r["loss"], r["grad_norm"]) for r in m]
    base = curves[PLACEMENTS[0][0]]
    print(f"{args.steps} steps; median seconds per step (steps 2..{args.steps})\n")
    print("| placement | " + " | ".join(PHASES) + " | wall / step | vs one process | same curve |")
    print("|---" * (len(PHASES) + 4) + "|")
    for name, med, wall in rows:
        same = "yes" if curves[name] == base else "NO"
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in med) +
              f" | {wall:.4f} | {wall / rows[0][2]:.2f}x | {same} |")
    if any(curves[n] != base for n in curves):
        sys.exit("the placements' learning curves differ")


if __name__ == "__main__":
    main()
