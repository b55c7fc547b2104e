//! FLUX's autoencoder decoder run channels-last: the structure and weights of
//! candle-transformers' `flux::autoencoder::Decoder` (BFL's names: `decoder.conv_in`,
//! `decoder.mid.{block_1,attn_1,block_2}`, `decoder.up.{i}.block.{j}`,
//! `decoder.up.{i}.upsample`, `decoder.norm_out`, `decoder.conv_out`), with activations held
//! as `(n, h, w, c)` so that every 3×3 convolution runs through cuDNN's NHWC engines.
//!
//! - convolutions: [`mold_exec::model::conv::conv2d_nhwc`], filters converted to KRSC once
//!   at load; each bias, and each resnet block's residual, added in the convolution's graph;
//! - GroupNorm + SiLU: one mold kernel pass after a two-level statistics reduction
//!   ([`mold_exec::model::group_norm`]);
//! - nearest 2× up-sampling and the 3×3 convolution after it: by default as four 2×2
//!   convolutions over the low-resolution input, one per output phase (row and column
//!   parity), whose filters sum the 3×3 taps that land on the same input pixel — 4/9 of the
//!   multiply-adds — interleaved into the output; else (`subpixel` off) one mold kernel
//!   up-samples and the 3×3 convolution runs at full resolution;
//! - the mid attention (one head of 512 channels, beyond cuDNN's fused attention): its
//!   1×1 q/k/v/projection convolutions as matrix products (cuBLASLt with the bias in the
//!   epilogue), `softmax(q kᵀ / √c) v` as candle's matmuls and mold's softmax kernel (a
//!   16384-element row per block, read and written once).
//!
//! On the CPU (tests) the same code runs candle's convolutions on NCHW views and the group
//! norm as candle ops: the structure is tested against candle-transformers' decoder.

use crate::error::{PipelineError, Result};
use crate::flux::vae::AeConfig;
use crate::flux::vae_bands::{Bands, Halo};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mold_exec::model::conv::{conv2d_nhwc, ConvGeom, ConvOptions, Fusion, Ran};
use mold_exec::model::gemm;
use mold_exec::model::group_norm::{group_norm_nhwc, interleave2x_nhwc, upsample2x_nhwc};
use mold_exec::model::softmax::softmax_last_dim;

const GROUPS: usize = 32;
const EPS: f32 = 1e-6;

/// What ran in one decode: convolutions per implementation, how much of their epilogue
/// cuDNN fused, and why cuDNN was passed over (distinct reasons).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub cudnn: u64,
    /// cuDNN calls whose whole epilogue (bias, and residual where there is one) was fused.
    pub fully_fused: u64,
    pub candle: u64,
    pub refusals: Vec<String>,
}

impl DecodeStats {
    fn see(&mut self, ran: Ran, wanted: Fusion) {
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

fn mark(m: &mut Marks, label: impl FnOnce() -> String, t: &Tensor) {
    if let Some(f) = m.as_mut() {
        f(label(), t);
    }
}

fn load_err(what: &str, e: candle_core::Error) -> PipelineError {
    PipelineError::Component {
        component: "vae".into(),
        message: format!("cannot load {what}: {e}"),
    }
}

/// A convolution: KRSC filters, bias, geometry.
struct Conv {
    w: Tensor,
    b: Tensor,
    geom: ConvGeom,
    size: usize,
}

impl Conv {
    /// `cin → cout` with a `size`×`size` filter (padding `size / 2`), the output channels
    /// padded with zero filters to `cout_padded`.
    fn load(
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

    fn forward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        opts: ConvOptions,
        stats: &mut DecodeStats,
    ) -> Result<Tensor> {
        let (y, ran) = conv2d_nhwc(x, &self.w, Some(&self.b), residual, self.geom, opts)?;
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
    fn forward_halo(
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
        let (y, ran) = conv2d_nhwc(&x, &self.w, Some(&self.b), residual, geom, opts)?;
        let wanted = if residual.is_some() {
            Fusion::BiasResidual
        } else {
            Fusion::Bias
        };
        stats.see(ran, wanted);
        Ok(y)
    }

    fn label(&self, x: &Tensor) -> String {
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

    /// The whole image's norm over the bands `xs` (`norms[b]` on band `b`'s device), each
    /// band with its neighbours' edge rows when `halo`.
    fn forward_bands(
        norms: &[&Norm],
        xs: &[Tensor],
        bands: &Bands,
        silu: bool,
        halo: bool,
        opts: ConvOptions,
    ) -> Result<Vec<Halo>> {
        let params: Vec<(&Tensor, &Tensor)> = norms.iter().map(|n| (&n.gamma, &n.beta)).collect();
        bands.norm(xs, &params, GROUPS, EPS, silu, halo, |x| {
            norms[0].forward(x, silu, opts)
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

    /// `blocks[b]` runs band `b` (`xs[b]`, on its device).
    fn forward_bands(
        blocks: &[&ResBlock],
        xs: Vec<Tensor>,
        bands: &Bands,
        opts: ConvOptions,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Vec<Tensor>> {
        let norms1: Vec<&Norm> = blocks.iter().map(|r| &r.norm1).collect();
        let h = Norm::forward_bands(&norms1, &xs, bands, true, true, opts)?;
        mark(m, || gn_label(&xs[0]), &h[0].t);
        let label = blocks[0].conv1.label(&h[0].t);
        let mut h1 = Vec::with_capacity(xs.len());
        for (r, hb) in blocks.iter().zip(&h) {
            h1.push(r.conv1.forward_halo(hb, None, opts, stats)?);
        }
        drop(h);
        mark(m, || label, &h1[0]);
        let norms2: Vec<&Norm> = blocks.iter().map(|r| &r.norm2).collect();
        let h2 = Norm::forward_bands(&norms2, &h1, bands, true, true, opts)?;
        mark(m, || gn_label(&h1[0]), &h2[0].t);
        drop(h1);
        let mut ys = Vec::with_capacity(xs.len());
        for (b, ((r, x), hb)) in blocks.iter().zip(&xs).zip(&h2).enumerate() {
            let short = match &r.nin_shortcut {
                Some(c) => {
                    let s = c.forward(x, None, opts, stats)?;
                    if b == 0 {
                        mark(m, || c.label(x), &s);
                    }
                    s
                }
                None => x.clone(),
            };
            ys.push(r.conv2.forward_halo(hb, Some(&short), opts, stats)?);
        }
        mark(m, || blocks[0].conv2.label(&h2[0].t), &ys[0]);
        Ok(ys)
    }
}

/// A 1×1 convolution as a linear layer over the pixels.
struct Linear {
    lin: candle_nn::Linear,
    b: Tensor,
}

impl Linear {
    fn load(vb: &VarBuilder, c: usize) -> Result<Linear> {
        let w = vb
            .get((c, c, 1, 1), "weight")
            .map_err(|e| load_err(&vb.prefix(), e))?
            .reshape((c, c))?;
        let b = vb.get(c, "bias").map_err(|e| load_err(&vb.prefix(), e))?;
        Ok(Linear {
            lin: candle_nn::Linear::new(w, None),
            b,
        })
    }

    fn forward(&self, x: &Tensor, opts: ConvOptions) -> Result<Tensor> {
        Ok(gemm::linear(x, &self.lin, &self.b, false, opts.kernels)?)
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

    /// `attns[b]` runs band `b`: its rows' queries against every pixel's keys and values.
    fn forward_bands(
        attns: &[&Attn],
        xs: Vec<Tensor>,
        bands: &Bands,
        opts: ConvOptions,
        m: &mut Marks,
    ) -> Result<Vec<Tensor>> {
        let norms: Vec<&Norm> = attns.iter().map(|a| &a.norm).collect();
        let hn: Vec<Tensor> = Norm::forward_bands(&norms, &xs, bands, false, false, opts)?
            .into_iter()
            .map(|h| h.t)
            .collect();
        mark(m, || gn_label(&xs[0]), &hn[0]);
        let whole = bands.gather(&hn)?;
        let mut ys = Vec::with_capacity(xs.len());
        // Marks (which wait for a device) only for the first band: the others run on.
        let mut none: Marks = None;
        for (b, (((a, x), hb), all)) in attns.iter().zip(&xs).zip(hn).zip(whole).enumerate() {
            let m: &mut Marks = if b == 0 { &mut *m } else { &mut none };
            let (n, h, w, c) = x.dims4()?;
            let rows = all.dim(1)?;
            let hb = hb.reshape((n, h * w, c))?;
            let all = all.reshape((n, rows * w, c))?;
            // The scale on q (n·h·w·c elements) rather than on the scores.
            let q = (a.q.forward(&hb, opts)? * (1.0 / (c as f64).sqrt()))?;
            drop(hb);
            let k = a.k.forward(&all, opts)?;
            let v = a.v.forward(&all, opts)?;
            drop(all);
            mark(m, || "attention q/k/v".into(), &v);
            let o = attend(&q, &k, &v, opts)?;
            drop((q, k, v));
            mark(m, || format!("attention softmax(qk)v {}", h * w), &o);
            let y = (a.proj_out.forward(&o, opts)? + x.reshape((n, h * w, c))?)?;
            mark(m, || "attention proj".into(), &y);
            ys.push(y.reshape((n, h, w, c))?);
        }
        Ok(ys)
    }
}

/// Score elements one attention product may hold: 2^28 (512 MiB in bf16), the whole of a
/// 1024² image's; larger images run their queries in slices of as many rows.
const MAX_SCORES: usize = 1 << 28;

/// `softmax(q kᵀ) v` over `(n, l, c)`, the queries in slices so that no score matrix holds
/// more than [`MAX_SCORES`] elements (a 2048² image's would hold 2^32).
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, opts: ConvOptions) -> Result<Tensor> {
    attend_within(q, k, v, opts, MAX_SCORES)
}

fn attend_within(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: ConvOptions,
    max_scores: usize,
) -> Result<Tensor> {
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
enum Upsample {
    /// Up-sample, then convolve at full resolution.
    Plain(Conv),
    /// The four output phases `(a, b)` (row, column parity) as 2×2 convolutions of the
    /// low-resolution input: `phases[2a + b]`.
    Subpixel(Box<[Conv; 4]>),
}

impl Upsample {
    fn load(vb: &VarBuilder, c: usize, subpixel: bool) -> Result<Upsample> {
        let conv = Conv::load(vb, c, c, 3, c)?;
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

    /// `ups[b]` runs band `b`, with its neighbours' edge rows.
    fn forward_bands(
        ups: &[&Upsample],
        xs: Vec<Tensor>,
        bands: &Bands,
        opts: ConvOptions,
        stats: &mut DecodeStats,
        m: &mut Marks,
    ) -> Result<Vec<Tensor>> {
        let hs = bands.halo(&xs)?;
        drop(xs);
        let mut ys = Vec::with_capacity(hs.len());
        let mut none: Marks = None;
        for (b, (up, h)) in ups.iter().zip(hs).enumerate() {
            let m: &mut Marks = if b == 0 { &mut *m } else { &mut none };
            ys.push(match up {
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
                        let y = c.forward_halo(&h, None, opts, stats)?;
                        mark(m, || format!("{label} (phase)"), &y);
                        p.push(y);
                    }
                    let y = interleave2x_nhwc([&p[0], &p[1], &p[2], &p[3]], opts.kernels)?;
                    drop(p);
                    mark(m, || format!("interleave {:?}", y.dims()), &y);
                    y
                }
            });
        }
        Ok(ys)
    }
}

/// One resolution of the decoder: its resnet blocks, then (except the last) 2× up-sampling
/// and a 3×3 convolution.
struct Level {
    blocks: Vec<ResBlock>,
    upsample: Option<Upsample>,
}

/// How the channels-last decoder runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NhwcOptions {
    pub conv: ConvOptions,
    /// Up-sampling + 3×3 convolution as four 2×2 phase convolutions ([`Upsample`]).
    pub subpixel: bool,
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
                Some(Upsample::load(
                    &vl.pp("upsample").pp("conv"),
                    block_in,
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
        let mover = |t: &Tensor, d: &Device| t.to_device(d);
        let bands = Bands::new(&devices, &mover, self.opts.kernels);
        Self::forward_bands(&[self], z, &bands, stats, m)
    }

    /// [`NhwcDecoder::forward`] in row bands, one per device of `bands`, `decoders[b]` holding
    /// the weights on band `b`'s device ([`crate::flux::vae_bands`]); the image is joined on the
    /// first band's device. One band runs exactly the one-device decode; `m` sees the first
    /// band's operations.
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
        let d0 = decoders[0];
        let opts = d0.opts;
        let x = z.permute((0, 2, 3, 1))?.contiguous()?;
        mark(&mut m, || "to NHWC".into(), &x);
        let xs = bands.split(&x)?;
        drop(x);
        let label = d0.conv_in.label(&xs[0]);
        let mut hs = Vec::with_capacity(xs.len());
        for (d, h) in decoders.iter().zip(bands.halo(&xs)?) {
            hs.push(d.conv_in.forward_halo(&h, None, opts, stats)?);
        }
        mark(&mut m, || label, &hs[0]);
        drop(xs);
        let each = |f: &dyn Fn(&NhwcDecoder) -> &ResBlock| -> Vec<&ResBlock> {
            decoders.iter().map(|d| f(d)).collect()
        };
        hs = ResBlock::forward_bands(&each(&|d| &d.mid_block_1), hs, bands, opts, stats, &mut m)?;
        let attns: Vec<&Attn> = decoders.iter().map(|d| &d.mid_attn_1).collect();
        hs = Attn::forward_bands(&attns, hs, bands, opts, &mut m)?;
        hs = ResBlock::forward_bands(&each(&|d| &d.mid_block_2), hs, bands, opts, stats, &mut m)?;
        for (li, level) in d0.up.iter().enumerate() {
            for bi in 0..level.blocks.len() {
                let blocks = each(&|d| &d.up[li].blocks[bi]);
                hs = ResBlock::forward_bands(&blocks, hs, bands, opts, stats, &mut m)?;
            }
            if level.upsample.is_some() {
                let ups: Vec<&Upsample> = decoders
                    .iter()
                    .filter_map(|d| d.up[li].upsample.as_ref())
                    .collect();
                hs = Upsample::forward_bands(&ups, hs, bands, opts, stats, &mut m)?;
            }
        }
        let norms: Vec<&Norm> = decoders.iter().map(|d| &d.norm_out).collect();
        let hn = Norm::forward_bands(&norms, &hs, bands, true, true, opts)?;
        mark(&mut m, || gn_label(&hs[0]), &hn[0].t);
        drop(hs);
        let label = d0.conv_out.label(&hn[0].t);
        let mut ys = Vec::with_capacity(hn.len());
        for (d, h) in decoders.iter().zip(&hn) {
            let y = d.conv_out.forward_halo(h, None, opts, stats)?;
            ys.push(
                y.narrow(3, 0, d.out_ch)?
                    .permute((0, 3, 1, 2))?
                    .contiguous()?,
            );
        }
        drop(hn);
        mark(&mut m, || label, &ys[0]);
        let y = bands.join(&ys, 2)?;
        mark(&mut m, || "to NCHW".into(), &y);
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};
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
                let mover = |t: &Tensor, d: &Device| t.to_device(d);
                let bands = Bands::new(&devices, &mover, Kernels::Auto);
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
        for max in [1, 74, 75, 600] {
            let sliced = attend_within(&q, &k, &v, opts, max).unwrap();
            let e = max_rel(&sliced, &whole);
            assert!(e <= 1e-6, "max {max}: {e}");
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
