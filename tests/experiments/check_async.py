#!/usr/bin/env python3
"""Asynchronous runs: no token is ever trained on by a policy more than k versions newer than
the one that sampled it; in one process, with two rollout engine processes
(placement.mode = multi_process), and with the trainer and the reference in processes too (the
trainer node streams its newest version when the rollout thread applies weights).

Two regimes. Slow trainer (algorithm.update_delay_ms, fast rollouts): the rollout thread fills
its k-step lead while the trainer sleeps, so from step k + 1 on every token is exactly k
versions old (every step trains: zero-variance filtering off) -- the run must reach the bound, not just stay under it. Slow rollouts
(rollout.step_delay_ms): weights arrive between decode steps, ages mix; only the bound is
checked (how far ahead the thread gets there depends on timing).
Usage: check_async.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, shutil, subprocess, sys

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
checks = []
STEPS = 8
for k, mode, regime in ((0, "single_process", "slow_trainer"), (2, "single_process", "slow_trainer"),
                        (2, "single_process", "slow_rollouts"), (1, "multi_process", "slow_trainer"),
                        (1, "multi_process", "slow_rollouts"), (1, "trainer_process", "slow_rollouts")):
    name = f"k={k} {mode} {regime}"
    out = f"{work}/k{k}-{mode}-{regime}"
    extra = ["--set", "placement.mode=multi_process", "--set", "placement.rollout_engines=2"] if mode != "single_process" else []
    if mode == "trainer_process":
        extra += ["--set", "placement.reference=process", "--set", "placement.trainer=process"]
    # Slow trainer: every step trains (no zero-variance filtering), so version = step.
    delay = (["--set", "algorithm.update_delay_ms=600", "--set", "algorithm.filter_zero_variance=false"]
             if regime == "slow_trainer" else ["--set", "rollout.step_delay_ms=25"])
    p = subprocess.run([kiln, "run", *extra, *delay, "--set", f"algorithm.staleness={k}",
                        "--set", f"run.steps={STEPS}", "--set", "algorithm.prompts_per_step=8", "--set", f"run.output_dir={out}",
                        "--set", "logging.plot=false", "--set", "logging.progress=false"],
                       capture_output=True, text=True, timeout=600)
    checks.append((p.returncode == 0, f"{name}: kiln run exits 0 ({p.stderr[-300:]})"))
    if p.returncode:
        continue
    rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    checks.append((len(rows) == STEPS, f"{name}: {STEPS} steps logged ({len(rows)})"))
    for r in rows:
        ages = sorted({int(a) for a in r["staleness_histogram"]})
        checks.append((max(ages) <= k, f"{name} step {r['step']}: token ages {ages} <= {k}"))
        checks.append((r["stale_dropped_groups"] == 0, f"{name} step {r['step']}: no group dropped for staleness"))
        if regime == "slow_trainer":
            # Step s was sampled by version max(0, s-1-k) and is trained by version s-1.
            checks.append((r["policy_version"] == r["step"], f"{name} step {r['step']}: trained (version {r['policy_version']})"))
            want = [min(k, r["step"] - 1)]
            checks.append((ages == want, f"{name} step {r['step']}: the rollouts ran ahead as far as allowed "
                                         f"(ages {ages}, expected {want})"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
