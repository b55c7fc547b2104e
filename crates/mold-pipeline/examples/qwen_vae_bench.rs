//! Times Qwen-Image's VAE decoder alone, as `QwenVae::decode` runs it (benches/vae/qwen
//! builds and runs this on a GPU machine beside benches/vae/qwen_vae_torch.py, diffusers'
//! `AutoencoderKLQwenImage` on the same weights).
//!
//! qwen_vae_bench --vae DIR --latent z.safetensors [--kernels auto|candle|...] [--tune]
//!                [--no-subpixel] [--dtype bf16|f16|f32] [--iters N] [--out image.safetensors]
//!                [--profile]
//!
//! DIR holds diffusers' `config.json` and `diffusion_pytorch_model.safetensors`; the latent
//! file holds `z` `(1, 16, h, w)`, normalized (as the sampler hands it over). Prints the
//! load, the first decode (plans built), the median of `N` more and the decoder's note;
//! `--profile`, one more decode with the device synchronised after every operation.
//! `--kernels candle` runs the channels-first decoder on candle's operations (the path
//! before the channels-last one). Freed device memory stays in CUDA's pool (its release
//! threshold unlimited, as `mold` sets it on the GPUs it opens).

#[path = "common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use mold_exec::model::conv::ConvOptions;
use mold_exec::Kernels;
use mold_pipeline::nhwc::NhwcOptions;
use mold_pipeline::qwen::vae::{QwenVae, QwenVaeFiles};
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    vae: PathBuf,
    latent: PathBuf,
    kernels: Kernels,
    tune: bool,
    subpixel: bool,
    dtype: DType,
    iters: usize,
    out: Option<PathBuf>,
    profile: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        vae: PathBuf::new(),
        latent: PathBuf::new(),
        kernels: Kernels::Auto,
        tune: false,
        subpixel: true,
        dtype: DType::BF16,
        iters: 10,
        out: None,
        profile: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--vae" => a.vae = val()?.into(),
            "--latent" => a.latent = val()?.into(),
            "--kernels" => a.kernels = Kernels::parse(&val()?)?,
            "--tune" => a.tune = true,
            "--no-subpixel" => a.subpixel = false,
            "--dtype" => {
                a.dtype = match val()?.as_str() {
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    "f32" => DType::F32,
                    d => return Err(format!("--dtype {d}: expected bf16, f16 or f32")),
                }
            }
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--out" => a.out = Some(val()?.into()),
            "--profile" => a.profile = true,
            _ => return Err(format!("unknown argument {k} (see the file's header)")),
        }
    }
    if a.vae.as_os_str().is_empty() || a.latent.as_os_str().is_empty() {
        return Err("--vae and --latent are required".into());
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse().map_err(|e| format!("qwen_vae_bench: {e}"))?;
    let dev = Device::cuda_if_available(0)?;
    if dev.is_cuda() {
        mold_exec::runtime::keep_freed_memory_of(&dev)?;
    }
    let files = QwenVaeFiles {
        config: a.vae.join("config.json"),
        weights: vec![a.vae.join("diffusion_pytorch_model.safetensors")],
    };
    let opts = NhwcOptions {
        conv: ConvOptions {
            kernels: a.kernels,
            tune: a.tune,
        },
        subpixel: a.subpixel,
    };
    let t = Instant::now();
    let vae = QwenVae::load_with(&files, a.dtype, &dev, opts)?;
    dev.synchronize()?;
    println!("load: {:.3} s", t.elapsed().as_secs_f64());
    let z = common::load_latent(&a.latent, &dev)?;
    let (img, times) =
        common::time_decodes(&z, a.iters, &|| dev.synchronize(), &|z| Ok(vae.decode(z)?))?;
    common::print_decodes(&z, a.dtype, &times, a.kernels, a.tune, a.subpixel);
    println!("{}", vae.note());
    println!("{}", mold_exec::model::plan_cache::counts());
    if a.profile {
        let mut rows: Vec<(String, f64)> = Vec::new();
        dev.synchronize()?;
        let mut last = Instant::now();
        let mut mark = |label: String, t: &Tensor| {
            let _ = t.device().synchronize();
            let now = Instant::now();
            rows.push((label, (now - last).as_secs_f64()));
            last = now;
        };
        let t = Instant::now();
        vae.decode_marked(&z, Some(&mut mark))?;
        dev.synchronize()?;
        println!(
            "profile (synchronised after each operation): {:.2} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        common::print_by_kind(&rows, "total");
    }
    if let Some(out) = &a.out {
        common::save_image(&img, out)?;
    }
    Ok(())
}
