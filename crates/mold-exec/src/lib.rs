//! `mold-exec`: runs a diffusion transformer the way a [`mold_plan::Plan`] places it.
//!
//! # Model vs runtime
//!
//! - [`model`] is the maths: the [`model::Transformer`] interface (block kinds, checks,
//!   loading per [`model::Shard`], stem, blocks, final layer) and the families behind it
//!   ([`model::flux`]), built from replicated, column-parallel and row-parallel linears.
//!   A block talks to its tensor-parallel group only through the [`comm::Comm`] trait; it
//!   knows nothing of plans, devices or residency.
//! - [`comm`] is collective communication (a group of one, threads, TCP between
//!   processes, NCCL); [`dist`] is the multi-process mesh (launch, rendezvous, hand-offs).
//! - [`runtime`] maps plan devices to candle devices (`emu:N` and `host` → CPU, `cuda:N`
//!   → GPU with the `cuda` feature), hands activations between devices and accounts
//!   memory ([`DeviceMemory`]); [`streaming`] streams weights from host memory.
//! - [`Executor`] ties them together: for each transformer part in order it runs the
//!   part's blocks on its device group (one device: plainly; several: tensor parallel,
//!   one thread per rank), handing activations from part to part. The stem runs on the
//!   first part's devices and the final layer on the last part's first device.
//!
//! Options come in as an [`ExecOptions`] struct: nothing here reads the environment.
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
//! let v = exec.forward(&x)?; // once per denoising step
//! for m in exec.memory_report() { println!("{}: {} weight bytes", m.device, m.resident_weight_bytes); }
//! # Ok(()) }
//! ```
//!
//! Checks happen before any tensor data is read: [`Checkpoint::check`] (names, shapes,
//! dtypes from the safetensors headers) and [`check_plan`] (block ranges, coverage,
//! tensor-parallel degrees).

pub mod block_errors;
pub mod calibrate;
pub mod checkpoint;
pub mod comm;
pub mod dist;
pub mod error;
pub mod executor;
pub mod fault;
pub mod memory_probe;
pub mod model;
pub mod options;
pub mod random_weights;
pub mod runtime;
pub mod staging;
pub mod streaming;
pub mod verify;
pub mod weights_copy;

pub use checkpoint::{Checkpoint, TensorHeader};
pub use error::ExecError;
pub use executor::{check_plan, compute_dtype, weights_dtype, Executor, PhaseTime};
pub use fault::{Fault, FaultKind};
pub use model::attention::{report as attention_report, AttentionReport};
pub use model::flux::testdata::{write_testdata, write_testdata_sharded};
pub use model::flux::{random_inputs, FluxConfig, FluxInputs};
pub use model::ops::Kernels;
pub use model::qwen::{QwenConfig, QwenInputs};
pub use model::{BlockRef, Inputs, TensorSpec, Transformer};
pub use options::{ExecOptions, Fp8Options};
pub use random_weights::write_safetensors;
pub use runtime::DeviceMemory;
pub use streaming::Streaming;
pub use verify::{digest, fnv1a, max_relative_error};

/// Re-exported so callers need not depend on candle directly.
pub use candle_core::{DType, Device, Tensor};
