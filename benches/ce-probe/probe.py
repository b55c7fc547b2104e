#!/usr/bin/env python3
"""Copy engines between two GPUs against NCCL, for TP2's row-parallel sums (issue 38).

On cuda:0 and cuda:1 of one process, with peer access on:
  1. a peer copy by `cudaMemcpyAsync` (the copy engines, no SM) by size: pulled and pushed,
     one way and both ways at once; NCCL's all-reduce of the same size (torch.cuda.nccl);
  2. a FLUX TP2 row-parallel product (4608 tokens, K = 1536 or 6144, N = 3072, bf16) alone,
     the same with 28 MB peer copies running beside it on another stream;
  3. the product and the sum of the two ranks' partials: product then NCCL all-reduce;
     product then one peer copy and an add; the product in C token chunks with chunk i's copy
     under chunk i+1's product, then one add.
Each device first runs a sleep kernel so that the host has queued the whole measured work before
the GPU reaches it (launch costs are not timed); times are CUDA events, per device, the slower
device's, median of 20. Raw copies by ctypes: PyTorch's own cross-device copy_ makes each
device's stream wait for the other's, which serialises what this measures.
Usage: python3 probe.py
"""
import ctypes
import glob
import os
import site
import statistics

import torch
import torch.cuda.nccl as tnccl

assert torch.cuda.device_count() >= 2, "needs two GPUs"
BF = torch.bfloat16
HID, TOK = 3072, 4608
SLEEP = 6_000_000  # cycles, ~3 ms


def cudart():
    for d in site.getsitepackages() + [os.path.dirname(torch.__file__)]:
        for p in sorted(glob.glob(f"{d}/nvidia/*/lib/libcudart.so*")
                        + glob.glob(f"{d}/lib/libcudart*.so*")):
            try:
                return ctypes.CDLL(p)
            except OSError:
                pass
    for n in ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    raise SystemExit("no libcudart")


RT = cudart()
RT.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                               ctypes.c_void_p]


def ce(dst, src, stream):
    """dst <- src on `stream` by the copy engines (cudaMemcpyDefault, UVA)."""
    with torch.cuda.device(stream.device):
        r = RT.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                               4, stream.cuda_stream)
    assert r == 0, f"cudaMemcpyAsync: {r}"


D = [torch.device("cuda:0"), torch.device("cuda:1")]
print("GPUs:", torch.cuda.get_device_name(0), "| peer access:",
      torch.cuda.can_device_access_peer(0, 1), torch.cuda.can_device_access_peer(1, 0))
# Turn peer access on (PyTorch enables it on its first peer copy).
torch.ones(4, device=D[0]).copy_(torch.ones(4, device=D[1]))
torch.ones(4, device=D[1]).copy_(torch.ones(4, device=D[0]))
torch.cuda.synchronize(0)
torch.cuda.synchronize(1)
MAIN = [torch.cuda.Stream(device=d) for d in D]
SIDE = [torch.cuda.Stream(device=d, priority=-1) for d in D]


def timed(fn, reps=20, warm=3):
    ts = []
    for i in range(reps + warm):
        starts, ends = [], []
        slept = []
        for g in (0, 1):
            with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                torch.cuda._sleep(SLEEP)
                ev = torch.cuda.Event()
                ev.record(MAIN[g])
                slept.append(ev)
        # Both devices start when the later one's sleep ends (the host queued them apart).
        for g in (0, 1):
            with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                MAIN[g].wait_event(slept[1 - g])
                s = torch.cuda.Event(enable_timing=True)
                s.record(MAIN[g])
                starts.append(s)
                SIDE[g].wait_stream(MAIN[g])
        fn()
        for g in (0, 1):
            with torch.cuda.device(g):
                MAIN[g].wait_stream(SIDE[g])
                e = torch.cuda.Event(enable_timing=True)
                e.record(MAIN[g])
                ends.append(e)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= warm:
            ts.append(max(starts[g].elapsed_time(ends[g]) for g in (0, 1)) * 1e3)
    return statistics.median(ts)


def cross_wait(stream, g_from):
    """`stream` waits for what MAIN[g_from] has queued so far."""
    with torch.cuda.device(g_from):
        ev = torch.cuda.Event()
        ev.record(MAIN[g_from])
    stream.wait_event(ev)


print("\n== peer copy by the copy engines, and NCCL's all-reduce (µs; GB/s a direction) ==")
for mb in [0.07, 1, 4, 7, 14, 28]:
    n = int(mb * 2**20 / 2)
    a = [torch.randn(n, device=d, dtype=BF) for d in D]
    b = [torch.empty(n, device=d, dtype=BF) for d in D]

    def prep():
        for g in (0, 1):
            cross_wait(SIDE[g], 1 - g)

    def pull1():
        prep()
        ce(b[0], a[1], SIDE[0])

    def push1():
        prep()
        ce(b[0], a[1], SIDE[1])

    def pull2():
        prep()
        ce(b[0], a[1], SIDE[0])
        ce(b[1], a[0], SIDE[1])

    def push2():
        prep()
        ce(b[1], a[0], SIDE[0])
        ce(b[0], a[1], SIDE[1])

    def nccl():
        with torch.cuda.device(0):
            tnccl.all_reduce(a, streams=MAIN)

    byt = n * 2
    row = f"{mb:6.2f} MB"
    for name, f in [("pull", pull1), ("push", push1), ("pull both ways", pull2),
                    ("push both ways", push2), ("NCCL all-reduce", nccl)]:
        t = timed(f)
        row += f" | {name} {t:6.1f} ({byt / t / 1e3:4.0f})"
    print(row, flush=True)

print("\n== a product with copies beside it (µs) ==")
big = [torch.randn(TOK * HID, device=d, dtype=BF) for d in D]
land = [torch.empty_like(x) for x in big]
for k in [1536, 6144]:
    x = [torch.randn(TOK, k, device=d, dtype=BF) for d in D]
    w = [torch.randn(k, HID, device=d, dtype=BF) / k**0.5 for d in D]
    o = [torch.empty(TOK, HID, device=d, dtype=BF) for d in D]

    def prod():
        for g in (0, 1):
            with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                torch.mm(x[g], w[g], out=o[g])

    def copies():
        for g in (0, 1):
            cross_wait(SIDE[g], 1 - g)
        for g in (0, 1):
            ce(land[g], big[1 - g], SIDE[g])

    def both():
        copies()
        prod()

    def pushes():
        for g in (0, 1):
            ce(land[1 - g], big[g], SIDE[g])

    def both_push():
        pushes()
        prod()

    tp, tc, tb = timed(prod), timed(copies), timed(both)
    tq, tr = timed(pushes), timed(both_push)
    print(f"K={k:5d}: product {tp:6.1f} | 28 MB pulled both ways {tc:6.1f} | beside each other "
          f"{tb:6.1f} (max {max(tp, tc):6.1f}, sum {tp + tc:6.1f}) | pushed both ways {tq:6.1f}"
          f" | beside the product {tr:6.1f}", flush=True)

print("\n== row-parallel product + sum over 2 GPUs (µs) ==")
for k in [1536, 6144]:
    x = [torch.randn(TOK, k, device=d, dtype=BF) for d in D]
    w = [torch.randn(k, HID, device=d, dtype=BF) / k**0.5 for d in D]
    part = [torch.empty(TOK, HID, device=d, dtype=BF) for d in D]
    recv = [torch.empty(TOK, HID, device=d, dtype=BF) for d in D]
    out = [torch.empty(TOK, HID, device=d, dtype=BF) for d in D]

    def alone():
        for g in (0, 1):
            with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                torch.mm(x[g], w[g], out=part[g])

    def with_nccl():
        alone()
        with torch.cuda.device(0):
            tnccl.all_reduce(part, streams=MAIN)

    def chunked(c):
        def run():
            rows = TOK // c
            for i in range(c):
                sl = slice(i * rows, (i + 1) * rows)
                evs = []
                for g in (0, 1):
                    with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                        torch.mm(x[g][sl], w[g], out=part[g][sl])
                        ev = torch.cuda.Event()
                        ev.record(MAIN[g])
                        evs.append(ev)
                for g in (0, 1):
                    SIDE[g].wait_event(evs[1 - g])
                    ce(recv[g][sl], part[1 - g][sl], SIDE[g])
            for g in (0, 1):
                with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                    MAIN[g].wait_stream(SIDE[g])
                    torch.add(part[g], recv[g], out=out[g])
        return run

    def pushed(c):
        def run():
            rows = TOK // c
            done = [torch.cuda.Event() for _ in D]
            for i in range(c):
                sl = slice(i * rows, (i + 1) * rows)
                for g in (0, 1):
                    with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                        torch.mm(x[g][sl], w[g], out=part[g][sl])
                        SIDE[g].wait_stream(MAIN[g])
                        ce(recv[1 - g][sl], part[g][sl], SIDE[g])
            for g in (0, 1):
                with torch.cuda.device(g):
                    done[g].record(SIDE[g])
            for g in (0, 1):
                with torch.cuda.device(g), torch.cuda.stream(MAIN[g]):
                    MAIN[g].wait_event(done[1 - g])
                    torch.add(part[g], recv[g], out=out[g])
        return run

    ta = timed(alone)
    tn = timed(with_nccl)
    row = f"K={k:5d}: product {ta:6.1f} | + NCCL all-reduce {tn:6.1f} (+{tn - ta:5.1f})"
    for c in [1, 2, 4, 8]:
        tc = timed(chunked(c))
        row += f" | {c} chunk(s) pulled {tc:6.1f} (+{tc - ta:5.1f})"
    for c in [1, 2, 4, 8]:
        tc = timed(pushed(c))
        row += f" | {c} chunk(s) pushed {tc:6.1f} (+{tc - ta:5.1f})"
    chunked(4)()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    ref = part[0].float() + part[1].to(D[0]).float()
    err = (out[0].float() - ref).abs().max().item() / ref.abs().max().item()
    print(row + f" | rel err {err:.1e}, ranks equal {torch.equal(out[0], out[1].to(D[0]))}",
          flush=True)
