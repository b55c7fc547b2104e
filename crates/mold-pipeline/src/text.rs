//! What every family's encoders share (FLUX's T5 and CLIP in [`crate::flux::text`],
//! Qwen-Image's Qwen2.5-VL in [`crate::qwen::text`]): tokenizing with the tokenizers
//! crate's panics caught, and the bytes of a component's weights from their headers.

use crate::error::{PipelineError, Result};
use candle_core::DType;
use std::path::Path;
use tokenizers::Tokenizer;

/// A caught panic's message.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Token ids of `prompt`, exactly the tokenizer's fixed length.
/// A panic inside the tokenizers crate (on a malformed file) is an error naming the file.
pub fn tokenize(tok: &Tokenizer, path: &Path, prompt: &str) -> Result<Vec<u32>> {
    let bad = |message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message: message.replace('\n', " "),
    };
    let enc = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tok.encode(prompt, true)))
        .map_err(|p| {
            let why = panic_text(p.as_ref());
            bad(format!(
                "encoding failed inside the tokenizers crate ({why}): check post_processor's special tokens"
            ))
        })?
        .map_err(|e| bad(e.to_string()))?;
    Ok(enc.get_ids().to_vec())
}

/// Sum of the bytes the tensors named by `keep` take in `dtype`, from the headers.
pub(crate) fn weight_bytes(
    files: &[std::path::PathBuf],
    dtype: DType,
    keep: impl Fn(&str) -> bool,
) -> Result<u64> {
    let mut n = 0u64;
    for f in files {
        let h = mold_models::checkpoint::read_header(f).map_err(|e| PipelineError::Config {
            path: f.display().to_string(),
            message: e.to_string(),
        })?;
        for (name, t) in h.tensors {
            if keep(&name) {
                let elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                n = elems
                    .and_then(|e| e.checked_mul(dtype.size_in_bytes() as u64))
                    .and_then(|b| n.checked_add(b))
                    .ok_or_else(|| PipelineError::Config {
                        path: f.display().to_string(),
                        message: format!("tensor `{name}`: its size overflows"),
                    })?;
            }
        }
    }
    Ok(n)
}
