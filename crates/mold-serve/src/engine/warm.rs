//! The start-up warm-up ([`crate::ServeOptions::warm_up`]): one request per replica at the
//! plan's size and at each of [`crate::ServeOptions::warm_up_sizes`], one step each,
//! through the same queue, workers and encoder pool as a client's, before the server
//! answers anything. The first run of a process loads every
//! kernel module, builds cuDNN's plans for the decoder and attention at the plan's shapes
//! and opens the collectives' paths (on an H100 about 0.2 s of the encoders, 0.3 s of the
//! decoder and up to 1.4 s of the first step); afterwards a client's first request runs as
//! warm as its hundredth. Warm-up requests stay out of the metrics.

use super::{Engine, StartError};
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
        };
        let start = Instant::now();
        // As many at once as the queue takes (a queue shorter than the replicas).
        let mut left = n;
        while left > 0 {
            let k = left.min(self.capacity);
            left -= k;
            let pending = self
                .submit_with(
                    vec![req.clone(); k],
                    Arc::new(AtomicBool::new(false)),
                    None,
                    true,
                )
                .map_err(|r| StartError::Plan(format!("warm-up: not admitted ({r:?})")))?;
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
        }
        (self.log)(format!(
            "warm-up: {n} request{} at {}x{}, 1 step, in {:.2} s",
            if n == 1 { "" } else { "s" },
            width,
            height,
            start.elapsed().as_secs_f64()
        ));
        Ok(())
    }
}
