#!/usr/bin/env python3
"""Encode throughput of kiln's byte-level BPE tokenizer against HF `tokenizers` (the reference
it must equal), on the same machine in the same run, on the fixture corpus
(tests/fixtures/bpe_tokenizer: 10,500 strings, a GLM-style tokenizer.json):

    python3 tests/bench/bench_tokenizer.py BUILD/tests/kiln_bench_tokenizer [--repeats 5]

Modes: "strings" encodes each string with its own call (kiln: encode(); HF: Tokenizer.encode
in a Python loop, and encode_batch, which spreads over every core with Rayon); "document"
encodes all strings joined by "\\n" in one call. Both sides' ids are hashed (FNV-1a over the
little-endian int64 ids) and must be equal before any speed is printed. Best of --repeats
after one cold pass (timed separately: an empty BPE cache).
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
import time

from tokenizers import Tokenizer

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "bpe_tokenizer")


def fnv1a(ids, h=1469598103934665603):
    for i in ids:
        for b in int(i).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def timed(fn, repeats):
    t0 = time.perf_counter()
    out = fn()
    cold = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best, cold


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_exe")
    ap.add_argument("--tokenizer", default=os.path.join(FIXTURE, "tokenizer.json"))
    ap.add_argument("--corpus", default=os.path.join(FIXTURE, "corpus.jsonl.gz"))
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    strings = [json.loads(line)["text"] for line in gzip.open(a.corpus, "rt", encoding="utf-8")]
    document = "\n".join(strings)

    kiln = {}
    out = subprocess.run([a.bench_exe, a.tokenizer, a.corpus, str(a.repeats)], check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        row = json.loads(line)
        kiln[row["mode"]] = row

    rows = []
    for mode in ("strings", "document"):
        k = kiln[mode]
        rows.append((mode, "kiln encode (1 thread)", k["bytes"], k["tokens"], k["seconds"], k["cold_seconds"], int(k["hash"])))
        hf = Tokenizer.from_file(a.tokenizer)  # fresh: an empty cache for the cold pass
        if mode == "strings":
            ids, best, cold = timed(lambda: [hf.encode(s).ids for s in strings], a.repeats)
            flat = [i for x in ids for i in x]
            rows.append((mode, "HF encode loop (1 thread)", k["bytes"], len(flat), best, cold, fnv1a(flat)))
            hf = Tokenizer.from_file(a.tokenizer)
            ids, best, cold = timed(lambda: [e.ids for e in hf.encode_batch(strings)], a.repeats)
            flat = [i for x in ids for i in x]
            rows.append((mode, f"HF encode_batch ({os.cpu_count()} cores)", k["bytes"], len(flat), best, cold, fnv1a(flat)))
        else:
            ids, best, cold = timed(lambda: hf.encode(document).ids, a.repeats)
            rows.append((mode, "HF encode (1 thread)", k["bytes"], len(ids), best, cold, fnv1a(ids)))

    for mode in ("strings", "document"):
        hashes = {r[6] for r in rows if r[0] == mode}
        if len(hashes) != 1:
            sys.exit(f"bench_tokenizer: the ids differ between kiln and HF tokenizers in mode {mode}: no speed is compared")

    import tokenizers
    print(f"tokenizer encode throughput: {len(strings)} strings, {len(document.encode())} bytes "
          f"(HF tokenizers {tokenizers.__version__}); best of {a.repeats} after a cold pass; ids equal (hash checked)")
    print(f"{'mode':<9} {'implementation':<28} {'MB/s':>8} {'Mtokens/s':>10} {'cold MB/s':>10} {'vs HF 1 thread':>15}")
    for mode in ("strings", "document"):
        base = next(r for r in rows if r[0] == mode and r[1].startswith("HF encode") and "batch" not in r[1])
        for r in rows:
            if r[0] != mode:
                continue
            _, name, nbytes, ntok, best, cold, _ = r
            print(f"{mode:<9} {name:<28} {nbytes / best / 1e6:8.2f} {ntok / best / 1e6:10.3f} {nbytes / cold / 1e6:10.2f} "
                  f"{base[4] / best:14.2f}x")


if __name__ == "__main__":
    main()
