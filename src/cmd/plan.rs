use super::common::{load_machine, load_model};
use super::devices;
use anyhow::{bail, Context, Result};
use mold_config::{Layer, Origin, Setting, Val};
use mold_machine::Machine;
use mold_plan::{ByteSize, CfgMode, DType, DeviceId, MemoryPhases};
use mold_planner::{
    parse_cap, parse_pin, CfgChoice, ConstraintsFile, Objective, Request, SpChoice, TpChoice,
};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Catalogue id (flux-dev, qwen-image, …; see `mold models`) or a checkpoint path
    /// (.safetensors, .index.json or a directory): sizes come from its header.
    #[arg(long)]
    pub model: String,
    /// Which catalogue model a checkpoint is, when its tensor names do not say.
    #[arg(long)]
    pub model_id: Option<String>,
    /// Machine profile (YAML, e.g. sim/machines/2x-l40s.yaml), or `local`: this box's
    /// GPUs as queried now (CUDA builds). Default: MOLD_MACHINE, config `machine`.
    #[arg(long)]
    pub machine: Option<String>,
    /// Output size WIDTHxHEIGHT (default: the model's).
    #[arg(long)]
    pub size: Option<String>,
    /// Video frames (video models).
    #[arg(long)]
    pub frames: Option<u32>,
    #[arg(long)]
    pub steps: Option<u32>,
    #[arg(long)]
    pub batch: Option<u32>,
    /// Distilled guidance (FLUX dev).
    #[arg(long)]
    pub guidance: Option<f64>,
    /// True CFG (classifier-free guidance, two transformer passes a step): a number is
    /// its scale (`--cfg 0` turns it off); a word is how the two passes run: serial,
    /// parallel (on two replicas at once), pipelined (two micro-batches through a block
    /// split) or auto (the fastest that fits; the default). Repeatable: `--cfg 4 --cfg
    /// pipelined`.
    #[arg(long, value_name = "SCALE|MODE")]
    pub cfg: Vec<String>,
    /// one-shot (default: the text encoders are freed before the transformer loads, so
    /// each device's peak is its largest phase) or resident (everything loaded at once,
    /// a server; the default with --objective throughput).
    #[arg(long, value_name = "PHASES")]
    pub memory_phases: Option<String>,
    /// latency (default), memory, or throughput (replicas of a placement on disjoint
    /// devices versus one group: the most images per second with --clients requests in
    /// flight). Default: MOLD_OBJECTIVE, config `objective`.
    #[arg(long)]
    pub objective: Option<String>,
    /// With --objective throughput: requests in flight (default 4).
    #[arg(long, value_name = "N")]
    pub clients: Option<u32>,
    /// With --objective throughput: the most seconds one request may take on its replica
    /// (queueing aside).
    #[arg(long, value_name = "SECONDS")]
    pub max_latency: Option<f64>,
    /// Cap a device's budget: DEVICE=SIZE, e.g. cuda:0=20GiB (repeatable). Also
    /// MOLD_MAX_VRAM=cuda:0=20GiB,cuda:1=30GiB and config `[max_vram]`; a flag wins for
    /// the devices it names.
    #[arg(long = "max-vram", value_name = "DEV=SIZE")]
    pub max_vram: Vec<String>,
    /// Place a component: NAME=DEVICE[,DEVICE…], e.g. t5=cuda:1 (repeatable).
    #[arg(long, value_name = "NAME=DEV")]
    pub pin: Vec<String>,
    /// Storage type of a component: NAME=DTYPE, e.g. transformer=q8 (repeatable).
    #[arg(long, value_name = "NAME=DTYPE")]
    pub dtype: Vec<String>,
    /// Let the planner hold the transformer in FP8 (e4m3, a scale per output feature; FP8
    /// products on GPUs with FP8 tensor cores) where that plans a faster request or one that
    /// fits: both are planned, the better kept. FP8 changes the image slightly.
    #[arg(long)]
    pub allow_fp8: bool,
    /// Run the FP8 transformer's attention in FP8 too (`attention: fp8`: q, k, v and the
    /// probabilities in e4m3, cuDNN's FP8 flash attention on Hopper and later; elsewhere
    /// attention stays bf16). Faster, and further from bf16 than FP8 products alone
    /// (BENCHMARKS.md). Needs the transformer in FP8: --dtype transformer=fp8, an FP8
    /// checkpoint, or --allow-fp8 choosing FP8.
    #[arg(long)]
    pub fp8_attention: bool,
    /// Never stream transformer blocks from host memory.
    #[arg(long)]
    pub no_stream: bool,
    /// Keep encoders and VAE off the host CPU.
    #[arg(long)]
    pub no_host_components: bool,
    /// Tensor parallel: auto, off, or a degree (every parallel group then has it).
    #[arg(long)]
    pub tp: Option<String>,
    /// Sequence parallel (Ulysses: tokens split, all-to-alls around attention): auto,
    /// off, or a degree (every parallel group then has it; with --tp N, groups of N × sp
    /// devices). Default: auto on a machine with peer links, unless --tp is given (then
    /// off, so `--tp N` alone keeps meaning tensor parallel only); off without peer links.
    #[arg(long)]
    pub sp: Option<String>,
    /// The VAE's decode in row bands, one per GPU: auto (where it shortens the request, by
    /// the cost model), off, or a number of bands (GPUs). Default: auto.
    #[arg(long, value_name = "auto|off|N")]
    pub vae_bands: Option<String>,
    /// Use only these devices: cuda:0,cuda:2.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["gpus", "gpu"])]
    pub devices: Option<Vec<String>>,
    /// Use only these GPUs, by ordinal: 1,2 = cuda:1,cuda:2. Default: MOLD_GPUS (or
    /// MOLD_GPU), config `gpus`.
    #[arg(long, value_name = "N,N", conflicts_with = "gpu")]
    pub gpus: Option<String>,
    /// Use only this GPU: 1 = cuda:1.
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,
    /// Kept free on every device: SIZE, e.g. 2GiB. Default: MOLD_HEADROOM, config
    /// `headroom`, else the profile's (with --machine local: from the activation model at
    /// the requested size).
    #[arg(long, value_name = "SIZE")]
    pub headroom: Option<String>,
    /// Shorthand for --pin ENCODER=cuda:N for every text encoder.
    #[arg(long)]
    pub encoder_gpu: Option<u32>,
    /// Shorthand for --pin transformer=cuda:N[,cuda:M].
    #[arg(long, value_delimiter = ',')]
    pub transformer_gpu: Option<Vec<u32>>,
    /// Shorthand for --pin vae=cuda:N.
    #[arg(long)]
    pub vae_gpu: Option<u32>,
    /// Constraints declared in a YAML file (flags win over it).
    #[arg(long)]
    pub constraints: Option<PathBuf>,
    /// Where to write the plan. A file there is replaced only if it is a plan mold wrote
    /// and nobody edited since (its first line's `mold-sha256:` stamp still matches);
    /// anything else needs --force. `-` writes it to standard output (the summary then
    /// goes to standard error).
    #[arg(short, long, default_value = "plan.yaml")]
    pub out: PathBuf,
    /// Replace the file at -o whatever it is: a hand-edited plan, any other file (a
    /// symlink there is replaced, never written through).
    #[arg(long, alias = "overwrite")]
    pub force: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Measure before choosing: run each placement worth comparing (the planner's pick
    /// and the best plan of every other tensor × sequence-parallel layout and of every
    /// strategy family, those priced within 25 % of the fastest, at most
    /// --tune-candidates) for a few steps with `mold
    /// exec` on this box, one process after another, --tune-rounds times each, and write
    /// the one measured fastest, with the record of each as comments under the plan.
    /// Needs the weights and the GPUs free; a load and a few steps a run.
    #[arg(long)]
    pub tune: bool,
    /// With --tune: steps each placement runs; a run's step is the median of steps 2..N
    /// (default 8).
    #[arg(long, value_name = "N", requires = "tune")]
    pub tune_steps: Option<u32>,
    /// With --tune: the most placements measured, the planner's pick included (default 6).
    #[arg(long, value_name = "N", requires = "tune")]
    pub tune_candidates: Option<usize>,
    /// With --tune: runs of each placement, each a fresh process, every other round in
    /// reverse order; the smallest run's step counts (default 2).
    #[arg(long, value_name = "N", requires = "tune")]
    pub tune_rounds: Option<u32>,
    /// With --tune: the most seconds one run of a placement may take, its load included;
    /// a run past it is stopped and the placement left out (default 300).
    #[arg(long, value_name = "SECONDS", requires = "tune")]
    pub tune_timeout: Option<f64>,
    /// With --tune: the weights the placements run, as `mold exec --weights` takes them
    /// (default: the checkpoint given as --model, else found as `mold exec` finds them).
    #[arg(long, requires = "tune")]
    pub weights: Option<PathBuf>,
}

/// Steps each placement runs under `--tune` by default.
const TUNE_STEPS: u32 = 8;
/// Runs of each placement under `--tune` by default.
const TUNE_ROUNDS: u32 = 2;
/// How long one placement may run under `--tune`, its load included.
const TUNE_LIMIT_S: f64 = 300.0;

#[derive(clap::Args, Debug)]
pub struct ModelsArgs {
    #[arg(long)]
    pub json: bool,
}

/// GPU ordinal `n` as the machine names it (cuda:N, or emu:N on an emulated machine);
/// `source` (a flag with its value, an env variable, a config key) prefixes the error.
fn gpu(machine: &Machine, n: u32, source: &str) -> Result<DeviceId> {
    machine
        .devices
        .iter()
        .find(|d| d.id.ordinal() == Some(n))
        .map(|d| d.id.clone())
        .with_context(|| {
            format!(
                "{source}: machine `{}` has no device cuda:{n} (it has {})",
                machine.name,
                machine.device_list()
            )
        })
}

/// The configuration (environment, config file) under the flags that have a config
/// key: --machine, --gpus/--gpu, --headroom. (--max-vram and --objective are applied in
/// their own order: flags, then the constraints file, then these.)
fn settings(a: &Args) -> Result<mold_config::Settings> {
    let mut flags = Layer::default();
    if let Some(m) = &a.machine {
        flags.machine = Some(Val::new(m.clone(), "--machine"));
    }
    if let Some(g) = &a.gpus {
        let key = format!("--gpus {g}");
        flags.gpus = Some(Val::new(mold_config::parse_gpu_list(g, &key)?, key));
    }
    if let Some(n) = a.gpu {
        flags.gpus = Some(Val::new(vec![n], format!("--gpu {n}")));
    }
    if let Some(h) = &a.headroom {
        let size: ByteSize = h
            .parse()
            .map_err(|e: mold_plan::ByteSizeError| anyhow::anyhow!("--headroom: {e}"))?;
        flags.headroom = Some(Val::new(size, "--headroom"));
    }
    Ok(mold_config::load(flags)?)
}

/// GPU ordinals as the machine names them.
fn gpus_of(machine: &Machine, ordinals: &[u32], source: &str) -> Result<Vec<DeviceId>> {
    ordinals.iter().map(|&n| gpu(machine, n, source)).collect()
}

/// The machine to plan for, after device selection, headroom and budget caps; and the
/// line saying which profile it is.
fn machine_for(
    a: &Args,
    file: &ConstraintsFile,
    settings: &mold_config::Settings,
    model: &mold_models::ModelSpec,
    w: &mold_plan::Workload,
) -> Result<(Machine, String, String)> {
    let spec = match &settings.machine {
        Some(s) => s.clone(),
        None if cfg!(feature = "cuda") => Setting {
            value: "local".into(),
            origin: Origin::Default,
            key: "machine".into(),
        },
        None => bail!(
            "name a machine: --machine PROFILE (e.g. sim/machines/2x-l40s.yaml), MOLD_MACHINE, or `machine = \"...\"` in {}",
            settings
                .file
                .as_ref()
                .map(|p| format!("the config file {}", p.display()))
                .unwrap_or_else(|| "a config file ($MOLD_CONFIG or ~/.config/mold/config.toml)".into())
        ),
    };
    let from = if spec.origin == Origin::Flag {
        String::new()
    } else {
        format!(" [from {}]", spec.source())
    };
    let headroom = settings.headroom.as_ref().map(|h| (h.value, h.source()));
    let (mut machine, profile_line) = if spec.value == "local" {
        let (h, hsrc) = headroom.clone().unwrap_or_else(|| {
            (
                devices::default_headroom(model, w),
                format!("activation model at {}x{}", w.width, w.height),
            )
        });
        let (m, adopted) = devices::local_machine_adopting(h)
            .with_context(|| format!("machine from {}", spec.source()))?;
        // This box's kept calibration is named `box-…` (mold_machine::box_cache).
        let (own, shipped): (Vec<_>, Vec<_>) =
            adopted.iter().partition(|a| a.from.starts_with("box-"));
        let list = |v: &[&mold_machine::shipped::Adopted]| -> String {
            v.iter()
                .map(|a| a.describe())
                .collect::<Vec<_>>()
                .join("; ")
        };
        let mut tables = String::new();
        if !own.is_empty() {
            tables += &format!("; operation tables measured on this box: {}", list(&own));
        }
        if !shipped.is_empty() {
            tables += &format!("; operation tables shipped with mold: {}", list(&shipped));
        }
        let line = format!(
            "machine profile: local (queried now: {}; headroom {h} from {hsrc}{tables}){from}",
            m.device_list()
        );
        (m, line)
    } else {
        let m = if spec.origin == Origin::Flag {
            load_machine(&spec.value)?
        } else {
            load_machine(&spec.value).with_context(|| format!("machine from {}", spec.source()))?
        };
        let line = format!(
            "machine profile: {} ({}{}){from}",
            spec.value,
            m.calibration.source,
            m.calibration
                .date
                .as_deref()
                .map(|d| format!(", {d}"))
                .unwrap_or_default()
        );
        (m, line)
    };
    if let Some((h, src)) = &headroom {
        for d in machine.devices.iter_mut() {
            if *h >= d.budget {
                bail!(
                    "{src}: headroom {h} leaves nothing of {}'s budget {}",
                    d.id,
                    d.budget
                );
            }
            d.headroom = *h;
        }
    }
    // Caps from the environment and the config file, on the whole machine (a device not
    // selected below may be named); a --max-vram flag wins for the devices it names.
    let flagged: Vec<DeviceId> = a
        .max_vram
        .iter()
        .filter_map(|s| parse_cap(s).ok().map(|(d, _)| d))
        .collect();
    for (d, cap) in &settings.max_vram {
        if flagged.contains(d) {
            continue;
        }
        if machine.device(d).is_none() {
            bail!(
                "{}: {d} is not a device of machine `{}` (it has {})",
                cap.source(),
                machine.name,
                machine.device_list()
            );
        }
        machine
            .cap_budget(d, cap.value)
            .with_context(|| format!("max_vram from {}", cap.source()))?;
    }
    // Selection: --devices or --gpus/--gpu, then the constraints file, then
    // MOLD_GPUS/MOLD_GPU, then config `gpus`.
    let gpus = settings.gpus.as_ref();
    let flag_gpus = gpus.filter(|g| g.origin == Origin::Flag);
    let devices: Option<Vec<DeviceId>> = match (&a.devices, flag_gpus, &file.devices, gpus) {
        (Some(v), ..) => Some(
            v.iter()
                .map(|d| {
                    d.parse::<DeviceId>()
                        .map_err(|e| anyhow::anyhow!("--devices: {e}"))
                })
                .collect::<Result<_>>()?,
        ),
        (None, Some(g), ..) => Some(gpus_of(&machine, &g.value, &g.source())?),
        (None, None, Some(d), _) => Some(d.clone()),
        (None, None, None, Some(g)) => Some(gpus_of(&machine, &g.value, &g.source())?),
        (None, None, None, None) => None,
    };
    if let Some(ids) = &devices {
        machine = machine.select(ids)?;
    }
    for (d, cap) in &file.max_vram {
        machine.cap_budget(d, *cap)?;
    }
    for s in &a.max_vram {
        let (d, cap) = parse_cap(s).map_err(anyhow::Error::msg)?;
        machine.cap_budget(&d, cap)?;
    }
    Ok((machine, profile_line, spec.value))
}

/// Builds the planner request from flags, the constraints file, the environment, the
/// config file and the profile; also the profile line and the machine named.
pub fn request(a: &Args) -> Result<(Request, String, String)> {
    let file = match &a.constraints {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--constraints {}", p.display()))?;
            ConstraintsFile::from_yaml(&text, &p.display().to_string())?
        }
        None => ConstraintsFile::default(),
    };
    let loaded = load_model(&a.model, a.model_id.as_deref())?;
    let model = loaded.spec;
    let mut w = model.default_workload.clone();
    if let Some(size) = &a.size {
        (w.width, w.height) = super::common::parse_size("--size", size)?;
    }
    if let Some(f) = a.frames {
        w.frames = f;
    }
    if let Some(s) = a.steps {
        w.steps = s;
    }
    if let Some(b) = a.batch {
        w.batch = b;
    }
    if let Some(g) = a.guidance {
        w.guidance = Some(g);
    }
    let mut cfg_choice = None;
    for c in &a.cfg {
        match c.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => w.cfg_scale = (x > 0.0).then_some(x),
            Ok(x) => bail!("--cfg {x}: a CFG scale is a finite number ≥ 0 (0 turns CFG off)"),
            Err(_) => {
                cfg_choice = Some(
                    c.trim()
                        .parse::<CfgChoice>()
                        .map_err(|e| anyhow::anyhow!("--cfg: {e}, or a scale such as 4"))?,
                )
            }
        }
    }
    model.check_workload(&w)?;

    let settings = settings(a)?;
    let (machine, profile_line, machine_name) = machine_for(a, &file, &settings, &model, &w)?;

    let mut req = Request::new(model, machine, w);
    req.checkpoint = loaded.checkpoint;
    if let Some(d) = loaded.dtype {
        if d == DType::Fp8 {
            eprintln!(
                "note: {} stores the transformer in FP8 (e4m3): planned in FP8 (a byte a weight and a scale per output feature, FP8 products on GPUs with FP8 tensor cores); --dtype transformer=bf16 widens it at load",
                a.model
            );
        }
        req.dtypes.insert("transformer".into(), d);
    }
    for s in &a.dtype {
        let (name, d) = s
            .split_once('=')
            .with_context(|| format!("--dtype {s}: write NAME=DTYPE, e.g. transformer=q8"))?;
        if !req.dtypes.contains_key(name) {
            bail!(
                "--dtype {s}: {} has no component `{name}` (it has {})",
                req.model.id,
                req.dtypes.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        let d: DType = d
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--dtype {name}: {e}"))?;
        req.dtypes.insert(name.to_string(), d);
    }
    req.fp8_attention = a.fp8_attention;
    // `--allow-fp8` may still choose FP8, unless a transformer dtype was given.
    let may_choose = a.allow_fp8 && !a.dtype.iter().any(|s| s.starts_with("transformer="));
    if a.fp8_attention && !may_choose && req.dtype("transformer") != DType::Fp8 {
        bail!(
            "--fp8-attention: the transformer is planned in {}: FP8 attention runs in FP8 blocks; add --dtype transformer=fp8 (or --allow-fp8 to let the planner choose)",
            req.dtype("transformer")
        );
    }

    let c = &mut req.constraints;
    if let Some(tp) = file.tp {
        c.tp = tp;
    }
    if let Some(s) = file.stream {
        c.stream = s;
    }
    if let Some(h) = file.host_components {
        c.host_components = h;
    }
    if let Some(b) = file.stream_buffers {
        c.stream_buffers = b;
    }
    for (name, devs) in &file.pin {
        c.pins.insert(name.clone(), devs.devices());
    }
    if let Some(tp) = &a.tp {
        c.tp = tp
            .parse::<TpChoice>()
            .map_err(|e| anyhow::anyhow!("--tp: {e}"))?;
    }
    c.sp = match (&a.sp, file.sp) {
        (Some(sp), _) => sp
            .parse::<SpChoice>()
            .map_err(|e| anyhow::anyhow!("--sp: {e}"))?,
        (None, Some(sp)) => sp,
        // `--tp N` alone keeps its meaning: tensor parallel, no sequence parallel.
        (None, None) if a.tp.is_some() || file.tp.is_some() => SpChoice::Off,
        // All-to-alls staged through the host do not pay; peers are where SP helps.
        (None, None) if req.machine.links.peer.is_empty() => SpChoice::Off,
        (None, None) => SpChoice::Auto,
    };
    if let Some(v) = file.vae_bands {
        c.vae_bands = v;
    }
    if let Some(v) = &a.vae_bands {
        c.vae_bands = v
            .parse::<SpChoice>()
            .map_err(|e| anyhow::anyhow!("--vae-bands: {e}"))?;
    }
    if a.no_stream {
        c.stream = false;
    }
    if a.no_host_components {
        c.host_components = false;
    }
    for s in &a.pin {
        let (name, devs) = parse_pin(s).map_err(anyhow::Error::msg)?;
        c.pins.insert(name, devs);
    }
    if let Some(n) = a.encoder_gpu {
        let d = gpu(&req.machine, n, &format!("--encoder-gpu {n}"))?;
        for comp in &req.model.components {
            if comp.role == mold_plan::ComponentRole::Encoder {
                req.constraints
                    .pins
                    .insert(comp.name.clone(), vec![d.clone()]);
            }
        }
    }
    if let Some(v) = &a.transformer_gpu {
        let ds = v
            .iter()
            .map(|n| gpu(&req.machine, *n, &format!("--transformer-gpu {n}")))
            .collect::<Result<Vec<_>>>()?;
        req.constraints.pins.insert("transformer".into(), ds);
    }
    if let Some(n) = a.vae_gpu {
        let d = gpu(&req.machine, n, &format!("--vae-gpu {n}"))?;
        req.constraints.pins.insert("vae".into(), vec![d]);
    }
    req.objective = match (&a.objective, file.objective) {
        (Some(o), _) => o.parse::<Objective>().map_err(anyhow::Error::msg)?,
        (None, Some(o)) => o.into(),
        (None, None) => match settings.objective.value {
            mold_config::Objective::Latency => Objective::Latency,
            mold_config::Objective::Memory => Objective::Memory,
        },
    };
    req.memory_phases = match &a.memory_phases {
        Some(m) => m
            .parse::<MemoryPhases>()
            .map_err(|e| anyhow::anyhow!("--memory-phases: {e}"))?,
        // A server keeps everything loaded; one request loads phase by phase.
        None if req.objective == Objective::Throughput => MemoryPhases::Resident,
        None => MemoryPhases::OneShot,
    };
    if let Some(c) = cfg_choice {
        if !req.true_cfg() {
            bail!(
                "--cfg {}: {} runs no true CFG ({}): drop it, or give a scale too (--cfg 4)",
                a.cfg.join(" --cfg "),
                req.model.id,
                if req.workload.cfg_scale.is_none() {
                    "the workload has no CFG scale"
                } else {
                    "it is guidance-distilled"
                }
            );
        }
        if req.objective == Objective::Throughput && c == CfgChoice::Mode(CfgMode::Parallel) {
            bail!("--cfg parallel runs the two passes on two replicas, and with --objective throughput the replicas serve requests of their own: use --cfg serial or pipelined, or drop --objective throughput");
        }
        req.cfg = c;
    }
    if req.objective == Objective::Throughput {
        if let Some(n) = a.clients {
            req.serving.clients = n;
        }
        req.serving.max_latency_s = a.max_latency;
    } else if let Some(flag) = [
        a.clients.map(|n| format!("--clients {n}")),
        a.max_latency.map(|s| format!("--max-latency {s}")),
    ]
    .into_iter()
    .flatten()
    .next()
    {
        bail!(
            "{flag}: only --objective throughput weighs requests in flight: add `--objective throughput` or drop it"
        );
    }
    Ok((req, profile_line, machine_name))
}

pub fn run(a: Args) -> Result<i32> {
    // A plan mold wrote and nobody edited since is replaced; anything else at -o (a
    // reviewed and edited plan, a file of the user's) only with --force: refused before
    // the planner runs.
    let dest = mold_files::Dest {
        path: &a.out,
        flag: "-o",
        what: "plan",
        force_flag: "--force",
        force: a.force,
    };
    let stamp = mold_files::Stamp::HashComment;
    let to_stdout = a.out.as_os_str() == "-";
    if to_stdout && a.json {
        bail!("-o -: the plan goes to standard output, where --json writes too: give -o a file, or drop --json");
    }
    if !to_stdout {
        dest.check(mold_files::Mine::Stamped(stamp))?;
    }
    let (req, profile_line, machine_name) = request(&a)?;
    // Everything --tune needs is checked before the planner runs.
    let tuning = if a.tune {
        Some(tune_args(&a, &req)?)
    } else {
        None
    };
    let mut outcome = plan_with_fp8_attention(&a, &req, plan_with_fp8_allowed(&a, &req)?)?;
    let mut record = None;
    let mut yaml = outcome.plan.to_yaml();
    if let Some((weights, steps, rounds, options, limit)) = &tuning {
        let t = super::tune::TuneArgs {
            weights,
            machine: &machine_name,
            steps: *steps,
            rounds: *rounds,
            options: *options,
            limit: *limit,
        };
        let (tuned, rows) = super::tune::run(&req, outcome, &t)?;
        outcome = tuned;
        yaml = outcome.plan.to_yaml();
        if let Some(rows) = &rows {
            yaml += &super::tune::plan_comment(rows, *steps, *rounds);
        }
        record = rows;
    }
    if to_stdout {
        let bytes = mold_files::stamp(stamp, yaml.as_bytes())
            .ok_or_else(|| anyhow::anyhow!("the plan has no line for its stamp"))?;
        std::io::stdout().lock().write_all(&bytes)?;
    } else {
        dest.write_stamped(stamp, yaml.as_bytes())?;
    }
    if a.json {
        let mut v = serde_json::json!({
            "machine_profile": machine_name,
            "plan_file": a.out,
            "outcome": outcome,
        });
        if let Some(rows) = &record {
            v["tune"] = serde_json::to_value(rows)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    // The summary goes where the plan does not.
    let mut w: Box<dyn Write> = if to_stdout {
        Box::new(std::io::stderr().lock())
    } else {
        Box::new(std::io::stdout().lock())
    };
    writeln!(w, "{profile_line}")?;
    write!(w, "{}", mold_planner::report::summary(&outcome))?;
    if let Some(rows) = &record {
        writeln!(w, "\nmeasured on this box (--tune), the kept placement written (the table of families above is the planner's own search, priced):")?;
        write!(w, "{}", mold_planner::tune::table(rows, "  "))?;
    }
    if !to_stdout {
        writeln!(w, "\nplan written to {}", a.out.display())?;
    }
    Ok(0)
}

/// `--tune`'s weights, steps and options, each checked: refused in one line before the
/// planner runs.
#[allow(clippy::type_complexity)]
fn tune_args(
    a: &Args,
    req: &Request,
) -> Result<(
    PathBuf,
    u32,
    u32,
    mold_planner::tune::TuneOptions,
    std::time::Duration,
)> {
    if let Some(m) = mold_planner::tune::refuse(req) {
        bail!("{m}");
    }
    let steps = a.tune_steps.unwrap_or(TUNE_STEPS);
    if steps < 2 {
        bail!("--tune-steps {steps}: give at least 2 (a placement's step is the median of steps 2..N; step 1 loads kernels)");
    }
    let rounds = a.tune_rounds.unwrap_or(TUNE_ROUNDS);
    if rounds < 1 {
        bail!("--tune-rounds 0: give at least 1 (runs of each placement)");
    }
    let limit_s = a.tune_timeout.unwrap_or(TUNE_LIMIT_S);
    if !(limit_s.is_finite() && limit_s > 0.0 && limit_s <= 86_400.0) {
        bail!("--tune-timeout {limit_s}: give the seconds one run may take, above 0 and at most 86400 (default {TUNE_LIMIT_S})");
    }
    let limit = std::time::Duration::from_secs_f64(limit_s);
    let mut options = mold_planner::tune::TuneOptions::default();
    if let Some(n) = a.tune_candidates {
        if n < 2 {
            bail!("--tune-candidates {n}: give at least 2 (the planner's pick and one more to compare)");
        }
        options.max_candidates = n;
    }
    // A checkpoint given as --model is the weights to run, unless --weights says otherwise.
    let flag = a.weights.clone().or_else(|| {
        let p = PathBuf::from(&a.model);
        p.exists().then_some(p)
    });
    let weights = super::exec::weights_for_model(&req.model.id, &flag)
        .map_err(|e| anyhow::anyhow!("--tune: {e}"))?;
    Ok((weights, steps, rounds, options, limit))
}

/// `asked` as planned; with `--fp8-attention`, a word where it could not apply (a dense
/// transformer) or where the tables price it no faster than attention in the activations'
/// dtype for this workload (short sequences, a few heads a shard: its quantizing pass
/// outweighs the faster kernel). FP8 attention is kept as asked: its price is within the cost
/// model's error of the other there (BENCHMARKS.md).
fn plan_with_fp8_attention(
    a: &Args,
    req: &Request,
    asked: mold_planner::Outcome,
) -> Result<mold_planner::Outcome> {
    if !a.fp8_attention {
        return Ok(asked);
    }
    let Some(t) = asked.plan.transformer().filter(|t| t.fp8_attention()) else {
        eprintln!("--fp8-attention: the transformer stays dense, so its attention does too");
        return Ok(asked);
    };
    let mut plain = asked.plan.clone();
    if let Some(c) = plain.components.iter_mut().find(|c| c.name == t.name) {
        c.attention = None;
    }
    let step = |p: &mold_plan::Plan| mold_cost::evaluate(p, &req.model, &req.machine).step_s;
    let (with, without) = (step(&asked.plan), step(&plain));
    if with >= without {
        eprintln!(
            "--fp8-attention: FP8 attention is priced no faster here ({:.2} ms a step against {:.2} ms with attention in bf16); kept as asked",
            with * 1e3,
            without * 1e3
        );
    }
    Ok(asked)
}

/// The plan; with `--allow-fp8` (and no transformer dtype given), the better of the plan
/// as asked and the same request with the transformer in FP8, by the objective, saying
/// which and both figures. The two are compared only where both are priced alike (both
/// from operation tables, or both estimated); otherwise FP8 is kept only when the plan as
/// asked does not fit, and the message says how to price FP8 too.
fn plan_with_fp8_allowed(a: &Args, req: &Request) -> Result<mold_planner::Outcome> {
    let given = a.dtype.iter().any(|s| s.starts_with("transformer="));
    let asked = req.dtypes.get("transformer").copied();
    if !a.allow_fp8 || given || asked == Some(DType::Fp8) {
        return Ok(mold_planner::plan(req)?);
    }
    let dense_dtype = asked.unwrap_or(req.model.transformer.default_dtype);
    let unlike = req.machine.devices.iter().find_map(|d| {
        let t = |dt| req.machine.op_tables(&req.model.id, dt, &d.name).is_some();
        (t(dense_dtype) != t(DType::Fp8)).then(|| {
            format!(
                "on {} {} is priced from operation tables and {} by estimate",
                d.name,
                if t(dense_dtype) {
                    dense_dtype
                } else {
                    DType::Fp8
                },
                if t(dense_dtype) {
                    DType::Fp8
                } else {
                    dense_dtype
                },
            )
        })
    });
    let mut r8 = req.clone();
    r8.dtypes.insert("transformer".into(), DType::Fp8);
    let dense = mold_planner::plan(req);
    let fp8 = mold_planner::plan(&r8);
    let score = |o: &mold_planner::Outcome| o.plan.solver.objective_value;
    // Images a minute for throughput (more is better); seconds or bytes otherwise.
    let better = |x: f64, y: f64| {
        if req.objective == Objective::Throughput {
            x > y
        } else {
            x < y
        }
    };
    let name = asked.map_or("its default dtype".to_string(), |d| d.to_string());
    Ok(match (dense, fp8) {
        (Ok(d), Ok(_)) if unlike.is_some() => {
            eprintln!(
                "--allow-fp8: the transformer stays in {name}: the two are not priced alike ({}); measure FP8 too with `mold devices --calibrate --model {} --dtype fp8`",
                unlike.unwrap_or_default(),
                req.model.id
            );
            d
        }
        (Ok(d), Ok(f)) if better(score(&f), score(&d)) => {
            eprintln!(
                "--allow-fp8: the transformer in FP8 (objective {} against {} in {name})",
                score(&f),
                score(&d)
            );
            f
        }
        (Ok(d), Ok(f)) => {
            eprintln!(
                "--allow-fp8: the transformer stays in {name} (objective {} against {} in FP8)",
                score(&d),
                score(&f)
            );
            d
        }
        (Err(e), Ok(f)) => {
            eprintln!("--allow-fp8: the transformer in FP8 (in {name}: {e})");
            f
        }
        (Ok(d), Err(_)) => d,
        (Err(e), Err(_)) => return Err(e.into()),
    })
}

pub fn models(a: ModelsArgs) -> Result<i32> {
    let all = mold_models::builtin();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!("{:<15} {:>8} {:>10}  components", "model", "blocks", "bf16");
    for m in all {
        println!(
            "{:<15} {:>8} {:>10}  {}",
            m.id,
            m.transformer.total_blocks(),
            mold_planner::report::decimal_bytes(m.transformer.weight_bytes(DType::Bf16)),
            m.components
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(0)
}
