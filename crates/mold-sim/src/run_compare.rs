//! `mold sim PLAN --compare run.json`: a run report ([`crate::run_report`]) checked
//! against its plan and printed as a table: prediction, measurement and deviation per
//! phase and per device peak, and the largest deviation named.

use crate::run_report::{ms, pct, PhaseKind, RunReport, RunReportError};
use crate::text::human;
use mold_plan::Plan;
use std::fmt::Write;

/// Refuses a report written for another plan than `plan` (its fingerprint differs).
pub fn check_plan(
    report: &RunReport,
    source_name: &str,
    plan: &Plan,
    plan_name: &str,
) -> Result<(), RunReportError> {
    let fp = crate::run_report::plan_fingerprint(plan);
    if report.plan.fingerprint != fp {
        return Err(RunReportError::Field {
            source_name: source_name.to_string(),
            field: "plan.fingerprint".into(),
            message: format!(
                "the report is of another plan ({}, {} on {}) than {plan_name} ({fp}, {} on {}): compare it with the plan that ran",
                report.plan.fingerprint,
                report.plan.model,
                report.plan.machine,
                plan.model.id,
                plan.machine.name
            ),
        });
    }
    Ok(())
}

impl RunReport {
    /// The side-by-side table `mold sim --compare` prints.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let r = &self.run;
        let _ = writeln!(
            o,
            "run of {} on {}: {}, {} steps, {}x{}; predicted by {}{}",
            self.plan.model,
            self.plan.machine,
            r.kind.name(),
            r.steps,
            r.width,
            r.height,
            r.predicted_by,
            if r.profiled {
                " (measured with MOLD_PROFILE: synchronised marks slow the step)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            o,
            "{:<36} {:>12} {:>12} {:>10}",
            "phase", "predicted", "measured", "deviation"
        );
        let opt = |s: Option<f64>| s.map(ms).unwrap_or_else(|| "-".into());
        for p in &self.phases {
            let name = if p.per_step && p.kind != PhaseKind::Step {
                format!("{} (per step)", p.phase)
            } else {
                p.phase.clone()
            };
            let _ = writeln!(
                o,
                "{:<36} {:>12} {:>12} {:>10}",
                name,
                opt(p.predicted_s),
                opt(p.measured_s),
                pct(p.deviation())
            );
        }
        let _ = writeln!(
            o,
            "\n{:<12} {:>12} {:>12} {:>24} {:>10}",
            "peak memory", "plan", "accounted", "measured", "deviation"
        );
        let b = |x: Option<u64>| x.map(human).unwrap_or_else(|| "-".into());
        for m in &self.memory {
            let measured = match &m.measured {
                Some(x) => format!("{} ({})", human(x.peak_bytes), x.source.name()),
                None => "-".into(),
            };
            let _ = writeln!(
                o,
                "{:<12} {:>12} {:>12} {:>24} {:>10}",
                m.device.to_string(),
                b(m.predicted_peak_bytes),
                b(m.accounted_peak_bytes),
                measured,
                pct(m.deviation())
            );
        }
        match self.largest_deviation() {
            Some((what, d)) => {
                let _ = writeln!(o, "\nlargest deviation: {what} {}", pct(Some(d)));
            }
            None => o.push_str("\nlargest deviation: nothing both predicted and measured\n"),
        }
        // Each note once, with the rows it applies to.
        let mut notes: Vec<(String, Vec<String>)> = Vec::new();
        for p in &self.phases {
            if let Some(n) = &p.note {
                match notes.iter_mut().find(|(t, _)| t == n) {
                    Some((_, rows)) => rows.push(p.phase.clone()),
                    None => notes.push((n.clone(), vec![p.phase.clone()])),
                }
            }
        }
        for (n, rows) in notes {
            let _ = writeln!(o, "note ({}): {n}", rows.join(", "));
        }
        o
    }
}
