//! FLUX's autoencoder decoder run channels-last: the structure and weights of
//! candle-transformers' `flux::autoencoder::Decoder` (BFL's names: `decoder.conv_in`,
//! `decoder.mid.{block_1,attn_1,block_2}`, `decoder.up.{i}.block.{j}`,
//! `decoder.up.{i}.upsample`, `decoder.norm_out`, `decoder.conv_out`), on the channels-last
//! layers of [`crate::nhwc`] (cuDNN's NHWC convolutions with the bias and each resnet
//! block's residual in the convolution's graph, up-sampling as phase convolutions, the
//! mid attention as products and mold's softmax), with GroupNorm + SiLU as one mold kernel
//! pass after a two-level statistics reduction ([`mold_exec::model::group_norm`]).
//!
//! On several devices the image decodes in row bands, each band on a thread of its own
//! ([`crate::flux::vae_bands`]): every layer below runs on one band, meeting the others
//! through its [`Band`] where the whole image's values are needed.
//!
//! On the CPU (tests) the same code runs candle's convolutions on NCHW views and the group
//! norm as candle ops: the structure is tested against candle-transformers' decoder.

use crate::error::{PipelineError, Result};
use crate::flux::vae::AeConfig;
use crate::flux::vae_bands::{Band, Bands};
use crate::nhwc::{attend, load_err, mark, Conv, Halo, Linear, Upsample};
pub use crate::nhwc::{DecodeStats, Marks, NhwcOptions};
use candle_core::Tensor;
use candle_nn::VarBuilder;
use mold_exec::model::conv::ConvOptions;
use mold_exec::model::group_norm::group_norm_nhwc;

const GROUPS: usize = 32;
const EPS: f32 = 1e-6;

struct Norm {
    gamma: Tensor,
    beta: Tensor,
}

impl Norm {
    fn load(vb: &VarBuilder, c: usize) -> Result<Norm> {
        Ok(Norm {
            gamma: vb.get(c, "weight").map_err(|e| load_err(&vb.prefix(), e))?,
            beta: vb.get(c, "bias").map_err(|e| load_err(&vb.prefix(), e))?,
        })
    }

    fn forward(&self, x: &Tensor, silu: bool, opts: ConvOptions) -> Result<Tensor> {
        Ok(group_norm_nhwc(
            x,
            &self.gamma,
            &self.beta,
            GROUPS,
            EPS,
            silu,
            opts.kernels,
        )?)
    }

    /// The whole image's norm on `band`'s rows `x` (this norm's weights on its device), with
    /// its neighbours' edge rows when `halo`.
    fn forward_band(
        &self,
        x: &Tensor,
        band: &Band,
        silu: bool,
        halo: bool,
        opts: ConvOptions,
    ) -> Result<Halo> {
        band.norm(x, (&self.gamma, &self.beta), GROUPS, EPS, silu, halo, |x| {
            self.forward(x, silu, opts)
        })
    }
}

fn gn_label(x: &Tensor) -> String {
    let d = x.dims();
    format!("group norm {}x{} {}", d[1], d[2], d[3])
}

struct ResBlock {
    norm1: Norm,
    conv1: Conv,
    norm2: Norm,
    conv2: Conv,
    nin_shortcut: Option<Conv>,
}

impl ResBlock {
    fn load(vb: &VarBuilder, cin: usize, cout: usize) -> Result<ResBlock> {
        Ok(ResBlock {
            norm1: Norm::load(&vb.pp("norm1"), cin)?,
            conv1: Conv::load(&vb.pp("conv1"), cin, cout, 3, cout)?,
            norm2: Norm::load(&vb.pp("norm2"), cout)?,
            conv2: Conv::load(&vb.pp("conv2"), cout, cout, 3, cout)?,
            nin_shortcut: if cin == cout {
                None
            } else {
                Some(Conv::load(&vb.pp("nin_shortcut"), cin, cout, 1, cout)?)
            },
        })
    }

    /// This block on `band`'s rows `x` (its weights on the band's device).
    fn forward_band(
        &self,
        x: Tensor,
        band: &Band,
        opts: ConvOptions,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Tensor> {
        let h = self.norm1.forward_band(&x, band, true, true, opts)?;
        mark(m, || gn_label(&x), &h.t);
        let label = self.conv1.label(&h.t);
        let h1 = self.conv1.forward_halo(&h, None, opts, stats)?;
        drop(h);
        mark(m, || label, &h1);
        let h2 = self.norm2.forward_band(&h1, band, true, true, opts)?;
        mark(m, || gn_label(&h1), &h2.t);
        drop(h1);
        let short = match &self.nin_shortcut {
            Some(c) => {
                let s = c.forward(&x, None, opts, stats)?;
                mark(m, || c.label(&x), &s);
                s
            }
            None => x,
        };
        let y = self.conv2.forward_halo(&h2, Some(&short), opts, stats)?;
        mark(m, || self.conv2.label(&h2.t), &y);
        Ok(y)
    }
}

/// The mid block's single-head self-attention over all pixels.
struct Attn {
    norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    proj_out: Linear,
}

impl Attn {
    fn load(vb: &VarBuilder, c: usize) -> Result<Attn> {
        Ok(Attn {
            norm: Norm::load(&vb.pp("norm"), c)?,
            q: Linear::load(&vb.pp("q"), c)?,
            k: Linear::load(&vb.pp("k"), c)?,
            v: Linear::load(&vb.pp("v"), c)?,
            proj_out: Linear::load(&vb.pp("proj_out"), c)?,
        })
    }

    /// This attention on `band`'s rows `x`: its rows' queries against every pixel's keys
    /// and values.
    fn forward_band(
        &self,
        x: Tensor,
        band: &Band,
        opts: ConvOptions,
        m: &mut Marks,
    ) -> Result<Tensor> {
        let hb = self.norm.forward_band(&x, band, false, false, opts)?.t;
        mark(m, || gn_label(&x), &hb);
        let all = band.gather(&hb)?;
        let (n, h, w, c) = x.dims4()?;
        let rows = all.dim(1)?;
        let hb = hb.reshape((n, h * w, c))?;
        let all = all.reshape((n, rows * w, c))?;
        // The scale on q (n·h·w·c elements) rather than on the scores.
        let q = (self.q.forward(&hb, opts)? * (1.0 / (c as f64).sqrt()))?;
        drop(hb);
        let k = self.k.forward(&all, opts)?;
        let v = self.v.forward(&all, opts)?;
        drop(all);
        mark(m, || "attention q/k/v".into(), &v);
        let o = attend(&q, &k, &v, opts)?;
        drop((q, k, v));
        mark(m, || format!("attention softmax(qk)v {}", h * w), &o);
        let y = (self.proj_out.forward(&o, opts)? + x.reshape((n, h * w, c))?)?;
        mark(m, || "attention proj".into(), &y);
        Ok(y.reshape((n, h, w, c))?)
    }
}

/// One resolution of the decoder: its resnet blocks, then (except the last) 2× up-sampling
/// and a 3×3 convolution.
struct Level {
    blocks: Vec<ResBlock>,
    upsample: Option<Upsample>,
}

/// The decoder, channels-last.
pub struct NhwcDecoder {
    conv_in: Conv,
    mid_block_1: ResBlock,
    mid_attn_1: Attn,
    mid_block_2: ResBlock,
    /// In running order (lowest resolution first).
    up: Vec<Level>,
    norm_out: Norm,
    conv_out: Conv,
    out_ch: usize,
    opts: ConvOptions,
}

impl NhwcDecoder {
    /// Loads `cfg`'s decoder from `vb` (at the decoder's prefix, e.g. `vb.pp("decoder")`).
    pub fn new(cfg: &AeConfig, vb: VarBuilder, opts: NhwcOptions) -> Result<NhwcDecoder> {
        let Some(&last) = cfg.ch_mult.last() else {
            return Err(PipelineError::Component {
                component: "vae".into(),
                message: "ch_mult is empty".into(),
            });
        };
        let mut block_in = cfg.ch * last;
        let conv_in = Conv::load(&vb.pp("conv_in"), cfg.z_channels, block_in, 3, block_in)?;
        let mid_block_1 = ResBlock::load(&vb.pp("mid.block_1"), block_in, block_in)?;
        let mid_attn_1 = Attn::load(&vb.pp("mid.attn_1"), block_in)?;
        let mid_block_2 = ResBlock::load(&vb.pp("mid.block_2"), block_in, block_in)?;
        let mut up = Vec::with_capacity(cfg.ch_mult.len());
        for (i, mult) in cfg.ch_mult.iter().enumerate().rev() {
            let block_out = cfg.ch * mult;
            let vl = vb.pp("up").pp(i);
            let mut blocks = Vec::with_capacity(cfg.num_res_blocks + 1);
            for j in 0..=cfg.num_res_blocks {
                blocks.push(ResBlock::load(&vl.pp("block").pp(j), block_in, block_out)?);
                block_in = block_out;
            }
            let upsample = if i != 0 {
                Some(Upsample::new(
                    Conv::load(
                        &vl.pp("upsample").pp("conv"),
                        block_in,
                        block_in,
                        3,
                        block_in,
                    )?,
                    opts.subpixel,
                )?)
            } else {
                None
            };
            up.push(Level { blocks, upsample });
        }
        let norm_out = Norm::load(&vb.pp("norm_out"), block_in)?;
        // Output channels padded to 8 (16 bytes of bf16): cuDNN's engines want aligned rows.
        let conv_out = Conv::load(
            &vb.pp("conv_out"),
            block_in,
            cfg.out_ch,
            3,
            cfg.out_ch.next_multiple_of(8),
        )?;
        Ok(NhwcDecoder {
            conv_in,
            mid_block_1,
            mid_attn_1,
            mid_block_2,
            up,
            norm_out,
            conv_out,
            out_ch: cfg.out_ch,
            opts: opts.conv,
        })
    }

    /// Which kernels run the decode (`MOLD_KERNELS`).
    pub fn kernels(&self) -> mold_exec::Kernels {
        self.opts.kernels
    }

    /// Latents `(n, z, h, w)` (already scaled and shifted) → images `(n, out_ch, 8h, 8w)`
    /// in the weights' dtype; `stats` counts what ran, `m` is called after each operation.
    pub fn forward(&self, z: &Tensor, stats: &mut DecodeStats, m: Marks) -> Result<Tensor> {
        let devices = [z.device().clone()];
        let bands = Bands::new(&devices, true, self.opts.kernels);
        Self::forward_bands(&[self], z, &bands, stats, m)
    }

    /// [`NhwcDecoder::forward`] in row bands, one per device of `bands`, `decoders[b]` holding
    /// the weights on band `b`'s device, each band on a thread of its own
    /// ([`crate::flux::vae_bands`]); the image is joined on the first band's device. One band
    /// runs exactly the one-device decode, on this thread; `m` sees the first band's
    /// operations. `stats` adds up every band's.
    pub fn forward_bands(
        decoders: &[&NhwcDecoder],
        z: &Tensor,
        bands: &Bands,
        stats: &mut DecodeStats,
        mut m: Marks,
    ) -> Result<Tensor> {
        if decoders.is_empty() || decoders.len() != bands.len() {
            return Err(PipelineError::Component {
                component: "vae".into(),
                message: format!("{} decoders for {} bands", decoders.len(), bands.len()),
            });
        }
        let x = z.permute((0, 2, 3, 1))?.contiguous()?;
        mark(&mut m, || "to NHWC".into(), &x);
        let (y, accounts) = bands.run(&x, m, |band, xb, marks| {
            let mut m: Marks = marks.flatten();
            let mut st = DecodeStats::default();
            let t = std::time::Instant::now();
            let y = decoders[band.index()].forward_band(band, xb, &mut st, &mut m)?;
            st.queued_us = t.elapsed().as_micros() as u64;
            if let Some(y) = &y {
                mark(&mut m, || "to NCHW".into(), y);
            }
            Ok((y, st))
        })?;
        for s in accounts {
            stats.add(s);
        }
        Ok(y)
    }

    /// One band's decode: `x` its latent rows `(n, h, w, z)` on its device; the joined
    /// image on band 0, `None` on the others.
    fn forward_band(
        &self,
        band: &Band,
        x: Tensor,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Option<Tensor>> {
        let opts = self.opts;
        let label = self.conv_in.label(&x);
        let hx = band.halo(&x)?;
        drop(x);
        let mut h = self.conv_in.forward_halo(&hx, None, opts, stats)?;
        drop(hx);
        mark(m, || label, &h);
        h = self.mid_block_1.forward_band(h, band, opts, stats, m)?;
        h = self.mid_attn_1.forward_band(h, band, opts, m)?;
        h = self.mid_block_2.forward_band(h, band, opts, stats, m)?;
        for level in &self.up {
            for block in &level.blocks {
                h = block.forward_band(h, band, opts, stats, m)?;
            }
            if let Some(up) = &level.upsample {
                let hx = band.halo(&h)?;
                drop(h);
                h = up.forward(&hx, opts, stats, m)?;
            }
        }
        let hn = self.norm_out.forward_band(&h, band, true, true, opts)?;
        mark(m, || gn_label(&h), &hn.t);
        drop(h);
        let label = self.conv_out.label(&hn.t);
        let y = self.conv_out.forward_halo(&hn, None, opts, stats)?;
        drop(hn);
        let y = y
            .narrow(3, 0, self.out_ch)?
            .permute((0, 3, 1, 2))?
            .contiguous()?;
        mark(m, || label, &y);
        band.join(&y, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Module};
    use candle_nn::VarMap;
    use mold_exec::Kernels;

    /// Random weights for the tiny autoencoder's decoder: normal, scaled by 1/√fan-in, the
    /// group norms' scales near 1 (so activations stay O(1) through every block).
    fn tiny_weights(cfg: &AeConfig) -> VarMap {
        let vm = VarMap::new();
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev).pp("decoder");
        // Materialise every variable through candle-transformers' own constructor, then
        // refill them with scaled random values.
        candle_transformers::models::flux::autoencoder::Decoder::new(&cfg.to_candle(), vb).unwrap();
        let data = vm.data().lock().unwrap();
        for (name, var) in data.iter() {
            let dims = var.dims().to_vec();
            let fan_in: usize = dims.iter().skip(1).product::<usize>().max(1);
            let t = Tensor::randn(0f32, 1f32, dims.as_slice(), &dev).unwrap();
            let v = if name.ends_with(".weight") && dims.len() == 1 {
                ((t * 0.1).unwrap() + 1.0).unwrap()
            } else if name.ends_with(".bias") {
                (t * 0.1).unwrap()
            } else {
                (t / (fan_in as f64).sqrt()).unwrap()
            };
            var.set(&v).unwrap();
        }
        drop(data);
        vm
    }

    /// Default kernels, heuristic engines.
    fn auto(subpixel: bool) -> NhwcOptions {
        NhwcOptions {
            conv: ConvOptions {
                kernels: Kernels::Auto,
                tune: false,
            },
            subpixel,
        }
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap()
    }

    /// The channels-last decoder, with up-sampling as phase convolutions and plain, equals
    /// candle-transformers' decoder on the tiny autoencoder (f32, CPU, random weights), and
    /// reports candle's convolutions.
    #[test]
    fn nhwc_decoder_matches_candle_transformers() {
        let cfg = AeConfig::tiny();
        let vm = tiny_weights(&cfg);
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev).pp("decoder");
        let reference = candle_transformers::models::flux::autoencoder::Decoder::new(
            &cfg.to_candle(),
            vb.clone(),
        )
        .unwrap();
        let z = Tensor::randn(0f32, 1f32, (2, cfg.z_channels, 6, 5), &dev).unwrap();
        let want = reference.forward(&z).unwrap();
        for subpixel in [true, false] {
            let opts = auto(subpixel);
            let ours = NhwcDecoder::new(&cfg, vb.clone(), opts).unwrap();
            let mut stats = DecodeStats::default();
            let mut labels = Vec::new();
            let mut marks = |l: String, _: &Tensor| labels.push(l);
            let got = ours.forward(&z, &mut stats, Some(&mut marks)).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert_eq!(got.dims(), [2, 3, 48, 40]);
            let e = max_rel(&got, &want);
            assert!(e <= 1e-5, "subpixel {subpixel}: max relative error {e}");
            // conv_in, 2 × 2 in the mid blocks, 4 levels × 2 blocks × 2, 3 up-samplings
            // (4 phases each, or one), conv_out; every one on candle (a CPU tensor: no
            // refusal reason).
            let ups = if subpixel { 12 } else { 3 };
            assert_eq!(stats.candle, 1 + 4 + 16 + ups + 1);
            assert_eq!((stats.cudnn, stats.refusals.len()), (0, 0));
            assert!(
                labels.iter().any(|l| l.starts_with("conv3x3 48x40 32->8")),
                "{labels:?}"
            );
            assert_eq!(
                labels.iter().any(|l| l.starts_with("interleave")),
                subpixel,
                "{labels:?}"
            );
        }
    }

    /// The decoder split into 2, 3 and 4 row bands on emulated devices (each with its own
    /// copy of the weights) equals the one-device decode, with up-sampling as phase
    /// convolutions and plain; so do more latent rows than bands by an uneven count.
    #[test]
    fn banded_decode_equals_the_one_device_decode() {
        let cfg = AeConfig::tiny();
        let vm = tiny_weights(&cfg);
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev).pp("decoder");
        let z = Tensor::randn(0f32, 1f32, (1, cfg.z_channels, 7, 5), &dev).unwrap();
        for subpixel in [true, false] {
            let opts = auto(subpixel);
            let one = NhwcDecoder::new(&cfg, vb.clone(), opts).unwrap();
            let mut s1 = DecodeStats::default();
            let want = one.forward(&z, &mut s1, None).unwrap();
            for k in [2, 3, 4] {
                let decoders: Vec<NhwcDecoder> = (0..k)
                    .map(|_| NhwcDecoder::new(&cfg, vb.clone(), opts).unwrap())
                    .collect();
                let refs: Vec<&NhwcDecoder> = decoders.iter().collect();
                let devices = vec![Device::Cpu; k];
                let bands = Bands::new(&devices, true, Kernels::Auto);
                let mut sk = DecodeStats::default();
                let got = NhwcDecoder::forward_bands(&refs, &z, &bands, &mut sk, None).unwrap();
                assert_eq!(got.dims(), want.dims());
                let e = max_rel(&got, &want);
                assert!(e <= 1e-5, "subpixel {subpixel}, {k} bands: {e}");
                // Every band ran every convolution.
                assert_eq!(sk.candle, k as u64 * s1.candle);
            }
        }
    }

    /// A checkpoint missing a tensor names it.
    #[test]
    fn a_missing_tensor_is_named() {
        let cfg = AeConfig::tiny();
        let vm = VarMap::new();
        let dev = Device::Cpu;
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        // An empty var map creates variables on demand; a backend without them fails.
        drop(vb);
        let empty = VarBuilder::from_tensors(Default::default(), DType::F32, &dev).pp("decoder");
        let opts = auto(true);
        let e = NhwcDecoder::new(&cfg, empty, opts)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("decoder.conv_in"), "{e}");
    }
}
