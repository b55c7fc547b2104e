#!/usr/bin/env python3
"""mold's Qwen-Image pipeline against diffusers' QwenImagePipeline, stage by stage.

Given a weights directory written by `mold testdata qwen-image-tiny-pipeline DIR` (or
`qwen-image-pipeline`: full size, bf16) — the published repository's layout, loadable by
`QwenImagePipeline.from_pretrained(DIR)` — and the file `mold exec PLAN --weights DIR
--prompt P [--negative-prompt N --cfg S] --save-io io.safetensors` wrote, this runs
diffusers on the same weights, the same prompts and mold's initial noise, and prints, as
JSON, the max relative error (max |mold - diffusers| / max |diffusers|) of:

- `txt`, `txt_negative`: the text encoder's conditioning (Qwen2.5-VL's last hidden state
  less the template's 34 tokens) against `pipe.encode_prompt`;
- `timesteps`: the sigmas against the scheduler's (`mu` from the image's token count);
- `final`: the latents after the last step against the pipeline run with
  `latents=` mold's noise and `output_type="latent"` (true CFG when mold ran it);
- `image`: mold's decoded image against `pipe.vae.decode` of mold's final latents
  (un-normalized per channel as the pipeline does), so the VAE is compared alone.

Targets: <= 1e-4 in f32 (qwen-image-tiny-pipeline) for each stage but `final`, which
compounds the steps (reported; <= 1e-3 expected in f32, ~5e-2 in bf16). The exit status
is 1 when a stage with a tolerance is above it. f32 here is strict IEEE f32: PyTorch's
default TF32 for convolutions (the VAE) is turned off; with it the VAE alone differs
by ~3e-3 on an H200. The plan's components must be f32 too for an f32 comparison
(qwen-image-tiny's are by default; `mold plan --dtype qwen2.5-vl=f32 --dtype vae=f32
--dtype transformer=f32` for the others); a bf16 text encoder alone gives `txt` ~2e-2.

    mold testdata qwen-image-tiny-pipeline W
    mold plan --model qwen-image-tiny --machine sim/machines/cpu-emu-4.yaml --tp off -o p.yaml
    mold exec p.yaml --weights W --prompt "a red fox" --negative-prompt "blurry" --cfg 4 \
        --steps 4 --seed 1 --save-io io.safetensors
    python3 benches/parity/qwen_pipeline_diffusers.py --weights W --io io.safetensors [--device cuda]
"""

import argparse
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


def strict_f32():
    """f32 as IEEE f32: PyTorch runs f32 convolutions (and, where asked, matrix products)
    in TF32 on Ampere and later GPUs by default, a 10-bit mantissa."""
    b = torch.backends
    if hasattr(b.cudnn, "conv") and hasattr(b.cudnn.conv, "fp32_precision"):
        b.cudnn.conv.fp32_precision = "ieee"
        b.cudnn.rnn.fp32_precision = "ieee"
        b.cuda.matmul.fp32_precision = "ieee"
    else:
        b.cudnn.allow_tf32 = False
        b.cuda.matmul.allow_tf32 = False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="mold testdata qwen-image[-tiny]-pipeline DIR")
    ap.add_argument("--io", required=True, help="the file of `mold exec PLAN --weights DIR --prompt P --save-io FILE`")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default=None, help="default: f32 for the tiny model, else bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, default=None, help="per stage (default 1e-4 f32, 2e-2 bf16)")
    ap.add_argument("--out", help="also write the JSON result here")
    a = ap.parse_args()

    from diffusers import QwenImagePipeline

    with safe_open(a.io, framework="pt") as f:
        meta = f.metadata() or {}
    io = load_file(a.io)
    for k in ("txt", "timesteps", "latents", "final", "image"):
        if k not in io:
            raise SystemExit(f"{a.io}: no `{k}`: write it with `mold exec PLAN --weights DIR --prompt P --save-io FILE`")
    model = meta.get("model", "")
    dtype_name = a.dtype or ("f32" if model.endswith("-tiny") else "bf16")
    dtype = torch.float32 if dtype_name == "f32" else torch.bfloat16
    tol = a.tolerance if a.tolerance is not None else (1e-4 if dtype_name == "f32" else 2e-2)
    dev = torch.device(a.device)
    strict_f32()

    prompt = meta["prompt"]
    negative = meta.get("negative_prompt")
    cfg = float(meta.get("true_cfg_scale", "1"))
    steps = int(meta["steps"])
    width, height = int(meta["width"]), int(meta["height"])

    t0 = time.time()
    pipe = QwenImagePipeline.from_pretrained(a.weights, torch_dtype=dtype).to(dev)
    load_s = time.time() - t0
    res = {"model": model, "dtype": dtype_name, "device": str(dev), "diffusers_load_s": load_s}

    with torch.no_grad():
        emb, _ = pipe.encode_prompt(prompt=prompt, device=dev, max_sequence_length=512)
        res["txt"] = rel(io["txt"], emb[0:1])
        neg = None
        if negative is not None and "txt_negative" in io:
            neg, _ = pipe.encode_prompt(prompt=negative, device=dev, max_sequence_length=512)
            res["txt_negative"] = rel(io["txt_negative"], neg[0:1])

        latents = io["latents"].to(dev, dtype)
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        sc = pipe.scheduler.config
        mu = calculate_shift(
            latents.shape[1],
            sc.get("base_image_seq_len", 256),
            sc.get("max_image_seq_len", 4096),
            sc.get("base_shift", 0.5),
            sc.get("max_shift", 1.15),
        )
        sig = np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(pipe.scheduler, steps, dev, sigmas=sig, mu=mu)
        res["timesteps"] = rel(io["timesteps"], pipe.scheduler.sigmas.float().cpu())

        kwargs = dict(
            prompt=prompt,
            num_inference_steps=steps,
            width=width,
            height=height,
            latents=latents,
            output_type="latent",
            true_cfg_scale=cfg,
        )
        if neg is not None:
            kwargs["negative_prompt"] = negative
        t1 = time.time()
        final = pipe(**kwargs).images
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res["diffusers_denoise_s"] = time.time() - t1
        res["final"] = rel(io["final"], final)

        # The VAE alone, on mold's final latents.
        z = pipe._unpack_latents(io["final"].to(dev, dtype), height, width, pipe.vae_scale_factor)
        vc = pipe.vae.config
        mean = torch.tensor(vc.latents_mean).view(1, vc.z_dim, 1, 1, 1).to(dev, dtype)
        std = 1.0 / torch.tensor(vc.latents_std).view(1, vc.z_dim, 1, 1, 1).to(dev, dtype)
        img = pipe.vae.decode(z / std + mean, return_dict=False)[0][:, :, 0]
        res["image"] = rel(io["image"], img)

    checked = ["txt", "txt_negative", "timesteps", "image"]
    res["tolerance"] = tol
    res["passed"] = all(res[k] <= tol for k in checked if k in res)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if res["passed"] else 1)


if __name__ == "__main__":
    main()
