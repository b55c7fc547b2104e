//! adaLN modulation shared by the families: the per-sample (shift, scale, gate) triples a
//! block's modulation linear produces, and putting a column-parallel modulation output
//! back together across a tensor-parallel group.

use super::ops::{self, Kernels};
use super::Ctx;
use candle_core::{Tensor, D};

type CResult<T> = candle_core::Result<T>;

/// Shift, scale and gate, each `(b, 1, hidden)`.
pub(crate) struct ModOut {
    pub(crate) shift: Tensor,
    pub(crate) scale: Tensor,
    pub(crate) gate: Tensor,
}

impl ModOut {
    /// `layer_norm(x) * (1 + scale) + shift` (LayerNorm without affine parameters), in one
    /// pass on CUDA.
    pub(crate) fn norm_scale_shift(&self, x: &Tensor, eps: f32, k: Kernels) -> CResult<Tensor> {
        ops::ln_modulate(x, &self.scale, &self.shift, eps, k)
    }
    /// `res + gate * (x + bias)`: a row-parallel layer's bias, after its all-reduce, added
    /// in the gated residual's pass.
    pub(crate) fn gate_bias_residual(
        &self,
        res: &Tensor,
        x: &Tensor,
        bias: &Tensor,
        k: Kernels,
    ) -> CResult<Tensor> {
        ops::gate_residual(res, x, Some(bias), &self.gate, k)
    }
}

/// The full modulation outputs, each `(b, out_i)`, from this rank's slices `(b, out_i /
/// world)` (rank `r` holds features `r·out_i/world ..`): one all-gather for all of them
/// (the slices side by side), none in a group of one.
pub(crate) fn gather_modulation(locals: &[Tensor], ctx: &Ctx) -> CResult<Vec<Tensor>> {
    if ctx.comm.world_size() == 1 {
        return Ok(locals.to_vec());
    }
    let joined = if locals.len() == 1 {
        locals[0].clone()
    } else {
        Tensor::cat(locals, D::Minus1)?
    };
    // (world, b, Σ out_i / world): contiguous row ranges in rank order, so each output
    // is its columns of every rank, laid side by side.
    let all = ctx.comm.all_gather(&joined)?;
    let (world, b, _) = all.dims3()?;
    let mut off = 0;
    let mut out = Vec::with_capacity(locals.len());
    for l in locals {
        let k = l.dim(D::Minus1)?;
        out.push(
            all.narrow(2, off, k)?
                .permute((1, 0, 2))?
                .contiguous()?
                .reshape((b, world * k))?,
        );
        off += k;
    }
    Ok(out)
}

/// `n` × (shift, scale, gate), each `(b, 1, hidden)`, from a full modulation output.
pub(crate) fn mod_outs(full: &Tensor, n: usize) -> CResult<Vec<ModOut>> {
    let ys = full.unsqueeze(1)?.chunk(3 * n, D::Minus1)?;
    Ok(ys
        .chunks(3)
        .map(|c| ModOut {
            shift: c[0].clone(),
            scale: c[1].clone(),
            gate: c[2].clone(),
        })
        .collect())
}
