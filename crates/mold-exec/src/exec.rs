//! The executor: runs the transformer component of a plan, part by part.

use crate::checkpoint::Checkpoint;
use crate::comm::{Comm, LocalComm};
use crate::config::FluxConfig;
use crate::dist::{self, Mesh, Ownership, TcpComm};
use crate::error::{ExecError, Result};
use crate::model::flux::{DoubleBlock, FinalLayer, SingleBlock, Stem};
use crate::model::ops::Kernels;
use crate::model::{ActivationMeter, Ctx, Profiler, Shard};
use crate::runtime::{self, Block, CheckpointSource, DeviceMap, DeviceMemory, Held};
use crate::streaming::{self, Ring, Streaming};
use candle_core::{DType, Device, IndexOp, Tensor};
use mold_plan::{DeviceId, Part, Plan, Residency};
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Inputs of one transformer call (BFL / candle `Flux::forward` argument order).
#[derive(Clone, Debug)]
pub struct FluxInputs {
    /// Packed latent tokens `(b, L_img, in_channels)`.
    pub img: Tensor,
    /// `(b, L_img, 3)` positions (0, row, col).
    pub img_ids: Tensor,
    /// Text-encoder tokens `(b, L_txt, context_in_dim)`.
    pub txt: Tensor,
    /// `(b, L_txt, 3)`, zeros for FLUX.
    pub txt_ids: Tensor,
    /// `(b,)` in [0, 1].
    pub timesteps: Tensor,
    /// Pooled vector `(b, vec_in_dim)`.
    pub y: Tensor,
    /// `(b,)` distilled guidance; required by guidance-distilled models.
    pub guidance: Option<Tensor>,
}

/// One profiled phase: `(label, seconds, marks)`.
pub type PhaseTime = (&'static str, f64, u64);

/// A block in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockRef {
    Double(usize),
    Single(usize),
}

/// Maps a plan's transformer dtype to the compute dtype.
pub fn compute_dtype(d: mold_plan::DType) -> Result<DType> {
    match d {
        mold_plan::DType::F32 => Ok(DType::F32),
        mold_plan::DType::Bf16 => Ok(DType::BF16),
        mold_plan::DType::Fp16 => Ok(DType::F16),
        other => Err(ExecError::UnsupportedDtype(other.to_string())),
    }
}

/// Checks the transformer parts of `plan` against `cfg` without loading anything: every
/// block range names a known kind and lies inside the model, every block runs exactly
/// once, doubles before singles in ascending order, and each tensor-parallel degree
/// divides the heads and the MLP width. Returns each part's blocks in execution order.
pub fn check_plan(cfg: &FluxConfig, plan: &Plan) -> Result<Vec<Vec<BlockRef>>> {
    let comp = transformer_of(plan)?;
    check_parts(cfg, &comp.parts)
}

fn transformer_of(plan: &Plan) -> Result<&mold_plan::ComponentPlan> {
    plan.transformer().ok_or_else(|| {
        ExecError::Plan("no transformer component: add one (role: transformer) or regenerate the plan with `mold plan`".into())
    })
}

fn check_parts(cfg: &FluxConfig, parts: &[Part]) -> Result<Vec<Vec<BlockRef>>> {
    let mut out = Vec::with_capacity(parts.len());
    let mut owner: Vec<Option<(usize, String)>> = vec![None; cfg.depth + cfg.depth_single];
    let mut order = Vec::new();
    for (pi, p) in parts.iter().enumerate() {
        let tp = p.devices.len();
        let mlp = cfg.mlp_hidden();
        if tp == 0 || !cfg.heads.is_multiple_of(tp) || !mlp.is_multiple_of(tp) {
            let what = if tp == 0 {
                "it names no device".to_string()
            } else if !cfg.heads.is_multiple_of(tp) {
                format!("{tp} does not divide the {} attention heads", cfg.heads)
            } else {
                format!("{tp} does not divide the MLP width {mlp}")
            };
            return Err(ExecError::TpDegree {
                part: pi,
                degree: tp,
                heads: cfg.heads,
                mlp,
                what,
            });
        }
        let mut steps = Vec::new();
        for r in &p.blocks {
            let bad = |message: String| ExecError::BadRange {
                part: pi,
                range: r.to_string(),
                message,
            };
            let (n, base) = match r.kind.as_str() {
                "double" => (cfg.depth, 0),
                "single" => (cfg.depth_single, cfg.depth),
                k => {
                    return Err(bad(format!(
                        "unknown block kind `{k}`: FLUX has `double` and `single` blocks"
                    )))
                }
            };
            if r.start >= r.end {
                return Err(bad("empty: write start..end with start < end".into()));
            }
            if r.end as usize > n {
                return Err(bad(format!(
                    "goes past the model's {n} {} blocks (valid: {} 0..{n}): fix the range or regenerate the plan for this model",
                    r.kind, r.kind
                )));
            }
            for i in r.start as usize..r.end as usize {
                if let Some((op, orange)) = &owner[base + i] {
                    return Err(bad(format!(
                        "block {} {i} is already run by part {op} (`{orange}`): each block runs exactly once",
                        r.kind
                    )));
                }
                owner[base + i] = Some((pi, r.to_string()));
                order.push(base + i);
                steps.push(if base == 0 {
                    BlockRef::Double(i)
                } else {
                    BlockRef::Single(i)
                });
            }
        }
        out.push(steps);
    }
    let missing: Vec<String> = owner
        .iter()
        .enumerate()
        .filter(|(_, o)| o.is_none())
        .map(|(i, _)| {
            if i < cfg.depth {
                format!("double {i}")
            } else {
                format!("single {}", i - cfg.depth)
            }
        })
        .collect();
    if !missing.is_empty() {
        return Err(ExecError::Plan(format!(
            "no part runs block(s) {}: the transformer parts must cover double 0..{} and single 0..{}",
            missing.join(", "),
            cfg.depth,
            cfg.depth_single
        )));
    }
    if order.windows(2).any(|w| w[0] > w[1]) {
        return Err(ExecError::Plan(format!(
            "blocks must run in model order (double 0..{}, then single 0..{}) across parts: reorder the parts or ranges",
            cfg.depth, cfg.depth_single
        )));
    }
    Ok(out)
}

struct Rank {
    id: DeviceId,
    /// This rank's index in its part's group.
    index: usize,
    device: Device,
    stem: Option<Stem>,
    final_layer: Option<FinalLayer>,
    blocks: Vec<Held>,
    meter: ActivationMeter,
    profile: Profiler,
    resident_bytes: u64,
    /// `sync` streaming: the largest streamed block and the host bytes of all of them.
    sync_stream_bytes: u64,
    sync_host_bytes: u64,
}

struct PartRt {
    /// Every device of the part (the group), in rank order.
    devices: Vec<DeviceId>,
    steps: Vec<BlockRef>,
    /// The ranks this process runs (all of them in a one-process run).
    ranks: Vec<Rank>,
    /// How this process opens each of `ranks` (`cuda:K` of its own GPUs).
    local_ids: Vec<DeviceId>,
    /// Communicators of `ranks`, made once, for a group that spans processes.
    comms: Option<Vec<Box<dyn Comm>>>,
}

/// A multi-process run: this process's mesh and which process runs which device.
struct DistRt {
    mesh: Arc<Mesh>,
    own: Ownership,
    /// Forward calls so far (names the messages of each).
    calls: AtomicU64,
}

/// Activations between parts.
#[derive(Clone)]
enum Acts {
    Double {
        img: Tensor,
        txt: Tensor,
        vec: Tensor,
        pe: Tensor,
    },
    Single {
        x: Tensor,
        vec: Tensor,
        pe: Tensor,
        txt_len: usize,
    },
    Out(Tensor),
}

impl Acts {
    /// The activations on `d` ([`runtime::hand_off`]: a peer copy between GPUs that
    /// allow it).
    fn to_device(&self, d: &Device) -> candle_core::Result<Acts> {
        let mv = |t: &Tensor| runtime::hand_off(t, d);
        Ok(match self {
            Acts::Double { img, txt, vec, pe } => Acts::Double {
                img: mv(img)?,
                txt: mv(txt)?,
                vec: mv(vec)?,
                pe: mv(pe)?,
            },
            Acts::Single {
                x,
                vec,
                pe,
                txt_len,
            } => Acts::Single {
                x: mv(x)?,
                vec: mv(vec)?,
                pe: mv(pe)?,
                txt_len: *txt_len,
            },
            Acts::Out(t) => Acts::Out(mv(t)?),
        })
    }
}

enum PartInput<'a> {
    Inputs(&'a FluxInputs),
    Acts(&'a Acts),
}

/// Aborts the rank's group if the rank's thread leaves without finishing (error or
/// panic), so the other ranks do not wait forever.
struct AbortGuard<'a>(&'a dyn Comm, bool);

impl Drop for AbortGuard<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.abort();
        }
    }
}

/// Runs the transformer of a plan. Weights are loaded once by [`Executor::new`];
/// [`Executor::forward`] can then be called once per denoising step.
pub struct Executor {
    cfg: FluxConfig,
    dtype: DType,
    parts: Vec<PartRt>,
    kernels: Kernels,
    profiling: bool,
    streaming: Streaming,
    /// One per device that runs streamed blocks (pipelined streaming).
    rings: Vec<(DeviceId, Mutex<Ring>)>,
    dist: Option<DistRt>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
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
    residency: Residency,
    buffers: usize,
    steps: Vec<BlockRef>,
}

impl Executor {
    /// Checks the config, the checkpoint headers and the plan (no tensor data read), then
    /// loads each part's weights onto its devices (each rank reads only its own blocks
    /// and shards) in the plan's transformer dtype.
    ///
    /// Streamed parts stream as `MOLD_STREAMING` says (default: pinned); see
    /// [`Executor::new_with_streaming`].
    pub fn new(cfg: &FluxConfig, plan: &Plan, ckpt: &Checkpoint) -> Result<Executor> {
        Self::new_with_streaming(cfg, plan, ckpt, Streaming::from_env()?)
    }

    /// [`Executor::new`] with an explicit way of streaming host-resident blocks. Refuses,
    /// before reading any weight, a plan whose streamed weights do not fit the host
    /// memory available ([`streaming::host_memory_available`]).
    pub fn new_with_streaming(
        cfg: &FluxConfig,
        plan: &Plan,
        ckpt: &Checkpoint,
        streaming: Streaming,
    ) -> Result<Executor> {
        Self::new_in(cfg, plan, ckpt, streaming, None)
    }

    /// This process's share of a multi-process run ([`crate::dist`]): loads and runs only
    /// the ranks on the devices [`Ownership`] gives this process (opened as its own
    /// `cuda:0, cuda:1, …`); activations cross processes over `mesh`, and every process's
    /// [`Executor::forward`] returns the same output (on the host in the processes that
    /// do not run the final layer). Every process must call it, then `forward` with the
    /// same inputs, in the same order.
    pub fn new_multi_process(
        cfg: &FluxConfig,
        plan: &Plan,
        ckpt: &Checkpoint,
        streaming: Streaming,
        mesh: Arc<Mesh>,
    ) -> Result<Executor> {
        Self::new_in(cfg, plan, ckpt, streaming, Some(mesh))
    }

    /// The devices each process of a `world`-process run of `plan` runs.
    pub fn ownership(plan: &Plan, world: usize) -> Result<Ownership> {
        let comp = transformer_of(plan)?;
        let devices: Vec<DeviceId> = comp.parts.iter().flat_map(|p| p.devices.clone()).collect();
        Ownership::split(&devices, world)
    }

    fn new_in(
        cfg: &FluxConfig,
        plan: &Plan,
        ckpt: &Checkpoint,
        streaming: Streaming,
        mesh: Option<Arc<Mesh>>,
    ) -> Result<Executor> {
        cfg.validate().map_err(ExecError::Config)?;
        let comp = transformer_of(plan)?;
        let dtype = compute_dtype(comp.dtype)?;
        let steps = check_parts(cfg, &comp.parts)?;
        ckpt.check(cfg, &plan.model.id)?;
        let specs = comp
            .parts
            .iter()
            .zip(steps)
            .map(|(p, steps)| PartSpec {
                devices: p.devices.clone(),
                residency: p.residency,
                buffers: p.buffers().max(1) as usize,
                steps,
            })
            .collect();
        let dist = match mesh {
            None => None,
            Some(mesh) => Some(DistRt {
                own: Self::ownership(plan, mesh.world())?,
                mesh,
                calls: AtomicU64::new(0),
            }),
        };
        Self::build(cfg, ckpt, specs, dtype, streaming, dist)
    }

    /// The reference: the same model, unsharded, every block resident on one device.
    pub fn reference(
        cfg: &FluxConfig,
        ckpt: &Checkpoint,
        device: &DeviceId,
        dtype: DType,
    ) -> Result<Executor> {
        cfg.validate().map_err(ExecError::Config)?;
        ckpt.check(cfg, "the given model config")?;
        let steps = (0..cfg.depth)
            .map(BlockRef::Double)
            .chain((0..cfg.depth_single).map(BlockRef::Single))
            .collect();
        let spec = PartSpec {
            devices: vec![device.clone()],
            residency: Residency::Resident,
            buffers: 0,
            steps,
        };
        Self::build(cfg, ckpt, vec![spec], dtype, Streaming::default(), None)
    }

    /// Refuses streamed weights that the host cannot hold, before anything is read: each
    /// streamed block is sized per rank from the checkpoint's headers
    /// ([`runtime::ShapeSource`]).
    fn check_host_memory(
        cfg: &FluxConfig,
        ckpt: &Checkpoint,
        specs: &[PartSpec],
        dtype: DType,
        local: &dyn Fn(&DeviceId) -> bool,
    ) -> Result<()> {
        let shapes = runtime::ShapeSource { ckpt, dtype };
        let mut need = 0u64;
        let mut blocks = 0usize;
        for s in specs.iter().filter(|s| s.residency == Residency::Streamed) {
            let world = s.devices.len();
            for rank in (0..world).filter(|r| local(&s.devices[*r])) {
                let shard = Shard { rank, world };
                for step in &s.steps {
                    need += match step {
                        BlockRef::Double(i) => DoubleBlock::load(&shapes, cfg, *i, shard)?.bytes(),
                        BlockRef::Single(i) => SingleBlock::load(&shapes, cfg, *i, shard)?.bytes(),
                    };
                }
            }
            blocks += s.steps.len();
        }
        if need == 0 {
            return Ok(());
        }
        match streaming::host_memory_available()? {
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
        cfg: &FluxConfig,
        ckpt: &Checkpoint,
        specs: Vec<PartSpec>,
        dtype: DType,
        streaming: Streaming,
        dist: Option<DistRt>,
    ) -> Result<Executor> {
        // How this process opens a plan device it runs (None: another process runs it).
        let local_id = |d: &DeviceId| -> Option<DeviceId> {
            match &dist {
                None => Some(d.clone()),
                Some(x) => x.own.local_id(x.mesh.rank(), d),
            }
        };
        let mut devmap = DeviceMap::default();
        // Resolve every device before reading any weight.
        for s in &specs {
            for d in s.devices.iter().filter_map(local_id) {
                devmap.get(&d)?;
            }
        }
        Self::check_host_memory(cfg, ckpt, &specs, dtype, &|d| local_id(d).is_some())?;
        let mut rings: Vec<(DeviceId, Ring)> = Vec::new();
        let src = CheckpointSource { ckpt, dtype };
        let n = specs.len();
        let mut parts = Vec::with_capacity(n);
        for (pi, spec) in specs.into_iter().enumerate() {
            let world = spec.devices.len();
            let mut ranks = Vec::with_capacity(world);
            let mut local_ids = Vec::with_capacity(world);
            for (rank, id) in spec.devices.iter().enumerate() {
                let Some(lid) = local_id(id) else { continue };
                let device = devmap.get(&lid)?;
                local_ids.push(lid);
                let shard = Shard { rank, world };
                let mut resident_bytes = 0;
                let mut sync_stream_bytes = 0;
                let mut sync_host_bytes = 0;
                let stem = if pi == 0 {
                    let s = Stem::load(&src, cfg)?.to_device(&device)?;
                    resident_bytes += s.bytes();
                    Some(s)
                } else {
                    None
                };
                let final_layer = if pi == n - 1 && rank == 0 {
                    let f = FinalLayer::load(&src)?.to_device(&device)?;
                    resident_bytes += f.bytes();
                    Some(f)
                } else {
                    None
                };
                let mut blocks = Vec::with_capacity(spec.steps.len());
                for step in &spec.steps {
                    let b = match step {
                        BlockRef::Double(i) => {
                            Block::Double(DoubleBlock::load(&src, cfg, *i, shard)?)
                        }
                        BlockRef::Single(i) => {
                            Block::Single(SingleBlock::load(&src, cfg, *i, shard)?)
                        }
                    };
                    let bytes = b.bytes();
                    blocks.push(match spec.residency {
                        Residency::Resident => {
                            resident_bytes += bytes;
                            Held::Resident(b.to_device(&device)?)
                        }
                        Residency::Streamed if streaming == Streaming::Sync => {
                            sync_host_bytes += bytes;
                            sync_stream_bytes = sync_stream_bytes.max(bytes);
                            Held::Sync(b)
                        }
                        Residency::Streamed => {
                            let ri = match rings.iter().position(|(d, _)| d == id) {
                                Some(i) => i,
                                None => {
                                    rings.push((
                                        id.clone(),
                                        Ring::new(device.clone(), dtype, streaming, spec.buffers),
                                    ));
                                    rings.len() - 1
                                }
                            };
                            let ring = &mut rings[ri].1;
                            ring.want_buffers(spec.buffers);
                            Held::Streamed(ri, ring.add(&b)?)
                        }
                    });
                }
                ranks.push(Rank {
                    id: id.clone(),
                    index: rank,
                    device,
                    stem,
                    final_layer,
                    blocks,
                    meter: ActivationMeter::default(),
                    profile: Profiler::default(),
                    resident_bytes,
                    sync_stream_bytes,
                    sync_host_bytes,
                });
            }
            let comms = match &dist {
                Some(x) if world > 1 && !ranks.is_empty() && ranks.len() < world => Some(
                    Self::cross_process_group(x, pi, &spec.devices, &ranks, &local_ids)?,
                ),
                _ => None,
            };
            parts.push(PartRt {
                devices: spec.devices,
                steps: spec.steps,
                ranks,
                local_ids,
                comms,
            });
        }
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
            cfg: cfg.clone(),
            dtype,
            parts,
            kernels: Kernels::from_env(),
            profiling: Profiler::requested(),
            streaming,
            rings: rings.into_iter().map(|(d, r)| (d, Mutex::new(r))).collect(),
            dist,
        })
    }

    /// The communicators of this process's ranks of part `pi`, whose group spans
    /// processes: NCCL when every device is a GPU (with the `nccl` feature; rank 0's
    /// process makes the `ncclUniqueId` and sends it over the mesh), else host-staged
    /// over the mesh ([`TcpComm`]).
    fn cross_process_group(
        d: &DistRt,
        pi: usize,
        devices: &[DeviceId],
        ranks: &[Rank],
        local_ids: &[DeviceId],
    ) -> Result<Vec<Box<dyn Comm>>> {
        let procs: Vec<usize> = devices
            .iter()
            .map(|x| d.own.owner(x).expect("every plan device has an owner"))
            .collect();
        #[cfg(feature = "nccl")]
        if devices.iter().all(|x| matches!(x, DeviceId::Cuda(_))) {
            let tag = format!("nccl-id/{pi}");
            let me = d.mesh.rank();
            let id = if procs[0] == me {
                let id = crate::comm::nccl::unique_id().map_err(|m| ExecError::Device {
                    device: devices[0].to_string(),
                    message: m,
                })?;
                let mut sent = Vec::new();
                for &p in &procs {
                    if p != me && !sent.contains(&p) {
                        d.mesh.send(p, &tag, &id)?;
                        sent.push(p);
                    }
                }
                id
            } else {
                d.mesh.recv(procs[0], &tag)?
            };
            let local: Vec<(usize, usize)> = ranks
                .iter()
                .zip(local_ids)
                .map(|(r, l)| (r.index, l.ordinal().expect("a GPU") as usize))
                .collect();
            return Ok(crate::comm::nccl::group_with_id(&id, devices.len(), &local)
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Comm>)
                .collect());
        }
        let _ = local_ids;
        Ok(ranks
            .iter()
            .map(|r| {
                Box::new(TcpComm::new(
                    d.mesh.clone(),
                    format!("p{pi}"),
                    r.index,
                    procs.clone(),
                )) as Box<dyn Comm>
            })
            .collect())
    }

    /// Chooses fused CUDA kernels or candle's ops (default: `MOLD_KERNELS`, else the
    /// fused kernels where they apply). `--verify` runs its reference with candle's ops,
    /// so the comparison also checks the fused kernels.
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// Turns phase profiling on or off (default: `MOLD_PROFILE`).
    pub fn with_profiling(mut self, on: bool) -> Self {
        self.profiling = on;
        self
    }

    /// Whether phases are being timed.
    pub fn profiling(&self) -> bool {
        self.profiling
    }

    /// Time per phase and device since the last [`Executor::clear_profile`]: for each
    /// rank, `(label, seconds, marks)`, largest first. Empty unless profiling.
    pub fn profile_report(&self) -> Vec<(DeviceId, Vec<PhaseTime>)> {
        self.parts
            .iter()
            .flat_map(|p| p.ranks.iter())
            .map(|r| (r.id.clone(), r.profile.report()))
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }

    /// Forgets the phase times so far (e.g. the warm-up step's).
    pub fn clear_profile(&self) {
        for r in self.parts.iter().flat_map(|p| p.ranks.iter()) {
            r.profile.clear();
        }
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How streamed blocks reach their devices.
    pub fn streaming(&self) -> Streaming {
        self.streaming
    }

    /// Each streaming device's ring: buffers, host memory, copies and restarts so far.
    pub fn streaming_report(&self) -> Vec<(DeviceId, streaming::RingInfo)> {
        (0..self.rings.len())
            .map(|i| (self.rings[i].0.clone(), self.ring(i).info()))
            .collect()
    }

    fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring> {
        self.rings[i].1.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One transformer call. Inputs may live on any device and in any float dtype; they
    /// are moved to the first part's devices; `img`, `txt` and `y` are converted to the
    /// compute dtype, the ids, `timesteps` and `guidance` to f32 (RoPE and the sinusoidal
    /// embeddings are computed in f32, then cast). Returns
    /// the predicted velocity `(b, L_img, in_channels)` on the last part's first device.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        timesteps: &Tensor,
        y: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.forward_inputs(&FluxInputs {
            img: img.clone(),
            img_ids: img_ids.clone(),
            txt: txt.clone(),
            txt_ids: txt_ids.clone(),
            timesteps: timesteps.clone(),
            y: y.clone(),
            guidance: guidance.cloned(),
        })
    }

    /// [`Executor::forward`] taking a [`FluxInputs`].
    pub fn forward_inputs(&self, inputs: &FluxInputs) -> Result<Tensor> {
        self.check_inputs(inputs)?;
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
        let mut acts: Option<Acts> = None;
        for part in &self.parts {
            let input = match &acts {
                None => PartInput::Inputs(inputs),
                Some(a) => PartInput::Acts(a),
            };
            acts = Some(self.run_part(part, input)?);
        }
        match acts {
            Some(Acts::Out(t)) => Ok(t),
            _ => Err(ExecError::Plan("the last part produced no output".into())),
        }
    }

    /// [`Executor::forward_inputs`] in a multi-process run: runs the parts this process
    /// has ranks in; the process running a part's rank 0 sends the part's output to the
    /// processes that run the next part without running this one (for the last part: to
    /// every other process).
    fn forward_multi_process(&self, d: &DistRt, inputs: &FluxInputs) -> Result<Tensor> {
        let me = d.mesh.rank();
        let call = d.calls.fetch_add(1, Ordering::SeqCst);
        let owner = |x: &DeviceId| d.own.owner(x).expect("every plan device has an owner");
        let n = self.parts.len();
        // The previous part's output, when this process ran it.
        let mut acts: Option<Acts> = None;
        for (pi, part) in self.parts.iter().enumerate() {
            let out = if part.ranks.is_empty() {
                None
            } else {
                if pi > 0 && acts.is_none() {
                    let from = owner(&self.parts[pi - 1].devices[0]);
                    let b = d.mesh.recv(from, &format!("acts/{call}/{pi}"))?;
                    acts = Some(decode_acts(&b)?);
                }
                let input = match &acts {
                    None => PartInput::Inputs(inputs),
                    Some(a) => PartInput::Acts(a),
                };
                Some(self.run_part(part, input)?)
            };
            if owner(&part.devices[0]) == me {
                let out = out.as_ref().expect("rank 0's process ran the part");
                let (tag, to): (String, Vec<usize>) = if pi + 1 < n {
                    let mut to: Vec<usize> = self.parts[pi + 1].devices.iter().map(owner).collect();
                    let ran: Vec<usize> = part.devices.iter().map(owner).collect();
                    to.retain(|p| !ran.contains(p));
                    to.sort_unstable();
                    to.dedup();
                    (format!("acts/{call}/{}", pi + 1), to)
                } else {
                    let to = (0..d.mesh.world()).filter(|p| *p != me).collect();
                    (format!("out/{call}"), to)
                };
                if !to.is_empty() {
                    let b = encode_acts(out)?;
                    for p in to {
                        d.mesh.send(p, &tag, &b)?;
                    }
                }
            }
            acts = out;
        }
        match acts {
            Some(Acts::Out(t)) => Ok(t),
            _ => {
                let from = owner(&self.parts[n - 1].devices[0]);
                match decode_acts(&d.mesh.recv(from, &format!("out/{call}"))?)? {
                    Acts::Out(t) => Ok(t),
                    _ => Err(ExecError::Dist(format!(
                        "process {from} sent activations where the output was expected"
                    ))),
                }
            }
        }
    }

    fn check_inputs(&self, x: &FluxInputs) -> Result<()> {
        let c = &self.cfg;
        fn bad<T>(m: String) -> Result<T> {
            Err(ExecError::Input(m))
        }
        let (b, l_img, ch) = x.img.dims3().or_else(|_| {
            bad(format!(
                "img must be (batch, tokens, {}), got {:?}",
                c.in_channels,
                x.img.shape()
            ))
        })?;
        if ch != c.in_channels {
            return bad(format!(
                "img has {ch} channels per token, the model takes {}",
                c.in_channels
            ));
        }
        let (tb, _, tc) = x.txt.dims3().or_else(|_| {
            bad(format!(
                "txt must be (batch, tokens, {}), got {:?}",
                c.context_in_dim,
                x.txt.shape()
            ))
        })?;
        if tb != b || tc != c.context_in_dim {
            return bad(format!(
                "txt must be ({b}, tokens, {}), got {:?}",
                c.context_in_dim,
                x.txt.shape()
            ));
        }
        if x.img_ids.dims() != [b, l_img, 3] {
            return bad(format!(
                "img_ids must be ({b}, {l_img}, 3), got {:?}",
                x.img_ids.shape()
            ));
        }
        if x.txt_ids.dims() != [b, x.txt.dim(1)?, 3] {
            return bad(format!(
                "txt_ids must be ({b}, {}, 3), got {:?}",
                x.txt.dim(1)?,
                x.txt_ids.shape()
            ));
        }
        if x.y.dims() != [b, c.vec_in_dim] {
            return bad(format!(
                "y must be ({b}, {}), got {:?}",
                c.vec_in_dim,
                x.y.shape()
            ));
        }
        if x.timesteps.dims() != [b] {
            return bad(format!(
                "timesteps must be ({b},), got {:?}",
                x.timesteps.shape()
            ));
        }
        match &x.guidance {
            None if c.guidance_embed => {
                bad("this model is guidance distilled: pass a guidance strength (e.g. 3.5)".into())
            }
            Some(g) if g.dims() != [b] => {
                bad(format!("guidance must be ({b},), got {:?}", g.shape()))
            }
            _ => Ok(()),
        }
    }

    fn run_part(&self, part: &PartRt, input: PartInput) -> Result<Acts> {
        if part.devices.len() == 1 {
            let rank = &part.ranks[0];
            let out = self.run_rank(part, rank, &LocalComm, &input)?;
            // The next part may read it from another thread (a tensor-parallel rank's),
            // whose stream is not ordered with this one: finish it first.
            rank.device.synchronize()?;
            return Ok(out);
        }
        let made;
        let comms: &[Box<dyn Comm>] = match &part.comms {
            Some(c) => c,
            None => {
                made = runtime::make_group(&part.local_ids);
                &made
            }
        };
        let results: Vec<std::thread::Result<candle_core::Result<Acts>>> =
            std::thread::scope(|s| {
                let handles: Vec<_> = part
                    .ranks
                    .iter()
                    .zip(comms.iter())
                    .map(|(rank, comm)| {
                        let input = &input;
                        s.spawn(move || {
                            let mut guard = AbortGuard(comm.as_ref(), false);
                            // Finish this rank's kernels before its thread hands the
                            // result on: work queued from another thread is not ordered
                            // with it otherwise (a no-op on the CPU).
                            let r = self
                                .run_rank(part, rank, comm.as_ref(), input)
                                .and_then(|a| rank.device.synchronize().map(|_| a))
                                // A collective may fail after it was enqueued.
                                .and_then(|a| comm.check().map(|_| a));
                            guard.1 = r.is_ok();
                            r
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join()).collect()
            });
        let mut errors: Vec<(usize, String)> = Vec::new();
        let mut out = None;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                // The lowest rank this process runs (rank 0 holds the final layer).
                Ok(Ok(a)) if i == 0 => out = Some(a),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => errors.push((i, e.to_string())),
                Err(_) => errors.push((i, "the rank's thread panicked".into())),
            }
        }
        // Report the rank that failed first, not the ranks it released.
        let primary = errors
            .iter()
            .find(|(_, m)| !m.contains("another rank"))
            .or(errors.first());
        match (primary, out) {
            (Some((i, m)), _) => Err(ExecError::Device {
                device: part.ranks[*i].id.to_string(),
                message: m.clone(),
            }),
            (None, Some(a)) => Ok(a),
            (None, None) => Err(ExecError::Plan("rank 0 produced no result".into())),
        }
    }

    fn run_rank(
        &self,
        part: &PartRt,
        rank: &Rank,
        comm: &dyn Comm,
        input: &PartInput,
    ) -> candle_core::Result<Acts> {
        let dev = &rank.device;
        let ctx = Ctx {
            comm,
            meter: &rank.meter,
            kernels: self.kernels,
            profile: self.profiling.then_some(&rank.profile),
        };
        let mut acts = match input {
            PartInput::Acts(a) => a.to_device(dev)?,
            PartInput::Inputs(x) => {
                let stem = rank.stem.as_ref().expect("the first part holds the stem");
                let mv = |t: &Tensor| t.to_device(dev)?.to_dtype(self.dtype);
                // Positions, timesteps and guidance stay f32: the RoPE table and the
                // sinusoidal embeddings are computed in f32, then cast.
                let f32 = |t: &Tensor| t.to_device(dev)?.to_dtype(DType::F32);
                let s = stem.forward(
                    &mv(&x.img)?,
                    &f32(&x.img_ids)?,
                    &mv(&x.txt)?,
                    &f32(&x.txt_ids)?,
                    &f32(&x.timesteps)?,
                    &mv(&x.y)?,
                    x.guidance.as_ref().map(f32).transpose()?.as_ref(),
                )?;
                ctx.mark("stem", &s.img);
                Acts::Double {
                    img: s.img,
                    txt: s.txt,
                    vec: s.vec,
                    pe: s.pe,
                }
            }
        };
        let ring_err = |e: ExecError| candle_core::Error::Msg(e.to_string());
        for (step, held) in part.steps.iter().zip(&rank.blocks) {
            if let Some(f) = Fault::from_env() {
                f.trigger(&rank.id, *step)?;
            }
            if let Some(p) = ctx.profile {
                p.mark(None, dev);
            }
            let block: Cow<Block> = match held {
                Held::Resident(b) => Cow::Borrowed(b),
                Held::Streamed(ri, k) => Cow::Owned(self.ring(*ri).fetch(*k).map_err(ring_err)?),
                Held::Sync(b) => Cow::Owned(b.to_device(dev)?),
            };
            if let Some(p) = ctx.profile {
                p.mark(Some("weight fetch (streamed)"), dev);
            }
            acts = match (block.as_ref(), acts) {
                (Block::Double(b), Acts::Double { img, txt, vec, pe }) => {
                    let (img, txt) = b.forward(&img, &txt, &vec, &pe, &ctx)?;
                    rank.meter.see(&img);
                    Acts::Double { img, txt, vec, pe }
                }
                (Block::Single(b), a) => {
                    let (x, vec, pe, txt_len) = match a {
                        Acts::Double { img, txt, vec, pe } => {
                            let txt_len = txt.dim(1)?;
                            (Tensor::cat(&[&txt, &img], 1)?, vec, pe, txt_len)
                        }
                        Acts::Single {
                            x,
                            vec,
                            pe,
                            txt_len,
                        } => (x, vec, pe, txt_len),
                        Acts::Out(_) => candle_core::bail!("block {step:?} after the final layer"),
                    };
                    let x = b.forward(&x, &vec, &pe, &ctx)?;
                    rank.meter.see(&x);
                    Acts::Single {
                        x,
                        vec,
                        pe,
                        txt_len,
                    }
                }
                (Block::Double(_), _) => {
                    candle_core::bail!("double block {step:?} after single blocks")
                }
            };
            match held {
                Held::Resident(_) => {}
                // The buffer is refilled once this block's kernels are done.
                Held::Streamed(ri, _) => self.ring(*ri).release().map_err(ring_err)?,
                // The baseline: wait for the block, then free its weights.
                Held::Sync(_) => {
                    dev.synchronize()?;
                    drop(block);
                }
            }
        }
        if let Some(fl) = &rank.final_layer {
            let (img, vec) = match acts {
                Acts::Double { img, vec, .. } => (img, vec),
                Acts::Single {
                    x, vec, txt_len, ..
                } => (x.i((.., txt_len..))?, vec),
                Acts::Out(_) => candle_core::bail!("final layer run twice"),
            };
            ctx.mark_start(&img);
            let out = fl.forward(&img, &vec)?;
            ctx.mark("final layer", &out);
            rank.meter.see(&out);
            acts = Acts::Out(out);
        }
        Ok(acts)
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

/// Activations on the wire: a kind byte, then the tensors ([`dist::encode_shaped`]).
fn encode_acts(a: &Acts) -> Result<Vec<u8>> {
    let (kind, body) = match a {
        Acts::Double { img, txt, vec, pe } => (0u8, dist::encode_shaped(&[img, txt, vec, pe])?),
        Acts::Single {
            x,
            vec,
            pe,
            txt_len,
        } => {
            let tl = Tensor::new(&[*txt_len as u32], &Device::Cpu)?;
            (1, dist::encode_shaped(&[x, vec, pe, &tl])?)
        }
        Acts::Out(t) => (2, dist::encode_shaped(&[t])?),
    };
    let mut out = Vec::with_capacity(body.len() + 1);
    out.push(kind);
    out.extend_from_slice(&body);
    Ok(out)
}

fn decode_acts(b: &[u8]) -> Result<Acts> {
    let bad = || ExecError::Dist("malformed activations message".into());
    let (kind, body) = b.split_first().ok_or_else(bad)?;
    let mut t = dist::decode_shaped(body)?.into_iter();
    let mut next = || t.next().ok_or_else(bad);
    Ok(match kind {
        0 => Acts::Double {
            img: next()?,
            txt: next()?,
            vec: next()?,
            pe: next()?,
        },
        1 => Acts::Single {
            x: next()?,
            vec: next()?,
            pe: next()?,
            txt_len: next()?.to_vec1::<u32>()?[0] as usize,
        },
        2 => Acts::Out(next()?),
        _ => return Err(bad()),
    })
}

/// Max relative error of `a` against the reference `b`:
/// `max_i |a_i - b_i| / max(max_i |b_i|, 1e-12)`, computed in f32 on the host. It is
/// relative to the reference's largest magnitude (not element-wise), so elements near
/// zero do not blow it up.
pub fn max_relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        return Err(ExecError::Input(format!(
            "cannot compare shapes {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    if a.elem_count() == 0 {
        return Ok(0.0);
    }
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let scale = b.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    Ok(diff / scale.max(1e-12))
}

/// A fault injected on purpose (`MOLD_FAULT=DEVICE@BLOCK[:KIND]`, e.g. `cuda:1@single 3`
/// or `emu:1@double 0:panic`), to test that a failing rank brings its group down cleanly:
/// when the rank on DEVICE reaches BLOCK it returns an error (`error`, the default),
/// panics (`panic`), or stops making progress (`hang`, CUDA devices only: NCCL's watchdog
/// ends it).
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub device: DeviceId,
    pub block: BlockRef,
    pub kind: FaultKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Error,
    Panic,
    Hang,
    /// The process exits at once (status 3), as a crash would: no clean-up, no message
    /// to the other processes.
    Exit,
}

impl Fault {
    /// Parses `DEVICE@BLOCK[:KIND]`; BLOCK is `double N` or `single N`.
    pub fn parse(s: &str) -> std::result::Result<Fault, String> {
        let usage = "MOLD_FAULT must be DEVICE@BLOCK[:error|panic|hang|exit], e.g. cuda:1@single 3";
        let (dev, rest) = s.split_once('@').ok_or(usage)?;
        let device: DeviceId = dev
            .trim()
            .parse()
            .map_err(|e| format!("{usage}: device: {e}"))?;
        let (block, kind) = match rest.rsplit_once(':') {
            Some((b, k)) => (b, k.trim()),
            None => (rest, "error"),
        };
        let kind = match kind {
            "error" => FaultKind::Error,
            "panic" => FaultKind::Panic,
            "hang" => FaultKind::Hang,
            "exit" => FaultKind::Exit,
            k => return Err(format!("{usage}: unknown kind '{k}'")),
        };
        let mut it = block.split_whitespace();
        let block = match (it.next(), it.next().map(str::parse::<usize>), it.next()) {
            (Some("double"), Some(Ok(i)), None) => BlockRef::Double(i),
            (Some("single"), Some(Ok(i)), None) => BlockRef::Single(i),
            _ => return Err(format!("{usage}: block '{}'", block.trim())),
        };
        Ok(Fault {
            device,
            block,
            kind,
        })
    }

    /// `MOLD_FAULT`, parsed once; a malformed value is reported once and ignored.
    pub fn from_env() -> Option<&'static Fault> {
        static F: std::sync::OnceLock<Option<Fault>> = std::sync::OnceLock::new();
        F.get_or_init(|| {
            let v = std::env::var("MOLD_FAULT").ok()?;
            match Fault::parse(&v) {
                Ok(f) => Some(f),
                Err(e) => {
                    eprintln!("warning: {e}; no fault injected");
                    None
                }
            }
        })
        .as_ref()
    }

    fn trigger(&self, device: &DeviceId, block: BlockRef) -> candle_core::Result<()> {
        if *device != self.device || block != self.block {
            return Ok(());
        }
        match self.kind {
            FaultKind::Error => {
                candle_core::bail!("injected fault (MOLD_FAULT) on {device} at {block:?}")
            }
            FaultKind::Panic => panic!("injected panic (MOLD_FAULT) on {device} at {block:?}"),
            // Only NCCL groups have a watchdog that ends a hang; elsewhere it would hang
            // the test for good.
            FaultKind::Hang if !matches!(device, DeviceId::Cuda(_)) => candle_core::bail!(
                "MOLD_FAULT: `hang` needs a CUDA device (NCCL's watchdog ends it); {device} \
                 has no watchdog: use `error` or `panic`"
            ),
            FaultKind::Exit => {
                eprintln!(
                    "injected exit (MOLD_FAULT) on {device} at {block:?}: exiting with status 3"
                );
                std::process::exit(3)
            }
            FaultKind::Hang => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
        }
    }
}
