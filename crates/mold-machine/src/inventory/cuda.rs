//! Querying and measuring through the CUDA driver (the `cuda` feature).

use super::*;
use candle_core::cuda::cudarc::driver::{result, sys, CudaContext, DriverError};
use mold_plan::MIB;
use std::sync::Arc;
use std::time::Instant;

fn err(e: DriverError) -> InventoryError {
    InventoryError::Cuda(e.to_string())
}

fn cal(e: impl std::fmt::Display) -> InventoryError {
    InventoryError::Calibration(e.to_string())
}

fn attr(ctx: &CudaContext, a: sys::CUdevice_attribute) -> Option<u32> {
    ctx.attribute(a).ok().and_then(|v| u32::try_from(v).ok())
}

fn p2p(a: sys::CUdevice, b: sys::CUdevice, what: sys::CUdevice_P2PAttribute) -> Option<i32> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: both handles come from cuDeviceGet; `v` outlives the call.
    let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, what, a, b) };
    r.result().ok().map(|_| v)
}

/// Each device in its own primary context: free memory is that device's own.
pub fn query() -> Result<Inventory, InventoryError> {
    let n = CudaContext::device_count().map_err(err)?;
    if n <= 0 {
        return Err(InventoryError::NoDevices);
    }
    let mut driver: std::ffi::c_int = 0;
    // SAFETY: `driver` outlives the call; the driver is initialised by device_count.
    let driver_version = unsafe { sys::cuDriverGetVersion(&mut driver) }
        .result()
        .ok()
        .map(|_| format!("{}.{}", driver / 1000, (driver % 1000) / 10));
    let mut ctxs: Vec<Arc<CudaContext>> = Vec::new();
    let mut devices = Vec::new();
    use sys::CUdevice_attribute as A;
    for i in 0..n as usize {
        let ctx = CudaContext::new(i).map_err(err)?;
        // Free as this device's own context sees it; total as cuDeviceTotalMem (and
        // nvidia-smi) report it, which is a little more than cuMemGetInfo's total.
        let (free, _) = ctx.mem_get_info().map_err(err)?;
        let total = ctx.total_mem().map_err(err)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let uuid = ctx.uuid().map_err(err)?;
        let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
        let pci = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).unwrap_or(0),
            attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).unwrap_or(0),
            attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).unwrap_or(0)
        );
        devices.push(GpuInfo {
            ordinal: i as u32,
            name: ctx.name().map_err(err)?,
            uuid: format_uuid(&bytes),
            total: ByteSize(total as u64),
            free: ByteSize(free as u64),
            compute_capability: format!("{major}.{minor}"),
            pci_bus: pci,
            multiprocessors: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(0),
            clock_mhz: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).map(|k| k / 1000),
            memory_clock_mhz: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
                .map(|k| k / 1000),
            memory_bus_bits: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
        });
        ctxs.push(ctx);
    }
    let mut peers = Vec::new();
    use sys::CUdevice_P2PAttribute as P;
    for a in &ctxs {
        for b in &ctxs {
            if a.ordinal() == b.ordinal() {
                continue;
            }
            let mut can: std::ffi::c_int = 0;
            // SAFETY: both handles come from cuDeviceGet; `can` outlives the call.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .map_err(err)?;
            let access = can != 0;
            peers.push(PeerInfo {
                from: a.ordinal() as u32,
                to: b.ordinal() as u32,
                access,
                performance_rank: if access {
                    p2p(
                        a.cu_device(),
                        b.cu_device(),
                        P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
                    )
                } else {
                    None
                },
                native_atomics: access
                    && p2p(
                        a.cu_device(),
                        b.cu_device(),
                        P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                    )
                    .unwrap_or(0)
                        != 0,
            });
        }
    }
    let (host_memory, host_cpus) = host_facts();
    Ok(Inventory {
        driver_version,
        devices,
        peers,
        host_memory,
        host_cpus,
    })
}

/// Device memory from the raw driver API, freed on drop (in its context).
struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl DevBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf, InventoryError> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: the context is current; the memory is freed once, on drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(err)?;
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 1, bytes) }.map_err(err)?;
        Ok(DevBuf {
            ctx: ctx.clone(),
            ptr,
        })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context, freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory, freed on drop.
struct Pinned {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Pinned, InventoryError> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: plain page-locked allocation; freed once, on drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(err)?;
        // SAFETY: `ptr` holds `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 1, bytes) };
        Ok(Pinned { ptr, bytes })
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `bytes` initialised bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host, freed only here.
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

/// Seconds per call of `f`, best of `reps` after one warm-up call.
fn best_s(
    reps: usize,
    mut f: impl FnMut() -> Result<(), InventoryError>,
) -> Result<f64, InventoryError> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Device `ordinal` through candle, and two random bf16 `n × n` matrices on it.
fn bf16_operands(
    ordinal: usize,
    n: usize,
) -> Result<
    (
        candle_core::Device,
        candle_core::Tensor,
        candle_core::Tensor,
    ),
    InventoryError,
> {
    use candle_core::{DType, Device, Tensor};
    let dev = Device::new_cuda(ordinal).map_err(cal)?;
    let random = || {
        Tensor::randn(0f32, 1.0, (n, n), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .map_err(cal)
    };
    let (a, b) = (random()?, random()?);
    Ok((dev, a, b))
}

fn matmul_tflops(ordinal: usize, n: usize) -> Result<f64, InventoryError> {
    let (dev, a, b) = bf16_operands(ordinal, n)?;
    let iters = 10;
    let s = best_s(3, || {
        for _ in 0..iters {
            let c = a.matmul(&b).map_err(cal)?;
            drop(c);
        }
        dev.synchronize().map_err(cal)
    })?;
    Ok(2.0 * (n as f64).powi(3) * iters as f64 / s / 1e12)
}

/// Seconds of the pinned host→device copy of `pinned` into `dst` while bf16 matrix
/// products run on the device (best of 3): the rate a streamed block's copy gets beside
/// the compute of the blocks before it. The products are queued on candle's stream of
/// this thread, enough of them (at the device's measured `tflops`) for several times the
/// idle copy (`idle_s`), the copy goes on a stream of its own; a copy that outlived the
/// products (the compute stream idle when it ended) does not count. `None` when no
/// repetition stayed under load.
fn htod_busy_s(
    ordinal: usize,
    ctx: &Arc<CudaContext>,
    dst: &DevBuf,
    pinned: &Pinned,
    idle_s: f64,
    tflops: f64,
) -> Result<Option<f64>, InventoryError> {
    let n = 4096usize;
    let (dev, a, b) = bf16_operands(ordinal, n)?;
    let compute = dev.as_cuda_device().map_err(cal)?.cuda_stream();
    // One product's time, to size the queue.
    let gemm_s = (2.0 * (n as f64).powi(3) / (tflops.max(1e-3) * 1e12)).max(1e-6);
    let copy = ctx.new_stream().map_err(err)?;
    let mut best: Option<f64> = None;
    let mut queued = ((4.0 * idle_s / gemm_s).ceil() as usize + 4).min(20_000);
    for _ in 0..3 {
        for _ in 0..queued {
            drop(a.matmul(&b).map_err(cal)?);
        }
        ctx.bind_to_thread().map_err(err)?;
        let t = Instant::now();
        // SAFETY: `dst` holds `bytes` bytes in this context; the pinned source lives
        // through the copy, which is synchronised before it is used again.
        unsafe { result::memcpy_htod_async(dst.ptr, pinned.as_slice(), copy.cu_stream()) }
            .map_err(err)?;
        copy.synchronize().map_err(err)?;
        let s = t.elapsed().as_secs_f64();
        // SAFETY: a stream handle of this thread's context; a query does not block.
        let busy = unsafe { sys::cuStreamQuery(compute.cu_stream()) }
            == sys::CUresult::CUDA_ERROR_NOT_READY;
        dev.synchronize().map_err(cal)?;
        if busy {
            best = Some(best.map_or(s, |b: f64| b.min(s)));
        } else {
            queued = (queued * 2).min(20_000);
        }
    }
    Ok(best)
}

/// Measures every device of `inv`: bf16 matrix product, device memory bandwidth,
/// host→device copies (pinned and pageable), peer copies. All-reduce is not measured
/// here (it needs NCCL); the result says so.
pub fn calibrate(
    inv: &Inventory,
    progress: &mut dyn FnMut(&str),
) -> Result<Measurements, InventoryError> {
    let mut ctxs = BTreeMap::new();
    for g in &inv.devices {
        ctxs.insert(
            g.ordinal,
            CudaContext::new(g.ordinal as usize).map_err(err)?,
        );
    }
    let mut out = Measurements::default();
    let n = 8192usize;
    for g in &inv.devices {
        let ctx = &ctxs[&g.ordinal];
        progress(&format!("{}: bf16 matrix product {n}^3", g.id()));
        let bf16_tflops = matmul_tflops(g.ordinal as usize, n)?;
        // Large copies, but never more than a sixth of what is free.
        let bytes = ((g.free.0 / 6).min(GIB) / MIB * MIB).max(64 * MIB) as usize;
        progress(&format!(
            "{}: copies of {} MiB (device, pinned, pageable)",
            g.id(),
            bytes / MIB as usize
        ));
        let src = DevBuf::new(ctx, bytes)?;
        let dst = DevBuf::new(ctx, bytes)?;
        let dtod = best_s(5, || {
            ctx.bind_to_thread().map_err(err)?;
            // SAFETY: both buffers hold `bytes` bytes in this context.
            unsafe { result::memcpy_dtod_sync(dst.ptr, src.ptr, bytes) }.map_err(err)?;
            ctx.synchronize().map_err(err)
        })?;
        let pinned = Pinned::new(ctx, bytes)?;
        let htod_pinned = best_s(3, || {
            ctx.bind_to_thread().map_err(err)?;
            // SAFETY: `dst` holds `bytes` bytes; the source slice lives through the call.
            unsafe { result::memcpy_htod_sync(dst.ptr, pinned.as_slice()) }.map_err(err)
        })?;
        progress(&format!(
            "{}: pinned copy of {} MiB beside bf16 matrix products",
            g.id(),
            bytes / MIB as usize
        ));
        let htod_busy = htod_busy_s(
            g.ordinal as usize,
            ctx,
            &dst,
            &pinned,
            htod_pinned,
            bf16_tflops,
        )?;
        if htod_busy.is_none() {
            progress(&format!(
                "{}: the matrix products ended before the copy: busy copy rate not measured",
                g.id()
            ));
        }
        drop(pinned);
        let pageable = vec![1u8; bytes];
        let htod_pageable = best_s(3, || {
            ctx.bind_to_thread().map_err(err)?;
            // SAFETY: as above.
            unsafe { result::memcpy_htod_sync(dst.ptr, &pageable[..]) }.map_err(err)
        })?;
        out.devices.push(DeviceMeasurement {
            ordinal: g.ordinal,
            bf16_tflops,
            matmul_n: n as u32,
            mem_bandwidth_gbps: 2.0 * bytes as f64 / dtod / 1e9,
            host_pinned_gbps: bytes as f64 / htod_pinned / 1e9,
            host_pinned_busy_gbps: htod_busy.map(|t| bytes as f64 / t / 1e9),
            host_pageable_gbps: bytes as f64 / htod_pageable / 1e9,
            copy_bytes: bytes as u64,
        });
    }
    for p in inv.peers.iter().filter(|p| p.access) {
        let (a, b) = (&ctxs[&p.from], &ctxs[&p.to]);
        progress(&format!("peer copy cuda:{} -> cuda:{}", p.from, p.to));
        for (x, y) in [(a, b), (b, a)] {
            x.bind_to_thread().map_err(err)?;
            // SAFETY: both are live primary contexts; x is current.
            let r = unsafe { sys::cuCtxEnablePeerAccess(y.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS
                && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(err(DriverError(r)));
            }
        }
        let free = |o: u32| inv.device(o).map(|g| g.free.0).unwrap_or(0);
        let bytes =
            ((free(p.from).min(free(p.to)) / 6).min(GIB) / MIB * MIB).max(64 * MIB) as usize;
        let src = DevBuf::new(a, bytes)?;
        let dst = DevBuf::new(b, bytes)?;
        let s = best_s(3, || {
            // SAFETY: each buffer holds `bytes` bytes in its own context.
            unsafe { sys::cuMemcpyPeer(dst.ptr, b.cu_ctx(), src.ptr, a.cu_ctx(), bytes) }
                .result()
                .map_err(err)?;
            a.synchronize().map_err(err)?;
            b.synchronize().map_err(err)
        })?;
        out.peer_copies.push(PeerCopy {
            from: p.from,
            to: p.to,
            gbps: bytes as f64 / s / 1e9,
        });
    }
    // All-reduce needs NCCL; `apply_measurements` records it as not measured.
    out.allreduce = None;
    Ok(out)
}
