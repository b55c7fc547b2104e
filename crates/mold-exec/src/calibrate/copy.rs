//! The host→device copy beside a model's own work, for `mold devices --calibrate
//! --model M`: a streamed block's weights are copied while the blocks before it compute,
//! and what they compute decides how fast the copy goes. The profile's
//! `links.host_pinned_busy_gbps` is timed beside bf16 matrix products only; here the
//! copy is timed beside each kind of the model's operations (its products, attention,
//! element-wise kernels) and beside a block of each kind run whole, through the
//! executor's own streaming path (page-locked host memory, the copy stream of
//! [`crate::streaming`], one copy of a block-sized buffer).
//!
//! Each load is queued on the device's compute stream, enough runs of it for several
//! idle copies, then the copy starts on its own stream; a copy counts only if the
//! compute stream is still busy when it ends (else more runs are queued next time). The
//! median of the counted copies gives the rate. Emulated devices have no copy engine:
//! nothing is measured there.

use super::loads::Load;
use crate::error::Result;
use candle_core::Device;

/// The copy's rates, idle and beside each load.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct CopyBeside {
    /// GB/s of the copy with the device idle.
    pub idle_gbps: f64,
    /// `(load, GB/s)` for each load that stayed busy through enough copies.
    pub beside: Vec<(String, f64)>,
}

impl CopyBeside {
    /// The rate beside `load` over the idle rate, where it was measured.
    pub fn ratio(&self, load: &str) -> Option<f64> {
        let (_, gbps) = self.beside.iter().find(|(l, _)| l == load)?;
        (self.idle_gbps > 0.0).then(|| gbps / self.idle_gbps)
    }

    /// One line: `idle 55.4 GB/s; beside matrix products 55.3 (1.00), …`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .beside
            .iter()
            .map(|(l, g)| format!("{l} {g:.1} ({:.2})", g / self.idle_gbps.max(1e-9)))
            .collect();
        format!(
            "idle {:.1} GB/s; beside {}",
            self.idle_gbps,
            if parts.is_empty() {
                "nothing that stayed busy".to_string()
            } else {
                parts.join(", ")
            }
        )
    }
}

/// The copy of `bytes` to `dev`, idle and beside each of `loads`; `None` on a device
/// without a copy engine (the CPU, emulated devices) or a build without CUDA.
pub(super) fn measure(
    dev: &Device,
    loads: &[(String, Load)],
    bytes: usize,
) -> Result<Option<CopyBeside>> {
    if !dev.is_cuda() {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        gpu::measure(dev, loads, bytes).map(Some)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (loads, bytes);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{CopyBeside, Load};
    use crate::calibrate::timing::median_time;
    use crate::error::{ExecError, Result};
    use crate::streaming::gpu::{copy_stream, pin, SlotGpu};
    use candle_core::cuda::cudarc::driver::sys;
    use candle_core::{DType, Device, Tensor};
    use std::time::Instant;

    /// Copies timed (the median kept) per load, and the cap on queued runs.
    const COPIES: usize = 5;
    const MOST_QUEUED: usize = 10_000;

    pub fn measure(dev: &Device, loads: &[(String, Load)], bytes: usize) -> Result<CopyBeside> {
        let fail = |what: &str, e: &dyn std::fmt::Display| ExecError::Device {
            device: format!("{:?}", dev.location()),
            message: format!("timing the host→device copy ({what}): {e}"),
        };
        let n = (bytes / 2).max(1);
        let host = Tensor::zeros(n, DType::BF16, &Device::Cpu)?;
        let pinned = pin(dev, &host)?;
        let buf = Tensor::zeros(n, DType::BF16, dev)?;
        let slot = SlotGpu::new(&buf)?;
        let stream = copy_stream(dev)?;
        let copy = || -> Result<f64> {
            let t = Instant::now();
            slot.copy_pinned(&stream, &pinned)?;
            stream.synchronize().map_err(|e| fail("copy", &e))?;
            Ok(t.elapsed().as_secs_f64())
        };
        copy()?;
        let idle = median((0..COPIES).map(|_| copy()).collect::<Result<Vec<_>>>()?);
        let compute = dev.as_cuda_device()?.cuda_stream();
        let mut beside = Vec::new();
        for (name, load) in loads {
            let one = median_time(dev, 1, 3, load)?.max(1e-6);
            let mut queued = ((3.0 * idle / one).ceil() as usize + 2).min(MOST_QUEUED);
            let mut times = Vec::new();
            for _ in 0..2 * COPIES {
                if times.len() == COPIES {
                    break;
                }
                for _ in 0..queued {
                    drop(load()?);
                }
                let s = copy()?;
                // SAFETY: the compute stream's handle, in its own context; a query does
                // not block or change the stream.
                let busy = unsafe { sys::cuStreamQuery(compute.cu_stream()) }
                    == sys::CUresult::CUDA_ERROR_NOT_READY;
                dev.synchronize()?;
                if busy {
                    times.push(s);
                } else {
                    queued = (queued * 2).min(MOST_QUEUED);
                }
            }
            if !times.is_empty() {
                beside.push((name.clone(), bytes as f64 / median(times) / 1e9));
            }
        }
        Ok(CopyBeside {
            idle_gbps: bytes as f64 / idle / 1e9,
            beside,
        })
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2)
            .copied()
            .unwrap_or(f64::INFINITY)
            .max(1e-9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn nothing_is_measured_without_a_copy_engine() {
        let loads: Vec<(String, Load)> = vec![(
            "a load".into(),
            Box::new(|| Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu)),
        )];
        assert_eq!(measure(&Device::Cpu, &loads, 1 << 20).unwrap(), None);
    }

    #[test]
    fn ratios_and_summary_name_each_load() {
        let c = CopyBeside {
            idle_gbps: 50.0,
            beside: vec![("matrix products".into(), 50.0), ("blocks".into(), 40.0)],
        };
        assert_eq!(c.ratio("blocks"), Some(0.8));
        assert_eq!(c.ratio("attention"), None);
        assert_eq!(
            c.summary(),
            "idle 50.0 GB/s; beside matrix products 50.0 (1.00), blocks 40.0 (0.80)"
        );
    }
}
