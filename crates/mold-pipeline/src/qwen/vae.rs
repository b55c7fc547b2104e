//! Qwen-Image's VAE decoder (diffusers `AutoencoderKLQwenImage`, the Wan-2.1 causal 3-D
//! convolutional VAE) for one frame, latents to RGB.
//!
//! On a single frame the causal 3-D VAE is a 2-D one: a causal 3×3×3 convolution pads
//! two zero frames in front, so only its last temporal slice `weight[:, :, 2]` meets
//! the frame; the 1×1×1 ones are 1×1 convolutions; the up-samplers' temporal
//! convolutions (`time_conv`) do not run on the first frame. The latents are first
//! un-normalized per channel (`z · latents_std + latents_mean`), then
//! `post_quant_conv`, the decoder (RMS norms over channels, SiLU, one single-head
//! attention in the middle block, nearest 2× up-sampling), and clamped to [-1, 1].

use crate::error::{PipelineError, Result};
use crate::nhwc::{channels_last, DecodeStats, Marks, NhwcOptions};
use crate::qwen::vae_nhwc::QwenNhwcDecoder;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, VarBuilder};
use mold_exec::model::conv::conv2d_nchw;
use mold_exec::TensorSpec;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// `vae/config.json` (the fields the decoder reads; diffusers' defaults are Qwen-Image's).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct QwenVaeConfig {
    #[serde(default = "default_base_dim")]
    pub base_dim: usize,
    #[serde(default = "default_z_dim")]
    pub z_dim: usize,
    #[serde(default = "default_dim_mult")]
    pub dim_mult: Vec<usize>,
    #[serde(default = "default_num_res_blocks")]
    pub num_res_blocks: usize,
    #[serde(default)]
    pub attn_scales: Vec<f64>,
    #[serde(default = "default_temperal_downsample")]
    pub temperal_downsample: Vec<bool>,
    #[serde(default = "default_input_channels")]
    pub input_channels: usize,
    #[serde(default = "default_latents_mean")]
    pub latents_mean: Vec<f64>,
    #[serde(default = "default_latents_std")]
    pub latents_std: Vec<f64>,
}

fn default_base_dim() -> usize {
    96
}
fn default_z_dim() -> usize {
    16
}
fn default_dim_mult() -> Vec<usize> {
    vec![1, 2, 4, 4]
}
fn default_num_res_blocks() -> usize {
    2
}
fn default_temperal_downsample() -> Vec<bool> {
    vec![false, true, true]
}
fn default_input_channels() -> usize {
    3
}
fn default_latents_mean() -> Vec<f64> {
    vec![
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
        0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ]
}
fn default_latents_std() -> Vec<f64> {
    vec![
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
        1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
    ]
}

impl QwenVaeConfig {
    /// Qwen-Image's VAE (diffusers' defaults).
    pub fn qwen_image() -> QwenVaeConfig {
        serde_json::from_value(serde_json::json!({})).expect("defaults")
    }

    /// A tiny VAE of the same structure (8× up-sampling, 16 latent channels, Qwen-Image's
    /// latent statistics), for tests.
    pub fn tiny() -> QwenVaeConfig {
        QwenVaeConfig {
            base_dim: 8,
            dim_mult: vec![1, 1, 1, 1],
            num_res_blocks: 1,
            ..QwenVaeConfig::qwen_image()
        }
    }

    /// Reads and checks `config.json`.
    pub fn read(path: &Path) -> Result<QwenVaeConfig> {
        let text = std::fs::read_to_string(path).map_err(PipelineError::io(path))?;
        let c: QwenVaeConfig = serde_json::from_str(&text).map_err(|e| PipelineError::Config {
            path: path.display().to_string(),
            message: format!("not an AutoencoderKLQwenImage config: {e}"),
        })?;
        c.check().map_err(|message| PipelineError::Config {
            path: path.display().to_string(),
            message,
        })?;
        Ok(c)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let levels = self.dim_mult.len();
        if levels < 2 || self.base_dim == 0 || self.dim_mult.contains(&0) || self.z_dim == 0 {
            return Err(format!(
                "base_dim {}, z_dim {}, dim_mult {:?}: need positive sizes and at least 2 levels",
                self.base_dim, self.z_dim, self.dim_mult
            ));
        }
        if self.temperal_downsample.len() != levels - 1 {
            return Err(format!(
                "temperal_downsample has {} entries; dim_mult's {levels} levels need {}",
                self.temperal_downsample.len(),
                levels - 1
            ));
        }
        // Up-samplers halve the channels: each level's width must be even.
        if self.dims().iter().any(|d| d % 2 == 1) {
            return Err(format!(
                "base_dim {} × dim_mult {:?} gives odd widths; the up-samplers halve them",
                self.base_dim, self.dim_mult
            ));
        }
        for (name, v) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if v.len() != self.z_dim {
                return Err(format!(
                    "{name} has {} values, z_dim is {}",
                    v.len(),
                    self.z_dim
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(format!("{name} has a value that is not finite"));
            }
        }
        if self.latents_std.iter().any(|s| *s <= 0.0) {
            return Err("latents_std must be positive".into());
        }
        if self.input_channels != 3 {
            return Err(format!(
                "input_channels {}: the pipeline writes RGB images (3)",
                self.input_channels
            ));
        }
        Ok(())
    }

    /// The decoder's widths: the top one, then each level's from the bottom up.
    pub(crate) fn dims(&self) -> Vec<usize> {
        let top = self.base_dim * self.dim_mult[self.dim_mult.len() - 1];
        std::iter::once(top)
            .chain(self.dim_mult.iter().rev().map(|m| self.base_dim * m))
            .collect()
    }

    /// Spatial up-sampling of the decoder (8 for Qwen-Image).
    pub fn scale(&self) -> usize {
        1 << (self.dim_mult.len() - 1)
    }

    /// The widest feature map the decoder holds at full resolution (its last level).
    pub fn top_channels(&self) -> usize {
        self.base_dim * self.dim_mult[0]
    }

    /// Every tensor of the autoencoder's checkpoint (diffusers names; encoder and
    /// decoder) with its shape.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let z = self.z_dim;
        let spec = |out: &mut Vec<TensorSpec>, name: String, shape: Vec<usize>| {
            out.push(TensorSpec { name, shape })
        };
        let conv3 = |out: &mut Vec<TensorSpec>, p: &str, o: usize, i: usize, k: [usize; 3]| {
            spec(out, format!("{p}.weight"), vec![o, i, k[0], k[1], k[2]]);
            spec(out, format!("{p}.bias"), vec![o]);
        };
        let conv2 = |out: &mut Vec<TensorSpec>, p: &str, o: usize, i: usize, k: usize| {
            spec(out, format!("{p}.weight"), vec![o, i, k, k]);
            spec(out, format!("{p}.bias"), vec![o]);
        };
        let res = |out: &mut Vec<TensorSpec>, p: &str, i: usize, o: usize| {
            spec(out, format!("{p}.norm1.gamma"), vec![i, 1, 1, 1]);
            conv3(out, &format!("{p}.conv1"), o, i, [3, 3, 3]);
            spec(out, format!("{p}.norm2.gamma"), vec![o, 1, 1, 1]);
            conv3(out, &format!("{p}.conv2"), o, o, [3, 3, 3]);
            if i != o {
                conv3(out, &format!("{p}.conv_shortcut"), o, i, [1, 1, 1]);
            }
        };
        let attn = |out: &mut Vec<TensorSpec>, p: &str, c: usize| {
            spec(out, format!("{p}.norm.gamma"), vec![c, 1, 1]);
            conv2(out, &format!("{p}.to_qkv"), 3 * c, c, 1);
            conv2(out, &format!("{p}.proj"), c, c, 1);
        };
        let mid = |out: &mut Vec<TensorSpec>, p: &str, c: usize| {
            res(out, &format!("{p}.resnets.0"), c, c);
            attn(out, &format!("{p}.attentions.0"), c);
            res(out, &format!("{p}.resnets.1"), c, c);
        };
        // Encoder (diffusers' `QwenImageEncoder3d`, z_dim × 2 outputs).
        let levels = self.dim_mult.len();
        let edims: Vec<usize> = std::iter::once(self.base_dim)
            .chain(self.dim_mult.iter().map(|m| self.base_dim * m))
            .collect();
        conv3(&mut out, "encoder.conv_in", edims[0], 3, [3, 3, 3]);
        let mut k = 0;
        for i in 0..levels {
            let (mut a, b) = (edims[i], edims[i + 1]);
            for _ in 0..self.num_res_blocks {
                res(&mut out, &format!("encoder.down_blocks.{k}"), a, b);
                k += 1;
                a = b;
            }
            if i != levels - 1 {
                let p = format!("encoder.down_blocks.{k}");
                conv2(&mut out, &format!("{p}.resample.1"), b, b, 3);
                if self.temperal_downsample[i] {
                    conv3(&mut out, &format!("{p}.time_conv"), b, b, [3, 1, 1]);
                }
                k += 1;
            }
        }
        let top = edims[levels];
        mid(&mut out, "encoder.mid_block", top);
        spec(
            &mut out,
            "encoder.norm_out.gamma".into(),
            vec![top, 1, 1, 1],
        );
        conv3(&mut out, "encoder.conv_out", 2 * z, top, [3, 3, 3]);
        conv3(&mut out, "quant_conv", 2 * z, 2 * z, [1, 1, 1]);
        conv3(&mut out, "post_quant_conv", z, z, [1, 1, 1]);
        // Decoder.
        let d = self.dims();
        conv3(&mut out, "decoder.conv_in", d[0], z, [3, 3, 3]);
        mid(&mut out, "decoder.mid_block", d[0]);
        let up_t: Vec<bool> = self.temperal_downsample.iter().rev().copied().collect();
        for i in 0..levels {
            let a0 = if i > 0 { d[i] / 2 } else { d[i] };
            let b = d[i + 1];
            let mut a = a0;
            for j in 0..=self.num_res_blocks {
                res(
                    &mut out,
                    &format!("decoder.up_blocks.{i}.resnets.{j}"),
                    a,
                    b,
                );
                a = b;
            }
            if i != levels - 1 {
                let p = format!("decoder.up_blocks.{i}.upsamplers.0");
                conv2(&mut out, &format!("{p}.resample.1"), b / 2, b, 3);
                if up_t[i] {
                    conv3(&mut out, &format!("{p}.time_conv"), b * 2, b, [3, 1, 1]);
                }
            }
        }
        let last = d[levels];
        spec(
            &mut out,
            "decoder.norm_out.gamma".into(),
            vec![last, 1, 1, 1],
        );
        conv3(&mut out, "decoder.conv_out", 3, last, [3, 3, 3]);
        out
    }

    /// diffusers' `vae/config.json` for this config.
    pub fn diffusers_config(&self) -> serde_json::Value {
        serde_json::json!({
            "_class_name": "AutoencoderKLQwenImage",
            "attn_scales": self.attn_scales,
            "base_dim": self.base_dim,
            "dim_mult": self.dim_mult,
            "dropout": 0.0,
            "input_channels": self.input_channels,
            "latents_mean": self.latents_mean,
            "latents_std": self.latents_std,
            "num_res_blocks": self.num_res_blocks,
            "temperal_downsample": self.temperal_downsample,
            "z_dim": self.z_dim,
        })
    }
}

/// The VAE's files: `config.json` and its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QwenVaeFiles {
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
}

/// A convolution of the checkpoint as the 2-D one a single frame sees.
pub(crate) fn conv(
    vb: &VarBuilder,
    o: usize,
    i: usize,
    k: usize,
    causal3d: bool,
) -> candle_core::Result<Conv2d> {
    let w = if causal3d {
        // Causal padding puts two zero frames before the one frame: only the last
        // temporal slice of a 3-frame kernel (the only slice of a 1-frame one) meets it.
        let kt = if k == 1 { 1 } else { 3 };
        vb.get((o, i, kt, k, k), "weight")?
            .narrow(2, kt - 1, 1)?
            .squeeze(2)?
            .contiguous()?
    } else {
        vb.get((o, i, k, k), "weight")?
    };
    let b = vb.get(o, "bias")?;
    Ok(Conv2d::new(
        w,
        Some(b),
        Conv2dConfig {
            padding: k / 2,
            ..Default::default()
        },
    ))
}

/// `c`'s convolution through [`conv2d_nchw`]: on CUDA a large image's in bands of rows, where
/// candle's whole convolution would unfold its input past [`UNFOLD_LIMIT`] elements and come
/// out wrong (seen at 2048²).
///
/// [`UNFOLD_LIMIT`]: mold_exec::model::conv::UNFOLD_LIMIT
fn fwd(c: &Conv2d, x: &Tensor) -> candle_core::Result<Tensor> {
    let y = conv2d_nchw(x, c.weight(), c.config().padding)?;
    match c.bias() {
        Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?),
        None => Ok(y),
    }
}

/// diffusers' `QwenImageRMS_norm`: `x / ‖x‖₂ · √c · γ` over the channels (dim 1),
/// normalized in f32.
struct ChannelRms {
    gamma: Tensor,
    scale: f64,
}

impl ChannelRms {
    fn load(vb: &VarBuilder, c: usize, image: bool) -> candle_core::Result<Self> {
        let gamma = if image {
            vb.get((c, 1, 1), "gamma")?
        } else {
            vb.get((c, 1, 1, 1), "gamma")?.squeeze(3)?
        };
        Ok(ChannelRms {
            gamma,
            scale: (c as f64).sqrt(),
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dt = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let norm = xf.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
        let y = xf.broadcast_div(&norm)?.to_dtype(dt)?;
        (y * self.scale)?.broadcast_mul(&self.gamma)
    }
}

struct ResBlock {
    norm1: ChannelRms,
    conv1: Conv2d,
    norm2: ChannelRms,
    conv2: Conv2d,
    shortcut: Option<Conv2d>,
}

impl ResBlock {
    fn load(vb: &VarBuilder, i: usize, o: usize) -> candle_core::Result<Self> {
        Ok(ResBlock {
            norm1: ChannelRms::load(&vb.pp("norm1"), i, false)?,
            conv1: conv(&vb.pp("conv1"), o, i, 3, true)?,
            norm2: ChannelRms::load(&vb.pp("norm2"), o, false)?,
            conv2: conv(&vb.pp("conv2"), o, o, 3, true)?,
            shortcut: if i != o {
                Some(conv(&vb.pp("conv_shortcut"), o, i, 1, true)?)
            } else {
                None
            },
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = match &self.shortcut {
            Some(s) => fwd(s, x)?,
            None => x.clone(),
        };
        let y = candle_nn::ops::silu(&self.norm1.forward(x)?)?;
        let y = fwd(&self.conv1, &y)?;
        let y = candle_nn::ops::silu(&self.norm2.forward(&y)?)?;
        fwd(&self.conv2, &y)? + h
    }
}

/// Query rows per attention chunk: bounds the score matrix at this many rows × h·w
/// (at 1328×1328, 4096 × 27 556 f32 values, 450 MB).
const ATTN_ROWS: usize = 4096;

struct Attention {
    norm: ChannelRms,
    qkv: Conv2d,
    proj: Conv2d,
}

impl Attention {
    fn load(vb: &VarBuilder, c: usize) -> candle_core::Result<Self> {
        Ok(Attention {
            norm: ChannelRms::load(&vb.pp("norm"), c, true)?,
            qkv: conv(&vb.pp("to_qkv"), 3 * c, c, 1, false)?,
            proj: conv(&vb.pp("proj"), c, c, 1, false)?,
        })
    }

    /// One head over the h·w positions (scale 1/√c), in f32, queries in chunks.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let n = h * w;
        let qkv = fwd(&self.qkv, &self.norm.forward(x)?)?
            .reshape((b, 3 * c, n))?
            .transpose(1, 2)?
            .to_dtype(DType::F32)?;
        let q = qkv.narrow(2, 0, c)?;
        let k = qkv.narrow(2, c, c)?.contiguous()?;
        let v = qkv.narrow(2, 2 * c, c)?.contiguous()?;
        let kt = k.transpose(1, 2)?.contiguous()?;
        let scale = 1.0 / (c as f64).sqrt();
        let mut outs = Vec::new();
        let mut start = 0;
        while start < n {
            let rows = ATTN_ROWS.min(n - start);
            let qc = q.narrow(1, start, rows)?.contiguous()?;
            let s = (qc.matmul(&kt)? * scale)?;
            let p = candle_nn::ops::softmax_last_dim(&s)?;
            outs.push(p.matmul(&v)?);
            start += rows;
        }
        let o = Tensor::cat(&outs, 1)?
            .transpose(1, 2)?
            .reshape((b, c, h, w))?
            .to_dtype(x.dtype())?;
        fwd(&self.proj, &o)? + x
    }
}

struct UpBlock {
    resnets: Vec<ResBlock>,
    /// Nearest 2× then a 3×3 convolution halving the channels.
    up: Option<Conv2d>,
}

/// The channels-first decoder on candle's operations (where cuDNN's channels-last one
/// does not run: the CPU, f32, `MOLD_KERNELS=candle|mold`).
pub(crate) struct NchwDecoder {
    post_quant: Conv2d,
    conv_in: Conv2d,
    mid: (ResBlock, Attention, ResBlock),
    ups: Vec<UpBlock>,
    norm_out: ChannelRms,
    conv_out: Conv2d,
}

impl NchwDecoder {
    pub(crate) fn load(cfg: &QwenVaeConfig, vb: &VarBuilder) -> candle_core::Result<NchwDecoder> {
        let d = cfg.dims();
        let levels = cfg.dim_mult.len();
        let z = cfg.z_dim;
        let post_quant = conv(&vb.pp("post_quant_conv"), z, z, 1, true)?;
        let vd = vb.pp("decoder");
        let conv_in = conv(&vd.pp("conv_in"), d[0], z, 3, true)?;
        let m = vd.pp("mid_block");
        let mid = (
            ResBlock::load(&m.pp("resnets.0"), d[0], d[0])?,
            Attention::load(&m.pp("attentions.0"), d[0])?,
            ResBlock::load(&m.pp("resnets.1"), d[0], d[0])?,
        );
        let mut ups = Vec::new();
        for i in 0..levels {
            let u = vd.pp(format!("up_blocks.{i}"));
            let b = d[i + 1];
            let mut a = if i > 0 { d[i] / 2 } else { d[i] };
            let mut resnets = Vec::new();
            for j in 0..=cfg.num_res_blocks {
                resnets.push(ResBlock::load(&u.pp(format!("resnets.{j}")), a, b)?);
                a = b;
            }
            let up = if i != levels - 1 {
                Some(conv(&u.pp("upsamplers.0.resample.1"), b / 2, b, 3, false)?)
            } else {
                None
            };
            ups.push(UpBlock { resnets, up });
        }
        let norm_out = ChannelRms::load(&vd.pp("norm_out"), d[levels], false)?;
        let conv_out = conv(&vd.pp("conv_out"), 3, d[levels], 3, true)?;
        Ok(NchwDecoder {
            post_quant,
            conv_in,
            mid,
            ups,
            norm_out,
            conv_out,
        })
    }

    /// Un-normalized latents `(b, z, h, w)` → images `(b, 3, 8h, 8w)`, not clamped.
    pub(crate) fn forward(&self, z: &Tensor) -> candle_core::Result<Tensor> {
        let x = fwd(&self.post_quant, z)?;
        let mut x = fwd(&self.conv_in, &x)?;
        x = self.mid.0.forward(&x)?;
        x = self.mid.1.forward(&x)?;
        x = self.mid.2.forward(&x)?;
        for u in &self.ups {
            for r in &u.resnets {
                x = r.forward(&x)?;
            }
            if let Some(c) = &u.up {
                let (_, _, h, w) = x.dims4()?;
                x = fwd(c, &x.upsample_nearest2d(2 * h, 2 * w)?)?;
            }
        }
        let x = candle_nn::ops::silu(&self.norm_out.forward(&x)?)?;
        fwd(&self.conv_out, &x)
    }
}

enum Imp {
    /// Channels-first on candle's operations; why the channels-last decoder is not used.
    Nchw(Box<NchwDecoder>, String),
    /// Channels-last through cuDNN ([`crate::qwen::vae_nhwc`]), and cuDNN's version.
    Nhwc(Box<QwenNhwcDecoder>, String),
}

/// The decoder, ready to run on its device.
pub struct QwenVae {
    cfg: QwenVaeConfig,
    imp: Imp,
    mean: Tensor,
    std: Tensor,
    dtype: DType,
    device: Device,
    pub weight_bytes: u64,
    /// What the channels-last decoder's last decode ran.
    last: Mutex<Option<DecodeStats>>,
}

impl QwenVae {
    /// Loads the decoder in `dtype` with the default options ([`QwenVae::load_with`]).
    pub fn load(files: &QwenVaeFiles, dtype: DType, dev: &Device) -> Result<QwenVae> {
        Self::load_with(files, dtype, dev, NhwcOptions::default())
    }

    /// Loads the decoder in `dtype` (f32 for bf16 on the host): channels-last through cuDNN
    /// where `opts.conv.kernels`, the device and the dtype allow it
    /// ([`crate::nhwc::channels_last`]), else on candle's operations.
    pub fn load_with(
        files: &QwenVaeFiles,
        dtype: DType,
        dev: &Device,
        opts: NhwcOptions,
    ) -> Result<QwenVae> {
        // Candle's CPU matrix products have no bf16: on the host a bf16 decoder computes in
        // f32 (else it would fail at decode, after denoising).
        let dtype = crate::on_device_dtype(dtype, dev);
        let cfg = QwenVaeConfig::read(&files.config)?;
        let weight_bytes = crate::text::weight_bytes(&files.weights, dtype, |n| {
            n.starts_with("decoder.") || n.starts_with("post_quant_conv.")
        })?;
        // SAFETY: mapped read-only; the files must not change while loading.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, dev)? };
        let source = format!(
            "{} (its config is {})",
            files
                .weights
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            files.config.display()
        );
        Self::from_varbuilder(cfg, vb, dtype, dev, opts, weight_bytes, &source)
    }

    /// The decoder of `cfg` from `vb` (rooted where `decoder.` and `post_quant_conv.` live)
    /// in `dtype` on `dev`, as [`QwenVae::load_with`] builds it (`weight_bytes`: what it
    /// holds, for the run's accounting; `source`: where the weights come from, for a load
    /// failure's message).
    pub fn from_varbuilder(
        cfg: QwenVaeConfig,
        vb: VarBuilder,
        dtype: DType,
        dev: &Device,
        opts: NhwcOptions,
        weight_bytes: u64,
        source: &str,
    ) -> Result<QwenVae> {
        let dtype = crate::on_device_dtype(dtype, dev);
        let fail = |e: String| PipelineError::Component {
            component: "vae".into(),
            message: format!("cannot load the decoder from {source}: {e}"),
        };
        let imp = match channels_last(dev, dtype, opts.conv.kernels)? {
            Ok(version) => QwenNhwcDecoder::new(&cfg, &vb, opts)
                .map(|d| Imp::Nhwc(Box::new(d), version))
                .map_err(|e| fail(e.to_string()))?,
            Err(why) => NchwDecoder::load(&cfg, &vb)
                .map(|d| Imp::Nchw(Box::new(d), why))
                .map_err(|e| fail(e.to_string()))?,
        };
        let z = cfg.z_dim;
        let stat = |v: &[f64]| -> candle_core::Result<Tensor> {
            let v: Vec<f32> = v.iter().map(|x| *x as f32).collect();
            Tensor::from_vec(v, (1, z, 1, 1), dev)
        };
        Ok(QwenVae {
            mean: stat(&cfg.latents_mean)?,
            std: stat(&cfg.latents_std)?,
            cfg,
            imp,
            dtype,
            device: dev.clone(),
            weight_bytes,
            last: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &QwenVaeConfig {
        &self.cfg
    }

    /// Normalized latents `(b, z, h, w)` (any device, any float dtype) → images
    /// `(b, 3, 8h, 8w)` in [-1, 1], f32 on the VAE's device.
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.decode_marked(latents, None)
    }

    /// [`QwenVae::decode`], calling `marks` after each operation of the channels-last
    /// decoder (for a per-operation profile; the channels-first one calls it once).
    pub fn decode_marked(&self, latents: &Tensor, mut marks: Marks) -> Result<Tensor> {
        let z = mold_exec::runtime::hand_off_ordered(latents, &self.device, true)?
            .to_dtype(DType::F32)?;
        let z = z.broadcast_mul(&self.std)?.broadcast_add(&self.mean)?;
        let z = z.to_dtype(self.dtype)?;
        let x = match &self.imp {
            Imp::Nchw(d, _) => {
                let x = d.forward(&z)?;
                if let Some(m) = marks.as_mut() {
                    m("channels-first decoder".into(), &x);
                }
                x
            }
            Imp::Nhwc(d, _) => {
                let mut stats = DecodeStats::default();
                let x = d.forward(&z, &mut stats, marks)?;
                *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
                x
            }
        };
        Ok(x.to_dtype(DType::F32)?.clamp(-1f32, 1f32)?)
    }

    /// One line for the run's report: which decoder ran (for the channels-last one, the
    /// last decode's convolutions per implementation), or why the channels-last one did not.
    pub fn note(&self) -> String {
        match &self.imp {
            Imp::Nchw(_, why) => {
                format!("vae: candle's channels-first decoder (channels-last not used: {why})")
            }
            Imp::Nhwc(_, version) => {
                let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
                let Some(s) = last.as_ref() else {
                    return format!("vae: channels-last decoder, cuDNN {version} (not run yet)");
                };
                s.describe(version, ", mold RMS norm")
            }
        }
    }
}

/// One decoded image `(3, h, w)` in [-1, 1] → interleaved RGB bytes, as diffusers'
/// `VaeImageProcessor.postprocess` makes them: `round(255 · (x / 2 + 0.5))`.
pub fn to_rgb8(img: &Tensor) -> Result<(u32, u32, Vec<u8>)> {
    crate::image::rgb8_with(img, |v| {
        let v = if v.is_nan() { 0.0 } else { v };
        ((v / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0).round() as u8
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published VAE: 16 latent channels, 8× up-sampling, and its decoder's and
    /// encoder's parameter counts (diffusers' `AutoencoderKLQwenImage()`: 126.9 M in
    /// all).
    #[test]
    fn qwen_image_vae_shapes() {
        let c = QwenVaeConfig::qwen_image();
        c.check().unwrap();
        assert_eq!((c.z_dim, c.scale(), c.top_channels()), (16, 8, 96));
        let n: usize = c
            .tensor_specs()
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        assert!((126_000_000..128_000_000).contains(&n), "{n}");
        let tiny = QwenVaeConfig::tiny();
        tiny.check().unwrap();
        assert_eq!(tiny.scale(), 8);
    }

    #[test]
    fn config_refusals_name_the_field() {
        let mut c = QwenVaeConfig::qwen_image();
        c.latents_std.pop();
        assert!(c.check().unwrap_err().contains("latents_std has 15 values"));
        let mut c = QwenVaeConfig::qwen_image();
        c.temperal_downsample.push(true);
        assert!(c.check().unwrap_err().contains("temperal_downsample"));
    }

    #[test]
    fn rgb_rounds_as_diffusers() {
        let t = Tensor::new(&[-1f32, 0.0, 1.0], &Device::Cpu)
            .unwrap()
            .reshape((3, 1, 1))
            .unwrap();
        let (_, _, px) = to_rgb8(&t).unwrap();
        assert_eq!(px, vec![0, 128, 255]);
    }
}
