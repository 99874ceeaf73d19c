#!/usr/bin/env python3
"""What issue 17 asks of a one-node GLM-4.7-Flash run, read from its run directory.

    python3 experiments/summarize_node_run.py RUN_DIR

RUN_DIR is what kiln run wrote (experiments/run_node.sh runs it): metrics.jsonl, config.toml and,
on a GPU machine, gpu_memory.csv (nvidia-smi samples: timestamp, GPU index, MiB used). Prints
Markdown for docs/benchmarks.md:
- the run: layers (from the checkpoint's config.json), trainer ranks, steps;
- one row per step: the time split (rollout, reference log-probs, old log-probs, train, weight
  sync; seconds, as metrics.jsonl logs them), the step's wall time (elapsed_s difference), train
  tokens/s for the whole node (every rank's tokens over the train time), the mean train/rollout
  log-prob abs diff;
- the same means over the steps after the first (the first pays for first-touch allocations and
  kernel selection), or over every step when there is one;
- peak memory of each trainer rank (the largest peak_memory_gib_rank_R over the steps: CUDA
  allocator peak, or peak RSS on CPU) and of each GPU (the largest nvidia-smi sample: every
  process on it, the allocator's cache and NCCL buffers included).
Exits 1 naming what is missing when RUN_DIR has no metrics.
"""
import json
import os
import re
import sys

SPLIT = [("rollout_time", "rollout"), ("ref_logprob_time", "ref log-probs"), ("log_probs_time", "old log-probs"),
         ("actor_train_time", "train"), ("update_weights_time", "weight sync")]


def toml_value(text, section, key):
    """A scalar of kiln's own config.toml (one `key = value` per line under `[section]`)."""
    current = None
    for line in text.splitlines():
        m = re.match(r"\[(\w+)\]", line.strip())
        if m:
            current = m.group(1)
        elif current == section and line.split("=", 1)[0].strip() == key:
            return line.split("=", 1)[1].strip().strip('"')
    return None


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    run = sys.argv[1]
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"summarize_node_run: no metrics.jsonl in {run}", file=sys.stderr)
        return 1
    rows = [json.loads(l) for l in open(path) if l.strip()]
    if not rows:
        print(f"summarize_node_run: {path} holds no step", file=sys.stderr)
        return 1
    config = open(os.path.join(run, "config.toml")).read() if os.path.exists(os.path.join(run, "config.toml")) else ""
    ckpt = toml_value(config, "model", "checkpoint") or ""
    layers = "?"
    if ckpt and os.path.exists(os.path.join(ckpt, "config.json")):
        layers = json.load(open(os.path.join(ckpt, "config.json"))).get("num_hidden_layers", "?")
    ep, dp = toml_value(config, "parallel", "ep") or "1", toml_value(config, "parallel", "dp") or "1"
    print(f"run {run}: {layers} layers, trainer dp {dp} x ep {ep}, device {toml_value(config, 'model', 'device')} "
          f"{toml_value(config, 'model', 'dtype')}, {len(rows)} steps, checkpoint {ckpt}")
    print()
    head = ["step"] + [name for _, name in SPLIT] + ["step wall s", "train tokens/s (node)", "train/rollout logprob abs diff"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    walls, prev = [], 0.0
    for r in rows:
        walls.append(r["elapsed_s"] - prev)
        prev = r["elapsed_s"]
        cells = [str(r["step"])] + [f"{r[k]:.3f}" for k, _ in SPLIT] + [
            f"{walls[-1]:.2f}", f"{r['train_tokens_per_s']:.0f}", f"{r['train/rollout logprob abs diff']:.2e}"]
        print("| " + " | ".join(cells) + " |")
    later = list(range(1, len(rows))) if len(rows) > 1 else [0]
    which = f"steps {rows[later[0]]['step']}-{rows[later[-1]]['step']}"
    cells = [f"mean, {which}"] + [f"{mean([rows[i][k] for i in later]):.3f}" for k, _ in SPLIT] + [
        f"{mean([walls[i] for i in later]):.2f}", f"{mean([rows[i]['train_tokens_per_s'] for i in later]):.0f}",
        f"{mean([rows[i]['train/rollout logprob abs diff'] for i in later]):.2e}"]
    print("| " + " | ".join(cells) + " |")
    print()
    ranks = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("peak_memory_gib_rank_")})
    if ranks:
        peaks = [max(r.get(f"peak_memory_gib_rank_{i}", 0.0) for r in rows) for i in ranks]
        print("peak memory per trainer rank (GiB, allocator peak on CUDA, peak RSS on CPU): " +
              ", ".join(f"rank {i} {p:.1f}" for i, p in zip(ranks, peaks)))
    else:
        print("peak memory per trainer rank: not in metrics.jsonl (a kiln older than peak_memory_gib_rank_R)")
    gpu_csv = os.path.join(run, "gpu_memory.csv")
    if os.path.exists(gpu_csv):
        used = {}
        for line in open(gpu_csv):
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                used[int(parts[1])] = max(used.get(int(parts[1]), 0), int(parts[2]))
        print("peak memory per GPU (GiB, nvidia-smi every 0.5 s, all processes): " +
              ", ".join(f"GPU {g} {mib / 1024:.1f}" for g, mib in sorted(used.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
