#!/usr/bin/env python3
"""Where the GPU waits for the host, from a Kineto Chrome trace (`kiln bench gpu --trace FILE`,
or torch.profiler's export_chrome_trace).

Usage: python3 trace_gaps.py FILE.json [--top N] [--min-us US] [--kernels] [--timeline MS]

A trace of `kiln bench gpu --trace FILE --trace-steps N` first gets one line per step: the host
op "kiln bench gpu: step I" (the step and its device synchronize, as the timing runs it) split
into the host's time before the GPU's first work, the GPU span (busy, idle) and the time after
the GPU's last work (the synchronize's return).

The GPU's work is the union of its kernel, memcpy and memset intervals; an idle interval between
two of them of at least --min-us is a gap. Each gap is charged to the CPU op that launched the
work ending it (the kernel's launch call matched by correlation id, then the innermost and the
outermost `cpu_op` around that call on its thread). Prints the span, busy and idle time, the
launches, then the gaps' time summed by launching op (innermost and outermost), largest first,
and the longest single gaps; with --kernels also the GPU time summed by kernel name, by the
outermost cpu_op that launched it, and by the (outermost, innermost) pair of cpu_ops (which
backward node ran which ATen op), largest first. With --timeline MS, the first MS milliseconds
of the trace (from its first host op or launch), in time order: each launch (host time, its innermost
cpu_op, what it launched) and each GPU activity (start, duration, gap before it), so the host's
work between launches at a step's start can be read (with every host op of 10 us or more).
"""

import argparse
import bisect
import collections
import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP_OP = "kiln bench gpu: step "


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=2.0)
    ap.add_argument("--kernels", action="store_true", help="also GPU time by kernel name and launching op")
    ap.add_argument("--timeline", type=float, default=0.0, metavar="MS",
                    help="also the first MS ms of launches and GPU activity, in time order")
    a = ap.parse_args()
    if a.top < 1 or a.min_us < 0 or a.timeline < 0:
        ap.error(f"--top {a.top} must be >= 1, --min-us {a.min_us} and --timeline {a.timeline} >= 0")
    try:
        with open(a.file) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_gaps: cannot read {a.file} as a JSON trace: {e}")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        sys.exit(f"trace_gaps: {a.file} has no traceEvents list")
    gpu, launch, ops = [], {}, collections.defaultdict(list)
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        cat, ts, dur = e.get("cat", ""), float(e["ts"]), float(e.get("dur", 0))
        corr = (e.get("args") or {}).get("correlation")
        if cat in GPU_CATS:
            gpu.append((ts, ts + dur, corr, e.get("name", "?")))
        elif cat in ("cuda_runtime", "cuda_driver") and corr is not None:  # cuBLASLt launches by the driver API
            launch[corr] = (e.get("tid"), ts)
        elif cat == "cpu_op":
            ops[e.get("tid")].append((ts, ts + dur, e.get("name", "?")))
    if not gpu:
        sys.exit(f"trace_gaps: no GPU kernels in {a.file} (traced without CUDA activities?)")
    gpu.sort()
    for tid in ops:
        ops[tid].sort()
    starts = {tid: [o[0] for o in v] for tid, v in ops.items()}

    def enclosing(tid, ts):
        """(innermost, outermost) cpu_op names around ts on thread tid."""
        v = ops.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        around = [o for o in v[max(0, i - 400):i] if o[1] >= ts]
        if not around:
            return "(no cpu_op)", "(no cpu_op)"
        inner = max(around, key=lambda o: o[0])
        outer = min(around, key=lambda o: o[0])
        return inner[2], outer[2]

    # `kiln bench gpu --trace-steps N`: one host op per step, "kiln bench gpu: step I", holding the
    # step and its device synchronize, as the timing runs it.
    steps = sorted((o for v in ops.values() for o in v if o[2].startswith(STEP_OP)), key=lambda o: o[0])
    for s0, s1, name in steps:
        inside = [(s, t) for s, t, _, _ in gpu if s0 <= s < s1]
        if not inside:
            print(f"{name}: {(s1 - s0) / 1e3:.2f} ms on the host, no GPU work in it")
            continue
        g_busy, g_end = 0.0, inside[0][0]
        for s, t in inside:
            g_busy += max(0.0, t - max(s, g_end))
            g_end = max(g_end, t)
        g_span = g_end - inside[0][0]
        print(f"{name}: {(s1 - s0) / 1e3:.2f} ms = host before the GPU's first work {(inside[0][0] - s0) / 1e3:.2f} ms"
              f" + GPU span {g_span / 1e3:.2f} ms (busy {g_busy / 1e3:.2f}, idle {(g_span - g_busy) / 1e3:.2f})"
              f" + after its last work {(s1 - g_end) / 1e3:.2f} ms")
    span = gpu[-1][1] - gpu[0][0]
    busy, idle, end = 0.0, 0.0, gpu[0][0]
    by_inner, by_outer, gaps = collections.Counter(), collections.Counter(), []
    for s, t, corr, name in gpu:
        if s > end:
            g = s - end
            idle += g
            if g >= a.min_us:
                tid, lts = launch.get(corr, (None, None))
                inner, outer = enclosing(tid, lts) if tid is not None else ("(launch not traced)",) * 2
                by_inner[inner] += g
                by_outer[outer] += g
                gaps.append((g, inner, outer, name))
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    print(f"GPU span {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms "
          f"({100 * idle / span:.1f}%), {len(gpu)} kernels/copies, {len(gaps)} gaps >= {a.min_us} us")
    def ranked(title, counter, label=lambda k: k[:100]):
        print(f"\n{title}:")
        for k, v in counter.most_common(a.top):
            print(f"  {v:9.1f} us  {label(k)}")

    ranked("idle time by the op that launched the work after it (innermost cpu_op)", by_inner)
    ranked("idle time by the outermost cpu_op around that launch", by_outer)
    print("\nlongest gaps:")
    for g, inner, outer, name in sorted(gaps, reverse=True)[: a.top]:
        print(f"  {g:9.1f} us  before {name[:60]}  (launched in {inner[:50]} / {outer[:40]})")
    if a.kernels:
        by_name, by_op, by_pair = collections.Counter(), collections.Counter(), collections.Counter()
        count, pair_count = collections.Counter(), collections.Counter()
        for s, t, corr, name in gpu:
            by_name[name] += t - s
            count[name] += 1
            tid, lts = launch.get(corr, (None, None))
            inner, outer = enclosing(tid, lts) if tid is not None else ("(launch not traced)",) * 2
            by_op[outer] += t - s
            by_pair[(outer, inner)] += t - s
            pair_count[(outer, inner)] += 1
        ranked("GPU time by kernel (calls)", by_name, lambda k: f"{count[k]:5d}  {k[:110]}")
        ranked("GPU time by the outermost cpu_op that launched it", by_op)
        ranked("GPU time by outermost / innermost cpu_op (launches)", by_pair,
               lambda k: f"{pair_count[k]:5d}  {k[0][:60]} / {k[1][:50]}")
    if a.timeline > 0:
        first = launch.get(gpu[0][2], (None, gpu[0][0]))[1]
        t0 = min([first, gpu[0][0]] + [v[0][0] for v in ops.values() if v])  # the traced region's start
        rows, end = [], gpu[0][0]
        for s, t, corr, name in gpu:
            tid, lts = launch.get(corr, (None, None))
            if lts is not None and lts - t0 <= a.timeline * 1e3:
                inner, _ = enclosing(tid, lts)
                rows.append((lts, f"host launch  in {inner[:45]:45s} -> {name[:50]}"))
            if s - t0 <= a.timeline * 1e3:
                rows.append((s, f"gpu  {t - s:8.1f} us  after {max(0.0, s - end):7.1f} us idle  {name[:60]}"))
            end = max(end, t)
        for tid, v in ops.items():  # the host's ops of 10 us or more (the work between launches)
            for s, t, name in v:
                if 0 <= s - t0 <= a.timeline * 1e3 and t - s >= 10:
                    rows.append((s, f"host op {t - s:8.1f} us  {name[:80]}"))
        print(f"\nthe first {a.timeline} ms (us from the trace's first host op):")
        for ts, text in sorted(rows):
            print(f"  {ts - t0:9.1f}  {text}")


if __name__ == "__main__":
    main()
