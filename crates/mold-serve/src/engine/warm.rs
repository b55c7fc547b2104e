//! The start-up warm-up ([`crate::ServeOptions::warm_up`]): one request per replica at the
//! plan's size and at each of [`crate::ServeOptions::warm_up_sizes`], one step each,
//! through the same queue, workers and encoder pool as a client's, before the server
//! answers anything. The first run of a process loads every
//! kernel module, builds cuDNN's plans for the decoder and attention at the plan's shapes
//! and opens the collectives' paths (on an H100 about 0.2 s of the encoders, 0.3 s of the
//! decoder and up to 1.4 s of the first step); afterwards a client's first request runs as
//! warm as its hundredth. With the encoder pool on, a request's encoders and VAE run on
//! whichever device is idle, so the replicas' requests need not reach every instance: one
//! more request per device holding an encoder or the VAE runs them there. Warm-up requests
//! stay out of the metrics.

use super::{lock, Engine, Pending, StartError};
use mold_pipeline::Request;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

impl Engine {
    /// Runs one warm-up request per replica at the plan's size, then at each of `more`
    /// (a size given twice, or the plan's, runs once), waiting for each size's requests; a
    /// failure is the server's failure to start, with the request's cause in the log.
    pub(super) fn warm_up(&self, more: &[(u32, u32)]) -> Result<(), StartError> {
        let w = &self.plan.workload;
        let mut sizes = vec![(w.width, w.height)];
        for &s in more {
            if !sizes.contains(&s) {
                sizes.push(s);
            }
        }
        for (width, height) in sizes {
            self.warm_up_at(width, height)?;
        }
        Ok(())
    }

    fn warm_up_at(&self, width: u32, height: u32) -> Result<(), StartError> {
        let n = self.replicas.len();
        let req = Request {
            prompt: "warm-up".into(),
            seed: 0,
            steps: 1,
            guidance: None,
            width,
            height,
            latents: None,
            save_io: None,
            no_digests: true,
        };
        let start = Instant::now();
        // As many at once as the queue takes (a queue shorter than the replicas).
        let mut left = n;
        while left > 0 {
            let k = left.min(self.capacity);
            left -= k;
            let pending = self.warm_submit(vec![req.clone(); k], None)?;
            self.warm_wait(pending)?;
        }
        (self.log)(format!(
            "warm-up: {n} request{} at {}x{}, 1 step, in {:.2} s",
            if n == 1 { "" } else { "s" },
            width,
            height,
            start.elapsed().as_secs_f64()
        ));
        let devices = self.instance_devices();
        if !self.encoder_pool || devices.len() < 2 {
            // Each replica encoded and decoded on its planned devices, or on the one device
            // there is: all warmed above.
            return Ok(());
        }
        let start = Instant::now();
        lock(&self.warmed).clear();
        // As many devices at once as the queue takes.
        for chunk in devices.chunks(self.capacity.max(1)) {
            let mut pending = Vec::with_capacity(chunk.len());
            for &d in chunk {
                pending.extend(self.warm_submit(vec![req.clone()], Some(d))?);
            }
            self.warm_wait(pending)?;
        }
        // The devices each of whose instances ran pinned there.
        let covered: Vec<String> = {
            let warmed = lock(&self.warmed);
            let instances = lock(&self.instances);
            devices
                .iter()
                .filter(|&&d| {
                    instances
                        .keys()
                        .filter(|(_, di)| *di == d)
                        .all(|k| warmed.contains(k))
                })
                .map(|&d| self.pool.devices()[d].id.to_string())
                .collect()
        };
        (self.log)(format!(
            "warm-up: the encoders and the VAE on {} of {} devices ({}) at {}x{}, in {:.2} s",
            covered.len(),
            devices.len(),
            covered.join(", "),
            width,
            height,
            start.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    /// Submits `reqs` as warm-up requests, pinned to device `pin` if given.
    fn warm_submit(
        &self,
        reqs: Vec<Request>,
        pin: Option<usize>,
    ) -> Result<Vec<Pending>, StartError> {
        self.submit_with(reqs, Arc::new(AtomicBool::new(false)), None, true, pin)
            .map_err(|r| StartError::Plan(format!("warm-up: not admitted ({r:?})")))
    }

    /// Waits for each of `pending`; a failure is the start's failure.
    fn warm_wait(&self, pending: Vec<Pending>) -> Result<(), StartError> {
        for p in pending {
            match p.rx.blocking_recv() {
                Ok(Ok(_)) => {}
                Ok(Err(f)) => {
                    return Err(StartError::Plan(format!(
                        "warm-up request {} failed: the log above says why; `--warm-up off` starts without it",
                        f.request
                    )))
                }
                Err(_) => {
                    return Err(StartError::Plan(
                        "warm-up: a request was dropped unanswered".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}
