//! Loading weights onto a GPU through page-locked staging buffers.
//!
//! A weight read from a checkpoint the plain way is copied twice on the host (the mapped
//! file's bytes into a vector, the vector into a tensor) and uploaded from pageable memory,
//! which CUDA stages through its own buffers on the calling thread (about 7 GB/s on an H100
//! host, against 55 GB/s from page-locked memory; `benches/load/run`). A [`Stager`] copies
//! the stored bytes of a tensor straight from the mapped file into a few page-locked
//! buffers, in chunks on the rayon pool, and queues each chunk's copy to the tensor's
//! memory on a copy stream of its own; a buffer is refilled once its last copy is done (an
//! event per buffer). The tensor is then in the stored dtype, cast on the device where the
//! model asks for another.
//!
//! The copies go on the stager's own stream, not the device's: a device opened with
//! `Device::new_cuda` runs on CUDA's per-thread default stream, so copies queued "on the
//! device's stream" from the rayon threads would land on each thread's own stream, unordered
//! with the thread that uses the weights. The copy stream first waits for the tensor's
//! allocation (made on the calling thread's stream), and `upload` returns once its copies
//! are done: the tensor is then complete for any thread and stream.
//!
//! Only CUDA devices have a stager ([`Stager::new`] is `None` elsewhere, and where the
//! host memory cannot be page-locked): the caller falls back to reading on the host.

use candle_core::{DType, Device};

/// Bytes a staging buffer holds: one chunk of a tensor.
pub const CHUNK_BYTES: usize = 16 << 20;

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// Where `off..off + len` of the concatenation of `pieces` (with `starts[i]` the offset of
/// `pieces[i]`) is copied to `dst` (`len` bytes).
pub(crate) fn gather(pieces: &[&[u8]], starts: &[usize], off: usize, dst: &mut [u8]) {
    let end = off + dst.len();
    // The last piece starting at or before `off`.
    let mut i = starts.partition_point(|&s| s <= off).saturating_sub(1);
    let mut at = off;
    while at < end && i < pieces.len() {
        let (p, s) = (pieces[i], starts[i]);
        let from = at - s;
        let n = (p.len() - from).min(end - at);
        dst[at - off..at - off + n].copy_from_slice(&p[from..from + n]);
        at += n;
        i += 1;
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// The offset of each piece in the concatenation, and the total.
pub(crate) fn offsets(pieces: &[&[u8]]) -> (Vec<usize>, usize) {
    let mut starts = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        starts.push(total);
        total += p.len();
    }
    (starts, total)
}

#[cfg(feature = "cuda")]
pub use gpu::Stager;

/// Files below this size load through candle's reader ([`var_builder`]).
pub const STAGED_MIN_BYTES: u64 = 1 << 30;

/// A `VarBuilder` over safetensors `files` for `dev` (the text encoders and VAEs): on a GPU
/// with a [`Stager`] each tensor is staged to the device as stored and cast there; elsewhere
/// (or with `staged` false) candle's memory-mapped builder, which uploads each tensor from
/// the mapped file as pageable memory; likewise files of under [`STAGED_MIN_BYTES`] together.
pub fn var_builder(
    files: &[std::path::PathBuf],
    dtype: DType,
    dev: &Device,
    staged: bool,
) -> candle_core::Result<candle_nn::VarBuilder<'static>> {
    // SAFETY: the files are mapped read-only and must not change while loading.
    let mmap = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files)? };
    // Small files (CLIP's 0.2 GB) load faster than the staging buffers are page-locked.
    let bytes: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    #[cfg(feature = "cuda")]
    if staged && bytes >= STAGED_MIN_BYTES {
        if let Some(stager) = Stager::new(dev).map_err(candle_core::Error::wrap)? {
            let backend: Box<dyn candle_nn::var_builder::SimpleBackend> =
                Box::new(gpu::StagedSafetensors { mmap, stager });
            return Ok(candle_nn::VarBuilder::from_backend(
                backend,
                dtype,
                dev.clone(),
            ));
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (staged, bytes);
    let backend: Box<dyn candle_nn::var_builder::SimpleBackend> = Box::new(mmap);
    Ok(candle_nn::VarBuilder::from_backend(
        backend,
        dtype,
        dev.clone(),
    ))
}

/// At most `limit` bytes admitted at once, across threads: a request waits until what is
/// held leaves room for it; one larger than `limit` is admitted when nothing else is held, so
/// every request is admitted in time. A GPU's FP8 weights quantized at load go through one
/// ([`Stager::quantizing`]), which bounds the bf16 rows the reading threads hold there at
/// once by `mold_cost::load::FP8_STAGING_WINDOW_BYTES`, the figure the planner charges.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct ByteWindow {
    limit: u64,
    held: std::sync::Mutex<u64>,
    left: std::sync::Condvar,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl ByteWindow {
    pub(crate) fn new(limit: u64) -> ByteWindow {
        ByteWindow {
            limit,
            held: std::sync::Mutex::new(0),
            left: std::sync::Condvar::new(),
        }
    }

    /// Waits for room for `bytes`; they are held until the slot is dropped.
    pub(crate) fn enter(&self, bytes: u64) -> WindowSlot<'_> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        while *held > 0 && held.saturating_add(bytes) > self.limit {
            held = self.left.wait(held).unwrap_or_else(|p| p.into_inner());
        }
        *held = held.saturating_add(bytes);
        WindowSlot {
            window: self,
            bytes,
        }
    }
}

/// Bytes held in a [`ByteWindow`] until dropped.
pub(crate) struct WindowSlot<'a> {
    window: &'a ByteWindow,
    bytes: u64,
}

impl Drop for WindowSlot<'_> {
    fn drop(&mut self) {
        let mut held = self.window.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(self.bytes);
        self.window.left.notify_all();
    }
}

#[cfg(not(feature = "cuda"))]
/// Uploads through page-locked buffers: CUDA builds only.
pub enum Stager {}

#[cfg(not(feature = "cuda"))]
impl Stager {
    /// No stager without CUDA.
    pub fn new(_device: &Device) -> crate::error::Result<Option<Stager>> {
        Ok(None)
    }
    pub fn upload(
        &self,
        _pieces: &[&[u8]],
        _dtype: DType,
        _shape: &[usize],
    ) -> crate::error::Result<candle_core::Tensor> {
        match *self {}
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{gather, offsets, CHUNK_BYTES};
    use crate::error::{ExecError, Result};
    use candle_core::cuda::cudarc::driver::{
        result, sys, CudaEvent, CudaStream, DevicePtr, PinnedHostSlice,
    };
    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::{DType, Device, Storage, Tensor};
    use rayon::prelude::*;
    use std::sync::{Arc, Condvar, Mutex};

    struct Buf {
        host: PinnedHostSlice<u8>,
        /// Recorded after the last copy out of `host`.
        done: CudaEvent,
    }

    /// Page-locked staging buffers for one device.
    pub struct Stager {
        device: Device,
        cuda: CudaDevice,
        /// The device's stream (as seen from the calling thread): allocations.
        stream: Arc<CudaStream>,
        /// The stager's own stream: every staged copy.
        copy: Arc<CudaStream>,
        free: Mutex<Vec<Buf>>,
        returned: Condvar,
        /// The bf16 rows held on the device until quantized to FP8 ([`Stager::quantizing`]).
        quantize: super::ByteWindow,
    }

    fn dev_err(device: &Device, what: &str, e: impl std::fmt::Display) -> ExecError {
        ExecError::Device {
            device: format!("{:?}", device.location()),
            message: format!("{what}: {e}"),
        }
    }

    impl Stager {
        /// Two buffers per rayon thread (at most 16 buffers, 256 MiB of page-locked
        /// memory) for a CUDA `device`; `None` for another device, or where page-locking
        /// the buffers fails (the reason on standard error, once).
        pub fn new(device: &Device) -> Result<Option<Stager>> {
            let Device::Cuda(cuda) = device else {
                return Ok(None);
            };
            let stream = cuda.cuda_stream();
            let ctx = stream.context().clone();
            let copy = ctx
                .new_stream()
                .map_err(|e| dev_err(device, "creating the staging stream", e))?;
            let n = 2 * rayon::current_num_threads().clamp(1, 8);
            let mut bufs = Vec::with_capacity(n);
            for _ in 0..n {
                // SAFETY: every byte copied out is written first (`gather`).
                let host = match unsafe { ctx.alloc_pinned_with_flags::<u8>(CHUNK_BYTES, 0) } {
                    Ok(h) => h,
                    Err(e) => {
                        eprintln!(
                            "note: {:?}: page-locking {} MiB of staging memory failed ({e}): weights load through pageable memory",
                            device.location(),
                            n * (CHUNK_BYTES >> 20)
                        );
                        return Ok(None);
                    }
                };
                let done = ctx
                    .new_event(None)
                    .map_err(|e| dev_err(device, "event", e))?;
                bufs.push(Buf { host, done });
            }
            Ok(Some(Stager {
                device: device.clone(),
                cuda: cuda.clone(),
                stream,
                copy,
                free: Mutex::new(bufs),
                returned: Condvar::new(),
                quantize: super::ByteWindow::new(mold_cost::load::FP8_STAGING_WINDOW_BYTES),
            }))
        }

        fn take(&self) -> Buf {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(b) = free.pop() {
                    return b;
                }
                free = self.returned.wait(free).unwrap_or_else(|p| p.into_inner());
            }
        }

        fn give(&self, b: Buf) {
            self.free.lock().unwrap_or_else(|p| p.into_inner()).push(b);
            self.returned.notify_one();
        }

        /// Copies one chunk of the concatenated `pieces` to `dst + off` on the device's
        /// stream, through a free buffer.
        fn chunk(
            &self,
            pieces: &[&[u8]],
            starts: &[usize],
            off: usize,
            len: usize,
            dst: sys::CUdeviceptr,
        ) -> Result<()> {
            let mut b = self.take();
            let r = (|| {
                let fail = |e| dev_err(&self.device, "staged weight copy", e);
                // Its previous copy has left the buffer.
                b.done.synchronize().map_err(fail)?;
                let host = b.host.as_mut_slice().map_err(fail)?;
                gather(pieces, starts, off, &mut host[..len]);
                self.copy.context().bind_to_thread().map_err(fail)?;
                // SAFETY: `dst + off .. + len` lies in the tensor allocated by `upload`,
                // which the copy stream waited for and which outlives the copy (`upload`
                // waits for it); the page-locked source is not written again before `done`
                // (recorded right after) has passed.
                unsafe {
                    result::memcpy_htod_async(dst + off as u64, &host[..len], self.copy.cu_stream())
                }
                .map_err(fail)?;
                b.done.record(&self.copy).map_err(fail)
            })();
            self.give(b);
            r
        }

        /// `f` (which stages `bytes` of rows and quantizes them on the device) once the
        /// device's quantizing window has room for them; the calling thread's stream is
        /// drained before the window is left, so the rows `f` dropped are free memory by
        /// then, not a free still queued.
        pub fn quantizing<T>(&self, bytes: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
            let _slot = self.quantize.enter(bytes);
            let out = f()?;
            self.device
                .synchronize()
                .map_err(|e| dev_err(&self.device, "quantizing a weight", e))?;
            Ok(out)
        }

        /// A tensor of `shape` in `dtype` on the device holding the concatenation of
        /// `pieces` (its bytes, as stored), complete when this returns.
        pub fn upload(&self, pieces: &[&[u8]], dtype: DType, shape: &[usize]) -> Result<Tensor> {
            let (starts, total) = offsets(pieces);
            let n: usize = shape.iter().product();
            if total != n * dtype.size_in_bytes() {
                return Err(ExecError::Plan(format!(
                    "staged upload: {total} bytes for {shape:?} in {dtype:?}"
                )));
            }
            if n == 0 {
                return Ok(Tensor::zeros(shape, dtype, &self.device)?);
            }
            let fail = |what: &str, e| dev_err(&self.device, what, e);
            let (storage, ptr) = alloc(&self.cuda, &self.stream, dtype, n)?;
            // The allocation is ordered on this thread's stream: the copies wait for it.
            let ctx = self.copy.context();
            let allocated = ctx.new_event(None).map_err(|e| fail("event", e))?;
            allocated
                .record(&self.stream)
                .map_err(|e| fail("staged weight copy", e))?;
            self.copy
                .wait(&allocated)
                .map_err(|e| fail("staged weight copy", e))?;
            let chunks: Vec<usize> = (0..total).step_by(CHUNK_BYTES).collect();
            chunks.par_iter().try_for_each(|&off| {
                self.chunk(pieces, &starts, off, CHUNK_BYTES.min(total - off), ptr)
            })?;
            // Every chunk is queued: done once the copy stream has run them.
            let copied = ctx.new_event(None).map_err(|e| fail("event", e))?;
            copied
                .record(&self.copy)
                .map_err(|e| fail("staged weight copy", e))?;
            copied
                .synchronize()
                .map_err(|e| fail("staged weight copy", e))?;
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                shape,
                candle_core::op::BackpropOp::none(),
                false,
            ))
        }
    }

    /// Safetensors files read through a [`Stager`]: a tensor in bf16, f16 or f32 is staged
    /// to the stager's device as stored and cast there; any other (another device, another
    /// dtype) as candle's memory-mapped reader does it.
    pub struct StagedSafetensors {
        pub mmap: candle_core::safetensors::MmapedSafetensors,
        pub stager: Stager,
    }

    impl candle_nn::var_builder::SimpleBackend for StagedSafetensors {
        fn get(
            &self,
            s: candle_core::Shape,
            name: &str,
            _: candle_nn::Init,
            dtype: DType,
            dev: &Device,
        ) -> candle_core::Result<Tensor> {
            let t = self.get_unchecked(name, dtype, dev)?;
            if t.shape() != &s {
                Err(candle_core::Error::UnexpectedShape {
                    msg: format!("shape mismatch for {name}"),
                    expected: s,
                    got: t.shape().clone(),
                }
                .bt())?
            }
            Ok(t)
        }

        fn get_unchecked(
            &self,
            name: &str,
            dtype: DType,
            dev: &Device,
        ) -> candle_core::Result<Tensor> {
            use safetensors::Dtype as St;
            let view = self.mmap.get(name)?;
            let stored = match view.dtype() {
                St::BF16 => Some(DType::BF16),
                St::F16 => Some(DType::F16),
                St::F32 => Some(DType::F32),
                _ => None,
            };
            match stored {
                Some(st) if dev.same_device(&self.stager.device) => self
                    .stager
                    .upload(&[view.data()], st, view.shape())
                    .map_err(candle_core::Error::wrap)?
                    .to_dtype(dtype),
                _ => self.mmap.load(name, dev)?.to_dtype(dtype),
            }
        }

        fn contains_tensor(&self, name: &str) -> bool {
            self.mmap.get(name).is_ok()
        }
    }

    impl Drop for Stager {
        fn drop(&mut self) {
            // The page-locked buffers are freed with the stager: their copies first.
            let free = self.free.get_mut().unwrap_or_else(|p| p.into_inner());
            for b in free.iter() {
                let _ = b.done.synchronize();
            }
        }
    }

    /// Uninitialised device memory for `n` values of `dtype` (every byte is then copied
    /// in), and its address.
    fn alloc(
        cd: &CudaDevice,
        stream: &CudaStream,
        dtype: DType,
        n: usize,
    ) -> Result<(CudaStorage, sys::CUdeviceptr)> {
        macro_rules! typed {
            ($t:ty) => {{
                // SAFETY: every byte is written by the staged copies before any read on
                // the stream.
                let s = unsafe { cd.alloc::<$t>(n) }?;
                let p = s.device_ptr(stream).0;
                (CudaStorage::wrap_cuda_slice(s, cd.clone()), p)
            }};
        }
        Ok(match dtype {
            DType::BF16 => typed!(half::bf16),
            DType::F16 => typed!(half::f16),
            DType::F32 => typed!(f32),
            d => return Err(ExecError::UnsupportedDtype(format!("{d:?}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Threads entering a window together never hold more than its limit at once, save one
    /// request larger than the limit, held alone; every request gets in.
    #[test]
    fn a_window_bounds_what_threads_hold_at_once() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let w = ByteWindow::new(100);
        let (now, most, done) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let sizes = [40u64, 30, 60, 100, 10, 250, 50, 20, 90, 5, 70, 30];
        std::thread::scope(|s| {
            for round in 0..4 {
                for (i, &b) in sizes.iter().enumerate() {
                    let (w, now, most, done) = (&w, &now, &most, &done);
                    s.spawn(move || {
                        let _slot = w.enter(b);
                        let held = now.fetch_add(b, Ordering::SeqCst) + b;
                        most.fetch_max(held, Ordering::SeqCst);
                        if b > 100 {
                            assert_eq!(held, b, "an oversized request is held alone");
                        }
                        std::thread::sleep(std::time::Duration::from_micros(
                            (200 * ((i + round) % 5)) as u64,
                        ));
                        now.fetch_sub(b, Ordering::SeqCst);
                        done.fetch_add(1, Ordering::SeqCst);
                    });
                }
            }
        });
        assert_eq!(done.load(Ordering::SeqCst), 4 * sizes.len() as u64);
        assert!(
            most.load(Ordering::SeqCst) <= 250,
            "{}",
            most.load(Ordering::SeqCst)
        );
        // Without the window the twelve requests of a round (755 bytes) overlap.
        assert_eq!(*w.held.lock().unwrap(), 0);
    }

    /// Every product weight of the transformers mold runs fits the FP8 quantizing window in
    /// bf16, so the planner's charge for it (`FP8_STAGING_WINDOW_BYTES`) bounds the rows a
    /// GPU holds at load.
    #[test]
    fn every_product_fits_the_fp8_quantizing_window() {
        use crate::model::{flux::FluxConfig, qwen::QwenConfig};
        let specs = [
            FluxConfig::flux_dev().tensor_specs(),
            FluxConfig::flux_schnell().tensor_specs(),
            QwenConfig::qwen_image().tensor_specs(),
        ];
        let mut largest = 0u64;
        for t in specs.iter().flatten().filter(|t| t.shape.len() == 2) {
            largest = largest.max(2 * t.shape.iter().product::<usize>() as u64);
        }
        assert!(largest > 100 << 20, "{largest}");
        assert!(
            largest <= mold_cost::load::FP8_STAGING_WINDOW_BYTES,
            "{largest}"
        );
    }

    proptest! {
        /// Any chunking of the concatenation gathers exactly its bytes.
        #[test]
        fn gathered_chunks_are_the_concatenation(
            lens in proptest::collection::vec(0usize..40, 0..12),
            chunk in 1usize..50,
        ) {
            let data: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (i * 53 + j) as u8).collect())
                .collect();
            let pieces: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let want: Vec<u8> = data.concat();
            let (starts, total) = offsets(&pieces);
            prop_assert_eq!(total, want.len());
            let mut got = vec![0u8; total];
            let mut off = 0;
            while off < total {
                let n = chunk.min(total - off);
                gather(&pieces, &starts, off, &mut got[off..off + n]);
                off += n;
            }
            prop_assert_eq!(got, want);
        }
    }
}
