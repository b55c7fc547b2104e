//! The FLUX autoencoder's decoder (candle-transformers' `flux::autoencoder`), latents to
//! RGB.

use crate::error::{PipelineError, Result};
use crate::layout::WeightsLayout;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::flux::autoencoder::{Config, Decoder};
use serde::{Deserialize, Serialize};

/// The autoencoder's hyper-parameters (`ae.json`; BFL's `AutoEncoderParams`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AeConfig {
    pub resolution: usize,
    pub in_channels: usize,
    pub ch: usize,
    pub out_ch: usize,
    pub ch_mult: Vec<usize>,
    pub num_res_blocks: usize,
    pub z_channels: usize,
    pub scale_factor: f64,
    pub shift_factor: f64,
}

impl AeConfig {
    /// FLUX.1's autoencoder (dev and schnell share it).
    pub fn flux() -> AeConfig {
        let c = Config::dev();
        AeConfig {
            resolution: c.resolution,
            in_channels: c.in_channels,
            ch: c.ch,
            out_ch: c.out_ch,
            ch_mult: c.ch_mult,
            num_res_blocks: c.num_res_blocks,
            z_channels: c.z_channels,
            scale_factor: c.scale_factor,
            shift_factor: c.shift_factor,
        }
    }

    /// A tiny autoencoder with FLUX's structure (8× up-sampling, 16 latent channels,
    /// the same scale and shift), for tests.
    pub fn tiny() -> AeConfig {
        AeConfig {
            ch: 32,
            ch_mult: vec![1, 1, 1, 1],
            num_res_blocks: 1,
            ..AeConfig::flux()
        }
    }

    pub fn to_candle(&self) -> Config {
        Config {
            resolution: self.resolution,
            in_channels: self.in_channels,
            ch: self.ch,
            out_ch: self.out_ch,
            ch_mult: self.ch_mult.clone(),
            num_res_blocks: self.num_res_blocks,
            z_channels: self.z_channels,
            scale_factor: self.scale_factor,
            shift_factor: self.shift_factor,
        }
    }

    /// `ae.json` if the directory has one, else [`AeConfig::flux`].
    pub fn for_layout(layout: &WeightsLayout) -> Result<AeConfig> {
        let Some(p) = &layout.ae_config else {
            return Ok(AeConfig::flux());
        };
        let text = std::fs::read_to_string(p).map_err(PipelineError::io(p))?;
        let c: AeConfig = serde_json::from_str(&text).map_err(|e| PipelineError::Config {
            path: p.display().to_string(),
            message: format!("not an autoencoder config: {e}"),
        })?;
        if c.ch_mult.is_empty() || !c.ch.is_multiple_of(32) {
            return Err(PipelineError::Config {
                path: p.display().to_string(),
                message:
                    "ch must be a multiple of 32 (group norms of 32 groups) and ch_mult non-empty"
                        .into(),
            });
        }
        Ok(c)
    }
}

/// The decoder, ready to run on its device.
pub struct Vae {
    decoder: Decoder,
    cfg: AeConfig,
    dtype: DType,
    device: Device,
    pub weight_bytes: u64,
}

impl Vae {
    /// Loads the decoder in `dtype`; on a CPU device a bf16 decoder computes in f32
    /// (candle's CPU matrix products, which its convolutions use, have no bf16: a bf16
    /// VAE on the host or an emulated device would fail at decode, after denoising).
    pub fn load(layout: &WeightsLayout, dtype: DType, dev: &Device) -> Result<Vae> {
        let dtype = crate::on_device_dtype(dtype, dev);
        let cfg = AeConfig::for_layout(layout)?;
        let files = [layout.ae.clone()];
        let weight_bytes = crate::text::weight_bytes(&files, dtype, |n| n.starts_with("decoder."))?;
        // SAFETY: mapped read-only; the file must not change while loading.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, dev)? };
        let decoder = Decoder::new(&cfg.to_candle(), vb.pp("decoder")).map_err(|e| {
            PipelineError::Component {
                component: "vae".into(),
                message: format!(
                    "cannot load the decoder from {}: {e} (a config other than FLUX's goes in {})",
                    layout.ae.display(),
                    crate::layout::AE_CONFIG
                ),
            }
        })?;
        Ok(Vae {
            decoder,
            cfg,
            dtype,
            device: dev.clone(),
            weight_bytes,
        })
    }

    pub fn config(&self) -> &AeConfig {
        &self.cfg
    }

    /// Latents `(b, 16, h, w)` (any device, any float dtype) → images `(b, 3, 8h, 8w)`
    /// in about [-1, 1], f32 on the VAE's device.
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let z = latents.to_device(&self.device)?.to_dtype(self.dtype)?;
        let z = ((z / self.cfg.scale_factor)? + self.cfg.shift_factor)?;
        Ok(self.decoder.forward(&z)?.to_dtype(DType::F32)?)
    }
}

/// One decoded image `(3, h, w)` in [-1, 1] → interleaved RGB bytes (BFL's
/// `127.5 * (x.clamp(-1, 1) + 1)`, truncated).
pub fn to_rgb8(img: &Tensor) -> Result<(u32, u32, Vec<u8>)> {
    let (c, h, w) = img.dims3()?;
    if c != 3 {
        return Err(PipelineError::Component {
            component: "vae".into(),
            message: format!("decoded {c} channels, expected 3 (RGB)"),
        });
    }
    let hwc = img
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .permute((1, 2, 0))?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let bytes = hwc
        .into_iter()
        .map(|v| {
            let v = if v.is_nan() { 0.0 } else { v.clamp(-1.0, 1.0) };
            (127.5 * (v + 1.0)) as u8
        })
        .collect();
    Ok((w as u32, h as u32, bytes))
}
