//! `mold-pipeline`: FLUX text to image, each component where a [`mold_plan::Plan`]
//! places it.
//!
//! 1. **Check** ([`prepare`]): the weights directory holds every file
//!    ([`WeightsLayout::locate`] lists all that are missing), the transformer checkpoint
//!    matches the model (headers only), the encoder and autoencoder configs fit the
//!    transformer, and every component has a device and a dtype exec can run. Nothing
//!    is loaded.
//! 2. **Encode**: T5 on its device, then CLIP on its device (candle-transformers'
//!    models, tokenizers from `tokenizer.json`); each encoder is released right after it
//!    has encoded; the conditioning moves to the transformer's first devices.
//! 3. **Denoise**: seeded noise, 2×2 patch packing, rectified-flow Euler steps over the
//!    (for dev, resolution-shifted) schedule, the transformer run by
//!    [`mold_exec::Executor`] over the plan's parts (block split, tensor parallel,
//!    streamed), with the distilled guidance for guidance-distilled models.
//! 4. **Decode**: the FLUX autoencoder's decoder on its device, then RGB bytes, then a
//!    PNG with the prompt and settings as tEXt chunks ([`write_png`]).
//!
//! A component placed on `host` runs on the CPU; `emu:N` devices are the CPU too, so
//! every plan runs in CI. Memory figures are *accounted* from tensor shapes (weights held,
//! conditioning, the transformer's largest activation as exec meters it, encoder and VAE
//! outputs), not allocator peaks.

pub mod calibrate;
pub mod error;
pub mod image;
pub mod io;
pub mod layout;
pub mod qwen;
pub mod qwen_sampling;
pub mod qwen_testdata;
pub mod qwen_text;
pub mod qwen_vae;
pub mod report;
pub mod resident;
pub mod run;
pub mod sampling;
pub mod testdata;
pub mod text;
pub mod vae;

pub use error::{PipelineError, Result};
pub use image::{encode_png, read_png, write_png, RgbImage};
pub use layout::WeightsLayout;
pub use resident::{Decoder, Denoiser, Job, Resident, TextEncoder};
pub use sampling::check_size;

use candle_core::{DType, Device, Tensor};
use mold_exec::runtime::DeviceMap;
use mold_exec::{Checkpoint, FluxConfig};
use mold_plan::{DeviceId, Plan};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;

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
        /// equal conditioning, so runs can be compared stage by stage.
        digest: u64,
    },
    Released {
        component: String,
    },
    Step {
        index: u32,
        steps: u32,
        t: f64,
        seconds: f64,
        /// Digest of the latents after this step.
        digest: u64,
    },
    Decoded {
        seconds: f64,
        /// Digests of the final latents and of the decoded image's values.
        latents_digest: u64,
        image_digest: u64,
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
            } => {
                write!(f, "encode {component}: {seconds:.3} s (digest {digest:016x})")
            }
            Progress::Released { component } => write!(f, "free   {component}"),
            Progress::Step {
                index,
                steps,
                t,
                seconds,
                digest,
            } => write!(
                f,
                "step   {index:>3}/{steps} (t = {t:.3}): {seconds:.3} s (latents digest {digest:016x})"
            ),
            Progress::Decoded {
                seconds,
                latents_digest,
                image_digest,
            } => write!(
                f,
                "decode vae: {seconds:.3} s (latents digest {latents_digest:016x}, image digest {image_digest:016x})"
            ),
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

/// Everything checked before loading.
pub struct Prepared {
    pub flux: FluxConfig,
    pub layout: WeightsLayout,
    pub ckpt: Checkpoint,
    /// T5 tokens (512 dev, 256 schnell, 8 flux-tiny).
    pub t5_tokens: usize,
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

/// Checks the plan against the weights directory without loading anything: files,
/// transformer tensors (from headers), encoder/VAE configs against the transformer,
/// component placement and dtypes.
pub fn prepare(plan: &Plan, weights: &Path) -> Result<Prepared> {
    let id = &plan.model.id;
    let flux = FluxConfig::by_name(id).ok_or_else(|| {
        PipelineError::Plan(format!(
            "model `{id}`: the text-to-image pipeline runs FLUX models (flux-dev, flux-schnell, flux-tiny)"
        ))
    })?;
    let t5_tokens = mold_models::find(id)
        .map(|m| m.text_tokens as usize)
        .map_err(|e| PipelineError::Plan(e.to_string()))?;
    for name in ["t5", "clip", "vae"] {
        let (_, d) = placement(plan, name)?;
        component_dtype(name, d)?;
    }
    if plan.transformer().is_none() {
        return Err(PipelineError::Plan(
            "no transformer component: regenerate the plan with `mold plan`".into(),
        ));
    }
    mold_exec::check_plan(&flux, plan)?;
    let layout = WeightsLayout::locate(weights, id)?;
    let ckpt = Checkpoint::open(&layout.transformer)?;
    ckpt.check(&flux, id)?;
    let t5 = text::t5_config(&layout.t5)?;
    if t5.d_model != flux.context_in_dim {
        return Err(PipelineError::Config {
            path: layout.t5.config.display().to_string(),
            message: format!(
                "d_model {} but the transformer takes T5 tokens of width {} (context_in_dim): use the T5 that goes with this model",
                t5.d_model, flux.context_in_dim
            ),
        });
    }
    let clip = text::clip_config(&layout.clip)?;
    if clip.embed_dim != flux.vec_in_dim {
        return Err(PipelineError::Config {
            path: layout.clip.config.display().to_string(),
            message: format!(
                "hidden_size {} but the transformer takes a pooled vector of width {} (vec_in_dim): use the CLIP that goes with this model",
                clip.embed_dim, flux.vec_in_dim
            ),
        });
    }
    let ae = vae::AeConfig::for_layout(&layout)?;
    if ae.z_channels * 4 != flux.in_channels {
        return Err(PipelineError::Config {
            path: layout.ae.display().to_string(),
            message: format!(
                "{} latent channels, but the transformer takes 2x2 patches of {} channels",
                ae.z_channels,
                flux.in_channels / 4
            ),
        });
    }
    Ok(Prepared {
        flux,
        layout,
        ckpt,
        t5_tokens,
    })
}

/// The PNG tEXt chunks for a request: the prompt and every setting that determines the
/// image (nothing about the placement, which does not change it).
pub fn metadata(model_id: &str, req: &Request, guidance: Option<f64>) -> Vec<(String, String)> {
    let mut m = vec![
        ("prompt".to_string(), req.prompt.clone()),
        ("model".to_string(), model_id.to_string()),
        ("seed".to_string(), req.seed.to_string()),
        ("steps".to_string(), req.steps.to_string()),
    ];
    if let Some(g) = guidance {
        m.push(("guidance".to_string(), g.to_string()));
    }
    m.push(("width".to_string(), req.width.to_string()));
    m.push(("height".to_string(), req.height.to_string()));
    m.push((
        "sampler".to_string(),
        "rectified-flow euler (mold)".to_string(),
    ));
    m.push((
        "Software".to_string(),
        format!("mold {}", env!("CARGO_PKG_VERSION")),
    ));
    m
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

fn sync(d: &Device) -> Result<()> {
    Ok(d.synchronize()?)
}

/// Runs the whole pipeline for `req`, the transformer with `opts`; `on` sees progress as
/// it happens. Each component is loaded for this one request and released as soon as it
/// is done (an encoder before the next loads, the transformer before the VAE);
/// [`Resident`] keeps them loaded instead. Both run the stages of [`resident::Job`].
pub fn generate(
    plan: &Plan,
    prep: &Prepared,
    req: &Request,
    opts: &mold_exec::ExecOptions,
    on: &mut dyn FnMut(&Progress),
) -> Result<Output> {
    let never = AtomicBool::new(false);
    let mut job = Job::begin(plan, &prep.flux, req, on)?;
    let mut devmap = DeviceMap::default();
    let target = resident::Target::of(plan, &mut devmap)?;

    // Encode, one encoder at a time: load, encode, release.
    for name in resident::ENCODERS {
        let (id, _) = placement(plan, name)?;
        let enc = TextEncoder::load(plan, prep, name, &id, &mut devmap, on)?;
        job.add_load_s(enc.load_s());
        job.hold(&id, enc.weight_bytes(), true);
        job.encode(&enc, Some(&target), &never, on)?;
        job.hold(&id, enc.weight_bytes(), false);
        drop(enc);
        on(&Progress::Released {
            component: name.into(),
        });
    }

    // The transformer, on the plan's parts.
    let den = Denoiser::load(plan, prep, opts, &mut devmap, on)?;
    job.add_load_s(den.load_s());
    let latents = job.denoise(&den, false, &never, on)?;
    drop(den);
    on(&Progress::Released {
        component: "transformer".into(),
    });

    // Decode.
    let (id, _) = placement(plan, "vae")?;
    let dec = Decoder::load(plan, prep, &id, &mut devmap, on)?;
    job.add_load_s(dec.load_s());
    job.hold(&id, dec.weight_bytes(), true);
    job.decode(&dec, latents, &target, &never, on)
}
