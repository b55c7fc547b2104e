//! `mold devices` / `mold info --gpus`: this box's GPUs (CUDA builds), a machine profile
//! of them (`--save`), measured (`--calibrate`); `mold info`: the build and the
//! configuration in effect.
use anyhow::{bail, Context, Result};
use mold_config::{Layer, Setting, Val};
use mold_exec::calibrate_ops::Timing;
use mold_machine::inventory::{self, Inventory, ProfileOptions};
use mold_machine::{Machine, OpTables};
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
    /// profile; with --model, that model's operations too.
    #[arg(long)]
    pub calibrate: bool,
    /// With --calibrate: measure this model's operations through mold's own layers — its
    /// blocks' matrix products (full, tensor- and sequence-parallel shapes), attention
    /// over heads x sequence, the element-wise kernels, the collectives; for FLUX also its
    /// text encoders and VAE decoder (at half, the same and twice the default side), warm,
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
    if a.calibrate && a.save.is_none() && a.model.is_none() {
        bail!(
            "--calibrate: name the profile to write with --save FILE (or measure one model's \
             operations with --model MODEL)"
        );
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
        let t = measure_model_ops(&a, &m, model)?;
        print!("{}", ops_yaml(&t)?);
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
    let runs = mold_pipeline::calibrate::first_use(
        &a.model,
        &dev,
        (a.width, a.height),
        &Default::default(),
        &mut |s| eprintln!("calibrating: {s} on {id}"),
    )?;
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
    let blocks = mold_exec::calibrate_footprint::footprint_ops(&spec, dtype)?;
    let kernels = mold_exec::Kernels::parse(&std::env::var("MOLD_KERNELS").unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let probe = mold_exec::memory_probe::allocator_probe(&[(id.clone(), ordinal as usize)])?
        .with_context(|| {
            format!("--device {id}: this build has no CUDA, so there is no allocator to read")
        })?;
    let f = mold_exec::calibrate_footprint::measure_footprint(
        &probe,
        &id,
        dtype,
        &blocks,
        kernels,
        &mut |s| eprintln!("calibrating: {s}"),
    )?;
    println!("{}", serde_json::to_string(&f)?);
    Ok(0)
}

/// Fresh processes [`measure_first_use`] runs at least: first use varies from process
/// to process by a third, so its mean needs a few.
const FIRST_USE_PROCESSES: usize = 5;

/// Each component's first run in a fresh process on `device` (of the profile `machine`,
/// where the calibration was given one), into `points`' `first_use_seconds`: children
/// (`mold calibrate-first-use`, this binary), each running the text encoders and then
/// the decoder, as a one-shot `mold exec` does — one per decoder size, and at least
/// [`FIRST_USE_PROCESSES`], taking the sizes in turn; each point gets the mean of its
/// runs. A child that cannot start or fails is said in one line and the calibration goes
/// on without its figures.
fn measure_first_use(
    model: &str,
    machine: Option<&str>,
    device: &DeviceId,
    sizes: &[(u32, u32)],
    points: &mut [mold_machine::ComponentPoint],
) {
    let mut runs = Vec::new();
    let n = sizes.len().max(FIRST_USE_PROCESSES);
    for &(w, h) in sizes.iter().cycle().take(n) {
        eprintln!(
            "calibrating: first use of the encoders and the vae decoding {w}x{h} in a fresh \
             process on {device}"
        );
        match first_use_child(model, machine, device, (w, h)) {
            Ok(r) => runs.extend(r),
            Err(e) => eprintln!(
                "calibrating: first use in a fresh process not measured ({w}x{h} on \
                 {device}): {e:#}"
            ),
        }
    }
    mold_pipeline::calibrate::record_first_use(points, &runs);
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

/// Fresh processes [`measure_libraries`] runs: their median is kept.
const FOOTPRINT_PROCESSES: usize = 3;

/// The CUDA libraries' device memory on `device` (a GPU, of the profile `machine` where
/// the calibration was given one) with `model`'s blocks run in `dtype`: children (`mold
/// calibrate-footprint`, this binary), [`FOOTPRINT_PROCESSES`] of them, the median kept
/// (the upper one of two), rounded up to MiB. A child that cannot start or fails is said
/// in one line and the calibration goes on; `None` where none succeeded.
fn measure_libraries(
    model: &str,
    machine: Option<&str>,
    dtype: mold_plan::DType,
    device: &DeviceId,
) -> Option<ByteSize> {
    let mut bytes = Vec::new();
    for i in 1..=FOOTPRINT_PROCESSES {
        eprintln!(
            "calibrating: the CUDA libraries' device memory in a fresh process on {device} \
             ({i} of {FOOTPRINT_PROCESSES})"
        );
        match footprint_child(model, machine, dtype, device) {
            Ok(f) => bytes.push(f.library_bytes),
            Err(e) => eprintln!(
                "calibrating: the CUDA libraries' device memory not measured ({device}): {e:#}"
            ),
        }
    }
    median_bytes(bytes)
}

/// The median of `bytes` (the upper of the middle two for an even count), rounded up to
/// MiB; `None` for none.
fn median_bytes(mut bytes: Vec<u64>) -> Option<ByteSize> {
    bytes.sort_unstable();
    bytes.get(bytes.len() / 2).map(|&b| ByteSize(b).ceil_mib())
}

/// One `mold calibrate-footprint` child and what it printed.
fn footprint_child(
    model: &str,
    machine: Option<&str>,
    dtype: mold_plan::DType,
    device: &DeviceId,
) -> Result<mold_exec::calibrate_footprint::Footprint> {
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
    let mut m = super::common::load_machine(spec)?;
    without_peers(a, &mut m);
    let t = measure_model_ops(a, &m, model)?;
    match &a.save {
        Some(path) => {
            if let Some(n) = &a.name {
                m.name = n.clone();
            }
            for (t, timing) in t {
                add_tables(&mut m, t, timing);
            }
            write_profile(path, &m)?;
            eprintln!(
                "machine profile written to {} ({spec} with operation tables for {model})",
                path.display()
            );
        }
        None => print!("{}", ops_yaml(&t)?),
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

/// `t` into `m` (in place of any table of the same model, dtype and devices), noted in
/// its calibration.
fn add_tables(m: &mut Machine, t: OpTables, timing: Timing) {
    let note = format!(
        "Operation tables for {} {} on {} measured by mold {} on {} (`mold devices \
         --calibrate --model {}`: {} matrix products, {} attention shapes, element-wise \
         kernels, {} collective sizes, {} text-encoder and VAE runs{}; operations timed {}, \
         collectives, encoders and the decoder each run alone).",
        t.model,
        t.dtype,
        t.device,
        env!("CARGO_PKG_VERSION"),
        inventory::today(),
        t.model,
        t.gemm.len(),
        t.attention.len(),
        t.collectives.all_reduce.len()
            + t.collectives.all_gather.len()
            + t.collectives.all_to_all.len(),
        t.components.len(),
        if t.library_bytes.is_some() {
            ", the CUDA libraries' device memory in fresh processes"
        } else {
            ""
        },
        timing.describe()
    );
    let notes = &mut m.calibration.notes;
    if !notes.is_empty() {
        notes.push(' ');
    }
    notes.push_str(&note);
    m.set_op_tables(t);
}

/// Writes `m` to `path` and loads it back: what was written must load, here and on any
/// other box.
fn write_profile(path: &std::path::Path, m: &Machine) -> Result<()> {
    std::fs::write(path, m.to_yaml()).with_context(|| format!("--save {}", path.display()))?;
    Machine::load(path)?;
    Ok(())
}

/// The devices of `m` on its first device's node (the one this process reaches) by kind
/// (device name), kinds in the order their first device appears: each kind gets its own
/// operation tables (the cost model looks tables up by device name, so other nodes'
/// devices of the same name share them).
fn device_kinds(m: &Machine) -> Vec<Vec<DeviceId>> {
    let Some(node) = m.devices.first().map(|d| &d.node) else {
        return Vec::new();
    };
    let mut kinds: Vec<Vec<DeviceId>> = Vec::new();
    for d in m.devices.iter().filter(|d| &d.node == node) {
        let same = |k: &&mut Vec<DeviceId>| m.device(&k[0]).is_some_and(|f| f.name == d.name);
        match kinds.iter_mut().find(|k| same(k)) {
            Some(k) => k.push(d.id.clone()),
            None => kinds.push(vec![d.id.clone()]),
        }
    }
    kinds
}

/// Measures `model`'s operations on each kind of device in `m` (on its first device;
/// collectives over the first 2, 4, … of that kind), at the shapes the cost model looks
/// up for the model's default size at half, the same and twice its side: one table per
/// kind, in the order [`device_kinds`] gives.
fn measure_model_ops(a: &Args, m: &Machine, model: &str) -> Result<Vec<(OpTables, Timing)>> {
    let spec = mold_models::find(model).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
    let dtype = match &a.dtype {
        Some(d) => d
            .parse::<mold_plan::DType>()
            .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
        None => spec.transformer.default_dtype,
    };
    mold_exec::compute_dtype(dtype).map_err(|e| anyhow::anyhow!("--dtype {dtype}: {e}"))?;
    let tokens = spec.tokens(&spec.default_workload);
    if let Some(k) = spec
        .transformer
        .kinds
        .iter()
        .find(|k| mold_cost::ops::block_ops(k, tokens, 1, 1, 1, 2).is_none())
    {
        bail!(
            "--model {model}: its `{}` blocks have no operation breakdown (mold prices FLUX's \
             double and single blocks by operation): calibrate a FLUX model",
            k.name
        );
    }
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
    let kinds = device_kinds(m);
    if kinds.is_empty() {
        bail!("the machine profile has no device");
    }
    let mut tables = Vec::new();
    for devices in &kinds {
        let first = m.device(&devices[0]).context("a device of the profile")?;
        if kinds.len() > 1 {
            eprintln!(
                "calibrating {} ({} of this kind: {})",
                first.name,
                devices.len(),
                devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        tables.push(measure_kind(
            a, model, &spec, dtype, first, devices, &extra,
        )?);
    }
    Ok(tables)
}

/// [`measure_model_ops`] for one kind of device: `devices`, `first` of them, of the
/// profile `a.machine` where the calibration names one (`--machine`); the tables and how
/// they were timed.
fn measure_kind(
    a: &Args,
    model: &str,
    spec: &ModelSpec,
    dtype: mold_plan::DType,
    first: &mold_machine::Device,
    devices: &[DeviceId],
    extra: &[Workload],
) -> Result<(OpTables, Timing)> {
    let machine = a.machine.as_deref();
    let timing = op_timing(a.timing.as_deref(), devices);
    let sizes: Vec<u32> = inventory::allreduce_group_sizes(devices.len())
        .into_iter()
        .map(|n| n as u32)
        .collect();
    let mut req = mold_cost::ops::ShapeRequest::default_for(spec, devices.len() as u32, sizes);
    req.workloads.extend(extra.iter().cloned());
    let shapes = mold_cost::ops::calibration_shapes(spec, dtype, &req);
    let kernels = mold_exec::Kernels::parse(&std::env::var("MOLD_KERNELS").unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let comm = mold_exec::comm::CommOptions::from_vars(|k| std::env::var(k).ok())?;
    let bench = mold_exec::calibrate_ops::OpBench {
        kernels,
        comm,
        timing,
        ..Default::default()
    };
    let t = mold_exec::calibrate_ops::measure_ops(
        &mold_exec::calibrate_ops::OpTarget {
            model,
            dtype,
            device_name: &first.name,
            devices,
        },
        &shapes,
        &bench,
        &mut |s| eprintln!("calibrating: {s}"),
    )?;
    let mut t = t;
    if mold_exec::FluxConfig::by_name(model).is_some() {
        // The text encoders, and the VAE at half, the same and twice the default side.
        let (w, h) = (spec.default_workload.width, spec.default_workload.height);
        let mut sizes = vec![(w / 2, h / 2), (w, h), (w * 2, h * 2)];
        sizes.extend(extra.iter().map(|x| (x.width, x.height)));
        sizes.sort_by_key(|&(w, h)| (u64::from(w) * u64::from(h), w));
        sizes.dedup();
        let dev = mold_exec::runtime::DeviceMap::new(false)
            .get(&first.id)
            .map_err(|e| anyhow::anyhow!("{}: {e}", first.id))?;
        t.components = mold_pipeline::calibrate::time_components(
            model,
            &dev,
            &sizes,
            &Default::default(),
            &mut |s| eprintln!("calibrating: {s} on {}", first.id),
        )?;
        // This process has run its products by now: first use needs fresh ones.
        measure_first_use(model, machine, &first.id, &sizes, &mut t.components);
        t.sort();
    }
    if matches!(first.id, DeviceId::Cuda(_)) {
        // In fresh processes: this one has loaded every library by now.
        t.library_bytes = measure_libraries(model, machine, dtype, &first.id);
    }
    let first_use = t
        .components
        .iter()
        .filter_map(|p| {
            let unit = if p.component == "vae" { "px" } else { "tokens" };
            p.first_use_seconds
                .map(|f| format!("{} ({} {unit}) {:.1} ms", p.component, p.size, f * 1e3))
        })
        .collect::<Vec<_>>();
    eprintln!(
        "operation tables: {model} {dtype} on {}: {} matrix products, {} attention shapes, \
         element-wise {:.1} GB/s, {} encoder and decoder runs{}{}",
        first.name,
        t.gemm.len(),
        t.attention.len(),
        t.elementwise_gbps,
        t.components.len(),
        match t.library_bytes {
            Some(b) => format!("; CUDA libraries' device memory {}", b.human()),
            None => String::new(),
        },
        if first_use.is_empty() {
            String::new()
        } else {
            format!("; first use in a fresh process: {}", first_use.join(", "))
        }
    );
    Ok((t, timing))
}

/// `--timing`: as named, else mixed on GPUs and alone on emulated devices (the CPU's
/// clocks do not settle under a GPU's power limit, and tests stay fast).
fn op_timing(named: Option<&str>, devices: &[DeviceId]) -> Timing {
    match named {
        Some("alone") => Timing::Alone,
        Some("sustained") => Timing::SUSTAINED,
        Some(_) => Timing::MIXED,
        None if devices.iter().all(|d| matches!(d, DeviceId::Cuda(_))) => Timing::MIXED,
        None => Timing::Alone,
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
    let version = env!("CARGO_PKG_VERSION");
    let date = inventory::today();
    let mut m = inv.to_machine(&ProfileOptions {
        name,
        headroom,
        caps,
        date: date.clone(),
        mold_version: version.into(),
    })?;
    without_peers(a, &mut m);
    if a.calibrate {
        let r = inventory::calibrate(inv, &mut |s| eprintln!("calibrating: {s}"))?;
        #[cfg(feature = "nccl")]
        let r = calibrate_allreduce(inv, r);
        inventory::apply_measurements(&mut m, &r, &date, version);
        if !a.json {
            println!("\nmeasured:\n{}", serde_yaml_ng::to_string(&r)?);
        }
    }
    if let Some(model) = &a.model {
        for (t, timing) in measure_model_ops(a, &m, model)? {
            add_tables(&mut m, t, timing);
        }
    }
    write_profile(path, &m)?;
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

    fn profile(name: &str) -> Machine {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        Machine::load(&root.join("sim/machines").join(format!("{name}.yaml"))).unwrap()
    }

    /// Calibration by operation measures each kind of GPU this process reaches once:
    /// a mixed box gives two kinds, a two-node box only its first node's devices.
    #[test]
    fn device_kinds_are_the_local_nodes_kinds() {
        let mixed = device_kinds(&profile("rtx3090+rtx4060ti"));
        assert_eq!(mixed.len(), 2, "{mixed:?}");
        assert!(mixed.iter().all(|k| k.len() == 1), "{mixed:?}");
        let two_nodes = profile("2x8-h100-ib");
        let kinds = device_kinds(&two_nodes);
        assert_eq!(kinds.len(), 1, "{kinds:?}");
        assert_eq!(kinds[0].len(), 8, "{kinds:?}");
        let first_node = &two_nodes.devices[0].node;
        assert!(kinds[0]
            .iter()
            .all(|d| &two_nodes.device(d).unwrap().node == first_node));
        assert_eq!(device_kinds(&profile("cpu-emu-4"))[0].len(), 4);
    }

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

    /// GPUs are timed inside their blocks unless told otherwise; emulated devices alone.
    #[test]
    fn operations_on_gpus_are_timed_in_their_mix_by_default() {
        let gpus = [DeviceId::Cuda(0), DeviceId::Cuda(1)];
        let emu = [DeviceId::Emu(0)];
        assert_eq!(op_timing(None, &gpus), Timing::MIXED);
        assert_eq!(op_timing(None, &emu), Timing::Alone);
        assert_eq!(op_timing(Some("sustained"), &gpus), Timing::SUSTAINED);
        assert_eq!(op_timing(Some("alone"), &gpus), Timing::Alone);
        assert_eq!(op_timing(Some("mixed"), &emu), Timing::MIXED);
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
