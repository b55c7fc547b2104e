//! Linear layers for tensor parallelism.
//!
//! - [`Linear`]: replicated (every rank holds all of it).
//! - [`ColumnParallel`]: each rank holds some output features (rows of the `[out, in]`
//!   weight, and the matching bias entries); no communication.
//! - [`RowParallel`]: each rank holds some input features (columns of the weight); ranks
//!   produce partial sums that are all-reduced, and the bias is added once, after the
//!   reduce.

use super::mat::{Input, Mat};
use super::ops::{bias_act, Kernels};
use super::Ctx;
use super::WeightSource;
use crate::error::Result;
use crate::model::token_split::TokenSplit;
use candle_core::{Device, Module, Tensor};
use std::ops::Range;

/// Bytes of `t`'s values.
pub(crate) fn bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// A function applied to every weight tensor of a layer or block, in a fixed order (the
/// runtime uses it to move weights, to lay them out in one buffer, and to view them
/// back out of one).
pub type TensorMap<'a> = dyn FnMut(&Tensor) -> candle_core::Result<Tensor> + 'a;

fn lin_map(l: &candle_nn::Linear, f: &mut TensorMap) -> candle_core::Result<candle_nn::Linear> {
    let w = f(l.weight())?;
    let b = l.bias().map(&mut *f).transpose()?;
    Ok(candle_nn::Linear::new(w, b))
}

fn lin_bytes(l: &candle_nn::Linear) -> u64 {
    bytes(l.weight()) + l.bias().map(bytes).unwrap_or(0)
}

/// A replicated linear layer (`{prefix}.weight`, `{prefix}.bias`).
#[derive(Clone, Debug)]
pub struct Linear(candle_nn::Linear);

impl Linear {
    pub fn load(src: &dyn WeightSource, prefix: &str) -> Result<Self> {
        let w = src.load(&format!("{prefix}.weight"), None, None)?;
        let b = src.load(&format!("{prefix}.bias"), None, None)?;
        Ok(Linear(candle_nn::Linear::new(w, Some(b))))
    }
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
    pub fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
        Ok(Linear(lin_map(&self.0, f)?))
    }
    pub fn to_device(&self, d: &Device) -> candle_core::Result<Self> {
        self.map_tensors(&mut |t| t.to_device(d))
    }
    pub fn bytes(&self) -> u64 {
        lin_bytes(&self.0)
    }
}

/// Output features `rows` of a linear layer (several ranges are concatenated, so a fused
/// projection such as `qkv` is sharded per part, not as one slab).
#[derive(Clone, Debug)]
pub struct ColumnParallel {
    /// The weight alone (dense or FP8): the bias is added in the product's epilogue.
    weight: Mat,
    bias: Tensor,
}

impl ColumnParallel {
    /// Whether the weight is held in FP8 (the block's products run in FP8).
    pub fn is_fp8(&self) -> bool {
        self.weight.is_fp8()
    }
    pub fn load(src: &dyn WeightSource, prefix: &str, rows: &[Range<usize>]) -> Result<Self> {
        let w = src.load_product(&format!("{prefix}.weight"), Some(rows), None)?;
        let b = src.load(&format!("{prefix}.bias"), Some(rows), None)?;
        Ok(ColumnParallel { weight: w, bias: b })
    }
    /// `x Wᵀ + b`, the bias in the matmul's epilogue on CUDA ([`super::gemm::linear`]).
    pub fn forward(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight.linear(x, &self.bias, false, k)
    }
    /// `gelu(x Wᵀ + b)` (tanh approximation), bias and activation in the epilogue.
    pub fn forward_gelu(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight.linear(x, &self.bias, true, k)
    }
    /// [`Self::forward`] (`gelu`: [`Self::forward_gelu`]) of an input that may be quantized
    /// ahead ([`Mat::linear_in`]).
    pub fn forward_in(&self, x: &Input, gelu: bool, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight.linear_in(x, &self.bias, gelu, k)
    }
    /// The weight and the bias.
    pub fn parts(&self) -> (&Mat, &Tensor) {
        (&self.weight, &self.bias)
    }
    /// Whether [`Self::forward_split_gelu_in`]'s two products at `at` take an input like
    /// `x` quantized ahead by the norm before them ([`Mat::takes_rows`]).
    pub fn split_takes_rows(&self, x: &Tensor, at: usize, k: Kernels) -> bool {
        let Ok(n) = self.weight.rows() else {
            return false;
        };
        at < n
            && [(0, at, false), (at, n - at, true)]
                .iter()
                .all(|&(s, len, g)| {
                    match (self.weight.narrow_rows(s, len), self.bias.narrow(0, s, len)) {
                        (Ok(w), Ok(b)) => w.takes_rows(x, &[(Some(&b), g)], k),
                        _ => false,
                    }
                })
    }
    /// The first `at` output features as `x Wᵀ + b`, the rest as `gelu(x Wᵀ + b)`: two
    /// matmuls over row slices of the weight, each with its bias (and GELU) — in its
    /// epilogue on CUDA. Not one matmul sliced after: its first slice would keep the
    /// whole output alive as long as it lives, the MLP part's bytes twice over.
    /// The input may be quantized ahead: both products then take it as it is (one quantizing
    /// pass for the two).
    pub fn forward_split_gelu_in(
        &self,
        x: &Input,
        at: usize,
        k: Kernels,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let n = self.weight.rows()?;
        if at > n {
            candle_core::bail!("split at {at} of a {n}-feature linear");
        }
        Ok((
            self.forward_rows_in(x, 0, at, false, k)?,
            self.forward_rows_in(x, at, n - at, true, k)?,
        ))
    }
    /// Output features `start..start + len` alone: `x Wᵀ + b` of those rows, through GELU
    /// with `gelu` (bias and activation in the epilogue on CUDA); the input may be quantized
    /// ahead ([`Mat::linear_in`]).
    pub fn forward_rows_in(
        &self,
        x: &Input,
        start: usize,
        len: usize,
        gelu: bool,
        k: Kernels,
    ) -> candle_core::Result<Tensor> {
        let n = self.weight.rows()?;
        if start + len > n {
            candle_core::bail!("features {start}..{} of a {n}-feature linear", start + len);
        }
        let (w, b) = (
            self.weight.narrow_rows(start, len)?,
            self.bias.narrow(0, start, len)?,
        );
        w.linear_in(x, &b, gelu, k)
    }
    /// `x Wᵀ + b` for a small per-sample input (`(b, in)`, e.g. the conditioning vector):
    /// on CUDA one cuBLASLt matmul with the bias in its epilogue, elsewhere candle's matmul
    /// and broadcast add, as a replicated [`Linear`] computes these rows. An FP8 weight is
    /// widened and the input not quantized ([`Mat::linear_vec`]): the modulation it gives
    /// scales every token.
    pub fn forward_vec(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight.linear_vec(x, &self.bias, k)
    }
    pub fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
        Ok(ColumnParallel {
            weight: self.weight.map_tensors(f)?,
            bias: f(&self.bias)?,
        })
    }
    pub fn bytes(&self) -> u64 {
        self.weight.bytes() + bytes(&self.bias)
    }
}

/// Input features `cols` of a linear layer; the full bias. Each range of `cols` is held
/// as its own weight, so an input that arrives in pieces (FLUX's single block feeds
/// `[attention, MLP]`) is multiplied piece by piece, never concatenated.
#[derive(Clone, Debug)]
pub struct RowParallel {
    /// One `[out, cols[i].len()]` weight (dense or FP8) per range of `cols`.
    weights: Vec<Mat>,
    bias: Tensor,
}

impl RowParallel {
    pub fn load(src: &dyn WeightSource, prefix: &str, cols: &[Range<usize>]) -> Result<Self> {
        let name = format!("{prefix}.weight");
        let weights = cols
            .iter()
            .map(|c| src.load_product(&name, None, Some(std::slice::from_ref(c))))
            .collect::<Result<Vec<_>>>()?;
        let b = src.load(&format!("{prefix}.bias"), None, None)?;
        Ok(RowParallel { weights, bias: b })
    }
    /// This rank's partial product (no bias), `Σᵢ xs[i] Wᵢᵀ` with `xs[i]` the input
    /// features of `cols[i]`: all-reduce it, then [`Self::add_bias`].
    pub fn partial(&self, xs: &[&Tensor], k: Kernels) -> candle_core::Result<Tensor> {
        let xs: Vec<Input> = xs.iter().map(|x| Input::Dense((*x).clone())).collect();
        self.partial_in(&xs.iter().collect::<Vec<_>>(), k)
    }
    /// [`Self::partial`] of inputs that may be quantized ahead (FP8 attention's output goes
    /// to its projection as it is: [`Mat::matmul_in`]).
    pub fn partial_in(&self, xs: &[&Input], k: Kernels) -> candle_core::Result<Tensor> {
        if xs.len() != self.weights.len() {
            candle_core::bail!(
                "row-parallel linear over {} input segments given {}",
                self.weights.len(),
                xs.len()
            );
        }
        let mut acc: Option<Tensor> = None;
        for (x, w) in xs.iter().zip(&self.weights) {
            acc = Some(match acc {
                None => w.matmul_in(x, k)?,
                // On CUDA the next product is accumulated into the sum in the matmul
                // (cuBLASLt, beta = 1) instead of a separate add over the output.
                Some(a) => w.add_matmul_in(a, x, k)?,
            });
        }
        acc.ok_or_else(|| candle_core::Error::Msg("row-parallel linear without input".into()))
    }
    /// The partial product of input segment `i` alone, `x Wᵢᵀ`: [`Self::partial`] one
    /// segment at a time, in any order, the others added by [`Self::add_segment`].
    pub fn segment(&self, i: usize, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight_of(i)?.matmul(x, k)
    }
    /// `acc + x Wᵢᵀ`, accumulated in the product where the libraries run it (`acc`
    /// consumed); `x` may be quantized ahead ([`Mat::add_matmul_in`]).
    pub fn add_segment(
        &self,
        acc: Tensor,
        i: usize,
        x: &Input,
        k: Kernels,
    ) -> candle_core::Result<Tensor> {
        self.weight_of(i)?.add_matmul_in(acc, x, k)
    }
    fn weight_of(&self, i: usize) -> candle_core::Result<&Mat> {
        self.weights.get(i).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "row-parallel linear over {} input segments: no segment {i}",
                self.weights.len()
            ))
        })
    }
    pub fn add_bias(&self, reduced: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        bias_act(reduced, Some(&self.bias), false, k)
    }
    /// The bias (added once, after the all-reduce; e.g. in a gated residual's pass).
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
    pub fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
        Ok(RowParallel {
            weights: self
                .weights
                .iter()
                .map(|w| w.map_tensors(f))
                .collect::<candle_core::Result<_>>()?,
            bias: f(&self.bias)?,
        })
    }
    pub fn bytes(&self) -> u64 {
        self.weights.iter().map(Mat::bytes).sum::<u64>() + bytes(&self.bias)
    }
}

/// Token chunks are multiples of this many tokens (GEMM tiles stay whole).
const CHUNK_ALIGN: usize = 128;

/// Row-parallel products summed over the tensor-parallel group, one per sequence segment
/// in order (a double block's txt then img; a single block's one): `partial(i, start,
/// len)` is this rank's partial product (no bias) of tokens `start..start + len` of
/// segment `i`, `(b, len, out)`; `lens` are the segments' token counts. Returns each
/// segment's sum.
///
/// In a group of one the partial products are the sums (nothing is copied). With
/// [`Comm::overlap_chunks`](crate::comm::Comm::overlap_chunks) `n` > 1 the products are
/// made in about `n` token chunks (a segment gets its share of them, at least one), each
/// pushed to a [`chunked_sum`](crate::comm::Comm::chunked_sum) as soon as it is queued, so
/// the group sums chunk i while the GPU computes chunk i+1. With `n` = 1 the segments'
/// products are put side by side and summed with one all-reduce after them.
///
/// With `split` (token-split tensor parallelism) the segments' products are reduce-scattered
/// instead, and each segment's sum comes back as this rank's share of it: two segments are
/// a double block's streams ([`TokenSplit::scatter_streams`]), one a single-stream block's
/// tokens laid out rank by rank ([`TokenSplit::scatter_single`]).
///
/// `inputs` (what the products read) are taken by value and dropped as soon as the last
/// product is queued, before the sum, so they are not alive beside it.
pub(crate) fn row_parallel_sums<T>(
    inputs: T,
    lens: &[usize],
    label: &'static str,
    ctx: &Ctx,
    split: Option<&TokenSplit>,
    mut partial: impl FnMut(&T, usize, usize, usize) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Vec<Tensor>> {
    let world = ctx.comm.world_size();
    let n = ctx.comm.overlap_chunks();
    let total: usize = lens.iter().sum();
    if split.is_some() || world == 1 || n <= 1 || total == 0 {
        // Each segment's product whole, then one collective over them all.
        let parts = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| partial(&inputs, i, 0, l))
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(inputs);
        if let Some(last) = parts.last() {
            ctx.meter.see(last);
            ctx.mark(label, last);
        }
        if let Some(s) = split {
            let shares = match <[Tensor; 2]>::try_from(parts) {
                Ok([t, i]) => {
                    let (t, i) = s.scatter_streams(t, i, ctx)?;
                    vec![t, i]
                }
                Err(parts) => parts
                    .iter()
                    .map(|p| s.scatter_single(p, ctx))
                    .collect::<candle_core::Result<Vec<_>>>()?,
            };
            if let Some(last) = shares.last() {
                ctx.mark("reduce-scatter (tokens)", last);
            }
            return Ok(shares);
        }
        if world == 1 || parts.is_empty() {
            return Ok(parts);
        }
        let joined = if parts.len() == 1 {
            parts[0].clone()
        } else {
            Tensor::cat(&parts, 1)?
        };
        drop(parts);
        ctx.meter.see(&joined);
        let reduced = ctx.comm.all_reduce_sum(&joined)?;
        drop(joined);
        ctx.mark("all-reduce", &reduced);
        return split_segments(&reduced, lens);
    }
    let mut sum = ctx.comm.chunked_sum(total);
    for (i, &l) in lens.iter().enumerate() {
        let k = (n * l).div_ceil(total).max(1);
        for (start, len) in crate::comm::token_chunks(l, k, CHUNK_ALIGN) {
            let p = partial(&inputs, i, start, len)?;
            sum.push(p)?;
        }
    }
    drop(inputs);
    let reduced = sum.finish()?;
    // The result and, until the sums are done, every chunk: two hidden states.
    ctx.meter.see_all(&[&reduced, &reduced]);
    ctx.mark("out linear + all-reduce", &reduced);
    split_segments(&reduced, lens)
}

/// `t` (`(b, Σ lens, ..)`) cut back into its segments along dimension 1.
fn split_segments(t: &Tensor, lens: &[usize]) -> candle_core::Result<Vec<Tensor>> {
    if lens.len() == 1 {
        return Ok(vec![t.clone()]);
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(lens.len());
    for &l in lens {
        out.push(t.narrow(1, at, l)?);
        at += l;
    }
    Ok(out)
}

/// A replicated weight vector (e.g. an RMSNorm scale).
pub(crate) fn vector_bytes(t: &Tensor) -> u64 {
    bytes(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Comm, ThreadComm};
    use crate::model::{ActivationMeter, Ctx};
    use candle_core::{DType, Device, IndexOp};

    /// Runs `row_parallel_sums` on every rank of a thread group of `world` with `chunks`;
    /// rank r's partial product is `r + 1 + token index` at every element. Returns rank
    /// 0's sums and the (segment, start, len) calls it made.
    #[allow(clippy::type_complexity)]
    fn run(
        world: usize,
        chunks: usize,
        lens: &[usize],
    ) -> (Vec<Tensor>, Vec<(usize, usize, usize)>) {
        let comms: Vec<ThreadComm> = ThreadComm::group(world)
            .into_iter()
            .map(|c| c.with_overlap_chunks(chunks))
            .collect();
        let out = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let meter = ActivationMeter::default();
                        let ctx = Ctx {
                            comm: c,
                            sp: &crate::comm::LocalComm,
                            meter: &meter,
                            kernels: crate::Kernels::Candle,
                            token_split: false,
                            profile: None,
                            ahead: None,
                            slot: 0,
                            fp8_attention: false,
                        };
                        let mut calls = Vec::new();
                        let sums =
                            row_parallel_sums((), lens, "test", &ctx, None, |_, i, start, len| {
                                calls.push((i, start, len));
                                let base = (c.rank() + 1) as f32;
                                let tok = Tensor::arange(
                                    start as f32,
                                    (start + len) as f32,
                                    &Device::Cpu,
                                )?
                                .reshape((1, len, 1))?;
                                (tok + base as f64)?.broadcast_as((1, len, 3))?.contiguous()
                            })
                            .unwrap();
                        (sums, calls)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        out.into_iter().next().unwrap()
    }

    /// Chunked or not, each segment's sum is Σ_r (r + 1 + token) = world·token + Σ(r+1);
    /// with 4 chunks the 520-token segment is made in 4 aligned products and the 40-token
    /// one in one, and the sums come back per segment.
    #[test]
    fn chunked_row_parallel_sums_equal_one_sum() {
        let lens = [40usize, 520];
        for world in [2usize, 3] {
            for chunks in [1usize, 2, 4] {
                let (sums, calls) = run(world, chunks, &lens);
                assert_eq!(sums.len(), 2);
                for (seg, sum) in sums.iter().enumerate() {
                    assert_eq!(sum.dims(), &[1, lens[seg], 3]);
                    let got = sum.to_dtype(DType::F32).unwrap().i((0, .., 0)).unwrap();
                    let got = got.to_vec1::<f32>().unwrap();
                    let ranks: f32 = (1..=world).map(|r| r as f32).sum();
                    for (t, v) in got.iter().enumerate() {
                        assert_eq!(*v, world as f32 * t as f32 + ranks, "w{world} c{chunks}");
                    }
                }
                let want: Vec<(usize, usize, usize)> = match chunks {
                    1 => vec![(0, 0, 40), (1, 0, 520)],
                    2 => vec![(0, 0, 40), (1, 0, 256), (1, 256, 264)],
                    _ => vec![
                        (0, 0, 40),
                        (1, 0, 128),
                        (1, 128, 128),
                        (1, 256, 128),
                        (1, 384, 136),
                    ],
                };
                assert_eq!(calls, want, "world {world}, {chunks} chunks");
            }
        }
        // A group of one makes each segment's product whole, whatever the chunks.
        let (sums, calls) = run(1, 4, &lens);
        assert_eq!(calls, vec![(0, 0, 40), (1, 0, 520)]);
        assert_eq!(sums[1].dims(), &[1, 520, 3]);
    }
}
