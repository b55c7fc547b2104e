//! The pipeline's components as objects that stay loaded, and one request's way through
//! them.
//!
//! - [`TextEncoder`] (T5 or CLIP), [`Denoiser`] (the transformer's executor) and
//!   [`Decoder`] (the VAE) each load once on a device and then serve any number of
//!   requests; an encoder or the decoder can be loaded on any device, not only the one
//!   the plan names (a server's lock pool runs them on idle devices).
//! - [`Job`] is one request going through them: its checks ([`Job::begin`]), each
//!   encoder's output ([`Job::encode`]), the denoising loop with a cancel flag checked
//!   between steps ([`Job::denoise`]) and the decode to an [`Output`] ([`Job::decode`]),
//!   with the time of each stage and the accounted memory.
//! - [`Resident`] keeps all of them loaded for a plan and runs whole requests
//!   ([`Resident::generate`]); [`crate::flux::generate`] runs the same stages, loading each
//!   component for the one request and releasing it as soon as it is done.
//!
//! The same request and seed give the same PNG bytes whichever way it runs.

use super::{metadata, text, vae, Prepared};
use crate::error::{PipelineError, Result};
use crate::{
    bytes, component_dtype, io, placement, sampling, sync, DevicePeak, Mem, Output, Progress,
    Request, RgbImage, Timings,
};
use candle_core::{DType, Device, IndexOp, Tensor};
use mold_exec::runtime::DeviceMap;
use mold_exec::weights_copy::WeightsFrom;
use mold_exec::{Executor, FluxConfig, FluxInputs};
use mold_plan::{DeviceId, Plan};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The text encoders, in the order they run (their outputs: T5's tokens, CLIP's pooled
/// vector).
pub const ENCODERS: [&str; 2] = ["t5", "clip"];

enum EncoderModel {
    /// The encoders keep a position-bias or mask cache: encoding needs `&mut`.
    T5(Mutex<text::T5>),
    Clip(Mutex<text::Clip>),
}

/// A text encoder loaded on one device, in the plan's dtype for it.
pub struct TextEncoder {
    name: &'static str,
    model: EncoderModel,
    device: DeviceId,
    dev: Device,
    weight_bytes: u64,
    load_s: f64,
}

impl TextEncoder {
    /// Loads encoder `name` (`t5` or `clip`) on `on` (any device: the plan gives the
    /// dtype), reporting `Loading` and `Loaded`; `kernels`: mold's network, or
    /// candle-transformers' under `candle`; `from`: its files (through page-locked buffers
    /// where staged, [`mold_exec::staging`]), or copies of another instance's weights
    /// ([`mold_exec::weights_copy`]).
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        plan: &Plan,
        prep: &Prepared,
        name: &str,
        on: &DeviceId,
        devmap: &mut DeviceMap,
        kernels: mold_exec::Kernels,
        from: &WeightsFrom,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<TextEncoder> {
        let name = match ENCODERS.iter().find(|n| **n == name) {
            Some(n) => *n,
            None => {
                return Err(PipelineError::Plan(format!(
                    "`{name}` is not a text encoder (t5, clip)"
                )))
            }
        };
        let (_, d) = placement(plan, name)?;
        let (dtype, note) = component_dtype(name, d)?;
        if let Some(n) = note {
            progress(&Progress::Note(n));
        }
        let dev = devmap.get(on)?;
        progress(&Progress::Loading {
            component: name.into(),
            devices: copy_label(on, from),
        });
        let t = Instant::now();
        let (model, weight_bytes) = if name == "t5" {
            let m = text::T5::load(&prep.layout.t5, prep.t5_tokens, dtype, &dev, kernels, from)?;
            let b = m.weight_bytes;
            (EncoderModel::T5(Mutex::new(m)), b)
        } else {
            let m = text::Clip::load(&prep.layout.clip, dtype, &dev, kernels, from)?;
            let b = m.weight_bytes;
            (EncoderModel::Clip(Mutex::new(m)), b)
        };
        sync(&dev)?;
        let load_s = t.elapsed().as_secs_f64();
        progress(&Progress::Loaded {
            component: name.into(),
            devices: copy_label(on, from),
            seconds: load_s,
            weight_bytes,
        });
        Ok(TextEncoder {
            name,
            model,
            device: on.clone(),
            dev,
            weight_bytes,
            load_s,
        })
    }

    /// The encoder's output for `prompt` (T5: `(1, tokens, d_model)`, CLIP: `(1,
    /// hidden)`), in its dtype, on its device (finished).
    pub fn encode(&self, prompt: &str) -> Result<Tensor> {
        let poisoned = |component: &str| PipelineError::Component {
            component: component.into(),
            message: "an earlier encode panicked; restart".into(),
        };
        let out = match &self.model {
            EncoderModel::T5(m) => m.lock().map_err(|_| poisoned("t5"))?.encode(prompt)?,
            EncoderModel::Clip(m) => m.lock().map_err(|_| poisoned("clip"))?.encode(prompt)?,
        };
        sync(&self.dev)?;
        Ok(out)
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
    pub fn device(&self) -> &DeviceId {
        &self.device
    }
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }
    pub fn load_s(&self) -> f64 {
        self.load_s
    }
}

/// Where the conditioning goes: the transformer's first devices, in its compute dtype;
/// moved there by peer copies where the GPUs allow and `peer_copies` is on
/// ([`mold_exec::runtime::hand_off`]).
pub struct Target {
    first: Vec<DeviceId>,
    dev: Device,
    dtype: DType,
    peer_copies: bool,
}

impl Target {
    pub fn of(plan: &Plan, devmap: &mut DeviceMap, peer_copies: bool) -> Result<Target> {
        let tf = plan.transformer().ok_or_else(|| {
            PipelineError::Plan(
                "no transformer component: regenerate the plan with `mold plan`".into(),
            )
        })?;
        let first = tf.parts[0].devices.clone();
        Ok(Target {
            dev: devmap.get(&first[0])?,
            dtype: mold_exec::weights_dtype(tf.dtype)?.0,
            first,
            peer_copies,
        })
    }
}

/// The devices of `plan`'s transformer parts, each once, in the plan's order.
fn transformer_devices(plan: &Plan) -> Vec<DeviceId> {
    let mut devices: Vec<DeviceId> = Vec::new();
    for d in plan
        .transformer()
        .iter()
        .flat_map(|t| &t.parts)
        .flat_map(|p| &p.devices)
    {
        if !devices.contains(d) {
            devices.push(d.clone());
        }
    }
    devices
}

/// `on`, and where its weights were copied from when they were.
fn copy_label(on: &DeviceId, from: &WeightsFrom) -> String {
    match from {
        WeightsFrom::CopyOf { kept, .. } => format!("{on} (copied from {})", kept.source()),
        WeightsFrom::Files { .. } => on.to_string(),
    }
}

/// The transformer of a plan, loaded on its parts' devices.
pub struct Denoiser {
    exec: Executor<FluxConfig>,
    target: Target,
    devices: Vec<DeviceId>,
    load_s: f64,
}

impl Denoiser {
    /// Loads the plan's transformer (every part's weights on its devices) with `opts`.
    pub fn load(
        plan: &Plan,
        prep: &Prepared,
        opts: &mold_exec::ExecOptions,
        devmap: &mut DeviceMap,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Denoiser> {
        let target = Target::of(plan, devmap, opts.peer_copies)?;
        let devices = transformer_devices(plan);
        let label = crate::device_list(&devices);
        progress(&Progress::Loading {
            component: "transformer".into(),
            devices: label.clone(),
        });
        let t = Instant::now();
        let exec = Executor::with_options(&prep.flux, plan, &prep.ckpt, opts.clone())?;
        let load_s = t.elapsed().as_secs_f64();
        let weight_bytes = exec.weight_bytes();
        progress(&Progress::Loaded {
            component: "transformer".into(),
            devices: label,
            seconds: load_s,
            weight_bytes,
        });
        Ok(Denoiser {
            exec,
            target,
            devices,
            load_s,
        })
    }

    /// This transformer on the devices of each of `plans`, other replicas of the placement
    /// it was loaded for, its weights copied device to device ([`Executor::replicate`]:
    /// over NVLink or PCIe where the GPUs have peer access) instead of read from the
    /// checkpoint, every replica at once. One result per plan: refused in one line where
    /// the placements differ or a part streams.
    pub fn replicas(
        &self,
        plans: &[&Plan],
        devmap: &mut DeviceMap,
        progress: &mut dyn FnMut(&Progress),
    ) -> Vec<Result<Denoiser>> {
        let from = crate::device_list(&self.devices);
        let wanted: Vec<Result<(Target, Vec<DeviceId>)>> = plans
            .iter()
            .map(|plan| {
                Target::of(plan, devmap, self.target.peer_copies)
                    .map(|t| (t, transformer_devices(plan)))
            })
            .collect();
        for (_, devices) in wanted.iter().flatten() {
            progress(&Progress::Loading {
                component: "transformer".into(),
                devices: format!("{} (copied from {from})", crate::device_list(devices)),
            });
        }
        // Each replica's copies on threads of their own (and one per receiving device
        // inside): the source's links serve them all at once.
        let copies: Vec<Option<(Result<Executor<FluxConfig>>, f64)>> = std::thread::scope(|s| {
            let threads: Vec<_> = plans
                .iter()
                .zip(&wanted)
                .map(|(plan, w)| {
                    w.is_ok().then(|| {
                        s.spawn(move || {
                            let t = Instant::now();
                            let e = self.exec.replicate(plan).map_err(PipelineError::from);
                            (e, t.elapsed().as_secs_f64())
                        })
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.map(|t| {
                        t.join().unwrap_or_else(|_| {
                            (
                                Err(PipelineError::Plan(
                                    "a replica's copy thread panicked".into(),
                                )),
                                0.0,
                            )
                        })
                    })
                })
                .collect()
        });
        wanted
            .into_iter()
            .zip(copies)
            .map(|(w, c)| {
                let (target, devices) = w?;
                let (exec, load_s) = c.expect("a thread for every wanted replica");
                let exec = exec?;
                let weight_bytes = exec.weight_bytes();
                progress(&Progress::Loaded {
                    component: "transformer".into(),
                    devices: crate::device_list(&devices),
                    seconds: load_s,
                    weight_bytes,
                });
                Ok(Denoiser {
                    exec,
                    target,
                    devices,
                    load_s,
                })
            })
            .collect()
    }

    /// The devices the transformer runs on, each once, in the plan's order.
    pub fn devices(&self) -> &[DeviceId] {
        &self.devices
    }
    pub fn load_s(&self) -> f64 {
        self.load_s
    }
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Accounts the executor's weights and stream buffers as held (`add`) or freed.
    fn hold(&self, mem: &mut Mem, add: bool) {
        for m in self.exec.memory_report() {
            let (dev, host) = (
                m.resident_weight_bytes + m.stream_buffer_bytes,
                m.host_weight_bytes,
            );
            if add {
                mem.add(&m.device, dev);
                mem.add(&DeviceId::Host, host);
            } else {
                mem.sub(&m.device, dev);
                mem.sub(&DeviceId::Host, host);
            }
        }
    }
}

/// The VAE's decoder loaded on one device, or on several that decode in row bands.
pub struct Decoder {
    vae: vae::Vae,
    /// The first band's device (the image comes back there).
    device: DeviceId,
    /// Every band's device, in row order.
    devices: Vec<DeviceId>,
    dev: Device,
    /// The devices beside `dev`, waited for at the end of a decode.
    devs: Vec<Device>,
    dtype: DType,
    load_s: f64,
}

impl Decoder {
    /// Loads the VAE's decoder on `on` (any devices; the plan gives the dtype) with the
    /// default options ([`Decoder::load_with`]).
    pub fn load(
        plan: &Plan,
        prep: &Prepared,
        on: &[DeviceId],
        devmap: &mut DeviceMap,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Decoder> {
        let opts = vae::VaeOptions::default();
        Self::load_with(plan, prep, on, devmap, opts, progress)
    }

    /// Loads the VAE's decoder on one device, `on`, with `opts`, its weights read from the
    /// file or copied from another instance's as `from` says ([`mold_exec::weights_copy`]).
    pub fn load_from(
        plan: &Plan,
        prep: &Prepared,
        on: &DeviceId,
        devmap: &mut DeviceMap,
        opts: vae::VaeOptions,
        from: &WeightsFrom,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Decoder> {
        let (_, d) = crate::vae_devices(plan)?;
        let (dtype, _) = component_dtype("vae", d)?;
        let dev = devmap.get(on)?;
        let label = copy_label(on, from);
        progress(&Progress::Loading {
            component: "vae".into(),
            devices: label.clone(),
        });
        let t = Instant::now();
        let vae = vae::Vae::load_from(&prep.layout, dtype, &dev, opts, from)?;
        sync(&dev)?;
        let load_s = t.elapsed().as_secs_f64();
        progress(&Progress::Loaded {
            component: "vae".into(),
            devices: label,
            seconds: load_s,
            weight_bytes: vae.weight_bytes,
        });
        Ok(Decoder {
            vae,
            device: on.clone(),
            devices: vec![on.clone()],
            dev,
            devs: Vec::new(),
            dtype,
            load_s,
        })
    }

    /// Loads the VAE's decoder on `on` with `opts` (`MOLD_KERNELS` picks the decoder): one
    /// device, or several for a decode in row bands (the plan's `vae` part with `sp`).
    pub fn load_with(
        plan: &Plan,
        prep: &Prepared,
        on: &[DeviceId],
        devmap: &mut DeviceMap,
        opts: vae::VaeOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Decoder> {
        let (_, d) = crate::vae_devices(plan)?;
        let (dtype, _) = component_dtype("vae", d)?;
        let Some(first) = on.first() else {
            return Err(PipelineError::Plan("`vae` names no device".into()));
        };
        let mut devs: Vec<Device> = Vec::with_capacity(on.len());
        for id in on {
            devs.push(devmap.get(id)?);
        }
        let names = on
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",");
        progress(&Progress::Loading {
            component: "vae".into(),
            devices: names.clone(),
        });
        let t = Instant::now();
        let vae = vae::Vae::load_bands(&prep.layout, dtype, &devs, opts)?;
        for d in &devs {
            sync(d)?;
        }
        let load_s = t.elapsed().as_secs_f64();
        progress(&Progress::Loaded {
            component: "vae".into(),
            devices: names,
            seconds: load_s,
            weight_bytes: vae.weight_bytes * on.len() as u64,
        });
        Ok(Decoder {
            vae,
            device: first.clone(),
            devices: on.to_vec(),
            dev: devs[0].clone(),
            devs: devs[1..].to_vec(),
            dtype,
            load_s,
        })
    }

    pub fn device(&self) -> &DeviceId {
        &self.device
    }
    /// The decoder's weights on each of its devices.
    pub fn weight_bytes(&self) -> u64 {
        self.vae.weight_bytes
    }
    pub fn load_s(&self) -> f64 {
        self.load_s
    }
}

/// The request was cancelled (its client went away) between two stages or steps.
fn check_cancel(cancel: &AtomicBool) -> Result<()> {
    if cancel.load(Ordering::Relaxed) {
        return Err(PipelineError::Cancelled);
    }
    Ok(())
}

/// One request on its way through the components.
pub struct Job {
    req: Request,
    model_id: String,
    guidance: Option<f64>,
    given: Option<Tensor>,
    rec: Option<io::IoRecord>,
    /// Encoder outputs as they came (`None` once moved to the transformer).
    raw: Vec<Option<(DeviceId, Tensor)>>,
    /// Conditioning on the transformer's first devices, in encoder order.
    cond: Vec<Option<Tensor>>,
    times: Timings,
    mem: Mem,
    started: Instant,
}

impl Job {
    /// Checks `req` against the plan (size, steps, the given noise) before anything runs,
    /// and settles its guidance.
    pub fn begin(
        plan: &Plan,
        flux: &FluxConfig,
        req: &Request,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Job> {
        crate::check_size(req.width, req.height)?;
        if req.steps == 0 {
            return Err(PipelineError::Plan("steps must be at least 1".into()));
        }
        // The given noise is read (and its shape checked) before anything loads.
        let given = req
            .latents
            .as_deref()
            .map(|p| io::read_latents(p, req.width, req.height))
            .transpose()?;
        let guidance = if flux.guidance_embed {
            Some(req.guidance.or(plan.workload.guidance).unwrap_or(3.5))
        } else {
            if req.guidance.is_some() {
                progress(&Progress::Note(format!(
                    "{} has no guidance embedder: --guidance is ignored",
                    plan.model.id
                )));
            }
            None
        };
        Ok(Job {
            req: req.clone(),
            model_id: plan.model.id.clone(),
            guidance,
            given,
            rec: req.save_io.as_ref().map(|_| io::IoRecord::default()),
            raw: vec![None, None],
            cond: vec![None, None],
            times: Timings::default(),
            mem: Mem::default(),
            started: Instant::now(),
        })
    }

    pub fn request(&self) -> &Request {
        &self.req
    }
    pub fn timings(&self) -> &Timings {
        &self.times
    }

    /// Counts `seconds` of loading in this request's timings.
    pub fn add_load_s(&mut self, seconds: f64) {
        self.times.load_s += seconds;
    }

    /// Accounts `bytes` as held on `device` from now on (`add`) or freed.
    pub fn hold(&mut self, device: &DeviceId, bytes: u64, add: bool) {
        if add {
            self.mem.add(device, bytes);
        } else {
            self.mem.sub(device, bytes);
        }
    }

    /// Runs `enc` on the prompt, reporting `Encoded`; with `to`, the output goes straight
    /// on to the transformer's first devices (else [`Job::denoise`] moves it).
    pub fn encode(
        &mut self,
        enc: &TextEncoder,
        to: Option<&Target>,
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<()> {
        check_cancel(cancel)?;
        let i = ENCODERS.iter().position(|n| *n == enc.name).expect("named");
        let t = Instant::now();
        let out = enc.encode(&self.req.prompt)?;
        let seconds = t.elapsed().as_secs_f64();
        self.times.encode_s += seconds;
        progress(&Progress::Encoded {
            component: enc.name.into(),
            seconds,
            digest: crate::digest_if(!self.req.no_digests, &out)?,
        });
        self.mem.spike(&enc.device, bytes(&out));
        self.raw[i] = Some((enc.device.clone(), out));
        if let Some(to) = to {
            self.condition(to)?;
        }
        Ok(())
    }

    /// Moves the encoder outputs not yet moved to the transformer's first devices, in its
    /// compute dtype.
    fn condition(&mut self, to: &Target) -> Result<()> {
        for i in 0..ENCODERS.len() {
            if let Some((_, out)) = self.raw[i].take() {
                let t = Instant::now();
                let moved = mold_exec::runtime::hand_off(&out, &to.dev, to.peer_copies)?;
                if !out.device().same_device(&to.dev) {
                    // A peer copy is queued on the destination's stream; the source, freed
                    // below on this thread's (idle) stream of its GPU, would go back to that
                    // GPU's pool at once and could be reused before the copy read it.
                    sync(&to.dev)?;
                }
                drop(out);
                let out = moved.to_dtype(to.dtype)?;
                self.times.encode_s += t.elapsed().as_secs_f64();
                for d in &to.first {
                    self.mem.add(d, bytes(&out));
                }
                self.cond[i] = Some(out);
            }
        }
        Ok(())
    }

    /// The denoising loop on `den`, from the seed's noise (or the given one), the cancel
    /// flag checked before each step; returns the final latents. The transformer's
    /// weights are accounted as held around it unless `resident` (held all along).
    pub fn denoise(
        &mut self,
        den: &Denoiser,
        resident: bool,
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Tensor> {
        self.condition(&den.target)?;
        let missing: Vec<&str> = ENCODERS
            .iter()
            .zip(&self.cond)
            .filter(|(_, c)| c.is_none())
            .map(|(n, _)| *n)
            .collect();
        if !missing.is_empty() {
            return Err(PipelineError::Component {
                component: missing.join(", "),
                message: "no encoder output for this request: encode before denoising".into(),
            });
        }
        check_cancel(cancel)?;
        let y = self.cond[1].take().expect("checked");
        let txt = self.cond[0].take().expect("checked");
        let (req, flux) = (&self.req, den.exec.model());
        let cond_dev = &den.target.dev;
        let first = &den.target.first;
        let t_denoise = Instant::now();
        let batch = 1;
        let x = match self.given.take() {
            Some(x) => x,
            None => sampling::pack(&sampling::noise(req.seed, batch, req.width, req.height)?)?,
        };
        let image_tokens = x.dim(1)?;
        let mut inputs = FluxInputs {
            img: x.to_device(cond_dev)?,
            img_ids: crate::flux::sampling::img_ids(batch, req.width, req.height)?
                .to_device(cond_dev)?,
            txt_ids: crate::flux::sampling::txt_ids(batch, txt.dim(1)?)?.to_device(cond_dev)?,
            txt,
            timesteps: Tensor::zeros(batch, DType::F32, cond_dev)?,
            y,
            guidance: self
                .guidance
                .map(|g| Tensor::full(g as f32, batch, cond_dev))
                .transpose()?,
            schedule: None,
        };
        for d in first {
            self.mem.add(
                d,
                bytes(&inputs.img) + bytes(&inputs.img_ids) + bytes(&inputs.txt_ids),
            );
        }
        let sched = crate::flux::sampling::schedule(req.steps, image_tokens, flux.guidance_embed);
        if let Some(r) = &mut self.rec {
            io::record_inputs(r, &inputs, &sched)?;
        }
        // Every step's time, so the blocks' modulation is computed ahead.
        sampling::set_schedule(&mut inputs, &sched)?;
        // One step at a time (the one loop, `sampling::denoise`, over one window), so the
        // cancel flag is seen between steps and `--save-io` keeps each step's input.
        let steps = req.steps;
        for (i, w) in sched.windows(2).enumerate() {
            check_cancel(cancel)?;
            if let Some(r) = &mut self.rec {
                r.add(format!("step.{i}.latents"), &inputs.img)?;
                r.add(
                    format!("step.{i}.t"),
                    &Tensor::new(&[w[0] as f32], &Device::Cpu)?,
                )?;
            }
            let times = &mut self.times;
            sampling::denoise(&den.exec, &mut inputs, w, !req.no_digests, &mut |s| {
                times.step_s.push(s.seconds);
                progress(&Progress::Step {
                    index: i as u32 + 1,
                    steps,
                    t: s.t,
                    seconds: s.seconds,
                    digest: s.digest,
                });
            })?;
        }
        if let Some(r) = &mut self.rec {
            r.add("final", &inputs.img)?;
            r.add_velocities(&sched)?;
        }
        self.times.denoise_s = t_denoise.elapsed().as_secs_f64();
        if !resident {
            den.hold(&mut self.mem, true);
        }
        for m in den.exec.memory_report() {
            self.mem
                .spike(&m.device, m.largest_activation_bytes + m.ahead_bytes);
        }
        // The request's windows are done with: their memory goes back before the decode.
        den.exec.release_modulation_ahead();
        if !resident {
            den.hold(&mut self.mem, false);
        }
        for d in first {
            self.mem.sub(
                d,
                bytes(&inputs.txt)
                    + bytes(&inputs.y)
                    + bytes(&inputs.img_ids)
                    + bytes(&inputs.txt_ids),
            );
        }
        Ok(inputs.img)
    }

    /// Decodes `latents` (from [`Job::denoise`] on a transformer whose first devices are
    /// `first`) on `dec`: the image, its timings, accounted peaks and PNG metadata.
    pub fn decode(
        mut self,
        dec: &Decoder,
        latents: Tensor,
        first: &Target,
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Output> {
        check_cancel(cancel)?;
        let req = &self.req;
        let t = Instant::now();
        let z = sampling::unpack(&latents, req.width, req.height)?;
        let img = dec.vae.decode(&z)?;
        for d in &dec.devs {
            sync(d)?;
        }
        sync(&dec.dev)?;
        if dec.dev.is_cuda() {
            // Which decoder ran (channels-last through cuDNN or candle's), as attention's is.
            progress(&Progress::Note(dec.vae.note()));
        }
        let (width, height, data) = vae::to_rgb8(&img.i(0)?)?;
        if let (Some(mut r), Some(path)) = (self.rec.take(), &req.save_io) {
            r.add("image", &img)?;
            r.metadata = io::metadata(&self.model_id, req, self.guidance);
            r.write(path)?;
        }
        self.times.decode_s = t.elapsed().as_secs_f64();
        // The largest feature map: top channels at full resolution (a band's rows of it on
        // each band's device), plus the output.
        let top = (dec.vae.config().ch * req.width as usize * req.height as usize) as u64
            * dec.dtype.size_in_bytes() as u64;
        let k = dec.devices.len() as u64;
        for d in &dec.devices[1..] {
            self.mem.spike(d, top.div_ceil(k));
        }
        self.mem
            .spike(&dec.device, bytes(&z) + top.div_ceil(k) + bytes(&img));
        for d in &first.first {
            self.mem.sub(d, bytes(&latents));
        }
        progress(&Progress::Decoded {
            devices: crate::device_list(&dec.devices),
            seconds: self.times.decode_s,
            latents_digest: crate::digest_if(!self.req.no_digests, &latents)?,
            image_digest: crate::digest_if(!self.req.no_digests, &img)?,
        });
        self.times.total_s = self.started.elapsed().as_secs_f64();
        let peaks = self
            .mem
            .peak
            .into_iter()
            .filter(|(_, b)| *b > 0)
            .map(|(device, peak_bytes)| DevicePeak { device, peak_bytes })
            .collect();
        Ok(Output {
            image: RgbImage {
                width,
                height,
                data,
            },
            timings: self.times,
            peaks,
            metadata: metadata(&self.model_id, req, self.guidance),
        })
    }
}

/// A plan's whole pipeline kept loaded: both text encoders, the transformer and the VAE,
/// each where the plan places it, serving one request after another.
pub struct Resident {
    plan: Plan,
    prep: Prepared,
    encoders: Vec<TextEncoder>,
    denoiser: Denoiser,
    decoder: Decoder,
}

impl Resident {
    /// Loads every component where `plan` places it (checked by [`crate::flux::prepare`]).
    pub fn load(
        plan: &Plan,
        prep: Prepared,
        opts: &mold_exec::ExecOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Resident> {
        let mut devmap = DeviceMap::default();
        let mut encoders = Vec::new();
        for name in ENCODERS {
            let (id, _) = placement(plan, name)?;
            encoders.push(TextEncoder::load(
                plan,
                &prep,
                name,
                &id,
                &mut devmap,
                opts.kernels,
                &WeightsFrom::files(opts.staged_load),
                progress,
            )?);
        }
        let denoiser = Denoiser::load(plan, &prep, opts, &mut devmap, progress)?;
        let (on, _) = crate::vae_devices(plan)?;
        let vae_opts = vae::VaeOptions {
            peer_copies: opts.peer_copies,
            ..vae::VaeOptions::with_kernels(opts.kernels)
        };
        let decoder = Decoder::load_with(plan, &prep, &on, &mut devmap, vae_opts, progress)?;
        Ok(Resident {
            plan: plan.clone(),
            prep,
            encoders,
            denoiser,
            decoder,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Runs `req` through the loaded components; stops between steps once `cancel` is
    /// set ([`PipelineError::Cancelled`]). Load time is not counted: nothing loads.
    pub fn generate(
        &self,
        req: &Request,
        progress: &mut dyn FnMut(&Progress),
        cancel: &AtomicBool,
    ) -> Result<Output> {
        let mut job = Job::begin(&self.plan, &self.prep.flux, req, progress)?;
        // Everything is held for the whole request.
        for e in &self.encoders {
            job.hold(&e.device, e.weight_bytes, true);
        }
        self.denoiser.hold(&mut job.mem, true);
        for d in &self.decoder.devices {
            job.hold(d, self.decoder.weight_bytes(), true);
        }
        for e in &self.encoders {
            job.encode(e, Some(&self.denoiser.target), cancel, progress)?;
        }
        let latents = job.denoise(&self.denoiser, true, cancel, progress)?;
        job.decode(
            &self.decoder,
            latents,
            &self.denoiser.target,
            cancel,
            progress,
        )
    }
}
