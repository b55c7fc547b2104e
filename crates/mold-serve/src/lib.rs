//! `mold serve`: an HTTP server that runs a plan's text-to-image pipeline for concurrent
//! requests.
//!
//! - [`http`]: the routes (OpenAI-compatible `/v1/images/generations`, native
//!   `/v1/generate` and its server-sent-events twin, `/health`, `/status`, `/metrics`),
//!   the bearer token and limits; [`api`]: the request bodies and their checks.
//! - [`engine`]: the scheduler: a bounded queue (429 beyond), one worker per replica with
//!   its transformer loaded, cancellation, draining.
//! - [`pool`]: the per-device lock pool that runs text encoders and the VAE on idle
//!   devices with room, never on a device whose transformer is mid-request.
//! - [`server`]: binding, serving, graceful shutdown; [`options`]: what the command line
//!   resolves ([`ServeOptions`], [`Deployment`]); [`metrics`]: Prometheus text.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod options;
pub mod pool;
pub mod server;

pub use options::{Deployment, ServeOptions, DEFAULT_LISTEN};
pub use server::{run, spawn, Handle, ServeError, Summary};
