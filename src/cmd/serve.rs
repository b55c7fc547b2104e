//! `mold serve`: flags → [`mold_serve::ServeOptions`] and a [`mold_serve::Deployment`]
//! (the plan's replicas, checked like `mold exec` checks a plan), then the server.

use super::common::{load_machine, load_model, load_plan, model_of};
use super::exec_options::{exec_options, EnvVars};
use anyhow::{bail, Context, Result};
use mold_plan::Plan;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A positive number of seconds (`10`, `0.5`).
fn seconds(s: &str) -> std::result::Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!(
            "give a number of seconds above 0, e.g. 10 or 0.5, not `{s}`"
        )),
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The plan to serve (from `mold plan`); its `replicas:` each serve requests.
    #[arg(long, conflicts_with = "model", required_unless_present = "model")]
    pub plan: Option<PathBuf>,
    /// Plan for this model first (as `mold plan --objective throughput` would), then serve.
    #[arg(long, requires = "machine")]
    pub model: Option<String>,
    /// The machine profile (default with --plan: sim/machines/<the plan's machine>.yaml).
    #[arg(long)]
    pub machine: Option<String>,
    /// The weights directory (README: "Weights directory layout").
    #[arg(long)]
    pub weights: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = mold_serve::DEFAULT_LISTEN)]
    pub listen: String,
    /// Require `Authorization: Bearer <token>` on every request but /health, the token
    /// being this file's contents. Needed to listen beyond loopback (or --insecure).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Listen beyond loopback without --token-file: anyone who can reach the port can run
    /// the GPUs (a warning says so).
    #[arg(long)]
    pub insecure: bool,
    /// A `Host` name clients may use besides the listen address and localhost (NAME: any
    /// port; NAME:PORT: that port; `*`: any host). Repeatable.
    #[arg(long, value_name = "NAME[:PORT]")]
    pub allow_host: Vec<String>,
    /// A browser `Origin` that may call the server besides http(s)://<an allowed host>
    /// (requests without `Origin`, e.g. curl, always may). Repeatable.
    #[arg(long, value_name = "ORIGIN")]
    pub allow_origin: Vec<String>,
    /// Open connections at most; one more is answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = mold_serve::ServeOptions::default().max_connections)]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's header (also the longest a
    /// kept-alive connection may sit idle).
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = seconds)]
    pub header_timeout: Duration,
    /// Seconds a client may take to send a request's body (408 beyond).
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = seconds)]
    pub body_timeout: Duration,
    /// Seconds a response may wait for a client that does not read it (then the
    /// connection is closed).
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = seconds)]
    pub write_timeout: Duration,
    /// Seconds a request may take from admission, queued and running (504 beyond: it is
    /// cancelled and its queue slot freed).
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = seconds)]
    pub request_timeout: Duration,
    /// Seconds between keep-alive comments on an idle /v1/generate/stream.
    #[arg(long, value_name = "SECONDS", default_value = "15", value_parser = seconds)]
    pub sse_keep_alive: Duration,
    /// With --model: the size WIDTHxHEIGHT to plan for (default: the model's); requests
    /// larger than the plan's size are refused.
    #[arg(long, requires = "model")]
    pub size: Option<String>,
    /// Requests admitted and not yet started on a transformer; beyond it, 429.
    #[arg(long, default_value_t = 32)]
    pub queue: usize,
    /// on: text encoders and the VAE run on any idle device with room; off: where the
    /// plan places them for each replica.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub encoder_pool: String,
    /// on: before answering anything, one request per replica at the plan's size (one
    /// step; with the encoder pool on, one more per device holding an encoder or the VAE,
    /// run there) loads every kernel and builds cuDNN's plans on every device, so the first
    /// client's request runs warm; off: the first request pays that.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub warm_up: String,
    /// More sizes the warm-up runs besides the plan's, WIDTHxHEIGHT[,WIDTHxHEIGHT…] (e.g.
    /// 768x1344,1344x768): clients asking for them meet warm kernels and cuDNN plans too.
    /// Each must be a size a request could ask for (at most the plan's).
    #[arg(long, value_name = "SIZES", value_delimiter = ',')]
    pub warm_up_sizes: Vec<String>,
    /// Serve a plan made for another machine, or one the simulator says does not fit.
    #[arg(long)]
    pub force: bool,
    /// As `mold exec --no-peer`: hand-offs between GPUs through host memory and NCCL off
    /// the GPU-to-GPU path, for plans made on a `mold devices --no-peer` profile.
    #[arg(long)]
    pub no_peer: bool,
}

fn plan_for(model: &str, machine: &mold_machine::Machine, size: Option<&str>) -> Result<Plan> {
    let loaded = load_model(model, None)?;
    let mut w = loaded.spec.default_workload.clone();
    if let Some(size) = size {
        (w.width, w.height) = super::common::parse_size("--size", size)?;
    }
    let mut req = mold_planner::Request::new(loaded.spec, machine.clone(), w);
    req.checkpoint = loaded.checkpoint;
    req.objective = mold_planner::Objective::Throughput;
    let outcome = mold_planner::plan(&req)?;
    eprintln!(
        "planned {model} on {} ({} replica{}, objective throughput)",
        machine.name,
        outcome.plan.replica_count(),
        if outcome.plan.replica_count() == 1 {
            ""
        } else {
            "s"
        }
    );
    Ok(outcome.plan)
}

fn token(path: &Path) -> Result<String> {
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("--token-file {}", path.display()))?;
    let t = t.trim().to_string();
    if t.is_empty() {
        bail!(
            "--token-file {}: empty; put the bearer token clients send in it",
            path.display()
        );
    }
    Ok(t)
}

pub fn run(a: Args) -> Result<i32> {
    let listen: SocketAddr = a.listen.parse().map_err(|e| {
        anyhow::anyhow!(
            "--listen {}: {e}; write HOST:PORT, e.g. {}",
            a.listen,
            mold_serve::DEFAULT_LISTEN
        )
    })?;
    if a.queue == 0 {
        bail!("--queue 0: give at least 1 (requests waiting beyond it get 429)");
    }
    let token = a.token_file.as_deref().map(token).transpose()?;
    let warm_up_sizes = a
        .warm_up_sizes
        .iter()
        .map(|s| super::common::parse_size("--warm-up-sizes", s))
        .collect::<Result<Vec<_>>>()?;
    if !warm_up_sizes.is_empty() && a.warm_up != "on" {
        bail!("--warm-up-sizes with --warm-up off: drop one of them");
    }
    let opts = mold_serve::ServeOptions {
        listen,
        token,
        insecure: a.insecure,
        allow_hosts: a.allow_host.clone(),
        allow_origins: a.allow_origin.clone(),
        queue: a.queue,
        encoder_pool: a.encoder_pool == "on",
        warm_up: a.warm_up == "on",
        warm_up_sizes,
        max_connections: a.max_connections,
        header_timeout: a.header_timeout,
        body_timeout: a.body_timeout,
        write_timeout: a.write_timeout,
        request_timeout: a.request_timeout,
        sse_keep_alive: a.sse_keep_alive,
        ..mold_serve::ServeOptions::default()
    };
    // Before anything loads: listening beyond loopback without a token, a zero limit.
    opts.check()?;
    if opts.exposed_without_token() {
        eprintln!(
            "warning: --insecure: listening on {listen} without --token-file: anyone who can reach this port can run the GPUs"
        );
    }
    if !a.weights.is_dir() {
        bail!(
            "--weights {}: not a directory; point it at a weights directory (`mold testdata flux-tiny-pipeline DIR` writes a tiny one)",
            a.weights.display()
        );
    }
    let env = EnvVars::process();
    let comm = mold_exec::comm::CommOptions::from_vars(|k| env.get(k))?;
    let mut exec = exec_options(None, false, &env, comm)?;
    if a.no_peer {
        super::common::no_peer_access();
        exec.peer_copies = false;
    }
    let (plan, machine) = match (&a.plan, &a.model) {
        (Some(p), _) => {
            let plan = load_plan(p)?;
            let m = match &a.machine {
                Some(m) => m.clone(),
                None => format!("sim/machines/{}.yaml", plan.machine.name),
            };
            (plan, load_machine(&m)?)
        }
        (None, Some(model)) => {
            let machine = load_machine(a.machine.as_deref().unwrap_or_default())?;
            (plan_for(model, &machine, a.size.as_deref())?, machine)
        }
        (None, None) => bail!("give --plan PLAN, or --model ID --machine PROFILE"),
    };
    let model = model_of(&plan)?;
    // A CFG-parallel plan's replicas are one request's two passes, not two servers.
    if plan.cfg_mode() == Some(mold_plan::CfgMode::Parallel) {
        let what = match &a.plan {
            Some(p) => format!("--plan {}", p.display()),
            None => "the plan made for --model".into(),
        };
        bail!("{what}: cfg.mode is parallel (its two replicas run one request's conditional and unconditional passes at once), and mold serve runs each replica as a server of its own: re-plan with `mold plan ... --objective throughput --cfg serial` (or --cfg pipelined)");
    }
    let replicas = plan
        .replica_plans()
        .context("the plan's `replicas:` section")?;
    for (i, r) in replicas.iter().enumerate() {
        let checked = mold_pipeline::run::preflight(r, &model, &machine, a.force, None)
            .with_context(|| format!("replica {i}"))?;
        for w in checked.warnings {
            eprintln!("warning: replica {i}: {w}");
        }
    }
    let deploy = mold_serve::Deployment {
        replicas,
        model,
        machine,
        weights: a.weights.clone(),
        exec,
    };
    let summary = mold_serve::run(&deploy, &opts, Arc::new(|l| eprintln!("{l}")))?;
    eprintln!(
        "stopped: {} image{} served, {} cancelled, {} failed",
        summary.ok,
        if summary.ok == 1 { "" } else { "s" },
        summary.cancelled,
        summary.failed
    );
    Ok(0)
}
