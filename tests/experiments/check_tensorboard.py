#!/usr/bin/env python3
"""TensorBoard event files read by TensorBoard itself (the oracle: tensorboard's
EventAccumulator, installed into kiln's venv by scripts/setup.sh): a run of 4 steps, then a
resume from its step-2 checkpoint in the same directory (steps 3 and 4 trained again), leaves
RUN/tensorboard with two event files in which every numeric value of every metrics.jsonl row
is a scalar at its step, once, equal to the row's value (float32).
Usage: check_tensorboard.py PATH_TO_KILN WORK_DIR, with the venv's python. Prints "N passed, M failed"."""
import json, math, os, shutil, struct, subprocess, sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    print(f"FAIL tensorboard is not importable from {sys.executable} ({e}): run scripts/setup.sh")
    sys.exit(1)

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
out = f"{work}/run"
common = ["--set", "run.steps=4", "--set", "algorithm.prompts_per_step=8", "--set", "logging.plot=false",
          "--set", "logging.progress=false", "--set", f"run.output_dir={out}"]
a = subprocess.run([kiln, "run", *common, "--set", "run.checkpoint_every=2"], capture_output=True, text=True, timeout=600)
b = subprocess.run([kiln, "run", *common, "--set", f"run.resume_from={out}/checkpoints/step_000002"],
                   capture_output=True, text=True, timeout=600)
checks = [(a.returncode == 0, f"run of 4 steps exits 0 ({a.stderr[-300:]})"),
          (b.returncode == 0, f"resume from step 2 in place exits 0 ({b.stderr[-300:]})")]


def expected_scalars(row):  # what kiln promises: numbers, booleans as 0/1, objects' numbers as key/inner
    out = {}
    for k, v in row.items():
        if k == "step":
            continue
        items = [(f"{k}/{i}", w) for i, w in v.items()] if isinstance(v, dict) else [(k, v)]
        for tag, w in items:
            if isinstance(w, bool):
                out[tag] = float(w)
            elif isinstance(w, (int, float)) and math.isfinite(w):
                out[tag] = float(w)
    return out


if a.returncode == 0 and b.returncode == 0:
    files = sorted(f for f in os.listdir(f"{out}/tensorboard") if "tfevents" in f)
    checks.append((len(files) == 2, f"two event files, the resumed run's new one after the first ({files})"))
    rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    checks.append(([r["step"] for r in rows] == [1, 2, 3, 4], f"metrics.jsonl holds steps 1-4 once ({[r['step'] for r in rows]})"))
    # purge_orphaned_data off: TensorBoard would otherwise hide steps written twice (it drops
    # the older ones when a step goes back), and this check is that kiln writes each once.
    acc = EventAccumulator(f"{out}/tensorboard", size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {}
    for r in rows:
        for tag, v in expected_scalars(r).items():
            want.setdefault(tag, {})[r["step"]] = v
    checks.append((tags == set(want), f"the scalar tags are metrics.jsonl's numeric keys (missing {set(want) - tags}, extra {tags - set(want)})"))
    for key in ["reward_mean", "kl", "entropy", "rollout_time", "actor_train_time", "train_tokens_per_s", "loss"]:
        checks.append((key in tags, f"{key} is a scalar"))
    bad = []
    for tag in sorted(tags & set(want)):
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        if steps != sorted(want[tag]):
            bad.append(f"{tag}: steps {steps}, want {sorted(want[tag])}")
            continue
        for e in events:
            v = struct.unpack("<f", struct.pack("<f", want[tag][e.step]))[0]  # the row's value as float32
            if e.value != v:
                bad.append(f"{tag} step {e.step}: {e.value} != {v}")
    checks.append((not bad, f"every scalar at each step once, equal to metrics.jsonl's value ({len(tags)} tags; {bad[:5]})"))
    checks.append((all(e.wall_time > 1.7e9 for e in acc.Scalars("reward_mean")), "wall times are Unix times"))

for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
