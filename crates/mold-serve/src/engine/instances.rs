//! The encoder and VAE instances: each loaded once per device on first use, run under
//! the lock pool, and dropped (loaded afresh on next use) when it panics.

use super::queue::Ticket;
use super::{lock, panic_message, Engine, COMPONENTS};
use crate::options::Stage;
use mold_exec::weights_copy::{Kept, WeightsFrom};
use mold_pipeline::flux::resident::{Decoder, Job, ENCODERS};
use mold_pipeline::{PipelineError, Progress};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

/// An encoder or VAE instance on one device.
pub(super) enum Instance {
    Encoder(Box<mold_pipeline::flux::resident::TextEncoder>),
    Decoder(Box<Decoder>),
}

impl Engine {
    /// The instance of component `c` on device `d`, loaded on first use (the caller holds
    /// the device, or it is startup).
    pub(super) fn instance(
        &self,
        c: usize,
        d: usize,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Arc<Instance>, PipelineError> {
        self.instance_from(c, d, &WeightsFrom::files(self.staged_load), progress)
    }

    /// [`Engine::instance`], a new one's weights read or copied as `from` says.
    fn instance_from(
        &self,
        c: usize,
        d: usize,
        from: &WeightsFrom,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Arc<Instance>, PipelineError> {
        if let Some(i) = lock(&self.instances).get(&(c, d)) {
            return Ok(i.clone());
        }
        let id = self.pool.devices()[d].id.clone();
        let name = COMPONENTS[c];
        // The device opened in the shared map, loaded through a copy of it: loads on other
        // threads go on meanwhile.
        let mut devmap = {
            let mut shared = lock(&self.devmap);
            shared.get(&id)?;
            shared.clone()
        };
        let inst = if name == "vae" {
            Instance::Decoder(Box::new(Decoder::load_from(
                &self.plan,
                &self.prep,
                &id,
                &mut devmap,
                self.vae,
                from,
                progress,
            )?))
        } else {
            Instance::Encoder(Box::new(mold_pipeline::flux::resident::TextEncoder::load(
                &self.plan,
                &self.prep,
                name,
                &id,
                &mut devmap,
                self.vae.kernels,
                from,
                progress,
            )?))
        };
        let inst = Arc::new(inst);
        lock(&self.instances).insert((c, d), inst.clone());
        Ok(inst)
    }

    /// Loads component `c`'s planned instances on devices `ds` (startup): read from the
    /// checkpoint on the first, then copied from it to all the others at once, device to
    /// device ([`mold_exec::weights_copy`]) where the pair copies directly (peer access over
    /// NVLink or PCIe, [`mold_exec::runtime::copies_directly`]) instead of read again; read
    /// where it does not. An instance that cannot be copied is read, and the log says why.
    pub(super) fn load_planned(&self, c: usize, ds: &[usize]) -> Result<(), PipelineError> {
        let log = |p: &Progress| (self.log)(format!("{p}"));
        let Some((&first, others)) = ds.split_first() else {
            return Ok(());
        };
        let (rest, read): (Vec<usize>, Vec<usize>) = {
            let mut devmap = lock(&self.devmap);
            let id = |d: usize| self.pool.devices()[d].id.clone();
            let src = devmap.get(&id(first))?;
            let mut direct = Vec::with_capacity(others.len());
            for &d in others {
                let dst = devmap.get(&id(d))?;
                direct.push(mold_exec::runtime::copies_directly(
                    &src,
                    &dst,
                    self.peer_copies,
                ));
            }
            let (rest, read): (Vec<_>, Vec<_>) =
                others.iter().zip(direct).partition(|(_, direct)| *direct);
            (
                rest.into_iter().map(|(&d, _)| d).collect(),
                read.into_iter().map(|(&d, _)| d).collect(),
            )
        };
        let name = |d: usize| self.pool.devices()[d].id.to_string();
        for &d in &read {
            (self.log)(format!(
                "{} on {}: read from the checkpoint ({} cannot copy to it directly: {})",
                COMPONENTS[c],
                name(d),
                name(first),
                if self.peer_copies {
                    "no peer access between them"
                } else {
                    "--no-peer"
                }
            ));
        }
        if rest.is_empty() {
            for &d in std::iter::once(&first).chain(&read) {
                self.instance(c, d, &mut |p| log(p))?;
            }
            return Ok(());
        }
        for &d in &read {
            self.instance(c, d, &mut |p| log(p))?;
        }
        let kept = Kept::on(&name(first));
        {
            // Its own handle on `kept` goes with it: only `copy`'s is left to drop below.
            let keep = WeightsFrom::Files {
                staged: self.staged_load,
                keep: Some(kept.clone()),
            };
            self.instance_from(c, first, &keep, &mut |p| log(p))?;
        }
        let copy = WeightsFrom::CopyOf {
            kept,
            peer_copies: self.peer_copies,
        };
        let kept_misses = |w: &WeightsFrom| match w {
            WeightsFrom::CopyOf { kept, .. } => kept.misses(),
            WeightsFrom::Files { .. } => 0,
        };
        let copies: Vec<(usize, Result<(), String>)> = std::thread::scope(|s| {
            let threads: Vec<_> = rest
                .iter()
                .map(|&d| {
                    let copy = &copy;
                    let log = &log;
                    (
                        d,
                        s.spawn(move || {
                            catch_unwind(AssertUnwindSafe(|| {
                                self.instance_from(c, d, copy, &mut |p| log(p))
                            }))
                        }),
                    )
                })
                .collect();
            threads
                .into_iter()
                .map(|(d, t)| {
                    let res = match t.join() {
                        Ok(Ok(Ok(_))) => Ok(()),
                        Ok(Ok(Err(e))) => Err(e.to_string()),
                        Ok(Err(p)) | Err(p) => Err(format!("panicked: {}", panic_message(&*p))),
                    };
                    (d, res)
                })
                .collect()
        });
        // The copies are done (each load waits for its device): the first instance's
        // merged-away tensors can go.
        let misses = kept_misses(&copy);
        drop(copy);
        if misses > 0 {
            (self.log)(format!(
                "{}: {misses} tensors the copies asked for were not kept by the first load, read from the checkpoint",
                COMPONENTS[c]
            ));
        }
        for (d, res) in copies {
            if let Err(why) = res {
                (self.log)(format!(
                    "{} on {}: cannot copy it ({}); reading it",
                    COMPONENTS[c],
                    self.pool.devices()[d].id,
                    why.replace('\n', " ")
                ));
                self.instance(c, d, &mut |p| log(p))?;
            }
        }
        Ok(())
    }

    /// The device a warm-up `ticket` is pinned to, as the only one allowed for component
    /// `c`, where an instance of `c` is loaded there.
    pub(super) fn pinned(&self, ticket: &Ticket, c: usize) -> Option<Vec<usize>> {
        let d = ticket.pin?;
        lock(&self.instances).contains_key(&(c, d)).then(|| vec![d])
    }

    /// Devices holding a loaded encoder or VAE instance, in the pool's order.
    pub(super) fn instance_devices(&self) -> Vec<usize> {
        let mut ds: Vec<usize> = lock(&self.instances).keys().map(|&(_, d)| d).collect();
        ds.sort_unstable();
        ds.dedup();
        ds
    }

    /// Runs component `c` for `ticket` on a device from the pool (`allowed`, else any),
    /// loading its instance there on first use; `f` gets the instance. If `f` panics, the
    /// instance is dropped (loaded afresh on next use) and the panic goes on.
    pub(super) fn with_component<T>(
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
        if ticket.warm_up {
            lock(&self.warmed).insert((c, lease.device()));
        }
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
        if !ticket.warm_up {
            self.metrics
                .busy(&lease.device_id().to_string(), t.elapsed().as_secs_f64());
        }
        out
    }

    /// Encodes `job`'s prompt with both encoders: on replica `own`'s planned devices, or
    /// (`None`) on any device the pool gives.
    pub(super) fn encode(
        &self,
        ticket: &Ticket,
        job: &mut Job,
        own: Option<usize>,
    ) -> Result<(), PipelineError> {
        let mut started = None;
        for c in 0..ENCODERS.len() {
            let allowed = self
                .pinned(ticket, c)
                .or_else(|| own.map(|r| vec![self.replicas[r].planned[c]]));
            self.with_component(c, allowed.as_deref(), ticket, |inst| {
                if c == 0 {
                    self.hooks.at(Stage::Encode);
                    started = Some(Instant::now());
                }
                match inst {
                    Instance::Encoder(enc) => {
                        job.encode(enc, None, &ticket.cancel, &mut ticket.progress())
                    }
                    Instance::Decoder(_) => unreachable!("components 0 and 1 are encoders"),
                }
            })?;
        }
        if let Some(t) = started {
            ticket.spent(t.elapsed().as_secs_f64(), |p| &mut p.encode);
        }
        Ok(())
    }
}
