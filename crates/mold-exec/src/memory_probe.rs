//! Device memory as the allocator sees it, for the run report (`mold exec --report`).
//!
//! A [`MemoryProbe`] reads, for each device, the bytes in use when it is made (the
//! baseline), then at each phase boundary the caller names ([`MemoryProbe::sample`]):
//! the bytes in use less the baseline, and their high-water mark over the samples. On
//! CUDA ([`allocator_probe`], the `cuda` feature) "in use" is the device's total memory
//! less its free memory (`cuMemGetInfo`: everything allocated on the GPU, by this
//! process or another), and the default memory pool's own high-water mark of bytes in use
//! (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`, reset when the probe is made) is read too: candle
//! allocates from that pool, so it catches peaks inside a phase that the samples at its
//! boundaries miss. Devices the allocator cannot be asked about (emulated, the host, CPU
//! builds) get no probe: the run report gives their accounted figures instead.
//!
//! [`MemoryProbe::growth`] reads each device's use and its pool's reserved memory against
//! the baseline: what [`crate::calibrate::measure_footprint`] takes the CUDA libraries' memory from.

use crate::error::ExecError;
use mold_plan::DeviceId;

/// One device's memory, as its allocator reports it.
pub trait UsedMemory: Send {
    /// Bytes in use on the device now.
    fn used_bytes(&self) -> Result<u64, String>;
    /// The allocator pool's high-water mark of bytes in use since [`UsedMemory::reset_high`],
    /// where the allocator keeps one.
    fn pool_high_bytes(&self) -> Option<u64> {
        None
    }
    /// The allocator pool's bytes in use now, where the allocator keeps a pool.
    fn pool_used_bytes(&self) -> Option<u64> {
        None
    }
    /// The device memory the allocator's pool holds now (in use or kept for reuse),
    /// where the allocator keeps a pool: what of [`UsedMemory::used_bytes`] is the pool's.
    fn pool_reserved_bytes(&self) -> Option<u64> {
        None
    }
    /// Restarts the pool's high-water mark from what is in use now.
    fn reset_high(&self) {}
}

/// One device's measured peak over a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbedPeak {
    pub device: DeviceId,
    /// The largest of the samples and the pool's high-water mark less the pool's use at
    /// the baseline plus the memory outside the pool: bytes above the baseline.
    pub peak_bytes: u64,
    /// The pool's high-water mark less its use at the baseline, where the allocator keeps one.
    pub pool_high_bytes: Option<u64>,
    /// The most memory in use outside the pool at a sample (in use above the baseline less
    /// what the pool grew by: kernel code, library handles and workspaces allocated
    /// directly), where the allocator keeps a pool. It is in use at the pool's
    /// high-water mark too, so the peak counts both.
    pub outside_pool_bytes: Option<u64>,
    /// (phase, bytes above the baseline) at each boundary sampled.
    pub samples: Vec<(String, u64)>,
}

/// One device's memory now against its baseline ([`MemoryProbe::growth`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Growth {
    pub device: DeviceId,
    /// Bytes in use now less at the baseline (0 where fewer are in use).
    pub used_bytes: u64,
    /// What the allocator's pool holds now less at the baseline (0 where it shrank);
    /// `None` where the allocator keeps no pool.
    pub pool_reserved_bytes: Option<u64>,
    /// What of the pool is in use now less at the baseline (0 where less is); `None`
    /// where the allocator keeps no pool.
    pub pool_used_bytes: Option<u64>,
}

/// Samples device memory at phase boundaries; see the module documentation.
pub struct MemoryProbe {
    devices: Vec<ProbeDevice>,
    /// The first failure to read a device, reported once by [`MemoryProbe::finish`].
    error: Option<String>,
}

struct ProbeDevice {
    id: DeviceId,
    source: Box<dyn UsedMemory>,
    baseline: u64,
    pool_baseline: u64,
    /// The pool's reserved memory at the baseline, where the allocator keeps a pool.
    reserved_baseline: Option<u64>,
    samples: Vec<(String, u64)>,
    /// The most in use outside the pool at a sample, where the pool's reserve is read.
    outside_pool: Option<u64>,
}

impl MemoryProbe {
    /// Reads each device's baseline now (and restarts its pool's high-water mark).
    pub fn new(devices: Vec<(DeviceId, Box<dyn UsedMemory>)>) -> Result<MemoryProbe, ExecError> {
        let mut out = Vec::with_capacity(devices.len());
        for (id, source) in devices {
            source.reset_high();
            let baseline = source.used_bytes().map_err(|e| ExecError::Device {
                device: id.to_string(),
                message: format!("cannot read the memory in use: {e}"),
            })?;
            let pool_baseline = source.pool_used_bytes().unwrap_or(0);
            let reserved_baseline = source.pool_reserved_bytes();
            out.push(ProbeDevice {
                id,
                source,
                baseline,
                pool_baseline,
                reserved_baseline,
                samples: Vec::new(),
                outside_pool: None,
            });
        }
        Ok(MemoryProbe {
            devices: out,
            error: None,
        })
    }

    /// The devices probed, in the order given.
    pub fn devices(&self) -> Vec<DeviceId> {
        self.devices.iter().map(|d| d.id.clone()).collect()
    }

    /// Each device's memory in use now, its pool's reserved memory and what of the pool is
    /// in use, each against the baseline (saturating); a device that cannot be read is an
    /// error naming it.
    pub fn growth(&self) -> Result<Vec<Growth>, ExecError> {
        self.devices
            .iter()
            .map(|d| {
                let used = d.source.used_bytes().map_err(|e| ExecError::Device {
                    device: d.id.to_string(),
                    message: format!("cannot read the memory in use: {e}"),
                })?;
                let reserved = d
                    .source
                    .pool_reserved_bytes()
                    .map(|r| r.saturating_sub(d.reserved_baseline.unwrap_or(0)));
                let pool_used = d
                    .source
                    .pool_used_bytes()
                    .map(|u| u.saturating_sub(d.pool_baseline));
                Ok(Growth {
                    device: d.id.clone(),
                    used_bytes: used.saturating_sub(d.baseline),
                    pool_reserved_bytes: reserved,
                    pool_used_bytes: pool_used,
                })
            })
            .collect()
    }

    /// Reads every device at the end of `phase`. A device that cannot be read is skipped
    /// for this sample; the first such failure is kept for [`MemoryProbe::finish`].
    pub fn sample(&mut self, phase: &str) {
        for d in &mut self.devices {
            match d.source.used_bytes() {
                Ok(b) => {
                    let used = b.saturating_sub(d.baseline);
                    if let Some(r) = d.source.pool_reserved_bytes() {
                        let grew = r.saturating_sub(d.reserved_baseline.unwrap_or(0));
                        let outside = used.saturating_sub(grew);
                        d.outside_pool = Some(d.outside_pool.unwrap_or(0).max(outside));
                    }
                    d.samples.push((phase.to_string(), used))
                }
                Err(e) => {
                    if self.error.is_none() {
                        self.error = Some(format!("{}: at {phase}: {e}", d.id));
                    }
                }
            }
        }
    }

    /// Each device's peak above its baseline, and the first failure to read a device, if any.
    pub fn finish(self) -> (Vec<ProbedPeak>, Option<String>) {
        let peaks = self
            .devices
            .into_iter()
            .map(|d| {
                let pool = d
                    .source
                    .pool_high_bytes()
                    .map(|h| h.saturating_sub(d.pool_baseline));
                let sampled = d.samples.iter().map(|(_, b)| *b).max().unwrap_or(0);
                let outside = d.outside_pool.filter(|_| pool.is_some());
                ProbedPeak {
                    device: d.id,
                    peak_bytes: sampled.max(pool.unwrap_or(0).saturating_add(outside.unwrap_or(0))),
                    pool_high_bytes: pool,
                    outside_pool_bytes: outside,
                    samples: d.samples,
                }
            })
            .collect();
        (peaks, self.error)
    }
}

/// A probe over the CUDA devices among `devices` (the plan's id and the ordinal this
/// process opens it as); `None` when there are none or the build has no CUDA, and the
/// run report then gives accounted figures.
pub fn allocator_probe(devices: &[(DeviceId, usize)]) -> Result<Option<MemoryProbe>, ExecError> {
    let cuda: Vec<(DeviceId, usize)> = devices
        .iter()
        .filter(|(d, _)| matches!(d, DeviceId::Cuda(_)))
        .cloned()
        .collect();
    if cuda.is_empty() {
        return Ok(None);
    }
    cuda_probe(&cuda)
}

#[cfg(not(feature = "cuda"))]
fn cuda_probe(_devices: &[(DeviceId, usize)]) -> Result<Option<MemoryProbe>, ExecError> {
    Ok(None)
}

#[cfg(feature = "cuda")]
fn cuda_probe(devices: &[(DeviceId, usize)]) -> Result<Option<MemoryProbe>, ExecError> {
    let mut sources: Vec<(DeviceId, Box<dyn UsedMemory>)> = Vec::new();
    for (id, ordinal) in devices {
        let src = cuda::CudaUsed::open(*ordinal).map_err(|message| ExecError::Device {
            device: id.to_string(),
            message: format!("cannot open it to read its memory in use: {message}"),
        })?;
        sources.push((id.clone(), Box::new(src)));
    }
    MemoryProbe::new(sources).map(Some)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::UsedMemory;
    use candle_core::cuda::cudarc::driver::{sys, CudaContext};
    use std::sync::Arc;

    /// A GPU's memory through its primary context (the one candle uses).
    pub(super) struct CudaUsed {
        ctx: Arc<CudaContext>,
        /// The device's default memory pool (candle allocates from it), when it has one.
        pool: Option<usize>,
    }

    impl CudaUsed {
        pub(super) fn open(ordinal: usize) -> Result<CudaUsed, String> {
            let ctx = CudaContext::new(ordinal).map_err(|e| format!("{e:?}"))?;
            let pool = if ctx.has_async_alloc() {
                let mut p: sys::CUmemoryPool = std::ptr::null_mut();
                // SAFETY: a valid out pointer and the device of a live context.
                unsafe { sys::cuDeviceGetDefaultMemPool(&mut p, ctx.cu_device()) }
                    .result()
                    .ok()
                    .map(|_| p as usize)
            } else {
                None
            };
            Ok(CudaUsed { ctx, pool })
        }

        fn pool_attr(&self, attr: sys::CUmemPool_attribute) -> Option<u64> {
            let pool = self.pool? as sys::CUmemoryPool;
            self.ctx.bind_to_thread().ok()?;
            let mut v: u64 = 0;
            // SAFETY: the attribute is a cuuint64_t, written through a valid pointer.
            unsafe {
                sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
            }
            .result()
            .ok()?;
            Some(v)
        }
    }

    impl UsedMemory for CudaUsed {
        fn used_bytes(&self) -> Result<u64, String> {
            let (free, total) = self.ctx.mem_get_info().map_err(|e| format!("{e:?}"))?;
            Ok(total.saturating_sub(free) as u64)
        }

        fn pool_high_bytes(&self) -> Option<u64> {
            self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        }

        fn pool_used_bytes(&self) -> Option<u64> {
            self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        }

        fn pool_reserved_bytes(&self) -> Option<u64> {
            self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        }

        fn reset_high(&self) {
            let Some(pool) = self.pool else { return };
            if self.ctx.bind_to_thread().is_err() {
                return;
            }
            // The high-water mark can only be set to 0: it restarts from there.
            let mut zero: u64 = 0;
            // SAFETY: as in `pool_attr`; only 0 is allowed for this attribute.
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool as sys::CUmemoryPool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A device whose use the test sets, with a pool high-water mark.
    #[derive(Clone, Default)]
    struct Fake {
        used: Arc<Mutex<u64>>,
        high: Arc<Mutex<Option<u64>>>,
        pool_used: Arc<Mutex<Option<u64>>>,
        reserved: Arc<Mutex<Option<u64>>>,
        fail: Arc<Mutex<bool>>,
    }

    impl UsedMemory for Fake {
        fn used_bytes(&self) -> Result<u64, String> {
            if *self.fail.lock().unwrap() {
                return Err("device lost".into());
            }
            Ok(*self.used.lock().unwrap())
        }
        fn pool_high_bytes(&self) -> Option<u64> {
            *self.high.lock().unwrap()
        }
        fn pool_used_bytes(&self) -> Option<u64> {
            *self.pool_used.lock().unwrap()
        }
        fn pool_reserved_bytes(&self) -> Option<u64> {
            *self.reserved.lock().unwrap()
        }
    }

    /// Memory outside the pool (kernel code, library handles) is in use at the pool's
    /// high-water mark too: the peak is the pool's mark plus the most seen outside it.
    #[test]
    fn memory_outside_the_pool_adds_to_the_pool_s_peak() {
        let f = Fake::default();
        *f.used.lock().unwrap() = 1000;
        *f.pool_used.lock().unwrap() = Some(0);
        *f.reserved.lock().unwrap() = Some(0);
        let mut p = MemoryProbe::new(vec![(DeviceId::Cuda(0), Box::new(f.clone()))]).unwrap();
        // Loaded: 5000 in the pool, 300 outside it (1000 + 5000 + 300 in use).
        *f.used.lock().unwrap() = 6300;
        *f.reserved.lock().unwrap() = Some(5000);
        p.sample("loaded");
        // A step's transient tensors peaked at 7000 in the pool, freed before the sample;
        // the libraries now hold 400 outside it.
        *f.high.lock().unwrap() = Some(7000);
        *f.used.lock().unwrap() = 6400;
        p.sample("step 1");
        let (peaks, _) = p.finish();
        assert_eq!(peaks[0].outside_pool_bytes, Some(400));
        assert_eq!(peaks[0].pool_high_bytes, Some(7000));
        assert_eq!(peaks[0].peak_bytes, 7400);
    }

    #[test]
    fn peaks_are_above_the_baseline_and_the_highest_sample() {
        let f = Fake::default();
        *f.used.lock().unwrap() = 1000;
        let mut p = MemoryProbe::new(vec![(DeviceId::Cuda(0), Box::new(f.clone()))]).unwrap();
        for (phase, used) in [("loaded", 5000), ("step 1", 7000), ("decode", 3000)] {
            *f.used.lock().unwrap() = used;
            p.sample(phase);
        }
        let (peaks, err) = p.finish();
        assert!(err.is_none());
        assert_eq!(peaks[0].peak_bytes, 6000);
        assert_eq!(peaks[0].pool_high_bytes, None);
        assert_eq!(
            peaks[0].samples,
            vec![
                ("loaded".to_string(), 4000),
                ("step 1".to_string(), 6000),
                ("decode".to_string(), 2000)
            ]
        );
    }

    #[test]
    fn the_pools_high_water_mark_catches_a_peak_between_samples() {
        let f = Fake::default();
        *f.pool_used.lock().unwrap() = Some(100);
        let mut p = MemoryProbe::new(vec![(DeviceId::Cuda(1), Box::new(f.clone()))]).unwrap();
        *f.used.lock().unwrap() = 4000;
        p.sample("step 1");
        // Inside the step the pool held 9000 more than at the start; freed before the end.
        *f.high.lock().unwrap() = Some(9100);
        let (peaks, _) = p.finish();
        assert_eq!(peaks[0].pool_high_bytes, Some(9000));
        assert_eq!(peaks[0].peak_bytes, 9000);
    }

    #[test]
    fn a_device_that_cannot_be_read_is_named_once() {
        let f = Fake::default();
        let mut p = MemoryProbe::new(vec![(DeviceId::Cuda(2), Box::new(f.clone()))]).unwrap();
        *f.fail.lock().unwrap() = true;
        p.sample("step 1");
        p.sample("step 2");
        let (peaks, err) = p.finish();
        assert_eq!(err.unwrap(), "cuda:2: at step 1: device lost");
        assert!(peaks[0].samples.is_empty());
        let bad = MemoryProbe::new(vec![(DeviceId::Cuda(3), Box::new(f))]);
        let e = bad.err().unwrap().to_string();
        assert!(e.starts_with("device cuda:3: cannot read"), "{e}");
    }

    #[test]
    fn emulated_devices_and_the_host_get_no_probe() {
        let p = allocator_probe(&[(DeviceId::Emu(0), 0), (DeviceId::Host, 0)]).unwrap();
        assert!(p.is_none());
    }
}
