#!/usr/bin/env python3
"""Where the GPU waits: the longest idle gaps of one device's timeline, each with the work
before and after it, and the gaps summed by the kernel they follow. Reads the CSV libtrace.so
wrote (trace.c; gzipped or not). Unlike gaps.py and classes.py it does not split the timeline
into steps, so a wait longer than their --split-ms (a long stall inside a step, an exchange
that hangs for milliseconds) shows here too.

    python3 waits.py trace.csv[.gz] [--device 0] [--min-us 20] [--list 15] [--last-ms 0]

--last-ms N looks only at the last N ms of the device's timeline (the last steps of a run);
0 looks at all of it.
"""
import argparse
import collections
import sys

from classes import load


def waits(ev, min_ns):
    """Idle gaps of the device (no kernel, copy or fill running on any stream) of at least
    min_ns: (gap_ns, event before, event after)."""
    out, end, last = [], None, None
    for x in ev:
        if end is not None and x[0] - end >= min_ns:
            out.append((x[0] - end, last, x))
        if end is None or x[1] > end:
            end, last = x[1], x
    return out


def short(name, n=60):
    return name if len(name) <= n else name[: n - 1] + "…"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--list", type=int, default=15)
    p.add_argument("--last-ms", type=float, default=0.0)
    a = p.parse_args()
    ev = load(a.trace, a.device)
    if not ev:
        sys.exit(f"waits.py: no events for device {a.device}")
    if a.last_ms > 0:
        cut = max(x[1] for x in ev) - int(a.last_ms * 1e6)
        ev = [x for x in ev if x[0] >= cut]
    w = waits(ev, int(a.min_us * 1e3))
    span = (max(x[1] for x in ev) - ev[0][0]) / 1e6
    total = sum(g for g, *_ in w) / 1e6
    print(f"device {a.device}: {span:.1f} ms traced, {len(w)} idle gaps of {a.min_us:g} µs or more, "
          f"{total:.2f} ms in all")
    print("the longest (ms, after -> before):")
    for g, b, n in sorted(w, key=lambda t: -t[0])[: a.list]:
        print(f"  {g / 1e6:8.3f}  {short(b[3])} -> {short(n[3])}")
    by = collections.Counter()
    count = collections.Counter()
    for g, b, _ in w:
        by[short(b[3], 48)] += g
        count[short(b[3], 48)] += 1
    print("summed by the work they follow (ms, gaps):")
    for k, g in by.most_common(a.list):
        print(f"  {g / 1e6:8.3f}  {count[k]:5d}  {k}")


if __name__ == "__main__":
    main()
