//! Random-weight Qwen-Image transformers in the published repository's layout:
//! `transformer/diffusion_pytorch_model-0000i-of-0000n.safetensors`, its
//! `diffusion_pytorch_model.safetensors.index.json` and diffusers' `config.json`, so the
//! same folder loads in mold (`--weights DIR`) and in diffusers
//! (`QwenImageTransformer2DModel.from_pretrained(DIR, subfolder="transformer")`).

use super::QwenConfig;
use crate::error::{ExecError, Result};
use candle_core::DType;
use std::path::{Path, PathBuf};

/// The file stem of the published transformer's shards and index.
pub const SHARD_STEM: &str = "diffusion_pytorch_model";

/// diffusers' `config.json` for `cfg`.
pub fn diffusers_config(cfg: &QwenConfig) -> serde_json::Value {
    serde_json::json!({
        "_class_name": "QwenImageTransformer2DModel",
        "patch_size": cfg.patch,
        "in_channels": cfg.in_channels,
        "out_channels": cfg.out_channels,
        "num_layers": cfg.depth,
        "attention_head_dim": cfg.head_dim,
        "num_attention_heads": cfg.heads,
        "joint_attention_dim": cfg.joint_attention_dim,
        "guidance_embeds": false,
        "axes_dims_rope": cfg.axes_dim,
    })
}

/// Writes random weights for `cfg` (deterministic from `seed` and each name, as
/// [`crate::write_safetensors`] fills them) into `dir/transformer/`, in shards of at
/// most `max_shard_bytes`; returns the files written (shards, index, config).
pub fn write_testdata(
    cfg: &QwenConfig,
    dir: &Path,
    seed: u64,
    dtype: DType,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let t = dir.join(mold_models::snapshot::DIFFUSERS_TRANSFORMER);
    let index = crate::random_weights::write_sharded(
        &t,
        &cfg.tensor_specs(),
        seed,
        dtype,
        max_shard_bytes,
        SHARD_STEM,
    )?;
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ExecError::Io { path, source }
    };
    // The shards are the ones the index names (not whatever else is in the folder).
    let text = std::fs::read_to_string(&index).map_err(io(&index))?;
    let map: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ExecError::Input(format!("{}: {e}", index.display())))?;
    let mut files: Vec<PathBuf> = map["weight_map"]
        .as_object()
        .into_iter()
        .flat_map(|m| m.values())
        .filter_map(|v| v.as_str().map(|f| t.join(f)))
        .collect();
    files.sort();
    files.dedup();
    files.push(index);
    let config = t.join("config.json");
    let text = serde_json::to_string_pretty(&diffusers_config(cfg)).expect("json");
    mold_files::write_bytes(&config, text.as_bytes()).map_err(io(&config))?;
    files.push(config);
    Ok(files)
}
