"""mold's text encoders against transformers' on the same random weights: T5 and CLIP of a
`mold testdata flux-*-pipeline` directory, run by transformers in f32 (the reference) and in
bf16, beside the outputs `mold exec --save-io` saved (mold's encoders, and optionally
candle-transformers' from a `MOLD_KERNELS=candle` run). Prints one JSON line: each output's
relative error (‖a − ref‖ / ‖ref‖) against the f32 reference.

  python3 parity.py --pipeline DIR --io mold.safetensors [--io-candle candle.safetensors]
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import CLIPTextModel, T5EncoderModel


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def ids_for(tok_file, prompt, length, pads):
    # As mold's load_tokenizer: truncate and pad to exactly `length`, padding with the first
    # of `pads` the vocabulary has.
    tok = Tokenizer.from_file(str(tok_file))
    pad = next((p for p in pads if tok.token_to_id(p) is not None), None)
    pad_id = tok.token_to_id(pad) if pad else 0
    tok.enable_truncation(max_length=length)
    tok.enable_padding(length=length, pad_id=pad_id, pad_token=pad or tok.id_to_token(0))
    return tok.encode(prompt).ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", required=True, type=Path)
    ap.add_argument("--io", required=True, type=Path)
    ap.add_argument("--io-candle", type=Path)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    io = load_file(str(a.io))
    with safe_open(str(a.io), "pt") as f:
        prompt = (f.metadata() or {})["prompt"]
    candle = load_file(str(a.io_candle)) if a.io_candle else None
    res = {"prompt": prompt, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}

    tokens = io["t5"].shape[1]
    t5_ids = torch.tensor([ids_for(a.pipeline / "t5" / "tokenizer.json", prompt, tokens, ["<pad>"])],
                          device=dev)
    outs = {}
    for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        m = T5EncoderModel.from_pretrained(a.pipeline / "t5", torch_dtype=dt).to(dev).eval()
        with torch.no_grad():
            outs[name] = m(input_ids=t5_ids).last_hidden_state
        del m
        torch.cuda.empty_cache() if dev == "cuda" else None
    res["t5"] = {"mold": rel(io["t5"], outs["f32"]),
                 "transformers_bf16": rel(outs["bf16"], outs["f32"])}
    if candle is not None:
        res["t5"]["candle_transformers"] = rel(candle["t5"], outs["f32"])

    cfg = json.loads((a.pipeline / "clip" / "config.json").read_text())
    length = cfg.get("max_position_embeddings", 77)
    ids = ids_for(a.pipeline / "clip" / "tokenizer.json", prompt, length, ["<|endoftext|>", "<pad>"])
    pos = ids.index(max(ids))  # mold's (and HF's argmax) pooling position
    clip_ids = torch.tensor([ids], device=dev)
    outs = {}
    for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        m = CLIPTextModel.from_pretrained(a.pipeline / "clip", torch_dtype=dt).to(dev).eval()
        with torch.no_grad():
            outs[name] = m(input_ids=clip_ids).last_hidden_state[:, pos]
        del m
    res["clip"] = {"mold": rel(io["clip"], outs["f32"]),
                   "transformers_bf16": rel(outs["bf16"], outs["f32"])}
    if candle is not None:
        res["clip"]["candle_transformers"] = rel(candle["clip"], outs["f32"])
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
