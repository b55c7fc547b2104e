//! The runtime: plan devices → candle devices, tensor-parallel groups, weight residency
//! (resident vs streamed from host memory) and memory accounting. Model code lives in
//! [`crate::model`] and knows none of this.

use crate::checkpoint::Checkpoint;
use crate::error::{ExecError, Result};
use crate::model::fp8::Fp8Weight;
use crate::model::mat::Mat;
use crate::model::WeightSource;
use candle_core::{DType, Device, Tensor};
use mold_plan::DeviceId;
use serde::Serialize;
use std::collections::HashMap;
use std::ops::Range;

/// Maps plan devices to candle devices, one candle device per plan device (so tensors
/// of the same GPU compare as on the same device).
/// A clone maps the devices opened so far to the same candle devices (loaders on other
/// threads take one, so none holds the shared map while it loads).
#[derive(Clone, Default)]
pub struct DeviceMap {
    devices: HashMap<DeviceId, Device>,
    /// Open each GPU with a stream of its own ([`ExecOptions::deterministic`]) instead of
    /// candle's default, the calling thread's per-thread default stream.
    ///
    /// [`ExecOptions::deterministic`]: crate::ExecOptions::deterministic
    own_streams: bool,
}

impl DeviceMap {
    /// A map whose GPUs get a stream of their own when `own_streams`.
    pub fn new(own_streams: bool) -> Self {
        DeviceMap {
            devices: HashMap::new(),
            own_streams,
        }
    }

    /// `emu:N` and `host` → the CPU; `cuda:N` → GPU N (needs the `cuda` feature).
    pub fn get(&mut self, id: &DeviceId) -> Result<Device> {
        if let Some(d) = self.devices.get(id) {
            return Ok(d.clone());
        }
        let d = match id {
            DeviceId::Emu(_) | DeviceId::Host => Device::Cpu,
            DeviceId::Cuda(n) => cuda_device(*n, id, self.own_streams)?,
        };
        self.devices.insert(id.clone(), d.clone());
        Ok(d)
    }

    /// Opens every device of `ids` not opened yet, the GPUs at once (a thread each: a CUDA
    /// context, its memory pool and mold's kernels take a few hundred milliseconds a GPU).
    pub fn open_all(&mut self, ids: &[DeviceId]) -> Result<()> {
        let own_streams = self.own_streams;
        let mut new: Vec<&DeviceId> = Vec::new();
        for id in ids {
            if !self.devices.contains_key(id) && !new.contains(&id) {
                new.push(id);
            }
        }
        let opened: Vec<(DeviceId, Result<Device>)> = std::thread::scope(|s| {
            let threads: Vec<_> = new
                .iter()
                .map(|&id| {
                    s.spawn(move || {
                        let mut one = DeviceMap::new(own_streams);
                        (id.clone(), one.get(id))
                    })
                })
                .collect();
            threads
                .into_iter()
                .zip(&new)
                .map(|(t, &id)| {
                    t.join().unwrap_or_else(|_| {
                        (
                            id.clone(),
                            Err(ExecError::Device {
                                device: id.to_string(),
                                message: "opening it panicked".into(),
                            }),
                        )
                    })
                })
                .collect()
        });
        for (id, d) in opened {
            let d = d?;
            self.devices.entry(id).or_insert(d);
        }
        Ok(())
    }

    /// Waits for what this thread queued on every device opened so far (weights uploaded
    /// from this thread are complete before other threads' streams read them).
    pub fn synchronize(&self) -> Result<()> {
        for (id, d) in &self.devices {
            d.synchronize().map_err(|e| ExecError::Device {
                device: id.to_string(),
                message: e.to_string(),
            })?;
        }
        Ok(())
    }
}

/// Whether this build's kernels have code for the GPU (machine code, or PTX the driver
/// compiles): a GPU older than every architecture built is refused when it is opened, in one
/// line naming the rebuild, rather than at its first kernel. Where the GPU's compute
/// capability cannot be read, nothing is refused here (the first kernel would say).
#[cfg(feature = "cuda")]
fn kernels_run_on(cd: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    let Ok((major, minor)) = cd.cuda_stream().context().compute_capability() else {
        return Ok(());
    };
    let Ok(contents) = mold_fatbin::contents(crate::model::ops::KERNELS_FATBIN) else {
        return Ok(());
    };
    contents.check((major * 10 + minor) as u32).map(|_| ())
}

/// GPU `n`: with candle's default stream (the calling thread's per-thread default
/// stream), or with a stream of its own (`own_stream`). The executor's devices are used
/// from several threads (the loading thread, one rank thread per call): with per-thread
/// streams their work is ordered by thread, not by device, and every call of a
/// tensor-parallel part runs on new threads, so on new streams; cuBLAS, whose state is per
/// stream, then gave other results from the second call on (measured on 2 × H200: the same
/// TP2 text-to-image plan and seed gave other latents from step 2 on). With a stream of its
/// own, work for the device from any thread is queued on that one stream in program order,
/// and the latents repeat bit for bit at the same step time. It is not the default
/// because the tiny TP2 check hung (NCCL watchdog) twice in ~14 runs in this mode and
/// never with per-thread streams: cause not found yet. cudarc's per-buffer event tracking
/// (which a second stream switches on) is turned off: the executor orders its streams
/// itself (the weight ring's copy stream through its own events).
#[cfg(feature = "cuda")]
fn cuda_device(n: u32, id: &DeviceId, own_stream: bool) -> Result<Device> {
    let err = |e: candle_core::Error| ExecError::Device {
        device: id.to_string(),
        message: format!(
            // One line: candle's error may carry a captured backtrace after it.
            "cannot open it ({}): check the GPU exists and is visible (CUDA_VISIBLE_DEVICES)",
            e.to_string().lines().next().unwrap_or("no CUDA device")
        ),
    };
    let d = if !own_stream {
        Device::new_cuda(n as usize).map_err(err)?
    } else {
        let cd = candle_core::CudaDevice::new_with_stream(n as usize).map_err(err)?;
        // SAFETY: every buffer is used on this device's one stream, except the weight ring's
        // slots, which the ring orders with its own events; nothing relies on cudarc's
        // automatic cross-stream waits.
        unsafe { cd.disable_event_tracking() };
        Device::Cuda(cd)
    };
    if let Device::Cuda(cd) = &d {
        kernels_run_on(cd).map_err(|message| ExecError::Device {
            device: id.to_string(),
            message,
        })?;
        keep_freed_memory(cd).map_err(|message| ExecError::Device {
            device: id.to_string(),
            message,
        })?;
    }
    Ok(d)
}

/// Keeps the memory candle frees in the device's default memory pool (the stream-ordered
/// allocator candle allocates from) instead of giving it back to the driver at every
/// synchronisation: the pool's release threshold at its maximum, as PyTorch's caching
/// allocator keeps what it frees. With the default threshold (0) every synchronisation
/// trims the pool to what is in use, and the next pass maps its activations' memory again.
/// What the pool holds never exceeds its high-water mark of bytes in use, the peak the
/// cost model predicts. A device without memory pools is left as it is.
/// The default memory pool of `ctx`'s device (the stream-ordered allocator candle allocates
/// from), with `ctx` bound to this thread; `None` for a device without memory pools.
#[cfg(feature = "cuda")]
fn default_pool(
    ctx: &candle_core::cuda::cudarc::driver::CudaContext,
) -> std::result::Result<Option<candle_core::cuda::cudarc::driver::sys::CUmemoryPool>, String> {
    use candle_core::cuda::cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out pointer and the device of a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(|e| format!("its memory pool: {e:?}"))?;
    Ok(Some(pool))
}

#[cfg(feature = "cuda")]
fn keep_freed_memory(cd: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    use candle_core::cuda::cudarc::driver::sys;
    let Some(pool) = default_pool(cd.cuda_stream().context())? else {
        return Ok(());
    };
    let mut keep: u64 = u64::MAX;
    // SAFETY: the release threshold is a cuuint64_t, read through a valid pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| format!("its memory pool's release threshold: {e:?}"))
}

/// [`keep_freed_memory`] on a device opened elsewhere (benchmarks, tools): freed memory
/// stays in the CUDA pool as in the devices mold opens. Nothing on the host.
pub fn keep_freed_memory_of(dev: &Device) -> std::result::Result<(), String> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        return keep_freed_memory(cd);
    }
    let _ = dev;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_n: u32, id: &DeviceId, _own_stream: bool) -> Result<Device> {
    Err(ExecError::NoCuda {
        device: id.to_string(),
    })
}

/// The GPU-to-GPU hand-off paths used so far: `(from ordinal, to ordinal, peer copy)`,
/// one per pair of GPUs, `false` when staged through host memory.
pub fn hand_off_paths() -> Vec<(usize, usize, bool)> {
    #[cfg(feature = "cuda")]
    return peer::PAIRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}

/// Whether [`hand_off`] moves a tensor from `src` to `dst` without host memory: a peer
/// copy between two GPUs with peer access (and `peer_copies` on), or the host itself (an
/// emulated device). The executor copies a loaded shard's weights to another rank's device
/// only then; elsewhere each rank reads the checkpoint itself.
pub fn copies_directly(src: &Device, dst: &Device, peer_copies: bool) -> bool {
    #[cfg(not(feature = "cuda"))]
    let _ = peer_copies;
    match (src, dst) {
        (Device::Cpu, Device::Cpu) => true,
        #[cfg(feature = "cuda")]
        (Device::Cuda(s), Device::Cuda(d)) => {
            peer_copies && !src.same_device(dst) && peer::access(s, d)
        }
        _ => false,
    }
}

/// Whether GPU `s` can write `d`'s memory (its stream-ordered pool included) with a peer
/// copy: `cuDeviceCanAccessPeer`, checked once per pair, then enabled both ways — the
/// check [`hand_off`] makes. The copy engines' all-to-alls (`comm::copy_engine`) ask it.
#[cfg(feature = "cuda")]
pub(crate) fn peer_access(
    s: &candle_core::cuda::CudaDevice,
    d: &candle_core::cuda::CudaDevice,
) -> bool {
    peer::access(s, d)
}

/// Moves a tensor to `dst`: the one way mold moves data between two GPUs. Between two GPUs
/// that can access each other's memory (`cuDeviceCanAccessPeer`, checked once per pair,
/// then `cuCtxEnablePeerAccess` and the memory pools' access), a peer copy
/// (`cuMemcpyPeerAsync`, over NVLink or PCIe, on the destination's stream after the
/// source's work is done), unless `peer_copies` is off ([`crate::ExecOptions::peer_copies`],
/// `--no-peer`); between any other two GPUs, through host memory: candle's `to_device`, which
/// mold's patch of candle (vendor/README.md) makes read the source back on this thread's
/// stream of its GPU (the host waits) and upload it on this thread's stream of the
/// destination. Each GPU pair's path is recorded for [`hand_off_paths`]. Either way the copy
/// is ordered before the work this thread queues next on `dst`. The caller keeps `t` until
/// the receiving device's work on the copy is done (a peer copy reads it after this returns).
///
/// Unpatched, candle's copy between two GPUs queued `cuMemcpyPeerAsync` on the
/// destination's per-thread stream however the pair stood, and between GPUs without peer
/// access to each other's memory pools it was seen unordered with the destination's next
/// work: FLUX's text encoders copied that way encoded wrongly on 4 × H100 with `--no-peer`,
/// and a server's decode of latents from such a GPU gave another image now and then
/// (BENCHMARKS.md, "Replicas answering alike").
pub fn hand_off(t: &Tensor, dst: &Device, peer_copies: bool) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(s), Device::Cuda(d)) = (t.device(), dst) {
        if !t.device().same_device(dst) {
            if !peer_copies {
                peer::staged(s, d);
            } else if peer::access(s, d) {
                return peer::copy(t, s, d);
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = peer_copies;
    t.to_device(dst)
}

/// [`hand_off`] without the host waiting: between two GPUs with peer access, the
/// destination's stream waits on the GPU for the source's work so far (an event), copies, and
/// the source's stream waits for the copy before anything it runs next. Only for work with no
/// collectives between the two devices (a collective queued on one stream could then wait
/// for a rank whose stream waits for it); elsewhere as [`hand_off`].
pub fn hand_off_ordered(
    t: &Tensor,
    dst: &Device,
    peer_copies: bool,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(s), Device::Cuda(d)) = (t.device(), dst) {
        if peer_copies && !t.device().same_device(dst) && peer::access(s, d) {
            return peer::copy_ordered(t, d);
        }
    }
    hand_off(t, dst, peer_copies)
}

/// A point in the work one thread has queued for a tensor's device, which a thread of
/// another device can wait for ([`pull`]): on a GPU an event recorded on the recording
/// thread's stream; nothing on the host, where work is done when queued.
#[derive(Clone, Default)]
pub struct Ready {
    #[cfg(feature = "cuda")]
    event: Option<std::sync::Arc<candle_core::cuda::cudarc::driver::CudaEvent>>,
}

/// The point after everything this thread has queued so far on `t`'s device.
pub fn ready(t: &Tensor) -> candle_core::Result<Ready> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = t.device() {
        use candle_core::cuda::WrapErr;
        let e = d.cuda_stream().record_event(None).w()?;
        return Ok(Ready {
            event: Some(std::sync::Arc::new(e)),
        });
    }
    let _ = t;
    Ok(Ready::default())
}

/// `t` (contiguous, queued by another thread up to `ready`) copied to `dst` by this thread:
/// between two GPUs with peer access a peer copy on this thread's stream of `dst`, after
/// `ready` on the GPU (the host does not wait); else the host waits for `ready` and the copy
/// goes through host memory as [`hand_off`]'s. The sender keeps `t` (and does not write
/// it) until this thread's work on `dst` is done: nothing here orders the sender's later
/// work after the copy.
pub fn pull(
    t: &Tensor,
    ready: &Ready,
    dst: &Device,
    peer_copies: bool,
) -> candle_core::Result<Tensor> {
    if t.device().same_device(dst) {
        return Ok(t.clone());
    }
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(s), Device::Cuda(d)) = (t.device(), dst) {
        if !t.is_contiguous() {
            candle_core::bail!("pull: the sender's tensor is not contiguous");
        }
        // Two devices of one GPU (separate candle devices, e.g. a test of several bands on
        // one GPU) copy within it.
        let one_gpu = peer::ctx(s).ordinal() == peer::ctx(d).ordinal();
        if one_gpu || (peer_copies && peer::access(s, d)) {
            return peer::pull(t, ready.event.as_deref(), d);
        }
        if !peer_copies {
            peer::staged(s, d);
        }
        if let Some(e) = &ready.event {
            use candle_core::cuda::WrapErr;
            e.synchronize().w()?;
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (ready, peer_copies);
    t.to_device(dst)
}

#[cfg(feature = "cuda")]
mod peer {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{
        result, sys, CudaContext, CudaEvent, DevicePtr, DevicePtrMut,
    };
    use candle_core::cuda::{CudaDType, CudaDevice};
    use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Tensor};
    use std::sync::Mutex;

    /// The CUDA context of a candle device.
    pub(super) fn ctx(d: &CudaDevice) -> std::sync::Arc<CudaContext> {
        d.cuda_stream().context().clone()
    }

    /// Pairs checked so far: (from, to, peer access enabled).
    pub(super) static PAIRS: Mutex<Vec<(usize, usize, bool)>> = Mutex::new(Vec::new());

    /// Whether `s`'s GPU can read and write `d`'s memory; enables it the first time.
    pub(super) fn access(s: &CudaDevice, d: &CudaDevice) -> bool {
        let (a, b) = (ctx(s).ordinal(), ctx(d).ordinal());
        let mut pairs = PAIRS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, ok)) = pairs.iter().find(|(x, y, _)| (*x, *y) == (a, b)) {
            return *ok;
        }
        let ok = enable(s, d).is_ok();
        pairs.push((a, b, ok));
        ok
    }

    /// Records the pair `s` → `d` as staged through host memory (peer copies off).
    pub(super) fn staged(s: &CudaDevice, d: &CudaDevice) {
        let (a, b) = (ctx(s).ordinal(), ctx(d).ordinal());
        let mut pairs = PAIRS.lock().unwrap_or_else(|e| e.into_inner());
        if !pairs.iter().any(|(x, y, _)| (*x, *y) == (a, b)) {
            pairs.push((a, b, false));
        }
    }

    fn enable(s: &CudaDevice, d: &CudaDevice) -> Result<(), String> {
        let mut can = 0i32;
        // SAFETY: valid out pointer and device handles of live contexts.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, ctx(s).cu_device(), ctx(d).cu_device()) }
            .result()
            .map_err(|e| format!("{e:?}"))?;
        if can == 0 {
            return Err("no peer access between these GPUs".into());
        }
        // Both directions: the copy's source and destination contexts each map the other.
        for (from, to) in [(s, d), (d, s)] {
            ctx(from).bind_to_thread().map_err(|e| format!("{e:?}"))?;
            // SAFETY: `to`'s context is live; flags must be 0.
            match unsafe { sys::cuCtxEnablePeerAccess(ctx(to).cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => return Err(format!("{e:?}")),
            }
        }
        // Peer access of contexts does not reach memory from the stream-ordered allocator
        // (candle allocates from each device's default pool): without the pool's own grant a
        // copy between two pool allocations still works, but the driver stages it through
        // host memory (about 35 GB/s on an H100 box, against hundreds over NVLink).
        for (owner, peer) in [(s, d), (d, s)] {
            grant_pool(owner, peer)?;
        }
        Ok(())
    }

    /// Lets `peer`'s GPU read and write every allocation, present and future, of `owner`'s
    /// default memory pool (`cuMemPoolSetAccess`), as PyTorch's asynchronous allocator does
    /// for peers. A device without memory pools needs nothing.
    fn grant_pool(owner: &CudaDevice, peer: &CudaDevice) -> Result<(), String> {
        let Some(pool) = super::default_pool(&ctx(owner))? else {
            return Ok(());
        };
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx(peer).ordinal() as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `pool` is the owner's live default pool; one valid descriptor.
        unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
            .result()
            .map_err(|e| format!("cuMemPoolSetAccess: {e:?}"))
    }

    /// How a peer copy is ordered after the work that wrote its source.
    #[derive(Clone, Copy)]
    enum Order<'e> {
        /// The host waits for this thread's stream of the source's GPU.
        HostWaits,
        /// The destination's stream waits on the GPU for this thread's work on the source's
        /// GPU so far (an event), and the source's stream for the copy.
        Joined,
        /// The destination's stream waits on the GPU for an event another thread recorded
        /// (nothing when `None`); the source's stream is not touched.
        After(Option<&'e CudaEvent>),
    }

    /// The copy as a candle op on the source tensor, returning storage on `dst`.
    struct PeerCopy<'a> {
        dst: &'a CudaDevice,
        order: Order<'a>,
    }

    impl PeerCopy<'_> {
        fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let (start, end) = l
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg("peer copy: not contiguous".into()))?;
            let n = end - start;
            let src_dev = s.device().clone();
            let src_stream = src_dev.cuda_stream();
            let dst_stream = self.dst.cuda_stream();
            // The source was written from this thread's stream of its GPU: the copy, on the
            // destination's stream, comes after that work — through an event the destination
            // waits for on the GPU, or with the host waiting.
            match self.order {
                Order::Joined => dst_stream.join(&src_stream),
                Order::HostWaits => src_stream.synchronize(),
                Order::After(Some(e)) => dst_stream.wait(e),
                Order::After(None) => Ok(()),
            }
            .map_err(|e| candle_core::Error::Msg(format!("peer copy: {e:?}")))?;
            let src = s.as_cuda_slice::<T>()?.slice(start..end);
            // SAFETY: every element is written by the copy before anyone reads it.
            let mut out = unsafe { self.dst.alloc::<T>(n) }?;
            {
                let (sp, _sg) = src.device_ptr(&src_stream);
                let (dp, _dg) = out.device_ptr_mut(&dst_stream);
                // The destination's stream is this thread's per-thread stream
                // (`CU_STREAM_PER_THREAD`), which names the stream of the *current* context:
                // the calls above may have left the source's context current, and the copy
                // would then be queued on the source's stream, unordered with the work that
                // reads it on the destination (seen as wrong outputs and an illegal address
                // once peer copies of pool memory stopped going through the host).
                ctx(self.dst)
                    .bind_to_thread()
                    .map_err(|e| candle_core::Error::Msg(format!("peer copy: {e:?}")))?;
                // SAFETY: both buffers hold n elements of T and live until the guards
                // drop (after the enqueue, which records their use on the streams).
                unsafe {
                    result::memcpy_peer_async(
                        ctx(self.dst).cu_ctx(),
                        dp,
                        ctx(&src_dev).cu_ctx(),
                        sp,
                        n * std::mem::size_of::<T>(),
                        dst_stream.cu_stream(),
                    )
                }
                .map_err(|e| candle_core::Error::Msg(format!("cuMemcpyPeerAsync: {e:?}")))?;
            }
            // Ordered: the source's own stream waits for the copy, so whatever it runs next
            // — freeing the source (stream-ordered), reusing its memory — comes after the
            // copy has read it, and a source dropped at once never has its memory handed on
            // or given back to the driver mid-copy. The host-waiting copy leaves the source's
            // stream free: its callers keep the source until the receiving work is done (the
            // executor's parts, the ranks' weights), and a wait there would hold the sending
            // GPU until the receiver's queued work ends.
            if matches!(self.order, Order::Joined) {
                src_stream
                    .join(&dst_stream)
                    .map_err(|e| candle_core::Error::Msg(format!("peer copy: {e:?}")))?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, self.dst.clone()))
        }
    }

    impl CustomOp1 for PeerCopy<'_> {
        fn name(&self) -> &'static str {
            "peer-copy"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("peer copy of a CPU tensor")
        }
        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            use half::{bf16, f16};
            let out = match s.dtype() {
                DType::BF16 => self.run::<bf16>(s, l)?,
                DType::F16 => self.run::<f16>(s, l)?,
                DType::F32 => self.run::<f32>(s, l)?,
                DType::F64 => self.run::<f64>(s, l)?,
                DType::U32 => self.run::<u32>(s, l)?,
                DType::I64 => self.run::<i64>(s, l)?,
                DType::U8 => self.run::<u8>(s, l)?,
                DType::F8E4M3 => self.run::<float8::F8E4M3>(s, l)?,
                dt => candle_core::bail!("peer copy: unsupported dtype {dt:?}"),
            };
            Ok((out, l.shape().clone()))
        }
    }

    pub(super) fn copy(t: &Tensor, _s: &CudaDevice, d: &CudaDevice) -> candle_core::Result<Tensor> {
        let c = t.contiguous()?;
        let out = c.apply_op1_no_bwd(&PeerCopy {
            dst: d,
            order: Order::HostWaits,
        })?;
        if !t.is_contiguous() {
            // `c` is a copy made here: dropped on return, its memory goes back to the source's
            // pool at once (nothing is queued on the source's stream after the copy), where
            // the next allocation may take it before the destination's stream has read it.
            // The copy is done first. (The caller keeps a contiguous `t` itself.)
            use candle_core::backend::BackendDevice;
            d.synchronize()?;
        }
        drop(c);
        Ok(out)
    }

    pub(super) fn copy_ordered(t: &Tensor, d: &CudaDevice) -> candle_core::Result<Tensor> {
        t.contiguous()?.apply_op1_no_bwd(&PeerCopy {
            dst: d,
            order: Order::Joined,
        })
    }

    /// `t` (contiguous) copied to `d` on this thread's stream there after `ready`.
    pub(super) fn pull(
        t: &Tensor,
        ready: Option<&CudaEvent>,
        d: &CudaDevice,
    ) -> candle_core::Result<Tensor> {
        t.apply_op1_no_bwd(&PeerCopy {
            dst: d,
            order: Order::After(ready),
        })
    }
}

/// Reads checkpoint slices into host memory in the compute dtype; with `fp8`, the weights
/// of products quantized to FP8 per output feature ([`crate::model::fp8`]).
#[derive(Clone, Copy)]
pub(crate) struct CheckpointSource<'a> {
    pub ckpt: &'a Checkpoint,
    pub dtype: DType,
    pub fp8: bool,
}

/// Columns `cols` of an FP8 weight (`None`: all), each row keeping its scale.
fn fp8_cols(w: Fp8Weight, cols: Option<&[Range<usize>]>) -> candle_core::Result<Fp8Weight> {
    match cols {
        None => Ok(w),
        Some([c]) => w.narrow_cols(c.start, c.len()),
        Some(cs) => {
            let parts = cs
                .iter()
                .map(|c| w.values().narrow(1, c.start, c.len()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Fp8Weight::from_parts(Tensor::cat(&parts, 1)?, w.scales().clone())
        }
    }
}

impl WeightSource for CheckpointSource<'_> {
    fn load(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        self.ckpt.read_slice(name, rows, cols, self.dtype)
    }
    fn load_product(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Mat> {
        if !self.fp8 {
            return Ok(Mat::Dense(self.load(name, rows, cols)?));
        }
        // Whole rows first: a row's scale is its largest magnitude over all its columns,
        // whichever columns this rank keeps. An FP8 checkpoint's values (times their
        // stored scale) are read in f32, so requantizing them per row rounds only once.
        let stored_fp8 = self
            .ckpt
            .tensors()
            .get(name)
            .is_some_and(|h| h.dtype.starts_with("F8"));
        let read = if stored_fp8 { DType::F32 } else { self.dtype };
        let w = self.ckpt.read_slice(name, rows, None, read)?;
        Ok(Mat::Fp8(fp8_cols(Fp8Weight::quantize(&w)?, cols)?))
    }
}

/// Resident weights for a GPU: a slice the checkpoint holds as the model wants it
/// ([`Checkpoint::stored_slice`]) goes from the mapped file to the device through page-locked
/// buffers ([`crate::staging::Stager`]) and is cast there to the compute dtype; any other
/// (a LoRA merged in, diffusers' names, an FP8 checkpoint, FP8 products) is read on the host
/// by [`CheckpointSource`], for the caller to upload.
pub(crate) struct StagedSource<'a> {
    pub host: CheckpointSource<'a>,
    pub stager: &'a crate::staging::Stager,
}

impl WeightSource for StagedSource<'_> {
    fn load(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        match self.host.ckpt.stored_slice(name, rows, cols)? {
            Some(sel) if matches!(sel.dtype, DType::BF16 | DType::F16 | DType::F32) => {
                let t = self.stager.upload(&sel.pieces, sel.dtype, &sel.shape)?;
                Ok(t.to_dtype(self.host.dtype)?)
            }
            _ => self.host.load(name, rows, cols),
        }
    }
    fn load_product(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Mat> {
        if self.host.fp8 {
            // A product's whole rows as the checkpoint stores them (bf16 or f16) go to the
            // GPU through the staging buffers and are quantized there, instead of being
            // read, quantized and uploaded on the host (FLUX.1-dev's FP8 load on an H200:
            // 1.15 s so, 13.4 s on the host, 1.2 s in bf16; BENCHMARKS.md). A product loaded as
            // column pieces (row-parallel: a TP rank's share, FLUX's single-block output
            // projection's [attention, MLP] pieces) uploads the whole rows too (a row's
            // scale needs every column) and quantizes only its columns, with the rows'
            // scales. Checkpoints stored otherwise keep the host path.
            #[cfg(feature = "cuda")]
            if matches!(self.host.dtype, DType::BF16 | DType::F16) {
                if let Some(sel) = self.host.ckpt.stored_slice(name, rows, None)? {
                    let matrix = sel.shape.len() == 2 && sel.shape.iter().all(|&d| d > 0);
                    if matches!(sel.dtype, DType::BF16 | DType::F16) && matrix {
                        // The reading threads' rows on the device at once are bounded by
                        // the stager's quantizing window (the planner charges it); rows
                        // cast to the compute dtype are held twice until quantized.
                        let n = sel.shape.iter().product::<usize>();
                        let cast = if sel.dtype == self.host.dtype {
                            0
                        } else {
                            n * self.host.dtype.size_in_bytes()
                        };
                        let bytes = (n * sel.dtype.size_in_bytes() + cast) as u64;
                        return self.stager.quantizing(bytes, || {
                            let t = self.stager.upload(&sel.pieces, sel.dtype, &sel.shape)?;
                            let t = t.to_dtype(self.host.dtype)?;
                            Ok(Mat::Fp8(match cols {
                                None => Fp8Weight::quantize_on_gpu(&t)?,
                                Some(cs) => Fp8Weight::quantize_cols_on_gpu(&t, cs)?,
                            }))
                        });
                    }
                }
            }
            return self.host.load_product(name, rows, cols);
        }
        Ok(Mat::Dense(self.load(name, rows, cols)?))
    }
}

/// Shapes only: what [`CheckpointSource`] would read, as broadcast zeros (nothing read
/// or allocated). Loading a block from it gives the block's exact per-rank size, by the
/// model's own sharding, before any weight is touched.
pub(crate) struct ShapeSource<'a> {
    pub ckpt: &'a Checkpoint,
    pub dtype: DType,
    pub fp8: bool,
}

impl ShapeSource<'_> {
    fn shape(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Vec<usize>> {
        let h = self.ckpt.tensors().get(name).ok_or_else(|| {
            ExecError::Plan(format!("tensor `{name}` is not in {}", self.ckpt.path()))
        })?;
        let len = |r: &[Range<usize>]| r.iter().map(|x| x.len()).sum::<usize>();
        let mut shape = h.shape.clone();
        if let (Some(r), Some(d)) = (rows, shape.first_mut()) {
            *d = len(r);
        }
        if let (Some(c), Some(d)) = (cols, shape.get_mut(1)) {
            *d = len(c);
        }
        Ok(shape)
    }
}

impl WeightSource for ShapeSource<'_> {
    fn load(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        let shape = self.shape(name, rows, cols)?;
        Ok(Tensor::zeros((), self.dtype, &Device::Cpu)?.broadcast_as(shape)?)
    }
    fn load_product(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Mat> {
        if !self.fp8 {
            return Ok(Mat::Dense(self.load(name, rows, cols)?));
        }
        let shape = self.shape(name, rows, cols)?;
        let n = shape.first().copied().unwrap_or(1);
        let q = Tensor::zeros((), DType::F8E4M3, &Device::Cpu)?.broadcast_as(shape)?;
        let s = Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(n)?;
        Ok(Mat::Fp8(Fp8Weight::from_parts(q, s)?))
    }
}

/// Where a block's weights live between uses.
pub(crate) enum Held<B> {
    /// On the rank's device for the whole run.
    Resident(B),
    /// Block `.1` of ring `.0` ([`crate::streaming::Ring`]): host memory, copied ahead into
    /// one of the device's stream buffers.
    Streamed(usize, usize),
    /// [`crate::streaming::Streaming::Sync`]: in pageable host memory, copied to a fresh
    /// allocation right before the block runs, freed after it.
    Sync(B),
}

/// Measured memory of one device, summed over the parts it serves.
///
/// All figures are *accounted* bytes, computed from the shapes and dtypes of the tensors
/// exec holds; they are not allocator peaks (on the CPU, for emulated devices, nothing
/// else is available).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    pub device: DeviceId,
    /// Weights kept on the device for the whole run (resident blocks, stem, final layer).
    pub resident_weight_bytes: u64,
    /// Device bytes for streamed block weights: the device's stream buffers (one set per
    /// device, shared by its streamed parts), or the largest streamed block in `sync`
    /// streaming.
    pub stream_buffer_bytes: u64,
    /// How many stream buffers (0: nothing streams here, 1: `sync` streaming).
    pub stream_buffers: usize,
    /// Host memory holding this device's streamed weights.
    pub host_weight_bytes: u64,
    /// Whether that host memory is page-locked.
    pub host_pinned: bool,
    /// The largest single activation tensor the model code recorded on this device
    /// (attention weights are usually the largest).
    pub largest_activation_bytes: u64,
    /// The most bytes of the blocks' modulation outputs computed ahead for a window of
    /// steps held at once, between steps ([`crate::model::modulation::ModulationCache`]).
    pub ahead_bytes: u64,
}
