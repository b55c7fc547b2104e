//! CUDA fat binaries, the form in which mold carries GPU code: machine code (SASS) for each
//! GPU architecture it supports and PTX of the newest for GPUs that come after them, so that
//! no supported GPU compiles PTX on first use (a fresh box paid 14.5 s for it in T5's first
//! run when only PTX was shipped; BENCHMARKS.md).
//!
//! - [`build`]: what build scripts call (mold-exec's `kernels/*.cu`, the vendored
//!   candle-kernels): `nvcc --fatbin` for the architectures in `MOLD_CUDA_ARCHS`.
//! - [`contents`]: the images a fat binary holds, read from its bytes (the check CI runs
//!   on the built kernels, and what `mold` reports before it runs on a GPU).

mod archs;
pub mod build;
mod contents;

pub use archs::{Archs, ArchsError, DEFAULT_ARCHS};
pub use contents::{contents, Contents, FatbinError, Image, ImageKind};
