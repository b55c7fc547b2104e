//! The scheduler: a bounded queue of requests, one worker thread per replica (its
//! transformer loaded once, on its devices), encoder workers that encode queued requests
//! on idle devices through the lock pool ([`crate::pool`]), and the encoder and VAE
//! instances, each loaded once per device and reused.
//!
//! A request goes: admitted ([`Engine::submit`]: 429 beyond the bound, 400 for more
//! images than the bound, 503 while draining or with no replica left) → encoded (with
//! the pool on: by an encoder worker on any idle device with room; off: by its replica on
//! the devices the plan gives) → denoised by the first free replica, which holds its
//! devices' locks meanwhile → decoded on an idle device with a VAE (or room for one) →
//! its PNG. Its cancel flag (set when the client goes away or its deadline passes) is
//! checked between stages and denoising steps; a cancelled request frees everything it
//! held, and one still queued leaves the queue at the next admission.
//!
//! A panic while serving a request fails that request only (500, its id in the log with
//! the cause): the encoder or VAE instance it ran on is dropped and loaded afresh on its
//! next use; a replica whose transformer panicked reloads it, and is marked failed if
//! that fails ([`Engine::health`]). When no replica is left, what is queued fails with
//! 503 and nothing more is admitted.

mod instances;
mod queue;
mod start;
mod warm;
mod workers;

use crate::metrics::{Gauges, Metrics};
use crate::options::Hooks;
use crate::pool::{Holder, Pool};
use instances::Instance;
use mold_exec::runtime::DeviceMap;
use mold_pipeline::flux::Prepared;
use mold_pipeline::{PipelineError, Progress};
use mold_plan::Plan;
use queue::Queue;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("{0}")]
    Plan(String),
}

/// A finished image.
#[derive(Clone, Debug)]
pub struct Image {
    pub png: Vec<u8>,
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    pub replica: usize,
    pub seconds: f64,
    /// The request's id (as the log names it).
    pub request: u64,
    /// Where its `seconds` went.
    pub phases: Phases,
}

/// Seconds a request spent in each part of its run, from its admission; what is left of
/// [`Image::seconds`] is waiting (for an encoder, a transformer, a decoder). HTTP answers
/// carry them as a `Server-Timing` header.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Phases {
    /// Both text encoders, from the first one's start to the second one's end.
    pub encode: f64,
    /// Every denoising step on the transformer's devices.
    pub denoise: f64,
    /// The VAE, the decoded image back on the host included.
    pub decode: f64,
    /// The PNG made from it.
    pub png: f64,
}

/// What a request's client hears while it runs.
#[derive(Clone, Debug)]
pub enum Event {
    Progress(Progress),
}

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue has no room now (429).
    Full { capacity: usize },
    /// More images in one request than the queue ever holds (400).
    TooMany { n: usize, capacity: usize },
    /// The server is shutting down (503).
    Draining,
    /// Every replica failed (503).
    NoReplica,
}

/// How an admitted request failed. What the client is told names no internal detail:
/// the cause is in the server's log under the request's id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    /// The request's id.
    pub request: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The pipeline failed or panicked (500).
    Internal,
    /// No replica was left to run it (503).
    Unavailable,
    /// Its client went away or its deadline passed.
    Cancelled,
}

impl Failure {
    /// The HTTP status for the client.
    pub fn status(&self) -> u16 {
        match self.kind {
            FailureKind::Internal => 500,
            FailureKind::Unavailable => 503,
            FailureKind::Cancelled => 499,
        }
    }

    /// One line for the client, without internal detail.
    pub fn message(&self) -> String {
        let id = self.request;
        match self.kind {
            FailureKind::Internal => format!(
                "request {id} failed inside the server; its log has the cause under request {id}"
            ),
            FailureKind::Unavailable => format!(
                "request {id}: no replica can serve it (each failed; the server's log says why); restart the server"
            ),
            FailureKind::Cancelled => format!("request {id} was cancelled"),
        }
    }
}

/// A request admitted: its id and where its image (or failure) comes.
pub struct Pending {
    pub id: u64,
    pub rx: oneshot::Receiver<Result<Image, Failure>>,
}

/// What a replica does now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaState {
    /// Loading its transformer at start.
    Loading,
    Serving,
    /// Reloading its transformer after a panic.
    Restarting,
    /// Out of service, and why.
    Failed(String),
}

/// Whether the server can take requests, for `/health`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    pub replicas: usize,
    pub serving: usize,
    pub failed: usize,
    pub draining: bool,
}

/// One replica: its plan and its transformer's devices (pool indices).
struct ReplicaInfo {
    plan: Plan,
    devices: Vec<usize>,
    /// Per pool component, the device its plan places it on (pool index).
    planned: Vec<usize>,
}

type Log = Arc<dyn Fn(String) + Send + Sync>;

/// The running scheduler.
pub struct Engine {
    model_id: String,
    prep: Prepared,
    plan: Plan,
    pool: Pool,
    replicas: Vec<ReplicaInfo>,
    instances: Mutex<HashMap<(usize, usize), Arc<Instance>>>,
    /// The (component, device) pairs warm-up requests ran since it was last cleared
    /// ([`Engine::warm_up`]).
    warmed: Mutex<std::collections::HashSet<(usize, usize)>>,
    devmap: Mutex<DeviceMap>,
    queue: Mutex<Queue>,
    wake: Condvar,
    capacity: usize,
    encoder_pool: bool,
    /// How the VAE decodes (`MOLD_KERNELS`, through the deployment's exec options).
    vae: mold_pipeline::flux::vae::VaeOptions,
    /// Encoders' weights staged to the GPU (`MOLD_LOAD`, through the exec options).
    staged_load: bool,
    /// Hand-offs between GPUs by peer copies (`--no-peer`: through host memory).
    peer_copies: bool,
    next_id: AtomicU64,
    pub metrics: Metrics,
    workers: Mutex<Vec<JoinHandle<()>>>,
    hooks: Hooks,
    log: Log,
}

/// A panic's message.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Pool components: the encoders then the VAE.
const COMPONENTS: [&str; 3] = ["t5", "clip", "vae"];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The first replica's plan (the workload defaults and limits come from it).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn replica_count(&self) -> usize {
        self.replicas.len()
    }

    /// The queue's bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the server is shutting down (nothing more admitted).
    pub fn draining(&self) -> bool {
        lock(&self.queue).closed
    }

    /// How many replicas serve, have failed, and whether the server drains.
    pub fn health(&self) -> Health {
        let q = lock(&self.queue);
        Health {
            replicas: q.replicas.len(),
            serving: q
                .replicas
                .iter()
                .filter(|s| **s == ReplicaState::Serving)
                .count(),
            failed: q
                .replicas
                .iter()
                .filter(|s| matches!(s, ReplicaState::Failed(_)))
                .count(),
            draining: q.closed,
        }
    }

    /// Stops admitting; the workers finish what was admitted, then exit.
    pub fn close(&self) {
        lock(&self.queue).closed = true;
        self.wake.notify_all();
    }

    /// Waits for every worker to exit (after [`Engine::close`]).
    pub fn join(&self) {
        let hs: Vec<JoinHandle<()>> = lock(&self.workers).drain(..).collect();
        for h in hs {
            let _ = h.join();
        }
    }

    /// Queue figures and every device, for `/metrics`.
    pub fn gauges(&self) -> Gauges {
        self.purge();
        let q = lock(&self.queue);
        Gauges {
            queued: q.queued,
            running: q.running,
            queue_capacity: self.capacity,
            replicas_serving: q
                .replicas
                .iter()
                .filter(|s| **s == ReplicaState::Serving)
                .count(),
            connections: 0,
            devices: self
                .pool
                .devices()
                .iter()
                .map(|d| d.id.to_string())
                .collect(),
        }
    }

    /// What `/status` shows: each device and what it does, the replicas, the queue.
    pub fn status(&self) -> serde_json::Value {
        self.purge();
        let holders = self.pool.holders();
        let extras = self.pool.extras();
        let used = self.pool.used();
        let comps = self.pool.components();
        let devices: Vec<serde_json::Value> = self
            .pool
            .devices()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let doing = match &holders[i] {
                    None => "idle".to_string(),
                    Some(Holder::Transformer { replica, request }) => {
                        format!("transformer of replica {replica}, request {request}")
                    }
                    Some(Holder::Component { component, request }) => {
                        format!("{}, request {request}", comps[*component].name)
                    }
                };
                let mut loaded: Vec<String> = comps
                    .iter()
                    .filter(|c| c.planned.contains(&d.id))
                    .map(|c| c.name.clone())
                    .collect();
                loaded.extend(
                    extras[i]
                        .iter()
                        .map(|&c| format!("{} (pool)", comps[c].name)),
                );
                let replicas: Vec<usize> = self
                    .replicas
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.devices.contains(&i))
                    .map(|(k, _)| k)
                    .collect();
                serde_json::json!({
                    "device": d.id.to_string(),
                    "doing": doing,
                    "transformer_of_replicas": replicas,
                    "components": loaded,
                    "accounted_bytes": used[i],
                    "budget_bytes": (d.capacity != u64::MAX).then_some(d.capacity),
                })
            })
            .collect();
        let q = lock(&self.queue);
        let states: Vec<String> = q
            .replicas
            .iter()
            .map(|s| match s {
                ReplicaState::Loading => "loading".to_string(),
                ReplicaState::Serving => "serving".to_string(),
                ReplicaState::Restarting => "restarting".to_string(),
                ReplicaState::Failed(_) => "failed (the log says why)".to_string(),
            })
            .collect();
        serde_json::json!({
            "model": self.model_id,
            "replicas": self.replicas.iter().map(|r| r.devices.iter().map(|&d| self.pool.devices()[d].id.to_string()).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "replica_states": states,
            "encoder_pool": self.encoder_pool,
            "devices": devices,
            "queue": {
                "queued": q.queued,
                "running": q.running,
                "capacity": self.capacity,
                "closed": q.closed,
            },
        })
    }
}
