//! The model interface: what the executor needs from a transformer family. A family
//! (FLUX in [`super::flux`]) says which blocks it has, checks its checkpoint and inputs,
//! loads a stem, blocks (per [`Shard`]) and a final layer from a [`WeightSource`], and
//! runs them on [`Activations`] it defines. The executor ([`crate::Executor`]) keeps
//! placement, residency, hand-offs and communication, and knows no family's shapes.
//!
//! Adding a family: a folder under `model/` implementing [`Transformer`], plus its entry
//! in the catalogue (`mold-models`).

use super::layers::TensorMap;
use super::{Ctx, Shard, WeightSource};
use crate::error::Result;
use candle_core::{DType, Device, Tensor};

type CResult<T> = candle_core::Result<T>;

/// A block in execution order: its kind (one of [`Transformer::block_kinds`]) and its
/// index among the blocks of that kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRef {
    pub kind: &'static str,
    pub index: usize,
}

impl std::fmt::Display for BlockRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.index)
    }
}

/// A checkpoint tensor a family needs: its name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

/// Weights the runtime can place: moved to a device and sized.
pub trait Weights: Clone + Send + Sync + Sized {
    fn to_device(&self, d: &Device) -> CResult<Self>;
    /// Bytes of every tensor held.
    fn bytes(&self) -> u64;
}

/// Weights that can also be rebuilt tensor by tensor: the streaming ring packs a block's
/// tensors into one buffer and rebuilds the block from views of it.
pub trait Packable: Weights {
    /// The same weights with `f` applied to each tensor, in a fixed order.
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self>;
}

/// What flows between blocks, and between parts on different devices or processes.
pub trait Activations: Clone + Send + Sync + Sized {
    /// The activations with `f` applied to each tensor (e.g. a hand-off to a device).
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self>;
    /// For the wire between processes: a tag and the tensors (sizes such as a token
    /// count travel as small tensors).
    fn to_wire(&self) -> CResult<(u8, Vec<Tensor>)>;
    /// The inverse of [`Activations::to_wire`]; a malformed message is an error.
    fn from_wire(tag: u8, tensors: Vec<Tensor>) -> CResult<Self>;
}

/// The inputs of one transformer call, as the denoising loop drives them.
pub trait Inputs: Clone + Send + Sync {
    /// The latents being denoised.
    fn latents(&self) -> &Tensor;
    fn set_latents(&mut self, x: Tensor);
    /// Sets the time of the next call (1 = pure noise, 0 = clean), for every sample.
    fn set_time(&mut self, t: f64) -> CResult<()>;
    /// Every time the request's steps will be given ([`Inputs::set_time`]), in order, so
    /// that a model may compute what depends only on the time for several steps at once
    /// ([`crate::model::modulation`]). The default ignores them.
    fn set_schedule(&mut self, _times: &[f64]) -> CResult<()> {
        Ok(())
    }
    /// The inputs with `f` applied to each tensor (e.g. a hand-off to a rank's device).
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self>;
}

/// A transformer family: its blocks, checks, loading and forward pieces.
pub trait Transformer: Clone + Send + Sync + 'static {
    type Inputs: Inputs;
    type Acts: Activations;
    type Block: Packable;
    type Stem: Weights;
    type Final: Weights;

    /// A short name for messages (e.g. `FLUX`).
    fn family(&self) -> &'static str;
    /// Checks the hyper-parameters are consistent.
    fn validate(&self) -> std::result::Result<(), String>;
    /// The block kinds in execution order, each with how many blocks it has.
    fn block_kinds(&self) -> Vec<(&'static str, usize)>;
    /// Why a tensor-parallel group of `degree` ranks cannot share this model's blocks
    /// (e.g. it does not divide the heads), or `None` when it can.
    fn tp_refusal(&self, degree: usize) -> Option<String>;
    /// Why a part of `tp` tensor-parallel × `sp` sequence-parallel ranks cannot run this
    /// model's blocks (e.g. `tp · sp` does not divide the heads), or `None`.
    fn sp_refusal(&self, tp: usize, sp: usize) -> Option<String>;
    /// Every checkpoint tensor the model reads, with its shape.
    fn tensor_specs(&self) -> Vec<TensorSpec>;
    /// Checks one call's inputs (shapes, required conditioning).
    fn check_inputs(&self, x: &Self::Inputs) -> Result<()>;

    fn load_stem(&self, src: &dyn WeightSource) -> Result<Self::Stem>;
    fn load_final(&self, src: &dyn WeightSource) -> Result<Self::Final>;
    fn load_block(&self, src: &dyn WeightSource, b: BlockRef, shard: Shard) -> Result<Self::Block>;

    /// The inputs (on any device, any float dtype) to the activations entering the first
    /// block, on `dev` in the compute dtype `dtype`.
    fn stem(
        &self,
        stem: &Self::Stem,
        x: &Self::Inputs,
        dtype: DType,
        dev: &Device,
        ctx: &Ctx,
    ) -> CResult<Self::Acts>;
    /// This rank's slice of the sequence (rank `ctx.sp.rank()` of `ctx.sp.world_size()`);
    /// the activations unchanged without sequence parallelism.
    fn scatter_sequence(&self, acts: Self::Acts, ctx: &Ctx) -> CResult<Self::Acts>;
    /// The whole sequence again on every rank of `ctx.sp` (the inverse of
    /// [`Transformer::scatter_sequence`]; unchanged activations pass through).
    fn gather_sequence(&self, acts: Self::Acts, ctx: &Ctx) -> CResult<Self::Acts>;
    /// One block. It records its largest activation in `ctx.meter`.
    fn block(&self, b: &Self::Block, acts: Self::Acts, ctx: &Ctx) -> CResult<Self::Acts>;
    /// The final layer: the model's output (for a denoiser: the predicted velocity).
    fn final_layer(&self, f: &Self::Final, acts: Self::Acts, ctx: &Ctx) -> CResult<Tensor>;

    /// Every block in execution order.
    fn all_blocks(&self) -> Vec<BlockRef> {
        self.block_kinds()
            .into_iter()
            .flat_map(|(kind, n)| (0..n).map(move |index| BlockRef { kind, index }))
            .collect()
    }
}
