#!/usr/bin/env python3
"""Does the GPU's L2 cache explain why element-wise kernels run faster by themselves than
inside a block? mold's sustained element-wise timing repeats one kernel over the same
(rows, width) tensors; at FLUX's 4608 x 3072 in bf16 that is 28 MB, inside an H100/H200's
50 MB L2. Inside a block, matrix products between the element-wise kernels stream their
weights and activations through L2 and evict it. This times one modulation kernel
(y = x * (1 + scale) + shift, bf16) three ways, in one process, CUDA events, median of rounds:

  same      the same x and y each time (what the sustained timing does)
  rotating  x and y taken in turn from N pairs that together exceed L2 four times
  gemm      the same x and y, with a (rows x width) @ (width x 4·width) product between
            (the block's mix: the product's operands and result pass through L2)

and prints GB/s each (bytes read and written by the element-wise kernel over its own time;
in the gemm case the kernel is timed alone between two events around it).

    python3 elementwise-l2.py [--rows 4608] [--width 3072] [--iters 200]
"""
import argparse
import statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4608)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    dt = torch.bfloat16
    shape = (1, a.rows, a.width)
    nbytes = a.rows * a.width * 2
    scale = torch.randn(1, 1, a.width, device=dev, dtype=dt)
    shift = torch.randn(1, 1, a.width, device=dev, dtype=dt)
    pairs = max(2, (4 * l2) // (2 * nbytes) + 1)
    xs = [torch.randn(shape, device=dev, dtype=dt) for _ in range(pairs)]
    ys = [torch.empty(shape, device=dev, dtype=dt) for _ in range(pairs)]
    w = torch.randn(a.width, 4 * a.width, device=dev, dtype=dt)

    def kernel(x, y):
        torch.addcmul(shift, x, 1 + scale, out=y)

    def timed(case):
        times = []
        for i in range(a.iters + 10):
            k = i % pairs if case == "rotating" else 0
            if case == "gemm":
                torch.matmul(xs[0].view(a.rows, a.width), w)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            kernel(xs[k], ys[k])
            e.record()
            if i >= 10:
                times.append((s, e))
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in times)
        return 2 * nbytes / (ms / 1e3) / 1e9, ms

    print(f"device {props.name}, L2 {l2 / 2**20:.0f} MiB, tensor {nbytes / 1e6:.1f} MB, "
          f"{pairs} pairs when rotating ({2 * pairs * nbytes / 1e6:.0f} MB)")
    for case in ("same", "rotating", "gemm", "same"):
        gbps, ms = timed(case)
        print(f"elementwise-l2 {case:9s} {ms * 1e3:8.1f} us  {gbps:7.0f} GB/s")


if __name__ == "__main__":
    main()
