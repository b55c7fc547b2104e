//! Which process runs which device ([`Ownership`]): one share of the transformer's
//! devices per process, each within one node ([`super::LocalDevices::resolve`] cuts them).

use mold_plan::DeviceId;

/// Which process runs which device: share `p` is process `p`'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    shares: Vec<Vec<DeviceId>>,
}

impl Ownership {
    /// One share per process, in process order.
    pub(super) fn from_shares(shares: Vec<Vec<DeviceId>>) -> Ownership {
        Ownership { shares }
    }

    /// The number of processes.
    pub fn world(&self) -> usize {
        self.shares.len()
    }

    /// The process that runs `d`.
    pub fn owner(&self, d: &DeviceId) -> Option<usize> {
        self.shares.iter().position(|s| s.contains(d))
    }

    /// The devices of process `p` (empty past the last process).
    pub fn share(&self, p: usize) -> &[DeviceId] {
        self.shares.get(p).map_or(&[], Vec::as_slice)
    }
}
