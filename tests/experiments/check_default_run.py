#!/usr/bin/env python3
"""Runs `kiln run` (the built-in default experiment) and checks that it learns: first-step
mean reward <= 0.3, some step >= 0.8, within 15 minutes; metrics.jsonl and the PNG exist.
Usage: check_default_run.py PATH_TO_KILN RUN_DIR [--set KEY=VALUE ...] (further arguments go to
`kiln run`, e.g. another model package). Prints "N passed, 0 failed"."""
import json, os, shutil, subprocess, sys, time

kiln, run_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
shutil.rmtree(run_dir, ignore_errors=True)  # a finished run there would be refused (run.overwrite)
t0 = time.time()
p = subprocess.run([kiln, "run", "--set", f"run.output_dir={run_dir}", "--set", "logging.progress=false"] + extra,
                   timeout=900, capture_output=True, text=True)
elapsed = time.time() - t0
checks = []
checks.append((p.returncode == 0, f"kiln run exits 0 (got {p.returncode}: {p.stderr[-500:]})"))
rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))] if p.returncode == 0 else []
first = rows[0]["reward_mean"] if rows else None
best = max((r["reward_mean"] for r in rows), default=None)
checks.append((first is not None and first <= 0.3, f"first-step reward {first} <= 0.3"))
checks.append((best is not None and best >= 0.8, f"best reward {best} >= 0.8"))
checks.append((elapsed < 900, f"finished in {elapsed:.0f}s < 15 min"))
checks.append((os.path.exists(os.path.join(run_dir, "reward_kl.png")), "reward/KL plot written"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
