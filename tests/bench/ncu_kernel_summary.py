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
    lines = [ln for ln in open(a.file, errors="replace") if ln.startswith('"')]
    if not lines:
        sys.exit(f"ncu_kernel_summary: no ncu CSV rows in {a.file}")
    rows = list(csv.DictReader(io.StringIO("".join(lines))))
    total = collections.Counter()
    count = collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        if unit not in UNIT_US:
            sys.exit(f"ncu_kernel_summary: unknown unit {unit!r}")
        us = float(r["Metric Value"].replace(",", "")) * UNIT_US[unit]
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
