use super::common::{load_machine, load_plan, model_of};
use super::exec_options::{exec_options, EnvVars};
use super::progress::{hex, say, OutputArgs, Reporter};
use anyhow::{bail, Context, Result};
use mold_exec::{Executor, FluxConfig, Transformer};
use mold_pipeline::run::{Benchable, Family};
use mold_plan::{ByteSize, DeviceId, Plan};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The plan to run (from `mold plan`).
    pub plan: PathBuf,
    /// Checkpoint: a .safetensors file, an .index.json, or a directory holding them (a
    /// Hugging Face repository of FLUX.1 or its hub cache snapshot included). Default:
    /// the plan's model found in config `weights_dirs` or the Hugging Face cache
    /// (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub).
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Denoising steps (default: the plan's).
    #[arg(long)]
    pub steps: Option<u32>,
    /// Seed of the random latents and conditioning.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the unsharded single-device reference and compare; exit 1 above tolerance.
    #[arg(long)]
    pub verify: bool,
    /// Largest max-relative error `--verify` accepts. Defaults: 1e-5 for f32 plans; for bf16/f16
    /// plans 2e-2 against the reference in the plan's dtype and 1.5e-2 with `--verify-f32`.
    /// Why (flux-dev 1024², 2 steps, one H200, BENCHMARKS.md): mold's bf16 kernels are 9.7e-3
    /// from an f32 run of the same weights and candle's bf16 ops 9.8e-3, so two correct bf16
    /// runs differ by up to the sum of their distances from exact (~2e-2); 1.5e-2 leaves the
    /// measured bf16 floor a 50 % margin.
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// With `--verify`: compute the reference in f32 (the checkpoint's weights widened on
    /// load, candle's ops) instead of the plan's dtype, so a bf16 run's error is measured
    /// against the exact computation rather than against another bf16 rounding of it.
    #[arg(long, requires = "verify")]
    pub verify_f32: bool,
    /// The machine this runs on (default: sim/machines/<plan's machine>.yaml).
    #[arg(long)]
    pub machine: Option<String>,
    /// Run a plan made for another machine (its predictions do not hold here).
    #[arg(long)]
    pub force: bool,
    /// Text to image: run the whole pipeline (FLUX: T5, CLIP, transformer, VAE;
    /// Qwen-Image: Qwen2.5-VL, transformer with true CFG, VAE) for this prompt, each
    /// component where the plan places it; --weights is then a weights
    /// directory (README: "Weights directory layout"). Without it, exec runs the
    /// transformer alone on random inputs.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Distilled guidance strength, with --prompt (FLUX dev; default: the plan's, else 3.5).
    #[arg(long)]
    pub guidance: Option<f64>,
    /// With --prompt, Qwen-Image: the negative prompt of true CFG (default " " when the
    /// CFG scale is above 1).
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// With --prompt, Qwen-Image: the true-CFG scale (default: the plan's, 4 for
    /// qwen-image); 1 turns true CFG off (one transformer pass a step).
    #[arg(long)]
    pub cfg: Option<f64>,
    /// With --prompt, Qwen-Image: CFG-parallel, each step's unconditional pass on the
    /// plan's second replica (`replicas:`, e.g. from `mold plan --objective throughput`)
    /// at the same time as the conditional pass on its first.
    #[arg(long)]
    pub cfg_parallel: bool,
    /// Image width in pixels, with --prompt (default: the plan's; another size is
    /// re-checked with the simulator before anything loads).
    #[arg(long)]
    pub width: Option<u32>,
    /// Image height in pixels, with --prompt (default: the plan's).
    #[arg(long)]
    pub height: Option<u32>,
    /// The PNG to write, with --prompt (default: out.png).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// How streamed blocks reach their GPU: pinned (page-locked host memory, a copy
    /// stream, the plan's stream buffers; pageable with a warning if pinning is refused),
    /// pageable (the same pipeline from pageable memory) or sync (the baseline: copy,
    /// compute, synchronize, free per block). Default: MOLD_STREAMING, else pinned.
    #[arg(long, value_parser = mold_exec::Streaming::parse)]
    pub streaming: Option<mold_exec::Streaming>,
    /// The same seed gives the same output bit for bit under tensor and sequence
    /// parallelism too (each GPU gets a stream of its own; see README, "Determinism").
    /// Default: MOLD_DETERMINISTIC, else off (one GPU and block splits repeat anyway).
    #[arg(long)]
    pub deterministic: bool,
    /// Run as on a box without peer access between its GPUs: every hand-off between GPUs
    /// staged through host memory, and NCCL kept off the GPU-to-GPU path
    /// (NCCL_P2P_DISABLE=1: collectives through host memory). For plans made on a profile
    /// saved with `mold devices --no-peer`, and to measure what a PCIe box without peer
    /// access would do.
    #[arg(long)]
    pub no_peer: bool,
    /// A LoRA merged into the transformer's weights at load, PATH[:STRENGTH] (strength 1
    /// when absent; repeatable): kohya (`lora_unet_*`), BFL-style or diffusers/PEFT names.
    #[arg(long = "lora", value_name = "PATH[:STRENGTH]", value_parser = mold_exec::checkpoint::LoraSpec::parse)]
    pub loras: Vec<mold_exec::checkpoint::LoraSpec>,
    /// With --prompt: the initial noise from this safetensors file (tensor `latents`,
    /// [1, 16, H/8, W/8] or packed [1, H/16·W/16, 64]) instead of the seed's.
    #[arg(long, value_name = "FILE")]
    pub latents: Option<PathBuf>,
    /// With --prompt: write the conditioning, the initial and per-step latents, the
    /// transformer's outputs and the decoded image to this safetensors file
    /// (crates/mold-pipeline/src/io.rs names them). Without --prompt: the benchmark's
    /// random inputs and one transformer call's `output` (for benches/parity/).
    #[arg(long, value_name = "FILE")]
    pub save_io: Option<PathBuf>,
    /// Write the plan's prediction beside this run's measurement, per phase and per
    /// device peak, to this JSON file (`mold sim PLAN --compare FILE` prints it); with
    /// MOLD_PROFILE=1, per part too (transformer-only runs).
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(clap::Args, Debug)]
pub struct TestdataArgs {
    /// A FLUX-family model: flux-tiny, flux-dev or flux-schnell (the transformer); or
    /// flux-tiny-pipeline: a whole tiny weights directory (T5, CLIP, VAE, tokenizers,
    /// transformer) for `mold exec --prompt`; flux-tiny-hf, flux-dev-hf, flux-schnell-hf:
    /// the same in the Hugging Face repository's layout (BFL and diffusers transformers);
    /// qwen-image, qwen-image-tiny: the transformer as the published repository's
    /// `transformer/` folder (shards, index, diffusers' config.json);
    /// qwen-image-tiny-pipeline, qwen-image-pipeline: the whole Qwen-Image repository
    /// (transformer, text encoder, tokenizer, VAE, scheduler) for `mold exec --prompt`.
    pub name: String,
    /// Directory to write into (created if missing).
    pub dir: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// f32 or bf16 (default: f32 for flux-tiny, bf16 otherwise).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Split into shards of at most this size, with an index.json (e.g. 5GB).
    #[arg(long)]
    pub shard_size: Option<ByteSize>,
    #[command(flatten)]
    pub output: OutputArgs,
}

fn flux_config(id: &str) -> Result<FluxConfig> {
    FluxConfig::by_name(id).with_context(|| {
        format!("model `{id}`: testdata writes flux-dev, flux-schnell, flux-tiny, qwen-image and qwen-image-tiny transformers (and the pipelines and -hf snapshots of `mold testdata --help`)")
    })
}

pub fn testdata(a: TestdataArgs) -> Result<i32> {
    if let Some(model) = a.name.strip_suffix("-hf") {
        return testdata_hf(&a, model);
    }
    if a.name == "flux-tiny-pipeline" {
        return testdata_pipeline(a);
    }
    if matches!(
        a.name.as_str(),
        "qwen-image-tiny-pipeline" | "qwen-image-pipeline"
    ) {
        return testdata_qwen_pipeline(&a);
    }
    if let Some(model) = a.name.strip_suffix("-pipeline") {
        return testdata_full_pipeline(&a, model);
    }
    if let Some(cfg) = mold_exec::QwenConfig::by_name(&a.name) {
        return testdata_qwen(&a, &cfg);
    }
    let cfg = flux_config(&a.name)?;
    let dtype = match a.dtype.as_deref() {
        None if a.name == "flux-tiny" => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create {}", a.dir.display()))?;
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let path = rep.observe_writes(|| -> Result<PathBuf> {
        Ok(match a.shard_size {
            Some(s) => mold_exec::write_testdata_sharded(&cfg, &a.dir, a.seed, dtype, s.0)?,
            None => mold_exec::write_testdata(&cfg, &a.dir, a.seed, dtype)?,
        })
    })?;
    rep.event(json!({"event": "wrote", "path": path.display().to_string()}));
    rep.result(
        format_args!(
            "wrote {} ({} parameters, {dtype:?}, seed {}) in {:.1} s",
            path.display(),
            cfg.param_count(),
            a.seed,
            t.elapsed().as_secs_f64()
        ),
        json!({
            "event": "done",
            "model": a.name,
            "parameters": cfg.param_count(),
            "dtype": format!("{dtype:?}"),
            "seed": a.seed,
            "seconds": t.elapsed().as_secs_f64(),
        }),
    );
    Ok(0)
}

/// `mold testdata qwen-image DIR` (and qwen-image-tiny): the transformer in the published
/// repository's `transformer/` layout, in shards of `--shard-size` (default 5 GB, as
/// published).
fn testdata_qwen(a: &TestdataArgs, cfg: &mold_exec::QwenConfig) -> Result<i32> {
    let dtype = match a.dtype.as_deref() {
        None if a.name.ends_with("-tiny") => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    let shard = a.shard_size.map(|s| s.0).unwrap_or(5_000_000_000);
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep.observe_writes(|| -> Result<Vec<PathBuf>> {
        mold_exec::model::qwen::testdata::write_testdata(cfg, &a.dir, a.seed, dtype, shard)
            .with_context(|| format!("cannot write {} into {}", a.name, a.dir.display()))
    })?;
    report_testdata(
        &rep,
        a,
        &files,
        &format!("{dtype:?}"),
        Some(cfg.param_count()),
        t,
        format_args!("{} transformer, random weights ({} parameters, {dtype:?}, seed {}): `mold exec PLAN --weights {}`", a.name, cfg.param_count(), a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata qwen-image-tiny-pipeline DIR` (f32) and `qwen-image-pipeline DIR`
/// (bf16 unless --dtype f32): the whole Qwen-Image repository layout, random weights.
fn testdata_qwen_pipeline(a: &TestdataArgs) -> Result<i32> {
    let tiny = a.name == "qwen-image-tiny-pipeline";
    let dtype = match (a.dtype.as_deref(), tiny) {
        (None | Some("f32"), true) => mold_exec::DType::F32,
        (Some(o), true) => {
            bail!("--dtype {o}: qwen-image-tiny-pipeline is written in f32: drop --dtype")
        }
        (None | Some("bf16"), false) => mold_exec::DType::BF16,
        (Some("f32"), false) => mold_exec::DType::F32,
        (Some(o), false) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!("{}: the transformer and text encoder are written in 5 GB shards as published: drop --shard-size", a.name);
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| {
            if tiny {
                mold_pipeline::qwen_testdata::write_tiny_pipeline(&a.dir, a.seed)
            } else {
                mold_pipeline::qwen_testdata::write_full_pipeline(&a.dir, a.seed, dtype)
            }
        })
        .with_context(|| format!("cannot write {} into {}", a.name, a.dir.display()))?;
    report_testdata(
        &rep,
        a,
        &files,
        &format!("{dtype:?}"),
        None,
        t,
        format_args!("{}, random weights ({dtype:?}, seed {}): `mold exec PLAN --weights {} --prompt \"...\" --negative-prompt \"...\" --cfg 4`", a.name, a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata flux-dev-hf DIR` (and flux-schnell-hf, flux-tiny-hf): a random snapshot
/// in the layout of the Hugging Face repository, both transformer formats.
fn testdata_hf(a: &TestdataArgs, model: &str) -> Result<i32> {
    let which = mold_pipeline::testdata::HfModel::by_name(model).with_context(|| {
        format!(
            "{}: Hugging Face snapshots are flux-tiny-hf, flux-dev-hf or flux-schnell-hf",
            a.name
        )
    })?;
    let dtype = match a.dtype.as_deref() {
        None if model == "flux-tiny" => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!(
            "{}: files are sharded as the published repository's: drop --shard-size",
            a.name
        );
    }
    let t = Instant::now();
    let files = mold_pipeline::testdata::write_hf_snapshot(&a.dir, which, a.seed, dtype)
        .with_context(|| format!("cannot write the {model} snapshot into {}", a.dir.display()))?;
    for f in &files {
        println!("wrote {}", f.display());
    }
    println!(
        "{model} Hugging Face-layout snapshot, random weights ({dtype:?}, seed {}) in {:.1} s: `mold exec PLAN --weights {} --prompt \"...\"` (remove {} to run the diffusers-format transformer/)",
        a.seed,
        t.elapsed().as_secs_f64(),
        a.dir.display(),
        if model == "flux-schnell" { "flux1-schnell.safetensors" } else { "flux1-dev.safetensors" }
    );
    Ok(0)
}

/// `mold testdata flux-dev-pipeline DIR`: a full-size pipeline with random weights.
fn testdata_full_pipeline(a: &TestdataArgs, model: &str) -> Result<i32> {
    let dtype = match a.dtype.as_deref() {
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!("{}: the transformer is written in 5 GB shards, the others one file each: drop --shard-size", a.name);
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| {
            mold_pipeline::testdata::write_full_pipeline(&a.dir, model, a.seed, dtype)
        })
        .with_context(|| format!("cannot write the {model} pipeline into {}", a.dir.display()))?;
    report_testdata(
        &rep,
        a,
        &files,
        &format!("{dtype:?}"),
        None,
        t,
        format_args!("{model} pipeline, random weights ({dtype:?}, seed {}): `mold exec PLAN --weights {} --prompt \"...\"`", a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata flux-tiny-pipeline DIR`: every component of a tiny FLUX pipeline.
fn testdata_pipeline(a: TestdataArgs) -> Result<i32> {
    if a.dtype.as_deref().is_some_and(|d| d != "f32") || a.shard_size.is_some() {
        bail!("flux-tiny-pipeline is written in f32, one file per component: drop --dtype and --shard-size");
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| mold_pipeline::testdata::write_tiny_pipeline(&a.dir, a.seed))
        .with_context(|| format!("cannot write the tiny pipeline into {}", a.dir.display()))?;
    report_testdata(
        &rep,
        &a,
        &files,
        "F32",
        None,
        t,
        format_args!("tiny FLUX pipeline (seed {}): plan flux-tiny, then `mold exec PLAN --weights {} --prompt \"...\"`", a.seed, a.dir.display()),
    );
    Ok(0)
}

/// Prints what a `mold testdata` command wrote (a line and a JSON event per file) and its
/// one-line result, `summary` followed by how long it took.
fn report_testdata(
    rep: &Reporter,
    a: &TestdataArgs,
    files: &[PathBuf],
    dtype: &str,
    parameters: Option<u64>,
    t: Instant,
    summary: std::fmt::Arguments,
) {
    for f in files {
        say!(rep, "wrote {}", f.display());
        rep.event(json!({"event": "wrote", "path": f.display().to_string()}));
    }
    let secs = t.elapsed().as_secs_f64();
    let mut done = json!({
        "event": "done",
        "model": a.name,
        "dtype": dtype,
        "seed": a.seed,
        "seconds": secs,
    });
    if let Some(n) = parameters {
        done["parameters"] = json!(n);
    }
    rep.result(format_args!("{summary} ({secs:.1} s)"), done);
}

/// The machine a plan runs on here: `--machine`, else `MOLD_MACHINE`, else config
/// `machine` (the same resolution as `mold plan`), else the profile named in the plan
/// (`sim/machines/<name>.yaml`).
fn machine_for(plan: &Plan, flag: &Option<String>) -> Result<mold_machine::Machine> {
    let mut flags = mold_config::Layer::default();
    if let Some(m) = flag {
        flags.machine = Some(mold_config::Val::new(m.clone(), "--machine"));
    }
    let settings = mold_config::load(flags)?;
    if let Some(m) = &settings.machine {
        return load_machine(&m.value).with_context(|| format!("machine from {}", m.source()));
    }
    let p = format!("sim/machines/{}.yaml", plan.machine.name);
    if !Path::new(&p).exists() {
        bail!(
            "the plan was made for machine `{}` but {p} is not here: pass --machine PROFILE (or set MOLD_MACHINE, or `machine` in config.toml) for the box this runs on",
            plan.machine.name
        );
    }
    load_machine(&p)
}

/// On CUDA builds, compares the GPUs of this box (queried now) with the ones the plan
/// was made for, and warns about each difference: the plan's predictions (and maybe its
/// fit) do not hold on other hardware.
fn warn_if_box_differs(plan: &Plan) {
    use mold_machine::inventory;
    let uses_cuda = plan
        .machine
        .devices
        .iter()
        .any(|d| matches!(d.id, DeviceId::Cuda(_)));
    if !inventory::CUDA || !uses_cuda {
        return;
    }
    match inventory::query() {
        Ok(inv) => {
            for d in inventory::differences_from_plan(&inv, &plan.machine) {
                eprintln!("warning: {d}; the plan's predictions do not hold on this box (re-plan with `mold plan --machine local`)");
            }
        }
        Err(e) => {
            eprintln!("warning: cannot query this box's GPUs to compare them with the plan's: {e}")
        }
    }
}

/// The weights to run: `--weights` (which must exist: named once, with what to point it
/// at), else the plan's model found in config `weights_dirs` and the Hugging Face hub
/// cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), every
/// place looked at named when it is nowhere.
fn weights_for(plan: &Plan, flag: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = flag {
        if !path.exists() {
            bail!(
                "--weights {}: no such file or directory; point it at a .safetensors file, an .index.json, or a weights directory",
                path.display()
            );
        }
        return Ok(path.clone());
    }
    let settings = mold_config::load(mold_config::Layer::default())?;
    let mut roots = settings.weights_dirs.value.clone();
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    roots.extend(
        var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub"))),
    );
    let id = &plan.model.id;
    match mold_models::snapshot::find_weights(&roots, id) {
        Ok(dir) => {
            eprintln!("note: no --weights: using {}", dir.display());
            Ok(dir)
        }
        Err(looked) => {
            let looked: Vec<String> = looked.iter().map(|p| p.display().to_string()).collect();
            bail!(
                "no --weights, and no weights for {id} in {}; pass --weights DIR, add the folder holding them to `weights_dirs` in config.toml (or MOLD_WEIGHTS_DIRS), or put the Hugging Face repository in its cache (HF_HUB_CACHE / HF_HOME)",
                if looked.is_empty() { "no place (no weights_dirs, HF_HUB_CACHE, HF_HOME or HOME)".to_string() } else { looked.join(", ") }
            )
        }
    }
}

/// Merges `--lora` files into the transformer checkpoint (checked before any weight loads).
fn add_loras(
    ckpt: &mut mold_exec::Checkpoint,
    loras: &[mold_exec::checkpoint::LoraSpec],
) -> Result<()> {
    for l in loras {
        ckpt.add_lora(l)?;
        eprintln!(
            "lora   {} (strength {}) merged at load",
            l.path.display(),
            l.strength
        );
    }
    Ok(())
}

/// `--steps` and `--tolerance` that would make a run or a check vacuous are refused.
fn check_numbers(a: &Args) -> Result<()> {
    if a.steps == Some(0) {
        bail!("--steps 0: give at least 1 denoising step");
    }
    if let Some(t) = a.tolerance {
        if !t.is_finite() || t < 0.0 {
            bail!("--tolerance {t}: give a finite number >= 0 (e.g. 1e-2)");
        }
    }
    Ok(())
}

fn warn_all(w: &[String]) {
    for w in w {
        eprintln!("warning: {w}");
    }
}

/// A short fingerprint of a file's text, for processes to check they run the same plan.
fn text_fingerprint(text: &str) -> String {
    format!("{:016x}", mold_exec::fnv1a(text.bytes()))
}

pub fn run(a: Args) -> Result<i32> {
    // Everything the library is told comes from here: flags, then the environment
    // (MOLD_STREAMING, MOLD_KERNELS, MOLD_PROFILE, MOLD_FAULT, MOLD_HOST_MEMORY, the
    // multi-process launch and communication settings).
    let env = EnvVars::process();
    let get = |k: &str| env.get(k);
    let launch = mold_exec::dist::Launch::from_vars(get)?;
    let comm_opts = mold_exec::comm::CommOptions::from_vars(get)?;
    check_numbers(&a)?;
    if let Some(p) = &a.report {
        super::run_report::check_path(p)?;
    }
    let mut opts = exec_options(a.streaming, a.deterministic, &env, comm_opts.clone())?;
    if a.no_peer {
        super::common::no_peer_access();
        opts.peer_copies = false;
    }
    if let Some(prompt) = a.prompt.clone() {
        if let Some(l) = &launch {
            bail!(
                "{}={}: text to image (--prompt) runs in one process; a multi-process \
                 launch ({}) runs the transformer (drop --prompt), or start one process",
                l.world_var(),
                l.world,
                l.launcher
            );
        }
        return run_pipeline(&a, &prompt, &opts);
    }
    for (flag, set) in [
        ("--guidance", a.guidance.is_some()),
        ("--negative-prompt", a.negative_prompt.is_some()),
        ("--cfg", a.cfg.is_some()),
        ("--cfg-parallel", a.cfg_parallel),
        ("--width", a.width.is_some()),
        ("--height", a.height.is_some()),
        ("--out", a.out.is_some()),
        ("--latents", a.latents.is_some()),
    ] {
        if set {
            bail!("{flag} is for text to image: add --prompt \"...\" (and point --weights at a weights directory)");
        }
    }
    if let (Some(l), Some(_)) = (&launch, &a.report) {
        bail!(
            "--report: a multi-process launch ({}={}) measures each process's ranks apart; run it in one process",
            l.world_var(),
            l.world
        );
    }
    if let (Some(l), Some(_)) = (&launch, &a.save_io) {
        bail!(
            "--save-io: a multi-process launch ({}={}) does not write the transformer's I/O; run it in one process",
            l.world_var(),
            l.world
        );
    }
    let rep = Reporter::new(a.output);
    let plan = load_plan(&a.plan)?;
    let model = model_of(&plan)?;
    let machine = machine_for(&plan, &a.machine)?;
    // In a multi-process run each process sees only its node's GPUs (or its own share).
    if launch.is_none() {
        warn_if_box_differs(&plan);
    }
    // Which plan devices this process runs and how it opens them, before anything loads.
    let local = match &launch {
        None => None,
        Some(l) => {
            let tf = plan.transformer().context("the plan has no transformer")?;
            let devices: Vec<DeviceId> = tf.parts.iter().flat_map(|p| p.devices.clone()).collect();
            let visible = mold_exec::dist::Visible::from_vars(|k| {
                std::env::var(k).ok().filter(|v| !v.trim().is_empty())
            });
            Some(mold_exec::dist::LocalDevices::resolve(
                &devices,
                &machine,
                l,
                visible.as_ref(),
            )?)
        }
    };
    let checked = mold_pipeline::run::preflight(&plan, &model, &machine, a.force, None)?;
    warn_all(&checked.warnings);
    let weights = weights_for(&plan, &a.weights)?;
    let report = match &a.report {
        Some(_) => {
            let steps = a.steps.unwrap_or(plan.workload.steps);
            let (run_plan, sim) =
                super::run_report::simulate_steps(&plan, &model, &machine, steps)?;
            Some((run_plan, sim, machine.name.clone()))
        }
        None => None,
    };
    let run = BenchRun {
        rep,
        plan,
        model,
        weights,
        launch,
        local,
        opts,
        comm_opts,
        report,
    };
    match mold_pipeline::run::transformer_family(&run.plan)? {
        Family::Flux(cfg) => run_bench(a, cfg, run),
        Family::Qwen(cfg) => run_bench(a, cfg, run),
    }
}

/// What `mold exec` resolved before it knew the model's family.
struct BenchRun {
    rep: Reporter,
    plan: Plan,
    model: mold_models::ModelSpec,
    weights: PathBuf,
    launch: Option<mold_exec::dist::Launch>,
    /// This process's devices, when `launch` is set.
    local: Option<mold_exec::dist::LocalDevices>,
    opts: mold_exec::ExecOptions,
    comm_opts: mold_exec::comm::CommOptions,
    /// With `--report`: the plan as run, its simulation and the machine profile's name.
    report: Option<(Plan, mold_sim::SimReport, String)>,
}

/// The transformer benchmark (and `--verify`, `--save-io`) for a model of family `M`.
fn run_bench<M: Benchable>(a: Args, cfg: M, run: BenchRun) -> Result<i32> {
    let BenchRun {
        rep,
        plan,
        model,
        weights,
        launch,
        local,
        opts,
        comm_opts,
        report,
    } = run;
    let mut warnings = Vec::new();
    let mut ckpt = mold_pipeline::run::open_transformer(&cfg, &plan, &weights, &mut warnings)?;
    add_loras(&mut ckpt, &a.loras)?;
    warn_all(&warnings);
    let steps = a.steps.unwrap_or(plan.workload.steps);
    if steps == 0 {
        bail!("the plan's workload has 0 steps: pass --steps N (at least 1)");
    }
    // A multi-process run: which devices are this process's, then the rendezvous (every
    // process must run the same plan and arguments), all before any weight is read.
    let mesh = match (&launch, local) {
        (Some(l), Some(own)) => {
            let local: Vec<String> = own
                .devices()
                .iter()
                .map(|(d, x)| format!("{d} as {x}"))
                .collect();
            let (local_rank, per_node) = own.local_rank();
            let via = match l.launcher {
                mold_exec::dist::Launcher::Mold => String::new(),
                other => format!(", from {other}'s variables"),
            };
            say!(
                rep,
                "process {} of {}: runs {} (node {}, process {local_rank} of {per_node} there; \
                 sees {}; master {}{via})",
                l.rank,
                l.world,
                local.join(", "),
                own.node(),
                own.ordinals(),
                l.master
            );
            rep.event(json!({
                "event": "process",
                "rank": l.rank,
                "world": l.world,
                "node": own.node(),
                "local_rank": local_rank,
                "launcher": l.launcher.to_string(),
                "master": l.master,
                "devices": local,
            }));
            let plan_text = std::fs::read_to_string(&a.plan).unwrap_or_default();
            let run = [
                ("plan", text_fingerprint(&plan_text)),
                ("steps", steps.to_string()),
                ("seed", a.seed.to_string()),
                ("verify", a.verify.to_string()),
                ("streaming", opts.streaming.to_string()),
            ];
            let t = Instant::now();
            let mesh = mold_exec::dist::Mesh::connect(l, &run, &comm_opts)?;
            say!(
                rep,
                "all {} processes joined in {:.2} s",
                l.world,
                t.elapsed().as_secs_f64()
            );
            rep.event(json!({
                "event": "joined",
                "processes": l.world,
                "seconds": t.elapsed().as_secs_f64(),
            }));
            Some((std::sync::Arc::new(mesh), own))
        }
        _ => None,
    };
    let mut rec = match &report {
        Some(_) => Some(mold_pipeline::report::Recorder::new(
            mold_sim::run_report::RunKind::Transformer,
            super::run_report::probe(&plan)?,
        )),
        None => None,
    };
    let t0 = Instant::now();
    rep.spin(format!("loading {}", weights.display()));
    let exec = match &mesh {
        None => Executor::with_options(&cfg, &plan, &ckpt, opts.clone())?,
        Some((m, own)) => {
            Executor::new_multi_process(&cfg, &plan, &ckpt, opts.clone(), m.clone(), own.clone())?
        }
    };
    rep.clear();
    if let Some(r) = rec.as_mut() {
        r.sample("loaded transformer");
    }
    say!(
        rep,
        "loaded {} in {:.2} s",
        weights.display(),
        t0.elapsed().as_secs_f64()
    );
    rep.event(json!({
        "event": "loaded",
        "component": "transformer",
        "weights": weights.display().to_string(),
        "seconds": t0.elapsed().as_secs_f64(),
        "weight_bytes": exec
            .memory_report()
            .iter()
            .map(|m| m.resident_weight_bytes + m.host_weight_bytes)
            .sum::<u64>(),
    }));
    // Between processes: NCCL between GPUs when built with it, else TCP.
    for (pi, from, to, path) in exec.process_hand_offs() {
        say!(
            rep,
            "hand-off after part {pi}: process {from} -> process {to} over {path}"
        );
        rep.event(
            json!({"event": "process_hand_off", "part": pi, "from": from, "to": to, "path": path}),
        );
    }
    if let Some(path) = &a.save_io {
        mold_pipeline::run::save_bench_io(&exec, &plan, &model, a.seed, path)?;
        say!(
            rep,
            "wrote {} (the benchmark's inputs and one transformer call's output)",
            path.display()
        );
        rep.event(json!({"event": "wrote", "path": path.display().to_string()}));
    }
    let predicted = plan.predicted.step_time_s;
    let mut times = Vec::new();
    // CFG-parallel: the unconditional passes on the plan's second replica, as priced.
    let uncond = match (mold_pipeline::run::uncond_plan(&plan)?, &mesh) {
        (Some(u), None) => {
            let t = Instant::now();
            let e = Executor::with_options(&cfg, &u, &ckpt, opts.clone())?;
            say!(
                rep,
                "loaded transformer (unconditional) on the second replica in {:.2} s",
                t.elapsed().as_secs_f64()
            );
            Some(e)
        }
        (Some(_), Some(_)) => {
            warn_all(&["the plan's CFG is parallel (two replicas at once); a multi-process run runs the two passes one after the other, so steps take longer than the plan's".to_string()]);
            None
        }
        (None, _) => {
            if mesh.is_some() && plan.cfg_mode() == Some(mold_plan::CfgMode::Pipelined) {
                warn_all(&["the plan's CFG is pipelined (two micro-batches through the split); a multi-process run runs them one after the other, so steps take longer than the plan's".to_string()]);
            }
            None
        }
    };
    let u = uncond.as_ref();
    let out = mold_pipeline::run::bench(&exec, u, &plan, &model, a.seed, steps, &mut |s| {
        rep.plain(format_args!(
            "step {:>3}/{steps}: {:.4} s   (plan predicted {:.4} s)   latents {:016x}",
            s.index + 1,
            s.seconds,
            predicted,
            s.digest
        ));
        rep.step(s.index as u32 + 1, steps, s.seconds);
        rep.event(json!({
            "event": "step",
            "index": s.index + 1,
            "steps": steps,
            "seconds": s.seconds,
            "predicted_s": predicted,
            "digest": hex(s.digest),
        }));
        if s.index == 0 {
            exec.clear_profile(); // the first step includes warm-up (kernel loading)
        }
        if let Some(r) = rec.as_mut() {
            r.step(s.index + 1, s.seconds);
        }
        times.push(s.seconds);
    })?;
    let (median, over) = step_median(&times);
    say!(
        rep,
        "step time: median {median:.4} s over {over}; plan predicted {predicted:.4} s"
    );
    say_attention(&rep);
    let digest = mold_exec::digest(&out)?;
    rep.result(
        format_args!("output digest: {digest:016x}"),
        json!({
            "event": "result",
            "median_step_s": median,
            "median_over": over,
            "predicted_step_s": predicted,
            "output_digest": hex(digest),
        }),
    );
    if exec.profiling() {
        let measured = times.len().saturating_sub(1).max(1) as f64;
        say!(rep, "\nprofile (MOLD_PROFILE: device synchronised at each mark, so slower than a plain step), per step:");
        for (dev, phases) in exec.profile_report() {
            let total: f64 = phases.iter().map(|p| p.1).sum();
            say!(
                rep,
                "  {dev}: {:.2} ms in marked phases",
                total / measured * 1e3
            );
            let mut per_phase = Vec::new();
            for (label, secs, n) in phases {
                say!(
                    rep,
                    "    {label:<28} {:>9.2} ms  {:>5.1}%  ({} marks)",
                    secs / measured * 1e3,
                    100.0 * secs / total.max(1e-12),
                    n as f64 / measured
                );
                per_phase.push(json!({
                    "phase": label,
                    "ms_per_step": secs / measured * 1e3,
                    "marks_per_step": n as f64 / measured,
                }));
            }
            rep.event(json!({"event": "profile", "device": dev.to_string(), "phases": per_phase}));
        }
    }
    say!(rep, "\nmemory (accounted from tensor shapes)   weights  stream buffers  largest activation | plan: peak");
    for m in exec.memory_report() {
        let planned = plan
            .predicted
            .devices
            .iter()
            .find(|d| d.device == m.device)
            .map(|d| d.peak);
        rep.event(json!({
            "event": "memory",
            "device": m.device.to_string(),
            "weight_bytes": m.resident_weight_bytes,
            "stream_buffer_bytes": m.stream_buffer_bytes,
            "largest_activation_bytes": m.largest_activation_bytes,
            "predicted_peak_bytes": planned.map(|b| b.0),
        }));
        let p = planned.map(|b| b.human()).unwrap_or_else(|| "-".into());
        say!(
            rep,
            "  {:<10} {:>28} {:>15} {:>19} | {p}",
            m.device.to_string(),
            ByteSize(m.resident_weight_bytes).human(),
            ByteSize(m.stream_buffer_bytes).human(),
            ByteSize(m.largest_activation_bytes).human(),
        );
    }
    print_streaming(&exec, &rep);
    for (from, to, peer) in mold_exec::runtime::hand_off_paths() {
        let how = if peer {
            "peer copy (cuDeviceCanAccessPeer)"
        } else {
            "through host memory (no peer access, or --no-peer)"
        };
        say!(rep, "  hand-off cuda:{from} -> cuda:{to}: {how}");
        rep.event(json!({"event": "hand_off", "from": format!("cuda:{from}"), "to": format!("cuda:{to}"), "peer": peer}));
    }
    if let (Some(mut r), Some((run_plan, sim, profile)), Some(path)) = (rec, &report, &a.report) {
        if exec.profiling() {
            let measured = times.len().saturating_sub(1).max(1) as f64;
            r.profile(&plan, &exec.profile_report(), measured);
        }
        let (report, err) = r.finish(mold_pipeline::report::ReportInputs {
            plan: &plan,
            run_plan,
            sim,
            machine_profile: profile,
            timings: None,
            predicted_peaks: plan
                .predicted
                .devices
                .iter()
                .map(|d| (d.device.clone(), d.peak.0))
                .collect(),
            accounted_peaks: exec
                .memory_report()
                .iter()
                .map(|m| mold_pipeline::DevicePeak {
                    device: m.device.clone(),
                    peak_bytes: m.resident_weight_bytes
                        + m.stream_buffer_bytes
                        + m.largest_activation_bytes,
                })
                .collect(),
        });
        super::run_report::write(&rep, path, &report, err)?;
    }
    if a.verify {
        let tf = plan.transformer().context("the plan has no transformer")?;
        let mut first = tf.parts[0].devices[0].clone();
        if let Some((_, own)) = &mesh {
            // The reference runs once, in the process that runs the first device.
            match own.local_id(&first) {
                Some(local) => first = local,
                None => {
                    say!(rep, "\nverify: done by the process that runs {first}");
                    rep.event(json!({"event": "verify", "done_by": first.to_string()}));
                    return Ok(0);
                }
            }
        }
        let dtype = if a.verify_f32 {
            mold_exec::DType::F32
        } else {
            mold_exec::compute_dtype(tf.dtype)?
        };
        let inputs = mold_pipeline::run::bench_inputs(&cfg, &plan, &model, a.seed)?;
        let want = mold_pipeline::run::reference_run(&cfg, &ckpt, &first, dtype, inputs, steps)?;
        let precision = if a.verify_f32 {
            "f32"
        } else {
            "the plan's dtype"
        };
        let err = mold_exec::max_relative_error(&out, &want)?;
        let tol = a.tolerance.unwrap_or(if tf.dtype == mold_plan::DType::F32 {
            1e-5
        } else if a.verify_f32 {
            1.5e-2
        } else {
            2e-2
        });
        rep.result(
            format_args!("\nverify: max relative error {err:.3e} against the single-device reference on {first}, candle ops in {precision} (tolerance {tol:.0e})"),
            json!({
                "event": "verify",
                "reference_dtype": if a.verify_f32 { "f32" } else { "plan" },
                "max_relative_error": err,
                "tolerance": tol,
                "reference_device": first.to_string(),
                "passed": err <= tol,
            }),
        );
        if err > tol {
            eprintln!("error: max relative error {err:.3e} is above the tolerance {tol:.0e}");
            return Ok(1);
        }
    }
    Ok(0)
}

/// One line per device that streams: mode, buffers, host memory, copies.
pub fn print_streaming<M: Transformer>(exec: &Executor<M>, rep: &Reporter) {
    for m in exec.memory_report() {
        if m.stream_buffers == 0 {
            continue;
        }
        let host = if m.host_pinned {
            "page-locked"
        } else {
            "pageable"
        };
        let report = exec
            .streaming_report()
            .into_iter()
            .find(|(d, _)| d == &m.device)
            .map(|(_, r)| r);
        rep.event(json!({
            "event": "streaming",
            "device": m.device.to_string(),
            "mode": exec.streaming().to_string(),
            "host_bytes": m.host_weight_bytes,
            "host_pinned": m.host_pinned,
            "stream_buffers": m.stream_buffers,
            "stream_buffer_bytes": m.stream_buffer_bytes,
            "block_copies": report.as_ref().map(|r| r.copies),
            "ring_fills": report.as_ref().map(|r| r.restarts),
        }));
        let ring = report
            .map(|r| format!(", {} block copies, {} ring fill(s)", r.copies, r.restarts))
            .unwrap_or_default();
        say!(
            rep,
            "  {:<10} streams ({}): {} in {host} host memory, {} stream buffer(s) ({} on the device){ring}",
            m.device.to_string(),
            exec.streaming(),
            ByteSize(m.host_weight_bytes).human(),
            m.stream_buffers,
            ByteSize(m.stream_buffer_bytes).human(),
        );
    }
}

/// Seconds for people: `1.23 s`, `45.6 ms`, `0.030 ms`.
fn secs(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.2} s")
    } else if x >= 1e-3 {
        format!("{:.1} ms", x * 1e3)
    } else {
        format!("{:.3} ms", x * 1e3)
    }
}

/// What the plan (or, for another size, the simulator) predicts for this request.
struct Predicted {
    step_s: f64,
    encode_s: f64,
    decode_s: f64,
    /// Peak per device.
    peaks: Vec<(mold_plan::DeviceId, u64)>,
    source: &'static str,
}

/// `mold exec PLAN --weights DIR --prompt ...`: the whole text-to-image pipeline.
fn run_pipeline(a: &Args, prompt: &str, opts: &mold_exec::ExecOptions) -> Result<i32> {
    if a.verify || a.tolerance.is_some() {
        bail!("--verify compares the transformer alone with a 1-device reference: drop --prompt to use it");
    }
    let rep = Reporter::new(a.output);
    let plan = load_plan(&a.plan)?;
    let width = a.width.unwrap_or(plan.workload.width);
    let height = a.height.unwrap_or(plan.workload.height);
    // Sizes first: nothing else is worth checking for an image FLUX cannot make.
    mold_pipeline::check_size(width, height)?;
    let steps = a.steps.unwrap_or(plan.workload.steps);
    if steps == 0 {
        bail!("the plan's workload has 0 steps: pass --steps N (at least 1)");
    }
    let model = model_of(&plan)?;
    let machine = machine_for(&plan, &a.machine)?;
    warn_if_box_differs(&plan);
    // The plan with this request's workload: another size changes activations (and
    // tokens), so the simulator re-checks it before anything loads.
    let resized = width != plan.workload.width || height != plan.workload.height;
    let mut run_plan = plan.clone();
    run_plan.workload.width = width;
    run_plan.workload.height = height;
    run_plan.workload.steps = steps;
    if a.guidance.is_some() {
        run_plan.workload.guidance = a.guidance;
    }
    let family = mold_pipeline::run::transformer_family(&plan)?;
    let qwen_cfg = match &family {
        Family::Qwen(_) => {
            let c = a.cfg.or(plan.workload.cfg_scale).unwrap_or(1.0);
            if !c.is_finite() || c < 1.0 {
                bail!("--cfg {c}: the true-CFG scale is a number >= 1 (1 turns true CFG off; Qwen-Image's default is 4)");
            }
            if a.guidance.is_some() {
                bail!("--guidance is FLUX's distilled guidance; Qwen-Image has none: use --cfg (true CFG) instead");
            }
            // One transformer pass a step without true CFG, two with it.
            run_plan.workload.cfg_scale = (c > 1.0).then_some(c);
            if c <= 1.0 {
                run_plan.cfg = None;
            }
            c
        }
        Family::Flux(_) => {
            if a.cfg.is_some() || a.negative_prompt.is_some() || a.cfg_parallel {
                bail!("--cfg, --negative-prompt and --cfg-parallel are Qwen-Image's true CFG; FLUX models take --guidance");
            }
            1.0
        }
    };
    let checked = mold_pipeline::run::preflight(
        &run_plan,
        &model,
        &machine,
        a.force,
        resized.then_some((plan.workload.width, plan.workload.height)),
    )?;
    warn_all(&checked.warnings);
    let sim = checked.sim.context("the simulator's report")?;
    let predicted = if resized {
        rep.pipeline(&mold_pipeline::Progress::Note(format!(
            "{width}x{height} differs from the plan's {}x{}: the simulator re-checked it and its predictions are shown",
            plan.workload.width, plan.workload.height
        )));
        Predicted {
            step_s: sim.step_s,
            encode_s: sim.encode_s,
            decode_s: sim.decode_s,
            peaks: sim
                .devices
                .iter()
                .map(|d| (d.device.clone(), d.peak))
                .collect(),
            source: "sim",
        }
    } else {
        let p = &plan.predicted;
        Predicted {
            step_s: p.step_time_s,
            encode_s: p.encode_time_s,
            decode_s: p.decode_time_s,
            peaks: p
                .devices
                .iter()
                .map(|d| (d.device.clone(), d.peak.0))
                .collect(),
            source: "plan",
        }
    };
    let weights = weights_for(&plan, &a.weights)?;
    // With --report: what the run measures, the allocator's baseline taken now.
    let mut rec = match &a.report {
        Some(_) => Some(mold_pipeline::report::Recorder::new(
            mold_sim::run_report::RunKind::Pipeline,
            super::run_report::probe(&run_plan)?,
        )),
        None => None,
    };
    let mut on = |p: &mold_pipeline::Progress| {
        rep.pipeline(p);
        if let Some(r) = rec.as_mut() {
            r.progress(p);
        }
    };
    let req = mold_pipeline::Request {
        prompt: prompt.to_string(),
        seed: a.seed,
        steps,
        guidance: a.guidance,
        width,
        height,
        latents: a.latents.clone(),
        save_io: a.save_io.clone(),
    };
    let out = match family {
        Family::Qwen(_) => {
            let mut prep = mold_pipeline::qwen::prepare(&run_plan, &weights)?;
            add_loras(&mut prep.ckpt, &a.loras)?;
            warn_all(
                &mold_pipeline::run::header_warning(&plan, &prep.layout.transformer)?
                    .into_iter()
                    .collect::<Vec<_>>(),
            );
            let q = mold_pipeline::qwen::QwenRequest {
                req,
                negative_prompt: a.negative_prompt.clone(),
                cfg: qwen_cfg,
            };
            // CFG-parallel when the plan says so (`cfg: {mode: parallel}`) or when asked.
            let parallel = a.cfg_parallel
                || (qwen_cfg > 1.0 && run_plan.cfg_mode() == Some(mold_plan::CfgMode::Parallel));
            if parallel {
                let replicas = run_plan.replica_plans()?;
                let [cond, uncond, ..] = replicas.as_slice() else {
                    bail!("--cfg-parallel runs the unconditional pass on the plan's second replica, and {} has {}: make one with `mold plan ... --objective throughput` (two replicas), or drop --cfg-parallel", a.plan.display(), if replicas.len() == 1 { "one".to_string() } else { replicas.len().to_string() });
                };
                mold_pipeline::qwen::generate_on(cond, Some(uncond), &prep, &q, opts, &mut on)?
            } else {
                mold_pipeline::qwen::generate(&run_plan, &prep, &q, opts, &mut on)?
            }
        }
        Family::Flux(_) => {
            let mut prep = mold_pipeline::prepare(&run_plan, &weights)?;
            add_loras(&mut prep.ckpt, &a.loras)?;
            // `prepare` opened and checked the checkpoint; only the header comparison is left.
            warn_all(
                &mold_pipeline::run::header_warning(&plan, &prep.layout.transformer)?
                    .into_iter()
                    .collect::<Vec<_>>(),
            );
            mold_pipeline::generate(&run_plan, &prep, &req, opts, &mut on)?
        }
    };
    let path = a.out.clone().unwrap_or_else(|| PathBuf::from("out.png"));
    mold_pipeline::write_png(&path, &out.image, &out.metadata)?;
    rep.result(
        format_args!(
            "wrote {} ({}x{}, seed {}, {} steps)",
            path.display(),
            out.image.width,
            out.image.height,
            a.seed,
            steps
        ),
        json!({
            "event": "wrote",
            "path": path.display().to_string(),
            "width": out.image.width,
            "height": out.image.height,
            "seed": a.seed,
            "steps": steps,
        }),
    );
    let t = &out.timings;
    let median = {
        let mut s = t.step_s.clone();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    let src = predicted.source;
    let mut peaks = Vec::new();
    let mut peak_events = Vec::new();
    for p in &out.peaks {
        let want = predicted
            .peaks
            .iter()
            .find(|(d, _)| d == &p.device)
            .map(|(_, b)| *b);
        peak_events.push(json!({
            "device": p.device.to_string(),
            "peak_bytes": p.peak_bytes,
            "predicted_bytes": want,
        }));
        let want = want
            .map(|b| ByteSize(b).human())
            .unwrap_or_else(|| "-".into());
        peaks.push(format!(
            "{} {} ({src} {want})",
            p.device,
            ByteSize(p.peak_bytes).human()
        ));
    }
    rep.event(json!({
        "event": "done",
        "total_s": t.total_s,
        "load_s": t.load_s,
        "encode_s": t.encode_s,
        "denoise_s": t.denoise_s,
        "decode_s": t.decode_s,
        "median_step_s": median,
        "predicted": {
            "source": src,
            "step_s": predicted.step_s,
            "encode_s": predicted.encode_s,
            "decode_s": predicted.decode_s,
        },
        "peaks": peak_events,
    }));
    say!(
        rep,
        "done in {}: load {} | encode {} ({src} {}) | denoise {}, median step {} ({src} {}) | decode {} ({src} {}) | peak memory, accounted: {}",
        secs(t.total_s),
        secs(t.load_s),
        secs(t.encode_s),
        secs(predicted.encode_s),
        secs(t.denoise_s),
        secs(median),
        secs(predicted.step_s),
        secs(t.decode_s),
        secs(predicted.decode_s),
        peaks.join(", ")
    );
    if let (Some(r), Some(path)) = (rec, &a.report) {
        let (report, err) = r.finish(mold_pipeline::report::ReportInputs {
            plan: &plan,
            run_plan: &run_plan,
            sim: &sim,
            machine_profile: &machine.name,
            timings: Some(&out.timings),
            predicted_peaks: predicted.peaks.clone(),
            accounted_peaks: out.peaks.clone(),
        });
        super::run_report::write(&rep, path, &report, err)?;
    }
    Ok(0)
}

/// Which attention implementations ran (cuDNN, mold's kernel, candle's ops) and, where
/// cuDNN was allowed but passed over, why.
fn say_attention(rep: &Reporter) {
    let r = mold_exec::attention_report();
    if r.calls.is_empty() {
        return;
    }
    let calls: Vec<String> = r
        .calls
        .iter()
        .map(|(k, n)| format!("{k} ({n} calls)"))
        .collect();
    say!(rep, "attention: {}", calls.join(", "));
    for why in &r.cudnn_refusals {
        say!(rep, "  cuDNN not used: {why}");
    }
    rep.event(json!({"event": "attention", "calls": r.calls, "cudnn_refusals": r.cudnn_refusals}));
}

/// Median step time, leaving out the first step (kernel loading, allocator warm-up)
/// when there are later ones; with the description of what it covers.
fn step_median(times: &[f64]) -> (f64, String) {
    let (rest, what) = if times.len() > 1 {
        (
            &times[1..],
            format!("steps 2..{} (step 1 is warm-up)", times.len()),
        )
    } else {
        (times, format!("{} step", times.len()))
    };
    let mut v = rest.to_vec();
    v.sort_by(f64::total_cmp);
    (v.get(v.len() / 2).copied().unwrap_or(0.0), what)
}

#[cfg(test)]
mod tests {
    use super::step_median;

    #[test]
    fn step_median_leaves_out_the_warm_up_step() {
        let (m, what) = step_median(&[9.0, 0.3, 0.1, 0.2]);
        assert_eq!(m, 0.2);
        assert!(what.contains("steps 2..4"), "{what}");
        assert_eq!(step_median(&[0.5]).0, 0.5);
        assert_eq!(step_median(&[]).0, 0.0);
    }
}
