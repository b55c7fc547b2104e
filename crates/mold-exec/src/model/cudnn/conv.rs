//! 2-D convolution forward through cuDNN's graph API, channels-last (NHWC activations,
//! KRSC filters), bf16/f16 in and out with f32 accumulation, the bias and a residual added
//! as pointwise operations of the same graph where an engine takes them.
//!
//! A plan is built once per (device, shape, dtype, fusion, tuning): the graph with every
//! requested epilogue, else with the bias only, else the bare convolution (the caller adds
//! what the graph left out). With tuning, up to [`TUNE_CANDIDATES`] engine configurations
//! that finalise are timed on the first call's own data and the fastest is kept (what
//! PyTorch's `cudnn.benchmark` does); without, the heuristics' first choice runs.

use super::ffi::{self, Handle};
use super::graph::{self, tensor, Builder, D};
pub use crate::model::conv::{ConvGeom, Fusion};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

type R<T> = Result<T, String>;

/// Engine configurations timed when tuning.
pub const TUNE_CANDIDATES: usize = 8;

/// What a plan is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub dtype: i32,
    /// Batch, input channels, input height and width.
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    /// Output channels, filter height and width.
    pub k: usize,
    pub r: usize,
    pub s: usize,
    pub geom: ConvGeom,
    /// The fusion asked for (the plan may hold less: [`Plan::fusion`]).
    pub fusion: Fusion,
    pub tune: bool,
}

/// Unique ids of the graph's real tensors.
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_B: i64 = 3;
const UID_Z: i64 = 4;
const UID_Y: i64 = 5;

/// Logical `[n, c, h, w]` dims and channels-last strides.
fn nhwc(n: usize, c: usize, h: usize, w: usize) -> ([i64; 4], [i64; 4]) {
    let (n, c, h, w) = (n as i64, c as i64, h as i64, w as i64);
    ([n, c, h, w], [h * w * c, 1, w * c, c])
}

/// A finalised convolution: its candidate plans and the one chosen.
pub struct Plan {
    _parts: Vec<D>,
    candidates: Vec<(D, usize)>,
    /// Index into `candidates`; `usize::MAX` until tuned.
    chosen: AtomicUsize,
    /// The epilogue the graph holds.
    pub fusion: Fusion,
    pub out_h: usize,
    pub out_w: usize,
}

impl Plan {
    /// The index of the configuration to run, once chosen.
    pub fn chosen(&self) -> Option<usize> {
        let i = self.chosen.load(Ordering::Relaxed);
        (i < self.candidates.len()).then_some(i)
    }

    /// How many configurations there are to choose from.
    pub fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// The largest workspace of any candidate.
    pub fn max_workspace(&self) -> usize {
        self.candidates.iter().map(|c| c.1).max().unwrap_or(0)
    }

    pub fn choose(&self, i: usize) {
        self.chosen.store(i, Ordering::Relaxed);
    }

    pub fn candidate(&self, i: usize) -> (&D, usize) {
        let (d, ws) = &self.candidates[i];
        (d, *ws)
    }
}

/// Builds the graph for `key` with `fusion` and finalises its engine configuration(s);
/// `residual_first`: the residual added before the bias (the order of cuDNN's ConvBiasAct
/// pattern, which its precompiled kernels may take where the other order needs a runtime-
/// compiled one).
fn build_one(
    api: &'static ffi::Api,
    handle: Handle,
    key: &Key,
    fusion: Fusion,
    residual_first: bool,
    gpu: &str,
) -> R<Plan> {
    let (p, q) = key
        .geom
        .output(key.h, key.w, key.r, key.s)
        .ok_or_else(|| format!("a {}x{} filter does not fit the input", key.r, key.s))?;
    let mut g = Builder::new(api);
    let dt = key.dtype;
    let f = ffi::DATA_FLOAT;
    let (xd, xs) = nhwc(key.n, key.c, key.h, key.w);
    let x = g.push(tensor(api, UID_X, xd, xs, dt, false, false)?);
    let (wd, ws) = nhwc(key.k, key.c, key.r, key.s);
    let w = g.push(tensor(api, UID_W, wd, ws, dt, false, false)?);
    let (yd, ys) = nhwc(key.n, key.k, p, q);
    let y = g.push(tensor(api, UID_Y, yd, ys, dt, false, false)?);
    let conv_out = if fusion == Fusion::None {
        y
    } else {
        g.virt(yd, ys, f)?
    };
    let cd = D::new(api, ffi::CONVOLUTION_DESCRIPTOR)?;
    let geom = key.geom;
    let two = |a: [usize; 2]| [a[0] as i64, a[1] as i64];
    cd.enum32(ffi::ATTR_CONVOLUTION_COMP_TYPE, ffi::TYPE_DATA_TYPE, f)?
        .enum32(
            ffi::ATTR_CONVOLUTION_CONV_MODE,
            ffi::TYPE_CONVOLUTION_MODE,
            ffi::CROSS_CORRELATION,
        )?
        .i64s(ffi::ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?
        .i64s(ffi::ATTR_CONVOLUTION_DILATIONS, &[1, 1])?
        .i64s(ffi::ATTR_CONVOLUTION_FILTER_STRIDES, &two(geom.stride))?
        .i64s(ffi::ATTR_CONVOLUTION_PRE_PADDINGS, &two(geom.pad_pre))?
        .i64s(ffi::ATTR_CONVOLUTION_POST_PADDINGS, &two(geom.pad_post))?;
    cd.finalize("convolution")?;
    let op = D::new(api, ffi::OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    op.descs(ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&g.keep[x]])?
        .descs(ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&g.keep[w]])?
        .descs(
            ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
            &[&g.keep[conv_out]],
        )?
        .descs(ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, &[&cd])?
        .set_raw(
            ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
            ffi::TYPE_FLOAT,
            1,
            (&alpha as *const f32).cast::<c_void>(),
        )?
        .set_raw(
            ffi::ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ffi::TYPE_FLOAT,
            1,
            (&beta as *const f32).cast::<c_void>(),
        )?;
    op.finalize("convolution operation")?;
    g.push(cd);
    let mut ops = vec![g.push(op)];
    if fusion != Fusion::None {
        let k = key.k as i64;
        let b = g.push(tensor(
            api,
            UID_B,
            [1, k, 1, 1],
            [k, 1, k, k],
            dt,
            false,
            false,
        )?);
        if fusion == Fusion::Bias {
            ops.push(g.pointwise(ffi::POINTWISE_ADD, conv_out, Some(b), y)?);
        } else {
            let z = g.push(tensor(api, UID_Z, yd, ys, dt, false, false)?);
            let (first, second) = if residual_first { (z, b) } else { (b, z) };
            let t = g.virt(yd, ys, f)?;
            ops.push(g.pointwise(ffi::POINTWISE_ADD, conv_out, Some(first), t)?);
            ops.push(g.pointwise(ffi::POINTWISE_ADD, t, Some(second), y)?);
        }
    }
    let want = if key.tune { TUNE_CANDIDATES } else { 1 };
    let keep = crate::model::plan_cache::settings().dir.as_ref().map(|d| {
        let graph = format!("conv {fusion:?} residual_first={residual_first} {key:?}");
        crate::model::plan_cache::PlanStore::new(d).path(&api.version_string(), gpu, &graph)
    });
    let f = graph::finalise(api, handle, g, &ops, want, keep)?;
    Ok(Plan {
        _parts: f.parts,
        chosen: AtomicUsize::new(if f.plans.len() == 1 { 0 } else { usize::MAX }),
        candidates: f.plans,
        fusion,
        out_h: p,
        out_w: q,
    })
}

/// The most fused graph for `key` an engine takes (see [`Fusion::fallbacks`]).
pub fn build(api: &'static ffi::Api, handle: Handle, key: &Key, gpu: &str) -> R<Plan> {
    let mut errors = Vec::new();
    for &fusion in key.fusion.fallbacks() {
        let orders: &[bool] = if fusion == Fusion::BiasResidual {
            &[true, false]
        } else {
            &[false]
        };
        for &residual_first in orders {
            match build_one(api, handle, key, fusion, residual_first, gpu) {
                Ok(p) => return Ok(p),
                Err(e) => errors.push(format!("{fusion:?}: {e}")),
            }
        }
    }
    Err(format!(
        "no cuDNN engine runs this convolution ({}x{}x{}x{} NHWC, {} filters {}x{}): {}",
        key.n,
        key.h,
        key.w,
        key.c,
        key.k,
        key.r,
        key.s,
        errors.join("; ")
    ))
}

/// Device pointers of a convolution's tensors; `b` and `z` only where the plan uses them.
pub struct Ptrs {
    pub x: u64,
    pub w: u64,
    pub b: u64,
    pub z: u64,
    pub y: u64,
}

/// Runs candidate `plan` (workspace at `ws`, 0 for none) on `ptrs`.
pub fn execute(
    api: &'static ffi::Api,
    handle: Handle,
    plan: &D,
    fusion: Fusion,
    ptrs: &Ptrs,
    ws: u64,
) -> R<()> {
    let p = |v: u64| v as *mut c_void;
    let (uids, data): (Vec<i64>, Vec<*mut c_void>) = match fusion {
        Fusion::None => (
            vec![UID_X, UID_W, UID_Y],
            vec![p(ptrs.x), p(ptrs.w), p(ptrs.y)],
        ),
        Fusion::Bias => (
            vec![UID_X, UID_W, UID_B, UID_Y],
            vec![p(ptrs.x), p(ptrs.w), p(ptrs.b), p(ptrs.y)],
        ),
        Fusion::BiasResidual => (
            vec![UID_X, UID_W, UID_B, UID_Z, UID_Y],
            vec![p(ptrs.x), p(ptrs.w), p(ptrs.b), p(ptrs.z), p(ptrs.y)],
        ),
    };
    graph::run(api, handle, plan, &uids, &data, ws, "execute convolution")
}
