//! The Qwen-Image transformer (diffusers `QwenImageTransformer2DModel`) split into a
//! stem, dual-stream blocks and the final layer so a plan can place each on its devices.
//!
//! A block (`QwenImageTransformerBlock`): per stream (image, text) an adaLN modulation
//! (`img_mod` / `txt_mod`: shift, scale, gate for the attention and the MLP), affine-free
//! LayerNorms, q/k/v projections with per-head RMSNorm on q and k, joint attention over
//! `[text; image]` with the 3-axis RoPE ([`super::rope`]), the output projections
//! (`to_out.0`, `to_add_out`) and tanh-GELU MLPs, each added to its residual through
//! its gate.
//!
//! Tensor parallelism (Megatron style, as FLUX's blocks): q, k, v and the MLP's first
//! linear are column parallel (this rank's heads and MLP columns), the output
//! projections and the MLP's second linear row parallel, with one all-reduce after
//! attention and one after the MLPs (image and text reduced together). The modulation
//! linears are column parallel too, put together by one all-gather per block. Norm
//! weights, row-parallel biases, the stem and the final layer are replicated.

use super::config::{QwenConfig, TIME_EMBED_DIM};
use crate::error::Result;
use crate::model::layers::{self, vector_bytes, ColumnParallel, Linear, RowParallel, TensorMap};
use crate::model::mat::{Input, Mat};
use crate::model::modulation::{gather_modulation, mod_outs};
use crate::model::ops::{self, Kernels};
use crate::model::sequence;
use crate::model::token_split::{whole_input, Side, TokenSplit};
use crate::model::{Ctx, Shard, WeightSource};
use candle_core::{DType, Device, IndexOp, Tensor, D};

type CResult<T> = candle_core::Result<T>;

const EPS: f64 = 1e-6;

/// LayerNorm without affine parameters (`elementwise_affine=False`), through candle's
/// fused layer-norm kernel.
fn layer_norm(x: &Tensor) -> CResult<Tensor> {
    ops::layer_norm(x, EPS as f32)
}

/// The sinusoidal timestep embedding of diffusers' `Timesteps(256, flip_sin_to_cos=True,
/// downscale_freq_shift=0, scale=1000)`: `t · f_i · 1000` for `f_i = exp(-ln(10⁴)·i/128)`,
/// cos then sin, in f32. `t` is first rounded to the compute dtype, as the reference
/// casts the timestep to the hidden states' dtype.
fn timestep_embedding(t: &Tensor, dtype: DType) -> CResult<Tensor> {
    let half = TIME_EMBED_DIM / 2;
    let dev = t.device();
    let t = t.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let arange = Tensor::arange(0, half as u32, dev)?.to_dtype(DType::F32)?;
    let freqs = (arange * (-(10_000f64.ln()) / half as f64))?.exp()?;
    let args = (t.unsqueeze(1)?.broadcast_mul(&freqs.unsqueeze(0)?)? * 1000.0)?;
    Tensor::cat(&[args.cos()?, args.sin()?], D::Minus1)?.to_dtype(dtype)
}

/// RoPE on `(b, h, L, d)` with the rotation table `(2, L', d/2)` (L' ≥ L): interleaved
/// pairs, computed in f32 and rounded once, as the reference multiplies by complex
/// exponentials in f32.
fn apply_rope(x: &Tensor, pe: &Tensor) -> CResult<Tensor> {
    let cos = pe.i(0)?.contiguous()?;
    let sin = pe.i(1)?.contiguous()?;
    let y = candle_nn::rotary_emb::rope_i(&x.to_dtype(DType::F32)?.contiguous()?, &cos, &sin)?;
    y.to_dtype(x.dtype())
}

/// Per-head RMSNorm scales of q and k for one stream.
#[derive(Clone, Debug)]
struct QkNorm {
    q: Tensor,
    k: Tensor,
}

impl QkNorm {
    fn load(src: &dyn WeightSource, p: &str, q: &str, k: &str) -> Result<Self> {
        Ok(QkNorm {
            q: src.load(&format!("{p}.{q}.weight"), None, None)?,
            k: src.load(&format!("{p}.{k}.weight"), None, None)?,
        })
    }
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        let q = f(&self.q)?;
        Ok(QkNorm { q, k: f(&self.k)? })
    }
    fn bytes(&self) -> u64 {
        vector_bytes(&self.q) + vector_bytes(&self.k)
    }
}

/// One stream's q, k and v projections as one column-parallel linear: this rank's rows
/// of `to_q`, `to_k` and `to_v` (or the `add_*_proj` of the text stream) stacked, so one
/// matmul computes all three and the fused q/k/v preparation reads them as FLUX's `qkv`.
#[derive(Clone, Debug)]
struct Qkv {
    /// Dense or FP8 ([`Mat`]).
    weight: Mat,
    bias: Tensor,
}

impl Qkv {
    fn load(
        src: &dyn WeightSource,
        names: [String; 3],
        rows: &std::ops::Range<usize>,
    ) -> Result<Self> {
        let rows = std::slice::from_ref(rows);
        let mut w = Vec::with_capacity(3);
        let mut b = Vec::with_capacity(3);
        for n in names {
            w.push(src.load_product(&format!("{n}.weight"), Some(rows), None)?);
            b.push(src.load(&format!("{n}.bias"), Some(rows), None)?);
        }
        Ok(Qkv {
            weight: Mat::cat_rows(&w)?,
            bias: Tensor::cat(&b, 0)?,
        })
    }
    /// `x Wᵀ + b`, the bias in the matmul's epilogue on CUDA ([`Mat::linear`]), as the
    /// cost model's `Run::Bias` product measures it (a separate bias pass read and wrote
    /// the 3·hidden outputs once more per token).
    /// The input may be quantized ahead for an FP8 weight ([`Mat::linear_in`]).
    fn forward_in(&self, x: &Input, k: Kernels) -> CResult<Tensor> {
        self.weight.linear_in(x, &self.bias, false, k)
    }
    fn parts(&self) -> (&Mat, &Tensor) {
        (&self.weight, &self.bias)
    }
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(Qkv {
            weight: self.weight.map_tensors(f)?,
            bias: f(&self.bias)?,
        })
    }
    fn bytes(&self) -> u64 {
        self.weight.bytes() + vector_bytes(&self.bias)
    }
}

/// One stream's weights in a block.
#[derive(Clone, Debug)]
struct Stream {
    /// `{img,txt}_mod.1`: this rank's rows of the 6h modulation outputs.
    modulation: ColumnParallel,
    qkv: Qkv,
    norm: QkNorm,
    out: RowParallel,
    mlp_in: ColumnParallel,
    mlp_out: RowParallel,
}

impl Stream {
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(Stream {
            modulation: self.modulation.map_tensors(f)?,
            qkv: self.qkv.map_tensors(f)?,
            norm: self.norm.map_tensors(f)?,
            out: self.out.map_tensors(f)?,
            mlp_in: self.mlp_in.map_tensors(f)?,
            mlp_out: self.mlp_out.map_tensors(f)?,
        })
    }
    fn bytes(&self) -> u64 {
        self.modulation.bytes()
            + self.qkv.bytes()
            + self.norm.bytes()
            + self.out.bytes()
            + self.mlp_in.bytes()
            + self.mlp_out.bytes()
    }
}

/// A dual-stream block (`transformer_blocks.N`) of one rank.
#[derive(Clone, Debug)]
pub struct Block {
    img: Stream,
    txt: Stream,
    /// Heads on this rank.
    heads: usize,
}

impl Block {
    pub fn load(
        src: &dyn WeightSource,
        cfg: &QwenConfig,
        index: usize,
        shard: Shard,
    ) -> Result<Self> {
        let p = format!("transformer_blocks.{index}");
        let h = cfg.hidden;
        let heads = shard.range(h);
        let mlp = shard.range(cfg.mlp_hidden);
        let a = format!("{p}.attn");
        let stream = |s: &str, proj: [&str; 3], norm: [&str; 2], out: &str| -> Result<Stream> {
            Ok(Stream {
                modulation: ColumnParallel::load(
                    src,
                    &format!("{p}.{s}_mod.1"),
                    &[shard.range(6 * h)],
                )?,
                qkv: Qkv::load(src, proj.map(|n| format!("{a}.{n}")), &heads)?,
                norm: QkNorm::load(src, &a, norm[0], norm[1])?,
                out: RowParallel::load(src, &format!("{a}.{out}"), std::slice::from_ref(&heads))?,
                mlp_in: ColumnParallel::load(
                    src,
                    &format!("{p}.{s}_mlp.net.0.proj"),
                    std::slice::from_ref(&mlp),
                )?,
                mlp_out: RowParallel::load(
                    src,
                    &format!("{p}.{s}_mlp.net.2"),
                    std::slice::from_ref(&mlp),
                )?,
            })
        };
        Ok(Block {
            img: stream(
                "img",
                ["to_q", "to_k", "to_v"],
                ["norm_q", "norm_k"],
                "to_out.0",
            )?,
            txt: stream(
                "txt",
                ["add_q_proj", "add_k_proj", "add_v_proj"],
                ["norm_added_q", "norm_added_k"],
                "to_add_out",
            )?,
            heads: cfg.heads / shard.world,
        })
    }

    /// q, k, v of the joint sequence `[txt; img]`, `(b, heads, L, head_dim)`: q/k RMSNorm
    /// per stream, RoPE, the segments concatenated. One fused kernel per segment on CUDA
    /// (with `fp8`, attention in FP8, also taking their largest magnitudes).
    fn prepare_qkv(
        &self,
        txt_qkv: &Tensor,
        img_qkv: &Tensor,
        pe: &Tensor,
        lens: &[usize],
        fp8: bool,
        ctx: &Ctx,
    ) -> CResult<sequence::Qkv> {
        let segs = [(txt_qkv, &self.txt.norm), (img_qkv, &self.img.norm)];
        let fsegs: Vec<ops::QkvSegment> = segs
            .iter()
            .map(|(x, n)| ops::QkvSegment {
                qkv: x,
                q_scale: &n.q,
                k_scale: &n.k,
            })
            .collect();
        let supported = ops::qkv_prep_supported(&fsegs, self.heads);
        if ctx.kernels.use_fused(supported, "q/k/v preparation")? {
            let cos = pe.narrow(0, 0, 1)?.contiguous()?;
            let sin = pe.narrow(0, 1, 1)?.contiguous()?;
            return sequence::prepare_fused(
                &fsegs,
                self.heads,
                (&cos, &sin),
                EPS as f32,
                lens,
                fp8,
                ctx,
            );
        }
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (x, norm) in segs {
            let (b, l, _) = x.dims3()?;
            let x = x.reshape((b, l, 3, self.heads, ()))?;
            // (b, heads, L, head_dim), contiguous.
            let part = |i: usize| x.i((.., .., i))?.transpose(1, 2)?.contiguous();
            qs.push(candle_nn::ops::rms_norm(&part(0)?, &norm.q, EPS as f32)?);
            ks.push(candle_nn::ops::rms_norm(&part(1)?, &norm.k, EPS as f32)?);
            vs.push(part(2)?);
        }
        let (q, k, v) = (
            Tensor::cat(&qs, 2)?,
            Tensor::cat(&ks, 2)?,
            Tensor::cat(&vs, 2)?,
        );
        ctx.mark("qk norm + layout", &v);
        let q = apply_rope(&q, pe)?;
        let k = apply_rope(&k, pe)?;
        ctx.mark("rope", &k);
        sequence::Qkv::new(q, k, v, ctx.sp.world_size())
    }

    /// The block on this rank's tokens: `img` `(b, L_img, h)`, `txt` `(b, L_txt, h)`,
    /// `temb` `(b, h)`, `pe` the rotation table of `[txt; img]`; `lens` every
    /// sequence-parallel rank's token count ([`sequence::attention`]). `img` and `txt` are
    /// taken by value: each intermediate (the inputs included) is dropped after its last
    /// use, not at the end of the call, so the block's peak is its MLP's — about what
    /// [`mold_models::BlockKind::activation_bytes`] counts — and not every intermediate at
    /// once.
    ///
    /// With `split` (token-split tensor parallelism), `img` and `txt` are this rank's
    /// shares of each stream's tokens: the norms, modulation and gated residuals run on
    /// them alone; each stream's normed share is all-gathered before its column-parallel
    /// product, and both streams' row-parallel partial sums are reduce-scattered back to
    /// shares in one call ([`TokenSplit::scatter_streams`]). The results are this rank's
    /// shares.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        img: Tensor,
        txt: Tensor,
        temb: &Tensor,
        pe: &Tensor,
        lens: &[usize],
        split: Option<&TokenSplit>,
        ctx: &Ctx,
    ) -> CResult<(Tensor, Tensor)> {
        ctx.mark_start(&img);
        let silu = temb.silu()?;
        let local = [
            self.img.modulation.forward_vec(&silu, ctx.kernels)?,
            self.txt.modulation.forward_vec(&silu, ctx.kernels)?,
        ];
        let full = gather_modulation(&local, ctx)?;
        let im = mod_outs(&full[0], 2)?;
        let tm = mod_outs(&full[1], 2)?;
        let (im1, im2, tm1, tm2) = (&im[0], &im[1], &tm[0], &tm[1]);
        ctx.mark("modulation", &tm2.gate);
        let kn = ctx.kernels;
        let eps = EPS as f32;
        let (iq, tq) = (&self.img.qkv, &self.txt.qkv);
        let img_in = whole_input(split, im1, &img, eps, iq.parts(), false, Side::Img, ctx)?;
        let img_qkv = iq.forward_in(&img_in, kn)?;
        drop(img_in);
        let txt_in = whole_input(split, tm1, &txt, eps, tq.parts(), false, Side::Txt, ctx)?;
        let txt_qkv = tq.forward_in(&txt_in, kn)?;
        drop(txt_in);
        ctx.meter.see(&img_qkv);
        ctx.mark("norm + qkv linear", &txt_qkv);
        let fp8 = sequence::fp8_attention(iq.weight.is_fp8(), ctx);
        let qkv = self.prepare_qkv(&txt_qkv, &img_qkv, pe, lens, fp8, ctx)?;
        drop((img_qkv, txt_qkv));
        let attn = sequence::attention(qkv, lens, fp8, ctx)?;
        let tl = match split {
            Some(s) => s.txt,
            None => txt.dim(1)?,
        };
        let il = attn.dims()[1] - tl;

        // One all-reduce for both streams' output projections (none in a group of one;
        // under token split one reduce-scatter); their biases in the gated residual's pass.
        let streams = [&self.txt, &self.img];
        let sums = layers::row_parallel_sums(
            attn,
            &[tl, il],
            "attn out linear",
            ctx,
            split,
            |attn, i, s, n| {
                streams[i]
                    .out
                    .partial_in(&[&attn.narrow_tokens([0, tl][i] + s, n)?], kn)
            },
        )?;
        let [txt_attn, img_attn]: [Tensor; 2] = sums
            .try_into()
            .map_err(|_| candle_core::Error::Msg("row-parallel sums: two expected".into()))?;
        let img_mid = im1.gate_bias_residual(&img, &img_attn, self.img.out.bias(), kn)?;
        let txt_mid = tm1.gate_bias_residual(&txt, &txt_attn, self.txt.out.bias(), kn)?;
        drop((img, txt, img_attn, txt_attn));
        ctx.mark("bias + gate + residual", &txt_mid);

        // One all-reduce for both streams' MLPs.
        let (im0, tm0) = (&self.img.mlp_in, &self.txt.mlp_in);
        let img_in = whole_input(split, im2, &img_mid, eps, im0.parts(), true, Side::Img, ctx)?;
        let img_h = im0.forward_in(&img_in, true, kn)?;
        drop(img_in);
        let txt_in = whole_input(split, tm2, &txt_mid, eps, tm0.parts(), true, Side::Txt, ctx)?;
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
            |hs, i, s, n| streams[i].mlp_out.partial(&[&hs[i].narrow(1, s, n)?], kn),
        )?;
        let [txt_mlp, img_mlp]: [Tensor; 2] = sums
            .try_into()
            .map_err(|_| candle_core::Error::Msg("row-parallel sums: two expected".into()))?;
        let img = im2.gate_bias_residual(&img_mid, &img_mlp, self.img.mlp_out.bias(), kn)?;
        drop((img_mid, img_mlp));
        let txt = tm2.gate_bias_residual(&txt_mid, &txt_mlp, self.txt.mlp_out.bias(), kn)?;
        ctx.mark("bias + gate + residual", &txt);
        Ok((img, txt))
    }

    /// The block with `f` applied to each weight tensor, in a fixed order.
    pub fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(Block {
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

/// Everything before the blocks: `img_in`, `txt_norm` + `txt_in`, the timestep embedder
/// (`time_text_embed.timestep_embedder.linear_{1,2}`) and the RoPE table. Replicated.
#[derive(Clone, Debug)]
pub struct Stem {
    img_in: Linear,
    txt_norm: Tensor,
    txt_in: Linear,
    t1: Linear,
    t2: Linear,
    axes_dim: [usize; 3],
    theta: f64,
    /// The last rotation table made, for `(grid h, grid w, text tokens)` on a device: every pass of
    /// a request (each step, both CFG passes) has the same positions, and the table is
    /// computed on the host (tens of thousands of sin/cos), so it is made once.
    pe: PeCache,
}

/// `((grid h, grid w, text tokens), the device's location)`: what the table depends on.
type PeKey = ((usize, usize, usize), candle_core::DeviceLocation);
type PeCache = crate::model::cache::LastMade<PeKey>;

/// Activations entering the first block.
pub struct StemOut {
    pub img: Tensor,
    pub txt: Tensor,
    /// The conditioning `(b, hidden)`.
    pub temb: Tensor,
    /// The rotation table of `[txt; img]`, `(2, L, head_dim/2)` f32.
    pub pe: Tensor,
}

impl Stem {
    pub fn load(src: &dyn WeightSource, cfg: &QwenConfig) -> Result<Self> {
        let t = "time_text_embed.timestep_embedder";
        Ok(Stem {
            img_in: Linear::load(src, "img_in")?,
            txt_norm: src.load("txt_norm.weight", None, None)?,
            txt_in: Linear::load(src, "txt_in")?,
            t1: Linear::load(src, &format!("{t}.linear_1"))?,
            t2: Linear::load(src, &format!("{t}.linear_2"))?,
            axes_dim: cfg.axes_dim,
            theta: cfg.theta,
            pe: PeCache::default(),
        })
    }

    /// `img` and `txt` in the compute dtype, `timesteps` `(b,)` f32, `grid` the patch
    /// grid (rows, columns).
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        timesteps: &Tensor,
        grid: (usize, usize),
    ) -> CResult<StemOut> {
        let dtype = img.dtype();
        let img = self.img_in.forward(img)?;
        let txt = candle_nn::ops::rms_norm(&txt.contiguous()?, &self.txt_norm, EPS as f32)?;
        let txt = self.txt_in.forward(&txt)?;
        let temb = self.t2.forward(
            &self
                .t1
                .forward(&timestep_embedding(timesteps, dtype)?)?
                .silu()?,
        )?;
        let txt_len = txt.dim(1)?;
        let key = ((grid.0, grid.1, txt_len), img.device().location());
        let pe = self.pe.get(key, || {
            super::rope::table(
                &self.axes_dim,
                self.theta,
                grid.0,
                grid.1,
                txt_len,
                img.device(),
            )
        })?;
        Ok(StemOut { img, txt, temb, pe })
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(Stem {
            img_in: self.img_in.to_device(d)?,
            txt_norm: self.txt_norm.to_device(d)?,
            txt_in: self.txt_in.to_device(d)?,
            t1: self.t1.to_device(d)?,
            t2: self.t2.to_device(d)?,
            axes_dim: self.axes_dim,
            theta: self.theta,
            pe: PeCache::default(),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.img_in.bytes()
            + vector_bytes(&self.txt_norm)
            + self.txt_in.bytes()
            + self.t1.bytes()
            + self.t2.bytes()
    }
}

/// `norm_out` (diffusers `AdaLayerNormContinuous`: scale, then shift, from the SiLU'd
/// conditioning; affine-free LayerNorm) and `proj_out`. Replicated.
#[derive(Clone, Debug)]
pub struct FinalLayer {
    norm: Linear,
    proj: Linear,
}

impl FinalLayer {
    pub fn load(src: &dyn WeightSource) -> Result<Self> {
        Ok(FinalLayer {
            norm: Linear::load(src, "norm_out.linear")?,
            proj: Linear::load(src, "proj_out")?,
        })
    }

    /// `img` is `(b, L_img, hidden)`; returns `(b, L_img, patch² · out_channels)`.
    pub fn forward(&self, img: &Tensor, temb: &Tensor) -> CResult<Tensor> {
        let c = self.norm.forward(&temb.silu()?)?.chunk(2, 1)?;
        let (scale, shift) = (&c[0], &c[1]);
        let x = layer_norm(img)?
            .broadcast_mul(&(scale.unsqueeze(1)? + 1.0)?)?
            .broadcast_add(&shift.unsqueeze(1)?)?;
        self.proj.forward(&x)
    }

    pub fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(FinalLayer {
            norm: self.norm.to_device(d)?,
            proj: self.proj.to_device(d)?,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.norm.bytes() + self.proj.bytes()
    }
}
