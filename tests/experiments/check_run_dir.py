#!/usr/bin/env python3
"""A run directory is never damaged by another run: a finished run is not run over (unless
resuming or told run.overwrite=true), a refused run changes no file, two runs cannot share a
directory (the second is refused naming the first's pid; a dead run's lock blocks nothing),
and Ctrl-C finishes the step, checkpoints and prints the command that continues the run, which
then trains every step exactly once; a run refused at start-up (a multi-process one too, after
its nodes started) removes the directories it made;
a directory's name with quotes and $(...) is plotted into, nothing run; a run whose first step
fails (a resume whose reference node dies, an overwrite) leaves every file of the run it continues
or replaces as it was, rollouts in flight whose routed experts the model cannot replay are
refused at the start, and a resume sets aside the checkpoints of the steps it trains again.
Also: an experiment "file" that is a directory is refused.
Usage: check_run_dir.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import re, json, os, shlex, shutil, signal, subprocess, sys, time

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false", "--set", "algorithm.prompts_per_step=8"]
checks = []


def run(out, *sets, timeout=600):
    cmd = [kiln, "run", *quiet, "--set", f"run.output_dir={out}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def rows(out):
    return [json.loads(l)["step"] for l in open(f"{out}/metrics.jsonl")]


def files(out):
    return {f: open(os.path.join(out, f), "rb").read() for f in ("config.toml", "metrics.jsonl")}


# 1. A finished run is not run over; refused runs change nothing.
a = f"{work}/a"
r = run(a, "run.steps=3", "run.checkpoint_every=3")
checks.append((r.returncode == 0, f"run A exits 0 ({r.stderr[-300:]})"))
before = files(a)
for what, sets in (("the same run again", ["run.steps=3"]), ("an unknown flavor", ["model.flavor=huge"]),
                   ("max_new_tokens 1000000", ["algorithm.max_new_tokens=1000000"])):
    r = run(a, *sets)
    checks.append((r.returncode == 2, f"{what} over a finished run is refused (exit {r.returncode})"))
    checks.append((files(a) == before, f"{what}: config.toml and metrics.jsonl unchanged"))
r = run(a, "run.steps=3")
checks.append(("already holds a run" in r.stderr and "run.resume_from=" in r.stderr and "run.overwrite=true" in r.stderr,
               f"the refusal says how to resume or overwrite ({r.stderr.strip()[-300:]})"))
# Its advice, followed: resume from the checkpoint it names with a larger run.steps.
advised = re.search(r"run\.resume_from=(\S+)", r.stderr)
checks.append((advised is not None and "larger run.steps" in r.stderr, "the refusal names the checkpoint and the larger run.steps"))
if advised:
    r = run(a, "run.steps=5", f"run.resume_from={advised.group(1)}")
    checks.append((r.returncode == 0 and rows(a) == [1, 2, 3, 4, 5],
                   f"resuming as advised goes on to step 5 ({r.returncode}, {rows(a)}: {r.stderr.strip()[-200:]})"))
r = run(a, "run.steps=2", "run.overwrite=true")
checks.append((r.returncode == 0 and rows(a) == [1, 2], f"run.overwrite=true replaces it ({rows(a)})"))
checks.append((not os.path.exists(f"{a}/checkpoints/step_000003"), "the replaced run's checkpoints are gone"))

# 2. One run per directory; a dead run's lock blocks nothing.
b = f"{work}/b"
cmd = [kiln, "run", *quiet, "--set", f"run.output_dir={b}", "--set", "run.steps=12", "--set", "rollout.step_delay_ms=40"]
first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
deadline = time.time() + 300
while time.time() < deadline and not (os.path.exists(f"{b}/metrics.jsonl") and len(rows(b)) >= 2):
    time.sleep(0.05)
second = run(b, "run.steps=3", "run.overwrite=true")
checks.append((second.returncode == 2 and f"pid {first.pid}" in second.stderr,
               f"a second run in the same directory is refused naming the first's pid {first.pid} ({second.stderr.strip()[-200:]})"))

# 3. Ctrl-C: the step finishes, a checkpoint, the command that continues.
first.send_signal(signal.SIGINT)
_, err = first.communicate(timeout=300)
checks.append((first.returncode == 130, f"Ctrl-C exits 130 (got {first.returncode}: {err.strip()[-300:]})"))
line = [l for l in err.splitlines() if "continue with: " in l and " run " in l]
checks.append((bool(line), f"Ctrl-C prints the command that continues ({err.strip()[-300:]})"))
if line:
    exe, verb, *args = line[0].split("continue with: ", 1)[1].split()
    checks.append((verb == "run" and os.path.samefile(exe, kiln), f"the command names this kiln binary ({exe})"))
    ck = args[-1].split("=", 1)[1]
    checks.append((os.path.exists(f"{ck}/state.json"), f"the checkpoint it names exists ({ck})"))
    lines = [json.loads(l) for l in open(f"{b}/metrics.jsonl")]
    checks.append((all("reward_mean" in l for l in lines), "metrics.jsonl holds whole rows only"))
    r = subprocess.run([kiln, "run", *args, "--set", "rollout.step_delay_ms=0"], capture_output=True, text=True, timeout=600)
    checks.append((r.returncode == 0, f"the printed command continues the run (exit {r.returncode}: {r.stderr[-300:]})"))
    checks.append((rows(b) == list(range(1, 13)), f"every step trained exactly once across Ctrl-C ({rows(b)})"))
    # Resuming B's checkpoint into another finished run's directory would mix the two runs.
    o = f"{work}/other"
    r = run(o, "run.steps=2")
    before = files(o)
    r = run(o, "run.steps=13", f"run.resume_from={ck}")
    checks.append((r.returncode == 2 and "is not one of its checkpoints" in r.stderr and files(o) == before,
                   f"resuming another run's checkpoint into a finished run is refused, nothing changed ({r.stderr.strip()[-200:]})"))

# 4. A stale lock (its run is gone) does not block.
c = f"{work}/c"
os.makedirs(c)
open(f"{c}/.lock", "w").write("999999999\n")
r = run(c, "run.steps=1")
checks.append((r.returncode == 0, f"a stale lock file blocks nothing ({r.stderr[-200:]})"))

# 5. What cannot fit this machine is refused before anything starts (it used to be OOM-killed).
r = run(f"{work}/huge", "algorithm.prompts_per_step=100000000")
checks.append((r.returncode == 2 and "algorithm.prompts_per_step" in r.stderr and "GiB per step" in r.stderr
               and not os.path.exists(f"{work}/huge/config.toml"), f"100M prompts per step are refused by name ({r.stderr.strip()[-200:]})"))
r = run(f"{work}/huge", "algorithm.prompts_per_step=9223372036854775807")
checks.append((r.returncode == 2 and "= 1.4757395258967641e+20 sequences" in r.stderr,
               f"2^63 - 1 prompts per step: the count is not wrapped negative ({r.stderr.strip()[-200:]})"))

# 5b. A run refused at start-up (by its model) leaves no directory of its own making behind.
r = run(f"{work}/fresh_refused", "model.flavor=huge")
checks.append((r.returncode == 2 and not os.path.exists(f"{work}/fresh_refused"),
               f"a run refused by its model leaves no new directory behind ({r.stderr.strip()[-160:]})"))

# 5c. The same for a multi-process run, in directories it had to make: refused by the memory its
# nodes would hold on this machine before any starts, or by its trainer node after it started
# (its pid file written): no directory of its own making is left, parents included.
nodes = ["placement.mode=multi_process", "placement.trainer=process", "placement.reference=process"]
r = run(f"{work}/made/for/it", *nodes, "model.flavor=glm47_flash")
checks.append((r.returncode == 2 and "the kiln nodes it starts" in r.stderr and "29.9 billion parameters" in r.stderr
               and not os.path.exists(f"{work}/made"),
               f"a multi-process run too big for this machine is refused counting its nodes, no directory left ({r.stderr.strip()[-200:]})"))
bad = f"{work}/bad_checkpoint"
os.makedirs(bad)
open(f"{bad}/config.json", "w").write('{"model_type": "glm4_moe_lite"}')
r = run(f"{work}/made/for/it", *nodes, f"model.checkpoint={bad}")
checks.append((r.returncode != 0 and "could not build its policy" in r.stderr and not os.path.exists(f"{work}/made"),
               f"a run whose trainer node fails at start leaves neither its pid file nor the directories it made ({r.stderr.strip()[-200:]})"))

# A stop signal while the nodes start (before step 1): the same, the pid files included.
cmd = [kiln, "run", *quiet, "--set", f"run.output_dir={work}/made/for/it", *sum((["--set", n] for n in nodes), []),
       "--set", "placement.rollout_engines=2"]
p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
deadline = time.time() + 120
while time.time() < deadline and not os.path.exists(f"{work}/made/for/it/trainer_node.pid") and p.poll() is None:
    time.sleep(0.01)
p.send_signal(signal.SIGTERM)
_, err = p.communicate(timeout=120)
checks.append((p.returncode == -signal.SIGTERM and "no checkpoint was written by this run" in err
               and not os.path.exists(f"{work}/made"),
               f"SIGTERM while the nodes start: stopped at once, no directory of its making left ({p.returncode}: {err.strip()[-200:]})"))

# 6. An experiment "file" that is a directory.
r = subprocess.run([kiln, "run", work], capture_output=True, text=True, timeout=60)
checks.append((r.returncode == 2 and "is a directory" in r.stderr, f"kiln run DIR is refused ({r.stderr.strip()[-200:]})"))

# 7. A run directory's name is data, also to the plot: quotes and a command substitution in it
# neither break the plot nor run anything (gnuplot used to be started through a shell).
odd = f"{work}/it's $(touch {work}/pwned)"
r = subprocess.run([kiln, "run", "--set", "logging.progress=false", "--set", "algorithm.prompts_per_step=8",
                    "--set", "run.steps=1", "--set", "run.checkpoint_every=1", "--set", f"run.output_dir={odd}"],
                   capture_output=True, text=True, timeout=300)
checks.append((r.returncode == 0 and os.path.exists(os.path.join(odd, "reward_kl.png")) and not os.path.exists(f"{work}/pwned")
               and "Warning" not in r.stderr and "Warning" not in r.stdout,
               f"an odd run directory name: plotted, nothing executed, no gnuplot warning ({r.stderr.strip()[-200:]})"))
# A newline in the name ended gnuplot's quoted path and ran the rest (system, backticks).
nl = f"{work}/nl\nsystem \"touch {work}/pwned2\"\n`touch {work}/pwned3`"
r = subprocess.run([kiln, "run", "--set", "logging.progress=false", "--set", "algorithm.prompts_per_step=8",
                    "--set", "run.steps=1", "--set", f"run.output_dir={nl}"], capture_output=True, text=True, timeout=300)
checks.append((r.returncode == 0 and os.path.exists(os.path.join(nl, "reward_kl.png"))
               and not os.path.exists(f"{work}/pwned2") and not os.path.exists(f"{work}/pwned3") and "no plot" not in r.stderr,
               f"a run directory name with newlines, system and backticks: plotted, nothing executed ({r.stderr.strip()[-200:]})"))
# The refusal's resume advice, pasted into a shell as is: the path is quoted as one word.
r = run(odd, "run.steps=1")
advised = re.search(r"run\.resume_from=('(?:[^']|'\\'')*'|\S+) \(it goes on", r.stderr)
checks.append((advised is not None and advised.group(1).startswith("'"), f"the advice quotes the odd path ({r.stderr.strip()[-240:]})"))
if advised:
    line = " ".join([shlex.quote(kiln), "run", *map(shlex.quote, quiet), "--set", shlex.quote(f"run.output_dir={odd}"),
                     "--set", "run.steps=2", "--set", "run.resume_from=" + advised.group(1)])
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    checks.append((r.returncode == 0 and rows(odd) == [1, 2] and not os.path.exists(f"{work}/pwned"),
                   f"followed through bash, it resumes the odd run, nothing executed ({r.returncode}: {r.stderr.strip()[-200:]})"))

# 6. Directories whose files would land where they damage something: refused at start, nothing changed.
g = f"{work}/g"
r = run(g, "run.steps=2", "run.checkpoint_every=1")
ck = f"{g}/checkpoints/step_000002"
snapshot = lambda d: {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}
ck_before = snapshot(ck) if r.returncode == 0 else None
os.symlink(f"{work}/no_such_dir", f"{work}/dangling")
os.makedirs(f"{work}/h")
open(f"{work}/h/checkpoints", "w").close()
for what, out, sets, needle in (
        ("inside a checkpoint", ck, ["run.steps=3", f"run.resume_from={ck}"], "lies inside the checkpoint"),
        ("a run's checkpoints directory", f"{g}/checkpoints", ["run.steps=1"], "the checkpoints directory of the run"),
        ("the filesystem root", "/", ["run.steps=1"], "is the filesystem root"),
        ("a dangling symbolic link", f"{work}/dangling", ["run.steps=1"], "that leads to nothing"),
        ("a dangling symbolic link with a trailing slash", f"{work}/dangling/", ["run.steps=1"], "that leads to nothing"),
        ("a run directory whose checkpoints is a file", f"{work}/h", ["run.steps=1"], "is not a directory"),
        ("overwrite deleting model.checkpoint", g, ["run.steps=1", "run.overwrite=true", f"model.checkpoint={ck}"],
         "which run.overwrite deletes")):
    r = run(out, *sets)
    checks.append((r.returncode == 2 and needle in r.stderr, f"run.output_dir {what}: refused naming it ({r.stderr.strip()[-200:]})"))
checks.append((ck_before is not None and snapshot(ck) == ck_before, "the checkpoint is unchanged by the refused runs"))
checks.append((not os.path.exists("/metrics.jsonl") and not os.path.exists(f"{work}/no_such_dir"), "nothing made at / or behind the link"))

# 7. A run whose first step fails changes nothing it was to replace. A resume whose reference
# node dies during the resumed step (exit 1) leaves config.toml, the metrics rows and the TensorBoard
# events as they were (they used to be rewritten with the failed attempt's settings, the rows
# past the checkpoint dropped for good); a resume whose restored rollouts hold a routed expert id
# past the model's E is refused at the start by file, step and completion (it used to fail at its
# first step); and a run.overwrite=true run over a finished one whose first row cannot be
# committed (config.toml.tmp a directory with a file in it: the write of config.toml fails)
# leaves the old run's checkpoints.
def tree(d):  # every file's bytes, but .lock and the nodes' pids (they name the latest attempt's processes)
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            if n != ".lock" and not n.endswith(".pid"):
                p = os.path.join(root, n)
                out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def bad_routed_experts(path):  # every routed expert id in the file -> 127, the file's size kept
    data, n, at = bytearray(open(path, "rb").read()), 0, 0
    key = b"\xaerouted_experts"  # msgpack fixstr(14) "routed_experts", then its array of ids
    while (at := data.find(key, at)) >= 0:
        at += len(key)
        head, count = data[at], 0
        if 0x90 <= head <= 0x9F:
            count, at = head - 0x90, at + 1
        elif head == 0xDC:
            count, at = int.from_bytes(data[at + 1:at + 3], "big"), at + 3
        for k in range(count):
            if data[at + k] >= 0x80:
                return 0  # not positive fixints: not the layout this expects
            data[at + k] = 0x7F
        n += count
    open(path, "wb").write(bytes(data))
    return n


j = f"{work}/j"
node = ["placement.mode=multi_process", "placement.reference=process", "placement.trainer=process"]
r = run(j, *node, "run.steps=6", "run.checkpoint_every=3")
checks.append((r.returncode == 0, f"run J (nodes, checkpoints at 3 and 6) exits 0 ({r.stderr[-300:]})"))
if r.returncode == 0:
    ck3, ck6 = f"{j}/checkpoints/step_000003", f"{j}/checkpoints/step_000006"
    before = tree(j)
    # The reference node killed 0.5 s after the resume, inside step 4's rollouts (slowed to 1 s an
    # engine step), before its reference log-probs (step 4 may train nothing: every group filtered).
    cmd = [kiln, "run", *quiet, "--set", f"run.output_dir={j}", "--set", "run.steps=8", "--set", "algorithm.lr=0.001",
           "--set", "rollout.step_delay_ms=1000", "--set", f"run.resume_from={ck3}"]
    for x in node:
        cmd += ["--set", x]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    err = ""
    for line in p.stderr:
        err += line
        if "resumed from" in line:
            time.sleep(0.5)
            os.kill(int(open(f"{j}/ref_node.pid").read()), signal.SIGKILL)
            break
    err += p.stderr.read()
    p.wait(timeout=600)
    checks.append((p.returncode == 1 and "step 4:" in err and "ref/0" in err,
                   f"the resume whose reference node dies in step 4 exits 1 naming it ({p.returncode}: {err.strip()[-300:]})"))
    after = tree(j)
    changed = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
    checks.append((changed == [], f"the failed resume changed no file of the run ({changed})"))
    r = run(j, *node, "run.steps=8", f"run.resume_from={ck6}")
    checks.append((r.returncode == 0 and rows(j) == list(range(1, 9)) and "resuming with" not in r.stderr,
                   f"resumed from step 6 it goes on to step 8, every row kept and no setting of the failed attempt "
                   f"taken ({r.returncode}, {rows(j)}: {r.stderr.strip()[-300:]})"))
    before = tree(j)
    os.makedirs(f"{j}/config.toml.tmp/kept")  # not empty: the failed write cannot remove it
    r = run(j, "run.steps=2", "run.overwrite=true")
    shutil.rmtree(f"{j}/config.toml.tmp")
    after = tree(j)
    changed = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
    checks.append((r.returncode == 1 and "config.toml" in r.stderr and changed == [],
                   f"run.overwrite=true whose first row cannot be committed leaves the run it was to replace, checkpoints "
                   f"included ({r.returncode}, changed {changed}: {r.stderr.strip()[-300:]})"))

# A resume from an earlier checkpoint than the newest trains those steps again: the newer
# checkpoints are set aside at its first row (step_N.superseded), so that the advice of a later
# refusal does not lead back to them (resuming step 6 of the run that was replaced left step 6
# without a row).
k = f"{work}/k"
r = run(k, "run.steps=6", "run.checkpoint_every=3")
if r.returncode == 0:
    r = run(k, "run.steps=5", "run.checkpoint_every=3", f"run.resume_from={k}/checkpoints/step_000003")
    checks.append((r.returncode == 0 and rows(k) == [1, 2, 3, 4, 5] and "step_000006.superseded" in r.stderr and
                   sorted(os.listdir(f"{k}/checkpoints")) == ["step_000003", "step_000006.superseded"],
                   f"resumed from step 3, the run's step-6 checkpoint is set aside ({r.returncode}, {rows(k)}, "
                   f"{sorted(os.listdir(f'{k}/checkpoints'))}: {r.stderr.strip()[-300:]})"))
    r = run(k, "run.steps=8")
    advised = re.search(r"run\.resume_from=(\S+)", r.stderr)
    checks.append((advised is not None and advised.group(1).endswith("step_000003"),
                   f"a later refusal advises step 3, not the set-aside step 6 ({r.stderr.strip()[-300:]})"))
    if advised:
        r = run(k, "run.steps=8", f"run.resume_from={advised.group(1)}")
        checks.append((r.returncode == 0 and rows(k) == list(range(1, 9)),
                       f"followed, every step has its row once ({r.returncode}, {rows(k)}: {r.stderr.strip()[-200:]})"))
else:
    checks.append((False, f"run K exits 0 ({r.stderr[-300:]})"))

i = f"{work}/i"
mp = node + ["algorithm.staleness=1"]
r = run(i, *mp, "run.steps=6", "run.checkpoint_every=3")
checks.append((r.returncode == 0, f"run I (nodes, staleness 1, a checkpoint at 3) exits 0 ({r.stderr[-300:]})"))
if r.returncode == 0:
    ck3 = f"{i}/checkpoints/step_000003"
    patched = bad_routed_experts(f"{ck3}/in_flight_rollouts.msgpack")
    checks.append((patched > 0, f"step 3's rollouts in flight hold routed experts ({patched} ids set to 127)"))
    before = tree(i)
    r = run(i, *mp, "run.steps=8", f"run.resume_from={ck3}")
    after = tree(i)
    changed = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
    checks.append((r.returncode == 2 and "in_flight_rollouts.msgpack: step 4 completion" in r.stderr and
                   "routed expert id 127 outside [0, 8)" in r.stderr and changed == [],
                   f"routed experts past the model's E in the rollouts in flight: refused at the start by file, step and "
                   f"completion, nothing changed ({r.returncode}, changed {changed}: {r.stderr.strip()[-300:]})"))

for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
