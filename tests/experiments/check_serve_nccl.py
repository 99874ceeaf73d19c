#!/usr/bin/env python3
"""`kiln serve`'s weight-update group over NCCL (two GPUs): a server on cuda:0 joins a
torch.distributed trainer's NCCL group (the trainer on cuda:1, SGLang's
init_custom_process_group), a zeroed lm_head broadcast into it makes every log-prob -log(V); a
wrong shape is refused by name; and
`kiln run` with rollout.backend "http" and rollout.weight_update "distributed" (the controller on
cuda:1, NCCL) runs and logs the same metrics as the in-process engine. Prints KILN_TEST_SKIPPED
without two CUDA devices or a kiln built with CUDA.
Usage: check_serve_nccl.py PATH_TO_KILN WORK_DIR (a Python with torch). Prints "N passed, M failed"."""
import json, math, os, subprocess, sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Checks, http
from sglang_trainer import form_group, free_port, message, update

kiln, work = sys.argv[1], sys.argv[2]
if torch.cuda.device_count() < 2:
    print(f"KILN_TEST_SKIPPED: {torch.cuda.device_count()} CUDA devices (2 needed)")
    sys.exit(0)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
torch.cuda.set_device(1)
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]

with Checks(work) as check:
    _, url = check.server(kiln, "server", ["--set", "model.device=cuda:0"])
    greedy = {"input_ids": [[2, 5, 6, 7], [2, 9, 10]], "return_logprob": True,
              "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    s, before = http(url, "/generate", greedy)
    check(s == 200, f"the CUDA server generates ({str(before)[:200]})")
    V = http(url, "/get_model_info")[1]["vocab_size"]
    pg, (s, r) = form_group(url, free_port(), backend="nccl")
    check(s == 200 and r.get("success") is True, f"/init_weights_update_group over NCCL ({s}: {message(r)[:200]})")
    D = 64  # the debug flavor's hidden size
    s, r = update(url, pg, [("lm_head.weight", torch.zeros(V, D, device="cuda:1"))], version="5")
    _, flat = http(url, "/generate", greedy)
    lps = [x[0] for item in flat for x in item["meta_info"]["output_token_logprobs"]]
    check(s == 200 and all(abs(x + math.log(V)) < 1e-4 for x in lps),
          f"a zeroed lm_head over NCCL: every log-prob is -log({V}) ({s}: {message(r)[:160]}; {lps[:3]})")
    s, r = http(url, "/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                          "shapes": [[V + 1, D]]})
    check(s == 400 and f"[{V + 1}, {D}]" in message(r), f"a wrong shape: 400 naming it ({s}: {message(r)[:200]})")

    # kiln run through the servers, weights over NCCL, against the in-process engine on CUDA
    a_proc, a = check.server(kiln, "server_a", ["--set", "model.device=cuda:0"])
    runs = {"engine": ["--set", "model.device=cuda:1"],
            "http_nccl": ["--set", "model.device=cuda:1", "--set", "rollout.backend=http",
                          "--set", f'rollout.urls=["{a}"]', "--set", "rollout.weight_update=distributed"]}
    for name, extra in runs.items():
        p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=3", *extra, "--set", f"run.output_dir={work}/{name}"],
                           capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, f"{name} run exits 0 ({p.stderr[-400:]})")
    if check.all_ok():
        base = [json.loads(l) for l in open(f"{work}/engine/metrics.jsonl")]
        got = [json.loads(l) for l in open(f"{work}/http_nccl/metrics.jsonl")]
        for x, y in zip(base, got):
            for k in ("reward_mean", "loss", "kl", "grad_norm", "train/rollout logprob abs diff"):
                check(abs(x[k] - y[k]) <= 1e-5 * max(1.0, abs(x[k])),
                      f"step {x['step']} {k}: in-process {x[k]} ~ http over NCCL {y[k]}")
