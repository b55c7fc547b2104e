//! How the simulator writes sizes, times, links and device lists.

use crate::Live;
use mold_plan::{ByteSize, DeviceId};

pub(crate) fn human(b: u64) -> String {
    ByteSize(b).human()
}

/// Seconds, in a unit that suits them.
pub(crate) fn secs(s: f64) -> String {
    if s == 0.0 {
        "0 s".into()
    } else if s.abs() < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s.abs() < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.3} s")
    }
}

pub(crate) fn gbps_text(g: f64) -> String {
    if g.is_finite() {
        format!("{g:.0} GB/s")
    } else {
        "same device".into()
    }
}

pub(crate) fn list(ds: &[DeviceId]) -> String {
    ds.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("+")
}

pub(crate) fn live_list(live: &[Live]) -> String {
    live.iter()
        .map(|l| format!("{} {}", l.what, human(l.bytes)))
        .collect::<Vec<_>>()
        .join(", ")
}
