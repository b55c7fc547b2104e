//! The model: FLUX blocks built from replicated, column-parallel and row-parallel
//! layers. Nothing here knows about plans, devices, residency or threads: a block is
//! loaded for one [`Shard`] (rank `r` of a group of `world`) from a [`WeightSource`], and
//! its forward pass talks to its group only through [`crate::comm::Comm`].

pub mod flux;
pub mod layers;

use crate::comm::Comm;
use crate::error::Result;
use candle_core::Tensor;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Which slice of a tensor-parallel group a set of weights is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The unsharded model.
    pub const FULL: Shard = Shard { rank: 0, world: 1 };

    /// This rank's contiguous slice of `0..n` (`n` must divide by `world`).
    pub fn range(&self, n: usize) -> Range<usize> {
        let k = n / self.world;
        self.rank * k..(self.rank + 1) * k
    }

    /// This rank's slice of the `n`-wide segment starting at `base`.
    pub fn segment(&self, base: usize, n: usize) -> Range<usize> {
        let r = self.range(n);
        base + r.start..base + r.end
    }
}

/// Where the model gets its weights: slices of named checkpoint tensors, in host memory,
/// in the compute dtype.
pub trait WeightSource {
    /// `rows` (dim 0, output features) and, per row, `cols` (dim 1, input features) of
    /// tensor `name`; `None` selects everything; ranges are concatenated in order.
    fn load(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor>;
}

/// Records the largest activation tensor a rank handled (bytes, as accounted from the
/// tensors' shapes and dtypes; not an allocator measurement).
#[derive(Debug, Default)]
pub struct ActivationMeter(AtomicU64);

impl ActivationMeter {
    pub fn see(&self, t: &Tensor) {
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        self.0.fetch_max(bytes, Ordering::Relaxed);
    }
    pub fn largest(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a block's forward pass may use besides its inputs.
pub struct Ctx<'a> {
    pub comm: &'a dyn Comm,
    pub meter: &'a ActivationMeter,
}
