//! `mold-pipeline`: text to image around the executor, each component where a
//! [`mold_plan::Plan`] places it, and the sequence of a `mold exec` run.
//!
//! - A model family is one folder: [`flux`] (T5, CLIP, the FLUX sampler, the stages a
//!   request runs through, test data) and [`qwen`] (Qwen2.5-VL, its VAE, the true-CFG
//!   sampler, test data). A new family is a new folder beside them.
//! - Shared by the families: this file's request, progress and output types and the
//!   placement of a component ([`placement`]); [`sampling`] (sizes, seeded noise, 2×2
//!   patch packing, the one denoising loop); [`text`] (tokenizing, weight accounting);
//!   [`io`] (`--latents`, `--save-io`); [`image`] (PNG); [`run`] (the checks before any
//!   run, the transformer benchmark); [`session`] (a `mold exec` run from resolved options
//!   to its outcome: the binary parses, calls it and prints); [`report`] (the measured
//!   side of `--report`); [`calibrate`].
//!
//! A component placed on `host` runs on the CPU; `emu:N` devices are the CPU too, so
//! every plan runs in CI. Memory figures are *accounted* from tensor shapes (weights held,
//! conditioning, the transformer's largest activation as exec meters it, encoder and VAE
//! outputs), not allocator peaks.

pub mod calibrate;
pub mod encoders;
pub mod error;
pub mod flux;
pub mod image;
pub mod io;
pub mod layout;
pub mod nhwc;
pub mod qwen;
pub mod report;
pub mod run;
pub mod sampling;
pub mod session;
pub mod text;

pub use error::{PipelineError, Result};
pub use image::{encode_png, read_png, write_png, RgbImage};
pub use layout::WeightsLayout;
pub use sampling::check_size;

use candle_core::{DType, Device, Tensor};
use mold_plan::{DeviceId, Plan};
use std::collections::BTreeMap;

/// What to generate.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    pub prompt: String,
    pub seed: u64,
    pub steps: u32,
    /// Distilled guidance (FLUX dev); ignored by models without a guidance embedder.
    pub guidance: Option<f64>,
    pub width: u32,
    pub height: u32,
    /// The initial noise from this file instead of the seed ([`io::read_latents`]).
    pub latents: Option<std::path::PathBuf>,
    /// Write the run's inputs and outputs to this file ([`io`] names them).
    pub save_io: Option<std::path::PathBuf>,
    /// No digests in the progress events (a server that reports none): each is the values
    /// copied to the host and hashed there, about a millisecond per megabyte, between the
    /// steps and around the encoders and the decoder.
    pub no_digests: bool,
}

/// The digest of `t`'s values ([`mold_exec::digest`]) where `take`: the events of a
/// request without digests ([`Request::no_digests`]) carry none.
pub(crate) fn digest_if(take: bool, t: &candle_core::Tensor) -> Result<Option<u64>> {
    if take {
        Ok(Some(mold_exec::digest(t)?))
    } else {
        Ok(None)
    }
}

/// Progress, reported as the pipeline goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    Loading {
        component: String,
        devices: String,
    },
    Loaded {
        component: String,
        devices: String,
        seconds: f64,
        weight_bytes: u64,
    },
    Encoded {
        component: String,
        seconds: f64,
        /// FNV-1a of the encoder's output values ([`mold_exec::digest`]): equal digests,
        /// equal conditioning, so runs can be compared stage by stage. `None` with
        /// [`Request::no_digests`].
        digest: Option<u64>,
    },
    Released {
        component: String,
    },
    Step {
        index: u32,
        steps: u32,
        t: f64,
        seconds: f64,
        /// Digest of the latents after this step (`None` with [`Request::no_digests`]).
        digest: Option<u64>,
    },
    Decoded {
        /// The devices the VAE decoded on (its bands' devices, comma-separated).
        devices: String,
        seconds: f64,
        /// Digests of the final latents and of the decoded image's values (`None` with
        /// [`Request::no_digests`]).
        latents_digest: Option<u64>,
        image_digest: Option<u64>,
    },
    Note(String),
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        match self {
            Progress::Loading { component, devices } => {
                write!(f, "load   {component} on {devices} ...")
            }
            Progress::Loaded {
                component,
                devices,
                seconds,
                weight_bytes,
            } => write!(
                f,
                "load   {component} on {devices}: {:.1} MiB of weights in {seconds:.2} s",
                mib(*weight_bytes)
            ),
            Progress::Encoded {
                component,
                seconds,
                digest,
            } => match digest {
                Some(d) => write!(f, "encode {component}: {seconds:.3} s (digest {d:016x})"),
                None => write!(f, "encode {component}: {seconds:.3} s"),
            },
            Progress::Released { component } => write!(f, "free   {component}"),
            Progress::Step {
                index,
                steps,
                t,
                seconds,
                digest,
            } => {
                write!(f, "step   {index:>3}/{steps} (t = {t:.3}): {seconds:.3} s")?;
                match digest {
                    Some(d) => write!(f, " (latents digest {d:016x})"),
                    None => Ok(()),
                }
            }
            Progress::Decoded {
                devices,
                seconds,
                latents_digest,
                image_digest,
            } => {
                write!(f, "decode vae on {devices}: {seconds:.3} s")?;
                match (latents_digest, image_digest) {
                    (Some(l), Some(i)) => {
                        write!(f, " (latents digest {l:016x}, image digest {i:016x})")
                    }
                    _ => Ok(()),
                }
            }
            Progress::Note(n) => write!(f, "note: {n}"),
        }
    }
}

/// Seconds per stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// All weight loading (encoders, transformer, VAE).
    pub load_s: f64,
    pub encode_s: f64,
    pub denoise_s: f64,
    pub decode_s: f64,
    pub total_s: f64,
    pub step_s: Vec<f64>,
}

/// Accounted peak memory of one device over the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePeak {
    pub device: DeviceId,
    pub peak_bytes: u64,
}

/// A generated image and how it went.
#[derive(Clone, Debug)]
pub struct Output {
    pub image: RgbImage,
    pub timings: Timings,
    /// Devices in id order (`cuda:N`, `emu:N`, then `host`).
    pub peaks: Vec<DevicePeak>,
    /// The PNG's tEXt chunks.
    pub metadata: Vec<(String, String)>,
}

/// The one device and dtype of a whole component (`t5`, `clip`, `vae`).
pub fn placement(plan: &Plan, name: &str) -> Result<(DeviceId, mold_plan::DType)> {
    let c = plan
        .components
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            PipelineError::Plan(format!(
                "no `{name}` component: the pipeline places t5, clip, transformer and vae; regenerate the plan with `mold plan`"
            ))
        })?;
    let devices: Vec<&DeviceId> = c.parts.iter().flat_map(|p| &p.devices).collect();
    match devices.as_slice() {
        [d] => Ok(((*d).clone(), c.dtype)),
        [] => Err(PipelineError::Plan(format!("`{name}` names no device"))),
        many => Err(PipelineError::Plan(format!(
            "`{name}` is spread over {} devices ({}): the pipeline runs text encoders and the VAE whole on one device; pin it to one (e.g. --pin {name}={})",
            many.len(),
            many.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
            many[0]
        ))),
    }
}

/// The devices the VAE decodes on, in band order, and its dtype: one device, or several
/// (`sp` of them, one row band each: [`crate::flux::vae_bands`]).
pub fn vae_devices(plan: &Plan) -> Result<(Vec<DeviceId>, mold_plan::DType)> {
    let c = plan
        .components
        .iter()
        .find(|c| c.name == "vae")
        .ok_or_else(|| {
            PipelineError::Plan(
                "no `vae` component: the pipeline places t5, clip, transformer and vae; regenerate the plan with `mold plan`".into(),
            )
        })?;
    match c.parts.as_slice() {
        [p] if !p.devices.is_empty()
            && (p.devices.len() == 1 || p.sp as usize == p.devices.len()) =>
        {
            Ok((p.devices.clone(), c.dtype))
        }
        _ => placement(plan, "vae").map(|(d, t)| (vec![d], t)),
    }
}

/// The compute dtype of a component; T5 asked for fp16 computes in bf16 (T5's
/// activations overflow fp16 and candle's T5 has no clamp; bf16 is the same size).
fn component_dtype(name: &str, d: mold_plan::DType) -> Result<(DType, Option<String>)> {
    let dt = mold_exec::compute_dtype(d).map_err(|_| {
        PipelineError::Plan(format!(
            "`{name}` has dtype {d}: the pipeline runs f32, bf16 and fp16 components; re-plan with --dtype {name}=bf16"
        ))
    })?;
    if name == "t5" && dt == DType::F16 {
        return Ok((
            DType::BF16,
            Some(
                "t5 is planned in fp16; it computes in bf16 (same size: fp16 overflows in T5)"
                    .into(),
            ),
        ));
    }
    Ok((dt, None))
}

/// The dtype a component planned in `dt` computes in on `dev`: candle's CPU matrix
/// products have no bf16, so on a CPU device (the host, an emulated device) bf16 widens
/// to f32.
pub(crate) fn on_device_dtype(dt: DType, dev: &Device) -> DType {
    if dev.is_cpu() && dt == DType::BF16 {
        DType::F32
    } else {
        dt
    }
}

/// Accounted bytes per device: current and peak.
#[derive(Clone, Default)]
pub(crate) struct Mem {
    cur: BTreeMap<DeviceId, u64>,
    peak: BTreeMap<DeviceId, u64>,
}

impl Mem {
    fn add(&mut self, d: &DeviceId, b: u64) {
        let c = self.cur.entry(d.clone()).or_default();
        *c += b;
        let c = *c;
        let p = self.peak.entry(d.clone()).or_default();
        *p = (*p).max(c);
    }
    fn sub(&mut self, d: &DeviceId, b: u64) {
        let c = self.cur.entry(d.clone()).or_default();
        *c = c.saturating_sub(b);
    }
    /// Something live for a moment on top of what is held.
    fn spike(&mut self, d: &DeviceId, b: u64) {
        self.add(d, b);
        self.sub(d, b);
    }
}

fn bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Device ids as a progress line names them: `cuda:0, cuda:1`.
pub(crate) fn device_list(ids: &[DeviceId]) -> String {
    ids.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn sync(d: &Device) -> Result<()> {
    Ok(d.synchronize()?)
}
