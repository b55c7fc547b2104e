//! The placement problem as data, independent of how it is searched: what a block kind
//! costs on a device group, where each component may run and what it costs there, what
//! each device may hold, and the objective. The integer program (`ilp.rs`) encodes it
//! for the solver; the exhaustive enumerator (`brute.rs`) walks it directly.
//!
//! Memory per device: components' weights + resident blocks + stream buffers + stem (if
//! the device runs any transformer part) + its largest activation, plus headroom, the
//! CUDA libraries' measured device memory (where the profile has it) and the transfer
//! reserve (below), within its budget. The transfer reserve is what the
//! simulator (and the executor) holds beside that and `mold_cost::evaluate` does not
//! count: conditioning on the transformer's first devices, hand-off and all-reduce
//! buffers, latents. Without it a plan filled to the last byte of its budget was refused
//! by `mold sim` (and so by `mold exec`) by the size of those buffers.

use crate::{Family, Objective, Request};
use mold_cost::{BlockCost, Ctx, Group};
use mold_models::Workkind;
use mold_plan::{CfgMode, ComponentRole, DType, DeviceId, MemoryPhases, GIB};
use std::collections::BTreeMap;

/// Weight of latency in the `memory` objective (GiB per second): least device memory in
/// total first, then the shortest request.
pub const MEMORY_LATENCY_WEIGHT: f64 = 1e-4;

/// A solution: which blocks each group runs, where each component runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Groups that run blocks, with resident and streamed block counts per kind.
    pub groups: Vec<GroupChoice>,
    /// Component name → device (or host).
    pub placement: BTreeMap<String, DeviceId>,
    /// The objective's value (request seconds, or GiB + ε·seconds for `memory`).
    pub objective: f64,
}

/// The blocks one device group runs.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupChoice {
    /// Its devices and their layout (`tp × sp`).
    pub group: Group,
    /// Resident blocks of each kind.
    pub resident: Vec<u32>,
    /// Host-streamed blocks of each kind.
    pub streamed: Vec<u32>,
}

impl Choice {
    pub fn streamed_blocks(&self) -> u32 {
        self.groups.iter().flat_map(|g| g.streamed.iter()).sum()
    }
}

/// One place a component may run, and what it costs there.
#[derive(Clone, Debug)]
pub(crate) struct ComponentOption {
    pub at: DeviceId,
    pub seconds: f64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
}

/// One component and the places it may run.
#[derive(Clone, Debug)]
pub(crate) struct ComponentChoices {
    pub name: String,
    pub is_vae: bool,
    pub options: Vec<ComponentOption>,
}

/// The problem of one request.
pub(crate) struct Problem<'a> {
    pub req: &'a Request,
    pub ctx: Ctx<'a>,
    /// Devices the transformer may use, in machine order.
    pub allowed: Vec<DeviceId>,
    /// Blocks of each kind, in execution order.
    pub counts: Vec<u32>,
    pub components: Vec<ComponentChoices>,
    /// Stream buffers per streaming group.
    pub buffers: u64,
    pub stream: bool,
    /// Transformer passes a plan pays per request: steps, times 2 under serial true CFG
    /// (under CFG-parallel each replica runs one pass a step; pipelined, one pass plus
    /// the bottleneck, `pipelined`).
    pub steps: f64,
    /// Pipelined CFG: the step is a pass plus its bottleneck (the slowest stage, each
    /// stage but the last with the hand-off it makes), and the device groups are
    /// disjoint (each a stage).
    pub pipelined: bool,
    pub phases: MemoryPhases,
    /// One hand-off between device groups (seconds).
    pub handoff_s: f64,
    pub stem: u64,
    /// Conditioning the encoders hand the transformer's first devices (bytes, all of
    /// them together).
    pub conditioning: u64,
    /// One hidden state handed between groups (bytes), the largest all-reduce buffer too.
    pub hidden: u64,
    /// Latents between steps and into the VAE (bytes).
    pub latents: u64,
    /// The largest parallel group allowed (1 when none is).
    pub max_degree: u64,
}

impl<'a> Problem<'a> {
    pub fn new(req: &'a Request) -> Problem<'a> {
        let ctx = req.cost_ctx();
        let allowed: Vec<DeviceId> = req
            .machine
            .devices
            .iter()
            .map(|d| d.id.clone())
            .filter(|d| req.constraints.allowed("transformer", d))
            .collect();
        let mut locs: Vec<DeviceId> = req.machine.devices.iter().map(|d| d.id.clone()).collect();
        locs.push(DeviceId::Host);
        let components = req
            .model
            .components
            .iter()
            .map(|c| {
                let dtype = req.dtype(&c.name);
                let options = locs
                    .iter()
                    .filter(|l| req.constraints.allowed(&c.name, l))
                    .map(|l| ComponentOption {
                        at: l.clone(),
                        seconds: ctx.component_s(c, l, dtype),
                        weight_bytes: c.weight_bytes(dtype),
                        activation_bytes: ctx.component_activation(c, dtype),
                    })
                    .collect();
                ComponentChoices {
                    name: c.name.clone(),
                    is_vae: c.role == ComponentRole::Vae,
                    options,
                }
            })
            .collect();
        let dtype = req.dtype("transformer");
        let act = dtype.activation_bytes();
        // What the simulator moves between phases (`mold-sim`'s engine: conditioning,
        // hand-offs, all-reduces, latents), sized the same way.
        let conditioning = req
            .model
            .components
            .iter()
            .map(|c| match &c.work {
                Workkind::TextEncoder { hidden, .. } => {
                    ctx.conditioning_bytes(*hidden, req.dtype(&c.name))
                }
                _ => 0,
            })
            .fold(0u64, u64::saturating_add);
        let hidden = req
            .model
            .transformer
            .kinds
            .iter()
            .map(|k| k.hidden_bytes(ctx.tokens, ctx.batch, act))
            .max()
            .unwrap_or(0)
            .max(ctx.handoff_bytes(dtype));
        let latents = ctx.latent_bytes();
        let cfg = req.cfg_mode();
        let max_degree = (2..=allowed.len() as u32)
            .filter(|&n| !layouts(req, n).is_empty())
            .max()
            .unwrap_or(1) as u64;
        Problem {
            counts: req
                .model
                .transformer
                .kinds
                .iter()
                .map(|k| k.count)
                .collect(),
            components,
            buffers: req.constraints.stream_buffers as u64,
            // FP8 weights are held resident only (the executor's stream buffers hold one
            // dtype; an FP8 block is e4m3 values, f32 scales and bf16 biases).
            stream: req.constraints.stream && req.dtype("transformer") != DType::Fp8,
            steps: req.workload.steps as f64
                * if cfg == Some(CfgMode::Serial) {
                    2.0
                } else {
                    1.0
                },
            pipelined: cfg == Some(CfgMode::Pipelined),
            phases: req.memory_phases,
            handoff_s: ctx.handoff_s(dtype),
            stem: req.model.transformer.stem_bytes(dtype),
            conditioning,
            hidden,
            latents,
            max_degree,
            allowed,
            ctx,
            req,
        }
    }

    /// What one block of each kind costs on `group`.
    pub fn costs(&self, group: &Group) -> Vec<BlockCost> {
        let dtype = self.req.dtype("transformer");
        self.req
            .model
            .transformer
            .kinds
            .iter()
            .map(|k| self.ctx.block(k, group, dtype))
            .collect()
    }

    /// The all-gather that ends `group`'s run of blocks (0 without sequence parallel).
    pub fn gather_s(&self, group: &Group) -> f64 {
        self.ctx.gather_s(group, self.req.dtype("transformer"))
    }

    /// Whether plans of `family` may be chosen at all: `--sp N` asks for sequence
    /// parallelism, so plans without a sequence-parallel group (one device, a block
    /// split) are not considered. (`--tp N` only fixes the degree of the groups that
    /// are tensor parallel.)
    /// Pipelined CFG needs two or more stages: a split (or mixed) plan.
    pub fn family_allowed(&self, family: Family) -> bool {
        !(matches!(self.req.constraints.sp, crate::SpChoice::Degree(_))
            && matches!(family, Family::Single | Family::Split))
            && (!self.pipelined || matches!(family, Family::Split | Family::Mixed))
    }

    /// The `(tp, sp)` layouts a group of `size` devices (two or more) may take, by the
    /// constraints and the model's heads.
    pub fn layouts(&self, size: usize) -> Vec<(u32, u32)> {
        layouts(self.req, size as u32)
    }

    /// Bytes each device may hold for the plan: budget less headroom, less the CUDA
    /// libraries' device memory where the profile measured it ([`Ctx::library_bytes`]:
    /// `mold_cost::evaluate` and the simulator count it on every device the plan uses, so
    /// a device that holds anything holds it too; one that holds nothing fits any cap).
    pub fn cap(&self, device: usize) -> u64 {
        let d = &self.req.machine.devices[device];
        let libraries = self.ctx.library_bytes(&d.id, self.req.dtype("transformer"));
        d.budget
            .0
            .saturating_sub(d.headroom.0)
            .saturating_sub(libraries)
    }

    /// The transfer reserve of a device that runs transformer blocks, in plans of
    /// `family`: the conditioning, plus the most of hand-off buffers (one
    /// per rank of the receiving group, on the sending device), the all-reduce buffer
    /// and the latents that can be live at one moment. A plan of one group hands
    /// nothing off and all-reduces nothing.
    pub fn transformer_reserve(&self, family: Family) -> u64 {
        let moving = match family {
            Family::Single => self.latents,
            Family::Split | Family::Tensor | Family::Sequence | Family::Hybrid => {
                self.hidden.max(self.latents)
            }
            Family::Mixed => self
                .hidden
                .saturating_mul(self.max_degree)
                .max(self.latents),
        };
        self.conditioning.saturating_add(moving)
    }

    /// The transfer reserve of the VAE's device: the latents it decodes.
    pub fn vae_reserve(&self) -> u64 {
        self.latents
    }

    /// Whether an evaluated plan of `family` fits every budget with the transfer
    /// reserves: exact, in bytes (the solver meets its constraints only to tolerances).
    /// `ev`'s peaks and phases hold the CUDA libraries' measured memory already
    /// (`DeviceUse::libraries`), as [`Problem::cap`] leaves room for.
    pub fn fits(&self, plan: &mold_plan::Plan, ev: &mold_cost::Evaluation, family: Family) -> bool {
        self.overflow(plan, ev, family) == 0
    }

    /// By how many bytes an evaluated plan of `family` breaks its budgets, all of them
    /// together (pinned and host memory, and each device with its transfer reserves and
    /// headroom): 0 when it [fits](Problem::fits). The local search (`local.rs`) walks
    /// towards plans that fit by it.
    pub fn overflow(
        &self,
        plan: &mold_plan::Plan,
        ev: &mold_cost::Evaluation,
        family: Family,
    ) -> u64 {
        // Every transformer's devices: both replicas' under CFG-parallel.
        let placements = match plan.cfg_mode() {
            Some(CfgMode::Parallel) => plan.replica_plans().unwrap_or_default(),
            _ => vec![],
        };
        let runs = |id: &DeviceId| {
            std::iter::once(plan)
                .chain(&placements)
                .filter_map(|p| p.transformer())
                .any(|t| t.parts.iter().any(|p| p.devices.contains(id)))
        };
        let vae_on = |id: &DeviceId| {
            plan.components.iter().any(|c| {
                c.role == ComponentRole::Vae && c.parts.iter().any(|p| p.devices.contains(id))
            })
        };
        let over = |need: u64, limit: u64| need.saturating_sub(limit);
        let host = over(ev.host_pinned, ev.host_pinned_limit)
            .saturating_add(over(ev.host_ram, ev.host_memory));
        ev.devices.iter().fold(host, |sum, d| {
            let t = if runs(&d.device) {
                self.transformer_reserve(family)
            } else {
                0
            };
            let v = if vae_on(&d.device) {
                self.vae_reserve()
            } else {
                0
            };
            let need = match plan.memory_phases {
                MemoryPhases::Resident => d.peak.saturating_add(t).saturating_add(v),
                MemoryPhases::OneShot => d
                    .phases
                    .encode
                    .max(d.phases.denoise.saturating_add(t))
                    .max(d.phases.decode.saturating_add(v)),
            };
            sum.saturating_add(over(need.saturating_add(d.headroom), d.budget))
        })
    }

    /// The objective of a plan: request seconds, or (memory) the GiB all devices hold
    /// plus [`MEMORY_LATENCY_WEIGHT`] per request second.
    pub fn objective(&self, request_s: f64, device_bytes: u64) -> f64 {
        match self.req.objective {
            Objective::Latency | Objective::Throughput => request_s,
            Objective::Memory => {
                device_bytes as f64 / GIB as f64 + MEMORY_LATENCY_WEIGHT * request_s
            }
        }
    }
}

/// The `(tp, sp)` layouts of a group of `n` devices (n ≥ 2) the constraints and the
/// model's heads allow: every factorisation `tp × sp = n` whose degrees `--tp` and
/// `--sp` permit, `n` dividing every block kind's heads (each rank attends with
/// `heads / n` heads). Tensor parallel first.
///
/// Sequence-parallel layouts (`sp` > 1) are proposed on groups of 2, 4, 8, … devices
/// only: on eight GPUs the 3- and 6-device layouts would take the program from 29 to 34
/// groups and qwen-image's mixed family on 8x-l40s from 0.36 s to about 1 s, its whole
/// time limit, for plans that the power-of-two layouts match there. Plans written by
/// hand may use any `tp × sp` dividing the heads (`mold sim` and `mold exec` take them).
fn layouts(req: &Request, n: u32) -> Vec<(u32, u32)> {
    if n < 2 || !req.model.transformer.tp_divides(n) {
        return vec![];
    }
    let c = &req.constraints;
    (1..=n)
        .rev()
        .filter(|tp| n.is_multiple_of(*tp))
        .map(|tp| (tp, n / tp))
        .filter(|&(tp, sp)| c.tp.allows(tp) && c.sp.allows(sp))
        .filter(|&(_, sp)| sp == 1 || n.is_power_of_two())
        .collect()
}

/// The family of a plan whose transformer runs on `groups`.
pub(crate) fn family_of(groups: &[&Group]) -> Family {
    let parallel: Vec<&&Group> = groups.iter().filter(|g| g.is_parallel()).collect();
    match (groups.len(), parallel.as_slice()) {
        (1, []) => Family::Single,
        (_, []) => Family::Split,
        (1, [g]) => Family::of_layout(g.tp, g.sp),
        _ => Family::Mixed,
    }
}
