//! Qwen-Image's text encoder: the language model of Qwen2.5-VL-7B on text prompts, as
//! diffusers' `QwenImagePipeline._get_qwen_prompt_embeds` runs it.
//!
//! - The prompt goes into the chat template [`PROMPT_TEMPLATE`], is tokenized (at most
//!   [`MAX_TOKENS`] + [`DROP_TOKENS`] tokens) and run through the decoder layers with a
//!   causal mask; the output is the last hidden state (after the final norm) less its
//!   first [`DROP_TOKENS`] positions (the system prompt and `<|im_start|>user\n`), at most
//!   [`MAX_SEQUENCE`] tokens: `(1, L, hidden)`.
//! - The model runs on mold's layers ([`super::lm::QwenLm`]: fused products and cuDNN's
//!   attention on GPUs); `MOLD_KERNELS=candle` runs [`CandleLm`] instead, the reference
//!   of candle's ops.
//! - Text-only positions are the same on Qwen2.5-VL's three rotary sections (time,
//!   height, width), so its multimodal rotary embedding is the ordinary one over
//!   `0..L`; the tables are computed in f32 (positions past 256 are not exact in bf16).
//! - The tokenizer is the repository's `tokenizer.json`, else its `vocab.json` and
//!   `merges.txt` (the published `tokenizer/` folder, a slow `Qwen2Tokenizer`) with the
//!   added tokens of `tokenizer_config.json` (or `added_tokens.json`), built as
//!   `transformers`' `Qwen2Converter` builds the fast tokenizer.
//! - Weights: `model.*` (Qwen2.5-VL as first published) or `model.language_model.*`
//!   (transformers ≥ 4.52); the vision tower and the LM head are not read.

use super::lm::QwenLm;
use crate::error::{PipelineError, Result};
use crate::text::read_bpe_files;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, RmsNorm, VarBuilder};
use mold_exec::Kernels;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use tokenizers::{Tokenizer, TruncationParams};

/// The chat template the pipeline puts each prompt into (`{}` is the prompt).
pub const PROMPT_TEMPLATE: &str = "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n";

/// Template tokens dropped from the front of the hidden states
/// (`prompt_template_encode_start_idx`).
pub const DROP_TOKENS: usize = 34;

/// The tokenizer's length limit past the dropped tokens (`tokenizer_max_length`).
pub const MAX_TOKENS: usize = 1024;

/// Text tokens the transformer gets at most (the pipeline's `max_sequence_length`).
pub const MAX_SEQUENCE: usize = 512;

/// Qwen2's pre-tokenization pattern (`transformers`' `Qwen2Converter`).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special tokens the template needs.
const TEMPLATE_SPECIALS: [&str; 2] = ["<|im_start|>", "<|im_end|>"];

/// The text encoder's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QwenTextFiles {
    pub config: PathBuf,
    /// One `.safetensors` file, or the shards an index names.
    pub weights: Vec<PathBuf>,
    /// `tokenizer.json`, or `vocab.json` (with `merges.txt` beside it).
    pub tokenizer: PathBuf,
}

/// The language model's hyper-parameters (Qwen2.5-VL's `config.json`: top level, or its
/// `text_config`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct QwenTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    1_000_000.0
}
fn default_act() -> String {
    "silu".into()
}

impl QwenTextConfig {
    /// Reads and checks `config.json`.
    pub fn read(path: &Path) -> Result<QwenTextConfig> {
        let bad = |message: String| PipelineError::Config {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(PipelineError::io(path))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        // transformers ≥ 4.52 nests the language model's fields in `text_config`.
        let lm = match v.get("text_config") {
            Some(t) if t.get("hidden_size").is_some() => t.clone(),
            _ => v.clone(),
        };
        let c: QwenTextConfig = serde_json::from_value(lm.clone())
            .map_err(|e| bad(format!("not a Qwen2.5-VL text config: {e}")))?;
        if c.hidden_act != "silu" {
            return Err(bad(format!(
                "hidden_act `{}`: Qwen2.5-VL's language model uses silu",
                c.hidden_act
            )));
        }
        let heads = c.num_attention_heads;
        if heads == 0
            || c.num_key_value_heads == 0
            || !heads.is_multiple_of(c.num_key_value_heads)
            || !c.hidden_size.is_multiple_of(heads)
            || !(c.hidden_size / heads).is_multiple_of(2)
        {
            return Err(bad(format!(
                "{heads} attention heads, {} key/value heads, hidden_size {}: the heads must divide hidden_size into an even head size, and the key/value heads the heads",
                c.num_key_value_heads, c.hidden_size
            )));
        }
        if c.vocab_size == 0 || c.num_hidden_layers == 0 || c.intermediate_size == 0 {
            return Err(bad(
                "vocab_size, num_hidden_layers and intermediate_size must be positive".into(),
            ));
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 0.0 && c.rms_norm_eps >= 0.0) {
            return Err(bad(format!(
                "rope_theta {} and rms_norm_eps {} must be positive",
                c.rope_theta, c.rms_norm_eps
            )));
        }
        // Multimodal rotary sections (pairs of the head's dimensions per axis) must cover
        // the head: text positions rotate every pair.
        let scaling = lm.get("rope_scaling").or_else(|| v.get("rope_scaling"));
        if let Some(sec) = scaling
            .and_then(|s| s.get("mrope_section"))
            .and_then(|s| s.as_array())
        {
            let sum: u64 = sec.iter().filter_map(|x| x.as_u64()).sum();
            if sum as usize != c.head_dim() / 2 {
                return Err(bad(format!(
                    "rope_scaling.mrope_section sums to {sum}, not half the head size ({})",
                    c.head_dim() / 2
                )));
            }
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// The prefix of the language model's tensors in `files`: `model` or
/// `model.language_model` (whichever holds `embed_tokens.weight`), checked against the
/// config's vocabulary and width.
pub(crate) fn lm_prefix(files: &[PathBuf], cfg: &QwenTextConfig) -> Result<&'static str> {
    for f in files {
        let h = mold_models::checkpoint::read_header(f).map_err(|e| PipelineError::Config {
            path: f.display().to_string(),
            message: e.to_string(),
        })?;
        for p in ["model", "model.language_model"] {
            if let Some(t) = h.tensors.get(&format!("{p}.embed_tokens.weight")) {
                let want = [cfg.vocab_size as u64, cfg.hidden_size as u64];
                if t.shape != want {
                    return Err(PipelineError::Config {
                        path: f.display().to_string(),
                        message: format!(
                            "`{p}.embed_tokens.weight` is {:?}, the config says {want:?} (vocab_size, hidden_size): use the config.json that goes with these weights",
                            t.shape
                        ),
                    });
                }
                return Ok(p);
            }
        }
    }
    Err(PipelineError::Component {
        component: "qwen2.5-vl".into(),
        message: format!(
            "{} hold no `model.embed_tokens.weight` or `model.language_model.embed_tokens.weight`: point --weights at Qwen-Image's repository (its text_encoder/ is Qwen2.5-VL)",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// The `tokenizer.json` of a Qwen2 byte-level BPE tokenizer from its `vocab.json`, the
/// `merges.txt` beside it and the added tokens of `tokenizer_config.json`
/// (`added_tokens_decoder`) or `added_tokens.json`, as `transformers`' `Qwen2Converter`
/// builds it: NFC; Qwen2's split pattern, then byte-level; BPE without unknown token;
/// nothing added around the ids.
pub fn qwen2_tokenizer_json(vocab: &Path) -> Result<String> {
    let bad = |path: &Path, message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message,
    };
    let (v, pairs) = read_bpe_files(vocab)?;
    // Added tokens: tokenizer_config.json's `added_tokens_decoder` (id → token), else
    // added_tokens.json (token → id).
    let mut added: Vec<(u64, String, bool)> = Vec::new();
    let tc = vocab.with_file_name("tokenizer_config.json");
    let at = vocab.with_file_name("added_tokens.json");
    if tc.is_file() {
        let t = std::fs::read_to_string(&tc).map_err(PipelineError::io(&tc))?;
        let j: serde_json::Value =
            serde_json::from_str(&t).map_err(|e| bad(&tc, format!("not JSON: {e}")))?;
        if let Some(m) = j.get("added_tokens_decoder").and_then(|m| m.as_object()) {
            for (id, tok) in m {
                let id: u64 = id.parse().map_err(|_| {
                    bad(
                        &tc,
                        format!("added_tokens_decoder: {id:?} is not a token id"),
                    )
                })?;
                let content = tok.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                    bad(
                        &tc,
                        format!("added_tokens_decoder.{id}: no `content` string"),
                    )
                })?;
                let special = tok.get("special").and_then(|s| s.as_bool()).unwrap_or(true);
                added.push((id, content.to_string(), special));
            }
        }
    }
    if added.is_empty() && at.is_file() {
        let t = std::fs::read_to_string(&at).map_err(PipelineError::io(&at))?;
        let m: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&t)
            .map_err(|e| bad(&at, format!("not a JSON object of token ids: {e}")))?;
        for (content, id) in m {
            let id = id
                .as_u64()
                .ok_or_else(|| bad(&at, format!("token {content:?}: id {id} is not an integer")))?;
            added.push((id, content, true));
        }
    }
    added.sort();
    for s in TEMPLATE_SPECIALS {
        if !added.iter().any(|(_, c, _)| c == s) && !v.contains_key(s) {
            return Err(bad(
                vocab,
                format!(
                    "no `{s}` token (in tokenizer_config.json's added_tokens_decoder, added_tokens.json or the vocabulary): Qwen-Image's prompt template needs <|im_start|> and <|im_end|>"
                ),
            ));
        }
    }
    let added_json: Vec<serde_json::Value> = added
        .iter()
        .map(|(id, content, special)| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let j = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_json,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "vocab": v, "merges": pairs}
    });
    Ok(j.to_string())
}

/// Loads the tokenizer (`tokenizer.json`, or `vocab.json` with its `merges.txt`:
/// [`qwen2_tokenizer_json`]), truncating at `MAX_TOKENS + DROP_TOKENS` tokens, and
/// checks it encodes the template.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let bad = |message: String| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message: message.replace('\n', " "),
    };
    let text = if path.file_name().is_some_and(|n| n == "vocab.json") {
        qwen2_tokenizer_json(path)?
    } else {
        std::fs::read_to_string(path).map_err(PipelineError::io(path))?
    };
    let mut tok: Tokenizer = text
        .parse()
        .map_err(|e: Box<dyn std::error::Error + Send + Sync>| bad(e.to_string()))?;
    for s in TEMPLATE_SPECIALS {
        if tok.token_to_id(s).is_none() {
            return Err(bad(format!(
                "no `{s}` token: Qwen-Image's prompt template needs <|im_start|> and <|im_end|>"
            )));
        }
    }
    tok.with_truncation(Some(TruncationParams {
        max_length: MAX_TOKENS + DROP_TOKENS,
        ..Default::default()
    }))
    .map_err(|e| bad(e.to_string()))?;
    tok.with_padding(None);
    // The template alone must leave a token past the dropped ones.
    let ids = crate::text::tokenize(&tok, path, &PROMPT_TEMPLATE.replace("{}", ""))?;
    if ids.len() <= DROP_TOKENS {
        return Err(bad(format!(
            "the prompt template is {} tokens, not more than the {DROP_TOKENS} the pipeline drops: this is not Qwen-Image's tokenizer",
            ids.len()
        )));
    }
    Ok(tok)
}

/// One decoder layer's weights, as the reference holds them.
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    norm1: RmsNorm,
    norm2: RmsNorm,
}

/// The language model of candle's ops, one product per weight, attention in f32: the
/// reference [`super::lm::QwenLm`] is tested against (`MOLD_KERNELS=candle`).
pub struct CandleLm {
    embed: candle_nn::Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    cfg: QwenTextConfig,
    device: Device,
    dtype: DType,
}

impl CandleLm {
    /// Loads the model from `vb` (rooted where `embed_tokens`, `layers` and `norm` live).
    pub fn new(vb: VarBuilder, cfg: &QwenTextConfig) -> candle_core::Result<CandleLm> {
        let (h, kv) = (cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim());
        let embed = candle_nn::embedding(cfg.vocab_size, h, vb.pp("embed_tokens"))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp("layers").pp(i);
            let a = l.pp("self_attn");
            let m = l.pp("mlp");
            let eps = cfg.rms_norm_eps;
            layers.push(Layer {
                q: candle_nn::linear(h, h, a.pp("q_proj"))?,
                k: candle_nn::linear(h, kv, a.pp("k_proj"))?,
                v: candle_nn::linear(h, kv, a.pp("v_proj"))?,
                o: candle_nn::linear_no_bias(h, h, a.pp("o_proj"))?,
                gate: candle_nn::linear_no_bias(h, cfg.intermediate_size, m.pp("gate_proj"))?,
                up: candle_nn::linear_no_bias(h, cfg.intermediate_size, m.pp("up_proj"))?,
                down: candle_nn::linear_no_bias(cfg.intermediate_size, h, m.pp("down_proj"))?,
                norm1: candle_nn::rms_norm(h, eps, l.pp("input_layernorm"))?,
                norm2: candle_nn::rms_norm(h, eps, l.pp("post_attention_layernorm"))?,
            });
        }
        let norm = candle_nn::rms_norm(h, cfg.rms_norm_eps, vb.pp("norm"))?;
        Ok(CandleLm {
            embed,
            layers,
            norm,
            cfg: cfg.clone(),
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }

    /// The last hidden state (after the final norm) of `ids`: `(1, len, hidden)`.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        let n = ids.len();
        let dev = &self.device;
        let (heads, kv_heads, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim(),
        );
        let (cos, sin) = rope_tables(n, hd, self.cfg.rope_theta, dev)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        // Causal mask, f32: 0 on and below the diagonal, -inf above.
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| (0..n).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, n, n), dev)?;
        let ids = Tensor::new(ids, dev)?.unsqueeze(0)?;
        let mut x = self.embed.forward(&ids)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for l in &self.layers {
            let h = l.norm1.forward(&x)?;
            let split = |t: Tensor, k: usize| -> candle_core::Result<Tensor> {
                t.reshape((1, n, k, hd))?.transpose(1, 2)?.contiguous()
            };
            let q = split(l.q.forward(&h)?, heads)?;
            let k = split(l.k.forward(&h)?, kv_heads)?;
            let v = split(l.v.forward(&h)?, kv_heads)?;
            let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?.to_dtype(DType::F32)?;
            let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?.to_dtype(DType::F32)?;
            let v = v.to_dtype(DType::F32)?;
            let rep = heads / kv_heads;
            let repeat = |t: Tensor| -> candle_core::Result<Tensor> {
                if rep == 1 {
                    return Ok(t);
                }
                // (1, kv, n, hd) → (1, kv, rep, n, hd) → (1, heads, n, hd): head j uses
                // key/value head j / rep.
                t.unsqueeze(2)?
                    .expand((1, kv_heads, rep, n, hd))?
                    .reshape((1, heads, n, hd))
            };
            let (k, v) = (repeat(k)?, repeat(v)?);
            let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let o = att
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((1, n, heads * hd))?
                .to_dtype(self.dtype)?;
            x = (x + l.o.forward(&o)?)?;
            let h = l.norm2.forward(&x)?;
            let m = (candle_nn::ops::silu(&l.gate.forward(&h)?)? * l.up.forward(&h)?)?;
            x = (x + l.down.forward(&m)?)?;
        }
        Ok(self.norm.forward(&x)?)
    }
}

/// The language model a run uses.
enum Net {
    Mold(QwenLm),
    Candle(CandleLm),
}

/// Qwen2.5-VL's language model with its tokenizer, on one device.
pub struct QwenText {
    cfg: QwenTextConfig,
    net: Net,
    tok: Tokenizer,
    tok_path: PathBuf,
    pub weight_bytes: u64,
}

impl QwenText {
    /// The config, then the tokenizer, then the weights (names checked from the headers
    /// first), on mold's layers or, with `kernels` `candle`, candle's ([`CandleLm`]).
    pub fn load(
        files: &QwenTextFiles,
        dtype: DType,
        dev: &Device,
        kernels: Kernels,
    ) -> Result<QwenText> {
        let cfg = QwenTextConfig::read(&files.config)?;
        let tok = load_tokenizer(&files.tokenizer)?;
        let prefix = lm_prefix(&files.weights, &cfg)?;
        let layers_prefix = format!("{prefix}.");
        let weight_bytes = crate::text::weight_bytes(&files.weights, dtype, |n| {
            n.starts_with(&layers_prefix) && !n.starts_with("model.visual")
        })?;
        // SAFETY: the files are mapped read-only and must not change while loading.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, dev)? };
        let vb = vb.pp(prefix);
        let net = if kernels == Kernels::Candle {
            CandleLm::new(vb, &cfg).map(Net::Candle)
        } else {
            QwenLm::new(vb, &cfg, kernels).map(Net::Mold)
        };
        let net = net.map_err(|e| PipelineError::Component {
            component: "qwen2.5-vl".into(),
            message: format!(
                "cannot load the language model from {}: {e}",
                files
                    .weights
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })?;
        Ok(QwenText {
            cfg,
            net,
            tok,
            tok_path: files.tokenizer.clone(),
            weight_bytes,
        })
    }

    pub fn config(&self) -> &QwenTextConfig {
        &self.cfg
    }

    /// The token ids of `prompt` in the template.
    pub fn token_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        let text = PROMPT_TEMPLATE.replace("{}", prompt);
        let ids = crate::text::tokenize(&self.tok, &self.tok_path, &text)?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            return Err(PipelineError::Tokenizer {
                path: self.tok_path.display().to_string(),
                message: format!(
                    "token id {bad} is past the model's vocabulary ({}): use the tokenizer that goes with this text encoder",
                    self.cfg.vocab_size
                ),
            });
        }
        Ok(ids)
    }

    /// The conditioning for `prompt`: `(1, L, hidden)` in the model's dtype on its device,
    /// `L` ≤ [`MAX_SEQUENCE`].
    pub fn encode(&self, prompt: &str) -> Result<Tensor> {
        let ids = self.token_ids(prompt)?;
        let hidden = self.forward(&ids)?;
        let n = hidden.dim(1)?;
        let keep = n
            .checked_sub(DROP_TOKENS)
            .filter(|k| *k > 0)
            .ok_or_else(|| PipelineError::Tokenizer {
                path: self.tok_path.display().to_string(),
                message: format!(
                    "the prompt in its template is {n} tokens, not more than the {DROP_TOKENS} the pipeline drops: this is not Qwen-Image's tokenizer"
                ),
            })?
            .min(MAX_SEQUENCE);
        Ok(hidden.narrow(1, DROP_TOKENS, keep)?.contiguous()?)
    }

    /// The last hidden state (after the final norm) of `ids`: `(1, len, hidden)`.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        match &self.net {
            Net::Mold(m) => Ok(m.forward(ids)?),
            Net::Candle(c) => c.forward(ids),
        }
    }
}

/// Rotary tables `(n, head_dim / 2)` for positions `0..n`, f32 (HF's `inv_freq` in f32).
pub(crate) fn rope_tables(
    n: usize,
    hd: usize,
    theta: f64,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..hd)
        .step_by(2)
        .map(|i| 1.0 / (theta as f32).powf(i as f32 / hd as f32))
        .collect();
    let half = inv.len();
    let inv = Tensor::from_vec(inv, (1, half), dev)?;
    let pos = Tensor::arange(0u32, n as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let f = pos.broadcast_mul(&inv)?;
    Ok((f.cos()?, f.sin()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qwen::testdata::{write_tokenizer, TextSize};

    fn tiny_files(name: &str) -> (QwenTextFiles, TextSize) {
        tiny_files_of(name, TextSize::tiny(32))
    }

    fn tiny_files_of(name: &str, size: TextSize) -> (QwenTextFiles, TextSize) {
        let dir =
            std::env::temp_dir().join(format!("mold-qwen-text-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let te = dir.join("text_encoder");
        std::fs::create_dir_all(&te).unwrap();
        let w = te.join("model.safetensors");
        mold_exec::write_safetensors(&w, &size.tensor_specs(), 3, DType::F32).unwrap();
        let config = te.join("config.json");
        std::fs::write(&config, size.config(DType::F32).to_string()).unwrap();
        write_tokenizer(&dir.join("tokenizer")).unwrap();
        (
            QwenTextFiles {
                config,
                weights: vec![w],
                tokenizer: dir.join("tokenizer/vocab.json"),
            },
            size,
        )
    }

    /// The language model, on mold's layers and as the candle reference, equals
    /// candle-transformers' Qwen2 (the same decoder: Qwen2.5-VL's rotary sections coincide
    /// on text) on the same weights and tokens, with grouped key/value heads (two query
    /// heads each) and without (one), over the prompt's tokens and shorter runs of them;
    /// the conditioning is the hidden states less the template's first 34 tokens.
    #[test]
    fn matches_candle_qwen2_and_drops_the_template_prefix() {
        let mut alike = TextSize::tiny(32);
        alike.kv_heads = alike.heads;
        for (name, size) in [("grouped", TextSize::tiny(32)), ("alike", alike)] {
            let (files, size) = tiny_files_of(name, size);
            let dev = Device::Cpu;
            let cfg = candle_transformers::models::qwen2::Config {
                vocab_size: size.vocab,
                hidden_size: size.hidden,
                intermediate_size: size.intermediate,
                num_hidden_layers: size.layers,
                num_attention_heads: size.heads,
                num_key_value_heads: size.kv_heads,
                max_position_embeddings: 4096,
                sliding_window: 32768,
                max_window_layers: size.layers,
                tie_word_embeddings: false,
                rope_theta: 1_000_000.0,
                rms_norm_eps: 1e-6,
                use_sliding_window: false,
                hidden_act: candle_nn::Activation::Silu,
            };
            let vb = unsafe {
                VarBuilder::from_mmaped_safetensors(&files.weights, DType::F32, &dev).unwrap()
            };
            let mut reference = candle_transformers::models::qwen2::Model::new(&cfg, vb).unwrap();
            for kernels in [Kernels::Auto, Kernels::Candle] {
                let enc = QwenText::load(&files, DType::F32, &dev, kernels).unwrap();
                assert_eq!(
                    matches!(enc.net, Net::Candle(_)),
                    kernels == Kernels::Candle
                );
                let ids = enc.token_ids("a red fox in the snow").unwrap();
                for n in [1, 5, ids.len()] {
                    let ids = &ids[..n];
                    let ours = enc.forward(ids).unwrap();
                    let t = Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
                    reference.clear_kv_cache();
                    let theirs = reference.forward(&t, 0, None).unwrap();
                    let err = mold_exec::max_relative_error(&ours, &theirs).unwrap();
                    assert!(err < 1e-5, "{name} {kernels:?} {n} tokens: {err}");
                }
                let c = enc.encode("a red fox in the snow").unwrap();
                assert_eq!(c.dims(), [1, ids.len() - DROP_TOKENS, size.hidden]);
                let ours = enc.forward(&ids).unwrap();
                let tail = ours
                    .narrow(1, DROP_TOKENS, ids.len() - DROP_TOKENS)
                    .unwrap();
                assert_eq!(
                    mold_exec::digest(&c).unwrap(),
                    mold_exec::digest(&tail).unwrap()
                );
            }
        }
    }

    /// The template's special tokens are single ids, and the prompt survives the
    /// byte-level round trip.
    #[test]
    fn tokenizer_from_vocab_and_merges() {
        let (files, _) = tiny_files("tok");
        let tok = load_tokenizer(&files.tokenizer).unwrap();
        let ids = crate::text::tokenize(
            &tok,
            &files.tokenizer,
            &PROMPT_TEMPLATE.replace("{}", "ein Fuchs, 3 Äpfel"),
        )
        .unwrap();
        let start = tok.token_to_id("<|im_start|>").unwrap();
        let end = tok.token_to_id("<|im_end|>").unwrap();
        assert_eq!(ids[0], start);
        assert_eq!(ids.iter().filter(|&&i| i == start).count(), 3);
        assert_eq!(ids.iter().filter(|&&i| i == end).count(), 2);
        let text = tok.decode(&ids, false).unwrap();
        assert!(
            text.contains("user\nein Fuchs, 3 Äpfel<|im_end|>"),
            "{text}"
        );
        // Merges are used: fewer ids than bytes.
        assert!(ids.len() < PROMPT_TEMPLATE.len());
        let e = QwenTextConfig::read(&files.tokenizer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a Qwen2.5-VL text config"), "{e}");
    }
}
