use cudaforge::{KernelBuilder, Result};
use std::env;
use std::path::PathBuf;

const CUTILE_FEATURE: &str = "CARGO_FEATURE_CUTILE";

/// The kernels candle loads at run time (src/lib.rs, one module each).
const MODULES: [&str; 11] = [
    "affine", "binary", "cast", "conv", "fill", "indexing", "quantized", "reduce", "sort",
    "ternary", "unary",
];

fn main() -> Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");

    // The kernels candle loads at run time, as fat binaries (mold's patch, vendor/README.md):
    // machine code for every architecture in MOLD_CUDA_ARCHS plus PTX of the newest for
    // GPUs that come after it, so that no supported GPU compiles PTX on first use.
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    mold_fatbin::build::rerun_if_env_changed();
    let archs = mold_fatbin::Archs::from_env().unwrap_or_else(|e| panic!("candle-kernels: {e}"));
    let jobs: Vec<_> = MODULES
        .iter()
        .map(|&m| mold_fatbin::build::Job {
            src: format!("src/{m}.cu").into(),
            out: out_dir.join(format!("{m}.fatbin")),
            // GGUF kernels: mold never runs them; PTX keeps them loadable without
            // compiling them for every architecture.
            archs: if m == "quantized" {
                mold_fatbin::build::Targets::PtxOnly(80)
            } else {
                mold_fatbin::build::Targets::Archs(archs.clone())
            },
        })
        .collect();
    mold_fatbin::build::compile(&jobs, &["--expt-relaxed-constexpr", "-std=c++17", "-O3"])
        .unwrap_or_else(|e| panic!("candle-kernels: {e}"));

    let mut moe_sources = vec![
        "src/moe/moe_gguf.cu",
        "src/moe/moe_wmma.cu",
        "src/moe/moe_wmma_gguf.cu",
        "src/mmvq_gguf.cu",
        "src/mmq_gguf/mmq_quantize.cu",
        "src/mmq_gguf/mmq_instance_q4_0.cu",
        "src/mmq_gguf/mmq_instance_q4_1.cu",
        "src/mmq_gguf/mmq_instance_q5_0.cu",
        "src/mmq_gguf/mmq_instance_q5_1.cu",
        "src/mmq_gguf/mmq_instance_q8_0.cu",
        "src/mmq_gguf/mmq_instance_q2_k.cu",
        "src/mmq_gguf/mmq_instance_q3_k.cu",
        "src/mmq_gguf/mmq_instance_q4_k.cu",
        "src/mmq_gguf/mmq_instance_q5_k.cu",
        "src/mmq_gguf/mmq_instance_q6_k.cu",
    ];
    if env::var_os(CUTILE_FEATURE).is_some() {
        moe_sources.push("src/moe/moe_align.cu");
    }

    let mut moe_builder = KernelBuilder::default()
        .source_files(moe_sources)
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3");

    // Disable bf16 WMMA kernels on GPUs older than sm_80 (Ampere).
    // bf16 WMMA fragments require compute capability >= 8.0.
    let compute_cap = cudaforge::detect_compute_cap()
        .map(|arch| arch.base())
        .unwrap_or(80);
    if compute_cap < 80 {
        moe_builder = moe_builder.arg("-DNO_BF16_KERNEL");
    }

    let mut is_target_msvc = false;
    if let Ok(target) = std::env::var("TARGET") {
        if target.contains("msvc") {
            is_target_msvc = true;
            moe_builder = moe_builder.arg("-D_USE_MATH_DEFINES");
        }
    }

    if !is_target_msvc {
        moe_builder = moe_builder.arg("-Xcompiler").arg("-fPIC");
    }

    moe_builder.build_lib(out_dir.join("libmoe.a"))?;
    println!("cargo:rustc-link-search={}", out_dir.display());
    println!("cargo:rustc-link-lib=moe");
    println!("cargo:rustc-link-lib=dylib=cudart");
    if !is_target_msvc {
        println!("cargo:rustc-link-lib=stdc++");
    }
    Ok(())
}
