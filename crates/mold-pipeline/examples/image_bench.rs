//! Host-side work at the end of a request, timed on this machine: the decoded image
//! tensor to RGB bytes, the digests the progress events carry, and the PNG at each
//! compression level. A smooth gradient with mild noise stands in for a decoded image.
//!   cargo run --release -p mold-pipeline --example image_bench [SIZE]
use candle_core::{DType, Device, Tensor};
use mold_pipeline::image::RgbImage;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let size: usize = std::env::args().nth(1).map_or(Ok(1024), |s| s.parse())?;
    let dev = Device::Cpu;
    let ramp = Tensor::arange(0f32, size as f32, &dev)?.affine(2.0 / size as f64, -1.0)?;
    let noise = Tensor::randn(0f32, 0.05, (3, size, size), &dev)?;
    let img = ramp
        .reshape((1, 1, size))?
        .broadcast_as((3, size, size))?
        .add(&noise)?
        .to_dtype(DType::BF16)?;
    let latents = Tensor::randn(0f32, 1.0, (1, size * size / 256, 64), &dev)?;
    let rgb = || mold_pipeline::flux::vae::to_rgb8(&img).unwrap();
    println!(
        "{size}²: image to RGB bytes {:.2} ms",
        time(5, || drop(rgb()))
    );
    println!(
        "digest of the image {:.2} ms, of the latents {:.2} ms",
        time(5, || {
            mold_exec::digest(&img).unwrap();
        }),
        time(5, || {
            mold_exec::digest(&latents).unwrap();
        })
    );
    let (w, h, data) = rgb();
    let im = RgbImage {
        width: w,
        height: h,
        data,
    };
    for c in [
        png::Compression::Fast,
        png::Compression::Balanced,
        png::Compression::High,
    ] {
        let mut bytes = 0;
        let ms = time(3, || {
            let out = mold_pipeline::image::encode_png_with(&im, &[], c).unwrap();
            bytes = out.len();
        });
        println!("PNG {c:?}: {ms:.2} ms, {bytes} bytes");
    }
    Ok(())
}
