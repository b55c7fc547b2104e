//! Operation benchmarks for `mold devices --calibrate --model M`: a model's own
//! operations timed through mold's own layers and kernels, so the table holds what mold
//! runs — the matrix products of its blocks through the layers the blocks run them with
//! ([`ColumnParallel`] with its bias and GELU, in cuBLASLt's epilogue on CUDA;
//! [`RowParallel`]'s partial product; the per-sample linear), attention through
//! [`attention_with`] (mold's fused kernel on CUDA, candle's ops elsewhere), the
//! element-wise kernels of [`ops`] (modulation, gated residual, bias + GELU) and the
//! collectives of [`Comm`] over groups from [`make_group`] (NCCL on GPUs with the `nccl`
//! feature, the thread backend otherwise). The shapes come from
//! [`mold_cost::ops::calibration_shapes`]: those the cost model looks up.
//!
//! An operation on one device is timed as [`OpBench::timing`] says: alone (the median
//! of `iters` runs after `warmup` untimed ones, each ended by a device synchronise), or
//! sustained (back to back for a while, as in a step, where a GPU at its power limit
//! clocks lower than one that idles between runs: on an H200, 7-14 % longer per
//! operation). A collective's run is the slowest rank's, the ranks lined up by a barrier
//! before each, always alone. Emulated devices (`emu:N`) run on the CPU, so the
//! same code measures a CPU build (tests use it with tiny shapes).

use crate::calibrate_copy::{self, Load};
use crate::calibrate_mix::Slot;
use crate::comm::{make_group, Comm, CommOptions};
use crate::error::{ExecError, Result};
use crate::executor::compute_dtype;
use crate::model::attention::attention_with;
use crate::model::layers::{ColumnParallel, RowParallel};
use crate::model::ops::{self, Kernels};
use crate::model::{ActivationMeter, WeightSource};
use crate::runtime::DeviceMap;
use candle_core::{DType, Device, Shape, Tensor};
use mold_cost::ops::{AttentionShape, BlockOps, CalibrationShapes, Gemm, Run};
use mold_machine::{
    AttentionPoint, CollectiveOp, CollectivePoint, CollectiveTables, GemmPoint, OpTables,
};
use mold_plan::DeviceId;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// The host→device copy timed beside the model's blocks: about one streamed block.
const COPY_BYTES: usize = 512 << 20;

/// How [`measure_ops`] times.
#[derive(Clone, Debug, PartialEq)]
pub struct OpBench {
    /// Untimed runs before the timed ones (kernels loaded, allocator warm).
    pub warmup: usize,
    /// Timed runs; the median is kept.
    pub iters: usize,
    /// Which attention and element-wise implementations run (`MOLD_KERNELS`).
    pub kernels: Kernels,
    /// Open each GPU with a stream of its own, as `mold exec` does with it on.
    pub own_streams: bool,
    /// The collectives' options (the NCCL watchdog).
    pub comm: CommOptions,
    /// How an operation on one device is timed.
    pub timing: Timing,
}

/// How [`measure_ops`] times an operation on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Timing {
    /// Each run alone, the device drained before and after it (`warmup`, then the
    /// median of `iters`): a GPU idle between runs, at the clocks of a light load.
    Alone,
    /// Runs back to back, one synchronise per round of about `round`, rounds for at
    /// least `span`: the per-run time of the median round of the later half — the
    /// device as loaded as in a step, at the clocks its power limit then allows.
    Sustained { round: Duration, span: Duration },
    /// Each operation inside the mix of the block it belongs to, the block's operations
    /// run back to back in its order, rounds of about `round` for at least `span` per
    /// block ([`crate::calibrate_mix`]): the clock the block's whole mix runs at under
    /// the power limit. An operation in no block is timed sustained.
    Mixed { round: Duration, span: Duration },
}

impl Timing {
    /// The sustained timing `mold devices --calibrate` uses on GPUs: rounds of 20 ms
    /// for 250 ms.
    pub const SUSTAINED: Timing = Timing::Sustained {
        round: Duration::from_millis(20),
        span: Duration::from_millis(250),
    };

    /// The mixed timing `mold devices --calibrate --timing mixed` uses: rounds of 20 ms
    /// for 250 ms per block.
    pub const MIXED: Timing = Timing::Mixed {
        round: Duration::from_millis(20),
        span: Duration::from_millis(250),
    };

    /// How a profile's note describes it.
    pub fn describe(&self) -> String {
        match self {
            Timing::Alone => "alone, the median of timed runs".into(),
            Timing::Sustained { round, span } => format!(
                "back to back for {} ms, median per-run time of rounds of {} ms",
                span.as_millis(),
                round.as_millis()
            ),
            Timing::Mixed { round, span } => format!(
                "inside their blocks, each block's operations back to back for {} ms, the \
                 median of rounds of {} ms",
                span.as_millis(),
                round.as_millis()
            ),
        }
    }
}

impl Default for OpBench {
    /// 3 warm-ups, median of 10, the default kernels and streams.
    fn default() -> Self {
        OpBench {
            warmup: 3,
            iters: 10,
            kernels: Kernels::Auto,
            own_streams: false,
            comm: CommOptions::default(),
            timing: Timing::Alone,
        }
    }
}

impl OpBench {
    /// Refuses a benchmark that cannot run, in one line.
    pub fn check(&self, devices: &[DeviceId]) -> std::result::Result<(), String> {
        if self.iters == 0 {
            return Err("measuring operations: iters must be at least 1".into());
        }
        if let Timing::Sustained { round, span } | Timing::Mixed { round, span } = self.timing {
            if round.is_zero() || span < round {
                return Err(format!(
                    "measuring operations: {} timing needs a round above 0 and a span of at \
                     least one round (round {round:?}, span {span:?})",
                    if matches!(self.timing, Timing::Mixed { .. }) {
                        "mixed"
                    } else {
                        "sustained"
                    }
                ));
            }
        }
        if devices.is_empty() {
            return Err("measuring operations: no device to measure on".into());
        }
        if devices.iter().any(|d| d.is_host()) {
            return Err(
                "measuring operations: `host` is not a device: name GPUs or emulated devices"
                    .into(),
            );
        }
        let mut seen = devices.to_vec();
        seen.sort();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(format!(
                "measuring operations: devices {} are not distinct",
                list(devices)
            ));
        }
        Ok(())
    }
}

fn list(devices: &[DeviceId]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`measure_ops`] measures for.
pub struct OpTarget<'a> {
    /// The catalogue id of the model (`flux-dev`).
    pub model: &'a str,
    /// The dtype the model runs in.
    pub dtype: mold_plan::DType,
    /// The profile name of the devices (the table's `device`).
    pub device_name: &'a str,
    /// The devices: products, attention and element-wise kernels run on the first;
    /// collectives over the first 2, 4, … of them (`shapes.collectives`' group sizes).
    pub devices: &'a [DeviceId],
}

/// Measures `shapes` for `target` and returns the table, sorted. Collectives over more
/// devices than `target.devices` holds are left out.
pub fn measure_ops(
    target: &OpTarget,
    shapes: &CalibrationShapes,
    bench: &OpBench,
    progress: &mut dyn FnMut(&str),
) -> Result<OpTables> {
    bench.check(target.devices).map_err(ExecError::Input)?;
    let dtype = compute_dtype(target.dtype)?;
    let mut map = DeviceMap::new(bench.own_streams);
    let id = &target.devices[0];
    let dev = map.get(id)?;
    let on = |e: candle_core::Error, what: &str| ExecError::Device {
        device: id.to_string(),
        message: format!("measuring {what}: {e}"),
    };
    let timing = match bench.timing {
        Timing::Alone => format!("median of {}", bench.iters),
        t => t.describe(),
    };
    let mixed = match bench.timing {
        Timing::Mixed { round, span } => {
            progress(&format!(
                "{} blocks of {} on {id}, each operation timed inside its block ({dtype:?}, {timing})",
                shapes.mixes.len(),
                target.model,
            ));
            crate::calibrate_mix::measure(
                &dev,
                dtype,
                &shapes.mixes,
                bench.kernels,
                (round, span),
                progress,
            )
            .map_err(|e| on(e, "the blocks' operations in their mix"))?
        }
        _ => Default::default(),
    };
    progress(&format!(
        "{} matrix products of {} on {id} ({dtype:?}, {timing})",
        shapes.gemm.len(),
        target.model,
    ));
    let mut gemm = Vec::new();
    for g in &shapes.gemm {
        let seconds = match mixed.gemm_s(g) {
            Some(s) => s,
            None => time_gemm(&dev, dtype, *g, bench)
                .map_err(|e| on(e, &format!("the product m={} n={} k={}", g.m, g.n, g.k)))?,
        };
        gemm.push(GemmPoint {
            m: g.m,
            n: g.n,
            k: g.k,
            seconds,
        });
    }
    progress(&format!(
        "{} attention shapes on {id}",
        shapes.attention.len()
    ));
    let mut attention = Vec::new();
    for a in &shapes.attention {
        let what = || {
            format!(
                "attention over {} heads x {} tokens of {}",
                a.heads, a.seq, a.head_dim
            )
        };
        let seconds = match mixed.attention_s(a) {
            Some(s) => s,
            None => {
                let run = attention_load(&dev, dtype, *a, 1, bench.kernels)
                    .map_err(|e| on(e, &what()))?;
                median(&dev, bench, run).map_err(|e| on(e, &what()))?
            }
        };
        attention.push(AttentionPoint {
            heads: a.heads,
            seq: a.seq,
            head_dim: a.head_dim,
            seconds,
        });
    }
    progress(&format!(
        "element-wise kernels on {id} ({} x {})",
        shapes.elementwise.0, shapes.elementwise.1
    ));
    let elementwise_gbps = match mixed.elementwise_gbps() {
        Some(g) => g,
        None => elementwise_gbps(&dev, dtype, shapes.elementwise, bench)
            .map_err(|e| on(e, "element-wise kernels"))?,
    };
    let mut htod_busy_ratio = None;
    if dev.is_cuda() && !shapes.blocks.is_empty() {
        progress(&format!(
            "the host→device copy of {} MiB on {id}, idle and beside {}'s operations",
            COPY_BYTES >> 20,
            target.model
        ));
        let loads = copy_loads(&dev, dtype, &shapes.blocks, bench.kernels)
            .map_err(|e| on(e, "the loads the copy runs beside"))?;
        if let Some(c) = calibrate_copy::measure(&dev, &loads, COPY_BYTES)? {
            progress(&format!("host→device copy: {}", c.summary()));
            htod_busy_ratio = c.ratio(COPY_BESIDE_BLOCKS).map(|r| (r * 1e4).round() / 1e4);
        }
    }
    let collectives =
        measure_collectives(&mut map, target.devices, dtype, shapes, bench, progress)?;
    let mut t = OpTables {
        model: target.model.into(),
        dtype: target.dtype,
        device: target.device_name.into(),
        gemm,
        attention,
        elementwise_gbps,
        htod_busy_ratio,
        library_bytes: None,
        collectives,
        components: Vec::new(),
    };
    t.sort();
    Ok(t)
}

/// A weight source of random tensors of the shapes it is told: what a layer loads from
/// it has the layer's real shape and dtype, so the layer runs as it does on a checkpoint.
struct Random<'a> {
    shapes: Vec<(String, Vec<usize>)>,
    dtype: DType,
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
}

/// Normal values of standard deviation 0.02 (a trained weight's scale), in `dtype`.
fn random(dims: &[u64], dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    let dims: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
    Tensor::randn(0f32, 0.02, dims, dev)?.to_dtype(dtype)
}

/// One product `x · Wᵀ`, `W` `(n, k)`, through the layer the block runs it with
/// ([`Run`]): a column-parallel linear with its bias (and GELU), a row-parallel layer's
/// partial product (its bias comes after the all-reduce, an element-wise pass), or a
/// per-sample linear on an `(m, k)` conditioning vector.
fn time_gemm(dev: &Device, dtype: DType, g: Gemm, bench: &OpBench) -> candle_core::Result<f64> {
    median(dev, bench, gemm_load(dev, dtype, g, bench.kernels)?)
}

/// [`time_gemm`]'s product with its layer and random input built, ready to run.
pub(crate) fn gemm_load(
    dev: &Device,
    dtype: DType,
    g: Gemm,
    k: Kernels,
) -> candle_core::Result<Load<'static>> {
    let src = Random {
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
pub(crate) fn attention_load(
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

/// mold's element-wise kernels over `(1, rows, width)`, each with the passes over `x`
/// it makes ([`elementwise_gbps`]).
pub(crate) fn elementwise_loads(
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
    let (x1, x2, b2) = (x.clone(), x.clone(), bias.clone());
    Ok(vec![
        (
            2.0,
            Box::new(move || ops::ln_modulate(&x, &scale, &shift, 1e-6, k)),
        ),
        (
            3.0,
            Box::new(move || ops::gate_residual(&res, &x1, Some(&bias), &gate, k)),
        ),
        (
            2.0,
            Box::new(move || ops::bias_act(&x2, Some(&b2), true, k)),
        ),
    ])
}

/// What [`calibrate_copy::measure`] times the copy beside, on `dev`: candle's kernels
/// over broadcast operands (each uploads its layout first), every kind's matrix
/// products, its attention, its element-wise kernels (repeated for the block's
/// element-wise bytes), and a block of each kind whole (as the mixed timing runs it,
/// [`crate::calibrate_mix::block_loads`]).
fn copy_loads(
    dev: &Device,
    dtype: DType,
    blocks: &[BlockOps],
    k: Kernels,
) -> candle_core::Result<Vec<(String, Load<'static>)>> {
    type Part = Rc<dyn Fn() -> candle_core::Result<Tensor>>;
    let part = |l: Load<'static>| -> Part { Rc::from(l) };
    let mut gemms: Vec<Part> = Vec::new();
    let mut attention: Vec<Part> = Vec::new();
    let mut elementwise: Vec<Part> = Vec::new();
    let mut whole: Vec<Part> = Vec::new();
    for b in blocks {
        let (slots, loads) = crate::calibrate_mix::block_loads(dev, dtype, b, k)?;
        for (slot, l) in slots.into_iter().zip(loads) {
            let p = part(l);
            match slot {
                Slot::Gemm(_) => gemms.push(p.clone()),
                Slot::Attention(..) => attention.push(p.clone()),
                Slot::Elementwise(_) => elementwise.push(p.clone()),
            }
            whole.push(p);
        }
    }
    let all = |parts: Vec<Part>| -> Load<'static> {
        Box::new(move || {
            let mut last = None;
            for p in &parts {
                last = Some(p()?);
            }
            last.ok_or_else(|| candle_core::Error::Msg("nothing to run".into()))
        })
    };
    // candle's kernels over broadcast or strided operands upload their layout (dims and
    // strides) with a small host→device copy on the compute stream before each launch:
    // does a stream of those slow the weight copy beside them?
    let width = blocks
        .iter()
        .map(|b| b.attention.heads.saturating_mul(b.attention.head_dim))
        .max()
        .unwrap_or(1)
        .max(1);
    let small = random(&[1, 256, width], dtype, dev)?;
    let row = random(&[1, 1, width], dtype, dev)?;
    let strided: Load<'static> = Box::new(move || {
        let mut y = small.broadcast_add(&row)?;
        for _ in 0..15 {
            y = y.broadcast_add(&row)?;
        }
        Ok(y)
    });
    Ok(vec![
        ("strided kernels".into(), strided),
        ("matrix products".into(), all(gemms)),
        ("attention".into(), all(attention)),
        ("element-wise kernels".into(), all(elementwise)),
        (COPY_BESIDE_BLOCKS.into(), all(whole)),
    ])
}

/// The load whose copy rate goes into the table: the model's blocks run whole.
const COPY_BESIDE_BLOCKS: &str = "its blocks";

/// Bytes per second of mold's element-wise kernels over `(1, rows, width)`: LayerNorm +
/// modulation (reads x, writes the result), gated residual with the row-parallel bias
/// (reads two, writes one) and bias + GELU
/// (reads x, writes the result), their bytes over their median times.
fn elementwise_gbps(
    dev: &Device,
    dtype: DType,
    (rows, width): (u64, u64),
    bench: &OpBench,
) -> candle_core::Result<f64> {
    let x_bytes = (rows.max(1) * width.max(1)) as f64 * dtype.size_in_bytes() as f64;
    let (mut bytes, mut seconds) = (0.0, 0.0);
    for (passes, run) in elementwise_loads(dev, dtype, (rows, width), bench.kernels)? {
        bytes += passes * x_bytes;
        seconds += median(dev, bench, run)?;
    }
    Ok(((bytes / seconds / 1e9) * 1000.0).round().max(1.0) / 1000.0)
}

/// The median seconds of `f` on `dev`, each run synchronised; never 0 (a clock tick).
fn median(
    dev: &Device,
    bench: &OpBench,
    f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<f64> {
    match bench.timing {
        Timing::Alone => median_time(dev, bench.warmup, bench.iters, f),
        Timing::Sustained { round, span } | Timing::Mixed { round, span } => {
            sustained_time(dev, round, span, f)
        }
    }
}

/// The most runs in one round of [`sustained_time`], whatever the estimate says.
const MOST_PER_ROUND: usize = 100_000;

/// `f` run back to back on `dev`: after one warm-up and one timed run (the estimate of a
/// round's length), rounds of about `round` with one synchronise each, until `span` has
/// passed (four rounds at least). The per-run time of the median round of the later
/// half, in seconds: the earlier rounds are the clocks settling under the load.
pub fn sustained_time(
    dev: &Device,
    round: Duration,
    span: Duration,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<f64> {
    drop(f()?);
    dev.synchronize()?;
    let start = Instant::now();
    drop(f()?);
    dev.synchronize()?;
    let one = start.elapsed().as_secs_f64().max(1e-7);
    let per_round = ((round.as_secs_f64() / one).round() as usize).clamp(1, MOST_PER_ROUND);
    let begin = Instant::now();
    let mut rounds = Vec::new();
    while rounds.len() < 4 || begin.elapsed() < span {
        let t = Instant::now();
        for _ in 0..per_round {
            drop(f()?);
        }
        dev.synchronize()?;
        rounds.push(t.elapsed().as_secs_f64() / per_round as f64);
    }
    let later = rounds.split_off(rounds.len() / 2);
    Ok(median_of(later))
}

/// `f` run `warmup` times untimed, then timed `iters` times (at least once), each run
/// synchronised on `dev`: the median of the timed runs, in seconds.
pub fn median_time(
    dev: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = Instant::now();
        let out = f()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(median_of(times))
}

fn median_of(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let m = if n == 0 {
        0.0
    } else if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    // Nanoseconds: what a clock resolves; never 0.
    ((m * 1e9).round() / 1e9).max(1e-9)
}

/// Every collective of `shapes` over the first `n` of `devices` (where there are `n`).
fn measure_collectives(
    map: &mut DeviceMap,
    devices: &[DeviceId],
    dtype: DType,
    shapes: &CalibrationShapes,
    bench: &OpBench,
    progress: &mut dyn FnMut(&str),
) -> Result<CollectiveTables> {
    let mut out = CollectiveTables::default();
    let mut sizes: Vec<u32> = shapes.collectives.iter().map(|c| c.1).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for n in sizes {
        let n_us = n as usize;
        if n_us > devices.len() || n < 2 {
            continue;
        }
        let group = &devices[..n_us];
        let devs: Vec<Device> = group.iter().map(|d| map.get(d)).collect::<Result<_>>()?;
        let jobs: Vec<(CollectiveOp, u64)> = shapes
            .collectives
            .iter()
            .filter(|c| c.1 == n)
            .map(|c| (c.0, c.2))
            .collect();
        progress(&format!(
            "{} collectives over {} (all-reduce, all-gather, all-to-all)",
            jobs.len(),
            list(group)
        ));
        let comms = make_group(group, &bench.comm, None);
        for (op, bytes) in jobs {
            let (seconds, actual) = time_collective(&comms, &devs, dtype, op, bytes, bench)
                .map_err(|e| ExecError::Device {
                    device: list(group),
                    message: format!("measuring {} of {bytes} bytes: {e}", op.name()),
                })?;
            let p = CollectivePoint {
                devices: n,
                bytes: actual,
                seconds,
            };
            let l = match op {
                CollectiveOp::AllReduce => &mut out.all_reduce,
                CollectiveOp::AllGather => &mut out.all_gather,
                CollectiveOp::AllToAll => &mut out.all_to_all,
            };
            // Rounding to whole elements can make two sizes one: keep the first.
            if !l.iter().any(|q| q.devices == n && q.bytes == actual) {
                l.push(p);
            }
        }
    }
    Ok(out)
}

/// The median over runs of the slowest rank's time of one `op` of about `bytes` per
/// rank ([`mold_machine::CollectiveTables`] says which bytes), and the bytes it moved
/// (whole elements, divisible by the ranks).
fn time_collective(
    comms: &[Box<dyn Comm>],
    devs: &[Device],
    dtype: DType,
    op: CollectiveOp,
    bytes: u64,
    bench: &OpBench,
) -> candle_core::Result<(f64, u64)> {
    let n = comms.len();
    let size = dtype.size_in_bytes() as u64;
    // Elements per rank of the message: a multiple of the ranks, at least one each.
    let elems = (bytes / size).div_ceil(n as u64).max(1) * n as u64;
    let runs = bench.warmup + bench.iters.max(1);
    let barrier = Barrier::new(n);
    let per_rank: Vec<candle_core::Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(devs)
            .map(|(comm, dev)| {
                let barrier = &barrier;
                s.spawn(move || {
                    let r = rank_runs(comm.as_ref(), dev, dtype, op, elems, runs, barrier);
                    if r.is_err() {
                        comm.abort();
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(candle_core::Error::Msg(
                        "a measuring thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut slowest = vec![0.0f64; runs];
    for r in per_rank {
        for (s, t) in slowest.iter_mut().zip(r?) {
            *s = s.max(t);
        }
    }
    let timed = slowest.split_off(bench.warmup.min(slowest.len()));
    Ok((median_of(timed), elems * size))
}

/// One rank's runs of `op`; `elems` is the message per rank in elements (for an
/// all-gather the gathered output, for an all-to-all the whole send buffer).
fn rank_runs(
    comm: &dyn Comm,
    dev: &Device,
    dtype: DType,
    op: CollectiveOp,
    elems: u64,
    runs: usize,
    barrier: &Barrier,
) -> candle_core::Result<Vec<f64>> {
    let n = comm.world_size();
    let piece = elems / n as u64;
    let input = match op {
        CollectiveOp::AllReduce => random(&[elems], dtype, dev)?,
        CollectiveOp::AllGather => random(&[piece], dtype, dev)?,
        CollectiveOp::AllToAll => random(&[elems], dtype, dev)?,
    };
    let pieces: Vec<Tensor> = match op {
        CollectiveOp::AllToAll => (0..n)
            .map(|j| input.narrow(0, j * piece as usize, piece as usize))
            .collect::<candle_core::Result<_>>()?,
        _ => Vec::new(),
    };
    let recv: Vec<Shape> = (0..n).map(|_| Shape::from(piece as usize)).collect();
    dev.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        barrier.wait();
        let start = Instant::now();
        let out = match op {
            CollectiveOp::AllReduce => vec![comm.all_reduce_sum(&input)?],
            CollectiveOp::AllGather => vec![comm.all_gather(&input)?],
            CollectiveOp::AllToAll => comm.all_to_all(&pieces, &recv)?,
        };
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(out);
    }
    comm.check()?;
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mold_cost::ops::{calibration_shapes, ShapeRequest};

    fn emu(n: u32) -> Vec<DeviceId> {
        (0..n).map(DeviceId::Emu).collect()
    }

    /// The loads the copy is timed beside (built only on GPUs in a calibration) run on
    /// the CPU too: one of each kind plus the whole blocks, each giving an output, the
    /// blocks' element-wise kernels repeated for their bytes.
    #[test]
    fn the_copy_s_loads_are_the_blocks_operations() {
        let model = mold_models::find("flux-tiny").unwrap();
        let req = ShapeRequest::default_for(&model, 1, vec![]);
        let shapes = calibration_shapes(&model, mold_plan::DType::F32, &req);
        assert_eq!(shapes.blocks.len(), model.transformer.kinds.len());
        let loads = copy_loads(&Device::Cpu, DType::F32, &shapes.blocks, Kernels::Auto).unwrap();
        let names: Vec<&str> = loads.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "strided kernels",
                "matrix products",
                "attention",
                "element-wise kernels",
                COPY_BESIDE_BLOCKS
            ]
        );
        for (name, load) in &loads {
            let y = load().unwrap();
            assert!(y.elem_count() > 0, "{name}");
        }
    }

    /// flux-tiny's shapes on emulated devices: a table of every shape asked for, which
    /// the profile accepts, with collectives over 2 and 4 devices.
    #[test]
    fn tiny_shapes_measure_into_a_valid_table() {
        let model = mold_models::find("flux-tiny").unwrap();
        let req = ShapeRequest::default_for(&model, 4, vec![2, 4]);
        let shapes = calibration_shapes(&model, mold_plan::DType::F32, &req);
        let devices = emu(4);
        let bench = OpBench {
            warmup: 1,
            iters: 3,
            ..OpBench::default()
        };
        let t = measure_ops(
            &OpTarget {
                model: "flux-tiny",
                dtype: mold_plan::DType::F32,
                device_name: "emulated device (CPU)",
                devices: &devices,
            },
            &shapes,
            &bench,
            &mut |_| {},
        )
        .unwrap();
        t.validate("ops[0]").unwrap();
        assert_eq!(t.gemm.len(), shapes.gemm.len());
        assert_eq!(t.attention.len(), shapes.attention.len());
        for g in &shapes.gemm {
            assert!(
                t.gemm.iter().any(|p| (p.m, p.n, p.k) == (g.m, g.n, g.k)),
                "{g:?}"
            );
        }
        for (op, n) in [
            (CollectiveOp::AllReduce, 2),
            (CollectiveOp::AllReduce, 4),
            (CollectiveOp::AllToAll, 2),
            (CollectiveOp::AllGather, 4),
        ] {
            assert!(!t.collective_curve(op, n).is_empty(), "{op:?} {n}");
        }
        assert!(t.elementwise_gbps > 0.0);
    }

    /// The mixed timing fills the same table: every product and attention shape, from
    /// inside the blocks, with an element-wise rate.
    #[test]
    fn mixed_timing_measures_into_a_valid_table() {
        let model = mold_models::find("flux-tiny").unwrap();
        let req = ShapeRequest::default_for(&model, 1, vec![]);
        let shapes = calibration_shapes(&model, mold_plan::DType::F32, &req);
        let bench = OpBench {
            timing: Timing::Mixed {
                round: Duration::from_millis(1),
                span: Duration::from_millis(2),
            },
            ..OpBench::default()
        };
        let mut said = Vec::new();
        let t = measure_ops(
            &OpTarget {
                model: "flux-tiny",
                dtype: mold_plan::DType::F32,
                device_name: "emulated device (CPU)",
                devices: &emu(1),
            },
            &shapes,
            &bench,
            &mut |s| said.push(s.to_string()),
        )
        .unwrap();
        t.validate("ops[0]").unwrap();
        assert_eq!(t.gemm.len(), shapes.gemm.len());
        assert_eq!(t.attention.len(), shapes.attention.len());
        assert!(t.elementwise_gbps > 0.0);
        assert!(
            said.iter().any(|s| s.contains("timed inside its block")),
            "{said:?}"
        );
        assert!(Timing::MIXED.describe().contains("inside their blocks"));
    }

    /// Sustained timing runs the operation back to back for the whole span, rounds of
    /// many runs with one synchronise each, and reports one run's time: well below a
    /// round's, and above 0.
    #[test]
    fn sustained_timing_runs_back_to_back_for_its_span() {
        let dev = Device::Cpu;
        let x = Tensor::ones((64, 64), DType::F32, &dev).unwrap();
        let mut runs = 0usize;
        let start = Instant::now();
        let (round, span) = (Duration::from_millis(5), Duration::from_millis(60));
        let t = sustained_time(&dev, round, span, || {
            runs += 1;
            x.matmul(&x)
        })
        .unwrap();
        assert!(start.elapsed() >= span);
        // Two runs to estimate, then at least four rounds of several runs each.
        assert!(runs > 2 + 4, "{runs} runs");
        assert!(t > 0.0 && t < round.as_secs_f64(), "{t} s per run");
        let per_run = start.elapsed().as_secs_f64() / runs as f64;
        assert!(t < 4.0 * per_run, "{t} s per run, {per_run} s on average");
    }

    #[test]
    fn a_benchmark_that_cannot_run_is_refused_in_one_line() {
        let b = OpBench::default();
        assert_eq!(b.check(&emu(2)), Ok(()));
        assert!(b.check(&[]).unwrap_err().contains("no device"));
        let e = b.check(&[DeviceId::Emu(0), DeviceId::Emu(0)]).unwrap_err();
        assert!(e.contains("not distinct"), "{e}");
        assert!(b.check(&[DeviceId::Host]).unwrap_err().contains("host"));
        let none = OpBench {
            iters: 0,
            ..OpBench::default()
        };
        assert!(none.check(&emu(1)).unwrap_err().contains("iters"));
        for (round, span) in [(0, 10), (20, 10)] {
            let b = OpBench {
                timing: Timing::Sustained {
                    round: Duration::from_millis(round),
                    span: Duration::from_millis(span),
                },
                ..OpBench::default()
            };
            assert!(b.check(&emu(1)).unwrap_err().contains("sustained"));
            let b = OpBench {
                timing: Timing::Mixed {
                    round: Duration::from_millis(round),
                    span: Duration::from_millis(span),
                },
                ..OpBench::default()
            };
            assert!(b.check(&emu(1)).unwrap_err().contains("mixed"));
        }
        assert_eq!(median_of(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median_of(vec![0.0]), 1e-9);
    }
}
