//! This box's own measurements, kept between runs: `mold devices --calibrate` on the local
//! box keeps the profile it measured in mold's cache directory, named by the box's key (its
//! GPUs' UUIDs in ordinal order and the CUDA driver API version: another GPU, another order
//! under `CUDA_VISIBLE_DEVICES`, or a driver of another CUDA version is another box), and
//! `--machine local` adopts its tables before the ones mold ships ([`crate::shipped`]). The
//! key also carries [`TABLES_VERSION`], so tables measured otherwise are never adopted. A
//! later calibration replaces whole tables (a model, dtype and device) and keeps the others;
//! two calibrations at once may each keep only its own. A calibration thus refines
//! every later plan on the box without a `--machine FILE`.
//!
//! The directory is the caller's (the CLI resolves `MOLD_CACHE_DIR` / `XDG_CACHE_HOME`);
//! nothing here reads the environment.

use crate::inventory::Inventory;
use crate::{Machine, MachineError, OpTables};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The folder under mold's cache directory that holds the boxes' profiles.
pub const DIR: &str = "profiles";

/// What a kept profile's tables measure, as a number: raised whenever calibration measures
/// other sizes or the cost model reads its tables otherwise (2: the all-to-all's
/// three-shard q/k/v message; 3: the element-wise kernels timed back to back and the
/// all-to-all's layout copies measured; 4: the all-to-all's copies as they run with the
/// messages written in place; 5: its own q/k/v piece written in place too, only the
/// output's join copied). It is part of the key, so a profile kept by a mold
/// that measured otherwise is never adopted: the box is calibrated anew, or planned on the
/// tables mold ships, until then.
pub const TABLES_VERSION: u32 = 5;

/// The box's key: `box-` and 16 hex digits of the SHA-256 of [`TABLES_VERSION`], its
/// driver version and its GPUs' UUIDs in ordinal order.
pub fn key(inv: &Inventory) -> String {
    key_of(inv, TABLES_VERSION)
}

fn key_of(inv: &Inventory, version: u32) -> String {
    let mut gpus: Vec<(u32, &str)> = inv
        .devices
        .iter()
        .map(|g| (g.ordinal, g.uuid.as_str()))
        .collect();
    gpus.sort();
    let mut h = Sha256::new();
    // (Version 1's key hashed "mold box v1" here: its files stay where they are, unread.)
    h.update(format!("mold box tables {version}\n").as_bytes());
    h.update(inv.driver_version.as_deref().unwrap_or("?").as_bytes());
    for (ordinal, uuid) in gpus {
        h.update(format!("\n{ordinal} {uuid}").as_bytes());
    }
    let d = h.finalize();
    let hex: String = d.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("box-{hex}")
}

/// Where the box's kept profile lives under `cache_dir`.
pub fn path(cache_dir: &Path, inv: &Inventory) -> PathBuf {
    cache_dir.join(DIR).join(format!("{}.yaml", key(inv)))
}

/// The kept profile of the box, if there is one that parses; a file that does not parse
/// (another mold version's, or damaged) is `Err`, for the caller to mention and pass over.
pub fn load(cache_dir: &Path, inv: &Inventory) -> Result<Option<Machine>, MachineError> {
    let p = path(cache_dir, inv);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(MachineError::Io {
                path: p.display().to_string(),
                message: e.to_string(),
            })
        }
    };
    Machine::from_yaml(&text, &p.display().to_string()).map(Some)
}

/// Adds to `m` (this box's profile, as queried now) the tables of `kept` (its kept
/// calibration) that `m` has none of, as measured: with their collectives and the busy
/// copy rate, which are this box's own (unlike a shipped profile's, see
/// [`Machine::adopt_tables`]). Tables of devices `m` does not have are left out.
pub fn adopt(m: &mut Machine, kept: &Machine) -> Vec<crate::shipped::Adopted> {
    let mut added = Vec::new();
    for t in &kept.ops {
        if !m.devices.iter().any(|d| d.name == t.device)
            || m.op_tables(&t.model, t.dtype, &t.device).is_some()
        {
            continue;
        }
        added.push(crate::shipped::Adopted {
            from: kept.name.clone(),
            date: kept.calibration.date.clone(),
            table: format!("{} {} on {}", t.model, t.dtype, t.device),
            collectives: !t.collectives.all_reduce.is_empty(),
            scaled: None,
        });
        m.ops.push(t.clone());
    }
    added
}

/// `measured` (a profile of this box with the tables just measured) with the tables kept
/// before for models, dtypes or devices it did not measure: what [`keep`] writes.
pub fn merged(measured: &Machine, kept: Option<&Machine>) -> Machine {
    let mut m = measured.clone();
    if let Some(old) = kept {
        let same = |a: &OpTables, b: &OpTables| {
            a.model == b.model && a.dtype == b.dtype && a.device == b.device
        };
        let older: Vec<OpTables> = old
            .ops
            .iter()
            .filter(|t| !measured.ops.iter().any(|n| same(n, t)))
            .cloned()
            .collect();
        m.ops.extend(older);
    }
    m
}

/// Keeps `measured` as the box's profile (merged with what was kept before: [`merged`]),
/// written whole to a temporary file and renamed over the old one, so a reader never
/// sees half a profile. Returns the path.
pub fn keep(
    cache_dir: &Path,
    inv: &Inventory,
    measured: &Machine,
) -> Result<PathBuf, MachineError> {
    let io = |p: &Path, e: std::io::Error| MachineError::Io {
        path: p.display().to_string(),
        message: e.to_string(),
    };
    let p = path(cache_dir, inv);
    let dir = p.parent().expect("a file under the cache directory");
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    // A kept file that no longer parses is replaced, not merged.
    let kept = load(cache_dir, inv).ok().flatten();
    let mut m = merged(measured, kept.as_ref());
    m.name = key(inv);
    let text = m.to_yaml();
    let tmp = p.with_extension(format!("yaml.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(&p, e)
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuInfo;

    fn gpu(ordinal: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            ordinal,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: uuid.into(),
            total: crate::ByteSize(80 << 30),
            free: crate::ByteSize(79 << 30),
            compute_capability: "9.0".into(),
            pci_bus: format!("0000:{ordinal:02x}:00.0"),
            multiprocessors: 132,
            clock_mhz: None,
            memory_clock_mhz: None,
            memory_bus_bits: None,
        }
    }

    fn inv(driver: &str, gpus: &[(u32, &str)]) -> Inventory {
        Inventory {
            driver_version: Some(driver.into()),
            devices: gpus.iter().map(|(o, u)| gpu(*o, u)).collect(),
            peers: Vec::new(),
            host_memory: None,
            host_cpus: None,
        }
    }

    /// The key names the GPUs in ordinal order and the driver: the same box gives the
    /// same key whatever order the query listed them in; another GPU, another ordinal
    /// order or another driver gives another.
    #[test]
    fn the_key_is_the_gpus_in_order_and_the_driver() {
        let a = inv("13.0", &[(0, "GPU-a"), (1, "GPU-b")]);
        let k = key(&a);
        assert!(k.starts_with("box-") && k.len() == 20, "{k}");
        assert_eq!(key(&inv("13.0", &[(1, "GPU-b"), (0, "GPU-a")])), k);
        for other in [
            inv("13.0", &[(0, "GPU-b"), (1, "GPU-a")]),
            inv("13.0", &[(0, "GPU-a"), (1, "GPU-c")]),
            inv("13.0", &[(0, "GPU-a")]),
            inv("12.8", &[(0, "GPU-a"), (1, "GPU-b")]),
        ] {
            assert_ne!(key(&other), k);
        }
        assert!(path(Path::new("/c"), &a).ends_with(format!("profiles/{k}.yaml")));
        // Tables measured by a mold that measured otherwise are another box's.
        assert_ne!(key_of(&a, TABLES_VERSION - 1), k);
        assert_ne!(key_of(&a, TABLES_VERSION + 1), k);
    }

    fn measured(models: &[&str]) -> Machine {
        let mut m = crate::shipped::profiles()
            .into_iter()
            .next()
            .expect("a shipped profile");
        let t = m.ops[0].clone();
        m.ops = models
            .iter()
            .map(|model| OpTables {
                model: model.to_string(),
                ..t.clone()
            })
            .collect();
        m
    }

    /// Kept, read back, merged: a later calibration replaces the tables it measured and
    /// keeps the others; nothing is kept for another box; a damaged file is an error to
    /// mention, and the next calibration replaces it.
    #[test]
    fn kept_profiles_round_trip_and_merge() {
        let dir = std::env::temp_dir().join(format!("mold-box-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let box_a = inv("13.0", &[(0, "GPU-a")]);
        assert_eq!(load(&dir, &box_a).unwrap(), None);
        let first = measured(&["flux-dev", "qwen-image"]);
        let p = keep(&dir, &box_a, &first).unwrap();
        assert_eq!(p, path(&dir, &box_a));
        let got = load(&dir, &box_a).unwrap().expect("kept");
        assert_eq!(got.name, key(&box_a));
        assert_eq!(got.ops, first.ops);
        // A later calibration of flux-dev alone: its new table, qwen-image's old one.
        let mut second = measured(&["flux-dev"]);
        second.ops[0].elementwise_gbps = 1234.5;
        keep(&dir, &box_a, &second).unwrap();
        let got = load(&dir, &box_a).unwrap().unwrap();
        let models: Vec<&str> = got.ops.iter().map(|t| t.model.as_str()).collect();
        assert_eq!(models, ["flux-dev", "qwen-image"]);
        assert_eq!(got.ops[0].elementwise_gbps, 1234.5);
        // Adopted as measured (the busy copy rate kept), before anything else; a table
        // the profile already has is not replaced.
        let mut local = measured(&[]);
        local.ops.clear();
        let mut kept = load(&dir, &box_a).unwrap().unwrap();
        kept.ops[0].htod_busy_ratio = Some(0.5);
        let added = adopt(&mut local, &kept);
        assert_eq!(added.len(), 2);
        assert!(added[0].from.starts_with("box-"));
        assert_eq!(local.ops[0].htod_busy_ratio, Some(0.5));
        assert!(adopt(&mut local, &kept).is_empty());
        // Another box has nothing kept.
        assert_eq!(load(&dir, &inv("13.0", &[(0, "GPU-z")])).unwrap(), None);
        // Damaged: an error naming the file; the next calibration writes it afresh.
        std::fs::write(path(&dir, &box_a), "devices: [").unwrap();
        let e = load(&dir, &box_a).unwrap_err().to_string();
        assert!(e.contains(&key(&box_a)), "{e}");
        keep(&dir, &box_a, &second).unwrap();
        assert_eq!(load(&dir, &box_a).unwrap().unwrap().ops.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
