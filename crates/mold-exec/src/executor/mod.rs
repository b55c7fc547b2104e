//! The executor: runs the transformer component of a plan, part by part, for any model
//! family ([`Transformer`]). It owns placement (which rank runs which blocks on which
//! device), residency (resident, streamed through a ring, or synchronously copied),
//! hand-offs between parts and the communicators of tensor-parallel groups; the model
//! owns the maths.
//!
//! - [`plan_check`]: the plan's parts against the model, before anything loads;
//! - `build` (here): devices, weights, rings and communicators;
//! - [`rank`]: one part's ranks running their blocks (threads for tensor parallelism);
//! - [`pipeline`]: several micro-batches through the parts at once (a thread per stage);
//! - [`multiprocess`]: a run spread over several processes.

mod copy_out;
mod load_ahead;
mod multiprocess;
pub mod pipeline;
pub mod plan_check;
mod rank;
mod read_resident;
mod replicate;

pub use pipeline::MicroBatchSpan;

pub use plan_check::{check_plan, compute_dtype, weights_dtype};

use crate::checkpoint::Checkpoint;
use crate::comm::Comm;
use crate::dist::{LocalDevices, Mesh};
use crate::error::{ExecError, Result};
use crate::model::modulation::ModulationCache;
use crate::model::{ActivationMeter, BlockRef, Profiler, Shard, Transformer, Weights};
use crate::options::ExecOptions;
use crate::runtime::{self, CheckpointSource, DeviceMap, DeviceMemory, Held};
use crate::streaming::{self, Ring, Streaming};
use candle_core::{DType, Device, Tensor};
use mold_plan::{DeviceId, Plan, Residency};
use multiprocess::DistRt;
use plan_check::{check_parts, transformer_of};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// One profiled phase: `(label, seconds, marks)`.
pub type PhaseTime = (&'static str, f64, u64);

/// One rank of a part: its device, the weights it holds, its meters.
struct Rank<M: Transformer> {
    id: DeviceId,
    /// This rank's index in its part's group.
    index: usize,
    device: Device,
    stem: Option<M::Stem>,
    final_layer: Option<M::Final>,
    blocks: Vec<Held<M::Block>>,
    meter: ActivationMeter,
    profile: Profiler,
    /// Phase times of each micro-batch index of [`Executor::forward_micro_batches`]
    /// (grown on first use), apart from [`Rank::profile`]'s single calls.
    mb_profiles: Mutex<Vec<Arc<Profiler>>>,
    /// The blocks' modulation outputs computed ahead for a window of steps
    /// ([`crate::model::modulation`]).
    ahead: ModulationCache,
    resident_bytes: u64,
    /// `sync` streaming: the largest streamed block and the host bytes of all of them.
    sync_stream_bytes: u64,
    sync_host_bytes: u64,
}

impl<M: Transformer> Rank<M> {
    /// The profiler of micro-batch `j`.
    fn mb_profile(&self, j: usize) -> Arc<Profiler> {
        let mut v = self.mb_profiles.lock().unwrap_or_else(|e| e.into_inner());
        while v.len() <= j {
            v.push(Arc::new(Profiler::with_events(self.profile.events())));
        }
        v[j].clone()
    }

    /// Every phase this rank timed, largest first: single calls under the model's labels,
    /// micro-batch `j` under `mb{j} <label>`.
    fn profile_report(&self) -> Vec<PhaseTime> {
        let mut out = self.profile.report();
        let mbs = self.mb_profiles.lock().unwrap_or_else(|e| e.into_inner());
        for (j, p) in mbs.iter().enumerate() {
            out.extend(
                p.report()
                    .into_iter()
                    .map(|(label, s, n)| (mb_label(j, label), s, n)),
            );
        }
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }
}

/// `mb{j} {label}` as a static label, made once per pair: the model's phase labels are
/// a fixed set and micro-batch indices are bounded by the largest call, so the few
/// strings this keeps for the process's lifetime are bounded too.
fn mb_label(j: usize, label: &'static str) -> &'static str {
    static LABELS: Mutex<BTreeMap<(usize, &'static str), &'static str>> =
        Mutex::new(BTreeMap::new());
    let mut m = LABELS.lock().unwrap_or_else(|e| e.into_inner());
    m.entry((j, label))
        .or_insert_with(|| Box::leak(format!("mb{j} {label}").into_boxed_str()))
}

/// Which ranks get their resident blocks copied from another rank's device at load, by
/// the rank that reads them: `ranks` are this process's `(rank, device)` of a part in rank
/// order, sharded over `tp`. The first rank of each shard reads the checkpoint; a later
/// rank of the same shard follows it where [`runtime::copies_directly`] allows, and reads
/// for itself where not. Returns each reading rank's followers, in rank order.
fn followers_of(
    ranks: &[(usize, Device)],
    tp: usize,
    peer_copies: bool,
) -> HashMap<usize, Vec<(usize, Device)>> {
    let mut reader_of_shard: HashMap<usize, (usize, &Device)> = HashMap::new();
    let mut out: HashMap<usize, Vec<(usize, Device)>> = HashMap::new();
    for (rank, device) in ranks {
        match reader_of_shard.get(&(rank % tp.max(1))) {
            Some((reader, from)) if runtime::copies_directly(from, device, peer_copies) => {
                out.entry(*reader)
                    .or_default()
                    .push((*rank, device.clone()));
            }
            Some(_) => {}
            None => {
                reader_of_shard.insert(rank % tp.max(1), (*rank, device));
            }
        }
    }
    out
}

struct PartRt<M: Transformer> {
    /// Every device of the part (the group), in rank order.
    devices: Vec<DeviceId>,
    /// Tensor- and sequence-parallel degrees ([`PartSpec`]).
    tp: usize,
    sp: usize,
    /// The next part runs on the same devices with the same layout (sequence parallel,
    /// one process): each rank hands its slice of the sequence straight to the same rank
    /// of the next part ([`Flow::Sliced`]) instead of gathering and scattering it again.
    keep_sliced: bool,
    steps: Vec<BlockRef>,
    /// The ranks this process runs (all of them in a one-process run).
    ranks: Vec<Rank<M>>,
    /// How this process opens each of `ranks` (`cuda:K` of its own GPUs).
    local_ids: Vec<DeviceId>,
    /// Communicators of `ranks`, made once, for a group that spans processes.
    comms: Option<Vec<Box<dyn Comm>>>,
}

/// What flows between parts: a model's activations, each rank's slice of them (between
/// sequence-parallel parts of the same layout, [`PartRt::keep_sliced`]), the
/// activations already copied to each rank's device of the next part (between the
/// stages of [`Executor::forward_micro_batches`]), or the model's output after the final
/// layer.
#[derive(Clone)]
enum Flow<A> {
    Acts(A),
    Sliced(Vec<A>),
    Placed {
        /// One copy per rank of the next part, on its device.
        copies: Vec<A>,
        /// What they were copied from, kept alive until the next part has finished
        /// (with a stream per device nothing else waits for the copy to have read it).
        _source: A,
    },
    Out(Tensor),
}

/// Runs the transformer of a plan. Weights are loaded once by [`Executor::new`];
/// [`Executor::forward`] can then be called once per denoising step.
pub struct Executor<M: Transformer> {
    model: M,
    dtype: DType,
    /// The products' weights are FP8 ([`weights_dtype`]).
    fp8: bool,
    /// The FP8 blocks' attention runs in FP8 ([`Executor::fp8_attention`]).
    fp8_attention: bool,
    parts: Vec<PartRt<M>>,
    opts: ExecOptions,
    /// One per device that runs streamed blocks (pipelined streaming).
    rings: Vec<(DeviceId, Mutex<Ring<M::Block>>)>,
    dist: Option<DistRt>,
    /// When each part ran each micro-batch in the last
    /// [`Executor::forward_micro_batches`] call.
    timeline: Mutex<Vec<MicroBatchSpan>>,
    /// Times a part's kernels were waited for before the next part ran
    /// ([`Executor::part_waits`]).
    waits: std::sync::atomic::AtomicU64,
    /// Resident blocks a rank copied from another rank's device at load instead of
    /// reading them from the checkpoint ([`Executor::blocks_copied`]).
    blocks_copied: usize,
    /// Where the load's time went ([`Executor::load_phases`]).
    load_phases: Vec<(&'static str, f64)>,
}

impl<M: Transformer> std::fmt::Debug for Executor<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("family", &self.model.family())
            .field("dtype", &self.dtype)
            .field(
                "parts",
                &self.parts.iter().map(|p| &p.devices).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A part as the executor builds it.
struct PartSpec {
    devices: Vec<DeviceId>,
    /// Tensor- and sequence-parallel degrees (`tp · sp` = devices; device `i` is
    /// tensor-parallel rank `i % tp` of sequence-parallel rank `i / tp`).
    tp: usize,
    sp: usize,
    residency: Residency,
    buffers: usize,
    steps: Vec<BlockRef>,
}

/// The device lists of every communicator group of two or more devices the parts of a
/// one-process plan will ask for ([`rank::group_members`]), in the parts' order.
fn group_device_lists(specs: &[PartSpec]) -> Vec<Vec<DeviceId>> {
    let mut lists = Vec::new();
    for s in specs {
        let (tp, sp) = rank::group_members(s.tp, s.sp);
        for members in tp.into_iter().chain(sp) {
            if members.len() > 1 {
                lists.push(members.iter().map(|&i| s.devices[i].clone()).collect());
            }
        }
    }
    lists
}

/// Starts making, on a thread of its own, the communicator groups of
/// [`group_device_lists`], each dropped once made: NCCL groups go to their pool and the first
/// call takes them from there. None where there is no such group.
fn warm_groups(
    specs: &[PartSpec],
    comm: &crate::comm::CommOptions,
) -> Option<std::thread::JoinHandle<()>> {
    warm_lists(group_device_lists(specs), comm)
}

/// Starts and drops the communicators of `lists` on a thread of its own.
fn warm_lists(
    lists: Vec<Vec<DeviceId>>,
    comm: &crate::comm::CommOptions,
) -> Option<std::thread::JoinHandle<()>> {
    if lists.is_empty() {
        return None;
    }
    let comm = comm.clone();
    std::thread::Builder::new()
        .name("mold-comm-warm".into())
        .spawn(move || {
            for ids in lists {
                drop(crate::comm::make_group(&ids, &comm, None));
            }
        })
        .ok()
}

impl<M: Transformer> Executor<M> {
    /// Checks the model, the checkpoint headers and the plan (no tensor data read), then
    /// loads each part's weights onto its devices (each rank reads only its own blocks
    /// and shards) in the plan's transformer dtype, with default options.
    pub fn new(model: &M, plan: &Plan, ckpt: &Checkpoint) -> Result<Self> {
        Self::with_options(model, plan, ckpt, ExecOptions::default())
    }

    /// [`Executor::new`] with explicit options. Refuses, before reading any weight, a
    /// plan whose streamed weights do not fit the host memory available
    /// ([`streaming::host_memory_available`]).
    pub fn with_options(
        model: &M,
        plan: &Plan,
        ckpt: &Checkpoint,
        opts: ExecOptions,
    ) -> Result<Self> {
        Self::new_in(model, plan, ckpt, opts, None)
    }

    /// [`Executor::new`] with default options except how streamed blocks are copied.
    pub fn new_with_streaming(
        model: &M,
        plan: &Plan,
        ckpt: &Checkpoint,
        streaming: Streaming,
    ) -> Result<Self> {
        let opts = ExecOptions {
            streaming,
            ..ExecOptions::default()
        };
        Self::new_in(model, plan, ckpt, opts, None)
    }

    /// This process's share of a multi-process run ([`crate::dist`]): loads and runs only
    /// the ranks on the devices `local` gives this process (resolved at the CLI edge,
    /// [`LocalDevices::resolve`]), opened under the ids it maps them to; activations cross
    /// processes over `mesh`, and every process's [`Executor::forward`] returns the same
    /// output (on the host in the processes that do not run the final layer). Every
    /// process must call it, then `forward` with the same inputs, in the same order.
    pub fn new_multi_process(
        model: &M,
        plan: &Plan,
        ckpt: &Checkpoint,
        opts: ExecOptions,
        mesh: Arc<Mesh>,
        local: LocalDevices,
    ) -> Result<Self> {
        Self::new_in(model, plan, ckpt, opts, Some((mesh, local)))
    }

    fn new_in(
        model: &M,
        plan: &Plan,
        ckpt: &Checkpoint,
        opts: ExecOptions,
        mesh: Option<(Arc<Mesh>, LocalDevices)>,
    ) -> Result<Self> {
        model.validate().map_err(ExecError::Config)?;
        let comp = transformer_of(plan)?;
        let (dtype, fp8) = weights_dtype(comp.dtype)?;
        // The plan's attention precision, unless the options override it.
        let fp8_attention = fp8 && opts.fp8.attention.unwrap_or(comp.fp8_attention());
        let steps = check_parts(model, &comp.parts)?;
        ckpt.check(model, &plan.model.id)?;
        let specs = comp
            .parts
            .iter()
            .zip(steps)
            .map(|(p, steps)| PartSpec {
                devices: p.devices.clone(),
                tp: p.tp as usize,
                sp: p.sp as usize,
                residency: p.residency,
                buffers: p.buffers().max(1) as usize,
                steps,
            })
            .collect();
        let dist = match mesh {
            None => None,
            Some((mesh, local)) => Some(DistRt::new(mesh, local, &comp.parts)?),
        };
        Self::build(model, ckpt, specs, (dtype, fp8, fp8_attention), opts, dist)
    }

    /// The reference: the same model, unsharded, every block resident on one device,
    /// with default options ([`Executor::with_kernels`] picks its kernels).
    pub fn reference(
        model: &M,
        ckpt: &Checkpoint,
        device: &DeviceId,
        dtype: DType,
    ) -> Result<Self> {
        Self::reference_products(model, ckpt, device, dtype, false)
    }

    /// [`Executor::reference`] with the products' weights in FP8 where `fp8` (the
    /// reference for an FP8 plan: the same quantized weights, unsharded).
    pub fn reference_products(
        model: &M,
        ckpt: &Checkpoint,
        device: &DeviceId,
        dtype: DType,
        fp8: bool,
    ) -> Result<Self> {
        model.validate().map_err(ExecError::Config)?;
        ckpt.check(model, "the given model config")?;
        let spec = PartSpec {
            devices: vec![device.clone()],
            tp: 1,
            sp: 1,
            residency: Residency::Resident,
            buffers: 0,
            steps: model.all_blocks(),
        };
        Self::build(
            model,
            ckpt,
            vec![spec],
            (dtype, fp8, false),
            ExecOptions::default(),
            None,
        )
    }

    /// Refuses streamed weights that the host cannot hold, before anything is read: each
    /// streamed block is sized per rank from the checkpoint's headers
    /// ([`runtime::ShapeSource`]).
    fn check_host_memory(
        model: &M,
        ckpt: &Checkpoint,
        specs: &[PartSpec],
        dtype: DType,
        limit: Option<u64>,
        local: &dyn Fn(&DeviceId) -> bool,
    ) -> Result<()> {
        let shapes = runtime::ShapeSource {
            ckpt,
            dtype,
            fp8: false,
        };
        let mut need = 0u64;
        let mut blocks = 0usize;
        for s in specs.iter().filter(|s| s.residency == Residency::Streamed) {
            for i in (0..s.devices.len()).filter(|r| local(&s.devices[*r])) {
                let shard = Shard {
                    rank: i % s.tp,
                    world: s.tp,
                };
                for step in &s.steps {
                    need += model.load_block(&shapes, *step, shard)?.bytes();
                }
            }
            blocks += s.steps.len();
        }
        if need == 0 {
            return Ok(());
        }
        match streaming::host_memory_available(limit) {
            Some((available, from)) if need > available => Err(ExecError::HostMemory {
                blocks,
                need: mold_plan::ByteSize(need),
                available: mold_plan::ByteSize(available),
                source_: from.to_string(),
            }),
            _ => Ok(()),
        }
    }

    fn build(
        model: &M,
        ckpt: &Checkpoint,
        specs: Vec<PartSpec>,
        (dtype, fp8, fp8_attention): (DType, bool, bool),
        opts: ExecOptions,
        dist: Option<DistRt>,
    ) -> Result<Self> {
        crate::model::fp8::configure(opts.fp8);
        if let Some(pi) = specs
            .iter()
            .position(|s| fp8 && s.residency != Residency::Resident)
        {
            return Err(ExecError::Plan(format!(
                "part {pi}: FP8 weights are held resident only: set its residency to resident (`mold plan --dtype transformer=fp8` plans that), or plan the transformer in bf16"
            )));
        }
        if let Some(f) = &opts.fault {
            let kinds = model.block_kinds();
            match kinds.iter().find(|(k, _)| *k == f.block_kind) {
                Some((_, n)) if f.block_index < *n => {}
                _ => {
                    let valid: Vec<String> =
                        kinds.iter().map(|(k, n)| format!("{k} 0..{n}")).collect();
                    return Err(ExecError::Input(format!(
                        "MOLD_FAULT: {} has no block `{} {}` (valid: {})",
                        model.family(),
                        f.block_kind,
                        f.block_index,
                        valid.join(", ")
                    )));
                }
            }
        }
        // How this process opens a plan device it runs (None: another process runs it).
        let local_id = |d: &DeviceId| -> Option<DeviceId> {
            match &dist {
                None => Some(d.clone()),
                Some(x) => x.local.local_id(d),
            }
        };
        let mut devmap = DeviceMap::new(opts.deterministic);
        // Resolve every device before reading any weight.
        for s in &specs {
            for d in s.devices.iter().filter_map(local_id) {
                devmap.get(&d)?;
            }
        }
        Self::check_host_memory(model, ckpt, &specs, dtype, opts.host_memory, &|d| {
            local_id(d).is_some()
        })?;
        let t_load = std::time::Instant::now();
        let (mut read_s, mut copy_s) = (0.0, 0.0);
        // The communicators of a one-process run start while the weights load (NCCL's take
        // about a second for four GPUs), instead of in the first step.
        let warm_now = dist.is_none() && opts.comm.warm_during_load;
        let warm_later = dist.is_none() && !opts.comm.warm_during_load;
        let mut warming = if warm_now {
            warm_groups(&specs, &opts.comm)
        } else {
            None
        };
        let group_lists = if warm_later {
            group_device_lists(&specs)
        } else {
            Vec::new()
        };
        let mut rings: Vec<(DeviceId, Ring<M::Block>)> = Vec::new();
        let src = CheckpointSource { ckpt, dtype, fp8 };
        let shapes = runtime::ShapeSource { ckpt, dtype, fp8 };
        let n = specs.len();
        let mut parts = Vec::with_capacity(n);
        let mut blocks_copied = 0;
        for (pi, spec) in specs.into_iter().enumerate() {
            let world = spec.devices.len();
            let mut ranks = Vec::with_capacity(world);
            // The ranks holding a shard another rank of this process reads (a
            // sequence-parallel group's) get its resident blocks copied device to device as
            // each block is uploaded, instead of reading the checkpoint again
            // ([`runtime::copies_directly`]): the copies run beside the reading.
            let followers = if spec.residency == Residency::Resident {
                let mut ranks_devices = Vec::new();
                for (rank, id) in spec.devices.iter().enumerate() {
                    if let Some(lid) = local_id(id) {
                        ranks_devices.push((rank, devmap.get(&lid)?));
                    }
                }
                followers_of(&ranks_devices, spec.tp, opts.peer_copies)
            } else {
                HashMap::new()
            };
            let mut copied: HashMap<usize, Vec<M::Block>> = HashMap::new();
            // Resident blocks of the ranks that read the checkpoint, read by all of them at
            // once (each on its own thread), the followers' copies with them.
            let mut pre_read: HashMap<usize, Vec<M::Block>> = HashMap::new();
            if spec.residency == Residency::Resident {
                let following: Vec<usize> = followers.values().flatten().map(|(r, _)| *r).collect();
                let mut reading = Vec::new();
                for (rank, id) in spec.devices.iter().enumerate() {
                    if let Some(lid) = local_id(id) {
                        if !following.contains(&rank) {
                            reading.push((rank, id.clone(), devmap.get(&lid)?));
                        }
                    }
                }
                let share = reading.len();
                let read_one = |(rank, id, device): &(usize, DeviceId, Device)| {
                    let shard = Shard {
                        rank: rank % spec.tp,
                        world: spec.tp,
                    };
                    let mine = followers.get(rank).map_or(&[][..], |f| &f[..]);
                    read_resident::read_resident(
                        model,
                        src,
                        &spec.steps,
                        shard,
                        device,
                        id,
                        mine,
                        &opts,
                        share,
                    )
                };
                let t = std::time::Instant::now();
                let reads: Vec<Result<_>> = if share > 1 {
                    std::thread::scope(|s| {
                        let threads: Vec<_> = reading
                            .iter()
                            .map(|r| s.spawn(move || read_one(r)))
                            .collect();
                        threads
                            .into_iter()
                            .map(|t| {
                                t.join().unwrap_or_else(|_| {
                                    Err(ExecError::Plan("a weight-reading thread panicked".into()))
                                })
                            })
                            .collect()
                    })
                } else {
                    reading.iter().map(read_one).collect()
                };
                let mut longest_read: f64 = 0.0;
                for ((rank, _, _), read) in reading.iter().zip(reads) {
                    let read = read?;
                    longest_read = longest_read.max(read.read_s);
                    let mine = followers.get(rank).map_or(&[][..], |f| &f[..]);
                    for ((to, _), c) in mine.iter().zip(read.copies) {
                        copied.insert(*to, c);
                    }
                    pre_read.insert(*rank, read.blocks);
                }
                // The copies' wait after the longest reading; without copies, all reading.
                let wall = t.elapsed().as_secs_f64();
                if followers.is_empty() {
                    read_s += wall;
                } else {
                    read_s += longest_read;
                    copy_s += (wall - longest_read).max(0.0);
                }
            }
            let mut host_stem = None;
            let mut local_ids = Vec::with_capacity(world);
            for (rank, id) in spec.devices.iter().enumerate() {
                let Some(lid) = local_id(id) else { continue };
                let device = devmap.get(&lid)?;
                local_ids.push(lid);
                // Weights are sharded over the tensor-parallel group only: the ranks
                // of a sequence-parallel group hold the same shard.
                let shard = Shard {
                    rank: rank % spec.tp,
                    world: spec.tp,
                };
                let mut resident_bytes = 0;
                let mut sync_stream_bytes = 0;
                let mut sync_host_bytes = 0;
                let stem = if pi == 0 {
                    // Read once for every rank of the part.
                    if host_stem.is_none() {
                        host_stem = Some(model.load_stem(&src)?);
                    }
                    let s = host_stem
                        .as_ref()
                        .map(|h| h.to_device(&device))
                        .transpose()?;
                    resident_bytes += s.as_ref().map_or(0, |s| s.bytes());
                    s
                } else {
                    None
                };
                let final_layer = if pi == n - 1 && rank == 0 {
                    let f = model.load_final(&src)?.to_device(&device)?;
                    resident_bytes += f.bytes();
                    Some(f)
                } else {
                    None
                };
                let mut blocks = Vec::with_capacity(spec.steps.len());
                if let Some(copies) = copied.remove(&rank) {
                    for copy in copies {
                        resident_bytes += copy.bytes();
                        blocks.push(Held::Resident(copy));
                        blocks_copied += 1;
                    }
                } else if let Some(read) = pre_read.remove(&rank) {
                    for b in read {
                        resident_bytes += b.bytes();
                        blocks.push(Held::Resident(b));
                    }
                } else if spec.residency == Residency::Resident {
                    return Err(ExecError::Plan(format!(
                        "part {pi}: rank {rank}'s resident blocks were neither read nor copied (a bug in mold: please report it)"
                    )));
                } else {
                    // Streamed blocks: read here in order, each added to its device's ring
                    // or kept on the host.
                    let t = std::time::Instant::now();
                    let mut largest = 0;
                    for step in &spec.steps {
                        largest = largest.max(model.load_block(&shapes, *step, shard)?.bytes());
                    }
                    let readers = load_ahead::readers(largest);
                    let steps = &spec.steps;
                    load_ahead::in_order(
                        steps.len(),
                        readers,
                        readers,
                        |i| model.load_block(&src, steps[i], shard),
                        |_, b| {
                            let bytes = b.bytes();
                            blocks.push(if opts.streaming == Streaming::Sync {
                                sync_host_bytes += bytes;
                                sync_stream_bytes = sync_stream_bytes.max(bytes);
                                Held::Sync(b)
                            } else {
                                let ri = match rings.iter().position(|(d, _)| d == id) {
                                    Some(i) => i,
                                    None => {
                                        rings.push((
                                            id.clone(),
                                            Ring::new(
                                                device.clone(),
                                                dtype,
                                                opts.streaming,
                                                spec.buffers,
                                            ),
                                        ));
                                        rings.len() - 1
                                    }
                                };
                                let ring = &mut rings[ri].1;
                                ring.want_buffers(spec.buffers);
                                Held::Streamed(ri, ring.add(&b)?)
                            });
                            Ok::<_, ExecError>(())
                        },
                    )?;
                    read_s += t.elapsed().as_secs_f64();
                }
                ranks.push(Rank {
                    id: id.clone(),
                    index: rank,
                    device,
                    stem,
                    final_layer,
                    blocks,
                    meter: ActivationMeter::default(),
                    profile: Profiler::with_events(opts.profile_events),
                    mb_profiles: Mutex::default(),
                    ahead: ModulationCache::default(),
                    resident_bytes,
                    sync_stream_bytes,
                    sync_host_bytes,
                });
            }
            let comms = match &dist {
                Some(_) if spec.sp > 1 && !ranks.is_empty() && ranks.len() < world => {
                    return Err(ExecError::Plan(format!(
                        "part {pi}: sequence parallelism over devices of several processes is not supported yet: run the plan as one process, or give the part's devices to one process"
                    )));
                }
                Some(x) if world > 1 && !ranks.is_empty() && ranks.len() < world => {
                    Some(x.group(pi, &spec.devices, &ranks, &local_ids)?)
                }
                _ => None,
            };
            parts.push(PartRt {
                devices: spec.devices,
                tp: spec.tp,
                sp: spec.sp,
                keep_sliced: false,
                steps: spec.steps,
                ranks,
                local_ids,
                comms,
            });
        }
        // Hand-offs between processes, made once (NCCL communicators wait for the peer).
        let mut dist = dist;
        if let Some(d) = dist.as_mut() {
            d.open_hand_offs(&parts)?;
        }
        for i in 1..parts.len() {
            let (a, b) = (&parts[i - 1], &parts[i]);
            let same = a.devices == b.devices && a.tp == b.tp && a.sp == b.sp;
            parts[i - 1].keep_sliced = same && a.sp > 1 && dist.is_none();
        }
        // The weights were uploaded from this thread; ranks read them from theirs, whose
        // streams are not ordered with this one.
        let t = std::time::Instant::now();
        devmap.synchronize()?;
        let sync_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        if warm_later {
            warming = warm_lists(group_lists, &opts.comm);
        }
        if let Some(w) = warming {
            // Made and dropped: pooled for the first call. A group that failed to start is
            // not pooled, and the first call makes it again and reports why.
            let _ = w.join();
        }
        let groups_s = t.elapsed().as_secs_f64();
        let total_s = t_load.elapsed().as_secs_f64();
        let load_phases = vec![
            ("blocks read and uploaded", read_s),
            ("blocks copied between GPUs", copy_s),
            ("waiting for the GPUs", sync_s),
            ("waiting for the communicators", groups_s),
            (
                "the rest (stem, final layer, groups of other processes)",
                (total_s - read_s - copy_s - sync_s - groups_s).max(0.0),
            ),
        ];
        for (id, ring) in rings.iter_mut() {
            ring.finish()?;
            if let Some(why) = ring.pinned_failed() {
                eprintln!(
                    "warning: {id}: page-locking {} of host memory for streamed weights failed ({why}): \
                     streaming from pageable memory instead (slower copies, and the host waits for each)",
                    mold_plan::ByteSize(ring.info().host_bytes)
                );
            }
        }
        Ok(Executor {
            model: model.clone(),
            dtype,
            fp8,
            fp8_attention,
            parts,
            opts,
            rings: rings.into_iter().map(|(d, r)| (d, Mutex::new(r))).collect(),
            dist,
            timeline: Mutex::default(),
            waits: Default::default(),
            blocks_copied,
            load_phases,
        })
    }

    /// Chooses fused CUDA kernels or candle's ops. `--verify` runs its reference with
    /// candle's ops, so the comparison also checks the fused kernels.
    pub fn with_kernels(mut self, kernels: crate::Kernels) -> Self {
        self.opts.kernels = kernels;
        self
    }

    /// Turns phase profiling on or off.
    pub fn with_profiling(mut self, on: bool) -> Self {
        self.opts.profiling = on;
        self
    }

    /// The options this executor runs with.
    pub fn options(&self) -> &ExecOptions {
        &self.opts
    }

    /// Whether phases are being timed.
    pub fn profiling(&self) -> bool {
        self.opts.profiling
    }

    /// Time per phase and device since the last [`Executor::clear_profile`]: for each
    /// rank (one entry per part a device serves), `(label, seconds, marks)`, largest
    /// first; phases of [`Executor::forward_micro_batches`] are labelled by micro-batch
    /// (`mb0 attention`, `mb1 attention`, …). Empty unless profiling.
    pub fn profile_report(&self) -> Vec<(DeviceId, Vec<PhaseTime>)> {
        self.parts
            .iter()
            .flat_map(|p| p.ranks.iter())
            .map(|r| (r.id.clone(), r.profile_report()))
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }

    /// Forgets the phase times so far (e.g. the warm-up step's), micro-batches' too.
    pub fn clear_profile(&self) {
        for r in self.parts.iter().flat_map(|p| p.ranks.iter()) {
            r.profile.clear();
            for p in r
                .mb_profiles
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
            {
                p.clear();
            }
        }
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether the FP8 blocks' attention runs in FP8: the plan's `attention: fp8`, unless
    /// [`crate::Fp8Options::attention`] overrides it; never in a plan whose products are
    /// not FP8.
    pub fn fp8_attention(&self) -> bool {
        self.fp8_attention
    }

    /// The model this runs.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// How streamed blocks reach their devices.
    pub fn streaming(&self) -> Streaming {
        self.opts.streaming
    }

    /// Each streaming device's ring: buffers, host memory, copies and restarts so far.
    pub fn streaming_report(&self) -> Vec<(DeviceId, streaming::RingInfo)> {
        (0..self.rings.len())
            .map(|i| (self.rings[i].0.clone(), self.ring(i).info()))
            .collect()
    }

    fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring<M::Block>> {
        self.rings[i].1.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One transformer call. Inputs may live on any device and in any float dtype; the
    /// model moves them to the first part's devices and converts them. Returns the model's
    /// output on the last part's first device (in a multi-process run, on the host in the
    /// processes that do not run it).
    ///
    /// Inputs on a CUDA device must be complete when this is called: the executor's ranks
    /// queue work on streams of their own threads (or, with
    /// [`ExecOptions::deterministic`], of their devices), not ordered with the stream the
    /// inputs were made on, so the thread that produced them synchronizes its device
    /// first (`mold_pipeline::sampling::denoise` does).
    pub fn forward(&self, inputs: &M::Inputs) -> Result<Tensor> {
        let r = self.forward_once(inputs);
        if r.is_err() {
            // A failed call may have left some ranks with a window the others lack:
            // every rank starts again from nothing, so they miss (and gather) together.
            self.release_modulation_ahead();
        }
        r
    }

    /// Drops every rank's modulation outputs computed ahead
    /// ([`crate::model::modulation`]): after a request's last step (the pipeline does),
    /// or after a failure. The next scheduled call computes its window again.
    pub fn release_modulation_ahead(&self) {
        for part in &self.parts {
            for r in &part.ranks {
                r.ahead.clear();
            }
        }
    }

    /// Misses of the ranks' modulation caches so far: each is one product (and, under
    /// tensor parallelism, one all-gather) for a window of steps.
    pub fn modulation_ahead_misses(&self) -> u64 {
        self.parts
            .iter()
            .flat_map(|p| &p.ranks)
            .map(|r| r.ahead.misses())
            .sum()
    }

    fn forward_once(&self, inputs: &M::Inputs) -> Result<Tensor> {
        self.model.check_inputs(inputs)?;
        // Start the first copies of every streaming device now: they overlap the stem
        // and whatever runs before each device's first streamed block.
        for i in 0..self.rings.len() {
            self.ring(i).prime()?;
        }
        if let Some(d) = &self.dist {
            let r = self.forward_multi_process(d, inputs);
            if let Err(e) = &r {
                // Tell the other processes (unless they told us).
                if !matches!(e, ExecError::Dist(_)) {
                    d.mesh
                        .abort_all(&format!("process {} failed: {e}", d.mesh.rank()));
                }
            }
            return r;
        }
        let mut flow: Option<Flow<M::Acts>> = None;
        let mut pi = 0;
        while pi < self.parts.len() {
            // A tensor-parallel group's consecutive parts run as one, without a wait
            // between them.
            let mut end = pi + 1;
            while end < self.parts.len() && self.same_group(end - 1, end) {
                end += 1;
            }
            let run = &self.parts[pi..end];
            flow =
                Some(self.run_parts(run, flow.take(), inputs, None, self.must_finish(end - 1))?);
            pi = end;
        }
        match flow {
            Some(Flow::Out(t)) => Ok(t),
            _ => Err(ExecError::Plan("the last part produced no output".into())),
        }
    }

    /// [`runtime::hand_off`] to `dev` with this executor's peer-copy setting, for an
    /// activations' or inputs' `map`.
    fn hand_off_to<'a>(
        &'a self,
        dev: &'a Device,
    ) -> impl FnMut(&Tensor) -> candle_core::Result<Tensor> + 'a {
        move |t| runtime::hand_off(t, dev, self.opts.peer_copies)
    }

    /// Whether part `pi`'s kernels must be done before the next part starts: yes, unless
    /// the next part runs on the same single device, whose kernels this thread then
    /// queues on the same stream after these (ordered without a wait). The last part
    /// finishes (its output leaves the executor). A wait at every boundary drained the
    /// GPU in a plan that alternates resident and streamed parts on one device: 0.5–1 ms
    /// idle at each of its 44 boundaries while the host queued the next kernels, and the
    /// ring's copies 25 % slower while the host waited (BENCHMARKS.md, history
    /// 2026-11-23).
    fn must_finish(&self, pi: usize) -> bool {
        let (this, next) = (&self.parts[pi], self.parts.get(pi + 1));
        !matches!(next, Some(n) if this.devices.len() == 1
            && n.devices.len() == 1
            && n.devices == this.devices
            && !this.ranks.is_empty()
            && !n.ranks.is_empty())
    }

    /// Whether parts `a` and `b` (consecutive, one process) run as one run on one
    /// tensor-parallel group ([`Executor::run_parts`]): the same devices, ranks and
    /// layout, several ranks, no sequence parallelism (whose slices flow by rank index)
    /// and no communicators of their own (a group spanning processes).
    fn same_group(&self, a: usize, b: usize) -> bool {
        let (x, y) = (&self.parts[a], &self.parts[b]);
        x.devices.len() > 1
            && x.devices == y.devices
            && (x.tp, x.sp) == (y.tp, y.sp)
            && x.sp == 1
            && !x.keep_sliced
            && x.comms.is_none()
            && y.comms.is_none()
            && x.ranks.len() == y.ranks.len()
            && x.local_ids == y.local_ids
    }

    /// Where a caller best keeps its inputs: the device of the first part's first rank,
    /// when this process runs it (`None` otherwise). The model reads them there without a
    /// host→device copy each call (from the host, a streamed plan's per-step upload was
    /// seen to start only when a weight copy of the ring ended).
    pub fn input_device(&self) -> Option<candle_core::Device> {
        self.parts
            .first()
            .and_then(|p| p.ranks.first())
            .map(|r| r.device.clone())
    }

    /// Resident blocks a rank copied from another rank's device at load (peer copies on
    /// GPUs) instead of reading them from the checkpoint: the ranks of a
    /// sequence-parallel group hold the same weights, and each is read once.
    /// Where the load's time went, in seconds: the blocks read from the checkpoint and
    /// uploaded, the blocks copied from another rank's device, the wait for the GPUs' queued
    /// copies, the wait for the communicators started beside the load, and the rest.
    pub fn load_phases(&self) -> &[(&'static str, f64)] {
        &self.load_phases
    }

    pub fn blocks_copied(&self) -> usize {
        self.blocks_copied
    }

    /// How many times, in all calls so far, the host waited for a part's kernels to end
    /// before going on ([`Executor::must_finish`]; a part of several ranks always counts
    /// one): one per call for parts that all run on one device.
    pub fn part_waits(&self) -> u64 {
        self.waits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The transformer's weights, on its devices and in host memory, in bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.memory_report()
            .iter()
            .map(|m| m.resident_weight_bytes + m.host_weight_bytes)
            .sum()
    }

    /// Accounted memory per device, summed over the parts each device serves (in
    /// first-use order). Activation sizes are known after a [`Executor::forward`].
    pub fn memory_report(&self) -> Vec<DeviceMemory> {
        let mut out: Vec<DeviceMemory> = Vec::new();
        for part in &self.parts {
            for r in &part.ranks {
                let i = match out.iter().position(|m| m.device == r.id) {
                    Some(i) => i,
                    None => {
                        out.push(DeviceMemory {
                            device: r.id.clone(),
                            resident_weight_bytes: 0,
                            stream_buffer_bytes: 0,
                            stream_buffers: 0,
                            host_weight_bytes: 0,
                            host_pinned: false,
                            largest_activation_bytes: 0,
                            ahead_bytes: 0,
                        });
                        out.len() - 1
                    }
                };
                let m = &mut out[i];
                m.resident_weight_bytes += r.resident_bytes;
                if r.sync_stream_bytes > 0 {
                    m.stream_buffer_bytes = m.stream_buffer_bytes.max(r.sync_stream_bytes);
                    m.stream_buffers = 1;
                }
                m.host_weight_bytes += r.sync_host_bytes;
                m.largest_activation_bytes = m.largest_activation_bytes.max(r.meter.largest());
                m.ahead_bytes += r.ahead.peak_bytes();
            }
        }
        for (i, (id, _)) in self.rings.iter().enumerate() {
            let info = self.ring(i).info();
            if let Some(m) = out.iter_mut().find(|m| &m.device == id) {
                m.stream_buffer_bytes = info.buffer_bytes;
                m.stream_buffers = info.buffers;
                m.host_weight_bytes += info.host_bytes;
                m.host_pinned = info.pinned;
            }
        }
        out
    }
}

#[cfg(test)]
mod group_tests {
    use super::*;

    fn spec(devices: &[u32], tp: usize, sp: usize) -> PartSpec {
        PartSpec {
            devices: devices.iter().map(|&i| DeviceId::Cuda(i)).collect(),
            tp,
            sp,
            residency: Residency::Resident,
            buffers: 0,
            steps: Vec::new(),
        }
    }

    fn ids(v: &[u32]) -> Vec<DeviceId> {
        v.iter().map(|&i| DeviceId::Cuda(i)).collect()
    }

    #[test]
    fn loading_makes_the_groups_the_first_call_asks_for() {
        // One device: no group. TP2 then SP2 x TP2 over four devices.
        let specs = [
            spec(&[5], 1, 1),
            spec(&[0, 1], 2, 1),
            spec(&[0, 1, 2, 3], 2, 2),
        ];
        assert_eq!(
            group_device_lists(&specs),
            vec![
                ids(&[0, 1]),
                ids(&[0, 1]),
                ids(&[2, 3]),
                ids(&[0, 2]),
                ids(&[1, 3]),
            ]
        );
        assert!(group_device_lists(&specs[..1]).is_empty());
        assert!(warm_groups(&specs[..1], &Default::default()).is_none());
        assert_eq!(
            group_device_lists(&[spec(&[0, 1, 2, 3], 1, 4)]),
            vec![ids(&[0, 1, 2, 3])]
        );
    }
}

#[cfg(test)]
mod follower_tests {
    use super::*;

    fn cpu(ranks: &[usize]) -> Vec<(usize, Device)> {
        ranks.iter().map(|&r| (r, Device::Cpu)).collect()
    }

    fn of(f: &HashMap<usize, Vec<(usize, Device)>>, reader: usize) -> Vec<usize> {
        f.get(&reader)
            .map(|v| v.iter().map(|(r, _)| *r).collect())
            .unwrap_or_default()
    }

    #[test]
    fn each_shard_is_read_once_and_copied_to_the_ranks_holding_it() {
        // SP4: rank 0 reads, the other three get copies.
        let f = followers_of(&cpu(&[0, 1, 2, 3]), 1, true);
        assert_eq!(of(&f, 0), vec![1, 2, 3]);
        assert_eq!(f.len(), 1);
        // SP2 x TP2 (rank = sp_rank * tp + tp_rank): ranks 0 and 1 read their shards,
        // 2 and 3 copy them.
        let f = followers_of(&cpu(&[0, 1, 2, 3]), 2, true);
        assert_eq!((of(&f, 0), of(&f, 1)), (vec![2], vec![3]));
        // TP4: every rank reads its own shard.
        assert!(followers_of(&cpu(&[0, 1, 2, 3]), 4, true).is_empty());
        // Ranks of another process are absent: the local ones follow the first local one.
        let f = followers_of(&cpu(&[2, 3]), 1, true);
        assert_eq!(of(&f, 2), vec![3]);
    }
}
