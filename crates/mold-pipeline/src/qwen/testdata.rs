//! Random-weight Qwen-Image pipelines in the published repository's layout
//! (`Qwen/Qwen-Image`: `transformer/`, `text_encoder/`, `tokenizer/`, `vae/`,
//! `scheduler/`, `model_index.json`) with its tensor names and config files, so the same
//! folder loads in mold (`mold exec PLAN --weights DIR --prompt ...`) and in diffusers
//! (`QwenImagePipeline.from_pretrained(DIR)`).
//!
//! - `qwen-image-tiny-pipeline`: every component tiny (f32), for CI.
//! - `qwen-image-pipeline`: full size (bf16 by default): the 20B transformer, the 7B
//!   language model of Qwen2.5-VL and its LM head, the VAE; for GPU benchmarks.
//!
//! Both leave out Qwen2.5-VL's vision tower (text prompts never reach it; transformers
//! initializes it when it loads the folder) and share one small byte-level BPE
//! tokenizer (its ids fit either vocabulary), written as the published slow
//! `Qwen2Tokenizer`'s files: `vocab.json`, `merges.txt`, `tokenizer_config.json`.

use crate::error::{PipelineError, Result};
use crate::qwen::sampling::SchedulerConfig;
use crate::qwen::vae::QwenVaeConfig;
use candle_core::DType;
use mold_exec::{QwenConfig, TensorSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The language model of a Qwen-Image pipeline's text encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextSize {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
}

impl TextSize {
    /// Qwen2.5-VL-7B's language model.
    pub const QWEN25_VL_7B: TextSize = TextSize {
        vocab: 152_064,
        hidden: 3584,
        layers: 28,
        heads: 28,
        kv_heads: 4,
        intermediate: 18_944,
    };

    /// The tiny one (hidden = the tiny transformer's `joint_attention_dim`), with
    /// grouped key/value heads as the real one has.
    pub fn tiny(joint_attention_dim: usize) -> TextSize {
        TextSize {
            vocab: 1000,
            hidden: joint_attention_dim,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 2 * joint_attention_dim,
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The language model's configuration at this size (Qwen2.5-VL's published values
    /// elsewhere: SiLU, RMS norm epsilon 1e-6, rotary base 10⁶).
    pub fn text_config(&self) -> crate::qwen::text::QwenTextConfig {
        crate::qwen::text::QwenTextConfig {
            vocab_size: self.vocab,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            hidden_act: "silu".into(),
        }
    }

    /// The checkpoint's language-model tensors (`model.*` and `lm_head.weight`).
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let (h, kv, m) = (
            self.hidden,
            self.kv_heads * self.head_dim(),
            self.intermediate,
        );
        let mut out = Vec::new();
        let mut t = |name: String, shape: Vec<usize>| out.push(TensorSpec { name, shape });
        t("model.embed_tokens.weight".into(), vec![self.vocab, h]);
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            t(format!("{p}.input_layernorm.weight"), vec![h]);
            for (n, o) in [("q_proj", h), ("k_proj", kv), ("v_proj", kv)] {
                t(format!("{p}.self_attn.{n}.weight"), vec![o, h]);
                t(format!("{p}.self_attn.{n}.bias"), vec![o]);
            }
            t(format!("{p}.self_attn.o_proj.weight"), vec![h, h]);
            t(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            t(format!("{p}.mlp.gate_proj.weight"), vec![m, h]);
            t(format!("{p}.mlp.up_proj.weight"), vec![m, h]);
            t(format!("{p}.mlp.down_proj.weight"), vec![h, m]);
        }
        t("model.norm.weight".into(), vec![h]);
        t("lm_head.weight".into(), vec![self.vocab, h]);
        out
    }

    /// transformers' `config.json` (`Qwen2_5_VLForConditionalGeneration`); the vision
    /// config is Qwen2.5-VL-7B's at full size and a small one for the tiny model.
    pub fn config(&self, dtype: DType) -> serde_json::Value {
        let half = self.head_dim() / 2;
        // Qwen2.5-VL-7B's [16, 24, 24] of 64 pairs; the same proportions otherwise.
        let t = half / 4;
        let section = [t, (half - t) / 2, half - t - (half - t) / 2];
        let full = *self == TextSize::QWEN25_VL_7B;
        let vision = if full {
            serde_json::json!({"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                "num_heads": 16, "out_hidden_size": self.hidden, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3, "hidden_act": "silu"})
        } else {
            serde_json::json!({"depth": 1, "hidden_size": 16, "intermediate_size": 32,
                "num_heads": 2, "out_hidden_size": self.hidden, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                "fullatt_block_indexes": [0], "in_chans": 3, "hidden_act": "silu"})
        };
        serde_json::json!({
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 128000,
            "max_window_layers": self.layers,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": section},
            "sliding_window": 32768,
            "use_sliding_window": false,
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": if dtype == DType::F32 { "float32" } else { "bfloat16" },
            "vision_config": vision,
        })
    }
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<PathBuf> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(PipelineError::io(d))?;
    }
    // Through a temporary file renamed over `path`: never through a symlink, never half.
    mold_files::write_bytes(
        path,
        serde_json::to_string_pretty(v).expect("json").as_bytes(),
    )
    .map_err(PipelineError::io(path))?;
    Ok(path.to_path_buf())
}

/// GPT-2's map of bytes to printable characters (`bytes_to_unicode`), indexed by byte.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut by_byte = vec!['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        by_byte[b as usize] = char::from_u32(c).expect("char");
    }
    by_byte
}

/// Words the tiny tokenizer's merges are learnt from: the template's system prompt and a
/// few of a prompt's.
const CORPUS: &str = "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background: a red fox in the snow, a cat sitting on the table, blue sky over a mountain river, a photo of a golden house at night";

/// The template's role words, each right after `<|im_start|>` (no leading space).
const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Merges learnt by frequency at most (before the ones that complete the words).
const MERGES: usize = 160;

/// The tiny tokenizer's files in `dir`: byte-level BPE (the 256 byte characters, then
/// one token per merge: learnt greedily from [`CORPUS`] and [`ROLES`], then the merges
/// that make each of their words one token), then `<|endoftext|>`, `<|im_start|>`,
/// `<|im_end|>` as added special tokens. As with Qwen2.5-VL's tokenizer, the template's
/// system prompt and `<|im_start|>user\n` are then the [`DROP_TOKENS`] tokens the
/// pipeline drops, so the conditioning starts at the prompt.
///
/// [`DROP_TOKENS`]: crate::qwen::text::DROP_TOKENS
pub fn write_tokenizer(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(PipelineError::io(dir))?;
    let map = bytes_to_unicode();
    let mut vocab: Vec<String> = map.iter().map(|c| c.to_string()).collect();
    // Words as the pre-tokenizer cuts them: a leading space joins the word (Ġ).
    let mut words: Vec<Vec<String>> = Vec::new();
    let spaced = CORPUS.split(' ').enumerate().map(|(i, w)| {
        let w = w.trim_end_matches([',', ':']);
        if i == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        }
    });
    for w in spaced.chain(ROLES.iter().map(|r| r.to_string())) {
        words.push(w.bytes().map(|b| map[b as usize].to_string()).collect());
    }
    let mut merges: Vec<(String, String)> = Vec::new();
    let apply = |words: &mut Vec<Vec<String>>, pair: &(String, String)| {
        let joined = format!("{}{}", pair.0, pair.1);
        for w in words.iter_mut() {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == pair.0 && w[i + 1] == pair.1 {
                    out.push(joined.clone());
                    i += 2;
                } else {
                    out.push(w[i].clone());
                    i += 1;
                }
            }
            *w = out;
        }
        joined
    };
    while merges.len() < MERGES {
        let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
            }
        }
        // The most frequent pair, the first in order among equals (deterministic).
        let Some((pair, n)) = counts
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        else {
            break;
        };
        if n < 2 {
            break;
        }
        let joined = apply(&mut words, &pair);
        // Two merges may make one token (`th`+`e`, `t`+`he`): one id.
        if !vocab.contains(&joined) {
            vocab.push(joined);
        }
        merges.push(pair);
    }
    // Then every word one token: its first two pieces merged, until one is left.
    for k in 0..words.len() {
        while words[k].len() > 1 {
            let pair = (words[k][0].clone(), words[k][1].clone());
            let joined = apply(&mut words, &pair);
            // Two merges may make one token (`th`+`e`, `t`+`he`): one id.
            if !vocab.contains(&joined) {
                vocab.push(joined);
            }
            merges.push(pair);
        }
    }
    let v: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let vocab_path = write_json(&dir.join("vocab.json"), &serde_json::Value::Object(v))?;
    let merges_path = dir.join("merges.txt");
    let mut text = String::from("#version: 0.2\n");
    for (a, b) in &merges {
        text.push_str(&format!("{a} {b}\n"));
    }
    mold_files::write_bytes(&merges_path, text.as_bytes())
        .map_err(PipelineError::io(&merges_path))?;
    let n = vocab.len();
    let mut added = serde_json::Map::new();
    for (i, s) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        added.insert(
            (n + i).to_string(),
            serde_json::json!({"content": s, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": true}),
        );
    }
    let config = write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": added,
            "bos_token": null,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": null,
            "errors": "replace",
            "clean_up_tokenization_spaces": false,
            "split_special_tokens": false,
            "model_max_length": 131072,
        }),
    )?;
    // Prove it loads as the pipeline loads it.
    crate::qwen::text::load_tokenizer(&vocab_path)?;
    Ok(vec![vocab_path, merges_path, config])
}

/// The pipeline's components at one size.
struct Sizes {
    transformer: QwenConfig,
    text: TextSize,
    vae: QwenVaeConfig,
    /// Text-encoder shards at most this large (the published repository's are ~5 GB).
    shard: u64,
}

fn write(dir: &Path, seed: u64, dtype: DType, s: &Sizes) -> Result<Vec<PathBuf>> {
    let mut files = mold_exec::model::qwen::testdata::write_testdata(
        &s.transformer,
        dir,
        seed,
        dtype,
        s.shard,
    )?;
    let te = dir.join("text_encoder");
    let index = mold_exec::random_weights::write_sharded(
        &te,
        &s.text.tensor_specs(),
        seed,
        dtype,
        s.shard,
        "model",
    )?;
    let map = crate::qwen::index_files(&index)?;
    files.extend(map);
    files.push(index);
    files.push(write_json(&te.join("config.json"), &s.text.config(dtype))?);
    files.extend(write_tokenizer(&dir.join("tokenizer"))?);
    let vae = dir.join("vae");
    std::fs::create_dir_all(&vae).map_err(PipelineError::io(&vae))?;
    let vw = vae.join("diffusion_pytorch_model.safetensors");
    mold_exec::write_safetensors(&vw, &s.vae.tensor_specs(), seed, dtype)?;
    files.push(vw);
    files.push(write_json(
        &vae.join("config.json"),
        &s.vae.diffusers_config(),
    )?);
    let sc = SchedulerConfig::qwen_image();
    files.push(write_json(
        &dir.join("scheduler/scheduler_config.json"),
        &serde_json::json!({
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "base_image_seq_len": sc.base_image_seq_len as u64,
            "base_shift": sc.base_shift,
            "invert_sigmas": false,
            "max_image_seq_len": sc.max_image_seq_len as u64,
            "max_shift": sc.max_shift,
            "num_train_timesteps": 1000,
            "shift": sc.shift,
            "shift_terminal": sc.shift_terminal,
            "stochastic_sampling": false,
            "time_shift_type": sc.time_shift_type,
            "use_beta_sigmas": false,
            "use_dynamic_shifting": true,
            "use_exponential_sigmas": false,
            "use_karras_sigmas": false,
        }),
    )?);
    files.push(write_json(
        &dir.join("model_index.json"),
        &serde_json::json!({
            "_class_name": "QwenImagePipeline",
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
        }),
    )?);
    Ok(files)
}

/// `mold testdata qwen-image-tiny-pipeline DIR`: every component tiny, f32.
pub fn write_tiny_pipeline(dir: &Path, seed: u64) -> Result<Vec<PathBuf>> {
    let transformer = QwenConfig::qwen_image_tiny();
    let text = TextSize::tiny(transformer.joint_attention_dim);
    write(
        dir,
        seed,
        DType::F32,
        &Sizes {
            transformer,
            text,
            vae: QwenVaeConfig::tiny(),
            shard: 5_000_000_000,
        },
    )
}

/// `mold testdata qwen-image-pipeline DIR`: full size, in `dtype` (bf16 as published, or
/// f32), 5 GB shards.
pub fn write_full_pipeline(dir: &Path, seed: u64, dtype: DType) -> Result<Vec<PathBuf>> {
    write(
        dir,
        seed,
        dtype,
        &Sizes {
            transformer: QwenConfig::qwen_image(),
            text: TextSize::QWEN25_VL_7B,
            vae: QwenVaeConfig::qwen_image(),
            shard: 5_000_000_000,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As with Qwen2.5-VL's tokenizer, the template up to `<|im_start|>user\n` is the
    /// 34 tokens the pipeline drops, so the conditioning is the prompt's tokens and the
    /// template's 5 closing ones (`<|im_end|>`, `\n`, `<|im_start|>`, `assistant`, `\n`).
    #[test]
    fn the_dropped_tokens_are_the_template_prefix() {
        use crate::qwen::text::{load_tokenizer, DROP_TOKENS, PROMPT_TEMPLATE};
        let dir = std::env::temp_dir().join(format!("mold-qwen-td-{}-tok", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = write_tokenizer(&dir).unwrap();
        let tok = load_tokenizer(&files[0]).unwrap();
        let (prefix, _) = PROMPT_TEMPLATE.split_once("{}").unwrap();
        let ids = |s: &str| crate::text::tokenize(&tok, &files[0], s).unwrap();
        assert_eq!(ids(prefix).len(), DROP_TOKENS);
        for prompt in ["a red fox in the snow", "blurry", "ein Fuchs, 3 Äpfel"] {
            let all = ids(&PROMPT_TEMPLATE.replace("{}", prompt));
            assert_eq!(all.len(), DROP_TOKENS + ids(prompt).len() + 5, "{prompt}");
            assert_eq!(
                tok.decode(&all[DROP_TOKENS..], false).unwrap(),
                format!("{prompt}<|im_end|>\n<|im_start|>assistant\n")
            );
        }
        // Every id is in the tiny model's vocabulary.
        let max = ids(&PROMPT_TEMPLATE.replace("{}", "x"))
            .into_iter()
            .max()
            .unwrap();
        assert!((max as usize) < TextSize::tiny(32).vocab, "{max}");
    }

    /// Qwen2.5-VL-7B's language model and LM head: 8.3 B parameters (the catalogue's
    /// encoder, less its 675 M vision tower).
    #[test]
    fn full_text_encoder_size() {
        let n: usize = TextSize::QWEN25_VL_7B
            .tensor_specs()
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        let spec = mold_models::find("qwen-image").unwrap();
        let c = spec
            .components
            .iter()
            .find(|c| c.name == "qwen2.5-vl")
            .unwrap();
        let lm = c.params - 675_000_000;
        // The catalogue counts no biases or norms: within 0.1 %.
        assert!(
            (n as f64 - lm as f64).abs() / (lm as f64) < 1e-3,
            "{n} vs {lm}"
        );
        let cfg = TextSize::QWEN25_VL_7B.config(DType::BF16);
        assert_eq!(
            cfg["rope_scaling"]["mrope_section"],
            serde_json::json!([16, 24, 24])
        );
    }
}
