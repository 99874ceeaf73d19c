#!/usr/bin/env python3
"""The HF export of a sharded trainer loads in transformers with kiln's logits (issue 12).

Starts from the transformers-made fixture tests/fixtures/glm4_moe_lite_tiny (8 routed experts,
top-2, a dense first layer, q_lora; fp32, CPU) and trains 2 RL steps with `kiln run` at each mesh
below, checkpointing at step 2, with a learning rate that moves the weights:
- ep 2 (two ranks over Gloo: each writes model-0000k-of-00002.safetensors with its own experts
  under their global HF names, rank 0 the index);
- dp 2 x ep 2 (four ranks: the ep ranks of replica 0 write, the others write nothing of the policy);
- dp 2 (the replicated trainer: rank 0 writes the policy whole, as one shard).
Every group is trained (filter_zero_variance off; the tiny model's rewards are mostly equal) with
weight decay, so that the weights move whatever the rewards. For each checkpoint:
- the policy files are what the mesh writes (model-0000k-of-0000P.safetensors with
  model.safetensors.index.json mapping tensors to each of them);
- the weights moved from the fixture's (the export is the trained policy, not the start);
- `kiln model logits` on it and transformers' Glm4MoeLiteForCausalLM.from_pretrained on it
  (tests/fixtures/make_glm4_moe_lite_fixture.py --compare-kiln, fp32, eager attention) give the
  same logits (max |diff| <= 1e-4) and the same routed experts for three documents.
Skipped (prints KILN_TEST_SKIPPED) when the Python given has no transformers with Glm4MoeLite.
Usage: check_hf_export.py PATH_TO_KILN WORK_DIR PYTHON (KILN_TEST_TRANSFORMERS_PYTHON overrides
PYTHON). Prints "N passed, M failed"."""
import glob, json, os, re, shutil, subprocess, sys

kiln, work = os.path.abspath(sys.argv[1]), sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_runs import clean_env, transformers_python  # noqa: E402

py = transformers_python(sys.argv[3])
fixture = os.path.join(root, "tests", "fixtures", "glm4_moe_lite_tiny")
compare = os.path.join(root, "tests", "fixtures", "make_glm4_moe_lite_fixture.py")
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = clean_env()
checks = []
DOCS = "5,17,42,8,91,3,64;11,2,77,30,29;60,61,7,13,88,45,12,9,70,33,21"  # the fixture script's documents

# The largest change of any tensor between two checkpoints' policy files (read in the Python
# given, which has safetensors with transformers).
WEIGHT_CHANGE = r"""
import glob, sys
from safetensors.torch import load_file
def load(d):
    out = {}
    for f in sorted(glob.glob(d + "/model*.safetensors")):
        out.update(load_file(f))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
print(len(a), len(b), sorted(set(a) ^ set(b))[:3], max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b))
"""

for tag, mesh, shards in (("ep 2", ["--set", "parallel.ep=2"], 2),
                          ("dp 2 x ep 2", ["--set", "parallel.dp=2", "--set", "parallel.ep=2"], 2),
                          ("dp 2", ["--set", "parallel.dp=2"], 1)):
    out = os.path.join(work, re.sub(r"\W+", "_", tag))
    run = subprocess.run([kiln, "run", "--set", f"model.checkpoint={fixture}", *mesh, "--set", "run.steps=2",
                          "--set", "run.checkpoint_every=2", "--set", "algorithm.lr=0.01",
                          "--set", "algorithm.weight_decay=0.1", "--set", "algorithm.filter_zero_variance=false",
                          "--set", "algorithm.prompts_per_step=4", "--set", "algorithm.samples_per_prompt=4",
                          "--set", f"run.output_dir={out}", "--set", "logging.progress=false"],
                         capture_output=True, text=True, timeout=600, env=env)
    checks.append((run.returncode == 0, f"{tag}: kiln run exits 0 ({run.returncode}: {run.stderr[-600:]})"))
    if run.returncode != 0:
        continue
    ckpt = os.path.join(out, "checkpoints", "step_000002")
    files = sorted(os.path.basename(f) for f in glob.glob(f"{ckpt}/model*.safetensors"))
    want = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    checks.append((files == want, f"{tag}: the policy files are {want} ({files})"))
    index = json.load(open(f"{ckpt}/model.safetensors.index.json"))
    owners = set(index["weight_map"].values())
    checks.append((owners == set(want), f"{tag}: the index maps tensors to every shard ({sorted(owners)})"))
    moved = subprocess.run([py, "-c", WEIGHT_CHANGE, ckpt, fixture], capture_output=True, text=True, timeout=300)
    words = moved.stdout.split()
    change = float(words[-1]) if moved.returncode == 0 and words else -1.0
    checks.append((moved.returncode == 0 and words[0] == words[1] and "[]" in moved.stdout and change > 1e-4,
                   f"{tag}: the export holds the fixture's tensors, trained (largest change {change}; "
                   f"{moved.stdout.strip()} {moved.stderr[-300:]})"))
    logits = os.path.join(out, "kiln_logits.safetensors")
    lg = subprocess.run([kiln, "model", "logits", "--from", ckpt, "--docs", DOCS, "--out", logits],
                        capture_output=True, text=True, timeout=300, env=env)
    checks.append((lg.returncode == 0, f"{tag}: kiln model logits exits 0 ({lg.returncode}: {lg.stderr[-300:]})"))
    if lg.returncode != 0:
        continue
    tf = subprocess.run([py, compare, "--compare-kiln", ckpt, logits], capture_output=True, text=True, timeout=600,
                        env=env)
    said = [l for l in tf.stdout.splitlines() if l.startswith("transformers on")]
    checks.append((tf.returncode == 0 and said and "routed experts identical: True" in said[-1],
                   f"{tag}: transformers loads the export with kiln's logits and experts "
                   f"({said[-1] if said else tf.stderr[-600:]})"))
    if said:
        print(f"{tag}: {said[-1]}")

failed = [what for ok, what in checks if not ok]
for what in failed:
    print("FAILED:", what)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
