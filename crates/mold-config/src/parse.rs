//! Values as flags and variables write them: GPU lists, device caps, sizes.

use crate::{invalid, ConfigError};
use mold_plan::{ByteSize, DeviceId};
use std::collections::BTreeMap;

/// A list of GPUs as flags and variables write it: `1,2`, `cuda:1,cuda:2`, `1`.
pub fn parse_gpu_list(s: &str, origin: &str) -> Result<Vec<u32>, ConfigError> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let n = match item.parse::<u32>() {
            Ok(n) => n,
            Err(_) => match item.parse::<DeviceId>() {
                Ok(d @ DeviceId::Cuda(_)) | Ok(d @ DeviceId::Emu(_)) => d.ordinal().unwrap(),
                _ => {
                    return Err(invalid(
                        origin,
                        format!(
                            "`{item}` is not a GPU: write ordinals such as 1,2 or cuda:1,cuda:2"
                        ),
                    ))
                }
            },
        };
        if out.contains(&n) {
            return Err(invalid(origin, format!("GPU {n} is named twice")));
        }
        out.push(n);
    }
    if out.is_empty() {
        return Err(invalid(origin, "names no GPU: write ordinals such as 1,2"));
    }
    Ok(out)
}

/// One budget cap: `cuda:0=20GiB`.
pub fn parse_cap(s: &str, origin: &str) -> Result<(DeviceId, ByteSize), ConfigError> {
    let (d, size) = s.split_once('=').ok_or_else(|| {
        invalid(
            origin,
            format!("`{s}`: write DEVICE=SIZE, e.g. cuda:0=20GiB"),
        )
    })?;
    let d: DeviceId = d.trim().parse().map_err(|e: String| invalid(origin, e))?;
    let size: ByteSize = size
        .trim()
        .parse()
        .map_err(|e: mold_plan::ByteSizeError| invalid(origin, format!("{d}: {e}")))?;
    Ok((d, size))
}

/// Budget caps, comma-separated: `cuda:0=20GiB,cuda:1=30GiB` (`MOLD_MAX_VRAM`).
pub(crate) fn parse_caps(
    s: &str,
    origin: &str,
) -> Result<BTreeMap<DeviceId, ByteSize>, ConfigError> {
    let mut out = BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (d, size) = parse_cap(item, origin)?;
        if out.insert(d.clone(), size).is_some() {
            return Err(invalid(origin, format!("{d} is capped twice")));
        }
    }
    Ok(out)
}

pub(crate) fn parse_size(s: &str, origin: &str) -> Result<ByteSize, ConfigError> {
    s.trim()
        .parse()
        .map_err(|e: mold_plan::ByteSizeError| invalid(origin, e.to_string()))
}
