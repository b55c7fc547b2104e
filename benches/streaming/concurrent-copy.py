"""Pinned host->device copies to every GPU at once against each GPU alone (issue 19): does
the host share one rate among the GPUs streaming at the same moment? The calibration times
each device's copy alone; a plan streaming on several GPUs at once (tensor parallel or a
split with streamed parts) is priced as if each had its own.
    python3 benches/streaming/concurrent-copy.py [--gib 2] [--reps 5]
Prints one JSON line: GB/s per GPU alone, each GPU's and the total GB/s all at once."""
import argparse, json, threading, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--gib", type=float, default=2.0)
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()
n = torch.cuda.device_count()
nbytes = int(a.gib * (1 << 30))
src = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(n)]
dst = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
streams = [torch.cuda.Stream(device=i) for i in range(n)]

def copy(i, reps):
    with torch.cuda.device(i), torch.cuda.stream(streams[i]):
        for _ in range(reps):
            dst[i].copy_(src[i], non_blocking=True)
        streams[i].synchronize()

for i in range(n):
    copy(i, 1)
alone = []
for i in range(n):
    t = time.perf_counter(); copy(i, a.reps); s = time.perf_counter() - t
    alone.append(round(a.reps * nbytes / s / 1e9, 1))
threads = [threading.Thread(target=copy, args=(i, a.reps)) for i in range(n)]
t = time.perf_counter()
for th in threads: th.start()
for th in threads: th.join()
s = time.perf_counter() - t
each = round(a.reps * nbytes / s / 1e9, 1)
print(json.dumps({"gpus": n, "bytes": nbytes, "reps": a.reps, "alone_gbps": alone,
                  "together_each_gbps": each, "together_total_gbps": round(each * n, 1)}))
