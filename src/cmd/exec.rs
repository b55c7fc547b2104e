//! `mold exec`: the flags, their resolution with the environment and config at the edge,
//! and what a run prints. The run itself is [`mold_pipeline::session`]: text to image
//! ([`ImageRun`]) or the transformer benchmark ([`bench::run`]).

use super::common::{load_machine, load_plan, model_of};
use super::exec_options::{exec_options, EnvVars};
use super::exec_print::{say_bench, say_done, say_event, say_step, say_verified};
use super::progress::{OutputArgs, Reporter};
use anyhow::{bail, Context, Result};
use mold_pipeline::run::{Benchable, Family};
use mold_pipeline::session::bench::{self, BenchOptions, Processes};
use mold_pipeline::session::image::{ImageOptions, ImageRun};
use mold_pipeline::session::Event;
use mold_plan::{DeviceId, Plan};
use serde_json::json;
use std::path::{Path, PathBuf};

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
    /// Replace the files at --out, --save-io and --report whatever they are. Without it,
    /// a file there is replaced only if mold wrote it and nobody changed it since (the
    /// PNG's and the safetensors' `mold-sha256:` stamp still matches; for --report, a
    /// file that reads as a run report); anything else is refused before anything loads.
    /// A symlink there is replaced, never written through. Not --force: that one runs a
    /// plan made for another machine.
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The image `--prompt` writes: `--out`, else `out.png`.
fn png_path(a: &Args) -> PathBuf {
    a.out.clone().unwrap_or_else(|| PathBuf::from("out.png"))
}

/// An output file of `mold exec` as mold-files sees it (`--overwrite` replaces anything).
fn output<'a>(a: &Args, path: &'a Path, flag: &'a str, what: &'a str) -> mold_files::Dest<'a> {
    mold_files::Dest {
        path,
        flag,
        what,
        force_flag: "--overwrite",
        force: a.overwrite,
    }
}

/// `--out` (with --prompt; `out.png` by default), `--save-io` and `--report`: a file
/// there that mold may not replace is refused before anything loads.
fn check_outputs(a: &Args) -> Result<()> {
    use mold_files::{Mine, Stamp};
    let png = png_path(a);
    if a.prompt.is_some() {
        output(a, &png, "--out", "image").check(Mine::Stamped(Stamp::Png))?;
    }
    if let Some(p) = &a.save_io {
        output(a, p, "--save-io", "I/O file").check(Mine::Stamped(Stamp::Embedded))?;
    }
    if let Some(p) = &a.report {
        super::run_report::dest(p, a.overwrite)
            .check(Mine::Recognised(&super::run_report::is_report))?;
    }
    Ok(())
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
    weights_for_model(&plan.model.id, flag)
}

/// [`weights_for`] by the catalogue id of the model (`mold plan --tune` resolves its
/// weights before it plans).
pub(super) fn weights_for_model(id: &str, flag: &Option<PathBuf>) -> Result<PathBuf> {
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
    check_outputs(&a)?;
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
    let processes = match (launch, local) {
        (Some(launch), Some(own)) => Some(Processes {
            launch,
            own,
            comm: comm_opts,
        }),
        _ => None,
    };
    let o = BenchOptions {
        plan_file: a.plan.clone(),
        seed: a.seed,
        steps: a.steps,
        verify: a.verify,
        loras: a.loras.clone(),
        save_io: a.save_io.clone(),
        overwrite: a.overwrite,
        report: report.is_some(),
    };
    let run = BenchRun {
        rep,
        plan,
        model,
        weights,
        processes,
        opts,
        report,
        o,
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
    processes: Option<Processes>,
    opts: mold_exec::ExecOptions,
    /// With `--report`: the plan as run, its simulation and the machine profile's name.
    report: Option<(Plan, mold_sim::SimReport, String)>,
    o: BenchOptions,
}

/// The transformer benchmark (and `--verify`, `--save-io`) for a model of family `M`:
/// [`bench::run`], then what it measured.
fn run_bench<M: Benchable>(a: Args, cfg: M, run: BenchRun) -> Result<i32> {
    let BenchRun {
        rep,
        plan,
        model,
        weights,
        processes,
        opts,
        report,
        o,
    } = run;
    let (steps, predicted) = (o.steps_on(&plan), plan.predicted.step_time_s);
    let mut done = bench::run(
        cfg,
        &plan,
        &model,
        &weights,
        &o,
        &opts,
        processes.as_ref(),
        &mut |e| match e {
            Event::Step(s) => say_step(&rep, s, steps, predicted),
            e => say_event(&rep, e),
        },
    )?;
    say_bench(&rep, &plan, &done)?;
    if let (Some((run_plan, sim, profile)), Some(path)) = (&report, &a.report) {
        if let Some((report, err)) = done.report(&plan, run_plan, sim, profile) {
            super::run_report::write(&rep, path, a.overwrite, &report, err)?;
        }
    }
    if !a.verify {
        return Ok(0);
    }
    let verified = done.verify(&plan, &model, a.seed, a.verify_f32, a.tolerance)?;
    Ok(say_verified(&rep, &verified))
}

/// `mold exec PLAN --weights DIR --prompt ...`: the whole text-to-image pipeline, run
/// by [`ImageRun`] between the CLI's own resolution of the machine and the weights.
fn run_pipeline(a: &Args, prompt: &str, opts: &mold_exec::ExecOptions) -> Result<i32> {
    if a.verify || a.tolerance.is_some() {
        bail!("--verify compares the transformer alone with a 1-device reference: drop --prompt to use it");
    }
    let rep = Reporter::new(a.output);
    let plan = load_plan(&a.plan)?;
    let o = ImageOptions {
        plan_file: a.plan.clone(),
        prompt: prompt.to_string(),
        seed: a.seed,
        steps: a.steps,
        guidance: a.guidance,
        negative_prompt: a.negative_prompt.clone(),
        cfg: a.cfg,
        cfg_parallel: a.cfg_parallel,
        width: a.width,
        height: a.height,
        latents: a.latents.clone(),
        save_io: a.save_io.clone(),
        force: a.force,
        loras: a.loras.clone(),
    };
    let run = ImageRun::new(&plan, &o)?;
    let model = model_of(&plan)?;
    let machine = machine_for(&plan, &a.machine)?;
    warn_if_box_differs(&plan);
    let checked = run.check(&model, &machine)?;
    warn_all(&checked.warnings);
    if let Some(note) = &checked.note {
        rep.pipeline(&mold_pipeline::Progress::Note(note.clone()));
    }
    let weights = weights_for(&plan, &a.weights)?;
    let done = checked.generate(&weights, opts, a.report.is_some(), &mut |e| {
        say_event(&rep, e)
    })?;
    let out = &done.output;
    let steps = checked.steps();
    let path = png_path(a);
    // Checked again: the run took a while, and a file may have appeared there since.
    output(a, &path, "--out", "image").check(mold_files::Mine::Stamped(mold_files::Stamp::Png))?;
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
    say_done(&rep, out, &checked.predicted);
    if let (Some((report, err)), Some(path)) = (checked.report(done), &a.report) {
        super::run_report::write(&rep, path, a.overwrite, &report, err)?;
    }
    Ok(0)
}
