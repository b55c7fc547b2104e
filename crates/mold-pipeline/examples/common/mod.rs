//! What the decoder benchmarks (`vae_bench`, `qwen_vae_bench`) share.

use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// A profile's rows (label, seconds) summed by kind (a label's first word), largest first,
/// one line each: `  {tag} {ms} ms  {kind} ({count})`.
pub fn print_by_kind(rows: &[(String, f64)], tag: &str) {
    let mut by_kind: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for (label, s) in rows {
        let kind: String = label.split(' ').next().unwrap_or("").to_string();
        let e = by_kind.entry(kind).or_default();
        e.0 += s;
        e.1 += 1;
    }
    let mut kinds: Vec<_> = by_kind.into_iter().collect();
    kinds.sort_by(|x, y| y.1 .0.total_cmp(&x.1 .0));
    for (kind, (s, n)) in kinds {
        println!("  {tag} {:>8.3} ms  {kind} ({n})", s * 1e3);
    }
}

/// `img` as f32 under the name `image` in the safetensors file `out`.
pub fn save_image(img: &Tensor, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let img = img.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    candle_core::safetensors::save(&[("image".to_string(), img)].into_iter().collect(), out)?;
    println!("wrote {}", out.display());
    Ok(())
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The latent `z` of the safetensors file `path`, on `dev`.
pub fn load_latent(path: &Path, dev: &Device) -> AnyResult<Tensor> {
    Ok(candle_core::safetensors::load(path, dev)?
        .remove("z")
        .ok_or_else(|| format!("{}: no tensor `z`", path.display()))?)
}

/// `decode(z)` once (the first decode: plans built), then `iters` (at least one) more, each
/// timed between two `sync()`s; prints the first decode's time. The first output and the
/// later decodes' seconds, sorted.
pub fn time_decodes(
    z: &Tensor,
    iters: usize,
    sync: &dyn Fn() -> candle_core::Result<()>,
    decode: &dyn Fn(&Tensor) -> AnyResult<Tensor>,
) -> AnyResult<(Tensor, Vec<f64>)> {
    let timed = |z: &Tensor| -> AnyResult<(Tensor, f64)> {
        sync()?;
        let t = Instant::now();
        let y = decode(z)?;
        sync()?;
        Ok((y, t.elapsed().as_secs_f64()))
    };
    let (img, first) = timed(z)?;
    println!("first decode: {:.1} ms", first * 1e3);
    let mut times = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        times.push(timed(z)?.1);
    }
    times.sort_by(f64::total_cmp);
    Ok((img, times))
}

/// The line both decoder benchmarks print for the sorted `times` of decoding `z`.
pub fn print_decodes(
    z: &Tensor,
    dtype: DType,
    times: &[f64],
    kernels: mold_exec::Kernels,
    tune: bool,
    subpixel: bool,
) {
    println!(
        "decode {:?} {}: median {:.2} ms, min {:.2} ms over {} (kernels {kernels:?}, tune {tune}, subpixel {subpixel})",
        z.dims(),
        format!("{dtype:?}").to_lowercase(),
        times[times.len() / 2] * 1e3,
        times[0] * 1e3,
        times.len(),
    );
}
