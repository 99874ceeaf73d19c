#!/usr/bin/env python3
"""Collective weight sync (weight_sync.transport = "collective"; Gloo between CPU processes, the
code NCCL runs between GPUs): the trainer broadcasts each version to the engine nodes over a
c10d group.
1. Two engine nodes, 5 steps: every metric equal to the same run with weight sync over ZeroMQ
   messages (the engines hold the same weights bit for bit, or their rollouts would differ;
   the collective run places the engines by a list, one device per engine);
   also with the trainer over two data-parallel ranks (parallel.dp = 2), and over two
   expert-parallel ranks (parallel.ep = 2: rank 0 gathers each expert tensor from both ranks as
   it packs it), where each rank's peak memory is logged every step.
2. An engine node killed mid-run (twice): it is restarted, every engine joins a new group, and
   the run ends with the metrics of the uninterrupted run.
3. Refused by name: collective with one process, with staleness > 0, with a trainer node, a
   GPU engine for a CPU trainer; a device list of the wrong length; a bad transport name.
Usage: check_collective_sync.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, shutil, signal, subprocess, sys, time

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = dict(os.environ, OMP_NUM_THREADS="1")
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]
multi = ["--set", "placement.mode=multi_process", "--set", "placement.rollout_engines=2"]
collective = ["--set", "weight_sync.transport=collective"]
KEYS = ("reward_mean", "loss", "kl", "grad_norm", "entropy", "trained_samples", "train/rollout logprob abs diff")
checks = []


def metrics(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]


def run(name, *args):
    p = subprocess.run([kiln, "run", *quiet, *multi, "--set", f"run.output_dir={work}/{name}", *args],
                       capture_output=True, text=True, timeout=600, env=env)
    checks.append((p.returncode == 0, f"{name} exits 0 ({p.returncode}: {p.stderr[-400:]})"))
    return p.returncode == 0


def same(a, b, what):
    x, y = metrics(f"{work}/{a}"), metrics(f"{work}/{b}")
    checks.append((len(x) == len(y) and len(x) > 0, f"{what}: {len(y)} steps logged as {len(x)}"))
    for r, s in zip(x, y):
        for k in KEYS:
            checks.append((r[k] == s[k], f"{what}: step {r['step']} {k}: {s[k]} == {r[k]}"))


# 1. the same run over messages and over the broadcast group
steps = ["--set", "run.steps=5"]
per_engine = ["--set", 'placement.rollout_device=["cpu", "cpu"]']
if run("messages", *steps) and run("collective", *steps, *collective, *per_engine):
    same("messages", "collective", "collective vs messages")
    syncs = [m["update_weights_time"] for m in metrics(f"{work}/collective")]
    checks.append((all(t > 0 for t in syncs), f"collective: update_weights_time logged every step {syncs}"))
dp = ["--set", "parallel.dp=2", "--set", "placement.reference=process"]
if run("messages_dp2", *steps, *dp) and run("collective_dp2", *steps, *dp, *collective):
    same("messages_dp2", "collective_dp2", "collective vs messages, trainer over 2 ranks")
ep = ["--set", "parallel.ep=2", "--set", "placement.reference=process"]
if run("messages_ep2", *steps, *ep) and run("collective_ep2", *steps, *ep, *collective):
    same("messages_ep2", "collective_ep2", "collective vs messages, trainer over 2 expert-parallel ranks")
    peaks = [(m.get("peak_memory_gib_rank_0", 0), m.get("peak_memory_gib_rank_1", 0)) for m in metrics(f"{work}/collective_ep2")]
    checks.append((all(a > 0 and b > 0 for a, b in peaks), f"ep2: each trainer rank's peak memory logged every step {peaks}"))

# 2. an engine killed twice mid-run
twelve = ["--set", "run.steps=12", "--set", "rollout.step_delay_ms=150"]
if run("uninterrupted", *twelve, *collective):
    out = f"{work}/killed"
    p = subprocess.Popen([kiln, "run", *quiet, *multi, *twelve, *collective, "--set", f"run.output_dir={out}"],
                         stderr=subprocess.PIPE, text=True, env=env)
    for rows in (3, 7):
        deadline = time.time() + 120
        while time.time() < deadline and not (os.path.exists(f"{out}/metrics.jsonl") and
                                              len(open(f"{out}/metrics.jsonl").read().splitlines()) >= rows):
            time.sleep(0.05)
        os.kill(int(open(f"{out}/rollout_node_1.pid").read()), signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    checks.append((p.returncode == 0, f"killed engine: the run exits 0 ({p.returncode}: {err[-400:]})"))
    checks.append((err.count("rollout node rollout/1 lost") == 2, "killed engine: each loss reported, naming rollout/1"))
    if p.returncode == 0:
        same("uninterrupted", "killed", "killed engine vs uninterrupted")

# 3. refusals
def refused(args, fragment):
    p = subprocess.run([kiln, "run", *quiet, "--set", f"run.output_dir={work}/refused", *args], capture_output=True,
                       text=True, timeout=120, env=env)
    checks.append((p.returncode == 2 and fragment in p.stderr, f"refused ({p.returncode}) naming '{fragment}': {p.stderr[-300:]}"))

refused(collective, "weight_sync.transport")
refused([*multi, *collective, "--set", "algorithm.staleness=1"], "algorithm.staleness = 0")
refused([*multi, *collective, "--set", "placement.reference=process", "--set", "placement.trainer=process"],
        "weight_sync.transport")
refused([*multi, *collective, "--set", "placement.rollout_device=cuda:1"], "placement.rollout_device")
refused([*multi, *collective, "--set", 'placement.rollout_device=["cpu", "cpu", "cpu"]'], "lists 3 devices for 2 engines")
refused([*multi, "--set", "weight_sync.transport=nccl"], "weight_sync.transport")
refused(["--set", "placement.rollout_device=cuda"], "placement.rollout_device")

failed = [w for ok, w in checks if not ok]
for w in failed:
    print("FAIL:", w)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
