#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel `gpu__time_duration.sum` (a `--csv --print-units base`
log of a 2-step `mold exec`) by kernel name over the second step: each name's later half
of its launches (the two steps launch the same kernels; the first step's extra warm-up
launches fall in the first half). Prints one step's kernel time and the top kernels.

    python3 benches/ncu_kernels.py ncu.csv
"""
import csv
import sys
from collections import defaultdict


def main(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        rows.append((r.get("Kernel Name", "?"), ns))
    by = defaultdict(list)
    for name, ns in rows:
        by[name].append(ns)
    total = 0.0
    out = []
    for name, v in by.items():
        step = sum(v[len(v) // 2:]) if len(v) > 1 else v[0] / 2
        n = len(v) - len(v) // 2 if len(v) > 1 else 1
        total += step
        out.append((step / 1e6, n, name))
    out.sort(reverse=True)
    print(f"ncu: {len(rows)} kernel launches over 2 steps; one step ~ {total / 1e6:.2f} ms of kernel time")
    for ms, n, name in out[:60]:
        print(f"  {ms:8.3f} ms {n:5d}x  {name[:120]}")


if __name__ == "__main__":
    main(sys.argv[1])
