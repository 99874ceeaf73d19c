#!/usr/bin/env python3
"""A trainer rank lost mid-run on CUDA (NCCL), as check_data_parallel.py part 4 shows over Gloo:
`kiln run` with two trainer ranks on two GPUs (parallel.dp = 2, and again with the layers fully
sharded, parallel.fsdp), checkpoints every 2 steps; once step 3 is logged, rank 1 is SIGKILLed.
Rank 0 must exit 1 within 20 s naming trainer rank 1 (below parallel.collective_timeout_s = 30:
once rank 1 is known lost, rank 0 aborts its NCCL communicators instead of waiting), no
process of the job may be left, and a resume from the newest checkpoint must finish the run.
Needs two CUDA GPUs: prints KILN_TEST_SKIPPED and exits 0 otherwise.
Usage: check_lost_rank_cuda.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import os, shutil, signal, subprocess, sys, time

kiln, work = sys.argv[1], sys.argv[2]
try:
    gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines())
except (OSError, subprocess.TimeoutExpired):
    gpus = 0
if gpus < 2:
    print(f"KILN_TEST_SKIPPED: needs 2 CUDA GPUs, found {gpus}")
    sys.exit(0)
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
    env.pop(v, None)
base = ["--set", "logging.plot=false", "--set", "logging.progress=false", "--set", "model.device=cuda",
        "--set", "parallel.dp=2", "--set", "run.checkpoint_every=2", "--set", "parallel.collective_timeout_s=30",
        "--set", "algorithm.update_delay_ms=150"]
checks = []


def steps_logged(d):
    try:
        return len(open(f"{d}/metrics.jsonl").read().splitlines())
    except OSError:
        return 0


for tag, extra in (("dp2", []), ("dp2_fsdp", ["--set", "parallel.fsdp=true"])):
    d = f"{work}/{tag}"
    p = subprocess.Popen([kiln, "run", *base, *extra, "--set", "run.steps=40", "--set", f"run.output_dir={d}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None and steps_logged(d) < 3:
        time.sleep(0.05)
    victim = None
    for c in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
        try:
            if b"RANK=1\x00" in open(f"/proc/{c}/environ", "rb").read():
                victim = int(c)
        except OSError:
            pass
    checks.append((victim is not None, f"{tag}: found rank 1's process"))
    if not victim:
        p.kill()
        continue
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    took = time.monotonic() - t0
    print(f"{tag}: rank 0 exited {p.returncode} {took:.1f} s after the kill: {err.strip().splitlines()[-1:] }")
    checks.append((p.returncode == 1, f"{tag}: rank 0 exits 1 after rank 1 is killed ({p.returncode}: {err[-400:]})"))
    checks.append((took < 20, f"{tag}: ... within 20 s ({took:.1f} s)"))
    checks.append(("trainer rank 1" in err, f"{tag}: ... naming trainer rank 1"))
    alive = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    checks.append((not alive, f"{tag}: no process of the job is left ({alive})"))
    done = sorted(int(x.split("_")[1]) for x in os.listdir(f"{d}/checkpoints") if x.startswith("step_") and "." not in x) \
        if os.path.isdir(f"{d}/checkpoints") else []
    checks.append((len(done) >= 1, f"{tag}: checkpoints before the kill: {done}"))
    if done:
        r = subprocess.run([kiln, "run", *base, *extra, "--set", "run.steps=6", "--set", f"run.output_dir={d}",
                            "--set", f"run.resume_from={d}/checkpoints/step_{done[-1]:06d}"],
                           capture_output=True, text=True, env=env, timeout=300)
        checks.append((r.returncode == 0, f"{tag}: the resume exits 0 ({r.returncode}: {r.stderr[-400:]})"))
        checks.append((steps_logged(d) == 6, f"{tag}: resumed: 6 steps logged ({steps_logged(d)})"))

for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
