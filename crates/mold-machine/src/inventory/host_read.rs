//! The host's read rate from a warm page cache (`mold devices --calibrate`): what loading a
//! checkpoint runs at before its upload. A scratch file is written (so its pages are in the
//! cache), then read back by every core at once (at most 8 threads, as the loader reads),
//! each thread its own contiguous share in 16 MiB reads into one reused buffer, as the
//! loader fills its page-locked staging buffers. The best of three passes is kept.

use super::InventoryError;
use std::io::Write;
use std::path::Path;

const MIB: usize = 1 << 20;
/// One read, the size of a staging buffer.
const CHUNK: usize = 16 * MIB;

/// Measures the read rate (GB/s) with a scratch file of `bytes` in `dir`, removed after.
pub fn measure(dir: &Path, bytes: usize) -> Result<f64, InventoryError> {
    let err = |what: &str, e: std::io::Error| {
        InventoryError::Calibration(format!("host read rate: {what}: {e}"))
    };
    let bytes = bytes.max(CHUNK) / CHUNK * CHUNK;
    let path = dir.join(format!("mold-read-probe-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&path).map_err(|e| err("creating a scratch file", e))?;
        let block: Vec<u8> = (0..CHUNK).map(|i| (i % 251) as u8).collect();
        for _ in 0..bytes / CHUNK {
            f.write_all(&block)
                .map_err(|e| err("writing the scratch file", e))?;
        }
        f.flush().map_err(|e| err("writing the scratch file", e))?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(read_once(&path, bytes, threads).map_err(|e| err("reading", e))?);
        }
        Ok(bytes as f64 / best / 1e9)
    })();
    let _ = std::fs::remove_file(&path);
    result
}

/// Seconds for `threads` threads to read the file's `bytes`, each its share.
fn read_once(path: &Path, bytes: usize, threads: usize) -> std::io::Result<f64> {
    let chunks = bytes / CHUNK;
    let t = std::time::Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || -> std::io::Result<()> {
                    let f = std::fs::File::open(path)?;
                    let mut buf = vec![0u8; CHUNK];
                    let (a, b) = (chunks * k / threads, chunks * (k + 1) / threads);
                    for c in a..b {
                        read_at(&f, &mut buf, (c * CHUNK) as u64)?;
                    }
                    std::hint::black_box(&buf);
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| std::io::Error::other("a reading thread panicked"))??;
        }
        Ok::<_, std::io::Error>(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

#[cfg(unix)]
fn read_at(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, at)
}

#[cfg(not(unix))]
fn read_at(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = f;
    f.seek(SeekFrom::Start(at))?;
    f.read_exact(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_measured_and_the_scratch_file_removed() {
        let dir = std::env::temp_dir().join(format!("mold-read-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gbps = measure(&dir, 2 * CHUNK).unwrap();
        assert!(gbps.is_finite() && gbps > 0.0, "{gbps}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_directory_is_one_line_naming_the_step() {
        let e = measure(Path::new("/nonexistent/mold"), CHUNK)
            .unwrap_err()
            .to_string();
        assert!(e.contains("host read rate: creating a scratch file"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
