//! A complete tiny pipeline weights directory with random weights: T5, CLIP and VAE
//! (with configs and tokenizers) shaped for `FluxConfig::flux_tiny`, and the tiny
//! transformer, so CI runs the whole pipeline in seconds.
//!
//! Tensor names and shapes come from candle-transformers' own loaders (each model is
//! built once over a [`VarMap`] to list them), so the files load exactly as real ones do.
//! Values depend only on the seed and the tensor name.

use crate::error::{PipelineError, Result};
use crate::vae::AeConfig;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::clip::text_model::{
    Activation, ClipTextConfig, ClipTextTransformer,
};
use candle_transformers::models::flux::autoencoder::Decoder;
use candle_transformers::models::t5;
use mold_exec::FluxConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
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

fn fnv(s: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Deterministic values for a tensor: norm weights ~ 1 + N(0, 0.1²), biases and norm
/// biases ~ N(0, 0.02²), matrices and kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1).
fn fill(name: &str, shape: &[usize], seed: u64) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed ^ fnv(name));
    let n: usize = shape.iter().product();
    let is_norm = name.contains("norm");
    let (mean, std) = if is_norm && name.ends_with(".weight") {
        (1.0, 0.1)
    } else if name.ends_with(".bias") {
        (0.0, 0.02)
    } else if name.contains("embed") || name.starts_with("shared.") {
        (0.0, 1.0)
    } else {
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        (0.0, 1.0 / (fan_in as f32).sqrt())
    };
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
        let u2: f64 = rng.gen();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        v.push(mean + std * z as f32);
    }
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Lists the tensors `build` asks a [`VarBuilder`] for, fills them, renames per
/// `rename`, and saves them to `path`.
fn save_random(
    path: &Path,
    seed: u64,
    rename: impl Fn(&str) -> String,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<()>,
) -> Result<()> {
    let vm = VarMap::new();
    build(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    let data = vm.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let shape = data[name].as_tensor().dims().to_vec();
        let name = rename(name);
        let t = fill(&name, &shape, seed)?;
        out.insert(name, t);
    }
    candle_core::safetensors::save(&out, path)?;
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("json"))
        .map_err(PipelineError::io(path))
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
    tok.save(path, true).map_err(tok_err(path))?;
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

/// Writes a whole tiny pipeline into `dir` (the layout of [`crate::WeightsLayout`]) and
/// returns the files written.
pub fn write_tiny_pipeline(dir: &Path, seed: u64) -> Result<Vec<PathBuf>> {
    let flux = FluxConfig::flux_tiny();
    let mut written = Vec::new();
    for d in [dir.to_path_buf(), dir.join("t5"), dir.join("clip")] {
        std::fs::create_dir_all(&d).map_err(PipelineError::io(&d))?;
    }

    // Transformer.
    written.push(mold_exec::write_testdata(&flux, dir, seed, DType::F32)?);

    // T5 encoder (HF T5EncoderModel names: shared.weight, encoder.block.N...).
    let t5_dir = dir.join("t5");
    let cfg_json = tiny_t5_config(&flux);
    let cfg: t5::Config = serde_json::from_value(cfg_json.clone()).expect("t5 config");
    write_json(&t5_dir.join("config.json"), &cfg_json)?;
    let p = t5_dir.join("model.safetensors");
    save_random(
        &p,
        seed ^ 0x75,
        |n| {
            if n == "encoder.embed_tokens.weight" {
                "shared.weight".into()
            } else {
                n.to_string()
            }
        },
        |vb| t5::T5EncoderModel::load(vb, &cfg).map(|_| ()),
    )?;
    written.push(p);
    let p = t5_dir.join("tokenizer.json");
    write_tokenizer(
        &p,
        &["<pad>", "</s>", "<unk>"],
        None,
        "<unk>",
        "$A </s>",
        &["</s>"],
    )?;
    written.extend([t5_dir.join("config.json"), p]);

    // CLIP text model (HF CLIPTextModel names: text_model.*).
    let clip_dir = dir.join("clip");
    let cfg_json = tiny_clip_config(&flux);
    write_json(&clip_dir.join("config.json"), &cfg_json)?;
    let ccfg = ClipTextConfig {
        vocab_size: TINY_VOCAB,
        embed_dim: flux.vec_in_dim,
        activation: Activation::QuickGelu,
        intermediate_size: 64,
        max_position_embeddings: 77,
        pad_with: None,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        projection_dim: flux.vec_in_dim,
    };
    let p = clip_dir.join("model.safetensors");
    save_random(
        &p,
        seed ^ 0xc1,
        |n| n.to_string(),
        |vb| ClipTextTransformer::new(vb.pp("text_model"), &ccfg).map(|_| ()),
    )?;
    written.push(p);
    let p = clip_dir.join("tokenizer.json");
    // End-of-text is the highest id, as in CLIP's vocabulary: pooling finds it by argmax.
    write_tokenizer(
        &p,
        &["<|startoftext|>", "<unk>"],
        Some("<|endoftext|>"),
        "<unk>",
        "<|startoftext|> $A <|endoftext|>",
        &["<|startoftext|>", "<|endoftext|>"],
    )?;
    written.extend([clip_dir.join("config.json"), p]);

    // Autoencoder: the decoder's tensors under `decoder.` (as in BFL's ae.safetensors),
    // and ae.json since the shape is not FLUX's.
    let ae = AeConfig::tiny();
    let p = dir.join("ae.safetensors");
    let cc = ae.to_candle();
    save_random(
        &p,
        seed ^ 0xae,
        |n| n.to_string(),
        |vb| Decoder::new(&cc, vb.pp("decoder")).map(|_| ()),
    )?;
    written.push(p);
    let p = dir.join(crate::layout::AE_CONFIG);
    write_json(&p, &serde_json::to_value(&ae).expect("json"))?;
    written.push(p);
    Ok(written)
}

/// A [`SimpleBackend`](candle_nn::var_builder::SimpleBackend) that records the names
/// and shapes a model asks for and hands out broadcast zeros (nothing allocated), so a
/// full-size model can be listed without building it.
struct Recorder(std::sync::Mutex<Vec<(String, Vec<usize>)>>);

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
    let rec = std::sync::Arc::new(Recorder(std::sync::Mutex::new(Vec::new())));
    struct Shared(std::sync::Arc<Recorder>);
    impl candle_nn::var_builder::SimpleBackend for Shared {
        fn get(
            &self,
            s: candle_core::Shape,
            name: &str,
            h: candle_nn::Init,
            dtype: DType,
            dev: &Device,
        ) -> candle_core::Result<Tensor> {
            self.0.get(s, name, h, dtype, dev)
        }
        fn get_unchecked(&self, name: &str, d: DType, dev: &Device) -> candle_core::Result<Tensor> {
            self.0.get_unchecked(name, d, dev)
        }
        fn contains_tensor(&self, name: &str) -> bool {
            self.0.contains_tensor(name)
        }
    }
    let backend: Box<dyn candle_nn::var_builder::SimpleBackend> = Box::new(Shared(rec.clone()));
    build(VarBuilder::from_backend(backend, DType::F32, Device::Cpu))?;
    let mut seen = std::collections::BTreeMap::new();
    for (n, shape) in rec.0.lock().expect("recorder").iter() {
        seen.insert(rename(n), shape.clone());
    }
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
/// shards, T5-XXL, CLIP-L and FLUX's autoencoder with their configs, and word-level
/// tokenizers over a small vocabulary (the ids they produce are valid for the real
/// vocabularies). Every file is written tensor by tensor on all cores (~40 GB in bf16:
/// a minute or two on a GPU machine's disk). For benchmarks of the whole pipeline: the
/// images are noise.
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
            message: format!("`{model}`: full-size pipelines are flux-dev or flux-schnell"),
        })?;
    let mut written = Vec::new();
    for d in [dir.to_path_buf(), dir.join("t5"), dir.join("clip")] {
        std::fs::create_dir_all(&d).map_err(PipelineError::io(&d))?;
    }
    written.push(mold_exec::write_testdata_sharded(
        &flux,
        dir,
        seed,
        dtype,
        5_000_000_000,
    )?);

    let t5_dir = dir.join("t5");
    let cfg_json = t5_xxl_config();
    let cfg: t5::Config = serde_json::from_value(cfg_json.clone()).expect("t5 config");
    write_json(&t5_dir.join("config.json"), &cfg_json)?;
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
    let p = t5_dir.join("model.safetensors");
    mold_exec::write_safetensors(&p, &specs, seed ^ 0x75, dtype)?;
    written.push(p);
    let p = t5_dir.join("tokenizer.json");
    write_tokenizer(
        &p,
        &["<pad>", "</s>", "<unk>"],
        None,
        "<unk>",
        "$A </s>",
        &["</s>"],
    )?;
    written.extend([t5_dir.join("config.json"), p]);

    let clip_dir = dir.join("clip");
    write_json(&clip_dir.join("config.json"), &clip_l_config())?;
    let ccfg = ClipTextConfig {
        vocab_size: 49408,
        embed_dim: 768,
        activation: Activation::QuickGelu,
        intermediate_size: 3072,
        max_position_embeddings: 77,
        pad_with: None,
        num_hidden_layers: 12,
        num_attention_heads: 12,
        projection_dim: 768,
    };
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| ClipTextTransformer::new(vb.pp("text_model"), &ccfg).map(|_| ()),
    )?;
    let p = clip_dir.join("model.safetensors");
    mold_exec::write_safetensors(&p, &specs, seed ^ 0xc1, dtype)?;
    written.push(p);
    let p = clip_dir.join("tokenizer.json");
    write_tokenizer(
        &p,
        &["<|startoftext|>", "<unk>"],
        Some("<|endoftext|>"),
        "<unk>",
        "<|startoftext|> $A <|endoftext|>",
        &["<|startoftext|>", "<|endoftext|>"],
    )?;
    written.extend([clip_dir.join("config.json"), p]);

    let cc = AeConfig::flux().to_candle();
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| Decoder::new(&cc, vb.pp("decoder")).map(|_| ()),
    )?;
    let p = dir.join("ae.safetensors");
    mold_exec::write_safetensors(&p, &specs, seed ^ 0xae, dtype)?;
    written.push(p);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{Clip, T5};
    use crate::vae::Vae;
    use crate::WeightsLayout;

    #[test]
    fn recorder_lists_what_the_varmap_lists() {
        let flux = FluxConfig::flux_tiny();
        let cfg: t5::Config = serde_json::from_value(tiny_t5_config(&flux)).unwrap();
        let listed = list_tensors(
            |n| n.to_string(),
            |vb| t5::T5EncoderModel::load(vb, &cfg).map(|_| ()),
        )
        .unwrap();
        let vm = VarMap::new();
        t5::T5EncoderModel::load(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg)
            .unwrap();
        let data = vm.data().lock().unwrap();
        let mut want: Vec<(String, Vec<usize>)> = data
            .iter()
            .map(|(k, v)| {
                // An empty VarMap has no `shared.weight`, so T5 falls back to this name;
                // the recorder claims every name, as a real checkpoint has `shared`.
                let k = if k == "encoder.embed_tokens.weight" {
                    "shared.weight"
                } else {
                    k
                };
                (k.to_string(), v.as_tensor().dims().to_vec())
            })
            .collect();
        want.sort();
        let got: Vec<(String, Vec<usize>)> =
            listed.into_iter().map(|s| (s.name, s.shape)).collect();
        assert_eq!(got, want);
        // Full size, without allocating it: T5-XXL has 4.76 B parameters in the encoder.
        let xxl: t5::Config = serde_json::from_value(t5_xxl_config()).unwrap();
        let specs = list_tensors(
            |n| n.to_string(),
            |vb| t5::T5EncoderModel::load(vb, &xxl).map(|_| ()),
        )
        .unwrap();
        let params: usize = specs
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert!((4_700_000_000..4_800_000_000).contains(&params), "{params}");
    }

    #[test]
    fn tiny_pipeline_loads_and_runs_each_component() {
        let d = std::env::temp_dir().join(format!("mold-pipeline-tiny-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        write_tiny_pipeline(&d, 0).unwrap();
        let l = WeightsLayout::locate(&d, "flux-tiny").unwrap();
        let flux = FluxConfig::flux_tiny();
        let dev = Device::Cpu;

        let mut t5 = T5::load(&l.t5, 8, DType::F32, &dev).unwrap();
        let txt = t5.encode("a red fox in snow").unwrap();
        assert_eq!(txt.dims(), [1, 8, flux.context_in_dim]);
        // Truncation: a long prompt still gives 8 tokens.
        let long = "a red fox ".repeat(20);
        assert_eq!(t5.encode(&long).unwrap().dims(), [1, 8, 32]);
        let tok = crate::text::load_tokenizer(&l.t5.tokenizer, 8, &["<pad>"]).unwrap();
        let ids = crate::text::tokenize(&tok, &l.t5.tokenizer, "A red fox").unwrap();
        // a, red, fox, </s>, then <pad> (0).
        assert_eq!(&ids[3..], &[1, 0, 0, 0, 0]);
        assert!(ids[..3].iter().all(|&i| i > 2), "{ids:?}");

        let clip = Clip::load(&l.clip, DType::F32, &dev).unwrap();
        let y = clip.encode("a red fox in snow").unwrap();
        assert_eq!(y.dims(), [1, flux.vec_in_dim]);
        let ctok = crate::text::load_tokenizer(&l.clip.tokenizer, 77, &["<|endoftext|>"]).unwrap();
        let ids = crate::text::tokenize(&ctok, &l.clip.tokenizer, "red fox").unwrap();
        let eot = ctok.token_to_id("<|endoftext|>").unwrap();
        assert_eq!(ids.len(), 77);
        assert_eq!(ids[0], ctok.token_to_id("<|startoftext|>").unwrap());
        assert!(ids[3..].iter().all(|&i| i == eot), "{ids:?}");
        assert_eq!(ids.iter().copied().max(), Some(eot));

        let vae = Vae::load(&l, DType::F32, &dev).unwrap();
        let z = Tensor::zeros((1, 16, 4, 6), DType::F32, &dev).unwrap();
        assert_eq!(vae.decode(&z).unwrap().dims(), [1, 3, 32, 48]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
