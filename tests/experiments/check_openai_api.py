#!/usr/bin/env python3
"""`kiln serve`'s OpenAI-compatible endpoints answer the real `openai` client (PyPI, in kiln's
venv): /v1/completions and /v1/chat/completions (GLM-4.7's chat template over the fixture
tokenizer.json, on a tiny checkpoint whose vocabulary fits it), whole and streamed (the streamed
pieces join to the whole answer for the same seed), /v1/models; bad input (unknown fields,
non-finite or out-of-range values, over-long prompts, bad roles, a chat without a template) gets
a 400 naming the field, and the server goes on serving.
Usage: check_openai_api.py PATH_TO_KILN WORK_DIR (with the venv's python). Prints "N passed, M failed"."""
import os, sys

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import Checks, http, stop_server
from tiny_vocab import write_tiny_vocab2048

kiln, work = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def refused(client, what, field, call):
    try:
        call(client)
        check(False, f"{what}: refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and field in str(e), f"{what}: 400 naming '{field}' ({str(e)[:200]})")


with Checks(work) as check:
    proc, url = check.server(kiln, "plain")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    models = client.models.list()
    check(len(models.data) == 1 and models.data[0].id, f"/v1/models lists the model ({models.data})")
    whole = client.completions.create(model="kiln", prompt="1+2=", max_tokens=6, seed=3)
    c = whole.choices[0]
    check(isinstance(c.text, str) and c.finish_reason in ("stop", "length") and whole.usage.prompt_tokens == 4
          and 1 <= whole.usage.completion_tokens <= 6, f"/v1/completions: {whole}")
    pieces, reasons = [], []
    for chunk in client.completions.create(model="kiln", prompt="1+2=", max_tokens=6, seed=3, stream=True):
        for ch in chunk.choices:
            pieces.append(ch.text)
            reasons.append(ch.finish_reason)
    check("".join(pieces) == c.text and reasons[-1] == c.finish_reason,
          f"streamed completion joins to the whole one ({pieces} vs {c.text!r}, {reasons})")
    lp = client.completions.create(model="kiln", prompt=[2, 5, 6], max_tokens=4, seed=3, logprobs=0)
    check(len(lp.choices[0].logprobs.token_logprobs) == lp.usage.completion_tokens
          and all(x <= 0 for x in lp.choices[0].logprobs.token_logprobs), "logprobs=0: the sampled tokens' log-probs")
    refused(client, "a chat without a chat template", "chat template",
            lambda cl: cl.chat.completions.create(model="kiln", messages=[{"role": "user", "content": "hi"}]))
    refused(client, "an unknown field", "bogus",
            lambda cl: cl.completions.create(model="kiln", prompt="1", extra_body={"bogus": 1}))
    refused(client, "temperature -1", "temperature", lambda cl: cl.completions.create(model="kiln", prompt="1", temperature=-1))
    # NaN and Infinity are not JSON (the openai client refuses to send them): sent as raw bytes
    s, r = http(url, "/v1/completions", raw=b'{"model": "kiln", "prompt": "1", "temperature": NaN}')
    check(s == 400 and "not valid JSON" in r["error"]["message"], f"temperature NaN: 400, not JSON ({s}: {r})")
    s, r = http(url, "/v1/chat/completions", raw=b'{"model": "kiln", "messages": [], "top_p": Infinity}')
    check(s == 400 and "not valid JSON" in r["error"]["message"], f"top_p Infinity: 400, not JSON ({s}: {r})")
    refused(client, "top_p 2", "top_p", lambda cl: cl.completions.create(model="kiln", prompt="1", top_p=2))
    refused(client, "max_tokens 0", "max_tokens", lambda cl: cl.completions.create(model="kiln", prompt="1", max_tokens=0))
    refused(client, "an over-long prompt", "context",
            lambda cl: cl.completions.create(model="kiln", prompt=[1] * 20000, max_tokens=4))
    # prompt + max_tokens past int64 once passed the check and crashed the server (no cache pages)
    refused(client, "max_tokens near 2^63", "context",
            lambda cl: cl.completions.create(model="kiln", prompt=[1, 2, 3], max_tokens=2**63 - 2))
    refused(client, "a token id outside the vocabulary", "prompt[1]",
            lambda cl: cl.completions.create(model="kiln", prompt=[1, 100000], max_tokens=4))
    refused(client, "logprobs 5", "logprobs", lambda cl: cl.completions.create(model="kiln", prompt="1", logprobs=5))
    again = client.completions.create(model="kiln", prompt="1+2=", max_tokens=6, seed=3)
    check(again.choices[0].text == c.text, "after the refusals the server answers as before")
    stop_server(proc)

    ckpt = os.path.join(work, "tiny_vocab2048")
    write_tiny_vocab2048(root, ckpt)
    tokenizer = os.path.join(root, "tests/fixtures/bpe_tokenizer/tokenizer.json")
    proc, url = check.server(kiln, "chat", ["--set", f"model.checkpoint={ckpt}", "--set", f"task.tokenizer={tokenizer}",
                                                  "--set", "task.chat_template=glm47"])
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}]
    whole = client.chat.completions.create(model="kiln", messages=messages, max_tokens=12, seed=5)
    m = whole.choices[0]
    check(m.message.role == "assistant" and isinstance(m.message.content, str) and whole.usage.prompt_tokens > 10
          and whole.object == "chat.completion", f"/v1/chat/completions: {whole}")
    pieces, reasons, roles = [], [], []
    for chunk in client.chat.completions.create(model="kiln", messages=messages, max_tokens=12, seed=5, stream=True,
                                                stream_options={"include_usage": True}):
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            roles.append(ch.delta.role)
            reasons.append(ch.finish_reason)
        if chunk.usage:
            check(chunk.usage.completion_tokens == whole.usage.completion_tokens, f"streamed usage {chunk.usage}")
    check("".join(pieces) == m.message.content and reasons[-1] == m.finish_reason and roles[0] == "assistant",
          f"streamed chat joins to the whole answer ({pieces} vs {m.message.content!r})")
    refused(client, "a bad role", "messages[0].role",
            lambda cl: cl.chat.completions.create(model="kiln", messages=[{"role": "robot", "content": "x"}]))
    refused(client, "no messages", "messages", lambda cl: cl.chat.completions.create(model="kiln", messages=[]))
    refused(client, "frequency_penalty", "frequency_penalty",
            lambda cl: cl.chat.completions.create(model="kiln", messages=messages, frequency_penalty=1.0))
    # 70000 levels of nesting as a message's content (a copy of it overran the server's stack).
    deep = b"[" * 70000 + b"]" * 70000
    s, r = http(url, "/v1/chat/completions", raw=b'{"model": "kiln", "messages": [{"role": "user", "content": ' + deep + b'}]}')
    check(s == 400 and "content" in str(r), f"a deeply nested content: 400 naming it ({s}: {str(r)[:160]})")
    for kind in (5, None, ["text"]):  # a library type error (500) once
        refused(client, f"a content part of type {kind!r}", "messages[0].content[0]",
                lambda cl: cl.chat.completions.create(
                    model="kiln", messages=[{"role": "user", "content": [{"type": kind, "text": "x"}]}]))
    refused(client, "a name that is not a string", "messages[0].name",
            lambda cl: cl.chat.completions.create(model="kiln", messages=[{"role": "user", "content": "x", "name": [1]}]))
    refused(client, "stream_options without stream", "stream_options",
            lambda cl: cl.chat.completions.create(model="kiln", messages=messages, stream_options={"include_usage": True}))
    refused(client, "max_tokens and max_completion_tokens that disagree", "max_completion_tokens",
            lambda cl: cl.chat.completions.create(model="kiln", messages=messages, max_tokens=12, max_completion_tokens=3))
    same = client.chat.completions.create(model="kiln", messages=messages, max_tokens=12, max_completion_tokens=12, seed=5)
    check(same.choices[0].message.content == m.message.content, "the two bounds with the same value answer as one")
    again = client.chat.completions.create(model="kiln", messages=messages, max_tokens=12, seed=5)
    check(again.choices[0].message.content == m.message.content, "after the refusals the chat answers as before")
