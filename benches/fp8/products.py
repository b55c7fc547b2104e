#!/usr/bin/env python3
"""FLUX.1-dev's products (1024², 512 text tokens) one by one in PyTorch, to see what an FP8
product costs with each way of scaling it, on the GPU at hand:

  bf16        torch.mm (cuBLAS)
  tensor      torch._scaled_mm, one scale per matrix (cuBLASLt's tensor-wide FP8 kernels)
  rows        torch._scaled_mm, one scale per token and per output feature (what mold's FP8
              products compute; PyTorch's own rowwise kernel)
each FP8 way with and without fast accumulation. Prints each shape's time and TFLOP/s and the
step's products summed over the blocks (19 double blocks: image 4096 and text 512 tokens; 38
single blocks: 4608 tokens), so they can be set beside mold's FP8 operation table and step.

  python3 benches/fp8/products.py [--reps 30]
"""
import argparse

import torch

HIDDEN, MLP = 3072, 12288
# (tokens, out, in, how many per step)
SHAPES = [
    (4096, 3 * HIDDEN, HIDDEN, 19), (4096, HIDDEN, HIDDEN, 19),
    (4096, MLP, HIDDEN, 19), (4096, HIDDEN, MLP, 19),
    (512, 3 * HIDDEN, HIDDEN, 19), (512, HIDDEN, HIDDEN, 19),
    (512, MLP, HIDDEN, 19), (512, HIDDEN, MLP, 19),
    (4608, 3 * HIDDEN, HIDDEN, 38), (4608, MLP, HIDDEN, 38),
    (4608, HIDDEN, HIDDEN, 38), (4608, HIDDEN, MLP, 38),
]


def timed(f, reps):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        f()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2] * 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    f8 = torch.float8_e4m3fn
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    ways = ["bf16", "tensor", "tensor-fast", "rows", "rows-fast"]
    print("# tokens out in | " + " | ".join(f"{w} us (TF/s)" for w in ways))
    total = {w: 0.0 for w in ways}
    for m, n, k, count in SHAPES:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        xs = x.abs().amax(dim=1, keepdim=True).float() / 448
        ws = w.abs().amax(dim=1, keepdim=True).float() / 448
        x8, w8 = (x / xs).to(f8), (w / ws).to(f8)
        one = torch.ones((), device=dev)
        b = torch.zeros(n, device=dev, dtype=torch.bfloat16)
        run = {
            "bf16": lambda: torch.nn.functional.linear(x, w, b),
            "tensor": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, bias=b,
                                               out_dtype=torch.bfloat16),
            "tensor-fast": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                    bias=b, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True),
            "rows": lambda: torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws.t(), bias=b,
                                             out_dtype=torch.bfloat16),
            "rows-fast": lambda: torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws.t(),
                                                  bias=b, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True),
        }
        flops = 2 * m * n * k
        cells = []
        for wname in ways:
            try:
                t = timed(run[wname], a.reps)
                total[wname] += t * count
                cells.append(f"{t * 1e6:8.1f} ({flops / t / 1e12:6.0f})")
            except Exception as e:  # a way this PyTorch or GPU refuses
                total[wname] = float("nan")
                cells.append(f"refused: {str(e).splitlines()[0][:60]}")
        print(f"{m} {n} {k} | " + " | ".join(cells), flush=True)
    print("step's products, ms: " + ", ".join(f"{w} {total[w] * 1e3:.2f}" for w in ways))


if __name__ == "__main__":
    main()
