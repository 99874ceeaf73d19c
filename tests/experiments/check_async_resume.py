#!/usr/bin/env python3
"""Lossless asynchronous resume: with staleness k = 2, run A (16 steps, a checkpoint at step
12) keeps in its checkpoint the rollouts already generated for steps 13-14
(in_flight_rollouts.msgpack); run B resumes from it and trains on exactly those batches, so
its steps 13-14 give the same metrics as A's, bit for bit (in one process, and with the
trainer in its own node process: the file travels in trainer.save). Without the file (removed
from a copy) the same resume generates steps 13-14 again with newer weights, and they differ:
the file is what makes the resume lossless. A truncated, emptied, missing or garbage file is
refused by name; a failure right after the resume leaves the checkpoint resumed from as it was
and names it; a k = 0 checkpoint has no such file.
Usage: check_async_resume.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, shutil, subprocess, sys

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
common = ["--set", "run.steps=16", "--set", "logging.plot=false", "--set", "logging.progress=false",
          "--set", "algorithm.staleness=2"]
KEYS = ("reward_mean", "loss", "kl", "grad_norm", "entropy", "trained_samples", "staleness_histogram", "policy_version")
checks = []

def metrics(d):
    return {m["step"]: m for m in (json.loads(l) for l in open(f"{d}/metrics.jsonl"))}

def kiln_run(*args):
    return subprocess.run([kiln, "run", *common, *args], capture_output=True, text=True, timeout=900)

trainer_process = ["--set", "placement.mode=multi_process", "--set", "placement.reference=process",
                   "--set", "placement.trainer=process", "--set", "algorithm.kl_coef=0.05"]
for mode, extra in (("one process", []), ("trainer node", trainer_process)):
    tag = mode.replace(" ", "_")
    a = kiln_run(*extra, "--set", f"run.output_dir={work}/{tag}_a", "--set", "run.checkpoint_every=12")
    checks.append((a.returncode == 0, f"{mode}: run A exits 0 ({a.stderr[-300:]})"))
    if a.returncode != 0:
        continue
    ck = f"{work}/{tag}_a/checkpoints/step_000012"
    checks.append((os.path.exists(f"{ck}/in_flight_rollouts.msgpack"), f"{mode}: the step-12 checkpoint holds the rollouts in flight"))
    b = kiln_run(*extra, "--set", f"run.output_dir={work}/{tag}_b", "--set", f"run.resume_from={ck}")
    checks.append((b.returncode == 0, f"{mode}: run B (resumed) exits 0 ({b.stderr[-300:]})"))
    checks.append(("2 batches of rollouts in flight restored (steps 13..14)" in b.stderr,
                   f"{mode}: B says it restored the batches of steps 13-14"))
    if b.returncode != 0:
        continue
    ma, mb = metrics(f"{work}/{tag}_a"), metrics(f"{work}/{tag}_b")
    checks.append((sorted(mb) == list(range(13, 17)), f"{mode}: B logs steps 13-16 once each ({sorted(mb)})"))
    checks.append((any(ma[s]["loss"] != 0 for s in (13, 14)), f"{mode}: A trains at steps 13-14 (a nonzero loss)"))
    for s in (13, 14):
        for k in KEYS:
            checks.append((ma[s][k] == mb[s][k], f"{mode}: step {s} {k}: resumed {mb[s][k]} == uninterrupted {ma[s][k]}"))
    later = [s for s in (15, 16) if all(ma[s][k] == mb[s][k] for k in KEYS)]
    print(f"{mode}: steps 15-16 (generated after the resume, new weights arriving mid-generation as timing allows) "
          f"equal to A's: {later}")
    if mode == "one process":
        # the counterfactual: the same resume without the file
        shutil.copytree(ck, f"{work}/no_in_flight")
        os.remove(f"{work}/no_in_flight/in_flight_rollouts.msgpack")
        state = json.load(open(f"{work}/no_in_flight/state.json"))
        del state["in_flight_rollouts_bytes"]  # as a checkpoint without them says
        json.dump(state, open(f"{work}/no_in_flight/state.json", "w"))
        c = kiln_run("--set", f"run.output_dir={work}/{tag}_c", "--set", f"run.resume_from={work}/no_in_flight")
        checks.append((c.returncode == 0, f"{mode}: resume without the file exits 0 ({c.stderr[-300:]})"))
        if c.returncode == 0:
            mc = metrics(f"{work}/{tag}_c")
            checks.append((any(ma[s][k] != mc[s][k] for s in (13, 14) for k in KEYS),
                           f"{mode}: without the file, steps 13-14 are generated again and differ from A's"))
        # a truncated, an emptied and a missing file: refused by name (state.json lists the
        # file's size), nothing of the run directory touched; garbage of the right size too
        path_ok = f"{ck}/in_flight_rollouts.msgpack"
        data = open(path_ok, "rb").read()
        for case, content, expect in (("truncated", data[: len(data) // 2], "holds"), ("emptied", b"", "holds"),
                                      ("missing", None, "is missing"),
                                      ("garbage", bytes([0xc1]) * len(data), "not a readable")):
            shutil.copytree(ck, f"{work}/{case}")
            path = f"{work}/{case}/in_flight_rollouts.msgpack"
            if content is None:
                os.remove(path)
            else:
                open(path, "wb").write(content)
            t = kiln_run("--set", f"run.output_dir={work}/{tag}_{case}", "--set", f"run.resume_from={work}/{case}")
            checks.append((t.returncode == 2 and "in_flight_rollouts.msgpack" in t.stderr and expect in t.stderr,
                           f"{mode}: a {case} in-flight file is refused by name ({t.stderr.strip()[-300:]})"))
            checks.append((not os.path.exists(f"{work}/{tag}_{case}/metrics.jsonl"),
                           f"{mode}: the refused resume ({case}) wrote no metrics"))
        # restored behaviour log-probs made NaN: refused by file, step and completion at the resume
        shutil.copytree(ck, f"{work}/nan_in_flight")
        path = f"{work}/nan_in_flight/in_flight_rollouts.msgpack"
        raw = bytearray(open(path, "rb").read())
        at = raw.find(b"logprobs")
        while at >= 0:  # the first float32 (0xca) of every logprobs array -> NaN, same size
            f32 = raw.find(b"\xca", at)
            raw[f32 + 1:f32 + 5] = b"\x7f\xc0\x00\x00"
            at = raw.find(b"logprobs", f32)
        open(path, "wb").write(raw)
        n = kiln_run("--set", f"run.output_dir={work}/{tag}_nan_run", "--set", f"run.resume_from={work}/nan_in_flight")
        checks.append((n.returncode == 2 and "in_flight_rollouts.msgpack: step" in n.stderr
                       and "is not a log-probability" in n.stderr,
                       f"{mode}: NaN log-probs in flight are refused at the resume by name ({n.stderr.strip()[-300:]})"))
        shutil.rmtree(f"{work}/nan_in_flight")
        # a failure at the first step after the resume (here: an update of lr 1e300 overflows, the
        # weight sync refuses the non-finite policy and no checkpoint of it is written) names the
        # checkpoint resumed from and leaves it as it was, rollouts in flight included (it used to
        # be written again without them)
        shutil.copytree(ck, f"{work}/kept")
        before = {f: open(f"{work}/kept/{f}", "rb").read() for f in os.listdir(f"{work}/kept")}
        k = kiln_run("--set", f"run.output_dir={work}/kept_run", "--set", f"run.resume_from={work}/kept",
                     "--set", "algorithm.lr=1e300")
        after = {f: open(f"{work}/kept/{f}", "rb").read() for f in os.listdir(f"{work}/kept")}
        checks.append((k.returncode == 1 and f"run.resume_from={work}/kept" in k.stderr,
                       f"{mode}: a failure right after the resume names the checkpoint it resumed from ({k.stderr.strip()[-300:]})"))
        checks.append((before == after, f"{mode}: that checkpoint is left as it was"))

sync = kiln_run("--set", "algorithm.staleness=0", "--set", "run.steps=4", "--set", "run.checkpoint_every=2",
                "--set", f"run.output_dir={work}/sync")
checks.append((sync.returncode == 0 and not os.path.exists(f"{work}/sync/checkpoints/step_000002/in_flight_rollouts.msgpack"),
               "k = 0: a checkpoint holds no rollouts in flight"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
