//! Typed errors. Every message names the thing at fault and says how to fix it.

/// Shape as written in messages: `[3072, 64]`.
pub(crate) fn shape_str(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a readable safetensors checkpoint: {message}")]
    BadCheckpointFile { path: String, message: String },

    #[error(
        "checkpoint {checkpoint} lacks tensor `{name}` (expected shape {}): it does not hold \
         this model ({model}); pick the checkpoint that matches the plan's model, or a \
         model config that matches the checkpoint",
        shape_str(expected)
    )]
    MissingTensor {
        checkpoint: String,
        model: String,
        name: String,
        expected: Vec<usize>,
    },

    #[error(
        "checkpoint {checkpoint}: tensor `{name}` has shape {}, expected {} for this model \
         ({model}); pick the checkpoint that matches the plan's model, or a model config \
         that matches the checkpoint",
        shape_str(found),
        shape_str(expected)
    )]
    ShapeMismatch {
        checkpoint: String,
        model: String,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error(
        "checkpoint {checkpoint}: tensor `{name}` is stored as {dtype}; exec reads F32, BF16 \
         and F16 checkpoints: convert it (e.g. to bf16) first"
    )]
    UnsupportedTensorDtype {
        checkpoint: String,
        name: String,
        dtype: String,
    },

    #[error("invalid model config: {0}")]
    Config(String),

    #[error("plan: {0}")]
    Plan(String),

    #[error("plan: part {part}: block range `{range}`: {message}")]
    BadRange {
        part: usize,
        range: String,
        message: String,
    },

    /// `what` says why and what degree to use instead ([`crate::model::Transformer::tp_refusal`]).
    #[error("plan: part {part} is tensor parallel over {degree} devices, but {what}")]
    TpDegree {
        part: usize,
        degree: usize,
        what: String,
    },

    #[error(
        "plan: transformer dtype {0} is not supported by exec yet: plan with f32, bf16 or fp16"
    )]
    UnsupportedDtype(String),

    #[error("device {device}: this build has no CUDA: rebuild with --features cuda")]
    NoCuda { device: String },

    #[error("device {device}: {message}")]
    Device { device: String, message: String },

    #[error("input: {0}")]
    Input(String),

    /// A LoRA file that cannot be merged into the checkpoint; the message names the tensor.
    #[error("LoRA {path}: {message}")]
    Lora { path: String, message: String },

    #[error(
        "verify: {which} is not finite ({count} of {total} values are NaN or infinite, the first \
         at index {index}: {value}): the computation diverged; a NaN never passes a comparison"
    )]
    NonFinite {
        which: &'static str,
        index: usize,
        value: f32,
        count: usize,
        total: usize,
    },

    #[error(
        "host memory: the plan streams {blocks} block(s) whose weights take {} of host \
         memory, but only {} is available ({source_}); nothing was loaded. Make \
         more blocks resident (re-plan with more device memory or more devices), free host \
         memory, or set MOLD_HOST_MEMORY if this figure is wrong",
        .need.human(),
        .available.human()
    )]
    HostMemory {
        blocks: usize,
        need: mold_plan::ByteSize,
        available: mold_plan::ByteSize,
        source_: String,
    },

    /// `MOLD_RANK` / `MOLD_WORLD_SIZE` / `MOLD_MASTER_ADDR` are wrong or incomplete.
    #[error("multi-process launch: {0}")]
    Launch(String),

    /// Another process of a multi-process run failed, or cannot be reached.
    #[error("multi-process run: {0}")]
    Dist(String),

    #[error("{0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = ExecError> = std::result::Result<T, E>;
