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

`--reference f32` (for a bf16 run) also runs diffusers in f32 on the same weights and
inputs (both as the bf16 runs see them: rounded to bf16, then computed in f32) and
reports, under `reference`, `mold_vs_f32` and `diffusers_vs_f32` (each bf16 output
against that f32 one) beside `mold_vs_diffusers` (the number above), so that a bf16 miss
can be judged against diffusers' own bf16 error. f32 runs here are strict
IEEE f32: PyTorch's default TF32 for convolutions and matrix products is turned off.

    mold testdata qwen-image-tiny W
    mold plan --model qwen-image-tiny --machine sim/machines/cpu-emu-4.yaml --tp 2 -o p.yaml
    mold exec p.yaml --weights W --steps 1 --save-io io.safetensors
    python3 benches/parity/qwen_diffusers.py --weights W --io io.safetensors [--device cuda]

    # bf16 (mold plan --dtype transformer=bf16), judged against f32:
    python3 benches/parity/qwen_diffusers.py --weights W --io io-bf16.safetensors --reference f32

The call's inputs: `hidden_states` (b, h*w, 64) packed latents, `encoder_hidden_states`
(b, L, joint_attention_dim), `timestep` (b,) in [0, 1] (the pipeline's `timestep /
1000`), `img_shapes` [1, h, w]; every text token is valid (no mask, as the pipeline
passes none when the prompt has no padding).
"""

import argparse
import inspect
import json
import statistics
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


IO_INPUTS = ("hidden_states", "encoder_hidden_states", "timestep", "img_shapes")


def read_io(path, need=IO_INPUTS + ("output",)):
    """mold's io file (`mold exec PLAN --weights DIR --save-io FILE`, no --prompt): its
    tensors, its metadata and the patch grid (1, h, w); exits when a key in `need` is
    missing or the grid does not hold the image tokens."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    io = load_file(path)
    missing = [k for k in need if k not in io]
    if missing:
        raise SystemExit(
            f"{path}: no {', '.join(missing)}: write it with `mold exec PLAN --weights DIR --save-io FILE` (without --prompt)"
        )
    grid = tuple(int(v) for v in io["img_shapes"].tolist())
    n_img = io["hidden_states"].shape[1]
    if len(grid) != 3 or grid[1] * grid[2] != n_img:
        raise SystemExit(f"{path}: img_shapes {grid} does not hold {n_img} image tokens")
    return io, meta, grid


def load_transformer(weights, dt, dev, compute=None):
    """diffusers' QwenImageTransformer2DModel from `weights`/transformer (mold testdata's
    layout), weights read in `dt`, moved to `dev` in `compute` (default `dt`), eval mode."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(weights, subfolder="transformer", torch_dtype=dt)
    return model.to(dev, compute or dt).eval()


def compile_model(model):
    """torch.compile as a user chasing speed would: regional (compile_repeated_blocks, one
    graph for the repeated blocks) where diffusers has it, else the whole model.
    Returns (model, how)."""
    if hasattr(model, "compile_repeated_blocks"):
        model.compile_repeated_blocks(fullgraph=True)
        return model, "compile_repeated_blocks(fullgraph=True)"
    return torch.compile(model), "torch.compile(model)"


def call_kwargs(model, hidden_states, encoder_hidden_states, timestep, grid):
    """The keyword arguments of one transformer call on these inputs: every text token
    valid (no mask), `grid` = (1, h, w) for every batch item."""
    b = hidden_states.shape[0]
    kwargs = dict(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        encoder_hidden_states_mask=None,
        timestep=timestep,
        img_shapes=[[grid]] * b,
        return_dict=False,
    )
    # Older diffusers releases take the text lengths for RoPE as `txt_seq_lens`.
    if "txt_seq_lens" in inspect.signature(model.forward).parameters:
        kwargs["txt_seq_lens"] = [encoder_hidden_states.shape[1]] * b
    return kwargs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="directory holding transformer/ (mold testdata qwen-image[-tiny])")
    ap.add_argument("--io", required=True, help="the file of `mold exec PLAN --weights DIR --save-io FILE` (no --prompt)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], help="compute dtype (default: the plan's, from the io file)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, help="largest accepted error (default 1e-4 f32, 2e-2 bf16)")
    ap.add_argument(
        "--reference",
        choices=["f32"],
        help="also run diffusers in f32 and report mold's and diffusers' bf16 errors against it",
    )
    ap.add_argument("--time", type=int, default=0, metavar="N",
                    help="also time N more calls of the same inputs after 2 warm-up calls (median, "
                         "synchronised): diffusers' step beside mold's in the same run")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the transformer first, as a user chasing speed would: "
                         "regional (compile_repeated_blocks, one graph for the 60 blocks) where "
                         "diffusers has it, else torch.compile of the whole model")
    ap.add_argument("--out", help="also write the JSON result here")
    a = ap.parse_args()

    io, meta, grid = read_io(a.io)
    dtype_name = a.dtype or meta.get("dtype", "f32")
    if dtype_name not in ("f32", "bf16"):
        raise SystemExit(f"{a.io}: the plan's dtype is {dtype_name}: pass --dtype f32 or bf16")
    if a.reference == "f32" and dtype_name != "bf16":
        raise SystemExit(f"--reference f32 judges a bf16 run; {a.io} is {dtype_name}: drop --reference")
    dtype = torch.float32 if dtype_name == "f32" else torch.bfloat16
    tol = a.tolerance if a.tolerance is not None else (1e-4 if dtype_name == "f32" else 2e-2)
    dev = torch.device(a.device)
    strict_f32()

    b, n_img = io["hidden_states"].shape[0], io["hidden_states"].shape[1]

    def run(dt, compute=None):
        """diffusers' transformer on the io file's inputs, weights and inputs in `dt`,
        computed in `compute` (default `dt`): (output, load s, call s)."""
        compute = compute or dt
        t0 = time.time()
        model = load_transformer(a.weights, dt, dev, compute)
        compiled = None
        if a.compile and compute == dt:
            model, compiled = compile_model(model)
        load_s = time.time() - t0

        def inp(k):
            return io[k].to(dev, dt).to(compute)

        kwargs = call_kwargs(model, inp("hidden_states"), inp("encoder_hidden_states"), inp("timestep"), grid)
        with torch.no_grad():
            t1 = time.time()
            out = model(**kwargs)[0]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            call_s = time.time() - t1
            if a.time > 0 and compute == dt:
                sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
                for _ in range(2):
                    model(**kwargs)
                sync()
                ms = []
                for _ in range(a.time):
                    t2 = time.perf_counter()
                    model(**kwargs)
                    sync()
                    ms.append((time.perf_counter() - t2) * 1e3)
                timing["call_ms_median"] = statistics.median(ms)
                timing["call_ms_all"] = [round(x, 3) for x in ms]
                timing["mode"] = compiled or "eager"
                timing["first_call_s"] = call_s
        out = out.float().cpu()
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return out, load_s, call_s

    timing = {}
    want, load_s, call_s = run(dtype)
    err = rel(io["output"], want)
    result = {
        "model": meta.get("model"),
        "dtype": dtype_name,
        "device": str(dev),
        "batch": b,
        "image_tokens": n_img,
        "text_tokens": io["encoder_hidden_states"].shape[1],
        "transformer_max_relative_error": err,
        "tolerance": tol,
        "passed": err <= tol,
        "diffusers_load_s": load_s,
        "diffusers_call_s": call_s,
    }
    if timing:
        # True CFG runs the transformer twice a step (the prompt, then the negative prompt),
        # as QwenImagePipeline does: a step is two calls of this batch.
        timing["batch"] = b
        timing["cfg_step_ms"] = 2 * timing["call_ms_median"]
        result["diffusers_timing"] = timing
    if a.reference == "f32":
        ref, _, ref_call_s = run(dtype, torch.float32)
        result["reference"] = {
            "dtype": "f32",
            "weights_and_inputs": dtype_name,
            "mold_vs_f32": rel(io["output"], ref),
            "diffusers_vs_f32": rel(want, ref),
            "mold_vs_diffusers": err,
            "diffusers_f32_call_s": ref_call_s,
        }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if err <= tol else 1)


if __name__ == "__main__":
    main()
