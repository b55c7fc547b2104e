#!/usr/bin/env python3
"""Is the GPU ever waiting on the host inside a step? Reads the CSV libtrace.so wrote (every
kernel, copy and fill with the run's own start and end times) and, per device, splits the
timeline into stretches of GPU work at idle gaps longer than --split-ms (a step ends with a
host synchronisation, so steps come out as stretches). For each stretch of at least
--min-kernels kernels: its span, the time some kernel ran (the union of kernel intervals), the
idle time left and how it splits by gap length, and the kernels' count. The summary line is
the median over those stretches: idle / span is what launch overhead (and any other host-side
stall) can cost a step at most; it is what a CUDA graph could win back.

    python3 gaps.py trace.csv [--device 0] [--split-ms 2] [--min-kernels 500] [--json]
"""
import argparse
import json
import statistics
import sys

from classes import load, stretches


def analyse(st):
    span = max(x[1] for x in st) - st[0][0]
    busy, gaps = 0, []
    cs, ce = st[0][0], st[0][1]
    for s, e, *_ in st[1:]:
        if s > ce:
            busy += ce - cs
            gaps.append(s - ce)
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    idle = span - busy
    buckets = {"lt_5us": 0, "5_50us": 0, "gt_50us": 0}
    for g in gaps:
        buckets["lt_5us" if g < 5e3 else "5_50us" if g < 5e4 else "gt_50us"] += g
    kernels = sum(1 for x in st if x[2] == "kernel")
    return {
        "span_ms": span / 1e6,
        "busy_ms": busy / 1e6,
        "idle_ms": idle / 1e6,
        "idle_frac": idle / span if span else 0.0,
        "kernels": kernels,
        "events": len(st),
        "gaps": len(gaps),
        "idle_ms_by_gap": {k: v / 1e6 for k, v in buckets.items()},
        "longest_gap_us": max(gaps) / 1e3 if gaps else 0.0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--split-ms", type=float, default=2.0)
    ap.add_argument("--min-kernels", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ev = load(a.trace, a.device)
    if not ev:
        sys.exit(f"gaps.py: no events for device {a.device} in {a.trace}")
    rows = [analyse(st) for st in stretches(ev, a.split_ms * 1e6)]
    steps = [r for r in rows if r["kernels"] >= a.min_kernels]
    if not steps:
        sys.exit(f"gaps.py: no stretch of >= {a.min_kernels} kernels (stretches: "
                 f"{[r['kernels'] for r in rows]}); lower --min-kernels or raise --split-ms")
    med = {k: statistics.median(r[k] for r in steps)
           for k in ("span_ms", "busy_ms", "idle_ms", "idle_frac", "kernels", "longest_gap_us")}
    if a.json:
        print(json.dumps({"stretches": steps, "median": med}))
        return
    for i, r in enumerate(steps):
        g = r["idle_ms_by_gap"]
        print(f"stretch {i}: span {r['span_ms']:.2f} ms, GPU busy {r['busy_ms']:.2f} ms, idle "
              f"{r['idle_ms']:.3f} ms ({100 * r['idle_frac']:.2f} %; gaps <5 us {g['lt_5us']:.3f}, "
              f"5-50 us {g['5_50us']:.3f}, >50 us {g['gt_50us']:.3f} ms; longest "
              f"{r['longest_gap_us']:.1f} us), {r['kernels']} kernels")
    print(f"median over {len(steps)} stretches: span {med['span_ms']:.2f} ms, busy "
          f"{med['busy_ms']:.2f} ms, idle {med['idle_ms']:.3f} ms = {100 * med['idle_frac']:.2f} % "
          f"of the span, {med['kernels']:.0f} kernels, longest gap {med['longest_gap_us']:.1f} us")


if __name__ == "__main__":
    main()
