#!/usr/bin/env python3
"""The tree's layers, checked: a folder's sources may include (and its CMake targets link) only
folders at or below its own layer, so nothing runs upward.

    messaging    (wire format, transport, hosting)       includes: messaging
    parallel     (launch env, c10d process groups)       includes: parallel
    kernels      (CUDA ops + references)                 includes: kernels
    model        (blocks, packages, checkpoints)         includes: model, kernels, messaging, parallel
    actors       (controller, rollout, trainer, ...)     includes: actors, model, kernels, messaging, parallel
    experiments  (command line, experiment files, benchmark drivers): anything

Usage: check_layering.py [ROOT]  (default: the repository holding this file). Exit 1 naming each
offending include or link, with file and line.
"""
import os, re, sys

ALLOWED = {
    "messaging": {"messaging"},
    "parallel": {"parallel"},
    "kernels": {"kernels"},
    "model": {"model", "kernels", "messaging", "parallel"},
    "actors": {"actors", "model", "kernels", "messaging", "parallel"},
}
# CMake targets defined by a folder above each layer (linking one would run upward).
UPWARD_TARGETS = {"experiments": re.compile(r"\bkiln_launcher(_model)?\b|\bkiln\b(?!_)")}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bad, files = [], 0
    for layer, allowed in ALLOWED.items():
        for dirpath, _, names in os.walk(os.path.join(root, layer)):
            for name in names:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                if name.endswith((".hpp", ".cpp", ".h", ".cu", ".cuh")):
                    files += 1
                    for no, line in enumerate(open(path, errors="replace"), 1):
                        m = INCLUDE.match(line)
                        if m and m.group(1) in ALLOWED.keys() | {"experiments", "tests"} and m.group(1) not in allowed:
                            bad.append(f"{rel}:{no}: {layer}/ includes {m.group(1)}/ ({line.strip()})")
                elif name == "CMakeLists.txt":
                    for no, line in enumerate(open(path), 1):
                        code = line.split("#", 1)[0]
                        if "target_link_libraries" in code or (code.strip() and not code.strip().startswith("add_")):
                            for upper, pattern in UPWARD_TARGETS.items():
                                if pattern.search(code):
                                    bad.append(f"{rel}:{no}: {layer}/ links a target of {upper}/ ({line.strip()})")
    for b in bad:
        print("FAIL " + b)
    print(f"{files} source files of {', '.join(ALLOWED)} read; {len(bad)} upward includes or links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
