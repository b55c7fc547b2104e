//! Running a plan, the library side of `mold exec`: the checks every run makes before any
//! weight loads ([`preflight`], [`open_transformer`]) and the transformer benchmark on
//! random inputs ([`bench`]); text to image is [`crate::generate`]. The binary parses
//! flags, calls these and prints.

use crate::error::{PipelineError, Result};
use crate::sampling::{self, StepTime};
use mold_exec::{Checkpoint, Executor, FluxConfig, QwenConfig, Tensor, Transformer};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::Plan;
use std::path::Path;

/// What the checks before a run found worth telling the user (and did not refuse).
#[derive(Debug, Default)]
pub struct Checked {
    pub warnings: Vec<String>,
    /// The simulator's report for the plan as it will run.
    pub sim: Option<mold_sim::SimReport>,
}

/// The FLUX config of a plan's model (text to image runs FLUX), or why not.
pub fn transformer_config(plan: &Plan) -> Result<FluxConfig> {
    let id = &plan.model.id;
    FluxConfig::by_name(id).ok_or_else(|| {
        PipelineError::Refused(format!(
            "model `{id}`: text to image runs FLUX-family models (flux-dev, flux-schnell, flux-tiny); `{id}`'s transformer runs on random inputs (drop --prompt)"
        ))
    })
}

/// The transformer families `mold exec` runs, by a plan's model.
#[derive(Clone, Debug)]
pub enum Family {
    Flux(FluxConfig),
    Qwen(QwenConfig),
}

/// The transformer family of a plan's model, or why exec cannot run it.
pub fn transformer_family(plan: &Plan) -> Result<Family> {
    let id = &plan.model.id;
    if let Some(c) = FluxConfig::by_name(id) {
        return Ok(Family::Flux(c));
    }
    if let Some(c) = QwenConfig::by_name(id) {
        return Ok(Family::Qwen(c));
    }
    Err(PipelineError::Refused(format!(
        "model `{id}`: mold exec runs flux-dev, flux-schnell, flux-tiny, qwen-image and qwen-image-tiny; `{id}` can be planned and simulated but not executed yet"
    )))
}

/// What the benchmark needs of a family beyond [`Transformer`]: random inputs at a
/// workload, and the named tensors of one call's inputs (for `--save-io`).
pub trait Benchable: Transformer {
    /// Deterministic random inputs for `width` × `height` pixels, `txt_len` text tokens.
    fn random_inputs(
        &self,
        width: u32,
        height: u32,
        txt_len: usize,
        batch: usize,
        seed: u64,
    ) -> Result<Self::Inputs>;
    /// The inputs' tensors by name (the reference implementation's argument names).
    fn input_tensors(x: &Self::Inputs) -> Result<Vec<(String, Tensor)>>;
}

impl Benchable for FluxConfig {
    fn random_inputs(
        &self,
        width: u32,
        height: u32,
        txt_len: usize,
        batch: usize,
        seed: u64,
    ) -> Result<mold_exec::FluxInputs> {
        Ok(mold_exec::random_inputs(
            self, width, height, txt_len, batch, seed,
        )?)
    }
    fn input_tensors(x: &mold_exec::FluxInputs) -> Result<Vec<(String, Tensor)>> {
        let mut v = vec![
            ("img".to_string(), x.img.clone()),
            ("img_ids".to_string(), x.img_ids.clone()),
            ("txt".to_string(), x.txt.clone()),
            ("txt_ids".to_string(), x.txt_ids.clone()),
            ("timesteps".to_string(), x.timesteps.clone()),
            ("y".to_string(), x.y.clone()),
        ];
        if let Some(g) = &x.guidance {
            v.push(("guidance".to_string(), g.clone()));
        }
        Ok(v)
    }
}

impl Benchable for QwenConfig {
    fn random_inputs(
        &self,
        width: u32,
        height: u32,
        txt_len: usize,
        batch: usize,
        seed: u64,
    ) -> Result<mold_exec::QwenInputs> {
        Ok(mold_exec::model::qwen::random_inputs(
            self, width, height, txt_len, batch, seed,
        )?)
    }
    fn input_tensors(x: &mold_exec::QwenInputs) -> Result<Vec<(String, Tensor)>> {
        let (h, w) = x.grid;
        let grid = Tensor::new(&[1u32, h as u32, w as u32], &mold_exec::Device::Cpu)?;
        Ok(vec![
            ("hidden_states".to_string(), x.img.clone()),
            ("encoder_hidden_states".to_string(), x.txt.clone()),
            ("timestep".to_string(), x.timesteps.clone()),
            ("img_shapes".to_string(), grid),
        ])
    }
}

/// Everything a run checks about a plan before it loads anything: the machine it runs on
/// is the plan's (or `force`), the plan matches its model and machine, and the simulator
/// says it fits (with `force`, a misfit is a warning). When the request's size differs
/// from the size the plan was made for, `made_for` is that size (for the message).
pub fn preflight(
    plan: &Plan,
    model: &ModelSpec,
    machine: &Machine,
    force: bool,
    made_for: Option<(u32, u32)>,
) -> Result<Checked> {
    let mut out = Checked::default();
    transformer_family(plan)?;
    let refused = |m: String| PipelineError::Refused(m);
    match mold_cost::check_machine(plan, machine, force).map_err(|e| refused(e.to_string()))? {
        mold_cost::MachineCheck::Same => {}
        mold_cost::MachineCheck::Warn(w) => out.warnings.push(w),
    }
    mold_cost::validate(plan, model, machine)
        .map_err(|e| refused(format!("the plan does not match its model or machine: {e}")))?;
    let sim = mold_sim::simulate(plan, model, machine).map_err(|e| refused(e.to_string()))?;
    if !sim.fits() {
        let why: Vec<&str> = sim.overflows.iter().map(|o| o.message.as_str()).collect();
        let size = match made_for {
            Some((w, h)) => format!(
                " at {}x{} (the plan was made for {w}x{h})",
                plan.workload.width, plan.workload.height
            ),
            None => String::new(),
        };
        let msg = format!(
            "the simulator says this plan cannot fit{size}: {}",
            why.join("; ")
        );
        if force {
            out.warnings.push(format!("{msg} (going on: --force)"));
        } else {
            let fix = if made_for.is_some() {
                "re-plan for this size, or pass --force to try anyway"
            } else {
                "re-plan it, or pass --force to try anyway"
            };
            return Err(refused(format!("{msg}; {fix}")));
        }
    }
    out.sim = Some(sim);
    Ok(out)
}

/// Opens the transformer checkpoint at `path` (headers only) and checks it holds the
/// plan's model `cfg`; warns when its header differs from the one the plan was made from.
pub fn open_transformer<M: Transformer>(
    cfg: &M,
    plan: &Plan,
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<Checkpoint> {
    let ckpt = Checkpoint::open(path)?;
    ckpt.check(cfg, &plan.model.id)?;
    warnings.extend(header_warning(plan, path)?);
    Ok(ckpt)
}

/// A warning when the checkpoint at `path` has another header than the one the plan was
/// made from (its sizes may then differ from the plan's).
pub fn header_warning(plan: &Plan, path: &Path) -> Result<Option<String>> {
    let Some(c) = &plan.model.checkpoint else {
        return Ok(None);
    };
    let h = mold_models::checkpoint::read_header(path)
        .map_err(|e| PipelineError::Refused(e.to_string()))?;
    Ok((h.sha256 != c.header_sha256).then(|| {
        format!(
            "{} has a different header than the checkpoint the plan was made from ({}): sizes may differ from the plan's",
            path.display(),
            c.path
        )
    }))
}

/// The transformer benchmark: `steps` denoising steps on random inputs (seeded) at the
/// plan's workload, over the linear schedule; returns the final latents. The
/// executor is built by the caller (one process or several).
pub fn bench<M: Benchable>(
    exec: &Executor<M>,
    plan: &Plan,
    model: &ModelSpec,
    seed: u64,
    steps: u32,
    on_step: &mut dyn FnMut(StepTime),
) -> Result<Tensor> {
    if steps == 0 {
        return Err(PipelineError::Refused(
            "--steps 0: give at least 1 denoising step".into(),
        ));
    }
    let mut inputs = bench_inputs(exec.model(), plan, model, seed)?;
    sampling::denoise(
        exec,
        &mut inputs,
        &sampling::linear_schedule(steps),
        on_step,
    )?;
    Ok(mold_exec::Inputs::latents(&inputs).clone())
}

/// The benchmark's random inputs at the plan's workload.
pub fn bench_inputs<M: Benchable>(
    cfg: &M,
    plan: &Plan,
    model: &ModelSpec,
    seed: u64,
) -> Result<M::Inputs> {
    let tokens = model.tokens(&plan.workload);
    cfg.random_inputs(
        plan.workload.width,
        plan.workload.height,
        tokens.txt as usize,
        plan.workload.effective_batch() as usize,
        seed,
    )
}

/// One transformer call on the benchmark's random inputs (random times too), written
/// with those inputs to `path` as f32 safetensors: the inputs under the reference
/// implementation's argument names, the output as `output` (for the parity scripts in
/// benches/parity/).
pub fn save_bench_io<M: Benchable>(
    exec: &Executor<M>,
    plan: &Plan,
    model: &ModelSpec,
    seed: u64,
    path: &Path,
) -> Result<()> {
    let x = bench_inputs(exec.model(), plan, model, seed)?;
    let out = exec.forward(&x)?;
    let mut rec = crate::io::IoRecord::default();
    for (name, t) in M::input_tensors(&x)? {
        rec.add(name, &t)?;
    }
    rec.add("output", &out)?;
    rec.metadata.insert("model".into(), plan.model.id.clone());
    rec.metadata.insert("seed".into(), seed.to_string());
    if let Some(t) = plan.transformer() {
        rec.metadata.insert("dtype".into(), t.dtype.to_string());
    }
    rec.write(path)
}

/// Runs the benchmark's reference: the same steps on the unsharded model on one device,
/// with candle's ops (so the comparison checks mold's fused kernels as well as the
/// placement).
pub fn reference_run<M: Benchable>(
    cfg: &M,
    ckpt: &Checkpoint,
    device: &mold_plan::DeviceId,
    dtype: mold_exec::DType,
    inputs: M::Inputs,
    steps: u32,
) -> Result<Tensor> {
    let reference =
        Executor::reference(cfg, ckpt, device, dtype)?.with_kernels(mold_exec::Kernels::Candle);
    let mut inputs = inputs;
    sampling::denoise(
        &reference,
        &mut inputs,
        &sampling::linear_schedule(steps),
        &mut |_| {},
    )?;
    Ok(mold_exec::Inputs::latents(&inputs).clone())
}
