//! Random-weight safetensors files: the one writer every family's test data goes through
//! (FLUX's [`crate::model::flux::testdata`], Qwen-Image's [`crate::model::qwen::testdata`],
//! the pipelines' encoders and VAEs), and the seeded normal draws that random inputs share.
//!
//! Values depend only on the seed and the tensor name, so a sharded and a single-file
//! checkpoint of the same seed hold the same weights. Files are written tensor by tensor,
//! so memory stays bounded by one tensor even for full-size models. A leaf: it knows no
//! model family.

use crate::error::{ExecError, Result};
use crate::model::TensorSpec;
use candle_core::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::path::{Path, PathBuf};

/// What an observer of [`observe_writes`] is told after each tensor: the file, its bytes
/// written so far and its bytes in all (header included).
type OnWrite = Box<dyn FnMut(&Path, u64, u64)>;

thread_local! {
    static ON_WRITE: RefCell<Option<OnWrite>> = const { RefCell::new(None) };
}

/// Runs `f` with `on` told of the progress of every file [`write_safetensors`] writes on
/// this thread (every writer of test data goes through it, the pipelines' too): the file,
/// its bytes written so far (after the header, then after each tensor) and its bytes in
/// all. For progress bars; the previous observer is back when `f` returns or panics.
pub fn observe_writes<R>(on: impl FnMut(&Path, u64, u64) + 'static, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<OnWrite>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            ON_WRITE.with(|c| *c.borrow_mut() = prev);
        }
    }
    let prev = ON_WRITE.with(|c| c.borrow_mut().replace(Box::new(on)));
    let _restore = Restore(prev);
    f()
}

/// Tells this thread's observer, if any (an observer that itself writes is not told).
fn report_write(path: &Path, done: u64, total: u64) {
    ON_WRITE.with(|c| {
        if let Ok(mut on) = c.try_borrow_mut() {
            if let Some(on) = on.as_mut() {
                on(path, done, total);
            }
        }
    });
}

/// An I/O error naming `path`.
pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ExecError + '_ {
    move |source| ExecError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Standard normal samples (Box–Muller), `n` of them.
pub(crate) fn normals(rng: &mut StdRng, n: usize, mut f: impl FnMut(f32)) {
    let mut i = 0;
    while i < n {
        let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        f((r * th.cos()) as f32);
        i += 1;
        if i < n {
            f((r * th.sin()) as f32);
            i += 1;
        }
    }
}

/// How a test tensor is filled: weights ~ N(0, 1/fan_in) (std 1/sqrt(fan_in)), biases
/// ~ N(0, 0.02²), norm scales ~ 1 + N(0, 0.1²). The tensor is cut into chunks of
/// `CHUNK` values, each drawn from its own generator seeded by (seed, name, chunk), and
/// the chunks are filled on every core: a full-size FLUX checkpoint takes seconds, not
/// minutes, and the values do not depend on the number of threads.
fn fill_bytes(spec: &TensorSpec, seed: u64, dtype: DType) -> Vec<u8> {
    const CHUNK: usize = 1 << 16;
    let es = dtype.size_in_bytes();
    let n: usize = spec.shape.iter().product();
    let (mean, std) = if spec.name.ends_with(".scale") {
        (1.0, 0.1)
    } else if spec.name.ends_with(".bias") {
        (0.0, 0.02)
    } else if spec.shape.len() < 2 {
        // Other vectors: norm weights around 1, anything else small.
        if spec.name.contains("norm") {
            (1.0, 0.1)
        } else {
            (0.0, 0.02)
        }
    } else {
        // Matrices [out, in] and kernels [out, in, kh, kw]: fan-in is all but dim 0.
        let fan_in: usize = spec.shape[1..].iter().product();
        (0.0, 1.0 / (fan_in.max(1) as f32).sqrt())
    };
    // FNV-1a of the name: per-tensor seeds that do not depend on the std hasher.
    let base = seed ^ crate::verify::fnv1a(spec.name.bytes());
    let mut out = vec![0u8; n * es];
    let chunks: Vec<(usize, &mut [u8])> = out.chunks_mut(CHUNK * es).enumerate().collect();
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(chunks.len().max(1));
    let mut lanes: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, c) in chunks {
        lanes[i % threads].push((i, c));
    }
    std::thread::scope(|sc| {
        for lane in lanes {
            sc.spawn(move || {
                for (i, buf) in lane {
                    let mut rng = StdRng::seed_from_u64(
                        base.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    );
                    let mut k = 0;
                    normals(&mut rng, buf.len() / es, |x| {
                        let v = mean + std * x;
                        let dst = &mut buf[k * es..(k + 1) * es];
                        match dtype {
                            DType::F32 => dst.copy_from_slice(&v.to_le_bytes()),
                            DType::BF16 => {
                                dst.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes())
                            }
                            _ => dst.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                        }
                        k += 1;
                    });
                }
            });
        }
    });
    out
}

fn st_dtype(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("F32"),
        DType::BF16 => Ok("BF16"),
        DType::F16 => Ok("F16"),
        d => Err(ExecError::Input(format!(
            "test checkpoints are f32, bf16 or f16, not {d:?}"
        ))),
    }
}

/// Writes random tensors `specs` into one safetensors file, tensor by tensor (memory
/// bounded by one tensor), deterministic from `seed` and each name: matrices and kernels
/// ~ N(0, 1/fan_in), biases ~ N(0, 0.02²), norm scales ~ 1 + N(0, 0.1²).
pub fn write_safetensors(path: &Path, specs: &[TensorSpec], seed: u64, dtype: DType) -> Result<()> {
    let es = dtype.size_in_bytes();
    let dt = st_dtype(dtype)?;
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for s in specs {
        let n: usize = s.shape.iter().product::<usize>() * es;
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": dt, "shape": s.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    // Through a temporary file renamed over `path`: never through a symlink there (a
    // hub cache snapshot's files are links into its blobs), never half a file.
    mold_files::write_with(path, |w| {
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        let total = (8 + h.len() + offset) as u64;
        let mut done = (8 + h.len()) as u64;
        report_write(path, done, total);
        for s in specs {
            let bytes = fill_bytes(s, seed, dtype);
            w.write_all(&bytes)?;
            done += bytes.len() as u64;
            report_write(path, done, total);
        }
        Ok(())
    })
    .map_err(io(path))
}

/// Random tensors `specs` (as [`write_safetensors`] fills them) in files
/// `{stem}-0000i-of-0000n.safetensors` of at most `max_shard_bytes` each (or one tensor
/// when a tensor is larger), in order, plus the weight map `{stem}.safetensors.index.json`
/// (the Hugging Face layout); returns the index path.
pub fn write_sharded(
    dir: &Path,
    specs: &[TensorSpec],
    seed: u64,
    dtype: DType,
    max_shard_bytes: u64,
    stem: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let es = dtype.size_in_bytes() as u64;
    let mut shards: Vec<Vec<TensorSpec>> = vec![Vec::new()];
    let mut size = 0u64;
    for s in specs {
        let n = s.shape.iter().product::<usize>() as u64 * es;
        if size + n > max_shard_bytes && !shards.last().unwrap().is_empty() {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().unwrap().push(s.clone());
    }
    let total = shards.len();
    let mut map = serde_json::Map::new();
    let mut total_size = 0u64;
    for (i, specs) in shards.iter().enumerate() {
        let name = format!("{stem}-{:05}-of-{:05}.safetensors", i + 1, total);
        write_safetensors(&dir.join(&name), specs, seed, dtype)?;
        for s in specs {
            total_size += s.shape.iter().product::<usize>() as u64 * es;
            map.insert(s.name.clone(), serde_json::Value::String(name.clone()));
        }
    }
    let index = dir.join(format!("{stem}.safetensors.index.json"));
    let body = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": map});
    mold_files::write_bytes(
        &index,
        serde_json::to_string_pretty(&body)
            .expect("json")
            .as_bytes(),
    )
    .map_err(io(&index))?;
    Ok(index)
}
