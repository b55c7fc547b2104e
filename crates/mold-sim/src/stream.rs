//! A stream of requests over a plan's replicas: a queue, each replica serving one
//! request at a time, each request taking the time [`crate::simulate`] gives for its
//! replica (encode, steps, decode; weights stay loaded between requests).
//!
//! Requests arrive in a closed loop (`k` clients, each submitting its next request the
//! moment its last one finishes, all starting at 0) or at a fixed rate (`i / rate`
//! seconds for request `i`: evenly spaced, so the figures are exact, not a sample). They
//! are served first come, first served: the request at the head of the queue goes to
//! the replica that can start it soonest, the fastest of those free at once, then the
//! lowest index.

use crate::SimError;
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{DeviceId, Plan};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write;

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrivals {
    /// `clients` requests in flight: each client submits its next request when its last
    /// one finishes.
    ClosedLoop { clients: u32 },
    /// Requests a second, evenly spaced.
    Rate { per_s: f64 },
}

/// The stream to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StreamOptions {
    pub requests: u32,
    pub arrivals: Arrivals,
}

impl StreamOptions {
    /// One line naming the flag at fault, for figures no stream can have.
    pub fn check(&self) -> Result<(), String> {
        if self.requests == 0 {
            return Err("--requests 0: simulate at least one request".into());
        }
        match self.arrivals {
            Arrivals::ClosedLoop { clients: 0 } => {
                Err("--clients 0: at least one client submits requests".into())
            }
            Arrivals::Rate { per_s } if !(per_s.is_finite() && per_s > 0.0) => Err(format!(
                "--arrival-rate {per_s}: give requests a second, above 0 (e.g. 0.5)"
            )),
            _ => Ok(()),
        }
    }
}

/// One replica over the stream.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaLoad {
    /// The devices it runs on.
    pub devices: Vec<DeviceId>,
    /// One request's simulated time on it.
    pub request_s: f64,
    pub served: u32,
    /// Busy seconds, and as a percentage of the stream's span.
    pub busy_s: f64,
    pub busy_pct: f64,
}

/// One request of the stream.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Served {
    pub arrival_s: f64,
    pub start_s: f64,
    pub end_s: f64,
    pub replica: usize,
}

/// What the stream gives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamReport {
    pub options: StreamOptions,
    /// Images a request makes (the plan's batch).
    pub images_per_request: u32,
    pub replicas: Vec<ReplicaLoad>,
    /// From the first arrival to the last image.
    pub span_s: f64,
    pub images_per_min: f64,
    pub latency_p50_s: f64,
    pub latency_p95_s: f64,
    pub latency_mean_s: f64,
    pub latency_max_s: f64,
    /// Time in the queue before a replica starts the request.
    pub wait_p95_s: f64,
    #[serde(skip)]
    pub requests: Vec<Served>,
}

/// Simulates `opts`' stream over `plan`'s replicas: each replica simulated once for its
/// request time ([`crate::simulate`], which validates the plan and every replica).
pub fn simulate_stream(
    plan: &Plan,
    model: &ModelSpec,
    machine: &Machine,
    opts: StreamOptions,
) -> Result<StreamReport, SimError> {
    opts.check().map_err(SimError::Invalid)?;
    // The whole plan first: its refusals name `replicas[i]`.
    mold_cost::validate(plan, model, machine).map_err(|e| SimError::Invalid(e.to_string()))?;
    // Under CFG-parallel the two replicas serve one request together: one server.
    let replicas = if plan.cfg_mode() == Some(mold_plan::CfgMode::Parallel) {
        vec![plan.clone()]
    } else {
        plan.replica_plans()
            .map_err(|e| SimError::Invalid(e.to_string()))?
    };
    let mut timed = Vec::with_capacity(replicas.len());
    for (i, r) in replicas.iter().enumerate() {
        let sim = crate::simulate(r, model, machine).map_err(|e| match e {
            SimError::Invalid(m) if plan.replicas.is_some() => {
                SimError::Invalid(format!("replicas[{i}]: {m}"))
            }
            e => e,
        })?;
        if !sim.fits() {
            let why = sim
                .overflows
                .iter()
                .map(|o| o.message.clone())
                .collect::<Vec<_>>()
                .join(" | ");
            return Err(SimError::Invalid(if plan.replicas.is_some() {
                format!("replicas[{i}] does not fit: {why}")
            } else {
                format!("the plan does not fit: {why}")
            }));
        }
        // Every replica's devices (both, for a CFG-parallel pair).
        let used: std::collections::BTreeSet<DeviceId> = r
            .replica_plans()
            .map(|rs| rs.iter().flat_map(|p| p.placement_devices()).collect())
            .unwrap_or_else(|_| r.placement_devices());
        let devices = machine
            .devices
            .iter()
            .map(|d| d.id.clone())
            .filter(|d| used.contains(d))
            .collect();
        timed.push((devices, sim.request_s));
    }
    Ok(stream(&timed, plan.workload.batch, opts))
}

/// The stream over replicas given as (devices, request seconds): the queue itself, for
/// any figures (`opts` checked by the caller).
pub fn stream(
    replicas: &[(Vec<DeviceId>, f64)],
    images_per_request: u32,
    opts: StreamOptions,
) -> StreamReport {
    let n = opts.requests as usize;
    // Arrivals waiting to be served, earliest first (then in submission order).
    let mut pending: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let mut submitted = 0usize;
    let mut submit = |pending: &mut BinaryHeap<Reverse<(Time, usize)>>, at: f64| {
        if submitted < n {
            pending.push(Reverse((Time(at), submitted)));
            submitted += 1;
        }
    };
    match opts.arrivals {
        Arrivals::ClosedLoop { clients } => {
            for _ in 0..clients {
                submit(&mut pending, 0.0);
            }
        }
        Arrivals::Rate { per_s } => {
            for i in 0..n {
                submit(&mut pending, i as f64 / per_s);
            }
        }
    }
    let closed = matches!(opts.arrivals, Arrivals::ClosedLoop { .. });
    let mut free_at = vec![0.0f64; replicas.len()];
    let mut served = Vec::with_capacity(n);
    while let Some(Reverse((Time(arrival), _))) = pending.pop() {
        let (r, start) = free_at
            .iter()
            .enumerate()
            .map(|(r, &f)| (r, f.max(arrival)))
            .min_by(|a, b| {
                a.1.total_cmp(&b.1)
                    .then(replicas[a.0].1.total_cmp(&replicas[b.0].1))
                    .then(a.0.cmp(&b.0))
            })
            .expect("a plan has at least one replica");
        let end = start + replicas[r].1;
        free_at[r] = end;
        served.push(Served {
            arrival_s: arrival,
            start_s: start,
            end_s: end,
            replica: r,
        });
        if closed {
            submit(&mut pending, end);
        }
    }
    let first = served
        .iter()
        .map(|s| s.arrival_s)
        .fold(f64::INFINITY, f64::min);
    let last = served.iter().map(|s| s.end_s).fold(0.0, f64::max);
    let span = (last - first).max(0.0);
    let mut latency: Vec<f64> = served.iter().map(|s| s.end_s - s.arrival_s).collect();
    let mut wait: Vec<f64> = served.iter().map(|s| s.start_s - s.arrival_s).collect();
    latency.sort_by(f64::total_cmp);
    wait.sort_by(f64::total_cmp);
    let loads = replicas
        .iter()
        .enumerate()
        .map(|(r, (devices, request_s))| {
            let mine = served.iter().filter(|s| s.replica == r);
            let busy: f64 = mine.clone().map(|s| s.end_s - s.start_s).sum();
            ReplicaLoad {
                devices: devices.clone(),
                request_s: *request_s,
                served: mine.count() as u32,
                busy_s: busy,
                busy_pct: if span > 0.0 { 100.0 * busy / span } else { 0.0 },
            }
        })
        .collect();
    StreamReport {
        options: opts,
        images_per_request,
        replicas: loads,
        span_s: span,
        images_per_min: if span > 0.0 {
            60.0 * (served.len() as f64 * images_per_request as f64) / span
        } else {
            0.0
        },
        latency_p50_s: percentile(&latency, 50.0),
        latency_p95_s: percentile(&latency, 95.0),
        latency_mean_s: latency.iter().sum::<f64>() / latency.len().max(1) as f64,
        latency_max_s: latency.last().copied().unwrap_or(0.0),
        wait_p95_s: percentile(&wait, 95.0),
        requests: served,
    }
}

/// The nearest-rank percentile of sorted values: the smallest value at or above `p`
/// percent of them.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Seconds ordered totally, for the arrival heap.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn secs(s: f64) -> String {
    if s >= 100.0 {
        format!("{s:.0} s")
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

impl StreamReport {
    /// The stream in words: how requests came, each replica's load, throughput and
    /// latency.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let how = match self.options.arrivals {
            Arrivals::ClosedLoop { clients } => format!(
                "{clients} client{} in a closed loop",
                if clients == 1 { "" } else { "s" }
            ),
            Arrivals::Rate { per_s } => format!("arriving at {per_s} a second, evenly spaced"),
        };
        let _ = writeln!(
            s,
            "\nrequest stream: {} request{}, {how}, over {} replica{}",
            self.options.requests,
            if self.options.requests == 1 { "" } else { "s" },
            self.replicas.len(),
            if self.replicas.len() == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            s,
            "  {:<8} {:<24} {:>10} {:>7} {:>6}",
            "replica", "devices", "request", "served", "busy"
        );
        for (i, r) in self.replicas.iter().enumerate() {
            let _ = writeln!(
                s,
                "  {i:<8} {:<24} {:>10} {:>7} {:>5.0}%",
                r.devices
                    .iter()
                    .map(DeviceId::to_string)
                    .collect::<Vec<_>>()
                    .join("+"),
                secs(r.request_s),
                r.served,
                r.busy_pct
            );
        }
        let _ = writeln!(
            s,
            "throughput: {:.1} images/min over {} ({} image{} a request)",
            self.images_per_min,
            secs(self.span_s),
            self.images_per_request,
            if self.images_per_request == 1 {
                ""
            } else {
                "s"
            }
        );
        let _ = writeln!(
            s,
            "latency: p50 {}, p95 {}, mean {}, max {} (waiting in the queue: p95 {})",
            secs(self.latency_p50_s),
            secs(self.latency_p95_s),
            secs(self.latency_mean_s),
            secs(self.latency_max_s),
            secs(self.wait_p95_s)
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cuda(n: u32) -> Vec<DeviceId> {
        vec![DeviceId::Cuda(n)]
    }

    fn closed(requests: u32, clients: u32) -> StreamOptions {
        StreamOptions {
            requests,
            arrivals: Arrivals::ClosedLoop { clients },
        }
    }

    #[test]
    fn two_replicas_eight_clients_report() {
        let r = stream(&[(cuda(0), 3.0), (cuda(1), 3.5)], 1, closed(16, 8));
        insta::assert_snapshot!(r.table());
    }

    #[test]
    fn a_rate_stream_report() {
        let opts = StreamOptions {
            requests: 10,
            arrivals: Arrivals::Rate { per_s: 0.5 },
        };
        let r = stream(&[(cuda(0), 3.0)], 2, opts);
        insta::assert_snapshot!(r.table());
    }

    #[test]
    fn closed_loop_figures_by_hand() {
        // Two equal replicas, four clients: pairs of requests every 3 s, each waiting 3 s
        // every other time.
        let r = stream(&[(cuda(0), 3.0), (cuda(1), 3.0)], 1, closed(8, 4));
        assert_eq!(r.span_s, 12.0);
        assert_eq!(r.images_per_min, 40.0);
        assert_eq!((r.latency_p50_s, r.latency_p95_s), (6.0, 6.0));
        assert_eq!(
            r.replicas.iter().map(|x| x.served).collect::<Vec<_>>(),
            [4, 4]
        );
    }

    #[test]
    fn bad_figures_name_the_flag() {
        for (opts, want) in [
            (closed(0, 4), "--requests 0"),
            (closed(4, 0), "--clients 0"),
            (
                StreamOptions {
                    requests: 4,
                    arrivals: Arrivals::Rate { per_s: f64::NAN },
                },
                "--arrival-rate NaN",
            ),
        ] {
            let e = opts.check().unwrap_err();
            assert!(e.starts_with(want), "{e}");
        }
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 10.0);
        assert_eq!(percentile(&v, 95.0), 19.0);
        assert_eq!(percentile(&[7.0], 95.0), 7.0);
    }

    fn arrivals() -> impl Strategy<Value = Arrivals> {
        prop_oneof![
            (1u32..12).prop_map(|clients| Arrivals::ClosedLoop { clients }),
            (0.01f64..4.0).prop_map(|per_s| Arrivals::Rate { per_s }),
        ]
    }

    proptest! {
        #[test]
        fn stream_invariants(
            times in prop::collection::vec(0.2f64..20.0, 1..5),
            requests in 1u32..60,
            arrivals in arrivals(),
            batch in 1u32..4,
        ) {
            let replicas: Vec<(Vec<DeviceId>, f64)> =
                times.iter().enumerate().map(|(i, t)| (cuda(i as u32), *t)).collect();
            let opts = StreamOptions { requests, arrivals };
            let r = stream(&replicas, batch, opts);
            let fastest = times.iter().cloned().fold(f64::INFINITY, f64::min);
            // Every request served once, none before it arrives, none faster than the
            // fastest replica.
            prop_assert_eq!(r.requests.len(), requests as usize);
            prop_assert_eq!(r.replicas.iter().map(|x| x.served).sum::<u32>(), requests);
            for s in &r.requests {
                prop_assert!(s.start_s >= s.arrival_s);
                prop_assert!(s.end_s - s.arrival_s >= fastest - 1e-9);
            }
            // No more than every replica busy all the time.
            let bound = 60.0 * batch as f64 * times.iter().map(|t| 1.0 / t).sum::<f64>();
            prop_assert!(r.images_per_min <= bound * (1.0 + 1e-9), "{} > {bound}", r.images_per_min);
            prop_assert!(r.latency_p50_s <= r.latency_p95_s);
            prop_assert!(r.latency_p95_s <= r.latency_max_s);
            prop_assert!(r.latency_mean_s <= r.latency_max_s + 1e-9);
            for x in &r.replicas {
                prop_assert!(x.busy_pct <= 100.0 + 1e-9);
            }
            // One client: never a wait, every request on the fastest replica.
            if arrivals == (Arrivals::ClosedLoop { clients: 1 }) {
                // (end − arrival rounds: seconds added to a clock and taken off again)
                let near = |x: f64| (x - fastest).abs() <= 1e-9 * fastest.max(1.0);
                prop_assert!(near(r.latency_p50_s) && near(r.latency_max_s), "{r:?}");
                prop_assert_eq!(r.wait_p95_s, 0.0);
            }
        }
    }
}
