"""Loads the torchtitan peer's benchmark module (../shared/peers/torchtitan/bench_tt.py) from its
folder, for the scripts here that run its model: bench_torchtitan_ac.py and profile_torchtitan.py."""

import importlib.util
import os
import sys


def load_bench_tt(peer, who):
    """bench_tt.py of the folder `peer` as a module; exits naming `who` and the cause when it
    is missing or cannot be imported (torchtitan's wheels not on PYTHONPATH)."""
    path = os.path.join(peer, "bench_tt.py")
    if not os.path.isfile(path):
        sys.exit(f"{who}: no bench_tt.py in {peer}")
    spec = importlib.util.spec_from_file_location("bench_tt", path)
    tt = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(tt)
    except ImportError as e:
        sys.exit(f"{who}: {path} cannot be imported: {e} (install the wheels of the peer's whl/ folder)")
    return tt
