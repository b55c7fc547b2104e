#!/usr/bin/env python3
"""PyTorch reference for one denoising step of the FLUX.1-dev transformer.

The BFL architecture (github.com/black-forest-labs/flux, src/flux/model.py), written out
in plain PyTorch, bf16, with random weights: 19 double-stream and 38 single-stream
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
  sp       Ulysses sequence parallel under `torchrun --nproc_per_node N`: every rank
           holds all weights and a contiguous slice of the text tokens and one of the
           image tokens (uneven: the first n % N ranks one token more); everything
           token-wise runs on the local slice; in each attention q, k, v (after QK norm
           and RoPE at the local tokens' positions) go through one all_to_all_single
           (variable split sizes) so that each rank holds all tokens of HEADS/N heads,
           SDPA runs on those, and a second all_to_all_single brings every rank its own
           tokens of all heads back; the final layer runs on the local image tokens and
           its output is all-gathered. HEADS must divide by N (24: N = 2, 3, 4, 6, 8).

--compile wraps the block kinds in torch.compile (Inductor, default mode): one compiled
function for DoubleBlock.__call__ and one for SingleBlock.__call__, shared by all blocks
of that kind (weights are graph inputs, so the blocks of a kind share one graph); stem and
final layer stay eager. tp's all-reduces and sp's all-to-alls are traced into the block
graphs as functional collectives (one graph per block kind, no graph break); with
--compile-comm eager they run as in eager mode at graph breaks (torch.compiler.disable),
the fallback should tracing them fail. The warm-up steps absorb compilation (--warmup >= 1);
the JSON line's compile_stats gives the graphs, graph breaks and the first step's seconds.

--fp8 holds every block's linear layers (projections, MLPs, modulation) in float8 e4m3 with
one scale per output feature and runs them through torch._scaled_mm with per-token input
scales computed on the fly (rowwise scaling), as mold's FP8 plans do; the stem and the final
layer stay bf16. With --check the reference is then the dense bf16 model.

--check, after the timed steps, runs the model once more on the first step's inputs and,
on rank 0, the unsharded eager model (mode single, no compile) on the same inputs and
weights, and adds to the JSON line check_max_abs_err = max|out - ref| and
check_max_rel_err = max|out - ref| / max|ref| (the model output, i.e. the velocity).
In single mode without --compile the reference is the same computation (error 0).

Weights are drawn from N(0, 1/sqrt(fan_in)) straight on the GPU, each tensor from its own
generator seeded from --seed and the tensor's index, so every mode builds the same model
(TP ranks draw the full tensor and keep their shard, SP ranks keep it whole):
`out_abs_mean` should agree across modes up to bf16 rounding.

Prints one JSON line (rank 0 only under torchrun), e.g.
  {"impl": "pytorch", "mode": "tp", "world": 2, "step_ms_median": ..., "compiled": false, ...}

  python3 benches/flux_step_torch.py --mode single [--compile] [--check] [--fp8]
  python3 benches/flux_step_torch.py --mode split
  torchrun --nproc_per_node 2 benches/flux_step_torch.py --mode tp
  torchrun --nproc_per_node 4 benches/flux_step_torch.py --mode sp --check
  torchrun --nproc_per_node 3 benches/flux_step_torch.py --mode sp --device cpu --tiny --check
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
        return all_reduce(x) if self.world > 1 else x


NO_TP = TP()


# The collectives inside the blocks. Under --compile Dynamo traces them into the block's
# graph (functional collectives); --compile-comm eager swaps in torch.compiler.disable'd
# versions (Flux.compile), which run as in eager mode at graph breaks.
def traced_all_reduce(x):
    dist.all_reduce(x)
    return x


def traced_all_to_all(out, inp, out_splits, in_splits):
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    return out


all_reduce, all_to_all = traced_all_reduce, traced_all_to_all


def even_split(n, world):
    """Sizes of `world` contiguous slices of n items: the first n % world one larger."""
    return [n // world + (r < n % world) for r in range(world)]


class SP:
    """Ulysses sequence parallelism: this rank's token slices and the attention that
    trades tokens for heads around SDPA (world 1: plain attention, no slicing)."""

    def __init__(self, world=1, rank=0, n_txt=0, n_img=0):
        self.world, self.rank = world, rank
        self.txt_sizes = even_split(n_txt, world)
        self.img_sizes = even_split(n_img, world)
        # a rank's attention sequence is its text slice, then its image slice
        self.tok_sizes = [t + i for t, i in zip(self.txt_sizes, self.img_sizes)]

    def _slice(self, t, sizes):
        return t.narrow(1, sum(sizes[: self.rank]), sizes[self.rank])

    def local(self, x):
        """This rank's slices of the token-wise inputs (dim 1); the rest as it is."""
        if self.world == 1:
            return x
        x = dict(x)
        for key, sizes in (("txt", self.txt_sizes), ("txt_ids", self.txt_sizes),
                           ("img", self.img_sizes), ("img_ids", self.img_sizes)):
            x[key] = self._slice(x[key], sizes)
        return x

    def attention(self, q, k, v, pe):
        """q, k, v: (B, H, l, D) of the local tokens -> (B, l, H*D) of the local tokens."""
        if self.world == 1:
            return attention(q, k, v, pe)
        q, k = apply_rope(q, pe), apply_rope(k, pe)
        b, h, l, d = q.shape
        n, hl = self.world, h // self.world
        # rank j gets heads j*hl..(j+1)*hl of q, k, v for our l tokens: (n, 3, B, hl, l, D)
        send = torch.stack((q, k, v)).view(3, b, n, hl, l, d).permute(2, 0, 1, 3, 4, 5).contiguous()
        chunk = 3 * b * hl * d
        recv = q.new_empty(chunk * sum(self.tok_sizes))
        all_to_all(recv, send.view(-1), [chunk * t for t in self.tok_sizes], [chunk * l] * n)
        # rank j's tokens for our heads, in rank order: all tokens (a permutation of the
        # sequence, which non-causal attention does not see; RoPE is already applied)
        parts = recv.split([chunk * t for t in self.tok_sizes])
        q, k, v = torch.cat([p.view(3, b, hl, t, d) for p, t in zip(parts, self.tok_sizes)], dim=3)
        o = F.scaled_dot_product_attention(q, k, v)  # (B, hl, L, D)
        # rank j gets its tokens of our heads back: token-major so the splits are along dim 0
        send = o.permute(2, 0, 1, 3).contiguous()  # (L, B, hl, D)
        recv = o.new_empty(n * l, b, hl, d)
        all_to_all(recv, send, [l] * n, self.tok_sizes)
        # (n, l, B, hl, D): rank j sent heads j*hl.. -> (B, l, H*D)
        return recv.view(n, l, b, hl, d).permute(2, 1, 0, 3, 4).reshape(b, l, h * d)

    def gather_img(self, out):
        """(B, local image tokens, C) -> (B, all image tokens, C) on every rank."""
        if self.world == 1:
            return out
        pad = max(self.img_sizes) - out.shape[1]
        out = F.pad(out, (0, 0, 0, pad)).contiguous()
        bufs = [torch.empty_like(out) for _ in range(self.world)]
        dist.all_gather(bufs, out)
        return torch.cat([t[:, :n] for t, n in zip(bufs, self.img_sizes)], dim=1)


NO_SP = SP()


def fp8_rows(t):
    """Rows of t scaled into float8 e4m3 by their own largest magnitude: (values, scales
    as an (rows, 1) float32 column), as mold quantizes weights and activations."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (t.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


FAST_ACCUM = False  # --fast-accum


def fp8_linear(x, w8, ws, b):
    """x W^T + b through torch._scaled_mm with per-token input scales and per-output-feature
    weight scales (rowwise scaling, f32 accumulation, bf16 out)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x8, xs = fp8_rows(x.reshape(-1, k))
    y = torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws.t(), bias=b, out_dtype=x.dtype,
                         use_fast_accum=FAST_ACCUM)
    return y.reshape(*lead, w8.shape[0])


class Linear:
    def __init__(self, init, device, fan_in, fan_out, bias=True):
        self.w = init.randn((fan_out, fan_in), fan_in, device)
        self.b = init.randn((fan_out,), fan_in, device) if bias else None
        self.w8 = None

    def to_fp8(self):
        """Holds the weight in FP8 (per-row scales); products through fp8_linear."""
        self.w8, self.ws = fp8_rows(self.w)
        self.w = None

    def __call__(self, x):
        if self.w8 is not None:
            return fp8_linear(x, self.w8, self.ws, self.b)
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
        if self.w8 is not None:
            return self.tp.all_reduce(fp8_linear(x, self.w8, self.ws, None)) + self.b
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

    def __call__(self, img, txt, vec, pe, sp):
        (iq, ik, iv), im = self.img.pre_attention(img, vec, self.heads)
        (tq, tk, tv), tm = self.txt.pre_attention(txt, vec, self.heads)
        q, k, v = (torch.cat(p, dim=2) for p in ((tq, iq), (tk, ik), (tv, iv)))
        attn = sp.attention(q, k, v, pe)
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

    def __call__(self, x, vec, pe, sp):
        shift, scale, gate = self.mod(F.silu(vec))[:, None, :].chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(x, shift, scale)).split(
            [self.qkv_local, self.linear1.b.shape[0] - self.qkv_local], dim=-1)
        q, k, v = split_heads(qkv, self.heads)
        attn = sp.attention(self.q_norm(q).to(v), self.k_norm(k).to(v), v, pe)
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
    38 single), the stem on the first block's device, the final layer on the last's.
    Under sequence parallelism (sp) it takes the full inputs, runs on this rank's token
    slices and returns the full output; compiled=True runs the blocks through the
    torch.compile'd functions (compile() first)."""

    def __init__(self, init, devices, tp=NO_TP):
        assert len(devices) == DEPTH_DOUBLE + DEPTH_SINGLE
        self.devices = devices
        self.stem = Stem(init, devices[0])
        self.blocks = [DoubleBlock(init, devices[i], tp) for i in range(DEPTH_DOUBLE)]
        self.blocks += [SingleBlock(init, devices[DEPTH_DOUBLE + i], tp) for i in range(DEPTH_SINGLE)]
        self.final = FinalLayer(init, devices[-1])
        self.compiled_double = self.compiled_single = None

    def to_fp8(self):
        """The products mold runs in FP8 (every block's projections, MLPs and modulation)
        hold FP8 weights; the stem and the final layer stay bf16, as in mold."""
        for b in self.blocks:
            streams = [b.img, b.txt] if isinstance(b, DoubleBlock) else [b]
            for s in streams:
                for name in ("mod", "qkv", "proj", "mlp_up", "mlp_down", "linear1", "linear2"):
                    if hasattr(s, name):
                        getattr(s, name).to_fp8()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def compile(self, comm):
        """One compiled function per block kind, shared by all blocks of that kind;
        comm "traced": collectives in the graph, "eager": graph breaks around them."""
        if comm == "eager":
            # several graphs per block, and the resumed pieces see both streams' shapes:
            # specialize each shape (no dynamic-shape graphs)
            torch._dynamo.config.automatic_dynamic_shapes = False
            globals().update(all_reduce=torch.compiler.disable(traced_all_reduce),
                             all_to_all=torch.compiler.disable(traced_all_to_all))
        self.compiled_double = torch.compile(DoubleBlock.__call__)
        self.compiled_single = torch.compile(SingleBlock.__call__)

    @torch.inference_mode()
    def __call__(self, x, sp=NO_SP, compiled=False):
        double, single = DoubleBlock.__call__, SingleBlock.__call__
        if compiled:
            double, single = self.compiled_double, self.compiled_single
        img, txt, vec, pe = self.stem(sp.local(x))
        dev = self.devices[0]
        n_txt = txt.shape[1]
        for i, block in enumerate(self.blocks):
            if self.devices[i] != dev:  # block-split boundary: move the activations
                dev = self.devices[i]
                img, txt, vec, pe = (t.to(dev) for t in (img, txt, vec, pe))
            if i < DEPTH_DOUBLE:
                img, txt = double(block, img, txt, vec, pe, sp)
            else:
                if i == DEPTH_DOUBLE:
                    img = torch.cat((txt, img), dim=1)
                img = single(block, img, vec, pe, sp)
        return sp.gather_img(self.final(img[:, n_txt:], vec))


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
    ap.add_argument("--mode", choices=["single", "split", "tp", "sp"], default="single")
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
                         "blocks, hidden 96, 6 heads x 16: tp/sp over 2, 3 or 6 ranks), "
                         "checks the code paths, not speed")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile (Inductor, default mode) each block kind; the warm-up "
                         "steps absorb compilation")
    ap.add_argument("--compile-comm", choices=["traced", "eager"], default="traced",
                    help="with --compile: tp/sp collectives traced into the block graphs "
                         "(default) or run eagerly at graph breaks")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, profile one more step (torch.profiler, CUDA "
                         "kernels) and print its kernels grouped by kind to stderr")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 products (torch._scaled_mm, rowwise scales: per token and per "
                         "output feature) for every block's linear layers, as mold's FP8 plans; "
                         "--check then compares with the dense bf16 model")
    ap.add_argument("--fast-accum", action="store_true",
                    help="with --fp8: _scaled_mm's fast accumulation (use_fast_accum=True), as "
                         "mold's FP8 products run by default")
    ap.add_argument("--check", action="store_true",
                    help="after timing, compare one output with the unsharded eager model's "
                         "on rank 0 (max abs / max relative error in the JSON line)")
    args = ap.parse_args()
    globals()["FAST_ACCUM"] = args.fast_accum
    if args.tiny:
        globals().update(HIDDEN=96, HEADS=6, HEAD_DIM=16, MLP_HIDDEN=384, DEPTH_DOUBLE=3,
                         DEPTH_SINGLE=4, IN_CHANNELS=8, CONTEXT_DIM=32, VEC_DIM=24,
                         AXES_DIM=(4, 6, 6))
        if args.split_at == ap.get_default("split_at"):
            args.split_at = 4
    width, height = (int(v) for v in args.size.lower().split("x"))
    n_blocks = DEPTH_DOUBLE + DEPTH_SINGLE
    n_img = (width // 16) * (height // 16)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (--device cpu --tiny runs a smoke test on the CPU)")
    if not 0 < args.split_at < n_blocks:
        sys.exit(f"error: --split-at must be in 1..{n_blocks - 1}")
    if args.compile and args.warmup < 1:
        sys.exit("error: --compile needs --warmup 1 or more (the warm-up steps absorb compilation)")

    def device(i):
        return torch.device("cuda", i) if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    tp, sp = NO_TP, NO_SP
    rank, world = 0, 1
    if args.mode in ("tp", "sp"):
        if "LOCAL_RANK" not in os.environ:
            sys.exit(f"error: --mode {args.mode} runs under torchrun --nproc_per_node N")
        local = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=device(local))
        else:
            dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        if HEADS % world:
            sys.exit(f"error: {HEADS} heads do not split over {world} ranks")
        if args.mode == "tp":
            tp = TP(world, rank)
        else:
            if min(args.txt_len, n_img) < world:
                sys.exit(f"error: --mode sp needs at least {world} text and image tokens "
                         f"(--txt-len {args.txt_len}, --size {args.size}: {n_img} image tokens)")
            sp = SP(world, rank, args.txt_len, n_img)
        devices = [device(local)] * n_blocks
    elif args.mode == "split":
        if cuda and torch.cuda.device_count() < 2:
            sys.exit("error: --mode split needs 2 GPUs")
        devices = [device(0 if i < args.split_at else 1) for i in range(n_blocks)]
        world = 2
    else:
        devices = [device(0)] * n_blocks
    distributed = args.mode in ("tp", "sp") and world > 1
    used = sorted({d.index for d in devices}) if cuda else []

    def sync():
        for d in used:
            torch.cuda.synchronize(d)

    t0 = time.perf_counter()
    model = Flux(Init(args.seed), devices, tp)
    if args.fp8:
        model.to_fp8()
    x = make_inputs(args.seed + 1, devices[0], width, height, args.txt_len)
    x0 = {k: v.clone() for k, v in x.items()} if args.check else None
    sync()
    build_s = time.perf_counter() - t0
    if cuda:  # TP ranks drew full tensors and kept shards: hand the rest back (for nvidia-smi)
        torch.cuda.empty_cache()
    weights_gib = [torch.cuda.memory_allocated(d) / 2**30 for d in used] or [0.0]
    for d in used:
        torch.cuda.reset_peak_memory_stats(d)
    if args.compile:
        model.compile(args.compile_comm)

    # Rectified-flow Euler steps, as `mold exec` runs them: x <- x + (t_next - t) v(x, t).
    total = args.warmup + args.iters
    times, first_step_s = [], None
    with sdpa_context(args.sdpa), torch.inference_mode():
        for i in range(total):
            t, t_next = 1.0 - i / total, 1.0 - (i + 1) / total
            x["timesteps"].fill_(t)
            sync()
            start = time.perf_counter()
            v = model(x, sp, args.compile).to(devices[0])
            x["img"] = x["img"] + (t_next - t) * v
            sync()
            if i == 0:
                first_step_s = time.perf_counter() - start
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
    if args.profile and cuda:
        profile_step(model, x, sp, args, devices)
    compile_stats = None
    if args.compile:  # before --check, whose eager reference is not compiled
        from torch._dynamo.utils import counters
        compile_stats = {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "first_step_s": round(first_step_s, 2),
        }
    out_abs_mean = x["img"].float().abs().mean().item()
    peak = [torch.cuda.max_memory_allocated(d) / 2**30 for d in used] or [0.0]

    check = {}
    if args.check:
        check = run_check(args, model, x0, sp, tp, devices, rank)

    if distributed:  # a step lasts as long as its slowest rank; gather every rank's memory
        dev = devices[0]
        t = torch.tensor(times, device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
        mem = torch.tensor(peak + weights_gib, device=dev, dtype=torch.float64)
        all_mem = [torch.empty_like(mem) for _ in range(world)]
        dist.all_gather(all_mem, mem)
        peak = [m[0].item() for m in all_mem]
        weights_gib = [m[1].item() for m in all_mem]

    if rank == 0:
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
            "img_tokens": n_img,
            "txt_tokens": args.txt_len,
            "warmup": args.warmup,
            "iters": args.iters,
            "split_at": args.split_at if args.mode == "split" else None,
            "sdpa": args.sdpa,
            "compiled": args.compile,
            "fp8": args.fp8,
            "fast_accum": args.fast_accum,
            "compile": compile_how(args.compile_comm) if args.compile else None,
            "compile_stats": compile_stats,
            "build_s": round(build_s, 2),
            "out_abs_mean": out_abs_mean,
            **check,
        }), flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def kernel_kind(name):
    """A CUDA kernel's kind, by its name (cuBLAS/cuDNN/Triton/ATen naming)."""
    n = name.lower()
    if any(k in n for k in ("sdpa", "flash", "fmha", "attention", "cudnn_generated")):
        return "attention"
    if any(k in n for k in ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "cublas")):
        return "gemm"
    if any(k in n for k in ("nccl", "allreduce", "all_reduce")):
        return "collective"
    if "triton" in n:
        return "fused (triton)"
    if any(k in n for k in ("norm", "layer_norm", "rms")):
        return "norm"
    if any(k in n for k in ("copy", "cat", "transpose")):
        return "copy"
    return "elementwise / other"


def profile_step(model, x, sp, args, devices):
    """One step under torch.profiler: every CUDA kernel's time, grouped by kind, and the top
    kernels, printed to stderr (so the JSON line on stdout stays one line)."""
    from torch.profiler import ProfilerActivity, profile
    with sdpa_context(args.sdpa), torch.inference_mode():
        torch.cuda.synchronize(devices[0])
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            model(x, sp, args.compile)
            torch.cuda.synchronize(devices[0])
    kinds, count, top = {}, 0, []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if not us or e.device_type.name != "CUDA":
            continue
        k = kernel_kind(e.key)
        ms, n = kinds.get(k, (0.0, 0))
        kinds[k] = (ms + us / 1e3, n + e.count)
        count += e.count
        top.append((us / 1e3, e.count, e.key))
    total = sum(v[0] for v in kinds.values())
    print(f"profile ({'compiled' if args.compile else 'eager'}): {count} kernels, "
          f"{total:.1f} ms of kernel time", file=sys.stderr)
    for k, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:22s} {ms:8.2f} ms  {n:6d} kernels", file=sys.stderr)
    for ms, n, key in sorted(top, reverse=True)[:25]:
        print(f"  {ms:8.2f} ms {n:5d}x  {key[:110]}", file=sys.stderr)


def compile_how(comm):
    comm = ("collectives traced into the graphs" if comm == "traced"
            else "collectives eager at graph breaks, static shapes")
    return ("inductor default mode, per block kind: torch.compile(DoubleBlock.__call__) and "
            f"torch.compile(SingleBlock.__call__); {comm}; stem and final layer eager")


def run_check(args, model, x0, sp, tp, devices, rank):
    """One more forward on the first step's inputs (all ranks), and on rank 0 the
    unsharded eager model's on the same inputs and weights: the errors for the JSON line."""
    with sdpa_context(args.sdpa), torch.inference_mode():
        out = model(x0, sp, args.compile).to(devices[0]).float()
        if rank != 0:
            return {}
        if tp.world == 1 and len(set(devices)) == 1 and not args.fp8:
            ref_model = model  # single or sp: the same weights, whole on this device
        else:  # tp shards, split spans two devices: build the whole model here
            ref_model = Flux(Init(args.seed), [devices[0]] * len(devices))
        ref = ref_model(x0).float()
    del ref_model
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()
    err = (out - ref).abs().max().item()
    return {
        "check_ref": "unsharded eager model, mode single",
        "check_max_abs_err": err,
        "check_max_rel_err": err / ref.abs().max().item(),
    }


if __name__ == "__main__":
    main()
