use super::common::{load_machine, load_model};
use anyhow::{bail, Context, Result};
use mold_plan::{DType, DeviceId};
use mold_planner::{parse_cap, parse_pin, ConstraintsFile, Objective, Request, TpChoice};
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
    /// Machine profile (YAML, e.g. sim/machines/2x-l40s.yaml).
    #[arg(long)]
    pub machine: String,
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
    /// Classifier-free guidance scale (doubles the batch); `--cfg 0` turns it off.
    #[arg(long)]
    pub cfg: Option<f64>,
    /// latency (default) or memory.
    #[arg(long)]
    pub objective: Option<String>,
    /// Cap a device's budget: DEVICE=SIZE, e.g. cuda:0=20GiB (repeatable).
    #[arg(long = "max-vram", value_name = "DEV=SIZE")]
    pub max_vram: Vec<String>,
    /// Place a component: NAME=DEVICE[,DEVICE…], e.g. t5=cuda:1 (repeatable).
    #[arg(long, value_name = "NAME=DEV")]
    pub pin: Vec<String>,
    /// Storage type of a component: NAME=DTYPE, e.g. transformer=q8 (repeatable).
    #[arg(long, value_name = "NAME=DTYPE")]
    pub dtype: Vec<String>,
    /// Never stream transformer blocks from host memory.
    #[arg(long)]
    pub no_stream: bool,
    /// Keep encoders and VAE off the host CPU.
    #[arg(long)]
    pub no_host_components: bool,
    /// Tensor parallel: auto, off, or a degree.
    #[arg(long)]
    pub tp: Option<String>,
    /// Use only these devices: cuda:0,cuda:2.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<String>>,
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
    /// Where to write the plan.
    #[arg(short, long, default_value = "plan.yaml")]
    pub out: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ModelsArgs {
    #[arg(long)]
    pub json: bool,
}

/// A GPU shorthand (`--encoder-gpu 1`) as the machine names that device.
fn gpu(machine: &mold_machine::Machine, n: u32, flag: &str) -> Result<DeviceId> {
    machine
        .devices
        .iter()
        .find(|d| d.id.ordinal() == Some(n))
        .map(|d| d.id.clone())
        .with_context(|| {
            format!(
                "{flag} {n}: machine `{}` has no device {n} (it has {})",
                machine.name,
                machine.device_list()
            )
        })
}

/// Builds the planner request from flags, the constraints file and the profile.
pub fn request(a: &Args) -> Result<(Request, String)> {
    let file = match &a.constraints {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--constraints {}", p.display()))?;
            ConstraintsFile::from_yaml(&text, &p.display().to_string())?
        }
        None => ConstraintsFile::default(),
    };
    let mut machine = load_machine(&a.machine)?;
    let profile_line = format!(
        "machine profile: {} ({}{})",
        a.machine,
        machine.calibration.source,
        machine
            .calibration
            .date
            .as_deref()
            .map(|d| format!(", {d}"))
            .unwrap_or_default()
    );
    let devices: Option<Vec<DeviceId>> = match &a.devices {
        Some(v) => Some(
            v.iter()
                .map(|d| {
                    d.parse::<DeviceId>()
                        .map_err(|e| anyhow::anyhow!("--devices: {e}"))
                })
                .collect::<Result<_>>()?,
        ),
        None => file.devices.clone(),
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

    let loaded = load_model(&a.model, a.model_id.as_deref())?;
    let model = loaded.spec;
    let mut w = model.default_workload.clone();
    if let Some(size) = &a.size {
        let (x, y) = size
            .split_once(['x', 'X'])
            .with_context(|| format!("--size {size}: write WIDTHxHEIGHT, e.g. 1024x1024"))?;
        w.width = x
            .trim()
            .parse()
            .with_context(|| format!("--size {size}: width `{x}` is not a number"))?;
        w.height = y
            .trim()
            .parse()
            .with_context(|| format!("--size {size}: height `{y}` is not a number"))?;
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
    if let Some(c) = a.cfg {
        w.cfg_scale = (c > 0.0).then_some(c);
    }
    model.check_workload(&w)?;

    let mut req = Request::new(model, machine, w);
    req.checkpoint = loaded.checkpoint;
    if let Some(d) = loaded.dtype {
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
        c.tp = tp.parse::<TpChoice>().map_err(anyhow::Error::msg)?;
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
        let d = gpu(&req.machine, n, "--encoder-gpu")?;
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
            .map(|n| gpu(&req.machine, *n, "--transformer-gpu"))
            .collect::<Result<Vec<_>>>()?;
        req.constraints.pins.insert("transformer".into(), ds);
    }
    if let Some(n) = a.vae_gpu {
        let d = gpu(&req.machine, n, "--vae-gpu")?;
        req.constraints.pins.insert("vae".into(), vec![d]);
    }
    req.objective = match (&a.objective, file.objective) {
        (Some(o), _) => o.parse::<Objective>().map_err(anyhow::Error::msg)?,
        (None, Some(o)) => o.into(),
        (None, None) => Objective::Latency,
    };
    Ok((req, profile_line))
}

pub fn run(a: Args) -> Result<i32> {
    let (req, profile_line) = request(&a)?;
    let outcome = mold_planner::plan(&req)?;
    std::fs::write(&a.out, outcome.plan.to_yaml())
        .with_context(|| format!("-o {}", a.out.display()))?;
    if a.json {
        let v = serde_json::json!({
            "machine_profile": a.machine,
            "plan_file": a.out,
            "outcome": outcome,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{profile_line}");
        print!("{}", mold_planner::report::summary(&outcome));
        println!("\nplan written to {}", a.out.display());
    }
    Ok(0)
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
            format!(
                "{:.1} GB",
                m.transformer.weight_bytes(DType::Bf16) as f64 / 1e9
            ),
            m.components
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(0)
}
