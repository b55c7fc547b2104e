//! The cost model shared by the planner and the simulator.
//!
//! Everything a plan costs — seconds per block on a device group, bytes per device —
//! comes from the functions here. The planner's integer program is built from the same
//! per-block figures (`BlockCost`), so the objective it minimises is exactly
//! [`evaluate`]'s request time; the simulator replays the same figures as events on
//! per-device streams and adds what a closed form cannot see (the exact hand-off links,
//! the first copy of a streamed part overlapping earlier compute).
//!
//! The rules, in one place:
//! - a part's layout is `tp × sp` devices ([`Group`]): tensor parallel splits heads and
//!   MLP columns `tp` ways, sequence parallel (Ulysses) splits the tokens `sp` ways;
//! - per rank, a block runs its per-token linears on `⌈tokens/sp⌉` rows and `1/tp` of the
//!   columns, attention over the full sequence for `heads/(tp·sp)` heads, its per-sample
//!   (modulation) linears on `1/tp` of the columns; the slowest device sets the pace;
//!   the matrix work is never faster than reading the weights from device memory;
//! - element-wise passes (norms, modulation, bias, activation, gated residual, q/k/v
//!   preparation) are memory traffic over `⌈tokens/sp⌉` tokens at the device's
//!   element-wise bandwidth ([`Ctx::elementwise_bytes`]), replicated across a
//!   tensor-parallel group;
//! - tensor parallel pays `allreduces` all-reduces of its token shard's hidden state
//!   over each tensor-parallel group's link (peer domain, or staged through the host),
//!   plus `allgathers` (one per block with sharded modulation linears) of the per-sample
//!   modulation outputs, priced as an all-reduce of the gathered bytes (what the
//!   executor's all-gather is: a latency-bound collective of a few hundred KiB at most);
//! - sequence parallel pays two all-to-alls per block (q, k and v in one message of three
//!   head shards, the attention output back in one), a head shard being `⌈tokens/sp⌉ ·
//!   hidden/tp` elements per rank of which `(sp−1)/sp` is sent (in e4m3, after an
//!   all-gather of the ranks' maxima, where FP8 attention takes them so:
//!   `Ctx::exchanges_e4m3`), priced latency + bytes /
//!   bandwidth over the sequence-parallel group's link (or the measured tables), less
//!   what runs beside them where the group is two GPUs of one peer domain on one node (the
//!   executor's copy-engine all-to-alls, [`copies_beside`]): FLUX's single block hides each
//!   behind its MLP product ([`ops::beside_all_to_alls`]), `max(0, all-to-all − product)`; plus the
//!   output join's copy ([`alltoall_copy_shards`]); and one
//!   all-gather of the hidden state where a run of parts on one sequence-parallel group
//!   ends ([`Ctx::gather_s`]);
//! - the blocks of one kind on one device group cost max(their compute, the copies of
//!   the streamed ones) ([`BlockCost::group_kind_s`]: the copy stream runs beside the
//!   compute stream, and the planner spreads streamed blocks among resident ones), plus,
//!   once per device group that streams, the largest min(copy, compute) of its streamed
//!   blocks (the pipeline fill: the group's copy stream runs ahead across its parts);
//! - a collective whose group spans nodes runs over the group's slowest link: the
//!   network between nodes (`links.inter_node`) or a node's own share of the group
//!   (`Machine::group_link`);
//! - each change of device group or layout between consecutive parts hands the hidden
//!   state over the machine's slowest device-to-device path (on several nodes, the
//!   network: latency + bytes / bandwidth);
//! - a device holds the weights of its components and resident blocks (`1/tp` of each
//!   block's sharded weights), its stream buffers (one set per device group, shared by
//!   the group's streamed parts), the transformer stem if it runs any transformer part,
//!   and the largest activation of anything it runs (a block's over `⌈tokens/sp⌉`
//!   tokens); that plus its headroom must fit its budget;
//! - memory phases (the plan's `memory_phases`): `resident`, every component stays
//!   loaded for the whole request and a device's peak counts them all at once;
//!   `one-shot`, the text encoders are freed before the transformer loads and the
//!   transformer before the VAE loads, so the transformer holds no device memory while
//!   the encoders run: a device's peak is the largest of its encode phase (its encoders'
//!   weights and the largest of their activations), its denoise phase (the transformer's
//!   resident blocks, stream buffers, stem and largest activation) and its decode phase
//!   (the VAE's weights and activation) ([`PhasePeaks`]);
//! - true CFG (a `cfg_scale`) runs two transformer passes a step, each at the
//!   workload's batch ([`Ctx::batch`]): `serial`, 2 × the pass; `parallel`, the
//!   slower of the two replicas' passes plus the combine (the unconditional output,
//!   latent-sized, sent to replica 0's output device over that pair's link); `pipelined`,
//!   the two passes as micro-batches through the stages of a block split (a flow shop of
//!   the stages, each stage making its own hand-off before it takes the next
//!   micro-batch, as the executor's stage threads do): the pass plus the bottleneck
//!   `max(t_1 + h, …, t_{S−1} + h, t_S)` ([`pipelined_bottleneck`]), (S + 1) stage
//!   times and S hand-offs for S equal stages ([`evaluate`]);
//! - where the profile has operation tables for the model, dtype and device (`ops:`,
//!   measured by `mold devices --calibrate --model M`), a block's compute on that device
//!   is the sum of its measured operations ([`ops`]: its matrix products, attention and
//!   element-wise bytes at the tables' bandwidth, interpolated log-log between measured
//!   sizes) in place of the peak rate and efficiencies above, and a collective with a
//!   table for its group size comes from the table; the rest of this list is unchanged;
//! - where that table also holds `library_bytes` (the CUDA libraries' device memory
//!   beyond the tensors: kernel code, cuBLAS/cuDNN handles and workspaces,
//!   measured in a fresh process), every device the plan puts anything on holds it for
//!   the whole request, in every phase ([`Ctx::library_bytes`], [`plan_libraries`]); the
//!   planner leaves it out of the device's capacity and the simulator allocates it at load.
//!
//! Byte counts saturate at `u64::MAX` rather than wrap: a workload the model does not
//! support (which [`validate`] refuses first) can never come out as fitting.

mod evaluate;
mod group;
pub mod load;
pub mod ops;
mod validate;

pub use evaluate::{
    evaluate, pipelined_bottleneck, plan_libraries, round6, DeviceUse, Evaluation, PartTime,
    PhasePeaks,
};
pub use group::Group;
pub use load::{load_time, LoadTime, DEFAULT_HOST_READ_GBPS};
pub use validate::{check_machine, validate, MachineCheck};

use mold_machine::{Collective, CollectiveOp, Machine};
use mold_models::{Attention, BlockKind, ComponentSpec, ModelSpec, Tokens, Workkind};
use mold_plan::{DType, DeviceId, Plan, Workload};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> CostError {
    CostError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// What one transformer block costs on one device group.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BlockCost {
    /// Compute on the slowest device of the group, collectives excluded.
    pub compute_s: f64,
    /// Tensor-parallel collectives of the block over the group's link: its all-reduces
    /// and its modulation all-gather.
    pub allreduce_s: f64,
    /// Sequence-parallel all-to-alls of the block (two: q, k and v in, the output back),
    /// with the output join's copy.
    pub alltoall_s: f64,
    /// Host→device copy of one device's share of the block's weights (pinned), the
    /// device otherwise idle.
    pub copy_s: f64,
    /// The share of the copy rate lost while the device computes beside it, `1 − ρ`
    /// for the measured busy/idle ratio ρ ([`Ctx::copy_busy_ratio`]; 0
    /// without a busy rate). Over a stretch where copies never stop and compute `C`
    /// runs beside them, the copies of `B` bytes end after `B/r + (1 − ρ)·C`: each
    /// second of compute moves only `ρ` seconds' worth of idle-rate copying.
    pub copy_contention: f64,
    /// Weight bytes on each device of the group.
    pub weight_bytes: u64,
    /// Peak activation bytes on each device while the block runs.
    pub activation_bytes: u64,
}

impl BlockCost {
    /// Compute plus collectives: the block's time when resident.
    pub fn resident_s(&self) -> f64 {
        self.compute_s + self.allreduce_s + self.alltoall_s
    }
    /// Steady-state time per block when streamed with double buffering: the next
    /// block's copy runs beside this block's compute.
    pub fn streamed_s(&self) -> f64 {
        let compute = self.resident_s();
        (self.copy_s + self.copy_contention * compute).max(compute)
    }
    /// The part of the first streamed block that no earlier copy hides.
    pub fn fill_s(&self) -> f64 {
        self.copy_s.min(self.resident_s())
    }
    /// Time of `resident` + `streamed` blocks of this kind on one group, in a step:
    /// the copy stream works while the compute stream runs every block of the kind, so
    /// the slower of the two sets the pace — max(all blocks' compute, streamed blocks'
    /// copies). With the streamed blocks spread among the resident ones (as the planner
    /// lays them out) the executor gets there; bunched together they cost more, which the
    /// simulator, replaying the actual order, shows. (Every streamed: n · max(copy,
    /// compute), the double-buffering figure.) Copy-bound, every block's compute but
    /// the last streamed one's runs beside a copy and slows it by
    /// [`BlockCost::copy_contention`]: max(compute, copies + contention · (compute −
    /// one block)).
    pub fn group_kind_s(&self, resident: u64, streamed: u64) -> f64 {
        let compute = (resident + streamed) as f64 * self.resident_s();
        if streamed == 0 {
            return compute;
        }
        let copies = streamed as f64 * self.copy_s;
        compute.max(copies + self.copy_contention * (compute - self.resident_s()))
    }
}

/// A model, workload and machine, with the figures every cost needs.
pub struct Ctx<'a> {
    pub model: &'a ModelSpec,
    pub machine: &'a Machine,
    pub workload: &'a Workload,
    pub tokens: Tokens,
    /// Samples in one transformer pass: the workload's batch (true CFG runs two passes
    /// of it a step; [`evaluate`] composes them).
    pub batch: u64,
    /// The transformer's attention in FP8 in its FP8 blocks (a plan's `attention: fp8`,
    /// [`Ctx::for_plan`]): priced from the tables' `fp8_attention`.
    pub fp8_attention: bool,
}

impl<'a> Ctx<'a> {
    pub fn new(model: &'a ModelSpec, machine: &'a Machine, workload: &'a Workload) -> Self {
        Ctx {
            model,
            machine,
            workload,
            tokens: model.tokens(workload),
            batch: workload.batch as u64,
            fp8_attention: false,
        }
    }

    /// The context that prices `plan`: its workload, and its transformer's attention
    /// precision.
    pub fn for_plan(model: &'a ModelSpec, machine: &'a Machine, plan: &'a Plan) -> Self {
        Ctx {
            fp8_attention: plan.transformer().is_some_and(|t| t.fp8_attention()),
            ..Ctx::new(model, machine, &plan.workload)
        }
    }

    /// Bytes of the latents (f32): what a step hands on, what the VAE decodes, and
    /// what CFG-parallel's unconditional pass sends to be combined.
    pub fn latent_bytes(&self) -> u64 {
        let l = &self.model.latent;
        mold_models::product(&[
            self.batch,
            self.tokens.img,
            (l.channels * l.patch * l.patch) as u64,
            4,
        ])
    }

    /// Conditioning bytes a text encoder of `hidden` width hands the transformer: the
    /// prompt's, and the negative prompt's under true CFG.
    pub fn conditioning_bytes(&self, hidden: u64, dtype: DType) -> u64 {
        mold_models::product(&[
            self.workload.effective_batch(),
            self.model.text_tokens as u64,
            hidden,
            dtype.activation_bytes(),
        ])
    }

    fn device(&self, id: &DeviceId) -> &mold_machine::Device {
        self.machine
            .device(id)
            .unwrap_or_else(|| panic!("device {id} not in machine (validate the plan first)"))
    }

    /// The windows (steps each) the executor computes the blocks' per-sample products in
    /// ([`mold_models::modulation_windows`]), where the model's executor computes them
    /// ahead; empty where every step computes its own.
    pub fn modulation_windows(&self) -> Vec<u64> {
        self.model
            .transformer
            .modulation_windows(self.workload.steps)
    }

    /// Bytes a rank keeps between steps for the per-sample outputs computed ahead: every
    /// block's full outputs (each rank of a tensor-parallel group gathers them) for the
    /// largest window — counted for the whole model on every device, an upper bound
    /// for a device holding some of the blocks.
    pub fn modulation_ahead_bytes(&self, act: u64) -> u64 {
        let rows = self.modulation_windows().into_iter().max().unwrap_or(0);
        self.model
            .transformer
            .kinds
            .iter()
            .map(|k| {
                (k.count as u64)
                    .saturating_mul(k.per_sample_bytes(self.batch.saturating_mul(rows), act))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Seconds for `flops` and `bytes` read on one device: the slower of compute and
    /// memory traffic.
    pub(crate) fn device_time(&self, id: &DeviceId, flops: f64, bytes: u64, dtype: DType) -> f64 {
        if id.is_host() {
            let h = &self.machine.host;
            return (flops / (h.tflops * 1e12)).max(bytes as f64 / (h.mem_bandwidth_gbps * 1e9));
        }
        let d = self.device(id);
        (flops / (d.tflops(dtype) * 1e12)).max(bytes as f64 / (d.mem_bandwidth_gbps * 1e9))
    }

    /// One block of `kind` on `group`, per rank (the slowest rank's compute).
    pub fn block(&self, kind: &BlockKind, group: &Group, dtype: DType) -> BlockCost {
        let (tp, sp) = (group.tp.max(1), group.sp.max(1));
        let act = dtype.activation_bytes();
        let weight_bytes = kind.weight_bytes(dtype, tp);
        let stream = kind.stream_token_count(self.tokens);
        // The busiest rank's tokens: the executor splits unevenly, exactly.
        let local = stream.div_ceil(sp as u64);
        let share = if stream == 0 {
            1.0
        } else {
            local as f64 / stream as f64
        };
        let f = kind.flop_parts(self.tokens);
        let flops = self.batch as f64
            * (f.token_linear * share / tp as f64
                + f.attention / (tp as f64 * sp as f64)
                + f.per_sample / tp as f64
                + f.replicated);
        let elementwise = Self::elementwise_bytes(kind, local, self.batch, act);
        // Per-sample weights computed ahead are read once a window, not once a step.
        let windows = self.modulation_windows();
        let weight_reads = if windows.is_empty() {
            weight_bytes
        } else {
            let per_sample = dtype
                .weight_bytes(kind.per_sample_params)
                .div_ceil(tp as u64);
            let saved = per_sample as f64
                * (1.0 - windows.len() as f64 / windows.iter().sum::<u64>() as f64);
            weight_bytes.saturating_sub(saved as u64)
        };
        let heads = (kind.heads as u64).div_ceil(tp as u64 * sp as u64);
        let mut compute_s: f64 = 0.0;
        let mut unfused = false;
        for id in &group.devices {
            // Measured operations where the profile has them for this block.
            if let Ok(t) = self.block_from_tables(kind, group, dtype, id) {
                compute_s = compute_s.max(t.total_s());
                continue;
            }
            let mut t = self.device_time(id, flops, weight_reads, dtype)
                + self.elementwise_time(id, elementwise);
            if let Some(d) = self.machine.device(id).filter(|d| !d.fused_attention) {
                unfused = true;
                // Scores written, read by softmax, written, read again: 4 passes in f32.
                let (q, k) = kind.attention_shape(self.tokens);
                let bytes = 4.0 * self.batch as f64 * heads as f64 * q as f64 * k as f64 * 4.0;
                t += bytes / (d.mem_bandwidth_gbps * 1e9);
            }
            compute_s = compute_s.max(t);
        }
        let hidden_local = mold_models::product(&[self.batch, local, kind.hidden, act]);
        // The modulation's all-gather: once a step, or once a window over its steps' rows.
        let gathers: Vec<(u64, f64)> = if windows.is_empty() {
            vec![(kind.per_sample_bytes(self.batch, act), 1.0)]
        } else {
            let steps = windows.iter().sum::<u64>() as f64;
            windows
                .iter()
                .map(|w| {
                    let rows = self.batch.saturating_mul(*w);
                    (kind.per_sample_bytes(rows, act), 1.0 / steps)
                })
                .collect()
        };
        let allreduce_s = self.slowest_op(&group.tp_groups(), dtype, |c, n, op| {
            kind.allreduces as f64
                * op(CollectiveOp::AllReduce, hidden_local as f64)
                    .unwrap_or_else(|| c.allreduce_s(hidden_local, n))
                + kind.allgathers() as f64
                    * gathers
                        .iter()
                        .map(|&(bytes, share)| {
                            share
                                * op(CollectiveOp::AllGather, bytes as f64)
                                    .unwrap_or_else(|| c.allreduce_s(bytes, n))
                        })
                        .sum::<f64>()
        });
        // Each all-to-all: this rank's token shard of its head columns, all but the
        // 1/sp it keeps sent to the others; in e4m3 where FP8 attention takes them so
        // (mold-exec's `sequence::exchange_e4m3`), after the group's maxima are exchanged.
        let e4m3 = sp > 1 && self.exchanges_e4m3(kind, group, dtype);

        let sent_bytes = if e4m3 { 1 } else { act };
        let shard = mold_models::product(&[
            self.batch,
            local,
            kind.hidden.div_ceil(tp as u64),
            sent_bytes,
        ]);
        // As the executor runs them: q, k and v in one all-to-all, the output in another,
        // and the output's join copied on the rank's memory.
        let alltoall_s = if sp > 1 {
            // What runs beside each all-to-all where the group's GPUs copy to each other
            // directly (the copy engines: no SM taken from the products): the fastest
            // rank's products, which it finishes first and then waits.
            let beside = ops::beside_all_to_alls(kind, self.tokens, self.batch, tp, sp).map(|g| {
                g.map(|g| {
                    group
                        .devices
                        .iter()
                        .map(|id| self.gemm_s(id, &g, dtype))
                        .fold(f64::INFINITY, f64::min)
                })
            });
            let transfers = group
                .sp_groups()
                .iter()
                .filter(|g| g.len() > 1)
                .map(|g| {
                    let n = g.len();
                    let c = self.machine.group_link(g).collective;
                    let direct = copies_beside(self.machine, g);
                    ALLTOALL_SHARDS
                        .iter()
                        .enumerate()
                        .map(|(i, &k)| {
                            let bytes = k as f64 * shard as f64;
                            let sent = bytes * (sp - 1) as f64 / sp as f64;
                            let t = self
                                .collective_from_tables(g, CollectiveOp::AllToAll, bytes, dtype)
                                .unwrap_or_else(|| alltoall_s(&c, sent, n));
                            match beside {
                                Some(b) if direct => (t - b[i]).max(0.0),
                                _ => t,
                            }
                        })
                        .sum::<f64>()
                        // The maxima's all-gather before the q/k/v all-to-all (each rank's
                        // partial maxima, [`FP8_MAXIMA_BYTES`]), as measured where the tables
                        // have it.
                        + if e4m3 {
                            let bytes = (FP8_MAXIMA_BYTES * n as u64) as f64;
                            self.collective_from_tables(g, CollectiveOp::AllGather, bytes, dtype)
                                .unwrap_or_else(|| {
                                    allgather_s(&c, bytes * (n - 1) as f64 / n as f64, n)
                                })
                        } else {
                            0.0
                        }
                })
                .fold(0.0, f64::max);
            let copy_bytes = (alltoall_copy_shards(self.batch) * shard as f64) as u64;
            let copies = group
                .devices
                .iter()
                .map(|id| match self.op_tables(id, dtype) {
                    // The measured layout-copy rate where the profile has one, else
                    // its element-wise rate.
                    Some(t) if t.elementwise_gbps > 0.0 => {
                        let gbps = t
                            .layout_copy_gbps
                            .filter(|g| *g > 0.0)
                            .unwrap_or(t.elementwise_gbps);
                        copy_bytes as f64 / (gbps * 1e9)
                    }
                    _ => self.elementwise_time(id, copy_bytes),
                })
                .fold(0.0, f64::max);
            transfers + copies
        } else {
            0.0
        };
        let mut activation_bytes = kind.activation_bytes(
            Self::shard_tokens(kind, self.tokens, local),
            self.batch,
            act,
            tp,
            true,
        );
        if unfused {
            let (q, k) = kind.attention_shape(self.tokens);
            activation_bytes = activation_bytes
                .saturating_add(mold_models::product(&[2, self.batch, heads, q, k, 4]));
        }
        // Held between steps beside the block's own activations.
        activation_bytes = activation_bytes.saturating_add(self.modulation_ahead_bytes(act));
        // FP8 weights quantized on a GPU at load hold up to a window of bf16 rows there
        // beside the weights loaded so far: no less than that at the block's worst.
        if dtype == DType::Fp8 && group.devices.iter().any(|d| matches!(d, DeviceId::Cuda(_))) {
            activation_bytes = activation_bytes.max(load::FP8_STAGING_WINDOW_BYTES);
        }
        BlockCost {
            compute_s,
            allreduce_s,
            alltoall_s,
            copy_s: weight_bytes as f64 / (self.machine.links.host_pinned_gbps * 1e9),
            copy_contention: 1.0 - self.copy_busy_ratio(group, dtype),
            weight_bytes,
            activation_bytes,
        }
    }

    /// Whether a block of `kind` on `group` sends FP8 attention's q, k, v and output in
    /// e4m3 under sequence parallelism (mold-exec's `sequence::exchange_e4m3`): an FP8
    /// block of a plan with `attention: fp8` on devices whose tables measured FP8
    /// attention (where they did not, the executor runs attention in the activations'
    /// dtype, and sends that).
    fn exchanges_e4m3(&self, kind: &BlockKind, group: &Group, dtype: DType) -> bool {
        let (tp, sp) = (group.tp.max(1) as u64, group.sp.max(1) as u64);
        let heads = (kind.heads as u64).div_ceil(tp * sp);
        self.fp8_attention
            && dtype == DType::Fp8
            && group.devices.iter().all(|id| {
                self.op_tables(id, dtype).is_some_and(|t| {
                    !t.fp8_attention_curve(heads, kind.head_dim as u64)
                        .is_empty()
                })
            })
    }

    /// The slowest of `groups`' collectives, `price(link, ranks, measured)` each (0 for
    /// groups of one device), where `measured(op, bytes)` is the group's time for `op`
    /// from the profile's operation tables, if they have it ([`ops`]).
    fn slowest_op(
        &self,
        groups: &[Vec<DeviceId>],
        dtype: DType,
        price: impl Fn(&Collective, usize, &dyn Fn(CollectiveOp, f64) -> Option<f64>) -> f64,
    ) -> f64 {
        groups
            .iter()
            .filter(|g| g.len() > 1)
            .map(|g| {
                let measured = |op, bytes| self.collective_from_tables(g, op, bytes, dtype);
                price(&self.machine.group_link(g).collective, g.len(), &measured)
            })
            .fold(0.0, f64::max)
    }

    /// Seconds of one product on device `id`: from its operation table where measured,
    /// else at the device's rate (the slower of its FLOPs and reading its weights).
    fn gemm_s(&self, id: &DeviceId, g: &ops::Gemm, dtype: DType) -> f64 {
        if let Some(s) = self.op_tables(id, dtype).and_then(|t| ops::gemm_from(t, g)) {
            return s;
        }
        let flops = 2.0 * g.m as f64 * g.n as f64 * g.k as f64;
        self.device_time(
            id,
            flops,
            g.n.saturating_mul(g.k)
                .saturating_mul(dtype.activation_bytes()),
            dtype,
        )
    }

    /// Bytes the element-wise passes of one block move on one rank holding `local`
    /// tokens of the block's stream. Per token, at the FLUX kernels' widths: each of the
    /// block's `allreduces` sub-blocks (attention, MLP; one for FLUX's parallel single
    /// block) reads and writes its norm and modulation (4·hidden) and its bias + gate +
    /// residual (3·hidden); q/k/v bias and preparation (norm, RoPE, layout: 12·hidden)
    /// and the MLP activation (2·mlp). Other families are priced by the same rule.
    ///
    /// Tensor parallelism does not divide it: every rank of a tensor-parallel group pays
    /// it in full. The passes over the hidden state are replicated under TP; those over
    /// q/k/v and the MLP shard are not, but the measured TP steps do not shrink them
    /// either (with them divided, no efficiency ≤ 1 fits the measured 1-GPU and TP2
    /// steps: narrower GEMMs and per-kernel costs that TP leaves whole stand in the same
    /// term; BENCHMARKS.md). Sequence parallelism divides it: `local` is the rank's
    /// share of the tokens.
    pub fn elementwise_bytes(kind: &BlockKind, local: u64, batch: u64, act: u64) -> u64 {
        let h = kind.hidden;
        let per_token = (7 * h)
            .saturating_mul(kind.allreduces as u64)
            .saturating_add(12 * h + 2 * kind.mlp_hidden);
        mold_models::product(&[batch, local, act, per_token])
    }

    /// The pinned host→device rate beside compute, as a share of the idle rate, on the
    /// slowest device of `group`: the ratio measured beside this model's own blocks
    /// where the device's operation tables have it
    /// ([`mold_machine::OpTables::htod_busy_ratio`],
    /// at most 1), else the profile's GEMM-only [`Machine::copy_busy_ratio`].
    pub fn copy_busy_ratio(&self, group: &Group, dtype: DType) -> f64 {
        let general = self.machine.copy_busy_ratio();
        group
            .devices
            .iter()
            .map(|id| {
                self.op_tables(id, dtype)
                    .and_then(|t| t.htod_busy_ratio)
                    .filter(|r| r.is_finite() && *r > 0.0)
                    .map_or(general, |r| r.min(1.0))
            })
            .fold(1.0, f64::min)
    }

    /// Seconds for `bytes` of element-wise traffic on one device, at the profile's
    /// element-wise efficiency of its memory bandwidth.
    fn elementwise_time(&self, id: &DeviceId, bytes: u64) -> f64 {
        if id.is_host() {
            return bytes as f64 / (self.machine.host.mem_bandwidth_gbps * 1e9);
        }
        let d = self.device(id);
        bytes as f64 / (d.mem_bandwidth_gbps * d.elementwise_efficiency.unwrap_or(1.0) * 1e9)
    }

    /// Token counts whose stream (for `kind`) is `local` tokens: one rank's shard.
    fn shard_tokens(kind: &BlockKind, t: Tokens, local: u64) -> Tokens {
        match kind.attention {
            Attention::Joint => Tokens { img: local, txt: 0 },
            Attention::Image | Attention::ImageCrossText => Tokens {
                img: local,
                txt: t.txt,
            },
            Attention::Text => Tokens {
                img: t.img,
                txt: local,
            },
        }
    }

    /// The all-gather that ends a run of parts on a sequence-parallel group: every rank
    /// receives the other ranks' token shards of the hidden state; 0 without sequence
    /// parallel.
    pub fn gather_s(&self, group: &Group, dtype: DType) -> f64 {
        if group.sp <= 1 {
            return 0.0;
        }
        let bytes = self.handoff_bytes(dtype) as f64;
        self.slowest_op(&group.sp_groups(), dtype, |c, n, op| {
            op(CollectiveOp::AllGather, bytes)
                .unwrap_or_else(|| allgather_s(c, bytes * (n - 1) as f64 / n as f64, n))
        })
    }

    /// Bytes of the hidden state handed from one part to the next.
    pub fn handoff_bytes(&self, dtype: DType) -> u64 {
        let act = dtype.activation_bytes();
        self.model
            .transformer
            .kinds
            .iter()
            .map(|k| {
                mold_models::product(&[
                    self.batch,
                    self.tokens.img.saturating_add(self.tokens.txt),
                    k.hidden,
                    act,
                ])
            })
            .max()
            .unwrap_or(0)
    }

    /// Seconds for one hand-off between device groups, priced over the machine's slowest
    /// device-to-device path (the simulator uses the actual pair): on a machine of
    /// several nodes, the network between them, its latency included.
    pub fn handoff_s(&self, dtype: DType) -> f64 {
        let ds = &self.machine.devices;
        let bytes = self.handoff_bytes(dtype);
        let mut slowest: f64 = 0.0;
        for a in ds {
            for b in ds {
                if a.id != b.id {
                    slowest = slowest.max(self.machine.transfer_s(&a.id, &b.id, bytes));
                }
            }
        }
        slowest
    }

    /// The CUDA libraries' device memory on `id` (kernel code, cuBLAS/cuDNN handles and
    /// workspaces) with the model's transformer in `dtype`: the `library_bytes` of the
    /// profile's operation tables for this model, dtype and `id`'s kind of device; 0
    /// without them (older profiles, emulated devices, the host): priced as before.
    pub fn library_bytes(&self, id: &DeviceId, dtype: DType) -> u64 {
        self.op_tables(id, dtype)
            .and_then(|t| t.library_bytes)
            .map_or(0, |b| b.0)
    }

    /// Seconds for a whole component (encoder or VAE) on one device or the host.
    /// A text encoder's or the VAE's time for one request on `on`: from the profile's
    /// measured runs of it where there are any ([`Ctx::component_from_tables`]), else
    /// from its FLOPs at the device's rate.
    pub fn component_s(&self, c: &ComponentSpec, on: &DeviceId, dtype: DType) -> f64 {
        if let Some(s) = self.component_from_tables(c, on, dtype) {
            return s;
        }
        let flops = c.flops(self.model, self.workload);
        self.device_time(on, flops, c.weight_bytes(dtype), dtype)
    }

    /// `c` in `dtype` on `on` from the measured runs in the profile's operation tables
    /// of this model on `on`'s kind of device (`mold devices --calibrate --model`): a
    /// decoder's time at this image's pixels (interpolated in log–log between the
    /// measured sizes, scaled by pixels beyond them) for every frame and sample; a text
    /// encoder's measured run for every prompt (two under true CFG). `None` without a
    /// point for it.
    pub fn component_from_tables(
        &self,
        c: &ComponentSpec,
        on: &DeviceId,
        dtype: DType,
    ) -> Option<f64> {
        self.component_estimate(c, on, dtype).map(|e| e.seconds)
    }

    /// [`Ctx::component_from_tables`] with what it had to assume: where the run asked
    /// for lies outside the measured points, `outside` says so in words; and what the
    /// component's first run in a fresh process adds, where the profile measured it
    /// ([`ComponentEstimate::first_use_s`]).
    pub fn component_estimate(
        &self,
        c: &ComponentSpec,
        on: &DeviceId,
        dtype: DType,
    ) -> Option<ComponentEstimate> {
        self.component_estimate_scaled(c, on, dtype, 1.0)
    }

    /// [`Ctx::component_estimate`] of a decoder for `share` of the image's pixels (a row
    /// band's, [`Ctx::decode_bands_s`]); a text encoder ignores `share`.
    fn component_estimate_scaled(
        &self,
        c: &ComponentSpec,
        on: &DeviceId,
        dtype: DType,
        share: f64,
    ) -> Option<ComponentEstimate> {
        let name = &self.machine.device(on)?.name;
        // (size, warm seconds, first use): one point per size.
        let mut points: Vec<(f64, f64, Option<f64>)> = Vec::new();
        // The newest table first (a calibration appends, or replaces its own dtype's).
        for t in self
            .machine
            .ops
            .iter()
            .rev()
            .filter(|t| t.model == self.model.id && &t.device == name)
        {
            for p in t.component_points(&c.name, dtype) {
                let size = p.size as f64;
                if !points.iter().any(|q| q.0 == size) {
                    points.push((size, p.seconds, p.first_use_seconds));
                }
            }
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let curve: Vec<(f64, f64)> = points.iter().map(|p| (p.0, p.1)).collect();
        // The point nearest to `size` (by ratio: sizes are compared as scales).
        let nearest = |size: f64| {
            points.iter().min_by(|a, b| {
                (a.0.ln() - size.ln())
                    .abs()
                    .total_cmp(&(b.0.ln() - size.ln()).abs())
            })
        };
        let w = self.workload;
        match c.work {
            Workkind::TextEncoder { .. } => {
                // Run at the model's prompt length (CLIP at its fixed 77, where the
                // calibration timed it); the point nearest to it, taken as is.
                let tokens = self.model.text_tokens as f64;
                let (_, s, first) = points
                    .iter()
                    .min_by(|a, b| (a.0 - tokens).abs().total_cmp(&(b.0 - tokens).abs()))?;
                Some(ComponentEstimate {
                    seconds: s * w.effective_batch() as f64,
                    first_use_s: *first,
                    outside: None,
                })
            }
            Workkind::VaeDecoder { .. } => {
                let pixels = w.width as f64 * w.height as f64 * share;
                let (s, outside) = ops::loglog(&curve, pixels, false)?;
                let (lo, hi) = (curve.first()?.0, curve.last()?.0);
                Some(ComponentEstimate {
                    seconds: s * w.frames as f64 * w.batch as f64,
                    first_use_s: nearest(pixels).and_then(|p| p.2),
                    outside: outside.then(|| {
                        format!(
                            "{} at {}x{} ({:.2} MP), outside the measured {:.2}–{:.2} MP (scaled by pixels)",
                            c.name,
                            w.width,
                            w.height,
                            pixels / 1e6,
                            lo / 1e6,
                            hi / 1e6
                        )
                    }),
                })
            }
        }
    }

    /// Seconds for the VAE's decode in row bands, one on each of `on` (in row order; one
    /// device is [`Ctx::component_s`]):
    ///
    /// - each band decodes `1/k` of the image: the one-device decode of an image of that
    ///   many pixels on its device (the measured curve, so a small band's lower efficiency
    ///   is priced), the slowest band setting the pace;
    /// - each of the decoder's `band_exchanges` (its group norms) gathers every band's
    ///   statistics on every band's device and copies two edge rows: `k + 1` small copies
    ///   on the slowest link between the bands, and [`BAND_EXCHANGE_HOST_S`] per band;
    /// - the mid attention gathers the whole latent's normalised input on every device.
    ///
    /// A decoder without `band_exchanges` decodes on one device: the first of `on`.
    pub fn decode_bands_s(&self, c: &ComponentSpec, on: &[DeviceId], dtype: DType) -> f64 {
        let Some(first) = on.first() else {
            return 0.0;
        };
        let exchanges = match c.work {
            Workkind::VaeDecoder {
                band_exchanges: Some(x),
                ..
            } if on.len() > 1 => x as f64,
            _ => return self.component_s(c, first, dtype),
        };
        let k = on.len() as f64;
        let band = on
            .iter()
            .map(
                |d| match self.component_estimate_scaled(c, d, dtype, 1.0 / k) {
                    Some(e) => e.seconds,
                    None => {
                        let flops = c.flops(self.model, self.workload) / k;
                        self.device_time(d, flops, c.weight_bytes(dtype), dtype)
                    }
                },
            )
            .fold(0.0, f64::max);
        let w = self.workload;
        let latent_pixels = (w.width as u64 / 8) * (w.height as u64 / 8);
        // The attention's input, 512 channels at the latent's pixels (FLUX's AE).
        let gathered = latent_pixels * 512 * dtype.activation_bytes();
        let mut slowest_row: f64 = 0.0;
        let mut slowest_gather: f64 = 0.0;
        let row = (w.width as u64) * 128 * dtype.activation_bytes();
        for a in on {
            for b in on {
                if a != b {
                    slowest_row = slowest_row.max(self.machine.transfer_s(a, b, row));
                    slowest_gather = slowest_gather.max(self.machine.transfer_s(
                        a,
                        b,
                        gathered / on.len() as u64,
                    ));
                }
            }
        }
        let exchange = (k + 1.0) * slowest_row + k * BAND_EXCHANGE_HOST_S;
        band + exchanges * exchange + (k - 1.0) * slowest_gather
    }

    pub fn component_activation(&self, c: &ComponentSpec, dtype: DType) -> u64 {
        c.activation_bytes(self.model, self.workload, dtype.activation_bytes())
    }
}

/// What one band adds to each exchange of a decode in row bands ([`Ctx::decode_bands_s`]):
/// queueing its statistics' copies, merge and norm, and waiting for the other bands there.
/// Fitted on 4 × H100 (NVLink) to the 2-band decode of a 1024² image (25.32 ms against
/// 11.69 ms for the one-GPU decode of half the image, 30 exchanges) when one host thread
/// queued every band's work; it predicts the 4-band 1024² decode within 1 % (32.9 against
/// 33.15 ms) and prices 2048² 25 % (2 bands) and 46 % (4 bands) short: BENCHMARKS.md, "FLUX
/// VAE decode in row bands". Each band has had a thread of its own since commit 634dd9d,
/// not yet measured across GPUs: the price stands until it is.
pub const BAND_EXCHANGE_HOST_S: f64 = 0.224e-3;

/// A pipeline component's time from measured runs ([`Ctx::component_estimate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ComponentEstimate {
    /// Warm: what every request pays with the component loaded (the planner's objective,
    /// the simulator's encode and decode, `mold serve`).
    pub seconds: f64,
    /// What its first run in a fresh process adds, once per process (not per prompt,
    /// frame or sample): the measured point's `first_use_seconds` — the text encoder's
    /// point at the prompt length, the decoder's nearest measured size. Only a one-shot
    /// `mold exec` pays it (its run report adds it to encode and decode); `None` where
    /// the profile did not measure it.
    pub first_use_s: Option<f64>,
    /// Set when a decoder's image lies outside the measured sizes: what was measured.
    pub outside: Option<String>,
}

/// The all-to-alls a block runs under sequence parallelism, as the executor runs them
/// (`mold-exec`'s `model/sequence.rs`), in head shards (a rank's tokens of its tensor-parallel
/// heads) per rank: q, k and v from token shards to head shards, stacked into one message
/// (3), and the attention output back (1).
pub const ALLTOALL_SHARDS: [u32; 2] = [3, 1];

/// Whether the executor runs the all-to-alls of sequence-parallel group `g` by the copy
/// engines, beside the compute (mold-exec's `comm/copy_engine.rs`): two GPUs (`cuda:N`;
/// emulated devices have none) of one peer domain on one node. Larger groups keep NCCL's
/// all-to-all between the products by default (on 4 × H200 the copy engines did not beat
/// it, BENCHMARKS.md) and are priced so.
pub fn copies_beside(machine: &Machine, g: &[DeviceId]) -> bool {
    g.len() == 2
        && g.iter().all(|d| matches!(d, DeviceId::Cuda(_)))
        && !machine.spans_nodes(g)
        && machine.domain_of(g).is_some()
}

/// Bytes a rank contributes to the maxima's all-gather before FP8 attention's e4m3 q/k/v
/// all-to-all (mold-exec's `sequence::start`: q's, k's and v's partial maxima as the q/k/v
/// preparation takes them, `(3, 64, 32)` f32).
pub const FP8_MAXIMA_BYTES: u64 = 3 * 64 * 32 * 4;

/// Memory traffic of the all-to-alls' copies, in shards, for a batch of `batch`. The q/k/v
/// preparation writes the messages in place, the rank's own piece straight into the buffer
/// the others' pieces arrive in, and attention reads that buffer as it is, so what is
/// copied is the output's pieces put together (1 read, 1 written); with more than one
/// sample the output's pieces are also made contiguous before they are sent (1 and 1; a
/// batch of one slices contiguous pieces).
pub fn alltoall_copy_shards(batch: u64) -> f64 {
    2.0 + if batch > 1 { 2.0 } else { 0.0 }
}

/// Seconds for an all-to-all in which each of `n` ranks sends `sent` bytes: the link's
/// latency plus the bytes over its bus bandwidth (the model the all-reduce uses).
pub fn alltoall_s(link: &Collective, sent: f64, n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    link.latency_us * 1e-6 + sent / (link.gbps * 1e9)
}

/// Seconds for an all-gather in which each of `n` ranks receives `received` bytes.
pub fn allgather_s(link: &Collective, received: f64, n: usize) -> f64 {
    alltoall_s(link, received, n)
}

#[cfg(test)]
mod tests;
