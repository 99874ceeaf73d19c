#!/usr/bin/env python3
"""An independent kiln client, written from docs/wire-format.md only (pyzmq + msgpack).

Usage: wire_client.py PATH_TO_KILN
Starts `kiln node` hosting diag/0 on a free tcp port, then as a DEALER and as a REQ client:
sends diag.echo requests with tensors and checks the reply (same bytes, zlib CRC-32s),
a ping, and malformed requests that must come back as `error` replies naming the fault.
Exits non-zero on the first failed check; prints "N passed, 0 failed" at the end.
"""
import subprocess
import sys
import zlib

import msgpack
import numpy as np
import zmq

passed = 0


def check(cond, what):
    global passed
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    passed += 1


def envelope(type_, id_, payload, tensors=(), kind="request", to="diag/0", tv=1, v=1):
    descs = [{"name": n, "dtype": dt, "shape": list(a.shape), "nbytes": a.nbytes} for n, dt, a in tensors]
    env = {"v": v, "type": type_, "tv": tv, "kind": kind, "from": "python-client", "to": to, "id": id_,
           "payload": payload, "tensors": descs}
    return [msgpack.packb(env)] + [a.tobytes() for _, _, a in tensors]


def decode(frames):
    env = msgpack.unpackb(frames[0], raw=False)
    check(len(frames) == 1 + len(env.get("tensors", [])), "one frame per tensor descriptor")
    for d, f in zip(env.get("tensors", []), frames[1:]):
        check(len(f) == d["nbytes"], f"tensor frame {d['name']} holds nbytes")
    return env, frames[1:]


def main():
    kiln = sys.argv[1]
    node = subprocess.Popen([kiln, "node", "--name", "interop", "--bind", "tcp://127.0.0.1:0", "--actor", "diag/0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = node.stdout.readline().strip()  # "kiln node NAME ready at ENDPOINT"
        check(" ready at " in line, f"node announces its endpoint (got {line!r})")
        endpoint = line.split(" ready at ")[1]
        ctx = zmq.Context()

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)

        # 1. diag.echo with three tensors: F32, I64 and raw BF16 bit patterns.
        rng = np.random.default_rng(5)
        x = rng.standard_normal((2, 3)).astype(np.float32)
        ids = np.arange(10, dtype=np.int64)
        bf16 = rng.integers(0, 2**16, size=(64, 32), dtype=np.uint16)  # bf16 travels as its bits
        dealer.send_multipart(envelope("diag.echo", 41, {"note": "from python"},
                                       [("x", "F32", x), ("ids", "I64", ids), ("w", "BF16", bf16)]))
        env, frames = decode(dealer.recv_multipart())
        check(env["kind"] == "reply" and env["type"] == "diag.echo_result", f"echo answered with a reply: {env}")
        check(env["id"] == 41, "reply carries the request id")
        check(env["payload"]["node"] == "interop", "reply names the node")
        for i, a in enumerate([x, ids, bf16]):
            check(env["payload"]["crc32"][i] == zlib.crc32(a.tobytes()), f"crc32 of tensor {i} matches")
            check(frames[i] == a.tobytes(), f"tensor {i} bytes come back unchanged")
        check(env["tensors"][2]["dtype"] == "BF16" and env["tensors"][2]["shape"] == [64, 32], "descriptor kept")
        back = np.frombuffer(frames[0], dtype=np.float32).reshape(env["tensors"][0]["shape"])
        check(np.array_equal(back, x), "float32 tensor decodes to the same values")

        # 2. ping: no tensors, payload only.
        dealer.send_multipart(envelope("ping", 42, {"note": "are you there"}))
        env, _ = decode(dealer.recv_multipart())
        check(env["type"] == "pong" and env["payload"]["note"] == "are you there", "ping answered with pong")

        # 3. Malformed requests come back as errors that name the fault.
        bad_cases = [
            (envelope("diag.echo", 43, {}, [("x", "F32", x)])[:1], "tensor frames"),  # frame missing
            (envelope("diag.echo", 44, {}, v=7), "envelope schema version 7"),
            (envelope("no.such.type", 45, {}), "unknown message type"),
            (envelope("ping", 46, {}, to="ghost/9"), "ghost/9"),
        ]
        desc_lie = envelope("diag.echo", 47, {}, [("x", "F32", x)])
        env47 = msgpack.unpackb(desc_lie[0])
        env47["tensors"][0]["nbytes"] = 4
        bad_cases.append(([msgpack.packb(env47), desc_lie[1]], "nbytes is 4"))
        for frames_out, needle in bad_cases:
            dealer.send_multipart(frames_out)
            env, _ = decode(dealer.recv_multipart())
            check(env["kind"] == "error", f"malformed request answered with an error ({needle})")
            check(needle in env["payload"]["message"], f"error names the fault: {env['payload']}")

        # 4. A REQ socket (empty delimiter frame) is served too.
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.RCVTIMEO, 10000)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send_multipart(envelope("diag.echo", 48, {"note": "req"}, [("e", "F16", np.zeros((0, 4), np.float16))]))
        env, frames = decode(req.recv_multipart())
        check(env["id"] == 48 and env["tensors"][0]["shape"] == [0, 4] and frames[0] == b"", "REQ client, empty tensor")

        dealer.close()
        req.close()
        ctx.term()
    finally:
        node.terminate()
        node.wait(timeout=10)
    check(node.returncode == 0, f"node exits cleanly on SIGTERM (code {node.returncode})")
    print(f"{passed} passed, 0 failed")


if __name__ == "__main__":
    main()
