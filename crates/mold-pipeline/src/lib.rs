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

pub mod error;
pub mod image;
pub mod io;
pub mod layout;
pub mod run;
pub mod sampling;
pub mod testdata;
pub mod text;
pub mod vae;

pub use error::{PipelineError, Result};
pub use image::{encode_png, read_png, write_png, RgbImage};
pub use layout::WeightsLayout;
pub use sampling::check_size;

use candle_core::{DType, Device, IndexOp, Tensor};
use mold_exec::runtime::DeviceMap;
use mold_exec::{Checkpoint, Executor, FluxConfig, FluxInputs};
use mold_plan::{DeviceId, Plan};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

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
#[derive(Default)]
struct Mem {
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
/// it happens.
pub fn generate(
    plan: &Plan,
    prep: &Prepared,
    req: &Request,
    opts: &mold_exec::ExecOptions,
    on: &mut dyn FnMut(&Progress),
) -> Result<Output> {
    check_size(req.width, req.height)?;
    if req.steps == 0 {
        return Err(PipelineError::Plan("steps must be at least 1".into()));
    }
    // The given noise is read (and its shape checked) before anything loads.
    let given = req
        .latents
        .as_deref()
        .map(|p| io::read_latents(p, req.width, req.height))
        .transpose()?;
    let mut rec = req.save_io.as_ref().map(|_| io::IoRecord::default());
    let flux = &prep.flux;
    let guidance = if flux.guidance_embed {
        Some(req.guidance.or(plan.workload.guidance).unwrap_or(3.5))
    } else {
        if req.guidance.is_some() {
            on(&Progress::Note(format!(
                "{} has no guidance embedder: --guidance is ignored",
                plan.model.id
            )));
        }
        None
    };
    let total = Instant::now();
    let mut times = Timings::default();
    let mut mem = Mem::default();
    let mut devmap = DeviceMap::default();
    let tf = plan.transformer().expect("checked by prepare");
    let tf_dtype = mold_exec::compute_dtype(tf.dtype)?;
    let first_ids = tf.parts[0].devices.clone();
    let cond_dev = devmap.get(&first_ids[0])?;

    // Encode, one encoder at a time: load, encode, release.
    let mut encoded = Vec::new();
    for name in ["t5", "clip"] {
        let (id, d) = placement(plan, name)?;
        let (dtype, note) = component_dtype(name, d)?;
        if let Some(n) = note {
            on(&Progress::Note(n));
        }
        let dev = devmap.get(&id)?;
        on(&Progress::Loading {
            component: name.into(),
            devices: id.to_string(),
        });
        let t = Instant::now();
        let (out, weight_bytes, load_s, encode_s) = if name == "t5" {
            let mut m = text::T5::load(&prep.layout.t5, prep.t5_tokens, dtype, &dev)?;
            sync(&dev)?;
            let load_s = t.elapsed().as_secs_f64();
            mem.add(&id, m.weight_bytes);
            let t = Instant::now();
            let out = m.encode(&req.prompt)?;
            sync(&dev)?;
            (out, m.weight_bytes, load_s, t.elapsed().as_secs_f64())
        } else {
            let m = text::Clip::load(&prep.layout.clip, dtype, &dev)?;
            sync(&dev)?;
            let load_s = t.elapsed().as_secs_f64();
            mem.add(&id, m.weight_bytes);
            let t = Instant::now();
            let out = m.encode(&req.prompt)?;
            sync(&dev)?;
            (out, m.weight_bytes, load_s, t.elapsed().as_secs_f64())
        };
        times.load_s += load_s;
        times.encode_s += encode_s;
        on(&Progress::Loaded {
            component: name.into(),
            devices: id.to_string(),
            seconds: load_s,
            weight_bytes,
        });
        on(&Progress::Encoded {
            component: name.into(),
            seconds: encode_s,
            digest: mold_exec::digest(&out)?,
        });
        mem.spike(&id, bytes(&out));
        // The encoder is dropped here (end of the branch above); its weights are freed.
        mem.sub(&id, weight_bytes);
        on(&Progress::Released {
            component: name.into(),
        });
        // Conditioning to the transformer's first devices, in its compute dtype.
        let t = Instant::now();
        let out = out.to_device(&cond_dev)?.to_dtype(tf_dtype)?;
        times.encode_s += t.elapsed().as_secs_f64();
        for d in &first_ids {
            mem.add(d, bytes(&out));
        }
        encoded.push(out);
    }
    let y = encoded.pop().expect("clip");
    let txt = encoded.pop().expect("t5");

    // The transformer, on the plan's parts.
    let tf_devices = tf
        .parts
        .iter()
        .flat_map(|p| p.devices.iter().map(|d| d.to_string()))
        .collect::<Vec<_>>();
    let mut seen = std::collections::HashSet::new();
    let tf_devices = tf_devices
        .into_iter()
        .filter(|d| seen.insert(d.clone()))
        .collect::<Vec<_>>()
        .join(", ");
    on(&Progress::Loading {
        component: "transformer".into(),
        devices: tf_devices.clone(),
    });
    let t = Instant::now();
    let exec = Executor::with_options(flux, plan, &prep.ckpt, opts.clone())?;
    let load_s = t.elapsed().as_secs_f64();
    times.load_s += load_s;
    let report = exec.memory_report();
    let tf_weights: u64 = report
        .iter()
        .map(|m| m.resident_weight_bytes + m.host_weight_bytes)
        .sum();
    on(&Progress::Loaded {
        component: "transformer".into(),
        devices: tf_devices,
        seconds: load_s,
        weight_bytes: tf_weights,
    });

    // Denoise.
    let t_denoise = Instant::now();
    let batch = 1;
    let x = match given {
        Some(x) => x,
        None => sampling::pack(&sampling::noise(req.seed, batch, req.width, req.height)?)?,
    };
    let image_tokens = x.dim(1)?;
    let mut inputs = FluxInputs {
        img: x.to_device(&cond_dev)?,
        img_ids: sampling::img_ids(batch, req.width, req.height)?.to_device(&cond_dev)?,
        txt_ids: sampling::txt_ids(batch, txt.dim(1)?)?.to_device(&cond_dev)?,
        txt,
        timesteps: Tensor::zeros(batch, DType::F32, &cond_dev)?,
        y,
        guidance: guidance
            .map(|g| Tensor::full(g as f32, batch, &cond_dev))
            .transpose()?,
    };
    for d in &first_ids {
        mem.add(
            d,
            bytes(&inputs.img) + bytes(&inputs.img_ids) + bytes(&inputs.txt_ids),
        );
    }
    let sched = sampling::schedule(req.steps, image_tokens, flux.guidance_embed);
    let mut on_step = |s: sampling::StepTime| {
        times.step_s.push(s.seconds);
        on(&Progress::Step {
            index: s.index as u32 + 1,
            steps: req.steps,
            t: s.t,
            seconds: s.seconds,
            digest: s.digest,
        });
    };
    match &mut rec {
        None => sampling::denoise(&exec, &mut inputs, &sched, &mut on_step)?,
        Some(r) => {
            io::record_inputs(r, &inputs, &sched)?;
            // The same loop, one step at a time, to keep each step's input.
            for (i, w) in sched.windows(2).enumerate() {
                r.add(format!("step.{i}.latents"), &inputs.img)?;
                r.add(
                    format!("step.{i}.t"),
                    &Tensor::new(&[w[0] as f32], &Device::Cpu)?,
                )?;
                sampling::denoise(&exec, &mut inputs, w, &mut |s| {
                    on_step(sampling::StepTime { index: i, ..s })
                })?;
            }
            r.add("final", &inputs.img)?;
            r.add_velocities(&sched)?;
        }
    }
    times.denoise_s = t_denoise.elapsed().as_secs_f64();
    let report = exec.memory_report();
    for m in &report {
        mem.add(&m.device, m.resident_weight_bytes + m.stream_buffer_bytes);
        mem.add(&DeviceId::Host, m.host_weight_bytes);
    }
    for m in &report {
        mem.spike(&m.device, m.largest_activation_bytes);
    }
    let latents = inputs.img.clone();
    drop(exec);
    for m in &report {
        mem.sub(&m.device, m.resident_weight_bytes + m.stream_buffer_bytes);
        mem.sub(&DeviceId::Host, m.host_weight_bytes);
    }
    on(&Progress::Released {
        component: "transformer".into(),
    });
    for d in &first_ids {
        mem.sub(
            d,
            bytes(&inputs.txt) + bytes(&inputs.y) + bytes(&inputs.img_ids) + bytes(&inputs.txt_ids),
        );
    }
    drop(inputs);

    // Decode.
    let (id, d) = placement(plan, "vae")?;
    let (dtype, _) = component_dtype("vae", d)?;
    let dev = devmap.get(&id)?;
    on(&Progress::Loading {
        component: "vae".into(),
        devices: id.to_string(),
    });
    let t = Instant::now();
    let vae = vae::Vae::load(&prep.layout, dtype, &dev)?;
    sync(&dev)?;
    let load_s = t.elapsed().as_secs_f64();
    times.load_s += load_s;
    mem.add(&id, vae.weight_bytes);
    on(&Progress::Loaded {
        component: "vae".into(),
        devices: id.to_string(),
        seconds: load_s,
        weight_bytes: vae.weight_bytes,
    });
    let t = Instant::now();
    let z = sampling::unpack(&latents, req.width, req.height)?;
    let img = vae.decode(&z)?;
    sync(&dev)?;
    let rgb = vae::to_rgb8(&img.i(0)?)?;
    if let (Some(mut r), Some(path)) = (rec, &req.save_io) {
        r.add("image", &img)?;
        r.metadata = io::metadata(&plan.model.id, req, guidance);
        r.write(path)?;
    }
    times.decode_s = t.elapsed().as_secs_f64();
    // The largest feature map: top channels at full resolution, plus the output.
    let top = (vae.config().ch * req.width as usize * req.height as usize) as u64
        * dtype.size_in_bytes() as u64;
    mem.spike(&id, bytes(&z) + top + bytes(&img));
    for d in &first_ids {
        mem.sub(d, bytes(&latents));
    }
    on(&Progress::Decoded {
        seconds: times.decode_s,
        latents_digest: mold_exec::digest(&latents)?,
        image_digest: mold_exec::digest(&img)?,
    });
    times.total_s = total.elapsed().as_secs_f64();
    let peaks = mem
        .peak
        .into_iter()
        .filter(|(_, b)| *b > 0)
        .map(|(device, peak_bytes)| DevicePeak { device, peak_bytes })
        .collect();
    let (width, height, data) = rgb;
    Ok(Output {
        image: RgbImage {
            width,
            height,
            data,
        },
        timings: times,
        peaks,
        metadata: metadata(&plan.model.id, req, guidance),
    })
}
