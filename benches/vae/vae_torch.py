#!/usr/bin/env python3
"""FLUX's autoencoder decoder in plain PyTorch (the structure of BFL's
flux/modules/autoencoder.py), to time against mold's and as a parity reference on the same
weights. No diffusers needed.

  vae_torch.py make DIR [--size S] [--seed N]
      writes DIR/ae.safetensors (random decoder weights under BFL's names, f32: what mold's
      Vae::load reads) and DIR/z.safetensors (`z`, a (1, 16, S, S) f32 latent, S = 128 for
      a 1024x1024 image)
  vae_torch.py run DIR [--iters N] [--compile-mode MODE|none] [--profile]
      decodes DIR/z with DIR/ae in bf16: eager (NCHW), eager channels_last, torch.compile
      channels_last; median of N after warm-up, CUDA events; one JSON line each; writes
      DIR/torch_bf16.safetensors (eager) and DIR/torch_f32.safetensors (an f32 decode, TF32
      off: the reference the bf16 decodes are compared with)
  vae_torch.py compare REF A [B ...]
      `image` of each file against REF's: max |a - ref| / max |ref|, mean |a - ref|
"""
import argparse, json, math, statistics, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

SCALE, SHIFT = 0.3611, 0.1159


def norm(c):
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        q, k, v = (t.reshape(b, 1, c, hh * ww).transpose(2, 3).contiguous() for t in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v)
        h = h.transpose(2, 3).reshape(b, c, hh, ww)
        return x + self.proj_out(h)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)
        self.cin, self.cout = cin, cout

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.cin != self.cout:
            x = self.nin_shortcut(x)
        return x + h


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    def __init__(self, ch=128, out_ch=3, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=16):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        self.up = nn.ModuleList()
        for i in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[i]
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
            if i != 0:
                up.upsample = Upsample(block_in)
            self.up.insert(0, up)
        self.norm_out = norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i in reversed(range(len(self.up))):
            for b in self.up[i].block:
                h = b(h)
            if i != 0:
                h = self.up[i].upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def make(a):
    g = torch.Generator().manual_seed(a.seed)
    dec = Decoder()
    sd = {}
    for name, p in dec.state_dict().items():
        r = torch.randn(p.shape, generator=g)
        if p.ndim == 1 and "norm" in name and name.endswith("weight"):
            v = 1 + 0.1 * r
        elif name.endswith("bias"):
            v = 0.1 * r
        else:  # convolution filters: unit-variance outputs
            v = r / math.sqrt(p[0].numel())
        sd["decoder." + name] = v.contiguous()
    save_file(sd, f"{a.dir}/ae.safetensors")
    z = torch.randn((1, 16, a.size, a.size), generator=g)
    save_file({"z": z}, f"{a.dir}/z.safetensors")
    print(json.dumps({"wrote": a.dir, "tensors": len(sd), "latent": list(z.shape)}), flush=True)


def load(d, dtype):
    dec = Decoder()
    sd = {k[len("decoder."):]: v for k, v in load_file(f"{d}/ae.safetensors").items()}
    dec.load_state_dict(sd)
    return dec.to("cuda", dtype).eval()


def timed(fn, x, iters):
    with torch.inference_mode():
        for _ in range(3):
            y = fn(x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(x)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
    return y, statistics.median(ts), min(ts)


def run(a):
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name(),
                      "cudnn_benchmark": torch.backends.cudnn.benchmark}), flush=True)
    z = load_file(f"{a.dir}/z.safetensors")["z"].cuda()
    zin = z / SCALE + SHIFT
    # f32 reference, TF32 off.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dec = load(a.dir, torch.float32)
    with torch.inference_mode():
        ref = dec(zin).float().cpu()
    save_file({"image": ref.contiguous()}, f"{a.dir}/torch_f32.safetensors")
    del dec
    torch.cuda.empty_cache()

    dec = load(a.dir, torch.bfloat16)
    x = zin.to(torch.bfloat16)
    y, med, mn = timed(dec, x, a.iters)
    save_file({"image": y.float().cpu().contiguous()}, f"{a.dir}/torch_bf16.safetensors")
    print(json.dumps({"variant": "eager NCHW", "median_ms": round(med, 2), "min_ms": round(mn, 2)}), flush=True)

    dec = dec.to(memory_format=torch.channels_last)
    xc = x.contiguous(memory_format=torch.channels_last)
    _, med, mn = timed(dec, xc, a.iters)
    print(json.dumps({"variant": "eager channels_last", "median_ms": round(med, 2), "min_ms": round(mn, 2)}), flush=True)
    torch.backends.cudnn.benchmark = True
    _, med, mn = timed(dec, xc, a.iters)
    print(json.dumps({"variant": "eager channels_last, cudnn.benchmark", "median_ms": round(med, 2),
                      "min_ms": round(mn, 2)}), flush=True)
    if a.profile:
        from torch.profiler import profile, ProfilerActivity
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec(xc)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    torch.backends.cudnn.benchmark = False

    if a.compile_mode != "none":
        t = time.time()
        comp = torch.compile(dec, mode=a.compile_mode)
        with torch.inference_mode():
            yc = comp(xc)
            torch.cuda.synchronize()
        compile_s = time.time() - t
        _, med, mn = timed(comp, xc, a.iters)
        d = (yc.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
        print(json.dumps({"variant": f"compiled channels_last ({a.compile_mode})", "median_ms": round(med, 2),
                          "min_ms": round(mn, 2), "compile_s": round(compile_s, 1),
                          "max_rel_vs_f32": d}), flush=True)


def compare(a):
    ref = load_file(a.ref)["image"].float()
    scale = ref.abs().max().item()
    print(json.dumps({"reference": a.ref, "max_abs": scale}), flush=True)
    for f in a.others:
        x = load_file(f)["image"].float()
        if x.shape != ref.shape:
            print(json.dumps({"file": f, "error": f"shape {list(x.shape)} vs {list(ref.shape)}"}), flush=True)
            continue
        d = (x - ref).abs()
        print(json.dumps({"file": f, "max_rel": d.max().item() / scale, "mean_abs": d.mean().item()}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--size", type=int, default=128)
    m.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--iters", type=int, default=20)
    r.add_argument("--compile-mode", default="default")
    r.add_argument("--profile", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("others", nargs="+")
    a = p.parse_args()
    {"make": make, "run": run, "compare": compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
