#!/usr/bin/env python3
"""Which work slows a host-to-device copy? Reads the CSV libtrace.so wrote (trace.c) and takes
every host-to-device copy of at least --min-mb (the weight ring's block copies: one
contiguous copy per streamed block). For each: its rate, and for how much of its duration the
GPU also ran matrix products, attention, other kernels, other host-to-device copies (candle's
small layout uploads, the checkpoint's loading), device-to-device copies and fills (classes as in classes.py).
Prints the copies, their rates' quartiles, the copy stream's idle time between them, the mean
overlap of the slowest and fastest third of the copies by class, and each class's correlation
with the copy's duration per byte: the class whose overlap goes with slow copies is the
suspect.

    python3 copies.py trace.csv [--device 0] [--min-mb 64] [--stream S] [--skip 0] [--list 40]
                               [--json]
"""
import argparse
import bisect
import json
import re
import statistics
import sys

from classes import classify, load

KIND = re.compile(r"kind(\d+)_(\d+)_bytes")
HTOD, DTOH, DTOD = 1, 2, 8
LANES = ("products", "attention", "other", "htod_other", "dtod", "dtoh", "memset")


def lane(kind, name):
    if kind == "memcpy":
        m = KIND.match(name)
        k = int(m.group(1)) if m else 0
        return {HTOD: "htod_other", DTOH: "dtoh", DTOD: "dtod"}.get(k, "dtod")
    if kind == "memset":
        return "memset"
    return classify(kind, name)


def merged(intervals):
    """The union of intervals, sorted and disjoint."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(union, starts, s, e):
    """How long the disjoint sorted intervals `union` cover [s, e)."""
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    t = 0
    while i < len(union) and union[i][0] < e:
        a, b = union[i]
        t += max(0, min(b, e) - max(a, s))
        i += 1
    return t


def pearson(xs, ys):
    if len(xs) < 3:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def analyse(ev, min_bytes, skip, stream=None):
    big, rest = [], {l: [] for l in LANES}
    for s, e, kind, name, stream in ev:
        m = KIND.match(name) if kind == "memcpy" else None
        if m and int(m.group(1)) == HTOD and int(m.group(2)) >= min_bytes:
            big.append((s, e, int(m.group(2)), stream))
        else:
            rest[lane(kind, name)].append((s, e))
    # The ring's copy stream: the stream of the last large copy unless named (the checkpoint's
    # loading copies run earlier, on the compute stream); the others count as other copies.
    if big and stream is None:
        stream = big[-1][3]
    for s, e, n, st in big:
        if st != stream:
            rest["htod_other"].append((s, e))
    big = [c for c in big if c[3] == stream][skip:]
    unions = {l: merged(v) for l, v in rest.items()}
    starts = {l: [a for a, _ in u] for l, u in unions.items()}
    copies = []
    for s, e, n, stream in big:
        d = e - s
        if d <= 0:
            continue
        frac = {l: overlap(unions[l], starts[l], s, e) / d for l in LANES}
        copies.append({"start_ns": s, "ms": d / 1e6, "mb": n / 1e6, "gbps": n / d,
                       "stream": stream, "overlap": frac})
    gaps = [b["start_ns"] - (a["start_ns"] + a["ms"] * 1e6) for a, b in zip(copies, copies[1:])]
    return copies, gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--min-mb", type=float, default=64)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N copies (loading)")
    ap.add_argument("--list", type=int, default=40)
    ap.add_argument("--stream", type=int, help="the copy stream (default: that of the last large copy)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ev = load(a.trace, a.device)
    copies, gaps = analyse(ev, a.min_mb * 1e6, a.skip, a.stream)
    if len(copies) < 3:
        sys.exit(f"copies.py: {len(copies)} host-to-device copies of >= {a.min_mb} MB; "
                 "lower --min-mb")
    rates = sorted(c["gbps"] for c in copies)
    q = statistics.quantiles(rates, n=4)
    by_rate = sorted(copies, key=lambda c: c["gbps"])
    third = max(1, len(copies) // 3)
    slow, fast = by_rate[:third], by_rate[-third:]
    mean = lambda cs, l: statistics.fmean(c["overlap"][l] for c in cs)
    per_byte = [c["ms"] / c["mb"] for c in copies]
    corr = {l: pearson([c["overlap"][l] for c in copies], per_byte) for l in LANES}
    total_mb = sum(c["mb"] for c in copies)
    total_ms = sum(c["ms"] for c in copies)
    summary = {
        "copies": len(copies),
        "gbps_quartiles": [rates[0], *q, rates[-1]],
        "gbps_while_copying": total_mb / total_ms,
        "idle_between_ms": {"sum": sum(max(g, 0) for g in gaps) / 1e6,
                            "median": statistics.median(gaps) / 1e6 if gaps else 0.0},
        "slow_third_overlap": {l: mean(slow, l) for l in LANES},
        "fast_third_overlap": {l: mean(fast, l) for l in LANES},
        "corr_with_ms_per_mb": corr,
    }
    if a.json:
        print(json.dumps({"summary": summary, "copies": copies}))
        return
    t0 = copies[0]["start_ns"]
    print(f"{'at ms':>9} {'MB':>7} {'ms':>7} {'GB/s':>6}  " + " ".join(f"{l[:9]:>9}" for l in LANES))
    for c in copies[: a.list]:
        print(f"{(c['start_ns'] - t0) / 1e6:9.2f} {c['mb']:7.1f} {c['ms']:7.3f} {c['gbps']:6.1f}  "
              + " ".join(f"{c['overlap'][l]:9.2f}" for l in LANES))
    r = summary["gbps_quartiles"]
    print(f"{len(copies)} copies: {summary['gbps_while_copying']:.1f} GB/s while copying; per copy "
          f"min {r[0]:.1f}, quartiles {r[1]:.1f} / {r[2]:.1f} / {r[3]:.1f}, max {r[4]:.1f} GB/s")
    g = summary["idle_between_ms"]
    print(f"idle between copies: {g['sum']:.2f} ms in all, median {g['median']:.3f} ms")
    print("overlap (share of the copy's time)  " + " ".join(f"{l[:9]:>9}" for l in LANES))
    for label, key in (("slowest third", "slow_third_overlap"), ("fastest third", "fast_third_overlap")):
        print(f"  {label:<33} " + " ".join(f"{summary[key][l]:9.2f}" for l in LANES))
    print("  corr. with ms per MB              " + " ".join(f"{corr[l]:9.2f}" for l in LANES))


if __name__ == "__main__":
    main()
