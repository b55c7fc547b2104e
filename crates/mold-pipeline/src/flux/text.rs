//! The text encoders: T5 (per-token conditioning) and CLIP-L (the pooled vector), with
//! their tokenizers, as FLUX uses them.
//!
//! - T5: `max_length` tokens (512 dev, 256 schnell), truncated, padded with `<pad>`,
//!   `</s>` appended by the tokenizer; the encoder attends over the padding (BFL passes no
//!   attention mask). Output `(1, max_length, d_model)`.
//! - CLIP: 77 tokens (the model's positions), `<|startoftext|> … <|endoftext|>`, padded
//!   with `<|endoftext|>`; the pooled output is the final-layer-normed hidden state at the
//!   first end-of-text token (the first maximum id, as HF's `CLIPTextModel` pools).
//!   Output `(1, hidden)`.

use crate::encoders::clip::ClipText;
use crate::encoders::t5::T5Encoder;
use crate::error::{PipelineError, Result};
use crate::layout::EncoderFiles;
use crate::text::{panic_text, read_bpe_files, tokenize, weight_bytes};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::clip::text_model::{
    Activation, ClipTextConfig, ClipTextTransformer,
};
use candle_transformers::models::t5;
use mold_exec::weights_copy::WeightsFrom;
use mold_exec::Kernels;
use std::path::Path;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(PipelineError::io(path))?;
    serde_json::from_str(&text).map_err(|e| PipelineError::Config {
        path: path.display().to_string(),
        message: format!("not JSON: {e}"),
    })
}

/// CLIP's pre-tokenization pattern (HF's `CLIPConverter`; the slow tokenizer's `pat`
/// less its special tokens, which the tokenizer matches before).
const CLIP_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// The `tokenizer.json` of CLIP's byte-level BPE tokenizer from its `vocab.json` and the
/// `merges.txt` beside it (the Hugging Face repositories of FLUX ship only these), built
/// as `transformers`' `CLIPConverter` builds it from the slow `CLIPTokenizer`: NFC,
/// whitespace runs to one space, lower case; CLIP's split pattern then byte-level; BPE
/// with `</w>` ending each word; `<|startoftext|> … <|endoftext|>` around the ids.
pub fn clip_bpe_tokenizer_json(vocab: &Path) -> Result<String> {
    let bad = |path: &Path, message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message,
    };
    let (v, pairs) = read_bpe_files(vocab)?;
    let id = |t: &str| {
        v.get(t).and_then(|x| x.as_u64()).ok_or_else(|| {
            bad(
                vocab,
                format!("no `{t}` token: a CLIP vocabulary has <|startoftext|> and <|endoftext|>"),
            )
        })
    };
    let (bos, eos) = (id("<|startoftext|>")?, id("<|endoftext|>")?);
    let special = |id: u64, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": true, "special": true})
    };
    let j = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(bos, "<|startoftext|>"), special(eos, "<|endoftext|>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"},
            {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
            {"type": "Lowercase"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": CLIP_PATTERN}, "behavior": "Removed", "invert": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": {"type": "RobertaProcessing", "sep": ["<|endoftext|>", eos],
            "cls": ["<|startoftext|>", bos], "trim_offsets": false, "add_prefix_space": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<|endoftext|>",
            "continuing_subword_prefix": "", "end_of_word_suffix": "</w>", "fuse_unk": false,
            "byte_fallback": false, "vocab": v, "merges": pairs}
    });
    Ok(j.to_string())
}

/// Loads `tokenizer.json` (or CLIP's `vocab.json` with its `merges.txt`:
/// [`clip_bpe_tokenizer_json`]) set to pad and truncate to exactly `len` tokens,
/// padding with the first of `pad_tokens` the vocabulary has (else id 0).
pub fn load_tokenizer(path: &Path, len: usize, pad_tokens: &[&str]) -> Result<Tokenizer> {
    let bad = |message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message: message.replace('\n', " "),
    };
    let text = if path.file_name().is_some_and(|n| n == "vocab.json") {
        clip_bpe_tokenizer_json(path)?
    } else {
        std::fs::read_to_string(path).map_err(PipelineError::io(path))?
    };
    // The tokenizers crate can panic while it reads a malformed file (a decoder whose
    // fields do not deserialise, found by the fuzz test): a refusal naming the file.
    let parsed =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| text.parse::<Tokenizer>()))
            .map_err(|p| {
                let why = panic_text(p.as_ref());
                bad(diagnose_tokenizer(&text).unwrap_or_else(|| {
                    format!("reading it failed inside the tokenizers crate ({why})")
                }))
            })?;
    let mut tok: Tokenizer = parsed.map_err(|e: Box<dyn std::error::Error + Send + Sync>| {
        bad(diagnose_tokenizer(&text).unwrap_or_else(|| e.to_string()))
    })?;
    let (pad_token, pad_id) = pad_tokens
        .iter()
        .find_map(|t| tok.token_to_id(t).map(|id| (t.to_string(), id)))
        .unwrap_or_else(|| (tok.id_to_token(0).unwrap_or_default(), 0));
    tok.with_truncation(Some(TruncationParams {
        max_length: len,
        ..Default::default()
    }))
    .map_err(|e| bad(e.to_string()))?;
    tok.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::Fixed(len),
        pad_id,
        pad_token,
        ..Default::default()
    }));
    // A tokenizer that loads may still fail (or panic, inside the tokenizers crate: a
    // post-processor template naming a special token it does not define) when it
    // encodes: try it now, before any weight loads.
    tokenize(&tok, path, "a")?;
    Ok(tok)
}

/// Why a `tokenizer.json` the tokenizers crate refused does not load, naming the
/// top-level field at fault (`model`, `pre_tokenizer`, …), each tried on its own with
/// the type the tokenizers crate reads it as; `None` when no one field is to blame (the
/// crate's own message, with its line and column, then stands). One line.
fn diagnose_tokenizer(text: &str) -> Option<String> {
    use serde::de::DeserializeOwned;
    use tokenizers::{
        DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    };
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let Some(map) = v.as_object() else {
        return Some(
            "not a JSON object: a tokenizer.json is an object with a `model` (WordLevel, BPE, WordPiece, Unigram)"
                .into(),
        );
    };
    if !map.contains_key("model") {
        return Some(
            "model: missing: a tokenizer.json names its model (WordLevel, BPE, WordPiece, Unigram)"
                .into(),
        );
    }
    fn field<T: DeserializeOwned>(
        map: &serde_json::Map<String, serde_json::Value>,
        key: &str,
    ) -> Option<String> {
        let v = map.get(key)?.clone();
        serde_json::from_value::<T>(v)
            .err()
            .map(|e| format!("{key}: {e}").replace('\n', " "))
    }
    if let Some(v) = map.get("version") {
        if v.as_str() != Some("1.0") {
            return Some(format!(
                "version: {v} is not \"1.0\", the only tokenizer.json version"
            ));
        }
    }
    field::<ModelWrapper>(map, "model")
        .or_else(|| field::<Option<NormalizerWrapper>>(map, "normalizer"))
        .or_else(|| field::<Option<PreTokenizerWrapper>>(map, "pre_tokenizer"))
        .or_else(|| field::<Option<PostProcessorWrapper>>(map, "post_processor"))
        .or_else(|| field::<Option<DecoderWrapper>>(map, "decoder"))
        .or_else(|| field::<Option<TruncationParams>>(map, "truncation"))
        .or_else(|| field::<Option<PaddingParams>>(map, "padding"))
        .or_else(|| {
            map.get("added_tokens")
                .filter(|t| !t.is_array())
                .map(|t| format!("added_tokens: {t} is not a list of tokens"))
        })
}

fn var_builder(
    files: &[std::path::PathBuf],
    dtype: DType,
    dev: &Device,
    from: &WeightsFrom,
) -> Result<VarBuilder<'static>> {
    Ok(mold_exec::weights_copy::var_builder(
        files, dtype, dev, from,
    )?)
}

/// T5's config, read before loading.
pub fn t5_config(files: &EncoderFiles) -> Result<t5::Config> {
    let v = read_json(&files.config)?;
    serde_json::from_value(v).map_err(|e| PipelineError::Config {
        path: files.config.display().to_string(),
        message: format!("not a T5 config: {e}"),
    })
}

/// T5's encoder network: mold's ([`crate::encoders::t5`]), or candle-transformers' under
/// `MOLD_KERNELS=candle` (the reference).
pub enum T5Net {
    Mold(T5Encoder),
    Candle(t5::T5EncoderModel),
}

impl T5Net {
    /// Built from `vb` (rooted where `shared.weight` and `encoder.` live).
    pub fn new(vb: VarBuilder, cfg: &t5::Config, kernels: Kernels) -> candle_core::Result<T5Net> {
        if kernels == Kernels::Candle {
            return Ok(T5Net::Candle(t5::T5EncoderModel::load(vb, cfg)?));
        }
        if let Err(why) = crate::encoders::t5::supported(cfg) {
            candle_core::bail!("{why}");
        }
        Ok(T5Net::Mold(T5Encoder::new(vb, cfg, kernels)?))
    }

    /// `(1, len, d_model)` for `ids` `(1, len)`.
    pub fn forward(&mut self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            T5Net::Mold(m) => m.forward(ids),
            T5Net::Candle(m) => m.forward(ids),
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            T5Net::Mold(m) => m.device(),
            T5Net::Candle(m) => m.device(),
        }
    }
}

/// The T5 encoder with its tokenizer.
pub struct T5 {
    model: T5Net,
    tok: Tokenizer,
    tok_path: std::path::PathBuf,
    pub weight_bytes: u64,
}

impl T5 {
    pub fn load(
        files: &EncoderFiles,
        len: usize,
        dtype: DType,
        dev: &Device,
        kernels: Kernels,
        from: &WeightsFrom,
    ) -> Result<T5> {
        let cfg = t5_config(files)?;
        let tok = load_tokenizer(&files.tokenizer, len, &["<pad>"])?;
        let weight_bytes = weight_bytes(&files.weights, dtype, |n| {
            n.starts_with("shared.") || n.starts_with("encoder.")
        })?;
        let vb = var_builder(&files.weights, dtype, dev, from)?;
        let model = T5Net::new(vb, &cfg, kernels).map_err(|e| PipelineError::Component {
            component: "t5".into(),
            message: format!("cannot load {:?}: {e}", files.weights),
        })?;
        Ok(T5 {
            model,
            tok,
            tok_path: files.tokenizer.clone(),
            weight_bytes,
        })
    }

    /// `(1, len, d_model)` in the model's dtype, on its device.
    pub fn encode(&mut self, prompt: &str) -> Result<Tensor> {
        let ids = tokenize(&self.tok, &self.tok_path, prompt)?;
        let ids = Tensor::new(ids.as_slice(), self.model.device())?.unsqueeze(0)?;
        Ok(self.model.forward(&ids)?)
    }
}

/// CLIP's text config from an HF `config.json` (`CLIPTextModel`, or a `CLIPModel` one
/// with a `text_config`).
pub fn clip_config(files: &EncoderFiles) -> Result<ClipTextConfig> {
    clip_config_from(read_json(&files.config)?, &files.config)
}

/// [`clip_config`] of a parsed `config.json` (`path` names it in errors).
pub fn clip_config_from(v: serde_json::Value, path: &Path) -> Result<ClipTextConfig> {
    let v = v.get("text_config").cloned().unwrap_or(v);
    let bad = |m: String| PipelineError::Config {
        path: path.display().to_string(),
        message: m,
    };
    let get = |k: &str| -> Result<usize> {
        v.get(k)
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .ok_or_else(|| bad(format!("not a CLIP text config: no integer `{k}`")))
    };
    match v.get("hidden_act").and_then(|a| a.as_str()) {
        None | Some("quick_gelu") => {}
        Some(a) => {
            return Err(bad(format!(
                "hidden_act `{a}`: the CLIP text model here supports quick_gelu (CLIP-L)"
            )))
        }
    }
    let hidden = get("hidden_size")?;
    Ok(ClipTextConfig {
        vocab_size: get("vocab_size")?,
        embed_dim: hidden,
        activation: Activation::QuickGelu,
        intermediate_size: get("intermediate_size")?,
        max_position_embeddings: get("max_position_embeddings")?,
        pad_with: None,
        num_hidden_layers: get("num_hidden_layers")?,
        num_attention_heads: get("num_attention_heads")?,
        projection_dim: v
            .get("projection_dim")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(hidden),
    })
}

/// CLIP's text network: mold's ([`crate::encoders::clip`]), or candle-transformers' under
/// `MOLD_KERNELS=candle` (the reference).
pub enum ClipNet {
    Mold(ClipText),
    Candle(ClipTextTransformer),
}

impl ClipNet {
    /// Built from `vb` rooted at `text_model`.
    pub fn new(
        vb: VarBuilder,
        cfg: &ClipTextConfig,
        kernels: Kernels,
    ) -> candle_core::Result<ClipNet> {
        Ok(if kernels == Kernels::Candle {
            ClipNet::Candle(ClipTextTransformer::new(vb, cfg)?)
        } else {
            ClipNet::Mold(ClipText::new(vb, cfg, kernels)?)
        })
    }

    /// The final-layer-normed hidden states `(1, len, hidden)` for `ids` `(1, len)`.
    pub fn forward(&mut self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            ClipNet::Mold(m) => m.forward(ids),
            ClipNet::Candle(m) => m.forward_with_mask(ids, usize::MAX),
        }
    }
}

/// The CLIP text model with its tokenizer.
pub struct Clip {
    model: ClipNet,
    tok: Tokenizer,
    tok_path: std::path::PathBuf,
    device: Device,
    pub weight_bytes: u64,
}

impl Clip {
    pub fn load(
        files: &EncoderFiles,
        dtype: DType,
        dev: &Device,
        kernels: Kernels,
        from: &WeightsFrom,
    ) -> Result<Clip> {
        let cfg = clip_config(files)?;
        let tok = load_tokenizer(
            &files.tokenizer,
            cfg.max_position_embeddings,
            &["<|endoftext|>", "<pad>"],
        )?;
        let weight_bytes = weight_bytes(&files.weights, dtype, |n| {
            n.starts_with("text_model.") && !n.ends_with("position_ids")
        })?;
        let vb = var_builder(&files.weights, dtype, dev, from)?;
        let model = ClipNet::new(vb.pp("text_model"), &cfg, kernels).map_err(|e| {
            PipelineError::Component {
                component: "clip".into(),
                message: format!("cannot load {:?}: {e}", files.weights),
            }
        })?;
        Ok(Clip {
            model,
            tok,
            tok_path: files.tokenizer.clone(),
            device: dev.clone(),
            weight_bytes,
        })
    }

    /// The pooled vector `(1, hidden)` in the model's dtype, on its device.
    pub fn encode(&mut self, prompt: &str) -> Result<Tensor> {
        let ids = tokenize(&self.tok, &self.tok_path, prompt)?;
        // HF pools at `input_ids.argmax(-1)`: the first end-of-text token, the largest id.
        let max = ids.iter().copied().max().unwrap_or(0);
        let pos = ids.iter().position(|&i| i == max).unwrap_or(0);
        let ids = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
        let hidden = self.model.forward(&ids)?;
        Ok(hidden.i((.., pos))?)
    }
}
