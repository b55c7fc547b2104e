//! Linear layers for tensor parallelism.
//!
//! - [`Linear`]: replicated (every rank holds all of it).
//! - [`ColumnParallel`]: each rank holds some output features (rows of the `[out, in]`
//!   weight, and the matching bias entries); no communication.
//! - [`RowParallel`]: each rank holds some input features (columns of the weight); ranks
//!   produce partial sums that are all-reduced, and the bias is added once, after the
//!   reduce.

use super::ops::{bias_act, Kernels};
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
    /// The weight alone: the bias is added by [`bias_act`] (fused on CUDA).
    weight: candle_nn::Linear,
    bias: Tensor,
}

impl ColumnParallel {
    pub fn load(src: &dyn WeightSource, prefix: &str, rows: &[Range<usize>]) -> Result<Self> {
        let w = src.load(&format!("{prefix}.weight"), Some(rows), None)?;
        let b = src.load(&format!("{prefix}.bias"), Some(rows), None)?;
        Ok(ColumnParallel {
            weight: candle_nn::Linear::new(w, None),
            bias: b,
        })
    }
    pub fn forward(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        bias_act(&self.weight.forward(x)?, Some(&self.bias), false, k)
    }
    /// `gelu(x Wᵀ + b)` (tanh approximation), bias and activation in one pass.
    pub fn forward_gelu(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        bias_act(&self.weight.forward(x)?, Some(&self.bias), true, k)
    }
    pub fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
        Ok(ColumnParallel {
            weight: lin_map(&self.weight, f)?,
            bias: f(&self.bias)?,
        })
    }
    pub fn bytes(&self) -> u64 {
        lin_bytes(&self.weight) + bytes(&self.bias)
    }
}

/// Input features `cols` of a linear layer; the full bias.
#[derive(Clone, Debug)]
pub struct RowParallel {
    weight: candle_nn::Linear,
    bias: Tensor,
}

impl RowParallel {
    pub fn load(src: &dyn WeightSource, prefix: &str, cols: &[Range<usize>]) -> Result<Self> {
        let w = src.load(&format!("{prefix}.weight"), None, Some(cols))?;
        let b = src.load(&format!("{prefix}.bias"), None, None)?;
        Ok(RowParallel {
            weight: candle_nn::Linear::new(w, None),
            bias: b,
        })
    }
    /// This rank's partial product (no bias): all-reduce it, then [`Self::add_bias`].
    pub fn partial(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.weight.forward(x)
    }
    pub fn add_bias(&self, reduced: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        bias_act(reduced, Some(&self.bias), false, k)
    }
    pub fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
        Ok(RowParallel {
            weight: lin_map(&self.weight, f)?,
            bias: f(&self.bias)?,
        })
    }
    pub fn bytes(&self) -> u64 {
        lin_bytes(&self.weight) + bytes(&self.bias)
    }
}

/// A replicated weight vector (e.g. an RMSNorm scale).
pub(crate) fn vector_bytes(t: &Tensor) -> u64 {
    bytes(t)
}
