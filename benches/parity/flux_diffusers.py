#!/usr/bin/env python3
"""mold against diffusers, stage by stage, on the same random FLUX snapshot.

Given a snapshot directory in the Hugging Face layout (`mold testdata flux-dev-hf DIR`,
or flux-tiny-hf / flux-schnell-hf) and the file mold wrote with `--save-io` (which also
holds the initial noise, the prompt and the settings), this loads the same weights into
diffusers and transformers and prints, as JSON, the max relative error of mold's
tensors against diffusers' at each stage:

- `t5`, `clip`: the text encoders' outputs for the prompt (T5EncoderModel and
  CLIPTextModel's pooled output, tokenized by transformers from the snapshot's files);
- `transformer`: for each transformer format (`diffusers`: FluxTransformer2DModel from
  transformer/, `bfl`: the same class from flux1-*.safetensors through
  `from_single_file`), the output at every step, fed mold's saved inputs of that step
  (latents, T5, CLIP, timestep, guidance, ids);
- `pipeline`: FluxPipeline from mold's initial noise (`latents=`), same prompt, steps,
  guidance and size: the latents after each step, the final latents, and the decoded
  image (max relative error, and PSNR in dB on [0, 1]).

The relative error is mold's own (`mold_exec::max_relative_error`):
max |a - b| / max |b|, with diffusers' tensor as the reference b.

    python3 benches/parity/flux_diffusers.py --snapshot DIR --io io.safetensors \
        [--dtype bf16|f32] [--device cuda] [--formats diffusers,bfl] [--reference f32] \
        [--out result.json]

`--reference f32` (with `--dtype bf16`) also runs the transformer in f32 on the same
weights and each step's inputs (both rounded to bf16 as the bf16 runs see them, then
computed in strict IEEE f32) and reports, under `transformer.reference`, each step's
`mold_vs_f32` and `diffusers_vs_f32` beside `mold_vs_diffusers`: a bf16 difference between
the two is judged against each one's distance from the exact computation. (On a CPU,
PyTorch's bf16 FLUX transformer lands 0.3-0.5 from f32 on flux-tiny while mold's stays
near 1e-2, so there a bf16 `mold_vs_diffusers` says nothing without this.)
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

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


def psnr(a, b):
    """PSNR in dB of two images in [0, 1]."""
    mse = float(((a.float().cpu() - b.float().cpu()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def bfl_to_diffusers(sd, cfg):
    """BFL names to diffusers', as diffusers' scripts/convert_flux_to_diffusers.py."""
    h = cfg.num_attention_heads * cfg.attention_head_dim
    out = {}

    def lin(bfl, d):
        for s in ("weight", "bias"):
            out[f"{d}.{s}"] = sd.pop(f"{bfl}.{s}")

    def split(bfl, names, sizes):
        for s in ("weight", "bias"):
            for n, t in zip(names, torch.split(sd.pop(f"{bfl}.{s}"), sizes, dim=0)):
                out[f"{n}.{s}"] = t

    lin("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    lin("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    lin("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    lin("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    if "guidance_in.in_layer.weight" in sd:
        lin("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
        lin("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    lin("txt_in", "context_embedder")
    lin("img_in", "x_embedder")
    for i in range(cfg.num_layers):
        b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        lin(f"{b}.img_mod.lin", f"{t}.norm1.linear")
        lin(f"{b}.txt_mod.lin", f"{t}.norm1_context.linear")
        split(f"{b}.img_attn.qkv", [f"{t}.attn.to_{x}" for x in "qkv"], [h] * 3)
        split(f"{b}.txt_attn.qkv", [f"{t}.attn.add_{x}_proj" for x in "qkv"], [h] * 3)
        for s, q, k in (("img", "norm_q", "norm_k"), ("txt", "norm_added_q", "norm_added_k")):
            out[f"{t}.attn.{q}.weight"] = sd.pop(f"{b}.{s}_attn.norm.query_norm.scale")
            out[f"{t}.attn.{k}.weight"] = sd.pop(f"{b}.{s}_attn.norm.key_norm.scale")
        lin(f"{b}.img_mlp.0", f"{t}.ff.net.0.proj")
        lin(f"{b}.img_mlp.2", f"{t}.ff.net.2")
        lin(f"{b}.txt_mlp.0", f"{t}.ff_context.net.0.proj")
        lin(f"{b}.txt_mlp.2", f"{t}.ff_context.net.2")
        lin(f"{b}.img_attn.proj", f"{t}.attn.to_out.0")
        lin(f"{b}.txt_attn.proj", f"{t}.attn.to_add_out")
    for i in range(cfg.num_single_layers):
        b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        lin(f"{b}.modulation.lin", f"{t}.norm.linear")
        split(f"{b}.linear1", [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"],
              [h, h, h, 4 * h])
        out[f"{t}.attn.norm_q.weight"] = sd.pop(f"{b}.norm.query_norm.scale")
        out[f"{t}.attn.norm_k.weight"] = sd.pop(f"{b}.norm.key_norm.scale")
        lin(f"{b}.linear2", f"{t}.proj_out")
    lin("final_layer.linear", "proj_out")
    for s in ("weight", "bias"):
        shift, scale = sd.pop(f"final_layer.adaLN_modulation.1.{s}").chunk(2, dim=0)
        out[f"norm_out.linear.{s}"] = torch.cat([scale, shift], dim=0)
    if sd:
        raise SystemExit(f"BFL tensors left unconverted: {sorted(sd)[:5]}")
    return out


def strict_f32():
    """f32 as IEEE f32: PyTorch runs f32 convolutions (and, where asked, matrix products)
    in TF32 on Ampere and later GPUs by default, a 10-bit mantissa (on the VAE a ~3e-3
    difference measured for Qwen-Image's, which is no difference of mold's)."""
    b = torch.backends
    if hasattr(b.cudnn, "conv") and hasattr(b.cudnn.conv, "fp32_precision"):
        b.cudnn.conv.fp32_precision = "ieee"
        b.cudnn.rnn.fp32_precision = "ieee"
        b.cuda.matmul.fp32_precision = "ieee"
    else:
        b.cudnn.allow_tf32 = False
        b.cuda.matmul.allow_tf32 = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--snapshot", required=True, type=Path, help="the Hugging Face-layout directory")
    ap.add_argument("--io", required=True, type=Path, help="mold exec --save-io FILE")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--t5-dtype", choices=["bf16", "fp16", "f32"],
                    help="T5's dtype (default: --dtype). mold computes a T5 planned in fp16 in bf16 "
                         "(fp16 overflows in T5): pass bf16 for such plans")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--formats", default="diffusers,bfl", help="transformer formats to compare")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the whole-pipeline run")
    ap.add_argument("--reference", choices=["f32"],
                    help="with --dtype bf16: also the transformer in f32, and both bf16 errors against it")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    if a.reference and a.dtype != "bf16":
        raise SystemExit("--reference f32 judges a bf16 run: pass --dtype bf16, or drop --reference")
    if a.dtype == "f32" or a.reference:
        strict_f32()

    import diffusers
    import transformers
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel

    try:
        from transformers import T5TokenizerFast as T5Tok
    except ImportError:  # transformers 5 names the fast tokenizer T5Tokenizer
        from transformers import T5Tokenizer as T5Tok

    dev = torch.device(a.device)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    snap = a.snapshot
    io = load_file(str(a.io))
    with safe_open(str(a.io), "pt") as f:
        meta = f.metadata() or {}
    prompt = meta["prompt"]
    steps = int(meta["steps"])
    width, height = int(meta["width"]), int(meta["height"])
    guidance = float(meta["guidance"]) if "guidance" in meta else None
    tokens = io["t5"].shape[1]
    res = {
        "snapshot": str(snap),
        "io": str(a.io),
        "prompt": prompt,
        "steps": steps,
        "size": [width, height],
        "dtype": a.dtype,
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__},
    }
    t0 = time.time()

    # Text encoders, as FluxPipeline runs them.
    tok = CLIPTokenizer.from_pretrained(snap / "tokenizer")
    clip = CLIPTextModel.from_pretrained(snap / "text_encoder", torch_dtype=dt).to(dev)
    ids = tok(prompt, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids.to(dev)
    with torch.no_grad():
        pooled = clip(ids, output_hidden_states=False).pooler_output
    res["clip"] = rel(io["clip"], pooled)
    tok2 = T5Tok.from_pretrained(snap / "tokenizer_2")
    t5_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "f32": torch.float32}.get(a.t5_dtype, dt)
    t5 = T5EncoderModel.from_pretrained(snap / "text_encoder_2", torch_dtype=t5_dt).to(dev)
    ids2 = tok2(prompt, padding="max_length", max_length=tokens, truncation=True,
                return_tensors="pt").input_ids.to(dev)
    with torch.no_grad():
        t5_out = t5(ids2, output_hidden_states=False)[0]
    res["t5"] = rel(io["t5"], t5_out)
    if a.reference and t5_dt != torch.float32:
        # Both lower-precision T5 runs against T5 in f32 (the same weights widened).
        del t5
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        t5 = T5EncoderModel.from_pretrained(snap / "text_encoder_2", torch_dtype=torch.float32).to(dev)
        with torch.no_grad():
            t5_ref = t5(ids2, output_hidden_states=False)[0]
        res["t5_reference"] = {"dtype": "f32", "mold_vs_f32": rel(io["t5"], t5_ref),
                               "transformers_vs_f32": rel(t5_out, t5_ref)}
        del t5_ref
    res["token_ids_equal_note"] = "ids are transformers' own; mold's are not saved"

    # The transformer alone, at every step, from mold's inputs.
    def load_transformer(fmt):
        if fmt == "diffusers":
            return FluxTransformer2DModel.from_pretrained(snap / "transformer", torch_dtype=dt)
        single = next(p for p in [snap / "flux1-dev.safetensors", snap / "flux1-schnell.safetensors"]
                      if p.exists())
        try:
            m = FluxTransformer2DModel.from_single_file(
                str(single), config=str(snap), subfolder="transformer", torch_dtype=dt)
            res["bfl_loader"] = "from_single_file"
            return m
        except RuntimeError:
            # diffusers' single-file converter assumes FLUX.1's sizes (the tiny model is
            # not): the same conversion (scripts/convert_flux_to_diffusers.py) with the
            # sizes from the config.
            m = FluxTransformer2DModel.from_config(
                FluxTransformer2DModel.load_config(snap / "transformer")).to(dt)
            m.load_state_dict(bfl_to_diffusers(load_file(str(single)), m.config), strict=True)
            res["bfl_loader"] = "convert_flux_to_diffusers.py's map, config sizes"
            return m

    put = lambda t: t.to(dev, dt)
    txt, vec = put(io["t5"]), put(io["clip"])
    img_ids, txt_ids = io["img_ids"][0].to(dev), io["txt_ids"][0].to(dev)
    g = io["guidance"].to(dev) if "guidance" in io else None
    def block_outputs(tf, into):
        """Hooks that append every block's output (double blocks, then single blocks) to
        `into` as f32 on the CPU, while `into` is not None; returns the hooks' handles."""
        def hook(_m, _inp, out):
            if into is None or len(into) >= n_blocks:
                return
            parts = out if isinstance(out, tuple) else (out,)
            into.append(torch.cat([p.detach().float().flatten().cpu() for p in parts
                                   if torch.is_tensor(p)]))
        blocks = list(tf.transformer_blocks) + list(tf.single_transformer_blocks)
        n_blocks = len(blocks)
        return [b.register_forward_hook(hook) for b in blocks]

    def velocities(tf, cast, tcast, blocks=None, exact_t=False):
        """The transformer's output at every step from mold's inputs, `cast` to its dtype
        (the timestep and guidance by `tcast`); with `blocks` (a list), every block's output
        at the first step appended to it. With `exact_t`, the timestep and guidance reach
        the embedding unrounded: FluxTransformer2DModel.forward casts them to the model's
        dtype before scaling by 1000 (in bf16 t·1000 is then off by up to ~2), where mold
        and the f32 reference embed the exact value."""
        handles = block_outputs(tf, blocks) if blocks is not None else []
        exact = {}
        emb = tf.time_text_embed
        if exact_t:
            orig = emb.forward

            def unrounded(timestep, *rest):
                rest = list(rest)
                if len(rest) == 2 and rest[0] is not None:  # (guidance, pooled)
                    rest[0] = exact["g"] * 1000
                return orig(exact["t"] * 1000, *rest)

            emb.forward = unrounded
        out = []
        for i in range(steps):
            t = io[f"step.{i}.t"].to(dev)
            exact["t"] = t.float()
            if g is not None:
                exact["g"] = g.float()
            with torch.no_grad():
                out.append(tf(hidden_states=cast(io[f"step.{i}.latents"]), timestep=tcast(t),
                              guidance=None if g is None else tcast(g), pooled_projections=cast(vec),
                              encoder_hidden_states=cast(txt), txt_ids=txt_ids, img_ids=img_ids,
                              return_dict=False)[0].float().cpu())
        for h in handles:
            h.remove()
        if exact_t:
            del emb.forward  # the class's own again
        return out

    res["transformer"] = {}
    first = None
    first_blocks = [] if a.reference else None
    rounded = None
    for fmt in [f for f in a.formats.split(",") if f]:
        tf = load_transformer(fmt).to(dev).eval()
        vs = velocities(tf, lambda t: t.to(dev, dt), lambda t: t.to(dev, dt),
                        first_blocks if first is None and dt == torch.float32 else None)
        errs = [rel(io[f"step.{i}.velocity"], v) for i, v in enumerate(vs)]
        res["transformer"][fmt] = {"per_step": errs, "max": max(errs)}
        if dt != torch.float32 and first is None:
            # The same model with the timestep unrounded: the computation mold runs.
            rounded = vs
            vs = velocities(tf, lambda t: t.to(dev, dt), lambda t: t.to(dev, dt),
                            first_blocks, exact_t=True)
            errs = [rel(io[f"step.{i}.velocity"], v) for i, v in enumerate(vs)]
            res["transformer"][fmt + "_exact_t"] = {"per_step": errs, "max": max(errs)}
        first = first or vs
        del tf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.reference and first is not None:
        # The same bf16 weights widened, the same bf16 inputs widened, computed in f32;
        # the timestep and guidance unrounded (mold embeds them in f32; diffusers rounds
        # them to the model dtype first, a known difference, README).
        fmt = a.formats.split(",")[0]
        tf = load_transformer(fmt).to(dev).float().eval()
        ref_blocks = []
        ref = velocities(tf, lambda t: t.to(dev, dt).float(), lambda t: t.to(dev).float(),
                         ref_blocks)
        mold = [io[f"step.{i}.velocity"] for i in range(steps)]
        n_double = len(tf.transformer_blocks)
        res["transformer"]["reference"] = {
            "dtype": "f32", "format": fmt,
            "mold_vs_f32": [rel(m, r) for m, r in zip(mold, ref)],
            "diffusers_vs_f32": [rel(d, r) for d, r in zip(first, ref)],
            "diffusers_rounded_t_vs_f32": [rel(d, r) for d, r in zip(rounded or first, ref)],
            "mold_vs_diffusers": res["transformer"].get(fmt + "_exact_t", res["transformer"][fmt])["per_step"],
            # Where bf16 rounding grows through the network: each block's output (txt and
            # img streams together) of the bf16 model against the f32 one, first step.
            "diffusers_bf16_vs_f32_per_block": {
                "double": [rel(b, r) for b, r in zip(first_blocks[:n_double], ref_blocks[:n_double])],
                "single": [rel(b, r) for b, r in zip(first_blocks[n_double:], ref_blocks[n_double:])],
            },
        }
        del tf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del t5, clip

    # The whole pipeline from mold's noise.
    if not a.no_pipeline:
        tf = load_transformer(a.formats.split(",")[0]).to(dev).eval()
        vae = AutoencoderKL.from_pretrained(snap / "vae", torch_dtype=dt).to(dev)
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(snap / "scheduler"),
            vae=vae,
            text_encoder=CLIPTextModel.from_pretrained(snap / "text_encoder", torch_dtype=dt).to(dev),
            tokenizer=tok,
            text_encoder_2=T5EncoderModel.from_pretrained(snap / "text_encoder_2", torch_dtype=dt).to(dev),
            tokenizer_2=tok2,
            transformer=tf,
        )
        seen = []

        def keep(p, i, t, kw):
            seen.append(kw["latents"].detach().float().cpu())
            return kw

        kwargs = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps,
                      latents=put(io["latents"]), max_sequence_length=tokens,
                      callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
        if guidance is not None:
            kwargs["guidance_scale"] = guidance
        with torch.no_grad():
            img = pipe(output_type="pt", **kwargs).images
        mold_steps = [io[f"step.{i}.latents"] for i in range(1, steps)] + [io["final"]]
        step_errs = [rel(m, d) for m, d in zip(mold_steps, seen)]
        mold_img = ((io["image"].float() / 2 + 0.5).clamp(0, 1))
        res["pipeline"] = {
            "step_latents": step_errs,
            "final_latents": step_errs[-1] if step_errs else None,
            "image": rel(mold_img, img),
            "image_psnr_db": psnr(mold_img, img),
            "transformer_format": a.formats.split(",")[0],
        }
    res["seconds"] = time.time() - t0
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
