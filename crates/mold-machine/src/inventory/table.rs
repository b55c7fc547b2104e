//! The listing `mold devices` prints: devices, budgets and the peer-access matrix.

use super::{DeviceBudget, Inventory};
use crate::LinkKind;
use mold_plan::ByteSize;
use std::fmt::Write as _;

impl Inventory {
    /// The listing `mold devices` prints.
    pub fn table(&self, budgets: &[DeviceBudget]) -> String {
        let mut s = String::new();
        if let Some(v) = &self.driver_version {
            let _ = writeln!(s, "CUDA driver {v}");
        }
        let _ = writeln!(
            s,
            "{:<7} {:<26} {:>10} {:>10} {:>10} {:>10} {:>4}  {:<13} uuid",
            "device", "name", "total", "free", "budget", "usable", "cc", "pci bus"
        );
        for g in &self.devices {
            let b = budgets.iter().find(|b| b.device == g.id());
            let cell = |f: fn(&DeviceBudget) -> ByteSize| {
                b.map(|b| f(b).human()).unwrap_or_else(|| "-".into())
            };
            let _ = writeln!(
                s,
                "{:<7} {:<26} {:>10} {:>10} {:>10} {:>10} {:>4}  {:<13} {}",
                g.id().to_string(),
                g.name,
                g.total.human(),
                g.free.human(),
                cell(|b| b.budget),
                cell(|b| b.usable),
                g.compute_capability,
                g.pci_bus,
                g.uuid
            );
        }
        if let Some(b) = budgets.first() {
            let _ = writeln!(
                s,
                "budget = min(max_vram cap, free); usable = budget - headroom ({})",
                b.headroom
            );
        }
        if self.devices.len() > 1 {
            let _ = writeln!(
                s,
                "\npeer access (NV = NVLink, inferred from native peer atomics; PCIe = \
                 peer-to-peer over PCIe; - = none, copies go through the host); \
                 (r) = performance rank, lower is faster"
            );
            let _ = write!(s, "{:<8}", "");
            for g in &self.devices {
                let _ = write!(s, " {:>9}", g.id().to_string());
            }
            let _ = writeln!(s);
            for a in &self.devices {
                let _ = write!(s, "{:<8}", a.id().to_string());
                for b in &self.devices {
                    let cell = if a.ordinal == b.ordinal {
                        "x".to_string()
                    } else {
                        let rank = self
                            .peer(a.ordinal, b.ordinal)
                            .and_then(|p| p.performance_rank)
                            .map(|r| format!("({r})"))
                            .unwrap_or_default();
                        match self.link(a.ordinal, b.ordinal) {
                            Some(LinkKind::Nvlink) => format!("NV{rank}"),
                            Some(LinkKind::Pcie) => format!("PCIe{rank}"),
                            None => "-".into(),
                        }
                    };
                    let _ = write!(s, " {cell:>9}");
                }
                let _ = writeln!(s);
            }
        }
        s
    }
}
