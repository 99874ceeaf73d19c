#!/usr/bin/env python3
"""`kiln serve`'s weight-update group endpoints against a Python trainer that does what SGLang's
trainers do (torch.distributed, Gloo, SGLang's init_custom_process_group; the trainer is rank 0
and broadcasts each named tensor in order while /update_weights_from_distributed is in flight):
a server that receives a one-step checkpoint's tensors (per-expert HF names) samples as a server
started from that checkpoint, at the weight version sent; a zeroed lm_head makes every log-prob
-log(V); transformers' grouped expert names load too; unknown names, wrong shapes, wrong or
unknown dtypes, an unknown group and an update before any init get a 400 naming the value before
anything is received, a refusal naming a group leaves it (a trainer broadcasting meanwhile fails
at once), and the server serves as before; a trainer that dies mid-broadcast, and one that stops sending, get an
error answer (the latter within the group's collective timeout) and the server serves the old
weights; the group can then be formed again; SIGTERM while a group join waits for its master
ends the server within its 5 s grace.
Usage: check_serve_distributed.py PATH_TO_KILN WORK_DIR (run with a Python that has torch).
Prints "N passed, M failed"."""
import json, math, os, subprocess, sys, time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Checks, http
from sglang_trainer import form_group, free_port, in_thread, init_custom_process_group, message, update
from tiny_vocab import read_safetensors

TIMEOUT_S = 8  # the servers' rollout.weight_update_timeout_s
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


kiln, work = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3 and sys.argv[3] == "--trainer":  # the child trainer of section 5
    port, mode, url_names = int(sys.argv[4]), sys.argv[5], json.load(open(sys.argv[6]))
    pg = init_custom_process_group("127.0.0.1", port, 2, 0, "doomed")
    time.sleep(1.5)  # the parent's update request is in flight by then
    for name, shape in url_names[:3]:
        dist.broadcast(torch.zeros(shape), src=0, group=pg)
    if mode == "die":
        os._exit(3)
    time.sleep(120)  # "stop": alive, silent
    os._exit(0)

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]
short = ["--set", f"rollout.weight_update_timeout_s={TIMEOUT_S}"]

with Checks(work) as check:
    # A checkpoint other than the initial weights: one trained step.
    run_dir = f"{work}/one_step"
    p = subprocess.run([kiln, "run", *quiet, "--set", "run.steps=1", "--set", "run.checkpoint_every=1",
                        "--set", f"run.output_dir={run_dir}"], capture_output=True, text=True, timeout=600)
    cks = sorted(os.listdir(f"{run_dir}/checkpoints")) if os.path.isdir(f"{run_dir}/checkpoints") else []
    ck = f"{run_dir}/checkpoints/{cks[-1]}" if cks else ""
    check(p.returncode == 0 and os.path.isdir(ck), f"a one-step run leaves an HF checkpoint ({p.stderr[-200:]})")
    trained = {}
    for f in sorted(os.listdir(ck)):
        if f.endswith(".safetensors"):
            for k, (dt, shape, blob) in read_safetensors(f"{ck}/{f}").items():
                trained[k] = torch.frombuffer(bytearray(blob), dtype=DTYPES[dt]).reshape(shape).clone()
    check(any(".mlp.experts.0.gate_proj.weight" in k for k in trained), "the checkpoint holds per-expert HF names")

    _, url = check.server(kiln, "server", short)
    _, ref_url = check.server(kiln, "from_checkpoint", ["--set", f"model.checkpoint={ck}"])
    greedy = {"input_ids": [[2, 5, 6, 7], [2, 9, 10]], "return_logprob": True,
              "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}

    def lps(r):
        return [[x[0] for x in item["meta_info"]["output_token_logprobs"]] for item in r]

    def same(a, b, tol=1e-4):
        return all(x["output_ids"] == y["output_ids"] for x, y in zip(a, b)) and all(
            abs(u - v) < tol for la, lb in zip(lps(a), lps(b)) for u, v in zip(la, lb))

    _, before = http(url, "/generate", greedy)
    _, want = http(ref_url, "/generate", greedy)
    check(not same(before, want), "the trained checkpoint samples otherwise than the initial weights")

    # 1. an update before any group, then the group
    s, r = http(url, "/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                          "shapes": [[1, 1]]})
    check(s == 400 and r.get("success") is False and "no such group" in message(r) and "init_weights_update_group" in message(r),
          f"an update before /init_weights_update_group: 400 saying so ({s}: {message(r)[:200]})")
    pg, (s, r) = form_group(url, free_port())
    check(s == 200 and r.get("success") is True, f"/init_weights_update_group joins the trainer's Gloo group ({s}: {r})")
    s, r = http(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    check(s == 400 and "weight_update_group" in message(r) and "already" in message(r),
          f"a second init of the same group name: 400 naming it ({s}: {message(r)[:200]})")

    # 2. the checkpoint's tensors, broadcast in order: the server samples as one started from it
    names = sorted(trained)
    s, r = update(url, pg, [(n, trained[n]) for n in names], version="7")
    check(s == 200 and r.get("success") is True, f"/update_weights_from_distributed of {len(names)} tensors ({s}: {message(r)[:200]})")
    _, got = http(url, "/generate", greedy)
    check(same(got, want), "after the update it samples as a server started from the checkpoint")
    check(all(item["meta_info"]["weight_version"] == "7" for item in got) and http(url, "/get_weight_version")[1] == {"weight_version": "7"},
          "at the weight version sent (7)")

    # 3. a partial update: a zeroed lm_head makes every log-prob -log(V)
    V = http(url, "/get_model_info")[1]["vocab_size"]
    s, r = update(url, pg, [("lm_head.weight", torch.zeros_like(trained["lm_head.weight"]))])
    _, flat = http(url, "/generate", greedy)
    check(s == 200 and all(abs(x + math.log(V)) < 1e-4 for row in lps(flat) for x in row),
          f"a zeroed lm_head alone: every log-prob is -log({V}) (version {http(url, '/get_weight_version')[1]})")
    check(http(url, "/get_weight_version")[1] == {"weight_version": "8"}, "without weight_version: the current + 1")
    # A NaN in the last tensor of an update (the embedding before it changed): refused naming it,
    # nothing written, the version kept; the group then carries the next update.
    _, pre_nan = http(url, "/generate", greedy)
    nan_lm = torch.zeros_like(trained["lm_head.weight"])
    nan_lm.view(-1)[-1] = float("nan")
    emb = trained["model.embed_tokens.weight"]
    s, r = update(url, pg, [("model.embed_tokens.weight", emb * 2), ("lm_head.weight", nan_lm)])
    _, after = http(url, "/generate", greedy)
    check(s == 400 and r.get("success") is False and "'lm_head.weight' holds 1 non-finite value" in message(r) and
          "nothing was written" in message(r), f"an update with a NaN: 400 naming the tensor ({s}: {message(r)[:240]})")
    check(same(after, pre_nan) and http(url, "/get_weight_version")[1] == {"weight_version": "8"},
          "and the server samples as before, at version 8")
    s, r = update(url, pg, [("model.embed_tokens.weight", emb)], version="8")
    check(s == 200, f"the group carries the next update ({s}: {message(r)[:160]})")

    # 4. bad requests: a 400 naming the value before anything is received. A refusal the group
    # can be named for leaves it (a trainer broadcasting meanwhile fails at once, not at its
    # timeout); the server serves as before
    lm = trained["lm_head.weight"]
    ok_body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [list(lm.shape)]}
    s, r = http(url, "/update_weights_from_distributed", {**ok_body, "group_name": "nobody"})
    check(s == 400 and r.get("success") is False and "'nobody'" in message(r) and "no such group" in message(r),
          f"unknown group_name: 400 naming it ({s}: {message(r)[:200]})")
    s, r = http(url, "/update_weights_from_distributed", {**ok_body, "colour": 1})
    check(s == 400 and "colour" in message(r), f"an unknown field: 400 naming it ({s}: {message(r)[:200]})")
    s, r = update(url, pg, [("lm_head.weight", torch.zeros_like(lm))])
    check(s == 200, f"those two leave the group alone: it still carries an update ({s}: {message(r)[:160]})")
    bad = [
        ({"names": ["model.layers.0.self_attn.nonsense.weight"], "dtypes": ["float32"], "shapes": [[2, 2]]},
         "model.layers.0.self_attn.nonsense.weight", "unknown name"),
        ({"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[lm.shape[0] + 1, lm.shape[1]]]},
         f"[{lm.shape[0] + 1}, {lm.shape[1]}]", "wrong shape"),
        ({"names": ["lm_head.weight"], "dtypes": ["int64"], "shapes": [list(lm.shape)]}, "int64", "wrong dtype"),
        ({"names": ["lm_head.weight"], "dtypes": ["floaty"], "shapes": [list(lm.shape)]}, "floaty", "unknown dtype"),
        ({"names": ["lm_head.weight", "lm_head.weight"], "dtypes": ["float32"] * 2, "shapes": [list(lm.shape)] * 2},
         "twice", "a name twice"),
        ({**ok_body, "load_format": "flattened_bucket"}, "load_format", "a load_format"),
    ]
    for i, (body, needle, what) in enumerate(bad):
        name = f"bad{i}"
        bad_pg, (s, r) = form_group(url, free_port(), name)
        answer = in_thread(lambda: http(url, "/update_weights_from_distributed", {**body, "group_name": name}))
        t0, failed = time.time(), None
        if what == "wrong shape":  # this trainer broadcasts while its request is in flight, as SGLang's do
            try:
                dist.broadcast(torch.zeros(lm.shape[0] + 1, lm.shape[1]), src=0, group=bad_pg)
            except Exception as e:
                failed = e
            check(failed is not None and time.time() - t0 < 10,
                  f"wrong shape: the trainer's broadcast fails at once ({time.time() - t0:.1f} s: {str(failed)[:120]})")
        s, r = answer()
        check(s == 400 and r.get("success") is False and needle in message(r) and f"left group '{name}'" in message(r),
              f"{what}: 400 naming '{needle}', the group left ({s}: {message(r)[:220]})")
    _, still = http(url, "/generate", greedy)
    check(same(still, flat), "after the refused updates the server serves as before")
    # restore lm_head, and the experts under transformers' grouped names
    grouped = []
    for layer in sorted({int(k.split(".")[2]) for k in trained if ".mlp.experts." in k}):
        pre = f"model.layers.{layer}.mlp.experts."
        E = len({k for k in trained if k.startswith(pre) and k.endswith("gate_proj.weight")})
        grouped.append((pre + "gate_up_proj", torch.stack(
            [torch.cat([trained[f"{pre}{e}.gate_proj.weight"], trained[f"{pre}{e}.up_proj.weight"]]) for e in range(E)])))
        grouped.append((pre + "down_proj", torch.stack([trained[f"{pre}{e}.down_proj.weight"] for e in range(E)])))
    s, r = update(url, pg, [("lm_head.weight", lm)] + grouped, version="9")
    _, back = http(url, "/generate", greedy)
    check(s == 200 and same(back, want), f"the group no refusal named still works; grouped expert names load ({s}: {message(r)[:200]})")

    # 5. a trainer that dies mid-broadcast, and one that stops sending: an error answer, old weights kept
    s, r = http(url, "/destroy_weights_update_group", {"group_name": "weight_update_group"})
    check(s == 200 and r.get("success") is True, f"/destroy_weights_update_group leaves the group ({s}: {r})")
    s, r = http(url, "/destroy_weights_update_group", {"group_name": "weight_update_group"})
    check(s == 400 and "no such group" in message(r), f"leaving it again: 400 ({s}: {message(r)[:160]})")
    spec_file = f"{work}/names.json"
    json.dump([[n, list(trained[n].shape)] for n in names], open(spec_file, "w"))
    for mode in ("die", "stop"):
        port = free_port()
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), kiln, work, "--trainer", str(port), mode, spec_file])
        s, r = http(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                                        "world_size": 2, "group_name": "doomed", "backend": "gloo"})
        check(s == 200, f"{mode}: the child trainer's group forms ({s}: {message(r)[:160]})")
        t0 = time.time()
        s, r = http(url, "/update_weights_from_distributed", {
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(trained[n].shape) for n in names],
            "group_name": "doomed", "weight_version": "100"}, timeout=TIMEOUT_S + 60)
        took = time.time() - t0
        check(s == 400 and r.get("success") is False and "doomed" in message(r) and "tensor 3" in message(r),
              f"{mode}: the update fails naming the group and the tensor it waited for, in {took:.1f} s ({s}: {message(r)[:300]})")
        if mode == "stop":
            check(TIMEOUT_S - 1 <= took <= TIMEOUT_S + 15, f"stop: within the collective timeout of {TIMEOUT_S} s ({took:.1f} s)")
        _, after = http(url, "/generate", greedy)
        check(same(after, want) and http(url, "/get_weight_version")[1] == {"weight_version": "9"},
              f"{mode}: the server still serves the old weights at the old version")
        child.kill()
        child.wait()
    # the failed group was left: the name can be joined again
    pg2, (s, r) = form_group(url, free_port(), "doomed")
    check(s == 200, f"after a failed update the group is left and can be formed again ({s}: {message(r)[:160]})")
    s, r = update(url, pg2, [("lm_head.weight", lm)], group="doomed")
    check(s == 200 and r.get("success") is True, "and it carries an update")
    s, r = http(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                    "rank_offset": 0, "world_size": 2, "backend": "gloo"})
    check(s == 400 and "rank_offset" in message(r), f"rank_offset 0 (the trainer's) is refused by name ({s}: {message(r)[:160]})")
    t0 = time.time()  # an address that resolves to nothing: named at once, not after the join's timeout
    s, r = http(url, "/init_weights_update_group", {"master_address": "256.0.0.1", "master_port": free_port(),
                                                    "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    check(s == 400 and "master_address" in message(r) and time.time() - t0 < 30,
          f"master_address 256.0.0.1 is refused by name at once ({s}, {time.time() - t0:.1f} s: {message(r)[:160]})")
    s, r = http(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                    "rank_offset": 1, "world_size": 2})
    check(s == 400 and "nccl" in message(r) and "gloo" in message(r),
          f"backend nccl (SGLang's default) on a CPU server: 400 saying to use gloo ({s}: {message(r)[:160]})")

    # SIGTERM while a group join waits for a master that never comes (the default 600 s
    # weight_update_timeout_s): the server exits within its 5 s grace, not after the timeout.
    stuck, stuck_url = check.server(kiln, "stuck_join")
    pending = in_thread(lambda: http(stuck_url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "never", "backend": "gloo"}, timeout=30))
    time.sleep(1.0)
    t0 = time.time()
    stuck.terminate()
    try:
        rc = stuck.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rc = None
    took = time.time() - t0
    said = open(f"{work}/stuck_join.log").read()
    check(rc == 0 and took < 15 and "abandoned" in said,
          f"SIGTERM during a group join that waits: exit 0 within 15 s ({rc}, {took:.1f} s: {said.strip()[-200:]})")
    try:
        pending()
    except Exception:  # the connection ended with the process
        pass
