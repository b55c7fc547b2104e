#!/usr/bin/env python3
"""One VAE decode's kernels from Nsight Compute (`ncu --csv --print-units base --metrics
gpu__time_duration.sum` over `vae_bench --iters 1`: two identical decodes after the load).
The last decode is the longest tail of launches that repeats the launches just before it;
prints its kernels in order and the time per kind (cuDNN convolution, mold's group norm,
softmax, interleave/upsample, cuBLAS, candle's other kernels).

    python3 benches/vae/ncu_decode.py ncu.csv
"""
import csv
import re
import sys
from collections import defaultdict

KINDS = [
    ("group norm (mold)", re.compile(r"mold_gn_")),
    ("softmax (mold)", re.compile(r"mold_softmax")),
    ("interleave/upsample (mold)", re.compile(r"mold_(interleave|upsample)")),
    ("convolution (cuDNN)", re.compile(r"fprop|conv|implicit|cudnn", re.I)),
    ("matmul (cuBLAS)", re.compile(r"nvjet|gemm|cublas|xmma|cutlass", re.I)),
]


def kind(name):
    for k, r in KINDS:
        if r.search(name):
            return k
    return "other (candle)"


def main(path):
    launches = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        launches.append((r.get("Kernel Name", "?"), ns))
    names = [n for n, _ in launches]
    n = len(names)
    d = next((d for d in range(n // 2, 0, -1) if names[n - d:] == names[n - 2 * d:n - d]), 0)
    if d == 0:
        print(f"ncu: {n} launches, no repeated decode found")
        return 1
    last = launches[n - d:]
    total = sum(ns for _, ns in last)
    print(f"ncu: {n} launches; one decode = the last {d}: {total / 1e6:.2f} ms of kernel time")
    by = defaultdict(lambda: [0.0, 0])
    for i, (name, ns) in enumerate(last):
        k = kind(name)
        by[k][0] += ns
        by[k][1] += 1
        print(f"  {i:4d} {ns / 1e3:9.1f} us  {k:28s} {name[:100]}")
    for k, (ns, c) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  total {ns / 1e6:8.3f} ms {c:4d}x  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
