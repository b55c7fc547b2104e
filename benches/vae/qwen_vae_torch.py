#!/usr/bin/env python3
"""Qwen-Image's VAE decoder in diffusers (`AutoencoderKLQwenImage`, the one-frame decode its
pipeline runs), to time against mold's and as a parity reference on the same weights.
Needs diffusers (the wheels in .whl: benches/parity/README.md).

  qwen_vae_torch.py make DIR [--size S] [--seed N]
      writes DIR/vae/ (diffusers' config.json and diffusion_pytorch_model.safetensors: random
      weights, f32, diffusers' own initialisation) and DIR/z.safetensors (`z`, a (1, 16, S, S)
      normalized latent; S = 166 for a 1328x1328 image)
  qwen_vae_torch.py run DIR [--iters N] [--compile-mode MODE|none]
      decodes DIR/z as the pipeline does (`z * std + mean`, one frame) in bf16: eager, then
      the decoder under torch.compile; median of N after warm-up, CUDA events; one JSON line
      each; writes DIR/torch_bf16.safetensors and DIR/torch_f32.safetensors (an f32 decode,
      TF32 off: the reference the bf16 decodes are compared with)
  Images are `image` (1, 3, 8S, 8S), clamped to [-1, 1] as diffusers' decode clamps them;
  benches/vae/vae_torch.py compare compares them.
"""
import argparse, json, os, time

import torch
from safetensors.torch import load_file, save_file

from vae_torch import timed  # this folder's: median of CUDA-event timings after warm-up


def make(a):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(a.seed)
    vae = AutoencoderKLQwenImage()
    vae.save_pretrained(os.path.join(a.dir, "vae"), safe_serialization=True)
    z = torch.randn(1, vae.config.z_dim, a.size, a.size)
    save_file({"z": z.contiguous()}, os.path.join(a.dir, "z.safetensors"))


def load(d, dtype):
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage.from_pretrained(os.path.join(d, "vae"), torch_dtype=dtype).to("cuda").eval()


def latents(vae, z, dtype):
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1).to(z)
    std = torch.tensor(c.latents_std).view(1, -1, 1, 1).to(z)
    return (z * std + mean).to(dtype)[:, :, None]


def run(a):
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name()}), flush=True)
    z = load_file(os.path.join(a.dir, "z.safetensors"))["z"].cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    vae = load(a.dir, torch.float32)
    with torch.inference_mode():
        ref = vae.decode(latents(vae, z, torch.float32), return_dict=False)[0][:, :, 0].float().cpu()
    save_file({"image": ref.contiguous()}, os.path.join(a.dir, "torch_f32.safetensors"))
    del vae
    torch.cuda.empty_cache()

    vae = load(a.dir, torch.bfloat16)
    x = latents(vae, z, torch.bfloat16)
    dec = lambda x: vae.decode(x, return_dict=False)[0]
    y, med, mn = timed(dec, x, a.iters)
    save_file({"image": y[:, :, 0].float().cpu().contiguous()}, os.path.join(a.dir, "torch_bf16.safetensors"))
    print(json.dumps({"variant": "diffusers eager", "median_ms": round(med, 2), "min_ms": round(mn, 2),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)

    if a.compile_mode != "none":
        try:
            t = time.time()
            vae.decoder = torch.compile(vae.decoder, mode=a.compile_mode)
            with torch.inference_mode():
                yc = dec(x)
                torch.cuda.synchronize()
            compile_s = time.time() - t
            _, med, mn = timed(dec, x, a.iters)
            d = (yc[:, :, 0].float().cpu() - ref).abs().max().item() / ref.abs().max().item()
            print(json.dumps({"variant": f"diffusers, decoder compiled ({a.compile_mode})", "median_ms": round(med, 2),
                              "min_ms": round(mn, 2), "compile_s": round(compile_s, 1),
                              "max_rel_vs_f32": d}), flush=True)
        except Exception as e:  # report, do not hide the eager figures
            print(json.dumps({"variant": f"diffusers, decoder compiled ({a.compile_mode})",
                              "error": str(e).splitlines()[0][:300]}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--size", type=int, default=166)
    m.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--compile-mode", default="default")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    {"make": make, "run": run}[a.cmd](a)


if __name__ == "__main__":
    main()
