//! Times FLUX's VAE decoder alone, as `Vae::decode` runs it (benches/vae/run builds and
//! runs this on a GPU machine beside benches/vae/vae_torch.py).
//!
//! vae_bench --ae ae.safetensors --latent z.safetensors [--kernels auto|candle|...]
//!           [--tune] [--no-subpixel] [--dtype bf16|f16|f32] [--iters N] [--out image.safetensors] [--profile]
//!           [--keep-pool] [--devices N] [--same-gpu] [--host-profile]
//!
//! `--devices N` decodes in N row bands on cuda:0..N-1 (peer copies between them; with
//! `--same-gpu` all on cuda:0, each band its own candle device and host thread) and, with
//! `--keep-pool`, prints each device's memory in use after the decodes: with freed memory kept
//! in the pool, the most the decode held at once plus the CUDA context.
//! The latent file holds `z` `(1, 16, h, w)` (before the autoencoder's scale and shift, as
//! the sampler hands it over). Prints the first decode's time (plans built, engines tuned),
//! the median of `N` more, the decoder's note, and with `--profile` one more decode with the
//! device synchronised after every operation (its split; the sum exceeds a plain decode).
//! `--host-profile` times one more decode's host side without synchronising: how long the
//! host takes to queue each layer (every band's share of it) and the whole decode, beside
//! the decode's time once the devices are done.
//! `--keep-pool` (built with mold-pipeline's `cuda` feature) keeps freed device memory in
//! the CUDA pool candle allocates from (release threshold: unlimited) instead of returning
//! it to the driver at every synchronisation, as PyTorch's caching allocator does.

#[path = "common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use mold_exec::Kernels;
use mold_pipeline::flux::vae::{AeConfig, Vae, VaeOptions};
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    ae: PathBuf,
    latent: PathBuf,
    kernels: Kernels,
    tune: bool,
    subpixel: bool,
    dtype: DType,
    iters: usize,
    out: Option<PathBuf>,
    profile: bool,
    host_profile: bool,
    keep_pool: bool,
    devices: usize,
    same_gpu: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        ae: PathBuf::new(),
        latent: PathBuf::new(),
        kernels: Kernels::Auto,
        tune: false,
        subpixel: true,
        dtype: DType::BF16,
        iters: 10,
        out: None,
        profile: false,
        host_profile: false,
        keep_pool: false,
        devices: 1,
        same_gpu: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--ae" => a.ae = val()?.into(),
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
            "--host-profile" => a.host_profile = true,
            "--keep-pool" => a.keep_pool = true,
            "--same-gpu" => a.same_gpu = true,
            "--devices" => {
                a.devices = val()?.parse().map_err(|e| format!("--devices: {e}"))?;
                if a.devices == 0 {
                    return Err("--devices: at least 1".into());
                }
            }
            _ => return Err(format!("unknown argument {k} (see the file's header)")),
        }
    }
    if a.ae.as_os_str().is_empty() || a.latent.as_os_str().is_empty() {
        return Err("--ae and --latent are required".into());
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse().map_err(|e| format!("vae_bench: {e}"))?;
    let devs: Vec<Device> = (0..a.devices)
        .map(|i| Device::cuda_if_available(if a.same_gpu { 0 } else { i }))
        .collect::<candle_core::Result<_>>()?;
    let dev = devs[0].clone();
    if a.keep_pool {
        for d in &devs {
            keep_pool(d)?;
        }
        println!("pool: freed memory kept (release threshold unlimited)");
    }
    let opts = VaeOptions {
        kernels: a.kernels,
        tune: a.tune,
        subpixel: a.subpixel,
        peer_copies: true,
    };
    let sync_all = || -> candle_core::Result<()> {
        for d in &devs {
            d.synchronize()?;
        }
        Ok(())
    };
    let t = Instant::now();
    let vae = Vae::load_bands_file(&a.ae, AeConfig::flux(), a.dtype, &devs, opts)?;
    sync_all()?;
    println!("load: {:.3} s", t.elapsed().as_secs_f64());
    let z = common::load_latent(&a.latent, &dev)?;
    let (img, times) = common::time_decodes(&z, a.iters, &sync_all, &|z| Ok(vae.decode(z)?))?;
    common::print_decodes(&z, a.dtype, &times, a.kernels, a.tune, a.subpixel);
    println!("{}", vae.note());
    println!("{}", mold_exec::model::plan_cache::counts());
    if a.keep_pool {
        for (i, d) in devs.iter().enumerate() {
            println!(
                "cuda:{i} memory in use after the decodes: {:.2} GiB",
                in_use(d)? as f64 / (1u64 << 30) as f64
            );
        }
    }
    if a.host_profile {
        let mut rows: Vec<(String, f64)> = Vec::new();
        sync_all()?;
        let t = Instant::now();
        let mut last = t;
        let mut mark = |label: String, _: &Tensor| {
            let now = Instant::now();
            rows.push((label, (now - last).as_secs_f64()));
            last = now;
        };
        vae.decode_marked(&z, Some(&mut mark))?;
        let queued = t.elapsed().as_secs_f64();
        sync_all()?;
        let done = t.elapsed().as_secs_f64();
        println!(
            "host profile ({} band(s), not synchronised): queued in {:.2} ms, done in {:.2} ms, {} layers",
            devs.len(),
            queued * 1e3,
            done * 1e3,
            rows.len()
        );
        if let Some(st) = vae.last_stats() {
            println!(
                "  the slowest band's thread queued its decode in {:.2} ms",
                st.queued_us as f64 / 1e3
            );
        }
        common::print_by_kind(&rows, "host");
    }
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
        let total = t.elapsed().as_secs_f64();
        println!(
            "profile (synchronised after each operation): {:.2} ms",
            total * 1e3
        );
        for (label, s) in &rows {
            println!("  {:>8.3} ms  {label}", s * 1e3);
        }
        common::print_by_kind(&rows, "total");
    }
    if let Some(out) = &a.out {
        common::save_image(&img, out)?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn keep_pool(dev: &Device) -> Result<(), String> {
    use candle_core::cuda::cudarc::driver::sys;
    let Device::Cuda(d) = dev else {
        return Err("--keep-pool: not a CUDA device".into());
    };
    let stream = d.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out pointer and the device of a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(|e| format!("cuDeviceGetDefaultMemPool: {e:?}"))?;
    let mut keep = u64::MAX;
    // SAFETY: the attribute is a cuuint64_t, passed through a valid pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| format!("cuMemPoolSetAttribute: {e:?}"))
}

/// Device memory in use (total less free) on `dev`'s GPU.
#[cfg(feature = "cuda")]
fn in_use(dev: &Device) -> Result<u64, String> {
    use candle_core::cuda::cudarc::driver::result;
    let Device::Cuda(d) = dev else {
        return Err("not a CUDA device".into());
    };
    d.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    let (free, total) = result::mem_get_info().map_err(|e| format!("cuMemGetInfo: {e:?}"))?;
    Ok((total - free) as u64)
}

#[cfg(not(feature = "cuda"))]
fn in_use(_: &Device) -> Result<u64, String> {
    Err("memory in use needs a build with mold-pipeline's `cuda` feature".into())
}

#[cfg(not(feature = "cuda"))]
fn keep_pool(_: &Device) -> Result<(), String> {
    Err("--keep-pool needs a build with mold-pipeline's `cuda` feature".into())
}
