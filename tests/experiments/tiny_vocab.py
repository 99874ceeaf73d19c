"""A tiny checkpoint whose vocabulary fits the fixture tokenizer.json (2005 ids): the
transformers-made tests/fixtures/glm4_moe_lite_tiny with its embedding and lm_head rows grown
from 96 to 2048, the new rows drawn from N(0, 0.02) (seed 0). Shared by the checks that use the
fixture tokenizer with a model."""
import json, os, random, struct


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for k, (dtype, shape, blob) in tensors.items():
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_tiny_vocab2048(root, ckpt):
    """Writes the checkpoint into directory `ckpt` (created); `root`: the repository."""
    fixture = os.path.join(root, "tests/fixtures/glm4_moe_lite_tiny")
    os.makedirs(ckpt)
    tensors = {}
    for name in sorted(os.listdir(fixture)):
        if name.startswith("model-") and name.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(fixture, name)))
    rng = random.Random(0)
    for key in ["model.embed_tokens.weight", "lm_head.weight"]:
        dtype, shape, blob = tensors[key]
        assert dtype == "F32" and shape[0] == 96, (key, dtype, shape)
        extra = struct.pack(f"<{(2048 - 96) * shape[1]}f", *(rng.gauss(0, 0.02) for _ in range((2048 - 96) * shape[1])))
        tensors[key] = (dtype, [2048, shape[1]], blob + extra)
    write_safetensors(os.path.join(ckpt, "model.safetensors"), tensors)
    config = json.load(open(os.path.join(fixture, "config.json")))
    config["vocab_size"] = 2048
    json.dump(config, open(os.path.join(ckpt, "config.json"), "w"), indent=2)
