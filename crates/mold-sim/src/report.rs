//! The text table and JSON of a simulation.

use crate::text::{human, secs};
use crate::{Comparison, SimReport};

impl SimReport {
    /// A human-readable summary: per device peak memory / budget, busy %, compute /
    /// copy / communication time; step and request time; the bottleneck; overruns.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let w = &self.workload;
        o.push_str(&format!(
            "{} on {}, {}x{}{}, {} steps, batch {}\n",
            self.model,
            self.machine,
            w.width,
            w.height,
            if w.frames > 1 {
                format!(", {} frames", w.frames)
            } else {
                String::new()
            },
            self.steps,
            w.batch
        ));
        o.push_str(&format!(
            "simulated: encode, steps 1–{} event by event, decode; {}\n\n",
            self.simulated_steps,
            self.steps_note()
        ));
        o.push_str(&format!(
            "{:<8} {:>28}  {:<34} {:>5} {:>10} {:>10} {:>10}\n",
            "device", "peak + headroom / budget", "peak at", "busy", "compute", "copy", "comm"
        ));
        for d in &self.devices {
            let used = d.peak > 0 || d.compute_s > 0.0;
            if !used {
                o.push_str(&format!(
                    "{:<8} {:>28}  {:<34}\n",
                    d.device.to_string(),
                    format!("unused / {}", human(d.budget)),
                    ""
                ));
                continue;
            }
            let mem = format!(
                "{} + {} / {}",
                gib(d.peak),
                gib(d.headroom),
                human(d.budget)
            );
            let mark = if d.fits() { "" } else { "  OVER" };
            o.push_str(&format!(
                "{:<8} {:>28}  {:<34} {:>4.0}% {:>10} {:>10} {:>10}{mark}\n",
                d.device.to_string(),
                mem,
                trunc(&d.peak_moment, 34),
                d.busy_pct,
                secs(d.compute_s),
                secs(d.copy_s),
                secs(d.comm_s),
            ));
        }
        if self.host.compute_s > 0.0 {
            o.push_str(&format!(
                "{:<8} {:>28}  {:<34} {:>5} {:>10}\n",
                "host",
                format!("{} / {}", gib(self.host.ram), human(self.host.memory)),
                "",
                "",
                secs(self.host.compute_s)
            ));
        }
        if self.host.pinned > 0 {
            o.push_str(&format!(
                "host pinned {} / {} (streamed weights; {} copied host→device a step)\n",
                human(self.host.pinned),
                human(self.host.pinned_limit),
                human(self.streamed_per_step)
            ));
        }
        o.push('\n');
        o.push_str(&format!(
            "step {}{}\nrequest {} = encode {} + {} steps ({}) + decode {}\n",
            secs(self.step_s),
            if self.first_step_differs {
                format!(" (first step {})", secs(self.first_step_s))
            } else {
                " (every step the same)".to_string()
            },
            secs(self.request_s),
            secs(self.encode_s),
            self.steps,
            secs(self.denoise_s),
            secs(self.decode_s),
        ));
        if self.load.total_s > 0.0 {
            let mut parts: Vec<String> = self
                .load
                .components
                .iter()
                .map(|(n, s)| format!("{n} {}", secs(*s)))
                .collect();
            parts.push(format!("transformer {}", secs(self.load.transformer_s)));
            o.push_str(&format!(
                "load {} before a one-shot request ({}; host read {:.1} GB/s, {})\n",
                secs(self.load.total_s),
                parts.join(", "),
                self.host_read_gbps,
                if self.host_read_measured {
                    "measured"
                } else {
                    "default: `mold devices --calibrate` measures it"
                }
            ));
        }
        o.push_str(&format!("bottleneck: {}\n", self.bottleneck));
        for line in &self.cost_basis {
            o.push_str(&format!("{line}\n"));
        }
        if self.fits() {
            o.push_str("fits: every device within its budget\n");
        } else {
            for f in &self.overflows {
                o.push_str(&format!("error: {}\n", f.message));
            }
        }
        o
    }

    /// Which steps repeat which, in words.
    pub fn steps_note(&self) -> String {
        let later = if self.steps > self.simulated_steps {
            format!(
                "steps {}–{} repeat step {}",
                self.simulated_steps + 1,
                self.steps,
                self.simulated_steps
            )
        } else {
            "every step simulated".to_string()
        };
        let first = if self.steps <= 1 {
            String::new()
        } else if self.first_step_differs {
            format!(
                "; the first step differs ({} vs {}: the copy stream starts idle)",
                secs(self.first_step_s),
                secs(self.step_s)
            )
        } else {
            "; the first step is the same as the others".to_string()
        };
        format!("{later}{first}")
    }

    pub fn to_json(&self, comparison: Option<&Comparison>) -> String {
        let v = serde_json::json!({
            "simulation": self,
            "fits": self.fits(),
            "vs_plan": comparison,
        });
        serde_json::to_string_pretty(&v).expect("a report always serializes")
    }
}

impl Comparison {
    /// Two lines for the table: the plan's prediction beside the simulation.
    pub fn table(&self) -> String {
        let mut o = format!(
            "vs plan: step {} recorded, {} simulated ({:+.2}%)",
            secs(self.recorded_step_s),
            secs(self.simulated_step_s),
            100.0 * self.step_deviation
        );
        if self.step_deviation.abs() > 1e-4 {
            o.push_str(&format!(
                "; planner's model replayed: {}",
                secs(self.planner_model_step_s)
            ));
        }
        o.push('\n');
        for p in &self.peaks {
            o.push_str(&format!(
                "         {} peak {} recorded, {} simulated ({:+.2}%)\n",
                p.device,
                gib(p.recorded),
                gib(p.simulated),
                100.0 * p.deviation
            ));
        }
        o
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / mold_plan::GIB as f64)
}

fn trunc(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}
