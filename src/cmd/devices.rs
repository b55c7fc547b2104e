//! `mold devices` / `mold info --gpus`: this box's GPUs (CUDA builds), a machine profile
//! of them (`--save`), measured (`--calibrate`); `mold info`: the build and the
//! configuration in effect.
use anyhow::{bail, Context, Result};
use mold_config::{Layer, Setting, Val};
use mold_exec::calibrate::Timing;
use mold_machine::inventory::{self, Inventory, Measurements, ProfileOptions};
use mold_machine::{Machine, OpTables};
use mold_models::ModelSpec;
use mold_pipeline::calibrate::{
    Calibrated, Calibration, DeviceCalibration, FirstUseRun, Host, ModelCalibration,
};
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
    /// Write a machine profile of this box here (e.g. sim/machines/my-box.yaml). A file
    /// there is replaced only if it is a profile mold wrote and nobody edited since
    /// (else pass --force).
    #[arg(long, value_name = "YAML")]
    pub save: Option<PathBuf>,
    /// Replace the file at --save whatever it is (a symlink there is replaced, never
    /// written through).
    #[arg(long, alias = "overwrite")]
    pub force: bool,
    /// Measure the devices (bf16 matmul, memory bandwidth, host and peer copies; NCCL
    /// all-reduce on builds with the `nccl` feature) and write the figures into the saved
    /// profile; with --model, that model's operations too.
    #[arg(long)]
    pub calibrate: bool,
    /// With --calibrate: measure this model's operations through mold's own layers — its
    /// blocks' matrix products (full, tensor- and sequence-parallel shapes), attention
    /// over heads x sequence, the element-wise kernels, the collectives; for FLUX and
    /// Qwen-Image also their text encoders and VAE decoder (at half, the same and twice the default side), warm,
    /// and what their first run adds in a fresh process (child processes of this binary,
    /// as a one-shot `mold exec` meets it) — into the profile's `ops` tables, which the
    /// cost model then prices blocks, encode and decode from. Without --save the tables
    /// are printed.
    #[arg(long, value_name = "MODEL", requires = "calibrate")]
    pub model: Option<String>,
    /// With --calibrate --model: measure the devices of this profile (e.g.
    /// sim/machines/cpu-emu-4.yaml, emulated devices on the CPU) instead of this box's
    /// GPUs; its figures are kept, the tables added.
    #[arg(long, value_name = "PROFILE", requires = "model")]
    pub machine: Option<String>,
    /// With --model: measure at this output size WIDTHxHEIGHT too (repeatable), beside
    /// half, the same and twice the model's default side: the products, attention and
    /// (FLUX) decoder at the sequence a run at that size has, so its step is priced from
    /// measured points instead of between them.
    #[arg(long = "size", value_name = "WxH", requires = "model")]
    pub sizes: Vec<String>,
    /// With --model: the dtype to measure in (default: the model's transformer dtype).
    #[arg(long, value_name = "DTYPE", requires = "model")]
    pub dtype: Option<String>,
    /// With --model: how an operation on one device is timed: `mixed`, each operation
    /// timed inside its block, the block's operations back to back for 250 ms, at the
    /// clock the block's whole mix runs at under the power limit (the default on GPUs);
    /// `sustained`, each operation back to back by itself for 250 ms; or `alone`, each run
    /// drained before the next (the default on emulated devices, whose clocks do not
    /// settle under load).
    #[arg(long, value_name = "HOW", requires = "model", value_parser = ["sustained", "mixed", "alone"])]
    pub timing: Option<String>,
    /// Profile the box as one without peer access between its GPUs: no peer domains in
    /// the profile (hand-offs priced through host memory), and with --calibrate the
    /// collectives measured with NCCL kept off the GPU-to-GPU path (NCCL_P2P_DISABLE=1),
    /// the all-reduce saved as `links.host_staged_allreduce` and in the operation
    /// tables. Plans made on it run the same way with `mold exec --no-peer`.
    #[arg(long)]
    pub no_peer: bool,
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

/// `mold calibrate-first-use` (hidden): the fresh process `mold devices --calibrate
/// --model M` spawns to time its components' first runs
/// ([`mold_pipeline::calibrate::first_use`]); prints the runs as JSON on stdout.
#[derive(clap::Args, Debug)]
pub struct FirstUseArgs {
    /// The FLUX model whose text encoders and VAE decoder run.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// The device they run on (cuda:0, emu:0).
    #[arg(long, value_name = "DEVICE")]
    pub device: String,
    /// The decoded image's width.
    #[arg(long)]
    pub width: u32,
    /// The decoded image's height.
    #[arg(long)]
    pub height: u32,
    /// The machine profile the device is one of (the calibration's --machine).
    #[arg(long, value_name = "PROFILE")]
    pub machine: Option<String>,
}

/// `mold calibrate-footprint` (hidden): the fresh process `mold devices --calibrate
/// --model M` spawns on a GPU to measure the CUDA libraries' device memory
/// ([`mold_exec::calibrate_footprint`]); prints it as one line of JSON on stdout.
#[derive(clap::Args, Debug)]
pub struct FootprintArgs {
    /// The model whose blocks' operations run once.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// The GPU they run on (cuda:0).
    #[arg(long, value_name = "DEVICE")]
    pub device: String,
    /// The dtype they run in (default: the model's transformer dtype).
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// The machine profile the device is one of (the calibration's --machine).
    #[arg(long, value_name = "PROFILE")]
    pub machine: Option<String>,
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
    Ok(local_machine_adopting(headroom)?.0)
}

/// [`local_machine`] and the operation tables it took from the profiles mold ships for
/// its GPUs (`mold_machine::shipped`): a box nobody calibrated is priced from measurement
/// where mold has measured its GPUs.
pub fn local_machine_adopting(
    headroom: ByteSize,
) -> Result<(Machine, Vec<mold_machine::shipped::Adopted>)> {
    let (mut m, inv) = local_inventory(headroom)?;
    // This box's own calibration, kept by `mold devices --calibrate`, comes first.
    let mut adopted = Vec::new();
    if let Some(dir) = mold_config::cache_dir(|k| std::env::var(k).ok()) {
        match mold_machine::box_cache::load(&dir, &inv) {
            Ok(Some(kept)) => adopted.extend(mold_machine::box_cache::adopt(&mut m, &kept)),
            Ok(None) => {}
            Err(e) => eprintln!(
                "warning: this box's kept calibration is unreadable and passed over ({e}); \
                 the next `mold devices --calibrate` replaces it"
            ),
        }
    }
    let own = adopted.len();
    adopted.extend(m.adopt_tables(&mold_machine::shipped::profiles()));
    let list = |a: &[mold_machine::shipped::Adopted]| -> String {
        a.iter()
            .map(|a| a.describe())
            .collect::<Vec<_>>()
            .join("; ")
    };
    if own > 0 {
        m.calibration.notes = format!(
            "{} Operation tables measured on this box by `mold devices --calibrate` (kept in \
             mold's cache directory): {}.",
            m.calibration.notes,
            list(&adopted[..own])
        )
        .trim()
        .to_string();
    }
    if adopted.len() > own {
        m.calibration.notes = format!(
            "{} Operation tables shipped with mold, not measured on this box: {}.",
            m.calibration.notes,
            list(&adopted[own..])
        )
        .trim()
        .to_string();
    }
    Ok((m, adopted))
}

/// This box's GPUs as queried now, nothing adopted.
pub fn local_inventory_machine(headroom: ByteSize) -> Result<Machine> {
    Ok(local_inventory(headroom)?.0)
}

/// [`local_inventory_machine`] and the inventory it was made from.
fn local_inventory(headroom: ByteSize) -> Result<(Machine, Inventory)> {
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
    Ok((m, inv))
}

/// Why a calibration was not measured as this box runs plans by default, if it was not:
/// then it prices another box and is not kept for `--machine local`.
fn not_as_the_box_runs(a: &Args, get: impl Fn(&str) -> Option<String>) -> Option<String> {
    if a.no_peer {
        return Some("measured as a box without peer access (--no-peer)".into());
    }
    for var in [
        "NCCL_P2P_DISABLE",
        "NCCL_P2P_LEVEL",
        "NCCL_ALGO",
        "NCCL_PROTO",
    ] {
        if get(var).is_some_and(|v| !v.trim().is_empty()) {
            return Some(format!(
                "{var} is set, so the collectives were measured unlike a plain run"
            ));
        }
    }
    if get("MOLD_KERNELS").is_some_and(|v| !matches!(v.trim(), "" | "auto")) {
        return Some("MOLD_KERNELS is not auto, so the operations ran other kernels".into());
    }
    // MOLD_FP8_ATTENTION is not among them: calibration measures attention in both.
    if mold_exec::Fp8Options::from_vars(&get).is_ok_and(|o| {
        mold_exec::Fp8Options {
            attention: None,
            ..o
        } != mold_exec::Fp8Options::default()
    }) {
        return Some(
            "a MOLD_FP8_* variable is not its default, so FP8 products ran otherwise".into(),
        );
    }
    if a.timing.as_deref().is_some_and(|t| t != "mixed") {
        return Some("--timing is not mixed, the way operations are timed for the tables".into());
    }
    None
}

/// Keeps `m`, a profile of this box just measured, in mold's cache directory, where
/// `--machine local` finds it (`mold_machine::box_cache`); says where, or why not.
fn keep_for_this_box(a: &Args, inv: &Inventory, m: &Machine) {
    if m.ops.is_empty() {
        return;
    }
    if let Some(why) = not_as_the_box_runs(a, |k| std::env::var(k).ok()) {
        eprintln!("note: the calibration is not kept for `--machine local`: {why}");
        return;
    }
    let Some(dir) = mold_config::cache_dir(|k| std::env::var(k).ok()) else {
        eprintln!(
            "note: no cache directory (MOLD_CACHE_DIR, XDG_CACHE_HOME or HOME): the \
             calibration is not kept for `--machine local`"
        );
        return;
    };
    match mold_machine::box_cache::keep(&dir, inv, m) {
        Ok(p) => eprintln!(
            "calibration kept for this box in {} (`mold plan --machine local` uses it)",
            p.display()
        ),
        Err(e) => eprintln!("warning: the calibration is not kept for `--machine local`: {e}"),
    }
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
    if a.calibrate && a.save.is_none() && a.model.is_none() {
        bail!(
            "--calibrate: name the profile to write with --save FILE (or measure one model's \
             operations with --model MODEL)"
        );
    }
    // A file at --save that mold may not replace is refused before anything is measured.
    if let Some(path) = &a.save {
        profile_dest(&a, path).check(mold_files::Mine::Stamped(mold_files::Stamp::HashComment))?;
    }
    if a.no_peer {
        super::common::no_peer_access();
    }
    if let Some(spec) = &a.machine {
        return calibrate_profile(&a, spec);
    }
    if !inventory::CUDA {
        eprintln!("{}", no_cuda_message("mold devices"));
        if a.model.is_some() {
            eprintln!(
                "To measure a model's operations on emulated devices: mold devices --calibrate \
                 --model MODEL --machine sim/machines/cpu-emu-4.yaml"
            );
        }
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
    } else if let Some(model) = &a.model {
        // The tables alone, for this box as queried.
        let mut m = inv.to_machine(&ProfileOptions {
            name: "local".into(),
            headroom,
            caps,
            date: inventory::today(),
            mold_version: env!("CARGO_PKG_VERSION").into(),
        })?;
        without_peers(&a, &mut m);
        let req = model_request(&a, model)?;
        let done = calibrate(&a, &mut m, None, Some(req))?;
        print!("{}", ops_yaml(&done.tables)?);
        keep_for_this_box(&a, &inv, &m);
    }
    Ok(0)
}

/// `mold calibrate-first-use`: `a.model`'s components run first in this process on
/// `a.device`, the runs printed as one line of JSON.
pub fn first_use(a: FirstUseArgs) -> Result<i32> {
    let id: DeviceId = a
        .device
        .parse()
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", a.device))?;
    if let Some(spec) = &a.machine {
        let m = super::common::load_machine(spec)?;
        if m.device(&id).is_none() {
            bail!("--device {id}: not a device of the machine profile {spec}");
        }
    }
    let dev = mold_exec::runtime::DeviceMap::new(false)
        .get(&id)
        .map_err(|e| anyhow::anyhow!("{id}: {e}"))?;
    // The decoder `mold exec` would run here (MOLD_KERNELS, inherited from the parent).
    let kernels = mold_exec::Kernels::parse(&std::env::var("MOLD_KERNELS").unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let runs = mold_pipeline::calibrate::first_use(
        &a.model,
        &dev,
        (a.width, a.height),
        &Default::default(),
        mold_pipeline::flux::vae::VaeOptions::with_kernels(kernels),
        &mut |s| eprintln!("calibrating: {s} on {id}"),
    )?;
    eprintln!("{}", mold_exec::model::plan_cache::counts());
    println!("{}", serde_json::to_string(&runs)?);
    Ok(0)
}

/// `mold calibrate-footprint`: the CUDA libraries' device memory on `a.device` once
/// `a.model`'s blocks have run in this process, printed as one line of JSON. The memory
/// probe is made before anything else touches the GPU: its baseline is the device with
/// this process's CUDA context and nothing more.
pub fn footprint(a: FootprintArgs) -> Result<i32> {
    let id: DeviceId = a
        .device
        .parse()
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", a.device))?;
    let DeviceId::Cuda(ordinal) = id else {
        bail!(
            "--device {id}: no allocator to read on emulated devices or the host: the CUDA \
             libraries' device memory is measured on GPUs (cuda:N) only"
        );
    };
    if let Some(spec) = &a.machine {
        let m = super::common::load_machine(spec)?;
        if m.device(&id).is_none() {
            bail!("--device {id}: not a device of the machine profile {spec}");
        }
    }
    let spec = mold_models::find(&a.model).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
    let dtype = match &a.dtype {
        Some(d) => d
            .parse::<mold_plan::DType>()
            .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
        None => spec.transformer.default_dtype,
    };
    let blocks = mold_exec::calibrate::footprint_ops(&spec, dtype)?;
    let kernels = mold_exec::Kernels::parse(&std::env::var("MOLD_KERNELS").unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let probe = mold_exec::memory_probe::allocator_probe(&[(id.clone(), ordinal as usize)])?
        .with_context(|| {
            format!("--device {id}: this build has no CUDA, so there is no allocator to read")
        })?;
    let f =
        mold_exec::calibrate::measure_footprint(&probe, &id, dtype, &blocks, kernels, &mut |s| {
            eprintln!("calibrating: {s}")
        })?;
    println!("{}", serde_json::to_string(&f)?);
    Ok(0)
}

/// One `mold calibrate-first-use` child and what it printed.
fn first_use_child(
    model: &str,
    machine: Option<&str>,
    device: &DeviceId,
    (w, h): (u32, u32),
) -> Result<Vec<mold_pipeline::calibrate::FirstUseRun>> {
    let mut args: Vec<String> = ["calibrate-first-use", "--model", model, "--device"]
        .map(String::from)
        .into();
    args.push(device.to_string());
    args.extend([
        "--width".into(),
        w.to_string(),
        "--height".into(),
        h.to_string(),
    ]);
    if let Some(m) = machine {
        args.extend(["--machine".into(), m.to_string()]);
    }
    let line = child_line(&args)?;
    serde_json::from_str(&line)
        .with_context(|| format!("the child process printed `{line}`, not its runs as JSON"))
}

/// This binary run with `args` in a child process: the last line it printed on stdout,
/// or an error with its last line on stderr where it failed.
fn child_line(args: &[String]) -> Result<String> {
    let exe = std::env::current_exe().context("the mold binary's path")?;
    let o = std::process::Command::new(&exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot start {}", exe.display()))?;
    let last = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(|l| l.trim().to_string())
    };
    if !o.status.success() {
        bail!(
            "the child process failed ({}): {}",
            o.status,
            last(&o.stderr).unwrap_or_else(|| "no message".into())
        );
    }
    last(&o.stdout).context("the child process printed nothing")
}

/// One `mold calibrate-footprint` child and what it printed.
fn footprint_child(
    model: &str,
    machine: Option<&str>,
    dtype: mold_plan::DType,
    device: &DeviceId,
) -> Result<mold_exec::calibrate::Footprint> {
    let mut args: Vec<String> = vec![
        "calibrate-footprint".into(),
        "--model".into(),
        model.into(),
        "--device".into(),
        device.to_string(),
        "--dtype".into(),
        dtype.to_string(),
    ];
    if let Some(m) = machine {
        args.extend(["--machine".into(), m.to_string()]);
    }
    let line = child_line(&args)?;
    serde_json::from_str(&line).with_context(|| {
        format!("the child process printed `{line}`, not the libraries' memory as JSON")
    })
}

/// `mold devices --calibrate --model M --machine PROFILE`: the profile's devices
/// measured, the tables added to it (`--save`) or printed.
fn calibrate_profile(a: &Args, spec: &str) -> Result<i32> {
    let model = a.model.as_deref().context("--machine needs --model")?;
    let mut m = super::common::load_machine_unadopted(spec)?;
    without_peers(a, &mut m);
    let req = model_request(a, model)?;
    if let (Some(_), Some(n)) = (&a.save, &a.name) {
        m.name = n.clone();
    }
    let done = calibrate(a, &mut m, None, Some(req))?;
    match &a.save {
        Some(path) => {
            write_profile(a, path, &m)?;
            eprintln!(
                "machine profile written to {} ({spec} with operation tables for {model})",
                path.display()
            );
        }
        None => print!("{}", ops_yaml(&done.tables)?),
    }
    Ok(0)
}

/// With `--no-peer`: the profile without its peer domains, so every group of its devices
/// is priced as staged through host memory; noted in its description.
fn without_peers(a: &Args, m: &mut Machine) {
    if a.no_peer && !m.links.peer.is_empty() {
        m.links.peer.clear();
        m.description = format!(
            "{} Profiled without peer access (`mold devices --no-peer`): hand-offs and \
             collectives through host memory; run its plans with `mold exec --no-peer`.",
            m.description.trim_end()
        );
    }
}

/// The tables as a profile's `ops:` list.
fn ops_yaml(t: &[(OpTables, Timing)]) -> Result<String> {
    #[derive(serde::Serialize)]
    struct Ops<'a> {
        ops: Vec<&'a OpTables>,
    }
    let ops = t.iter().map(|(t, _)| t).collect();
    Ok(serde_yaml_ng::to_string(&Ops { ops })?)
}

/// `--save PATH` as mold-files sees it: replaced only if mold wrote it and nobody edited
/// it since, or with --force.
fn profile_dest<'a>(a: &'a Args, path: &'a std::path::Path) -> mold_files::Dest<'a> {
    mold_files::Dest {
        path,
        flag: "--save",
        what: "machine profile",
        force_flag: "--force",
        force: a.force,
    }
}

/// Writes `m` to `path` (stamped, atomically: never through a symlink, never half a file)
/// and loads it back: what was written must load, here and on any other box.
fn write_profile(a: &Args, path: &std::path::Path, m: &Machine) -> Result<()> {
    profile_dest(a, path).write_stamped(mold_files::Stamp::HashComment, m.to_yaml().as_bytes())?;
    Machine::load(path)?;
    Ok(())
}

/// `--model` and the flags that go with it, resolved and checked: each bad one refused in
/// one line naming it, before anything is measured.
fn model_request(a: &Args, model: &str) -> Result<ModelCalibration> {
    let spec = mold_models::find(model).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
    let dtype = match &a.dtype {
        Some(d) => d
            .parse::<mold_plan::DType>()
            .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
        None => spec.transformer.default_dtype,
    };
    mold_exec::weights_dtype(dtype).map_err(|e| anyhow::anyhow!("--dtype {dtype}: {e}"))?;
    mold_pipeline::calibrate::check_model(&spec)
        .map_err(|e| anyhow::anyhow!("--model {model}: {e}"))?;
    let mut extra = Vec::new();
    for size in &a.sizes {
        let (width, height) = super::common::parse_size("--size", size)?;
        let w = Workload {
            width,
            height,
            ..spec.default_workload.clone()
        };
        spec.check_workload(&w)
            .map_err(|e| anyhow::anyhow!("--size {size}: {e}"))?;
        extra.push(w);
    }
    let kernels = mold_exec::Kernels::parse(&std::env::var("MOLD_KERNELS").unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut comm = mold_exec::comm::CommOptions::from_vars(|k| std::env::var(k).ok())?;
    // FP8 products measured as `mold exec` runs them here.
    mold_exec::model::fp8::configure(
        mold_exec::Fp8Options::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    // Measured as `mold exec --no-peer` runs: the all-to-alls by NCCL, not by peer copies.
    comm.exchange_beside &= !a.no_peer;
    Ok(ModelCalibration {
        model: model.into(),
        spec,
        dtype,
        extra,
        timing: a.timing.as_deref().map(timing_flag),
        kernels,
        comm,
    })
}

/// `--timing`'s value (clap admits only these three).
fn timing_flag(named: &str) -> Timing {
    match named {
        "alone" => Timing::Alone,
        "sustained" => Timing::SUSTAINED,
        _ => Timing::MIXED,
    }
}

/// [`mold_pipeline::calibrate::calibrate`] on `m`: the devices of `devices`, the model of
/// `model`, progress on stderr, fresh processes as children of this binary.
fn calibrate(
    a: &Args,
    m: &mut Machine,
    devices: Option<&Inventory>,
    model: Option<ModelCalibration>,
) -> Result<Calibrated> {
    let c = Calibration {
        devices: devices.map(|inv| DeviceCalibration {
            inventory: inv,
            watchdog: mold_exec::comm::CommOptions::from_vars(|k| std::env::var(k).ok())
                .map(|o| o.nccl_timeout)
                .map_err(|e| e.to_string()),
        }),
        model,
        date: inventory::today(),
        mold_version: env!("CARGO_PKG_VERSION").into(),
    };
    let mut host = Children {
        machine: a.machine.as_deref(),
        json: a.json,
    };
    Ok(mold_pipeline::calibrate::calibrate(m, c, &mut host)?)
}

/// What the calibration asks of the CLI: its progress on stderr, the devices' figures on
/// stdout (unless --json), and fresh processes: children of this binary (`mold
/// calibrate-first-use`, `mold calibrate-footprint`) on the devices of `machine` (the
/// calibration's --machine) where it names a profile.
struct Children<'a> {
    machine: Option<&'a str>,
    json: bool,
}

impl Host for Children<'_> {
    fn say(&mut self, line: &str) {
        eprintln!("{line}");
    }

    fn measured(&mut self, r: &Measurements) {
        if self.json {
            return;
        }
        match serde_yaml_ng::to_string(r) {
            Ok(y) => println!("\nmeasured:\n{y}"),
            Err(e) => eprintln!("calibrating: the measurements cannot be shown: {e}"),
        }
    }

    fn first_use(
        &mut self,
        model: &str,
        device: &DeviceId,
        size: (u32, u32),
    ) -> std::result::Result<Vec<FirstUseRun>, String> {
        first_use_child(model, self.machine, device, size).map_err(|e| format!("{e:#}"))
    }

    fn footprint(
        &mut self,
        model: &str,
        dtype: mold_plan::DType,
        device: &DeviceId,
    ) -> std::result::Result<mold_exec::calibrate::Footprint, String> {
        footprint_child(model, self.machine, dtype, device).map_err(|e| format!("{e:#}"))
    }
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
    let mut m = inv.to_machine(&ProfileOptions {
        name,
        headroom,
        caps,
        date: inventory::today(),
        mold_version: env!("CARGO_PKG_VERSION").into(),
    })?;
    without_peers(a, &mut m);
    let model = a
        .model
        .as_deref()
        .map(|model| model_request(a, model))
        .transpose()?;
    if a.calibrate || model.is_some() {
        calibrate(a, &mut m, a.calibrate.then_some(inv), model)?;
    }
    write_profile(a, path, &m)?;
    keep_for_this_box(a, inv, &m);
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

pub fn info(a: InfoArgs) -> Result<i32> {
    if a.gpus {
        if !inventory::CUDA {
            eprintln!("{}", no_cuda_message("mold info --gpus"));
            return Ok(NO_CUDA_EXIT);
        }
        return run(Args {
            json: a.json,
            save: None,
            force: false,
            calibrate: false,
            model: None,
            machine: None,
            sizes: Vec::new(),
            dtype: None,
            timing: None,
            name: None,
            headroom: None,
            max_vram: Vec::new(),
            no_peer: false,
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

    /// `--timing` names the timing, whatever the devices (their default:
    /// `mold_pipeline::calibrate`'s `operations_on_gpus_are_timed_in_their_mix_by_default`).
    #[test]
    fn a_calibration_unlike_a_plain_run_is_not_kept() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        use clap::Parser;
        let args = |flags: &[&str]| {
            let mut v = vec!["mold-devices", "--calibrate", "--model", "flux-dev"];
            v.extend_from_slice(flags);
            Cli::parse_from(v).a
        };
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(not_as_the_box_runs(&args(&[]), env(&[])), None);
        assert_eq!(
            not_as_the_box_runs(
                &args(&["--timing", "mixed"]),
                env(&[("MOLD_KERNELS", "auto"), ("MOLD_FP8_FUSE", "on")])
            ),
            None
        );
        for (flags, vars, why) in [
            (&["--no-peer"][..], &[][..], "--no-peer"),
            (
                &[][..],
                &[("NCCL_P2P_DISABLE", "1")][..],
                "NCCL_P2P_DISABLE",
            ),
            (&[][..], &[("NCCL_ALGO", "Tree")][..], "NCCL_ALGO"),
            (&[][..], &[("MOLD_KERNELS", "candle")][..], "MOLD_KERNELS"),
            (&[][..], &[("MOLD_FP8_FAST_ACCUM", "off")][..], "MOLD_FP8_*"),
            (&["--timing", "alone"][..], &[][..], "--timing"),
        ] {
            let vars: &'static [(&'static str, &'static str)] =
                Box::leak(vars.to_vec().into_boxed_slice());
            let got = not_as_the_box_runs(&args(flags), env(vars)).unwrap_or_default();
            assert!(got.contains(why), "{flags:?} {vars:?}: {got}");
        }
    }

    #[test]
    fn the_timing_flag_names_the_timing() {
        assert_eq!(timing_flag("sustained"), Timing::SUSTAINED);
        assert_eq!(timing_flag("alone"), Timing::Alone);
        assert_eq!(timing_flag("mixed"), Timing::MIXED);
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
