//! The model side: the [`Transformer`] interface and the families behind it ([`flux`]),
//! built from replicated, column-parallel and row-parallel layers ([`layers`]), mold's
//! attention and element-wise kernels ([`attention`], [`ops`]); channels-last convolution
//! and group norm for the autoencoder's decoder ([`conv`], [`group_norm`], [`softmax`]). Nothing here knows about
//! plans, devices, residency or threads: a block is loaded for one [`Shard`] (rank `r` of
//! a group of `world`) from a [`WeightSource`], and its forward pass talks to its group
//! only through [`crate::comm::Comm`].

pub mod attention;
mod cache;
#[cfg(any(feature = "cuda", test))]
pub(crate) mod cells;
pub mod conv;
#[cfg(feature = "cuda")]
pub mod cudnn;
pub mod flux;
pub mod fp8;
pub mod gemm;
pub mod group_norm;
pub mod layers;
pub mod mat;
pub mod modulation;
pub mod ops;
pub mod plan_cache;
pub mod qwen;
pub mod sequence;
pub mod softmax;
pub mod token_split;
pub mod transformer;

pub use transformer::{Activations, BlockRef, Inputs, Packable, TensorSpec, Transformer, Weights};

use crate::comm::Comm;
use crate::error::Result;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

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

    /// The weight of a product (`(n, k)`, sliced as [`WeightSource::load`]): dense in the
    /// compute dtype unless the source holds products in FP8, then quantized per output
    /// feature over whole rows before `cols` are taken (so a row's scale does not depend
    /// on the sharding).
    fn load_product(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<mat::Mat> {
        Ok(mat::Mat::Dense(self.load(name, rows, cols)?))
    }
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
    /// Tensors live at once, counted together (e.g. the two outputs of one linear).
    pub fn see_all(&self, ts: &[&Tensor]) {
        let bytes: usize = ts
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        self.0.fetch_max(bytes as u64, Ordering::Relaxed);
    }
    pub fn largest(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Per-rank time of the model's phases ([`crate::ExecOptions::profiling`]), each
/// [`Ctx::mark`] charging the time since the previous mark to its label, in one of two ways:
///
/// - **synchronised** (the default): each mark waits for the device and reads the host
///   clock. The waits serialise host and device, so a profiled step is slower than a plain
///   one (each collective also carries the ranks' host skew); the split between phases is
///   what it is for.
/// - **events** ([`Profiler::with_events`], `MOLD_PROFILE=events`): on a GPU each mark records
///   a CUDA event on the device's stream and nothing waits; the times are the GPU's, between
///   consecutive events, read when the report is asked for. The host runs ahead as in a plain
///   step, so a collective's phase is what it costs the GPU there (its transfer and the wait
///   for the slowest peer). Other devices are timed as synchronised.
#[derive(Debug, Default)]
pub struct Profiler {
    state: Mutex<ProfState>,
    events: bool,
}

#[derive(Debug, Default)]
struct ProfState {
    last: Option<Instant>,
    /// label → (seconds, marks)
    acc: BTreeMap<&'static str, (f64, u64)>,
    /// Events mode: the marks recorded and not yet read, in order (`None`: a restart).
    #[cfg(feature = "cuda")]
    pending: Vec<(
        Option<&'static str>,
        candle_core::cuda::cudarc::driver::CudaEvent,
    )>,
}

/// Marks an events-mode profiler keeps unread before it reads the older ones (which waits
/// for the GPU to reach them).
#[cfg(feature = "cuda")]
const MAX_PENDING_MARKS: usize = 4096;

impl ProfState {
    fn charge(&mut self, label: &'static str, secs: f64) {
        let e = self.acc.entry(label).or_insert((0.0, 0));
        e.0 += secs;
        e.1 += 1;
    }

    /// Events mode: charges the time between consecutive recorded marks, keeping the last
    /// one as the start of what follows.
    #[cfg(feature = "cuda")]
    fn settle(&mut self) {
        self.settle_first(self.pending.len());
    }

    /// Events mode: [`ProfState::settle`] for the oldest `n` marks only (reading a mark
    /// waits for the GPU to reach it: the older, the shorter the wait), the last of them
    /// kept as the start of the rest.
    #[cfg(feature = "cuda")]
    fn settle_first(&mut self, n: usize) {
        let n = n.min(self.pending.len());
        if n < 2 {
            return;
        }
        let rest = self.pending.split_off(n);
        let marks = std::mem::replace(&mut self.pending, rest);
        let mut prev: Option<candle_core::cuda::cudarc::driver::CudaEvent> = None;
        for (label, ev) in marks {
            if let (Some(p), Some(label)) = (&prev, label) {
                if let Ok(ms) = p.elapsed_ms(&ev) {
                    self.charge(label, f64::from(ms) * 1e-3);
                }
            }
            prev = Some(ev);
        }
        if let Some(ev) = prev {
            self.pending.insert(0, (None, ev));
        }
    }
}

impl Profiler {
    /// A profiler timing GPUs by CUDA events instead of synchronised marks.
    pub fn with_events(events: bool) -> Self {
        Profiler {
            events,
            ..Profiler::default()
        }
    }

    /// Whether GPUs are timed by events ([`Profiler::with_events`]).
    pub fn events(&self) -> bool {
        self.events
    }

    /// Charges the time since the last mark to `label` (`None`: restarts the clock without
    /// charging anything).
    pub fn mark(&self, label: Option<&'static str>, device: &candle_core::Device) {
        #[cfg(feature = "cuda")]
        if self.events {
            if let candle_core::Device::Cuda(cd) = device {
                use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
                let ev = cd
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                match ev {
                    Ok(ev) => st.pending.push((label, ev)),
                    // Without an event this mark is lost: what came before it is charged,
                    // and the next mark starts anew.
                    Err(_) => {
                        st.settle();
                        st.pending.clear();
                    }
                }
                if st.pending.len() > MAX_PENDING_MARKS {
                    let half = st.pending.len() / 2;
                    st.settle_first(half);
                }
                return;
            }
        }
        let _ = device.synchronize();
        let now = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(label), Some(last)) = (label, st.last) {
            st.charge(label, (now - last).as_secs_f64());
        }
        st.last = Some(now);
    }

    /// `(label, seconds, marks)`, largest time first.
    pub fn report(&self) -> Vec<(&'static str, f64, u64)> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        #[cfg(feature = "cuda")]
        st.settle();
        let mut v: Vec<_> = st.acc.iter().map(|(k, (s, n))| (*k, *s, *n)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    pub fn clear(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *st = ProfState::default();
    }
}

/// What a block's forward pass may use besides its inputs.
pub struct Ctx<'a> {
    /// The rank's tensor-parallel group (all-reduces of row-parallel layers).
    pub comm: &'a dyn Comm,
    /// The rank's sequence-parallel group (all-to-alls around attention;
    /// [`crate::comm::LocalComm`] without sequence parallelism).
    pub sp: &'a dyn Comm,
    pub meter: &'a ActivationMeter,
    /// Fused CUDA kernels or candle's ops, for attention and element-wise work.
    pub kernels: ops::Kernels,
    /// Token-split tensor parallelism where the model has it
    /// ([`crate::comm::CommOptions::token_split`]).
    pub token_split: bool,
    /// Phase timing, when profiling.
    pub profile: Option<&'a Profiler>,
    /// The rank's modulation outputs computed ahead ([`modulation`]); `None` computes
    /// each step's alone.
    pub ahead: Option<&'a modulation::ModulationCache>,
    /// The running block's position in the model (its key in [`Ctx::ahead`]).
    pub slot: usize,
    /// Attention in FP8 in blocks whose products are FP8 ([`sequence::fp8_attention`]):
    /// the plan's `attention: fp8`, or [`crate::Fp8Options::attention`] overriding it.
    pub fp8_attention: bool,
}

impl Ctx<'_> {
    /// Ends phase `label` once `t` is computed (no-op unless profiling).
    pub fn mark(&self, label: &'static str, t: &Tensor) {
        if let Some(p) = self.profile {
            p.mark(Some(label), t.device());
        }
    }
    /// Starts timing from now (no-op unless profiling).
    pub fn mark_start(&self, t: &Tensor) {
        if let Some(p) = self.profile {
            p.mark(None, t.device());
        }
    }
}
