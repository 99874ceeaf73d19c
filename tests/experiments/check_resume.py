#!/usr/bin/env python3
"""Resume from a checkpoint continues exactly: run A for 8 steps with checkpoints every 4;
run B resumes from A's step-4 checkpoint; steps 5-8 must give the same metrics (data order
from the restored RNG, weights, optimizer state). Also: the checkpoint is HF layout.
Usage: check_resume.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, shutil, subprocess, sys

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
common = ["--set", "run.steps=8", "--set", "logging.plot=false", "--set", "logging.progress=false",
          "--set", "algorithm.prompts_per_step=8"]
a = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/a", "--set", "run.checkpoint_every=4"],
                   capture_output=True, text=True, timeout=600)
ck = f"{work}/a/checkpoints/step_000004"
b = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/b", "--set", f"run.resume_from={ck}"],
                   capture_output=True, text=True, timeout=600)
bad = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/c", "--set", f"run.resume_from={work}/nowhere"],
                     capture_output=True, text=True, timeout=600)
checks = [(a.returncode == 0, f"run A exits 0 ({a.stderr[-300:]})"), (b.returncode == 0, f"resumed run exits 0 ({b.stderr[-300:]})")]
for f in ["config.json", "model.safetensors.index.json", "optimizer.pt", "state.json"]:
    checks.append((os.path.exists(os.path.join(ck, f)), f"checkpoint has {f}"))
if a.returncode == 0 and b.returncode == 0:
    ra = {r["step"]: r for r in map(json.loads, open(f"{work}/a/metrics.jsonl"))}
    rb = {r["step"]: r for r in map(json.loads, open(f"{work}/b/metrics.jsonl"))}
    checks.append((sorted(rb) == [5, 6, 7, 8], f"resumed run covers steps 5-8 (got {sorted(rb)})"))
    for s in sorted(rb):
        for k in ["reward_mean", "loss", "kl", "grad_norm", "trained_samples", "policy_version"]:
            checks.append((abs(ra[s][k] - rb[s][k]) <= 1e-6 * max(1.0, abs(ra[s][k])), f"step {s} {k}: {ra[s][k]} == {rb[s][k]}"))
checks.append((bad.returncode == 2 and "cannot resume" in bad.stderr, f"a missing checkpoint is a clear error ({bad.stderr.strip()[-200:]})"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
