//! Admission: the bounded queue of requests (encoding, then ready for a transformer),
//! what is refused and why, and the requests given up leaving the queue.

use super::workers::Fail;
use super::{lock, Engine, Event, Failure, Image, Pending, Refused, ReplicaState};
use crate::metrics::Outcome;
use mold_pipeline::flux::resident::Job;
use mold_pipeline::{PipelineError, Progress, Request};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// One admitted image request.
pub(super) struct Ticket {
    pub(super) id: u64,
    pub(super) req: Request,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) events: Option<mpsc::UnboundedSender<Event>>,
    pub(super) done: oneshot::Sender<Result<Image, Failure>>,
    pub(super) admitted: Instant,
    /// A start-up warm-up request: kept out of the metrics.
    pub(super) warm_up: bool,
    /// A warm-up request's device: its encoders and VAE run there wherever an instance of
    /// them is loaded there, so that every loaded instance is warmed ([`Engine::warm_up`]).
    pub(super) pin: Option<usize>,
    /// Where its time went so far (set by the thread running each part).
    pub(super) phases: std::sync::Mutex<super::Phases>,
}

impl Ticket {
    /// Adds `seconds` to one of its phases.
    pub(super) fn spent(&self, seconds: f64, phase: impl FnOnce(&mut super::Phases) -> &mut f64) {
        let mut p = self.phases.lock().unwrap_or_else(|e| e.into_inner());
        *phase(&mut p) += seconds;
    }

    pub(super) fn progress(&self) -> impl FnMut(&Progress) + '_ {
        move |p: &Progress| {
            if let Some(tx) = &self.events {
                let _ = tx.send(Event::Progress(p.clone()));
            }
        }
    }
}

/// A request ready for a transformer: encoded already (pool on) or not.
pub(super) struct Ready {
    pub(super) ticket: Ticket,
    pub(super) job: Option<Job>,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) to_encode: VecDeque<Ticket>,
    pub(super) ready: VecDeque<Ready>,
    /// Admitted, not yet started on a transformer (encoding included).
    pub(super) queued: usize,
    /// Being encoded by an encoder worker.
    pub(super) encoding: usize,
    /// On a transformer or decoding.
    pub(super) running: usize,
    pub(super) closed: bool,
    pub(super) replicas: Vec<ReplicaState>,
}

impl Queue {
    pub(super) fn none_left(&self) -> bool {
        self.replicas
            .iter()
            .all(|s| matches!(s, ReplicaState::Failed(_)))
    }

    /// Takes every queued request out (they fail: no replica is left).
    pub(super) fn take_all(&mut self) -> Vec<Ticket> {
        let mut out: Vec<Ticket> = self.to_encode.drain(..).collect();
        out.extend(self.ready.drain(..).map(|r| r.ticket));
        self.queued -= out.len();
        out
    }

    /// Takes the queued requests whose cancel flag is set out of the queue.
    pub(super) fn take_cancelled(&mut self) -> Vec<Ticket> {
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

impl Engine {
    /// Admits `reqs` together, or none of them. Returns one [`Pending`] per request, in
    /// order; `events` (shared) hears progress.
    pub fn submit(
        &self,
        reqs: Vec<Request>,
        cancel: Arc<AtomicBool>,
        events: Option<mpsc::UnboundedSender<Event>>,
    ) -> Result<Vec<Pending>, Refused> {
        self.submit_with(reqs, cancel, events, false, None)
    }

    /// [`Engine::submit`]; `warm_up` keeps the requests out of the metrics, `pin` holds
    /// their encoders and VAE to one device where it has them ([`Ticket::pin`]).
    pub(super) fn submit_with(
        &self,
        reqs: Vec<Request>,
        cancel: Arc<AtomicBool>,
        events: Option<mpsc::UnboundedSender<Event>>,
        warm_up: bool,
        pin: Option<usize>,
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
                warm_up,
                pin,
                phases: Default::default(),
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
    pub(super) fn purge(&self) {
        let gone = lock(&self.queue).take_cancelled();
        for t in gone {
            self.finish(t, Err(Fail::Pipeline(PipelineError::Cancelled)), 0);
        }
    }
}
