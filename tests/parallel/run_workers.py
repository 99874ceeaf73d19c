#!/usr/bin/env python3
"""Runs kiln_parallel_worker as several processes and checks what they report.

    run_workers.py WORKER collectives --world W [--mesh dp=2,ep=2] [--device cuda]
        W ranks on 127.0.0.1 (RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT); every rank
        must exit 0 having passed all of its checks.
    run_workers.py WORKER kill --world W --victim R [--signal KILL|STOP]
        W ranks all-reducing in a loop (collective timeout 10 s); once all loop, rank R gets
        SIGKILL (its connections close) or SIGSTOP (it hangs with its connections open, so only
        the timeout can notice). Every other rank must exit (code 3, not killed, not 0) within
        30 s, its error naming the operation and the world group.
    run_workers.py WORKER run --world W -- ARGS...
        W ranks of WORKER ARGS on 127.0.0.1 (any worker that checks something and prints
        "rank R: X of Y checks passed"); every rank must exit 0 with that line and no MISMATCH.
        Rank 0's other lines (its measurements) are printed.
    run_workers.py WORKER torchrun --torchrun PATH [--mesh dp=2,ep=2]
        two torchrun agents (--nnodes 2 --node-rank 0|1 --nproc-per-node 2, c10d rendezvous on
        loopback) run the collectives scenario; prints KILN_TEST_SKIPPED when PATH is absent.
"""
import argparse, os, signal, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loopback_port import free_port  # noqa: E402

DEADLINE_S = 30.0


def base_env():
    env = dict(os.environ)
    for name in list(env):  # the test's own launch, never the caller's
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            del env[name]
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn(worker, args, world, rank, port, out_dir):
    env = base_env()
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w+")
    return subprocess.Popen([worker] + args, env=env, stdout=log, stderr=subprocess.STDOUT), log


def read(log):
    log.flush()
    log.seek(0)
    return log.read()


def fail(msg, logs=()):
    print("FAIL " + msg)
    for name, text in logs:
        print(f"--- {name}\n{text}")
    sys.exit(1)


def run_collectives(a, out_dir):
    args = a.worker_args if a.scenario == "run" else ["collectives"] + (["--mesh", a.mesh] if a.mesh else [])
    port = free_port()
    if a.scenario != "run" and a.device != "cpu":
        args += ["--device", a.device]
    procs = [spawn(a.worker, args, a.world, r, port, out_dir) for r in range(a.world)]
    t0 = time.monotonic()
    codes = []
    for p, _ in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, t0 + 240 - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append("timeout")
    logs = [(f"rank {r}", read(log)) for r, (_, log) in enumerate(procs)]
    if any(codes):
        fail(f"exit codes {codes}", logs)
    for name, text in logs:
        if "checks passed" not in text or "MISMATCH" in text:
            fail(f"{name} did not pass every check", logs)
        print(f"{name}: " + [l for l in text.splitlines() if "checks passed" in l][0])
        for l in text.splitlines():
            if "all_reduce" in l and "GB/s" in l:
                print(f"{name}: {l}")
    print("\n".join(l for l in logs[0][1].splitlines() if not l.startswith("rank ")))
    print(f"ok: world {a.world} {' '.join(args)} in {time.monotonic() - t0:.1f} s")


def run_kill(a, out_dir):
    port = free_port()
    procs = [spawn(a.worker, ["loop", "--timeout-ms", "10000"], a.world, r, port, out_dir) for r in range(a.world)]
    t0 = time.monotonic()
    while not all("looping" in read(log) for _, log in procs):
        if any(p.poll() is not None for p, _ in procs) or time.monotonic() - t0 > 120:
            for p, _ in procs:
                p.kill()
            fail("the ranks did not all reach the loop", [(f"rank {r}", read(l)) for r, (_, l) in enumerate(procs)])
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the loop: every rank is in a collective or about to enter one
    procs[a.victim][0].send_signal(getattr(signal, "SIG" + a.signal))
    killed_at = time.monotonic()
    results = {}
    for r, (p, log) in enumerate(procs):
        if r == a.victim:
            continue
        try:
            p.wait(timeout=max(0.0, killed_at + DEADLINE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            fail(f"rank {r} still runs {DEADLINE_S:.0f} s after rank {a.victim} was killed",
                 [(f"rank {i}", read(l)) for i, (_, l) in enumerate(procs)])
        results[r] = (p.returncode, time.monotonic() - killed_at, read(log))
    procs[a.victim][0].kill()  # a stopped victim too
    procs[a.victim][0].wait()
    logs = [(f"rank {r}", text) for r, (_, _, text) in results.items()]
    for r, (code, seconds, text) in results.items():
        error = [l for l in text.splitlines() if ": error: " in l]
        if code != 3 or not error:
            fail(f"rank {r} exited with {code}, not 3 with an error", logs)
        if "group 'world'" not in error[0] or "all_reduce" not in error[0]:
            fail(f"rank {r}'s error does not name the operation and the group: {error[0]}", logs)
        print(f"rank {r}: exit {code} after {seconds:.1f} s: {error[0][:400]}")
    print(f"ok: SIG{a.signal} to rank {a.victim}: every other rank failed within {max(s for _, s, _ in results.values()):.1f} s")


def run_torchrun(a, out_dir):
    if not os.path.exists(a.torchrun):
        print(f"KILN_TEST_SKIPPED: no torchrun at {a.torchrun}")
        return
    port = free_port()
    mesh = ["--mesh", a.mesh] if a.mesh else []
    agents = []
    for node in range(2):
        log = open(os.path.join(out_dir, f"node{node}.log"), "w+")
        cmd = [a.torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
               "--no-python", a.worker, "collectives"] + mesh
        agents.append((subprocess.Popen(cmd, env=base_env(), stdout=log, stderr=subprocess.STDOUT), log))
    t0 = time.monotonic()
    codes = []
    for p, _ in agents:
        try:
            codes.append(p.wait(timeout=max(0.0, t0 + 240 - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q, _ in agents:
                q.kill()
            codes.append("timeout")
    logs = [(f"node {n}", read(log)) for n, (_, log) in enumerate(agents)]
    if codes != [0, 0]:
        fail(f"torchrun exit codes {codes}", logs)
    text = "".join(t for _, t in logs)
    for rank in range(4):
        if f"rank {rank} launcher torchrun world 4" not in text or f"rank {rank}: " not in text:
            fail(f"rank {rank} did not report a torchrun launch and its checks", logs)
    print("\n".join(l for l in text.splitlines() if "launcher" in l or "checks passed" in l))
    print(f"ok: 2 nodes x 2 ranks under torchrun in {time.monotonic() - t0:.1f} s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("worker")
    p.add_argument("scenario", choices=["collectives", "run", "kill", "torchrun"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    p.add_argument("--mesh", default="")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument("--torchrun", default="")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.worker_args = argv[cut + 1:]  # run: the worker's arguments
    with tempfile.TemporaryDirectory(prefix="kiln_parallel_") as out_dir:
        {"collectives": run_collectives, "run": run_collectives, "kill": run_kill, "torchrun": run_torchrun}[a.scenario](a, out_dir)


if __name__ == "__main__":
    main()
