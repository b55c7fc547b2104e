//! `mold-exec`: runs a FLUX transformer the way a [`mold_plan::Plan`] places it.
//!
//! # Model vs runtime
//!
//! - [`model`] is the FLUX transformer (stem, double-stream and single-stream blocks,
//!   final layer) built from replicated, column-parallel and row-parallel linears. A
//!   block is loaded for one [`model::Shard`] (rank r of a tensor-parallel group of w) and
//!   talks to its group only through the [`comm::Comm`] trait. It knows nothing of plans,
//!   devices or residency.
//! - [`comm`] is collective communication: [`comm::LocalComm`] (a group of one) and
//!   [`comm::ThreadComm`] (ranks as threads, deterministic rank-order sums); and, behind the `nccl`
//!   feature, an NCCL implementation on candle's compute streams.
//! - [`runtime`] maps plan devices to candle devices (`emu:N` and `host` → CPU, `cuda:N`
//!   → GPU with the `cuda` feature), picks communicators, holds weights resident or
//!   streamed from host memory, and accounts memory ([`DeviceMemory`]).
//! - [`Executor`] ties them together: for each transformer part in order it runs the
//!   part's blocks on its device group (one device: plainly; several: tensor parallel,
//!   one thread per rank), handing activations from part to part. The stem runs on the
//!   first part's devices and the final layer on the last part's first device.
//!
//! # Typical use
//!
//! ```no_run
//! # fn main() -> Result<(), mold_exec::ExecError> {
//! use mold_exec::*;
//! let cfg = FluxConfig::flux_dev();
//! let plan = mold_plan::Plan::load("plan.yaml".as_ref()).unwrap();
//! let ckpt = Checkpoint::open("flux1-dev.safetensors".as_ref())?; // headers only
//! let exec = Executor::new(&cfg, &plan, &ckpt)?; // checks, then loads weights
//! let x = random_inputs(&cfg, 1024, 1024, 512, 1, 0)?;
//! let v = exec.forward_inputs(&x)?; // once per denoising step
//! for m in exec.memory_report() { println!("{}: {} weight bytes", m.device, m.resident_weight_bytes); }
//! # Ok(()) }
//! ```
//!
//! Checks happen before any tensor data is read: [`Checkpoint::check`] (names, shapes,
//! dtypes from the safetensors headers) and [`check_plan`] (block ranges, coverage,
//! tensor-parallel degrees).

pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod dist;
pub mod error;
mod exec;
pub mod model;
pub mod runtime;
pub mod streaming;
pub mod testdata;

pub use checkpoint::{Checkpoint, TensorHeader};
pub use config::{FluxConfig, TensorSpec};
pub use error::ExecError;
pub use exec::{
    check_plan, compute_dtype, max_relative_error, BlockRef, Executor, Fault, FaultKind, FluxInputs,
};
pub use model::ops::Kernels;
pub use runtime::DeviceMemory;
pub use streaming::Streaming;
pub use testdata::{random_inputs, write_safetensors, write_testdata, write_testdata_sharded};

/// Re-exported so callers need not depend on candle directly.
pub use candle_core::{DType, Device, Tensor};
