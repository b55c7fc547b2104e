"""Where a checkpoint load's time can go on this machine: host reads of safetensors files
already in the page cache, by mmap copies into fresh arrays (as candle's reader does) and by
pread into reused buffers, on 1 to 16 threads; then host-to-device copies from pageable and
page-locked memory. Prints one line per measure.
    python3 benches/load/probe.py FILE [FILE ...]
"""
import mmap, os, sys, threading, time

import numpy as np

files = sys.argv[1:]
sizes = [os.path.getsize(f) for f in files]
total = sum(sizes)
CHUNK = 64 << 20


def chunks():
    for f, n in zip(files, sizes):
        for off in range(0, n, CHUNK):
            yield f, off, min(CHUNK, n - off)


def run(threads, work):
    items = list(chunks())
    lock = threading.Lock()
    it = iter(items)

    def worker():
        state = {}
        while True:
            with lock:
                x = next(it, None)
            if x is None:
                return
            work(state, *x)

    t = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    [x.start() for x in ts]
    [x.join() for x in ts]
    return total / (time.perf_counter() - t) / 1e9


fds = {f: os.open(f, os.O_RDONLY) for f in files}
maps = {f: mmap.mmap(fds[f], 0, prot=mmap.PROT_READ) for f in files}


def pread_reused(state, f, off, n):
    buf = state.setdefault("buf", bytearray(CHUNK))
    mv = memoryview(buf)[:n]
    got = os.preadv(fds[f], [mv], off)
    assert got == n


def pread_fresh(state, f, off, n):
    buf = np.empty(n, np.uint8)
    os.preadv(fds[f], [memoryview(buf)], off)


def mmap_fresh(state, f, off, n):
    src = np.frombuffer(maps[f], np.uint8, n, off)
    dst = np.empty(n, np.uint8)
    np.copyto(dst, src)


def mmap_reused(state, f, off, n):
    dst = state.setdefault("buf", np.empty(CHUNK, np.uint8))
    np.copyto(dst[:n], np.frombuffer(maps[f], np.uint8, n, off))


print(f"files: {len(files)}, {total / 1e9:.2f} GB, cpus {os.cpu_count()}")
run(16, pread_reused)  # warm the page cache
for name, w in [("pread, reused buffer", pread_reused), ("pread, fresh buffer", pread_fresh),
                ("mmap copy, fresh buffer", mmap_fresh), ("mmap copy, reused buffer", mmap_reused)]:
    for th in (1, 4, 8, 16):
        print(f"host read {name:26} {th:2} threads: {run(th, w):6.2f} GB/s", flush=True)

try:
    import torch
    n = 1 << 30
    for kind in ("pageable", "pinned"):
        h = torch.empty(n, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        h.fill_(1)
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        d.copy_(h); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        print(f"host to device, {kind:8}, 1 GiB: {5 * n / (time.perf_counter() - t) / 1e9:6.2f} GB/s")
except Exception as e:  # no torch or no GPU: the host figures stand alone
    print(f"host to device: not measured ({e})")
