//! The operations a calibration runs, built and ready: each a [`Load`] (a closure that
//! runs one operation on its device and returns its output), with its layer and random
//! inputs made once. The matrix products go through the layers the blocks run them with,
//! attention through [`attention_with`], the element-wise kernels through [`ops`]; a
//! block's operations together in the order a block runs them ([`block_loads`]). The
//! operation tables ([`super::ops`]), the mixed timing ([`super::mix`]), the copy beside
//! compute ([`super::copy`]) and the libraries' footprint ([`super::footprint`]) all run
//! these.

use crate::error::{ExecError, Result};
use crate::model::attention::{attention_with, fp8_attention};
use crate::model::fp8::Fp8Weight;
use crate::model::layers::{ColumnParallel, RowParallel};
use crate::model::mat::Input;
use crate::model::mat::Mat;
use crate::model::ops::{self, Kernels};
use crate::model::{ActivationMeter, WeightSource};
use candle_core::{DType, Device, Tensor};
use mold_cost::ops::{AttentionShape, BlockOps, Gemm, Run};
use std::ops::Range;

/// Something to run on the device's compute stream, its output dropped.
pub type Load<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;

/// The compute dtype, and whether the products' weights are FP8 ([`crate::model::fp8`]):
/// what a calibration measures in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Precision {
    pub dtype: DType,
    pub fp8: bool,
}

impl From<DType> for Precision {
    fn from(dtype: DType) -> Self {
        Precision { dtype, fp8: false }
    }
}

/// A weight source of random tensors of the shapes it is told: what a layer loads from
/// it has the layer's real shape and dtype (products' weights FP8 with `fp8`), so the
/// layer runs as it does on a checkpoint.
struct Random<'a> {
    shapes: Vec<(String, Vec<usize>)>,
    dtype: DType,
    fp8: bool,
    device: &'a Device,
}

impl WeightSource for Random<'_> {
    fn load(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        let shape = self
            .shapes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.clone())
            .ok_or_else(|| ExecError::Input(format!("measuring: no tensor `{name}`")))?;
        let count = |r: Option<&[Range<usize>]>, all: usize| {
            r.map_or(all, |r| r.iter().map(|x| x.len()).sum())
        };
        let mut dims = shape.clone();
        dims[0] = count(rows, shape[0]);
        if dims.len() > 1 {
            dims[1] = count(cols, shape[1]);
        }
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        Ok(random(&dims, self.dtype, self.device)?)
    }
    fn load_product(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Mat> {
        let w = self.load(name, rows, cols)?;
        if !self.fp8 {
            return Ok(Mat::Dense(w));
        }
        let q = Fp8Weight::quantize(&w)?.map(&mut |t| t.to_device(self.device))?;
        Ok(Mat::Fp8(q))
    }
}

/// Normal values of standard deviation 0.02 (a trained weight's scale), in `dtype`.
pub(super) fn random(dims: &[u64], dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    let dims: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
    Tensor::randn(0f32, 0.02, dims, dev)?.to_dtype(dtype)
}

/// One product `x · Wᵀ`, `W` `(n, k)`, through the layer the block runs it with
/// ([`Run`]): a column-parallel linear with its bias (and GELU), a row-parallel layer's
/// partial product (its bias comes after the all-reduce, an element-wise pass), or a
/// per-sample linear on an `(m, k)` conditioning vector; its layer and random input
/// built, ready to run.
pub(super) fn gemm_load(
    dev: &Device,
    p: Precision,
    g: Gemm,
    k: Kernels,
) -> candle_core::Result<Load<'static>> {
    let dtype = p.dtype;
    let src = Random {
        fp8: p.fp8,
        shapes: vec![
            ("w.weight".into(), vec![g.n as usize, g.k as usize]),
            ("w.bias".into(), vec![g.n as usize]),
        ],
        dtype,
        device: dev,
    };
    let msg = |e: ExecError| candle_core::Error::Msg(e.to_string());
    let (rows, cols) = (0..g.n as usize, 0..g.k as usize);
    Ok(match g.run {
        Run::Partial => {
            let layer = RowParallel::load(&src, "w", std::slice::from_ref(&cols)).map_err(msg)?;
            let x = random(&[1, g.m, g.k], dtype, dev)?;
            Box::new(move || layer.partial(&[&x], k))
        }
        Run::Bias | Run::BiasGelu => {
            let layer =
                ColumnParallel::load(&src, "w", std::slice::from_ref(&rows)).map_err(msg)?;
            let x = random(&[1, g.m, g.k], dtype, dev)?;
            let gelu = g.run == Run::BiasGelu;
            Box::new(move || {
                if gelu {
                    layer.forward_gelu(&x, k)
                } else {
                    layer.forward(&x, k)
                }
            })
        }
        Run::PerSample => {
            let layer =
                ColumnParallel::load(&src, "w", std::slice::from_ref(&rows)).map_err(msg)?;
            let x = random(&[g.m, g.k], dtype, dev)?;
            Box::new(move || layer.forward_vec(&x, k))
        }
    })
}

/// Attention over `a` (one sample's heads, repeated for `batch` samples) through
/// [`attention_with`], its random q, k and v built: three tensors, as the block passes
/// (one tensor for all three would let the kernel read keys and values from the cache
/// the queries filled).
pub(super) fn attention_load(
    dev: &Device,
    dtype: DType,
    a: AttentionShape,
    batch: u64,
    k: Kernels,
) -> candle_core::Result<Load<'static>> {
    let dims = [batch.max(1), a.heads, a.seq, a.head_dim];
    let (q, kt, v) = (
        random(&dims, dtype, dev)?,
        random(&dims, dtype, dev)?,
        random(&dims, dtype, dev)?,
    );
    let meter = ActivationMeter::default();
    Ok(Box::new(move || attention_with(k, &q, &kt, &v, &meter)))
}

/// FP8 attention over `a` as an FP8 block with `attention: fp8` runs it
/// ([`fp8_attention`]): random q, k and v with their largest magnitudes given (as the q/k/v
/// preparation takes them), quantized to e4m3 in one pass, cuDNN's FP8 flash attention.
/// `Ok(Err(why))` where it does not run in FP8 here (cuDNN cannot, or `k` runs attention
/// without libraries): a run of it would time the dense attention it falls back to.
pub(super) fn fp8_attention_load(
    dev: &Device,
    dtype: DType,
    a: AttentionShape,
    batch: u64,
    k: Kernels,
) -> candle_core::Result<Result<Load<'static>, String>> {
    let dims = [batch.max(1), a.heads, a.seq, a.head_dim];
    let (q, kt, v) = (
        random(&dims, dtype, dev)?,
        random(&dims, dtype, dev)?,
        random(&dims, dtype, dev)?,
    );
    // The maxima as the preparation leaves them: one partial maximum per slot, each the
    // first float of its stride; here the whole tensor's in slot 0.
    let mut partial = vec![0f32; 3 * ops::QKV_AMAX_SLOTS * ops::QKV_AMAX_STRIDE];
    for (i, t) in [&q, &kt, &v].into_iter().enumerate() {
        partial[i * ops::QKV_AMAX_SLOTS * ops::QKV_AMAX_STRIDE] = t
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
    }
    let amax = Tensor::from_vec(partial, (3, ops::QKV_AMAX_SLOTS, ops::QKV_AMAX_STRIDE), dev)?;
    let meter = ActivationMeter::default();
    if let Input::Dense(_) = fp8_attention(k, &q, &kt, &v, Some(&amax), &meter)? {
        let why = crate::model::attention::report()
            .cudnn_refusals
            .into_iter()
            .rfind(|r| r.starts_with("FP8 attention"))
            .unwrap_or_else(|| "FP8 attention fell back to the activations' dtype".into());
        return Ok(Err(why));
    }
    Ok(Ok(Box::new(move || {
        fp8_attention(k, &q, &kt, &v, Some(&amax), &meter).map(|o| o.tensor().clone())
    })))
}

/// mold's element-wise kernels over `(1, rows, width)` whose bytes the cost model prices
/// at the measured rate, each with the passes over `x` it makes (what [`super::ops`]
/// counts the kernels' bytes from, and `mold_cost::ops::elementwise_bytes` the block's):
/// the norm with its modulation and the bias + gate + residual. The bias and GELU after
/// a column-parallel product are not among them: they run in the product's epilogue,
/// timed with it.
pub(super) fn elementwise_loads(
    dev: &Device,
    dtype: DType,
    (rows, width): (u64, u64),
    k: Kernels,
) -> candle_core::Result<Vec<(f64, Load<'static>)>> {
    let (rows, width) = (rows.max(1), width.max(1));
    let x = random(&[1, rows, width], dtype, dev)?;
    let res = random(&[1, rows, width], dtype, dev)?;
    let vec = || random(&[1, 1, width], dtype, dev);
    let (scale, shift, gate) = (vec()?, vec()?, vec()?);
    let bias = random(&[width], dtype, dev)?;
    let x1 = x.clone();
    Ok(vec![
        (
            2.0,
            Box::new(move || ops::ln_modulate(&x, &scale, &shift, 1e-6, k)),
        ),
        (
            3.0,
            Box::new(move || ops::gate_residual(&res, &x1, Some(&bias), &gate, k)),
        ),
    ])
}

/// The copy around a sequence-parallel all-to-all over `n` ranks as
/// [`crate::model::sequence`] runs it, for a rank holding `tokens / n` of `tokens` tokens
/// of `hidden` features in heads of `head_dim`: the attention output's pieces put together
/// (a batch of one: the output's own pieces are sliced without a copy; the q/k/v messages
/// and the own piece are written in place). With the bytes it moves, read and written:
/// `mold_cost::alltoall_copy_shards(1)` shards of the rank's tokens by every head, as the
/// cost model counts them. `None` where the heads do not split over `n`.
pub(super) fn layout_copy_load(
    dev: &Device,
    dtype: DType,
    (tokens, hidden): (u64, u64),
    head_dim: u64,
    n: u64,
) -> candle_core::Result<Option<(f64, Load<'static>)>> {
    let heads = hidden / head_dim.max(1);
    let local = tokens / n.max(1);
    if n < 2 || heads < n || !heads.is_multiple_of(n) || local == 0 || heads * head_dim != hidden {
        return Ok(None);
    }
    let hs = heads / n;
    let outs = (0..n)
        .map(|_| random(&[1, local, hs * head_dim], dtype, dev))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let shard = (local * hidden) as f64 * dtype.size_in_bytes() as f64;
    let bytes = mold_cost::alltoall_copy_shards(1) * shard;
    Ok(Some((
        bytes,
        Box::new(move || crate::model::sequence::join_heads(&outs)),
    )))
}

/// What one operation of a mix is, for its table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Slot {
    Gemm(Gemm),
    /// Attention over `batch` samples.
    Attention(AttentionShape, u64),
    /// An element-wise kernel moving this many bytes.
    Elementwise(f64),
}

/// A load run several times in one block.
type Shared = std::rc::Rc<dyn Fn() -> candle_core::Result<candle_core::Tensor>>;

/// The block's operations: its products, then its attention, with its element-wise
/// kernels (repeated for its element-wise bytes, as the copy's loads are built in
/// [`super::ops`]) spread evenly before them, as a block runs its norms, modulation,
/// activations and residuals between its products. Spread, not bunched: a run of
/// small kernels alone would leave the device waiting on their launches, which a block
/// hides behind the products around them.
pub(super) fn block_loads(
    dev: &Device,
    p: Precision,
    b: &BlockOps,
    k: Kernels,
) -> candle_core::Result<(Vec<Slot>, Vec<Load<'static>>)> {
    let dtype = p.dtype;
    let mut big: Vec<(Slot, Load<'static>)> = Vec::new();
    for g in &b.gemms {
        big.push((Slot::Gemm(*g), gemm_load(dev, p, *g, k)?));
    }
    big.push((
        Slot::Attention(b.attention, b.batch),
        attention_load(dev, dtype, b.attention, b.batch, k)?,
    ));
    let rows = b.batch.max(1).saturating_mul(b.attention.seq);
    let width = b.attention.heads.saturating_mul(b.attention.head_dim);
    let x_bytes = (rows * width) as f64 * dtype.size_in_bytes() as f64;
    let runs = elementwise_loads(dev, dtype, (rows, width), k)?;
    let per_round: f64 = runs.iter().map(|(passes, _)| passes).sum::<f64>() * x_bytes;
    let rounds = (b.elementwise_bytes as f64 / per_round.max(1.0))
        .round()
        .max(1.0) as usize;
    let runs: Vec<(f64, Shared)> = runs
        .into_iter()
        .map(|(passes, l)| (passes, std::rc::Rc::from(l)))
        .collect();
    let mut small: Vec<(Slot, Load<'static>)> = Vec::new();
    for _ in 0..rounds {
        for (passes, run) in &runs {
            let run = run.clone();
            small.push((Slot::Elementwise(passes * x_bytes), Box::new(move || run())));
        }
    }
    Ok(spread(big, small).into_iter().unzip())
}

/// `small` spread evenly before the items of `big`, in order: before big item `i` go
/// small items `i·s/b .. (i+1)·s/b`.
fn spread<T>(big: Vec<T>, small: Vec<T>) -> Vec<T> {
    let (nb, ns) = (big.len().max(1), small.len());
    let mut out = Vec::with_capacity(big.len() + ns);
    let mut small = small.into_iter();
    for (i, item) in big.into_iter().enumerate() {
        let take = (i + 1) * ns / nb - i * ns / nb;
        out.extend(small.by_ref().take(take));
        out.push(item);
    }
    out.extend(small);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The small kernels go evenly between the big ones, every item once, in order.
    #[test]
    fn small_kernels_are_spread_between_the_big_ones() {
        assert_eq!(
            spread(vec![100, 200, 300], vec![1, 2, 3, 4, 5, 6, 7]),
            vec![1, 2, 100, 3, 4, 200, 5, 6, 7, 300]
        );
        assert_eq!(spread(vec![100], vec![1, 2]), vec![1, 2, 100]);
        assert_eq!(spread(Vec::new(), vec![1, 2]), vec![1, 2]);
        assert_eq!(spread(vec![100, 200], Vec::new()), vec![100, 200]);
    }
}
