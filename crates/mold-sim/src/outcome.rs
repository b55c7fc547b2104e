//! What a simulated timeline comes to: each device's memory swept over its allocations
//! (peak, when, what is live), budget overruns of devices and host, busy time per
//! stream, and what limits the step.

use crate::engine::Sim;
use crate::text::{human, live_list, secs};
use crate::{
    DeviceReport, Event, EventKind, FirstUse, HostReport, Lane, Live, Overflow, SimReport,
};
use mold_plan::ComponentRole;

impl Sim<'_> {
    pub(crate) fn finish(
        &mut self,
        denoise_start: f64,
        step_ends: Vec<f64>,
        sim_end: f64,
        sim_steps: u32,
    ) -> SimReport {
        let plan = self.plan;
        let steps = plan.workload.steps;
        let mut step_times = Vec::new();
        let mut prev = denoise_start;
        for e in &step_ends {
            step_times.push(e - prev);
            prev = *e;
        }
        let first_step = step_times.first().copied().unwrap_or(0.0);
        let step = step_times.last().copied().unwrap_or(0.0);
        let denoise_end = step_ends.last().copied().unwrap_or(denoise_start);
        let extra_steps = steps.saturating_sub(sim_steps) as f64;
        let request = sim_end + extra_steps * step;
        let window = if step_ends.len() >= 2 {
            (step_ends[step_ends.len() - 2], denoise_end)
        } else {
            (denoise_start, denoise_end)
        };

        let mut devices = Vec::new();
        let mut overflows = Vec::new();
        for (i, d) in self.machine.devices.iter().enumerate() {
            let (peak, at, moment, live, curve) = self.sweep(i, sim_end);
            let busy = |lane: Lane, lo: f64, hi: f64| -> f64 {
                self.events
                    .iter()
                    .filter(|e| e.device == d.id && e.lane == lane)
                    .map(|e| (e.end_s.min(hi) - e.start_s.max(lo)).max(0.0))
                    .sum()
            };
            let (lo, hi) = window;
            let (sc, sy, sm) = (
                busy(Lane::Compute, lo, hi),
                busy(Lane::Copy, lo, hi),
                busy(Lane::Comm, lo, hi),
            );
            let total =
                |lane: Lane, s: f64| busy(lane, f64::NEG_INFINITY, f64::INFINITY) + extra_steps * s;
            let compute_s = total(Lane::Compute, sc);
            let r = DeviceReport {
                device: d.id.clone(),
                name: d.name.clone(),
                budget: d.budget.0,
                headroom: d.headroom.0,
                weights: self.weights[i],
                stream_buffers: self.buffers[i],
                peak,
                peak_at_s: at,
                peak_moment: moment.clone(),
                peak_live: live.clone(),
                compute_s,
                copy_s: total(Lane::Copy, sy),
                comm_s: total(Lane::Comm, sm),
                busy_pct: if request > 0.0 {
                    100.0 * compute_s / request
                } else {
                    0.0
                },
                step_compute_s: sc,
                step_copy_s: sy,
                step_comm_s: sm,
                curve,
            };
            if !r.fits() {
                let need = peak + r.headroom;
                let message = format!(
                    "{}: over budget by {} at {moment} (t={}): peak {} + headroom {} > budget {}; live: {}",
                    d.id,
                    human(need - r.budget),
                    secs(at),
                    human(peak),
                    human(r.headroom),
                    human(r.budget),
                    live_list(&live)
                );
                overflows.push(Overflow {
                    device: d.id.to_string(),
                    moment,
                    at_s: at,
                    need,
                    limit: r.budget,
                    live,
                    message,
                });
            }
            devices.push(r);
        }
        let h = &self.machine.host;
        if self.host_pinned > h.pinned_limit.0 {
            let mut live = self.pinned_parts.clone();
            live.sort_by_key(|l| std::cmp::Reverse(l.bytes));
            overflows.push(Overflow {
                device: "host".into(),
                moment: "load (pinning streamed weights)".into(),
                at_s: 0.0,
                need: self.host_pinned,
                limit: h.pinned_limit.0,
                message: format!(
                    "host: pinned memory for streamed weights {} > pinned_limit {} (over by {}) at load; live: {}",
                    human(self.host_pinned),
                    human(h.pinned_limit.0),
                    human(self.host_pinned - h.pinned_limit.0),
                    live_list(&live)
                ),
                live,
            });
        }
        if self.host_ram > h.memory.0 {
            let mut live = self.host_ram_items.clone();
            live.extend(self.pinned_parts.iter().cloned());
            live.sort_by_key(|l| std::cmp::Reverse(l.bytes));
            overflows.push(Overflow {
                device: "host".into(),
                moment: "load".into(),
                at_s: 0.0,
                need: self.host_ram,
                limit: h.memory.0,
                message: format!(
                    "host: memory {} > host memory {} (over by {}) at load; live: {}",
                    human(self.host_ram),
                    human(h.memory.0),
                    human(self.host_ram - h.memory.0),
                    live_list(&live)
                ),
                live,
            });
        }
        let host_compute: f64 = self
            .events
            .iter()
            .filter(|e| e.device.is_host() && e.lane == Lane::Compute)
            .map(|e| e.duration_s())
            .sum();
        let bottleneck = bottleneck(&devices, step, &self.events, window);
        let mut events = std::mem::take(&mut self.events);
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        SimReport {
            model: self.model.id.clone(),
            machine: self.machine.name.clone(),
            workload: plan.workload.clone(),
            options: self.opts,
            steps,
            simulated_steps: sim_steps,
            first_step_s: first_step,
            step_s: step,
            first_step_differs: (first_step - step).abs() > 1e-9 * step.max(1e-9) + 1e-12,
            step_times_s: step_times,
            encode_s: denoise_start,
            denoise_s: first_step + (steps.saturating_sub(1)) as f64 * step,
            decode_s: sim_end - denoise_end,
            request_s: request,
            devices,
            host: HostReport {
                pinned: self.host_pinned,
                pinned_limit: h.pinned_limit.0,
                ram: self.host_ram,
                memory: h.memory.0,
                compute_s: host_compute,
            },
            overflows,
            bottleneck,
            streamed_per_step: self.streamed_per_step,
            events,
            sim_end_s: sim_end,
            step_ends_s: step_ends,
            denoise_start_s: denoise_start,
            cost_basis: mold_cost::ops::describe(plan, self.model, self.machine),
            first_use: self.first_use(),
            load: mold_cost::load_time(plan, &self.ctx),
            host_read_gbps: self.ctx.host_read_gbps(),
            host_read_measured: self.ctx.host_read_measured(),
        }
    }

    /// The plan's encoders' and decoders' first use in a fresh process, where the
    /// profile's measured runs have it.
    fn first_use(&self) -> Vec<FirstUse> {
        let mut out = Vec::new();
        for c in &self.plan.components {
            if c.role == ComponentRole::Transformer {
                continue;
            }
            let (Some(spec), Some(on)) = (
                self.model.component(&c.name),
                c.parts.first().and_then(|p| p.devices.first()),
            ) else {
                continue;
            };
            if let Some(seconds) = self
                .ctx
                .component_estimate(spec, on, c.dtype)
                .and_then(|e| e.first_use_s)
            {
                out.push(FirstUse {
                    component: c.name.clone(),
                    role: c.role,
                    device: on.clone(),
                    seconds,
                });
            }
        }
        out
    }

    /// Sweeps a device's allocations: (peak, when, moment, live at the peak, curve).
    #[allow(clippy::type_complexity)]
    fn sweep(&self, dev: usize, sim_end: f64) -> (u64, f64, String, Vec<Live>, Vec<(f64, u64)>) {
        let idx: Vec<usize> = (0..self.allocs.len())
            .filter(|&k| self.allocs[k].dev == dev)
            .collect();
        // (time, 0 = free / 1 = allocate, alloc index): frees first at equal times.
        let mut points: Vec<(f64, u8, usize)> = Vec::new();
        for &k in &idx {
            let a = &self.allocs[k];
            points.push((a.start, 1, k));
            points.push((a.end.unwrap_or(sim_end).max(a.start), 0, k));
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut live: Vec<usize> = Vec::new();
        let mut sum = 0u64;
        let mut peak = 0u64;
        let mut at = 0.0;
        let mut moment = "load".to_string();
        let mut snapshot: Vec<usize> = Vec::new();
        let mut curve = vec![(0.0, 0u64)];
        for (t, kind, k) in points {
            let a = &self.allocs[k];
            if kind == 1 {
                sum += a.bytes;
                live.push(k);
                if sum > peak {
                    peak = sum;
                    at = t;
                    moment = a.moment.clone();
                    snapshot = live.clone();
                }
            } else {
                sum -= a.bytes;
                live.retain(|&x| x != k);
            }
            curve.push((t, sum));
        }
        let mut grouped: Vec<Live> = Vec::new();
        for k in snapshot {
            let a = &self.allocs[k];
            match grouped.iter_mut().find(|l| l.what == a.what) {
                Some(l) => l.bytes += a.bytes,
                None => grouped.push(Live {
                    what: a.what.clone(),
                    bytes: a.bytes,
                }),
            }
        }
        grouped.sort_by_key(|l| std::cmp::Reverse(l.bytes));
        (peak, at, moment, grouped, curve)
    }
}

/// What limits the steady step: the busiest stream, in words.
fn bottleneck(devices: &[DeviceReport], step: f64, events: &[Event], window: (f64, f64)) -> String {
    if step <= 0.0 {
        return "no denoising step".into();
    }
    let mut best: Option<(f64, &DeviceReport, Lane)> = None;
    for d in devices {
        for (lane, t) in [
            (Lane::Compute, d.step_compute_s),
            (Lane::Copy, d.step_copy_s),
            (Lane::Comm, d.step_comm_s),
        ] {
            if best.map(|b| t > b.0).unwrap_or(t > 0.0) {
                best = Some((t, d, lane));
            }
        }
    }
    let Some((t, d, lane)) = best else {
        return "nothing runs in the step".into();
    };
    let pct = 100.0 * t / step;
    let (lo, hi) = window;
    match lane {
        Lane::Compute => {
            let others: Vec<String> = devices
                .iter()
                .filter(|o| o.device != d.device && o.step_compute_s > 0.0)
                .map(|o| format!("{} {:.0}%", o.device, 100.0 * o.step_compute_s / step))
                .collect();
            let mut s = format!(
                "compute on {} ({}): {} of the {} step ({pct:.0}%)",
                d.device,
                d.name,
                secs(t),
                secs(step)
            );
            if !others.is_empty() {
                s.push_str(&format!("; other devices compute {}", others.join(", ")));
            }
            s
        }
        Lane::Copy => format!(
            "host→device copies of streamed blocks on {}: {} of the {} step ({pct:.0}%): streaming is copy-bound, compute on it {}",
            d.device,
            secs(t),
            secs(step),
            secs(d.step_compute_s)
        ),
        Lane::Comm => {
            let of = |kind: EventKind| -> f64 {
                events
                    .iter()
                    .filter(|e| e.device == d.device && e.kind == kind)
                    .map(|e| (e.end_s.min(hi) - e.start_s.max(lo)).max(0.0))
                    .sum()
            };
            let (ar, a2a) = (of(EventKind::AllReduce), of(EventKind::AllToAll));
            let a2a = if a2a > 0.0 {
                format!(", all-to-alls {}", secs(a2a))
            } else {
                String::new()
            };
            format!(
                "communication on {}: {} of the {} step ({pct:.0}%), all-reduces {}{a2a}",
                d.device,
                secs(t),
                secs(step),
                secs(ar)
            )
        }
    }
}
