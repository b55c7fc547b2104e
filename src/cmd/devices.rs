//! `mold devices` / `mold info --gpus`: this box's GPUs (CUDA builds), a machine profile
//! of them (`--save`), measured (`--calibrate`); `mold info`: the build and the
//! configuration in effect.
use anyhow::{bail, Context, Result};
use mold_config::{Layer, Setting, Val};
use mold_machine::inventory::{self, Inventory, ProfileOptions};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{ByteSize, DeviceId, Workload, GIB, MIB};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Exit code of `mold devices` on a build without CUDA.
pub const NO_CUDA_EXIT: i32 = 2;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print the inventory and budgets as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write a machine profile of this box here (e.g. sim/machines/my-box.yaml).
    #[arg(long, value_name = "YAML")]
    pub save: Option<PathBuf>,
    /// Measure the devices (bf16 matmul, memory bandwidth, host and peer copies; NCCL
    /// all-reduce on builds with the `nccl` feature) and write the figures into the saved
    /// profile.
    #[arg(long, requires = "save")]
    pub calibrate: bool,
    /// The profile's name (default: the file name of --save without .yaml).
    #[arg(long)]
    pub name: Option<String>,
    /// Kept free on every device (default: MOLD_HEADROOM, config `headroom`, else 1GiB).
    #[arg(long, value_name = "SIZE")]
    pub headroom: Option<String>,
    /// Cap a device's budget: DEVICE=SIZE, e.g. cuda:0=20GiB (repeatable; also
    /// MOLD_MAX_VRAM and config `[max_vram]`).
    #[arg(long = "max-vram", value_name = "DEV=SIZE")]
    pub max_vram: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    /// This box's GPUs: the same as `mold devices`.
    #[arg(long)]
    pub gpus: bool,
    /// As JSON.
    #[arg(long)]
    pub json: bool,
}

/// What a build without CUDA says instead of listing GPUs.
pub fn no_cuda_message(what: &str) -> String {
    format!(
        "{what}: this build of mold has no CUDA, so it cannot query this box's GPUs.\n\
         Build one with CUDA: scripts/build-cuda (no GPU or system CUDA needed; it writes \
         target/cuda/mold), or `cargo build --release --features cuda` with a CUDA \
         toolkit installed.\n\
         Machine profiles work on any build: mold plan --machine sim/machines/2x-l40s.yaml ..."
    )
}

/// Headroom when nothing sets it and there is no model to size it from.
pub const DEFAULT_HEADROOM: ByteSize = ByteSize(GIB);

/// Default headroom from the activation model at the requested size: CUDA context
/// extras and library workspaces (512 MiB) plus half the largest activation of anything
/// the model runs (the caching allocator's fragmentation grows with the transient
/// tensors), at least 1 GiB, rounded up to 256 MiB.
pub fn default_headroom(model: &ModelSpec, w: &Workload) -> ByteSize {
    let tokens = model.tokens(w);
    let batch = w.effective_batch();
    let act = model.transformer.default_dtype.activation_bytes();
    let blocks = model
        .transformer
        .kinds
        .iter()
        .map(|k| k.activation_bytes(tokens, batch, act, 1, true))
        .max()
        .unwrap_or(0);
    let components = model
        .components
        .iter()
        .map(|c| c.activation_bytes(model, w, c.default_dtype.activation_bytes()))
        .max()
        .unwrap_or(0);
    let bytes = (512 * MIB + blocks.max(components) / 2).max(GIB);
    ByteSize(bytes.div_ceil(256 * MIB) * 256 * MIB)
}

/// The machine of this box as queried now (`--machine local`), budgets `free` with
/// `headroom` inside.
pub fn local_machine(headroom: ByteSize) -> Result<Machine> {
    if !inventory::CUDA {
        bail!(
            "--machine local: this build has no CUDA, so it cannot query this box's GPUs; build one with scripts/build-cuda, or pass a profile such as sim/machines/2x-h200.yaml"
        );
    }
    let inv = inventory::query().context("--machine local")?;
    let m = inv
        .to_machine(&ProfileOptions {
            name: "local".into(),
            headroom,
            caps: BTreeMap::new(),
            date: inventory::today(),
            mold_version: env!("CARGO_PKG_VERSION").into(),
        })
        .context("--machine local")?;
    Ok(m)
}

/// The configuration with these flags on top.
fn settings(a: &Args) -> Result<mold_config::Settings> {
    let mut flags = Layer::default();
    if let Some(h) = &a.headroom {
        let size: ByteSize = h
            .parse()
            .map_err(|e: mold_plan::ByteSizeError| anyhow::anyhow!("--headroom: {e}"))?;
        flags.headroom = Some(Val::new(size, "--headroom"));
    }
    for s in &a.max_vram {
        let (d, size) = mold_config::parse_cap(s, "--max-vram")?;
        flags.max_vram.insert(d, Val::new(size, "--max-vram"));
    }
    Ok(mold_config::load(flags)?)
}

pub fn run(a: Args) -> Result<i32> {
    if !inventory::CUDA {
        eprintln!("{}", no_cuda_message("mold devices"));
        return Ok(NO_CUDA_EXIT);
    }
    let settings = settings(&a)?;
    let inv = inventory::query()?;
    let headroom = settings
        .headroom
        .as_ref()
        .map(|s| s.value)
        .unwrap_or(DEFAULT_HEADROOM);
    let caps: BTreeMap<DeviceId, ByteSize> = settings
        .max_vram
        .iter()
        .map(|(d, s)| (d.clone(), s.value))
        .collect();
    let budgets = inv
        .budgets(headroom, &caps)
        .with_context(|| cap_sources(&settings.max_vram))?;
    if a.json {
        let v = serde_json::json!({ "inventory": inv, "budgets": budgets });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", inv.table(&budgets));
    }
    if let Some(path) = &a.save {
        save(&a, path, &inv, headroom, caps)?;
    }
    Ok(0)
}

fn cap_sources(caps: &BTreeMap<DeviceId, Setting<ByteSize>>) -> String {
    let v: Vec<String> = caps
        .iter()
        .map(|(d, s)| format!("{d} from {}", s.source()))
        .collect();
    format!("max_vram ({})", v.join(", "))
}

fn save(
    a: &Args,
    path: &std::path::Path,
    inv: &Inventory,
    headroom: ByteSize,
    caps: BTreeMap<DeviceId, ByteSize>,
) -> Result<()> {
    let name = match &a.name {
        Some(n) => n.clone(),
        None => path
            .file_stem()
            .and_then(|s| s.to_str())
            .map(str::to_string)
            .with_context(|| format!("--save {}: name the profile with --name", path.display()))?,
    };
    let version = env!("CARGO_PKG_VERSION");
    let date = inventory::today();
    let mut m = inv.to_machine(&ProfileOptions {
        name,
        headroom,
        caps,
        date: date.clone(),
        mold_version: version.into(),
    })?;
    if a.calibrate {
        let r = inventory::calibrate(inv, &mut |s| eprintln!("calibrating: {s}"))?;
        #[cfg(feature = "nccl")]
        let r = calibrate_allreduce(inv, r);
        inventory::apply_measurements(&mut m, &r, &date, version);
        if !a.json {
            println!("\nmeasured:\n{}", serde_yaml_ng::to_string(&r)?);
        }
    }
    std::fs::write(path, m.to_yaml()).with_context(|| format!("--save {}", path.display()))?;
    // What was written must load back, here and on any other box.
    Machine::load(path)?;
    eprintln!(
        "machine profile written to {} ({})",
        path.display(),
        if a.calibrate {
            "measured"
        } else {
            "not calibrated: add --calibrate to measure"
        }
    );
    Ok(())
}

/// `r` with NCCL all-reduce measured over this box's GPUs (`r.allreduce`); a failure does
/// not end the calibration: it is noted in `r.not_measured` and the profile keeps
/// estimates.
#[cfg(feature = "nccl")]
fn calibrate_allreduce(inv: &Inventory, mut r: inventory::Measurements) -> inventory::Measurements {
    let ordinals: Vec<usize> = inv.devices.iter().map(|g| g.ordinal as usize).collect();
    if ordinals.len() < 2 {
        r.not_measured
            .push("all-reduce: not measured (fewer than two GPUs)".into());
        return r;
    }
    // The large message: 256 MiB, or an eighth of the least free memory where that is less.
    let min_free = inv.devices.iter().map(|g| g.free.0).min().unwrap_or(0);
    let watchdog = match mold_exec::comm::CommOptions::from_vars(|k| std::env::var(k).ok()) {
        Ok(o) => o.nccl_timeout,
        Err(e) => {
            r.not_measured
                .push(format!("all-reduce: not measured ({e})"));
            return r;
        }
    };
    let bench = mold_exec::calibrate::AllreduceBench {
        large_bytes: (min_free / 8 / MIB * MIB).clamp(MIB, 256 * MIB) as usize,
        watchdog,
        ..Default::default()
    };
    match mold_exec::calibrate::measure_allreduce(&ordinals, &bench, &mut |s| {
        eprintln!("calibrating: {s}")
    }) {
        Ok(a) => r.allreduce = Some(a),
        Err(e) => {
            eprintln!("calibrating: all-reduce not measured: {e}");
            r.not_measured.push(format!(
                "all-reduce: not measured (NCCL failed: {e}); the peer domains' and \
                 host-staged all-reduce figures are estimates"
            ));
        }
    }
    r
}

pub fn info(a: InfoArgs) -> Result<i32> {
    if a.gpus {
        if !inventory::CUDA {
            eprintln!("{}", no_cuda_message("mold info --gpus"));
            return Ok(NO_CUDA_EXIT);
        }
        return run(Args {
            json: a.json,
            save: None,
            calibrate: false,
            name: None,
            headroom: None,
            max_vram: Vec::new(),
        });
    }
    let settings = mold_config::load(Layer::default())?;
    let exec = super::exec_options::describe(&super::exec_options::EnvVars::process());
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("nccl", cfg!(feature = "nccl")),
    ]
    .into_iter()
    .filter(|(_, on)| *on)
    .map(|(f, _)| f)
    .collect();
    if a.json {
        let v = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "features": features,
            "config_file": settings.file,
            "config": settings.to_string().lines().collect::<Vec<_>>(),
            "exec": exec.iter().map(|(k, v, src)| serde_json::json!({"option": k, "value": v, "from": src})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("mold {}", env!("CARGO_PKG_VERSION"));
        println!(
            "features      {}",
            if features.is_empty() {
                "(none: no CUDA; build one with scripts/build-cuda)".to_string()
            } else {
                features.join(", ")
            }
        );
        print!("{settings}");
        println!("mold exec options (flags win over these):");
        for (k, v, src) in &exec {
            println!("  {k:<13} {v} (from {src})");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_grows_with_the_size() {
        let m = mold_models::find("flux-dev").unwrap();
        let mut w = m.default_workload.clone();
        let small = default_headroom(&m, &w);
        w.width *= 2;
        w.height *= 2;
        let big = default_headroom(&m, &w);
        assert!(small >= ByteSize(GIB), "{small}");
        assert!(big > small, "{big} vs {small}");
        assert_eq!(big.0 % (256 * MIB), 0);
    }

    #[test]
    fn no_cuda_message_says_how() {
        let s = no_cuda_message("mold devices");
        assert!(
            s.contains("scripts/build-cuda") && s.contains("no CUDA"),
            "{s}"
        );
    }
}
