#!/usr/bin/env python3
"""`kiln bench rollout` refuses, with exit code 2 and the option's name, an option the chosen
device would ignore (cuda-only options on --device cpu, cpu-only ones on --device cuda) and
--split-profile without --split; every refusal comes before any model is built. `kiln bench
gpu` refuses a NaN --keep-logits-gib and --activation-checkpointing-layers without
--activation-checkpointing or above --layers, before looking for a device. Also kiln's
command line: an unknown command is named, a number option's word that is no decimal number or
out of its range is refused naming the range, malformed paths, endpoints and --docs lists are
refused by name before any model is built, a malformed KILN_GROUPED_GEMM_TILES is refused before
any run directory is made, and every refusal exits 2.
Usage: check_bench_args.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import os, subprocess, sys

kiln = sys.argv[1]
work = sys.argv[2]
os.makedirs(work, exist_ok=True)
checks = []
cases = [
    (("--device", "cpu", "--split"), "--split is read with --device cuda only"),
    (("--split",), "--split is read with --device cuda only"),  # cpu is the default device
    (("--device", "cpu", "--modes", "graphs"), "--modes is read with --device cuda only"),
    (("--device", "cpu", "--layers", "4"), "--layers is read with --device cuda only"),
    (("--device", "cpu", "--contexts", "1024"), "--contexts is read with --device cuda only"),
    (("--device", "cpu", "--split-profile"), "--split-profile is read with --device cuda only"),
    (("--device", "cuda", "--flavor", "debug"), "--flavor is read with --device cpu only"),
    (("--device", "cuda", "--prompt-tokens", "64"), "--prompt-tokens is read with --device cpu only"),
    (("--device", "cuda", "--split-profile"), "--split-profile needs --split"),
]
for args, needle in cases:
    r = subprocess.run([kiln, "bench", "rollout", *args], capture_output=True, text=True, timeout=60)
    checks.append((r.returncode == 2 and needle in r.stderr,
                   f"{' '.join(args)}: exit {r.returncode}, stderr names it ({r.stderr.strip()[-160:]})"))
# kiln bench gpu: what its option parser cannot check, refused before the device is looked for.
for args, needle in [(("--keep-logits-gib", "nan"), '--keep-logits-gib: must be a number in [0, 1048576], got "nan"'),
                     (("--layers", "abc"), '--layers: must be an integer in [2, 47], got "abc"'),
                     (("--layers", "48"), '--layers: must be an integer in [2, 47], got "48"'),
                     (("--layers", "050"), '--layers: must be an integer in [2, 47], got "050"'),  # decimal, not octal 40
                     (("--layers", "0x4"), '--layers: must be an integer in [2, 47], got "0x4"'),
                     (("--keep-logits-gib", "1e-400"), '--keep-logits-gib: must be a number in [0, 1048576], got "1e-400"'),
                     (("--activation-checkpointing-layers", "2"),
                      "--activation-checkpointing-layers is read with --activation-checkpointing only"),
                     (("--layers", "4", "--activation-checkpointing", "--activation-checkpointing-layers", "5"),
                      "--activation-checkpointing-layers 5 exceeds --layers 4"),
                     (("--keep-logits-gib", "-1"), "--keep-logits-gib")]:
    r = subprocess.run([kiln, "bench", "gpu", *args], capture_output=True, text=True, timeout=60)
    checks.append((r.returncode == 2 and needle in r.stderr,
                   f"bench gpu {' '.join(args)}: exit {r.returncode} ({r.stderr.strip()[-160:]})"))
# The command line itself: an unknown command is named with the commands there are, and a value
# the option parser refuses exits 2 as well (not CLI11's own codes, 105-114).
for args, needle in [(("frobnicate",), "unknown command 'frobnicate' (commands: "),
                     (("bench", "nope"), "unknown command 'nope' (commands of bench: "),
                     (("bench", "rollout", "--batch-sizes", "0"), "--batch-sizes"),
                     (("run", "--bogus"), "--bogus"),
                     (("run", ""), "the experiment file's path is empty"),
                     (("run", "/dev/null"), "experiment file '/dev/null' is not a regular file"),
                     (("model", "logits", "--from", "/nonexistent", "--out", "x.safetensors", "--docs", "1,,2"),
                      "--docs '1,,2': id 2 of document 1 is empty"),
                     (("model", "logits", "--from", "/nonexistent", "--out", "x.safetensors", "--docs", "1;2;"),
                      "id 1 of document 3 is empty"),
                     (("model", "logits", "--from", "/nonexistent", "--out", "x.safetensors", "--docs", "1.5"),
                      "id 1 of document 1 ('1.5') is not a decimal integer"),
                     (("node", "--bind", "tcp://127.0.0.1:99999"), "PORT in [0, 65535]"),
                     (("node", "--bind", "inproc://x", "--actor", "diag/99999999999999999999"), "is not <kind>/<index>"),
                     (("serve", "--port-file", "/nonexistent-dir/p"), "is in a directory that does not exist"),
                     (("serve", "--host", ""), "--host must name an address")]:
    r = subprocess.run([kiln, *args], capture_output=True, text=True, timeout=60)
    checks.append((r.returncode == 2 and needle in r.stderr, f"kiln {' '.join(args)}: exit {r.returncode} ({r.stderr.strip()[-160:]})"))
# Paths refused before anything is written or loaded: crop's --to is not made for a --from that
# is not there; logits' --out in a missing directory is named before the model is read.
crop_to = os.path.join(work, "crop_out")
r = subprocess.run([kiln, "model", "crop", "--from", "/nonexistent", "--to", crop_to, "--layers", "1"],
                   capture_output=True, text=True, timeout=60)
checks.append((r.returncode == 2 and "--from '/nonexistent' is not a directory" in r.stderr and not os.path.exists(crop_to),
               f"model crop from a missing directory: exit {r.returncode}, --to not made ({r.stderr.strip()[-160:]})"))
r = subprocess.run([kiln, "model", "logits", "--from", "/nonexistent", "--out", "/nonexistent-dir/x.safetensors",
                    "--docs", "1,2"], capture_output=True, text=True, timeout=60)
checks.append((r.returncode == 2 and "--out '/nonexistent-dir/x.safetensors' must be a file's path" in r.stderr,
               f"model logits --out in a missing directory: exit {r.returncode} ({r.stderr.strip()[-160:]})"))
# KILN_GROUPED_GEMM_TILES is read before any work on every machine (the MoE reads it on a GPU
# only): a malformed value is refused by name, and no run directory is made.
for value, needle in [("aten,bogus,aten", 'unknown tile "bogus"'), ("aten,aten", "needs \"aten\", \"cutlass\" or three"),
                      ("aten,aten,aten,aten", "more than three tiles")]:
    out_dir = os.path.join(work, "tiles_run")
    r = subprocess.run([kiln, "run", "--set", "run.steps=1", "--set", f"run.output_dir={out_dir}"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "KILN_GROUPED_GEMM_TILES": value})
    checks.append((r.returncode == 2 and f'KILN_GROUPED_GEMM_TILES="{value}"' in r.stderr and needle in r.stderr and
                   not os.path.exists(out_dir), f"KILN_GROUPED_GEMM_TILES={value}: exit {r.returncode} ({r.stderr.strip()[-160:]})"))
failed = [m for ok, m in checks if not ok]
for ok, m in checks:
    print(("PASS " if ok else "FAIL ") + m)
print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
