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

use crate::metrics::{Gauges, Metrics, Outcome};
use crate::options::{Deployment, Hooks, ServeOptions, Stage};
use crate::pool::{ComponentCost, DeviceBudget, Holder, Pool};
use mold_exec::runtime::DeviceMap;
use mold_pipeline::flux::resident::ENCODERS;
use mold_pipeline::flux::resident::{Decoder, Denoiser, Job};
use mold_pipeline::flux::Prepared;
use mold_pipeline::{PipelineError, Progress, Request};
use mold_plan::{ComponentRole, DeviceId, Plan};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

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

/// One admitted image request.
struct Ticket {
    id: u64,
    req: Request,
    cancel: Arc<AtomicBool>,
    events: Option<mpsc::UnboundedSender<Event>>,
    done: oneshot::Sender<Result<Image, Failure>>,
    admitted: Instant,
}

impl Ticket {
    fn progress(&self) -> impl FnMut(&Progress) + '_ {
        move |p: &Progress| {
            if let Some(tx) = &self.events {
                let _ = tx.send(Event::Progress(p.clone()));
            }
        }
    }
}

/// A request ready for a transformer: encoded already (pool on) or not.
struct Ready {
    ticket: Ticket,
    job: Option<Job>,
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

#[derive(Default)]
struct Queue {
    to_encode: VecDeque<Ticket>,
    ready: VecDeque<Ready>,
    /// Admitted, not yet started on a transformer (encoding included).
    queued: usize,
    /// Being encoded by an encoder worker.
    encoding: usize,
    /// On a transformer or decoding.
    running: usize,
    closed: bool,
    replicas: Vec<ReplicaState>,
}

impl Queue {
    fn none_left(&self) -> bool {
        self.replicas
            .iter()
            .all(|s| matches!(s, ReplicaState::Failed(_)))
    }

    /// Takes every queued request out (they fail: no replica is left).
    fn take_all(&mut self) -> Vec<Ticket> {
        let mut out: Vec<Ticket> = self.to_encode.drain(..).collect();
        out.extend(self.ready.drain(..).map(|r| r.ticket));
        self.queued -= out.len();
        out
    }

    /// Takes the queued requests whose cancel flag is set out of the queue.
    fn take_cancelled(&mut self) -> Vec<Ticket> {
        let gone = |t: &Ticket| t.cancel.load(Ordering::Relaxed);
        let mut out = Vec::new();
        let mut keep = VecDeque::new();
        for t in self.to_encode.drain(..) {
            if gone(&t) {
                out.push(t);
            } else {
                keep.push_back(t);
            }
        }
        self.to_encode = keep;
        let mut keep = VecDeque::new();
        for r in self.ready.drain(..) {
            if gone(&r.ticket) {
                out.push(r.ticket);
            } else {
                keep.push_back(r);
            }
        }
        self.ready = keep;
        self.queued -= out.len();
        out
    }
}

/// How a request failed, as the scheduler sees it.
enum Fail {
    Pipeline(PipelineError),
    Panic { stage: Stage, message: String },
    NoReplica,
}

/// A finished request's PNG.
struct Made {
    png: Vec<u8>,
    width: u32,
    height: u32,
}

/// Why a replica's loop returned.
enum Exit {
    Closed,
    /// Its transformer panicked: reload it.
    Restart,
}

/// An encoder or VAE instance on one device.
enum Instance {
    Encoder(Box<mold_pipeline::flux::resident::TextEncoder>),
    Decoder(Box<Decoder>),
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
    devmap: Mutex<DeviceMap>,
    queue: Mutex<Queue>,
    wake: Condvar,
    capacity: usize,
    encoder_pool: bool,
    /// How the VAE decodes (`MOLD_KERNELS`, through the deployment's exec options).
    vae: mold_pipeline::flux::vae::VaeOptions,
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

/// The pool's devices and components from the replicas' plans and the cost model.
fn pool_of(d: &Deployment) -> Result<Pool, StartError> {
    let mut held: BTreeMap<DeviceId, (u64, u64)> = BTreeMap::new();
    let mut budgets: BTreeMap<DeviceId, u64> = BTreeMap::new();
    for plan in &d.replicas {
        let ev = mold_cost::evaluate(plan, &d.model, &d.machine);
        for u in &ev.devices {
            let e = held.entry(u.device.clone()).or_default();
            e.0 = e.0.saturating_add(u.weights.saturating_add(u.buffers));
            e.1 = e.1.max(u.activation);
            budgets.insert(u.device.clone(), u.budget.saturating_sub(u.headroom));
        }
    }
    let mut devices: Vec<DeviceBudget> = held
        .iter()
        .map(|(id, (h, a))| DeviceBudget {
            id: id.clone(),
            capacity: budgets[id],
            held: *h,
            activation: *a,
            extra: true,
        })
        .collect();
    let plan = &d.replicas[0];
    let ctx = mold_cost::Ctx::new(&d.model, &d.machine, &plan.workload);
    let mut components = Vec::new();
    for name in COMPONENTS {
        let c = plan
            .components
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| StartError::Plan(format!("the plan has no `{name}` component")))?;
        let spec = d
            .model
            .component(name)
            .ok_or_else(|| StartError::Plan(format!("{} has no `{name}` component", d.model.id)))?;
        let mut planned = BTreeSet::new();
        for p in &d.replicas {
            let (dev, _) = mold_pipeline::placement(p, name)?;
            planned.insert(dev);
        }
        for dev in &planned {
            if !devices.iter().any(|x| &x.id == dev) {
                // The host (or a device outside the profile): what the plan put there,
                // nothing more.
                devices.push(DeviceBudget {
                    id: dev.clone(),
                    capacity: u64::MAX,
                    held: 0,
                    activation: 0,
                    extra: false,
                });
            }
        }
        components.push(ComponentCost {
            name: name.into(),
            weight: spec.weight_bytes(c.dtype),
            activation: ctx.component_activation(spec, c.dtype),
            planned: planned.into_iter().collect(),
        });
    }
    Ok(Pool::new(devices, components))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn role_ok(plan: &Plan) -> Result<(), StartError> {
    for c in &plan.components {
        if c.role != ComponentRole::Transformer && !COMPONENTS.contains(&c.name.as_str()) {
            return Err(StartError::Plan(format!(
                "component `{}`: the server runs t5, clip, transformer and vae",
                c.name
            )));
        }
    }
    Ok(())
}

impl Engine {
    /// Checks every replica's plan (no weight read), loads the encoders and VAE where the
    /// plans place them and each replica's transformer on its thread, and starts the
    /// workers. `log` sees a line per component loaded, and each failure with its cause.
    pub fn start(d: &Deployment, opts: &ServeOptions, log: Log) -> Result<Arc<Engine>, StartError> {
        if d.replicas.is_empty() {
            return Err(StartError::Plan("no replica to run".into()));
        }
        let mut preps = Vec::new();
        for p in &d.replicas {
            role_ok(p)?;
            preps.push(mold_pipeline::flux::prepare(p, &d.weights)?);
        }
        let pool = pool_of(d)?;
        let mut replicas = Vec::new();
        for p in &d.replicas {
            let tf = p.transformer().expect("prepare checked");
            let devices: Vec<usize> = tf
                .parts
                .iter()
                .flat_map(|x| &x.devices)
                .filter_map(|id| pool.index(id))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let mut planned = Vec::new();
            for name in COMPONENTS {
                let (dev, _) = mold_pipeline::placement(p, name)?;
                planned.push(pool.index(&dev).expect("pool_of added it"));
            }
            replicas.push(ReplicaInfo {
                plan: p.clone(),
                devices,
                planned,
            });
        }
        let prep = preps.remove(0);
        let n = replicas.len();
        let engine = Arc::new(Engine {
            model_id: d.replicas[0].model.id.clone(),
            prep,
            plan: d.replicas[0].clone(),
            pool,
            replicas,
            instances: Mutex::new(HashMap::new()),
            devmap: Mutex::new(DeviceMap::default()),
            queue: Mutex::new(Queue {
                replicas: vec![ReplicaState::Loading; n],
                ..Queue::default()
            }),
            wake: Condvar::new(),
            capacity: opts.queue.max(1),
            encoder_pool: opts.encoder_pool,
            vae: mold_pipeline::flux::vae::VaeOptions::with_kernels(d.exec.kernels),
            next_id: AtomicU64::new(1),
            metrics: Metrics::default(),
            workers: Mutex::new(Vec::new()),
            hooks: opts.hooks.clone(),
            log: log.clone(),
        });
        // The planned instances, loaded now (errors before serving).
        for (c, cost) in engine.pool.components().iter().enumerate() {
            for dev in &cost.planned {
                let d = engine.pool.index(dev).expect("in the pool");
                let mut on = |p: &Progress| log(format!("{p}"));
                engine.instance(c, d, &mut on)?;
            }
        }
        // One thread per replica, each loading its transformer.
        let (tx, rx) = std::sync::mpsc::channel::<Result<(), PipelineError>>();
        let mut preps_iter = std::iter::once(None).chain(preps.into_iter().map(Some));
        for r in 0..engine.replicas.len() {
            let own = preps_iter.next().flatten();
            let (e, tx) = (engine.clone(), tx.clone());
            let exec = d.exec.clone();
            let h = std::thread::Builder::new()
                .name(format!("mold-replica-{r}"))
                .spawn(move || {
                    let prep = own.as_ref().unwrap_or(&e.prep);
                    let load = || {
                        let mut devmap = lock(&e.devmap);
                        let mut on = |p: &Progress| (e.log)(format!("replica {r}: {p}"));
                        Denoiser::load(&e.replicas[r].plan, prep, &exec, &mut devmap, &mut on)
                    };
                    let mut den = match load() {
                        Ok(den) => den,
                        Err(err) => {
                            let _ = tx.send(Err(err));
                            return;
                        }
                    };
                    lock(&e.queue).replicas[r] = ReplicaState::Serving;
                    let _ = tx.send(Ok(()));
                    drop(tx);
                    while let Exit::Restart = e.replica_loop(r, &den) {
                        // Its state after a panic is unknown: load it afresh (the old
                        // one freed first).
                        drop(den);
                        (e.log)(format!(
                            "replica {r}: reloading its transformer after a panic"
                        ));
                        let reloaded = catch_unwind(AssertUnwindSafe(|| {
                            e.hooks.at(Stage::Reload);
                            load()
                        }));
                        den = match reloaded {
                            Ok(Ok(d)) => d,
                            Ok(Err(err)) => {
                                e.replica_failed(
                                    r,
                                    format!(
                                        "its transformer failed to reload after a panic: {err}"
                                    ),
                                );
                                return;
                            }
                            Err(p) => {
                                e.replica_failed(
                                    r,
                                    format!(
                                        "its transformer panicked reloading after a panic: {}",
                                        panic_message(p.as_ref())
                                    ),
                                );
                                return;
                            }
                        };
                        lock(&e.queue).replicas[r] = ReplicaState::Serving;
                        e.wake.notify_all();
                        (e.log)(format!("replica {r}: serving again"));
                    }
                })
                .map_err(|e| StartError::Plan(format!("cannot start a replica thread: {e}")))?;
            lock(&engine.workers).push(h);
        }
        drop(tx);
        let mut first_err = None;
        for _ in 0..engine.replicas.len() {
            match rx.recv() {
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Ok(Ok(())) => {}
                // A replica thread panicked while loading.
                Err(_) => {
                    first_err.get_or_insert(PipelineError::Plan(
                        "a replica's thread panicked loading its transformer".into(),
                    ));
                    break;
                }
            }
        }
        if let Some(e) = first_err {
            engine.close();
            engine.join();
            return Err(e.into());
        }
        if opts.encoder_pool {
            // As many encoder workers as devices: each waits for a device in the pool.
            for w in 0..engine.pool.devices().len() {
                let e = engine.clone();
                let h = std::thread::Builder::new()
                    .name(format!("mold-encode-{w}"))
                    .spawn(move || e.encode_loop())
                    .map_err(|e| {
                        StartError::Plan(format!("cannot start an encoder thread: {e}"))
                    })?;
                lock(&engine.workers).push(h);
            }
        }
        Ok(engine)
    }

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

    /// Admits `reqs` together, or none of them. Returns one [`Pending`] per request, in
    /// order; `events` (shared) hears progress.
    pub fn submit(
        &self,
        reqs: Vec<Request>,
        cancel: Arc<AtomicBool>,
        events: Option<mpsc::UnboundedSender<Event>>,
    ) -> Result<Vec<Pending>, Refused> {
        // Requests given up (deadline passed, client gone) leave the queue first.
        self.purge();
        let mut q = lock(&self.queue);
        let n = reqs.len();
        let refusal = if q.closed {
            Some((Refused::Draining, Outcome::Unavailable))
        } else if q.none_left() {
            Some((Refused::NoReplica, Outcome::Unavailable))
        } else if n > self.capacity {
            Some((
                Refused::TooMany {
                    n,
                    capacity: self.capacity,
                },
                Outcome::Rejected,
            ))
        } else if q.queued + n > self.capacity {
            Some((
                Refused::Full {
                    capacity: self.capacity,
                },
                Outcome::Overloaded,
            ))
        } else {
            None
        };
        if let Some((r, outcome)) = refusal {
            drop(q);
            self.metrics.count(outcome, n as u64);
            return Err(r);
        }
        let mut out = Vec::new();
        for req in reqs {
            let (done, rx) = oneshot::channel();
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let ticket = Ticket {
                id,
                req,
                cancel: cancel.clone(),
                events: events.clone(),
                done,
                admitted: Instant::now(),
            };
            q.queued += 1;
            if self.encoder_pool {
                q.to_encode.push_back(ticket);
            } else {
                q.ready.push_back(Ready { ticket, job: None });
            }
            out.push(Pending { id, rx });
        }
        drop(q);
        self.wake.notify_all();
        Ok(out)
    }

    /// Takes the queued requests that were given up out of the queue, and ends them.
    fn purge(&self) {
        let gone = lock(&self.queue).take_cancelled();
        for t in gone {
            self.finish(t, Err(Fail::Pipeline(PipelineError::Cancelled)), 0);
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

    /// Replica `r` is out of service; when none is left, what is queued fails.
    fn replica_failed(&self, r: usize, why: String) {
        (self.log)(format!("replica {r}: out of service: {why}"));
        let orphans = {
            let mut q = lock(&self.queue);
            q.replicas[r] = ReplicaState::Failed(why);
            if q.none_left() {
                q.take_all()
            } else {
                Vec::new()
            }
        };
        if !orphans.is_empty() || self.health().serving == 0 {
            (self.log)("no replica can serve: requests get 503; restart the server".into());
        }
        for t in orphans {
            self.finish(t, Err(Fail::NoReplica), r);
        }
        self.wake.notify_all();
    }

    /// The instance of component `c` on device `d`, loaded on first use (the caller holds
    /// the device, or it is startup).
    fn instance(
        &self,
        c: usize,
        d: usize,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Arc<Instance>, PipelineError> {
        if let Some(i) = lock(&self.instances).get(&(c, d)) {
            return Ok(i.clone());
        }
        let id = self.pool.devices()[d].id.clone();
        let name = COMPONENTS[c];
        let inst = {
            let mut devmap = lock(&self.devmap);
            if name == "vae" {
                Instance::Decoder(Box::new(Decoder::load_with(
                    &self.plan,
                    &self.prep,
                    &id,
                    &mut devmap,
                    self.vae,
                    progress,
                )?))
            } else {
                Instance::Encoder(Box::new(mold_pipeline::flux::resident::TextEncoder::load(
                    &self.plan,
                    &self.prep,
                    name,
                    &id,
                    &mut devmap,
                    progress,
                )?))
            }
        };
        let inst = Arc::new(inst);
        lock(&self.instances).insert((c, d), inst.clone());
        Ok(inst)
    }

    /// Runs component `c` for `ticket` on a device from the pool (`allowed`, else any),
    /// loading its instance there on first use; `f` gets the instance. If `f` panics, the
    /// instance is dropped (loaded afresh on next use) and the panic goes on.
    fn with_component<T>(
        &self,
        c: usize,
        allowed: Option<&[usize]>,
        ticket: &Ticket,
        f: impl FnOnce(&Instance) -> Result<T, PipelineError>,
    ) -> Result<T, PipelineError> {
        let lease = self
            .pool
            .component(c, allowed, ticket.id, &ticket.cancel)
            .map_err(|_| PipelineError::Cancelled)?;
        let t = Instant::now();
        let inst = match self.instance(c, lease.device(), &mut ticket.progress()) {
            Ok(i) => i,
            Err(e) => {
                lease.load_failed();
                return Err(e);
            }
        };
        let out = match catch_unwind(AssertUnwindSafe(|| f(&inst))) {
            Ok(out) => out,
            Err(p) => {
                lock(&self.instances).remove(&(c, lease.device()));
                drop(inst);
                drop(lease);
                resume_unwind(p);
            }
        };
        self.metrics
            .busy(&lease.device_id().to_string(), t.elapsed().as_secs_f64());
        out
    }

    /// Encodes `job`'s prompt with both encoders: on replica `own`'s planned devices, or
    /// (`None`) on any device the pool gives.
    fn encode(
        &self,
        ticket: &Ticket,
        job: &mut Job,
        own: Option<usize>,
    ) -> Result<(), PipelineError> {
        for c in 0..ENCODERS.len() {
            let allowed = own.map(|r| vec![self.replicas[r].planned[c]]);
            self.with_component(c, allowed.as_deref(), ticket, |inst| {
                if c == 0 {
                    self.hooks.at(Stage::Encode);
                }
                match inst {
                    Instance::Encoder(enc) => {
                        job.encode(enc, None, &ticket.cancel, &mut ticket.progress())
                    }
                    Instance::Decoder(_) => unreachable!("components 0 and 1 are encoders"),
                }
            })?;
        }
        Ok(())
    }

    fn encode_loop(&self) {
        loop {
            let ticket = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(t) = q.to_encode.pop_front() {
                        q.encoding += 1;
                        break Some(t);
                    }
                    if q.closed {
                        break None;
                    }
                    q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(ticket) = ticket else { return };
            let res = catch_unwind(AssertUnwindSafe(|| {
                Job::begin(
                    &self.plan,
                    &self.prep.flux,
                    &ticket.req,
                    &mut ticket.progress(),
                )
                .and_then(|mut job| self.encode(&ticket, &mut job, None).map(|_| job))
            }));
            let mut q = lock(&self.queue);
            q.encoding -= 1;
            let failed = match res {
                Ok(Ok(job)) if !q.none_left() => {
                    q.ready.push_back(Ready {
                        ticket,
                        job: Some(job),
                    });
                    None
                }
                Ok(Ok(_)) => Some((ticket, Fail::NoReplica)),
                Ok(Err(e)) => Some((ticket, Fail::Pipeline(e))),
                Err(p) => Some((
                    ticket,
                    Fail::Panic {
                        stage: Stage::Encode,
                        message: panic_message(p.as_ref()),
                    },
                )),
            };
            if let Some((ticket, fail)) = failed {
                q.queued -= 1;
                drop(q);
                self.finish(ticket, Err(fail), 0);
            } else {
                drop(q);
            }
            self.wake.notify_all();
        }
    }

    fn replica_loop(&self, r: usize, den: &Denoiser) -> Exit {
        loop {
            let ready = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(x) = q.ready.pop_front() {
                        q.queued -= 1;
                        q.running += 1;
                        break Some(x);
                    }
                    if q.closed && q.to_encode.is_empty() && q.encoding == 0 {
                        break None;
                    }
                    q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(Ready { ticket, job }) = ready else {
                self.wake.notify_all();
                return Exit::Closed;
            };
            let stage = Cell::new(Stage::Encode);
            let res = catch_unwind(AssertUnwindSafe(|| self.make(r, den, &ticket, job, &stage)));
            let (res, restart) = match res {
                Ok(Ok(m)) => (Ok(m), false),
                Ok(Err(e)) => (Err(Fail::Pipeline(e)), false),
                Err(p) => {
                    let stage = stage.get();
                    let message = panic_message(p.as_ref());
                    (Err(Fail::Panic { stage, message }), stage == Stage::Denoise)
                }
            };
            {
                let mut q = lock(&self.queue);
                q.running -= 1;
                if restart {
                    q.replicas[r] = ReplicaState::Restarting;
                }
            }
            self.finish(ticket, res, r);
            self.wake.notify_all();
            if restart {
                return Exit::Restart;
            }
        }
    }

    /// Denoises (encoding first when the pool did not) and decodes one request on
    /// replica `r`, then makes its PNG; `stage` follows where it is.
    fn make(
        &self,
        r: usize,
        den: &Denoiser,
        ticket: &Ticket,
        job: Option<Job>,
        stage: &Cell<Stage>,
    ) -> Result<Made, PipelineError> {
        let rep = &self.replicas[r];
        let mut job = match job {
            Some(j) => j,
            None => {
                let mut j = Job::begin(
                    &rep.plan,
                    &self.prep.flux,
                    &ticket.req,
                    &mut ticket.progress(),
                )?;
                self.encode(ticket, &mut j, Some(r))?;
                j
            }
        };
        stage.set(Stage::Denoise);
        self.hooks.at(Stage::Denoise);
        let latents = {
            let lease = self.pool.transformer(r, &rep.devices, ticket.id);
            let t = Instant::now();
            let out = job.denoise(den, true, &ticket.cancel, &mut ticket.progress());
            let s = t.elapsed().as_secs_f64();
            for &d in &rep.devices {
                self.metrics.busy(&self.pool.devices()[d].id.to_string(), s);
            }
            drop(lease);
            out?
        };
        stage.set(Stage::Decode);
        let vae = COMPONENTS.len() - 1;
        let allowed = (!self.encoder_pool).then(|| vec![rep.planned[vae]]);
        let mut job = Some(job);
        let out = self.with_component(vae, allowed.as_deref(), ticket, |inst| {
            self.hooks.at(Stage::Decode);
            match inst {
                Instance::Decoder(dec) => job.take().expect("once").decode(
                    dec,
                    latents,
                    den.target(),
                    &ticket.cancel,
                    &mut ticket.progress(),
                ),
                Instance::Encoder(_) => unreachable!("the VAE"),
            }
        })?;
        stage.set(Stage::Png);
        self.hooks.at(Stage::Png);
        let png = mold_pipeline::encode_png(&out.image, &out.metadata)?;
        Ok(Made {
            png,
            width: out.image.width,
            height: out.image.height,
        })
    }

    /// Answers a request's client, counts it, and logs a failure's cause with its id.
    fn finish(&self, ticket: Ticket, res: Result<Made, Fail>, r: usize) {
        let id = ticket.id;
        let fail = |kind| Err(Failure { kind, request: id });
        let reply = match res {
            Ok(m) => {
                let seconds = ticket.admitted.elapsed().as_secs_f64();
                self.metrics.count(Outcome::Ok, 1);
                self.metrics.latency(seconds);
                Ok(Image {
                    png: m.png,
                    seed: ticket.req.seed,
                    width: m.width,
                    height: m.height,
                    replica: r,
                    seconds,
                    request: id,
                })
            }
            Err(Fail::Pipeline(e))
                if matches!(e, PipelineError::Cancelled)
                    || ticket.cancel.load(Ordering::Relaxed) =>
            {
                self.metrics.count(Outcome::Cancelled, 1);
                fail(FailureKind::Cancelled)
            }
            Err(Fail::Pipeline(e)) => {
                self.metrics.count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: failed: {}",
                    e.to_string().replace('\n', " ")
                ));
                fail(FailureKind::Internal)
            }
            Err(Fail::Panic { stage, message }) => {
                self.metrics.count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: panicked in {stage} (replica {r}): {}",
                    message.replace('\n', " ")
                ));
                fail(FailureKind::Internal)
            }
            Err(Fail::NoReplica) => {
                self.metrics.count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: failed: no replica is left to run it"
                ));
                fail(FailureKind::Unavailable)
            }
        };
        let _ = ticket.done.send(reply);
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
