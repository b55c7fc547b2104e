"""Qwen-Image's text encoder in PyTorch: Qwen2.5-VL-7B's language model (transformers'
Qwen2Model of the same size: on text, Qwen2.5-VL's three rotary sections take the same
positions, so it is the same decoder), bf16, SDPA attention with the causal mask, eager and
torch.compile, timed on one GPU: the reference for mold's encoder (benches/encoders/qwen).
Random weights (a dense forward's time does not depend on the values). The language model
alone: diffusers' pipeline also runs the LM head, which it does not use.
Prints one JSON line per (tokens, mode): median and min of 20 runs after 5 warm-ups, CUDA
events around each forward.

    python3 torch_qwen_text.py [--tokens 64,256,1058]
"""
import argparse
import json

import torch
from transformers import Qwen2Config, Qwen2Model

from torch_encoders import timed  # this folder's: CUDA events, median and min after warm-ups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,256,1058")
    args = ap.parse_args()
    cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
                      hidden_act="silu", attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2Model(cfg).eval()
    compiled = torch.compile(model)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, 150000, (1, tokens), device="cuda")
        for mode, fn in [("eager", model), ("compiled", compiled)]:
            try:
                med, lo = timed(lambda x: fn(input_ids=x, use_cache=False).last_hidden_state, ids)
                print(json.dumps({"model": "qwen2.5-vl-7b-lm", "mode": mode, "tokens": tokens,
                                  "median_ms": round(med, 3), "min_ms": round(lo, 3),
                                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}),
                      flush=True)
            except Exception as e:  # a compile failure is a result, not the end of the run
                print(json.dumps({"model": "qwen2.5-vl-7b-lm", "mode": mode, "tokens": tokens,
                                  "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)


if __name__ == "__main__":
    main()
