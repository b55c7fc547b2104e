#!/usr/bin/env python3
"""mold's Qwen-Image transformer against diffusers' QwenImageTransformer2DModel.

Given a weights directory written by `mold testdata qwen-image-tiny DIR` (or
`qwen-image`: full size, bf16, 9 shards) — the published repository's `transformer/`
folder layout with diffusers' config.json — and the file `mold exec PLAN --weights DIR
--save-io io.safetensors` wrote (without --prompt: the benchmark's random inputs under
diffusers' argument names and mold's output of one transformer call), this loads the
same weights into diffusers, runs the same call and prints, as JSON, the max relative
error of mold's output against diffusers':

    max |mold - diffusers| / max |diffusers|      (mold_exec::max_relative_error)

Targets (issue 20): <= 1e-4 in f32 (qwen-image-tiny), <= 2e-2 in bf16 (qwen-image).
The exit status is 1 above the tolerance (--tolerance, default by dtype).

    mold testdata qwen-image-tiny W
    mold plan --model qwen-image-tiny --machine sim/machines/cpu-emu-4.yaml --tp 2 -o p.yaml
    mold exec p.yaml --weights W --steps 1 --save-io io.safetensors
    python3 benches/parity/qwen_diffusers.py --weights W --io io.safetensors [--device cuda]

The call's inputs: `hidden_states` (b, h*w, 64) packed latents, `encoder_hidden_states`
(b, L, joint_attention_dim), `timestep` (b,) in [0, 1] (the pipeline's `timestep /
1000`), `img_shapes` [1, h, w]; every text token is valid (no mask, as the pipeline
passes none when the prompt has no padding).
"""

import argparse
import inspect
import json
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def rel(a, b):
    """max |a - b| / max |b| in f32; NaN or inf anywhere is reported, never a pass."""
    a = a.detach().float().cpu()
    b = b.detach().float().cpu()
    if a.shape != b.shape:
        raise SystemExit(f"shape mismatch: mold {tuple(a.shape)} vs diffusers {tuple(b.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="directory holding transformer/ (mold testdata qwen-image[-tiny])")
    ap.add_argument("--io", required=True, help="the file of `mold exec PLAN --weights DIR --save-io FILE` (no --prompt)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], help="compute dtype (default: the plan's, from the io file)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, help="largest accepted error (default 1e-4 f32, 2e-2 bf16)")
    ap.add_argument("--out", help="also write the JSON result here")
    a = ap.parse_args()

    from diffusers import QwenImageTransformer2DModel

    with safe_open(a.io, framework="pt") as f:
        meta = f.metadata() or {}
    io = load_file(a.io)
    missing = [k for k in ("hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "output") if k not in io]
    if missing:
        raise SystemExit(
            f"{a.io}: no {', '.join(missing)}: write it with `mold exec PLAN --weights DIR --save-io FILE` (without --prompt)"
        )
    dtype_name = a.dtype or meta.get("dtype", "f32")
    if dtype_name not in ("f32", "bf16"):
        raise SystemExit(f"{a.io}: the plan's dtype is {dtype_name}: pass --dtype f32 or bf16")
    dtype = torch.float32 if dtype_name == "f32" else torch.bfloat16
    tol = a.tolerance if a.tolerance is not None else (1e-4 if dtype_name == "f32" else 2e-2)
    dev = torch.device(a.device)

    t0 = time.time()
    model = QwenImageTransformer2DModel.from_pretrained(a.weights, subfolder="transformer", torch_dtype=dtype)
    model = model.to(dev).eval()
    load_s = time.time() - t0

    x = io["hidden_states"].to(dev, dtype)
    txt = io["encoder_hidden_states"].to(dev, dtype)
    t = io["timestep"].to(dev, dtype)
    grid = tuple(int(v) for v in io["img_shapes"].tolist())
    b = x.shape[0]
    if grid[1] * grid[2] != x.shape[1]:
        raise SystemExit(f"{a.io}: img_shapes {grid} does not hold {x.shape[1]} image tokens")
    kwargs = dict(
        hidden_states=x,
        encoder_hidden_states=txt,
        encoder_hidden_states_mask=None,
        timestep=t,
        img_shapes=[[grid]] * b,
        return_dict=False,
    )
    # Older diffusers releases take the text lengths for RoPE as `txt_seq_lens`.
    if "txt_seq_lens" in inspect.signature(model.forward).parameters:
        kwargs["txt_seq_lens"] = [txt.shape[1]] * b
    with torch.no_grad():
        t1 = time.time()
        want = model(**kwargs)[0]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        call_s = time.time() - t1

    err = rel(io["output"], want)
    result = {
        "model": meta.get("model"),
        "dtype": dtype_name,
        "device": str(dev),
        "batch": b,
        "image_tokens": x.shape[1],
        "text_tokens": txt.shape[1],
        "transformer_max_relative_error": err,
        "tolerance": tol,
        "passed": err <= tol,
        "diffusers_load_s": load_s,
        "diffusers_call_s": call_s,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if err <= tol else 1)


if __name__ == "__main__":
    main()
