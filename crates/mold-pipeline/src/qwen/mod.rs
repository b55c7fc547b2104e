//! Qwen-Image text to image, each component where the plan places it: the text
//! encoder (`qwen2.5-vl`: [`crate::qwen::text`]), the transformer (the plan's parts, on
//! [`mold_exec::Executor`]), the sampler with true CFG ([`crate::qwen::sampling`]) and the
//! VAE decoder ([`crate::qwen::vae`]).
//!
//! 1. **Check** ([`prepare`]): the weights directory is Qwen-Image's repository layout
//!    ([`QwenLayout::locate`] names every missing file at once), the transformer's
//!    tensors (headers only), the text encoder's and VAE's configs against the
//!    transformer, the tokenizer, and every component's device and dtype. Nothing loads.
//! 2. **Encode**: the prompt and, with true CFG, the negative prompt, then the encoder
//!    is released; the conditioning moves to the transformer's first devices.
//! 3. **Denoise**: seeded noise packed in 2×2 patches, the shifted flow-matching
//!    schedule, one conditional and (true CFG) one unconditional transformer pass per
//!    step, combined; then the transformer is released. The two passes run as the
//!    plan's CFG mode says ([`Plan::cfg_mode`]): serially, CFG-parallel on a second
//!    device group ([`generate_on`]), or pipelined through the stages of a block split.
//! 4. **Decode**: the VAE on its device, then RGB bytes as diffusers rounds them, and
//!    the PNG's settings.
//!
//! ```text
//! DIR/ (the Hugging Face repository Qwen/Qwen-Image)
//!   transformer/  diffusion_pytorch_model[-0000N-of-0000M].safetensors (+ .index.json), config.json
//!   text_encoder/ config.json, model[-0000N-of-0000M].safetensors (+ model.safetensors.index.json)
//!   tokenizer/    tokenizer.json, or vocab.json + merges.txt + tokenizer_config.json
//!   vae/          config.json, diffusion_pytorch_model.safetensors
//!   scheduler/    scheduler_config.json (optional: the published values otherwise)
//! ```

pub mod lm;
pub mod sampling;
pub mod testdata;
pub mod text;
pub mod vae;
pub mod vae_nhwc;

use self::sampling::{Guidance, SchedulerConfig};
use self::text::{QwenText, QwenTextConfig, QwenTextFiles};
use self::vae::{QwenVae, QwenVaeConfig, QwenVaeFiles};
use crate::error::{PipelineError, Result};
use crate::{
    bytes, component_dtype, io, placement, sync, DevicePeak, Mem, Output, Progress, Request,
    RgbImage, Timings,
};
use candle_core::{DType, Device, IndexOp, Tensor};
use mold_exec::runtime::DeviceMap;
use mold_exec::{Checkpoint, Executor, QwenConfig, QwenInputs};
use mold_plan::{CfgMode, DeviceId, Plan};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The plan's name of the text encoder component.
pub const TEXT_ENCODER: &str = "qwen2.5-vl";

/// The negative prompt of true CFG when none is given (the published example's: one
/// space).
pub const DEFAULT_NEGATIVE: &str = " ";

/// Every file the Qwen-Image pipeline reads, found and checked to exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QwenLayout {
    pub dir: PathBuf,
    /// The transformer's index or single file, for [`Checkpoint::open`].
    pub transformer: PathBuf,
    pub text: QwenTextFiles,
    pub vae: QwenVaeFiles,
    /// `scheduler/scheduler_config.json` when the directory has one.
    pub scheduler: Option<PathBuf>,
}

/// The files of a safetensors index, sorted.
pub(crate) fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(PipelineError::io(index))?;
    let bad = |m: String| PipelineError::Config {
        path: index.display().to_string(),
        message: m,
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    names.sort();
    names.dedup();
    // Plain file names beside the index only (mold-models' one check of shard names).
    if let Some(m) = names
        .iter()
        .find_map(|n| mold_models::checkpoint::bad_shard_name(n))
    {
        return Err(bad(m));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

impl QwenLayout {
    /// Finds every file in `dir` (the repository's layout), listing all that are missing.
    pub fn locate(dir: &Path) -> Result<QwenLayout> {
        if !dir.is_dir() {
            return Err(PipelineError::Refused(format!(
                "--weights {}: text to image with Qwen-Image reads a weights directory (the Hugging Face repository's layout: transformer/, text_encoder/, tokenizer/, vae/), not a file",
                dir.display()
            )));
        }
        let mut missing: Vec<String> = Vec::new();
        let first = |cands: &[&str]| cands.iter().map(|c| dir.join(c)).find(|p| p.is_file());
        let need = |missing: &mut Vec<String>, found: Option<PathBuf>, what: &str| {
            if found.is_none() {
                missing.push(what.to_string());
            }
            found.unwrap_or_default()
        };
        let transformer = need(
            &mut missing,
            mold_models::snapshot::diffusers_transformer(dir),
            "transformer/diffusion_pytorch_model.safetensors[.index.json]",
        );
        let text_config = need(
            &mut missing,
            first(&["text_encoder/config.json"]),
            "text_encoder/config.json",
        );
        let text_w = need(
            &mut missing,
            first(&[
                "text_encoder/model.safetensors.index.json",
                "text_encoder/model.safetensors",
            ]),
            "text_encoder/model.safetensors[.index.json]",
        );
        let tokenizer = need(
            &mut missing,
            first(&["tokenizer/tokenizer.json", "tokenizer/vocab.json"]),
            "tokenizer/tokenizer.json (or vocab.json + merges.txt)",
        );
        if tokenizer.ends_with("vocab.json") && !dir.join("tokenizer/merges.txt").is_file() {
            missing.push("tokenizer/merges.txt".into());
        }
        let vae_config = need(&mut missing, first(&["vae/config.json"]), "vae/config.json");
        let vae_w = need(
            &mut missing,
            first(&[
                "vae/diffusion_pytorch_model.safetensors.index.json",
                "vae/diffusion_pytorch_model.safetensors",
            ]),
            "vae/diffusion_pytorch_model.safetensors",
        );
        if !missing.is_empty() {
            return Err(PipelineError::Refused(format!(
                "weights directory {} lacks {}: {}; it must have Qwen-Image's repository layout (README: \"Qwen-Image\"; `mold testdata qwen-image-tiny-pipeline DIR` writes a complete tiny one)",
                dir.display(),
                if missing.len() == 1 { "a file" } else { "files" },
                missing.join(", ")
            )));
        }
        let files = |p: PathBuf| -> Result<Vec<PathBuf>> {
            if p.extension().is_some_and(|e| e == "json") {
                let f = index_files(&p)?;
                let absent: Vec<String> = f
                    .iter()
                    .filter(|x| !x.is_file())
                    .map(|x| x.display().to_string())
                    .collect();
                if !absent.is_empty() {
                    return Err(PipelineError::Config {
                        path: p.display().to_string(),
                        message: format!("names shards that are missing: {}", absent.join(", ")),
                    });
                }
                Ok(f)
            } else {
                Ok(vec![p])
            }
        };
        let scheduler = dir.join("scheduler/scheduler_config.json");
        Ok(QwenLayout {
            dir: dir.to_path_buf(),
            transformer,
            text: QwenTextFiles {
                config: text_config,
                weights: files(text_w)?,
                tokenizer,
            },
            vae: QwenVaeFiles {
                config: vae_config,
                weights: files(vae_w)?,
            },
            scheduler: scheduler.is_file().then_some(scheduler),
        })
    }
}

/// Everything checked before loading.
pub struct QwenPrepared {
    pub cfg: QwenConfig,
    pub layout: QwenLayout,
    pub ckpt: Checkpoint,
    pub text: QwenTextConfig,
    pub vae: QwenVaeConfig,
    pub scheduler: SchedulerConfig,
}

/// What to generate: the request, the negative prompt and the true-CFG scale (above 1:
/// two transformer passes a step; at 1 or below: one, and no negative prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct QwenRequest {
    pub req: Request,
    /// The negative prompt ([`DEFAULT_NEGATIVE`] when none is given and CFG is on).
    pub negative_prompt: Option<String>,
    pub cfg: f64,
}

impl QwenRequest {
    /// The negative prompt true CFG runs with, `None` without true CFG.
    pub fn negative(&self) -> Option<&str> {
        (self.cfg > 1.0).then(|| self.negative_prompt.as_deref().unwrap_or(DEFAULT_NEGATIVE))
    }
}

/// Checks the plan against the weights directory without loading anything.
pub fn prepare(plan: &Plan, weights: &Path) -> Result<QwenPrepared> {
    let id = &plan.model.id;
    let cfg = QwenConfig::by_name(id).ok_or_else(|| {
        PipelineError::Plan(format!(
            "model `{id}`: the Qwen-Image pipeline runs qwen-image and qwen-image-tiny"
        ))
    })?;
    for name in [TEXT_ENCODER, "vae"] {
        let (_, d) = placement(plan, name)?;
        component_dtype(name, d)?;
    }
    if plan.transformer().is_none() {
        return Err(PipelineError::Plan(
            "no transformer component: regenerate the plan with `mold plan`".into(),
        ));
    }
    mold_exec::check_plan(&cfg, plan)?;
    let layout = QwenLayout::locate(weights)?;
    let ckpt = Checkpoint::open(&layout.transformer)?;
    ckpt.check(&cfg, id)?;
    let text = QwenTextConfig::read(&layout.text.config)?;
    if text.hidden_size != cfg.joint_attention_dim {
        return Err(PipelineError::Config {
            path: layout.text.config.display().to_string(),
            message: format!(
                "hidden_size {} but the transformer takes text states of width {} (joint_attention_dim): use the text encoder that goes with this model",
                text.hidden_size, cfg.joint_attention_dim
            ),
        });
    }
    crate::qwen::text::lm_prefix(&layout.text.weights, &text)?;
    crate::qwen::text::load_tokenizer(&layout.text.tokenizer)?;
    let vae = QwenVaeConfig::read(&layout.vae.config)?;
    if vae.z_dim * cfg.patch * cfg.patch != cfg.in_channels || vae.scale() != 8 {
        return Err(PipelineError::Config {
            path: layout.vae.config.display().to_string(),
            message: format!(
                "{} latent channels at {}x up-sampling, but the transformer takes {}x{} patches of {} channels of 8x latents",
                vae.z_dim,
                vae.scale(),
                cfg.patch,
                cfg.patch,
                cfg.in_channels / (cfg.patch * cfg.patch)
            ),
        });
    }
    let scheduler = match &layout.scheduler {
        Some(p) => SchedulerConfig::read(p)?,
        None => SchedulerConfig::qwen_image(),
    };
    Ok(QwenPrepared {
        cfg,
        layout,
        ckpt,
        text,
        vae,
        scheduler,
    })
}

/// The PNG tEXt chunks: the prompt and every setting that determines the image.
pub fn metadata(model_id: &str, q: &QwenRequest) -> Vec<(String, String)> {
    let req = &q.req;
    let mut m = vec![
        ("prompt".to_string(), req.prompt.clone()),
        ("model".to_string(), model_id.to_string()),
        ("seed".to_string(), req.seed.to_string()),
        ("steps".to_string(), req.steps.to_string()),
        ("true_cfg_scale".to_string(), q.cfg.to_string()),
    ];
    if let Some(n) = q.negative() {
        m.push(("negative_prompt".to_string(), n.to_string()));
    }
    m.push(("width".to_string(), req.width.to_string()));
    m.push(("height".to_string(), req.height.to_string()));
    m.push((
        "sampler".to_string(),
        "flow-matching euler, shifted, true CFG (mold)".to_string(),
    ));
    m.push((
        "Software".to_string(),
        format!("mold {}", env!("CARGO_PKG_VERSION")),
    ));
    m
}

/// Checks a request before anything runs: size, steps and scale.
fn check_request(q: &QwenRequest) -> Result<()> {
    let req = &q.req;
    crate::sampling::check_size(req.width, req.height)?;
    if req.steps == 0 {
        return Err(PipelineError::Refused(
            "--steps 0: give at least 1 denoising step".into(),
        ));
    }
    if !q.cfg.is_finite() || q.cfg < 1.0 {
        return Err(PipelineError::Refused(format!(
            "--cfg {}: the true-CFG scale is a number ≥ 1 (1 turns true CFG off; Qwen-Image's default is 4)",
            q.cfg
        )));
    }
    if req.guidance.is_some() {
        return Err(PipelineError::Refused(
            "--guidance is FLUX's distilled guidance; Qwen-Image has none: use --cfg (true CFG) instead".into(),
        ));
    }
    Ok(())
}

/// The unconditional pass's transformer on `plan`'s devices: `exec`'s weights copied
/// device to device ([`Executor::replicate`]), or read from the checkpoint where the two
/// placements differ (the progress says why).
fn copy_transformer(
    exec: &Executor<QwenConfig>,
    plan: &Plan,
    prep: &QwenPrepared,
    opts: &mold_exec::ExecOptions,
    times: &mut Timings,
    on: &mut dyn FnMut(&Progress),
) -> Result<Executor<QwenConfig>> {
    const COMPONENT: &str = "transformer (unconditional)";
    let label = crate::device_list(&transformer_devices(plan));
    on(&Progress::Loading {
        component: COMPONENT.into(),
        devices: format!("{label} (copied)"),
    });
    let t = Instant::now();
    let copy = match exec.replicate(plan) {
        Ok(copy) => copy,
        Err(why) => {
            on(&Progress::Note(format!("{COMPONENT}: {why}")));
            return load_transformer(plan, prep, opts, COMPONENT, times, on);
        }
    };
    let load_s = t.elapsed().as_secs_f64();
    times.load_s += load_s;
    on(&Progress::Loaded {
        component: COMPONENT.into(),
        devices: format!("{label} (copied)"),
        seconds: load_s,
        weight_bytes: copy.weight_bytes(),
    });
    Ok(copy)
}

/// Loads the transformer of `plan` (every part's weights on its devices), reporting it
/// as `component`.
fn load_transformer(
    plan: &Plan,
    prep: &QwenPrepared,
    opts: &mold_exec::ExecOptions,
    component: &str,
    times: &mut Timings,
    on: &mut dyn FnMut(&Progress),
) -> Result<Executor<QwenConfig>> {
    let label = crate::device_list(&transformer_devices(plan));
    on(&Progress::Loading {
        component: component.into(),
        devices: label.clone(),
    });
    let t = Instant::now();
    let exec = Executor::with_options(&prep.cfg, plan, &prep.ckpt, opts.clone())?;
    let load_s = t.elapsed().as_secs_f64();
    times.load_s += load_s;
    on(&Progress::Loaded {
        component: component.into(),
        devices: label,
        seconds: load_s,
        weight_bytes: exec.weight_bytes(),
    });
    Ok(exec)
}

/// The devices of a plan's transformer, each once, in the plan's order (the host left
/// out).
fn transformer_devices(plan: &Plan) -> Vec<DeviceId> {
    let mut v: Vec<DeviceId> = Vec::new();
    for d in plan
        .transformer()
        .iter()
        .flat_map(|t| &t.parts)
        .flat_map(|p| &p.devices)
    {
        if !v.contains(d) && !d.is_host() {
            v.push(d.clone());
        }
    }
    v
}

/// Checks a CFG-parallel pair: the unconditional pass's plan runs the same model on
/// devices of its own, and true CFG is on (else its devices would idle).
fn check_cfg_parallel(plan: &Plan, uncond: &Plan, q: &QwenRequest) -> Result<()> {
    if uncond.model.id != plan.model.id {
        return Err(PipelineError::Plan(format!(
            "CFG-parallel: the unconditional pass's placement is for `{}`, the plan's model is `{}`",
            uncond.model.id, plan.model.id
        )));
    }
    let a = transformer_devices(plan);
    let shared: Vec<String> = transformer_devices(uncond)
        .into_iter()
        .filter(|d| a.contains(d))
        .map(|d| d.to_string())
        .collect();
    if !shared.is_empty() {
        return Err(PipelineError::Plan(format!(
            "CFG-parallel: the conditional and unconditional passes share {}: give each pass devices of its own",
            shared.join(", ")
        )));
    }
    if q.negative().is_none() {
        return Err(PipelineError::Refused(format!(
            "CFG-parallel runs the unconditional pass on devices of its own, but --cfg {} turns true CFG off: use a scale above 1, or a plan without CFG-parallel",
            q.cfg
        )));
    }
    Ok(())
}

/// Runs the Qwen-Image pipeline for `q`, the transformer with `opts`; `on` sees
/// progress. Each component is loaded for this request and released when done.
pub fn generate(
    plan: &Plan,
    prep: &QwenPrepared,
    q: &QwenRequest,
    opts: &mold_exec::ExecOptions,
    on: &mut dyn FnMut(&Progress),
) -> Result<Output> {
    generate_on(plan, None, prep, q, opts, on)
}

/// [`generate`], CFG-parallel when `uncond` is given: the unconditional pass of each
/// step on `uncond`'s transformer placement (the same model on devices of its own, e.g.
/// a replica of the plan's: [`Plan::replica_plans`]) at the same time as the
/// conditional one on the plan's; the predictions are combined on the plan's first
/// devices. The text encoder and the VAE run where the plan places them.
pub fn generate_on(
    plan: &Plan,
    uncond: Option<&Plan>,
    prep: &QwenPrepared,
    q: &QwenRequest,
    opts: &mold_exec::ExecOptions,
    on: &mut dyn FnMut(&Progress),
) -> Result<Output> {
    check_request(q)?;
    if let Some(u) = uncond {
        check_cfg_parallel(plan, u, q)?;
        mold_exec::check_plan(&prep.cfg, u)?;
    }
    let pipelined = plan.cfg_mode() == Some(CfgMode::Pipelined);
    if pipelined && uncond.is_some() {
        return Err(PipelineError::Plan(
            "the plan's cfg.mode is pipelined (both passes through its block split), but the unconditional pass was also given devices of its own (CFG-parallel): use a plan with `cfg: {mode: parallel}` for that, or drop --cfg-parallel".into(),
        ));
    }
    let req = &q.req;
    let started = Instant::now();
    let mut times = Timings::default();
    let mut mem = Mem::default();
    let mut devmap = DeviceMap::default();
    let given = match &req.latents {
        Some(p) => Some(io::read_latents(p, req.width, req.height)?),
        None => None,
    };
    let mut rec = req.save_io.as_ref().map(|_| io::IoRecord::default());
    let digests = !req.no_digests;
    let tf = plan.transformer().ok_or_else(|| {
        PipelineError::Plan("no transformer component: regenerate the plan with `mold plan`".into())
    })?;
    let first: Vec<DeviceId> = tf.parts[0].devices.clone();
    let tdev = devmap.get(&first[0])?;
    let tdtype = mold_exec::weights_dtype(tf.dtype)?.0;

    // Encode: the prompt, then the negative prompt; then release the encoder.
    let (id, d) = placement(plan, TEXT_ENCODER)?;
    let (dtype, note) = component_dtype(TEXT_ENCODER, d)?;
    if let Some(n) = note {
        on(&Progress::Note(n));
    }
    let dev = devmap.get(&id)?;
    on(&Progress::Loading {
        component: TEXT_ENCODER.into(),
        devices: id.to_string(),
    });
    let t = Instant::now();
    let enc = QwenText::load(&prep.layout.text, dtype, &dev, opts.kernels)?;
    sync(&dev)?;
    times.load_s += t.elapsed().as_secs_f64();
    on(&Progress::Loaded {
        component: TEXT_ENCODER.into(),
        devices: id.to_string(),
        seconds: t.elapsed().as_secs_f64(),
        weight_bytes: enc.weight_bytes,
    });
    mem.add(&id, enc.weight_bytes);
    let mut conds = Vec::new();
    let prompts: Vec<(&str, &str)> = std::iter::once((TEXT_ENCODER, req.prompt.as_str()))
        .chain(q.negative().map(|n| ("qwen2.5-vl (negative)", n)))
        .collect();
    for (label, prompt) in prompts {
        let t = Instant::now();
        let c = enc.encode(prompt)?;
        sync(&dev)?;
        let seconds = t.elapsed().as_secs_f64();
        times.encode_s += seconds;
        mem.spike(&id, bytes(&c));
        on(&Progress::Encoded {
            component: label.into(),
            seconds,
            digest: crate::digest_if(digests, &c)?,
        });
        let c =
            mold_exec::runtime::hand_off_ordered(&c, &tdev, opts.peer_copies)?.to_dtype(tdtype)?;
        for d in &first {
            mem.add(d, bytes(&c));
        }
        conds.push(c);
    }
    mem.sub(&id, enc.weight_bytes);
    drop(enc);
    on(&Progress::Released {
        component: TEXT_ENCODER.into(),
    });
    let txt = conds.remove(0);
    let guidance = conds.pop().map(|txt| Guidance { txt, scale: q.cfg });

    // Denoise: the transformer on the plan's parts and, CFG-parallel, a second copy on
    // the unconditional pass's devices.
    let exec = load_transformer(plan, prep, opts, "transformer", &mut times, on)?;
    let uncond_exec = match uncond {
        Some(u) => Some(copy_transformer(&exec, u, prep, opts, &mut times, on)?),
        None => None,
    };
    let passes = match &uncond_exec {
        Some(u) => sampling::Passes::Parallel {
            cond: &exec,
            uncond: u,
        },
        None if pipelined => {
            on(&Progress::Note(match q.negative() {
                Some(_) => format!(
                    "pipelined CFG: each step's two passes as micro-batches through {} stages of the transformer",
                    exec.pipeline_stages().len()
                ),
                None => format!("pipelined CFG: --cfg {} runs one pass a step, nothing to pipeline", q.cfg),
            }));
            sampling::Passes::Pipelined(&exec)
        }
        None => sampling::Passes::Serial(&exec),
    };
    let t_denoise = Instant::now();
    let x = match given {
        Some(x) => x,
        None => {
            crate::sampling::pack(&crate::sampling::noise(req.seed, 1, req.width, req.height)?)?
        }
    };
    let grid = (req.height as usize / 16, req.width as usize / 16);
    let mut inputs = QwenInputs {
        img: x.to_device(&tdev)?,
        txt,
        timesteps: Tensor::zeros(1, DType::F32, &tdev)?,
        grid,
    };
    for d in &first {
        mem.add(d, bytes(&inputs.img));
    }
    let sigmas = prep.scheduler.sigmas(req.steps, grid.0 * grid.1);
    if let Some(r) = &mut rec {
        r.add("txt", &inputs.txt)?;
        if let Some(g) = &guidance {
            r.add("txt_negative", &g.txt)?;
        }
        let ts: Vec<f32> = sigmas.iter().map(|&t| t as f32).collect();
        r.add("timesteps", &Tensor::new(ts.as_slice(), &Device::Cpu)?)?;
        r.add("latents", &inputs.img)?;
    }
    let steps = req.steps;
    sampling::denoise(
        &passes,
        &mut inputs,
        guidance.as_ref(),
        &sigmas,
        digests,
        &mut |i, x, t| {
            if let Some(r) = &mut rec {
                r.add(format!("step.{i}.latents"), x)?;
                r.add(
                    format!("step.{i}.t"),
                    &Tensor::new(&[t as f32], &Device::Cpu)?,
                )?;
            }
            Ok(())
        },
        &mut |s| {
            times.step_s.push(s.seconds);
            on(&Progress::Step {
                index: s.index as u32 + 1,
                steps,
                t: s.t,
                seconds: s.seconds,
                digest: s.digest,
            });
        },
    )?;
    times.denoise_s = t_denoise.elapsed().as_secs_f64();
    if let Some(r) = &mut rec {
        r.add("final", &inputs.img)?;
        r.add_velocities(&sigmas)?;
    }
    let execs: Vec<&Executor<QwenConfig>> =
        std::iter::once(&exec).chain(uncond_exec.as_ref()).collect();
    for e in &execs {
        for m in e.memory_report() {
            mem.add(&m.device, m.resident_weight_bytes + m.stream_buffer_bytes);
            mem.add(&DeviceId::Host, m.host_weight_bytes);
        }
    }
    for e in &execs {
        for m in e.memory_report() {
            mem.spike(&m.device, m.largest_activation_bytes + m.ahead_bytes);
        }
    }
    for e in &execs {
        for m in e.memory_report() {
            mem.sub(&m.device, m.resident_weight_bytes + m.stream_buffer_bytes);
            mem.sub(&DeviceId::Host, m.host_weight_bytes);
        }
    }
    for d in &first {
        mem.sub(d, bytes(&inputs.txt));
        if let Some(g) = &guidance {
            mem.sub(d, bytes(&g.txt));
        }
    }
    drop(execs);
    drop(exec);
    drop(uncond_exec);
    on(&Progress::Released {
        component: "transformer".into(),
    });
    let latents = inputs.img;

    // Decode.
    let (id, d) = placement(plan, "vae")?;
    let (dtype, _) = component_dtype("vae", d)?;
    let dev = devmap.get(&id)?;
    on(&Progress::Loading {
        component: "vae".into(),
        devices: id.to_string(),
    });
    let t = Instant::now();
    let vae_opts = crate::nhwc::NhwcOptions {
        conv: mold_exec::model::conv::ConvOptions {
            kernels: opts.kernels,
            tune: false,
        },
        subpixel: true,
    };
    let vae = QwenVae::load_with(&prep.layout.vae, dtype, &dev, vae_opts)?;
    sync(&dev)?;
    times.load_s += t.elapsed().as_secs_f64();
    on(&Progress::Loaded {
        component: "vae".into(),
        devices: id.to_string(),
        seconds: t.elapsed().as_secs_f64(),
        weight_bytes: vae.weight_bytes,
    });
    mem.add(&id, vae.weight_bytes);
    let t = Instant::now();
    let z = crate::sampling::unpack(&latents, req.width, req.height)?;
    // To the VAE's GPU with the run's peer setting (the decode's own move is then none).
    let z = mold_exec::runtime::hand_off_ordered(&z, &dev, opts.peer_copies)?;
    let img = vae.decode(&z)?;
    sync(&dev)?;
    let (width, height, data) = crate::qwen::vae::to_rgb8(&img.i(0)?)?;
    times.decode_s = t.elapsed().as_secs_f64();
    // The largest feature maps: the last level's channels at full resolution (two live
    // at once in a residual block), and the output.
    let top = 2
        * (vae.config().top_channels() * req.width as usize * req.height as usize) as u64
        * dtype.size_in_bytes() as u64;
    mem.spike(&id, bytes(&z) + top + bytes(&img));
    for d in &first {
        mem.sub(d, bytes(&latents));
    }
    if let (Some(mut r), Some(path)) = (rec.take(), &req.save_io) {
        r.add("image", &img)?;
        r.metadata = metadata(&plan.model.id, q).into_iter().collect();
        r.write(path)?;
    }
    on(&Progress::Note(vae.note()));
    on(&Progress::Decoded {
        devices: id.to_string(),
        seconds: times.decode_s,
        latents_digest: crate::digest_if(digests, &latents)?,
        image_digest: crate::digest_if(digests, &img)?,
    });
    times.total_s = started.elapsed().as_secs_f64();
    let peaks = mem
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
        timings: times,
        peaks,
        metadata: metadata(&plan.model.id, q),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// qwen-image-tiny, tensor parallel over emu:0 and emu:1, with a second replica on
    /// emu:2 and emu:3 (the placement the unconditional pass gets under CFG-parallel).
    const PLAN: &str = "version: 3
model:
  id: qwen-image-tiny
workload: {width: 32, height: 32, steps: 2, cfg_scale: 4.0}
machine:
  name: cpu-emu-4
  fingerprint: sha256:70c9ec7dbfc3fc8c
  devices:
  - {id: emu:0, name: emulated device (CPU), memory: 4GiB}
  - {id: emu:1, name: emulated device (CPU), memory: 4GiB}
  - {id: emu:2, name: emulated device (CPU), memory: 4GiB}
  - {id: emu:3, name: emulated device (CPU), memory: 4GiB}
components:
- {name: qwen2.5-vl, role: encoder, dtype: f32, parts: [{devices: [emu:0], residency: resident}]}
- name: transformer
  role: transformer
  dtype: f32
  parts: [{blocks: [block 0..3], devices: [emu:0, emu:1], tp: 2, residency: resident}]
- {name: vae, role: vae, dtype: f32, parts: [{devices: [host], residency: resident}]}
replicas:
- {emu:0: emu:0, emu:1: emu:1}
- {emu:0: emu:2, emu:1: emu:3}
predicted:
  step_time_s: 0.0
  request_time_s: 0.0
  encode_time_s: 0.0
  denoise_time_s: 0.0
  decode_time_s: 0.0
  devices: []
  host_pinned: 0
  streamed_per_step: 0
solver: {solver: hand, status: optimal, objective: latency, objective_value: 0.0, strategy: tensor, solve_time_ms: 0.0}
";

    /// [`PLAN`] as a version 4 plan with its transformer split over emu:0 and emu:1,
    /// one replica, and `cfg` (none: serial).
    fn split_plan(cfg: Option<&str>) -> Plan {
        let cfg = cfg
            .map(|m| format!("cfg: {{mode: {m}}}\n"))
            .unwrap_or_default();
        let yaml = PLAN
            .replace("version: 3", "version: 4")
            .replace("machine:", &format!("{cfg}machine:"))
            .replace(
                "parts: [{blocks: [block 0..3], devices: [emu:0, emu:1], tp: 2, residency: resident}]",
                "parts: [{blocks: [block 0..1], devices: [emu:0], residency: resident}, {blocks: [block 1..3], devices: [emu:1], residency: resident}]",
            )
            .replace("replicas:\n- {emu:0: emu:0, emu:1: emu:1}\n- {emu:0: emu:2, emu:1: emu:3}\n", "");
        assert!(
            yaml.contains("block 1..3") && !yaml.contains("replicas"),
            "{yaml}"
        );
        Plan::from_yaml(&yaml, "test plan").unwrap()
    }

    /// A plan whose `cfg.mode` is pipelined runs each step's two passes as micro-batches
    /// through its block split and makes the serial plan's image; CFG-parallel on top of
    /// it is refused in one line.
    #[test]
    fn cfg_pipelined_pipeline_equals_serial() {
        let dir = std::env::temp_dir().join(format!("mold-qwen-pipelined-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        crate::qwen::testdata::write_tiny_pipeline(&dir, 1).unwrap();
        let (serial_plan, pipelined) = (split_plan(None), split_plan(Some("pipelined")));
        assert_eq!(serial_plan.cfg_mode(), Some(CfgMode::Serial));
        assert_eq!(pipelined.cfg_mode(), Some(CfgMode::Pipelined));
        let prep = prepare(&pipelined, &dir).unwrap();
        let opts = mold_exec::ExecOptions::default();
        let q = request(4.0);
        let serial = generate(&serial_plan, &prep, &q, &opts, &mut |_| {}).unwrap();
        let mut seen = Vec::new();
        let pipe = generate(&pipelined, &prep, &q, &opts, &mut |p| {
            seen.push(p.to_string())
        })
        .unwrap();
        assert_eq!(serial.image, pipe.image);
        assert!(
            seen.iter().any(|s| s
                == "note: pipelined CFG: each step's two passes as micro-batches through 2 stages of the transformer"),
            "{seen:?}"
        );
        // Without true CFG there is one pass a step: nothing to pipeline, same image.
        let one = generate(&pipelined, &prep, &request(1.0), &opts, &mut |_| {}).unwrap();
        let one_serial = generate(&serial_plan, &prep, &request(1.0), &opts, &mut |_| {}).unwrap();
        assert_eq!(one.image, one_serial.image);
        let other = Plan::from_yaml(PLAN, "test plan")
            .unwrap()
            .replica_plans()
            .unwrap()[1]
            .clone();
        let e = generate_on(&pipelined, Some(&other), &prep, &q, &opts, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("cfg.mode is pipelined"), "{e}");
    }

    fn request(cfg: f64) -> QwenRequest {
        QwenRequest {
            req: Request {
                prompt: "a red fox".into(),
                seed: 7,
                steps: 2,
                width: 32,
                height: 32,
                ..Default::default()
            },
            negative_prompt: Some("blurry".into()),
            cfg,
        }
    }

    /// CFG-parallel (the unconditional pass on the second replica's devices, at the same
    /// time) makes the image of the serial loop; the passes must not share devices, and
    /// true CFG must be on.
    #[test]
    fn cfg_parallel_pipeline_equals_serial() {
        let dir = std::env::temp_dir().join(format!("mold-qwen-pipe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        crate::qwen::testdata::write_tiny_pipeline(&dir, 1).unwrap();
        let full = Plan::from_yaml(PLAN, "test plan").unwrap();
        let replicas = full.replica_plans().unwrap();
        let (plan, other) = (&replicas[0], &replicas[1]);
        let prep = prepare(plan, &dir).unwrap();
        let opts = mold_exec::ExecOptions::default();
        let q = request(4.0);
        let mut seen = Vec::new();
        let serial = generate(plan, &prep, &q, &opts, &mut |_| {}).unwrap();
        let par = generate_on(plan, Some(other), &prep, &q, &opts, &mut |p| {
            seen.push(p.to_string())
        })
        .unwrap();
        assert_eq!(serial.image, par.image);
        assert!(
            seen.iter()
                .any(|s| s
                    .starts_with("load   transformer (unconditional) on emu:2, emu:3 (copied):")),
            "{seen:?}"
        );
        // The peaks count both copies of the transformer.
        assert!(par.peaks.iter().any(|p| p.device == DeviceId::Emu(3)));
        let e = generate_on(plan, Some(plan), &prep, &q, &opts, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("share emu:0, emu:1"), "{e}");
        let e = generate_on(plan, Some(other), &prep, &request(1.0), &opts, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cfg 1 turns true CFG off"), "{e}");
    }
}
