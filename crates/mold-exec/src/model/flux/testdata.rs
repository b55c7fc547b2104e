//! Random-weight checkpoints with FLUX's real tensor names and shapes, written through
//! [`crate::random_weights`] (values depend only on the seed and the tensor name, so a
//! sharded and a single-file checkpoint of the same seed hold the same weights).

use crate::error::Result;
use crate::model::flux::FluxConfig;
use crate::random_weights::{io, write_safetensors, write_sharded};
use candle_core::DType;
use std::path::{Path, PathBuf};

/// File name of a single-file test checkpoint.
pub const TESTDATA_FILE: &str = "flux-transformer.safetensors";
/// File name of a sharded test checkpoint's weight map.
pub const TESTDATA_INDEX: &str = "flux-transformer.safetensors.index.json";

/// Writes a random-weight checkpoint for `cfg` to `dir/flux-transformer.safetensors`
/// (deterministic from `seed`) in `dtype` (f32, bf16 or f16) and returns its path.
pub fn write_testdata(cfg: &FluxConfig, dir: &Path, seed: u64, dtype: DType) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(TESTDATA_FILE);
    write_safetensors(&path, &cfg.tensor_specs(), seed, dtype)?;
    Ok(path)
}

/// Like [`write_testdata`], split into files of at most `max_shard_bytes` (or one tensor
/// when a tensor is larger) plus `flux-transformer.safetensors.index.json`; returns the
/// index path. Same weights as [`write_testdata`] for the same seed.
pub fn write_testdata_sharded(
    cfg: &FluxConfig,
    dir: &Path,
    seed: u64,
    dtype: DType,
    max_shard_bytes: u64,
) -> Result<PathBuf> {
    write_sharded(
        dir,
        &cfg.tensor_specs(),
        seed,
        dtype,
        max_shard_bytes,
        "flux-transformer",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random_weights::observe_writes;
    use std::cell::RefCell;
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<(PathBuf, u64, u64)>>>;

    fn log_len(l: &Log) -> usize {
        l.borrow().len()
    }

    #[test]
    fn an_observer_sees_each_file_grow_to_its_size_and_only_while_it_observes() {
        let dir = std::env::temp_dir().join(format!("mold-observe-{}", std::process::id()));
        let seen: Log = Rc::new(RefCell::new(Vec::new()));
        let log = seen.clone();
        let cfg = FluxConfig::flux_tiny();
        let index = observe_writes(
            move |p: &Path, done, total| log.borrow_mut().push((p.to_path_buf(), done, total)),
            || write_testdata_sharded(&cfg, &dir, 1, DType::F32, 200_000),
        )
        .unwrap();
        let seen_rc = seen;
        let seen = seen_rc.borrow().clone();
        let mut files: Vec<PathBuf> = seen.iter().map(|s| s.0.clone()).collect();
        files.dedup();
        assert!(files.len() > 1, "{files:?}");
        for f in &files {
            let calls: Vec<_> = seen.iter().filter(|s| &s.0 == f).collect();
            assert!(calls.windows(2).all(|w| w[0].1 < w[1].1), "{f:?} grows");
            let last = calls.last().unwrap();
            assert_eq!(last.1, last.2, "{f:?} ends at its size");
            assert_eq!(last.2, std::fs::metadata(f).unwrap().len());
        }
        // The observer is gone after: a later write is not told to it.
        let before = log_len(&seen_rc);
        write_testdata(&FluxConfig::flux_tiny(), &dir, 1, DType::F32).unwrap();
        assert_eq!(log_len(&seen_rc), before);
        assert_eq!(Rc::strong_count(&seen_rc), 1, "the observer was dropped");
        let _ = std::fs::remove_dir_all(index.parent().unwrap());
    }
}
