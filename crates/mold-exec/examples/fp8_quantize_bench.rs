//! Host quantization to FP8 of one FLUX single block's linear1 weight (21504 × 3072, bf16),
//! the work an FP8 plan's load does for every product's weight: the best of three, per
//! weight and per weight and thread.
//!
//!   cargo run --release -p mold-exec --example fp8_quantize_bench
use candle_core::{DType, Device, Tensor};
use mold_exec::model::fp8::Fp8Weight;
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let w = Tensor::randn(0f32, 0.02, (21504, 3072), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let q = Fp8Weight::quantize(&w)?;
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(q);
    }
    let n = w.elem_count() as f64;
    let th = rayon::current_num_threads() as f64;
    println!(
        "{th} threads: {best:.3} s for {:.1} M weights, {:.2} ns a weight, {:.2} ns a weight and thread",
        n / 1e6,
        best / n * 1e9,
        best / n * 1e9 * th
    );
    Ok(())
}
