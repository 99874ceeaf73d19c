#!/usr/bin/env python3
"""Resume from a checkpoint continues exactly: run A for 8 steps with checkpoints every 4;
run B resumes from A's step-4 checkpoint; steps 5-8 must give the same metrics (data order
from the restored RNG, weights, optimizer state). Also: the checkpoint is HF layout; and
recompute_old_logprobs (a separate pi_old pass, timed as log_probs_time) trains step 1 alike;
a resume with nothing left to train, from a checkpoint without optimizer.pt, or from one moved
under another step's name, is refused; a resume in place sets aside the checkpoints of the
steps it trains again and saves them anew; a step whose update overflows writes no checkpoint,
and the advice names the last good one.
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
done = subprocess.run([kiln, "run", *common, "--set", "run.steps=4", "--set", f"run.output_dir={work}/a",
                       "--set", f"run.resume_from={ck}"], capture_output=True, text=True, timeout=600)
# A checkpoint missing its optimizer state: refused by name, without LibTorch's C++ backtrace.
shutil.copytree(ck, f"{work}/noopt")
os.remove(f"{work}/noopt/optimizer.pt")
noopt = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/d", "--set", f"run.resume_from={work}/noopt"],
                       capture_output=True, text=True, timeout=600)
# A checkpoint moved under another step's name: refused (its state.json's step decides which
# metrics rows are kept); under a name of the user's own it resumes.
os.makedirs(f"{work}/moved")
shutil.copytree(ck, f"{work}/moved/step_000006")
moved = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/e", "--set",
                        f"run.resume_from={work}/moved/step_000006"], capture_output=True, text=True, timeout=600)
moved_slash = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/e", "--set",
                              f"run.resume_from={work}/moved/step_000006/"], capture_output=True, text=True, timeout=600)
shutil.copytree(ck, f"{work}/moved/step_000000000000000000000006")
moved_long = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/e", "--set",
                             f"run.resume_from={work}/moved/step_000000000000000000000006"], capture_output=True, text=True,
                            timeout=600)
shutil.copytree(ck, f"{work}/moved/best")
named = subprocess.run([kiln, "run", *common, "--set", "run.steps=5", "--set", f"run.output_dir={work}/f", "--set",
                        f"run.resume_from={work}/moved/best"], capture_output=True, text=True, timeout=600)
# Resuming run A in place trains step 8 again: its first row sets the old step_000008 aside
# (step_000008.superseded), then step 8 is saved anew. (Before the set-aside the save replaced
# the existing directory, which crashed the run once: std::filesystem::remove_all bound to
# libtorch's copy, exit 139; the replace is tested in tests/trainer/test_checkpoint.cpp.)
again = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/a", "--set", "run.checkpoint_every=4",
                        "--set", f"run.resume_from={ck}"], capture_output=True, text=True, timeout=600)
rec = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/r",
                      "--set", "algorithm.recompute_old_logprobs=true"], capture_output=True, text=True, timeout=600)
checks = [(a.returncode == 0, f"run A exits 0 ({a.stderr[-300:]})"), (b.returncode == 0, f"resumed run exits 0 ({b.stderr[-300:]})"),
          (rec.returncode == 0, f"recompute_old_logprobs run exits 0 ({rec.stderr[-300:]})")]
if a.returncode == 0 and rec.returncode == 0:
    rr = {r["step"]: r for r in map(json.loads, open(f"{work}/r/metrics.jsonl"))}
    ra = {r["step"]: r for r in map(json.loads, open(f"{work}/a/metrics.jsonl"))}
    # The first step that trains: same data and weights in both runs (nothing trained before).
    first = min((s for s in ra if ra[s]["trained_samples"] > 0), default=None)
    checks.append((first is not None, "run A trains in some step"))
    if first is not None:
        r1, a1 = rr[first], ra[first]
        checks.append((r1["log_probs_time"] > 0 and a1["log_probs_time"] == 0,
                       f"log_probs_time reported with the pi_old pass ({r1['log_probs_time']}) and 0 without ({a1['log_probs_time']})"))
        for k in ["loss", "grad_norm", "clip_fraction"]:
            checks.append((abs(r1[k] - a1[k]) <= 1e-4 * max(1.0, abs(a1[k])),
                           f"step {first} {k} with the pi_old pass: {r1[k]} == {a1[k]}"))
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
checks.append((done.returncode == 2 and "nothing to train" in done.stderr,
               f"resuming step 4 with run.steps = 4 is refused ({done.stderr.strip()[-200:]})"))
checks.append((again.returncode == 0 and os.path.exists(f"{work}/a/checkpoints/step_000008/state.json")
               and os.path.exists(f"{work}/a/checkpoints/step_000008.superseded/state.json"),
               f"resuming run A in place sets its step-8 checkpoint aside and saves step 8 again (exit {again.returncode}: "
               f"{again.stderr[-300:]})"))
if a.returncode == 0:
    steps = [json.loads(l)["step"] for l in open(f"{work}/a/metrics.jsonl")]
    checks.append((steps == list(range(1, 9)), f"run A's metrics hold steps 1-8 once each after the refused and the in-place resume ({steps})"))
    checks.append((os.path.exists(f"{work}/a/checkpoints/step_000008/state.json"), "step_000008 re-saved"))
    checks.append((not any(d.endswith(".partial") for d in os.listdir(f"{work}/a/checkpoints")), "no .partial checkpoint left"))
checks.append((moved.returncode == 2 and "state.json says step 4 but the directory is step_000006" in moved.stderr,
               f"a checkpoint moved under another step's name is refused ({moved.stderr.strip()[-200:]})"))
checks.append((moved_slash.returncode == 2 and "but the directory is step_000006" in moved_slash.stderr,
               f"... also named with a trailing slash ({moved_slash.stderr.strip()[-160:]})"))
checks.append((moved_long.returncode == 2 and "but the directory is step_000000000000000000000006" in moved_long.stderr,
               f"... and with more than 18 digits ({moved_long.stderr.strip()[-160:]})"))
checks.append((named.returncode == 0, f"a checkpoint copied under a name of one's own resumes ({named.stderr.strip()[-200:]})"))
checks.append((noopt.returncode == 2 and "optimizer.pt in" in noopt.stderr and "cannot be read" in noopt.stderr
               and "frame #" not in noopt.stderr, f"a checkpoint without optimizer.pt is a clear error ({noopt.stderr.strip()[-300:]})"))
# A step whose update overflows (lr 1e300): no checkpoint of the NaN policy is written (every
# resume would refuse it, and the advice to resume from it failed); the advice names the
# newest good one, which then resumes.
def digest(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}
good = f"{work}/a/checkpoints/step_000008"
before = digest(good)
shutil.copytree(f"{work}/a", f"{work}/overflow")
over = subprocess.run([kiln, "run", *common, "--set", "run.steps=10", "--set", "run.checkpoint_every=1",
                       "--set", f"run.output_dir={work}/overflow", "--set", f"run.resume_from={work}/overflow/checkpoints/step_000008",
                       "--set", "algorithm.lr=1e300"], capture_output=True, text=True, timeout=600)
checks.append((over.returncode == 1 and "not saved" in over.stderr
               # (step_000008.superseded: run A's own, set aside when it was resumed in place above)
               and sorted(d for d in os.listdir(f"{work}/overflow/checkpoints") if ".superseded" not in d)
               == ["step_000004", "step_000008"],
               f"an overflowing update writes no checkpoint of the NaN policy ({over.returncode}: {over.stderr.strip()[-300:]})"))
checks.append((f"run.resume_from={work}/overflow/checkpoints/step_000008" in over.stderr, "the advice names the last good checkpoint"))
again = subprocess.run([kiln, "run", *common, "--set", "run.steps=10", "--set", f"run.output_dir={work}/overflow",
                        "--set", f"run.resume_from={work}/overflow/checkpoints/step_000008"], capture_output=True, text=True, timeout=600)
checks.append((again.returncode == 0 and digest(good) == before, f"which resumes (lr as before) ({again.stderr.strip()[-200:]})"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
