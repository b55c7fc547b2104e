//! What the decoder benchmarks (`vae_bench`, `qwen_vae_bench`) share.

use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

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
