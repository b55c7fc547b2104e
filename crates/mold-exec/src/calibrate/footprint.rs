//! The CUDA libraries' device memory, for `mold devices --calibrate --model M`: what a
//! process holds on a GPU beyond its tensors once a model's blocks have run — kernel
//! code loaded on first use (candle's PTX modules, mold's kernels, cuBLAS/cuBLASLt's
//! kernels, cuDNN's generated attention kernels), the cuBLAS/cuBLASLt handles and their
//! workspaces, curand's state, streams. The plan's tensors alone leave it out: on an
//! H200 a FLUX run's allocator peak sits 200–240 MB above them.
//!
//! Measured in a fresh process (`mold calibrate-footprint`, which the calibration spawns
//! three times), so that nothing is loaded yet: the allocator probe is made first (its
//! baseline: the device's memory in use once the CUDA context exists, and its memory
//! pool's reserved bytes), then the device is opened as `mold exec` opens it and every
//! block kind's operations run once on one rank at the model's default workload (its
//! matrix products through mold's layers, attention, the element-wise kernels: what
//! [`super::ops`] times). After a synchronise, with the tensors dropped and the
//! device still open, the footprint is the memory in use above the baseline less what
//! the pool grew by and keeps free for reuse ([`Footprint::from_growth`]): that cache is
//! the tensors' memory, which the cost model counts from their shapes. What the pool
//! still holds in use once every tensor is dropped is the libraries' too (cuBLASLt's
//! workspace, 32 MiB on Hopper, comes from the pool and lives as long as its handle).
//! Collectives (NCCL's buffers) are not run.

use super::loads::{block_loads, Precision};
use crate::error::{ExecError, Result};
use crate::executor::weights_dtype;
use crate::memory_probe::{Growth, MemoryProbe};
use crate::model::ops::Kernels;
use crate::runtime::DeviceMap;
use candle_core::{Device, Tensor};
use mold_cost::ops::{block_ops, BlockOps};
use mold_models::ModelSpec;
use mold_plan::{DType, DeviceId};
use serde::{Deserialize, Serialize};

/// What one fresh process measured on one device: the line `mold calibrate-footprint`
/// prints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Footprint {
    pub device: DeviceId,
    /// The libraries' device memory: `used_bytes` less what the pool grew by and keeps
    /// free (`pool_reserved_bytes` less `pool_live_bytes`), 0 at least.
    pub library_bytes: u64,
    /// The device's memory in use above the baseline, the device still open.
    pub used_bytes: u64,
    /// What the allocator's memory pool grew by (0 where it shrank); `None` where the
    /// allocator keeps no pool (then every byte above the baseline is counted).
    pub pool_reserved_bytes: Option<u64>,
    /// What of the pool's growth is still in use with every tensor dropped (the
    /// libraries' own allocations from it); `None` where the allocator keeps no pool.
    pub pool_live_bytes: Option<u64>,
    /// The operations run.
    pub operations: usize,
}

impl Footprint {
    /// The footprint of a device's growth: in use above the baseline less the pool's
    /// growth that is free (reserved less in use), saturating (a pool that grew by more
    /// than the device's use gives 0).
    pub fn from_growth(g: &Growth, operations: usize) -> Footprint {
        let free = g
            .pool_reserved_bytes
            .unwrap_or(0)
            .saturating_sub(g.pool_used_bytes.unwrap_or(0));
        Footprint {
            device: g.device.clone(),
            library_bytes: g.used_bytes.saturating_sub(free),
            used_bytes: g.used_bytes,
            pool_reserved_bytes: g.pool_reserved_bytes,
            pool_live_bytes: g.pool_used_bytes,
            operations,
        }
    }
}

/// The operations of one block of each of `model`'s kinds on one rank (no tensor or
/// sequence parallelism) at its default workload in `dtype`: what [`measure_footprint`]
/// runs. A kind without an operation breakdown is refused, naming it.
pub fn footprint_ops(model: &ModelSpec, dtype: DType) -> Result<Vec<BlockOps>> {
    let w = &model.default_workload;
    let tokens = model.tokens(w);
    let batch = w.batch as u64;
    model
        .transformer
        .kinds
        .iter()
        .map(|k| {
            block_ops(k, tokens, batch, 1, 1, dtype.activation_bytes()).ok_or_else(|| {
                ExecError::Input(format!(
                    "model {}: its `{}` blocks have no operation breakdown, so their \
                     libraries' memory cannot be measured",
                    model.id, k.name
                ))
            })
        })
        .collect()
}

/// Runs every operation of `blocks` once on `dev` (each block's products, attention and
/// element-wise kernels, as the calibration builds them:
/// [`block_loads`]), synchronises after each block and drops its
/// tensors; how many operations ran.
fn run_once(
    dev: &Device,
    p: Precision,
    blocks: &[BlockOps],
    kernels: Kernels,
) -> candle_core::Result<usize> {
    let mut ran = 0;
    for b in blocks {
        let (_, loads) = block_loads(dev, p, b, kernels)?;
        let outputs = loads
            .iter()
            .map(|run| run())
            .collect::<candle_core::Result<Vec<Tensor>>>()?;
        ran += loads.len();
        dev.synchronize()?;
        drop(outputs);
    }
    dev.synchronize()?;
    Ok(ran)
}

/// The libraries' device memory on `device`: opened now (as `mold exec` opens it, on
/// candle's default stream), `blocks` run once ([`run_once`]) in `dtype` with `kernels`,
/// then read through `probe`, which must have been made (its baseline read) before
/// anything in this process touched the device, and must probe `device`. The device
/// stays open until the reading: closing it would free the handles and workspaces
/// measured.
pub fn measure_footprint(
    probe: &MemoryProbe,
    device: &DeviceId,
    dtype: DType,
    blocks: &[BlockOps],
    kernels: Kernels,
    progress: &mut dyn FnMut(&str),
) -> Result<Footprint> {
    if !probe.devices().contains(device) {
        return Err(ExecError::Input(format!(
            "{device}: the memory probe does not read this device"
        )));
    }
    let (dtype, fp8) = weights_dtype(dtype)?;
    let mut map = DeviceMap::new(false);
    let dev = map.get(device)?;
    progress(&format!(
        "the operations of {} block kinds once on {device} ({dtype:?})",
        blocks.len()
    ));
    let ran = run_once(&dev, Precision { dtype, fp8 }, blocks, kernels).map_err(|e| {
        ExecError::Device {
            device: device.to_string(),
            message: format!("running the blocks' operations: {e}"),
        }
    })?;
    let growth = probe.growth()?;
    let g = growth
        .iter()
        .find(|g| &g.device == device)
        .ok_or_else(|| ExecError::Input(format!("{device}: not read by the memory probe")))?;
    // `dev` and `map` are dropped only after the reading, on return.
    Ok(Footprint::from_growth(g, ran))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory_probe::UsedMemory;
    use std::sync::{Arc, Mutex};

    /// A device whose use and pool the test sets.
    #[derive(Clone, Default)]
    struct Fake {
        used: Arc<Mutex<u64>>,
        reserved: Arc<Mutex<Option<u64>>>,
        pool_used: Arc<Mutex<Option<u64>>>,
        fail: Arc<Mutex<bool>>,
    }

    impl UsedMemory for Fake {
        fn used_bytes(&self) -> std::result::Result<u64, String> {
            if *self.fail.lock().unwrap() {
                return Err("device lost".into());
            }
            Ok(*self.used.lock().unwrap())
        }
        fn pool_reserved_bytes(&self) -> Option<u64> {
            *self.reserved.lock().unwrap()
        }
        fn pool_used_bytes(&self) -> Option<u64> {
            *self.pool_used.lock().unwrap()
        }
    }

    fn probe(device: DeviceId, used: u64, reserved: Option<u64>) -> (Fake, MemoryProbe) {
        let f = Fake::default();
        *f.used.lock().unwrap() = used;
        *f.reserved.lock().unwrap() = reserved;
        let p = MemoryProbe::new(vec![(device, Box::new(f.clone()))]).unwrap();
        (f, p)
    }

    fn tiny() -> (Vec<BlockOps>, DType) {
        let m = mold_models::find("flux-tiny").unwrap();
        (footprint_ops(&m, DType::F32).unwrap(), DType::F32)
    }

    /// The footprint is what the device's use grew by less what the pool grew by; the
    /// blocks' operations all ran (on an emulated device, the CPU).
    #[test]
    fn the_footprint_is_the_use_less_the_pools_growth() {
        let id = DeviceId::Emu(0);
        let (f, p) = probe(id.clone(), 1_000_000, Some(64 << 20));
        // Between the baseline and the reading: 300 MiB more in use, 80 MiB of it the pool's.
        *f.used.lock().unwrap() = 1_000_000 + (300 << 20);
        *f.reserved.lock().unwrap() = Some((64 + 80) << 20);
        let (blocks, dtype) = tiny();
        let mut said = Vec::new();
        let fp = measure_footprint(&p, &id, dtype, &blocks, Kernels::Auto, &mut |s| {
            said.push(s.to_string())
        })
        .unwrap();
        assert_eq!(fp.library_bytes, 220 << 20);
        assert_eq!(fp.used_bytes, 300 << 20);
        assert_eq!(fp.pool_reserved_bytes, Some(80 << 20));
        assert_eq!(fp.pool_live_bytes, None);
        assert_eq!(fp.device, id);
        // flux-tiny: a double block (2 modulation + 8 products) and a single block (1 +
        // 3), each with its attention and its element-wise kernels (three, repeated for
        // the block's element-wise bytes).
        let cpu = crate::executor::compute_dtype(dtype).unwrap();
        let want: usize = blocks
            .iter()
            .map(|b| {
                block_loads(&Device::Cpu, cpu.into(), b, Kernels::Auto)
                    .unwrap()
                    .1
                    .len()
            })
            .sum();
        assert_eq!(fp.operations, want);
        assert!(
            want >= blocks.iter().map(|b| b.gemms.len() + 4).sum(),
            "{want}"
        );
        assert!(fp.operations >= 2 * 4, "{fp:?}");
        assert_eq!(said.len(), 1, "{said:?}");
        // One line of JSON, read back the same.
        let line = serde_json::to_string(&fp).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Footprint>(&line).unwrap(), fp);
    }

    /// What the pool still holds in use once every tensor is dropped (cuBLASLt's
    /// workspace) is the libraries' too: only the pool's free growth is left out.
    #[test]
    fn the_pools_live_growth_counts() {
        let id = DeviceId::Emu(0);
        let f = Fake::default();
        *f.reserved.lock().unwrap() = Some(0);
        *f.pool_used.lock().unwrap() = Some(1 << 20);
        let p = MemoryProbe::new(vec![(id.clone(), Box::new(f.clone()))]).unwrap();
        // 300 MiB more in use; the pool grew by 80 MiB, 32 of them still in use.
        *f.used.lock().unwrap() = 300 << 20;
        *f.reserved.lock().unwrap() = Some(80 << 20);
        *f.pool_used.lock().unwrap() = Some((1 + 32) << 20);
        let (blocks, dtype) = tiny();
        let fp = measure_footprint(&p, &id, dtype, &blocks, Kernels::Auto, &mut |_| {}).unwrap();
        assert_eq!(fp.pool_live_bytes, Some(32 << 20));
        assert_eq!(fp.library_bytes, (300 - 80 + 32) << 20);
    }

    /// A pool that shrank counts as no growth, and a pool that grew by more than the
    /// device's use (or use that fell) gives 0, never a wrapped figure.
    #[test]
    fn the_footprint_saturates() {
        let g = |used, reserved| Growth {
            device: DeviceId::Cuda(0),
            used_bytes: used,
            pool_reserved_bytes: reserved,
            pool_used_bytes: None,
        };
        assert_eq!(
            Footprint::from_growth(&g(500, Some(700)), 0).library_bytes,
            0
        );
        assert_eq!(Footprint::from_growth(&g(500, None), 0).library_bytes, 500);
        let (f, p) = probe(DeviceId::Emu(0), 10_000, Some(4_000));
        *f.used.lock().unwrap() = 12_000;
        *f.reserved.lock().unwrap() = Some(1_000);
        let (blocks, dtype) = tiny();
        let fp = measure_footprint(
            &p,
            &DeviceId::Emu(0),
            dtype,
            &blocks,
            Kernels::Auto,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(fp.pool_reserved_bytes, Some(0));
        assert_eq!(fp.library_bytes, 2_000);
        // Less in use than at the baseline: 0.
        *f.used.lock().unwrap() = 9_000;
        let fp = measure_footprint(
            &p,
            &DeviceId::Emu(0),
            dtype,
            &blocks,
            Kernels::Auto,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!((fp.used_bytes, fp.library_bytes), (0, 0));
    }

    /// A device the probe does not read, a device that cannot be read and a model
    /// without an operation breakdown are typed errors, not panics.
    #[test]
    fn what_cannot_be_measured_is_an_error() {
        let (f, p) = probe(DeviceId::Emu(0), 0, None);
        let (blocks, dtype) = tiny();
        let measure = |id: u32, dtype| {
            measure_footprint(
                &p,
                &DeviceId::Emu(id),
                dtype,
                &blocks,
                Kernels::Auto,
                &mut |_| {},
            )
        };
        let e = measure(1, dtype).unwrap_err().to_string();
        assert!(
            e.contains("emu:1: the memory probe does not read this device"),
            "{e}"
        );
        *f.fail.lock().unwrap() = true;
        let e = measure(0, dtype).unwrap_err().to_string();
        assert!(
            e.contains("device emu:0: cannot read the memory in use: device lost"),
            "{e}"
        );
        let mut m = mold_models::find("flux-tiny").unwrap();
        m.transformer.kinds[0].streams = 3;
        let e = footprint_ops(&m, DType::F32).unwrap_err().to_string();
        assert!(e.contains("blocks have no operation breakdown"), "{e}");
        assert!(measure(0, DType::Fp8).is_err());
    }
}
