//! `mold`: plan, simulate and run diffusion-transformer inference across several GPUs.
//! A thin binary: every piece of work lives in the crates under `crates/`.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "mold",
    version,
    about = "Plan, simulate and run diffusion-transformer inference across several GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Solve for a placement of a model on a machine and write a YAML plan.
    Plan(Box<cmd::plan::Args>),
    /// Predict a plan's per-device memory and step time; check plans and scenarios.
    Sim(cmd::sim::Args),
    /// Run a plan's transformer on its devices (CUDA, or emulated devices on the CPU).
    Exec(cmd::exec::Args),
    /// Write random-weight checkpoints with real tensor names, for tests and benchmarks.
    Testdata(cmd::testdata::Args),
    /// List the models mold knows.
    Models(cmd::plan::ModelsArgs),
    /// List this box's GPUs, save a machine profile, calibrate it.
    Devices(cmd::devices::Args),
    /// Information about this box (`mold info --gpus` = `mold devices`).
    Info(cmd::devices::InfoArgs),
    /// Serve text to image over HTTP: concurrent requests over a plan's replicas.
    Serve(cmd::serve::Args),
    /// What `mold devices --calibrate --model M` spawns: a model's encoders and decoder
    /// run first in a fresh process (hidden: not for direct use).
    #[command(hide = true)]
    CalibrateFirstUse(cmd::devices::FirstUseArgs),
    /// What `mold devices --calibrate --model M` spawns on a GPU: the CUDA libraries'
    /// device memory once the model's blocks have run in a fresh process (hidden: not for
    /// direct use).
    #[command(hide = true)]
    CalibrateFootprint(cmd::devices::FootprintArgs),
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = cmd::common::install_plan_settings() {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(2);
    }
    let result = match cli.command {
        Command::Plan(a) => cmd::plan::run(*a),
        Command::Sim(a) => cmd::sim::run(a),
        Command::Exec(a) => cmd::exec::run(a),
        Command::Testdata(a) => cmd::testdata::run(a),
        Command::Models(a) => cmd::plan::models(a),
        Command::Devices(a) => cmd::devices::run(a),
        Command::Info(a) => cmd::devices::info(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::CalibrateFirstUse(a) => cmd::devices::first_use(a),
        Command::CalibrateFootprint(a) => cmd::devices::footprint(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            std::process::exit(1);
        }
    }
}

/// The error and its causes on one line, each cause once: typed errors that already show
/// their source in their own message (`{path}: {source}`) would otherwise print it twice.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn a_cause_its_error_already_shows_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        // mold-plan's I/O error shows its source in its own message
        let e = anyhow::Error::new(mold_plan::PlanError::Io {
            path: "p.yaml".into(),
            source: io,
        })
        .context("cannot use plan p.yaml");
        assert_eq!(one_line(&e), "cannot use plan p.yaml: p.yaml: No such file");
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(one_line(&plain), "outer: inner");
    }
}
