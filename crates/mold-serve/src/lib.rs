//! `mold serve`: an HTTP server that runs a plan's text-to-image pipeline for concurrent
//! requests.
//!
//! - [`http`]: the routes (OpenAI-compatible `/v1/images/generations`, native
//!   `/v1/generate` and its server-sent-events twin, `/health`, `/status`, `/metrics`),
//!   the `Host`, `Origin`, bearer-token and content-type checks, body limits, the request
//!   deadline; [`api`]: the request bodies and their checks (the plan's size a bound).
//! - [`engine`]: the scheduler: a bounded queue (429 beyond), one worker per replica with
//!   its transformer loaded, cancellation, draining, a panic failing one request.
//! - [`pool`]: the per-device lock pool that runs text encoders and the VAE on idle
//!   devices with room, never on a device whose transformer is mid-request.
//! - [`server`]: binding, each connection through hyper with its limits (connection cap,
//!   header and write timeouts), graceful shutdown; [`options`]: what the command line
//!   resolves ([`ServeOptions`], [`Deployment`]) and test hooks ([`Hooks`]); [`metrics`]:
//!   Prometheus text.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod options;
pub mod pool;
pub mod server;

pub use options::{Deployment, Gate, Hooks, OptionsError, ServeOptions, Stage, DEFAULT_LISTEN};
pub use server::{run, spawn, spawn_logged, Handle, ServeError, Summary};
