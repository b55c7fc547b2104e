//! The event simulation: one request, list-scheduled in the executor's issue order on
//! per-device streams, then a sweep over each device's allocations for its memory.

use crate::text::{gbps_text, human, list};
use crate::{Event, EventKind, Lane, Live, SimError, SimOptions, SimReport};
use mold_cost::{BlockCost, Ctx, Group};
use mold_machine::Machine;
use mold_models::{ModelSpec, Workkind};
use mold_plan::{
    CfgMode, ComponentPlan, ComponentRole, DType, DeviceId, MemoryPhases, Plan, Residency,
};
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
        ctx: Ctx::new(model, machine, &plan.workload),
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

    /// Components' weights (the encoders' first, then the VAE's, as allocation
    /// indices) and host memory: loaded at the start (see [`Sim::phase_allocs`]).
    fn load_components(&mut self, plan: &Plan) -> (Vec<usize>, Vec<usize>) {
        let (mut encoders, mut vaes) = (Vec::new(), Vec::new());
        for c in &plan.components {
            if c.role == ComponentRole::Transformer {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            let on = self.di(&c.parts[0].devices[0]);
            let w = spec.weight_bytes(c.dtype);
            if on == self.host() {
                let act = self.ctx.component_activation(spec, c.dtype);
                self.host_ram += w + act;
                self.host_ram_items.push(crate::Live {
                    what: format!("{} weights and activations", c.name),
                    bytes: w + act,
                });
            } else {
                self.weights[on] += w;
                match c.role {
                    ComponentRole::Encoder => encoders.push(self.allocs.len()),
                    _ => vaes.push(self.allocs.len()),
                }
                self.alloc(on, 0.0, None, w, format!("{} weights", c.name), "load");
            }
        }
        (encoders, vaes)
    }

    /// A transformer placement's resident blocks, stream buffers, stem and pinned host
    /// memory; the allocations' indices.
    fn load_transformer(&mut self, tc: &ComponentPlan) -> Vec<usize> {
        let first = self.allocs.len();
        let dtype = tc.dtype;
        let n = self.devs.len();
        let mut resident = vec![0u64; n];
        let mut resident_ranges: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut groups: Vec<Group> = Vec::new();
        let mut group_buffers: Vec<(u64, u32, u64)> = Vec::new();
        for (pi, p) in tc.parts.iter().enumerate() {
            let group = Group::of(p);
            let gi = match groups.iter().position(|g| g == &group) {
                Some(i) => i,
                None => {
                    groups.push(group.clone());
                    group_buffers.push((0, 0, 0));
                    groups.len() - 1
                }
            };
            let mut largest = 0u64;
            for r in &p.blocks {
                let info = self.info(&r.kind, &group, dtype);
                let wb = info.cost.weight_bytes;
                match p.residency {
                    Residency::Resident => {
                        for d in &p.devices {
                            let i = self.di(d);
                            resident[i] += r.len() as u64 * wb;
                            resident_ranges[i].push(r.to_string());
                        }
                    }
                    Residency::Streamed => {
                        largest = largest.max(wb);
                        let bytes = r.len() as u64 * wb * p.devices.len() as u64;
                        self.host_pinned += bytes;
                        self.streamed_per_step += bytes;
                        self.pinned_parts.push(Live {
                            what: format!(
                                "streamed weights of part {} ({r} on {})",
                                pi + 1,
                                list(&p.devices)
                            ),
                            bytes,
                        });
                    }
                }
            }
            let set = p.buffers() as u64 * largest;
            if set > group_buffers[gi].0 {
                group_buffers[gi] = (set, p.buffers(), largest);
            }
        }
        let stem = self.model.transformer.stem_bytes(dtype);
        for i in 0..n {
            if resident[i] > 0 {
                self.weights[i] += resident[i];
                let what = format!("transformer blocks {}", resident_ranges[i].join(", "));
                self.alloc(i, 0.0, None, resident[i], what, "load");
            }
        }
        for (g, (set, count, each)) in groups.iter().zip(group_buffers) {
            for d in &g.devices {
                let i = self.di(d);
                if set > 0 {
                    self.buffers[i] += set;
                    let what = format!("stream buffers ({count} × {})", human(each));
                    self.alloc(i, 0.0, None, set, what, "load");
                }
            }
        }
        let mut stemmed = vec![false; n];
        for g in &groups {
            for d in &g.devices {
                let i = self.di(d);
                if !stemmed[i] {
                    stemmed[i] = true;
                    self.weights[i] += stem;
                    self.alloc(i, 0.0, None, stem, "transformer stem".into(), "load");
                }
            }
        }
        (first..self.allocs.len()).collect()
    }

    /// The CUDA libraries' device memory where the profile measured it
    /// ([`mold_cost::plan_libraries`], what the cost model adds to every phase): live from
    /// the start to the end of the request on each device the plan uses.
    fn load_libraries(&mut self) {
        let libraries = mold_cost::plan_libraries(self.plan, &self.ctx);
        for (i, bytes) in libraries.into_iter().enumerate() {
            self.alloc(i, 0.0, None, bytes, LIBRARIES.into(), "load");
        }
    }

    /// One-shot phases: encoders' weights live until `encoded`, the transformer's from
    /// then until `denoised`, the VAE's from then on; resident, all for the whole run.
    fn phase_allocs(
        &mut self,
        (encoders, vaes): (&[usize], &[usize]),
        transformer: &[usize],
        encoded: f64,
        denoised: f64,
    ) {
        if self.plan.memory_phases != MemoryPhases::OneShot {
            return;
        }
        for &i in encoders {
            self.allocs[i].end = Some(encoded);
        }
        for &i in transformer {
            self.allocs[i].start = encoded;
            self.allocs[i].end = Some(denoised);
        }
        for &i in vaes {
            self.allocs[i].start = denoised;
        }
    }

    fn run(&mut self) -> SimReport {
        let mode = self.plan.cfg_mode();
        // The placements that run passes: under CFG-parallel both replicas (the
        // conditional one runs the encoders and the VAE), else the plan as written.
        let placements: Vec<Plan> = match mode {
            Some(CfgMode::Parallel) => self
                .plan
                .replica_plans()
                .unwrap_or_else(|_| vec![self.plan.clone()]),
            _ => vec![self.plan.clone()],
        };
        let plan = &placements[0];
        let components = self.load_components(plan);
        let mut transformer_allocs = Vec::new();
        for p in &placements {
            if let Some(tc) = p.transformer() {
                transformer_allocs.extend(self.load_transformer(tc));
            }
        }
        self.load_libraries();
        self.host_ram += self.host_pinned;

        // Encode: each encoder on its device, then its conditioning to the
        // transformer's first devices (each replica's under CFG-parallel).
        let mut first: Vec<DeviceId> = Vec::new();
        for p in &placements {
            if let Some(t) = p.transformer() {
                for d in &t.parts[0].devices {
                    if !first.contains(d) {
                        first.push(d.clone());
                    }
                }
            }
        }
        let mut encoded = 0.0f64;
        let mut cond_ready = vec![0.0f64; self.devs.len()];
        let mut cond_allocs: Vec<usize> = Vec::new();
        for c in &plan.components {
            if c.role != ComponentRole::Encoder {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            let on_id = c.parts[0].devices[0].clone();
            let on = self.di(&on_id);
            let start = self.devs[on].compute;
            let end = start + self.ctx.component_s(spec, &on_id, c.dtype);
            self.devs[on].compute = end;
            encoded = encoded.max(end);
            let phase = format!("encode: {}", c.name);
            self.event(
                on,
                Lane::Compute,
                EventKind::Encoder,
                start,
                end,
                c.name.clone(),
                &phase,
            );
            let act = self.ctx.component_activation(spec, c.dtype);
            self.alloc(
                on,
                start,
                Some(end),
                act,
                format!("{} activations", c.name),
                &phase,
            );
            let bytes = self.conditioning_bytes(&c.name, c.dtype);
            for d in &first {
                let di = self.di(d);
                let (s, e) = if d == &on_id {
                    (end, end)
                } else {
                    let g = self.machine.transfer_gbps(&on_id, d);
                    let s = end.max(self.devs[di].comm);
                    let e = s + self.machine.transfer_s(&on_id, d, bytes);
                    self.devs[di].comm = e;
                    let what = format!(
                        "conditioning from {} ({}, {} from {})",
                        c.name,
                        human(bytes),
                        gbps_text(g),
                        on_id
                    );
                    self.event(di, Lane::Comm, EventKind::Transfer, s, e, what, "encode");
                    (s, e)
                };
                cond_ready[di] = cond_ready[di].max(e);
                if self.opts.transfer_buffers && bytes > 0 && di != self.host() {
                    cond_allocs.push(self.allocs.len());
                    self.alloc(
                        di,
                        s,
                        None,
                        bytes,
                        format!("conditioning from {}", c.name),
                        &phase,
                    );
                }
            }
        }

        let steps = plan.workload.steps;
        let sim_steps = steps.min(SIMULATED_STEPS);
        let mut denoise_start = 0.0f64;
        let mut step_ends: Vec<f64> = Vec::new();
        let mut last_group: Vec<DeviceId> = first.clone();
        let mut ready = cond_ready.clone();
        let mut runs: Vec<PassRun> = placements
            .iter()
            .filter_map(|p| p.transformer())
            .map(PassRun::new)
            .collect();
        if !runs.is_empty() {
            denoise_start = first
                .iter()
                .map(|d| cond_ready[self.di(d)])
                .fold(0.0, f64::max);
            for d in &first {
                let i = self.di(d);
                ready[i] = denoise_start;
            }
            for r in runs.iter_mut() {
                for g in r.streams.iter_mut() {
                    for x in g.gate.iter_mut() {
                        *x = denoise_start;
                    }
                }
            }
            let latent = self.latent_bytes();
            last_group = runs[0].tc.parts.last().unwrap().devices.clone();
            for s in 1..=sim_steps {
                // The step's input: the latents, back on each placement's first devices.
                if s > 1 {
                    for r in &runs {
                        let to = r.tc.parts[0].devices.clone();
                        let phase = format!("step {s}, part 1");
                        self.step_input(&last_group, &to, latent, &mut ready, &phase);
                    }
                }
                match mode {
                    None => self.pass(&mut runs[0], s, "", &mut ready),
                    Some(CfgMode::Serial) => {
                        self.pass(&mut runs[0], s, "cond", &mut ready);
                        // The unconditional pass starts when the conditional one ends.
                        let end = self.end_of(&last_group, &ready);
                        for d in &runs[0].tc.parts[0].devices {
                            let i = self.di(d);
                            ready[i] = ready[i].max(end);
                        }
                        self.pass(&mut runs[0], s, "uncond", &mut ready);
                    }
                    Some(CfgMode::Pipelined) => {
                        // Two micro-batches, each with its own inputs' readiness; the
                        // devices' streams order them.
                        let mut second = ready.clone();
                        self.pass(&mut runs[0], s, "mb0", &mut ready);
                        self.pass(&mut runs[0], s, "mb1", &mut second);
                        for (r, x) in ready.iter_mut().zip(second) {
                            *r = r.max(x);
                        }
                    }
                    Some(CfgMode::Parallel) => {
                        self.pass(&mut runs[0], s, "cond", &mut ready);
                        if runs.len() > 1 {
                            self.pass(&mut runs[1], s, "uncond", &mut ready);
                            let from = runs[1].tc.parts.last().unwrap().devices[0].clone();
                            let to = last_group[0].clone();
                            self.combine(&from, &to, latent, s, &mut ready);
                        }
                    }
                }
                step_ends.push(self.end_of(&last_group, &ready));
            }
        }
        let denoise_end = step_ends.last().copied().unwrap_or(denoise_start);
        for i in cond_allocs {
            self.allocs[i].end = Some(denoise_end);
        }
        self.phase_allocs(
            (&components.0, &components.1),
            &transformer_allocs,
            encoded,
            denoise_end,
        );

        // Decode: latents to the VAE's device, then the VAE.
        let mut sim_end = denoise_end;
        for c in &plan.components {
            if c.role != ComponentRole::Vae {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            let on_id = c.parts[0].devices[0].clone();
            let on = self.di(&on_id);
            let phase = format!("decode: {}", c.name);
            let latent = self.latent_bytes();
            let arrive = if plan.transformer().is_none() || last_group.contains(&on_id) {
                denoise_end
            } else {
                let (src, g) = self.best_source(&last_group, &on_id);
                let s = denoise_end.max(self.devs[on].comm);
                let e = s + latent as f64 / (g * 1e9);
                self.devs[on].comm = e;
                let what = format!("latents from {src} ({}, {})", human(latent), gbps_text(g));
                self.event(on, Lane::Comm, EventKind::Transfer, s, e, what, &phase);
                e
            };
            let start = arrive.max(self.devs[on].compute);
            let end = start + self.ctx.component_s(spec, &on_id, c.dtype);
            self.devs[on].compute = end;
            self.event(
                on,
                Lane::Compute,
                EventKind::Vae,
                start,
                end,
                c.name.clone(),
                &phase,
            );
            if self.opts.transfer_buffers {
                self.alloc(
                    on,
                    denoise_end.min(arrive),
                    Some(end),
                    latent,
                    "latents".into(),
                    &phase,
                );
            }
            let act = self.ctx.component_activation(spec, c.dtype);
            self.alloc(
                on,
                start,
                Some(end),
                act,
                format!("{} activations", c.name),
                &phase,
            );
            sim_end = sim_end.max(end);
        }
        for s in &self.devs {
            sim_end = sim_end.max(s.compute).max(s.copy).max(s.comm);
        }
        self.finish(denoise_start, step_ends, sim_end, sim_steps)
    }

    /// When the last of `devices` is ready.
    fn end_of(&self, devices: &[DeviceId], ready: &[f64]) -> f64 {
        devices
            .iter()
            .map(|d| ready[self.di(d)])
            .fold(0.0, f64::max)
    }

    /// One transformer pass of step `s` through `run`'s parts (`label`: which pass or
    /// micro-batch, in the events' phase), from and into `ready`.
    fn pass(&mut self, run: &mut PassRun, s: u32, label: &str, ready: &mut [f64]) {
        let tc = run.tc;
        let dtype = tc.dtype;
        let hand_bytes = self.ctx.handoff_bytes(dtype);
        for st in run.streams.iter_mut() {
            st.seen_this_step = false;
        }
        for (pi, p) in tc.parts.iter().enumerate() {
            let phase = if label.is_empty() {
                format!("step {s}, part {}", pi + 1)
            } else {
                format!("step {s}, {label}, part {}", pi + 1)
            };
            let g = run.group_of[pi];
            if pi > 0 && run.group_of[pi - 1] != g {
                let prev = tc.parts[pi - 1].devices.clone();
                self.handoff(&prev, &p.devices, hand_bytes, dtype, ready, &phase);
            }
            if p.residency == Residency::Streamed && !run.streams[g].seen_this_step {
                run.streams[g].seen_this_step = true;
                if !self.opts.prefetch {
                    for (li, d) in p.devices.iter().enumerate() {
                        run.streams[g].gate[li] = ready[self.di(d)];
                    }
                }
            }
            for r in &p.blocks {
                let info = self.info(&r.kind, &run.groups[g], dtype);
                for b in r.start..r.end {
                    let what = format!("{} {b}", r.kind);
                    let moment = format!("{phase}, {what}");
                    self.block(p, &info, &what, &moment, &phase, &mut run.streams[g], ready);
                }
            }
            // A run of parts on a sequence-parallel group ends with an all-gather of
            // the hidden state.
            if run.group_of.get(pi + 1) != Some(&g) {
                let group = run.groups[g].clone();
                self.gather(&group, hand_bytes, dtype, ready, &phase);
            }
        }
    }

    /// CFG-parallel's combine: the unconditional pass's output to the conditional one's
    /// output device.
    fn combine(&mut self, from: &DeviceId, to: &DeviceId, bytes: u64, s: u32, ready: &mut [f64]) {
        if from == to {
            return;
        }
        let (fi, ti) = (self.di(from), self.di(to));
        let start = ready[fi].max(self.devs[ti].comm);
        let end = start + self.machine.transfer_s(from, to, bytes);
        self.devs[ti].comm = end;
        let g = self.machine.transfer_gbps(from, to);
        let phase = format!("step {s}, combine");
        let what = format!(
            "unconditional output from {from} ({}, {})",
            human(bytes),
            gbps_text(g)
        );
        self.event(
            ti,
            Lane::Comm,
            EventKind::Transfer,
            start,
            end,
            what,
            &phase,
        );
        if self.opts.transfer_buffers {
            self.alloc(ti, start, Some(end), bytes, "CFG combine".into(), &phase);
        }
        ready[ti] = ready[ti].max(end);
    }

    /// Moves the next step's input to the first part's devices.
    fn step_input(
        &mut self,
        last: &[DeviceId],
        first: &[DeviceId],
        bytes: u64,
        ready: &mut [f64],
        phase: &str,
    ) {
        let done = last.iter().map(|d| ready[self.di(d)]).fold(0.0, f64::max);
        for d in first {
            let i = self.di(d);
            if last.contains(d) {
                continue;
            }
            if !self.opts.latent_return {
                ready[i] = ready[i].max(done);
                continue;
            }
            let (src, g) = self.best_source(last, d);
            let s = ready[self.di(&src)].max(self.devs[i].comm);
            let e = s + self.machine.transfer_s(&src, d, bytes);
            self.devs[i].comm = e;
            let what = format!("latents from {src} ({}, {})", human(bytes), gbps_text(g));
            self.event(i, Lane::Comm, EventKind::Transfer, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(i, s, Some(e), bytes, "latents (next step)".into(), phase);
            }
            ready[i] = e;
        }
    }

    /// Hands the hidden state from one part's group to the next part's, to every rank.
    ///
    /// The sending devices take nothing else until the last copy has ended: the
    /// executor's thread that ran the sending part makes the copies itself and waits
    /// for them before it runs anything more (`mold-exec`'s `executor/pipeline.rs`,
    /// `Executor::place`), so under pipelined CFG the next micro-batch starts on those
    /// devices after its predecessor's hand-off, as `mold_cost::pipelined_bottleneck`
    /// charges it.
    #[allow(clippy::too_many_arguments)]
    fn handoff(
        &mut self,
        from: &[DeviceId],
        to: &[DeviceId],
        bytes: u64,
        dtype: DType,
        ready: &mut [f64],
        phase: &str,
    ) {
        let moment = format!("{phase}, hand-off");
        if !self.opts.exact_handoff {
            // The planner's price: the slowest device-to-device path, for any change of
            // group.
            let done = from.iter().map(|d| ready[self.di(d)]).fold(0.0, f64::max);
            let t = self.ctx.handoff_s(dtype);
            for d in to {
                let i = self.di(d);
                let e = done + t;
                if t > 0.0 {
                    self.event(
                        i,
                        Lane::Comm,
                        EventKind::HandOff,
                        done,
                        e,
                        format!("hand-off ({}, slowest link)", human(bytes)),
                        phase,
                    );
                    self.devs[i].comm = self.devs[i].comm.max(e);
                }
                if self.opts.transfer_buffers {
                    self.alloc(i, done, Some(e), bytes, "hand-off in".into(), &moment);
                }
                ready[i] = ready[i].max(e);
            }
            self.sender_waits(from, done + t);
            return;
        }
        let mut last_end: Option<f64> = None;
        for d in to {
            if from.contains(d) {
                continue;
            }
            let i = self.di(d);
            let (src, g) = self.best_source(from, d);
            let si = self.di(&src);
            let s = ready[si].max(self.devs[i].comm);
            let e = s + self.machine.transfer_s(&src, d, bytes);
            self.devs[i].comm = e;
            let how = if let Some(net) = self.machine.network_between(&src, d) {
                format!("{} between nodes", net.kind.name())
            } else if self.machine.domain_of(&[src.clone(), d.clone()]).is_some() {
                "peer".to_string()
            } else {
                "staged through host".to_string()
            };
            let what = format!(
                "hand-off from {src} ({}, {how}, {})",
                human(bytes),
                gbps_text(g)
            );
            self.event(i, Lane::Comm, EventKind::HandOff, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(
                    i,
                    s,
                    Some(e),
                    bytes,
                    format!("hand-off in from {src}"),
                    &moment,
                );
                self.alloc(
                    si,
                    ready[si],
                    Some(e),
                    bytes,
                    format!("hand-off out to {d}"),
                    &moment,
                );
            }
            ready[i] = e;
            last_end = Some(last_end.map_or(e, |x: f64| x.max(e)));
        }
        if let Some(end) = last_end {
            self.sender_waits(from, end);
        }
    }

    /// The sending devices of a hand-off take no more work until `end`, when its last
    /// copy has ended ([`Self::handoff`]): their compute lane waits, without computing
    /// (a streamed copy beside it keeps its idle rate).
    fn sender_waits(&mut self, from: &[DeviceId], end: f64) {
        for d in from {
            let i = self.di(d);
            self.devs[i].compute = self.devs[i].compute.max(end);
        }
    }

    /// The all-gather that ends a run of parts on a sequence-parallel group: every rank
    /// receives the others' token shards of the hidden state (`bytes` in all).
    fn gather(&mut self, group: &Group, bytes: u64, dtype: DType, ready: &mut [f64], phase: &str) {
        let t = self.ctx.gather_s(group, dtype);
        if t <= 0.0 {
            return;
        }
        let s = group
            .devices
            .iter()
            .map(|d| {
                let i = self.di(d);
                ready[i].max(self.devs[i].comm)
            })
            .fold(0.0, f64::max);
        let e = s + t;
        let moment = format!("{phase}, all-gather");
        for d in &group.devices {
            let i = self.di(d);
            self.devs[i].comm = e;
            let what = format!(
                "all-gather of the hidden state ({}, sp{})",
                human(bytes),
                group.sp
            );
            self.event(i, Lane::Comm, EventKind::AllGather, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(i, s, Some(e), bytes, "all-gather buffer".into(), &moment);
            }
            ready[i] = e;
            // On the compute stream, as a block's collectives ([`Self::block`]).
            self.devs[i].compute = self.devs[i].compute.max(e);
        }
    }

    /// One block on its group: copy (streamed), compute on each rank, all-reduces and
    /// all-to-alls.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &mut self,
        p: &mold_plan::Part,
        info: &BlockInfo,
        what: &str,
        moment: &str,
        phase: &str,
        st: &mut GroupStream,
        ready: &mut [f64],
    ) {
        let group = &p.devices;
        let streamed = p.residency == Residency::Streamed;
        let bc = info.cost;
        let mut starts = Vec::with_capacity(group.len());
        let mut ends = Vec::with_capacity(group.len());
        for (li, d) in group.iter().enumerate() {
            let i = self.di(d);
            let mut copied = 0.0f64;
            if streamed {
                let j = st.done[li].len();
                let buffer_free = if j >= st.buffers {
                    st.done[li][j - st.buffers]
                } else {
                    0.0
                };
                let s = self.devs[i].copy.max(st.gate[li]).max(buffer_free);
                let e = copy_end(&self.devs[i].busy, s, bc.copy_s, 1.0 - bc.copy_contention);
                self.devs[i].copy = e;
                self.event(
                    i,
                    Lane::Copy,
                    EventKind::Copy,
                    s,
                    e,
                    format!("copy {what} ({})", human(bc.weight_bytes)),
                    phase,
                );
                copied = e;
            }
            let s = self.devs[i].compute.max(ready[i]).max(copied);
            let e = s + info.per_rank_s[li];
            self.devs[i].compute = e;
            let kind = if streamed {
                EventKind::StreamedBlock
            } else {
                EventKind::Block
            };
            self.event(i, Lane::Compute, kind, s, e, what.to_string(), phase);
            starts.push(s);
            ends.push(e);
        }
        let mut done = ends.clone();
        let link = self.machine.group_link(group);
        let via = match (link.network, link.staged, link.kind) {
            (Some(n), ..) => format!("{} between nodes", n.name()),
            (None, true, _) => "staged through host".to_string(),
            (None, false, Some(k)) => format!("{k:?}").to_lowercase(),
            (None, false, None) => "peer".to_string(),
        };
        let allreduce = if info.allgathers > 0 {
            format!(
                "all-reduce ×{} + all-gather after {what} ({} each, {} gathered, {via})",
                info.allreduces,
                human(info.hidden),
                human(info.gathered)
            )
        } else {
            format!(
                "all-reduce ×{} after {what} ({} each, {via})",
                info.allreduces,
                human(info.hidden)
            )
        };
        let alltoall = format!(
            "all-to-all ×{} in {what} ({} shard each, {via})",
            mold_cost::ALLTOALLS_PER_BLOCK,
            human(info.shard)
        );
        // Tensor-parallel all-reduces, then sequence-parallel all-to-alls: each joins
        // the group, starting when its slowest rank is ready.
        let collectives = [
            (
                bc.allreduce_s,
                EventKind::AllReduce,
                allreduce,
                info.hidden,
                "all-reduce buffer",
            ),
            (
                bc.alltoall_s,
                EventKind::AllToAll,
                alltoall,
                info.shard,
                "all-to-all buffer",
            ),
        ];
        for (seconds, kind, w, bytes, buffer) in collectives {
            if group.len() < 2 || seconds <= 0.0 {
                continue;
            }
            let mut s = 0.0f64;
            for (li, d) in group.iter().enumerate() {
                s = s.max(done[li]).max(self.devs[self.di(d)].comm);
            }
            let e = s + seconds;
            for (li, d) in group.iter().enumerate() {
                let i = self.di(d);
                self.devs[i].comm = e;
                self.event(i, Lane::Comm, kind, s, e, w.clone(), phase);
                if self.opts.transfer_buffers {
                    self.alloc(i, s, Some(e), bytes, buffer.into(), moment);
                }
                done[li] = e;
            }
        }
        for (li, d) in group.iter().enumerate() {
            let i = self.di(d);
            self.alloc(
                i,
                starts[li],
                Some(done[li]),
                bc.activation_bytes,
                format!("activations of {what}"),
                moment,
            );
            ready[i] = done[li];
            // The executor runs a block's collectives on the device's compute stream:
            // nothing else (another micro-batch's block under pipelined CFG) computes
            // there before they end.
            self.devs[i].compute = self.devs[i].compute.max(done[li]);
            if streamed {
                st.done[li].push(done[li]);
            }
        }
    }
}
