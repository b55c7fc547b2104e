//! This box's GPUs against the machine a plan was made for.

use super::Inventory;
use mold_plan::{DeviceId, GIB};

/// How the GPUs of this box differ from the ones a plan was made for (its recorded
/// machine): one line per difference, empty when every CUDA device of the plan is here
/// with the same name and total memory. Host devices and emulated devices are ignored.
pub fn differences_from_plan(inv: &Inventory, planned: &mold_plan::MachineIdentity) -> Vec<String> {
    let mut out = Vec::new();
    for d in &planned.devices {
        let DeviceId::Cuda(ord) = d.id else { continue };
        match inv.devices.iter().find(|g| g.ordinal == ord) {
            None => out.push(format!(
                "{}: the plan's {} ({}) is not on this box ({} CUDA device(s) here)",
                d.id,
                d.name,
                d.memory.human(),
                inv.devices.len()
            )),
            Some(g) => {
                // Profiles record total memory rounded to MiB; allow 1 GiB of slack.
                let diff = g.total.0.abs_diff(d.memory.0);
                if g.name != d.name || diff > GIB {
                    out.push(format!(
                        "{}: this box has {} ({}), the plan was made for {} ({})",
                        d.id,
                        g.name,
                        g.total.human(),
                        d.name,
                        d.memory.human()
                    ));
                }
            }
        }
    }
    out
}
