#!/usr/bin/env python3
"""Multi-process placement: the same metrics as one process (k = 0, fixed seed, 5 steps), with
one rollout engine process and with two (prompt groups split between them), with the
reference policy in its own process too (KL in the loss), and with the trainer in its own
process as well (the controller holds no model; also with a bf16 policy); killing the rollout
node mid-run restarts it (the run finishes with the metrics of a run without the kill); with
its restarts used up (placement.engine_restarts = 1, killed twice; or 0), or killing the
reference node, gives a clear error and a checkpoint, and resuming from it finishes the run
with every step trained exactly once; killing the trainer node gives a clear error, and
resuming from the newest periodic checkpoint runs the lost steps again, each logged once.
Usage: check_node_kill.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, shutil, signal, subprocess, sys, time

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]
checks = []

def metrics(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]

# 1. one process vs multi-process (1 and 2 engines), k = 0
kl = ["--set", "algorithm.kl_coef=0.05"]
runs = {"single_process": ["single_process", 1, []], "multi_process": ["multi_process", 1, []],
        "two_engines": ["multi_process", 2, []], "single_process_kl": ["single_process", 1, kl],
        "ref_process_kl": ["multi_process", 2, kl + ["--set", "placement.reference=process"]],
        "trainer_process_kl": ["multi_process", 2, kl + ["--set", "placement.reference=process",
                                                         "--set", "placement.trainer=process"]],
        "single_process_bf16": ["single_process", 1, ["--set", "model.dtype=bf16"]],
        "trainer_process_bf16": ["multi_process", 2, ["--set", "model.dtype=bf16", "--set", "placement.reference=process",
                                                      "--set", "placement.trainer=process"]],
        # glm5_next: rollouts, reference and trainer requests carry the sparse layers' selections
        "single_process_glm5": ["single_process", 1, kl + ["--set", "model.package=glm5_next"]],
        "trainer_process_glm5": ["multi_process", 1, kl + ["--set", "model.package=glm5_next",
                                                           "--set", "placement.reference=process",
                                                           "--set", "placement.trainer=process"]]}
for name, (mode, engines, extra) in runs.items():
    p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=5", "--set", f"placement.mode={mode}", *extra,
                        "--set", f"placement.rollout_engines={engines}", "--set", f"run.output_dir={work}/{name}"],
                       capture_output=True, text=True, timeout=600)
    checks.append((p.returncode == 0, f"{name} run exits 0 ({p.stderr[-300:]})"))
if all(ok for ok, _ in checks):
    for base, name in (("single_process", "multi_process"), ("single_process", "two_engines"),
                       ("single_process_kl", "ref_process_kl"), ("single_process_kl", "trainer_process_kl"),
                       ("single_process_bf16", "trainer_process_bf16"), ("single_process_glm5", "trainer_process_glm5")):
        a, b = metrics(f"{work}/{base}"), metrics(f"{work}/{name}")
        checks.append((len(a) == len(b) == 5, f"{name}: 5 steps"))
        for x, y in zip(a, b):
            for k in ("reward_mean", "loss", "kl", "grad_norm", "trained_samples", "train/rollout logprob abs diff"):
                checks.append((x[k] == y[k], f"step {x['step']} {k}: one process {x[k]} == {name} {y[k]}"))
    checks.append((os.path.exists(f"{work}/two_engines/rollout_node_1.pid"), "the second engine ran as its own process"))
    checks.append((os.path.exists(f"{work}/ref_process_kl/ref_node.pid"), "the reference ran as its own process"))
    checks.append((any(m["kl"] > 0 for m in metrics(f"{work}/ref_process_kl")), "the remote reference's KL is nonzero"))
    checks.append((os.path.exists(f"{work}/trainer_process_kl/trainer_node.pid"), "the trainer ran as its own process"))

# 2. kill the rollout node, the reference node, or the trainer node, mid-run (with the trainer in
# its own process too for the rollout node: its checkpoint is written by the trainer node)
in_process = ["--set", "placement.reference=process", "--set", "placement.trainer=process"]
common = ["--set", "run.steps=12", "--set", "placement.mode=multi_process", "--set", "algorithm.prompts_per_step=4"]
base = f"{work}/uninterrupted"
p = subprocess.run([kiln, "run", *quiet, *common, *in_process, "--set", f"run.output_dir={base}"],
                   capture_output=True, text=True, timeout=600)
checks.append((p.returncode == 0, f"uninterrupted 12-step run exits 0 ({p.stderr[-300:]})"))

def wait_rows(out, n):
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(f"{out}/metrics.jsonl") and len(open(f"{out}/metrics.jsonl").read().splitlines()) >= n:
            return
        time.sleep(0.05)

def pid_of(out, victim):
    # kiln writes the file whole and renames it into place; an empty read (a writer that did not)
    # is retried rather than taken for a pid
    deadline = time.time() + 10
    while True:
        text = open(f"{out}/{victim}.pid").read().strip()
        if text or time.time() > deadline:
            return int(text)
        time.sleep(0.01)

# 2a. a rollout node killed mid-run (twice) is restarted, and its share generated again: the
# run ends as if nothing happened
out = f"{work}/restarted_rollout_node"
p = subprocess.Popen([kiln, "run", *quiet, *common, *in_process, "--set", "rollout.step_delay_ms=150",
                      "--set", f"run.output_dir={out}"], stderr=subprocess.PIPE, text=True)
for rows in (3, 6):
    wait_rows(out, rows)
    os.kill(pid_of(out, "rollout_node"), signal.SIGKILL)
_, err = p.communicate(timeout=300)
checks.append((p.returncode == 0, f"restarted rollout node: the run exits 0 (got {p.returncode}: {err.strip()[-300:]})"))
# >= 2: on a loaded machine a restarted node can also miss its heartbeats once and be restarted
# again (seen in a CI run beside two builds: three losses reported, the run still exact)
losses = err.count("rollout node rollout/0 lost")
checks.append((losses >= 2 and "restarting it" in err,
               f"restarted rollout node: each loss is reported, naming the engine, with the restart ({losses} reported)"))
if p.returncode == 0 and os.path.exists(f"{base}/metrics.jsonl"):
    a, b = metrics(base), metrics(out)
    checks.append(([m["step"] for m in b] == list(range(1, 13)), "restarted rollout node: 12 steps, each once"))
    for x, y in zip(a, b):
        for k in ("reward_mean", "loss", "grad_norm", "trained_samples", "entropy", "train/rollout logprob abs diff"):
            checks.append((x[k] == y[k], f"restarted rollout node: step {x['step']} {k}: {y[k]} == uninterrupted {x[k]}"))

# 2b. kill the rollout node with no restarts left (placement.engine_restarts = 1: killed again
# as soon as it is replaced; or 0), the reference node, or the trainer node, mid-run (with the
# trainer in its own process too for the rollout node: its checkpoint is written by the trainer node)
for case, victim, extra in (("rollout_node_restarts_0", "rollout_node", in_process + ["--set", "placement.engine_restarts=0"]),
                            ("rollout_node_restarts_1", "rollout_node", in_process + ["--set", "placement.engine_restarts=1"]),
                            ("ref_node", "ref_node", ["--set", "placement.reference=process"]),
                            ("trainer_node", "trainer_node", in_process + ["--set", "run.checkpoint_every=2"])):
    out = f"{work}/killed_{case}"
    run = [kiln, "run", *quiet, *common, *extra, "--set", "rollout.step_delay_ms=150", "--set", f"run.output_dir={out}"]
    p = subprocess.Popen(run, stderr=subprocess.PIPE, text=True)
    wait_rows(out, 3)
    first = pid_of(out, victim)
    os.kill(first, signal.SIGKILL)
    if case == "rollout_node_restarts_1":  # its replacement, before it generates anything
        deadline = time.time() + 60
        while time.time() < deadline and pid_of(out, victim) == first:
            time.sleep(0.01)
        os.kill(pid_of(out, victim), signal.SIGKILL)
        _, err = p.communicate(timeout=120)
        checks.append(("restarts used up (placement.engine_restarts = 1 in a row)" in err,
                       f"{case}: the error says the restarts are used up: {err.strip()[-300:]}"))
    else:
        _, err = p.communicate(timeout=120)
    who = {"rollout_node": "rollout node", "ref_node": "reference node", "trainer_node": "trainer node"}[victim]
    checks.append((p.returncode == 1, f"{case}: killed run exits 1 (got {p.returncode})"))
    checks.append((who in err and "disconnected" in err, f"{case}: the error names the lost {who}: {err.strip()[-300:]}"))
    checks.append(("resume_from=" in err, f"{case}: the error says how to continue"))
    ck = err.split("resume_from=")[-1].strip().split()[0] if "resume_from=" in err else ""
    if victim == "trainer_node":  # its policy is gone: the hint names the newest periodic checkpoint
        cks = sorted(d for d in os.listdir(f"{out}/checkpoints") if "." not in d) if os.path.isdir(f"{out}/checkpoints") else []
        logged = [m["step"] for m in metrics(out)]
        checks.append((bool(cks) and ck == f"{out}/checkpoints/{cks[-1]}", f"{case}: the hint names the newest checkpoint ({ck})"))
        # Usually the kill lands a step or more after the newest checkpoint (those rows are
        # dropped on resume); a kill right after a checkpoint loses nothing: both must hold up.
        checks.append((bool(cks) and int(cks[-1].split("_")[1]) <= logged[-1],
                       f"{case}: the newest checkpoint {cks[-1:]} is at or before the last logged step (logged {logged})"))
    checks.append((os.path.exists(f"{ck}/state.json"), f"{case}: checkpoint {ck} written"))
    if ck:
        r = subprocess.run(run[:-2] + ["--set", f"run.output_dir={out}", "--set", f"run.resume_from={ck}",
                                       "--set", "rollout.step_delay_ms=0"], capture_output=True, text=True, timeout=600)
        checks.append((r.returncode == 0, f"{case}: resumed run exits 0 ({r.stderr[-300:]})"))
        steps = [m["step"] for m in metrics(out)]
        checks.append((steps == list(range(1, 13)), f"{case}: every step trained exactly once across kill and resume: {steps}"))
# 2c. the reference node killed as soon as it joined (before step 1 is trained; before or
# after the controller first connects to it): kiln ends within 30 s naming it (a first
# connection refused is a lost peer: that request waited out its 300 s timeout before), and
# says how to go on (found by the chaos test: "nothing to checkpoint" without advice); doing so
# finishes the run.
out = f"{work}/killed_ref_node_at_start"
run = [kiln, "run", *quiet, *common, "--set", "placement.reference=process", "--set", "rollout.step_delay_ms=150",
       "--set", f"run.output_dir={out}"]
p = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
killed_at = None
for line in p.stdout:  # the node's own line once it joined
    if "kiln node ref-node ready" in line:
        os.kill(pid_of(out, "ref_node"), signal.SIGKILL)
        killed_at = time.time()
        break
try:
    _, err = p.communicate(timeout=120)
except subprocess.TimeoutExpired:
    p.kill()
    _, err = p.communicate()
took = time.time() - killed_at if killed_at else -1
logged = len(open(f"{out}/metrics.jsonl").read().splitlines()) if os.path.exists(f"{out}/metrics.jsonl") else 0
# exit 2: lost before the run started (the node's model not built yet); exit 1: in step 1
# (a directory that held no run before says "start again"; one over an earlier run adds run.overwrite)
advice = p.returncode == 2 or (p.returncode == 1 and "start again" in err)
checks.append((killed_at is not None and 0 <= took < 30 and logged == 0 and "reference node" in err and advice,
               f"reference node killed at start: exit {p.returncode} {took:.1f} s after the kill, {logged} steps logged, "
               f"naming it, with advice ({err.strip()[-300:]})"))
r = subprocess.run(run[:-2] + ["--set", f"run.output_dir={out}", "--set", "run.overwrite=true", "--set", "rollout.step_delay_ms=0"],
                   capture_output=True, text=True, timeout=600)
checks.append((r.returncode == 0 and [m["step"] for m in metrics(out)] == list(range(1, 13)),
               f"reference node killed at start: started again with run.overwrite=true, the run ends with 12 steps ({r.stderr[-300:]})"))

for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
