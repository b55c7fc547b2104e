//! Text to image as `mold exec PLAN --prompt ...` runs it, in three calls with the CLI's
//! own resolution between them (so every refusal comes in the same order, and before any
//! weight loads):
//!
//! 1. [`ImageRun::new`]: the image's size and the steps (nothing else is worth checking
//!    for an image the model cannot make);
//! 2. [`ImageRun::check`], given the model and the machine: the plan with this request's
//!    workload, the family's own flags (FLUX's distilled guidance, Qwen-Image's true CFG)
//!    and the checks before any run ([`crate::run::preflight`]: another size is
//!    re-checked by the simulator), with what the plan (or the simulator) predicts;
//! 3. [`CheckedImage::generate`], given the weights: the family's checks of its weights
//!    directory, the LoRAs, then every component loaded, run and released as the plan
//!    places it; [`CheckedImage::report`] then makes the run report of `--report`.

use super::{add_loras, Event};
use crate::error::{PipelineError, Result};
use crate::report::{self, Recorder, ReportInputs};
use crate::run::{self, Family};
use crate::{Output, Progress, Request};
use mold_exec::checkpoint::LoraSpec;
use mold_exec::ExecOptions;
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{CfgMode, DeviceId, Plan};
use mold_sim::run_report::{RunKind, RunReport};
use mold_sim::SimReport;
use std::path::{Path, PathBuf};

/// `mold exec --prompt` as the CLI resolved its flags.
#[derive(Clone, Debug, Default)]
pub struct ImageOptions {
    /// The plan's file, for messages that name it.
    pub plan_file: PathBuf,
    pub prompt: String,
    pub seed: u64,
    /// Denoising steps (default: the plan's).
    pub steps: Option<u32>,
    /// FLUX's distilled guidance (default: the plan's, else the model's).
    pub guidance: Option<f64>,
    /// Qwen-Image: true CFG's negative prompt.
    pub negative_prompt: Option<String>,
    /// Qwen-Image: the true-CFG scale (default: the plan's, else 1: off).
    pub cfg: Option<f64>,
    /// Qwen-Image: each step's unconditional pass on the plan's second replica.
    pub cfg_parallel: bool,
    /// The image's size (default: the plan's).
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// The initial noise from this file instead of the seed's.
    pub latents: Option<PathBuf>,
    /// Write the run's inputs and outputs to this file.
    pub save_io: Option<PathBuf>,
    /// Run a plan made for another machine, and one the simulator says cannot fit.
    pub force: bool,
    /// LoRAs merged into the transformer at load.
    pub loras: Vec<LoraSpec>,
}

/// What the plan (or, for another size, the simulator) predicts for a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub step_s: f64,
    pub encode_s: f64,
    pub decode_s: f64,
    /// Peak per device.
    pub peaks: Vec<(DeviceId, u64)>,
    /// `plan` or `sim`: where the figures come from.
    pub source: &'static str,
}

/// A text-to-image request against a plan, its size and steps checked.
#[derive(Debug)]
pub struct ImageRun<'a> {
    plan: &'a Plan,
    o: &'a ImageOptions,
    width: u32,
    height: u32,
    steps: u32,
}

impl<'a> ImageRun<'a> {
    /// The size (a multiple of 16 each way) and the steps (at least one) of `o` on
    /// `plan`, before anything else is checked.
    pub fn new(plan: &'a Plan, o: &'a ImageOptions) -> Result<ImageRun<'a>> {
        let width = o.width.unwrap_or(plan.workload.width);
        let height = o.height.unwrap_or(plan.workload.height);
        // Sizes first: nothing else is worth checking for an image FLUX cannot make.
        crate::sampling::check_size(width, height)?;
        let steps = o.steps.unwrap_or(plan.workload.steps);
        if steps == 0 {
            return Err(PipelineError::Refused(
                "the plan's workload has 0 steps: pass --steps N (at least 1)".into(),
            ));
        }
        Ok(ImageRun {
            plan,
            o,
            width,
            height,
            steps,
        })
    }

    /// The plan with this request's workload, the family's flags, and the checks every
    /// run makes before it loads anything, on `machine` for `model`.
    pub fn check(self, model: &ModelSpec, machine: &Machine) -> Result<CheckedImage<'a>> {
        let ImageRun {
            plan,
            o,
            width,
            height,
            steps,
        } = self;
        // The plan with this request's workload: another size changes activations (and
        // tokens), so the simulator re-checks it before anything loads.
        let resized = width != plan.workload.width || height != plan.workload.height;
        let mut run_plan = plan.clone();
        run_plan.workload.width = width;
        run_plan.workload.height = height;
        run_plan.workload.steps = steps;
        if o.guidance.is_some() {
            run_plan.workload.guidance = o.guidance;
        }
        let family = run::transformer_family(plan)?;
        let cfg = match &family {
            Family::Qwen(_) => {
                let c = o.cfg.or(plan.workload.cfg_scale).unwrap_or(1.0);
                if !c.is_finite() || c < 1.0 {
                    return Err(PipelineError::Refused(format!("--cfg {c}: the true-CFG scale is a number >= 1 (1 turns true CFG off; Qwen-Image's default is 4)")));
                }
                if o.guidance.is_some() {
                    return Err(PipelineError::Refused("--guidance is FLUX's distilled guidance; Qwen-Image has none: use --cfg (true CFG) instead".into()));
                }
                // One transformer pass a step without true CFG, two with it.
                run_plan.workload.cfg_scale = (c > 1.0).then_some(c);
                if c <= 1.0 {
                    run_plan.cfg = None;
                }
                c
            }
            Family::Flux(_) => {
                if o.cfg.is_some() || o.negative_prompt.is_some() || o.cfg_parallel {
                    return Err(PipelineError::Refused("--cfg, --negative-prompt and --cfg-parallel are Qwen-Image's true CFG; FLUX models take --guidance".into()));
                }
                1.0
            }
        };
        let checked = run::preflight(
            &run_plan,
            model,
            machine,
            o.force,
            resized.then_some((plan.workload.width, plan.workload.height)),
        )?;
        let sim = checked
            .sim
            .ok_or_else(|| PipelineError::Refused("the simulator's report".into()))?;
        let (note, predicted) = if resized {
            let note = format!(
                "{width}x{height} differs from the plan's {}x{}: the simulator re-checked it and its predictions are shown",
                plan.workload.width, plan.workload.height
            );
            let predicted = Predicted {
                step_s: sim.step_s,
                encode_s: sim.encode_s,
                decode_s: sim.decode_s,
                peaks: sim
                    .devices
                    .iter()
                    .map(|d| (d.device.clone(), d.peak))
                    .collect(),
                source: "sim",
            };
            (Some(note), predicted)
        } else {
            let p = &plan.predicted;
            let predicted = Predicted {
                step_s: p.step_time_s,
                encode_s: p.encode_time_s,
                decode_s: p.decode_time_s,
                peaks: p
                    .devices
                    .iter()
                    .map(|d| (d.device.clone(), d.peak.0))
                    .collect(),
                source: "plan",
            };
            (None, predicted)
        };
        Ok(CheckedImage {
            plan,
            o,
            run_plan,
            family,
            cfg,
            steps,
            sim,
            machine_profile: machine.name.clone(),
            warnings: checked.warnings,
            note,
            predicted,
        })
    }
}

/// A text-to-image request that passed every check before loading.
#[derive(Debug)]
pub struct CheckedImage<'a> {
    plan: &'a Plan,
    o: &'a ImageOptions,
    /// The plan as this request runs it (its size, steps, guidance and CFG).
    pub run_plan: Plan,
    family: Family,
    /// Qwen-Image's true-CFG scale (1: off; FLUX: 1).
    cfg: f64,
    steps: u32,
    /// The simulation of `run_plan`.
    pub sim: SimReport,
    machine_profile: String,
    /// What the checks found worth telling (and did not refuse).
    pub warnings: Vec<String>,
    /// Told after the warnings: the size differs from the plan's, and the predictions
    /// shown are the simulator's.
    pub note: Option<String>,
    pub predicted: Predicted,
}

/// A generated image and, with `--report`, what the run measured for its report.
pub struct ImageDone {
    pub output: Output,
    recorder: Option<Recorder>,
}

impl CheckedImage<'_> {
    /// Denoising steps.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// Runs the request on the weights at `weights`, the transformer with `opts`; with
    /// `report`, measures for the run report (the allocator's baseline taken first).
    /// `on` sees the LoRAs as they are merged, warnings and the pipeline's progress.
    pub fn generate(
        &self,
        weights: &Path,
        opts: &ExecOptions,
        report: bool,
        on: &mut dyn FnMut(Event),
    ) -> Result<ImageDone> {
        let o = self.o;
        // With --report: what the run measures, the allocator's baseline taken now.
        let mut recorder = if report {
            Some(Recorder::new(
                RunKind::Pipeline,
                report::probe(&self.run_plan)?,
            ))
        } else {
            None
        };
        let req = Request {
            prompt: o.prompt.clone(),
            seed: o.seed,
            steps: self.steps,
            guidance: o.guidance,
            width: self.run_plan.workload.width,
            height: self.run_plan.workload.height,
            latents: o.latents.clone(),
            save_io: o.save_io.clone(),
            // `mold exec` prints every stage's digest.
            no_digests: false,
        };
        let run_plan = &self.run_plan;
        let output = match &self.family {
            Family::Qwen(_) => {
                let mut prep = crate::qwen::prepare(run_plan, weights)?;
                add_loras(&mut prep.ckpt, &o.loras, on)?;
                if let Some(w) = run::header_warning(self.plan, &prep.layout.transformer)? {
                    on(Event::Warning(&w));
                }
                let q = crate::qwen::QwenRequest {
                    req,
                    negative_prompt: o.negative_prompt.clone(),
                    cfg: self.cfg,
                };
                let mut on_p = progress(&mut recorder, on);
                // CFG-parallel when the plan says so (`cfg: {mode: parallel}`) or when asked.
                let parallel = o.cfg_parallel
                    || (self.cfg > 1.0 && run_plan.cfg_mode() == Some(CfgMode::Parallel));
                if parallel {
                    let replicas = run_plan
                        .replica_plans()
                        .map_err(|e| PipelineError::Plan(e.to_string()))?;
                    let [cond, uncond, ..] = replicas.as_slice() else {
                        return Err(PipelineError::Refused(format!("--cfg-parallel runs the unconditional pass on the plan's second replica, and {} has {}: make one with `mold plan ... --objective throughput` (two replicas), or drop --cfg-parallel", o.plan_file.display(), if replicas.len() == 1 { "one".to_string() } else { replicas.len().to_string() })));
                    };
                    crate::qwen::generate_on(cond, Some(uncond), &prep, &q, opts, &mut on_p)?
                } else {
                    crate::qwen::generate(run_plan, &prep, &q, opts, &mut on_p)?
                }
            }
            Family::Flux(_) => {
                let mut prep = crate::flux::prepare(run_plan, weights)?;
                add_loras(&mut prep.ckpt, &o.loras, on)?;
                // `prepare` opened and checked the checkpoint; only the header comparison
                // is left.
                if let Some(w) = run::header_warning(self.plan, &prep.layout.transformer)? {
                    on(Event::Warning(&w));
                }
                let mut on_p = progress(&mut recorder, on);
                crate::flux::generate(run_plan, &prep, &req, opts, &mut on_p)?
            }
        };
        Ok(ImageDone { output, recorder })
    }

    /// `--report`: the run report of `done` (`None` when it was run without `report`),
    /// with the allocator's error, if any, as a warning to tell.
    pub fn report(&self, done: ImageDone) -> Option<(RunReport, Option<String>)> {
        let ImageDone { output, recorder } = done;
        Some(recorder?.finish(ReportInputs {
            plan: self.plan,
            run_plan: &self.run_plan,
            sim: &self.sim,
            machine_profile: &self.machine_profile,
            timings: Some(&output.timings),
            predicted_peaks: self.predicted.peaks.clone(),
            accounted_peaks: output.peaks.clone(),
        }))
    }
}

/// The pipeline's progress told to `on` and, with `--report`, recorded.
fn progress<'r>(
    recorder: &'r mut Option<Recorder>,
    on: &'r mut dyn FnMut(Event),
) -> impl FnMut(&Progress) + 'r {
    move |p: &Progress| {
        on(Event::Progress(p));
        if let Some(r) = recorder.as_mut() {
            r.progress(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// flux-tiny on four emulated devices (64x64, 4 steps), its model and machine.
    fn flux_tiny() -> (Plan, ModelSpec, Machine) {
        let plan = Plan::load(&root().join("plans/flux-tiny@cpu-emu-4.yaml")).unwrap();
        let model = mold_models::find("flux-tiny").unwrap();
        let machine = Machine::load(&root().join("sim/machines/cpu-emu-4.yaml")).unwrap();
        (plan, model, machine)
    }

    fn refusal(r: Result<impl std::fmt::Debug>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn the_size_is_refused_before_the_steps_and_zero_steps_before_the_machine() {
        let (plan, ..) = flux_tiny();
        let o = ImageOptions {
            width: Some(1000),
            steps: Some(0),
            ..Default::default()
        };
        let e = refusal(ImageRun::new(&plan, &o));
        assert!(e.contains("width 1000"), "{e}");
        let o = ImageOptions {
            steps: Some(0),
            ..Default::default()
        };
        let e = refusal(ImageRun::new(&plan, &o));
        assert!(e.contains("0 steps: pass --steps N"), "{e}");
    }

    #[test]
    fn flux_refuses_true_cfg_and_qwen_image_refuses_distilled_guidance() {
        let (plan, model, machine) = flux_tiny();
        let o = ImageOptions {
            negative_prompt: Some("blurry".into()),
            ..Default::default()
        };
        let e = refusal(ImageRun::new(&plan, &o).unwrap().check(&model, &machine));
        assert!(
            e.contains("Qwen-Image's true CFG; FLUX models take --guidance"),
            "{e}"
        );

        let mut qwen = plan.clone();
        qwen.model.id = "qwen-image-tiny".into();
        let qwen_model = mold_models::find("qwen-image-tiny").unwrap();
        for (o, want) in [
            (
                ImageOptions {
                    guidance: Some(3.5),
                    ..Default::default()
                },
                "--guidance is FLUX's distilled guidance",
            ),
            (
                ImageOptions {
                    cfg: Some(0.5),
                    ..Default::default()
                },
                "--cfg 0.5: the true-CFG scale is a number >= 1",
            ),
        ] {
            let e = refusal(
                ImageRun::new(&qwen, &o)
                    .unwrap()
                    .check(&qwen_model, &machine),
            );
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn another_size_runs_with_the_simulator_s_predictions_and_says_so() {
        let (plan, model, machine) = flux_tiny();
        let same = ImageOptions::default();
        let c = ImageRun::new(&plan, &same)
            .unwrap()
            .check(&model, &machine)
            .unwrap();
        assert_eq!((c.note.is_none(), c.predicted.source), (true, "plan"));
        assert_eq!(c.steps(), plan.workload.steps);

        let other = ImageOptions {
            width: Some(96),
            steps: Some(2),
            ..Default::default()
        };
        let c = ImageRun::new(&plan, &other)
            .unwrap()
            .check(&model, &machine)
            .unwrap();
        let note = c.note.as_deref().unwrap();
        assert!(
            note.starts_with("96x64 differs from the plan's 64x64"),
            "{note}"
        );
        assert_eq!(c.predicted.source, "sim");
        assert_eq!(c.predicted.step_s, c.sim.step_s);
        let w = &c.run_plan.workload;
        assert_eq!((w.width, w.height, w.steps), (96, 64, 2));
    }
}
