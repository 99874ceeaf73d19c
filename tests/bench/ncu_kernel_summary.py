#!/usr/bin/env python3
"""Sums the kernel times of an `ncu --csv --metrics gpu__time_duration.sum` run by kernel family.

Usage: python3 ncu_kernel_summary.py FILE.csv [--top N]
FILE may hold the profiled program's own output too (lines not in ncu's CSV are skipped).
Families: the kernel's name up to its template arguments or parameter list, so the launches
of one kernel at different shapes add up. Prints, largest first: total microseconds, share of
the whole, launches, family; then the total and the number of launches.
"""

import argparse
import collections
import csv
import io
import re
import sys

UNIT_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def family(name):
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    cut = len(name)
    for ch in "<(":
        i = name.find(ch)
        if i > 0:
            cut = min(cut, i)
    return name[:cut].strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if a.top < 1:
        ap.error(f"--top {a.top} < 1")
    try:
        with open(a.file, errors="replace") as fh:
            lines = [ln for ln in fh if ln.startswith('"')]
    except OSError as e:
        sys.exit(f"ncu_kernel_summary: cannot read {a.file}: {e.strerror}")
    if not lines:
        sys.exit(f"ncu_kernel_summary: no ncu CSV rows in {a.file}")
    reader = csv.DictReader(io.StringIO("".join(lines)))
    missing = {"Kernel Name", "Metric Name", "Metric Value"} - set(reader.fieldnames or [])
    if missing:
        sys.exit(f"ncu_kernel_summary: {a.file}'s CSV header lacks {sorted(missing)} (run ncu with --csv)")
    total = collections.Counter()
    count = collections.Counter()
    for line, r in enumerate(reader, start=2):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        if r.get("Metric Value") is None or r.get("Kernel Name") is None:
            sys.exit(f"ncu_kernel_summary: CSV row {line} of {a.file} has fewer fields than its header")
        unit = r.get("Metric Unit") or "nsecond"
        if unit not in UNIT_US:
            sys.exit(f"ncu_kernel_summary: unknown unit {unit!r} in CSV row {line} of {a.file}")
        try:
            us = float(r["Metric Value"].replace(",", "")) * UNIT_US[unit]
        except ValueError:
            sys.exit(f"ncu_kernel_summary: CSV row {line} of {a.file}: Metric Value {r['Metric Value']!r} is not a number")
        f = family(r["Kernel Name"])
        total[f] += us
        count[f] += 1
    whole = sum(total.values())
    if not whole:
        sys.exit(f"ncu_kernel_summary: no gpu__time_duration.sum rows in {a.file}")
    for f, us in total.most_common(a.top):
        print(f"{us:10.1f} us {100 * us / whole:5.1f}% {count[f]:5d}x  {f[:110]}")
    print(f"{whole:10.1f} us total, {sum(count.values())} launches")


if __name__ == "__main__":
    main()
