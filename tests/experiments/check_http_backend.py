#!/usr/bin/env python3
"""The HTTP rollout backend (rollout.backend = "http") against `kiln serve` processes on
loopback: the default experiment (5 steps, k = 0, fixed seed) gives the same metrics as with the
in-process engine, with one server and with two (prompt groups split between them), and with
two servers whose weights are broadcast over a Gloo group (rollout.weight_update =
"distributed": /init_weights_update_group, /update_weights_from_distributed), and with
staleness k = 1 it runs (weights loaded while servers generate) with every token at most one
version old; killing the server mid-run stops the run with an error naming the server's URL and
a checkpoint, and resuming from it against a new server finishes the run with every step trained
once; a server whose model routes otherwise than the policy (other MoE layers, experts per
token or experts) is refused at the start. Usage: check_http_backend.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, signal, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Checks, stop_server

kiln, work = sys.argv[1], sys.argv[2]
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]


def metrics(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]


def widen_experts(src, dst, experts):
    """The HF checkpoint in src (glm4_moe_lite, one safetensors file) with its routed experts
    repeated up to `experts` (the router's rows and correction bias too), into dst."""
    shard = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    assert len(shard) == 1, shard
    raw = open(f"{src}/{shard[0]}", "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    config = json.load(open(f"{src}/config.json"))
    old = config["n_routed_experts"]
    tensors = {}  # name -> (dtype, shape, bytes)
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        tensors[name] = (t["dtype"], t["shape"], data[b:e])
    for name, (dtype, shape, blob) in list(tensors.items()):
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            for extra in range(old, experts):
                if int(e) == extra % old:
                    tensors[f"{head}.mlp.experts.{extra}.{proj}"] = (dtype, shape, blob)
        elif name.endswith(".mlp.gate.weight") or name.endswith(".mlp.gate.e_score_correction_bias"):
            reps = experts // old
            tensors[name] = (dtype, [shape[0] * reps, *shape[1:]], blob * reps)
    out, at = {}, 0
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        at += len(blob)
    text = json.dumps(out).encode()
    os.makedirs(dst, exist_ok=True)
    with open(f"{dst}/model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(tensors[k][2] for k in sorted(tensors)))
    config["n_routed_experts"] = experts
    json.dump(config, open(f"{dst}/config.json", "w"), indent=1)


def urls(*us):
    return "rollout.urls=[" + ", ".join(f'"{u}"' for u in us) + "]"


with Checks(work) as check:
    # 1. the same metrics as the in-process engine (k = 0), with one server and with two
    a_proc, a = check.server(kiln, "server_a")
    b_proc, b = check.server(kiln, "server_b")
    dist = ["--set", "rollout.weight_update=distributed"]
    runs = {"engine": [], "http_one": ["--set", "rollout.backend=http", "--set", urls(a)],
            "http_two": ["--set", "rollout.backend=http", "--set", urls(a, b)],
            "http_two_distributed": ["--set", "rollout.backend=http", "--set", urls(a, b), *dist]}
    for name, extra in runs.items():
        p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=5", *extra, "--set", f"run.output_dir={work}/{name}"],
                           capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, f"{name} run exits 0 ({p.stderr[-400:]})")
    if check.all_ok():
        base = metrics(f"{work}/engine")
        for name in ("http_one", "http_two", "http_two_distributed"):
            m = metrics(f"{work}/{name}")
            check(len(m) == len(base) == 5, f"{name}: 5 steps")
            for x, y in zip(base, m):
                for k in ("reward_mean", "loss", "kl", "grad_norm", "entropy", "trained_samples",
                          "train/rollout logprob abs diff"):
                    check(x[k] == y[k], f"{name}: step {x['step']} {k}: in-process {x[k]} == http {y[k]}")
        check("rollout_weights" in os.listdir(f"{work}/http_one") and
                       os.listdir(f"{work}/http_one/rollout_weights") == ["version_5"],
                       "the servers read each version from RUN/rollout_weights; only the newest is kept")
        check(not os.path.exists(f"{work}/http_two_distributed/rollout_weights"),
              "with rollout.weight_update = \"distributed\" no weights are written to disk")

    # 2. staleness k = 1: weights reach the servers between and during generations
    for name, extra in (("http_async", []), ("http_async_distributed", dist)):
        p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=6", "--set", "algorithm.staleness=1",
                            "--set", "rollout.backend=http", "--set", urls(a, b), *extra,
                            "--set", f"run.output_dir={work}/{name}"], capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, f"{name}: k = 1 run exits 0 ({p.stderr[-400:]})")
        if p.returncode == 0:
            m = metrics(f"{work}/{name}")
            check([r["step"] for r in m] == list(range(1, 7)), f"{name}: k = 1: 6 steps")
            hist = {}
            for r in m:
                for age, count in r["staleness_histogram"].items():
                    hist[int(age)] = hist.get(int(age), 0) + count
            check(set(hist) <= {0, 1} and hist.get(1, 0) > 0,
                  f"{name}: k = 1: every token at most 1 version old, some exactly 1 (ages {hist})")
    for s in (a_proc, b_proc):
        stop_server(s)

    # 3. a server killed mid-run: an error naming its URL, a checkpoint; resume against a new one
    # (weights from disk, and broadcast: the new server joins a new group)
    for mode, extra in (("disk", []), ("distributed", dist)):
        slow, slow_url = check.server(kiln, f"server_slow_{mode}", ["--set", "rollout.step_delay_ms=150"])
        out = f"{work}/killed_{mode}"
        common = [*quiet, "--set", "run.steps=12", "--set", "algorithm.prompts_per_step=4", "--set", "rollout.backend=http",
                  "--set", "rollout.http_retry_s=2", *extra]
        p = subprocess.Popen([kiln, "run", *common, "--set", urls(slow_url), "--set", f"run.output_dir={out}"],
                             stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if os.path.exists(f"{out}/metrics.jsonl") and len(open(f"{out}/metrics.jsonl").read().splitlines()) >= 3:
                break
            time.sleep(0.05)
        os.kill(slow.pid, signal.SIGKILL)
        slow.wait()
        _, err = p.communicate(timeout=300)
        check(p.returncode == 1, f"{mode}: killed server: the run exits 1 (got {p.returncode})")
        check(f"rollout server {slow_url}" in err and "lost" in err,
              f"{mode}: killed server: the error names the server's URL: {err.strip()[-400:]}")
        ck = err.split("resume_from=")[-1].strip().split()[0] if "resume_from=" in err else ""
        check(bool(ck) and os.path.exists(f"{ck}/state.json"), f"{mode}: killed server: checkpoint {ck} written")
        if ck:
            fresh, fresh_url = check.server(kiln, f"server_fresh_{mode}")
            r = subprocess.run([kiln, "run", *common, "--set", urls(fresh_url), "--set", f"run.output_dir={out}",
                                "--set", f"run.resume_from={ck}"], capture_output=True, text=True, timeout=600)
            check(r.returncode == 0, f"{mode}: resumed against a new server: exits 0 ({r.stderr[-400:]})")
            steps = [m["step"] for m in metrics(out)]
            check(steps == list(range(1, 13)), f"{mode}: every step trained exactly once across kill and resume: {steps}")
            stop_server(fresh)

    # 4. a URL where nothing listens: refused at start, naming it
    p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=1", "--set", "rollout.backend=http",
                        "--set", "rollout.http_retry_s=1", "--set", urls("http://127.0.0.1:1"),
                        "--set", f"run.output_dir={work}/nobody"], capture_output=True, text=True, timeout=120)
    check(p.returncode == 2 and "rollout server http://127.0.0.1:1" in p.stderr,
                   f"no server at the URL: exit 2 naming it ({p.returncode}: {p.stderr.strip()[-300:]})")

    # 5. glm5_next through kiln serve: the completions carry each sparse layer's selections
    # (return_topk_indices, parsed by shape) and the run logs the in-process engine's metrics
    g5 = ["--set", "model.package=glm5_next"]
    g_proc, g = check.server(kiln, "server_glm5", g5)
    for name, extra in (("glm5_engine", []), ("glm5_http", ["--set", "rollout.backend=http", "--set", urls(g)])):
        p = subprocess.run([kiln, "run", *quiet, *g5, "--set", "run.steps=2", *extra, "--set", f"run.output_dir={work}/{name}"],
                           capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, f"{name} run exits 0 ({p.stderr[-400:]})")
    if os.path.exists(f"{work}/glm5_http/metrics.jsonl") and os.path.exists(f"{work}/glm5_engine/metrics.jsonl"):
        for x, y in zip(metrics(f"{work}/glm5_engine"), metrics(f"{work}/glm5_http")):
            for k in ("reward_mean", "loss", "grad_norm", "train/rollout logprob abs diff"):
                check(x[k] == y[k], f"glm5_next: step {x['step']} {k}: in-process {x[k]} == http {y[k]}")
    # A policy of another routing than the server's model (glm4_moe_lite's debug flavor: 2 MoE
    # layers; glm5_next's: 3, the same vocabulary): refused at the start naming both, not at step
    # 1 by the trainer's replay check
    p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=1", "--set", "rollout.backend=http", "--set", urls(g),
                        "--set", f"run.output_dir={work}/other_routing"], capture_output=True, text=True, timeout=600)
    check(p.returncode == 2 and f"rollout server {g}" in p.stderr and "2 experts per token in 3 MoE layers, the policy's 2 in 2"
          in p.stderr and not os.path.exists(f"{work}/other_routing"),
          f"a server whose model routes otherwise: refused at the start naming both ({p.returncode}: {p.stderr.strip()[-300:]})")
    stop_server(g_proc)

    # 6. A server whose model has other experts (the debug flavor's checkpoint widened to 16 experts:
    # the same layers, experts per token and vocabulary) is refused at the start naming both counts
    # (it used to be refused only when the first weights reached it)
    one = f"{work}/one_step_e8"
    p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=1", "--set", "run.checkpoint_every=1",
                        "--set", f"run.output_dir={one}"], capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, f"a one-step run for the 8-expert checkpoint exits 0 ({p.stderr[-200:]})")
    if p.returncode == 0:
        widen_experts(f"{one}/checkpoints/step_000001", f"{work}/e16", 16)
        e_proc, e16 = check.server(kiln, "server_e16", ["--set", f"model.checkpoint={work}/e16"])
        p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=1", "--set", "rollout.backend=http", "--set", urls(e16),
                            "--set", f"run.output_dir={work}/other_experts"], capture_output=True, text=True, timeout=600)
        check(p.returncode == 2 and f"rollout server {e16}: its model has 16 routed experts, the policy's 8" in p.stderr,
              f"a server whose model has 16 experts: refused at the start naming both ({p.returncode}: {p.stderr.strip()[-300:]})")
        stop_server(e_proc)
