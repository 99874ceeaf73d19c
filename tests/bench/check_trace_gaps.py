#!/usr/bin/env python3
"""trace_gaps.py on hand-made Kineto traces: each `kiln bench gpu: step I` host op split into the
host's time before the GPU's first work, the GPU span (busy, idle) and the time after its last
work; the whole trace's span, busy and idle; a gap charged to the op that launched the work after
it; a file that is not a trace refused by name. Exits 1 naming the first check that fails."""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(events_or_text):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(events_or_text if isinstance(events_or_text, str) else json.dumps({"traceEvents": events_or_text}))
        path = f.name
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "trace_gaps.py"), path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    return p.returncode, p.stdout, p.stderr


def main():
    ev = []

    def x(cat, name, ts, dur, corr=None, tid=1):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        ev.append(e)

    # Step 1: 1000 us on the host; kernels at 300-500 and 600-800 (100 us idle between), the
    # second launched inside aten::mm. Step 2: 500 us; one kernel at 1050-1450.
    x("cpu_op", "kiln bench gpu: step 1", 0, 1000)
    x("cpu_op", "aten::mm", 255, 20)
    x("cuda_runtime", "cudaLaunchKernel", 250, 4, corr=1)
    x("kernel", "k1", 300, 200, corr=1)
    x("cuda_runtime", "cudaLaunchKernel", 260, 4, corr=2)
    x("kernel", "k2", 600, 200, corr=2)
    x("cpu_op", "kiln bench gpu: step 2", 1000, 500)
    x("cuda_runtime", "cudaLaunchKernel", 1010, 4, corr=3)
    x("kernel", "k3", 1050, 400, corr=3)
    failures, checks = [], [0]

    def check(ok, what):
        checks[0] += 1
        if not ok:
            failures.append(what)

    rc, out, err = run(ev)
    lines = out.splitlines()
    check(rc == 0, f"exit 0 on a good trace, got {rc}: {err.strip()}")
    check(len(lines) > 2 and lines[0] == "kiln bench gpu: step 1: 1.00 ms = host before the GPU's first work 0.30 ms + "
          "GPU span 0.50 ms (busy 0.40, idle 0.10) + after its last work 0.20 ms", f"step 1's line, got {lines[:1]}")
    check(len(lines) > 2 and lines[1] == "kiln bench gpu: step 2: 0.50 ms = host before the GPU's first work 0.05 ms + "
          "GPU span 0.40 ms (busy 0.40, idle 0.00) + after its last work 0.05 ms", f"step 2's line, got {lines[1:2]}")
    check(len(lines) > 2 and lines[2].startswith("GPU span 1.15 ms: busy 0.80 ms, idle 0.35 ms"),
          f"the whole span's line, got {lines[2:3]}")
    check(any("100.0 us  aten::mm" in line for line in lines), "the 100 us gap charged to aten::mm (k2's launch)")

    rc, out, _ = run([e for e in ev if not e["name"].startswith("kiln bench gpu")])
    check(rc == 0 and out.startswith("GPU span 1.15 ms"), "a trace without step ops: no step lines, the span first")

    rc, _, err = run("not json")
    check(rc != 0 and "cannot read" in err, f"a file that is not JSON refused by name, got {rc}: {err.strip()}")

    for f in failures:
        print(f"FAILED: {f}")
    print(f"check_trace_gaps: {checks[0] - len(failures)} of {checks[0]} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
