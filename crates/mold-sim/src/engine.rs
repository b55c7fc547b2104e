//! The event simulation: one request, list-scheduled in the executor's issue order on
//! per-device streams, then a sweep over each device's allocations for its memory.
//!
//! Here: the simulation's state ([`Sim`]: each device's streams, events, allocations)
//! and the cost model's figures per block kind and group; `load.rs`: weights, buffers
//! and libraries, and when each is live; `run.rs`: the request from start to end;
//! `pass.rs`: a transformer pass and one block on its group; `transfer.rs`: hand-offs,
//! CFG's combine, the next step's input and the sequence-parallel all-gather.

mod load;
mod pass;
mod run;
mod transfer;

use crate::{Event, EventKind, Lane, Live, SimError, SimOptions, SimReport};
use mold_cost::{BlockCost, Ctx, Group};
use mold_machine::Machine;
use mold_models::{ModelSpec, Workkind};
use mold_plan::{ComponentPlan, DType, DeviceId, Plan, Residency};
use std::collections::HashMap;

/// Steps simulated event by event: the first (the copy stream starts idle), then enough
/// for the pipeline to repeat; later steps repeat the last simulated one.
const SIMULATED_STEPS: u32 = 3;

/// Free times of one device's streams.
#[derive(Clone, Debug)]
pub(crate) struct Streams {
    pub(crate) id: DeviceId,
    pub(crate) compute: f64,
    pub(crate) copy: f64,
    pub(crate) comm: f64,
    /// The compute lane's busy intervals, in order: a streamed copy beside them runs at
    /// the profile's busy rate ([`copy_end`]).
    pub(crate) busy: Vec<(f64, f64)>,
}

/// What the libraries' allocation is called in the memory timeline.
pub(crate) const LIBRARIES: &str = "libraries (kernels, cuBLAS/cuDNN workspaces)";

/// When a copy that starts at `start` and takes `work` seconds on an idle device ends,
/// with the device computing over the intervals `busy` (sorted, disjoint): inside them
/// it progresses at `ratio` of its idle rate (`mold_cost::Ctx::copy_busy_ratio`).
pub(crate) fn copy_end(busy: &[(f64, f64)], start: f64, work: f64, ratio: f64) -> f64 {
    if ratio >= 1.0 || work <= 0.0 {
        return start + work;
    }
    let (mut t, mut left) = (start, work);
    let first = busy.partition_point(|&(_, b)| b <= start);
    for &(a, b) in &busy[first..] {
        if a > t {
            if left <= a - t {
                return t + left;
            }
            left -= a - t;
            t = a;
        }
        let room = (b - t) * ratio;
        if left <= room {
            return t + left / ratio;
        }
        left -= room;
        t = b;
    }
    t + left
}

/// Bytes live on a device from `start` to `end` (`None`: to the end of the request).
#[derive(Clone, Debug)]
pub(crate) struct Alloc {
    pub(crate) dev: usize,
    pub(crate) start: f64,
    pub(crate) end: Option<f64>,
    pub(crate) bytes: u64,
    pub(crate) what: String,
    pub(crate) moment: String,
}

/// A block kind on a group, from the cost model, with each rank's own compute time.
#[derive(Clone, Debug)]
struct BlockInfo {
    cost: BlockCost,
    per_rank_s: Vec<f64>,
    /// One rank's token shard of the hidden state (all of it without sequence
    /// parallel): what each all-reduce moves.
    hidden: u64,
    /// One rank's token shard of its head columns: what each all-to-all moves.
    shard: u64,
    allreduces: u32,
    /// Modulation all-gathers per block and the bytes each yields per rank.
    allgathers: u32,
    gathered: u64,
}

/// Streaming state of one device group across the run: its buffers are shared by its
/// streamed parts, and block j's copy waits for block j−buffers to finish.
#[derive(Clone, Debug)]
struct GroupStream {
    buffers: usize,
    /// When each streamed block (run-wide index) finished on each rank.
    done: Vec<Vec<f64>>,
    /// Earliest start of this step's copies, per rank.
    gate: Vec<f64>,
    seen_this_step: bool,
}

/// A transformer placement being run: its device groups and their streaming state.
struct PassRun<'p> {
    tc: &'p ComponentPlan,
    groups: Vec<Group>,
    streams: Vec<GroupStream>,
    /// Each part's group.
    group_of: Vec<usize>,
}

impl<'p> PassRun<'p> {
    fn new(tc: &'p ComponentPlan) -> PassRun<'p> {
        let mut groups: Vec<Group> = Vec::new();
        let mut streams: Vec<GroupStream> = Vec::new();
        let mut group_of = Vec::new();
        for p in &tc.parts {
            let group = Group::of(p);
            let gi = match groups.iter().position(|g| g == &group) {
                Some(i) => i,
                None => {
                    groups.push(group);
                    streams.push(GroupStream {
                        buffers: 0,
                        done: vec![Vec::new(); p.devices.len()],
                        gate: vec![0.0; p.devices.len()],
                        seen_this_step: false,
                    });
                    groups.len() - 1
                }
            };
            if p.residency == Residency::Streamed {
                streams[gi].buffers = streams[gi].buffers.max(p.buffers() as usize);
            }
            group_of.push(gi);
        }
        PassRun {
            tc,
            groups,
            streams,
            group_of,
        }
    }
}

pub(crate) struct Sim<'a> {
    pub(crate) plan: &'a Plan,
    pub(crate) model: &'a ModelSpec,
    pub(crate) machine: &'a Machine,
    pub(crate) ctx: Ctx<'a>,
    pub(crate) opts: SimOptions,
    pub(crate) devs: Vec<Streams>,
    pub(crate) events: Vec<Event>,
    pub(crate) allocs: Vec<Alloc>,
    cache: HashMap<(String, Group), BlockInfo>,
    pub(crate) host_ram: u64,
    pub(crate) host_pinned: u64,
    pub(crate) pinned_parts: Vec<Live>,
    pub(crate) host_ram_items: Vec<Live>,
    pub(crate) streamed_per_step: u64,
    pub(crate) weights: Vec<u64>,
    pub(crate) buffers: Vec<u64>,
}

/// Simulates one request with the given refinements (see [`SimOptions`]).
pub fn simulate_with(
    plan: &Plan,
    model: &ModelSpec,
    machine: &Machine,
    opts: SimOptions,
) -> Result<SimReport, SimError> {
    mold_cost::validate(plan, model, machine).map_err(|e| SimError::Invalid(e.to_string()))?;
    let mut devs: Vec<Streams> = machine
        .devices
        .iter()
        .map(|d| Streams {
            id: d.id.clone(),
            compute: 0.0,
            copy: 0.0,
            comm: 0.0,
            busy: Vec::new(),
        })
        .collect();
    devs.push(Streams {
        id: DeviceId::Host,
        compute: 0.0,
        copy: 0.0,
        comm: 0.0,
        busy: Vec::new(),
    });
    let n = devs.len();
    let mut sim = Sim {
        plan,
        model,
        machine,
        ctx: Ctx::for_plan(model, machine, plan),
        opts,
        devs,
        events: Vec::new(),
        allocs: Vec::new(),
        cache: HashMap::new(),
        host_ram: 0,
        host_pinned: 0,
        pinned_parts: Vec::new(),
        host_ram_items: Vec::new(),
        streamed_per_step: 0,
        weights: vec![0; n],
        buffers: vec![0; n],
    };
    Ok(sim.run())
}

impl<'a> Sim<'a> {
    fn di(&self, d: &DeviceId) -> usize {
        self.devs
            .iter()
            .position(|s| &s.id == d)
            .expect("validated: the plan names only the machine's devices")
    }

    fn host(&self) -> usize {
        self.devs.len() - 1
    }

    #[allow(clippy::too_many_arguments)]
    fn event(
        &mut self,
        dev: usize,
        lane: Lane,
        kind: EventKind,
        start: f64,
        end: f64,
        what: String,
        phase: &str,
    ) {
        if lane == Lane::Compute && end > start {
            let busy = &mut self.devs[dev].busy;
            let at = busy.partition_point(|&(a, _)| a <= start);
            busy.insert(at, (start, end));
        }
        self.events.push(Event {
            device: self.devs[dev].id.clone(),
            lane,
            kind,
            start_s: start,
            end_s: end,
            what,
            phase: phase.to_string(),
        });
    }

    fn alloc(
        &mut self,
        dev: usize,
        start: f64,
        end: Option<f64>,
        bytes: u64,
        what: String,
        moment: &str,
    ) {
        if bytes == 0 {
            return;
        }
        if dev == self.host() {
            return;
        }
        self.allocs.push(Alloc {
            dev,
            start,
            end,
            bytes,
            what,
            moment: moment.to_string(),
        });
    }

    /// A block kind on a group: the cost model's figures, and each rank's own compute
    /// time (the cost model's time for a group of that rank alone in the same layout, so
    /// the group's figure is the slowest rank's).
    fn info(&mut self, kind_name: &str, group: &Group, dtype: DType) -> BlockInfo {
        let key = (kind_name.to_string(), group.clone());
        if let Some(i) = self.cache.get(&key) {
            return i.clone();
        }
        let (_, kind) = self
            .model
            .transformer
            .kind(kind_name)
            .expect("validated: known block kind");
        let cost = self.ctx.block(kind, group, dtype);
        let per_rank_s: Vec<f64> = group
            .devices
            .iter()
            .map(|d| {
                let alone = Group::new(vec![d.clone(); group.len()], group.tp, group.sp);
                self.ctx.block(kind, &alone, dtype).compute_s
            })
            .collect();
        let act = dtype.activation_bytes();
        let local = kind
            .stream_token_count(self.ctx.tokens)
            .div_ceil(group.sp.max(1) as u64);
        debug_assert!(
            (per_rank_s.iter().cloned().fold(0.0, f64::max) - cost.compute_s).abs()
                <= 1e-12 * cost.compute_s.max(1.0)
        );
        let info = BlockInfo {
            cost,
            per_rank_s,
            hidden: mold_models::product(&[self.ctx.batch, local, kind.hidden, act]),
            shard: mold_models::product(&[
                self.ctx.batch,
                local,
                kind.hidden.div_ceil(group.tp.max(1) as u64),
                act,
            ]),
            allreduces: kind.allreduces,
            allgathers: kind.allgathers(),
            gathered: kind.per_sample_bytes(self.ctx.batch, dtype.activation_bytes()),
        };
        self.cache.insert(key, info.clone());
        info
    }

    /// The source rank with the fastest link to `to`.
    fn best_source(&self, from: &[DeviceId], to: &DeviceId) -> (DeviceId, f64) {
        let mut best = (from[0].clone(), self.machine.transfer_gbps(&from[0], to));
        for s in &from[1..] {
            let g = self.machine.transfer_gbps(s, to);
            if g > best.1 {
                best = (s.clone(), g);
            }
        }
        best
    }

    /// Conditioning bytes one text encoder hands the transformer (the negative prompt's
    /// too under true CFG).
    fn conditioning_bytes(&self, name: &str, dtype: DType) -> u64 {
        match self.model.component(name).map(|c| &c.work) {
            Some(Workkind::TextEncoder { hidden, .. }) => {
                self.ctx.conditioning_bytes(*hidden, dtype)
            }
            _ => 0,
        }
    }

    /// Bytes of the latents (f32) between steps and into the VAE.
    fn latent_bytes(&self) -> u64 {
        self.ctx.latent_bytes()
    }
}
