//! For build scripts: CUDA sources compiled to fat binaries by nvcc, several at once.

use crate::Archs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One source to compile and where its fat binary goes.
#[derive(Clone, Debug)]
pub struct Job {
    pub src: PathBuf,
    pub out: PathBuf,
    /// The architectures it gets code for.
    pub archs: Targets,
}

/// What one job carries.
#[derive(Clone, Debug)]
pub enum Targets {
    /// Machine code for each architecture, PTX of the newest.
    Archs(Archs),
    /// PTX of this architecture only, compiled by the driver if ever loaded (for code mold
    /// never runs, kept only so that the library it belongs to links and loads).
    PtxOnly(u32),
}

/// nvcc as the build scripts find it: `NVCC`, else `$CUDA_ROOT/bin/nvcc` where it exists,
/// else `nvcc` on PATH.
pub fn nvcc() -> String {
    std::env::var("NVCC").unwrap_or_else(|_| {
        std::env::var("CUDA_ROOT")
            .map(|r| format!("{r}/bin/nvcc"))
            .ok()
            .filter(|p| Path::new(p).exists())
            .unwrap_or_else(|| "nvcc".into())
    })
}

/// The `cargo:rerun-if-env-changed` lines for what [`compile`] reads.
pub fn rerun_if_env_changed() {
    for v in ["MOLD_CUDA_ARCHS", "NVCC", "CUDA_ROOT"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
}

/// Compiles `jobs` with `nvcc --fatbin` and `flags`, as many at a time as the build may
/// use (cargo's `NUM_JOBS`); the first failure's message names the source and nvcc's
/// status.
pub fn compile(jobs: &[Job], flags: &[&str]) -> Result<(), String> {
    let nvcc = nvcc();
    let parallel = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let errors = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..parallel.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                if let Err(e) = compile_one(&nvcc, job, flags) {
                    errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn compile_one(nvcc: &str, job: &Job, flags: &[&str]) -> Result<(), String> {
    let gencode = match &job.archs {
        Targets::Archs(a) => a.gencode(),
        Targets::PtxOnly(a) => vec![format!("-gencode=arch=compute_{a},code=compute_{a}")],
    };
    let status = Command::new(nvcc)
        .arg("--fatbin")
        .args(flags)
        .args(&gencode)
        .arg("-o")
        .arg(&job.out)
        .arg(&job.src)
        .status()
        .map_err(|e| {
            format!("cannot run nvcc ({nvcc}): {e}; build CUDA with scripts/build-cuda")
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("nvcc failed on {} ({status})", job.src.display()))
    }
}
