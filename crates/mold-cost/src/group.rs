//! A device group and the parallel layout a part runs on it: `tp × sp` devices, in the
//! plan's order (`devices[i]` has sequence-parallel rank `i / tp` and tensor-parallel
//! rank `i % tp`).

use mold_plan::{DeviceId, Part};
use std::fmt;

/// The devices of a part and how its blocks are split over them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Group {
    pub devices: Vec<DeviceId>,
    /// Tensor-parallel degree: heads and MLP columns split, weights `1/tp` per device.
    pub tp: u32,
    /// Sequence-parallel (Ulysses) degree: tokens split, an all-to-all around attention.
    pub sp: u32,
}

impl Group {
    /// `devices` laid out as `sp` groups of `tp` consecutive devices.
    pub fn new(devices: Vec<DeviceId>, tp: u32, sp: u32) -> Group {
        Group { devices, tp, sp }
    }
    /// One device.
    pub fn single(device: DeviceId) -> Group {
        Group::new(vec![device], 1, 1)
    }
    /// Tensor parallel over every device (what a version 1 plan's group meant).
    pub fn tensor(devices: Vec<DeviceId>) -> Group {
        let tp = devices.len().max(1) as u32;
        Group::new(devices, tp, 1)
    }
    /// Sequence parallel over every device.
    pub fn sequence(devices: Vec<DeviceId>) -> Group {
        let sp = devices.len().max(1) as u32;
        Group::new(devices, 1, sp)
    }
    /// The layout of a plan's part.
    pub fn of(part: &Part) -> Group {
        Group::new(part.devices.clone(), part.tp, part.sp)
    }
    pub fn len(&self) -> usize {
        self.devices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
    /// More than one device.
    pub fn is_parallel(&self) -> bool {
        self.devices.len() > 1
    }
    /// The tensor-parallel groups: `sp` runs of `tp` consecutive devices (they all-reduce
    /// among themselves).
    pub fn tp_groups(&self) -> Vec<Vec<DeviceId>> {
        self.devices
            .chunks(self.tp.max(1) as usize)
            .map(|c| c.to_vec())
            .collect()
    }
    /// The sequence-parallel groups: the devices of equal tensor-parallel rank (their
    /// all-to-alls and all-gathers run among them).
    pub fn sp_groups(&self) -> Vec<Vec<DeviceId>> {
        let tp = self.tp.max(1) as usize;
        (0..tp.min(self.devices.len()))
            .map(|t| self.devices.iter().skip(t).step_by(tp).cloned().collect())
            .collect()
    }
    /// `tp2`, `sp2`, `sp2×tp2`; empty for one device.
    pub fn layout_name(&self) -> String {
        match (self.tp, self.sp) {
            (1, 1) => String::new(),
            (t, 1) => format!("tp{t}"),
            (1, s) => format!("sp{s}"),
            (t, s) => format!("sp{s}×tp{t}"),
        }
    }
    /// In words: `tensor parallel ×2`, `sequence parallel ×2`, `sequence parallel ×2 ×
    /// tensor parallel ×2`; empty for one device.
    pub fn describe(&self) -> String {
        match (self.tp, self.sp) {
            (1, 1) => String::new(),
            (t, 1) => format!("tensor parallel ×{t}"),
            (1, s) => format!("sequence parallel ×{s}"),
            (t, s) => format!("sequence parallel ×{s} × tensor parallel ×{t}"),
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let devs = self
            .devices
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("+");
        match self.layout_name() {
            l if l.is_empty() => f.write_str(&devs),
            l => write!(f, "{l} {devs}"),
        }
    }
}
