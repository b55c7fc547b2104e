//! What a server is told, resolved at the command line: [`ServeOptions`] (the HTTP side
//! and the scheduler) and [`Deployment`] (what it runs); [`Hooks`]: fault injection for
//! tests (a worker that panics or waits at a stage).

use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::Plan;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The address `mold serve` binds unless told otherwise: this machine only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7680";

/// How the server listens, admits and schedules.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Requests must carry `Authorization: Bearer <token>` (all but `/health`).
    pub token: Option<String>,
    /// Listen beyond loopback without a token (refused otherwise).
    pub insecure: bool,
    /// `Host` names (with or without a port) accepted besides the listen address,
    /// `localhost`, `127.0.0.1` and `[::1]` at the listen port; `*` accepts any.
    pub allow_hosts: Vec<String>,
    /// `Origin`s accepted besides `http(s)://<an accepted host>`; a request without
    /// `Origin` (curl, scripts) is accepted.
    pub allow_origins: Vec<String>,
    /// Requests admitted but not yet started on a transformer; beyond it, 429.
    pub queue: usize,
    /// Text encoders and the VAE run on any idle device with room (the lock pool);
    /// off: each request's on its replica's planned devices.
    pub encoder_pool: bool,
    /// Before serving, one request per replica at the plan's size, one step (with
    /// `encoder_pool`, one more per device holding an encoder or the VAE, run there): every kernel's
    /// first load, cuDNN's plans and the collectives' first use happen before the server
    /// answers, so the first client pays a warm request. Off here; `mold serve` turns it
    /// on (`--warm-up off` leaves it out). The start waits for it: start the engine
    /// outside an async runtime, as [`crate::serve`] and [`crate::spawn`] do.
    pub warm_up: bool,
    /// Further sizes (width, height) the warm-up runs, one request per replica each, so
    /// that clients asking for them meet warm kernels and cuDNN plans too; each must be a
    /// size a request could ask for (the model's range and multiple, at most the plan's).
    pub warm_up_sizes: Vec<(u32, u32)>,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Longest prompt, characters.
    pub max_prompt_chars: usize,
    /// Most images one `/v1/images/generations` request may ask for.
    pub max_images: u32,
    /// Most denoising steps a request may ask for.
    pub max_steps: u32,
    /// Open connections at most; one more is answered 503 and closed.
    pub max_connections: usize,
    /// The longest a client may take to send a request's header, counted from the
    /// connection's start or the end of the previous response: so also how long a
    /// kept-alive connection may sit idle.
    pub header_timeout: Duration,
    /// The longest a client may take to send a request's body (408 beyond).
    pub body_timeout: Duration,
    /// The longest a response may wait for a client that does not read it; then the
    /// connection is closed.
    pub write_timeout: Duration,
    /// The longest a request may take from admission (queued and running): 504 beyond,
    /// the request cancelled and its queue slot freed.
    pub request_timeout: Duration,
    /// Interval of the keep-alive comments on an idle event stream.
    pub sse_keep_alive: Duration,
    /// Fault injection, for tests; none by default.
    pub hooks: Hooks,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: DEFAULT_LISTEN.parse().expect("a valid address"),
            token: None,
            insecure: false,
            allow_hosts: Vec::new(),
            allow_origins: Vec::new(),
            queue: 32,
            encoder_pool: true,
            warm_up: false,
            warm_up_sizes: Vec::new(),
            max_body_bytes: 64 * 1024,
            max_prompt_chars: 4000,
            max_images: 8,
            max_steps: 200,
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(600),
            sse_keep_alive: Duration::from_secs(15),
            hooks: Hooks::default(),
        }
    }
}

/// Options a server refuses to start with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionsError {
    #[error("--listen {0}: beyond this machine without --token-file: anyone who can reach it could run the GPUs; give --token-file FILE (clients send `Authorization: Bearer <token>`), or --insecure to serve them all")]
    Exposed(SocketAddr),
    #[error("--{flag} 0: give a positive value")]
    Zero { flag: &'static str },
    #[error("--allow-host `{0}`: write a host name or address, with an optional :PORT (e.g. gpu-box.lan or gpu-box.lan:7680), or * for any")]
    Host(String),
    #[error("--allow-origin `{0}`: write SCHEME://HOST[:PORT], e.g. https://app.example.com")]
    Origin(String),
}

impl ServeOptions {
    /// Refuses what cannot be served safely or at all, in one line naming the flag.
    pub fn check(&self) -> Result<(), OptionsError> {
        if !self.listen.ip().is_loopback() && self.token.is_none() && !self.insecure {
            return Err(OptionsError::Exposed(self.listen));
        }
        for (flag, zero) in [
            ("max-connections", self.max_connections == 0),
            ("header-timeout", self.header_timeout.is_zero()),
            ("body-timeout", self.body_timeout.is_zero()),
            ("write-timeout", self.write_timeout.is_zero()),
            ("request-timeout", self.request_timeout.is_zero()),
            ("sse-keep-alive", self.sse_keep_alive.is_zero()),
            ("queue", self.queue == 0),
        ] {
            if zero {
                return Err(OptionsError::Zero { flag });
            }
        }
        for h in &self.allow_hosts {
            let ok = h == "*"
                || (!h.is_empty()
                    && !h.contains(['/', ' ', '@', '?', '#'])
                    && h.is_ascii()
                    && crate::http::split_host(h).is_some());
            if !ok {
                return Err(OptionsError::Host(h.clone()));
            }
        }
        for o in &self.allow_origins {
            let ok = o.split_once("://").is_some_and(|(scheme, host)| {
                !scheme.is_empty()
                    && !host.is_empty()
                    && !host.contains(['/', ' ', '@'])
                    && crate::http::split_host(host).is_some()
            });
            if !ok {
                return Err(OptionsError::Origin(o.clone()));
            }
        }
        Ok(())
    }

    /// Whether the server answers anyone who can reach it (a warning for the log).
    pub fn exposed_without_token(&self) -> bool {
        !self.listen.ip().is_loopback() && self.token.is_none()
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

/// A point in a request's life where [`Hooks`] act.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// A request read and checked, about to be admitted (on the HTTP side).
    Admit,
    /// The text encoders (on an encoder worker, or the replica with the pool off).
    Encode,
    /// The transformer, on its replica.
    Denoise,
    /// The VAE.
    Decode,
    /// The PNG of the image.
    Png,
    /// A replica reloading its transformer after a panic.
    Reload,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Admit => "admission",
            Stage::Encode => "the text encoders",
            Stage::Denoise => "the transformer",
            Stage::Decode => "the VAE",
            Stage::Png => "the PNG encoder",
            Stage::Reload => "reloading the transformer",
        })
    }
}

/// Fault injection for tests, as `MOLD_FAULT` is for `mold exec`: workers that panic at
/// a stage a given number of times, and a [`Gate`] that holds every request at a stage
/// until the test opens it. Off by default; `mold serve` sets none.
#[derive(Clone, Debug, Default)]
pub struct Hooks {
    panics: Vec<(Stage, Arc<AtomicUsize>)>,
    hold: Option<(Stage, Arc<Gate>)>,
}

impl Hooks {
    /// The next `times` requests (or reloads) reaching `stage` panic there.
    pub fn panic_at(mut self, stage: Stage, times: usize) -> Hooks {
        self.panics.push((stage, Arc::new(AtomicUsize::new(times))));
        self
    }

    /// Every request reaching `stage` waits at `gate` until it opens.
    pub fn hold_at(mut self, stage: Stage, gate: Arc<Gate>) -> Hooks {
        self.hold = Some((stage, gate));
        self
    }

    /// Whether anything is set at `stage`.
    pub(crate) fn active(&self, stage: Stage) -> bool {
        self.hold.as_ref().is_some_and(|(s, _)| *s == stage)
            || self.panics.iter().any(|(s, _)| *s == stage)
    }

    /// What a worker does at `stage`: waits at the gate, panics, or nothing.
    pub(crate) fn at(&self, stage: Stage) {
        if let Some((s, gate)) = &self.hold {
            if *s == stage {
                gate.pass();
            }
        }
        for (s, left) in &self.panics {
            if *s == stage
                && left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                panic!("injected panic (ServeOptions::hooks) in {stage}");
            }
        }
    }
}

/// A gate workers wait at until a test opens it; the test can wait for arrivals.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (bool, usize)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets every waiting and later worker through.
    pub fn open(&self) {
        self.lock().0 = true;
        self.changed.notify_all();
    }

    /// How many workers reached the gate so far.
    pub fn arrived(&self) -> usize {
        self.lock().1
    }

    /// Waits until `n` workers reached the gate; false if `limit` passed first.
    pub fn wait_arrived(&self, n: usize, limit: Duration) -> bool {
        let g = self.lock();
        let (g, _) = self
            .changed
            .wait_timeout_while(g, limit, |s| s.1 < n)
            .unwrap_or_else(|e| e.into_inner());
        g.1 >= n
    }

    fn pass(&self) {
        let mut g = self.lock();
        g.1 += 1;
        self.changed.notify_all();
        while !g.0 {
            g = self.changed.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}
