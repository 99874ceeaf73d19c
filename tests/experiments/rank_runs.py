"""Helpers of the scripts that run `kiln run` over trainer ranks and compare their metrics
(check_data_parallel.py, check_colocated.py): the run's metrics rows, their numbers without
the measurements, a relative comparison, an environment without a caller's launcher, the
child process of rank 0 that is rank R, and the Python with transformers (check_node_run.py,
check_hf_export.py)."""
import json, os, signal, subprocess, sys, time

TIMING = ("time", "elapsed", "per_s", "peak_memory")  # measurements, not results
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "SLURM_PROCID")


def clean_env():
    """os.environ with OMP_NUM_THREADS=1 and no launcher's variables (the test's own launch)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for v in LAUNCHER_VARIABLES:
        env.pop(v, None)
    return env


def transformers_python(given):
    """The Python to run transformers with: KILN_TEST_TRANSFORMERS_PYTHON, else `given`. Prints
    KILN_TEST_SKIPPED and exits 0 (the test skipped) when it cannot import Glm4MoeLiteForCausalLM."""
    py = os.environ.get("KILN_TEST_TRANSFORMERS_PYTHON") or given
    probe = subprocess.run([py, "-c", "from transformers import Glm4MoeLiteForCausalLM"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode
        print(f"KILN_TEST_SKIPPED: {py} has no transformers with Glm4MoeLiteForCausalLM ({why})")
        sys.exit(0)
    return py


def metrics(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]


def numbers(row):
    """A metrics row's numbers (nested maps flattened as "key.sub"), the timings left out."""
    out = {}
    for k, v in row.items():
        if any(t in k for t in TIMING):
            continue
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def close(a, b, rel):
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def rank_child(pid, rank):
    """The pid of the child of `pid` (rank 0, which started the other ranks) whose environment
    says RANK=`rank`, or None; and the children found."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for c in children:
        try:
            if f"RANK={rank}\0".encode() in open(f"/proc/{c}/environ", "rb").read():
                return int(c), children
        except OSError:
            pass
    return None, children


def kill_and_wait(p, victim):
    """SIGKILLs pid `victim` and waits (up to 120 s, then kills it) for rank 0 (Popen `p`) to
    end; returns its stderr, the seconds it took after the kill and the pids of its children left."""
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    took = time.monotonic() - t0
    return err, took, subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()


def expect_rank_lost(p, victim, rank, checks, within=60):
    """Kills `victim` (rank `rank`, SIGKILL) and appends to `checks` that rank 0 (Popen `p`)
    exits 1 within `within` s naming trainer rank `rank` and that no process of the job is left."""
    err, took, alive = kill_and_wait(p, victim)
    checks.append((p.returncode == 1, f"rank 0 exits 1 after rank {rank} is killed ({p.returncode}: {err[-500:]})"))
    checks.append((took < within, f"... within {within} s ({took:.1f} s)"))
    checks.append((f"trainer rank {rank}" in err, f"... naming trainer rank {rank}"))
    checks.append((not alive, f"no process of the job is left ({alive})"))


def expect_like_one_rank(base_dir, run_dir, tag, checks, steps=5):
    """Appends to `checks` that the run in `run_dir` logged `steps` steps whose first two equal the
    one-rank run's (`base_dir`) within 1e-4 in every metric (the same rollouts), and whose later
    ones stay close (entropy within 1e-3, KL within 5%): a few sampled tokens differ once fp32
    summation order has moved the weights by ~1e-6 relative."""
    base = [numbers(r) for r in metrics(base_dir)]
    got = [numbers(r) for r in metrics(run_dir)]
    checks.append((len(got) == len(base) == steps, f"{tag}: {steps} steps logged"))
    for step, (x, y) in enumerate(zip(base, got), 1):
        if step <= 2:
            bad = [f"{k} {x[k]} vs {y.get(k)}" for k in x if k not in y or not close(x[k], y[k], 1e-4)]
            checks.append((not bad, f"{tag} step {step}: every metric equals one rank's within 1e-4 {bad[:4]}"))
        else:
            checks.append((close(x["entropy"], y["entropy"], 1e-3), f"{tag} step {step}: entropy {y['entropy']} ~ {x['entropy']}"))
            checks.append((abs(x["kl"] - y["kl"]) <= 0.05 * abs(x["kl"]) + 1e-6, f"{tag} step {step}: kl {y['kl']} ~ {x['kl']}"))


def start_run(cmd, run_dir, rows, env):
    """Starts `cmd` (a kiln run into `run_dir`) and returns its Popen once `rows` metrics rows are
    logged (or it ended, or 300 s passed)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if os.path.exists(f"{run_dir}/metrics.jsonl") and len(open(f"{run_dir}/metrics.jsonl").read().splitlines()) >= rows:
            break
        time.sleep(0.05)
    return p
