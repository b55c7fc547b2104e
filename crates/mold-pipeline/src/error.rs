//! Typed errors; each names the thing at fault and says how to fix it.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(
        "weights directory {dir} lacks {}: {}; see \"Weights directory layout\" in the README \
         (`mold testdata flux-tiny-pipeline DIR` writes a complete tiny one)",
        if missing.len() == 1 { "a file" } else { "files" },
        missing.join(", ")
    )]
    MissingFiles { dir: String, missing: Vec<String> },

    #[error("{0}")]
    Size(String),

    #[error("{path}: {message}")]
    Config { path: String, message: String },

    #[error("{path}: not a usable tokenizer: {message}")]
    Tokenizer { path: String, message: String },

    #[error("{component}: {message}")]
    Component { component: String, message: String },

    #[error("plan: {0}")]
    Plan(String),

    /// A check before loading refused the run (the simulator says it cannot fit, the
    /// plan does not match its model or machine); the message says how to fix it.
    #[error("{0}")]
    Refused(String),

    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: cannot write the PNG: {message}")]
    Png { path: String, message: String },

    /// Boxed: exec's errors are large and this one is returned everywhere.
    #[error(transparent)]
    Exec(Box<mold_exec::ExecError>),

    #[error("{0}")]
    Candle(Box<candle_core::Error>),

    /// `--report` could not measure (what it was reading, then why).
    #[error("--report: {what}: {source}")]
    Report {
        what: &'static str,
        #[source]
        source: Box<mold_exec::ExecError>,
    },

    /// An output file is not mold's to replace ([`mold_files::Dest::check`]), or could
    /// not be written.
    #[error(transparent)]
    File(#[from] mold_files::FileError),

    /// The request's cancel flag was set (its client went away); nothing was produced.
    #[error("cancelled: the request was cancelled before it finished")]
    Cancelled,
}

impl From<mold_exec::ExecError> for PipelineError {
    fn from(e: mold_exec::ExecError) -> Self {
        PipelineError::Exec(Box::new(e))
    }
}

impl From<candle_core::Error> for PipelineError {
    fn from(e: candle_core::Error) -> Self {
        PipelineError::Candle(Box::new(e))
    }
}

impl PipelineError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PipelineError + '_ {
        move |source| PipelineError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
