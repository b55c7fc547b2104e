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
    /// How FP8 products run ([`crate::model::fp8`]).
    pub fp8: Fp8Options,
}

/// How a process's FP8 products run on GPUs with FP8 tensor cores. The executor applies
/// them to the process ([`crate::model::fp8::configure`]): the products run deep in the
/// model code, and every executor of a process resolves them alike from one environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Options {
    /// The norm before a block's q/k/v and MLP-in products writes their input quantized
    /// per token (`true`, the default); `false`: each product quantizes its own input
    /// (`MOLD_FP8_FUSE=off`). The same bits either way.
    pub quantize_in_norm: bool,
    /// cuBLASLt's fast accumulation: partial sums not promoted to f32 every few k-steps
    /// (`true`, the default, as torchao's and vLLM's inference products);
    /// `MOLD_FP8_FAST_ACCUM=off`.
    pub fast_accumulation: bool,
    /// Quantize inputs with the plain kernel, which reads a row twice, instead of the one
    /// that reads it once in 16-byte pieces, and widen e4m3 rows one value a thread instead
    /// of eight (`MOLD_FP8_QUANTIZE=plain`; the same bits).
    pub plain_quantize: bool,
    /// Attention in FP8 in blocks whose weights are held in FP8: `None` (the default) as
    /// the plan says (its transformer's `attention: fp8`, `mold plan --fp8-attention`);
    /// `MOLD_FP8_ATTENTION=on|off` overrides the plan either way. q, k and v quantized to
    /// e4m3 with one scale each, the probabilities in e4m3, cuDNN's FP8 flash attention
    /// (Hopper and later), its e4m3 output the output projection's FP8 input. Where cuDNN
    /// cannot run it, attention runs in the activations' dtype (the run's report says why);
    /// on the CPU its precision is emulated. Per executor, not process-wide.
    pub attention: Option<bool>,
    /// SMs the FP8 products leave to the work beside them (`MOLD_FP8_SM_CARVEOUT=N`, default
    /// 0: none): cuBLASLt's SM count target (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`) set to
    /// the GPU's SMs less N, so that a product whose kernel keeps one block per SM does not
    /// wait for the SMs an NCCL exchange's kernels hold (under sequence parallelism over
    /// more than two GPUs, and tensor parallelism, NCCL's kernels run beside the products).
    /// The same bits only where cuBLASLt picks the same algorithm; for measuring.
    pub sm_carveout: u32,
    /// Under sequence parallelism with FP8 attention, q, k and v sent in e4m3 with one
    /// scale per tensor agreed by the group, and the output back in e4m3 (`true`, the
    /// default; [`crate::model::sequence::exchange_e4m3`]); `false`
    /// (`MOLD_FP8_EXCHANGE=wide`): sent in the activations' dtype, each rank quantizing the
    /// heads it receives with scales of its own.
    pub exchange_e4m3: bool,
}

impl Fp8Options {
    /// Reads `MOLD_FP8_FUSE` (on|off), `MOLD_FP8_FAST_ACCUM` (on|off), `MOLD_FP8_QUANTIZE`
    /// (pieces|plain), `MOLD_FP8_ATTENTION` (on|off), `MOLD_FP8_SM_CARVEOUT` (a number of
    /// SMs, 0 to 1024) and `MOLD_FP8_EXCHANGE` (e4m3|wide) through `get` (the CLI passes its
    /// environment); unset ones keep their defaults. A bad value is refused in one line naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Fp8Options, String> {
        let d = Fp8Options::default();
        let pick = |k: &str, on: &str, off: &str, default: bool, what: &str| match get(k) {
            None => Ok(default),
            Some(v) => match v.trim().to_ascii_lowercase() {
                t if t == on || (on == "on" && t == "1") => Ok(true),
                t if t == off || (off == "off" && t == "0") => Ok(false),
                _ => Err(format!("{k}={v:?}: {what}")),
            },
        };
        Ok(Fp8Options {
            quantize_in_norm: pick(
                "MOLD_FP8_FUSE",
                "on",
                "off",
                d.quantize_in_norm,
                "give on (the default: the norm before a block's products quantizes their input) or off (each product quantizes its own)",
            )?,
            fast_accumulation: pick(
                "MOLD_FP8_FAST_ACCUM",
                "on",
                "off",
                d.fast_accumulation,
                "give on (the default: cuBLASLt's fast accumulation) or off (partial sums promoted to f32)",
            )?,
            plain_quantize: pick(
                "MOLD_FP8_QUANTIZE",
                "plain",
                "pieces",
                d.plain_quantize,
                "give pieces (the default: each row read once in 16-byte pieces) or plain",
            )?,
            attention: match get("MOLD_FP8_ATTENTION") {
                None => d.attention,
                Some(_) => Some(pick(
                    "MOLD_FP8_ATTENTION",
                    "on",
                    "off",
                    false,
                    "give on (FP8 attention in FP8 blocks) or off (attention in the activations' dtype), or leave it unset for what the plan says",
                )?),
            },
            sm_carveout: match get("MOLD_FP8_SM_CARVEOUT") {
                None => d.sm_carveout,
                Some(v) => match v.trim().parse::<u32>() {
                    Ok(n) if n <= 1024 => n,
                    _ => {
                        return Err(format!(
                            "MOLD_FP8_SM_CARVEOUT={v:?}: give the SMs the FP8 products leave to the work beside them, 0 (the default) to 1024"
                        ))
                    }
                },
            },
            exchange_e4m3: pick(
                "MOLD_FP8_EXCHANGE",
                "e4m3",
                "wide",
                d.exchange_e4m3,
                "give e4m3 (the default: FP8 attention's q, k, v and output sent in e4m3 under sequence parallelism) or wide (in the activations' dtype)",
            )?,
        })
    }
}

impl Default for Fp8Options {
    fn default() -> Self {
        Fp8Options {
            quantize_in_norm: true,
            fast_accumulation: true,
            plain_quantize: false,
            attention: None,
            sm_carveout: 0,
            exchange_e4m3: true,
        }
    }
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
            fp8: Fp8Options::default(),
        }
    }
}
