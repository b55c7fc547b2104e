#!/usr/bin/env python3
"""PyTorch reference for one denoising step of the FLUX.1-dev transformer.

The BFL architecture (github.com/black-forest-labs/flux, src/flux/model.py), written out
in plain PyTorch eager, bf16, with random weights: 19 double-stream and 38 single-stream
blocks, hidden 3072, 24 heads x 128, MLP ratio 4, QK RMSNorm, 3-axis RoPE (axes 16/56/56,
theta 10000), modulation, timestep/guidance/vector embeddings and the final adaLN layer.
Attention is torch.nn.functional.scaled_dot_product_attention.

Modes:
  single   one GPU (cuda:0)
  split    one process, two GPUs: the first --split-at blocks of the execution order
           (default 29 = double 0..19 + single 0..10) on cuda:0, the rest and the final
           layer on cuda:1; the activations move between them with .to()
  tp       Megatron-style tensor parallel under `torchrun --nproc_per_node N`: q/k/v
           and the MLP up projection column-parallel (sharded by heads / rows), attention
           out-projection and MLP down projection row-parallel, each followed by one NCCL
           all-reduce; single blocks' linear1 sharded per part (q, k, v, mlp), linear2
           row-parallel; embeddings, modulation and the final layer replicated

Weights are drawn from N(0, 1/sqrt(fan_in)) straight on the GPU, each tensor from its own
generator seeded from --seed and the tensor's index, so every mode builds the same model
(TP ranks draw the full tensor and keep their shard): `out_abs_mean` should agree across
modes up to bf16 rounding.

Prints one JSON line (rank 0 only under torchrun), e.g.
  {"impl": "pytorch", "mode": "tp", "world": 2, "step_ms_median": ..., ...}

  python3 benches/flux_step_torch.py --mode single
  python3 benches/flux_step_torch.py --mode split
  torchrun --nproc_per_node 2 benches/flux_step_torch.py --mode tp
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# FLUX.1-dev
HIDDEN = 3072
HEADS = 24
HEAD_DIM = HIDDEN // HEADS  # 128
MLP_HIDDEN = 4 * HIDDEN  # 12288
DEPTH_DOUBLE = 19
DEPTH_SINGLE = 38
IN_CHANNELS = 64  # 16 latent channels x 2x2 patch
CONTEXT_DIM = 4096  # T5-XXL
VEC_DIM = 768  # CLIP-L pooled
TIME_DIM = 256  # sinusoidal embedding width
AXES_DIM = (16, 56, 56)
THETA = 10000
DTYPE = torch.bfloat16


# ---------------------------------------------------------------- weights


class Init:
    """Draws every tensor from its own seeded generator on the tensor's device, so the
    same (seed, index) gives the same values whatever the mode or device."""

    def __init__(self, seed):
        self.seed = seed
        self.count = 0

    def randn(self, shape, fan_in, device):
        self.count += 1
        g = torch.Generator(device=device)
        g.manual_seed(self.seed * 1_000_003 + self.count)
        t = torch.randn(shape, generator=g, device=device, dtype=DTYPE)
        return t.mul_(1.0 / math.sqrt(fan_in))


class TP:
    """This process's tensor-parallel rank and world (1 and 0 outside `--mode tp`)."""

    def __init__(self, world=1, rank=0):
        self.world, self.rank = world, rank

    def block(self, t, dim):
        """This rank's one of `world` equal blocks of t along dim."""
        return t.chunk(self.world, dim)[self.rank] if self.world > 1 else t

    def all_reduce(self, x):
        if self.world > 1:
            dist.all_reduce(x)
        return x


NO_TP = TP()


class Linear:
    def __init__(self, init, device, fan_in, fan_out, bias=True):
        self.w = init.randn((fan_out, fan_in), fan_in, device)
        self.b = init.randn((fan_out,), fan_in, device) if bias else None

    def __call__(self, x):
        return F.linear(x, self.w, self.b)


def heads_shard(t, parts, tp):
    """Rows of a fused [part0 | part1 | ...] projection (each part HEADS*HEAD_DIM rows),
    keeping this rank's heads of every part."""
    if tp.world == 1:
        return t
    hl = HEADS // tp.world
    v = t.view(parts, HEADS, HEAD_DIM, *t.shape[1:])
    return v[:, tp.rank * hl:(tp.rank + 1) * hl].reshape(parts * hl * HEAD_DIM, *t.shape[1:])


class ColumnParallel(Linear):
    """Output features sharded: `parts` fused attention parts sharded by heads, then
    `mlp` rows sharded in equal blocks."""

    def __init__(self, init, device, fan_in, parts, mlp, tp):
        super().__init__(init, device, fan_in, parts * HIDDEN + mlp)
        if tp.world > 1:
            pieces_w, pieces_b = [], []
            if parts:
                pieces_w.append(heads_shard(self.w[: parts * HIDDEN], parts, tp))
                pieces_b.append(heads_shard(self.b[: parts * HIDDEN], parts, tp))
            if mlp:
                pieces_w.append(tp.block(self.w[parts * HIDDEN:], 0))
                pieces_b.append(tp.block(self.b[parts * HIDDEN:], 0))
            self.w = torch.cat(pieces_w, 0).contiguous()
            self.b = torch.cat(pieces_b, 0).contiguous()


class RowParallel(Linear):
    """Input features sharded (attention heads first, then MLP rows, as ColumnParallel
    leaves them); partial products all-reduced, bias added once after the sum."""

    def __init__(self, init, device, attn, mlp, tp):
        super().__init__(init, device, attn + mlp, HIDDEN)
        self.tp = tp
        if tp.world > 1:
            # heads are contiguous column blocks of the attention input, so the
            # attention columns and the MLP columns each split into equal blocks
            pieces = [tp.block(self.w[:, :attn], 1)] if attn else []
            if mlp:
                pieces.append(tp.block(self.w[:, attn:], 1))
            self.w = torch.cat(pieces, 1).contiguous()

    def __call__(self, x):
        return self.tp.all_reduce(F.linear(x, self.w)) + self.b


class RMSNorm:
    def __init__(self, device):
        self.scale = torch.ones(HEAD_DIM, device=device, dtype=DTYPE)

    def __call__(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x.to(dt) * self.scale


class MLPEmbedder:
    def __init__(self, init, device, fan_in):
        self.inp = Linear(init, device, fan_in, HIDDEN)
        self.out = Linear(init, device, HIDDEN, HIDDEN)

    def __call__(self, x):
        return self.out(F.silu(self.inp(x)))


# ---------------------------------------------------------------- functions


def layer_norm(x):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def gelu(x):
    return F.gelu(x, approximate="tanh")


def modulate(x, shift, scale):
    return (1 + scale) * layer_norm(x) + shift


def timestep_embedding(t, dim=TIME_DIM, max_period=10000, time_factor=1000.0):
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope(pos, dim):
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (THETA ** scale)
    out = torch.einsum("...n,d->...nd", pos.double(), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.view(*out.shape[:-1], 2, 2).float()


def embed_nd(ids):
    """(B, L, 3) positions -> (B, 1, L, HEAD_DIM/2, 2, 2) rotations."""
    emb = torch.cat([rope(ids[..., i], AXES_DIM[i]) for i in range(3)], dim=-3)
    return emb.unsqueeze(1)


def apply_rope(x, pe):
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]
    return out.reshape(*x.shape).type_as(x)


def attention(q, k, v, pe):
    q, k = apply_rope(q, pe), apply_rope(k, pe)
    x = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    b, h, l, d = x.shape
    return x.transpose(1, 2).reshape(b, l, h * d)


def split_heads(qkv, heads):
    """(B, L, 3*H*D) -> three (B, H, L, D)."""
    b, l, _ = qkv.shape
    q, k, v = qkv.view(b, l, 3, heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
    return q, k, v


# ---------------------------------------------------------------- blocks


class Stream:
    """One stream (img or txt) of a double block."""

    def __init__(self, init, device, tp):
        self.mod = Linear(init, device, HIDDEN, 6 * HIDDEN)  # replicated
        self.qkv = ColumnParallel(init, device, HIDDEN, 3, 0, tp)
        self.q_norm, self.k_norm = RMSNorm(device), RMSNorm(device)
        self.proj = RowParallel(init, device, HIDDEN, 0, tp)
        self.mlp_up = ColumnParallel(init, device, HIDDEN, 0, MLP_HIDDEN, tp)
        self.mlp_down = RowParallel(init, device, 0, MLP_HIDDEN, tp)

    def pre_attention(self, x, vec, heads):
        m = self.mod(F.silu(vec))[:, None, :].chunk(6, dim=-1)
        q, k, v = split_heads(self.qkv(modulate(x, m[0], m[1])), heads)
        return (self.q_norm(q).to(v), self.k_norm(k).to(v), v), m

    def post_attention(self, x, attn, m):
        x = x + m[2] * self.proj(attn)
        return x + m[5] * self.mlp_down(gelu(self.mlp_up(modulate(x, m[3], m[4]))))


class DoubleBlock:
    def __init__(self, init, device, tp):
        self.heads = HEADS // tp.world
        self.img = Stream(init, device, tp)
        self.txt = Stream(init, device, tp)

    def __call__(self, img, txt, vec, pe):
        (iq, ik, iv), im = self.img.pre_attention(img, vec, self.heads)
        (tq, tk, tv), tm = self.txt.pre_attention(txt, vec, self.heads)
        q, k, v = (torch.cat(p, dim=2) for p in ((tq, iq), (tk, ik), (tv, iv)))
        attn = attention(q, k, v, pe)
        n = txt.shape[1]
        img = self.img.post_attention(img, attn[:, n:], im)
        txt = self.txt.post_attention(txt, attn[:, :n], tm)
        return img, txt


class SingleBlock:
    def __init__(self, init, device, tp):
        self.heads = HEADS // tp.world
        self.mod = Linear(init, device, HIDDEN, 3 * HIDDEN)  # replicated
        self.linear1 = ColumnParallel(init, device, HIDDEN, 3, MLP_HIDDEN, tp)
        self.linear2 = RowParallel(init, device, HIDDEN, MLP_HIDDEN, tp)
        self.q_norm, self.k_norm = RMSNorm(device), RMSNorm(device)
        self.qkv_local = 3 * self.heads * HEAD_DIM

    def __call__(self, x, vec, pe):
        shift, scale, gate = self.mod(F.silu(vec))[:, None, :].chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(x, shift, scale)).split(
            [self.qkv_local, self.linear1.w.shape[0] - self.qkv_local], dim=-1)
        q, k, v = split_heads(qkv, self.heads)
        attn = attention(self.q_norm(q).to(v), self.k_norm(k).to(v), v, pe)
        return x + gate * self.linear2(torch.cat((attn, gelu(mlp)), dim=2))


class Stem:
    """Input projections and the conditioning vector."""

    def __init__(self, init, device):
        self.img_in = Linear(init, device, IN_CHANNELS, HIDDEN)
        self.time_in = MLPEmbedder(init, device, TIME_DIM)
        self.vector_in = MLPEmbedder(init, device, VEC_DIM)
        self.guidance_in = MLPEmbedder(init, device, TIME_DIM)
        self.txt_in = Linear(init, device, CONTEXT_DIM, HIDDEN)

    def __call__(self, x):
        vec = self.time_in(timestep_embedding(x["timesteps"]).to(DTYPE))
        vec = vec + self.guidance_in(timestep_embedding(x["guidance"]).to(DTYPE))
        vec = vec + self.vector_in(x["y"])
        pe = embed_nd(torch.cat((x["txt_ids"], x["img_ids"]), dim=1))
        return self.img_in(x["img"]), self.txt_in(x["txt"]), vec, pe


class FinalLayer:
    def __init__(self, init, device):
        self.mod = Linear(init, device, HIDDEN, 2 * HIDDEN)
        self.linear = Linear(init, device, HIDDEN, IN_CHANNELS)

    def __call__(self, x, vec):
        shift, scale = self.mod(F.silu(vec)).chunk(2, dim=1)
        return self.linear(modulate(x, shift[:, None, :], scale[:, None, :]))


class Flux:
    """The transformer; blocks[i] lives on devices[i] (execution order: 19 double, then
    38 single), the stem on the first block's device, the final layer on the last's."""

    def __init__(self, init, devices, tp=NO_TP):
        assert len(devices) == DEPTH_DOUBLE + DEPTH_SINGLE
        self.devices = devices
        self.stem = Stem(init, devices[0])
        self.blocks = [DoubleBlock(init, devices[i], tp) for i in range(DEPTH_DOUBLE)]
        self.blocks += [SingleBlock(init, devices[DEPTH_DOUBLE + i], tp) for i in range(DEPTH_SINGLE)]
        self.final = FinalLayer(init, devices[-1])

    @torch.inference_mode()
    def __call__(self, x):
        img, txt, vec, pe = self.stem(x)
        dev = self.devices[0]
        n_txt = txt.shape[1]
        for i, block in enumerate(self.blocks):
            if self.devices[i] != dev:  # block-split boundary: move the activations
                dev = self.devices[i]
                img, txt, vec, pe = (t.to(dev) for t in (img, txt, vec, pe))
            if i < DEPTH_DOUBLE:
                img, txt = block(img, txt, vec, pe)
            else:
                if i == DEPTH_DOUBLE:
                    img = torch.cat((txt, img), dim=1)
                img = block(img, vec, pe)
        return self.final(img[:, n_txt:], vec)


# ---------------------------------------------------------------- benchmark


def make_inputs(seed, device, width, height, txt_len):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    h, w = height // 16, width // 16

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(DTYPE)

    rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w)
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(1, h * w, 3)
    return {
        "img": randn(1, h * w, IN_CHANNELS),
        "img_ids": img_ids,
        "txt": randn(1, txt_len, CONTEXT_DIM),
        "txt_ids": torch.zeros(1, txt_len, 3, device=device),
        "y": randn(1, VEC_DIM),
        "timesteps": torch.ones(1, device=device),
        "guidance": torch.full((1,), 3.5, device=device),
    }


def sdpa_context(name):
    if name == "auto":
        import contextlib
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    return sdpa_kernel([backend])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["single", "split", "tp"], default="single")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="1024x1024", help="WIDTHxHEIGHT (default 1024x1024)")
    ap.add_argument("--txt-len", type=int, default=512)
    ap.add_argument("--split-at", type=int, default=DEPTH_DOUBLE + 10,
                    help="split mode: blocks (execution order) on cuda:0; default 29 = "
                         "double 0..19 + single 0..10")
    ap.add_argument("--sdpa", choices=["auto", "flash", "efficient", "cudnn", "math"], default="auto",
                    help="restrict scaled_dot_product_attention to one backend")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: smoke test (with --tiny), gloo instead of NCCL under torchrun")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: a tiny model of the same structure (3 double, 4 single "
                         "blocks, hidden 64, 4 heads x 16), checks the code paths, not speed")
    args = ap.parse_args()
    if args.tiny:
        globals().update(HIDDEN=64, HEADS=4, HEAD_DIM=16, MLP_HIDDEN=256, DEPTH_DOUBLE=3,
                         DEPTH_SINGLE=4, IN_CHANNELS=8, CONTEXT_DIM=32, VEC_DIM=24,
                         AXES_DIM=(4, 6, 6))
        if args.split_at == ap.get_default("split_at"):
            args.split_at = 4
    width, height = (int(v) for v in args.size.lower().split("x"))
    n_blocks = DEPTH_DOUBLE + DEPTH_SINGLE
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (--device cpu --tiny runs a smoke test on the CPU)")
    if not 0 < args.split_at < n_blocks:
        sys.exit(f"error: --split-at must be in 1..{n_blocks - 1}")

    def device(i):
        return torch.device("cuda", i) if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    tp = NO_TP
    if args.mode == "tp":
        if "LOCAL_RANK" not in os.environ:
            sys.exit("error: --mode tp runs under torchrun --nproc_per_node N")
        local = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=device(local))
        else:
            dist.init_process_group("gloo")
        tp = TP(dist.get_world_size(), dist.get_rank())
        if HEADS % tp.world:
            sys.exit(f"error: {HEADS} heads do not split over {tp.world} ranks")
        devices = [device(local)] * n_blocks
        world = tp.world
    elif args.mode == "split":
        if cuda and torch.cuda.device_count() < 2:
            sys.exit("error: --mode split needs 2 GPUs")
        devices = [device(0 if i < args.split_at else 1) for i in range(n_blocks)]
        world = 2
    else:
        devices = [device(0)] * n_blocks
        world = 1
    used = sorted({d.index for d in devices}) if cuda else []

    def sync():
        for d in used:
            torch.cuda.synchronize(d)

    t0 = time.perf_counter()
    model = Flux(Init(args.seed), devices, tp)
    x = make_inputs(args.seed + 1, devices[0], width, height, args.txt_len)
    sync()
    build_s = time.perf_counter() - t0
    if cuda:  # TP ranks drew full tensors and kept shards: hand the rest back (for nvidia-smi)
        torch.cuda.empty_cache()
    weights_gib = [torch.cuda.memory_allocated(d) / 2**30 for d in used] or [0.0]
    for d in used:
        torch.cuda.reset_peak_memory_stats(d)

    # Rectified-flow Euler steps, as `mold exec` runs them: x <- x + (t_next - t) v(x, t).
    total = args.warmup + args.iters
    times = []
    with sdpa_context(args.sdpa), torch.inference_mode():
        for i in range(total):
            t, t_next = 1.0 - i / total, 1.0 - (i + 1) / total
            x["timesteps"].fill_(t)
            sync()
            start = time.perf_counter()
            v = model(x).to(devices[0])
            x["img"] = x["img"] + (t_next - t) * v
            sync()
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
    out_abs_mean = x["img"].float().abs().mean().item()
    peak = [torch.cuda.max_memory_allocated(d) / 2**30 for d in used] or [0.0]

    if tp.world > 1:  # a step lasts as long as its slowest rank; gather every rank's memory
        dev = devices[0]
        t = torch.tensor(times, device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
        mem = torch.tensor(peak + weights_gib, device=dev, dtype=torch.float64)
        all_mem = [torch.empty_like(mem) for _ in range(tp.world)]
        dist.all_gather(all_mem, mem)
        peak = [m[0].item() for m in all_mem]
        weights_gib = [m[1].item() for m in all_mem]

    if tp.rank == 0:
        print(json.dumps({
            "impl": "pytorch",
            "mode": args.mode,
            "world": world,
            "step_ms_median": round(statistics.median(times), 3),
            "step_ms_all": [round(v, 3) for v in times],
            "peak_mem_gib": [round(v, 3) for v in peak],
            "weights_mem_gib": [round(v, 3) for v in weights_gib],
            "device": torch.cuda.get_device_name(devices[0]) if cuda else "cpu",
            "torch": torch.__version__,
            "size": f"{width}x{height}",
            "tiny": args.tiny,
            "img_tokens": (width // 16) * (height // 16),
            "txt_tokens": args.txt_len,
            "warmup": args.warmup,
            "iters": args.iters,
            "split_at": args.split_at if args.mode == "split" else None,
            "sdpa": args.sdpa,
            "build_s": round(build_s, 2),
            "out_abs_mean": out_abs_mean,
        }), flush=True)
    if tp.world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
