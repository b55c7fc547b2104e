//! The server's counters, rendered as Prometheus text at `/metrics`: requests by outcome,
//! request latency as a histogram, busy seconds per device; the queue depth is read from
//! the scheduler when rendering.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// An image came back.
    Ok,
    /// Refused before it was queued (bad request, wrong token): 4xx.
    Rejected,
    /// The queue was full: 429.
    Overloaded,
    /// Its client went away before it finished.
    Cancelled,
    /// The pipeline failed: 500 (or 503 when no replica was left to run it).
    Failed,
    /// Refused while draining or with no replica left: 503.
    Unavailable,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Rejected => "rejected",
            Outcome::Overloaded => "overloaded",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "failed",
            Outcome::Unavailable => "unavailable",
        }
    }
}

/// Upper bounds of the latency histogram's buckets, seconds.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
];

#[derive(Default)]
struct Counters {
    requests: BTreeMap<Outcome, u64>,
    /// Per bucket (and +Inf last), requests that finished with an image within it.
    latency: Vec<u64>,
    latency_sum: f64,
    /// Requests whose deadline passed (`--request-timeout`).
    timeouts: u64,
    busy: BTreeMap<String, f64>,
}

/// The counters, shared by the HTTP side and the scheduler.
pub struct Metrics {
    c: Mutex<Counters>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            c: Mutex::new(Counters {
                latency: vec![0; LATENCY_BUCKETS.len() + 1],
                ..Counters::default()
            }),
        }
    }
}

/// What the scheduler reports at render time.
pub struct Gauges {
    pub queued: usize,
    pub running: usize,
    pub queue_capacity: usize,
    /// Replicas serving now (not restarting or failed).
    pub replicas_serving: usize,
    /// Open HTTP connections.
    pub connections: usize,
    /// Every device, so idle ones show 0 busy seconds.
    pub devices: Vec<String>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.c.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn count(&self, outcome: Outcome, n: u64) {
        *self.lock().requests.entry(outcome).or_default() += n;
    }

    /// A request that returned an image after `seconds`, from admission.
    pub fn latency(&self, seconds: f64) {
        let mut c = self.lock();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        c.latency[i] += 1;
        c.latency_sum += seconds;
    }

    /// A request whose deadline passed.
    pub fn timeout(&self) {
        self.lock().timeouts += 1;
    }

    pub fn timeouts(&self) -> u64 {
        self.lock().timeouts
    }

    pub fn busy(&self, device: &str, seconds: f64) {
        *self.lock().busy.entry(device.to_string()).or_default() += seconds;
    }

    pub fn requests(&self, outcome: Outcome) -> u64 {
        self.lock().requests.get(&outcome).copied().unwrap_or(0)
    }

    /// Prometheus text exposition (version 0.0.4).
    pub fn render(&self, g: &Gauges) -> String {
        let c = self.lock();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP mold_queue_depth Requests admitted and not yet started on a transformer."
        );
        let _ = writeln!(s, "# TYPE mold_queue_depth gauge");
        let _ = writeln!(s, "mold_queue_depth {}", g.queued);
        let _ = writeln!(s, "# HELP mold_queue_capacity Queue bound (429 beyond it).");
        let _ = writeln!(s, "# TYPE mold_queue_capacity gauge");
        let _ = writeln!(s, "mold_queue_capacity {}", g.queue_capacity);
        let _ = writeln!(
            s,
            "# HELP mold_requests_running Requests on a transformer or decoding."
        );
        let _ = writeln!(s, "# TYPE mold_requests_running gauge");
        let _ = writeln!(s, "mold_requests_running {}", g.running);
        let _ = writeln!(
            s,
            "# HELP mold_requests_total Images requested, by outcome."
        );
        let _ = writeln!(s, "# TYPE mold_requests_total counter");
        for o in [
            Outcome::Ok,
            Outcome::Rejected,
            Outcome::Overloaded,
            Outcome::Cancelled,
            Outcome::Failed,
            Outcome::Unavailable,
        ] {
            let n = c.requests.get(&o).copied().unwrap_or(0);
            let _ = writeln!(s, "mold_requests_total{{outcome=\"{}\"}} {n}", o.label());
        }
        let _ = writeln!(
            s,
            "# HELP mold_request_timeouts_total Requests not done within the request deadline (504)."
        );
        let _ = writeln!(s, "# TYPE mold_request_timeouts_total counter");
        let _ = writeln!(s, "mold_request_timeouts_total {}", c.timeouts);
        let _ = writeln!(
            s,
            "# HELP mold_replicas_serving Replicas serving (not restarting after a panic, not failed)."
        );
        let _ = writeln!(s, "# TYPE mold_replicas_serving gauge");
        let _ = writeln!(s, "mold_replicas_serving {}", g.replicas_serving);
        let _ = writeln!(s, "# HELP mold_connections_open Open HTTP connections.");
        let _ = writeln!(s, "# TYPE mold_connections_open gauge");
        let _ = writeln!(s, "mold_connections_open {}", g.connections);
        let _ = writeln!(
            s,
            "# HELP mold_request_seconds Time from admission to the image, per image."
        );
        let _ = writeln!(s, "# TYPE mold_request_seconds histogram");
        let mut cum = 0;
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            cum += c.latency[i];
            let _ = writeln!(s, "mold_request_seconds_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += c.latency[LATENCY_BUCKETS.len()];
        let _ = writeln!(s, "mold_request_seconds_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(s, "mold_request_seconds_sum {}", c.latency_sum);
        let _ = writeln!(s, "mold_request_seconds_count {cum}");
        let _ = writeln!(
            s,
            "# HELP mold_device_busy_seconds_total Seconds each device ran a transformer, encoder or VAE."
        );
        let _ = writeln!(s, "# TYPE mold_device_busy_seconds_total counter");
        for d in &g.devices {
            let v = c.busy.get(d).copied().unwrap_or(0.0);
            let _ = writeln!(s, "mold_device_busy_seconds_total{{device=\"{d}\"}} {v}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.count(Outcome::Ok, 2);
        m.count(Outcome::Overloaded, 1);
        m.latency(0.07);
        m.latency(400.0);
        m.busy("emu:0", 1.5);
        m.timeout();
        let text = m.render(&Gauges {
            queued: 3,
            running: 1,
            queue_capacity: 8,
            replicas_serving: 2,
            connections: 5,
            devices: vec!["emu:0".into(), "emu:1".into()],
        });
        for line in [
            "mold_queue_depth 3",
            "mold_requests_total{outcome=\"ok\"} 2",
            "mold_requests_total{outcome=\"overloaded\"} 1",
            "mold_requests_total{outcome=\"cancelled\"} 0",
            "mold_requests_total{outcome=\"unavailable\"} 0",
            "mold_request_timeouts_total 1",
            "mold_replicas_serving 2",
            "mold_connections_open 5",
            "mold_request_seconds_bucket{le=\"0.05\"} 0",
            "mold_request_seconds_bucket{le=\"0.1\"} 1",
            "mold_request_seconds_bucket{le=\"300\"} 1",
            "mold_request_seconds_bucket{le=\"+Inf\"} 2",
            "mold_request_seconds_count 2",
            "mold_device_busy_seconds_total{device=\"emu:0\"} 1.5",
            "mold_device_busy_seconds_total{device=\"emu:1\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
        }
    }
}
