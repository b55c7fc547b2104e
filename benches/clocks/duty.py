#!/usr/bin/env python3
"""Do a GPU's kernels run faster when it is idle part of the time? Under sustained load an
H200 sits at its power cap and lowers its clocks (benches/clocks/sustained.py: operations back
to back take 7-14 % longer than alone). A GPU that works only part of a step -- a block split's
stage while the other stage runs (CFG passes in turn), a tensor-parallel rank waiting on its
peer -- may run its kernels at higher clocks than the calibration's sustained timing assumes.

This runs Qwen-Image's block mix at 1328^2 (its largest product 6,889 x 12,288 -> 3,072, then
attention 24 heads x 7,401 x 128, bf16, cuDNN SDPA where PyTorch has it) in busy windows of
--busy-ms, each followed by an idle gap (a synchronise, then the host sleeps) so that the GPU is
busy a share d of the time, for d in --duties, each for --seconds; per d, the median time of one
product+attention pair over the windows of the last half (CUDA events), and its ratio to d = 1.
Sample the clocks beside it (benches/lib/env.sh's smi_sample) to see why.

    python3 duty.py [--busy-ms 120] [--duties 1,0.75,0.5,0.25] [--seconds 6]

Prints one JSON line per duty.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-ms", type=float, default=120.0)
    ap.add_argument("--duties", default="1,0.75,0.5,0.25")
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    dt = torch.bfloat16
    x = torch.randn(6889, 12288, device="cuda", dtype=dt)
    w = torch.randn(3072, 12288, device="cuda", dtype=dt)
    q, k, v = (torch.randn(1, 24, 7401, 128, device="cuda", dtype=dt) for _ in range(3))

    def pair():
        y = F.linear(x, w)
        o = F.scaled_dot_product_attention(q, k, v)
        return y, o

    for _ in range(20):
        pair()
    torch.cuda.synchronize()
    base = None
    for d in [float(s) for s in a.duties.split(",")]:
        idle_s = a.busy_ms / 1e3 * (1 - d) / d
        windows = []
        t_end = time.time() + a.seconds
        while time.time() < t_end:
            evs = []
            t0 = time.time()
            while (time.time() - t0) * 1e3 < a.busy_ms:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                pair()
                e.record()
                evs.append((s, e))
                if len(evs) % 8 == 0:
                    evs[-8][1].synchronize()  # keep the host at most 8 pairs ahead
            torch.cuda.synchronize()
            windows.append([s.elapsed_time(e) for s, e in evs])
            if idle_s > 0:
                time.sleep(idle_s)
        half = windows[len(windows) // 2:]
        per = statistics.median(t for w_ in half for t in w_)
        first = statistics.median(w_[0] for w_ in half)
        if base is None:
            base = per
        print(json.dumps({
            "duty": d, "busy_ms": a.busy_ms, "idle_ms": round(idle_s * 1e3, 1),
            "pair_ms_median": round(per, 4), "ratio_to_full_load": round(per / base, 4),
            "first_pair_of_window_ms": round(first, 4), "windows": len(windows),
        }), flush=True)


if __name__ == "__main__":
    main()
