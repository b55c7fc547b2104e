//! Where a model's files are: the transformer inside a weights directory (mold's own
//! layout, or a Hugging Face repository of FLUX.1 as published: BFL's single file, or
//! diffusers' `transformer/` folder), and a repository's snapshot in a Hugging Face hub
//! cache (`models--ORG--NAME/snapshots/REV`). Paths only: the caller (the CLI) says
//! which directories to search.

use std::path::{Path, PathBuf};

/// The Hugging Face repository a catalogue model is published in.
pub fn hf_repo(model_id: &str) -> Option<&'static str> {
    match model_id {
        "flux-dev" => Some("black-forest-labs/FLUX.1-dev"),
        "flux-schnell" => Some("black-forest-labs/FLUX.1-schnell"),
        _ => None,
    }
}

/// Single-file (BFL-named) transformer checkpoints a weights directory may hold for
/// `model_id` (`None`: any FLUX), preferred first: BFL's own file name, then the names
/// `mold testdata` writes.
pub fn bfl_file_names(model_id: Option<&str>) -> Vec<&'static str> {
    let mut v = match model_id {
        Some("flux-dev") => vec!["flux1-dev.safetensors"],
        Some("flux-schnell") => vec!["flux1-schnell.safetensors"],
        // The tiny test model's Hugging Face-style snapshot names its file as dev's.
        Some("flux-tiny") => vec![],
        _ => vec!["flux1-dev.safetensors", "flux1-schnell.safetensors"],
    };
    v.extend([
        "flux-transformer.safetensors",
        "flux-transformer.safetensors.index.json",
    ]);
    if model_id == Some("flux-tiny") {
        v.push("flux1-dev.safetensors");
    }
    v
}

/// The folder of the diffusers-format transformer in a Hugging Face repository.
pub const DIFFUSERS_TRANSFORMER: &str = "transformer";

/// Files of the diffusers-format transformer in `transformer/`, preferred first.
pub const DIFFUSERS_TRANSFORMER_FILES: [&str; 2] = [
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
];

/// The diffusers-format transformer of a repository directory: its index or its one file.
pub fn diffusers_transformer(dir: &Path) -> Option<PathBuf> {
    let d = dir.join(DIFFUSERS_TRANSFORMER);
    DIFFUSERS_TRANSFORMER_FILES
        .iter()
        .map(|f| d.join(f))
        .find(|p| p.is_file())
}

/// The transformer checkpoint of a weights directory: a BFL-named single file (or
/// mold's sharded index), else diffusers' `transformer/` folder; `None` when neither is
/// there.
pub fn find_transformer(dir: &Path, model_id: Option<&str>) -> Option<PathBuf> {
    bfl_file_names(model_id)
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .or_else(|| diffusers_transformer(dir))
}

/// Where the transformer was looked for in a weights directory, for messages.
pub fn transformer_candidates(model_id: Option<&str>) -> String {
    let mut v: Vec<String> = bfl_file_names(model_id)
        .into_iter()
        .map(String::from)
        .collect();
    v.push(format!(
        "{DIFFUSERS_TRANSFORMER}/{}",
        DIFFUSERS_TRANSFORMER_FILES.join(" or ")
    ));
    v.join(", ")
}

/// The hub cache folder name of a repository: `models--ORG--NAME`.
pub fn cache_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// The snapshot a hub cache's repository folder (`models--ORG--NAME`) points at: the
/// revision `refs/main` names, else the only snapshot, else the most recently modified.
pub fn snapshot_of_repo_folder(folder: &Path) -> Option<PathBuf> {
    let snaps = folder.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(folder.join("refs").join("main")) {
        let p = snaps.join(rev.trim());
        if !rev.trim().is_empty() && p.is_dir() {
            return Some(p);
        }
    }
    let mut all: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snaps)
        .ok()?
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| {
            let t = e
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (t, e.path())
        })
        .collect();
    all.sort();
    all.pop().map(|(_, p)| p)
}

/// A weights path as the user gave it, with a hub cache repository folder
/// (`…/models--ORG--NAME`) taken to its snapshot; anything else unchanged.
pub fn resolve_weights_path(path: &Path) -> PathBuf {
    let is_repo_folder = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("models--"))
        && path.join("snapshots").is_dir();
    if is_repo_folder {
        if let Some(s) = snapshot_of_repo_folder(path) {
            return s;
        }
    }
    path.to_path_buf()
}

/// Searches `roots` (each a hub cache such as `~/.cache/huggingface/hub`, or a folder
/// of weights directories) for `model_id`'s weights: in each root, the hub cache
/// snapshot of its repository, then a folder named as the repository
/// (`FLUX.1-dev`), then one named as the model (`flux-dev`). Returns the directory
/// found, or every place looked at (for the message).
pub fn find_weights(roots: &[PathBuf], model_id: &str) -> Result<PathBuf, Vec<PathBuf>> {
    let mut looked = Vec::new();
    for root in roots {
        let mut candidates = Vec::new();
        if let Some(repo) = hf_repo(model_id) {
            candidates.push(root.join(cache_folder(repo)));
            if let Some(name) = repo.split('/').nth(1) {
                candidates.push(root.join(name));
            }
        }
        candidates.push(root.join(model_id));
        for c in candidates {
            let dir = resolve_weights_path(&c);
            if dir.is_dir() && find_transformer(&dir, Some(model_id)).is_some() {
                return Ok(dir);
            }
            looked.push(c);
        }
    }
    Err(looked)
}
