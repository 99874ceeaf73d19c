#!/usr/bin/env python3
"""No kiln binary exports a gloo symbol to the dynamic linker.

kiln compiles c10d's ProcessGroupGloo.hpp against Debian's gloo headers, an older gloo than the
one inside libtorch. Inline gloo code that a binary instantiated from those headers and exported
dynamically would interpose on libtorch's own copy: libtorch's gloo objects would then run code
written for another layout. This fails naming each exported gloo symbol.

Usage: check_no_gloo_exports.py BINARY [BINARY ...]
"""
import subprocess, sys


def main():
    bad = []
    for binary in sys.argv[1:]:
        out = subprocess.run(["nm", "-D", "--defined-only", "-C", binary], check=True, capture_output=True, text=True).stdout
        bad += [f"{binary}: {line}" for line in out.splitlines() if "gloo" in line]
    for b in bad:
        print("FAIL exports " + b)
    print(f"{len(sys.argv) - 1} binaries read; {len(bad)} exported gloo symbols")
    return 1 if bad or len(sys.argv) < 2 else 0


if __name__ == "__main__":
    sys.exit(main())
