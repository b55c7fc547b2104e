//! FLUX text to image, each component where a [`mold_plan::Plan`] places it.
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
//!    PNG with the prompt and settings as tEXt chunks ([`crate::write_png`]).
//!
//! The folder: [`text`] (T5 and CLIP), [`sampling`] (token positions, the shifted
//! schedule), [`resident`] (the stages of a request, kept loaded for `mold serve`),
//! [`testdata`] (random-weight weights directories and Hugging Face snapshots). The
//! autoencoder is [`vae`] and the weights layout [`crate::layout`].

pub mod resident;
pub mod sampling;
pub mod testdata;
pub mod text;
pub mod vae;
pub mod vae_bands;
pub mod vae_nhwc;

use self::resident::{Decoder, Denoiser, Job, TextEncoder};
use crate::error::{PipelineError, Result};
use crate::{component_dtype, placement, Output, Progress, Request, WeightsLayout};
use mold_exec::runtime::DeviceMap;
use mold_exec::{Checkpoint, FluxConfig};
use mold_plan::Plan;
use std::path::Path;
use std::sync::atomic::AtomicBool;

/// Everything checked before loading.
pub struct Prepared {
    pub flux: FluxConfig,
    pub layout: WeightsLayout,
    pub ckpt: Checkpoint,
    /// T5 tokens (512 dev, 256 schnell, 8 flux-tiny).
    pub t5_tokens: usize,
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
    for name in ["t5", "clip"] {
        let (_, d) = placement(plan, name)?;
        component_dtype(name, d)?;
    }
    let (_, d) = crate::vae_devices(plan)?;
    component_dtype("vae", d)?;
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

/// Runs the whole pipeline for `req`, the transformer with `opts`; `on` sees progress as
/// it happens. Each component is loaded for this one request and released as soon as it
/// is done (an encoder before the next loads, the transformer before the VAE);
/// [`resident::Resident`] keeps them loaded instead. Both run the stages of [`resident::Job`].
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
    let target = resident::Target::of(plan, &mut devmap, opts.peer_copies)?;

    // Encode, one encoder at a time: load, encode, release.
    for name in resident::ENCODERS {
        let (id, _) = placement(plan, name)?;
        let enc = TextEncoder::load(
            plan,
            prep,
            name,
            &id,
            &mut devmap,
            opts.kernels,
            &mold_exec::weights_copy::WeightsFrom::files(opts.staged_load),
            on,
        )?;
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
    let (bands, _) = crate::vae_devices(plan)?;
    let vae_opts = vae::VaeOptions {
        peer_copies: opts.peer_copies,
        ..vae::VaeOptions::with_kernels(opts.kernels)
    };
    let dec = Decoder::load_with(plan, prep, &bands, &mut devmap, vae_opts, on)?;
    job.add_load_s(dec.load_s());
    for id in &bands {
        job.hold(id, dec.weight_bytes(), true);
    }
    job.decode(&dec, latents, &target, &never, on)
}
