//! Pipeline weights directories with random weights: T5, CLIP and VAE (with configs and
//! tokenizers) and the transformer, either tiny (shaped for `FluxConfig::flux_tiny`, so
//! CI runs the whole pipeline in seconds) or full size (for GPU benchmarks).
//!
//! Tensor names and shapes come from candle-transformers' own loaders (each model is
//! built once over a recording backend that allocates nothing), so the files load
//! exactly as real ones do. Values depend only on the seed and the tensor name.

pub mod hf;

use crate::error::{PipelineError, Result};
use crate::flux::vae::AeConfig;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::clip::text_model::ClipTextTransformer;
use candle_transformers::models::flux::autoencoder::Decoder;
use candle_transformers::models::t5;
use mold_exec::FluxConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::normalizers::Lowercase;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

/// Words of the tiny tokenizers' vocabulary (after the special tokens).
const WORDS: &[&str] = &[
    "a", "an", "the", "of", "in", "on", "with", "and", "at", "red", "blue", "green", "white",
    "black", "golden", "fox", "cat", "dog", "bird", "tree", "house", "mountain", "river", "snow",
    "rain", "sun", "moon", "night", "forest", "city", "photo", "painting", "portrait", "sitting",
    "running", "small", "big", "old", "young", "light", "dark", ".", ",", "!",
];

/// Vocabulary size of the tiny encoders' embeddings (the tokenizers use fewer ids).
pub const TINY_VOCAB: usize = 1000;

/// Every file of test data is written through a temporary file renamed over its path
/// ([`mold_files::write_with`]): never through a symlink there, never half a file.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    mold_files::write_bytes(path, bytes).map_err(PipelineError::io(path))
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    write_file(
        path,
        serde_json::to_string_pretty(v).expect("json").as_bytes(),
    )
}

fn tok_err(path: &Path) -> impl Fn(tokenizers::Error) -> PipelineError + '_ {
    move |e| PipelineError::Tokenizer {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// A word-level tokenizer over [`WORDS`] with `specials` first (ids 0..), then the words,
/// then `last` (the highest id), and a template adding `template`'s specials.
fn write_tokenizer(
    path: &Path,
    specials: &[&str],
    last: Option<&str>,
    unk: &str,
    single: &str,
    template_tokens: &[&str],
) -> Result<()> {
    let mut vocab: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    vocab.extend(WORDS.iter().map(|w| w.to_string()));
    vocab.extend(last.map(|s| s.to_string()));
    let ids: Vec<(String, u32)> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), i as u32))
        .collect();
    let id = |t: &str| {
        ids.iter()
            .find(|(w, _)| w == t)
            .map(|(_, i)| *i)
            .expect("special")
    };
    let model = WordLevel::builder()
        .vocab(ids.iter().cloned().collect())
        .unk_token(unk.to_string())
        .build()
        .map_err(tok_err(path))?;
    let post = TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| PipelineError::Tokenizer {
            path: path.display().to_string(),
            message: e,
        })?
        .special_tokens(
            template_tokens
                .iter()
                .map(|t| (t.to_string(), id(t)))
                .collect::<Vec<_>>(),
        )
        .build()
        .map_err(|e| PipelineError::Tokenizer {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    let mut tok = Tokenizer::new(model);
    tok.with_normalizer(Some(Lowercase))
        .map_err(tok_err(path))?;
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.with_post_processor(Some(post));
    let all_special: Vec<AddedToken> = specials
        .iter()
        .chain(last.iter())
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tok.add_special_tokens(all_special).map_err(tok_err(path))?;
    let text = tok.to_string(true).map_err(tok_err(path))?;
    write_file(path, text.as_bytes())?;
    // Prove it loads.
    Tokenizer::from_file(path).map_err(tok_err(path))?;
    Ok(())
}

/// The tiny T5 config: d_model = `context_in_dim`.
pub fn tiny_t5_config(flux: &FluxConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "vocab_size": TINY_VOCAB,
        "d_model": flux.context_in_dim,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-6,
        "initializer_factor": 1.0,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": false,
        "is_encoder_decoder": true,
        "use_cache": true,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0
    })
}

/// The tiny CLIP text config: hidden = projection = `vec_in_dim`.
pub fn tiny_clip_config(flux: &FluxConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["CLIPTextModel"],
        "model_type": "clip_text_model",
        "vocab_size": TINY_VOCAB,
        "hidden_size": flux.vec_in_dim,
        "projection_dim": flux.vec_in_dim,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 77,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5
    })
}

/// What a test pipeline directory holds.
struct PipelineSpec {
    flux: FluxConfig,
    dtype: DType,
    t5: serde_json::Value,
    clip: serde_json::Value,
    ae: AeConfig,
    /// Write `ae.json` (an autoencoder shaped unlike FLUX's needs it).
    ae_json: bool,
    /// Shard the transformer into files of at most this many bytes.
    shard_bytes: Option<u64>,
}

/// Writes a pipeline directory (the layout of [`crate::WeightsLayout`]) with random
/// weights: the transformer, T5 and CLIP (configs, weights, word-level tokenizers over a
/// small vocabulary whose ids are valid for the real ones) and the autoencoder. Tensor
/// names and shapes come from candle-transformers' own loaders ([`list_tensors`]), so
/// the files load exactly as real ones do; values depend only on the seed and the name.
fn write_pipeline(dir: &Path, seed: u64, spec: &PipelineSpec) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for d in [dir.to_path_buf(), dir.join("t5"), dir.join("clip")] {
        std::fs::create_dir_all(&d).map_err(PipelineError::io(&d))?;
    }
    written.push(match spec.shard_bytes {
        Some(max) => mold_exec::write_testdata_sharded(&spec.flux, dir, seed, spec.dtype, max)?,
        None => mold_exec::write_testdata(&spec.flux, dir, seed, spec.dtype)?,
    });

    // T5 encoder (HF T5EncoderModel names: shared.weight, encoder.block.N...).
    let t5_dir = dir.join("t5");
    let files = crate::layout::EncoderFiles {
        config: t5_dir.join("config.json"),
        weights: vec![t5_dir.join("model.safetensors")],
        tokenizer: t5_dir.join("tokenizer.json"),
    };
    write_json(&files.config, &spec.t5)?;
    let cfg = crate::flux::text::t5_config(&files)?;
    let specs = list_tensors(
        |n| {
            if n == "encoder.embed_tokens.weight" {
                "shared.weight".into()
            } else {
                n.to_string()
            }
        },
        |vb| t5::T5EncoderModel::load(vb, &cfg).map(|_| ()),
    )?;
    mold_exec::write_safetensors(&files.weights[0], &specs, seed ^ 0x75, spec.dtype)?;
    write_tokenizer(
        &files.tokenizer,
        &["<pad>", "</s>", "<unk>"],
        None,
        "<unk>",
        "$A </s>",
        &["</s>"],
    )?;
    written.extend([files.weights[0].clone(), files.config, files.tokenizer]);

    // CLIP text model (HF CLIPTextModel names: text_model.*).
    let clip_dir = dir.join("clip");
    let files = crate::layout::EncoderFiles {
        config: clip_dir.join("config.json"),
        weights: vec![clip_dir.join("model.safetensors")],
        tokenizer: clip_dir.join("tokenizer.json"),
    };
    write_json(&files.config, &spec.clip)?;
    let ccfg = crate::flux::text::clip_config(&files)?;
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| ClipTextTransformer::new(vb.pp("text_model"), &ccfg).map(|_| ()),
    )?;
    mold_exec::write_safetensors(&files.weights[0], &specs, seed ^ 0xc1, spec.dtype)?;
    // End-of-text is the highest id, as in CLIP's vocabulary: pooling finds it by argmax.
    write_tokenizer(
        &files.tokenizer,
        &["<|startoftext|>", "<unk>"],
        Some("<|endoftext|>"),
        "<unk>",
        "<|startoftext|> $A <|endoftext|>",
        &["<|startoftext|>", "<|endoftext|>"],
    )?;
    written.extend([files.weights[0].clone(), files.config, files.tokenizer]);

    // Autoencoder: the decoder's tensors under `decoder.` (as in BFL's ae.safetensors).
    let cc = spec.ae.to_candle();
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| Decoder::new(&cc, vb.pp("decoder")).map(|_| ()),
    )?;
    let p = dir.join("ae.safetensors");
    mold_exec::write_safetensors(&p, &specs, seed ^ 0xae, spec.dtype)?;
    written.push(p);
    if spec.ae_json {
        let p = dir.join(crate::layout::AE_CONFIG);
        write_json(&p, &serde_json::to_value(&spec.ae).expect("json"))?;
        written.push(p);
    }
    Ok(written)
}

/// Writes a whole tiny pipeline (f32, shaped for `FluxConfig::flux_tiny`) into `dir`
/// and returns the files written.
pub fn write_tiny_pipeline(dir: &Path, seed: u64) -> Result<Vec<PathBuf>> {
    let flux = FluxConfig::flux_tiny();
    let spec = PipelineSpec {
        t5: tiny_t5_config(&flux),
        clip: tiny_clip_config(&flux),
        flux,
        dtype: DType::F32,
        ae: AeConfig::tiny(),
        ae_json: true,
        shard_bytes: None,
    };
    write_pipeline(dir, seed, &spec)
}

/// A [`SimpleBackend`](candle_nn::var_builder::SimpleBackend) that records the names
/// and shapes a model asks for and hands out broadcast zeros (nothing allocated), so a
/// full-size model can be listed without building it.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

/// A tensor's name and shape, as asked for.
type Seen = (String, Vec<usize>);

impl candle_nn::var_builder::SimpleBackend for Recorder {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .expect("recorder")
            .push((name.to_string(), s.dims().to_vec()));
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }
    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("{name}: the recorder needs shapes")
    }
    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// The tensors (`name`, shape) `build` asks for, renamed, in name order.
fn list_tensors(
    rename: impl Fn(&str) -> String,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<()>,
) -> Result<Vec<mold_exec::TensorSpec>> {
    let rec = Recorder::default();
    build(VarBuilder::from_backend(
        Box::new(rec.clone()),
        DType::F32,
        Device::Cpu,
    ))?;
    let seen: BTreeMap<String, Vec<usize>> = rec
        .0
        .lock()
        .expect("recorder")
        .iter()
        .map(|(n, shape)| (rename(n), shape.clone()))
        .collect();
    Ok(seen
        .into_iter()
        .map(|(name, shape)| mold_exec::TensorSpec { name, shape })
        .collect())
}

/// T5 v1.1 XXL (the encoder FLUX uses), as its `config.json` says.
pub fn t5_xxl_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "vocab_size": 32128,
        "d_model": 4096,
        "d_kv": 64,
        "d_ff": 10240,
        "num_layers": 24,
        "num_heads": 64,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-6,
        "initializer_factor": 1.0,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": false,
        "is_encoder_decoder": true,
        "use_cache": true,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0
    })
}

/// CLIP ViT-L/14's text model (FLUX's pooled conditioning).
pub fn clip_l_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["CLIPTextModel"],
        "model_type": "clip_text_model",
        "vocab_size": 49408,
        "hidden_size": 768,
        "projection_dim": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 77,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5
    })
}

/// Writes a full-size pipeline weights directory for `model` (`flux-dev` or
/// `flux-schnell`) with random weights in `dtype` (bf16 or f32): the transformer in 5 GB
/// shards, T5-XXL, CLIP-L and FLUX's autoencoder (~38 GB in bf16: about half a minute
/// on a GPU machine). For benchmarks of the whole pipeline: the images are noise.
pub fn write_full_pipeline(
    dir: &Path,
    model: &str,
    seed: u64,
    dtype: DType,
) -> Result<Vec<PathBuf>> {
    let flux = FluxConfig::by_name(model)
        .filter(|_| model != "flux-tiny")
        .ok_or_else(|| PipelineError::Component {
            component: "testdata".into(),
            message: format!(
                "`{model}`: full-size pipelines are flux-dev or flux-schnell (flux-tiny-pipeline for the tiny one)"
            ),
        })?;
    let spec = PipelineSpec {
        flux,
        dtype,
        t5: t5_xxl_config(),
        clip: clip_l_config(),
        ae: AeConfig::flux(),
        ae_json: false,
        shard_bytes: Some(5_000_000_000),
    };
    write_pipeline(dir, seed, &spec)
}

#[cfg(test)]
mod tests;
