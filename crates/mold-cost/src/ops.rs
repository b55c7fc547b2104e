//! A block as the operations it runs, priced from a profile's measured operation tables
//! (`ops:` in the machine profile, [`mold_machine::OpTables`]).
//!
//! [`block_ops`] lists what one rank of a `tp × sp` layout runs in a block: its matrix
//! products (`m` token rows, `k` input and `n` output features, after sharding), its
//! attention (heads over the whole sequence) and its element-wise traffic. Calibration
//! measures exactly these shapes ([`calibration_shapes`]), so at the sizes it measured a
//! lookup is exact; between them a time is interpolated log-log in the size dimension
//! (`m`, the sequence, the message bytes: [`loglog`]), and beyond the measured range
//! it is extrapolated at the nearest point's rate (time ∝ size) and reported
//! ([`Extrapolated`]). A block is priced this way only when the tables hold every
//! product and the attention it needs; otherwise the peak-rate model stays
//! (`Ctx::block`). Nothing here is fitted on a step.

use crate::{Ctx, Group};
use mold_machine::{CollectiveOp, Machine, OpTables};
use mold_models::{Attention, BlockKind, ModelSpec, Tokens};
use mold_plan::{DType, DeviceId, Plan, Workload};
use serde::Serialize;

/// A matrix product `(m × k) · (k × n)`, and how the executor runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Gemm {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub run: Run,
}

/// How a product runs in the executor, which decides what its measured time holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Run {
    /// A column-parallel linear: the product and its bias (in the matmul's epilogue on
    /// CUDA, a pass after it elsewhere).
    Bias,
    /// A column-parallel linear followed by GELU (the same, bias and GELU).
    BiasGelu,
    /// A row-parallel partial product: the product alone (its bias comes after the
    /// all-reduce, an element-wise pass).
    Partial,
    /// A per-sample (modulation) linear on the conditioning vector.
    PerSample,
}

/// Attention of one sample over `seq` tokens, `heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct AttentionShape {
    pub heads: u64,
    pub seq: u64,
    pub head_dim: u64,
}

/// What one rank runs in one block.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BlockOps {
    /// Every matrix product, in the order the block runs them (batch folded into `m`).
    pub gemms: Vec<Gemm>,
    pub attention: AttentionShape,
    /// Attention in FP8 ([`mold_machine::OpTables::fp8_attention`]): an FP8 block of a
    /// plan with `attention: fp8`.
    pub fp8_attention: bool,
    /// Sequence-parallel degree: above 1 the rank's attention runs after an all-to-all.
    pub sp: u64,
    /// Samples: the attention runs once per sample.
    pub batch: u64,
    /// Element-wise bytes read and written ([`Ctx::elementwise_bytes`]).
    pub elementwise_bytes: u64,
    /// The windows (steps each) a request computes the per-sample products in, where the
    /// executor computes them ahead ([`mold_models::modulation_windows`]): each
    /// [`Run::PerSample`] product then runs once a window over `m ×` its steps' rows, and
    /// a step costs the windows' sum over the steps. Empty: once a step.
    pub ahead: Vec<u64>,
}

/// The block layouts mold executes, recognised from a kind's parameter counts: FLUX's
/// double-stream block (per stream q/k/v, projection, MLP in and out, a 6·hidden
/// modulation) and its single-stream block (fused q/k/v + MLP in, the output linear over
/// attention and MLP, a 3·hidden modulation). Any other kind has no decomposition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Double,
    Single,
}

fn layout(kind: &BlockKind) -> Option<Layout> {
    let (h, m) = (kind.hidden, kind.mlp_hidden);
    if kind.attention != Attention::Joint || kind.heads == 0 || kind.head_dim == 0 {
        return None;
    }
    if kind.heads as u64 * kind.head_dim as u64 != h {
        return None;
    }
    let per_stream = (3 * h * h + 3 * h) + (h * h + h) + (h * m + m) + (m * h + h);
    if kind.streams == 2
        && kind.img_params == per_stream
        && kind.txt_params == per_stream
        && kind.joint_params == 0
        && kind.per_sample_params == 2 * (6 * h * h + 6 * h)
    {
        return Some(Layout::Double);
    }
    let joint = (h * (3 * h + m) + 3 * h + m) + ((h + m) * h + h);
    if kind.streams == 1
        && kind.img_params == 0
        && kind.txt_params == 0
        && kind.joint_params == joint
        && kind.per_sample_params == 3 * h * h + 3 * h
    {
        return Some(Layout::Single);
    }
    None
}

/// The operations of one block of `kind` on one rank of a `tp × sp` layout, for `batch`
/// samples of `tokens`; `None` for a kind whose layout is not one mold executes.
///
/// Sequence parallel gives each rank `⌈txt/sp⌉` text and `⌈img/sp⌉` image tokens (the
/// executor's split; the busiest rank), tensor parallel `⌈n/tp⌉` of each column-parallel
/// output and `⌈k/tp⌉` of each row-parallel input; attention runs over the whole
/// sequence for `⌈heads/(tp·sp)⌉` heads.
pub fn block_ops(
    kind: &BlockKind,
    tokens: Tokens,
    batch: u64,
    tp: u32,
    sp: u32,
    act: u64,
) -> Option<BlockOps> {
    let layout = layout(kind)?;
    let (tp, sp) = (tp.max(1) as u64, sp.max(1) as u64);
    let (h, mlp) = (kind.hidden, kind.mlp_hidden);
    let (hs, ms) = (h.div_ceil(tp), mlp.div_ceil(tp));
    let txt = tokens.txt.div_ceil(sp);
    let img = tokens.img.div_ceil(sp);
    let g = |m: u64, n: u64, k: u64, run: Run| Gemm {
        m: m.saturating_mul(batch),
        n,
        k,
        run,
    };
    use Run::{Bias, BiasGelu, Partial};
    let mut gemms = Vec::new();
    match layout {
        Layout::Double => {
            let modulation = Gemm {
                m: batch,
                n: (6 * h).div_ceil(tp),
                k: h,
                run: Run::PerSample,
            };
            gemms.extend([modulation, modulation]);
            for m in [img, txt] {
                gemms.extend([
                    g(m, 3 * hs, h, Bias),
                    g(m, h, hs, Partial),
                    g(m, ms, h, BiasGelu),
                    g(m, h, ms, Partial),
                ]);
            }
        }
        Layout::Single => {
            let m = txt.saturating_add(img);
            // linear1 as the executor runs it: q/k/v with their bias, the MLP part with
            // bias and GELU, two products over row slices of the weight.
            gemms.extend([
                Gemm {
                    m: batch,
                    n: (3 * h).div_ceil(tp),
                    k: h,
                    run: Run::PerSample,
                },
                g(m, 3 * hs, h, Bias),
                g(m, ms, h, BiasGelu),
                g(m, h, hs, Partial),
                g(m, h, ms, Partial),
            ]);
        }
    }
    gemms.retain(|x| x.m > 0);
    let local = kind.stream_token_count(tokens).div_ceil(sp);
    Some(BlockOps {
        gemms,
        attention: AttentionShape {
            heads: (kind.heads as u64).div_ceil(tp * sp),
            seq: tokens.img.saturating_add(tokens.txt),
            head_dim: kind.head_dim as u64,
        },
        fp8_attention: false,
        sp,
        batch,
        elementwise_bytes: elementwise_bytes(kind, local, batch, act, tp),
        ahead: Vec::new(),
    })
}

/// `ops` as the executor runs them over a request whose per-sample products are computed
/// ahead in `windows` (steps each; none: every step its own): each per-sample product
/// once per distinct window size, over that many steps' rows. What calibration times; its
/// products hold their actual rows, so `ahead` (which multiplies them) stays empty.
pub fn as_run(ops: BlockOps, windows: &[u64]) -> BlockOps {
    if windows.is_empty() {
        return ops;
    }
    let mut sizes = windows.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let gemms = ops
        .gemms
        .iter()
        .flat_map(|g| {
            let rows: Vec<u64> = if g.run == Run::PerSample {
                sizes.iter().map(|w| g.m.saturating_mul(*w)).collect()
            } else {
                vec![g.m]
            };
            rows.into_iter().map(|m| Gemm { m, ..*g })
        })
        .collect();
    BlockOps { gemms, ..ops }
}

/// The products the executor queues beside each of a block's two all-to-alls under
/// sequence parallelism (`sp` > 1), in their order (q/k/v, output): FLUX's single-stream
/// block runs its MLP in (`linear1`'s MLP rows, with GELU) while q, k and v move, and its
/// MLP out (`linear2`'s MLP columns) while the attention output moves. `None` for a kind
/// with nothing beside them (the double-stream block: everything after the q/k/v
/// all-to-all reads attention) or without sequence parallelism.
pub fn beside_all_to_alls(
    kind: &BlockKind,
    tokens: Tokens,
    batch: u64,
    tp: u32,
    sp: u32,
) -> Option<[Gemm; 2]> {
    if sp <= 1 || layout(kind)? != Layout::Single {
        return None;
    }
    let (tp, sp) = (tp.max(1) as u64, sp as u64);
    let (h, ms) = (kind.hidden, kind.mlp_hidden.div_ceil(tp));
    let m = (tokens.txt.div_ceil(sp) + tokens.img.div_ceil(sp)).saturating_mul(batch);
    Some([
        Gemm {
            m,
            n: ms,
            k: h,
            run: Run::BiasGelu,
        },
        Gemm {
            m,
            n: h,
            k: ms,
            run: Run::Partial,
        },
    ])
}

/// Seconds of one product from a table, `None` where it was never measured at its
/// `(n, k)`.
pub fn gemm_from(t: &OpTables, g: &Gemm) -> Option<f64> {
    loglog(&t.gemm_curve(g.n, g.k), g.m as f64, false).map(|(s, _)| s)
}

/// The bytes of a block's element-wise kernels as the executor runs them with operation
/// tables: [`Ctx::elementwise_bytes`] less the passes the measured products hold (the
/// q/k/v bias, 6·hidden per token, and the MLP's bias and GELU, 2·mlp, run in their
/// column-parallel products' epilogues: [`Run::Bias`], [`Run::BiasGelu`]), and with each
/// sub-block's norm and modulation as one fused pass. Per sub-block, over the hidden
/// state and whole on every rank of a tensor-parallel group: the norm with its
/// modulation (`ln_modulate`: reads the hidden state once, writes it once, 2·hidden) and
/// the bias + gate + residual (`gate_residual`: reads two, writes one, 3·hidden) — the
/// passes the calibration counts for the same kernels when it measures their rate; and
/// the q/k/v preparation (norm, RoPE, layout: 6·hidden) on the rank's `1/tp` of the
/// heads.
pub fn elementwise_bytes(kind: &BlockKind, local: u64, batch: u64, act: u64, tp: u64) -> u64 {
    let h = kind.hidden;
    let per_token = (HIDDEN_PASSES_PER_SUB_BLOCK * h)
        .saturating_mul(kind.allreduces as u64)
        .saturating_add((6 * h).div_ceil(tp.max(1)));
    mold_models::product(&[batch, local, act, per_token])
}

/// Passes over the hidden state per sub-block: `ln_modulate` (2) and `gate_residual` (3),
/// as [`elementwise_bytes`] says.
pub const HIDDEN_PASSES_PER_SUB_BLOCK: u64 = 5;

/// A time read from a table outside its measured range.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Extrapolated {
    /// `gemm n=9216 k=3072`, `attention heads=24 head_dim=128`, `all_reduce over 2`.
    pub what: String,
    pub size: u64,
    /// The measured range of the size.
    pub measured: (u64, u64),
}

impl std::fmt::Display for Extrapolated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at {} outside the measured {}..{}",
            self.what, self.size, self.measured.0, self.measured.1
        )
    }
}

/// Seconds at `x` from `points` (sizes strictly increasing, times positive): exact at a
/// measured size; between two, linear in log(size)–log(time) (so monotone between
/// them); outside, the nearest point's time scaled by `x / size` (its rate), or below
/// the smallest size with `floor` its time unscaled (a collective is never faster than
/// its smallest message). The flag says it was outside. `None` without points.
pub fn loglog(points: &[(f64, f64)], x: f64, floor: bool) -> Option<(f64, bool)> {
    let (first, last) = (points.first()?, points.last()?);
    if x.is_nan() || x <= 0.0 {
        return Some((0.0, false));
    }
    if x < first.0 {
        let t = if floor {
            first.1
        } else {
            first.1 * x / first.0
        };
        return Some((t, true));
    }
    if x > last.0 {
        return Some((last.1 * x / last.0, true));
    }
    let i = points.partition_point(|p| p.0 < x);
    let hi = points[i];
    if hi.0 == x {
        return Some((hi.1, false));
    }
    let lo = points[i - 1];
    let f = (x.ln() - lo.0.ln()) / (hi.0.ln() - lo.0.ln());
    let t = (lo.1.ln() + f * (hi.1.ln() - lo.1.ln())).exp();
    // Rounding must not step outside the two neighbours.
    Some((t.clamp(lo.1.min(hi.1), lo.1.max(hi.1)), false))
}

/// A block's compute on one device from its tables.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpsTime {
    pub gemm_s: f64,
    pub attention_s: f64,
    /// Which attention `attention_s` prices.
    pub attention: AttentionPrice,
    pub elementwise_s: f64,
    pub extrapolated: Vec<Extrapolated>,
}

impl OpsTime {
    pub fn total_s(&self) -> f64 {
        self.gemm_s + self.attention_s + self.elementwise_s
    }
}

/// The attention a block's price holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum AttentionPrice {
    /// In the activations' dtype.
    Dense,
    /// In FP8, from the table's `fp8_attention`.
    Fp8,
    /// FP8 attention asked for, but the table has no FP8 attention at this shape: priced as
    /// its attention (what the executor runs where cuDNN's FP8 attention does not).
    Fp8Unmeasured,
}

/// Why a block on a device is not priced from tables.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum NotCovered {
    /// The profile has no table for this model, dtype and device.
    NoTable,
    /// The kind's layout is not one mold executes.
    NoLayout,
    /// A product the block runs was never measured at its `(n, k)`.
    Gemm { n: u64, k: u64 },
    /// Attention over this many heads of this size was never measured.
    Attention { heads: u64, head_dim: u64 },
}

impl std::fmt::Display for NotCovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotCovered::NoTable => write!(f, "no operation table for this model, dtype and device"),
            NotCovered::NoLayout => write!(f, "the block's layout has no operation breakdown"),
            NotCovered::Gemm { n, k } => write!(f, "no measured product with n={n} k={k}"),
            NotCovered::Attention { heads, head_dim } => {
                write!(f, "no measured attention over {heads} heads of {head_dim}")
            }
        }
    }
}

/// Prices `ops` from `t`.
pub fn time_from(t: &OpTables, ops: &BlockOps) -> Result<OpsTime, NotCovered> {
    let mut extrapolated = Vec::new();
    let mut gemm_s = 0.0;
    for g in &ops.gemms {
        let curve = t.gemm_curve(g.n, g.k);
        let mut price = |m: u64| -> Result<f64, NotCovered> {
            let (lo, hi) = (curve.first(), curve.last());
            let above = hi.is_some_and(|p| (m as f64) > p.0);
            let below = lo.is_some_and(|p| (m as f64) < p.0);
            let (s, out) = if g.run == Run::PerSample && (above || below) {
                // A per-sample product reads its weights once for all its rows: outside
                // the rows measured it stays bandwidth-bound (up to hundreds of rows on the
                // GPUs mold prices), so the nearest rows measured give its time.
                let p = if above { hi } else { lo };
                (p.map_or(0.0, |p| p.1), true)
            } else {
                loglog(&curve, m as f64, false).ok_or(NotCovered::Gemm { n: g.n, k: g.k })?
            };
            if out {
                extrapolated.push(Extrapolated {
                    what: format!("gemm n={} k={}", g.n, g.k),
                    size: m,
                    measured: range(&curve),
                });
            }
            Ok(s)
        };
        gemm_s += if g.run == Run::PerSample && !ops.ahead.is_empty() {
            let steps: u64 = ops.ahead.iter().sum();
            let mut sum = 0.0;
            for w in &ops.ahead {
                sum += price(g.m.saturating_mul(*w))?;
            }
            sum / steps.max(1) as f64
        } else {
            price(g.m)?
        };
    }
    let a = ops.attention;
    // FP8 attention from its own points; where they were not measured (a GPU without
    // cuDNN's FP8 attention, where the executor runs the table's attention instead) from
    // the table's attention.
    let fp8 = ops
        .fp8_attention
        .then(|| t.fp8_attention_curve(a.heads, a.head_dim));
    let attention = match &fp8 {
        Some(c) if !c.is_empty() => AttentionPrice::Fp8,
        Some(_) => AttentionPrice::Fp8Unmeasured,
        None => AttentionPrice::Dense,
    };
    let (curve, what) = match fp8 {
        Some(c) if !c.is_empty() => (c, "FP8 attention"),
        _ => (t.attention_curve(a.heads, a.head_dim), "attention"),
    };
    let (s, out) = loglog(&curve, a.seq as f64, false).ok_or(NotCovered::Attention {
        heads: a.heads,
        head_dim: a.head_dim,
    })?;
    if out {
        extrapolated.push(Extrapolated {
            what: format!("{what} heads={} head_dim={}", a.heads, a.head_dim),
            size: a.seq,
            measured: range(&curve),
        });
    }
    // FP8 attention hands the projection after it its output already quantized: that
    // product's own quantizing pass, which its table time holds (a row-parallel product
    // timed on an input in the activations' dtype), is not run. Priced as the pass's bytes
    // (the bf16/f16 input read — FP8 attention takes no other —, e4m3 and a scale a row
    // written) at the element-wise rate. Under sequence parallelism the same: q, k and v are
    // quantized before they are sent (the pass the table's time holds, on as many values)
    // and the e4m3 output comes back as it is (mold-exec's `sequence::exchange_e4m3`; the
    // exchanges' bytes and the scales' exchange are the all-to-alls', [`super::Ctx`]).
    // The projection's input: every head of the rank's tensor-parallel shard (under
    // sequence parallelism `sp` times the heads its attention covers).
    let d = a.head_dim.max(1);
    let takes_attention =
        |k: u64| k.is_multiple_of(d) && (k / d).div_ceil(ops.sp.max(1)) == a.heads;
    let attention_s = s * ops.batch as f64;
    if attention == AttentionPrice::Fp8 {
        let saved: f64 = ops
            .gemms
            .iter()
            .filter(|g| g.run == Run::Partial && takes_attention(g.k))
            .map(|g| (g.m as f64 * (g.k as f64 * 3.0 + 4.0)) / (t.elementwise_gbps * 1e9))
            .sum();
        gemm_s = (gemm_s - saved).max(0.0);
    }
    Ok(OpsTime {
        gemm_s,
        attention_s,
        attention,
        elementwise_s: ops.elementwise_bytes as f64 / (t.elementwise_gbps * 1e9),
        extrapolated,
    })
}

fn range(curve: &[(f64, f64)]) -> (u64, u64) {
    (
        curve.first().map_or(0, |p| p.0 as u64),
        curve.last().map_or(0, |p| p.0 as u64),
    )
}

/// Seconds of collective `op` over `devices` ranks for a message of `bytes` (the
/// per-rank size [`mold_machine::CollectiveTables`] describes), and whether it was
/// outside the measured sizes; `None` when `t` has no point for that many devices.
pub fn collective_from(
    t: &OpTables,
    op: CollectiveOp,
    devices: usize,
    bytes: f64,
) -> Option<(f64, Option<Extrapolated>)> {
    let curve = t.collective_curve(op, devices as u32);
    let (s, out) = loglog(&curve, bytes, true)?;
    let note = out.then(|| Extrapolated {
        what: format!("{} over {devices}", op.name()),
        size: bytes as u64,
        measured: range(&curve),
    });
    Some((s, note))
}

impl Ctx<'_> {
    /// The operation tables that price work on `id` in `dtype`, if the profile has them.
    pub fn op_tables(&self, id: &DeviceId, dtype: DType) -> Option<&OpTables> {
        let d = self.machine.device(id)?;
        self.machine.op_tables(&self.model.id, dtype, &d.name)
    }

    /// One block of `kind` on `group`, on device `id`, from the tables.
    pub fn block_from_tables(
        &self,
        kind: &BlockKind,
        group: &Group,
        dtype: DType,
        id: &DeviceId,
    ) -> Result<OpsTime, NotCovered> {
        let t = self.op_tables(id, dtype).ok_or(NotCovered::NoTable)?;
        let ops = block_ops(
            kind,
            self.tokens,
            self.batch,
            group.tp,
            group.sp,
            dtype.activation_bytes(),
        )
        .ok_or(NotCovered::NoLayout)?;
        time_from(
            t,
            &BlockOps {
                ahead: self.modulation_windows(),
                fp8_attention: self.fp8_attention && dtype == DType::Fp8,
                ..ops
            },
        )
    }

    /// Seconds of `op` over the devices `group` for `bytes` per rank from the tables of
    /// its devices (all of one name), if they have a point for that many devices.
    pub(crate) fn collective_from_tables(
        &self,
        group: &[DeviceId],
        op: CollectiveOp,
        bytes: f64,
        dtype: DType,
    ) -> Option<f64> {
        let t = self.op_tables(group.first()?, dtype)?;
        let name = &self.machine.device(&group[0])?.name;
        if group
            .iter()
            .any(|d| self.machine.device(d).is_none_or(|x| &x.name != name))
        {
            return None;
        }
        collective_from(t, op, group.len(), bytes).map(|(s, _)| s)
    }
}

/// The shapes calibration measures for a model: every product, attention and message
/// size its blocks run at the given workloads and `(tp, sp)` layouts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CalibrationShapes {
    pub gemm: Vec<Gemm>,
    pub attention: Vec<AttentionShape>,
    /// Token rows and width of the element-wise kernels' measurement (the largest
    /// workload's full sequence, the widest kind).
    pub elementwise: (u64, u64),
    /// Per-rank message bytes, by collective and group size: `(op, devices, bytes)`.
    pub collectives: Vec<(CollectiveOp, u32, u64)>,
    /// One block of each kind, whole on one device, at the model's default workload:
    /// what the host→device copy of a streamed block is timed beside.
    pub blocks: Vec<BlockOps>,
    /// Every block the tables price, once: each kind at each workload and `(tp, sp)`
    /// layout, whose operations hold every product and attention shape above. A mixed
    /// calibration times each operation inside its block's mix.
    pub mixes: Vec<BlockOps>,
}

/// What [`calibration_shapes`] covers.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeRequest {
    pub workloads: Vec<Workload>,
    /// `(tp, sp)` layouts of one rank.
    pub layouts: Vec<(u32, u32)>,
    /// Group sizes whose collectives are measured (2, 4, …).
    pub group_sizes: Vec<u32>,
}

impl ShapeRequest {
    /// The model's default workload at half, the same and twice its side (those the
    /// model accepts), and the layouts `tp × sp ≤ max(4, devices)`: those of powers of
    /// two whose tensor-parallel degree divides the heads, and any other whose `tp × sp`
    /// divides them (three GPUs of four: the planner may pick them, so they are priced
    /// from measurement too); collectives over `group_sizes`.
    pub fn default_for(model: &ModelSpec, devices: u32, group_sizes: Vec<u32>) -> ShapeRequest {
        let base = &model.default_workload;
        let mut workloads = Vec::new();
        for (num, den) in [(1, 2), (1, 1), (2, 1)] {
            let w = Workload {
                width: base.width * num / den,
                height: base.height * num / den,
                ..base.clone()
            };
            if model.check_workload(&w).is_ok() {
                workloads.push(w);
            }
        }
        let most = devices.max(4);
        let powers: Vec<u32> = std::iter::successors(Some(1u32), |n| n.checked_mul(2))
            .take_while(|&n| n <= most)
            .collect();
        let mut layouts = Vec::new();
        for tp in 1..=most {
            for sp in 1..=most / tp {
                let powers_of_two = powers.contains(&tp) && powers.contains(&sp);
                if (powers_of_two && model.transformer.tp_divides(tp))
                    || model.transformer.tp_divides(tp * sp)
                {
                    layouts.push((tp, sp));
                }
            }
        }
        ShapeRequest {
            workloads,
            layouts,
            group_sizes,
        }
    }
}

/// Every shape [`block_ops`] gives for `model`'s kinds over `req`, each once, sorted;
/// the message sizes of the block collectives and hand-off gathers the cost model prices.
pub fn calibration_shapes(
    model: &ModelSpec,
    dtype: DType,
    req: &ShapeRequest,
) -> CalibrationShapes {
    let act = dtype.activation_bytes();
    let mut out = CalibrationShapes::default();
    for w in &req.workloads {
        let tokens = model.tokens(w);
        // One transformer pass (true CFG runs two of the workload's batch).
        let batch = w.batch as u64;
        let all = tokens.img.saturating_add(tokens.txt);
        for kind in &model.transformer.kinds {
            if out.elementwise.0.saturating_mul(out.elementwise.1) < all.saturating_mul(kind.hidden)
            {
                out.elementwise = (all.saturating_mul(batch), kind.hidden);
            }
            // The per-sample products computed ahead run over a window's rows.
            let windows = model.transformer.modulation_windows(w.steps);
            for &(tp, sp) in &req.layouts {
                if let Some(ops) = block_ops(kind, tokens, batch, tp, sp, act) {
                    let ops = as_run(ops, &windows);
                    out.gemm.extend(ops.gemms.iter().copied());
                    out.attention.push(ops.attention);
                    if !out.mixes.contains(&ops) {
                        out.mixes.push(ops);
                    }
                }
                let local = kind.stream_token_count(tokens).div_ceil(sp as u64);
                let hidden = mold_models::product(&[batch, local, kind.hidden, act]);
                let shard =
                    mold_models::product(&[batch, local, kind.hidden.div_ceil(tp as u64), act]);
                let gathered = mold_models::product(&[batch, all, kind.hidden, act]);
                for &n in &req.group_sizes {
                    if tp == n {
                        out.collectives.push((CollectiveOp::AllReduce, n, hidden));
                        out.collectives.push((
                            CollectiveOp::AllGather,
                            n,
                            kind.per_sample_bytes(batch, act),
                        ));
                        for w in &windows {
                            out.collectives.push((
                                CollectiveOp::AllGather,
                                n,
                                kind.per_sample_bytes(batch.saturating_mul(*w), act),
                            ));
                        }
                    }
                    if sp == n {
                        for k in crate::ALLTOALL_SHARDS {
                            out.collectives
                                .push((CollectiveOp::AllToAll, n, k as u64 * shard));
                        }
                        out.collectives.push((CollectiveOp::AllGather, n, gathered));
                    }
                }
            }
        }
    }
    let base = &model.default_workload;
    let windows = model.transformer.modulation_windows(base.steps);
    out.blocks = model
        .transformer
        .kinds
        .iter()
        .filter_map(|k| block_ops(k, model.tokens(base), base.batch as u64, 1, 1, act))
        .map(|o| as_run(o, &windows))
        .collect();
    out.gemm.sort();
    // One point per (m, n, k): the table's key.
    out.gemm.dedup_by_key(|g| (g.m, g.n, g.k));
    out.attention.sort();
    out.attention.dedup();
    // Between the sizes the model runs and below them, a sweep (4 KiB, ×4 …) so every
    // size in between is interpolated, not extrapolated.
    let mut sweep = Vec::new();
    for &(op, n, bytes) in &out.collectives {
        let mut b = SWEEP_FROM;
        while b < bytes {
            sweep.push((op, n, b));
            b = b.saturating_mul(4);
        }
    }
    out.collectives.extend(sweep);
    out.collectives.retain(|&(_, _, b)| b > 0);
    out.collectives.sort_by_key(|&(op, n, b)| (op.name(), n, b));
    out.collectives.dedup();
    out
}

/// The smallest message of the collective sweep.
pub const SWEEP_FROM: u64 = 4 << 10;

/// How a plan's transformer blocks are priced, in lines for a report: which blocks come
/// from the profile's operation tables ("calibrated by operation"), which do not and
/// why, and every size read outside a table's measured range. Empty when the profile
/// has no operation tables (the peak-rate model, as before).
pub fn describe(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Vec<String> {
    if machine.ops.is_empty() {
        return Vec::new();
    }
    let Some(tc) = plan.transformer() else {
        return Vec::new();
    };
    let ctx = Ctx::for_plan(model, machine, plan);
    let (mut covered, mut total) = (0usize, 0usize);
    let mut tables: Vec<String> = Vec::new();
    let mut gaps: Vec<String> = Vec::new();
    let mut outside: Vec<String> = Vec::new();
    let mut per_block: Vec<String> = Vec::new();
    let mut fp8_unmeasured: Vec<String> = Vec::new();
    let push = |v: &mut Vec<String>, s: String| {
        if !v.contains(&s) {
            v.push(s);
        }
    };
    for p in &tc.parts {
        let group = Group::of(p);
        for r in &p.blocks {
            let Some((_, kind)) = model.transformer.kind(&r.kind) else {
                continue;
            };
            for id in &group.devices {
                total += r.len() as usize;
                match ctx.block_from_tables(kind, &group, tc.dtype, id) {
                    Ok(t) => {
                        covered += r.len() as usize;
                        if let Some(d) = machine.device(id) {
                            let note = machine
                                .op_tables(&model.id, tc.dtype, &d.name)
                                .and_then(|t| t.estimated.as_deref())
                                .map(|e| format!(", {e}"))
                                .unwrap_or_default();
                            push(
                                &mut tables,
                                format!("{} {} on {}{note}", model.id, tc.dtype, d.name),
                            );
                        }
                        push(
                            &mut per_block,
                            format!(
                                "{} block on {id}{}: products {}, attention {}{}, \
                                 element-wise {} = {}",
                                kind.name,
                                if group.devices.len() > 1 {
                                    format!(" of {group}")
                                } else {
                                    String::new()
                                },
                                ms_text(t.gemm_s),
                                ms_text(t.attention_s),
                                if t.attention == AttentionPrice::Fp8 {
                                    " (FP8)"
                                } else {
                                    ""
                                },
                                ms_text(t.elementwise_s),
                                ms_text(t.total_s())
                            ),
                        );
                        for e in t.extrapolated {
                            push(&mut outside, format!("{} {group}: {e}", kind.name));
                        }
                        if t.attention == AttentionPrice::Fp8Unmeasured {
                            if let Some(d) = machine.device(id) {
                                push(&mut fp8_unmeasured, d.name.clone());
                            }
                        }
                    }
                    Err(e) => push(&mut gaps, format!("{} on {id} ({group}): {e}", kind.name)),
                }
            }
        }
    }
    let mut out = Vec::new();
    if covered == total && total > 0 {
        let estimated = tables.iter().any(|t| t.contains("scaled by spec sheet"));
        out.push(if estimated {
            format!(
                "block times: from operation tables (tables {}): another GPU's measured \
                 products, attention and element-wise bandwidth scaled by spec sheet, \
                 collectives from the link model: an estimate",
                tables.join("; ")
            )
        } else {
            format!(
                "block times: calibrated by operation (tables {}): measured products, attention, \
                 element-wise bandwidth and collectives, no whole-step factor",
                tables.join(", ")
            )
        });
    } else if covered > 0 {
        out.push(format!(
            "block times: calibrated by operation for {covered} of {total} block placements \
             (tables {}); the rest at the peak-rate model",
            tables.join(", ")
        ));
    } else {
        out.push(
            "block times: the peak-rate model (the profile's operation tables cover none of \
             this plan's blocks)"
                .into(),
        );
    }
    for b in per_block {
        out.push(format!("per block: {b}"));
    }
    for g in gaps {
        out.push(format!("not in the tables: {g}"));
    }
    for o in outside {
        out.push(format!("extrapolated at the nearest point's rate: {o}"));
    }
    for d in fp8_unmeasured {
        let hopper = machine
            .devices
            .iter()
            .find(|x| x.name == d)
            .is_some_and(mold_machine::shipped::fp8_attention);
        out.push(if hopper {
            format!(
                "FP8 attention: not measured on {d}, priced as the table's attention (what runs where cuDNN's FP8 attention does not); `mold devices --calibrate --model {} --dtype fp8` measures it",
                model.id
            )
        } else {
            format!(
                "FP8 attention: {d} runs attention in bf16 (cuDNN's FP8 attention needs Hopper or later, or its compute capability is not in the profile): priced so"
            )
        });
    }
    // Encoders and the VAE: measured runs where the tables have them.
    let (mut measured, mut modelled, mut beyond) = (Vec::new(), Vec::new(), Vec::new());
    let mut first_use = Vec::new();
    for c in plan.components.iter().filter(|c| c.name != tc.name) {
        let (Some(spec), Some(on)) = (
            model.component(&c.name),
            c.parts.first().and_then(|p| p.devices.first()),
        ) else {
            continue;
        };
        match ctx.component_estimate(spec, on, c.dtype) {
            Some(e) => {
                measured.push(format!("{} on {on}", c.name));
                if let Some(f) = e.first_use_s {
                    first_use.push(format!("{} on {on} +{}", c.name, ms_text(f)));
                }
                if let Some(o) = e.outside {
                    beyond.push(o);
                }
            }
            None => modelled.push(c.name.clone()),
        }
    }
    if !measured.is_empty() {
        out.push(format!(
            "encode and decode: measured runs for {}{}",
            measured.join(", "),
            if modelled.is_empty() {
                String::new()
            } else {
                format!("; FLOPs at the device's rate for {}", modelled.join(", "))
            }
        ));
    }
    for b in beyond {
        out.push(format!("encode and decode, beyond the measured runs: {b}"));
    }
    if !first_use.is_empty() {
        out.push(format!(
            "first use in a fresh process (measured; a one-shot `mold exec` pays it once, \
             its run report adds it to encode and decode; not in the plan's figures nor \
             `mold serve`'s): {}",
            first_use.join(", ")
        ));
    }
    out
}

/// Seconds as milliseconds, three significant figures at most (`98.0 ms`, `0.412 ms`).
fn ms_text(s: f64) -> String {
    let ms = s * 1e3;
    if ms == 0.0 {
        "0 ms".into()
    } else if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else if ms >= 10.0 {
        format!("{ms:.1} ms")
    } else if ms >= 1.0 {
        format!("{ms:.2} ms")
    } else {
        format!("{ms:.3} ms")
    }
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
