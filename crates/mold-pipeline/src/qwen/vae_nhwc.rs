//! Qwen-Image's VAE decoder (one frame, as [`crate::qwen::vae`] describes it) run
//! channels-last on the layers of [`crate::nhwc`]: every 3×3 and 1×1 convolution through
//! cuDNN's NHWC engines with its bias, and each residual block's shortcut, added in the
//! convolution's graph; the up-samplers' nearest 2× + 3×3 convolution as four phase
//! convolutions; the middle block's single-head attention (384 channels) as products and
//! mold's softmax in the weights' dtype (as diffusers runs it); each RMS norm over the
//! channels and the SiLU after it as one mold kernel pass (`x / ‖x‖₂ · √c · γ` is
//! `x / rms(x) · γ`; [`mold_exec::model::group_norm::rms_norm_channels`]).
//!
//! On the CPU (tests) the same code runs candle's convolutions on NCHW views: it is tested
//! against [`crate::qwen::vae`]'s channels-first decoder.

use crate::error::Result;
use crate::nhwc::Upsample;
use crate::nhwc::{attend, load_err, mark, Conv, DecodeStats, Halo, Linear, Marks, NhwcOptions};
use crate::qwen::vae::{conv as causal_conv, QwenVaeConfig};
use candle_core::{Tensor, D};
use candle_nn::VarBuilder;
use mold_exec::model::conv::ConvOptions;
use mold_exec::model::group_norm::rms_norm_channels;

/// diffusers' `F.normalize(eps=1e-12)`: the norm is at least 1e-12, the mean square
/// (over `c` channels) at least 1e-24 / c; small against any activation a decoder holds.
const MEAN_SQUARE_EPS: f32 = 1e-24;

/// `x / ‖x‖₂ · √c · γ` over the channels (the last dimension), then SiLU where asked.
struct Rms {
    gamma: Tensor,
}

impl Rms {
    fn load(vb: &VarBuilder, c: usize, image: bool) -> Result<Rms> {
        let g = if image {
            vb.get((c, 1, 1), "gamma")
        } else {
            vb.get((c, 1, 1, 1), "gamma")
        };
        Ok(Rms {
            gamma: g.map_err(|e| load_err(&vb.prefix(), e))?.flatten_all()?,
        })
    }

    fn forward(&self, x: &Tensor, silu: bool, opts: ConvOptions) -> Result<Tensor> {
        Ok(rms_norm_channels(
            x,
            &self.gamma,
            MEAN_SQUARE_EPS,
            silu,
            opts.kernels,
        )?)
    }
}

fn norm_label(x: &Tensor) -> String {
    let d = x.dims();
    format!("rms norm {}x{} {}", d[1], d[2], d[3])
}

/// A convolution of the checkpoint (a causal 3-D one as the frame sees it, else 2-D) as a
/// channels-last [`Conv`].
fn conv(vb: &VarBuilder, o: usize, i: usize, k: usize, causal3d: bool) -> Result<Conv> {
    conv_padded(vb, o, i, k, causal3d, o)
}

/// [`conv`] with its output channels padded with zero filters to `o_padded`.
fn conv_padded(
    vb: &VarBuilder,
    o: usize,
    i: usize,
    k: usize,
    causal3d: bool,
    o_padded: usize,
) -> Result<Conv> {
    let c = causal_conv(vb, o, i, k, causal3d).map_err(|e| load_err(&vb.prefix(), e))?;
    let b = c
        .bias()
        .cloned()
        .ok_or_else(|| load_err(&vb.prefix(), candle_core::Error::Msg("no bias".into())))?;
    Conv::from_oihw(c.weight(), b, o_padded)
}

struct ResBlock {
    norm1: Rms,
    conv1: Conv,
    norm2: Rms,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl ResBlock {
    fn load(vb: &VarBuilder, i: usize, o: usize) -> Result<ResBlock> {
        Ok(ResBlock {
            norm1: Rms::load(&vb.pp("norm1"), i, false)?,
            conv1: conv(&vb.pp("conv1"), o, i, 3, true)?,
            norm2: Rms::load(&vb.pp("norm2"), o, false)?,
            conv2: conv(&vb.pp("conv2"), o, o, 3, true)?,
            shortcut: if i != o {
                Some(conv(&vb.pp("conv_shortcut"), o, i, 1, true)?)
            } else {
                None
            },
        })
    }

    fn forward(
        &self,
        x: Tensor,
        opts: ConvOptions,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Tensor> {
        let h = self.norm1.forward(&x, true, opts)?;
        mark(m, || norm_label(&x), &h);
        let label = self.conv1.label(&h);
        let h1 = self.conv1.forward(&h, None, opts, stats)?;
        drop(h);
        mark(m, || label, &h1);
        let h2 = self.norm2.forward(&h1, true, opts)?;
        mark(m, || norm_label(&h1), &h2);
        drop(h1);
        let short = match &self.shortcut {
            Some(c) => {
                let s = c.forward(&x, None, opts, stats)?;
                mark(m, || c.label(&x), &s);
                s
            }
            None => x,
        };
        let y = self.conv2.forward(&h2, Some(&short), opts, stats)?;
        mark(m, || self.conv2.label(&h2), &y);
        Ok(y)
    }
}

/// The middle block's single-head self-attention over all pixels.
struct Attn {
    norm: Rms,
    qkv: Linear,
    proj: Linear,
}

impl Attn {
    fn load(vb: &VarBuilder, c: usize) -> Result<Attn> {
        Ok(Attn {
            norm: Rms::load(&vb.pp("norm"), c, true)?,
            qkv: Linear::load_to(&vb.pp("to_qkv"), c, 3 * c)?,
            proj: Linear::load(&vb.pp("proj"), c)?,
        })
    }

    fn forward(&self, x: Tensor, opts: ConvOptions, m: &mut Marks) -> Result<Tensor> {
        let (n, h, w, c) = x.dims4()?;
        let hn = self.norm.forward(&x, false, opts)?;
        mark(m, || norm_label(&x), &hn);
        let qkv = self.qkv.forward(&hn.reshape((n, h * w, c))?, opts)?;
        drop(hn);
        // The scale on q (n·h·w·c elements) rather than on the scores.
        let q = (qkv.narrow(D::Minus1, 0, c)? * (1.0 / (c as f64).sqrt()))?;
        let k = qkv.narrow(D::Minus1, c, c)?.contiguous()?;
        let v = qkv.narrow(D::Minus1, 2 * c, c)?.contiguous()?;
        drop(qkv);
        mark(m, || "attention q/k/v".into(), &v);
        let o = attend(&q, &k, &v, opts)?;
        drop((q, k, v));
        mark(m, || format!("attention softmax(qk)v {}", h * w), &o);
        let y = (self.proj.forward(&o, opts)? + x.reshape((n, h * w, c))?)?;
        mark(m, || "attention proj".into(), &y);
        Ok(y.reshape((n, h, w, c))?)
    }
}

/// One level of the decoder: its residual blocks, then (except the last) 2× up-sampling
/// with a 3×3 convolution halving the channels.
struct Level {
    resnets: Vec<ResBlock>,
    up: Option<Upsample>,
}

/// Qwen-Image's decoder, channels-last.
pub struct QwenNhwcDecoder {
    post_quant: Conv,
    conv_in: Conv,
    mid: (ResBlock, Attn, ResBlock),
    levels: Vec<Level>,
    norm_out: Rms,
    conv_out: Conv,
    opts: ConvOptions,
}

impl QwenNhwcDecoder {
    /// Loads `cfg`'s decoder from `vb` (diffusers' names at the autoencoder's root:
    /// `post_quant_conv`, `decoder.*`).
    pub fn new(cfg: &QwenVaeConfig, vb: &VarBuilder, opts: NhwcOptions) -> Result<Self> {
        let d = cfg.dims();
        let n_levels = cfg.dim_mult.len();
        let z = cfg.z_dim;
        let vd = vb.pp("decoder");
        let m = vd.pp("mid_block");
        let mut levels = Vec::with_capacity(n_levels);
        for i in 0..n_levels {
            let u = vd.pp(format!("up_blocks.{i}"));
            let b = d[i + 1];
            let mut a = if i > 0 { d[i] / 2 } else { d[i] };
            let mut resnets = Vec::with_capacity(cfg.num_res_blocks + 1);
            for j in 0..=cfg.num_res_blocks {
                resnets.push(ResBlock::load(&u.pp(format!("resnets.{j}")), a, b)?);
                a = b;
            }
            let up = if i != n_levels - 1 {
                let c = conv(&u.pp("upsamplers.0.resample.1"), b / 2, b, 3, false)?;
                Some(Upsample::new(c, opts.subpixel)?)
            } else {
                None
            };
            levels.push(Level { resnets, up });
        }
        let last = d[n_levels];
        Ok(QwenNhwcDecoder {
            post_quant: conv(&vb.pp("post_quant_conv"), z, z, 1, true)?,
            conv_in: conv(&vd.pp("conv_in"), d[0], z, 3, true)?,
            mid: (
                ResBlock::load(&m.pp("resnets.0"), d[0], d[0])?,
                Attn::load(&m.pp("attentions.0"), d[0])?,
                ResBlock::load(&m.pp("resnets.1"), d[0], d[0])?,
            ),
            levels,
            norm_out: Rms::load(&vd.pp("norm_out"), last, false)?,
            // Output channels padded to 8 (16 bytes of bf16): cuDNN's engines want aligned rows.
            conv_out: conv_padded(&vd.pp("conv_out"), 3, last, 3, true, 8)?,
            opts: opts.conv,
        })
    }

    /// Un-normalized latents `(n, z, h, w)` in the weights' dtype → images `(n, 3, 8h, 8w)`
    /// (not clamped); `stats` counts what ran, `m` is called after each operation.
    pub fn forward(&self, z: &Tensor, stats: &mut DecodeStats, mut m: Marks) -> Result<Tensor> {
        let opts = self.opts;
        let m = &mut m;
        let x = z.permute((0, 2, 3, 1))?.contiguous()?;
        mark(m, || "to NHWC".into(), &x);
        let x = self.post_quant.forward(&x, None, opts, stats)?;
        let label = self.conv_in.label(&x);
        let mut x = self.conv_in.forward(&x, None, opts, stats)?;
        mark(m, || label, &x);
        x = self.mid.0.forward(x, opts, stats, m)?;
        x = self.mid.1.forward(x, opts, m)?;
        x = self.mid.2.forward(x, opts, stats, m)?;
        for level in &self.levels {
            for r in &level.resnets {
                x = r.forward(x, opts, stats, m)?;
            }
            if let Some(up) = &level.up {
                let h = Halo::bare(x);
                x = up.forward(&h, opts, stats, m)?;
            }
        }
        let h = self.norm_out.forward(&x, true, opts)?;
        mark(m, || norm_label(&x), &h);
        drop(x);
        let label = self.conv_out.label(&h);
        let y = self.conv_out.forward(&h, None, opts, stats)?;
        let y = y.narrow(3, 0, 3)?.permute((0, 3, 1, 2))?.contiguous()?;
        mark(m, || label, &y);
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qwen::vae::NchwDecoder;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;
    use mold_exec::Kernels;

    /// Random weights for the tiny VAE's decoder: normal, scaled by 1/√fan-in, the norms'
    /// scales near 1, small biases (activations stay O(1) through every block).
    fn tiny_weights(cfg: &QwenVaeConfig) -> VarMap {
        let vm = VarMap::new();
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        for spec in cfg.tensor_specs() {
            if !(spec.name.starts_with("decoder.") || spec.name.starts_with("post_quant_conv.")) {
                continue;
            }
            let fan_in: usize = spec.shape.iter().skip(1).product::<usize>().max(1);
            let t = Tensor::randn(0f32, 1f32, spec.shape.as_slice(), &dev).unwrap();
            let v = if spec.name.ends_with(".gamma") {
                ((t * 0.1).unwrap() + 1.0).unwrap()
            } else if spec.name.ends_with(".bias") {
                (t * 0.1).unwrap()
            } else {
                (t / (fan_in as f64).sqrt()).unwrap()
            };
            let init = candle_nn::Init::Const(0.0);
            vb.get_with_hints(spec.shape.as_slice(), &spec.name, init)
                .unwrap();
            vm.data()
                .lock()
                .unwrap()
                .get(&spec.name)
                .unwrap()
                .set(&v)
                .unwrap();
        }
        vm
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap()
    }

    /// The channels-last decoder, with up-sampling as phase convolutions and plain, equals
    /// the channels-first one on the tiny VAE (f32, CPU, random weights), an odd latent
    /// size included.
    #[test]
    fn channels_last_decoder_matches_the_channels_first_one() {
        let cfg = QwenVaeConfig::tiny();
        let vm = tiny_weights(&cfg);
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let want_decoder = NchwDecoder::load(&cfg, &vb).unwrap();
        let z = Tensor::randn(0f32, 1f32, (1, cfg.z_dim, 5, 7), &dev).unwrap();
        let want = want_decoder.forward(&z).unwrap();
        assert_eq!(want.dims(), [1, 3, 40, 56]);
        for subpixel in [true, false] {
            let opts = NhwcOptions {
                conv: ConvOptions {
                    kernels: Kernels::Auto,
                    tune: false,
                },
                subpixel,
            };
            let ours = QwenNhwcDecoder::new(&cfg, &vb, opts).unwrap();
            let mut stats = DecodeStats::default();
            let mut labels = Vec::new();
            let mut marks = |l: String, _: &Tensor| labels.push(l);
            let got = ours.forward(&z, &mut stats, Some(&mut marks)).unwrap();
            assert_eq!(got.dims(), want.dims());
            let e = max_rel(&got, &want);
            assert!(e <= 1e-5, "subpixel {subpixel}: {e}");
            assert!(stats.candle > 0 && stats.cudnn == 0, "{stats:?}");
            assert!(
                labels.iter().any(|l| l.starts_with("attention")),
                "{labels:?}"
            );
        }
    }

    /// A checkpoint missing a tensor names it.
    #[test]
    fn a_missing_tensor_is_named() {
        let cfg = QwenVaeConfig::tiny();
        let dev = Device::Cpu;
        let empty = VarBuilder::from_tensors(Default::default(), DType::F32, &dev);
        let e = QwenNhwcDecoder::new(&cfg, &empty, NhwcOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("decoder."), "{e}");
    }
}
