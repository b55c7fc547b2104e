//! The FLUX autoencoder's decoder, latents to RGB: on CUDA in bf16/f16 with cuDNN loaded,
//! the channels-last decoder ([`crate::flux::vae_nhwc`]: cuDNN convolutions, mold's group norm);
//! elsewhere, or with `MOLD_KERNELS=mold|candle`, candle-transformers'
//! `flux::autoencoder::Decoder`. [`Vae::note`] says which ran and why.

use crate::error::{PipelineError, Result};
use crate::flux::vae_bands::Bands;
use crate::flux::vae_nhwc::{DecodeStats, NhwcDecoder, NhwcOptions};
use crate::layout::WeightsLayout;
use crate::nhwc::channels_last;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::flux::autoencoder::{Config, Decoder};
use mold_exec::model::conv::ConvOptions;
use mold_exec::weights_copy::WeightsFrom;
use mold_exec::Kernels;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Mutex;

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

/// How the decoder may run (resolved at the CLI edge: `MOLD_KERNELS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VaeOptions {
    pub kernels: Kernels,
    /// Time cuDNN's engine configurations on each convolution shape's first decode and
    /// keep the fastest (else the heuristics' first choice).
    pub tune: bool,
    /// Up-sampling and the 3×3 convolution after it as four 2×2 phase convolutions
    /// ([`crate::flux::vae_nhwc`]).
    pub subpixel: bool,
    /// A decode in row bands over several GPUs moves rows by peer copies where the pair
    /// allows (`--no-peer`: through host memory).
    pub peer_copies: bool,
}

impl Default for VaeOptions {
    fn default() -> Self {
        VaeOptions {
            kernels: Kernels::Auto,
            tune: false,
            subpixel: true,
            peer_copies: true,
        }
    }
}

impl VaeOptions {
    pub fn with_kernels(kernels: Kernels) -> VaeOptions {
        VaeOptions {
            kernels,
            ..VaeOptions::default()
        }
    }
}

enum Imp {
    /// candle-transformers' decoder; why the channels-last one is not used.
    Candle(Box<Decoder>, String),
    /// The channels-last decoder, one per band's device (one for a one-device decode), and
    /// cuDNN's version.
    Nhwc(Vec<NhwcDecoder>, String),
}

/// The decoder, ready to run on its device, or on several in row bands.
pub struct Vae {
    imp: Imp,
    cfg: AeConfig,
    dtype: DType,
    /// The bands' devices in row order ([`crate::flux::vae_bands`]); one for a one-device
    /// decode. The image comes back on the first.
    devices: Vec<Device>,
    peer_copies: bool,
    /// The decoder's weights on each device.
    pub weight_bytes: u64,
    /// What the last decode ran (the channels-last decoder).
    last: Mutex<Option<DecodeStats>>,
}

/// The implementation `opts` and the device allow, built from `vb`: an error where
/// `MOLD_KERNELS` requires what is missing, else the decoder or why it could not be built.
fn nhwc_options(opts: VaeOptions) -> NhwcOptions {
    NhwcOptions {
        conv: ConvOptions {
            kernels: opts.kernels,
            tune: opts.tune,
        },
        subpixel: opts.subpixel,
    }
}

fn build(
    vb: VarBuilder,
    cfg: &AeConfig,
    dtype: DType,
    dev: &Device,
    opts: VaeOptions,
) -> Result<std::result::Result<Imp, String>> {
    Ok(match channels_last(dev, dtype, opts.kernels)? {
        Ok(version) => NhwcDecoder::new(cfg, vb.pp("decoder"), nhwc_options(opts))
            .map(|d| Imp::Nhwc(vec![d], version))
            .map_err(|e| e.to_string()),
        Err(why) => Decoder::new(&cfg.to_candle(), vb.pp("decoder"))
            .map(|d| Imp::Candle(Box::new(d), why))
            .map_err(|e| e.to_string()),
    })
}

impl Vae {
    /// Loads the decoder in `dtype` with the default options ([`Vae::load_with`]).
    pub fn load(layout: &WeightsLayout, dtype: DType, dev: &Device) -> Result<Vae> {
        Self::load_with(layout, dtype, dev, VaeOptions::default())
    }

    /// Loads the decoder in `dtype`; on a CPU device a bf16 decoder computes in f32
    /// (candle's CPU matrix products, which its convolutions use, have no bf16: a bf16
    /// VAE on the host or an emulated device would fail at decode, after denoising).
    pub fn load_with(
        layout: &WeightsLayout,
        dtype: DType,
        dev: &Device,
        opts: VaeOptions,
    ) -> Result<Vae> {
        let cfg = AeConfig::for_layout(layout)?;
        Self::load_file(&layout.ae, cfg, dtype, dev, opts)
    }

    /// Loads the decoder of `cfg` from the safetensors file `ae` (BFL's names).
    pub fn load_file(
        ae: &Path,
        cfg: AeConfig,
        dtype: DType,
        dev: &Device,
        opts: VaeOptions,
    ) -> Result<Vae> {
        Self::load_file_from(ae, cfg, dtype, dev, opts, &WeightsFrom::files(false))
    }

    /// [`Vae::load_with`] on one device, its weights read from the file (candle's memory-
    /// mapped reader unless `from` says otherwise) or copied from another instance's
    /// ([`mold_exec::weights_copy`]).
    pub fn load_from(
        layout: &WeightsLayout,
        dtype: DType,
        dev: &Device,
        opts: VaeOptions,
        from: &WeightsFrom,
    ) -> Result<Vae> {
        let cfg = AeConfig::for_layout(layout)?;
        Self::load_file_from(&layout.ae, cfg, dtype, dev, opts, from)
    }

    fn load_file_from(
        ae: &Path,
        cfg: AeConfig,
        dtype: DType,
        dev: &Device,
        opts: VaeOptions,
        from: &WeightsFrom,
    ) -> Result<Vae> {
        let dtype = crate::on_device_dtype(dtype, dev);
        let files = [ae.to_path_buf()];
        let weight_bytes = crate::text::weight_bytes(&files, dtype, |n| n.starts_with("decoder."))?;
        let vb = mold_exec::weights_copy::var_builder(&files, dtype, dev, from)?;
        let imp = build(vb, &cfg, dtype, dev, opts)?.map_err(|e| PipelineError::Component {
            component: "vae".into(),
            message: format!(
                "cannot load the decoder from {}: {e} (a config other than FLUX's goes in {})",
                ae.display(),
                crate::layout::AE_CONFIG
            ),
        })?;
        let mut vae = Vae::new(imp, cfg, dtype, dev, weight_bytes);
        vae.peer_copies = opts.peer_copies;
        Ok(vae)
    }

    /// The decoder on each of `devices` for a decode in row bands, one per device
    /// ([`crate::flux::vae_bands`]): always the channels-last decoder (cuDNN's convolutions
    /// where it runs, candle's elsewhere), the only one that runs in bands.
    pub fn load_bands(
        layout: &WeightsLayout,
        dtype: DType,
        devices: &[Device],
        opts: VaeOptions,
    ) -> Result<Vae> {
        let cfg = AeConfig::for_layout(layout)?;
        Self::load_bands_file(&layout.ae, cfg, dtype, devices, opts)
    }

    /// [`Vae::load_bands`] from the autoencoder's file and config.
    pub fn load_bands_file(
        ae: &Path,
        cfg: AeConfig,
        dtype: DType,
        devices: &[Device],
        opts: VaeOptions,
    ) -> Result<Vae> {
        let Some(first) = devices.first() else {
            return Err(PipelineError::Component {
                component: "vae".into(),
                message: "no device to decode on".into(),
            });
        };
        if devices.len() == 1 {
            return Self::load_file(ae, cfg, dtype, first, opts);
        }
        let dtype = crate::on_device_dtype(dtype, first);
        let files = [ae.to_path_buf()];
        let weight_bytes = crate::text::weight_bytes(&files, dtype, |n| n.starts_with("decoder."))?;
        let version = match channels_last(first, dtype, opts.kernels)? {
            Ok(v) => v,
            Err(why) => format!("none, candle's convolutions ({why})"),
        };
        let mut decoders = Vec::with_capacity(devices.len());
        for dev in devices {
            // SAFETY: the file is not modified while mapped (as for every checkpoint).
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, dev)? };
            decoders.push(
                NhwcDecoder::new(&cfg, vb.pp("decoder"), nhwc_options(opts)).map_err(|e| {
                    PipelineError::Component {
                        component: "vae".into(),
                        message: format!("cannot load the decoder from {}: {e}", ae.display()),
                    }
                })?,
            );
        }
        let mut vae = Vae::new(
            Imp::Nhwc(decoders, version),
            cfg,
            dtype,
            first,
            weight_bytes,
        );
        vae.devices = devices.to_vec();
        vae.peer_copies = opts.peer_copies;
        Ok(vae)
    }

    /// The decoder of `cfg` from `vb` (BFL's names under `decoder.`; zero weights for the
    /// calibration's timings), the same choice of implementation as [`Vae::load_with`].
    /// `dtype` must already be the one it computes in on `dev`.
    pub fn from_varbuilder(
        vb: VarBuilder,
        cfg: AeConfig,
        dtype: DType,
        dev: &Device,
        opts: VaeOptions,
        weight_bytes: u64,
    ) -> Result<Vae> {
        let imp = build(vb, &cfg, dtype, dev, opts)?.map_err(|e| PipelineError::Component {
            component: "vae".into(),
            message: format!("cannot build the decoder: {e}"),
        })?;
        Ok(Vae::new(imp, cfg, dtype, dev, weight_bytes))
    }

    fn new(imp: Imp, cfg: AeConfig, dtype: DType, dev: &Device, weight_bytes: u64) -> Vae {
        Vae {
            imp,
            cfg,
            dtype,
            devices: vec![dev.clone()],
            peer_copies: true,
            weight_bytes,
            last: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &AeConfig {
        &self.cfg
    }

    /// Whether the channels-last decoder runs.
    pub fn is_channels_last(&self) -> bool {
        matches!(self.imp, Imp::Nhwc(..))
    }

    /// Latents `(b, 16, h, w)` (any device, any float dtype) → images `(b, 3, 8h, 8w)`
    /// in about [-1, 1], f32 on the VAE's device.
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.decode_marked(latents, None)
    }

    /// [`Vae::decode`], calling `marks` after each operation of the channels-last decoder
    /// (for a per-operation profile; candle's decoder calls it once, at the end).
    pub fn decode_marked(
        &self,
        latents: &Tensor,
        mut marks: crate::flux::vae_nhwc::Marks,
    ) -> Result<Tensor> {
        // The caller keeps `latents` until the decode is done (a peer copy reads it later).
        let z = mold_exec::runtime::hand_off(latents, &self.devices[0], self.peer_copies)?
            .to_dtype(self.dtype)?;
        let z = ((z / self.cfg.scale_factor)? + self.cfg.shift_factor)?;
        let y = match &self.imp {
            Imp::Candle(d, _) => {
                let y = d.forward(&z)?;
                if let Some(m) = marks.as_mut() {
                    m("candle decoder".into(), &y);
                }
                y
            }
            Imp::Nhwc(decoders, _) => {
                let mut stats = DecodeStats::default();
                let bands = Bands::new(&self.devices, self.peer_copies, decoders[0].kernels());
                let refs: Vec<&NhwcDecoder> = decoders.iter().collect();
                let y = NhwcDecoder::forward_bands(&refs, &z, &bands, &mut stats, marks)?;
                *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
                y
            }
        };
        Ok(y.to_dtype(DType::F32)?)
    }

    /// What the channels-last decoder's last decode ran (`None` before one, or with
    /// candle-transformers' decoder).
    pub fn last_stats(&self) -> Option<crate::flux::vae_nhwc::DecodeStats> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One line for the run's report: which decoder ran (for the channels-last one, the
    /// last decode's convolutions per implementation), or why the channels-last one did not.
    pub fn note(&self) -> String {
        match &self.imp {
            Imp::Candle(_, why) => {
                format!("vae: candle-transformers' decoder (channels-last not used: {why})")
            }
            Imp::Nhwc(_, version) => {
                let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
                let Some(s) = last.as_ref() else {
                    return format!("vae: channels-last decoder, cuDNN {version} (not run yet)");
                };
                let bands = match self.devices.len() {
                    1 => String::new(),
                    k => format!(", in {k} row bands (one a device)"),
                };
                s.describe(version, &format!(", mold group norm{bands}"))
            }
        }
    }
}

/// One decoded image `(3, h, w)` in [-1, 1] → interleaved RGB bytes (BFL's
/// `127.5 * (x.clamp(-1, 1) + 1)`, truncated).
pub fn to_rgb8(img: &Tensor) -> Result<(u32, u32, Vec<u8>)> {
    crate::image::rgb8_with(img, |v| {
        let v = if v.is_nan() { 0.0 } else { v.clamp(-1.0, 1.0) };
        (127.5 * (v + 1.0)) as u8
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channels_last_decoder_needs_cuda_and_nvidia_libraries() {
        let cpu = Device::Cpu;
        let why = |k| channels_last(&cpu, DType::BF16, k).unwrap().unwrap_err();
        assert_eq!(why(Kernels::Candle), "MOLD_KERNELS=candle");
        assert_eq!(why(Kernels::Mold), "MOLD_KERNELS=mold");
        assert_eq!(why(Kernels::Auto), "not a CUDA device");
        // A decoder on the host is no refusal of cuDNN, even where MOLD_KERNELS requires it.
        assert_eq!(why(Kernels::Cudnn), "not a CUDA device");
    }
}
