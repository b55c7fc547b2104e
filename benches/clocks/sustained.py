#!/usr/bin/env python3
"""Does an operation timed alone (a synchronise after each run, as `mold devices --calibrate`
times it) take what it takes inside a step, where operations run back to back? On a GPU at
its power cap the clocks fall under sustained load. For Qwen-Image's attention (24 heads x
7,401 tokens x 128, cuDNN's SDPA where PyTorch has it) and its largest product (6,889 x 12,288
-> 3,072, bf16), with PyTorch:

  alone        3 warm-ups, then 10 runs, each followed by a synchronise (wall clock): median
  sustained    the same op back to back for --seconds, in rounds of about 20 ms (CUDA
               events): the median per-run time over the last half of the rounds
  mixed        product then attention, back to back (as a block interleaves them), per pair,
               over the last half; set beside the sum of the two alone

    python3 sustained.py [--seconds 2]

Prints one JSON line per op and mode. Sample the clocks beside it (benches/lib/env.sh's
smi_sample) to see them settle.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def attention_op():
    q, k, v = (torch.randn(1, 24, 7401, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    except ImportError:
        sdpa_kernel = None

    def run():
        if sdpa_kernel is None:
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def product_op():
    x = torch.randn(6889, 12288, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 12288, device="cuda", dtype=torch.bfloat16)
    return lambda: x @ w.t()


def alone(f, warmup=3, iters=10):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def sustained(fs, seconds, round_s=0.02):
    """Per-iteration ms of running every f in `fs` once, back to back, over the last half of
    the rounds; with the rounds' count and size."""
    t1 = sum(alone(f, 1, 3) for f in fs) / 1e3
    per = max(1, int(round_s / t1))
    rounds, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per):
            for f in fs:
                f()
        b.record()
        b.synchronize()
        rounds.append(a.elapsed_time(b) / per)
    last = rounds[len(rounds) // 2:]
    return statistics.median(last), len(rounds), per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    ops = {"attention 24x7401x128": attention_op(), "product 6889x12288->3072": product_op()}
    al = {}
    for name, f in ops.items():
        al[name] = alone(f)
        print(json.dumps({"op": name, "mode": "alone", "ms": round(al[name], 4)}), flush=True)
        time.sleep(1.0)
        ms, n, per = sustained([f], a.seconds)
        print(json.dumps({"op": name, "mode": "sustained", "ms": round(ms, 4), "rounds": n,
                          "per_round": per, "vs_alone": round(ms / al[name], 3)}), flush=True)
        time.sleep(1.0)
    ms, n, per = sustained(list(ops.values()), a.seconds)
    print(json.dumps({"op": "product + attention", "mode": "mixed", "ms": round(ms, 4),
                      "alone_sum_ms": round(sum(al.values()), 4),
                      "vs_alone": round(ms / sum(al.values()), 3)}), flush=True)


if __name__ == "__main__":
    main()
