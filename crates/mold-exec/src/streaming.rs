//! Weight streaming: blocks whose weights live in host memory and reach their device
//! just in time.
//!
//! Each device that runs streamed blocks has one [`Ring`], shared by every streamed part
//! on that device (as the cost model and the simulator assume):
//!
//! - at load, each streamed block is packed into **one contiguous host buffer** (page-
//!   locked on CUDA, within what the driver grants; pageable otherwise), with every
//!   tensor at a 256-byte aligned offset;
//! - the device holds `N` buffers (the plan's `stream_buffers`), allocated once; a
//!   block's weights on the device are *views* into one of them, built once per buffer
//!   and block layout, so nothing is allocated per block;
//! - on CUDA a dedicated copy stream fills buffer `j` with the next block while the
//!   compute stream runs the current one: the compute stream waits on the buffer's
//!   "ready" event, and the copy stream waits on its "free" event (recorded after the
//!   block's kernels) before overwriting it. No device-wide synchronize in the loop;
//! - the copy stream runs ahead across parts and across steps: after the last streamed
//!   block of a step, its buffer is refilled with the first block of the next step, so
//!   resident blocks between streamed ones hide copies, and the next step starts with
//!   its first buffers already full.
//!
//! On the CPU (emulated devices) the same ring runs with synchronous copies into the
//! same views, so CI checks the buffer rotation, the views and the block order.
//!
//! [`Streaming::Sync`] keeps the naive path (copy from pageable memory, compute,
//! synchronize, free) as a benchmark baseline.

use crate::error::{ExecError, Result};
use crate::model::Packable;
use candle_core::{DType, Device, Tensor};
use std::collections::VecDeque;

/// How streamed blocks reach their device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Streaming {
    /// Page-locked host copies, a copy stream and `N` device buffers; falls back to
    /// [`Streaming::Pageable`] with a warning when the driver refuses to pin.
    #[default]
    Pinned,
    /// The same pipeline from pageable host memory (each copy is staged by the driver,
    /// and the host waits for it).
    Pageable,
    /// The baseline: per block, copy from pageable memory into a fresh allocation,
    /// compute, synchronize, free.
    Sync,
}

impl Streaming {
    /// `pinned`, `pageable` or `sync`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "pinned" => Ok(Streaming::Pinned),
            "pageable" => Ok(Streaming::Pageable),
            "sync" => Ok(Streaming::Sync),
            other => Err(format!(
                "`{other}` is not a streaming mode: use pinned (the default: page-locked \
                 host memory, copy stream, double buffering), pageable (the same from \
                 pageable memory) or sync (the baseline: copy, compute, synchronize, free)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Streaming::Pinned => "pinned",
            Streaming::Pageable => "pageable",
            Streaming::Sync => "sync",
        }
    }
}

impl std::fmt::Display for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Offsets are multiples of this many bytes (cuBLAS and the fused kernels want aligned
/// operands; 256 is what `cudaMalloc` itself guarantees).
const ALIGN_BYTES: usize = 256;

fn tensor_list<B: Packable>(b: &B) -> candle_core::Result<Vec<Tensor>> {
    let mut v = Vec::new();
    b.map_tensors(&mut |t| {
        v.push(t.clone());
        Ok(t.clone())
    })?;
    Ok(v)
}

/// How one kind of block (one set of tensor shapes) lies in a buffer.
struct Layout<B> {
    shapes: Vec<Vec<usize>>,
    offsets: Vec<usize>,
    /// Elements spanned, padding included.
    elems: usize,
    /// A block of this layout: its structure is reused for the views.
    proto: B,
}

impl<B: Packable> Layout<B> {
    fn of(b: &B, dtype: DType) -> candle_core::Result<Layout<B>> {
        let align = (ALIGN_BYTES / dtype.size_in_bytes()).max(1);
        let mut shapes = Vec::new();
        let mut offsets = Vec::new();
        let mut off = 0usize;
        for t in tensor_list(b)? {
            if t.dtype() != dtype {
                candle_core::bail!(
                    "a streamed block mixes dtypes ({:?} and {dtype:?})",
                    t.dtype()
                );
            }
            shapes.push(t.dims().to_vec());
            offsets.push(off);
            off += t.elem_count().div_ceil(align) * align;
        }
        Ok(Layout {
            shapes,
            offsets,
            elems: off,
            proto: b.clone(),
        })
    }

    /// The block's tensors packed at this layout's offsets, as one 1-D host tensor.
    fn pack(&self, b: &B, dtype: DType) -> candle_core::Result<Tensor> {
        let mut pieces = Vec::new();
        let mut at = 0usize;
        for (t, off) in tensor_list(b)?.iter().zip(&self.offsets) {
            if *off > at {
                pieces.push(Tensor::zeros(off - at, dtype, &Device::Cpu)?);
            }
            pieces.push(t.to_device(&Device::Cpu)?.flatten_all()?);
            at = off + t.elem_count();
        }
        if self.elems > at {
            pieces.push(Tensor::zeros(self.elems - at, dtype, &Device::Cpu)?);
        }
        Tensor::cat(&pieces, 0)
    }

    /// The block's structure over `buf` (1-D, on the device): each tensor a view.
    fn views(&self, buf: &Tensor) -> candle_core::Result<B> {
        let mut i = 0usize;
        self.proto.map_tensors(&mut |t| {
            let (off, shape) = (self.offsets[i], &self.shapes[i]);
            i += 1;
            buf.narrow(0, off, t.elem_count())?
                .reshape(shape.as_slice())
        })
    }
}

/// A streamed block's weights in host memory.
enum HostData {
    /// A 1-D CPU tensor (pageable).
    Tensor(Tensor),
    /// Page-locked bytes.
    #[cfg(feature = "cuda")]
    Pinned(candle_core::cuda::cudarc::driver::PinnedHostSlice<u8>),
}

struct HostBlock {
    layout: usize,
    /// Weight bytes, padding excluded.
    bytes: u64,
    data: HostData,
}

struct Slot<B> {
    /// 1-D device buffer; the views below alias it.
    buf: Tensor,
    /// One view of the buffer per layout.
    views: Vec<B>,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::SlotGpu>,
}

/// The streaming state of one device; see the module docs.
pub(crate) struct Ring<B> {
    device: Device,
    dtype: DType,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    requested: Streaming,
    layouts: Vec<Layout<B>>,
    host: Vec<HostBlock>,
    slots: Vec<Slot<B>>,
    buffers: usize,
    /// Copies issued and not yet fetched: `(block, slot)`, in fetch order.
    queue: VecDeque<(usize, usize)>,
    /// The block being computed from a slot: `(block, slot)`.
    in_use: Option<(usize, usize)>,
    pinned_failed: Option<String>,
    copies: std::cell::Cell<u64>,
    restarts: u64,
    #[cfg(feature = "cuda")]
    copy_stream: Option<std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>>,
}

/// What a ring holds, for the memory report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingInfo {
    /// Device buffers, allocated once.
    pub buffers: usize,
    /// All of them together (each holds the largest streamed block, 256-byte aligned
    /// tensors).
    pub buffer_bytes: u64,
    /// Weight bytes of the streamed blocks held in host memory.
    pub host_bytes: u64,
    /// Whether all of that host memory is page-locked.
    pub pinned: bool,
    /// Host→device block copies issued so far.
    pub copies: u64,
    /// Times the ring was drained and refilled: once at the first step, then only when
    /// blocks are fetched out of order (after an error).
    pub restarts: u64,
}

impl<B: Packable> Ring<B> {
    pub fn new(device: Device, dtype: DType, mode: Streaming, buffers: usize) -> Ring<B> {
        Ring {
            device,
            dtype,
            requested: mode,
            layouts: Vec::new(),
            host: Vec::new(),
            slots: Vec::new(),
            buffers: buffers.max(1),
            queue: VecDeque::new(),
            in_use: None,
            pinned_failed: None,
            copies: std::cell::Cell::new(0),
            restarts: 0,
            #[cfg(feature = "cuda")]
            copy_stream: None,
        }
    }

    /// Raises the number of device buffers to at least `n` (parts on the same device
    /// share one ring; the largest request wins).
    pub fn want_buffers(&mut self, n: usize) {
        self.buffers = self.buffers.max(n.max(1));
    }

    /// Packs `b` (host tensors) into host memory; returns its index in the ring.
    pub fn add(&mut self, b: &B) -> Result<usize> {
        let shapes: Vec<Vec<usize>> = tensor_list(b)?.iter().map(|t| t.dims().to_vec()).collect();
        let layout = match self.layouts.iter().position(|l| l.shapes == shapes) {
            Some(i) => i,
            None => {
                self.layouts.push(Layout::of(b, self.dtype)?);
                self.layouts.len() - 1
            }
        };
        let packed = self.layouts[layout].pack(b, self.dtype)?;
        let data = self.stage(packed)?;
        self.host.push(HostBlock {
            layout,
            bytes: b.bytes(),
            data,
        });
        Ok(self.host.len() - 1)
    }

    #[cfg(feature = "cuda")]
    fn stage(&mut self, packed: Tensor) -> Result<HostData> {
        if !self.device.is_cuda()
            || self.requested != Streaming::Pinned
            || self.pinned_failed.is_some()
        {
            return Ok(HostData::Tensor(packed));
        }
        match gpu::pin(&self.device, &packed) {
            Ok(p) => Ok(HostData::Pinned(p)),
            Err(e) => {
                self.pinned_failed = Some(e.to_string());
                Ok(HostData::Tensor(packed))
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn stage(&mut self, packed: Tensor) -> Result<HostData> {
        Ok(HostData::Tensor(packed))
    }

    /// Why pinning was refused, if it was (the ring then streams from pageable memory).
    pub fn pinned_failed(&self) -> Option<&str> {
        self.pinned_failed.as_deref()
    }

    /// Allocates the device buffers and their views, once, after the last [`Ring::add`].
    pub fn finish(&mut self) -> Result<()> {
        let m = self.host.len();
        if m == 0 {
            return Ok(());
        }
        self.buffers = self.buffers.min(m);
        let elems = self.layouts.iter().map(|l| l.elems).max().unwrap_or(0);
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            self.copy_stream = Some(gpu::copy_stream(&self.device)?);
        }
        for _ in 0..self.buffers {
            let buf = Tensor::zeros(elems, self.dtype, &self.device)?;
            let views = self
                .layouts
                .iter()
                .map(|l| l.views(&buf))
                .collect::<candle_core::Result<Vec<_>>>()?;
            #[cfg(feature = "cuda")]
            let gpu = if self.device.is_cuda() {
                Some(gpu::SlotGpu::new(&buf)?)
            } else {
                None
            };
            self.slots.push(Slot {
                buf,
                views,
                #[cfg(feature = "cuda")]
                gpu,
            });
        }
        Ok(())
    }

    pub fn info(&self) -> RingInfo {
        let elems = self.layouts.iter().map(|l| l.elems).max().unwrap_or(0) as u64;
        let size = self.dtype.size_in_bytes() as u64;
        RingInfo {
            buffers: self.slots.len(),
            buffer_bytes: self.slots.len() as u64 * elems * size,
            host_bytes: self.host.iter().map(|h| h.bytes).sum(),
            pinned: self
                .host
                .iter()
                .all(|h| !matches!(h.data, HostData::Tensor(_))),
            copies: self.copies.get(),
            restarts: self.restarts,
        }
    }

    /// Starts copying the first blocks if nothing is in flight (the copies then overlap
    /// whatever runs before the first streamed block).
    pub fn prime(&mut self) -> Result<()> {
        if self.queue.is_empty() && self.in_use.is_none() && !self.host.is_empty() {
            self.restart(0)?;
        }
        Ok(())
    }

    /// Block `k`'s weights on the device, ready for kernels queued from this thread.
    /// Blocks are fetched in ring order (`0, 1, …, M−1, 0, …`); any other order (after
    /// an error, say) drains the ring and starts over from `k`.
    pub fn fetch(&mut self, k: usize) -> Result<B> {
        if self.in_use.is_some() || self.queue.front().map(|q| q.0) != Some(k) {
            self.restart(k)?;
        }
        let (b, j) = self.queue.pop_front().expect("restart queues block k");
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.slots[j].gpu {
            g.wait_ready(&self.device)?;
        }
        self.in_use = Some((b, j));
        Ok(self.slots[j].views[self.host[b].layout].clone())
    }

    /// Called once the fetched block's kernels are queued: its buffer may be refilled
    /// (once those kernels are done) with the next block not yet in a buffer.
    pub fn release(&mut self) -> Result<()> {
        let Some((b, j)) = self.in_use.take() else {
            return Ok(());
        };
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.slots[j].gpu {
            g.record_free(&self.device)?;
        }
        let m = self.host.len();
        if self.slots.len() >= m {
            // Every block has its own buffer: nothing to copy again.
            self.queue.push_back((b, j));
            return Ok(());
        }
        let next = match self.queue.back() {
            Some(&(last, _)) => (last + 1) % m,
            None => (b + 1) % m,
        };
        self.copy(next, j)?;
        self.queue.push_back((next, j));
        Ok(())
    }

    /// Drains everything in flight, then queues copies of `k, k+1, …` into the buffers.
    fn restart(&mut self, k: usize) -> Result<()> {
        self.drain()?;
        self.queue.clear();
        self.in_use = None;
        self.restarts += 1;
        let m = self.host.len();
        if k >= m {
            return Err(ExecError::Plan(format!(
                "streamed block {k} requested, the ring holds {m}"
            )));
        }
        for j in 0..self.slots.len() {
            let b = (k + j) % m;
            self.copy(b, j)?;
            self.queue.push_back((b, j));
        }
        Ok(())
    }

    /// Fills slot `j` with block `b`.
    fn copy(&self, b: usize, j: usize) -> Result<()> {
        let slot = &self.slots[j];
        self.copies.set(self.copies.get() + 1);
        #[cfg(feature = "cuda")]
        if let (Some(g), Some(s)) = (&slot.gpu, &self.copy_stream) {
            return match &self.host[b].data {
                HostData::Pinned(p) => g.copy_pinned(s, p),
                HostData::Tensor(t) => g.copy_pageable(s, t),
            };
        }
        match &self.host[b].data {
            HostData::Tensor(t) => {
                slot.buf.slice_set(t, 0, 0)?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            HostData::Pinned(_) => Err(ExecError::Plan(
                "pinned host data on a device without a copy stream".into(),
            )),
        }
    }
}

impl<B> Ring<B> {
    fn drain(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.copy_stream {
            s.synchronize().map_err(|e| ExecError::Device {
                device: format!("{:?}", self.device.location()),
                message: format!("copy stream: {e}"),
            })?;
            self.device.synchronize()?;
        }
        Ok(())
    }
}

impl<B> Drop for Ring<B> {
    fn drop(&mut self) {
        // Copies may still read host memory or write buffers that are about to be freed.
        let _ = self.drain();
    }
}

/// The host memory a process may still use, and where that figure comes from: the
/// smallest of `MemAvailable` (/proc/meminfo), the cgroup's limit minus its usage, and
/// `limit` (an explicit budget: [`crate::ExecOptions::host_memory`]). `None` where none
/// is known.
pub fn host_memory_available(limit: Option<u64>) -> Option<(u64, &'static str)> {
    let mut best: Option<(u64, &'static str)> = None;
    let mut take = |v: u64, from: &'static str| {
        if best.is_none_or(|(b, _)| v < b) {
            best = Some((v, from));
        }
    };
    if let Some(b) = limit {
        take(b, "MOLD_HOST_MEMORY");
    }
    if let Ok(s) = std::fs::read_to_string("/proc/meminfo") {
        if let Some(kb) = s
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            take(kb * 1024, "MemAvailable in /proc/meminfo");
        }
    }
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    if let (Some(max), Some(cur)) = (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        take(
            max.saturating_sub(cur),
            "the cgroup's memory.max less memory.current",
        );
    }
    best
}

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    //! The CUDA side of a ring: pinned staging, the copy stream, per-slot events.
    use crate::error::{ExecError, Result};
    use candle_core::cuda::cudarc::driver::{
        result, sys, CudaEvent, CudaStream, DevicePtr, PinnedHostSlice,
    };
    use candle_core::{DType, Device, Storage, Tensor};
    use std::sync::Arc;

    fn dev_err(device: &Device, what: &str, e: impl std::fmt::Display) -> ExecError {
        ExecError::Device {
            device: format!("{:?}", device.location()),
            message: format!("{what}: {e}"),
        }
    }

    /// The bytes of a 1-D CPU tensor.
    pub fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*st else {
            return Err(ExecError::Plan("host block data is not on the host".into()));
        };
        fn raw<T>(v: &[T], start: usize, n: usize) -> &[u8] {
            let v = &v[start..start + n];
            // SAFETY: plain numeric data, viewed as bytes for its whole length.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        let (s, n) = (l.start_offset(), t.elem_count());
        let bytes = match cpu {
            candle_core::CpuStorage::BF16(v) => raw(v, s, n),
            candle_core::CpuStorage::F16(v) => raw(v, s, n),
            candle_core::CpuStorage::F32(v) => raw(v, s, n),
            _ => return Err(ExecError::UnsupportedDtype(format!("{:?}", t.dtype()))),
        };
        Ok(f(bytes))
    }

    /// Page-locked copy of a packed block.
    pub fn pin(device: &Device, packed: &Tensor) -> Result<PinnedHostSlice<u8>> {
        let cd = device.as_cuda_device()?;
        let ctx = cd.cuda_stream().context().clone();
        let n = packed.elem_count() * packed.dtype().size_in_bytes();
        // SAFETY: filled right below, before any use.
        let mut p = unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0) }
            .map_err(|e| dev_err(device, "page-locking host memory", e))?;
        let dst = p
            .as_mut_slice()
            .map_err(|e| dev_err(device, "page-locked memory", e))?;
        with_bytes(packed, |src| dst.copy_from_slice(src))?;
        Ok(p)
    }

    pub fn copy_stream(device: &Device) -> Result<Arc<CudaStream>> {
        let cd = device.as_cuda_device()?;
        cd.cuda_stream()
            .context()
            .new_stream()
            .map_err(|e| dev_err(device, "creating the copy stream", e))
    }

    pub struct SlotGpu {
        ptr: sys::CUdeviceptr,
        ready: CudaEvent,
        free: CudaEvent,
    }

    impl SlotGpu {
        pub fn new(buf: &Tensor) -> Result<SlotGpu> {
            let device = buf.device().clone();
            let cd = device.as_cuda_device()?;
            let stream = cd.cuda_stream();
            let ptr = {
                let (st, _) = buf.storage_and_layout();
                let Storage::Cuda(cs) = &*st else {
                    return Err(ExecError::Plan("stream buffer is not on a GPU".into()));
                };
                match buf.dtype() {
                    DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
                    DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
                    DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
                    d => return Err(ExecError::UnsupportedDtype(format!("{d:?}"))),
                }
            };
            // The zero-fill must land before the first copy overwrites it.
            stream
                .synchronize()
                .map_err(|e| dev_err(&device, "stream buffer", e))?;
            let ctx = stream.context();
            let ev = || {
                ctx.new_event(None)
                    .map_err(|e| dev_err(&device, "event", e))
            };
            Ok(SlotGpu {
                ptr,
                ready: ev()?,
                free: ev()?,
            })
        }

        /// The device's compute stream waits for the slot's copy.
        pub fn wait_ready(&self, device: &Device) -> Result<()> {
            let s = device.as_cuda_device()?.cuda_stream();
            s.wait(&self.ready)
                .map_err(|e| dev_err(device, "waiting for a weight copy", e))
        }

        /// Marks the slot free once the compute stream's queued work is done.
        pub fn record_free(&self, device: &Device) -> Result<()> {
            let s = device.as_cuda_device()?.cuda_stream();
            self.free
                .record(&s)
                .map_err(|e| dev_err(device, "recording a buffer release", e))
        }

        fn copy_bytes(&self, s: &CudaStream, src: &[u8]) -> Result<()> {
            let ctx = s.context();
            let fail = |e: candle_core::cuda::cudarc::driver::DriverError| ExecError::Device {
                device: format!("cuda:{}", ctx.ordinal()),
                message: format!("host→device weight copy: {e}"),
            };
            s.wait(&self.free).map_err(fail)?;
            ctx.bind_to_thread().map_err(fail)?;
            // SAFETY: `ptr` is this slot's buffer, at least `src.len()` bytes (every
            // layout fits the buffer) and alive as long as the ring; `src` outlives the
            // copy (pinned data lives in the ring; pageable copies are staged by the
            // driver before the call returns).
            unsafe { result::memcpy_htod_async(self.ptr, src, s.cu_stream()) }.map_err(fail)?;
            self.ready.record(s).map_err(fail)
        }

        pub fn copy_pinned(&self, s: &CudaStream, p: &PinnedHostSlice<u8>) -> Result<()> {
            let src = p.as_slice().map_err(|e| ExecError::Device {
                device: format!("cuda:{}", s.context().ordinal()),
                message: format!("page-locked memory: {e}"),
            })?;
            self.copy_bytes(s, src)
        }

        pub fn copy_pageable(&self, s: &CudaStream, t: &Tensor) -> Result<()> {
            with_bytes(t, |src| self.copy_bytes(s, src))?
        }
    }
}
