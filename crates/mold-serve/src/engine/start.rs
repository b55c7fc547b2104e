//! Starting the engine: the lock pool from the replicas' plans, the planned encoder and
//! VAE instances, one thread per replica (its transformer loaded, and reloaded after a
//! panic), the encoder workers.

use super::queue::Queue;
use super::workers::Exit;
use super::{lock, panic_message, Engine, Log, ReplicaInfo, ReplicaState, StartError, COMPONENTS};
use crate::metrics::Metrics;
use crate::options::{Deployment, ServeOptions, Stage};
use crate::pool::{ComponentCost, DeviceBudget, Pool};
use mold_exec::runtime::DeviceMap;
use mold_pipeline::flux::resident::Denoiser;
use mold_pipeline::{PipelineError, Progress};
use mold_plan::{ComponentRole, DeviceId, Plan};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};

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
    let ctx = mold_cost::Ctx::for_plan(&d.model, &d.machine, plan);
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
            planned.insert(planned_device(p, name)?);
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
        // Before anything loads: every size the warm-up would run must be one a request
        // could ask for.
        for &(w, h) in opts.warm_up_sizes.iter().filter(|_| opts.warm_up) {
            if let Some(why) = crate::api::size_refusal(opts, &d.model, &d.replicas[0], (w, h)) {
                return Err(StartError::Plan(format!("--warm-up-sizes {w}x{h}: {why}")));
            }
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
                let dev = planned_device(p, name)?;
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
            warmed: Mutex::default(),
            devmap: Mutex::new(DeviceMap::default()),
            queue: Mutex::new(Queue {
                replicas: vec![ReplicaState::Loading; n],
                ..Queue::default()
            }),
            wake: Condvar::new(),
            capacity: opts.queue.max(1),
            encoder_pool: opts.encoder_pool,
            vae: mold_pipeline::flux::vae::VaeOptions {
                peer_copies: d.exec.peer_copies,
                ..mold_pipeline::flux::vae::VaeOptions::with_kernels(d.exec.kernels)
            },
            staged_load: d.exec.staged_load,
            peer_copies: d.exec.peer_copies,
            next_id: AtomicU64::new(1),
            metrics: Metrics::default(),
            workers: Mutex::new(Vec::new()),
            hooks: opts.hooks.clone(),
            log: log.clone(),
        });
        // Every GPU of the pool opened at once before anything loads.
        {
            let ids: Vec<_> = engine.pool.devices().iter().map(|d| d.id.clone()).collect();
            lock(&engine.devmap)
                .open_all(&ids)
                .map_err(PipelineError::from)?;
        }
        // The planned instances, loaded now (errors before serving): each component read
        // once and copied device to device to its other planned devices.
        for (c, cost) in engine.pool.components().iter().enumerate() {
            let ds: Vec<usize> = cost
                .planned
                .iter()
                .map(|dev| engine.pool.index(dev).expect("in the pool"))
                .collect();
            engine.load_planned(c, &ds)?;
        }
        // Several replicas: the first one's transformer read from the checkpoint, every
        // other one's copied from it device to device where the placements allow
        // (`Denoiser::replicate`: over NVLink or PCIe instead of through host memory again),
        // read on its own thread where not.
        let mut copied: Vec<Option<Denoiser>> = (0..n).map(|_| None).collect();
        if n > 1 {
            // A panic loading or copying is a failed start, as a replica thread's is.
            let res =
                catch_unwind(AssertUnwindSafe(|| copy_replicas(&engine, d))).unwrap_or_else(|p| {
                    Err(PipelineError::Plan(format!(
                        "loading the replicas' transformers panicked: {}",
                        panic_message(p.as_ref())
                    )))
                });
            match res {
                Ok(dens) => copied = dens,
                Err(e) => {
                    engine.close();
                    engine.join();
                    return Err(e.into());
                }
            }
        }
        // One thread per replica, each loading its transformer (or taking its copy).
        let (tx, rx) = std::sync::mpsc::channel::<Result<(), PipelineError>>();
        let mut preps_iter = std::iter::once(None).chain(preps.into_iter().map(Some));
        let mut copied = copied.into_iter();
        for r in 0..engine.replicas.len() {
            let own = preps_iter.next().flatten();
            let ready = copied.next().flatten();
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
                    let loaded = match ready {
                        Some(den) => Ok(den),
                        None => load(),
                    };
                    let mut den = match loaded {
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
        if opts.warm_up {
            if let Err(e) = engine.warm_up(&opts.warm_up_sizes) {
                engine.close();
                engine.join();
                return Err(e);
            }
        }
        Ok(engine)
    }
}

/// The replicas' transformers: the first read from the checkpoint, each other copied from
/// it where [`Denoiser::replicate`] can (`None` where not: its thread reads it, and the log
/// says why).
fn copy_replicas(e: &Engine, d: &Deployment) -> Result<Vec<Option<Denoiser>>, PipelineError> {
    let mut devmap = lock(&e.devmap);
    let mut on = |p: &Progress| (e.log)(format!("replica 0: {p}"));
    let first = Denoiser::load(&e.replicas[0].plan, &e.prep, &d.exec, &mut devmap, &mut on)?;
    let plans: Vec<&Plan> = e.replicas[1..].iter().map(|r| &r.plan).collect();
    let mut on = |p: &Progress| (e.log)(format!("replica copies: {p}"));
    let mut out = vec![None];
    for (r, copy) in (1..).zip(first.replicas(&plans, &mut devmap, &mut on)) {
        match copy {
            Ok(den) => out.push(Some(den)),
            Err(why) => {
                (e.log)(format!("replica {r}: {why}"));
                out.push(None);
            }
        }
    }
    out[0] = Some(first);
    Ok(out)
}

/// Where the plan puts component `name`: its device; for a VAE planned in row bands over
/// several devices, the first of them (a server decodes each request on one device, the
/// pool's choice).
fn planned_device(
    p: &mold_plan::Plan,
    name: &str,
) -> Result<mold_plan::DeviceId, mold_pipeline::PipelineError> {
    if name == "vae" {
        let (mut on, _) = mold_pipeline::vae_devices(p)?;
        return Ok(on.remove(0));
    }
    Ok(mold_pipeline::placement(p, name)?.0)
}
