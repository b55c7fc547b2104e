use super::common::{load_machine, load_plan, model_of};
use anyhow::{bail, Context, Result};
use mold_exec::{Checkpoint, Executor, FluxConfig, FluxInputs, Tensor};
use mold_plan::{ByteSize, Plan};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The plan to run (from `mold plan`).
    pub plan: PathBuf,
    /// Checkpoint: a .safetensors file, an .index.json, or a directory holding them.
    #[arg(long)]
    pub weights: PathBuf,
    /// Denoising steps (default: the plan's).
    #[arg(long)]
    pub steps: Option<u32>,
    /// Seed of the random latents and conditioning.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the unsharded single-device reference and compare; exit 1 above tolerance.
    #[arg(long)]
    pub verify: bool,
    /// Largest max-relative error `--verify` accepts (default 1e-5 for f32, 1e-2 otherwise).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// The machine this runs on (default: sim/machines/<plan's machine>.yaml).
    #[arg(long)]
    pub machine: Option<String>,
    /// Run a plan made for another machine (its predictions do not hold here).
    #[arg(long)]
    pub force: bool,
}

#[derive(clap::Args, Debug)]
pub struct TestdataArgs {
    /// A FLUX-family model: flux-tiny, flux-dev or flux-schnell.
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
}

fn flux_config(id: &str) -> Result<FluxConfig> {
    FluxConfig::by_name(id).with_context(|| {
        format!("model `{id}`: mold exec runs FLUX-family transformers (flux-dev, flux-schnell, flux-tiny); `{id}` can be planned and simulated but not executed yet")
    })
}

pub fn testdata(a: TestdataArgs) -> Result<i32> {
    let cfg = flux_config(&a.name)?;
    let dtype = match a.dtype.as_deref() {
        None if a.name == "flux-tiny" => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create {}", a.dir.display()))?;
    let t = Instant::now();
    let path = match a.shard_size {
        Some(s) => mold_exec::write_testdata_sharded(&cfg, &a.dir, a.seed, dtype, s.0)?,
        None => mold_exec::write_testdata(&cfg, &a.dir, a.seed, dtype)?,
    };
    println!(
        "wrote {} ({} parameters, {dtype:?}, seed {}) in {:.1} s",
        path.display(),
        cfg.param_count(),
        a.seed,
        t.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// The machine a plan runs on here: `--machine`, else the profile named in the plan.
fn machine_for(plan: &Plan, flag: &Option<String>) -> Result<mold_machine::Machine> {
    match flag {
        Some(m) => load_machine(m),
        None => {
            let p = format!("sim/machines/{}.yaml", plan.machine.name);
            if !Path::new(&p).exists() {
                bail!(
                    "the plan was made for machine `{}` but {p} is not here: pass --machine PROFILE for the box this runs on",
                    plan.machine.name
                );
            }
            load_machine(&p)
        }
    }
}

/// Everything `exec` refuses happens here, before any weight is read.
pub fn preflight(plan: &Plan, a: &Args) -> Result<(FluxConfig, Checkpoint, mold_machine::Machine)> {
    let model = model_of(plan)?;
    let cfg = flux_config(&plan.model.id)?;
    let machine = machine_for(plan, &a.machine)?;
    match mold_cost::check_machine(plan, &machine, a.force)? {
        mold_cost::MachineCheck::Same => {}
        mold_cost::MachineCheck::Warn(w) => eprintln!("warning: {w}"),
    }
    mold_cost::validate(plan, &model, &machine)
        .context("the plan does not match its model or machine")?;
    let sim = mold_sim::simulate(plan, &model, &machine)?;
    if !sim.fits() {
        let why: Vec<&str> = sim.overflows.iter().map(|o| o.message.as_str()).collect();
        let msg = format!(
            "the simulator says this plan cannot fit: {}",
            why.join("; ")
        );
        if a.force {
            eprintln!("warning: {msg} (going on: --force)");
        } else {
            bail!("{msg}; re-plan it, or pass --force to try anyway");
        }
    }
    let ckpt = Checkpoint::open(&a.weights)?;
    ckpt.check(&cfg, &plan.model.id)?;
    if let Some(c) = &plan.model.checkpoint {
        let h = mold_models::checkpoint::read_header(&a.weights)?;
        if h.sha256 != c.header_sha256 {
            eprintln!(
                "warning: {} has a different header than the checkpoint the plan was made from ({}): sizes may differ from the plan's",
                a.weights.display(),
                c.path
            );
        }
    }
    Ok((cfg, ckpt, machine))
}

/// Rectified-flow Euler steps from t = 1 to 0: x ← x + (t_next − t) · v(x, t).
fn sample(
    forward: &dyn Fn(&FluxInputs) -> anyhow::Result<Tensor>,
    inputs: &FluxInputs,
    steps: u32,
    mut on_step: impl FnMut(u32, f64),
) -> Result<Tensor> {
    let mut x = inputs.clone();
    for i in 0..steps {
        let t = 1.0 - i as f64 / steps as f64;
        let t_next = 1.0 - (i + 1) as f64 / steps as f64;
        x.timesteps = x.timesteps.ones_like()?.affine(t, 0.0)?;
        let start = Instant::now();
        let v = forward(&x)?;
        let v = v.to_device(x.img.device())?;
        x.img = (&x.img + v.affine(t_next - t, 0.0)?)?;
        on_step(i, start.elapsed().as_secs_f64());
    }
    Ok(x.img)
}

pub fn run(a: Args) -> Result<i32> {
    let plan = load_plan(&a.plan)?;
    let (cfg, ckpt, _machine) = preflight(&plan, &a)?;
    let steps = a.steps.unwrap_or(plan.workload.steps);
    let model = model_of(&plan)?;
    let tokens = model.tokens(&plan.workload);
    let t0 = Instant::now();
    let exec = Executor::new(&cfg, &plan, &ckpt)?;
    println!(
        "loaded {} in {:.2} s",
        a.weights.display(),
        t0.elapsed().as_secs_f64()
    );
    let inputs = mold_exec::random_inputs(
        &cfg,
        plan.workload.width,
        plan.workload.height,
        tokens.txt as usize,
        plan.workload.effective_batch() as usize,
        a.seed,
    )?;
    let predicted = plan.predicted.step_time_s;
    let mut times = Vec::new();
    let out = sample(&|x| Ok(exec.forward_inputs(x)?), &inputs, steps, |i, s| {
        println!(
            "step {:>3}/{steps}: {:.4} s   (plan predicted {:.4} s)",
            i + 1,
            s,
            predicted
        );
        times.push(s);
    })?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "step time: median {:.4} s over {} steps; plan predicted {:.4} s",
        sorted[sorted.len() / 2],
        sorted.len(),
        predicted
    );
    println!("\nmemory (accounted from tensor shapes)   weights  stream buffers  largest activation | plan: peak");
    for m in exec.memory_report() {
        let p = plan
            .predicted
            .devices
            .iter()
            .find(|d| d.device == m.device)
            .map(|d| d.peak.human())
            .unwrap_or_else(|| "-".into());
        println!(
            "  {:<10} {:>28} {:>15} {:>19} | {p}",
            m.device.to_string(),
            ByteSize(m.resident_weight_bytes).human(),
            ByteSize(m.stream_buffer_bytes).human(),
            ByteSize(m.largest_activation_bytes).human(),
        );
    }
    if a.verify {
        let first = plan
            .transformer()
            .context("the plan has no transformer")?
            .parts[0]
            .devices[0]
            .clone();
        let dtype = mold_exec::compute_dtype(plan.transformer().unwrap().dtype)?;
        let reference = Executor::reference(&cfg, &ckpt, &first, dtype)?;
        let want = sample(
            &|x| Ok(reference.forward_inputs(x)?),
            &inputs,
            steps,
            |_, _| {},
        )?;
        let err = mold_exec::max_relative_error(&out, &want)?;
        let tol = a.tolerance.unwrap_or(
            if plan.transformer().unwrap().dtype == mold_plan::DType::F32 {
                1e-5
            } else {
                1e-2
            },
        );
        println!("\nverify: max relative error {err:.3e} against the single-device reference on {first} (tolerance {tol:.0e})");
        if err > tol {
            eprintln!("error: max relative error {err:.3e} is above the tolerance {tol:.0e}");
            return Ok(1);
        }
    }
    Ok(0)
}
