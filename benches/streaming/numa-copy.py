"""Pinned host->device copy rate by the NUMA node the host buffer was allocated from.

The 16 GiB partly resident FLUX plan's copies ran at 37.8-55.5 GB/s each (median 44.1)
while the calibration's single pinned buffer copies at 55.5 GB/s, idle or beside any of
the model's kernels (crates/mold-exec/src/calibrate/copy.rs). This allocates COUNT
page-locked buffers of SIZE_MIB, each from a thread bound to one NUMA node in turn, and
times each buffer's copy to GPU 0 (median of 3 after one warm-up), so the rate can be
read against placement.
    python3 benches/streaming/numa-copy.py [COUNT] [SIZE_MIB]   -> JSON lines on stdout
"""
import glob, json, os, statistics, sys, time

import torch

count = int(sys.argv[1]) if len(sys.argv) > 1 else 16
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 512) << 20


def cpulist(path):
    out = []
    for part in open(path).read().strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


nodes = {}
for p in sorted(glob.glob("/sys/devices/system/node/node*/cpulist")):
    cpus = [c for c in cpulist(p) if c in os.sched_getaffinity(0)]
    if cpus:
        nodes[int(p.split("/node")[-1].split("/")[0])] = cpus
if not nodes:
    nodes = {0: sorted(os.sched_getaffinity(0))}
everything = os.sched_getaffinity(0)
dst = torch.empty(size, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
bufs = []
ids = sorted(nodes)
for i in range(count):
    node = ids[i % len(ids)]
    os.sched_setaffinity(0, nodes[node])
    b = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    b.fill_(1)
    bufs.append((node, b))
os.sched_setaffinity(0, everything)
rates = {}
for i, (node, b) in enumerate(bufs):
    dst.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(b, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    gbps = size / statistics.median(ts) / 1e9
    rates.setdefault(node, []).append(gbps)
    print(json.dumps({"buffer": i, "node": node, "gbps": round(gbps, 2)}))
print(json.dumps({"summary": {str(n): {"buffers": len(r), "min": round(min(r), 2),
                                       "median": round(statistics.median(r), 2),
                                       "max": round(max(r), 2)} for n, r in rates.items()},
                  "nodes": {str(n): len(c) for n, c in nodes.items()}}))
