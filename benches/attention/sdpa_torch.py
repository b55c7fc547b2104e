#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention per backend (cuDNN, FlashAttention, memory-efficient)
at FLUX shapes: 1 x H x S x 128 bf16, H in 24/12/6 (1 GPU, TP2/SP2, TP4 shards), S = 4608.
Prints one JSON line per (backend, heads): median ms over 50 calls and TFLOP/s (4*H*S^2*D).
Also prints torch's and cuDNN's versions and where libcudnn was loaded from."""
import json, sys, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F

def where_cudnn():
    try:
        for line in open("/proc/self/maps"):
            if "libcudnn" in line:
                return line.split()[-1]
    except OSError:
        pass
    return None

def main():
    s = int(sys.argv[1]) if len(sys.argv) > 1 else 4608
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name()}), flush=True)
    for heads in (24, 12, 6):
        q, k, v = (torch.randn(1, heads, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    for _ in range(5):
                        F.scaled_dot_product_attention(q, k, v)
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(50):
                        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                        a.record(); F.scaled_dot_product_attention(q, k, v); b.record()
                        b.synchronize(); ts.append(a.elapsed_time(b))
                ts.sort(); ms = ts[len(ts) // 2]
                print(json.dumps({"backend": name, "heads": heads, "seq": s, "ms": round(ms, 4),
                                  "tflops": round(4 * heads * s * s * 128 / ms / 1e9, 1)}), flush=True)
            except Exception as e:  # a backend this build or GPU lacks
                print(json.dumps({"backend": name, "heads": heads, "error": str(e)[:160]}), flush=True)
    print(json.dumps({"libcudnn": where_cudnn()}), flush=True)

if __name__ == "__main__":
    main()
