#!/usr/bin/env python3
"""The trainer over several ranks through `kiln run` (parallel.dp, parallel.ep; Gloo on CPU):
1. dp 1, 2 and 4, ep 2 (dp 1), dp 2 x ep 2, and dp 2 and ep 2 with the decoder layers fully
   sharded (parallel.fsdp) (ranks started by kiln run itself), 5 RL steps of
   the default experiment:
   steps 1 and 2 give the same metrics (relative error <= 1e-4: the same rollouts, then the
   rollouts of the policy each trained, synced from rank 0); steps 3-5 stay close (entropy
   within 1e-3, KL within 5%) but are not equal: a few sampled tokens differ once fp32
   summation order (which rank adds which gradient) has moved the weights by ~1e-6 relative;
   a second dp-2 run equals the first bit for bit.
2. torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 2 on loopback (c10d rendezvous) gives
   the metrics of the dp-4 run started by kiln run, bit for bit.
3. A checkpoint written at dp 2 (step 2), resumed at dp 1, 2 and 4: step 3 equals the
   uninterrupted dp-2 run's (dp 2: bit for bit; 1 and 4: relative error <= 1e-4). The same for
   a checkpoint written at ep 2 (an HF part and optimizer parts per rank), resumed at ep 2 (bit
   for bit), dp 1 and dp 2.
4. Rank 1 killed mid-run (SIGKILL): rank 0 exits 1 within 60 s naming trainer rank 1; every
   process of the job is gone; resuming from the newest checkpoint finishes the run. At dp 2 x
   ep 2 (reference colocated, micro-batches of 8 tokens: nearly all of a step in the ranks'
   collectives), rank 1 and then rank 3 killed: rank 0 exits 1 within 15 s naming it, though
   parallel.collective_timeout_s is 600 (ranks whose collectives failed answer and exit; rank 0
   leaves its own collective once a rank is known lost). Rank 2 killed as soon as it is started
   (before the process groups exist): rank 0 exits 2 within 15 s naming it, no run directory.
5. parallel.dp = 3 under a launch of 2 ranks, and placement.trainer = "process" with dp 2, are
   refused by name.
Usage: check_data_parallel.py PATH_TO_KILN WORK_DIR PATH_TO_TORCHRUN. Prints "N passed, M failed"."""
import os, shutil, subprocess, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loopback_port import free_port  # noqa: E402
from rank_runs import clean_env, close, expect_like_one_rank, expect_rank_lost, kill_and_wait, metrics, numbers, rank_child, start_run  # noqa: E402

kiln, work, torchrun = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]
env = clean_env()
checks = []


def run(name, *args, timeout=600):
    p = subprocess.run([kiln, "run", *quiet, "--set", f"run.output_dir={work}/{name}", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    checks.append((p.returncode == 0, f"{name} exits 0 ({p.returncode}: {p.stderr[-400:]})"))
    return p


# 1. dp 1, 2, 4
for dp in (1, 2, 4):
    run(f"dp{dp}", "--set", "run.steps=5", "--set", f"parallel.dp={dp}")
run("dp2_again", "--set", "run.steps=5", "--set", "parallel.dp=2")
run("ep2", "--set", "run.steps=5", "--set", "parallel.ep=2")
run("dp2_ep2", "--set", "run.steps=5", "--set", "parallel.dp=2", "--set", "parallel.ep=2")
run("dp2_fsdp", "--set", "run.steps=5", "--set", "parallel.dp=2", "--set", "parallel.fsdp=true")
run("ep2_fsdp", "--set", "run.steps=5", "--set", "parallel.ep=2", "--set", "parallel.fsdp=true")
if all(ok for ok, _ in checks):
    for dp in (2, 4, "ep2", "dp2_ep2", "dp2_fsdp", "ep2_fsdp"):
        expect_like_one_rank(f"{work}/dp1", f"{work}/{dp if isinstance(dp, str) else f'dp{dp}'}", f"dp {dp}", checks)
    a, b = metrics(f"{work}/dp2"), metrics(f"{work}/dp2_again")
    checks.append(([numbers(r) for r in a] == [numbers(r) for r in b], "dp 2 twice: the same metrics bit for bit"))

# 2. torchrun, two agents of two ranks on loopback
if not os.path.exists(torchrun):
    print(f"KILN_TEST_SKIPPED: no torchrun at {torchrun}")
    sys.exit(0)
port = free_port()
agents = []
for node in range(2):
    log = open(f"{work}/torchrun_node{node}.log", "w+")
    cmd = [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", "--no-python", kiln, "run", *quiet,
           "--set", "run.steps=5", "--set", "parallel.dp=4", "--set", f"run.output_dir={work}/torchrun"]
    agents.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
codes = []
for p, _ in agents:
    try:
        codes.append(p.wait(timeout=600))
    except subprocess.TimeoutExpired:
        p.kill()
        codes.append("timeout")
logs = ""
for _, log in agents:
    log.seek(0)
    logs += log.read()
checks.append((codes == [0, 0], f"torchrun agents exit 0 ({codes}: {logs[-600:]})"))
if codes == [0, 0] and os.path.exists(f"{work}/dp4/metrics.jsonl"):
    a, b = metrics(f"{work}/dp4"), metrics(f"{work}/torchrun")
    checks.append(([numbers(r) for r in a] == [numbers(r) for r in b],
                   "torchrun 2 nodes x 2 ranks: the metrics of dp 4 in one launch, bit for bit"))

# 3. checkpoint at dp 2, resumed at dp 1, 2, 4
run("ckpt", "--set", "run.steps=3", "--set", "parallel.dp=2", "--set", "run.checkpoint_every=2")
step2 = f"{work}/ckpt/checkpoints/step_000002"
shards = sorted(f for f in os.listdir(step2) if f.startswith("optimizer_shard") and f.endswith(".pt")) if os.path.isdir(step2) else []
checks.append((shards == ["optimizer_shard_00000_of_00002.pt", "optimizer_shard_00001_of_00002.pt"], f"dp 2 wrote one optimizer shard per rank {shards}"))
for dp in (1, 2, 4):
    run(f"resume_dp{dp}", "--set", "run.steps=3", "--set", f"parallel.dp={dp}", "--set", f"run.resume_from={step2}")
if all(ok for ok, _ in checks):
    want = numbers(metrics(f"{work}/ckpt")[2])
    for dp in (1, 2, 4):
        rows = metrics(f"{work}/resume_dp{dp}")
        got = numbers(rows[-1])
        checks.append((rows[-1]["step"] == 3, f"resumed at dp {dp}: step 3 logged"))
        if dp == 2:
            checks.append((got == want, f"resumed at dp 2: step 3 equals the uninterrupted run's bit for bit"))
        else:
            bad = [f"{k} {want[k]} vs {got.get(k)}" for k in want if k not in got or not close(want[k], got[k], 1e-4)]
            checks.append((not bad, f"resumed at dp {dp}: step 3 equals the dp-2 run's within 1e-4 {bad[:4]}"))

# 3b. checkpoint at ep 2 (each rank its HF experts and optimizer parts), resumed at ep 2, dp 1, dp 2
run("ckpt_ep", "--set", "run.steps=3", "--set", "parallel.ep=2", "--set", "run.checkpoint_every=2")
step2_ep = f"{work}/ckpt_ep/checkpoints/step_000002"
files = sorted(os.listdir(step2_ep)) if os.path.isdir(step2_ep) else []
want_files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
              "optimizer_shard_00000_of_00002.json", "optimizer_shard_00000_of_00002.pt",
              "optimizer_shard_00001_of_00002.json", "optimizer_shard_00001_of_00002.pt"]
checks.append((all(f in files for f in want_files), f"ep 2 wrote an HF part and optimizer parts per rank {files}"))
for tag, args in (("ep2", ["parallel.ep=2"]), ("dp1", []), ("dp2", ["parallel.dp=2"])):
    sets = [x for a in args for x in ("--set", a)]
    run(f"resume_ep_{tag}", "--set", "run.steps=3", *sets, "--set", f"run.resume_from={step2_ep}")
if os.path.isdir(step2_ep) and os.path.exists(f"{work}/ckpt_ep/metrics.jsonl"):
    want = numbers(metrics(f"{work}/ckpt_ep")[2])
    for tag in ("ep2", "dp1", "dp2"):
        rows = metrics(f"{work}/resume_ep_{tag}") if os.path.exists(f"{work}/resume_ep_{tag}/metrics.jsonl") else [{"step": 0}]
        got = numbers(rows[-1])
        checks.append((rows[-1]["step"] == 3, f"ep-2 checkpoint resumed at {tag}: step 3 logged"))
        if tag == "ep2":
            checks.append((got == want, "ep-2 checkpoint resumed at ep 2: step 3 equals the uninterrupted run's bit for bit"))
        else:
            bad = [f"{k} {want[k]} vs {got.get(k)}" for k in want if k not in got or not close(want[k], got[k], 1e-4)]
            checks.append((not bad, f"ep-2 checkpoint resumed at {tag}: step 3 equals the ep-2 run's within 1e-4 {bad[:4]}"))

# 4. rank 1 killed mid-run
kill_dir = f"{work}/kill"
p = start_run([kiln, "run", *quiet, "--set", "run.steps=40", "--set", "parallel.dp=2", "--set", "run.checkpoint_every=2",
               "--set", "algorithm.update_delay_ms=150", "--set", f"run.output_dir={kill_dir}"], kill_dir, 5, env)
victim, children = rank_child(p.pid, 1)
checks.append((len(children) >= 1, f"rank 0 started rank 1 as its child ({children})"))
checks.append((victim is not None, "found rank 1's process"))
if victim:
    expect_rank_lost(p, victim, 1, checks)
    done = sorted(int(d.split("_")[1]) for d in os.listdir(f"{kill_dir}/checkpoints") if d.startswith("step_") and "." not in d)
    checks.append((len(done) >= 1, f"checkpoints before the kill: {done}"))
    if done:
        r = run("kill", "--set", "run.steps=8", "--set", "parallel.dp=2", "--set", "run.checkpoint_every=2",
                "--set", f"run.resume_from={kill_dir}/checkpoints/step_{done[-1]:06d}")
        steps = [m["step"] for m in metrics(kill_dir)]
        checks.append((steps == list(range(1, 9)), f"resumed: steps 1..8 logged once each ({steps})"))

for rank in (1, 3):
    kill_dir = f"{work}/kill_dp2_ep2_rank{rank}"
    p = start_run([kiln, "run", *quiet, "--set", "run.steps=200", "--set", "parallel.dp=2", "--set", "parallel.ep=2",
                   "--set", "placement.reference=colocated", "--set", "algorithm.max_tokens_per_microbatch=8",
                   "--set", f"run.output_dir={kill_dir}"], kill_dir, 3, env)
    victim, _ = rank_child(p.pid, rank)
    checks.append((victim is not None, f"dp 2 x ep 2: found rank {rank}'s process"))
    if victim:
        expect_rank_lost(p, victim, rank, checks, within=15)
    else:
        p.kill()
        p.communicate()

# A rank lost during start-up (killed as soon as rank 0 started it, before the process groups
# exist): rank 0 names it and exits 2 within 15 s, though parallel.store_timeout_s is 300; no
# run directory was made and no process of the job is left.
startup_dir = f"{work}/kill_startup"
p = subprocess.Popen([kiln, "run", *quiet, "--set", "parallel.dp=2", "--set", "parallel.ep=2",
                      "--set", f"run.output_dir={startup_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
victim, deadline = None, time.monotonic() + 30
while victim is None and p.poll() is None and time.monotonic() < deadline:
    victim, _ = rank_child(p.pid, 2)
    time.sleep(0.005)
checks.append((victim is not None, "start-up: found rank 2's process"))
if victim:
    err, took, alive = kill_and_wait(p, victim)
    checks.append((p.returncode == 2 and took < 15, f"start-up: rank 0 exits 2 within 15 s ({p.returncode}, {took:.1f} s: {err[-300:]})"))
    checks.append(("trainer rank 2" in err and "process groups were made" in err, "start-up: ... naming trainer rank 2"))
    checks.append((not alive and not os.path.exists(startup_dir), f"start-up: no process left ({alive}), no run directory"))
else:
    p.kill()
    p.communicate()

# 5. refusals
def refused(args, fragment, extra_env=None):
    e = dict(env, **(extra_env or {}))
    p = subprocess.run([kiln, "run", *quiet, "--set", f"run.output_dir={work}/refused", *args], capture_output=True,
                       text=True, timeout=120, env=e)
    checks.append((p.returncode == 2 and fragment in p.stderr, f"refused ({p.returncode}) naming '{fragment}': {p.stderr[-300:]}"))

refused(["--set", "parallel.dp=3"], "parallel.dp x parallel.ep = 3 x 1 = 3, but torchrun started 2 ranks",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
refused(["--set", "parallel.dp=2", "--set", "placement.mode=multi_process", "--set", "placement.reference=process",
         "--set", "placement.trainer=process"], "parallel.dp")
refused(["--set", "parallel.dp=0"], "parallel.dp")

failed = [w for ok, w in checks if not ok]
for w in failed:
    print("FAIL:", w)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
