//! Running a plan, the pieces of `mold exec`: the checks every run makes before any
//! weight loads ([`preflight`], [`open_transformer`]) and the transformer benchmark on
//! random inputs ([`bench`]); text to image is each family's `generate`
//! ([`crate::flux::generate`], [`crate::qwen::generate`]). [`crate::session`] puts them in
//! the order a run goes.

use crate::error::{PipelineError, Result};
use crate::sampling::{self, Passes, StepTime};
use mold_exec::{Checkpoint, Executor, FluxConfig, QwenConfig, Tensor, Transformer};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{CfgMode, Plan};
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
///
/// With true CFG (a workload `cfg_scale`) a step is what the plan prices: two passes at
/// the workload's batch, a conditional and an unconditional one ([`bench_inputs`]), run
/// as the plan's CFG mode says ([`bench_passes`]: serially, as two micro-batches through
/// the split when pipelined, on the two replicas at once when CFG-parallel and `uncond`,
/// the second replica's executor, is given), then combined.
pub fn bench<M: Benchable>(
    exec: &Executor<M>,
    uncond: Option<&Executor<M>>,
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
    // On the device that reads them, as the pipeline's encoders leave them: from the
    // host, every step uploaded them again.
    if let Some(dev) = exec.input_device() {
        inputs = inputs.to_device(&dev)?;
    }
    run_bench(&bench_passes(exec, uncond, plan), inputs, steps, on_step)
}

/// Where the benchmark runs a step's passes: as the plan's CFG mode says; CFG-parallel
/// only with `uncond` (the second replica's executor: a multi-process run has none, and
/// then runs the two passes one after the other).
pub fn bench_passes<'a, M: Benchable>(
    exec: &'a Executor<M>,
    uncond: Option<&'a Executor<M>>,
    plan: &Plan,
) -> Passes<'a, M> {
    match (plan.cfg_mode(), uncond) {
        (Some(CfgMode::Parallel), Some(u)) => Passes::Parallel {
            cond: exec,
            uncond: u,
        },
        (Some(CfgMode::Pipelined), _) => Passes::Pipelined(exec),
        _ => Passes::Serial(exec),
    }
}

/// The plan of the executor that runs the benchmark's unconditional passes: a
/// CFG-parallel plan's second replica; `None` for every other plan.
pub fn uncond_plan(plan: &Plan) -> Result<Option<Plan>> {
    if plan.cfg_mode() != Some(CfgMode::Parallel) {
        return Ok(None);
    }
    let mut replicas = plan
        .replica_plans()
        .map_err(|e| PipelineError::Plan(e.to_string()))?;
    if replicas.len() < 2 {
        return Err(PipelineError::Plan(format!(
            "cfg.mode is parallel, but the plan has {} replica(s): CFG-parallel runs the unconditional pass on `replicas[1]`; re-plan with `mold plan --cfg parallel`",
            replicas.len()
        )));
    }
    Ok(Some(replicas.swap_remove(1)))
}

/// The denoising steps of the benchmark (and its reference) on `inputs`.
fn run_bench<M: Benchable>(
    passes: &Passes<M>,
    inputs: BenchInputs<M::Inputs>,
    steps: u32,
    on_step: &mut dyn FnMut(StepTime),
) -> Result<Tensor> {
    let BenchInputs { mut cond, uncond } = inputs;
    let sched = sampling::linear_schedule(steps);
    sampling::set_schedule(&mut cond, &sched)?;
    // True CFG's combination (Qwen-Image's: the one model with true CFG).
    let scale = uncond.as_ref().map_or(1.0, |(_, s)| *s);
    let combine = |c: &Tensor, n: &Tensor| crate::qwen::sampling::combine(c, n, scale);
    let guided = match uncond {
        Some((mut neg, _)) => {
            sampling::set_schedule(&mut neg, &sched)?;
            Some(sampling::Guided {
                neg,
                combine: &combine,
            })
        }
        None => None,
    };
    let r = sampling::denoise_passes(passes, &mut cond, guided, &sched, true, on_step);
    // The request's windows are done with (and after a failure no rank keeps one).
    release_modulation_ahead(passes);
    r?;
    Ok(mold_exec::Inputs::latents(&cond).clone())
}

/// Drops the modulation outputs every executor of `passes` computed ahead.
fn release_modulation_ahead<M: Benchable>(passes: &Passes<M>) {
    match passes {
        Passes::Serial(e) | Passes::Pipelined(e) => e.release_modulation_ahead(),
        Passes::Parallel { cond, uncond } => {
            cond.release_modulation_ahead();
            uncond.release_modulation_ahead();
        }
    }
}

/// The benchmark's random inputs at the plan's workload: the conditional pass's at the
/// workload's batch and, with true CFG, the unconditional pass's (other random text, from
/// `seed + 1`; each step gives it the conditional pass's latents and time) with the
/// guidance scale.
pub struct BenchInputs<I> {
    pub cond: I,
    pub uncond: Option<(I, f64)>,
}

impl<I: mold_exec::Inputs> BenchInputs<I> {
    /// Every tensor on `dev` (the values unchanged).
    pub fn to_device(self, dev: &candle_core::Device) -> Result<Self> {
        let mut mv = |t: &Tensor| t.to_device(dev);
        Ok(BenchInputs {
            cond: self.cond.map(&mut mv)?,
            uncond: match self.uncond {
                Some((x, s)) => Some((x.map(&mut mv)?, s)),
                None => None,
            },
        })
    }
}

/// The benchmark's random inputs at the plan's workload ([`BenchInputs`]).
pub fn bench_inputs<M: Benchable>(
    cfg: &M,
    plan: &Plan,
    model: &ModelSpec,
    seed: u64,
) -> Result<BenchInputs<M::Inputs>> {
    let tokens = model.tokens(&plan.workload);
    let w = &plan.workload;
    let at = |seed: u64| {
        cfg.random_inputs(
            w.width,
            w.height,
            tokens.txt as usize,
            w.batch as usize,
            seed,
        )
    };
    let uncond = match w.cfg_scale {
        Some(scale) => Some((at(seed.wrapping_add(1))?, scale)),
        None => None,
    };
    Ok(BenchInputs {
        cond: at(seed)?,
        uncond,
    })
}

/// One transformer call on the benchmark's random inputs (random times too; with true
/// CFG, the conditional pass's), written
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
    let x = bench_inputs(exec.model(), plan, model, seed)?.cond;
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
/// placement), true CFG's passes one after the other. `(dtype, fp8)`: the compute dtype
/// and whether the products' weights are FP8 (then the same quantized weights, unsharded,
/// through the emulated FP8 products).
pub fn reference_run<M: Benchable>(
    cfg: &M,
    ckpt: &Checkpoint,
    device: &mold_plan::DeviceId,
    (dtype, fp8): (mold_exec::DType, bool),
    inputs: BenchInputs<M::Inputs>,
    steps: u32,
) -> Result<Tensor> {
    let reference = Executor::reference_products(cfg, ckpt, device, dtype, fp8)?
        .with_kernels(mold_exec::Kernels::Candle);
    run_bench(&Passes::Serial(&reference), inputs, steps, &mut |_| {})
}

#[cfg(test)]
mod tests {
    use super::*;
    use mold_exec::{DType, QwenConfig};
    use mold_plan::DeviceId;
    use std::collections::BTreeMap;

    /// qwen-image-tiny with true CFG, its transformer split over `emu:0` and `emu:1`;
    /// `cfg` is the plan's `cfg:` line, `replicas` its `replicas:` block (or nothing).
    fn plan(cfg: &str, replicas: &str) -> Plan {
        let yaml = format!(
            "version: 4
model: {{id: qwen-image-tiny}}
workload: {{width: 64, height: 32, steps: 2, cfg_scale: 4.0}}
{cfg}
machine:
  name: cpu-emu-4
  fingerprint: sha256:70c9ec7dbfc3fc8c
  devices:
  - {{id: emu:0, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:1, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:2, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:3, name: emulated device (CPU), memory: 4GiB}}
components:
- name: transformer
  role: transformer
  dtype: f32
  parts:
  - {{blocks: [block 0..1], devices: [emu:0], residency: resident}}
  - {{blocks: [block 1..3], devices: [emu:1], residency: resident}}
{replicas}
predicted: {{step_time_s: 0.0, request_time_s: 0.0, encode_time_s: 0.0, denoise_time_s: 0.0, decode_time_s: 0.0, devices: [], host_pinned: 0, streamed_per_step: 0}}
solver: {{solver: hand, status: optimal, objective: latency, objective_value: 0.0, strategy: split, solve_time_ms: 0.0}}
"
        );
        Plan::from_yaml(&yaml, "test plan").unwrap()
    }

    /// Transformer passes run by an executor since its profile was cleared, by
    /// micro-batch (`None`: plain calls), from its profile's marks: every pass marks each
    /// phase of each part the same number of times.
    fn passes(exec: &Executor<QwenConfig>, per_pass: u64) -> BTreeMap<Option<String>, u64> {
        let mut out = BTreeMap::new();
        for (_, phases) in exec.profile_report() {
            for (label, _, marks) in phases {
                let mb = label
                    .strip_prefix("mb")
                    .and_then(|r| r.split_once(' '))
                    .map(|(j, _)| j.to_string());
                *out.entry(mb).or_insert(0) += marks;
            }
        }
        out.into_iter().map(|(k, v)| (k, v / per_pass)).collect()
    }

    /// The benchmark of a true-CFG plan runs what the plan prices: two passes a step at
    /// the workload's batch, serially, as two micro-batches (pipelined) or on the two
    /// replicas (CFG-parallel), all three the latents of the serial reference.
    #[test]
    fn cfg_benchmark_runs_the_plans_passes() {
        let dir = std::env::temp_dir().join(format!("mold-bench-cfg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = QwenConfig::qwen_image_tiny();
        mold_exec::model::qwen::testdata::write_testdata(&cfg, &dir, 5, DType::F32, 1 << 30)
            .unwrap();
        let ckpt = Checkpoint::open(
            &dir.join("transformer/diffusion_pytorch_model.safetensors.index.json"),
        )
        .unwrap();
        let model = mold_models::find("qwen-image-tiny").unwrap();
        let steps = 2;

        let serial = plan("cfg: {mode: serial}", "");
        let x = bench_inputs(&cfg, &serial, &model, 9).unwrap();
        assert_eq!(x.cond.img.dims()[0], 1, "a pass at the workload's batch");
        let (neg, scale) = x.uncond.as_ref().unwrap();
        assert_eq!((neg.img.dims(), *scale), (x.cond.img.dims(), 4.0));
        let want = reference_run(
            &cfg,
            &ckpt,
            &DeviceId::Emu(0),
            (DType::F32, false),
            x,
            steps,
        )
        .unwrap();

        // One pass's marks, from one plain call.
        let exec = |p: &Plan| Executor::new(&cfg, p, &ckpt).unwrap().with_profiling(true);
        let e = exec(&serial);
        e.forward(&bench_inputs(&cfg, &serial, &model, 9).unwrap().cond)
            .unwrap();
        let per_pass: u64 = e
            .profile_report()
            .iter()
            .flat_map(|(_, v)| v.iter().map(|p| p.2))
            .sum();
        assert!(per_pass > 0);
        e.clear_profile();

        let check = |name: &str, got: &Tensor| {
            let err = mold_exec::max_relative_error(got, &want).unwrap();
            assert!(err <= 1e-6, "{name}: max relative error {err}");
        };
        let got = bench(&e, None, &serial, &model, 9, steps, &mut |_| {}).unwrap();
        check("serial", &got);
        let two = BTreeMap::from([(None, 2 * steps as u64)]);
        assert_eq!(passes(&e, per_pass), two, "serial");

        let pipelined = plan("cfg: {mode: pipelined}", "");
        let e = exec(&pipelined);
        let got = bench(&e, None, &pipelined, &model, 9, steps, &mut |_| {}).unwrap();
        check("pipelined", &got);
        let mbs = BTreeMap::from([
            (Some("0".to_string()), steps as u64),
            (Some("1".to_string()), steps as u64),
        ]);
        assert_eq!(passes(&e, per_pass), mbs, "pipelined");

        let parallel = plan(
            "cfg: {mode: parallel}",
            "replicas:\n- {emu:0: emu:0, emu:1: emu:1}\n- {emu:0: emu:2, emu:1: emu:3}",
        );
        let u = uncond_plan(&parallel).unwrap().unwrap();
        assert_eq!(
            u.transformer().unwrap().parts[0].devices,
            [DeviceId::Emu(2)]
        );
        let (e, eu) = (exec(&parallel), exec(&u));
        let got = bench(&e, Some(&eu), &parallel, &model, 9, steps, &mut |_| {}).unwrap();
        check("parallel", &got);
        let one = BTreeMap::from([(None, steps as u64)]);
        assert_eq!(passes(&e, per_pass), one, "parallel: conditional");
        assert_eq!(passes(&eu, per_pass), one, "parallel: unconditional");
        // Without the second replica's executor (a multi-process run): serially.
        let e = exec(&parallel);
        let got = bench(&e, None, &parallel, &model, 9, steps, &mut |_| {}).unwrap();
        check("parallel without its replica", &got);
        assert_eq!(passes(&e, per_pass), two, "parallel without its replica");
        // Plans without true CFG's modes have no second replica to load.
        assert!(uncond_plan(&serial).unwrap().is_none());
        assert!(uncond_plan(&pipelined).unwrap().is_none());
    }
}
