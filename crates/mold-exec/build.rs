//! With the `cuda` feature, compile mold's own CUDA kernels (kernels/*.cu) to PTX with
//! nvcc, for the architecture in CUDA_COMPUTE_CAP (default 90), the same way candle's
//! kernels are built. CPU builds do nothing here.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/flash_attn.cu");
    println!("cargo:rerun-if-changed=kernels/elementwise.cu");
    println!("cargo:rerun-if-changed=kernels/groupnorm.cu");
    println!("cargo:rerun-if-changed=kernels/softmax.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| {
        std::env::var("CUDA_ROOT")
            .map(|r| format!("{r}/bin/nvcc"))
            .ok()
            .filter(|p| std::path::Path::new(p).exists())
            .unwrap_or_else(|| "nvcc".into())
    });
    for name in ["flash_attn", "elementwise", "groupnorm", "softmax"] {
        let ptx = out.join(format!("{name}.ptx"));
        let src = format!("kernels/{name}.cu");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "--use_fast_math", "-std=c++17"])
            .arg(format!("-arch=sm_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "mold-exec: cannot run nvcc ({nvcc}): {e}; build CUDA with scripts/build-cuda"
                )
            });
        assert!(status.success(), "mold-exec: nvcc failed on {src}");
    }
}
