#!/usr/bin/env python3
"""Chaos test: RUNS runs (default 20) of a multi-process run (trainer, reference and two
rollout engines each in its own `kiln node`, staleness 0, a checkpoint every step), each with
one node (engine, reference or trainer, chosen at random) killed with SIGKILL at a random
moment, then resumed as kiln advises (its `--set run.resume_from=...` line; or started again
with `run.overwrite=true` when it says so or could not start) until it ends.
Every run must end with: every step trained exactly once (metrics rows 1..STEPS, unique and
complete), each row's training metrics equal to an uninterrupted run's, and the final
parameters (the last checkpoint's safetensors) bit-for-bit equal to the uninterrupted run's.

Usage: check_chaos.py PATH_TO_KILN WORK_DIR. Environment: KILN_CHAOS_RUNS (20),
KILN_CHAOS_SEED (random; printed, so that a failure can be replayed). Prints "N passed, M
failed" and a summary line per run (victim, moment, what happened)."""
import json, os, random, re, shutil, signal, subprocess, sys, time

kiln, work = sys.argv[1], sys.argv[2]
runs = int(os.environ.get("KILN_CHAOS_RUNS", "20"))
seed = int(os.environ.get("KILN_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 30))))
rng = random.Random(seed)
shutil.rmtree(work, ignore_errors=True)
STEPS = 8
cmd = [kiln, "run", "--set", "logging.plot=false", "--set", "logging.progress=false", "--set", f"run.steps={STEPS}",
       "--set", "run.checkpoint_every=1", "--set", "placement.mode=multi_process", "--set", "placement.rollout_engines=2",
       "--set", "placement.reference=process", "--set", "placement.trainer=process", "--set", "algorithm.kl_coef=0.05",
       "--set", "algorithm.prompts_per_step=4"]
KEYS = ("reward_mean", "loss", "kl", "grad_norm", "trained_samples", "entropy", "train/rollout logprob abs diff",
        "policy_version")
checks = []

def metrics(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]

def final_params(d):
    with open(f"{d}/checkpoints/step_{STEPS:06d}/model-00001-of-00001.safetensors", "rb") as f:
        return f.read()

def rows(d):
    try:
        return len(open(f"{d}/metrics.jsonl").read().splitlines())
    except FileNotFoundError:
        return 0

print(f"chaos seed {seed} (KILN_CHAOS_SEED={seed} replays it), {runs} runs of {STEPS} steps")
base = f"{work}/uninterrupted"
t0 = time.time()
p = subprocess.run(cmd + ["--set", f"run.output_dir={base}"], capture_output=True, text=True, timeout=600)
base_s = time.time() - t0
checks.append((p.returncode == 0, f"uninterrupted run exits 0 ({p.stderr[-300:]})"))
if p.returncode != 0:
    for ok, what in checks:
        print(("ok   " if ok else "FAIL ") + what)
    sys.exit(1)
want_rows, want_params = metrics(base), final_params(base)

victims = ["rollout_node", "rollout_node_1", "ref_node", "trainer_node"]
for i in range(runs):
    out = f"{work}/run_{i:02d}"
    victim = rng.choice(victims)
    after_rows = rng.randrange(0, STEPS)      # kill once this many steps are logged ...
    extra_ms = rng.randrange(0, 400)           # ... and this much later
    # Slow decode steps in the killed run, so that a random moment can fall in any phase.
    run = cmd + ["--set", "rollout.step_delay_ms=15", "--set", f"run.output_dir={out}"]
    proc = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, killed = time.time() + 120, False
    while time.time() < deadline and proc.poll() is None:
        if rows(out) >= after_rows and os.path.exists(f"{out}/{victim}.pid"):
            time.sleep(extra_ms / 1000)
            try:
                os.kill(int(open(f"{out}/{victim}.pid").read()), signal.SIGKILL)
                killed = True
            except (ProcessLookupError, ValueError):
                pass
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=300)
    story, rc, resumes = [f"rc {proc.returncode}"], proc.returncode, 0
    while rc != 0 and resumes < 3:  # resume as kiln advises
        hint = re.findall(r"run\.resume_from=(\S+)", err)
        if hint:
            again, what = ["--set", f"run.resume_from={hint[-1]}"], f"resumed from {os.path.basename(hint[-1])}"
        elif "start again" in err or rc == 2:  # nothing trained yet, or it could not start
            again, what = ["--set", "run.overwrite=true"], "started again"
        else:
            break
        resumes += 1
        r = subprocess.run(cmd + ["--set", f"run.output_dir={out}", *again], capture_output=True, text=True, timeout=600)
        rc, err = r.returncode, r.stderr
        story.append(f"{what}: rc {rc}")
    print(f"run {i:02d}: kill {victim} after {after_rows} rows + {extra_ms} ms ({'killed' if killed else 'ended first'}); "
          + "; ".join(story))
    name = f"run {i:02d} ({victim} after {after_rows} rows + {extra_ms} ms)"
    checks.append((rc == 0, f"{name}: ends with exit 0 after {resumes} resume(s) ({err.strip()[-300:]})"))
    if rc != 0:
        continue
    got = metrics(out)
    checks.append(([m["step"] for m in got] == list(range(1, STEPS + 1)),
                   f"{name}: every step logged exactly once: {[m['step'] for m in got]}"))
    bad = [f"step {x['step']} {k}: {y[k]} != {x[k]}" for x, y in zip(want_rows, got) for k in KEYS if x[k] != y[k]]
    checks.append((not bad, f"{name}: metrics equal the uninterrupted run's {bad[:3]}"))
    checks.append((final_params(out) == want_params, f"{name}: final parameters equal the uninterrupted run's"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed (chaos seed {seed}; uninterrupted run {base_s:.1f} s)")
sys.exit(1 if failed else 0)
