#!/usr/bin/env python3
"""Asynchronous run with slow rollouts: a rollout thread runs ahead of the trainer, and no
token is ever trained on by a policy more than k versions newer than the one that sampled it;
in one process, and with two rollout engine processes (placement.mode = multi_process).
Usage: check_async.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, shutil, subprocess, sys

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
checks = []
for k, mode in ((0, "single_process"), (2, "single_process"), (1, "multi_process")):
    out = f"{work}/k{k}-{mode}"
    extra = ["--set", "placement.mode=multi_process", "--set", "placement.rollout_engines=2"] if mode == "multi_process" else []
    p = subprocess.run([kiln, "run", *extra, "--set", f"algorithm.staleness={k}", "--set", "rollout.step_delay_ms=25",
                        "--set", "run.steps=10", "--set", "algorithm.prompts_per_step=8", "--set", f"run.output_dir={out}",
                        "--set", "logging.plot=false", "--set", "logging.progress=false"],
                       capture_output=True, text=True, timeout=600)
    checks.append((p.returncode == 0, f"k={k} {mode}: kiln run exits 0 ({p.stderr[-300:]})"))
    if p.returncode:
        continue
    rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    seen = set()
    for r in rows:
        ages = [int(a) for a in r["staleness_histogram"]]
        seen.update(ages)
        checks.append((max(ages) <= k, f"k={k} {mode} step {r['step']}: token ages {sorted(set(ages))} <= {k}"))
        checks.append((r["stale_dropped_groups"] == 0, f"k={k} {mode} step {r['step']}: no group dropped for staleness"))
    checks.append((max(seen) == k, f"k={k} {mode}: the rollouts really ran {k} version(s) ahead (ages seen {sorted(seen)})"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
