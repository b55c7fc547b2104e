//! Qwen-Image's sampler: diffusers' `FlowMatchEulerDiscreteScheduler` as the published
//! `scheduler/scheduler_config.json` sets it (dynamic, resolution-dependent shift;
//! stretched to a terminal sigma), and true classifier-free guidance with the
//! reference pipeline's norm-preserving combination.
//!
//! - Sigmas: `linspace(1, 1/N, N)`; `mu` linear in the image's token count from
//!   `base_shift` at `base_image_seq_len` to `max_shift` at `max_image_seq_len`; each
//!   sigma shifted `e^mu / (e^mu + (1/σ − 1))` (exponential) or `mu / (mu + (1/σ − 1))`
//!   (linear); then, with `shift_terminal`, stretched so the last one is it; then 0
//!   appended. The transformer sees `σ` as its time (`timestep / 1000`).
//! - Euler: `x ← x + (σ_next − σ) · v`, in the latents' dtype ([`crate::sampling`]'s
//!   one loop does the same for a single pass).
//! - True CFG: `c = v_neg + s · (v_cond − v_neg)`, rescaled token by token to the
//!   conditional prediction's norm: `v = c · ‖v_cond‖ / ‖c‖` (norms over the channels).
//!   The two passes of a step run as the plan's CFG mode says ([`Passes`]): one after
//!   the other, on two device groups at once (CFG-parallel), or as two micro-batches
//!   through the stages of a block split (pipelined); all three give the same latents.

use crate::error::{PipelineError, Result};
use candle_core::{DType, Tensor, D};
use serde::Deserialize;
use std::path::Path;

/// `scheduler/scheduler_config.json` (the fields the schedule depends on; the defaults
/// are Qwen-Image's published values).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct SchedulerConfig {
    #[serde(default = "d_base_len")]
    pub base_image_seq_len: f64,
    #[serde(default = "d_max_len")]
    pub max_image_seq_len: f64,
    #[serde(default = "d_base_shift")]
    pub base_shift: f64,
    #[serde(default = "d_max_shift")]
    pub max_shift: f64,
    #[serde(default = "d_terminal")]
    pub shift_terminal: Option<f64>,
    #[serde(default = "d_shift_type")]
    pub time_shift_type: String,
    #[serde(default = "d_true")]
    pub use_dynamic_shifting: bool,
    #[serde(default = "d_one")]
    pub shift: f64,
    #[serde(default)]
    pub use_karras_sigmas: bool,
    #[serde(default)]
    pub use_exponential_sigmas: bool,
    #[serde(default)]
    pub use_beta_sigmas: bool,
    #[serde(default)]
    pub invert_sigmas: bool,
    #[serde(default)]
    pub stochastic_sampling: bool,
}

fn d_base_len() -> f64 {
    256.0
}
fn d_max_len() -> f64 {
    8192.0
}
fn d_base_shift() -> f64 {
    0.5
}
fn d_max_shift() -> f64 {
    0.9
}
fn d_terminal() -> Option<f64> {
    Some(0.02)
}
fn d_shift_type() -> String {
    "exponential".into()
}
fn d_true() -> bool {
    true
}
fn d_one() -> f64 {
    1.0
}

impl SchedulerConfig {
    /// Qwen-Image's published scheduler.
    pub fn qwen_image() -> SchedulerConfig {
        serde_json::from_value(serde_json::json!({})).expect("defaults")
    }

    /// Reads and checks `scheduler_config.json`.
    pub fn read(path: &Path) -> Result<SchedulerConfig> {
        let text = std::fs::read_to_string(path).map_err(PipelineError::io(path))?;
        let c: SchedulerConfig =
            serde_json::from_str(&text).map_err(|e| PipelineError::Config {
                path: path.display().to_string(),
                message: format!("not a FlowMatchEulerDiscreteScheduler config: {e}"),
            })?;
        c.check().map_err(|message| PipelineError::Config {
            path: path.display().to_string(),
            message,
        })?;
        Ok(c)
    }

    fn check(&self) -> std::result::Result<(), String> {
        for (name, on) in [
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
            ("invert_sigmas", self.invert_sigmas),
            ("stochastic_sampling", self.stochastic_sampling),
        ] {
            if on {
                return Err(format!(
                    "{name} is true: mold's Qwen-Image sampler is the deterministic Euler one of the published config; set it to false"
                ));
            }
        }
        if !matches!(self.time_shift_type.as_str(), "exponential" | "linear") {
            return Err(format!(
                "time_shift_type `{}`: use exponential or linear",
                self.time_shift_type
            ));
        }
        if self.use_dynamic_shifting && self.max_image_seq_len == self.base_image_seq_len {
            return Err(
                "base_image_seq_len equals max_image_seq_len: the shift cannot interpolate".into(),
            );
        }
        if let Some(t) = self.shift_terminal {
            if !(0.0..1.0).contains(&t) {
                return Err(format!("shift_terminal {t} must be in [0, 1)"));
            }
        }
        if !(self.shift.is_finite() && self.shift > 0.0) {
            return Err(format!("shift {} must be positive", self.shift));
        }
        Ok(())
    }

    /// The resolution-dependent shift for `image_tokens` latent tokens
    /// (`calculate_shift`).
    pub fn mu(&self, image_tokens: usize) -> f64 {
        let m =
            (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len);
        let b = self.base_shift - m * self.base_image_seq_len;
        image_tokens as f64 * m + b
    }

    /// The `steps + 1` sigmas from about 1 down to 0 for an image of `image_tokens`
    /// latent tokens.
    pub fn sigmas(&self, steps: u32, image_tokens: usize) -> Vec<f64> {
        let n = steps.max(1) as usize;
        let lin: Vec<f64> = (0..n)
            .map(|i| {
                let end = 1.0 / n as f64;
                if n == 1 {
                    1.0
                } else {
                    1.0 + (end - 1.0) * i as f64 / (n - 1) as f64
                }
            })
            .collect();
        let mu = self.mu(image_tokens);
        let mut s: Vec<f64> = lin
            .iter()
            .map(|&t| {
                if self.use_dynamic_shifting {
                    match self.time_shift_type.as_str() {
                        "linear" => mu / (mu + (1.0 / t - 1.0)),
                        _ => mu.exp() / (mu.exp() + (1.0 / t - 1.0)),
                    }
                } else {
                    self.shift * t / (1.0 + (self.shift - 1.0) * t)
                }
            })
            .collect();
        if let Some(term) = self.shift_terminal.filter(|t| *t > 0.0) {
            let last = 1.0 - s[n - 1];
            let scale = last / (1.0 - term);
            if scale > 0.0 {
                for v in &mut s {
                    *v = 1.0 - (1.0 - *v) / scale;
                }
            }
        }
        s.push(0.0);
        s
    }
}

/// True CFG's combination of one step's conditional and unconditional predictions
/// `(b, tokens, channels)`: `c = neg + scale · (cond − neg)`, then `c · ‖cond‖ / ‖c‖`
/// per token (norms over the channels), in f32.
pub fn combine(cond: &Tensor, neg: &Tensor, scale: f64) -> Result<Tensor> {
    let cond = cond.to_dtype(DType::F32)?;
    // The denoising loops move it to `cond`'s device first, with the run's peer setting;
    // a caller's tensor elsewhere moves by peer copy where the GPUs allow.
    let neg =
        mold_exec::runtime::hand_off_ordered(&neg.to_dtype(DType::F32)?, cond.device(), true)?;
    let comb = (&neg + ((&cond - &neg)? * scale)?)?;
    let norm =
        |t: &Tensor| -> candle_core::Result<Tensor> { t.sqr()?.sum_keepdim(D::Minus1)?.sqrt() };
    let ratio = norm(&cond)?.broadcast_div(&norm(&comb)?)?;
    Ok(comb.broadcast_mul(&ratio)?)
}

/// True CFG's second pass: the negative prompt's conditioning and the guidance scale.
pub struct Guidance {
    /// The negative prompt's text-encoder output, where the conditional one is.
    pub txt: Tensor,
    pub scale: f64,
}

/// Where a step's transformer passes run: serially, CFG-parallel or pipelined
/// ([`crate::sampling::Passes`]).
pub type Passes<'a> = crate::sampling::Passes<'a, mold_exec::QwenConfig>;

/// The Qwen-Image denoising loop: over `sigmas`, the transformer on `inputs` (the
/// conditional pass) and, with `guidance`, on the same latents with the negative
/// conditioning (on `passes`: serially, or CFG-parallel on a second device group), the
/// two predictions combined ([`combine`]); then the Euler step in the latents' dtype.
/// Each step waits for the device before reading the clock; `on_step` sees it (with the
/// latents' digest where `digests`), and `before` each step's input (for `--save-io`).
#[allow(clippy::too_many_arguments)]
pub fn denoise(
    passes: &Passes,
    inputs: &mut mold_exec::QwenInputs,
    guidance: Option<&Guidance>,
    sigmas: &[f64],
    digests: bool,
    before: &mut dyn FnMut(usize, &Tensor, f64) -> Result<()>,
    on_step: &mut dyn FnMut(crate::sampling::StepTime),
) -> Result<()> {
    use mold_exec::Inputs;
    let mut neg = guidance.map(|g| mold_exec::QwenInputs {
        txt: g.txt.clone(),
        ..inputs.clone()
    });
    for (index, w) in sigmas.windows(2).enumerate() {
        let (t, t_next) = (w[0], w[1]);
        before(index, &inputs.img, t)?;
        let start = std::time::Instant::now();
        inputs.set_time(t)?;
        if let Some(n) = &mut neg {
            n.img = inputs.img.clone();
            n.set_time(t)?;
        }
        // The executors read the inputs from their rank threads (other streams on
        // GPUs): finish what this thread queued first.
        inputs.latents().device().synchronize()?;
        let x = inputs.latents().clone();
        let peer = passes.cond().options().peer_copies;
        let v = match crate::sampling::predict(passes, inputs, neg.as_ref())? {
            (v, Some(vn)) => {
                // CFG-parallel: the unconditional prediction comes from another GPU.
                let vn = mold_exec::runtime::hand_off_ordered(&vn, v.device(), peer)?;
                combine(&v, &vn, guidance.map_or(1.0, |g| g.scale))?
            }
            (v, None) => v,
        };
        let v = mold_exec::runtime::hand_off_ordered(&v, x.device(), peer)?.to_dtype(x.dtype())?;
        let next = (&x + v.affine(t_next - t, 0.0)?)?;
        next.device().synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        let digest = crate::digest_if(digests, &next)?;
        inputs.set_latents(next);
        on_step(crate::sampling::StepTime {
            index,
            t,
            seconds,
            digest,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use proptest::prelude::*;

    /// diffusers' schedule for the published config, 4 steps at 1024×1024 (4096 tokens):
    /// linspace, exponential shift by mu, stretch to 0.02, then 0.
    #[test]
    fn published_schedule() {
        let c = SchedulerConfig::qwen_image();
        let s = c.sigmas(4, 4096);
        assert_eq!(s.len(), 5);
        assert_eq!(s[4], 0.0);
        let mu = 0.5 + (0.9 - 0.5) / (8192.0 - 256.0) * (4096.0 - 256.0);
        assert!((c.mu(4096) - mu).abs() < 1e-12);
        let shift = |t: f64| mu.exp() / (mu.exp() + 1.0 / t - 1.0);
        let raw: Vec<f64> = [1.0, 0.75, 0.5, 0.25].iter().map(|&t| shift(t)).collect();
        let scale = (1.0 - raw[3]) / 0.98;
        for i in 0..4 {
            let want = 1.0 - (1.0 - raw[i]) / scale;
            assert!((s[i] - want).abs() < 1e-12, "{i}: {} vs {want}", s[i]);
        }
        assert!((s[0] - 1.0).abs() < 1e-12);
        assert!((s[3] - 0.02).abs() < 1e-12);
    }

    #[test]
    fn refusals_name_the_field() {
        let c: SchedulerConfig =
            serde_json::from_value(serde_json::json!({"use_karras_sigmas": true})).unwrap();
        assert!(c
            .check()
            .unwrap_err()
            .starts_with("use_karras_sigmas is true"));
        let c: SchedulerConfig =
            serde_json::from_value(serde_json::json!({"time_shift_type": "cosine"})).unwrap();
        assert!(c.check().unwrap_err().contains("time_shift_type `cosine`"));
    }

    /// CFG-parallel (the two passes at once on two devices, each holding the whole
    /// transformer) gives the latents of the serial loop on one device.
    #[test]
    fn cfg_parallel_equals_serial() {
        use mold_exec::{Executor, QwenConfig};
        use mold_plan::DeviceId;
        let dir = std::env::temp_dir().join(format!("mold-qwen-cfgpar-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = QwenConfig::qwen_image_tiny();
        mold_exec::model::qwen::testdata::write_testdata(&cfg, &dir, 5, DType::F32, 1 << 30)
            .unwrap();
        let ckpt = mold_exec::Checkpoint::open(
            &dir.join("transformer/diffusion_pytorch_model.safetensors.index.json"),
        )
        .unwrap();
        let a = Executor::reference(&cfg, &ckpt, &DeviceId::Emu(0), DType::F32).unwrap();
        let b = Executor::reference(&cfg, &ckpt, &DeviceId::Emu(1), DType::F32).unwrap();
        let x = mold_exec::model::qwen::random_inputs(&cfg, 64, 32, 5, 1, 3).unwrap();
        let neg = mold_exec::model::qwen::random_inputs(&cfg, 64, 32, 7, 1, 4).unwrap();
        let g = Guidance {
            txt: neg.txt,
            scale: 4.0,
        };
        let sigmas = SchedulerConfig::qwen_image().sigmas(3, 8);
        let run = |p: &Passes, g: Option<&Guidance>| {
            let mut inp = x.clone();
            denoise(
                p,
                &mut inp,
                g,
                &sigmas,
                true,
                &mut |_, _, _| Ok(()),
                &mut |_| {},
            )
            .unwrap();
            inp.img
        };
        let serial = run(&Passes::Serial(&a), Some(&g));
        let par = run(
            &Passes::Parallel {
                cond: &a,
                uncond: &b,
            },
            Some(&g),
        );
        let err = mold_exec::max_relative_error(&serial, &par).unwrap();
        assert!(err <= 1e-6, "{err}");
        // Without guidance the negative pass does not run: another result.
        let plain = run(&Passes::Serial(&a), None);
        assert!(mold_exec::max_relative_error(&serial, &plain).unwrap() > 1e-3);
    }

    /// A plan of qwen-image-tiny's transformer with `parts` (YAML flow sequence).
    fn split_plan(parts: &str) -> mold_plan::Plan {
        let yaml = format!(
            "version: 3
model: {{id: qwen-image-tiny}}
workload: {{width: 32, height: 32, steps: 2, cfg_scale: 4.0}}
machine:
  name: cpu-emu-4
  fingerprint: sha256:70c9ec7dbfc3fc8c
  devices:
  - {{id: emu:0, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:1, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:2, name: emulated device (CPU), memory: 4GiB}}
  - {{id: emu:3, name: emulated device (CPU), memory: 4GiB}}
components:
- {{name: transformer, role: transformer, dtype: f32, parts: {parts}}}
predicted: {{step_time_s: 0.0, request_time_s: 0.0, encode_time_s: 0.0, denoise_time_s: 0.0, decode_time_s: 0.0, devices: [], host_pinned: 0, streamed_per_step: 0}}
solver: {{solver: hand, status: optimal, objective: latency, objective_value: 0.0, strategy: split, solve_time_ms: 0.0}}
"
        );
        mold_plan::Plan::from_yaml(&yaml, "test plan").unwrap()
    }

    /// Pipelined CFG (a step's two passes as two micro-batches through the stages of a
    /// block split) gives the serial loop's latents bit for bit, over 2 and 3 stages,
    /// with a tensor-parallel and a streamed stage.
    #[test]
    fn cfg_pipelined_equals_serial() {
        use mold_exec::{Executor, QwenConfig};
        let dir = std::env::temp_dir().join(format!("mold-qwen-cfgpipe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = QwenConfig::qwen_image_tiny();
        mold_exec::model::qwen::testdata::write_testdata(&cfg, &dir, 5, DType::F32, 1 << 30)
            .unwrap();
        let ckpt = mold_exec::Checkpoint::open(
            &dir.join("transformer/diffusion_pytorch_model.safetensors.index.json"),
        )
        .unwrap();
        let x = mold_exec::model::qwen::random_inputs(&cfg, 64, 32, 5, 1, 3).unwrap();
        let neg = mold_exec::model::qwen::random_inputs(&cfg, 64, 32, 7, 1, 4).unwrap();
        let g = Guidance {
            txt: neg.txt,
            scale: 4.0,
        };
        let sigmas = SchedulerConfig::qwen_image().sigmas(3, 8);
        let run = |p: &Passes| {
            let mut inp = x.clone();
            let mut digests = Vec::new();
            denoise(
                p,
                &mut inp,
                Some(&g),
                &sigmas,
                true,
                &mut |_, _, _| Ok(()),
                &mut |s| digests.push(s.digest),
            )
            .unwrap();
            (inp.img, digests)
        };
        for parts in [
            "[{blocks: [block 0..1], devices: [emu:0], residency: resident}, {blocks: [block 1..3], devices: [emu:1], residency: resident}]",
            "[{blocks: [block 0..1], devices: [emu:0, emu:1], tp: 2, residency: resident}, {blocks: [block 1..2], devices: [emu:2], residency: streamed}, {blocks: [block 2..3], devices: [emu:3], residency: resident}]",
        ] {
            let exec = Executor::new(&cfg, &split_plan(parts), &ckpt).unwrap();
            let (serial, sd) = run(&Passes::Serial(&exec));
            let (pipe, pd) = run(&Passes::Pipelined(&exec));
            assert_eq!(sd, pd, "{parts}: latents digests step by step");
            assert_eq!(
                mold_exec::max_relative_error(&serial, &pipe).unwrap(),
                0.0,
                "{parts}"
            );
            assert_eq!(exec.last_micro_batch_timeline().len(), 2 * exec_parts(parts));
        }
    }

    fn exec_parts(yaml_parts: &str) -> usize {
        yaml_parts.matches("blocks:").count()
    }

    proptest! {
        /// Sigmas fall strictly from 1 to the terminal value, then 0, at any step count
        /// and image size.
        #[test]
        fn sigmas_fall(steps in 2u32..80, tokens in 1usize..20_000) {
            let s = SchedulerConfig::qwen_image().sigmas(steps, tokens);
            prop_assert_eq!(s.len(), steps as usize + 1);
            prop_assert!((s[0] - 1.0).abs() < 1e-9);
            prop_assert!(s.windows(2).all(|w| w[0] > w[1]));
            prop_assert!((s[steps as usize - 1] - 0.02).abs() < 1e-9);
        }

        /// The combination keeps the conditional prediction's norm per token, and at
        /// scale 1 it is the conditional prediction.
        #[test]
        fn cfg_keeps_the_conditional_norm(v in proptest::collection::vec(-3f32..3.0, 16), scale in 1.0f64..8.0) {
            let cond = Tensor::from_vec(v[..8].to_vec(), (1, 2, 4), &Device::Cpu).unwrap();
            let neg = Tensor::from_vec(v[8..].to_vec(), (1, 2, 4), &Device::Cpu).unwrap();
            let out = combine(&cond, &neg, scale).unwrap();
            let n = |t: &Tensor| t.sqr().unwrap().sum(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let comb = (&neg + ((&cond - &neg).unwrap() * scale).unwrap()).unwrap();
            for ((a, b), c) in n(&out).iter().zip(n(&cond)).zip(n(&comb)) {
                if c > 1e-6 {
                    prop_assert!((a - b).abs() <= 1e-4 * b.max(1.0), "{} vs {}", a, b);
                }
            }
            let same = combine(&cond, &neg, 1.0).unwrap();
            let d = (same - &cond).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            prop_assert!(d < 1e-5);
        }
    }
}
