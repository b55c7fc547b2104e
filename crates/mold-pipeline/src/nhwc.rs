//! Channels-last layers of the autoencoders' decoders (FLUX's in [`crate::flux::vae_nhwc`],
//! Qwen-Image's in [`crate::qwen::vae_nhwc`]): activations held as `(n, h, w, c)` so that every
//! convolution runs through cuDNN's NHWC engines.
//!
//! - [`Conv`]: KRSC filters converted once at load, the bias (and a residual) added in the
//!   convolution's graph ([`mold_exec::model::conv::conv2d_nhwc`]); on a band of rows with
//!   its neighbours' edge rows ([`Halo`]) it pads only at the image's own edges;
//! - [`Linear`]: a 1×1 convolution as a matrix product over the pixels (cuBLASLt, the bias
//!   in the epilogue);
//! - [`Upsample`]: nearest 2× up-sampling and the 3×3 convolution after it, by default as
//!   four 2×2 convolutions over the low-resolution input, one per output phase (row and
//!   column parity), whose filters sum the 3×3 taps that land on the same input pixel —
//!   4/9 of the multiply-adds — interleaved into the output;
//! - [`attend`]: one head's `softmax(q kᵀ) v` over all pixels (beyond cuDNN's fused
//!   attention's head sizes) as candle's matmuls and mold's softmax, the queries in slices
//!   that bound the score matrix.
//!
//! On the CPU (tests) the same code runs candle's convolutions on NCHW views.

use crate::error::{PipelineError, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mold_exec::model::conv::{conv2d_nhwc, cudnn_version, ConvGeom, ConvOptions, Fusion, Ran};
use mold_exec::model::gemm;
use mold_exec::model::group_norm::{interleave2x_nhwc, upsample2x_nhwc};
use mold_exec::model::softmax::softmax_last_dim;
use mold_exec::Kernels;

/// Whether the channels-last decoder runs for `dtype` on `dev` under `kernels`: cuDNN's
/// version, else why not (an error where `MOLD_KERNELS=cudnn|fused` requires it). In f32 it
/// runs candle's convolutions (cuDNN's NHWC engines take bf16/f16), in row bands where a
/// large image needs them ([`mold_exec::model::conv::conv2d_nchw`]): candle-transformers'
/// FLUX decoder would unfold a 2048² image's convolutions past what candle launches right.
pub(crate) fn channels_last(
    dev: &Device,
    dtype: DType,
    kernels: Kernels,
) -> Result<std::result::Result<String, String>> {
    let why = if matches!(kernels, Kernels::Candle | Kernels::Mold) {
        format!("MOLD_KERNELS={}", format!("{kernels:?}").to_lowercase())
    } else if !dev.is_cuda() {
        "not a CUDA device".into()
    } else if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        format!("dtype {dtype:?}, not bf16/f16/f32")
    } else {
        match cudnn_version() {
            Ok(v) => return Ok(Ok(v)),
            Err(e) if matches!(kernels, Kernels::Cudnn | Kernels::Fused) => {
                return Err(PipelineError::Component {
                    component: "vae".into(),
                    message: format!(
                        "MOLD_KERNELS={}: the decoder's convolutions need cuDNN: {e}; unset \
                         MOLD_KERNELS to fall back to candle's decoder",
                        format!("{kernels:?}").to_lowercase()
                    ),
                })
            }
            Err(e) => e,
        }
    };
    Ok(Err(why))
}

/// An activation with the neighbours' rows around it: `top` rows above its own and `bottom`
/// below (0 at the image's edges, and everywhere for a whole image).
pub struct Halo {
    pub t: Tensor,
    pub top: usize,
    pub bottom: usize,
}

impl Halo {
    /// An activation without neighbours' rows.
    pub fn bare(t: Tensor) -> Halo {
        Halo {
            t,
            top: 0,
            bottom: 0,
        }
    }
}

/// What ran in one decode: convolutions per implementation, how much of their epilogue
/// cuDNN fused, and why cuDNN was passed over (distinct reasons).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub cudnn: u64,
    /// cuDNN calls whose whole epilogue (bias, and residual where there is one) was fused.
    pub fully_fused: u64,
    pub candle: u64,
    pub refusals: Vec<String>,
    /// Microseconds the host took to queue the decode (with bands, the slowest band's
    /// thread, its waits for the other bands' posts included).
    pub queued_us: u64,
}

impl DecodeStats {
    /// Adds another decode's (another band's) account to this one.
    pub fn add(&mut self, o: DecodeStats) {
        self.cudnn += o.cudnn;
        self.fully_fused += o.fully_fused;
        self.candle += o.candle;
        self.queued_us = self.queued_us.max(o.queued_us);
        for r in o.refusals {
            if !self.refusals.contains(&r) && self.refusals.len() < 8 {
                self.refusals.push(r);
            }
        }
    }

    /// One line for a run's report of a channels-last decode through cuDNN `version`: its
    /// convolutions per implementation, `extra` after cuDNN's (e.g. the norm's kernel).
    pub fn describe(&self, version: &str, extra: &str) -> String {
        let mut line = format!(
            "vae: cudnn {version} conv ({} calls, {} with the bias/residual fused){extra}",
            self.cudnn, self.fully_fused
        );
        if self.candle > 0 {
            line += &format!(
                "; candle conv ({} calls: {})",
                self.candle,
                self.refusals.join("; ")
            );
        }
        line
    }

    pub(crate) fn see(&mut self, ran: Ran, wanted: Fusion) {
        match ran {
            Ran::Cudnn(f) => {
                self.cudnn += 1;
                if f == wanted {
                    self.fully_fused += 1;
                }
            }
            Ran::Candle(why) => {
                self.candle += 1;
                if let Some(w) = why {
                    if !self.refusals.contains(&w) && self.refusals.len() < 8 {
                        self.refusals.push(w);
                    }
                }
            }
        }
    }
}

/// Called after each operation with its label and output (a profiler waits for the device
/// there); `None` runs without marks.
pub type Marks<'a> = Option<&'a mut dyn FnMut(String, &Tensor)>;

pub(crate) fn mark(m: &mut Marks, label: impl FnOnce() -> String, t: &Tensor) {
    if let Some(f) = m.as_mut() {
        f(label(), t);
    }
}

pub(crate) fn load_err(what: &str, e: candle_core::Error) -> PipelineError {
    PipelineError::Component {
        component: "vae".into(),
        message: format!("cannot load {what}: {e}"),
    }
}

/// A convolution: KRSC filters, bias, geometry.
pub(crate) struct Conv {
    pub(crate) w: Tensor,
    pub(crate) b: Tensor,
    pub(crate) geom: ConvGeom,
    pub(crate) size: usize,
}

impl Conv {
    /// `cin → cout` with a `size`×`size` filter (padding `size / 2`), the output channels
    /// padded with zero filters to `cout_padded`.
    pub(crate) fn load(
        vb: &VarBuilder,
        cin: usize,
        cout: usize,
        size: usize,
        cout_padded: usize,
    ) -> Result<Conv> {
        let w = vb
            .get((cout, cin, size, size), "weight")
            .map_err(|e| load_err(&vb.prefix(), e))?;
        let b = vb
            .get(cout, "bias")
            .map_err(|e| load_err(&vb.prefix(), e))?;
        Conv::from_oihw(&w, b, cout_padded)
    }

    /// From PyTorch's layout: `w` `(cout, cin, size, size)`, `b` `(cout)`; the output
    /// channels padded with zero filters to `cout_padded`.
    pub(crate) fn from_oihw(w: &Tensor, b: Tensor, cout_padded: usize) -> Result<Conv> {
        let (cout, _, size, _) = w.dims4()?;
        let mut w = w.permute((0, 2, 3, 1))?.contiguous()?;
        let mut b = b;
        if cout_padded > cout {
            w = w.pad_with_zeros(0, 0, cout_padded - cout)?;
            b = b.pad_with_zeros(0, 0, cout_padded - cout)?;
        }
        Ok(Conv {
            w,
            b,
            geom: ConvGeom::new(size / 2, 1),
            size,
        })
    }

    pub(crate) fn forward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        opts: ConvOptions,
        stats: &mut DecodeStats,
    ) -> Result<Tensor> {
        self.run(x, residual, self.geom, opts, stats)
    }

    /// The convolution with geometry `geom`, counted in `stats`.
    fn run(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        geom: ConvGeom,
        opts: ConvOptions,
        stats: &mut DecodeStats,
    ) -> Result<Tensor> {
        let (y, ran) = conv2d_nhwc(x, &self.w, Some(&self.b), residual, geom, opts)?;
        let wanted = if residual.is_some() {
            Fusion::BiasResidual
        } else {
            Fusion::Bias
        };
        stats.see(ran, wanted);
        Ok(y)
    }

    /// [`Conv::forward`] on a band with its neighbours' rows: the rows the filter reads beyond
    /// the band come from the halo, zeros only at the image's own edges.
    pub(crate) fn forward_halo(
        &self,
        h: &Halo,
        residual: Option<&Tensor>,
        opts: ConvOptions,
        stats: &mut DecodeStats,
    ) -> Result<Tensor> {
        let (need_above, need_below) = (self.geom.pad_pre[0], self.geom.pad_post[0]);
        let own = h.t.dim(1)? - h.top - h.bottom;
        let (above, below) = (h.top.min(need_above), h.bottom.min(need_below));
        let x = if (above, below) == (h.top, h.bottom) {
            h.t.clone()
        } else {
            let x = h.t.narrow(1, h.top - above, above + own + below)?;
            if x.is_contiguous() {
                x
            } else {
                x.contiguous()?
            }
        };
        let geom = ConvGeom {
            pad_pre: [need_above - above, self.geom.pad_pre[1]],
            pad_post: [need_below - below, self.geom.pad_post[1]],
            stride: self.geom.stride,
        };
        self.run(&x, residual, geom, opts, stats)
    }

    pub(crate) fn label(&self, x: &Tensor) -> String {
        let d = x.dims();
        format!(
            "conv{0}x{0} {1}x{2} {3}->{4}",
            self.size,
            d[1],
            d[2],
            d[3],
            self.w.dim(0).unwrap_or(0)
        )
    }
}

/// A 1×1 convolution as a linear layer over the pixels.
pub(crate) struct Linear {
    lin: candle_nn::Linear,
    b: Tensor,
}

impl Linear {
    /// `c → c` from a 1×1 convolution's weights.
    pub(crate) fn load(vb: &VarBuilder, c: usize) -> Result<Linear> {
        Linear::load_to(vb, c, c)
    }

    /// `cin → cout` from a 1×1 convolution's weights.
    pub(crate) fn load_to(vb: &VarBuilder, cin: usize, cout: usize) -> Result<Linear> {
        let w = vb
            .get((cout, cin, 1, 1), "weight")
            .map_err(|e| load_err(&vb.prefix(), e))?
            .reshape((cout, cin))?;
        let b = vb
            .get(cout, "bias")
            .map_err(|e| load_err(&vb.prefix(), e))?;
        Ok(Linear::new(w, b))
    }

    /// From a `(cout, cin)` weight and its bias.
    pub(crate) fn new(w: Tensor, b: Tensor) -> Linear {
        Linear {
            lin: candle_nn::Linear::new(w, None),
            b,
        }
    }

    pub(crate) fn forward(&self, x: &Tensor, opts: ConvOptions) -> Result<Tensor> {
        Ok(gemm::linear(x, &self.lin, &self.b, false, opts.kernels)?)
    }
}

/// Score elements one attention product may hold: 2^28 (512 MiB in bf16), the whole of a
/// 1024² image's; larger images run their queries in slices of as many rows.
const MAX_SCORES: usize = 1 << 28;

/// `softmax(q kᵀ) v` over `(n, l, c)`, the queries in slices so that no score matrix holds
/// more than [`MAX_SCORES`] elements (a 2048² image's would hold 2^32).
pub(crate) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, opts: ConvOptions) -> Result<Tensor> {
    attend_within(q, k, v, opts, MAX_SCORES)
}

/// Score of a padded key: its weight after the softmax is 0 (`exp(-30000)`), and the
/// value is exact in bf16 and f16.
const MASKED: f64 = -30000.0;

/// `q`, `k` and `v` with the keys padded to a multiple of 8 (mold's softmax takes rows of
/// whole 16-byte vectors; Qwen-Image's 1328² latent has 166² = 27 556 pixels): the padded
/// keys and values are zero, and one more channel (padded to 8) holds 1 in every query
/// and [`MASKED`] in each padded key, so their scores are [`MASKED`] and the real ones
/// unchanged.
fn pad_keys(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, lq, c) = q.dims3()?;
    let lk = k.dim(1)?;
    let (lk8, extra) = (lk.next_multiple_of(8), (c + 1).next_multiple_of(8) - c);
    let (dt, dev) = (q.dtype(), q.device());
    let pad_rows = |t: &Tensor| -> Result<Tensor> {
        let z = Tensor::zeros((n, lk8 - lk, c), dt, dev)?;
        Ok(Tensor::cat(&[t, &z], 1)?)
    };
    let ones = Tensor::ones((n, lq, 1), dt, dev)?;
    let q = Tensor::cat(&[q, &ones, &Tensor::zeros((n, lq, extra - 1), dt, dev)?], 2)?;
    let mask: Vec<f32> = (0..lk8)
        .map(|i| if i < lk { 0.0 } else { MASKED as f32 })
        .collect();
    let mask = Tensor::from_vec(mask, (1, lk8, 1), dev)?
        .to_dtype(dt)?
        .broadcast_as((n, lk8, 1))?;
    let k = Tensor::cat(
        &[
            &pad_rows(k)?,
            &mask,
            &Tensor::zeros((n, lk8, extra - 1), dt, dev)?,
        ],
        2,
    )?;
    Ok((q, k, pad_rows(v)?))
}

pub(crate) fn attend_within(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: ConvOptions,
    max_scores: usize,
) -> Result<Tensor> {
    if !k.dim(1)?.is_multiple_of(8) {
        let (q, k, v) = pad_keys(q, k, v)?;
        return attend_within(&q, &k, &v, opts, max_scores);
    }
    let (n, lq, _) = q.dims3()?;
    let lk = k.dim(1)?;
    let rows = (max_scores / (n * lk).max(1)).max(1);
    let one = |q: &Tensor| -> Result<Tensor> {
        let p = softmax_last_dim(&q.matmul(&k.t()?)?, opts.kernels)?;
        Ok(p.matmul(v)?)
    };
    if rows >= lq {
        return one(q);
    }
    let mut out = Vec::with_capacity(lq.div_ceil(rows));
    let mut s = 0;
    while s < lq {
        let len = rows.min(lq - s);
        out.push(one(&q.narrow(1, s, len)?)?);
        s += len;
    }
    Ok(Tensor::cat(&out, 1)?)
}

/// Nearest 2× up-sampling followed by a 3×3 convolution (padding 1).
pub(crate) enum Upsample {
    /// Up-sample, then convolve at full resolution.
    Plain(Conv),
    /// The four output phases `(a, b)` (row, column parity) as 2×2 convolutions of the
    /// low-resolution input: `phases[2a + b]`.
    Subpixel(Box<[Conv; 4]>),
}

impl Upsample {
    /// `conv` (3×3, padding 1) after nearest 2× up-sampling; as four phase convolutions
    /// where `subpixel`.
    pub(crate) fn new(conv: Conv, subpixel: bool) -> Result<Upsample> {
        if !subpixel {
            return Ok(Upsample::Plain(conv));
        }
        // Output row 2i + a reads up-sampled rows 2i + a - 1 ..= 2i + a + 1, which are input
        // rows (i - 1, i, i) for a = 0 and (i, i, i + 1) for a = 1: two taps, the 3×3
        // filter's rows summed where they meet the same input row; likewise for columns.
        let w = conv.w.to_dtype(DType::F32)?; // (k, 3, 3, c)
        let fold = |w: &Tensor, dim: usize, a: usize| -> Result<Tensor> {
            let t = |i| w.narrow(dim, i, 1);
            Ok(if a == 0 {
                Tensor::cat(&[t(0)?, (t(1)? + t(2)?)?], dim)?
            } else {
                Tensor::cat(&[(t(0)? + t(1)?)?, t(2)?], dim)?
            })
        };
        let dtype = conv.w.dtype();
        let mut phases = Vec::with_capacity(4);
        for a in 0..2 {
            let wa = fold(&w, 1, a)?;
            for b in 0..2 {
                let wab = fold(&wa, 2, b)?.to_dtype(dtype)?.contiguous()?;
                phases.push(Conv {
                    w: wab,
                    b: conv.b.clone(),
                    geom: ConvGeom {
                        pad_pre: [1 - a, 1 - b],
                        pad_post: [a, b],
                        stride: [1, 1],
                    },
                    size: 2,
                });
            }
        }
        let phases: [Conv; 4] = phases
            .try_into()
            .unwrap_or_else(|_| unreachable!("four phases"));
        Ok(Upsample::Subpixel(Box::new(phases)))
    }

    /// This up-sampling of `h` (a band with its neighbours' edge rows, or a whole image).
    pub(crate) fn forward(
        &self,
        h: &Halo,
        opts: ConvOptions,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Tensor> {
        Ok(match self {
            Upsample::Plain(c) => {
                let u = upsample2x_nhwc(&h.t, opts.kernels)?;
                mark(m, || format!("upsample {:?}", u.dims()), &u);
                let label = c.label(&u);
                let u = Halo {
                    t: u,
                    top: 2 * h.top,
                    bottom: 2 * h.bottom,
                };
                let y = c.forward_halo(&u, None, opts, stats)?;
                mark(m, || label, &y);
                y
            }
            Upsample::Subpixel(phases) => {
                let mut p = Vec::with_capacity(4);
                for c in phases.iter() {
                    let label = c.label(&h.t);
                    let y = c.forward_halo(h, None, opts, stats)?;
                    mark(m, || format!("{label} (phase)"), &y);
                    p.push(y);
                }
                let y = interleave2x_nhwc([&p[0], &p[1], &p[2], &p[3]], opts.kernels)?;
                drop(p);
                mark(m, || format!("interleave {:?}", y.dims()), &y);
                y
            }
        })
    }
}

/// How the channels-last decoder runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NhwcOptions {
    pub conv: ConvOptions,
    /// Up-sampling + 3×3 convolution as four 2×2 phase convolutions ([`Upsample`]).
    pub subpixel: bool,
}

impl Default for NhwcOptions {
    /// Default kernels, cuDNN's heuristic engines, up-sampling as phase convolutions.
    fn default() -> Self {
        NhwcOptions {
            conv: ConvOptions {
                kernels: Kernels::Auto,
                tune: false,
            },
            subpixel: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use mold_exec::Kernels;

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap()
    }

    /// Attention over many pixels in query slices equals it in one product.
    #[test]
    fn sliced_attention_equals_one_product() {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1f32, (2, 37, 8), &dev).unwrap();
        let k = Tensor::randn(0f32, 1f32, (2, 37, 8), &dev).unwrap();
        let v = Tensor::randn(0f32, 1f32, (2, 37, 8), &dev).unwrap();
        let opts = ConvOptions {
            kernels: Kernels::Auto,
            tune: false,
        };
        let whole = attend_within(&q, &k, &v, opts, usize::MAX).unwrap();
        // 37 keys are padded to 40 and masked: the plain product is the same.
        let plain = candle_nn::ops::softmax_last_dim(&q.matmul(&k.t().unwrap()).unwrap())
            .unwrap()
            .matmul(&v)
            .unwrap();
        assert!(
            max_rel(&whole, &plain) <= 1e-6,
            "{}",
            max_rel(&whole, &plain)
        );
        for max in [1, 74, 75, 600] {
            let sliced = attend_within(&q, &k, &v, opts, max).unwrap();
            let e = max_rel(&sliced, &whole);
            assert!(e <= 1e-6, "max {max}: {e}");
        }
    }
}
