//! Operation benchmarks for `mold devices --calibrate --model M`: a model's own
//! operations timed through mold's own layers and kernels, so the table holds what mold
//! runs — the matrix products of its blocks through the layers the blocks run them with
//! ([`crate::model::layers::ColumnParallel`] with its bias and GELU, in cuBLASLt's
//! epilogue on CUDA; [`crate::model::layers::RowParallel`]'s partial product; the
//! per-sample linear), attention through [`crate::model::attention::attention_with`]
//! (mold's fused kernel on CUDA, candle's ops elsewhere), the element-wise kernels of
//! [`crate::model::ops`] (modulation, gated residual, bias + GELU), all built in
//! [`super::loads`], and the collectives of [`crate::comm::Comm`] over groups from
//! [`crate::comm::make_group`] ([`super::collectives`]; NCCL on GPUs with the `nccl`
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

use super::bench::{OpBench, Timing};
use super::collectives::measure_collectives;
use super::copy;
use super::loads::{
    attention_load, block_loads, elementwise_loads, fp8_attention_load, gemm_load,
    layout_copy_load, random, Load, Precision, Slot,
};
use super::mix;
use super::timing::{median_time, sustained_time};
use crate::error::{ExecError, Result};
use crate::executor::weights_dtype;
use crate::model::ops::Kernels;
use crate::runtime::DeviceMap;
use candle_core::{DType, Device, Tensor};
use mold_cost::ops::{BlockOps, CalibrationShapes, Gemm};
use mold_machine::{AttentionPoint, GemmPoint, OpTables};
use mold_plan::DeviceId;
use std::rc::Rc;

/// The host→device copy timed beside the model's blocks: about one streamed block.
const COPY_BYTES: usize = 512 << 20;

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
    // FP8 plans: products with FP8 weights (as they run), everything else in bf16.
    let (dtype, fp8) = weights_dtype(target.dtype)?;
    let precision = Precision { dtype, fp8 };
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
            mix::measure(
                &dev,
                precision,
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
            None => time_gemm(&dev, precision, *g, bench)
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
    let fp8_attention = if target.dtype == mold_plan::DType::Fp8 {
        measure_fp8_attention(&dev, dtype, shapes, &attention, &mixed, bench, progress)
            .map_err(|e| on(e, "FP8 attention"))?
    } else {
        Vec::new()
    };
    progress(&format!(
        "element-wise kernels on {id} ({} x {})",
        shapes.elementwise.0, shapes.elementwise.1
    ));
    // Timed back to back alone: they are bound by memory, not by the clock a mix sets,
    // and the per-operation marks of the mix add to such short kernels what a step does
    // not pay (the mix's rate is reported beside it).
    let elementwise_gbps = elementwise_gbps(&dev, dtype, shapes.elementwise, bench)
        .map_err(|e| on(e, "element-wise kernels"))?;
    if let Some(g) = mixed.elementwise_gbps() {
        progress(&format!(
            "element-wise kernels: {elementwise_gbps:.1} GB/s back to back alone (kept), {g:.1} GB/s timed one by one inside the blocks' mix"
        ));
    }
    let layout_copy_gbps = layout_copy_gbps(&dev, dtype, shapes, bench)
        .map_err(|e| on(e, "the all-to-all's output join"))?;
    if let Some(g) = layout_copy_gbps {
        progress(&format!(
            "the output join after a sequence-parallel all-to-all: {g:.1} GB/s"
        ));
    }
    let mut htod_busy_ratio = None;
    if dev.is_cuda() && !shapes.blocks.is_empty() {
        progress(&format!(
            "the host→device copy of {} MiB on {id}, idle and beside {}'s operations",
            COPY_BYTES >> 20,
            target.model
        ));
        let loads = copy_loads(&dev, precision, &shapes.blocks, bench.kernels)
            .map_err(|e| on(e, "the loads the copy runs beside"))?;
        if let Some(c) = copy::measure(&dev, &loads, COPY_BYTES)? {
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
        fp8_attention,
        elementwise_gbps,
        layout_copy_gbps,
        htod_busy_ratio,
        estimated: None,
        library_bytes: None,
        collectives,
        components: Vec::new(),
    };
    t.sort();
    Ok(t)
}

/// FP8 attention at `shapes`' attention shapes ([`fp8_attention_load`]), as an FP8 plan
/// with `attention: fp8` runs it; a shape where it does not run in FP8 here is left out
/// (each reason said once in `progress`), as the executor falls back call by call. Where the table's attention was timed inside its block's mix, an FP8
/// point is that time × FP8 attention's over attention's, the two timed alone the same
/// way: FP8 attention stands in the mix where attention stood.
fn measure_fp8_attention(
    dev: &Device,
    dtype: DType,
    shapes: &CalibrationShapes,
    attention: &[AttentionPoint],
    mixed: &mix::MixTimes,
    bench: &OpBench,
    progress: &mut dyn FnMut(&str),
) -> candle_core::Result<Vec<AttentionPoint>> {
    progress(&format!("FP8 attention: {} shapes", shapes.attention.len()));
    let mut out = Vec::new();
    let mut said: Vec<String> = Vec::new();
    for (a, p) in shapes.attention.iter().zip(attention) {
        let run = match fp8_attention_load(dev, dtype, *a, 1, bench.kernels)? {
            Ok(run) => run,
            Err(why) => {
                if !said.contains(&why) {
                    progress(&format!("FP8 attention not measured: {why}"));
                    said.push(why);
                }
                continue;
            }
        };
        let fp8_s = median(dev, bench, run)?;
        let seconds = if mixed.attention_s(a).is_some() {
            let alone = median(
                dev,
                bench,
                attention_load(dev, dtype, *a, 1, bench.kernels)?,
            )?;
            p.seconds * fp8_s / alone
        } else {
            fp8_s
        };
        progress(&format!(
            "FP8 attention over {} heads x {} tokens of {}: {:.3} ms ({:.3}x attention's)",
            a.heads,
            a.seq,
            a.head_dim,
            seconds * 1e3,
            seconds / p.seconds
        ));
        out.push(AttentionPoint {
            heads: a.heads,
            seq: a.seq,
            head_dim: a.head_dim,
            seconds,
        });
    }
    Ok(out)
}

/// One product ([`gemm_load`]) timed.
fn time_gemm(dev: &Device, p: Precision, g: Gemm, bench: &OpBench) -> candle_core::Result<f64> {
    median(dev, bench, gemm_load(dev, p, g, bench.kernels)?)
}

/// What [`copy::measure`] times the copy beside, on `dev`: candle's kernels
/// over broadcast operands (each uploads its layout first), every kind's matrix
/// products, its attention, its element-wise kernels (repeated for the block's
/// element-wise bytes), and a block of each kind whole (as the mixed timing runs it,
/// [`super::loads::block_loads`]).
fn copy_loads(
    dev: &Device,
    p: Precision,
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
        let (slots, loads) = block_loads(dev, p, b, k)?;
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
    let small = random(&[1, 256, width], p.dtype, dev)?;
    let row = random(&[1, 1, width], p.dtype, dev)?;
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

/// Bytes per second of mold's element-wise kernels over `(1, rows, width)`, each run back
/// to back by itself (`--timing mixed` and `sustained`; `alone`: synchronised runs):
/// LayerNorm + modulation (reads x, writes the result) and gated residual with the
/// row-parallel bias (reads two, writes one), their bytes over their median times.
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
    Ok(mix::gbps(bytes, seconds))
}

/// Bytes per second of the copies around a sequence-parallel all-to-all over two
/// ranks ([`layout_copy_load`]) at the element-wise shape's tokens and width, in heads of
/// the attention shapes' head size; `None` where there is no attention shape or the heads
/// do not split in two.
fn layout_copy_gbps(
    dev: &Device,
    dtype: DType,
    shapes: &CalibrationShapes,
    bench: &OpBench,
) -> candle_core::Result<Option<f64>> {
    let Some(head_dim) = shapes.attention.first().map(|a| a.head_dim) else {
        return Ok(None);
    };
    let Some((bytes, run)) = layout_copy_load(dev, dtype, shapes.elementwise, head_dim, 2)? else {
        return Ok(None);
    };
    let seconds = median(dev, bench, run)?;
    Ok(Some(mix::gbps(bytes, seconds)))
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

#[cfg(test)]
mod tests {
    use super::super::timing::median_of;
    use super::*;
    use mold_cost::ops::{calibration_shapes, ShapeRequest};
    use mold_machine::CollectiveOp;
    use std::time::Duration;

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
        let loads = copy_loads(
            &Device::Cpu,
            DType::F32.into(),
            &shapes.blocks,
            Kernels::Auto,
        )
        .unwrap();
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
        // flux-tiny's heads split in two: the all-to-all's layout copies are measured.
        assert!(t.layout_copy_gbps.is_some_and(|g| g > 0.0));
    }

    /// The layout-copy load runs the executor's own copies ([`crate::model::sequence`]):
    /// its output is the attention output's pieces side by side, and its bytes are the
    /// cost model's 2 shards of the rank's tokens (the output's pieces joined: 1 read, 1
    /// written).
    #[test]
    fn the_layout_copy_load_runs_the_all_to_alls_copies() {
        let dev = Device::Cpu;
        let (bytes, run) = layout_copy_load(&dev, DType::F32, (64, 32), 8, 2)
            .unwrap()
            .unwrap();
        let shard = (64 / 2 * 32 * 4) as f64;
        assert_eq!(bytes, 2.0 * shard);
        assert_eq!(run().unwrap().dims(), &[1, 32, 32]);
        // Heads that do not split over the ranks: nothing to measure.
        assert!(layout_copy_load(&dev, DType::F32, (64, 24), 8, 2)
            .unwrap()
            .is_none());
    }

    /// flux-tiny's shapes in `dtype` measured on one emulated device with the mixed timing:
    /// the table (validated), the shapes and what the measurement said.
    fn tiny_mixed(dtype: mold_plan::DType) -> (OpTables, CalibrationShapes, Vec<String>) {
        let model = mold_models::find("flux-tiny").unwrap();
        let req = ShapeRequest::default_for(&model, 1, vec![]);
        let shapes = calibration_shapes(&model, dtype, &req);
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
                dtype,
                device_name: "emulated device (CPU)",
                devices: &emu(1),
            },
            &shapes,
            &bench,
            &mut |s| said.push(s.to_string()),
        )
        .unwrap();
        t.validate("ops[0]").unwrap();
        (t, shapes, said)
    }

    /// The mixed timing fills the same table: every product and attention shape, from
    /// inside the blocks, with an element-wise rate.
    #[test]
    fn mixed_timing_measures_into_a_valid_table() {
        let (t, shapes, said) = tiny_mixed(mold_plan::DType::F32);
        assert_eq!(t.gemm.len(), shapes.gemm.len());
        assert_eq!(t.attention.len(), shapes.attention.len());
        assert!(t.elementwise_gbps > 0.0);
        assert!(
            said.iter().any(|s| s.contains("timed inside its block")),
            "{said:?}"
        );
        assert!(Timing::MIXED.describe().contains("inside their blocks"));
    }

    /// An FP8 table measures FP8 attention at every attention shape (the CPU's emulation
    /// here; cuDNN's FP8 flash attention on a GPU), from inside the blocks' mix as attention
    /// stands there; a table in another dtype holds none.
    #[test]
    fn an_fp8_table_measures_fp8_attention_too() {
        let (t, shapes, said) = tiny_mixed(mold_plan::DType::Fp8);
        assert_eq!(t.fp8_attention.len(), shapes.attention.len());
        for (p, a) in t.fp8_attention.iter().zip(&t.attention) {
            assert_eq!((p.heads, p.seq, p.head_dim), (a.heads, a.seq, a.head_dim));
            assert!(p.seconds > 0.0 && p.seconds.is_finite());
        }
        assert!(
            said.iter().any(|s| s.starts_with("FP8 attention over")),
            "{said:?}"
        );
        assert!(tiny_mixed(mold_plan::DType::F32).0.fp8_attention.is_empty());
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
