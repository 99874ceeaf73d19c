#!/usr/bin/env python3
"""`kiln model` commands: resave gives a checkpoint whose logits (kiln model logits) are the
original's bit for bit; crop cuts the GLM-5.3-Flash fixture to fewer layers, tensors bit for
bit; bad input is refused with exit code 2.
Usage: check_model_cmd.py PATH_TO_KILN WORK_DIR. Prints "N passed, M failed"."""
import json, os, resource, shutil, struct, subprocess, sys

kiln, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "glm4_moe_lite_tiny")
docs = "5,17,42,8,91,3,64;11,2,77,30,29"
checks = []

def run(*args):
    return subprocess.run([kiln, "model", *args], capture_output=True, text=True, timeout=300)

def tensor_bytes(path, name):  # safetensors: u64 header length, JSON header, data
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    b, e = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return raw[8 + n + b:8 + n + e]

r = run("resave", "--from", fixture, "--to", f"{work}/resaved", "--shard-mib", "1")
checks.append((r.returncode == 0, f"resave exits 0 ({r.stderr[-200:]})"))
a = run("logits", "--from", fixture, "--docs", docs, "--out", f"{work}/a.safetensors")
b = run("logits", "--from", f"{work}/resaved", "--docs", docs, "--out", f"{work}/b.safetensors")
checks.append((a.returncode == 0 and b.returncode == 0, "logits exits 0 on both checkpoints"))
if a.returncode == 0 and b.returncode == 0:
    for name in ("logits", "routed_experts"):
        checks.append((tensor_bytes(f"{work}/a.safetensors", name) == tensor_bytes(f"{work}/b.safetensors", name),
                       f"{name} of the resaved checkpoint equal the original's bit for bit"))
glm5 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "glm5_next_tiny")
r = run("crop", "--from", glm5, "--to", f"{work}/cropped", "--layers", "2", "--shard-mib", "1")
checks.append((r.returncode == 0 and "2 layers kept" in r.stdout, f"crop exits 0 ({r.stdout.strip()[-120:]}{r.stderr[-200:]})"))
if r.returncode == 0:
    text = json.load(open(f"{work}/cropped/config.json"))["text_config"]
    checks.append((text["num_hidden_layers"] == 2 and len(text["layer_types"]) == 2, "crop: config.json has 2 layers"))
    index = json.load(open(f"{work}/cropped/model.safetensors.index.json"))["weight_map"]
    src = json.load(open(f"{glm5}/model.safetensors.index.json"))["weight_map"]
    kept = [k for k in src if ".layers.2." not in k and ".layers.3." not in k]
    checks.append((sorted(index) == sorted(kept), "crop: layers 2 and 3 dropped, every other tensor kept"))
    name = "model.language_model.layers.1.self_attn.kv_b_proj.weight"
    checks.append((tensor_bytes(f"{work}/cropped/{index[name]}", name) == tensor_bytes(f"{glm5}/{src[name]}", name),
                   "crop: a kept tensor is bit for bit the source's"))
# A checkpoint with NaN and infinity in one weight (its first 3 elements, fp32): refused
# by name, not loaded into a model whose every logit it would turn into NaN.
def poisoned_copy(src, dst, name):
    shutil.copytree(src, dst)
    where = json.load(open(f"{dst}/model.safetensors.index.json"))["weight_map"][name]
    with open(f"{dst}/{where}", "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(n))[name]
        assert entry["dtype"] == "F32", entry
        f.seek(8 + n + entry["data_offsets"][0])
        f.write(struct.pack("<3f", float("nan"), float("inf"), float("nan")))

shard0 = sorted(f for f in os.listdir(f"{work}/resaved") if f.endswith(".safetensors"))[0]
shard0_bytes = open(f"{work}/resaved/{shard0}", "rb").read()
poisoned = "model.layers.1.self_attn.kv_b_proj.weight"
poisoned_copy(fixture, f"{work}/nan_ck", poisoned)
# crop reads tensors its own way (as stored, FP8 dequantised): it refuses them the same way.
poisoned5 = "model.language_model.layers.0.mlp.up_proj.weight"
poisoned_copy(glm5, f"{work}/nan5_ck", poisoned5)
os.makedirs(f"{work}/training_ck", exist_ok=True)
os.symlink(f"{work}/no_such_dir", f"{work}/dangling")
shutil.copytree(fixture, f"{work}/src_copy")
glm5_copy = f"{work}/glm5_copy"
shutil.copytree(glm5, glm5_copy)
open(f"{work}/training_ck/state.json", "w").write("{}")
open(f"{work}/training_ck/config.json", "w").write("{}")
for args, needle in [(("resave", "--from", f"{work}/nowhere", "--to", f"{work}/x"), "is not a directory (an HF checkpoint"),
                     (("resave", "--from", fixture, "--to", f"{work}/training_ck"), "holds a training checkpoint"),
                     (("logits", "--from", fixture, "--docs", "1,999999", "--out", f"{work}/c"), "outside the vocabulary"),
                     (("resave", "--from", f"{work}/resaved", "--to", f"{work}/resaved"), "is the --from checkpoint"),
                     (("logits", "--from", fixture, "--docs", "1,x", "--out", f"{work}/c"), "id 2 of document 1 ('x') is not a decimal integer"),
                     (("crop", "--from", glm5, "--to", f"{work}/crop9", "--layers", "9"), "layers must be in [1, 4]"),
                     (("crop", "--from", fixture, "--to", f"{work}/crop_lite", "--layers", "1"), "field 'model_type': is 'glm4_moe_lite', expected 'glm5_next'"),
                     (("resave", "--from", fixture, "--to", ""), "--to is empty"),
                     (("resave", "--from", fixture, "--to", "/proc/self/x"), "cannot write '/proc/self/x'"),
                     (("--plugins", f"{work}/a.safetensors", "list"), "is not a directory"),
                     (("resave", "--from", glm5, "--to", f"{work}/wrong_package"), "use package glm5_next (--package"),
                     (("--plugins", f"{work}/none", "list"), "does not exist"),
                     (("logits", "--from", f"{work}/nan_ck", "--docs", docs, "--out", f"{work}/c"),
                      f"tensor '{poisoned}' holds 3 non-finite values (NaN or infinity)"),
                     (("resave", "--from", f"{work}/nan_ck", "--to", f"{work}/nan_out"), "non-finite"),
                     (("crop", "--from", f"{work}/nan5_ck", "--to", f"{work}/nan5_out", "--layers", "2"),
                      f"tensor '{poisoned5}' holds 3 non-finite values"),
                     (("resave", "--from", fixture, "--to", f"{work}/resaved"), "is not empty"),
                     (("resave", "--from", fixture, "--to", f"{work}/a.safetensors"), "exists and is not a directory"),
                     (("resave", "--from", fixture, "--to", f"{work}/a.safetensors/sub"), "is not a directory, so no directory can be made under it"),
                     (("resave", "--from", fixture, "--to", f"{work}/dangling"), "that leads to nothing: give a new or empty directory"),
                     (("resave", "--from", fixture, "--to", f"{work}/dangling/"), "that leads to nothing: give a new or empty directory"),
                     (("resave", "--from", fixture, "--to", f"{work}/training_ck/x"), "lies inside the checkpoint"),
                     (("resave", "--from", f"{work}/src_copy", "--to", f"{work}/src_copy/inner"), "lies inside the --from checkpoint"),
                     (("crop", "--from", glm5_copy, "--to", f"{glm5_copy}/./sub/x", "--layers", "2"), "lies inside the --from checkpoint"),
                     (("logits", "--from", f"{work}/resaved", "--docs", docs, "--out", f"{work}/resaved/{shard0}"),
                      "already exists"),
                     (("crop", "--from", glm5, "--to", f"{work}/cropped", "--layers", "2"), "is not empty")]:
    r = run(*args)
    checks.append((r.returncode == 2 and needle in r.stderr, f"{' '.join(args[:1])}: refused with '{needle}' ({r.stderr.strip()[-160:]})"))
checks.append((open(f"{work}/resaved/{shard0}", "rb").read() == shard0_bytes, "logits: the checkpoint's shard is untouched"))
checks.append((sorted(os.listdir(f"{work}/src_copy")) == sorted(os.listdir(fixture)), "resave: nothing made inside the source"))
checks.append((not os.path.exists(f"{glm5_copy}/sub"), "crop: nothing made inside the source"))
checks.append((not os.path.exists(f"{work}/crop_lite") and not os.path.exists(f"{work}/crop9"), "crop: a refused source makes no --to"))
checks.append((not os.path.exists(f"{work}/nan5_out") or not os.listdir(f"{work}/nan5_out"),
               "crop: the refused checkpoint wrote nothing"))
# A write that fails (here a file-size limit, as a full disk would) is named, and leaves --to as it
# was: removed when the command made it, emptied again when it was an empty directory; logits
# leaves no --out (each once left a truncated file under its final name).
def limited(*args, limit=100_000):  # the checkpoint's one 1 MiB shard: ~510 KB; the logits file: ~5 KB
    return subprocess.run([kiln, "model", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
os.makedirs(f"{work}/empty_to")
for to, what in ((f"{work}/new_to", "a --to it made is removed"), (f"{work}/empty_to", "an empty --to is emptied again")):
    r = limited("resave", "--from", fixture, "--to", to, "--shard-mib", "1")
    left = os.listdir(to) if os.path.isdir(to) else None
    checks.append((r.returncode == 2 and "write failed (disk full, or a file-size limit?)" in r.stderr and
                   (left is None if to.endswith("new_to") else left == []),
                   f"resave past a file-size limit: refused by name, {what} ({r.returncode}: {r.stderr.strip()[-160:]}; left {left})"))
r = limited("logits", "--from", fixture, "--docs", docs, "--out", f"{work}/limited.safetensors", limit=2000)
checks.append((r.returncode == 2 and "write failed" in r.stderr and
               not [f for f in os.listdir(work) if f.startswith("limited.safetensors")],
               f"logits past a file-size limit: refused by name, no file left ({r.returncode}: {r.stderr.strip()[-160:]})"))
for ok, what in checks:
    print(("ok   " if ok else "FAIL ") + what)
failed = sum(not ok for ok, _ in checks)
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
