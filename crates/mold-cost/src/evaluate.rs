//! The closed-form evaluation of a plan: memory per device (all at once, or phase by
//! phase), one transformer pass, and a step composed of passes by the plan's CFG mode.

use crate::{BlockCost, Ctx, Group};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{
    ByteSize, CfgMode, ComponentPlan, ComponentRole, DeviceId, DevicePrediction, MemoryPhases,
    Plan, Prediction, Residency,
};
use serde::Serialize;

/// What one device holds in each phase of a one-shot request ([`MemoryPhases::OneShot`]):
/// the transformer loads after the encoders are freed, the VAE after the transformer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PhasePeaks {
    /// Its text encoders' weights and the largest of their activations.
    pub encode: u64,
    /// Its transformer resident blocks, stream buffers, stem and largest activation.
    pub denoise: u64,
    /// Its VAE's weights and activation.
    pub decode: u64,
}

impl PhasePeaks {
    /// The largest phase.
    pub fn max(&self) -> u64 {
        self.encode.max(self.denoise).max(self.decode)
    }
}

/// Memory of one device under a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceUse {
    pub device: DeviceId,
    /// Every weight the device loads during the request (components and transformer).
    pub weights: u64,
    pub buffers: u64,
    /// The largest activation of anything it runs.
    pub activation: u64,
    /// The CUDA libraries' device memory, held in every phase where the plan uses the
    /// device and the profile measured it ([`plan_libraries`]); 0 otherwise.
    #[serde(skip_serializing_if = "is_zero")]
    pub libraries: u64,
    /// What is live at the worst moment: resident, weights + buffers + activation +
    /// libraries; one-shot, the largest of `phases`.
    pub peak: u64,
    pub headroom: u64,
    pub budget: u64,
    /// What sets `activation`: a component name or `transformer <kind>`.
    pub activation_from: String,
    /// Each phase on its own (what a one-shot request holds at each time), the
    /// libraries in each.
    pub phases: PhasePeaks,
}

fn is_zero(b: &u64) -> bool {
    *b == 0
}

impl DeviceUse {
    pub fn fits(&self) -> bool {
        self.peak.saturating_add(self.headroom) <= self.budget
    }
}

/// The time of one transformer part within a pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PartTime {
    pub index: usize,
    pub devices: Vec<DeviceId>,
    pub tp: u32,
    pub sp: u32,
    pub blocks: u32,
    pub residency: Residency,
    pub compute_s: f64,
    pub allreduce_s: f64,
    pub alltoall_s: f64,
    pub copy_s: f64,
    pub total_s: f64,
}

/// The closed-form evaluation of a plan: what the planner records as its prediction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    /// One denoising step: its transformer passes composed by `cfg`.
    pub step_s: f64,
    /// One transformer pass (under CFG-parallel, the slower replica's).
    pub pass_s: f64,
    /// How true CFG runs the step's two passes; `None`: one pass a step.
    pub cfg: Option<CfgMode>,
    /// CFG-parallel: the unconditional output sent to replica 0's output device.
    pub combine_s: f64,
    /// Pipelined CFG: what the second micro-batch adds to a pass, the slowest stage
    /// with its hand-off ([`pipelined_bottleneck`]: `max(t_i + h)` over the stages
    /// before the last, and the last stage's time).
    pub bottleneck_s: f64,
    /// Each pipeline stage's time in one pass (a device group's blocks, fill and
    /// closing all-gather), in execution order.
    pub stage_s: Vec<f64>,
    pub memory_phases: MemoryPhases,
    /// Hand-offs between device groups, in one pass.
    pub handoff_s: f64,
    /// All-gathers ending runs of parts on sequence-parallel groups, in one pass.
    pub gather_s: f64,
    /// Pipeline fill of streamed parts: once per device group per pass.
    pub fill_s: f64,
    pub encode_s: f64,
    pub denoise_s: f64,
    pub decode_s: f64,
    pub request_s: f64,
    pub devices: Vec<DeviceUse>,
    /// The parts of one pass (replica 0's under CFG-parallel).
    pub parts: Vec<PartTime>,
    pub host_pinned: u64,
    pub host_pinned_limit: u64,
    pub host_ram: u64,
    pub host_memory: u64,
    /// Weight bytes copied host→device per step (every pass's).
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

/// The steady cycle of a pipeline of `stage_s` (in execution order) whose stages each
/// hand their output on themselves, `handoff_s` a hand-off, before taking the next
/// micro-batch: the largest of `t_i + h` over every stage but the last, and of the
/// last stage's `t_n` (it hands nothing on). 0 without stages.
pub fn pipelined_bottleneck(stage_s: &[f64], handoff_s: f64) -> f64 {
    match stage_s.split_last() {
        None => 0.0,
        Some((last, rest)) => rest.iter().map(|t| t + handoff_s).fold(*last, f64::max),
    }
}

/// Rounds seconds to microseconds so recorded plans stay stable and readable.
pub fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// The CUDA libraries' device memory on each of the machine's devices (in its order)
/// under `plan`: [`Ctx::library_bytes`] for the plan's transformer dtype on every device
/// the plan puts a component or a transformer part on (both replicas' under
/// CFG-parallel), 0 on the others. What [`evaluate`] adds to each phase of a device's
/// peak, the simulator allocates at load and the planner keeps out of its capacity.
pub fn plan_libraries(plan: &Plan, ctx: &Ctx) -> Vec<u64> {
    let placements: Vec<Plan> = match plan.cfg_mode() {
        Some(CfgMode::Parallel) => plan.replica_plans().unwrap_or_else(|_| vec![plan.clone()]),
        _ => vec![plan.clone()],
    };
    let dtype = plan
        .transformer()
        .map_or(ctx.model.transformer.default_dtype, |t| t.dtype);
    let component_on = |id: &DeviceId| {
        placements[0].components.iter().any(|c| {
            c.role != ComponentRole::Transformer
                && c.parts.first().and_then(|p| p.devices.first()) == Some(id)
        })
    };
    let transformer_on = |id: &DeviceId| {
        placements
            .iter()
            .filter_map(|p| p.transformer())
            .any(|t| t.parts.iter().any(|p| p.devices.contains(id)))
    };
    ctx.machine
        .devices
        .iter()
        .map(|d| {
            if component_on(&d.id) || transformer_on(&d.id) {
                ctx.library_bytes(&d.id, dtype)
            } else {
                0
            }
        })
        .collect()
}

/// One device's memory, by phase.
#[derive(Clone, Debug, Default)]
struct Held {
    encoder_weights: u64,
    encoder_activation: u64,
    transformer_weights: u64,
    buffers: u64,
    transformer_activation: u64,
    vae_weights: u64,
    vae_activation: u64,
    /// The largest activation of all, and what sets it.
    activation: u64,
    activation_from: String,
}

impl Held {
    fn raise(&mut self, bytes: u64, from: String) {
        if bytes > self.activation {
            self.activation = bytes;
            self.activation_from = from;
        }
    }
}

/// One transformer pass over a placement's parts.
struct Pass {
    step_s: f64,
    handoff_s: f64,
    gather_s: f64,
    fill_s: f64,
    parts: Vec<PartTime>,
    /// Each device group's time (blocks, fill, closing all-gathers), in order of first
    /// appearance: the pipeline stages of a placement whose groups each run one range.
    group_s: Vec<f64>,
    host_pinned: u64,
    streamed: u64,
    /// The first device of the last part: where the pass's output is.
    output: Option<DeviceId>,
}

/// Evaluates a plan that [`crate::validate`] accepted.
pub fn evaluate(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Evaluation {
    let ctx = Ctx::for_plan(model, machine, plan);
    let mode = plan.cfg_mode();
    let mut held: Vec<Held> = vec![Held::default(); machine.devices.len()];
    let idx = |id: &DeviceId| machine.devices.iter().position(|d| &d.id == id);
    // The placements that run passes at once: both replicas under CFG-parallel (the
    // conditional one runs the encoders and the VAE), else the plan as written.
    let placements: Vec<Plan> = match mode {
        Some(CfgMode::Parallel) => plan.replica_plans().unwrap_or_else(|_| vec![plan.clone()]),
        _ => vec![plan.clone()],
    };
    let mut host_ram = 0u64;
    let (mut encode_s, mut decode_s) = (0.0, 0.0);
    for c in &placements[0].components {
        if c.role == ComponentRole::Transformer {
            continue;
        }
        let spec = model.component(&c.name).expect("validated");
        // One device, or (the VAE) row bands over several: each band's device holds the
        // weights and its band's share of the activations.
        let on = &c.parts[0].devices;
        let bands = on.len() as u64;
        let is_encoder = c.role == ComponentRole::Encoder;
        if is_encoder {
            encode_s += ctx.component_s(spec, &on[0], c.dtype);
        } else {
            decode_s += ctx.decode_bands_s(spec, on, c.dtype);
        }
        let w = spec.weight_bytes(c.dtype);
        let a = ctx.component_activation(spec, c.dtype).div_ceil(bands);
        for d in on {
            match idx(d) {
                Some(i) => {
                    let h = &mut held[i];
                    if is_encoder {
                        h.encoder_weights = h.encoder_weights.saturating_add(w);
                        h.encoder_activation = h.encoder_activation.max(a);
                    } else {
                        h.vae_weights = h.vae_weights.saturating_add(w);
                        h.vae_activation = h.vae_activation.max(a);
                    }
                    h.raise(a, c.name.clone());
                }
                None => host_ram = host_ram.saturating_add(w).saturating_add(a),
            }
        }
    }
    let passes: Vec<Pass> = placements
        .iter()
        .filter_map(|p| p.transformer())
        .map(|tc| pass(tc, &ctx, model, &mut held, &idx))
        .collect();
    let pass_s = passes.iter().map(|p| p.step_s).fold(0.0, f64::max);
    let first = passes.first();
    let stage_s = first.map(|p| p.group_s.clone()).unwrap_or_default();
    let (mut combine_s, mut bottleneck_s) = (0.0, 0.0);
    let step_s = match mode {
        None => pass_s,
        Some(CfgMode::Serial) => 2.0 * pass_s,
        Some(CfgMode::Parallel) => {
            if let [a, b] = passes.as_slice() {
                if let (Some(to), Some(from)) = (&a.output, &b.output) {
                    if to != from {
                        combine_s = machine.transfer_s(from, to, ctx.latent_bytes());
                    }
                }
            }
            pass_s + combine_s
        }
        Some(CfgMode::Pipelined) => {
            // Two micro-batches through a flow shop whose machines are the stages: a
            // stage's thread makes its hand-off itself and waits for it before it takes
            // the next micro-batch (`mold-exec`'s `executor/pipeline.rs`), so every
            // stage but the last is busy for its time plus one hand-off, the last for
            // its time. The second micro-batch finishes one bottleneck after the first.
            let handoff = if stage_s.len() > 1 {
                first.map_or(0.0, |p| p.handoff_s / (stage_s.len() - 1) as f64)
            } else {
                0.0
            };
            bottleneck_s = pipelined_bottleneck(&stage_s, handoff);
            pass_s + bottleneck_s
        }
    };
    // Passes a step runs one after the other on the same devices.
    let repeats: u64 = match mode {
        Some(CfgMode::Serial) | Some(CfgMode::Pipelined) => 2,
        _ => 1,
    };
    let host_pinned = passes
        .iter()
        .map(|p| p.host_pinned)
        .fold(0u64, u64::saturating_add);
    let streamed = passes
        .iter()
        .map(|p| p.streamed)
        .fold(0u64, u64::saturating_add)
        .saturating_mul(repeats);
    let libraries = plan_libraries(plan, &ctx);
    let uses: Vec<DeviceUse> = machine
        .devices
        .iter()
        .zip(&held)
        .zip(&libraries)
        .map(|((d, h), &lib)| {
            // The libraries stay loaded from the first use to the end: in every phase.
            let phases = PhasePeaks {
                encode: h
                    .encoder_weights
                    .saturating_add(h.encoder_activation)
                    .saturating_add(lib),
                denoise: h
                    .transformer_weights
                    .saturating_add(h.buffers)
                    .saturating_add(h.transformer_activation)
                    .saturating_add(lib),
                decode: h
                    .vae_weights
                    .saturating_add(h.vae_activation)
                    .saturating_add(lib),
            };
            let weights = h
                .encoder_weights
                .saturating_add(h.transformer_weights)
                .saturating_add(h.vae_weights);
            let peak = match plan.memory_phases {
                MemoryPhases::Resident => weights
                    .saturating_add(h.buffers)
                    .saturating_add(h.activation)
                    .saturating_add(lib),
                MemoryPhases::OneShot => phases.max(),
            };
            DeviceUse {
                device: d.id.clone(),
                weights,
                buffers: h.buffers,
                activation: h.activation,
                libraries: lib,
                peak,
                headroom: d.headroom.0,
                budget: d.budget.0,
                activation_from: h.activation_from.clone(),
                phases,
            }
        })
        .collect();
    let denoise_s = step_s * plan.workload.steps as f64;
    Evaluation {
        step_s,
        pass_s,
        cfg: mode,
        combine_s,
        bottleneck_s,
        stage_s,
        memory_phases: plan.memory_phases,
        handoff_s: first.map_or(0.0, |p| p.handoff_s),
        gather_s: first.map_or(0.0, |p| p.gather_s),
        fill_s: first.map_or(0.0, |p| p.fill_s),
        encode_s,
        denoise_s,
        decode_s,
        request_s: encode_s + denoise_s + decode_s,
        devices: uses,
        parts: passes
            .into_iter()
            .next()
            .map(|p| p.parts)
            .unwrap_or_default(),
        host_pinned,
        host_pinned_limit: machine.host.pinned_limit.0,
        host_ram: host_ram.saturating_add(host_pinned),
        host_memory: machine.host.memory.0,
        streamed_per_step: streamed,
    }
}

/// One pass of the transformer `tc`, its memory added to `held`.
fn pass(
    tc: &ComponentPlan,
    ctx: &Ctx,
    model: &ModelSpec,
    held: &mut [Held],
    idx: &dyn Fn(&DeviceId) -> Option<usize>,
) -> Pass {
    let dtype = tc.dtype;
    let stem = model.transformer.stem_bytes(dtype);
    let mut groups: Vec<Group> = Vec::new();
    // Pipeline fill, once per device group: its copy stream runs ahead across parts.
    let mut fills: Vec<f64> = Vec::new();
    // Closing all-gathers, per device group.
    let mut gathers: Vec<f64> = Vec::new();
    // Stream buffers, once per device group: its streamed parts reuse them.
    let mut group_buffers: Vec<u64> = Vec::new();
    let mut transitions = 0usize;
    // Per (group, kind): the kind's cost there and its resident and streamed counts.
    let mut per_kind: Vec<(usize, String, BlockCost, u64, u64)> = Vec::new();
    let mut parts = Vec::new();
    let (mut host_pinned, mut streamed) = (0u64, 0u64);
    for (pi, p) in tc.parts.iter().enumerate() {
        let group = Group::of(p);
        let gi = match groups.iter().position(|g| g == &group) {
            Some(i) => i,
            None => {
                groups.push(group.clone());
                fills.push(0.0);
                gathers.push(0.0);
                group_buffers.push(0);
                groups.len() - 1
            }
        };
        if pi > 0 && Group::of(&tc.parts[pi - 1]) != group {
            transitions += 1;
        }
        // A run of parts on one sequence-parallel group ends with an all-gather.
        let run_ends = tc
            .parts
            .get(pi + 1)
            .is_none_or(|next| Group::of(next) != group);
        if run_ends {
            gathers[gi] += ctx.gather_s(&group, dtype);
        }
        let mut pt = PartTime {
            index: pi,
            devices: p.devices.clone(),
            tp: p.tp,
            sp: p.sp,
            blocks: p.block_count(),
            residency: p.residency,
            compute_s: 0.0,
            allreduce_s: 0.0,
            alltoall_s: 0.0,
            copy_s: 0.0,
            total_s: 0.0,
        };
        let mut buffer: u64 = 0;
        for r in &p.blocks {
            let (_, kind) = model.transformer.kind(&r.kind).expect("validated");
            let bc = ctx.block(kind, &group, dtype);
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
            pt.alltoall_s += n * bc.alltoall_s;
            for d in &p.devices {
                let h = &mut held[idx(d).expect("validated")];
                h.transformer_activation = h.transformer_activation.max(bc.activation_bytes);
                h.raise(bc.activation_bytes, format!("transformer {}", kind.name));
            }
            match p.residency {
                Residency::Resident => {
                    pt.total_s += n * bc.resident_s();
                    for d in &p.devices {
                        let h = &mut held[idx(d).expect("validated")];
                        h.transformer_weights = h
                            .transformer_weights
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
    let mut group_s: Vec<f64> = fills.iter().zip(&gathers).map(|(f, g)| f + g).collect();
    for (gi, _, bc, r, s) in &per_kind {
        group_s[*gi] += bc.group_kind_s(*r, *s);
    }
    for (g, b) in groups.iter().zip(&group_buffers) {
        for d in &g.devices {
            let h = &mut held[idx(d).expect("validated")];
            h.buffers = h.buffers.saturating_add(*b);
        }
    }
    // The stem is charged to every device that runs a transformer part.
    let mut stemmed: Vec<usize> = groups
        .iter()
        .flat_map(|g| &g.devices)
        .filter_map(idx)
        .collect();
    stemmed.sort_unstable();
    stemmed.dedup();
    for i in stemmed {
        held[i].transformer_weights = held[i].transformer_weights.saturating_add(stem);
    }
    let handoff_s = transitions as f64 * ctx.handoff_s(dtype);
    let gather_s: f64 = gathers.iter().sum();
    let fill_s: f64 = fills.iter().sum();
    Pass {
        step_s: group_s.iter().sum::<f64>() + handoff_s,
        handoff_s,
        gather_s,
        fill_s,
        parts,
        group_s,
        host_pinned,
        streamed,
        output: tc.parts.last().and_then(|p| p.devices.first()).cloned(),
    }
}
