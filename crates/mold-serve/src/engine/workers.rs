//! The workers: encoder workers taking queued requests, replica workers denoising and
//! decoding them, each request answered (and counted, its failure logged) at its end, a
//! replica out of service failing what is queued when none is left.

use super::instances::Instance;
use super::queue::{Ready, Ticket};
use super::{lock, panic_message, Engine, Failure, FailureKind, Image, ReplicaState, COMPONENTS};
use crate::metrics::Outcome;
use crate::options::Stage;
use mold_pipeline::flux::resident::{Denoiser, Job};
use mold_pipeline::PipelineError;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// How a request failed, as the scheduler sees it.
pub(super) enum Fail {
    Pipeline(PipelineError),
    Panic { stage: Stage, message: String },
    NoReplica,
}

/// A finished request's PNG.
pub(super) struct Made {
    pub(super) png: Vec<u8>,
    pub(super) width: u32,
    pub(super) height: u32,
}

/// Why a replica's loop returned.
pub(super) enum Exit {
    Closed,
    /// Its transformer panicked: reload it.
    Restart,
}

impl Engine {
    /// Replica `r` is out of service; when none is left, what is queued fails.
    pub(super) fn replica_failed(&self, r: usize, why: String) {
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

    pub(super) fn encode_loop(&self) {
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

    pub(super) fn replica_loop(&self, r: usize, den: &Denoiser) -> Exit {
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
            ticket.spent(s, |p| &mut p.denoise);
            for &d in rep.devices.iter().filter(|_| !ticket.warm_up) {
                self.metrics.busy(&self.pool.devices()[d].id.to_string(), s);
            }
            drop(lease);
            out?
        };
        stage.set(Stage::Decode);
        let vae = COMPONENTS.len() - 1;
        let allowed = self
            .pinned(ticket, vae)
            .or_else(|| (!self.encoder_pool).then(|| vec![rep.planned[vae]]));
        let mut job = Some(job);
        let out = self.with_component(vae, allowed.as_deref(), ticket, |inst| {
            self.hooks.at(Stage::Decode);
            let t = Instant::now();
            let out = match inst {
                Instance::Decoder(dec) => job.take().expect("once").decode(
                    dec,
                    latents,
                    den.target(),
                    &ticket.cancel,
                    &mut ticket.progress(),
                ),
                Instance::Encoder(_) => unreachable!("the VAE"),
            };
            ticket.spent(t.elapsed().as_secs_f64(), |p| &mut p.decode);
            out
        })?;
        stage.set(Stage::Png);
        self.hooks.at(Stage::Png);
        let t = Instant::now();
        let png = mold_pipeline::encode_png(&out.image, &out.metadata)?;
        ticket.spent(t.elapsed().as_secs_f64(), |p| &mut p.png);
        Ok(Made {
            png,
            width: out.image.width,
            height: out.image.height,
        })
    }

    /// Answers a request's client, counts it, and logs a failure's cause with its id.
    pub(super) fn finish(&self, ticket: Ticket, res: Result<Made, Fail>, r: usize) {
        let id = ticket.id;
        // A warm-up request is no client's: it stays out of the metrics.
        let count = |outcome, n| {
            if !ticket.warm_up {
                self.metrics.count(outcome, n);
            }
        };
        let fail = |kind| Err(Failure { kind, request: id });
        let reply = match res {
            Ok(m) => {
                let seconds = ticket.admitted.elapsed().as_secs_f64();
                count(Outcome::Ok, 1);
                if !ticket.warm_up {
                    self.metrics.latency(seconds);
                }
                Ok(Image {
                    png: m.png,
                    seed: ticket.req.seed,
                    width: m.width,
                    height: m.height,
                    replica: r,
                    seconds,
                    request: id,
                    phases: *ticket.phases.lock().unwrap_or_else(|e| e.into_inner()),
                })
            }
            Err(Fail::Pipeline(e))
                if matches!(e, PipelineError::Cancelled)
                    || ticket.cancel.load(Ordering::Relaxed) =>
            {
                count(Outcome::Cancelled, 1);
                fail(FailureKind::Cancelled)
            }
            Err(Fail::Pipeline(e)) => {
                count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: failed: {}",
                    e.to_string().replace('\n', " ")
                ));
                fail(FailureKind::Internal)
            }
            Err(Fail::Panic { stage, message }) => {
                count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: panicked in {stage} (replica {r}): {}",
                    message.replace('\n', " ")
                ));
                fail(FailureKind::Internal)
            }
            Err(Fail::NoReplica) => {
                count(Outcome::Failed, 1);
                (self.log)(format!(
                    "request {id}: failed: no replica is left to run it"
                ));
                fail(FailureKind::Unavailable)
            }
        };
        let _ = ticket.done.send(reply);
    }
}
