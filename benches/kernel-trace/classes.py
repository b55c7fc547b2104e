#!/usr/bin/env python3
"""Where a step's GPU time goes, by kind of kernel. Reads the CSV libtrace.so wrote (trace.c),
splits the timeline into steps at idle gaps longer than --split-ms (as gaps.py does), and for
each stretch of at least --min-kernels kernels sums the kernels' own durations by class:

    products   matrix products (cuBLAS / cuBLASLt / CUTLASS kernels)
    attention  fused attention (cuDNN's SDPA graphs, FlashAttention)
    other      every other kernel (element-wise, norms, RoPE, layout copies, reductions)

plus memory copies and fills, the GPU's idle time inside the step, and the kernels that took
the most time. The summary is the median over the stretches; --per N divides it by N (the
blocks a step runs, say) to set it beside the cost model's per-block figures.

    python3 classes.py trace.csv [--device 0] [--split-ms 2] [--min-kernels 500] [--per 120]
                                 [--top 15] [--kernels-only] [--json]
"""
import argparse
import collections
import gzip
import json
import re
import statistics
import sys

PRODUCT = re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|sm90_xmma|s16816|h16816", re.I)
ATTENTION = re.compile(r"sdpa|fmha|flash|attn|attention|cudnn", re.I)
CLASSES = ("products", "attention", "other", "copies")


def classify(kind, name):
    if kind != "kernel":
        return "copies"
    if ATTENTION.search(name):
        return "attention"
    if PRODUCT.search(name):
        return "products"
    return "other"


def load(path, device):
    # The trace as libtrace.so wrote it, or gzipped (as benches/step-trace keeps it).
    opener = gzip.open if path.endswith(".gz") else open
    ev = []
    with opener(path, "rt", newline="") as f:
        header = f.readline()
        if not header.startswith("start_ns"):
            sys.exit(f"classes.py: {path} is not a kernel-trace CSV (header {header.strip()!r})")
        for line in f:
            # The name is the last field and may hold commas (C++ signatures).
            parts = line.rstrip("\n").split(",", 5)
            if len(parts) < 6:
                continue
            s, e, dev, stream, kind, name = parts
            if int(dev) != device:
                continue
            s, e = int(s), int(e)
            if e >= s > 0:
                ev.append((s, e, kind, name, int(stream)))
    ev.sort()
    return ev


def stretches(ev, split_ns):
    out, cur, busy_end = [], [], None
    for x in ev:
        if cur and x[0] - busy_end > split_ns:
            out.append(cur)
            cur, busy_end = [], None
        cur.append(x)
        busy_end = x[1] if busy_end is None else max(busy_end, x[1])
    if cur:
        out.append(cur)
    return out


def short(name):
    """A kernel's name without its template arguments and parameter list."""
    n = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()[:90] or name[:90]


def analyse(st):
    span = max(x[1] for x in st) - st[0][0]
    by_class = dict.fromkeys(CLASSES, 0)
    count = dict.fromkeys(CLASSES, 0)
    names = collections.Counter()
    for s, e, kind, name, _ in st:
        c = classify(kind, name)
        by_class[c] += e - s
        count[c] += 1
        names[(c, short(name))] += e - s
    # GPU idle: the span less the union of every interval.
    busy, cs, ce = 0, st[0][0], st[0][1]
    for s, e, *_ in st[1:]:
        if s > ce:
            busy += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    return {
        "span_ms": span / 1e6,
        "idle_ms": (span - busy) / 1e6,
        "ms": {c: v / 1e6 for c, v in by_class.items()},
        "count": count,
        "top": [(c, n, t / 1e6) for (c, n), t in names.most_common()],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--split-ms", type=float, default=2.0)
    ap.add_argument("--min-kernels", type=int, default=500)
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--kernels-only", action="store_true",
                    help="leave copies and fills out (a weight ring's copies bridge the steps)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.per <= 0:
        sys.exit("classes.py: --per must be positive")
    ev = load(a.trace, a.device)
    if a.kernels_only:
        ev = [x for x in ev if x[2] == "kernel"]
    if not ev:
        sys.exit(f"classes.py: no events for device {a.device} in {a.trace}")
    rows = [analyse(st) for st in stretches(ev, a.split_ms * 1e6)]
    steps = [r for r in rows if sum(r["count"][c] for c in CLASSES[:3]) >= a.min_kernels]
    if not steps:
        sys.exit(f"classes.py: no stretch of >= {a.min_kernels} kernels; lower --min-kernels "
                 "or raise --split-ms")
    med = {
        "span_ms": statistics.median(r["span_ms"] for r in steps) / a.per,
        "idle_ms": statistics.median(r["idle_ms"] for r in steps) / a.per,
        "ms": {c: statistics.median(r["ms"][c] for r in steps) / a.per for c in CLASSES},
        "count": {c: statistics.median(r["count"][c] for r in steps) / a.per for c in CLASSES},
    }
    # The kernels that took the most time, median over the steps.
    totals = collections.defaultdict(list)
    for r in steps:
        for c, n, t in r["top"]:
            totals[(c, n)].append(t)
    top = sorted(((statistics.median(v + [0.0] * (len(steps) - len(v))) / a.per, c, n)
                  for (c, n), v in totals.items()), reverse=True)[: a.top]
    if a.json:
        print(json.dumps({"steps": len(steps), "median": med,
                          "top": [{"class": c, "name": n, "ms": t} for t, c, n in top]}))
        return
    unit = "" if a.per == 1 else f" (per 1/{a.per:g} of a step)"
    print(f"{len(steps)} steps; median{unit}: span {med['span_ms']:.3f} ms, idle "
          f"{med['idle_ms']:.3f} ms")
    for c in CLASSES:
        print(f"  {c:<9} {med['ms'][c]:9.3f} ms  {med['count'][c]:8.1f} launches")
    print("the kernels that took the most time (median ms per step" + unit + "):")
    for t, c, n in top:
        print(f"  {t:9.3f}  {c:<9} {n}")


if __name__ == "__main__":
    main()
