//! cuDNN's execution plans kept on disk between processes (cuDNN's serialised form, one file
//! per plan), and the process's count of plans built and read back.
//!
//! Building FLUX.1-dev's 27 plans (its attention on a runtime-compiled engine, 26 decoder
//! convolutions) took 1.17 s in a fresh process on an H100; reading them back 0.10 s
//! (BENCHMARKS.md). The files are keyed by cuDNN's version, the GPU (name, compute
//! capability) and the plan's graph, so a plan never meets another library or GPU; one that
//! cuDNN refuses to read back is rebuilt and replaced.
//!
//! The settings are the process's, installed once at the CLI edge ([`install`]): the cuDNN
//! code that uses them sits under layers that know nothing of options.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The process's plan settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanSettings {
    /// The directory plans are kept in (None: none kept).
    pub dir: Option<PathBuf>,
}

static SETTINGS: OnceLock<PlanSettings> = OnceLock::new();

/// Installs the process's settings; the first call wins (a later one is ignored and
/// answers false). Without a call, no plan is kept.
pub fn install(s: PlanSettings) -> bool {
    SETTINGS.set(s).is_ok()
}

/// The installed settings.
pub fn settings() -> &'static PlanSettings {
    SETTINGS.get_or_init(PlanSettings::default)
}

/// Plans kept under `dir` (`<dir>/cudnn-<version>/<sha256>.json`).
#[derive(Clone, Debug)]
pub struct PlanStore {
    dir: PathBuf,
}

/// Largest plan file read back: cuDNN's plans are a few kB to a few MB of JSON (compiled
/// kernels included); anything larger is not one of them.
const MAX_PLAN_BYTES: u64 = 64 << 20;

impl PlanStore {
    pub fn new(dir: impl Into<PathBuf>) -> PlanStore {
        PlanStore { dir: dir.into() }
    }

    /// The file of the plan for `graph` (the graph's full description) on `gpu` (its name
    /// and compute capability) with cuDNN `version`.
    pub fn path(&self, version: &str, gpu: &str, graph: &str) -> PathBuf {
        let mut h = Sha256::new();
        for part in [version, gpu, graph] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.dir
            .join(format!("cudnn-{version}"))
            .join(format!("{hex}.json"))
    }

    /// The kept plan at `path`, if there is a readable one of a plausible size.
    pub fn load(path: &Path) -> Option<Vec<u8>> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        if !meta.is_file() || meta.len() == 0 || meta.len() > MAX_PLAN_BYTES {
            return None;
        }
        std::fs::read(path).ok()
    }

    /// Keeps `json` at `path` (written whole or not at all; a failure only costs the next
    /// process a rebuild, so it is returned for the caller to count, not to stop on).
    pub fn store(path: &Path, json: &[u8]) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        mold_files::write_bytes(path, json)
    }
}

/// The process's plan counts since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlanCounts {
    /// Plans built by cuDNN's heuristics and finalised here.
    pub built: u64,
    /// Of those, on an engine that compiles its kernel at run time.
    pub runtime_compiled: u64,
    /// Plans read back from the store.
    pub kept: u64,
    /// Seconds spent building and reading plans back.
    pub seconds: f64,
    /// Plans that could not be stored (the directory not writable, the disk full).
    pub store_failures: u64,
}

static BUILT: AtomicU64 = AtomicU64::new(0);
static RTC: AtomicU64 = AtomicU64::new(0);
static KEPT: AtomicU64 = AtomicU64::new(0);
static NANOS: AtomicU64 = AtomicU64::new(0);
static STORE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Records one plan: read back (`kept`) or built (on a runtime-compiled engine or not), and
/// the time it took.
pub fn record(kept: bool, runtime_compiled: bool, seconds: f64) {
    if kept {
        KEPT.fetch_add(1, Ordering::Relaxed);
    } else {
        BUILT.fetch_add(1, Ordering::Relaxed);
        if runtime_compiled {
            RTC.fetch_add(1, Ordering::Relaxed);
        }
    }
    NANOS.fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
}

/// Records a plan that could not be stored.
pub fn record_store_failure() {
    STORE_FAILURES.fetch_add(1, Ordering::Relaxed);
}

/// The counts so far.
pub fn counts() -> PlanCounts {
    PlanCounts {
        built: BUILT.load(Ordering::Relaxed),
        runtime_compiled: RTC.load(Ordering::Relaxed),
        kept: KEPT.load(Ordering::Relaxed),
        seconds: NANOS.load(Ordering::Relaxed) as f64 * 1e-9,
        store_failures: STORE_FAILURES.load(Ordering::Relaxed),
    }
}

impl std::fmt::Display for PlanCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuDNN plans: {} built ({} runtime-compiled), {} read back, {:.3} s",
            self.built, self.runtime_compiled, self.kept, self.seconds
        )?;
        if self.store_failures > 0 {
            write!(
                f,
                ", {} not kept (the plan directory refused them)",
                self.store_failures
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_file_is_keyed_by_library_gpu_and_graph() {
        let s = PlanStore::new("/c");
        let p = s.path("9.19.0", "NVIDIA H100 80GB HBM3 sm_90", "Key { n: 1 }");
        assert!(p.starts_with("/c/cudnn-9.19.0"));
        assert_eq!(p.extension().unwrap(), "json");
        let others = [
            s.path("9.19.1", "NVIDIA H100 80GB HBM3 sm_90", "Key { n: 1 }"),
            s.path("9.19.0", "NVIDIA H200 sm_90", "Key { n: 1 }"),
            s.path("9.19.0", "NVIDIA H100 80GB HBM3 sm_90", "Key { n: 2 }"),
            // The parts are length-prefixed: moving a boundary changes the key.
            s.path("9.19.0", "NVIDIA H100 80GB HBM3 sm_9", "0Key { n: 1 }"),
        ];
        for o in others {
            assert_ne!(o.file_name(), p.file_name());
        }
        assert_eq!(
            p,
            s.path("9.19.0", "NVIDIA H100 80GB HBM3 sm_90", "Key { n: 1 }")
        );
    }

    #[test]
    fn kept_plans_round_trip_and_bad_files_read_as_none() {
        let d = tempfile::tempdir().unwrap();
        let s = PlanStore::new(d.path());
        let p = s.path("9.19.0", "gpu", "graph");
        assert_eq!(PlanStore::load(&p), None, "nothing kept yet");
        PlanStore::store(&p, b"{\"plan\":1}").unwrap();
        assert_eq!(PlanStore::load(&p).as_deref(), Some(&b"{\"plan\":1}"[..]));
        PlanStore::store(&p, b"{\"plan\":2}").unwrap();
        assert_eq!(PlanStore::load(&p).as_deref(), Some(&b"{\"plan\":2}"[..]));
        // Empty, a directory, or too large: not a plan.
        let empty = s.path("9.19.0", "gpu", "empty");
        PlanStore::store(&empty, b"").unwrap();
        assert_eq!(PlanStore::load(&empty), None);
        let dir = s.path("9.19.0", "gpu", "dir");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(PlanStore::load(&dir), None);
        let big = s.path("9.19.0", "gpu", "big");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_PLAN_BYTES + 1).unwrap();
        assert_eq!(PlanStore::load(&big), None);
    }

    #[cfg(unix)]
    #[test]
    fn a_link_in_the_store_is_neither_read_nor_written_through() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("user-file");
        std::fs::write(&target, b"the user's").unwrap();
        let s = PlanStore::new(d.path().join("store"));
        let p = s.path("9", "gpu", "graph");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert_eq!(PlanStore::load(&p), None);
        PlanStore::store(&p, b"plan").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"the user's");
        assert_eq!(std::fs::read(&p).unwrap(), b"plan");
    }

    #[test]
    fn counts_add_up() {
        let before = counts();
        record(false, true, 0.5);
        record(false, false, 0.25);
        record(true, false, 0.125);
        record_store_failure();
        let after = counts();
        assert!(after.built >= before.built + 2);
        assert!(after.runtime_compiled > before.runtime_compiled);
        assert!(after.kept > before.kept);
        assert!(after.seconds >= before.seconds + 0.875 - 1e-9);
        assert!(after.store_failures > before.store_failures);
        let line = after.to_string();
        assert!(line.starts_with("cuDNN plans: "), "{line}");
        assert!(line.contains("not kept"), "{line}");
    }
}
