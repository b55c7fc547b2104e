//! Linear layers for tensor parallelism.
//!
//! - [`Linear`]: replicated (every rank holds all of it).
//! - [`ColumnParallel`]: each rank holds some output features (rows of the `[out, in]`
//!   weight, and the matching bias entries); no communication.
//! - [`RowParallel`]: each rank holds some input features (columns of the weight); ranks
//!   produce partial sums that are all-reduced, and the bias is added once, after the
//!   reduce.

use super::mat::Mat;
use super::ops::{bias_act, Kernels};
use super::Ctx;
use super::WeightSource;
use crate::error::Result;
use candle_core::{Device, Module, Tensor};
use std::ops::Range;

fn bytes(t: &Tensor) -> u64 {
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
    /// The first `at` output features as `x Wᵀ + b`, the rest as `gelu(x Wᵀ + b)`: two
    /// matmuls over row slices of the weight, each with its bias (and GELU) — in its
    /// epilogue on CUDA. Not one matmul sliced after: its first slice would keep the
    /// whole output alive as long as it lives, the MLP part's bytes twice over.
    pub fn forward_split_gelu(
        &self,
        x: &Tensor,
        at: usize,
        k: Kernels,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let n = self.weight.rows()?;
        if at > n {
            candle_core::bail!("split at {at} of a {n}-feature linear");
        }
        let (w1, b1) = (self.weight.narrow_rows(0, at)?, self.bias.narrow(0, 0, at)?);
        let (w2, b2) = (
            self.weight.narrow_rows(at, n - at)?,
            self.bias.narrow(0, at, n - at)?,
        );
        Ok((w1.linear(x, &b1, false, k)?, w2.linear(x, &b2, true, k)?))
    }
    /// `x Wᵀ + b` for a small per-sample input (`(b, in)`, e.g. the conditioning vector):
    /// on CUDA one cuBLASLt matmul with the bias in its epilogue, elsewhere candle's matmul
    /// and broadcast add, as a replicated [`Linear`] computes these rows.
    pub fn forward_vec(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        self.weight.linear(x, &self.bias, false, k)
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
                None => w.matmul(x, k)?,
                // On CUDA the next product is accumulated into the sum in the matmul
                // (cuBLASLt, beta = 1) instead of a separate add over the output.
                Some(a) => w.add_matmul(a, x, k)?,
            });
        }
        acc.ok_or_else(|| candle_core::Error::Msg("row-parallel linear without input".into()))
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

/// The two streams' row-parallel partial sums (txt, img), summed over the tensor-parallel
/// group with one all-reduce (the two side by side along the sequence); in a group of one
/// they are already the sums, and nothing is copied.
pub(crate) fn reduce_pair(
    txt: Tensor,
    img: Tensor,
    label: &'static str,
    ctx: &Ctx,
) -> candle_core::Result<(Tensor, Tensor)> {
    ctx.meter.see(&img);
    ctx.mark(label, &img);
    if ctx.comm.world_size() == 1 {
        return Ok((txt, img));
    }
    let tl = txt.dim(1)?;
    let il = img.dim(1)?;
    let partial = Tensor::cat(&[&txt, &img], 1)?;
    drop((txt, img));
    ctx.meter.see(&partial);
    let reduced = ctx.comm.all_reduce_sum(&partial)?;
    drop(partial);
    ctx.mark("all-reduce", &reduced);
    Ok((reduced.narrow(1, 0, tl)?, reduced.narrow(1, tl, il)?))
}

/// A replicated weight vector (e.g. an RMSNorm scale).
pub(crate) fn vector_bytes(t: &Tensor) -> u64 {
    bytes(t)
}
