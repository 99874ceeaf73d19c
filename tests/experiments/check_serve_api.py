#!/usr/bin/env python3
"""`kiln serve`'s native API (SGLang's /generate and control endpoints) on loopback: answers with
output ids, per-token log-probs, routed experts and the weight version; the same seed gives the
same sample alone, in a batch and among 16 concurrent clients (continuous batching); bad requests
(invalid JSON (NaN, numbers that overflow), unknown fields, wrong types, out-of-range sampling
values, token ids outside the vocabulary, over-long prompts) get a 400 naming the field and the server goes on
serving; a client that disconnects has its sequence cancelled and its cache pages freed;
/pause_generation holds requests until /continue_generation (mode "abort" ends them);
/update_weights_from_disk loads a checkpoint (the server then samples as one started from it)
and refuses one that does not fit, naming a tensor; JSON sent as a form (curl -d) over 8 KiB is
read as JSON, and a POST without a body or Content-Length (curl -X POST) is answered at once; a
sample stops at the model's end token unless ignore_eos.
Usage: check_serve_api.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import base64, json, os, random, shutil, socket, struct, subprocess, sys, threading, time, urllib.error, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Checks, http, stop_server
from tiny_vocab import read_safetensors, write_safetensors, write_tiny_vocab2048

kiln, work = sys.argv[1], sys.argv[2]


def gen(url, ids, seed, n=8, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "sampling_seed": seed}, "return_logprob": True}
    body.update(extra)
    return http(url, "/generate", body)


def bad(url, path, body=None, raw=None, field=""):
    s, r = http(url, path, body=body, raw=raw)
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    check(s == 400 and field in msg, f"{path} {raw or json.dumps(body)[:80]}: 400 naming '{field}' (got {s}: {msg[:160]})")


with Checks(work) as check:
    proc, url = check.server(kiln, "server")
    s, _ = http(url, "/health")
    check(s == 200, "/health answers 200")
    # A second server on the same port is refused (with SO_REUSEPORT both listened and the kernel
    # split the requests between them).
    port = url.rsplit(":", 1)[1]
    second = subprocess.run([kiln, "serve", "--port", port], capture_output=True, text=True, timeout=120)
    check(second.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in second.stderr,
          f"a second server on port {port}: exit 2 naming the address ({second.returncode}: {second.stderr[-200:]})")
    s, info = http(url, "/get_model_info")
    check(s == 200 and info["weight_version"] == "0" and info["vocab_size"] > 0 and info["num_moe_layers"] > 0
          and info.get("num_experts") == 8, f"/get_model_info (the debug flavor's 8 experts): {info}")
    L, K, V = info["num_moe_layers"], info["experts_per_token"], info["vocab_size"]
    # What cpp-httplib answers itself (no route) has the handlers' JSON error body too.
    for method_body, path in ((None, "/generate"), (None, "/no_such_route"), ({"x": 1}, "/no_such_route")):
        s, r = http(url, path, body=method_body)
        msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else ""
        check(s == 404 and "no route" in msg and path in msg,
              f"{'POST' if method_body else 'GET'} {path}: 404 with a JSON error naming the route ({s}: {str(r)[:160]})")

    # 1. one request: ids, log-probs, routed experts, weight version
    prompt = [2, 5, 6, 7]
    s, r = gen(url, prompt, 7, return_routed_experts=True)
    check(s == 200, f"/generate answers 200 ({r if s != 200 else ''})")
    out, meta = r["output_ids"], r["meta_info"]
    n = len(out)
    check(1 <= n <= 8 and meta["completion_tokens"] == n and meta["prompt_tokens"] == len(prompt),
          f"{n} output ids, token counts in meta_info")
    check([t for _, t, _ in meta["output_token_logprobs"]] == out and all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"]),
          "output_token_logprobs: [logprob <= 0, id, null] per output token")
    experts = base64.b64decode(meta["routed_experts"])
    check(len(experts) == (len(prompt) + n - 1) * L * K * 4, f"routed_experts: int32 [P + n - 1, {L}, {K}] in base64")
    check(meta["weight_version"] == "0" and meta["output_token_weight_versions"] == [0] * n, "weight version 0 per token")
    check(meta["finish_reason"]["type"] in ("stop", "length"), f"finish_reason {meta['finish_reason']}")
    s2, r2 = gen(url, prompt, 7)
    check(r2["output_ids"] == out and r2["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"],
          "the same sampling_seed samples the same tokens with the same log-probs")

    # 2. a batch, and 16 concurrent clients: each sample as alone
    prompts = [[2, 5 + i % 80, 6, 7 + i % 80] for i in range(64)]
    alone = [gen(url, p, 100 + i, n=12)[1] for i, p in enumerate(prompts)]
    s, batch = http(url, "/generate", {"input_ids": prompts[:4], "return_logprob": True,
                                       "sampling_params": [{"max_new_tokens": 12, "sampling_seed": 100 + i} for i in range(4)]})
    check(s == 200 and isinstance(batch, list) and len(batch) == 4, "a batch of 4 prompts answers a list of 4")

    def close(a, b):
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        return a["output_ids"] == b["output_ids"] and all(abs(x - y) < 1e-4 for x, y in zip(la, lb))

    check(s == 200 and all(close(batch[i], alone[i]) for i in range(4)), "each sample of the batch equals it alone")
    results = [None] * 64
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, gen(url, prompts[i], 100 + i, n=12)))
               for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(all(r and r[0] == 200 and close(r[1], alone[i]) for i, r in enumerate(results)),
          "64 concurrent clients (a burst beyond cpp-httplib's listen backlog of 5): each sample equals it alone")
    s, r = http(url, "/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 3}})
    check(s == 200 and isinstance(r.get("text"), str), f"a text prompt (the character tokenizer): {r}")

    # 3. bad requests: 400 naming the field; the server goes on
    bad(url, "/generate", raw=b"{not json", field="not valid JSON")
    bad(url, "/generate", raw=b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "max_new_tokens": 900}}',
        field="the key 'max_new_tokens' appears twice")
    bad(url, "/update_weights_from_disk", raw=b'{"model_path": "/a", "model_path": "/b"}', field="'model_path' appears twice")
    # A deeply nested value where a number belongs: named by its kind, not printed whole (printing
    # 70000 levels overran the server's stack and killed it).
    deep = b"[" * 70000 + b"]" * 70000
    for field, raw in (("sampling_params.max_new_tokens", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + deep + b'}}'),
                       ("input_ids", b'{"input_ids": ' + deep + b'}'),
                       ("sampling_params.temperature", b'{"input_ids": [1], "sampling_params": {"temperature": ' + deep + b'}}')):
        bad(url, "/generate", raw=raw, field=f"{field}")
    s, r = http(url, "/generate", raw=b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + deep + b'}}')
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    check(s == 400 and "an array of 1 element" in msg and len(msg) < 300, f"the nested value is named by kind, briefly ({msg[:200]})")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": 1e-300}}, field="sampling_params.temperature")
    # A top_p below fp32's range is the nucleus of the top token (it failed every request of the step).
    s1, tiny = http(url, "/generate", {"input_ids": [2, 5, 6], "sampling_params": {"max_new_tokens": 4, "top_p": 1e-300}})
    s2, greedy0 = http(url, "/generate", {"input_ids": [2, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    check(s1 == 200 and s2 == 200 and tiny["output_ids"] == greedy0["output_ids"],
          f"top_p 1e-300 samples the top token each time, as greedy does ({s1}: {str(tiny)[:160]})")
    bad(url, "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "99999999999999999999999"},
        field="weight_version: kiln's versions are integers >= 0")
    bad(url, "/generate", {"input_ids": [1, 2], "prompt_magic": 1}, field="prompt_magic")
    bad(url, "/generate", {"input_ids": "12"}, field="input_ids")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, field="sampling_params.temperature")
    bad(url, "/generate", raw=b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', field="not valid JSON")
    bad(url, "/generate", raw=b'{"input_ids": [1, 2], "sampling_params": {"top_p": 1e999}}', field="1e999")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, field="sampling_params.top_p")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, field="sampling_params.temperature")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, field="max_new_tokens")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, field="top_k")
    # prompt + max_new_tokens past int64 once passed the check and crashed the server (no cache pages)
    for n in (2**63 - 1, 2**63 - 3):
        bad(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n}},
            field=f"max_new_tokens {n} exceeds the server's context")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"n": 2}}, field="sampling_params.n")
    bad(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}, field="sampling_params.min_p")
    bad(url, "/generate", {"input_ids": [1, V]}, field="input_ids[1]")
    bad(url, "/generate", {"input_ids": [1, -3]}, field="input_ids[1]")
    bad(url, "/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [V + 5]}}, field="stop_token_ids[0]")
    bad(url, "/generate", {"input_ids": []}, field="input_ids")
    bad(url, "/generate", {"input_ids": [[1], []]}, field="input_ids[1]")
    bad(url, "/generate", {"input_ids": [1] * 20000}, field="context")
    bad(url, "/generate", {"input_ids": [1, 2], "text": "x"}, field="exactly one of input_ids and text")
    bad(url, "/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, field="sampling_params")
    bad(url, "/pause_generation", {"mode": "sideways"}, field="mode")
    bad(url, "/update_weights_from_disk", {}, field="model_path")
    bad(url, "/update_weights_from_disk", {"model_path": f"{work}/nowhere"}, field="not a directory")
    # 300 random mutations of a valid body (bytes flipped, dropped, cut; seeded): each answered
    # 200 or 400 with a message, never a 5xx or a closed connection
    rng = random.Random(16)
    valid = json.dumps({"input_ids": [[2, 5, 6], [7, 8]], "return_logprob": True, "return_routed_experts": True,
                        "sampling_params": [{"max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                                             "sampling_seed": 1, "stop_token_ids": [1]}, {"max_new_tokens": 2}]}).encode()
    answers = {}
    for _ in range(300):
        b = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            if len(b) < 2:
                break
            i = rng.randrange(len(b))
            op = rng.random()
            if op < 0.5:
                b[i] = rng.choice(b'0123456789-.e[]{}",:truefalsnul \x00\xff')
            elif op < 0.8:
                del b[i]
            else:
                b = b[:i]
        try:
            status, answer = http(url, "/generate", raw=bytes(b), timeout=60)
            ok = status == 200 or (status == 400 and isinstance(answer, dict) and answer["error"]["message"])
            answers[status] = answers.get(status, 0) + 1
        except Exception as e:
            ok, status = False, repr(e)
        if not ok:
            check(False, f"mutated body {bytes(b)[:120]!r}: {status}")
            break
    check(set(answers) <= {200, 400} and sum(answers.values()) == 300, f"300 mutated bodies: only 200 and 400 answers ({answers})")
    s, _ = http(url, "/health")
    s2, r = gen(url, prompt, 7)
    check(s == 200 and s2 == 200 and r["output_ids"] == out, "after the bad requests the server serves as before")

    # 2b. what curl sends: JSON over 8 KiB as application/x-www-form-urlencoded (curl -d's
    # default) is read as JSON; a POST with no body and no Content-Length (curl -X POST) is an
    # empty body, answered at once
    padded = json.dumps({"input_ids": prompt, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 8, "sampling_seed": 7}}) + " " * 9000
    req = urllib.request.Request(url + "/generate", data=padded.encode(), method="POST",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            s, form = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        s, form = e.code, e.read().decode()[:200]
    check(s == 200 and form["output_ids"] == out,
          f"a {len(padded)}-byte JSON body sent as application/x-www-form-urlencoded is read as JSON ({s}: {str(form)[:120]})")
    for path in ("/pause_generation", "/continue_generation", "/flush_cache"):
        t0 = time.time()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            head = sock.recv(65536).decode(errors="replace")
        check(head.startswith("HTTP/1.1 200") and time.time() - t0 < 2,
              f"POST {path} without a body or Content-Length: 200 at once ({time.time() - t0:.2f} s: {head.splitlines()[:1]})")
    s, r = http(url, "/get_server_info")
    check(s == 200 and r["paused"] is False, "the server is not left paused")
    # a Content-Length that is not a byte count is a bad request (400), not an oversized one; one
    # past int64 is an oversized one (413; it was called "not decimal digits")
    for length, status, words in (("-5", 400, "is not a byte count"), ("12abc", 400, "is not a byte count"),
                                  ("+7", 400, "is not a byte count"), ("99999999999999999999", 413, "MiB a body may have")):
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {length}\r\n\r\n{{}}".encode())
            head = b""
            while b"}}" not in head:  # the JSON error body may come in a second segment
                part = sock.recv(65536)
                if not part:
                    break
                head += part
            head = head.decode(errors="replace")
        check(head.startswith(f"HTTP/1.1 {status}") and words in head,
              f"Content-Length {length}: {status} naming it ({head.splitlines()[:1]} {head[-120:]!r})")

    # 2c. the model's end token ends a sample unless ignore_eos (SGLang's default), as a stop
    # token of its own would
    EOS = 1  # the character tokenizer's <eos>
    params = [{"max_new_tokens": 48, "sampling_seed": 1000 + i, "ignore_eos": True} for i in range(32)]
    _, free = http(url, "/generate", {"input_ids": [prompt] * 32, "sampling_params": params})
    hit = [i for i, item in enumerate(free) if EOS in item["output_ids"][:-1]]
    check(len(hit) > 0, f"with ignore_eos some of 32 samples run past <eos> ({len(hit)})")
    if hit:
        i = hit[0]
        cut = free[i]["output_ids"].index(EOS) + 1
        p = dict(params[i])
        del p["ignore_eos"]
        _, stopped = http(url, "/generate", {"input_ids": prompt, "sampling_params": p})
        check(stopped["output_ids"] == free[i]["output_ids"][:cut] and
              stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS},
              f"without ignore_eos the same sample stops at <eos> ({stopped['output_ids']}, {stopped['meta_info']['finish_reason']})")
        p["ignore_eos"] = False
        _, stopped2 = http(url, "/generate", {"input_ids": prompt, "sampling_params": p})
        check(stopped2["output_ids"] == stopped["output_ids"], "ignore_eos false: the same")
    stop_server(proc)

    # 4. a client that disconnects: its sequence is cancelled, its pages freed
    slow, slow_url = check.server(kiln, "slow", ["--set", "rollout.step_delay_ms=100"])
    port = int(slow_url.rsplit(":", 1)[1])
    # ignore_eos: an early <eos> (the seed is drawn per request) would end it before it is seen running
    body = json.dumps({"input_ids": [2, 5, 6], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)

    def server_info():
        return http(slow_url, "/get_server_info")[1]

    deadline = time.time() + 30
    while time.time() < deadline and server_info()["running_requests"] != 1:
        time.sleep(0.05)
    before = server_info()
    check(before["running_requests"] == 1 and before["free_cache_blocks"] < before["cache_blocks"],
          f"a long generation runs and holds cache pages ({before})")
    sock.close()
    deadline = time.time() + 10
    while time.time() < deadline and server_info()["running_requests"] != 0:
        time.sleep(0.05)
    after = server_info()
    check(after["running_requests"] == 0 and after["free_cache_blocks"] == after["cache_blocks"],
          f"its client gone, the sequence is cancelled and every page is free within 10 s ({after})")
    check("disconnected" in open(f"{work}/slow.log").read(), "the server logs the disconnect")
    # the same for a streamed OpenAI completion (server-sent events), gone after its first event
    # (seed 38: the debug model samples 352 tokens before its end token; unseeded it drew the end
    # token within the first steps now and then, and the request was over before the client left)
    body = json.dumps({"model": "kiln", "prompt": [2, 5, 6], "max_tokens": 500, "stream": True, "seed": 38}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    first = b""
    while b"data: " not in first:
        first += sock.recv(4096)
    streaming = server_info()
    sock.close()
    deadline = time.time() + 10
    while time.time() < deadline and server_info()["running_requests"] != 0:
        time.sleep(0.05)
    after = server_info()
    check(streaming["running_requests"] == 1 and after["running_requests"] == 0 and
          after["free_cache_blocks"] == after["cache_blocks"],
          f"a streaming client gone after its first event: cancelled and its pages freed ({streaming} -> {after})")

    # 5. pause (in_place) holds requests until continue; mode abort ends them
    s, _ = http(slow_url, "/pause_generation", {"mode": "in_place"})
    held = []
    t = threading.Thread(target=lambda: held.append(gen(slow_url, prompt, 7)))
    t.start()
    time.sleep(1.0)
    check(s == 200 and not held and server_info()["paused"], "paused: a request waits")
    http(slow_url, "/continue_generation", {})
    t.join(60)
    check(held and held[0][0] == 200 and held[0][1]["output_ids"] == out, "continued: it finishes, as it would have")
    aborted = []  # ignore_eos: an end-of-sequence token sampled early ended it before the pause (a flake)
    t = threading.Thread(target=lambda: aborted.append(http(slow_url, "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and server_info()["running_requests"] != 1:
        time.sleep(0.05)
    s, r = http(slow_url, "/pause_generation", {"mode": "abort"})
    t.join(60)
    check(s == 200 and r["num_aborted_requests"] == 1 and aborted and "aborted" in json.dumps(aborted[0][1]),
          f"pause mode abort ends the running request ({r}, {aborted[:1]})")
    http(slow_url, "/continue_generation", {})
    stop_server(slow)

    # 6. update_weights_from_disk: the server then samples as one started from that checkpoint
    run_dir = f"{work}/one_step"
    p = subprocess.run([kiln, "run", "--set", "logging.plot=false", "--set", "logging.progress=false", "--set", "run.steps=1",
                        "--set", "run.checkpoint_every=1", "--set", f"run.output_dir={run_dir}"],
                       capture_output=True, text=True, timeout=600)
    cks = sorted(os.listdir(f"{run_dir}/checkpoints")) if os.path.isdir(f"{run_dir}/checkpoints") else []
    ck = f"{run_dir}/checkpoints/{cks[-1]}" if cks else ""
    check(p.returncode == 0 and os.path.isdir(ck), f"a one-step run leaves an HF checkpoint ({p.stderr[-200:]})")
    fresh, fresh_url = check.server(kiln, "fresh")
    loaded, loaded_url = check.server(kiln, "from_checkpoint", ["--set", f"model.checkpoint={ck}"])
    greedy = {"input_ids": prompts[:4], "return_logprob": True,
              "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    s, r = http(fresh_url, "/update_weights_from_disk", {"model_path": ck, "weight_version": "1"})
    check(s == 200 and r["success"], f"/update_weights_from_disk loads the checkpoint ({r})")
    _, want = http(loaded_url, "/generate", greedy)
    _, got = http(fresh_url, "/generate", greedy)
    check(all(close(a, b) for a, b in zip(want, got)) and got[0]["meta_info"]["weight_version"] == "1",
          "after the update it samples as a server started from the checkpoint, at weight version 1")
    other = f"{work}/tiny_vocab2048"  # the debug model's layers with a vocabulary of 2048
    write_tiny_vocab2048(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), other)
    s, r = http(fresh_url, "/update_weights_from_disk", {"model_path": other})
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    check(s == 400 and "describes another model" in msg and "'vocab_size' 2048" in msg,
          f"a checkpoint of another model is refused naming its config's field ({s}: {msg[:200]})")
    # Tensors that fit, a config.json that does not (another norm epsilon): refused by the field;
    # a config.json the package cannot read: refused by its reason (the file was not read before).
    eps_dir = f"{work}/other_eps"
    shutil.copytree(ck, eps_dir)
    cfg = json.load(open(f"{eps_dir}/config.json"))
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 10
    json.dump(cfg, open(f"{eps_dir}/config.json", "w"))
    bad(fresh_url, "/update_weights_from_disk", {"model_path": eps_dir}, field="'rms_norm_eps'")
    cfg["rms_norm_eps"], cfg["hidden_act"] = cfg["rms_norm_eps"] / 10, "gelu"
    json.dump(cfg, open(f"{eps_dir}/config.json", "w"))
    bad(fresh_url, "/update_weights_from_disk", {"model_path": eps_dir}, field="hidden_act")
    open(f"{eps_dir}/config.json", "w").write("[1, 2, 3]")
    bad(fresh_url, "/update_weights_from_disk", {"model_path": eps_dir}, field="must be a JSON object")
    _, again = http(fresh_url, "/generate", greedy)
    check(all(close(a, b) for a, b in zip(want, again)), "after the refused update the server serves as before")
    # The checkpoint with its embedding doubled (read first) and a NaN at the end of lm_head.weight
    # (read last): refused by the NaN, and nothing of it written, the embedding neither.
    nan_dir = f"{work}/nan_last"
    shutil.copytree(ck, nan_dir)
    for f in sorted(os.listdir(nan_dir)):
        if not f.endswith(".safetensors"):
            continue
        ts = read_safetensors(f"{nan_dir}/{f}")
        if "model.embed_tokens.weight" in ts:
            dt, shape, blob = ts["model.embed_tokens.weight"]
            assert dt == "F32", dt
            ts["model.embed_tokens.weight"] = (dt, shape, struct.pack(f"<{len(blob) // 4}f",
                                                                       *(2 * v for v in struct.unpack(f"<{len(blob) // 4}f", blob))))
        if "lm_head.weight" in ts:
            dt, shape, blob = ts["lm_head.weight"]
            ts["lm_head.weight"] = (dt, shape, blob[:-4] + struct.pack("<f", float("nan")))
        write_safetensors(f"{nan_dir}/{f}", ts)
    s, r = http(fresh_url, "/update_weights_from_disk", {"model_path": nan_dir, "weight_version": "2"})
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    check(s == 400 and "'lm_head.weight' holds 1 non-finite value" in msg,
          f"a checkpoint with a NaN in its last tensor is refused naming it ({s}: {msg[:200]})")
    _, again = http(fresh_url, "/generate", greedy)
    check(all(close(a, b) for a, b in zip(want, again)) and again[0]["meta_info"]["weight_version"] == "1",
          "and nothing of it was written: the server samples as before, at weight version 1")
    # Versions are decimal digits, and the last one has no next.
    for v in ("+1", " 1", "-0", "1\u0000"):
        bad(fresh_url, "/update_weights_from_disk", {"model_path": ck, "weight_version": v}, field="weight_version")
    s, r = http(fresh_url, "/update_weights_from_disk", {"model_path": ck, "weight_version": "9223372036854775807"})
    check(s == 200, f"weight version 2^63 - 1 is taken ({s}: {str(r)[:160]})")
    bad(fresh_url, "/update_weights_from_disk", {"model_path": ck}, field="no next one")
    bad(fresh_url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens\u0000": 2}}, field="max_new_tokens\\u0000: unknown field")

    # 7. glm5_next (sparse attention): /get_model_info reports its sparse layers and selection
    # width, and return_topk_indices (kiln's own field) answers each layer's selected positions
    g5, g5_url = check.server(kiln, "glm5_next", ["--set", "model.package=glm5_next"])
    s, info5 = http(g5_url, "/get_model_info")
    Ls, W = info5.get("num_sparse_layers", 0), info5.get("topk_width", 0)
    check(s == 200 and Ls > 0 and W > 0, f"glm5_next: /get_model_info reports sparse layers and selection width ({info5})")
    check(info["num_sparse_layers"] == 0 and info["topk_width"] == 0, "glm4_moe_lite: no sparse layers")
    s, r = gen(fresh_url, [2, 5, 6], 3, return_topk_indices=True)
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    check(s == 400 and "return_topk_indices" in msg and "no sparse-attention layers" in msg,
          f"glm4_moe_lite: return_topk_indices is refused by name, not ignored ({s}: {msg[:160]})")
    prompt5 = [2, 5, 6, 7, 8, 9, 10, 11]
    s, r = gen(g5_url, prompt5, 3, n=6, return_routed_experts=True, return_topk_indices=True)
    n5 = len(r["output_ids"]) if s == 200 else 0
    raw = base64.b64decode(r["meta_info"]["topk_indices"]) if s == 200 else b""
    rows = len(prompt5) + n5 - 1
    check(len(raw) == rows * Ls * W * 4, f"topk_indices: int32 [P + n - 1 = {rows}, {Ls}, {W}] in base64 ({len(raw)} bytes)")
    sel = struct.unpack(f"<{len(raw) // 4}i", raw)
    ok = all(-1 <= sel[(t * Ls + l) * W + w] <= t for t in range(rows) for l in range(Ls) for w in range(W))
    check(ok and any(x >= 0 for x in sel), "each row selects positions in [-1, its own position]")
    s, r = gen(g5_url, prompt5, 3, n=6)
    check(s == 200 and "topk_indices" not in r["meta_info"], "not asked: no topk_indices")
