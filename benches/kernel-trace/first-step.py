#!/usr/bin/env python3
"""Where a run's first step goes, against a later one. Reads the CSV libtrace.so wrote (every
kernel, copy and fill with its start and end) and splits the run into stretches of GPU work at
idle gaps longer than --split-ms. Prints every stretch with its span, the GPU time by kind
(kernels, copies, fills) and the idle gap before it, so the first step's extra time shows up
either as GPU work (copies, slower kernels) or as the GPU waiting on the host (gaps: plans
built, modules loaded, memory allocated). Then the kernels whose first run was the slowest
against their median later run.

    python3 first-step.py trace.csv [--device 0] [--split-ms 5] [--top 12]
"""
import argparse
import collections
import statistics

from classes import load, stretches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--split-ms", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    ev = load(a.trace, a.device)
    if not ev:
        raise SystemExit("first-step.py: no event on that device")
    t0 = ev[0][0]
    prev_end = t0
    print(f"{'start ms':>10} {'gap ms':>9} {'span ms':>9} {'kernels ms':>11} {'copies ms':>10} "
          f"{'fills ms':>9} {'n':>6}  first kernel")
    for st in stretches(ev, int(a.split_ms * 1e6)):
        by = collections.Counter()
        for s, e, kind, _name, _stream in st:
            by[kind] += e - s
        end = max(x[1] for x in st)
        first = next((x[3] for x in st if x[2] == "kernel"), "-")
        print(f"{(st[0][0] - t0) / 1e6:10.1f} {(st[0][0] - prev_end) / 1e6:9.1f} "
              f"{(end - st[0][0]) / 1e6:9.1f} {by['kernel'] / 1e6:11.1f} {by['memcpy'] / 1e6:10.1f} "
              f"{by['memset'] / 1e6:9.1f} {len(st):6d}  {first[:60]}")
        prev_end = end
    runs = collections.defaultdict(list)
    for s, e, kind, name, _stream in ev:
        if kind == "kernel":
            runs[name].append(e - s)
    worst = []
    for name, t in runs.items():
        if len(t) >= 3:
            worst.append((t[0] - statistics.median(t[1:]), t[0], statistics.median(t[1:]), len(t), name))
    worst.sort(reverse=True)
    print(f"\nkernels whose first run took longest beyond their median later run (top {a.top}):")
    for extra, first, med, n, name in worst[: a.top]:
        print(f"  +{extra / 1e6:8.2f} ms (first {first / 1e6:.2f}, median {med / 1e6:.3f} ms, {n} runs)  {name[:90]}")


if __name__ == "__main__":
    main()
