//! How a plan runs, as the caller chose: the library reads no environment. The binary
//! resolves these from flags, environment and `config.toml` at its edge.

use crate::comm::CommOptions;
use crate::fault::Fault;
use crate::model::ops::Kernels;
use crate::streaming::Streaming;

/// Options of one [`crate::Executor`].
#[derive(Clone, Debug, PartialEq)]
pub struct ExecOptions {
    /// How streamed blocks reach their devices.
    pub streaming: Streaming,
    /// Fused CUDA kernels or candle's ops.
    pub kernels: Kernels,
    /// Time each phase per device (synchronises at every mark: slower).
    pub profiling: bool,
    /// With `profiling`: time GPUs by CUDA events recorded at each mark instead of
    /// waiting for the device there ([`crate::model::Profiler`]; `MOLD_PROFILE=events`).
    pub profile_events: bool,
    /// A failure to inject into one rank (tests and the GPU suite).
    pub fault: Option<Fault>,
    /// The most host memory streamed weights may take; `None`: what the host reports
    /// available ([`crate::streaming::host_memory_available`]).
    pub host_memory: Option<u64>,
    /// Timeouts and the shared secret of collectives and the multi-process mesh.
    pub comm: CommOptions,
    /// The same seed gives the same output bit for bit under tensor and sequence
    /// parallelism: each GPU gets a stream of its own (see `runtime::DeviceMap`). One GPU
    /// and block splits repeat without it.
    pub deterministic: bool,
    /// Hand activations between GPUs by peer copy where a pair has peer access
    /// (`true`, the default); `false` stages every hand-off through host memory, as on a
    /// box without peer access (`mold exec --no-peer`, which also keeps NCCL off the
    /// GPU-to-GPU path: issue 19's no-peer profile).
    pub peer_copies: bool,
    /// Upload resident weights to a GPU through page-locked staging buffers straight from
    /// the mapped checkpoint (`true`, the default; [`crate::staging`]); `false` reads each
    /// slice on the host and uploads it from pageable memory (`MOLD_LOAD=host`).
    pub staged_load: bool,
    /// Compute each block's modulation for a window of steps at once where the inputs
    /// carry their request's schedule (`true`, the default; [`crate::model::modulation`]);
    /// `false` computes every step's alone (`MOLD_MODULATION_AHEAD=off`).
    pub modulation_ahead: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            streaming: Streaming::default(),
            kernels: Kernels::Auto,
            profiling: false,
            profile_events: false,
            fault: None,
            host_memory: None,
            comm: CommOptions::default(),
            deterministic: false,
            peer_copies: true,
            staged_load: true,
            modulation_ahead: true,
        }
    }
}
