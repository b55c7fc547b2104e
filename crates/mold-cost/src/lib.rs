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
//! - a block on a group of n devices runs 1/n of its sharded FLOPs on each device (the
//!   slowest device sets the pace), is never faster than reading its weights from
//!   device memory, and pays `allreduces` all-reduces of its hidden state over the
//!   group's link (peer domain, or staged through the host), plus `allgathers` (one per
//!   block with sharded modulation linears) of the per-sample modulation outputs,
//!   priced as an all-reduce of the gathered bytes (what the executor's all-gather is:
//!   a latency-bound collective of a few hundred KiB at most);
//! - the blocks of one kind on one device group cost max(their compute, the copies of
//!   the streamed ones) ([`BlockCost::group_kind_s`]: the copy stream runs beside the
//!   compute stream, and the planner spreads streamed blocks among resident ones), plus,
//!   once per device group that streams, the largest min(copy, compute) of its streamed
//!   blocks (the pipeline fill: the group's copy stream runs ahead across its parts);
//! - each change of device group between consecutive parts hands the hidden state over
//!   the machine's slowest device-to-device path;
//! - a device holds the weights of its components and resident blocks, its stream
//!   buffers (one set per device group, shared by the group's streamed parts), the transformer stem if it runs any transformer part, and the largest
//!   activation of anything it runs; that plus its headroom must fit its budget;
//! - every component stays loaded for the whole request.
//!
//! Byte counts saturate at `u64::MAX` rather than wrap: a workload the model does not
//! support (which [`validate`] refuses first) can never come out as fitting.

mod validate;

pub use validate::{check_machine, validate, MachineCheck};

use mold_machine::Machine;
use mold_models::{BlockKind, ComponentSpec, ModelSpec, Tokens};
use mold_plan::{
    ByteSize, ComponentRole, DType, DeviceId, DevicePrediction, Plan, Prediction, Residency,
    Workload,
};
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
    /// Collectives of the block over the group's link: its all-reduces and its
    /// modulation all-gather.
    pub allreduce_s: f64,
    /// Host→device copy of one device's share of the block's weights (pinned).
    pub copy_s: f64,
    /// Weight bytes on each device of the group.
    pub weight_bytes: u64,
    /// Peak activation bytes on each device while the block runs.
    pub activation_bytes: u64,
}

impl BlockCost {
    /// Compute plus collectives: the block's time when resident.
    pub fn resident_s(&self) -> f64 {
        self.compute_s + self.allreduce_s
    }
    /// Steady-state time per block when streamed with double buffering.
    fn streamed_s(&self) -> f64 {
        self.copy_s.max(self.resident_s())
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
    /// compute), the double-buffering figure.)
    pub fn group_kind_s(&self, resident: u64, streamed: u64) -> f64 {
        let compute = (resident + streamed) as f64 * self.resident_s();
        let copies = streamed as f64 * self.copy_s;
        compute.max(copies)
    }
}

/// A model, workload and machine, with the figures every cost needs.
pub struct Ctx<'a> {
    pub model: &'a ModelSpec,
    pub machine: &'a Machine,
    pub workload: &'a Workload,
    pub tokens: Tokens,
    pub batch: u64,
}

impl<'a> Ctx<'a> {
    pub fn new(model: &'a ModelSpec, machine: &'a Machine, workload: &'a Workload) -> Self {
        Ctx {
            model,
            machine,
            workload,
            tokens: model.tokens(workload),
            batch: workload.effective_batch(),
        }
    }

    fn device(&self, id: &DeviceId) -> &mold_machine::Device {
        self.machine
            .device(id)
            .unwrap_or_else(|| panic!("device {id} not in machine (validate the plan first)"))
    }

    /// Seconds for `flops` and `bytes` read on one device: the slower of compute and
    /// memory traffic.
    fn device_time(&self, id: &DeviceId, flops: f64, bytes: u64, dtype: DType) -> f64 {
        if id.is_host() {
            let h = &self.machine.host;
            return (flops / (h.tflops * 1e12)).max(bytes as f64 / (h.mem_bandwidth_gbps * 1e9));
        }
        let d = self.device(id);
        (flops / (d.tflops(dtype) * 1e12)).max(bytes as f64 / (d.mem_bandwidth_gbps * 1e9))
    }

    /// One block of `kind` on `group`.
    pub fn block(&self, kind: &BlockKind, group: &[DeviceId], dtype: DType) -> BlockCost {
        let tp = group.len() as u32;
        let act = dtype.activation_bytes();
        let weight_bytes = kind.weight_bytes(dtype, tp);
        let flops = kind.flops(self.tokens, self.batch, tp);
        let mut compute_s: f64 = 0.0;
        let mut unfused = false;
        for id in group {
            let d = self.device(id);
            let mut t = self.device_time(id, flops, weight_bytes, dtype);
            if !d.fused_attention {
                unfused = true;
                // Scores written, read by softmax, written, read again: 4 passes in f32.
                let (q, k) = kind.attention_shape(self.tokens);
                let heads = (kind.heads as u64).div_ceil(tp as u64);
                let bytes = 4.0 * self.batch as f64 * heads as f64 * q as f64 * k as f64 * 4.0;
                t += bytes / (d.mem_bandwidth_gbps * 1e9);
            }
            compute_s = compute_s.max(t);
        }
        let link = self.machine.group_link(group);
        let n = group.len();
        let allreduce_s = kind.allreduces as f64
            * link
                .collective
                .allreduce_s(kind.hidden_bytes(self.tokens, self.batch, act), n)
            + kind.allgathers() as f64
                * link
                    .collective
                    .allreduce_s(kind.per_sample_bytes(self.batch, act), n);
        BlockCost {
            compute_s,
            allreduce_s,
            copy_s: weight_bytes as f64 / (self.machine.links.host_pinned_gbps * 1e9),
            weight_bytes,
            activation_bytes: kind.activation_bytes(self.tokens, self.batch, act, tp, !unfused),
        }
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
    /// device-to-device path (the simulator uses the actual pair).
    pub fn handoff_s(&self, dtype: DType) -> f64 {
        let ds = &self.machine.devices;
        let mut slowest = f64::INFINITY;
        for a in ds {
            for b in ds {
                if a.id != b.id {
                    slowest = slowest.min(self.machine.transfer_gbps(&a.id, &b.id));
                }
            }
        }
        if slowest.is_finite() {
            self.handoff_bytes(dtype) as f64 / (slowest * 1e9)
        } else {
            0.0
        }
    }

    /// Seconds for a whole component (encoder or VAE) on one device or the host.
    pub fn component_s(&self, c: &ComponentSpec, on: &DeviceId, dtype: DType) -> f64 {
        let flops = c.flops(self.model, self.workload);
        self.device_time(on, flops, c.weight_bytes(dtype), dtype)
    }

    pub fn component_activation(&self, c: &ComponentSpec, dtype: DType) -> u64 {
        c.activation_bytes(self.model, self.workload, dtype.activation_bytes())
    }
}

/// Memory of one device under a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceUse {
    pub device: DeviceId,
    pub weights: u64,
    pub buffers: u64,
    pub activation: u64,
    /// What is live at the worst moment: weights + buffers + activation.
    pub peak: u64,
    pub headroom: u64,
    pub budget: u64,
    /// What sets `activation`: a component name or `transformer <kind>`.
    pub activation_from: String,
}

impl DeviceUse {
    pub fn fits(&self) -> bool {
        self.peak.saturating_add(self.headroom) <= self.budget
    }
}

/// The time of one transformer part within a step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PartTime {
    pub index: usize,
    pub devices: Vec<DeviceId>,
    pub blocks: u32,
    pub residency: Residency,
    pub compute_s: f64,
    pub allreduce_s: f64,
    pub copy_s: f64,
    pub total_s: f64,
}

/// The closed-form evaluation of a plan: what the planner records as its prediction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    pub step_s: f64,
    pub handoff_s: f64,
    /// Pipeline fill of streamed parts: once per device group per step.
    pub fill_s: f64,
    pub encode_s: f64,
    pub denoise_s: f64,
    pub decode_s: f64,
    pub request_s: f64,
    pub devices: Vec<DeviceUse>,
    pub parts: Vec<PartTime>,
    pub host_pinned: u64,
    pub host_pinned_limit: u64,
    pub host_ram: u64,
    pub host_memory: u64,
    pub streamed_per_step: u64,
}

impl Evaluation {
    pub fn overflows(&self) -> Vec<&DeviceUse> {
        self.devices.iter().filter(|d| !d.fits()).collect()
    }

    pub fn fits(&self) -> bool {
        self.overflows().is_empty()
            && self.host_pinned <= self.host_pinned_limit
            && self.host_ram <= self.host_memory
    }

    /// The prediction block recorded in a plan (memory rounded up to MiB).
    pub fn prediction(&self) -> Prediction {
        Prediction {
            step_time_s: round6(self.step_s),
            request_time_s: round6(self.request_s),
            encode_time_s: round6(self.encode_s),
            denoise_time_s: round6(self.denoise_s),
            decode_time_s: round6(self.decode_s),
            devices: self
                .devices
                .iter()
                .map(|d| DevicePrediction {
                    device: d.device.clone(),
                    peak: ByteSize(d.peak).ceil_mib(),
                    budget: ByteSize(d.budget),
                    weights: ByteSize(d.weights).ceil_mib(),
                })
                .collect(),
            host_pinned: ByteSize(self.host_pinned).ceil_mib(),
            streamed_per_step: ByteSize(self.streamed_per_step).ceil_mib(),
        }
    }
}

/// Rounds seconds to microseconds so recorded plans stay stable and readable.
pub fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Evaluates a plan that [`validate`] accepted.
pub fn evaluate(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Evaluation {
    let ctx = Ctx::new(model, machine, &plan.workload);
    let mut uses: Vec<DeviceUse> = machine
        .devices
        .iter()
        .map(|d| DeviceUse {
            device: d.id.clone(),
            weights: 0,
            buffers: 0,
            activation: 0,
            peak: 0,
            headroom: d.headroom.0,
            budget: d.budget.0,
            activation_from: String::new(),
        })
        .collect();
    let idx = |id: &DeviceId| machine.devices.iter().position(|d| &d.id == id);
    let mut host_ram = 0u64;
    let (mut encode_s, mut decode_s) = (0.0, 0.0);
    let raise_act = |u: &mut DeviceUse, bytes: u64, from: String| {
        if bytes > u.activation {
            u.activation = bytes;
            u.activation_from = from;
        }
    };

    for c in &plan.components {
        if c.role == ComponentRole::Transformer {
            continue;
        }
        let spec = model.component(&c.name).expect("validated");
        let on = &c.parts[0].devices[0];
        let t = ctx.component_s(spec, on, c.dtype);
        match c.role {
            ComponentRole::Encoder => encode_s += t,
            _ => decode_s += t,
        }
        match idx(on) {
            Some(i) => {
                uses[i].weights = uses[i].weights.saturating_add(spec.weight_bytes(c.dtype));
                raise_act(
                    &mut uses[i],
                    ctx.component_activation(spec, c.dtype),
                    c.name.clone(),
                );
            }
            None => {
                host_ram = host_ram
                    .saturating_add(spec.weight_bytes(c.dtype))
                    .saturating_add(ctx.component_activation(spec, c.dtype))
            }
        }
    }

    let mut step_s = 0.0;
    let mut handoff_s = 0.0;
    let mut fill_s = 0.0;
    let mut parts = Vec::new();
    let mut host_pinned = 0u64;
    let mut streamed = 0u64;
    if let Some(tc) = plan.transformer() {
        let dtype = tc.dtype;
        let stem = model.transformer.stem_bytes(dtype);
        let mut groups: Vec<Vec<DeviceId>> = Vec::new();
        // Pipeline fill, once per device group: its copy stream runs ahead across parts.
        let mut fills: Vec<f64> = Vec::new();
        // Stream buffers, once per device group: its streamed parts reuse them.
        let mut group_buffers: Vec<u64> = Vec::new();
        let mut transitions = 0usize;
        // Per (group, kind): the kind's cost there and its resident and streamed counts.
        let mut per_kind: Vec<(usize, String, BlockCost, u64, u64)> = Vec::new();
        for (pi, p) in tc.parts.iter().enumerate() {
            let gi = match groups.iter().position(|g| g == &p.devices) {
                Some(i) => i,
                None => {
                    groups.push(p.devices.clone());
                    fills.push(0.0);
                    group_buffers.push(0);
                    groups.len() - 1
                }
            };
            if pi > 0 && tc.parts[pi - 1].devices != p.devices {
                transitions += 1;
            }
            let mut pt = PartTime {
                index: pi,
                devices: p.devices.clone(),
                blocks: p.block_count(),
                residency: p.residency,
                compute_s: 0.0,
                allreduce_s: 0.0,
                copy_s: 0.0,
                total_s: 0.0,
            };
            let mut buffer: u64 = 0;
            for r in &p.blocks {
                let (_, kind) = model.transformer.kind(&r.kind).expect("validated");
                let bc = ctx.block(kind, &p.devices, dtype);
                let n = r.len() as f64;
                let at = match per_kind
                    .iter()
                    .position(|(g, k, ..)| *g == gi && *k == kind.name)
                {
                    Some(i) => i,
                    None => {
                        per_kind.push((gi, kind.name.clone(), bc, 0, 0));
                        per_kind.len() - 1
                    }
                };
                match p.residency {
                    Residency::Resident => per_kind[at].3 += r.len() as u64,
                    Residency::Streamed => per_kind[at].4 += r.len() as u64,
                }
                pt.compute_s += n * bc.compute_s;
                pt.allreduce_s += n * bc.allreduce_s;
                for d in &p.devices {
                    let i = idx(d).expect("validated");
                    raise_act(
                        &mut uses[i],
                        bc.activation_bytes,
                        format!("transformer {}", kind.name),
                    );
                }
                match p.residency {
                    Residency::Resident => {
                        pt.total_s += n * bc.resident_s();
                        for d in &p.devices {
                            let u = &mut uses[idx(d).expect("validated")];
                            u.weights = u
                                .weights
                                .saturating_add((r.len() as u64).saturating_mul(bc.weight_bytes));
                        }
                    }
                    Residency::Streamed => {
                        pt.copy_s += n * bc.copy_s;
                        pt.total_s += n * bc.streamed_s();
                        fills[gi] = fills[gi].max(bc.fill_s());
                        buffer = buffer.max(bc.weight_bytes);
                        let bytes = mold_models::product(&[
                            r.len() as u64,
                            bc.weight_bytes,
                            p.devices.len() as u64,
                        ]);
                        host_pinned = host_pinned.saturating_add(bytes);
                        streamed = streamed.saturating_add(bytes);
                    }
                }
            }
            group_buffers[gi] = group_buffers[gi].max((p.buffers() as u64).saturating_mul(buffer));
            parts.push(pt);
        }
        step_s += per_kind
            .iter()
            .map(|(_, _, bc, r, s)| bc.group_kind_s(*r, *s))
            .sum::<f64>();
        fill_s = fills.iter().sum();
        for (g, b) in groups.iter().zip(&group_buffers) {
            for d in g {
                let u = &mut uses[idx(d).expect("validated")];
                u.buffers = u.buffers.saturating_add(*b);
            }
        }
        step_s += fill_s;
        // The stem is charged to every device that runs a transformer part.
        for u in uses.iter_mut() {
            if groups.iter().any(|g| g.contains(&u.device)) {
                u.weights = u.weights.saturating_add(stem);
            }
        }
        handoff_s = transitions as f64 * ctx.handoff_s(dtype);
        step_s += handoff_s;
    }
    for u in uses.iter_mut() {
        u.peak = u
            .weights
            .saturating_add(u.buffers)
            .saturating_add(u.activation);
    }
    let denoise_s = step_s * plan.workload.steps as f64;
    Evaluation {
        step_s,
        handoff_s,
        fill_s,
        encode_s,
        denoise_s,
        decode_s,
        request_s: encode_s + denoise_s + decode_s,
        devices: uses,
        parts,
        host_pinned,
        host_pinned_limit: machine.host.pinned_limit.0,
        host_ram: host_ram.saturating_add(host_pinned),
        host_memory: machine.host.memory.0,
        streamed_per_step: streamed,
    }
}

#[cfg(test)]
mod tests;

impl Evaluation {
    /// An all-zero prediction, for plans assembled by hand before evaluation.
    pub fn default_prediction() -> Prediction {
        Prediction {
            step_time_s: 0.0,
            request_time_s: 0.0,
            encode_time_s: 0.0,
            denoise_time_s: 0.0,
            decode_time_s: 0.0,
            devices: vec![],
            host_pinned: ByteSize::ZERO,
            streamed_per_step: ByteSize::ZERO,
        }
    }
}
