//! Running a plan, the library side of `mold exec`: the checks every run makes before any
//! weight loads ([`preflight`], [`open_transformer`]) and the transformer benchmark on
//! random inputs ([`bench`]); text to image is [`crate::generate`]. The binary parses
//! flags, calls these and prints.

use crate::error::{PipelineError, Result};
use crate::sampling::{self, StepTime};
use mold_exec::{Checkpoint, Executor, FluxConfig, Tensor};
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

/// The transformer family of a plan's model, or why exec cannot run it.
pub fn transformer_config(plan: &Plan) -> Result<FluxConfig> {
    let id = &plan.model.id;
    FluxConfig::by_name(id).ok_or_else(|| {
        PipelineError::Refused(format!(
            "model `{id}`: mold exec runs FLUX-family transformers (flux-dev, flux-schnell, flux-tiny); `{id}` can be planned and simulated but not executed yet"
        ))
    })
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
    transformer_config(plan)?;
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
/// plan's model; warns when its header differs from the one the plan was made from.
pub fn open_transformer(
    plan: &Plan,
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<(FluxConfig, Checkpoint)> {
    let cfg = transformer_config(plan)?;
    let ckpt = Checkpoint::open(path)?;
    ckpt.check(&cfg, &plan.model.id)?;
    warnings.extend(header_warning(plan, path)?);
    Ok((cfg, ckpt))
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
pub fn bench(
    exec: &Executor<FluxConfig>,
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
    Ok(inputs.img)
}

/// The benchmark's random inputs at the plan's workload.
pub fn bench_inputs(
    cfg: &FluxConfig,
    plan: &Plan,
    model: &ModelSpec,
    seed: u64,
) -> Result<mold_exec::FluxInputs> {
    let tokens = model.tokens(&plan.workload);
    Ok(mold_exec::random_inputs(
        cfg,
        plan.workload.width,
        plan.workload.height,
        tokens.txt as usize,
        plan.workload.effective_batch() as usize,
        seed,
    )?)
}

/// Runs the benchmark's reference: the same steps on the unsharded model on one device,
/// with candle's ops (so the comparison checks mold's fused kernels as well as the
/// placement).
pub fn reference_run(
    cfg: &FluxConfig,
    ckpt: &Checkpoint,
    device: &mold_plan::DeviceId,
    dtype: mold_exec::DType,
    inputs: mold_exec::FluxInputs,
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
    Ok(inputs.img)
}
