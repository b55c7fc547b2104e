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

/// A byte-level BPE tokenizer's files as `tokenizer.json` wants them: `vocab.json`'s token
/// → id map (every id an integer) and the `merges.txt` beside it as `[a, b]` pairs
/// (`#version` and blank lines skipped). Each bad file is refused naming it and the line.
pub(crate) fn read_bpe_files(
    vocab: &Path,
) -> Result<(
    serde_json::Map<String, serde_json::Value>,
    Vec<serde_json::Value>,
)> {
    let bad = |path: &Path, message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(vocab).map_err(PipelineError::io(vocab))?;
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| bad(vocab, format!("not a JSON object of token ids: {e}")))?;
    if let Some((k, x)) = v.iter().find(|(_, x)| !x.is_u64()) {
        return Err(bad(
            vocab,
            format!("token {k:?} has id {x}, not an integer"),
        ));
    }
    let merges = vocab.with_file_name("merges.txt");
    let mtext = std::fs::read_to_string(&merges).map_err(PipelineError::io(&merges))?;
    let mut pairs = Vec::new();
    for (i, line) in mtext.lines().enumerate() {
        if line.starts_with("#version") || line.trim().is_empty() {
            continue;
        }
        match line.split(' ').collect::<Vec<_>>().as_slice() {
            [a, b] => pairs.push(serde_json::json!([a, b])),
            _ => {
                return Err(bad(
                    &merges,
                    format!(
                        "line {}: {line:?} is not a merge of two tokens `a b`",
                        i + 1
                    ),
                ))
            }
        }
    }
    Ok((v, pairs))
}
