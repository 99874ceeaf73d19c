#!/usr/bin/env python3
"""No standard-library symbol of kiln's binds to a copy inside another library.

libtorch exports its own copies of some libstdc++ functions (std::filesystem::remove_all and
friends, unversioned). When libtorch comes before libstdc++ in a binary's list of needed
libraries, the dynamic linker binds kiln's calls to those copies; remove_all then jumped to a
null weak symbol (a segfault when a checkpoint directory was re-saved). kiln links libstdc++
first (CMakeLists.txt); this check runs each binary with every symbol bound at start
(LD_BIND_NOW) and the loader's binding log (LD_DEBUG=bindings), and fails naming each std::
symbol that a kiln binary resolved anywhere but in libstdc++ or itself.

Usage: check_std_bindings.py BINARY [BINARY ...]  (each run as BINARY --help)
"""
import os, re, subprocess, sys, tempfile

STD = re.compile(r"`(_ZN?K?St|_ZT[IVS]St|_ZNSt|_ZNKSt)")


def main():
    bad, checked = [], 0
    for binary in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, LD_BIND_NOW="1", LD_DEBUG="bindings", LD_DEBUG_OUTPUT=os.path.join(d, "log"))
            subprocess.run([binary, "--help"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            lines = [l for f in os.listdir(d) for l in open(os.path.join(d, f), errors="replace")]
        real = os.path.realpath(binary)
        mine = [l for l in lines if f"binding file {binary} " in l or f"binding file {real} " in l]
        if not mine:
            bad.append(f"{binary}: the loader logged no binding of it (LD_DEBUG unsupported?)")
        for l in mine:
            m = re.search(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)'", l)
            if not m or not STD.search("`" + m.group(3)):
                continue
            checked += 1
            target = os.path.basename(m.group(2))
            if not target.startswith("libstdc++") and os.path.realpath(m.group(2)) != real:
                bad.append(f"{binary}: {m.group(3)} binds to {m.group(2)}")
    for b in bad:
        print("FAIL " + b)
    print(f"{checked} std:: symbol bindings checked in {len(sys.argv) - 1} binaries; {len(bad)} bound elsewhere")
    return 1 if bad or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
