#!/usr/bin/env python3
"""Does a small host-to-device upload on one stream wait for a large host-to-device copy in
flight on another? mold's weight ring copies a block (up to 680 MB for flux-dev) on a copy
stream while the compute stream runs; candle uploads a few dozen bytes (a strided kernel's
dims and strides, a new small tensor) before some kernels, and the model's inputs come from
the host in some paths. Measured with PyTorch on one GPU:

  big copy alone           pinned, one call, on stream A
  + small upload           1 ms after the big copy starts, on stream B: the upload's
                           completion as a time after the big copy's start; pageable
                           (as candle's are) and pinned
  + chunked big copy       the same bytes in --chunk-mb pieces (one call each), so the
                           engine can take the small upload between two pieces

    python3 upload-behind-copy.py [--mb 680] [--small-bytes 72] [--chunk-mb 32] [--reps 5]

Prints one JSON line per case: medians over --reps of the big copy's time, the small
upload's completion after the big copy's start, and the big copy's rate.
"""
import argparse
import json
import statistics
import time

import torch


def case(big_src, big_dst, small, chunk, stream_a, stream_b, delay_s):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream_a):
        ev[0].record(stream_a)
        if chunk:
            n = big_src.numel()
            for s in range(0, n, chunk):
                big_dst[s:s + chunk].copy_(big_src[s:s + chunk], non_blocking=True)
        else:
            big_dst.copy_(big_src, non_blocking=True)
        ev[1].record(stream_a)
    up_ms = None
    if small is not None:
        time.sleep(delay_s)
        with torch.cuda.stream(stream_b):
            ev[2].record(stream_b)
            small.to("cuda", non_blocking=True)
            ev[3].record(stream_b)
    torch.cuda.synchronize()
    big_ms = ev[0].elapsed_time(ev[1])
    if small is not None:
        up_ms = ev[0].elapsed_time(ev[3])
    return big_ms, up_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=680)
    ap.add_argument("--small-bytes", type=int, default=72)
    ap.add_argument("--chunk-mb", type=float, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    a = ap.parse_args()
    n = int(a.mb * 1e6)
    big_src = torch.empty(n, dtype=torch.uint8).pin_memory()
    big_dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    small_pageable = torch.arange(a.small_bytes, dtype=torch.uint8)
    small_pinned = small_pageable.pin_memory()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    chunk = int(a.chunk_mb * 1e6)
    cases = [
        ("big copy alone", None, 0),
        ("+ small pageable upload", small_pageable, 0),
        ("+ small pinned upload", small_pinned, 0),
        (f"chunked {a.chunk_mb:g} MB + small pageable upload", small_pageable, chunk),
        (f"chunked {a.chunk_mb:g} MB + small pinned upload", small_pinned, chunk),
    ]
    case(big_src, big_dst, small_pageable, 0, sa, sb, a.delay_ms / 1e3)  # warm-up
    for name, small, ch in cases:
        runs = [case(big_src, big_dst, small, ch, sa, sb, a.delay_ms / 1e3) for _ in range(a.reps)]
        big = statistics.median(r[0] for r in runs)
        out = {"case": name, "big_copy_ms": round(big, 3), "big_gbps": round(n / big / 1e6, 1)}
        if small is not None:
            out["small_done_after_start_ms"] = round(statistics.median(r[1] for r in runs), 3)
            out["small_issued_after_ms"] = a.delay_ms
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
