#!/usr/bin/env python3
"""The one-node GLM-4.7-Flash program (experiments/run_node.sh, issue 17) at the debug size on
the CPU: two expert-parallel trainer ranks over Gloo, the engine in its own process fed by the
collective weight sync, 3 steps, from a checkpoint transformers made (save_pretrained) and each
rank read only its own experts of. Checks:
- run_node.sh makes the checkpoint, runs, and exits 0; a second call reuses the checkpoint;
- metrics.jsonl has 3 steps, each with every number issue 17 asks: train tokens/s, the time split
  (rollout, reference log-probs, old log-probs, train, weight sync; all > 0), the train/rollout
  log-prob difference (finite, >= 0), the peak memory of both trainer ranks (> 0);
- every step trained the whole batch (16 samples: groups of equal rewards kept);
- the summary names each of them;
- the same program with "colocated" (an engine and a frozen reference in each trainer rank, over
  its own weights and experts): 3 steps, the whole batch trained each, the reference log-probs
  timed, no weight sync (update_weights_time < 50 ms), the run's config saying so;
- a placement other than separate/colocated is refused.
Skipped (prints KILN_TEST_SKIPPED) when the Python given has no transformers with Glm4MoeLite.
Usage: check_node_run.py PATH_TO_KILN WORK_DIR PYTHON (KILN_TEST_TRANSFORMERS_PYTHON overrides
PYTHON). Prints "N passed, M failed"."""
import json, math, os, shutil, subprocess, sys

kiln, work = os.path.abspath(sys.argv[1]), sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_runs import clean_env, transformers_python  # noqa: E402

py = transformers_python(sys.argv[3])
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = dict(clean_env(), KILN_BIN=kiln, KILN_PYTHON=py, KILN_NODE_CHECKPOINTS=f"{work}/checkpoints",
           KILN_NODE_RUNS=f"{work}/runs")
checks = []
script = os.path.join(root, "experiments", "run_node.sh")


def check_rows(run, tag, positive):
    """The run's 3 metrics rows, each checked: the time split, train tokens/s and `positive` > 0,
    the train/rollout log-prob difference finite, the whole batch (16 samples) trained."""
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    checks.append((len(rows) == 3, f"{tag}3 steps logged ({len(rows)})"))
    for r in rows:
        at = f"{tag}step {r['step']}"
        for k in ("rollout_time", "ref_logprob_time", "log_probs_time", "actor_train_time", "train_tokens_per_s", *positive):
            checks.append((k in r and r[k] > 0, f"{at}: {k} > 0 ({r.get(k)})"))
        d = r.get("train/rollout logprob abs diff", float("nan"))
        checks.append((math.isfinite(d) and d >= 0, f"{at}: train/rollout logprob abs diff finite ({d})"))
        checks.append((r["trained_samples"] == 16, f"{at}: the whole batch trained ({r['trained_samples']} of 16)"))
    return rows
quiet = ["--set", "logging.progress=false"]
p = subprocess.run([script, "2", "debug", *quiet], capture_output=True, text=True, timeout=600, env=env)
checks.append((p.returncode == 0, f"run_node.sh 2 debug exits 0 ({p.returncode}: {p.stderr[-600:]})"))
checks.append(("making the checkpoint" in p.stderr, "the checkpoint was made by the first call"))
run = f"{work}/runs/glm47_flash_node_2gpu_debugl"
if p.returncode == 0:
    rows = check_rows(run, "", ("update_weights_time", "peak_memory_gib_rank_0", "peak_memory_gib_rank_1"))
    for text in ("train tokens/s (node)", "weight sync", "old log-probs", "ref log-probs", "train/rollout logprob abs diff",
                 "peak memory per trainer rank", "rank 1"):
        checks.append((text in p.stdout, f"the summary shows '{text}'"))
    config = open(f"{run}/config.toml").read()
    for setting in ('ep = 2', 'transport = "collective"', 'routing_replay = true', 'checkpoint = "' + work):
        checks.append((setting in config, f"the run used {setting}"))
    again = subprocess.run([script, "2", "debug", *quiet, "--set", "run.steps=1"], capture_output=True, text=True,
                           timeout=600, env=env)
    checks.append((again.returncode == 0 and "making the checkpoint" not in again.stderr,
                   f"a second call reuses the checkpoint and exits 0 ({again.returncode}: {again.stderr[-300:]})"))
p = subprocess.run([script, "2", "debug", "colocated", *quiet], capture_output=True, text=True, timeout=600, env=env)
checks.append((p.returncode == 0, f"run_node.sh 2 debug colocated exits 0 ({p.returncode}: {p.stderr[-600:]})"))
run = f"{work}/runs/glm47_flash_node_2gpu_debugl_colocated"
if p.returncode == 0:
    for r in check_rows(run, "colocated ", ()):
        checks.append((0 <= r["update_weights_time"] < 0.05, f"colocated step {r['step']}: no weight sync ({r['update_weights_time']} s)"))
    config = open(f"{run}/config.toml").read()
    for setting in ('mode = "colocated"', 'reference = "colocated"', 'ep = 2'):
        checks.append((setting in config, f"the colocated run used {setting}"))
bad = subprocess.run([script, "2", "debug", "shared"], capture_output=True, text=True, timeout=60, env=env)
checks.append((bad.returncode == 2 and "separate or colocated" in bad.stderr, f"placement 'shared' refused ({bad.stderr[-200:]})"))
bad = subprocess.run([script, "3", "debug"], capture_output=True, text=True, timeout=60, env=env)
checks.append((bad.returncode == 2 and "GPUS must be 2, 4 or 8" in bad.stderr, f"GPUS 3 refused ({bad.stderr[-200:]})"))
bad = subprocess.run([script, "2", "48"], capture_output=True, text=True, timeout=60, env=env)
checks.append((bad.returncode == 2 and "LAYERS must be 1..47" in bad.stderr, f"LAYERS 48 refused ({bad.stderr[-200:]})"))
failed = [what for ok, what in checks if not ok]
for what in failed:
    print("FAILED:", what)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
