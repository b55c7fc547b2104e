//! Which process runs which device ([`Ownership`]): the sorted devices of the plan's
//! transformer cut into one contiguous share per process.

use crate::error::{ExecError, Result};
use mold_plan::DeviceId;

fn launch_err(m: String) -> ExecError {
    ExecError::Launch(m)
}

/// Which process runs which device: the sorted devices cut into contiguous shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    shares: Vec<Vec<DeviceId>>,
}

impl Ownership {
    /// Cuts `devices` (any order; sorted here) into `world` contiguous shares, the first
    /// ones one larger when they do not divide evenly.
    pub fn split(devices: &[DeviceId], world: usize) -> Result<Ownership> {
        let mut ds: Vec<DeviceId> = devices.to_vec();
        ds.sort_by_key(|d| {
            (
                d.to_string().split(':').next().map(str::to_owned),
                d.ordinal(),
            )
        });
        ds.dedup();
        if ds.len() < world {
            return Err(launch_err(format!(
                "MOLD_WORLD_SIZE={world}, but the plan's transformer runs on {} device(s) ({}): \
                 start at most one process per device",
                ds.len(),
                ds.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let (base, extra) = (ds.len() / world, ds.len() % world);
        let mut shares = Vec::with_capacity(world);
        let mut it = ds.into_iter();
        for p in 0..world {
            shares.push(it.by_ref().take(base + usize::from(p < extra)).collect());
        }
        Ok(Ownership { shares })
    }

    /// The process that runs `d`.
    pub fn owner(&self, d: &DeviceId) -> Option<usize> {
        self.shares.iter().position(|s| s.contains(d))
    }

    /// The devices of process `p`.
    pub fn share(&self, p: usize) -> &[DeviceId] {
        &self.shares[p]
    }

    /// How process `p` opens `d`: its position among the share's devices of the same
    /// kind (`cuda:N` → the process's `cuda:K`).
    pub fn local_id(&self, p: usize, d: &DeviceId) -> Option<DeviceId> {
        let share = &self.shares[p];
        if !share.contains(d) {
            return None;
        }
        let k = share
            .iter()
            .filter(|x| std::mem::discriminant(*x) == std::mem::discriminant(d))
            .position(|x| x == d)? as u32;
        Some(match d {
            DeviceId::Cuda(_) => DeviceId::Cuda(k),
            other => other.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_cuts_sorted_devices_into_contiguous_shares() {
        let d = |s: &str| s.parse::<DeviceId>().unwrap();
        let devs = [
            d("cuda:3"),
            d("cuda:0"),
            d("cuda:2"),
            d("cuda:1"),
            d("cuda:4"),
        ];
        let o = Ownership::split(&devs, 2).unwrap();
        assert_eq!(o.share(0), &[d("cuda:0"), d("cuda:1"), d("cuda:2")]);
        assert_eq!(o.share(1), &[d("cuda:3"), d("cuda:4")]);
        assert_eq!(o.owner(&d("cuda:3")), Some(1));
        assert_eq!(o.local_id(1, &d("cuda:4")), Some(d("cuda:1")));
        assert_eq!(o.local_id(0, &d("cuda:4")), None);
        let e = Ownership::split(&devs[..1], 2).unwrap_err().to_string();
        assert!(e.contains("at most one process per device"), "{e}");
        let emu = Ownership::split(&[d("emu:1"), d("emu:0")], 2).unwrap();
        assert_eq!(emu.local_id(1, &d("emu:1")), Some(d("emu:1")));
    }
}
