"""T5-XXL (512 tokens) and CLIP-L (77 tokens) text encoders in PyTorch (transformers), bf16,
eager and compiled, timed on one GPU: the reference for mold's encoders (benches/encoders/run).
Random weights from the published configs (a dense forward's time does not depend on the
values). Prints one JSON line per (model, mode): median and min of 20 runs after 5 warm-ups,
CUDA events around each forward.
"""
import json
import statistics
import sys

import torch
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel


def t5_xxl():
    # google/t5-v1_1-xxl's encoder (FLUX's text_encoder_2).
    return T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240,
                                   num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                                   relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                                   layer_norm_epsilon=1e-6, dropout_rate=0.0)), 512


def clip_l():
    # openai/clip-vit-large-patch14's text model (FLUX's text_encoder).
    return CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                        num_hidden_layers=12, num_attention_heads=12,
                                        max_position_embeddings=77, hidden_act="quick_gelu")), 77


def timed(fn, ids, warm=5, n=20):
    with torch.inference_mode():
        for _ in range(warm):
            fn(ids)
        torch.cuda.synchronize()
        ts = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(ids)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    return statistics.median(ts), min(ts)


def main():
    dev = "cuda"
    for name, make in [("t5", t5_xxl), ("clip", clip_l)]:
        model, tokens = make()
        model = model.to(dev, torch.bfloat16).eval()
        ids = torch.randint(0, 1000, (1, tokens), device=dev)
        for mode in ["eager", "compiled"]:
            fn = model if mode == "eager" else torch.compile(model)
            try:
                med, lo = timed(lambda x: fn(input_ids=x).last_hidden_state, ids)
                print(json.dumps({"model": name, "mode": mode, "tokens": tokens,
                                  "median_ms": round(med, 3), "min_ms": round(lo, 3),
                                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}),
                      flush=True)
            except Exception as e:  # a compile failure is a result, not the end of the run
                print(json.dumps({"model": name, "mode": mode, "error": str(e)[:300]}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
