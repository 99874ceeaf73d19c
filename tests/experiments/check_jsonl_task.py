#!/usr/bin/env python3
"""JSONL word-problem tasks end to end: the example experiment (experiments/gsm8k_style.toml:
character tokenizer, debug model) runs 2 steps; the same dataset with the fixture's
tokenizer.json and GLM-4.7's chat template runs 2 steps on a tiny checkpoint whose vocabulary
fits that tokenizer (tests/fixtures/glm4_moe_lite_tiny with its embedding and output rows grown
to 2048, written here); bad datasets and settings are refused at start, naming the key, the
file and the line, with the run directory left untouched.
Usage: check_jsonl_task.py PATH_TO_KILN WORK_DIR (run from anywhere). Prints "N passed, M failed"."""
import json, os, shutil, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_vocab import write_tiny_vocab2048

kiln, work = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
dataset = os.path.join(root, "experiments/data/gsm8k_style.jsonl")
tokenizer = os.path.join(root, "tests/fixtures/bpe_tokenizer/tokenizer.json")
quiet = ["--set", "logging.plot=false", "--set", "logging.progress=false"]


def run(*args):
    return subprocess.run([kiln, "run", *args, *quiet], capture_output=True, text=True, timeout=600, cwd=root)


# A tiny checkpoint with a vocabulary of 2048 (the fixture tokenizer has 2005 ids): the
# transformers-made fixture, its embedding and lm_head rows 96.. drawn from N(0, 0.02).
ckpt = os.path.join(work, "tiny_vocab2048")
write_tiny_vocab2048(root, ckpt)

checks = []


def rows(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


# The example experiment, shortened to 2 steps.
ex = run(os.path.join(root, "experiments/gsm8k_style.toml"), "--set", "run.steps=2", "--set", f"run.output_dir={work}/example")
checks.append((ex.returncode == 0, f"the example experiment runs 2 steps (exit {ex.returncode}: {ex.stderr[-400:]})"))
if ex.returncode == 0:
    r = rows(f"{work}/example")
    checks.append(([x["step"] for x in r] == [1, 2], f"2 metric rows ({[x['step'] for x in r]})"))
    checks.append((all(0 <= x["reward_mean"] <= 1 for x in r), "rewards in [0, 1]"))
    toml = open(f"{work}/example/config.toml").read()
    checks.append(('name = "jsonl"' in toml and 'path = "experiments/data/gsm8k_style.jsonl"' in toml
                   and 'prompt_field = "question"' in toml, "config.toml keeps the task's keys"))

# The fixture's tokenizer.json with GLM-4.7's chat template, on the 2048-id checkpoint.
bpe_args = ["--set", "task.name=jsonl", "--set", f"task.path={dataset}", "--set", f"task.tokenizer={tokenizer}",
            "--set", "task.chat_template=glm47", "--set", "run.steps=2", "--set", "algorithm.prompts_per_step=4",
            "--set", "algorithm.samples_per_prompt=4", "--set", "algorithm.max_new_tokens=12"]
bpe = run(*bpe_args, "--set", f"model.checkpoint={ckpt}", "--set", f"run.output_dir={work}/bpe")
checks.append((bpe.returncode == 0, f"a BPE tokenizer.json with the glm47 chat template runs 2 steps (exit {bpe.returncode}: {bpe.stderr[-400:]})"))
if bpe.returncode == 0:
    r = rows(f"{work}/bpe")
    checks.append(([x["step"] for x in r] == [1, 2], f"2 metric rows ({[x['step'] for x in r]})"))
    checks.append((all(0 <= x["reward_mean"] <= 1 for x in r), "rewards in [0, 1]"))

# Refusals: exit 2 at start, the message naming what is wrong, nothing written.
def refused(name, args, *needles):
    out = f"{work}/refused_{name}"
    p = run(*args, "--set", f"run.output_dir={out}")
    ok = p.returncode == 2 and all(n in p.stderr for n in needles) and not os.path.exists(f"{out}/metrics.jsonl")
    checks.append((ok, f"{name}: refused with {needles} (exit {p.returncode}: {p.stderr.strip()[-300:]})"))


def dataset_file(name, text):
    path = os.path.join(work, name)
    open(path, "w").write(text)
    return path


good = '{"question": "What is 2 + 2?", "answer": "#### 4"}\n'
jsonl = ["--set", "task.name=jsonl"]
bad_line = dataset_file("bad_line.jsonl", good + '{"prompt": "What is 3 + 3?", "answer": "#### 6"}\n')
refused("missing field", [*jsonl, "--set", f"task.path={bad_line}"], f"task.path: dataset '{bad_line}' line 2: field 'question' is missing")
not_json = dataset_file("not_json.jsonl", good + good + "{oops\n")
refused("invalid JSON", [*jsonl, "--set", f"task.path={not_json}"], f"dataset '{not_json}' line 3: invalid JSON")
number = dataset_file("number.jsonl", '{"question": "Two plus two?", "answer": 4}\n')
refused("non-string answer", [*jsonl, "--set", f"task.path={number}"], "line 1: field 'answer' must be a string")
empty_prompt = dataset_file("empty_prompt.jsonl", '{"question": "", "answer": "#### 4"}\n')
refused("empty prompt", [*jsonl, "--set", f"task.path={empty_prompt}"], "line 1: field 'question' is empty")
empty = dataset_file("empty.jsonl", "")
refused("empty file", [*jsonl, "--set", f"task.path={empty}"], f"dataset '{empty}': holds no records")
refused("missing file", [*jsonl, "--set", f"task.path={work}/nowhere.jsonl"], "nowhere.jsonl': cannot open")
refused("no path", jsonl, "key 'task.path'")
os.makedirs(f"{work}/a_directory.jsonl", exist_ok=True)
refused("a directory", [*jsonl, "--set", f"task.path={work}/a_directory.jsonl"], "a_directory.jsonl': is a directory")
long_prompt = dataset_file("long_prompt.jsonl", good + '{"question": "' + "1 + " * 5000 + '1?", "answer": "#### 5001"}\n')
refused("prompt longer than the cache", [*jsonl, "--set", f"task.path={long_prompt}", "--set", "rollout.cache_blocks=64"],
        "line 2: the prompt is", "does not fit the engine's cache of 1024 tokens")
refused("prompt field", [*jsonl, "--set", f"task.path={dataset}", "--set", "task.prompt_field=problem"],
        "line 1: field 'problem' is missing")
unicode = dataset_file("unicode.jsonl", good + '{"question": "Caf\\u00e9: 2 + 2?", "answer": "#### 4"}\n')
refused("character tokenizer, non-ASCII", [*jsonl, "--set", f"task.path={unicode}"], "line 2: byte 0xC3", "task.tokenizer")
refused("chat template without tokenizer", [*jsonl, "--set", f"task.path={dataset}", "--set", "task.chat_template=glm47"],
        "key 'task.chat_template'", "needs task.tokenizer")
refused("unknown chat template", [*jsonl, "--set", f"task.path={dataset}", "--set", "task.chat_template=chatml"],
        "key 'task.chat_template'")
refused("tokenizer larger than the model", [*jsonl, "--set", f"task.path={dataset}", "--set", f"task.tokenizer={tokenizer}"],
        f"task.tokenizer '{tokenizer}' (2005 ids) does not fit the model's (96 ids, model.flavor 'debug')")
refused("tokenizer missing", [*jsonl, "--set", f"task.path={dataset}", "--set", f"task.tokenizer={work}/none.json"],
        f"task.tokenizer '{work}/none.json'")
refused("path with a built-in task", ["--set", f"task.path={dataset}"], "key 'task.path'", "task.name \"jsonl\" only")

for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
