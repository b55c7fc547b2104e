//! The scheduler: a bounded queue of requests, one worker thread per replica (its
//! transformer loaded once, on its devices), encoder workers that encode queued requests
//! on idle devices through the lock pool ([`crate::pool`]), and the encoder and VAE
//! instances, each loaded once per device and reused.
//!
//! A request goes: admitted ([`Engine::submit`], 429 beyond the bound) → encoded (with
//! the pool on: by an encoder worker on any idle device with room; off: by its replica on
//! the devices the plan gives) → denoised by the first free replica, which holds its
//! devices' locks meanwhile → decoded on an idle device with a VAE (or room for one) →
//! its PNG. Its cancel flag (set when the client goes away) is checked between stages
//! and denoising steps; a cancelled request frees everything it held.

use crate::metrics::{Gauges, Metrics, Outcome};
use crate::options::Deployment;
use crate::pool::{ComponentCost, DeviceBudget, Holder, Pool};
use mold_exec::runtime::DeviceMap;
use mold_pipeline::resident::ENCODERS;
use mold_pipeline::{Decoder, Denoiser, Job, PipelineError, Prepared, Progress, Request};
use mold_plan::{ComponentRole, DeviceId, Plan};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
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
}

/// What a request's client hears while it runs.
#[derive(Clone, Debug)]
pub enum Event {
    Progress(Progress),
}

/// The queue is full.
#[derive(Debug)]
pub struct Overloaded {
    pub capacity: usize,
}

/// A failure after admission, as one line.
pub type Failure = String;

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
}

/// An encoder or VAE instance on one device.
enum Instance {
    Encoder(Box<mold_pipeline::TextEncoder>),
    Decoder(Box<Decoder>),
}

/// One replica: its plan and its transformer's devices (pool indices).
struct ReplicaInfo {
    plan: Plan,
    devices: Vec<usize>,
    /// Per pool component, the device its plan places it on (pool index).
    planned: Vec<usize>,
}

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
    next_id: AtomicU64,
    pub metrics: Metrics,
    workers: Mutex<Vec<JoinHandle<()>>>,
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
    /// workers. `log` sees a line per component loaded.
    pub fn start(
        d: &Deployment,
        queue: usize,
        encoder_pool: bool,
        log: Arc<dyn Fn(String) + Send + Sync>,
    ) -> Result<Arc<Engine>, StartError> {
        if d.replicas.is_empty() {
            return Err(StartError::Plan("no replica to run".into()));
        }
        let mut preps = Vec::new();
        for p in &d.replicas {
            role_ok(p)?;
            preps.push(mold_pipeline::prepare(p, &d.weights)?);
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
        let engine = Arc::new(Engine {
            model_id: d.replicas[0].model.id.clone(),
            prep,
            plan: d.replicas[0].clone(),
            pool,
            replicas,
            instances: Mutex::new(HashMap::new()),
            devmap: Mutex::new(DeviceMap::default()),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            capacity: queue.max(1),
            encoder_pool,
            next_id: AtomicU64::new(1),
            metrics: Metrics::default(),
            workers: Mutex::new(Vec::new()),
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
            let (e, tx, log) = (engine.clone(), tx.clone(), log.clone());
            let exec = d.exec.clone();
            let h = std::thread::Builder::new()
                .name(format!("mold-replica-{r}"))
                .spawn(move || {
                    let prep = own.as_ref().unwrap_or(&e.prep);
                    let plan = &e.replicas[r].plan;
                    let loaded = {
                        let mut devmap = lock(&e.devmap);
                        let mut on = |p: &Progress| log(format!("replica {r}: {p}"));
                        Denoiser::load(plan, prep, &exec, &mut devmap, &mut on)
                    };
                    match loaded {
                        Ok(den) => {
                            let _ = tx.send(Ok(()));
                            e.replica_loop(r, &den);
                        }
                        Err(err) => {
                            let _ = tx.send(Err(err));
                        }
                    }
                })
                .map_err(|e| StartError::Plan(format!("cannot start a replica thread: {e}")))?;
            lock(&engine.workers).push(h);
        }
        drop(tx);
        let mut first_err = None;
        for _ in 0..engine.replicas.len() {
            if let Ok(Err(e)) = rx.recv() {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            engine.close();
            engine.join();
            return Err(e.into());
        }
        if encoder_pool {
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

    /// The first replica's plan (the workload defaults come from it).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn replica_count(&self) -> usize {
        self.replicas.len()
    }

    /// Admits `reqs` together, or none of them when the queue has no room for all.
    /// Returns one receiver per request, in order; `events` (shared) hears progress.
    pub fn submit(
        &self,
        reqs: Vec<Request>,
        cancel: Arc<AtomicBool>,
        events: Option<mpsc::UnboundedSender<Event>>,
    ) -> Result<Vec<oneshot::Receiver<Result<Image, Failure>>>, Overloaded> {
        let mut q = lock(&self.queue);
        if q.closed || q.queued + reqs.len() > self.capacity {
            drop(q);
            self.metrics.count(Outcome::Overloaded, reqs.len() as u64);
            return Err(Overloaded {
                capacity: self.capacity,
            });
        }
        let mut out = Vec::new();
        for req in reqs {
            let (done, rx) = oneshot::channel();
            let ticket = Ticket {
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
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
            out.push(rx);
        }
        drop(q);
        self.wake.notify_all();
        Ok(out)
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
                Instance::Decoder(Box::new(Decoder::load(
                    &self.plan,
                    &self.prep,
                    &id,
                    &mut devmap,
                    progress,
                )?))
            } else {
                Instance::Encoder(Box::new(mold_pipeline::TextEncoder::load(
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
    /// loading its instance there on first use; `f` gets the instance.
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
        let out = f(&inst);
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
            self.with_component(c, allowed.as_deref(), ticket, |inst| match inst {
                Instance::Encoder(enc) => {
                    job.encode(enc, None, &ticket.cancel, &mut ticket.progress())
                }
                Instance::Decoder(_) => unreachable!("components 0 and 1 are encoders"),
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
            let res = Job::begin(
                &self.plan,
                &self.prep.flux,
                &ticket.req,
                &mut ticket.progress(),
            )
            .and_then(|mut job| self.encode(&ticket, &mut job, None).map(|_| job));
            let mut q = lock(&self.queue);
            q.encoding -= 1;
            match res {
                Ok(job) => q.ready.push_back(Ready {
                    ticket,
                    job: Some(job),
                }),
                Err(e) => {
                    q.queued -= 1;
                    drop(q);
                    self.finish(ticket, Err(e), 0);
                    q = lock(&self.queue);
                }
            }
            drop(q);
            self.wake.notify_all();
        }
    }

    fn replica_loop(&self, r: usize, den: &Denoiser) {
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
                return;
            };
            let res = self.run(r, den, &ticket, job);
            lock(&self.queue).running -= 1;
            self.finish(ticket, res, r);
            self.wake.notify_all();
        }
    }

    /// Denoises (encoding first when the pool did not) and decodes one request on
    /// replica `r`.
    fn run(
        &self,
        r: usize,
        den: &Denoiser,
        ticket: &Ticket,
        job: Option<Job>,
    ) -> Result<mold_pipeline::Output, PipelineError> {
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
        let vae = COMPONENTS.len() - 1;
        let allowed = (!self.encoder_pool).then(|| vec![rep.planned[vae]]);
        let mut job = Some(job);
        self.with_component(vae, allowed.as_deref(), ticket, |inst| match inst {
            Instance::Decoder(dec) => job.take().expect("once").decode(
                dec,
                latents,
                den.target(),
                &ticket.cancel,
                &mut ticket.progress(),
            ),
            Instance::Encoder(_) => unreachable!("the VAE"),
        })
    }

    fn finish(&self, ticket: Ticket, res: Result<mold_pipeline::Output, PipelineError>, r: usize) {
        let reply = match res {
            Ok(out) => match mold_pipeline::encode_png(&out.image, &out.metadata) {
                Ok(png) => {
                    let seconds = ticket.admitted.elapsed().as_secs_f64();
                    self.metrics.count(Outcome::Ok, 1);
                    self.metrics.latency(seconds);
                    Ok(Image {
                        png,
                        seed: ticket.req.seed,
                        width: out.image.width,
                        height: out.image.height,
                        replica: r,
                        seconds,
                    })
                }
                Err(e) => {
                    self.metrics.count(Outcome::Failed, 1);
                    Err(e.to_string())
                }
            },
            Err(PipelineError::Cancelled) => {
                self.metrics.count(Outcome::Cancelled, 1);
                Err(PipelineError::Cancelled.to_string())
            }
            Err(e) => {
                if ticket.cancel.load(Ordering::Relaxed) {
                    self.metrics.count(Outcome::Cancelled, 1);
                } else {
                    self.metrics.count(Outcome::Failed, 1);
                }
                Err(e.to_string().replace('\n', " "))
            }
        };
        let _ = ticket.done.send(reply);
    }

    /// Queue figures and every device, for `/metrics`.
    pub fn gauges(&self) -> Gauges {
        let q = lock(&self.queue);
        Gauges {
            queued: q.queued,
            running: q.running,
            queue_capacity: self.capacity,
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
        serde_json::json!({
            "model": self.model_id,
            "replicas": self.replicas.iter().map(|r| r.devices.iter().map(|&d| self.pool.devices()[d].id.to_string()).collect::<Vec<_>>()).collect::<Vec<_>>(),
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
