//! The transformer benchmark as `mold exec PLAN` (no `--prompt`) runs it: [`run`] opens
//! the checkpoint (headers) with its LoRAs, joins a multi-process run's other processes,
//! loads the executor (and CFG-parallel's second replica), writes `--save-io`, and runs
//! the steps on random inputs; the caller prints from the [`BenchDone`] it returns, then
//! asks it for the run report ([`BenchDone::report`]) and `--verify`'s comparison
//! ([`BenchDone::verify`]).

use super::{add_loras, Event};
use crate::error::{PipelineError, Result};
use crate::report::{self, Recorder, ReportInputs};
use crate::run::{self, Benchable};
use crate::DevicePeak;
use mold_exec::checkpoint::{Checkpoint, LoraSpec};
use mold_exec::comm::CommOptions;
use mold_exec::dist::{Launch, LocalDevices, Mesh};
use mold_exec::{ExecOptions, Executor, Tensor};
use mold_models::ModelSpec;
use mold_plan::{CfgMode, DeviceId, Plan};
use mold_sim::run_report::{RunKind, RunReport};
use mold_sim::SimReport;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// `mold exec PLAN` (the transformer alone) as the CLI resolved its flags.
#[derive(Clone, Debug, Default)]
pub struct BenchOptions {
    /// The plan's file: the processes of a multi-process run check they run the same.
    pub plan_file: PathBuf,
    /// Seed of the random latents and conditioning.
    pub seed: u64,
    /// Denoising steps (default: the plan's).
    pub steps: Option<u32>,
    /// `--verify` is asked for (the processes of a run must agree on it).
    pub verify: bool,
    /// LoRAs merged into the transformer at load.
    pub loras: Vec<LoraSpec>,
    /// Write the benchmark's inputs and one transformer call's output here.
    pub save_io: Option<PathBuf>,
    /// Replace the file at `save_io` whatever it is.
    pub overwrite: bool,
    /// Measure for the run report (`--report`).
    pub report: bool,
}

impl BenchOptions {
    /// The steps the benchmark runs on `plan`: `steps`, else the plan's.
    pub fn steps_on(&self, plan: &Plan) -> u32 {
        self.steps.unwrap_or(plan.workload.steps)
    }
}

/// A multi-process run, as the CLI resolved it from the launcher's variables: this
/// process's place, the devices it runs, and how the processes talk.
#[derive(Clone, Debug)]
pub struct Processes {
    pub launch: Launch,
    pub own: LocalDevices,
    pub comm: CommOptions,
}

/// The benchmark, run; the executor stays for what the caller prints.
pub struct BenchDone<M: Benchable> {
    pub exec: Executor<M>,
    /// The final latents.
    pub out: Tensor,
    /// Seconds per step.
    pub times: Vec<f64>,
    /// Denoising steps.
    pub steps: u32,
    cfg: M,
    ckpt: Checkpoint,
    own: Option<LocalDevices>,
    recorder: Option<Recorder>,
}

/// `--verify`: the comparison with the single-device reference.
#[derive(Clone, Debug, PartialEq)]
pub enum Verified {
    /// Another process runs the reference (the one that runs this device).
    ElsewhereBy(DeviceId),
    /// The largest relative error against the reference on `device`, computed in f32
    /// (`f32`) or in the plan's dtype, and the tolerance it is held to.
    Compared {
        error: f64,
        tolerance: f64,
        device: DeviceId,
        f32: bool,
    },
}

impl Verified {
    /// Whether the run passed (a comparison made elsewhere counts as passed here).
    pub fn passed(&self) -> bool {
        match self {
            Verified::ElsewhereBy(_) => true,
            Verified::Compared {
                error, tolerance, ..
            } => error <= tolerance,
        }
    }
}

/// What every process of a multi-process run must agree on, checked at the rendezvous
/// before any weight is read.
fn run_settings(
    plan_text: &str,
    steps: u32,
    o: &BenchOptions,
    opts: &ExecOptions,
) -> [(&'static str, String); 8] {
    [
        ("plan", text_fingerprint(plan_text)),
        ("steps", steps.to_string()),
        ("seed", o.seed.to_string()),
        ("verify", o.verify.to_string()),
        ("streaming", opts.streaming.to_string()),
        // Settings that change which collectives a group calls: a process that differs
        // would wait in one NCCL call while its peer waits in another.
        ("token split", opts.comm.token_split.to_string()),
        ("overlap chunks", opts.comm.overlap_chunks.to_string()),
        // One window's all-gather against one a step.
        ("modulation ahead", opts.modulation_ahead.to_string()),
    ]
}

/// A short fingerprint of a file's text, for processes to check they run the same plan.
fn text_fingerprint(text: &str) -> String {
    format!("{:016x}", mold_exec::fnv1a(text.bytes()))
}

/// Runs the benchmark of `cfg` (the plan's model) on `plan` with the transformer
/// checkpoint at `weights`; `processes` for a multi-process run. `on` sees each step,
/// and what happens before the steps, as it happens.
#[allow(clippy::too_many_arguments)]
pub fn run<M: Benchable>(
    cfg: M,
    plan: &Plan,
    model: &ModelSpec,
    weights: &Path,
    o: &BenchOptions,
    opts: &ExecOptions,
    processes: Option<&Processes>,
    on: &mut dyn FnMut(Event),
) -> Result<BenchDone<M>> {
    let mut warnings = Vec::new();
    let mut ckpt = run::open_transformer(&cfg, plan, weights, &mut warnings)?;
    add_loras(&mut ckpt, &o.loras, on)?;
    for w in &warnings {
        on(Event::Warning(w));
    }
    let steps = o.steps_on(plan);
    if steps == 0 {
        return Err(PipelineError::Refused(
            "the plan's workload has 0 steps: pass --steps N (at least 1)".into(),
        ));
    }
    // A multi-process run: which devices are this process's, then the rendezvous (every
    // process must run the same plan and arguments), all before any weight is read.
    let mesh = match processes {
        Some(p) => {
            on(Event::Process {
                launch: &p.launch,
                own: &p.own,
            });
            let plan_text = std::fs::read_to_string(&o.plan_file).unwrap_or_default();
            let run = run_settings(&plan_text, steps, o, opts);
            let t = Instant::now();
            let mesh = Mesh::connect(&p.launch, &run, &p.comm)?;
            on(Event::Joined {
                processes: p.launch.world,
                seconds: t.elapsed().as_secs_f64(),
            });
            Some((Arc::new(mesh), p.own.clone()))
        }
        None => None,
    };
    let mut recorder = if o.report {
        Some(Recorder::new(RunKind::Transformer, report::probe(plan)?))
    } else {
        None
    };
    let t0 = Instant::now();
    on(Event::Loading { weights });
    let exec = match &mesh {
        None => Executor::with_options(&cfg, plan, &ckpt, opts.clone())?,
        Some((m, own)) => {
            Executor::new_multi_process(&cfg, plan, &ckpt, opts.clone(), m.clone(), own.clone())?
        }
    };
    let load_s = t0.elapsed().as_secs_f64();
    if let Some(r) = recorder.as_mut() {
        r.loaded(load_s);
    }
    on(Event::Loaded {
        weights,
        seconds: load_s,
        weight_bytes: exec.weight_bytes(),
        phases: exec.load_phases().to_vec(),
    });
    // Between processes: NCCL between GPUs when built with it, else TCP.
    for (part, from, to, path) in exec.process_hand_offs() {
        on(Event::ProcessHandOff {
            part,
            from,
            to,
            path,
        });
    }
    if let Some(path) = &o.save_io {
        mold_files::Dest {
            path,
            flag: "--save-io",
            what: "I/O file",
            force_flag: "--overwrite",
            force: o.overwrite,
        }
        .check(mold_files::Mine::Stamped(mold_files::Stamp::Embedded))?;
        run::save_bench_io(&exec, plan, model, o.seed, path)?;
        on(Event::WroteIo { path });
    }
    let mut times = Vec::new();
    // CFG-parallel: the unconditional passes on the plan's second replica, as priced.
    let uncond = match (run::uncond_plan(plan)?, &mesh) {
        (Some(u), None) => {
            let t = Instant::now();
            let e = Executor::with_options(&cfg, &u, &ckpt, opts.clone())?;
            on(Event::LoadedUncond {
                seconds: t.elapsed().as_secs_f64(),
            });
            Some(e)
        }
        (Some(_), Some(_)) => {
            on(Event::Warning("the plan's CFG is parallel (two replicas at once); a multi-process run runs the two passes one after the other, so steps take longer than the plan's"));
            None
        }
        (None, _) => {
            if mesh.is_some() && plan.cfg_mode() == Some(CfgMode::Pipelined) {
                on(Event::Warning("the plan's CFG is pipelined (two micro-batches through the split); a multi-process run runs them one after the other, so steps take longer than the plan's"));
            }
            None
        }
    };
    let out = run::bench(
        &exec,
        uncond.as_ref(),
        plan,
        model,
        o.seed,
        steps,
        &mut |s| {
            on(Event::Step(s));
            if s.index == 0 {
                exec.clear_profile(); // the first step includes warm-up (kernel loading)
            }
            if let Some(r) = recorder.as_mut() {
                r.step(s.index + 1, s.seconds);
            }
            times.push(s.seconds);
        },
    )?;
    Ok(BenchDone {
        exec,
        out,
        times,
        steps,
        cfg,
        ckpt,
        own: mesh.map(|(_, own)| own),
        recorder,
    })
}

impl<M: Benchable> BenchDone<M> {
    /// Steps the profile averages over: all but the first (warm-up), at least one.
    pub fn measured_steps(&self) -> f64 {
        self.times.len().saturating_sub(1).max(1) as f64
    }

    /// `--report`: the run report (`None` when run without `report`), with the
    /// allocator's error, if any, as a warning to tell. `run_plan` is the plan with the
    /// run's steps, `sim` its simulation on the profile `machine_profile`.
    pub fn report(
        &mut self,
        plan: &Plan,
        run_plan: &Plan,
        sim: &SimReport,
        machine_profile: &str,
    ) -> Option<(RunReport, Option<String>)> {
        let mut r = self.recorder.take()?;
        if self.exec.profiling() {
            r.profile(plan, &self.exec.profile_report(), self.measured_steps());
        }
        Some(
            r.finish(ReportInputs {
                plan,
                run_plan,
                sim,
                machine_profile,
                timings: None,
                predicted_peaks: plan
                    .predicted
                    .devices
                    .iter()
                    .map(|d| (d.device.clone(), d.peak.0))
                    .collect(),
                accounted_peaks: self
                    .exec
                    .memory_report()
                    .iter()
                    .map(|m| DevicePeak {
                        device: m.device.clone(),
                        peak_bytes: m.resident_weight_bytes
                            + m.stream_buffer_bytes
                            + m.largest_activation_bytes
                            + m.ahead_bytes,
                    })
                    .collect(),
            }),
        )
    }

    /// `--verify`: the same steps on the unsharded model on the plan's first device, with
    /// candle's ops, in f32 (`f32`) or the plan's dtype, compared with this run's output;
    /// held to `tolerance` (default: 1e-5 for f32 plans; 2e-2 for bf16/f16 plans against
    /// a reference in their dtype, 1.5e-2 against an f32 one; 1e-1 for FP8 plans, whose
    /// reference is the dense model in bf16, or f32: FLUX.1-dev measures 6.5e-2). In a multi-process run the
    /// process that runs that device does it.
    pub fn verify(
        &self,
        plan: &Plan,
        model: &ModelSpec,
        seed: u64,
        f32: bool,
        tolerance: Option<f64>,
    ) -> Result<Verified> {
        let tf = plan
            .transformer()
            .ok_or_else(|| PipelineError::Refused("the plan has no transformer".into()))?;
        let mut first = tf.parts[0].devices[0].clone();
        if let Some(own) = &self.own {
            // The reference runs once, in the process that runs the first device.
            match own.local_id(&first) {
                Some(local) => first = local,
                None => return Ok(Verified::ElsewhereBy(first)),
            }
        }
        let dtype = if f32 {
            mold_exec::DType::F32
        } else {
            mold_exec::weights_dtype(tf.dtype)?.0
        };
        let inputs = run::bench_inputs(&self.cfg, plan, model, seed)?;
        let want = run::reference_run(
            &self.cfg,
            &self.ckpt,
            &first,
            // An FP8 plan is held to the dense model: the error is FP8's.
            (dtype, false),
            inputs,
            self.steps,
        )?;
        let error = mold_exec::max_relative_error(&self.out, &want)?;
        let tolerance = tolerance.unwrap_or(if tf.dtype == mold_plan::DType::F32 {
            1e-5
        } else if tf.dtype == mold_plan::DType::Fp8 {
            1e-1
        } else if f32 {
            1.5e-2
        } else {
            2e-2
        });
        Ok(Verified::Compared {
            error,
            tolerance,
            device: first,
            f32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mold_exec::FluxConfig;

    /// Processes that differ in a setting that changes their collectives differ in what
    /// they bring to the rendezvous, so it refuses them instead of letting them deadlock.
    #[test]
    fn the_rendezvous_compares_the_collective_settings() {
        let o = BenchOptions::default();
        let base = ExecOptions::default();
        let mut split = base.clone();
        split.comm.token_split = true;
        let mut chunks = base.clone();
        chunks.comm.overlap_chunks = 4;
        let mut alone = base.clone();
        alone.modulation_ahead = false;
        let of = |e: &ExecOptions| run_settings("plan", 2, &o, e);
        for (other, key) in [
            (&split, "token split"),
            (&chunks, "overlap chunks"),
            (&alone, "modulation ahead"),
        ] {
            let differ: Vec<&str> = of(&base)
                .iter()
                .zip(of(other).iter())
                .filter(|(a, b)| a != b)
                .map(|(a, _)| a.0)
                .collect();
            assert_eq!(differ, vec![key]);
        }
    }

    #[test]
    fn the_benchmark_reports_its_way_in_order_and_verifies_against_the_reference() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let plan = Plan::load(&root.join("plans/flux-tiny@cpu-emu-4.yaml")).unwrap();
        let model = mold_models::find("flux-tiny").unwrap();
        let dir = std::env::temp_dir().join(format!("mold-session-bench-{}", std::process::id()));
        let cfg = FluxConfig::flux_tiny();
        let weights = mold_exec::write_testdata(&cfg, &dir, 3, mold_exec::DType::F32).unwrap();
        let o = BenchOptions {
            steps: Some(2),
            ..Default::default()
        };
        let mut seen = Vec::new();
        let done = run(
            cfg,
            &plan,
            &model,
            &weights,
            &o,
            &ExecOptions::default(),
            None,
            &mut |e| {
                seen.push(match e {
                    Event::Loading { .. } => "loading".to_string(),
                    Event::Loaded { weight_bytes, .. } => format!("loaded {}", weight_bytes > 0),
                    Event::Step(s) => format!("step {}", s.index),
                    other => format!("{other:?}"),
                })
            },
        )
        .unwrap();
        assert_eq!(seen, ["loading", "loaded true", "step 0", "step 1"]);
        assert_eq!((done.times.len(), done.steps), (2, 2));
        let mut done = done;
        // Without `report`, nothing was recorded: no run report.
        let machine = mold_machine::Machine::load(&root.join("sim/machines/cpu-emu-4.yaml"));
        let sim = mold_sim::simulate(&plan, &model, &machine.unwrap()).unwrap();
        assert!(done.report(&plan, &plan, &sim, "cpu-emu-4").is_none());
        let v = done.verify(&plan, &model, 0, false, None).unwrap();
        assert!(v.passed(), "{v:?}");
        assert!(matches!(v, Verified::Compared { tolerance, .. } if tolerance == 1e-5));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
