#!/usr/bin/env python3
"""Colocated rollout and reference (placement.mode = "colocated": an engine in each trainer rank
over the trainer's own parameters, expert-parallel engines in lockstep; placement.reference =
"colocated": a frozen copy of the initial policy in each rank, with expert parallel only its
experts) through `kiln run` on CPU ranks
(Gloo), the default experiment (it learns) with 5 prompts of 16 samples a step and at most 16
sequences per engine step, so that the ranks' shares differ (2 and 3 groups at ep 2, 1-2 at ep
4) and a rank idles, serving the others' expert rows, while the others still prefill
(tests/rollout/lockstep_worker.cpp checks decode steps of different lengths):
1. One rank: the same metrics as placement.mode "single_process" (an engine with its own copy
   of the weights, synced every step, and a reference model of its own), bit for bit, over 5
   steps, with the engine colocated, and with the engine and the reference colocated;
   update_weights_time < 10 ms (nothing copied: the engine reads the parameters the optimizer
   wrote).
2. ep 2, ep 4 and dp 2 x ep 2, engines and reference colocated: steps 1 and 2 equal the one-rank single_process run's within
   1e-4 (the same rollouts: an expert's rows are summed in another grouping, the fp32 sums
   differ by ~1e-7), steps 3-5 close (entropy within 1e-3, KL within 5%), as
   check_data_parallel.py says for the trainer over ranks.
3. A colocated run at ep 2 with a checkpoint at step 2, resumed: steps 3-4 equal the
   uninterrupted run's within 1e-4.
4. A rank killed (SIGKILL) while the ranks generate (rollout.step_delay_ms), rank 1 at ep 2 and
   rank 3 at dp 2 x ep 2: rank 0 exits 1 within 60 s naming the rank (with no attempt at a
   checkpoint, which would wait out the collective timeout); no process of the job is left.
5. Refused by name (exit 2) before the run starts: an engine setting (cuda_graphs without
   absorbed_decode, refused by the engines built at start) with a finished run's directory left
   whole under run.overwrite; staleness 1, parallel.fsdp, cuda_graphs at ep 2, placement.trainer
   "process", rollout.backend "http"; placement.reference "colocated" with placement.trainer
   "process".
Usage: check_colocated.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import os, shutil, subprocess, sys, time

from rank_runs import clean_env, close, expect_like_one_rank, expect_rank_lost, metrics, numbers, rank_child, start_run

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
common = ["--set", "logging.plot=false", "--set", "logging.progress=false", "--set", "algorithm.prompts_per_step=5",
          "--set", "rollout.max_batch=16"]
env = clean_env()
checks = []
COLOCATED = ["--set", "placement.mode=colocated"]
BOTH = [*COLOCATED, "--set", "placement.reference=colocated"]


def run(name, *args, timeout=600):
    p = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/{name}", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    checks.append((p.returncode == 0, f"{name} exits 0 ({p.returncode}: {p.stderr[-400:]})"))
    return p.returncode == 0


# 1. one rank
if run("single", "--set", "run.steps=5") and run("colocated", "--set", "run.steps=5", *COLOCATED) and \
        run("colocated_ref", "--set", "run.steps=5", *BOTH):
    a, b, c = metrics(f"{work}/single"), metrics(f"{work}/colocated"), metrics(f"{work}/colocated_ref")
    checks.append(([numbers(r) for r in a] == [numbers(r) for r in b],
                   "one rank: colocated gives single_process's metrics bit for bit"))
    checks.append(([numbers(r) for r in a] == [numbers(r) for r in c],
                   "one rank: colocated engine and reference give single_process's metrics bit for bit"))
    # KL 0 at step 1 (the reference is the initial policy), > 0 once the policy has moved: a
    # reference that followed the policy (not frozen) would stay at 0.
    checks.append((c[0]["kl"] == 0 and all(r["kl"] > 0 for r in c[1:]),
                   f"one rank: KL to the frozen reference 0 at step 1, then > 0 ({[r['kl'] for r in c]})"))
    checks.append((sum(r["trained_samples"] for r in b) > 0, "one rank: steps trained"))
    checks.append((all(r["update_weights_time"] < 0.01 for r in b),
                   f"one rank: no weight sync ({[r['update_weights_time'] for r in b]})"))

# 2. ep 2, ep 4, dp 2 x ep 2
meshes = {"ep2": ["--set", "parallel.ep=2"], "ep4": ["--set", "parallel.ep=4"],
          "dp2_ep2": ["--set", "parallel.dp=2", "--set", "parallel.ep=2"]}
for name, mesh in meshes.items():
    if not run(name, "--set", "run.steps=5", *mesh, *BOTH) or not os.path.exists(f"{work}/single/metrics.jsonl"):
        continue
    expect_like_one_rank(f"{work}/single", f"{work}/{name}", name, checks)

# 3. checkpoint and resume at ep 2
ep2 = ["--set", "parallel.ep=2", *BOTH]
if run("resume", "--set", "run.steps=2", "--set", "run.checkpoint_every=2", *ep2) and \
        run("resume", "--set", "run.steps=4", "--set", f"run.resume_from={work}/resume/checkpoints/step_000002", *ep2) and \
        os.path.exists(f"{work}/ep2/metrics.jsonl"):
    want = [numbers(r) for r in metrics(f"{work}/ep2")][2:4]
    got = [numbers(r) for r in metrics(f"{work}/resume")][2:4]
    for step, (x, y) in enumerate(zip(want, got), 3):
        bad = [f"{k} {x[k]} vs {y.get(k)}" for k in x if k not in y or not close(x[k], y[k], 1e-4)]
        checks.append((not bad, f"resumed at ep 2, step {step}: equals the uninterrupted run's within 1e-4 {bad[:4]}"))
    checks.append((len(got) == 2, f"resumed: steps 3 and 4 logged ({len(got)})"))

# 4. a rank killed while the ranks generate: rank 1 at ep 2, rank 3 at dp 2 x ep 2 (there the other
# ranks' collectives would only end by their timeout: rank 0 must not wait for them)
for name, mesh, lost in (("kill_ep2", ["--set", "parallel.ep=2"], 1),
                         ("kill_dp2_ep2", ["--set", "parallel.dp=2", "--set", "parallel.ep=2"], 3)):
    kill_dir = f"{work}/{name}"
    p = start_run([kiln, "run", *common, "--set", "run.steps=40", *mesh, *BOTH, "--set", "rollout.step_delay_ms=100",
                   "--set", f"run.output_dir={kill_dir}"], kill_dir, 1, env)
    time.sleep(0.1)  # inside step 2's rollout (engine steps of 100 ms each)
    victim, children = rank_child(p.pid, lost)
    checks.append((victim is not None, f"{name}: found rank {lost}'s process among rank 0's children ({children})"))
    if victim:
        expect_rank_lost(p, victim, lost, checks)
    else:
        p.kill()
        p.communicate()


# 5. refusals
def refused(args, fragment):
    p = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/refused", *COLOCATED, *args],
                       capture_output=True, text=True, timeout=120, env=env)
    checks.append((p.returncode == 2 and fragment in p.stderr, f"refused ({p.returncode}) naming '{fragment}': {p.stderr[-300:]}"))


refused(["--set", "algorithm.staleness=1"], "algorithm.staleness")
if os.path.exists(f"{work}/colocated/metrics.jsonl"):
    before = open(f"{work}/colocated/metrics.jsonl").read()
    p = subprocess.run([kiln, "run", *common, "--set", f"run.output_dir={work}/colocated", *COLOCATED, "--set",
                        "run.overwrite=true", "--set", "rollout.cuda_graphs=true"], capture_output=True, text=True,
                       timeout=120, env=env)
    checks.append((p.returncode == 2 and "rollout.cuda_graphs needs rollout.absorbed_decode" in p.stderr,
                   f"an engine setting refused at start ({p.returncode}: {p.stderr[-300:]})"))
    checks.append((open(f"{work}/colocated/metrics.jsonl").read() == before, "... the earlier run's metrics kept"))
refused(["--set", "parallel.ep=2", "--set", "parallel.fsdp=true"], "parallel.fsdp")
refused(["--set", "parallel.ep=2", "--set", "rollout.cuda_graphs=true", "--set", "rollout.absorbed_decode=true"],
        "rollout.cuda_graphs")
refused(["--set", "placement.trainer=process"], "placement.trainer")
refused(["--set", "placement.mode=multi_process", "--set", "placement.trainer=process", "--set",
         "placement.reference=colocated"], "placement.reference")
refused(["--set", "rollout.backend=http", "--set", "rollout.urls=[\"http://127.0.0.1:1\"]"], "rollout.backend")

failed = [w for ok, w in checks if not ok]
for w in failed:
    print("FAIL:", w)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
