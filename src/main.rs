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
    Testdata(cmd::exec::TestdataArgs),
    /// List the models mold knows.
    Models(cmd::plan::ModelsArgs),
    /// List this box's GPUs, save a machine profile, calibrate it.
    Devices(cmd::devices::Args),
    /// Information about this box (`mold info --gpus` = `mold devices`).
    Info(cmd::devices::InfoArgs),
    /// Serve text to image over HTTP: concurrent requests over a plan's replicas.
    Serve(cmd::serve::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(a) => cmd::plan::run(*a),
        Command::Sim(a) => cmd::sim::run(a),
        Command::Exec(a) => cmd::exec::run(a),
        Command::Testdata(a) => cmd::exec::testdata(a),
        Command::Models(a) => cmd::plan::models(a),
        Command::Devices(a) => cmd::devices::run(a),
        Command::Info(a) => cmd::devices::info(a),
        Command::Serve(a) => cmd::serve::run(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
