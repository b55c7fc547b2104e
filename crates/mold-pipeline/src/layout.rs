//! The weights directory: where each component's files are, checked before anything
//! loads. Two layouts are read, mold's own and the Hugging Face repository of FLUX.1
//! (dev or schnell) as published (a hub cache snapshot `models--ORG--NAME/snapshots/REV`
//! too, or its `models--ORG--NAME` folder):
//!
//! ```text
//! DIR/ (mold)                         DIR/ (Hugging Face)
//!   flux1-dev.safetensors               flux1-dev.safetensors (BFL names), else
//!   (flux-transformer.safetensors[.index.json] from `mold testdata`)
//!                                       transformer/ diffusion_pytorch_model[-0000N-of-0000M].safetensors
//!                                                    (+ .index.json), diffusers names
//!   ae.safetensors  (ae.json)           ae.safetensors
//!   t5/   config.json model.safetensors text_encoder_2/ config.json model-0000N-of-0000M.safetensors
//!         (or an index) tokenizer.json                  + model.safetensors.index.json
//!                                       tokenizer_2/ tokenizer.json
//!   clip/ config.json model.safetensors text_encoder/ config.json model.safetensors
//!         tokenizer.json                tokenizer/ vocab.json merges.txt (CLIP BPE; or tokenizer.json)
//! ```
//!
//! Each encoder is looked for in mold's folder first, then in the Hugging Face ones.

use crate::error::{PipelineError, Result};
use std::path::{Path, PathBuf};

/// File name of the optional autoencoder config (`ae.safetensors` carries none; without
/// it the published FLUX autoencoder config is used).
pub const AE_CONFIG: &str = "ae.json";

/// A text encoder's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncoderFiles {
    pub config: PathBuf,
    /// One `.safetensors` file, or the shards an index names.
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
}

/// Every file the pipeline reads, found and checked to exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightsLayout {
    pub dir: PathBuf,
    /// The transformer checkpoint (file or index), for [`mold_exec::Checkpoint::open`].
    pub transformer: PathBuf,
    pub ae: PathBuf,
    pub ae_config: Option<PathBuf>,
    pub t5: EncoderFiles,
    pub clip: EncoderFiles,
}

/// Transformer file names a model's weights directory may hold, preferred first (BFL's
/// single file and mold's own names; diffusers' `transformer/` folder comes after them:
/// [`mold_models::snapshot::find_transformer`]).
pub fn transformer_names(model_id: &str) -> Vec<&'static str> {
    mold_models::snapshot::bfl_file_names(Some(model_id))
}

/// Files of a safetensors index, in sorted order.
fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(PipelineError::io(index))?;
    let bad = |m: String| PipelineError::Config {
        path: index.display().to_string(),
        message: m,
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    names.sort();
    names.dedup();
    if let Some(m) = names
        .iter()
        .find_map(|n| mold_models::checkpoint::bad_shard_name(n))
    {
        return Err(bad(m));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// Where an encoder's files are in each layout: mold's folder, or the Hugging Face
/// repository's model and tokenizer folders.
struct EncoderPlaces {
    /// mold's folder (`t5`, `clip`): config, weights and `tokenizer.json` together.
    mold: &'static str,
    /// The repository's model folder (`text_encoder_2`, `text_encoder`).
    hf_model: &'static str,
    /// The repository's tokenizer folder (`tokenizer_2`, `tokenizer`).
    hf_tokenizer: &'static str,
    /// Whether a BPE `vocab.json` + `merges.txt` may stand for `tokenizer.json` (CLIP).
    bpe: bool,
    what: &'static str,
}

const T5_PLACES: EncoderPlaces = EncoderPlaces {
    mold: "t5",
    hf_model: "text_encoder_2",
    hf_tokenizer: "tokenizer_2",
    bpe: false,
    what: "T5 encoder",
};

const CLIP_PLACES: EncoderPlaces = EncoderPlaces {
    mold: "clip",
    hf_model: "text_encoder",
    hf_tokenizer: "tokenizer",
    bpe: true,
    what: "CLIP text model",
};

/// Finds an encoder's files under `dir`, pushing onto `missing` (relative to `dir`,
/// naming where they were looked for) what is not there.
fn locate_encoder(
    dir: &Path,
    p: &EncoderPlaces,
    missing: &mut Vec<String>,
) -> Result<Option<EncoderFiles>> {
    let what = p.what;
    // mold's folder when it is there, else the repository's.
    let hf = !dir.join(p.mold).is_dir() && dir.join(p.hf_model).is_dir();
    let (model_dir, tok_dir) = if hf {
        (p.hf_model, p.hf_tokenizer)
    } else {
        (p.mold, p.mold)
    };
    let d = dir.join(model_dir);
    let config = d.join("config.json");
    let single = d.join("model.safetensors");
    let index = d.join("model.safetensors.index.json");
    let mut ok = true;
    if !config.is_file() {
        missing.push(format!(
            "{model_dir}/config.json (the {what} config; looked for in {}/ and {}/)",
            p.mold, p.hf_model
        ));
        ok = false;
    }
    let weights = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        let files = index_files(&index)?;
        for f in &files {
            if !f.is_file() {
                let rel = f.strip_prefix(dir).unwrap_or(f);
                missing.push(format!(
                    "{} (a {what} shard named by {model_dir}/model.safetensors.index.json)",
                    rel.display()
                ));
                ok = false;
            }
        }
        files
    } else {
        missing.push(format!(
            "{model_dir}/model.safetensors (the {what} weights; or a sharded model.safetensors.index.json)"
        ));
        ok = false;
        vec![]
    };
    let td = dir.join(tok_dir);
    let json = td.join("tokenizer.json");
    let (vocab, merges) = (td.join("vocab.json"), td.join("merges.txt"));
    let tokenizer = if json.is_file() {
        Some(json)
    } else if hf && p.bpe && vocab.is_file() && merges.is_file() {
        Some(vocab)
    } else {
        None
    };
    if tokenizer.is_none() {
        let alt = if hf && p.bpe {
            " or vocab.json + merges.txt"
        } else {
            ""
        };
        missing.push(format!(
            "{tok_dir}/tokenizer.json{alt} (the {what} tokenizer)"
        ));
        ok = false;
    }
    Ok(tokenizer.filter(|_| ok).map(|tokenizer| EncoderFiles {
        config,
        weights,
        tokenizer,
    }))
}

impl WeightsLayout {
    /// Finds every file of `model_id`'s pipeline under `dir` (mold's layout or the
    /// Hugging Face repository's; a hub cache `models--ORG--NAME` folder is taken to its
    /// snapshot). Fails listing *everything* missing (relative to `dir`, with where it
    /// was looked for), so one run tells the whole story.
    pub fn locate(dir: &Path, model_id: &str) -> Result<WeightsLayout> {
        let dir = &mold_models::snapshot::resolve_weights_path(dir);
        if !dir.is_dir() {
            let what = if dir.exists() {
                "is a file, not a directory: the pipeline reads a weights directory (transformer, ae.safetensors, t5/ or text_encoder_2/, clip/ or text_encoder/)"
            } else {
                "does not exist"
            };
            return Err(PipelineError::Config {
                path: dir.display().to_string(),
                message: what.into(),
            });
        }
        let mut missing: Vec<String> = Vec::new();
        let transformer = mold_models::snapshot::find_transformer(dir, Some(model_id));
        if transformer.is_none() {
            missing.push(format!(
                "the transformer (looked for {})",
                mold_models::snapshot::transformer_candidates(Some(model_id))
            ));
        }
        let ae = dir.join("ae.safetensors");
        if !ae.is_file() {
            missing.push("ae.safetensors (the FLUX autoencoder)".into());
        }
        let ae_config = Some(dir.join(AE_CONFIG)).filter(|p| p.is_file());
        let t5 = locate_encoder(dir, &T5_PLACES, &mut missing)?;
        let clip = locate_encoder(dir, &CLIP_PLACES, &mut missing)?;
        match (transformer, t5, clip) {
            (Some(transformer), Some(t5), Some(clip)) if missing.is_empty() => Ok(WeightsLayout {
                dir: dir.to_path_buf(),
                transformer,
                ae,
                ae_config,
                t5,
                clip,
            }),
            _ => Err(PipelineError::MissingFiles {
                dir: dir.display().to_string(),
                missing,
            }),
        }
    }
}
