#!/usr/bin/env python3
"""A PyTorch reference of Qwen-Image's one-CFG-step placements on two GPUs (issue 20).

diffusers' QwenImageTransformer2DModel on mold's weights and inputs (the ones
benches/parity/qwen_diffusers.py reads: `mold testdata qwen-image[-tiny] DIR` and
`mold exec PLAN --weights DIR --save-io io.safetensors`, no --prompt), one true-CFG step
(a conditional and an unconditional transformer pass) placed three ways:

  --mode one   one process, one GPU: the two passes in turn (the 1-GPU baseline, as
               qwen_diffusers.py --time times it).
  --mode cfg   CFG-parallel over 2 ranks: rank 0 runs the conditional pass, rank 1 the
               unconditional one, at once; then all_gather_into_tensor brings both outputs
               to both ranks (where the guidance combination would run). Step time =
               forward + gather.
  --mode tp2   tensor parallel (Megatron style) over the ranks on every transformer block,
               the two passes in turn: attn.to_q/to_k/to_v, attn.add_q/k/v_proj and each
               MLP's first linear column-parallel (heads split: the attention module's
               `heads` and `inner_dim` set to the local ones), attn.to_out[0],
               attn.to_add_out and each MLP's second linear row-parallel with one all-reduce
               after each (4 a block). Modulation, norms, stem and final layer replicated.
               --tp-impl picks how: `manual` (default: the weights sliced in place, plain
               tensors, a functional all_reduce in a RowParallelLinear; works with gloo on
               the CPU and under torch.compile), `dtensor` (torch.distributed.tensor.parallel
               .parallelize_module with ColwiseParallel/RowwiseParallel on each block) or
               `diffusers` (diffusers' own `_tp_plan`, model.enable_parallelism(
               TensorParallelConfig): the same sharding through DTensor; CUDA only).

Launch: `python3 qwen_2gpu_torch.py --mode one ...` and
`torchrun --standalone --nproc_per_node=2 qwen_2gpu_torch.py --mode cfg|tp2 ...`
(benches/qwen-2gpu-torch does both). NCCL on CUDA, gloo with --device cpu (dry runs).

Inputs: mold's io holds one call's inputs (batch 1). They are the conditional pass; the
unconditional pass takes the same latents and timestep and a seeded random
`encoder_hidden_states` of the same shape and scale (--uncond-seed): the same compute,
which is what timing needs (the JSON's `uncond_inputs` says so).

Runs (--runs eager,compiled; --compile = --runs compiled): each in the same process on the
same loaded model; `compiled` is diffusers' compile_repeated_blocks(fullgraph=True) (one
torch.compile per transformer block) applied after the sharding. Timing: --warmup calls,
then --time N calls of the whole step, each between a barrier and CUDA events (perf_counter
on the CPU), per rank; a call's step time is the max over ranks; the median is `step_ms`.

Correctness (rank 0): before any sharding or compiling, rank 0 runs the unsharded eager
model on both passes (the one-process reference: same weights, inputs and device); each
run's outputs are judged against it, max |a - b| / max |b| (mold_exec::max_relative_error),
and the conditional pass also against mold's saved output when the io file has it. The
exit status is 1 when an error against the one-process reference exceeds --tolerance
(default 1e-5 in f32, 2e-2 in bf16).

    W=/tmp/wq   # mold testdata qwen-image $W/f; mold exec PLAN --weights $W/f --steps 1 --save-io $W/io.safetensors
    python3 benches/parity/qwen_2gpu_torch.py --mode one --weights $W/f --io $W/io.safetensors --time 10 --runs eager,compiled
    torchrun --standalone --nproc_per_node=2 benches/parity/qwen_2gpu_torch.py --mode tp2 \\
        --weights $W/f --io $W/io.safetensors --time 10 --runs eager,compiled --out tp2.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts from the import below
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen_diffusers import IO_INPUTS, call_kwargs, compile_model, load_transformer, read_io, rel, strict_f32  # noqa: E402

# Megatron-style sharding of a QwenImageTransformerBlock (the same as diffusers' `_tp_plan`).
COLWISE = (
    "attn.to_q", "attn.to_k", "attn.to_v",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "img_mlp.net.0.proj", "txt_mlp.net.0.proj",
)
ROWWISE = ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2")


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the group: this rank's columns of the
    weight, a sum over the ranks (one all-reduce), then the bias, once."""

    def __init__(self, lin, rank, world, group):
        super().__init__()
        n = lin.in_features // world
        self.weight = nn.Parameter(lin.weight.detach()[:, rank * n:(rank + 1) * n].contiguous(), requires_grad=False)
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = n, lin.out_features
        self.group = group

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        y = funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias


def shard_columns(lin, rank, world):
    """Keeps this rank's rows of the weight and bias (its output features) in place."""
    n = lin.out_features // world
    lin.weight = nn.Parameter(lin.weight.detach()[rank * n:(rank + 1) * n].contiguous(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.detach()[rank * n:(rank + 1) * n].contiguous(), requires_grad=False)
    lin.out_features = n


def set_submodule(root, path, module):
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def local_heads(attn, world):
    """The attention module computes its local heads: diffusers' processor reshapes the
    projections by `inner_dim // heads` (0.42) or by `heads` (older releases); both stay
    right with both divided by the world size."""
    if attn.heads % world:
        raise SystemExit(f"tensor parallel over {world} ranks: {attn.heads} heads do not split evenly")
    attn.heads //= world
    if hasattr(attn, "inner_dim"):
        attn.inner_dim //= world


def tensor_parallel(model, impl, rank, world, dev):
    """Shards every transformer block over the world (see the module's docstring)."""
    blocks = list(model.transformer_blocks)
    for blk in blocks:
        for p in COLWISE + ROWWISE:
            lin = blk.get_submodule(p)
            dim = lin.out_features if p in COLWISE else lin.in_features
            if dim % world:
                raise SystemExit(f"tensor parallel over {world} ranks: {p} has {dim} features, which do not split evenly")
    if impl == "manual":
        group = dist.group.WORLD
        for blk in blocks:
            for p in COLWISE:
                shard_columns(blk.get_submodule(p), rank, world)
            for p in ROWWISE:
                set_submodule(blk, p, RowParallelLinear(blk.get_submodule(p), rank, world, group))
            local_heads(blk.attn, world)
    elif impl == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(dev.type, (world,))
        plan = {p: ColwiseParallel() for p in COLWISE}
        plan.update({p: RowwiseParallel() for p in ROWWISE})
        for blk in blocks:
            parallelize_module(blk, mesh, plan)
            local_heads(blk.attn, world)
    elif impl == "diffusers":
        # diffusers' own tensor parallelism (0.42: `_tp_plan`, DTensor through parallelize_module);
        # its processor keeps `heads` whole and reshapes by head_dim. It accepts CUDA meshes only.
        try:
            from diffusers import TensorParallelConfig
        except ImportError as e:
            raise SystemExit(f"--tp-impl diffusers: this diffusers has no TensorParallelConfig ({e})")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
        model.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
    else:
        raise SystemExit(f"unknown --tp-impl {impl}")
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def device_name(dev):
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or "cpu"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="directory holding transformer/ (mold testdata qwen-image[-tiny])")
    ap.add_argument("--io", required=True, help="the file of `mold exec PLAN --weights DIR --save-io FILE` (no --prompt)")
    ap.add_argument("--mode", required=True, choices=["one", "cfg", "tp2"])
    ap.add_argument("--tp-impl", default="manual", choices=["manual", "dtensor", "diffusers"],
                    help="how --mode tp2 shards the blocks (default manual)")
    ap.add_argument("--runs", default="eager", help="comma-separated: eager, compiled (default eager)")
    ap.add_argument("--compile", action="store_true", help="the same as --runs compiled")
    ap.add_argument("--no-fullgraph", action="store_true", help="compile the blocks with fullgraph=False")
    ap.add_argument("--dtype", choices=["f32", "bf16"], help="compute dtype (default: the plan's, from the io file)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time", type=int, default=10, metavar="N", help="timed steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--uncond-seed", type=int, default=2, help="seed of the unconditional pass's text states")
    ap.add_argument("--no-reference", action="store_true", help="skip the one-process reference (no correctness numbers)")
    ap.add_argument("--tolerance", type=float, help="largest accepted error against one process (default 1e-5 f32, 2e-2 bf16)")
    ap.add_argument("--out", help="also write the JSON result here (rank 0)")
    a = ap.parse_args()
    if a.time < 1:
        raise SystemExit("--time N: at least 1 timed step")
    runs = ["compiled"] if a.compile else [r for r in a.runs.split(",") if r]
    if not runs or any(r not in ("eager", "compiled") for r in runs):
        raise SystemExit(f"--runs {a.runs}: eager and/or compiled")

    # --- processes ---------------------------------------------------------------------
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if a.mode == "one" and world != 1:
        raise SystemExit("--mode one runs in one process: start it with python3, not torchrun")
    if a.mode != "one" and world < 2:
        raise SystemExit(f"--mode {a.mode} needs 2 processes: torchrun --standalone --nproc_per_node=2 {sys.argv[0]} ...")
    if a.mode == "cfg" and world != 2:
        raise SystemExit(f"--mode cfg runs the two CFG passes on 2 ranks, not {world}")
    if a.device == "cuda" and local >= torch.cuda.device_count():
        raise SystemExit(f"rank {rank}: local rank {local} but this box has {torch.cuda.device_count()} GPU(s)")
    dev = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    distributed = world > 1
    if distributed:
        if dev.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=dev)
        else:
            dist.init_process_group(backend="gloo")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    strict_f32()

    # --- inputs ------------------------------------------------------------------------
    io, meta, grid = read_io(a.io, need=IO_INPUTS)
    dtype_name = a.dtype or meta.get("dtype", "f32")
    if dtype_name not in ("f32", "bf16"):
        raise SystemExit(f"{a.io}: the plan's dtype is {dtype_name}: pass --dtype f32 or bf16")
    dt = torch.float32 if dtype_name == "f32" else torch.bfloat16
    tol = a.tolerance if a.tolerance is not None else (1e-5 if dtype_name == "f32" else 2e-2)
    txt = io["encoder_hidden_states"].float()
    g = torch.Generator().manual_seed(a.uncond_seed)
    neg = torch.randn(txt.shape, generator=g, dtype=torch.float32) * txt.std()
    passes = [  # (name, hidden_states, encoder_hidden_states, timestep), on every rank alike
        ("cond", io["hidden_states"], io["encoder_hidden_states"], io["timestep"]),
        ("uncond", io["hidden_states"], neg, io["timestep"]),
    ]

    # --- model and the one-process reference --------------------------------------------
    t0 = time.time()
    model = load_transformer(a.weights, dt, dev)
    load_s = time.time() - t0
    kws = [call_kwargs(model, *(x.to(dev, dt) for x in (hs, et, ts)), grid) for _, hs, et, ts in passes]

    def forward(kw):
        return model(**kw)[0]

    ref = None
    with torch.no_grad():
        if rank == 0 and not a.no_reference:
            ref = [forward(kw).float().cpu() for kw in kws]
    if distributed:
        dist.barrier()

    t0 = time.time()
    if a.mode == "tp2":
        tensor_parallel(model, a.tp_impl, rank, world, dev)
    shard_s = time.time() - t0
    blk = model.transformer_blocks[0]

    def local_shape(path):
        w = blk.get_submodule(path).weight
        return list((w.to_local() if hasattr(w, "to_local") else w).shape)

    block0 = {"attn.heads": blk.attn.heads, **{p: local_shape(p) for p in COLWISE + ROWWISE}}

    if a.mode == "cfg":
        kw_mine = kws[rank]

        def step():
            out = forward(kw_mine).contiguous()
            # Both ranks' outputs concatenated along the batch: [cond; uncond].
            both = torch.empty((world * out.shape[0],) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device)
            dist.all_gather_into_tensor(both, out)
            return list(both.chunk(world, dim=0))
    else:

        def step():
            return [forward(kw) for kw in kws]

    def timed(n):
        ms, out = [], None
        for _ in range(n):
            if distributed:
                dist.barrier()
            if cuda:
                sync()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = step()
                e.record()
                e.synchronize()
                ms.append(s.elapsed_time(e))
            else:
                t = time.perf_counter()
                out = step()
                ms.append((time.perf_counter() - t) * 1e3)
        return ms, out

    # --- runs ---------------------------------------------------------------------------
    results = {}
    compiled_how = None
    for run in runs:
        r = {}
        if run == "compiled" and compiled_how is None:
            if a.no_fullgraph:
                model.compile_repeated_blocks(fullgraph=False)
                compiled_how = "compile_repeated_blocks(fullgraph=False)"
            else:
                _, compiled_how = compile_model(model)
        r["how"] = compiled_how if run == "compiled" else "eager"
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            t0 = time.time()
            timed(1)
            r["first_step_s"] = time.time() - t0
            timed(max(a.warmup - 1, 0))
            ms, out = timed(a.time)
        out = [o.float().cpu() for o in out]
        per_rank = [ms]
        peaks = [torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None]
        if distributed:
            per_rank, peaks = [None] * world, [None] * world
            dist.all_gather_object(per_rank, ms)
            dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None)
        step_ms = [max(c) for c in zip(*per_rank)]
        r["step_ms"] = statistics.median(step_ms) if step_ms else None
        r["step_ms_all"] = [round(x, 3) for x in step_ms]
        r["step_ms_per_rank"] = [[round(x, 3) for x in m] for m in per_rank]
        r["peak_allocated_gib_per_rank"] = peaks
        if rank == 0:
            err = {}
            if ref is not None:
                for (name, *_), o, w in zip(passes, out, ref):
                    err[f"{name}_vs_one_process"] = rel(o, w)
                err["vs_one_process"] = max(err[f"{p[0]}_vs_one_process"] for p in passes)
            if "output" in io:
                err["cond_vs_mold"] = rel(out[0], io["output"])
            r["max_relative_error"] = err
        results[run] = r

    names = [device_name(dev)]
    if distributed:
        names = [None] * world
        dist.all_gather_object(names, device_name(dev))
    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return

    import diffusers

    result = {
        "mode": a.mode,
        "what": {
            "one": "1 process, 1 device: the cond and uncond passes in turn",
            "cfg": "CFG-parallel: rank 0 the cond pass, rank 1 the uncond pass at once, then all_gather_into_tensor",
            "tp2": f"tensor parallel over {world} ranks on every block ({a.tp_impl}), the two passes in turn",
        }[a.mode],
        "tp_impl": a.tp_impl if a.mode == "tp2" else None,
        "model": meta.get("model"),
        "dtype": dtype_name,
        "world_size": world,
        "backend": dist.get_backend() if distributed else None,
        "devices": names,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and distributed else None,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "batch": io["hidden_states"].shape[0],
        "image_tokens": io["hidden_states"].shape[1],
        "text_tokens": io["encoder_hidden_states"].shape[1],
        "img_shapes": list(grid),
        "passes_per_step": 2,
        "uncond_inputs": (
            "mold's io holds one call's inputs (the cond pass); the uncond pass takes the same hidden_states "
            f"and timestep and encoder_hidden_states ~ N(0, std(cond's)) of the same shape, seed {a.uncond_seed}"
        ),
        "warmup": a.warmup,
        "calls": a.time,
        "timing": "per call: barrier, then CUDA events around the whole step on each rank (perf_counter on "
                  "the CPU); a call's step time is the max over ranks; step_ms is the median",
        "block0_local_weights": block0,
        "load_s": load_s,
        "shard_s": shard_s,
        "reference": None if ref is None else "rank 0, the unsharded eager model on both passes before sharding/compiling",
        "tolerance": tol,
        "runs": results,
    }
    bad = [
        run for run, r in results.items()
        if not (r.get("max_relative_error", {}).get("vs_one_process", 0.0) <= tol)
    ]
    result["passed"] = not bad
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
