//! What a server is told, resolved at the command line: [`ServeOptions`] (the HTTP side
//! and the scheduler) and [`Deployment`] (what it runs).

use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::Plan;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The address `mold serve` binds unless told otherwise: this machine only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7680";

/// How the server listens, admits and schedules.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Requests must carry `Authorization: Bearer <token>` (all but `/health`).
    pub token: Option<String>,
    /// Requests admitted but not yet started on a transformer; beyond it, 429.
    pub queue: usize,
    /// Text encoders and the VAE run on any idle device with room (the lock pool);
    /// off: each request's on its replica's planned devices.
    pub encoder_pool: bool,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Longest prompt, characters.
    pub max_prompt_chars: usize,
    /// Most images one `/v1/images/generations` request may ask for.
    pub max_images: u32,
    /// Most denoising steps a request may ask for.
    pub max_steps: u32,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: DEFAULT_LISTEN.parse().expect("a valid address"),
            token: None,
            queue: 32,
            encoder_pool: true,
            max_body_bytes: 64 * 1024,
            max_prompt_chars: 4000,
            max_images: 8,
            max_steps: 200,
        }
    }
}

/// What the server runs: one plan per replica (from [`Plan::replica_plans`]), the model
/// and machine they were made for, the weights directory and the executor's options.
#[derive(Clone, Debug)]
pub struct Deployment {
    pub replicas: Vec<Plan>,
    pub model: ModelSpec,
    pub machine: Machine,
    pub weights: PathBuf,
    pub exec: mold_exec::ExecOptions,
}
