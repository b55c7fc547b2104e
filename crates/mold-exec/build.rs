//! With the `cuda` feature, compile mold's own CUDA kernels (kernels/*.cu) to fat binaries
//! with nvcc: machine code for each architecture in MOLD_CUDA_ARCHS (default
//! mold_fatbin::DEFAULT_ARCHS) and PTX of the newest, so no supported GPU compiles them on
//! first use. CPU builds do nothing here.

use std::path::PathBuf;

const KERNELS: [&str; 5] = ["flash_attn", "elementwise", "groupnorm", "softmax", "fp8"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    mold_fatbin::build::rerun_if_env_changed();
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let archs = mold_fatbin::Archs::from_env().unwrap_or_else(|e| panic!("mold-exec: {e}"));
    let jobs: Vec<_> = KERNELS
        .iter()
        .map(|k| mold_fatbin::build::Job {
            src: format!("kernels/{k}.cu").into(),
            out: out.join(format!("{k}.fatbin")),
            archs: mold_fatbin::build::Targets::Archs(archs.clone()),
        })
        .collect();
    mold_fatbin::build::compile(&jobs, &["-O3", "--use_fast_math", "-std=c++17"])
        .unwrap_or_else(|e| panic!("mold-exec: {e}"));
}
