#!/usr/bin/env python3
"""What was alive at the peak of device memory in use? Reads the memory CSV libtrace.so writes
under KERNEL_TRACE_MEMORY (every allocation and free the driver saw, every kernel launch and
copy, each with its API call's correlation id) and replays one device's allocations in the
order the host issued them. At the highest sum of bytes in use it lists the live allocations
grouped by what wrote them first (the next kernel or copy issued after the allocation on that
device): copies from the host are weights and stream buffers, kernels are activations and
temporaries. It prints the kernels issued just before the peak (the operation that reached it)
and, with --after NAME, also the peak after the first kernel whose name holds NAME (e.g. the
first GEMM, to leave loading out).

    python3 peak.py mem.csv [--device 0] [--top 25] [--around 12] [--json OUT]
"""
import argparse
import collections
import json
import re
import sys


def load(path, device):
    rows = []
    with open(path) as f:
        next(f, None)
        for line in f:
            parts = line.rstrip("\n").split(",", 7)
            if len(parts) < 8:
                continue
            corr, ts, dev, stream, op, addr, nbytes, name = parts
            if int(dev) != device:
                continue
            rows.append((int(corr), int(ts), op, int(addr), int(nbytes), name, int(stream)))
    # The host's order: correlation ids where the driver gave them, else the timestamps
    # (allocations are timed on the host, kernels on the GPU: only an approximation).
    if rows and all(r[0] == 0 for r in rows if r[2] in ("alloc", "free")):
        print("peak: no correlation ids on allocations; ordering by timestamps", file=sys.stderr)
        rows.sort(key=lambda r: r[1])
    else:
        rows.sort(key=lambda r: (r[0], r[1]))
    return rows


def short(name):
    """A kernel's name without templates and argument lists, at most 60 characters."""
    n = re.sub(r"^void ", "", name)
    n = re.sub(r"\((?!anonymous).*$", "", n)
    return n[:60]


def replay(rows, start=0):
    """The event index at which bytes in use peaked (from `start`), the peak and the bytes
    in use at `start`."""
    used = 0
    live = {}
    at_start = 0
    peak, peak_i = -1, None
    for i, (_, _, op, addr, nbytes, _, _) in enumerate(rows):
        if i == start:
            at_start = used
        if op == "alloc":
            live[addr] = nbytes
            used += nbytes
            if i >= start and used > peak:
                peak, peak_i = used, i
        elif op == "free":
            used -= live.pop(addr, 0)
    return peak_i, peak, at_start


def live_at(rows, upto):
    """Allocations alive just after event `upto`: address -> (bytes, event index)."""
    live = {}
    for i, (_, _, op, addr, nbytes, _, _) in enumerate(rows[: upto + 1]):
        if op == "alloc":
            live[addr] = (nbytes, i)
        elif op == "free":
            live.pop(addr, None)
    return live


def producers(rows):
    """For each allocation's event index, the first kernel or copy issued after it."""
    out = {}
    pending = []
    for i, r in enumerate(rows):
        if r[2] == "alloc":
            pending.append(i)
        elif r[2] in ("kernel", "memcpy"):
            label = short(r[5]) if r[2] == "kernel" else "copy " + {"kind1": "host->device"}.get(r[5], r[5])
            for j in pending:
                out[j] = label
            pending = []
    for j in pending:
        out[j] = "(nothing after it)"
    return out


def report(rows, peak_i, peak, top, around, title):
    live = live_at(rows, peak_i)
    prod = producers(rows)
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for _, (nbytes, i) in live.items():
        g = groups[prod.get(i, "?")]
        g[0] += nbytes
        g[1] += 1
        g[2][nbytes] += 1
    total = sum(g[0] for g in groups.values())
    weights = sum(g[0] for k, g in groups.items() if k.startswith("copy host->device"))
    print(f"== {title}: {peak / 1e9:.3f} GB in use at event {peak_i} "
          f"({len(live)} allocations; written by host copies {weights / 1e9:.3f} GB, "
          f"by kernels and others {(total - weights) / 1e9:.3f} GB)")
    print(f"   {'written first by':60s} {'MB':>9s} {'count':>6s}  largest sizes (MB x count)")
    for k, (b, n, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        sz = ", ".join(f"{s / 1e6:.1f}x{c}" for s, c in sorted(sizes.items(), key=lambda x: -x[0])[:4])
        print(f"   {k:60s} {b / 1e6:9.1f} {n:6d}  {sz}")
    print(f"   operations issued up to the peak:")
    lo = max(0, peak_i - around)
    for j, r in enumerate(rows[lo: peak_i + 3], lo):
        mark = ">>" if j == peak_i else "  "
        what = short(r[5]) if r[2] == "kernel" else r[5]
        size = f"{r[4] / 1e6:.1f} MB" if r[2] in ("alloc", "free", "memcpy") else ""
        print(f"   {mark} {r[2]:6s} {size:>11s} {what}")
    return {
        "title": title,
        "peak_bytes": peak,
        "host_copies_bytes": weights,
        "kernels_bytes": total - weights,
        "groups": {k: {"bytes": g[0], "count": g[1]} for k, g in groups.items()},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--around", type=int, default=12)
    ap.add_argument("--after", default=None, help="also the peak after the first kernel naming this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = load(a.trace, a.device)
    if not any(r[2] == "alloc" for r in rows):
        sys.exit(f"peak: no allocations on device {a.device} in {a.trace}")
    out = []
    i, p, _ = replay(rows)
    out.append(report(rows, i, p, a.top, a.around, "peak of the run"))
    if a.after:
        first = next((k for k, r in enumerate(rows) if r[2] == "kernel" and a.after in r[5]), None)
        if first is None:
            print(f"peak: no kernel naming {a.after!r}", file=sys.stderr)
        else:
            i, p, base = replay(rows, first)
            if i is None:
                print(f"peak: nothing allocated after the first {a.after!r} kernel", file=sys.stderr)
        if first is not None and i is not None:
            rep = report(rows, i, p, a.top, a.around, f"peak after the first {a.after!r} kernel")
            rep["in_use_at_start_bytes"] = base
            print(f"   in use when that kernel was issued: {base / 1e9:.3f} GB; growth to the peak "
                  f"{(p - base) / 1e6:.1f} MB")
            out.append(rep)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
