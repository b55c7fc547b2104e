//! adaLN modulation shared by the families: the per-sample (shift, scale, gate) triples a
//! block's modulation linear produces, putting a column-parallel modulation output back
//! together across a tensor-parallel group, and computing it ahead for several steps.
//!
//! **Ahead.** A denoising request knows every step's time from the start, and the
//! conditioning vector depends on nothing else that changes between steps (the pooled
//! text and the guidance are fixed), so a block's modulation linear can take the vectors
//! of [`AHEAD_STEPS`] steps as one product: its weights (FLUX.1-dev: 6.4 GB over 57
//! blocks, a bandwidth-bound matrix–vector product every step otherwise) are read once a
//! window instead of once a step, and a tensor-parallel group gathers the window's slices
//! once. The stem puts the window's vectors beside this step's ([`Conditioning::ahead`]);
//! each rank keeps the blocks' outputs in its [`ModulationCache`], keyed by the request's
//! window and the block's position, so every rank of a group misses and hits alike.

use super::mat::Input;
use super::ops::{self, Kernels};
use super::Ctx;
use candle_core::{Tensor, D};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

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
    /// [`Self::norm_scale_shift`] as the input of products that take an input quantized
    /// ahead (`fp8`: as [`crate::model::mat::Mat::takes_rows`] answers for them): then
    /// quantized per token in the same pass ([`ops::ln_modulate_fp8`]) where the kernel
    /// runs, else as computed.
    pub(crate) fn norm_scale_shift_for(
        &self,
        x: &Tensor,
        eps: f32,
        fp8: bool,
        k: Kernels,
    ) -> CResult<Input> {
        if fp8 {
            if let Some(q) = ops::ln_modulate_fp8(x, &self.scale, &self.shift, eps, k)? {
                return Ok(Input::Fp8(q));
            }
        }
        Ok(Input::Dense(self.norm_scale_shift(x, eps, k)?))
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

/// Steps whose modulation one product computes ahead (a window; the cost model prices the
/// same, [`mold_models::MODULATION_AHEAD_STEPS`]). 16 steps of FLUX.1-dev's outputs are
/// 34 MB a rank in bf16; the weights are read once per window.
pub const AHEAD_STEPS: usize = mold_models::MODULATION_AHEAD_STEPS as usize;

/// Requests (passes with their own conditioning) kept in a [`ModulationCache`] at once:
/// true CFG alternates a conditional and an unconditional pass on the same ranks.
const KEPT_REQUESTS: usize = 2;

/// One window of one request's steps; `request` is unique in the process ([`next_request`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AheadKey {
    pub request: u64,
    pub window: u32,
}

/// A process-unique request number for [`AheadKey`].
pub fn next_request() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Which window step `step` (from 0) of a request falls in, and its row there.
pub fn window_of(step: usize) -> (u32, usize) {
    ((step / AHEAD_STEPS) as u32, step % AHEAD_STEPS)
}

/// The conditioning vectors of every step of this step's window, `(n · b, hidden)` with
/// step `i`'s `b` samples at rows `i·b ..`; this step is row block `row`.
#[derive(Clone, Debug)]
pub struct Ahead {
    pub rows: Tensor,
    pub row: usize,
    pub key: AheadKey,
}

/// A step's conditioning vector `now`, `(b, hidden)`, and, when the request's schedule is
/// known, its window's ([`Ahead`]; `now` is its row block).
#[derive(Clone, Debug)]
pub struct Conditioning {
    pub now: Tensor,
    pub ahead: Option<Ahead>,
}

impl Conditioning {
    /// Only this step's vector.
    pub fn now(now: Tensor) -> Self {
        Conditioning { now, ahead: None }
    }
    /// With `f` applied to each tensor (hand-offs).
    pub fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self> {
        Ok(Conditioning {
            now: f(&self.now)?,
            ahead: match &self.ahead {
                Some(a) => Some(Ahead {
                    rows: f(&a.rows)?,
                    row: a.row,
                    key: a.key,
                }),
                None => None,
            },
        })
    }
    /// The tensors for a wire: `now`, then (with a window) its rows and a `u32` tensor of
    /// `[row, window, request low, request high]`.
    pub fn to_wire(&self) -> CResult<Vec<Tensor>> {
        let mut v = vec![self.now.clone()];
        if let Some(a) = &self.ahead {
            let row = u32::try_from(a.row)
                .map_err(|_| candle_core::Error::Msg(format!("ahead row {}", a.row)))?;
            let r = a.key.request;
            let meta = [row, a.key.window, r as u32, (r >> 32) as u32];
            v.push(a.rows.clone());
            v.push(Tensor::new(&meta, &candle_core::Device::Cpu)?);
        }
        Ok(v)
    }
    /// The inverse of [`Conditioning::to_wire`] (one or three tensors).
    pub fn from_wire(mut v: Vec<Tensor>) -> CResult<Self> {
        let bad =
            |n: usize| candle_core::Error::Msg(format!("conditioning on the wire: {n} tensors"));
        match v.len() {
            1 => Ok(Conditioning::now(v.remove(0))),
            3 => {
                let meta = v.pop().ok_or_else(|| bad(3))?.to_vec1::<u32>()?;
                let rows = v.pop().ok_or_else(|| bad(3))?;
                let now = v.pop().ok_or_else(|| bad(3))?;
                let [row, window, lo, hi] = <[u32; 4]>::try_from(meta).map_err(|_| bad(3))?;
                let b = now.dim(0)?;
                if (row as usize + 1) * b > rows.dim(0)? {
                    return Err(candle_core::Error::Msg(format!(
                        "conditioning on the wire: row {row} outside {} rows",
                        rows.dim(0)?
                    )));
                }
                Ok(Conditioning {
                    now,
                    ahead: Some(Ahead {
                        rows,
                        row: row as usize,
                        key: AheadKey {
                            request: (lo as u64) | ((hi as u64) << 32),
                            window,
                        },
                    }),
                })
            }
            n => Err(bad(n)),
        }
    }
}

/// A rank's modulation outputs computed ahead, by (window, block position): the full
/// outputs of each block's modulation linears for every step of the window.
#[derive(Debug, Default)]
pub struct ModulationCache {
    inner: Mutex<CacheInner>,
    misses: AtomicU64,
    /// The most bytes held at once.
    peak: AtomicU64,
}

#[derive(Debug, Default)]
struct CacheInner {
    /// The windows held, oldest first: one per request.
    keys: VecDeque<AheadKey>,
    entries: HashMap<(AheadKey, usize), Vec<Tensor>>,
}

impl ModulationCache {
    /// The outputs of block `slot` for window `key`, computed by `f` on a miss. A new
    /// window of a request drops the request's earlier one; past [`KEPT_REQUESTS`]
    /// requests the oldest goes.
    pub fn get_or(
        &self,
        key: AheadKey,
        slot: usize,
        f: impl FnOnce() -> CResult<Vec<Tensor>>,
    ) -> CResult<Vec<Tensor>> {
        if let Some(v) = self.lock().entries.get(&(key, slot)) {
            return Ok(v.clone());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let v = f()?;
        let mut g = self.lock();
        if !g.keys.contains(&key) {
            let stale: Vec<AheadKey> = g
                .keys
                .iter()
                .copied()
                .filter(|k| k.request == key.request)
                .collect();
            g.keys.retain(|k| k.request != key.request);
            while g.keys.len() >= KEPT_REQUESTS {
                if let Some(old) = g.keys.pop_front() {
                    g.entries.retain(|(k, _), _| *k != old);
                }
            }
            g.entries.retain(|(k, _), _| !stale.contains(k));
            g.keys.push_back(key);
        }
        g.entries.insert((key, slot), v.clone());
        let held = held_bytes(&g);
        self.peak.fetch_max(held, Ordering::Relaxed);
        Ok(v)
    }
    /// The most bytes held at once so far.
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    /// Bytes of the tensors held now.
    pub fn bytes(&self) -> u64 {
        held_bytes(&self.lock())
    }
    /// Windows computed so far (misses), each one product over the window's rows.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
    /// Drops everything held.
    pub fn clear(&self) {
        *self.lock() = CacheInner::default();
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn held_bytes(g: &CacheInner) -> u64 {
    g.entries.values().flatten().map(super::layers::bytes).sum()
}

/// This step's full modulation outputs, each `(b, out_i)`: `partials` maps SiLU'd
/// conditioning rows to this rank's slices of each linear's output, and
/// [`gather_modulation`] joins them. With a window ahead and the rank's cache in `ctx`,
/// the window's outputs come from the cache (computed for all its steps on a miss) and
/// this step's rows are taken; otherwise this step's alone are computed.
pub(crate) fn modulations(
    cond: &Conditioning,
    ctx: &Ctx,
    partials: &dyn Fn(&Tensor) -> CResult<Vec<Tensor>>,
) -> CResult<Vec<Tensor>> {
    let compute = |v: &Tensor| gather_modulation(&partials(&v.silu()?)?, ctx);
    match (&cond.ahead, ctx.ahead) {
        (Some(a), Some(cache)) => {
            let all = cache.get_or(a.key, ctx.slot, || compute(&a.rows))?;
            let b = cond.now.dim(0)?;
            all.iter().map(|t| t.narrow(0, a.row * b, b)).collect()
        }
        _ => compute(&cond.now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn t(rows: usize) -> CResult<Vec<Tensor>> {
        Ok(vec![Tensor::zeros((rows, 4), DType::F32, &Device::Cpu)?])
    }

    /// One window a request, two requests: a request's next window replaces its last, a
    /// third request drops the oldest, and a hit computes nothing.
    #[test]
    fn the_cache_keeps_one_window_of_two_requests() {
        let c = ModulationCache::default();
        let key = |request, window| AheadKey { request, window };
        let per = 16 * 4 * 4;
        for slot in 0..3 {
            c.get_or(key(1, 0), slot, || t(16)).unwrap();
        }
        assert_eq!((c.bytes(), c.misses()), (3 * per, 3));
        c.get_or(key(1, 0), 1, || panic!("a hit computes nothing"))
            .unwrap();
        // The request's second window replaces its first.
        c.get_or(key(1, 1), 0, || t(16)).unwrap();
        assert_eq!(c.bytes(), per);
        // Another request is kept beside it; a third drops the oldest.
        c.get_or(key(2, 0), 0, || t(16)).unwrap();
        assert_eq!(c.bytes(), 2 * per);
        c.get_or(key(3, 0), 0, || t(16)).unwrap();
        assert_eq!(c.bytes(), 2 * per);
        c.get_or(key(2, 0), 0, || panic!("request 2 is kept"))
            .unwrap();
        assert_eq!(c.misses(), 6);
        c.get_or(key(1, 1), 0, || t(16)).unwrap();
        assert_eq!(c.misses(), 7, "request 1 was dropped");
        assert_eq!(c.peak_bytes(), 3 * per);
        c.clear();
        assert_eq!(c.bytes(), 0);
    }

    /// A conditioning crosses a process boundary whole: this step's vector, the window's
    /// rows, the row and the key (a request number above 32 bits included).
    #[test]
    fn conditioning_round_trips_the_wire() {
        let now = Tensor::arange(0f32, 6., &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let rows = Tensor::arange(0f32, 18., &Device::Cpu)
            .unwrap()
            .reshape((6, 3))
            .unwrap();
        let c = Conditioning {
            now: now.clone(),
            ahead: Some(Ahead {
                rows: rows.clone(),
                row: 2,
                key: AheadKey {
                    request: (7 << 32) | 5,
                    window: 3,
                },
            }),
        };
        let back = Conditioning::from_wire(c.to_wire().unwrap()).unwrap();
        let a = back.ahead.unwrap();
        assert_eq!((a.row, a.key), (2, c.ahead.as_ref().unwrap().key));
        assert_eq!(
            a.rows.to_vec2::<f32>().unwrap(),
            rows.to_vec2::<f32>().unwrap()
        );
        assert_eq!(
            back.now.to_vec2::<f32>().unwrap(),
            now.to_vec2::<f32>().unwrap()
        );
        let plain = Conditioning::from_wire(Conditioning::now(now.clone()).to_wire().unwrap());
        assert!(plain.unwrap().ahead.is_none());
        // A row outside the rows, or a count of tensors no conditioning has, is refused.
        let mut bad = c.to_wire().unwrap();
        bad[2] = Tensor::new(&[3u32, 3, 5, 7], &Device::Cpu).unwrap();
        assert!(Conditioning::from_wire(bad).is_err());
        assert!(Conditioning::from_wire(vec![now.clone(), now]).is_err());
    }
}
