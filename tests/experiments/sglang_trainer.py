"""What an SGLang-style trainer does against a server's weight-update group endpoints, with
torch.distributed: SGLang's init_custom_process_group (the group's store keys as torch lays them
out) and the update protocol (the request in flight while rank 0 broadcasts each tensor in
order). Shared by check_serve_distributed.py (Gloo) and check_serve_nccl.py."""
import os, sys, threading
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from serve_util import http

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loopback_port import free_port  # noqa: E402,F401  (check_serve_*.py import it from here)


def init_custom_process_group(address, port, world, rank, group_name, backend="gloo"):
    """SGLang's init_custom_process_group (python/sglang/srt/utils.py)."""
    timeout = timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://{address}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def in_thread(fn):
    """Runs fn() on a thread; returns a function that joins it and gives its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    return lambda: (t.join(120), out.get("r"))[1]


def form_group(url, port, name="weight_update_group", backend="gloo"):
    """The trainer's side of forming a group of two with the server at `url`: (its process
    group, the server's answer (status, body) to /init_weights_update_group)."""
    answer = in_thread(lambda: http(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": backend}))
    pg = init_custom_process_group("127.0.0.1", port, 2, 0, name, backend)
    return pg, answer()


def update(url, pg, tensors, version=None, group="weight_update_group", broadcast=True):
    """POSTs /update_weights_from_distributed for `tensors` [(name, tensor)] and, while it is in
    flight, broadcasts them in order from rank 0 (as SGLang's trainers do)."""
    body = {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": group}
    if version is not None:
        body["weight_version"] = version
    answer = in_thread(lambda: http(url, "/update_weights_from_distributed", body))
    if broadcast:
        for _, t in tensors:
            dist.broadcast(t.contiguous(), src=0, group=pg)
    return answer()


def message(r):
    return r.get("message", "") if isinstance(r, dict) else str(r)
