//! Operations timed inside the mix of the block they belong to (`mold devices
//! --calibrate --model M --timing mixed`).
//!
//! A GPU at its power limit sets one clock for whatever it runs, and that clock depends
//! on the mix: a matrix product run back to back by itself draws more power than a
//! block's products, attention and element-wise kernels together, so it runs slower
//! alone than inside the block (on an H200 the sustained timing priced a block's products
//! about 10 % high), and an attention timed by itself runs faster than beside them. Here
//! each block the cost model prices ([`mold_cost::ops::CalibrationShapes::mixes`]: every
//! kind at every size and `tp × sp` layout) runs its operations in its own order, back
//! to back for a span, as a step runs them; each operation is timed inside that stream
//! by a per-operation clock (CUDA events recorded between the launches, so the device
//! never drains; on the CPU, whose operations return when done, the wall clock), in one
//! repetition of the block per round of about `round`, and the median of the later half
//! of the rounds is kept. The block is the calibration's own operations at the block's
//! shapes (random weights and inputs), never the model's step: nothing here is fitted
//! on a step.

use super::loads::{block_loads, Load, Precision, Slot};
use crate::model::ops::Kernels;
use candle_core::Device;
use mold_cost::ops::{AttentionShape, BlockOps, Gemm};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Every operation's time inside its block's mix, by table key.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct MixTimes {
    /// Seconds of a product `(m, n, k)`, one entry per mix that runs it.
    pub gemm: BTreeMap<(u64, u64, u64), Vec<f64>>,
    /// Seconds of one sample's attention `(heads, seq, head_dim)`, one entry per mix.
    pub attention: BTreeMap<(u64, u64, u64), Vec<f64>>,
    /// Bytes the mixes' element-wise kernels moved, and their seconds.
    pub elementwise: (f64, f64),
}

impl MixTimes {
    /// The product's time: the median over the mixes that run it.
    pub fn gemm_s(&self, g: &Gemm) -> Option<f64> {
        self.gemm.get(&(g.m, g.n, g.k)).map(|v| median(v.clone()))
    }

    /// One sample's attention: the median over the mixes that run it.
    pub fn attention_s(&self, a: &AttentionShape) -> Option<f64> {
        self.attention
            .get(&(a.heads, a.seq, a.head_dim))
            .map(|v| median(v.clone()))
    }

    /// The element-wise kernels' rate (GB/s) over every mix; `None` without any.
    pub fn elementwise_gbps(&self) -> Option<f64> {
        let (bytes, s) = self.elementwise;
        (bytes > 0.0 && s > 0.0).then(|| gbps(bytes, s))
    }
}

/// Times every operation of each of `mixes` inside its block on `dev` (module
/// documentation): `round` per round, at least four rounds and `span` per block.
pub(super) fn measure(
    dev: &Device,
    p: Precision,
    mixes: &[BlockOps],
    kernels: Kernels,
    (round, span): (Duration, Duration),
    progress: &mut dyn FnMut(&str),
) -> candle_core::Result<MixTimes> {
    let mut out = MixTimes::default();
    for (i, b) in mixes.iter().enumerate() {
        progress(&format!(
            "block {}/{} in its mix: {} products, attention over {} heads x {} tokens, {} MB element-wise",
            i + 1,
            mixes.len(),
            b.gemms.len(),
            b.attention.heads,
            b.attention.seq,
            b.elementwise_bytes / 1_000_000
        ));
        let (slots, loads) = block_loads(dev, p, b, kernels)?;
        let times = time_in_mix(dev, &loads, round, span)?;
        for (slot, s) in slots.iter().zip(times) {
            match slot {
                Slot::Gemm(g) => out.gemm.entry((g.m, g.n, g.k)).or_default().push(s),
                Slot::Attention(a, batch) => out
                    .attention
                    .entry((a.heads, a.seq, a.head_dim))
                    .or_default()
                    .push(s / (*batch).max(1) as f64),
                Slot::Elementwise(bytes) => {
                    out.elementwise.0 += bytes;
                    out.elementwise.1 += s;
                }
            }
        }
    }
    Ok(out)
}

/// `bytes` moved in `seconds` as GB/s, to a thousandth, at least 0.001 (what the tables
/// keep of a measured rate).
pub(super) fn gbps(bytes: f64, seconds: f64) -> f64 {
    ((bytes / seconds / 1e9) * 1000.0).round().max(1.0) / 1000.0
}

/// The most repetitions of a block in one round, whatever the estimate says.
const MOST_PER_ROUND: usize = 10_000;

/// `loads` run in order, back to back, in rounds of about `round` (one synchronise
/// each) until `span` has passed and four rounds ran; in the last repetition of each
/// round every load is timed by the [`OpClock`]. Each load's median seconds over the
/// later half of the rounds.
pub(super) fn time_in_mix(
    dev: &Device,
    loads: &[Load<'_>],
    round: Duration,
    span: Duration,
) -> candle_core::Result<Vec<f64>> {
    let run_all = || -> candle_core::Result<()> {
        for l in loads {
            drop(l()?);
        }
        Ok(())
    };
    run_all()?;
    dev.synchronize()?;
    let start = Instant::now();
    run_all()?;
    dev.synchronize()?;
    let one = start.elapsed().as_secs_f64().max(1e-7);
    let reps = ((round.as_secs_f64() / one).round() as usize).clamp(1, MOST_PER_ROUND);
    let mut clock = OpClock::new(dev, loads.len() + 1)?;
    let begin = Instant::now();
    let mut rounds: Vec<Vec<f64>> = Vec::new();
    while rounds.len() < 4 || begin.elapsed() < span {
        for _ in 1..reps {
            run_all()?;
        }
        for (i, l) in loads.iter().enumerate() {
            clock.mark(i)?;
            drop(l()?);
        }
        clock.mark(loads.len())?;
        dev.synchronize()?;
        rounds.push(clock.read()?);
    }
    let later = rounds.split_off(rounds.len() / 2);
    Ok((0..loads.len())
        .map(|i| median(later.iter().map(|r| r[i]).collect()))
        .collect())
}

/// Marks between the operations of one repetition, read after a synchronise: on CUDA,
/// events recorded on the device's stream (the stream never waits for them); on the
/// CPU, the wall clock (its operations are done when they return).
pub(super) enum OpClock {
    Wall(Vec<Instant>),
    #[cfg(feature = "cuda")]
    Events {
        stream: std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
        events: Vec<candle_core::cuda::cudarc::driver::CudaEvent>,
    },
}

impl OpClock {
    /// A clock of `marks` marks on `dev`.
    pub(super) fn new(dev: &Device, marks: usize) -> candle_core::Result<OpClock> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = dev {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            let stream = cd.cuda_stream();
            let ctx = stream.context().clone();
            let events = (0..marks)
                .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| candle_core::Error::Msg(format!("creating timing events: {e:?}")))?;
            return Ok(OpClock::Events { stream, events });
        }
        let _ = dev;
        let now = Instant::now();
        Ok(OpClock::Wall(vec![now; marks]))
    }

    /// Mark `i`: now (the CPU), or when the device reaches it (CUDA).
    pub(super) fn mark(&mut self, i: usize) -> candle_core::Result<()> {
        match self {
            OpClock::Wall(t) => {
                t[i] = Instant::now();
                Ok(())
            }
            #[cfg(feature = "cuda")]
            OpClock::Events { stream, events } => events[i]
                .record(stream)
                .map_err(|e| candle_core::Error::Msg(format!("recording a timing event: {e:?}"))),
        }
    }

    /// Seconds between consecutive marks, never below a nanosecond.
    pub(super) fn read(&self) -> candle_core::Result<Vec<f64>> {
        let secs: Vec<f64> = match self {
            OpClock::Wall(t) => t
                .windows(2)
                .map(|w| w[1].duration_since(w[0]).as_secs_f64())
                .collect(),
            #[cfg(feature = "cuda")]
            OpClock::Events { events, .. } => events
                .windows(2)
                .map(|w| {
                    w[0].elapsed_ms(&w[1])
                        .map(|ms| ms as f64 / 1e3)
                        .map_err(|e| {
                            candle_core::Error::Msg(format!("reading timing events: {e:?}"))
                        })
                })
                .collect::<candle_core::Result<_>>()?,
        };
        Ok(secs.into_iter().map(|s| s.max(1e-9)).collect())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 1e-9;
    }
    let m = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    ((m * 1e9).round() / 1e9).max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use candle_core::Tensor;
    use mold_cost::ops::{calibration_shapes, ShapeRequest};
    use std::cell::Cell;
    use std::rc::Rc;

    /// Each load is timed by itself: a load that sleeps 4 ms reads about 4 ms, one
    /// beside it that sleeps 1 ms about 1 ms, in the order given; every load ran in
    /// every repetition of every round.
    #[test]
    fn each_operation_of_the_mix_is_timed_by_itself() {
        let dev = Device::Cpu;
        let runs = Rc::new(Cell::new((0usize, 0usize)));
        let x = Tensor::ones(4, DType::F32, &dev).unwrap();
        let (r1, r2, x1, x2) = (runs.clone(), runs.clone(), x.clone(), x.clone());
        let loads: Vec<Load<'_>> = vec![
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(4));
                let (a, b) = r1.get();
                r1.set((a + 1, b));
                Ok(x1.clone())
            }),
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(1));
                let (a, b) = r2.get();
                r2.set((a, b + 1));
                Ok(x2.clone())
            }),
        ];
        let t = time_in_mix(
            &dev,
            &loads,
            Duration::from_millis(15),
            Duration::from_millis(60),
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert!(t[0] >= 0.004 && t[0] < 0.04, "{t:?}");
        assert!(t[1] >= 0.001 && t[1] < t[0], "{t:?}");
        let (a, b) = runs.get();
        assert_eq!(a, b, "every load runs in every repetition");
        // Two to estimate, then at least four rounds.
        assert!(a >= 2 + 4, "{a} runs");
    }

    /// flux-tiny's mixes on the CPU: every product and attention shape the calibration
    /// asks for is timed inside some block, and the element-wise kernels give a rate.
    #[test]
    fn the_mixes_time_every_shape_the_tables_need() {
        let model = mold_models::find("flux-tiny").unwrap();
        let req = ShapeRequest::default_for(&model, 4, vec![2, 4]);
        let shapes = calibration_shapes(&model, mold_plan::DType::F32, &req);
        let m = measure(
            &Device::Cpu,
            DType::F32.into(),
            &shapes.mixes,
            Kernels::Auto,
            (Duration::from_millis(1), Duration::from_millis(2)),
            &mut |_| {},
        )
        .unwrap();
        for g in &shapes.gemm {
            assert!(m.gemm_s(g).is_some_and(|s| s > 0.0), "{g:?}");
        }
        for a in &shapes.attention {
            assert!(m.attention_s(a).is_some_and(|s| s > 0.0), "{a:?}");
        }
        assert!(m.elementwise_gbps().is_some_and(|g| g > 0.0));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
