//! The FLUX transformer (BFL `flux.model.Flux`), numerically following
//! candle-transformers' `flux::model`, split into a stem, double-stream blocks,
//! single-stream blocks and the final layer so a plan can place each on its devices.
//!
//! Tensor parallelism (Megatron style): attention is split by heads and the MLP by
//! hidden columns. `qkv` and `linear1` are column parallel with q, k, v (and the MLP part
//! of `linear1`) each sharded separately; `proj`, `mlp.2` and `linear2` are row parallel,
//! followed by exactly one all-reduce each (a double block reduces img and txt together:
//! one all-reduce after attention, one after the MLP). The modulation linears are column
//! parallel too (each rank computes a contiguous slice of the per-sample shift, scale and
//! gate vectors), followed by one all-gather per block (a double block gathers img and
//! txt together). Norm scales, row-parallel biases, the stem and the final layer are
//! replicated.
//!
//! Token-split tensor parallelism (`CommOptions::token_split`, [`crate::model::token_split`]):
//! between products each rank holds its share of the tokens, so the norms, modulation and
//! gated residuals are not repeated on every rank; all-gathers of the normed tokens before
//! the column-parallel products and a reduce-scatter of the row-parallel partial sums
//! replace each all-reduce ([`DoubleBlock::forward`], [`SingleBlock::forward`]).

use super::config::{FluxConfig, TIME_EMBED_DIM};
use crate::error::Result;
use crate::model::layers::{self, vector_bytes, ColumnParallel, Linear, RowParallel, TensorMap};
use crate::model::mat::Input;
use crate::model::modulation::{mod_outs, modulations, Conditioning};
use crate::model::ops;
use crate::model::sequence::{self, Qkv};
use crate::model::token_split::{whole_input, Side, TokenSplit};
use crate::model::{Ctx, Shard, WeightSource};
use candle_core::{DType, Device, IndexOp, Tensor, D};

type CResult<T> = candle_core::Result<T>;

const EPS: f64 = 1e-6;

/// LayerNorm without affine parameters (BFL `elementwise_affine=False`).
fn layer_norm(x: &Tensor) -> CResult<Tensor> {
    ops::layer_norm(x, EPS as f32)
}

/// RoPE rotation matrices for one position axis: `(b, n, dim/2, 2, 2)`.
fn rope(pos: &Tensor, dim: usize, theta: f64) -> CResult<Tensor> {
    let inv_freq: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1f32 / theta.powf(i as f64 / dim as f64) as f32)
        .collect();
    let n = inv_freq.len();
    let inv_freq = Tensor::from_vec(inv_freq, (1, 1, n), pos.device())?.to_dtype(pos.dtype())?;
    let freqs = pos.unsqueeze(2)?.broadcast_mul(&inv_freq)?;
    let cos = freqs.cos()?;
    let sin = freqs.sin()?;
    let out = Tensor::stack(&[&cos, &sin.neg()?, &sin, &cos], 3)?;
    let (b, n, d, _) = out.dims4()?;
    out.reshape((b, n, d, 2, 2))
}

/// RoPE on `(b, h, L, d)` with the table from [`rope_table`]: BFL rotates
/// interleaved pairs `(x[2i], x[2i+1])` by the matrix `[[cos, -sin], [sin, cos]]`, which is
/// candle's fused `rope_i` with the table's `cos` and `sin` entries.
fn apply_rope(x: &Tensor, pe: &Tensor) -> CResult<Tensor> {
    let (cos, sin) = rope_cos_sin(pe, x.dtype())?;
    candle_nn::rotary_emb::rope_i(&x.contiguous()?, &cos, &sin)
}

/// `cos` and `sin`, each `(b, L, head_dim/2)` and contiguous, from the table
/// [`rope_table`] made (views, unless `dtype` differs from the table's).
fn rope_cos_sin(pe: &Tensor, dtype: DType) -> CResult<(Tensor, Tensor)> {
    let cos = pe.i(0)?.to_dtype(dtype)?.contiguous()?;
    let sin = pe.i(1)?.to_dtype(dtype)?.contiguous()?;
    Ok((cos, sin))
}

/// The RoPE table the blocks take, `(2, b, L, head_dim/2)`: `cos` then `sin` of every
/// position's angles, from [`positional_embedding`]'s rotation matrices
/// `[[cos, -sin], [sin, cos]]` — made once per forward, so no block slices the rotation
/// matrices again. The sequence is dimension 2, as in the matrices.
pub fn rope_table(pe: &Tensor) -> CResult<Tensor> {
    let pe = pe.i((.., 0))?; // (b, L, d/2, 2, 2)
    let cos = pe.i((.., .., .., 0, 0))?;
    let sin = pe.i((.., .., .., 1, 0))?;
    Tensor::stack(&[&cos, &sin], 0)?.contiguous()
}

/// Attention over this rank's heads, q, k and v already normed and rotated
/// ([`prepare_qkv`]); returns `(b, L, heads * head_dim)`. Under sequence parallelism `L`
/// is this rank's tokens and `lens` every rank's count ([`sequence::attention`]).
fn attention(qkv: Qkv, lens: &[usize], fp8: bool, ctx: &Ctx) -> CResult<Input> {
    sequence::attention(qkv, lens, sequence::fp8_attention(fp8, ctx), ctx)
}

/// q, k, v for attention from the fused projections of the sequence segments in order
/// (double blocks: txt then img, each with its own q/k norms; single blocks: one): q/k
/// RMSNorm, RoPE, `(b, heads, L, head_dim)` layout, segments concatenated along L — or,
/// under sequence parallelism, laid out as the all-to-all's messages ([`Qkv`]). On CUDA
/// one fused kernel per segment (in a block whose attention runs in FP8, `fp8_block` and
/// [`sequence::fp8_attention`], also taking q's, k's and v's largest magnitudes); elsewhere
/// candle's ops.
fn prepare_qkv(
    segs: &[(&Tensor, &QkNorm)],
    heads: usize,
    pe: &Tensor,
    lens: &[usize],
    fp8_block: bool,
    ctx: &Ctx,
) -> CResult<Qkv> {
    let fsegs: Vec<ops::QkvSegment> = segs
        .iter()
        .map(|(x, n)| ops::QkvSegment {
            qkv: x,
            q_scale: &n.query_scale,
            k_scale: &n.key_scale,
        })
        .collect();
    let supported = ops::qkv_prep_supported(&fsegs, heads);
    if ctx.kernels.use_fused(supported, "q/k/v preparation")? {
        // The table in the activations' dtype, as the candle path below rotates with it.
        let (cos, sin) = (pe.i(0)?, pe.i(1)?);
        let fp8 = sequence::fp8_attention(fp8_block, ctx);
        return sequence::prepare_fused(&fsegs, heads, (&cos, &sin), EPS as f32, lens, fp8, ctx);
    }
    let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for (x, norm) in segs {
        let d = norm.query_scale.dims1()?;
        let (q, k, v) = split_qkv(&x.narrow(D::Minus1, 0, 3 * heads * d)?, heads, norm)?;
        qs.push(q);
        ks.push(k);
        vs.push(v);
    }
    let cat = |t: Vec<Tensor>| {
        if t.len() == 1 {
            Ok(t[0].clone())
        } else {
            Tensor::cat(&t, 2)
        }
    };
    let (q, k, v) = (cat(qs)?, cat(ks)?, cat(vs)?);
    ctx.mark("qk norm + layout", &v);
    let q = apply_rope(&q, pe)?;
    let k = apply_rope(&k, pe)?;
    ctx.mark("rope", &k);
    Qkv::new(q, k, v, ctx.sp.world_size())
}

/// [`layers::row_parallel_sums`] gave other than one sum per segment (cannot happen).
fn pair_err() -> candle_core::Error {
    candle_core::Error::Msg("row-parallel sums: one per segment expected".into())
}

/// Sinusoidal embedding of `t` (scaled by 1000), `dim` wide, cos then sin.
fn timestep_embedding(t: &Tensor, dim: usize, dtype: DType) -> CResult<Tensor> {
    const TIME_FACTOR: f64 = 1000.;
    const MAX_PERIOD: f64 = 10000.;
    let half = dim / 2;
    let dev = t.device();
    let t = (t * TIME_FACTOR)?;
    let arange = Tensor::arange(0, half as u32, dev)?.to_dtype(DType::F32)?;
    let freqs = (arange * (-MAX_PERIOD.ln() / half as f64))?.exp()?;
    let args = t
        .unsqueeze(1)?
        .to_dtype(DType::F32)?
        .broadcast_mul(&freqs.unsqueeze(0)?)?;
    Tensor::cat(&[args.cos()?, args.sin()?], D::Minus1)?.to_dtype(dtype)
}

/// RoPE for all positions: `ids` is `(b, L, 3)`; returns `(b, 1, L, head_dim/2, 2, 2)`.
pub fn positional_embedding(ids: &Tensor, axes_dim: &[usize; 3], theta: f64) -> CResult<Tensor> {
    let mut emb = Vec::with_capacity(3);
    for (i, d) in axes_dim.iter().enumerate() {
        emb.push(rope(&ids.get_on_dim(D::Minus1, i)?, *d, theta)?);
    }
    Tensor::cat(&emb, 2)?.unsqueeze(1)
}

#[derive(Clone, Debug)]
struct MlpEmbedder {
    in_layer: Linear,
    out_layer: Linear,
}

impl MlpEmbedder {
    fn load(src: &dyn WeightSource, prefix: &str) -> Result<Self> {
        Ok(MlpEmbedder {
            in_layer: Linear::load(src, &format!("{prefix}.in_layer"))?,
            out_layer: Linear::load(src, &format!("{prefix}.out_layer"))?,
        })
    }
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        self.out_layer.forward(&self.in_layer.forward(x)?.silu()?)
    }
    fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(MlpEmbedder {
            in_layer: self.in_layer.to_device(d)?,
            out_layer: self.out_layer.to_device(d)?,
        })
    }
    fn bytes(&self) -> u64 {
        self.in_layer.bytes() + self.out_layer.bytes()
    }
}

/// The adaLN linear from the SiLU'd conditioning vector to `n` × (shift, scale, gate)
/// (`out = 3n·hidden` features), column parallel: a rank holds output rows
/// `shard.range(out)` of the weight and bias and computes that contiguous slice of the
/// output; [`gather_modulation`] puts the slices back together.
#[derive(Clone, Debug)]
struct Modulation(ColumnParallel);

impl Modulation {
    fn load(src: &dyn WeightSource, prefix: &str, out: usize, shard: Shard) -> Result<Self> {
        Ok(Modulation(ColumnParallel::load(
            src,
            prefix,
            &[shard.range(out)],
        )?))
    }
    /// This rank's slice of the output, `(b, out / world)`; `silu_vec` is `silu(vec)`.
    fn partial(&self, silu_vec: &Tensor, k: ops::Kernels) -> CResult<Tensor> {
        self.0.forward_vec(silu_vec, k)
    }
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(Modulation(self.0.map_tensors(f)?))
    }
    fn bytes(&self) -> u64 {
        self.0.bytes()
    }
}

#[derive(Clone, Debug)]
struct QkNorm {
    query_scale: Tensor,
    key_scale: Tensor,
}

impl QkNorm {
    fn load(src: &dyn WeightSource, prefix: &str) -> Result<Self> {
        let q = src.load(&format!("{prefix}.query_norm.scale"), None, None)?;
        let k = src.load(&format!("{prefix}.key_norm.scale"), None, None)?;
        Ok(Self::new(q, k))
    }
    fn new(q: Tensor, k: Tensor) -> Self {
        QkNorm {
            query_scale: q,
            key_scale: k,
        }
    }
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        let q = f(&self.query_scale)?;
        Ok(Self::new(q, f(&self.key_scale)?))
    }
    fn bytes(&self) -> u64 {
        vector_bytes(&self.query_scale) + vector_bytes(&self.key_scale)
    }
}

/// Splits a `(b, L, 3 * heads * head_dim)` projection into normed `q`, `k` and `v`, each
/// `(b, heads, L, head_dim)`.
fn split_qkv(qkv: &Tensor, heads: usize, norm: &QkNorm) -> CResult<(Tensor, Tensor, Tensor)> {
    let (b, l, _) = qkv.dims3()?;
    let qkv = qkv.reshape((b, l, 3, heads, ()))?;
    // (b, heads, L, head_dim), contiguous: the fused RMSNorm, RoPE and attention
    // kernels need it.
    let part = |i: usize| qkv.i((.., .., i))?.transpose(1, 2)?.contiguous();
    let q = candle_nn::ops::rms_norm(&part(0)?, &norm.query_scale, EPS as f32)?;
    let k = candle_nn::ops::rms_norm(&part(1)?, &norm.key_scale, EPS as f32)?;
    Ok((q, k, part(2)?))
}

/// The rows of a fused `[q; k; v]` (and optionally a trailing MLP segment) that belong to
/// one shard: each part sharded on its own.
fn qkv_rows(cfg: &FluxConfig, shard: Shard, with_mlp: bool) -> Vec<std::ops::Range<usize>> {
    let h = cfg.hidden;
    let mut rows = vec![
        shard.segment(0, h),
        shard.segment(h, h),
        shard.segment(2 * h, h),
    ];
    if with_mlp {
        rows.push(shard.segment(3 * h, cfg.mlp_hidden()));
    }
    rows
}

#[derive(Clone, Debug)]
struct Stream {
    modulation: Modulation,
    qkv: ColumnParallel,
    norm: QkNorm,
    proj: RowParallel,
    mlp0: ColumnParallel,
    mlp2: RowParallel,
}

impl Stream {
    fn load(src: &dyn WeightSource, p: &str, cfg: &FluxConfig, shard: Shard) -> Result<Self> {
        let mlp = shard.range(cfg.mlp_hidden());
        Ok(Stream {
            modulation: Modulation::load(src, &format!("{p}_mod.lin"), 6 * cfg.hidden, shard)?,
            qkv: ColumnParallel::load(src, &format!("{p}_attn.qkv"), &qkv_rows(cfg, shard, false))?,
            norm: QkNorm::load(src, &format!("{p}_attn.norm"))?,
            proj: RowParallel::load(src, &format!("{p}_attn.proj"), &[shard.range(cfg.hidden)])?,
            mlp0: ColumnParallel::load(src, &format!("{p}_mlp.0"), std::slice::from_ref(&mlp))?,
            mlp2: RowParallel::load(src, &format!("{p}_mlp.2"), &[mlp])?,
        })
    }
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(Stream {
            modulation: self.modulation.map_tensors(f)?,
            qkv: self.qkv.map_tensors(f)?,
            norm: self.norm.map_tensors(f)?,
            proj: self.proj.map_tensors(f)?,
            mlp0: self.mlp0.map_tensors(f)?,
            mlp2: self.mlp2.map_tensors(f)?,
        })
    }
    fn bytes(&self) -> u64 {
        self.modulation.bytes()
            + self.qkv.bytes()
            + self.norm.bytes()
            + self.proj.bytes()
            + self.mlp0.bytes()
            + self.mlp2.bytes()
    }
}

/// A double-stream block: separate img and txt weights, joint attention.
#[derive(Clone, Debug)]
pub struct DoubleBlock {
    img: Stream,
    txt: Stream,
    /// Heads on this rank.
    heads: usize,
}

impl DoubleBlock {
    pub fn load(
        src: &dyn WeightSource,
        cfg: &FluxConfig,
        index: usize,
        shard: Shard,
    ) -> Result<Self> {
        let p = format!("double_blocks.{index}");
        Ok(DoubleBlock {
            img: Stream::load(src, &format!("{p}.img"), cfg, shard)?,
            txt: Stream::load(src, &format!("{p}.txt"), cfg, shard)?,
            heads: cfg.heads / shard.world,
        })
    }

    /// The block over `img` and `txt`, taken by value: each intermediate (the inputs
    /// included) is dropped after its last use, not at the end of the call, so the
    /// block's peak is its MLP's — about what [`mold_models::BlockKind::activation_bytes`]
    /// counts — and not every intermediate at once.
    ///
    /// With `split` (token-split tensor parallelism), `img` and `txt` are this
    /// rank's shares of each stream's tokens: the norms, modulation and gated residuals run
    /// on them alone; each stream's normed share is all-gathered before its
    /// column-parallel product, and the row-parallel partial sums of both streams are
    /// reduce-scattered back to shares in one call ([`TokenSplit::scatter_streams`]). The
    /// results are this rank's shares.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        img: Tensor,
        txt: Tensor,
        vec: &Conditioning,
        pe: &Tensor,
        lens: &[usize],
        split: Option<&TokenSplit>,
        ctx: &Ctx,
    ) -> CResult<(Tensor, Tensor)> {
        ctx.mark_start(&img);
        let k = ctx.kernels;
        let full = modulations(vec, ctx, &|s| {
            Ok(vec![
                self.img.modulation.partial(s, k)?,
                self.txt.modulation.partial(s, k)?,
            ])
        })?;
        let im = mod_outs(&full[0], 2)?;
        let tm = mod_outs(&full[1], 2)?;
        ctx.mark("modulation", &tm[1].gate);
        let kn = ctx.kernels;
        let eps = EPS as f32;
        let (iq, tq) = (&self.img.qkv, &self.txt.qkv);
        let img_in = whole_input(split, &im[0], &img, eps, iq.parts(), false, Side::Img, ctx)?;
        let img_qkv = iq.forward_in(&img_in, false, kn)?;
        drop(img_in);
        let txt_in = whole_input(split, &tm[0], &txt, eps, tq.parts(), false, Side::Txt, ctx)?;
        let txt_qkv = tq.forward_in(&txt_in, false, kn)?;
        drop(txt_in);
        ctx.meter.see(&img_qkv);
        ctx.mark("norm + qkv linear", &txt_qkv);
        let qkv = prepare_qkv(
            &[(&txt_qkv, &self.txt.norm), (&img_qkv, &self.img.norm)],
            self.heads,
            pe,
            lens,
            iq.is_fp8(),
            ctx,
        )?;
        drop((img_qkv, txt_qkv));
        let attn = attention(qkv, lens, iq.is_fp8(), ctx)?;
        let tl = match split {
            Some(s) => s.txt,
            None => txt.dim(1)?,
        };
        let il = attn.dims()[1] - tl;
        let streams = [&self.txt, &self.img];
        let sums = layers::row_parallel_sums(
            attn,
            &[tl, il],
            "attn out linear",
            ctx,
            split,
            |attn, i, s, n| {
                streams[i]
                    .proj
                    .partial_in(&[&attn.narrow_tokens([0, tl][i] + s, n)?], kn)
            },
        )?;
        let [txt_proj, img_proj]: [Tensor; 2] = sums.try_into().map_err(|_| pair_err())?;
        // The projections' biases in the gated residual's pass.
        let img_mid = im[0].gate_bias_residual(&img, &img_proj, self.img.proj.bias(), kn)?;
        let txt_mid = tm[0].gate_bias_residual(&txt, &txt_proj, self.txt.proj.bias(), kn)?;
        drop((img, txt, img_proj, txt_proj));
        ctx.mark("bias + gate + residual", &txt_mid);

        let (im0, tm0) = (&self.img.mlp0, &self.txt.mlp0);
        let img_in = whole_input(
            split,
            &im[1],
            &img_mid,
            eps,
            im0.parts(),
            true,
            Side::Img,
            ctx,
        )?;
        let img_h = im0.forward_in(&img_in, true, kn)?;
        drop(img_in);
        let txt_in = whole_input(
            split,
            &tm[1],
            &txt_mid,
            eps,
            tm0.parts(),
            true,
            Side::Txt,
            ctx,
        )?;
        let txt_h = tm0.forward_in(&txt_in, true, kn)?;
        drop(txt_in);
        ctx.meter.see(&img_h);
        ctx.mark("norm + mlp in + gelu", &txt_h);
        let (tl, il) = (txt_h.dim(1)?, img_h.dim(1)?);
        let sums = layers::row_parallel_sums(
            [txt_h, img_h],
            &[tl, il],
            "mlp out linear",
            ctx,
            split,
            |hs, i, s, n| streams[i].mlp2.partial(&[&hs[i].narrow(1, s, n)?], kn),
        )?;
        let [txt_mlp, img_mlp]: [Tensor; 2] = sums.try_into().map_err(|_| pair_err())?;
        let img = im[1].gate_bias_residual(&img_mid, &img_mlp, self.img.mlp2.bias(), kn)?;
        drop((img_mid, img_mlp));
        let txt = tm[1].gate_bias_residual(&txt_mid, &txt_mlp, self.txt.mlp2.bias(), kn)?;
        ctx.mark("bias + gate + residual", &txt);
        Ok((img, txt))
    }

    /// The block with `f` applied to each weight tensor, in a fixed order.
    pub fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(DoubleBlock {
            img: self.img.map_tensors(f)?,
            txt: self.txt.map_tensors(f)?,
            heads: self.heads,
        })
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        self.map_tensors(&mut |t| t.to_device(d))
    }

    /// Bytes of this shard's weights.
    pub fn bytes(&self) -> u64 {
        self.img.bytes() + self.txt.bytes()
    }
}

/// A single-stream block over the concatenated `[txt, img]` tokens.
#[derive(Clone, Debug)]
pub struct SingleBlock {
    linear1: ColumnParallel,
    linear2: RowParallel,
    norm: QkNorm,
    modulation: Modulation,
    heads: usize,
    /// Width of this rank's attention output and MLP hidden.
    h_local: usize,
    mlp_local: usize,
}

impl SingleBlock {
    pub fn load(
        src: &dyn WeightSource,
        cfg: &FluxConfig,
        index: usize,
        shard: Shard,
    ) -> Result<Self> {
        let p = format!("single_blocks.{index}");
        let h = cfg.hidden;
        let m = cfg.mlp_hidden();
        // linear2's input is [attn (h), mlp (m)]: this rank's columns of each, held as two
        // weights so the two inputs need no concatenation.
        let cols = [shard.segment(0, h), shard.segment(h, m)];
        Ok(SingleBlock {
            linear1: ColumnParallel::load(
                src,
                &format!("{p}.linear1"),
                &qkv_rows(cfg, shard, true),
            )?,
            linear2: RowParallel::load(src, &format!("{p}.linear2"), &cols)?,
            norm: QkNorm::load(src, &format!("{p}.norm"))?,
            modulation: Modulation::load(src, &format!("{p}.modulation.lin"), 3 * h, shard)?,
            heads: cfg.heads / shard.world,
            h_local: h / shard.world,
            mlp_local: m / shard.world,
        })
    }

    /// The block over `x`, taken by value: each intermediate is dropped after its last
    /// use (see [`DoubleBlock::forward`]).
    ///
    /// With `split` (token-split tensor parallelism), `x` is this rank's text share then
    /// its image share: the norm, modulation and gated residual run on them alone; every
    /// rank's normed shares are gathered before `linear1` ([`TokenSplit::gather_single`])
    /// and `linear2`'s partial sums reduce-scattered back to shares
    /// ([`TokenSplit::scatter_single`]), in place of the one all-reduce. The result is this
    /// rank's shares.
    pub fn forward(
        &self,
        x: Tensor,
        vec: &Conditioning,
        pe: &Tensor,
        lens: &[usize],
        split: Option<&TokenSplit>,
        ctx: &Ctx,
    ) -> CResult<Tensor> {
        ctx.mark_start(&x);
        let k = ctx.kernels;
        let full = modulations(vec, ctx, &|s| Ok(vec![self.modulation.partial(s, k)?]))?;
        let m = mod_outs(&full[0], 1)?;
        ctx.mark("modulation", &m[0].gate);
        let kn = ctx.kernels;
        let eps = EPS as f32;
        let normed = match split {
            // The norm quantizes for linear1's FP8 products where they take it: once for
            // both (and for both of sequence parallelism's pieces).
            None => {
                let fp8 = self.linear1.split_takes_rows(&x, 3 * self.h_local, kn);
                m[0].norm_scale_shift_for(&x, eps, fp8, kn)?
            }
            Some(sp) => {
                let normed = m[0].norm_scale_shift(&x, eps, kn)?;
                ctx.mark("norm", &normed);
                let all = sp.gather_single(&normed, ctx)?;
                ctx.mark("all-gather (tokens)", &all);
                Input::Dense(all)
            }
        };
        if ctx.sp.world_size() > 1 && split.is_none() {
            let reduced = self.mix_beside(normed, pe, lens, ctx)?;
            let out = m[0].gate_bias_residual(&x, &reduced, self.linear2.bias(), kn)?;
            ctx.mark("bias + gate + residual", &out);
            return Ok(out);
        }
        // q, k, v with their bias; the MLP part with bias and GELU (in the matmuls'
        // epilogues on CUDA).
        let (x_qkv, mlp) = self
            .linear1
            .forward_split_gelu_in(&normed, 3 * self.h_local, kn)?;
        drop(normed);
        ctx.meter.see_all(&[&x_qkv, &mlp]);
        ctx.mark("norm + qkv/mlp linear + gelu", &mlp);
        let fp8 = self.linear1.is_fp8();
        let qkv = prepare_qkv(&[(&x_qkv, &self.norm)], self.heads, pe, lens, fp8, ctx)?;
        drop(x_qkv);
        let attn = attention(qkv, lens, fp8, ctx)?;
        // [attn, gelu(mlp)] · linear2ᵀ as attn · W_attnᵀ + gelu(mlp) · W_mlpᵀ.
        let len = attn.dims()[1];
        let reduced = layers::row_parallel_sums(
            (attn, mlp),
            &[len],
            "out linear",
            ctx,
            split,
            |(attn, mlp), _, s, n| {
                let mlp = Input::Dense(mlp.narrow(1, s, n)?);
                self.linear2
                    .partial_in(&[&attn.narrow_tokens(s, n)?, &mlp], kn)
            },
        )?
        .pop()
        .ok_or_else(pair_err)?;
        let out = m[0].gate_bias_residual(&x, &reduced, self.linear2.bias(), kn)?;
        ctx.mark("bias + gate + residual", &out);
        Ok(out)
    }

    /// Under sequence parallelism, from the normed input to the summed output product
    /// (no bias): the MLP's products, which do not read attention, are queued while the
    /// all-to-alls move — `linear1`'s MLP rows under the q/k/v exchange, `linear2`'s MLP
    /// columns under the output's, the attention columns then accumulated into that sum
    /// — so where the group exchanges by the copy engines (two GPUs, `MOLD_SP_OVERLAP`)
    /// the exchanges run beside them. The same sums as [`Self::forward`]'s other path, the
    /// MLP's part rounded to the activations' dtype before the attention's is added.
    fn mix_beside(&self, normed: Input, pe: &Tensor, lens: &[usize], ctx: &Ctx) -> CResult<Tensor> {
        let kn = ctx.kernels;
        let x_qkv = self
            .linear1
            .forward_rows_in(&normed, 0, 3 * self.h_local, false, kn)?;
        ctx.meter.see(&x_qkv);
        ctx.mark("norm + qkv linear", &x_qkv);
        let fp8_block = self.linear1.is_fp8();
        let qkv = prepare_qkv(
            &[(&x_qkv, &self.norm)],
            self.heads,
            pe,
            lens,
            fp8_block,
            ctx,
        )?;
        drop(x_qkv);
        let moving = sequence::start(qkv, lens, sequence::fp8_attention(fp8_block, ctx), ctx)?;
        let mlp =
            self.linear1
                .forward_rows_in(&normed, 3 * self.h_local, self.mlp_local, true, kn)?;
        drop(normed);
        ctx.meter.see(&mlp);
        ctx.mark("mlp linear + gelu (beside all-to-all)", &mlp);
        let out = moving.attend(ctx)?;
        let acc = self.linear2.segment(1, &mlp, kn)?;
        drop(mlp);
        ctx.mark("mlp out linear (beside all-to-all)", &acc);
        let attn = out.finish(ctx)?;
        let partial = self.linear2.add_segment(acc, 0, &attn, kn)?;
        drop(attn);
        let len = partial.dim(1)?;
        layers::row_parallel_sums(partial, &[len], "out linear", ctx, None, |p, _, s, n| {
            p.narrow(1, s, n)
        })?
        .pop()
        .ok_or_else(pair_err)
    }

    /// The block with `f` applied to each weight tensor, in a fixed order.
    pub fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(SingleBlock {
            linear1: self.linear1.map_tensors(f)?,
            linear2: self.linear2.map_tensors(f)?,
            norm: self.norm.map_tensors(f)?,
            modulation: self.modulation.map_tensors(f)?,
            heads: self.heads,
            h_local: self.h_local,
            mlp_local: self.mlp_local,
        })
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        self.map_tensors(&mut |t| t.to_device(d))
    }

    pub fn bytes(&self) -> u64 {
        self.linear1.bytes() + self.linear2.bytes() + self.norm.bytes() + self.modulation.bytes()
    }
}

/// Embeddings before the blocks: `img_in`, `txt_in`, `time_in`, `vector_in`,
/// `guidance_in`, and the RoPE table. Replicated.
#[derive(Clone, Debug)]
pub struct Stem {
    img_in: Linear,
    txt_in: Linear,
    time_in: MlpEmbedder,
    vector_in: MlpEmbedder,
    guidance_in: Option<MlpEmbedder>,
    axes_dim: [usize; 3],
    theta: f64,
    /// The last rotation table made, for the position tensors it was made from (by
    /// identity: candle's tensors are immutable and their ids never reused) on a device
    /// in a dtype: every call of a request passes the same ids, so it is made once.
    pe: PeCache,
}

/// `(txt_ids, img_ids, device, dtype)` of a rotation table ([`Stem::pe`]).
type PeKey = (
    candle_core::TensorId,
    candle_core::TensorId,
    candle_core::DeviceLocation,
    DType,
);
type PeCache = crate::model::cache::LastMade<PeKey>;

/// Activations entering the double blocks.
pub struct StemOut {
    pub img: Tensor,
    pub txt: Tensor,
    pub vec: Tensor,
    pub pe: Tensor,
}

impl Stem {
    pub fn load(src: &dyn WeightSource, cfg: &FluxConfig) -> Result<Self> {
        Ok(Stem {
            img_in: Linear::load(src, "img_in")?,
            txt_in: Linear::load(src, "txt_in")?,
            time_in: MlpEmbedder::load(src, "time_in")?,
            vector_in: MlpEmbedder::load(src, "vector_in")?,
            guidance_in: if cfg.guidance_embed {
                Some(MlpEmbedder::load(src, "guidance_in")?)
            } else {
                None
            },
            axes_dim: cfg.axes_dim,
            theta: cfg.theta,
            pe: PeCache::default(),
        })
    }

    /// `img`, `txt` and `y` are in the compute dtype; the ids, `timesteps` and `guidance`
    /// may be f32 (the RoPE table and sinusoidal embeddings are computed in f32 and cast
    /// to the compute dtype, as candle does for f32 inputs). `guidance` is required by
    /// guidance-distilled models and ignored by others.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        timesteps: &Tensor,
        y: &Tensor,
        guidance: Option<&Tensor>,
    ) -> CResult<StemOut> {
        let vec = self.vector(timesteps, y, guidance, img.dtype())?;
        self.tokens(img, img_ids, txt, txt_ids, vec)
    }

    /// The conditioning vectors `(n, hidden)` in `dtype`, one per row of `timesteps`
    /// `(n,)`, `y` `(n, vec_in_dim)` and `guidance` `(n,)` (see [`Stem::forward`]).
    pub fn vector(
        &self,
        timesteps: &Tensor,
        y: &Tensor,
        guidance: Option<&Tensor>,
        dtype: DType,
    ) -> CResult<Tensor> {
        let mut vec =
            self.time_in
                .forward(&timestep_embedding(timesteps, TIME_EMBED_DIM, dtype)?)?;
        if let Some(g_in) = &self.guidance_in {
            let g = guidance.ok_or_else(|| {
                candle_core::Error::Msg(
                    "this model is guidance distilled: pass a guidance strength (e.g. 3.5)".into(),
                )
            })?;
            vec = (vec + g_in.forward(&timestep_embedding(g, TIME_EMBED_DIM, dtype)?)?)?;
        }
        vec + self.vector_in.forward(y)?
    }

    /// The stem's token embeddings and RoPE table beside the given conditioning `vec`.
    pub fn tokens(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        vec: Tensor,
    ) -> CResult<StemOut> {
        let dtype = img.dtype();
        let key = (txt_ids.id(), img_ids.id(), img.device().location(), dtype);
        let pe = self.pe.get(key, || {
            let ids = Tensor::cat(&[txt_ids, img_ids], 1)?;
            rope_table(&positional_embedding(
                &ids.to_dtype(DType::F32)?,
                &self.axes_dim,
                self.theta,
            )?)?
            .to_dtype(dtype)
        })?;
        let txt = self.txt_in.forward(txt)?;
        let img = self.img_in.forward(img)?;
        Ok(StemOut { img, txt, vec, pe })
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(Stem {
            img_in: self.img_in.to_device(d)?,
            txt_in: self.txt_in.to_device(d)?,
            time_in: self.time_in.to_device(d)?,
            vector_in: self.vector_in.to_device(d)?,
            guidance_in: self
                .guidance_in
                .as_ref()
                .map(|g| g.to_device(d))
                .transpose()?,
            axes_dim: self.axes_dim,
            theta: self.theta,
            pe: PeCache::default(),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.img_in.bytes()
            + self.txt_in.bytes()
            + self.time_in.bytes()
            + self.vector_in.bytes()
            + self.guidance_in.as_ref().map(|g| g.bytes()).unwrap_or(0)
    }
}

/// `final_layer`: adaLN modulation then the output projection. Replicated.
#[derive(Clone, Debug)]
pub struct FinalLayer {
    linear: Linear,
    ada: Linear,
}

impl FinalLayer {
    pub fn load(src: &dyn WeightSource) -> Result<Self> {
        Ok(FinalLayer {
            linear: Linear::load(src, "final_layer.linear")?,
            ada: Linear::load(src, "final_layer.adaLN_modulation.1")?,
        })
    }

    /// `img` is `(b, L_img, hidden)`; returns `(b, L_img, in_channels)`.
    pub fn forward(&self, img: &Tensor, vec: &Tensor) -> CResult<Tensor> {
        let chunks = self.ada.forward(&vec.silu()?)?.chunk(2, 1)?;
        let (shift, scale) = (&chunks[0], &chunks[1]);
        let x = layer_norm(img)?
            .broadcast_mul(&(scale.unsqueeze(1)? + 1.0)?)?
            .broadcast_add(&shift.unsqueeze(1)?)?;
        self.linear.forward(&x)
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(FinalLayer {
            linear: self.linear.to_device(d)?,
            ada: self.ada.to_device(d)?,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.linear.bytes() + self.ada.bytes()
    }
}

#[cfg(test)]
mod tests;
