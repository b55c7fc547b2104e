//! The weights directory: where each component's files are, checked before anything
//! loads.
//!
//! ```text
//! DIR/
//!   flux1-dev.safetensors       the transformer (BFL file; flux1-schnell.safetensors for
//!                               schnell, flux-transformer.safetensors[.index.json] from
//!                               `mold testdata`)
//!   ae.safetensors              the FLUX autoencoder (BFL file); ae.json optional
//!   t5/   config.json  model.safetensors (or model.safetensors.index.json)  tokenizer.json
//!   clip/ config.json  model.safetensors (or model.safetensors.index.json)  tokenizer.json
//! ```

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

/// Transformer file names a model's weights directory may hold, preferred first.
pub fn transformer_names(model_id: &str) -> Vec<&'static str> {
    let mut v = match model_id {
        "flux-dev" => vec!["flux1-dev.safetensors"],
        "flux-schnell" => vec!["flux1-schnell.safetensors"],
        _ => vec![],
    };
    v.extend([
        "flux-transformer.safetensors",
        "flux-transformer.safetensors.index.json",
    ]);
    v
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
    let dir = index.parent().unwrap_or(Path::new("."));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

impl WeightsLayout {
    /// Finds every file of `model_id`'s pipeline under `dir`. Fails listing *everything*
    /// missing (relative to `dir`), so one run tells the whole story.
    pub fn locate(dir: &Path, model_id: &str) -> Result<WeightsLayout> {
        if !dir.is_dir() {
            let what = if dir.exists() {
                "is a file, not a directory: the pipeline reads a weights directory (transformer, ae.safetensors, t5/, clip/)"
            } else {
                "does not exist"
            };
            return Err(PipelineError::Config {
                path: dir.display().to_string(),
                message: what.into(),
            });
        }
        let mut missing: Vec<String> = Vec::new();
        let names = transformer_names(model_id);
        let transformer = names.iter().map(|n| dir.join(n)).find(|p| p.is_file());
        if transformer.is_none() {
            missing.push(format!("{} (the transformer)", names[0]));
        }
        let ae = dir.join("ae.safetensors");
        if !ae.is_file() {
            missing.push("ae.safetensors (the FLUX autoencoder)".into());
        }
        let ae_config = Some(dir.join(AE_CONFIG)).filter(|p| p.is_file());
        let mut encoder = |name: &str, what: &str| -> Result<Option<EncoderFiles>> {
            let d = dir.join(name);
            let config = d.join("config.json");
            let tokenizer = d.join("tokenizer.json");
            let single = d.join("model.safetensors");
            let index = d.join("model.safetensors.index.json");
            let mut ok = true;
            if !config.is_file() {
                missing.push(format!("{name}/config.json (the {what} config)"));
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
                            "{} (a {what} shard named by {name}/model.safetensors.index.json)",
                            rel.display()
                        ));
                        ok = false;
                    }
                }
                files
            } else {
                missing.push(format!(
                    "{name}/model.safetensors (the {what} weights; or a sharded model.safetensors.index.json)"
                ));
                ok = false;
                vec![]
            };
            if !tokenizer.is_file() {
                missing.push(format!("{name}/tokenizer.json (the {what} tokenizer)"));
                ok = false;
            }
            Ok(ok.then_some(EncoderFiles {
                config,
                weights,
                tokenizer,
            }))
        };
        let t5 = encoder("t5", "T5 encoder")?;
        let clip = encoder("clip", "CLIP text model")?;
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
