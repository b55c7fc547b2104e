use anyhow::{Context, Result};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{CheckpointRef, DType, Plan};
use std::path::Path;

/// Loads a machine profile from a path, or `local`: the box as queried now (a CUDA build;
/// budgets with the default headroom), which a build without CUDA refuses in one line.
pub fn load_machine(spec: &str) -> Result<Machine> {
    if spec == "local" {
        return super::devices::local_machine(super::devices::DEFAULT_HEADROOM);
    }
    load_profile(spec)
}

/// [`load_machine`] without the tables mold ships: `local` is the box's own inventory
/// alone (what a calibration measures into and saves).
pub fn load_machine_unadopted(spec: &str) -> Result<Machine> {
    if spec == "local" {
        return super::devices::local_inventory_machine(super::devices::DEFAULT_HEADROOM);
    }
    load_profile(spec)
}

fn load_profile(spec: &str) -> Result<Machine> {
    let path = Path::new(spec);
    if !path.exists() {
        let hint = if !spec.contains('/') && !spec.ends_with(".yaml") {
            format!(" (did you mean sim/machines/{spec}.yaml?)")
        } else {
            String::new()
        };
        anyhow::bail!("--machine {spec}: no such file{hint}");
    }
    Ok(Machine::load(path)?)
}

/// A model named by catalogue id, or a checkpoint path whose header gives exact sizes.
pub struct LoadedModel {
    pub spec: ModelSpec,
    pub checkpoint: Option<CheckpointRef>,
    pub dtype: Option<DType>,
}

pub fn load_model(spec: &str, hint: Option<&str>) -> Result<LoadedModel> {
    let looks_like_path =
        spec.contains('/') || spec.ends_with(".safetensors") || spec.ends_with(".json");
    if looks_like_path || Path::new(spec).exists() {
        let path = Path::new(spec);
        let r = mold_models::checkpoint::refine(path, hint)?;
        return Ok(LoadedModel {
            spec: r.model,
            checkpoint: Some(CheckpointRef {
                path: spec.to_string(),
                header_sha256: r.header_sha256,
            }),
            dtype: Some(r.dtype),
        });
    }
    Ok(LoadedModel {
        spec: mold_models::find(spec)?,
        checkpoint: None,
        dtype: None,
    })
}

/// Loads a plan, naming the file in every error.
pub fn load_plan(path: &Path) -> Result<Plan> {
    Plan::load(path).with_context(|| format!("cannot use plan {}", path.display()))
}

/// Model of a plan: the catalogue entry, refined by the recorded checkpoint if it is
/// still there.
pub fn model_of(plan: &Plan) -> Result<ModelSpec> {
    if let Some(c) = &plan.model.checkpoint {
        if Path::new(&c.path).exists() {
            let r = mold_models::checkpoint::refine(Path::new(&c.path), Some(&plan.model.id))?;
            return Ok(r.model);
        }
    }
    mold_models::find(&plan.model.id).context("model.id")
}

/// `WIDTHxHEIGHT` of the option `flag` (`--size`), refused in one line naming the fix.
pub fn parse_size(flag: &str, size: &str) -> Result<(u32, u32)> {
    let (x, y) = size
        .split_once(['x', 'X'])
        .with_context(|| format!("{flag} {size}: write WIDTHxHEIGHT, e.g. 1024x1024"))?;
    let w = x
        .trim()
        .parse()
        .with_context(|| format!("{flag} {size}: width `{x}` is not a number"))?;
    let h = y
        .trim()
        .parse()
        .with_context(|| format!("{flag} {size}: height `{y}` is not a number"))?;
    Ok((w, h))
}

/// Keeps NCCL off the GPU-to-GPU path for the rest of this process and its children
/// (`--no-peer`): `NCCL_P2P_DISABLE=1`, so its collectives go through host memory as on a
/// box without peer access, and `NCCL_NVLS_ENABLE=0` (no NVLink multicast either). Set
/// here, at the edge, before any communicator exists: NCCL reads its settings only from
/// the environment. A different value the user set is replaced, with a line saying so.
pub fn no_peer_access() {
    for (k, v) in [("NCCL_P2P_DISABLE", "1"), ("NCCL_NVLS_ENABLE", "0")] {
        if let Ok(old) = std::env::var(k) {
            if old.trim() != v {
                eprintln!("--no-peer: {k}={old} replaced by {v}");
            }
        }
        std::env::set_var(k, v);
    }
}

/// The process's cuDNN plan settings, from the environment, installed before any command
/// runs: built plans kept in mold's cache directory (`mold_config::cache_dir`) unless
/// `MOLD_CUDNN_PLANS=off` (`mold_exec::model::plan_cache`).
pub fn install_plan_settings() -> Result<()> {
    use mold_exec::model::plan_cache::{install, PlanSettings};
    let get = |k: &str| std::env::var(k).ok();
    let keep = match get("MOLD_CUDNN_PLANS").as_deref().map(str::trim) {
        None | Some("") | Some("on") => true,
        Some("off") => false,
        Some(other) => anyhow::bail!(
            "MOLD_CUDNN_PLANS: `{other}` is neither `on` (keep built cuDNN plans in the cache \
             directory, the default) nor `off`"
        ),
    };
    install(PlanSettings {
        dir: if keep {
            mold_config::cache_dir(get)
        } else {
            None
        },
    });
    Ok(())
}
