//! Turns block counts per group into contiguous block ranges in execution order, and a
//! choice into a plan.

use crate::{Choice, Family, Request};
use mold_plan::{
    BlockRange, ComponentPlan, ComponentRole, ModelRef, Part, Plan, Residency, SolverRecord,
    PLAN_VERSION,
};

/// Orders groups so each runs one contiguous range: by the first kind they run, then by
/// the last (a group that continues into the next kind comes last among its kind's).
/// Within a group, each kind's streamed blocks are spread evenly among its resident ones:
/// the executor's copy stream then fills a buffer with the next streamed block while the
/// resident blocks before it compute, so copies hide behind compute wherever the link
/// allows (streamed blocks bunched together would leave the copies nothing to hide
/// behind but each other's compute). Memory is the same either way.
fn layout(req: &Request, choice: &Choice) -> Vec<Part> {
    let kinds = &req.model.transformer.kinds;
    let span = |g: &crate::problem::GroupChoice| {
        let has: Vec<usize> = (0..kinds.len())
            .filter(|&k| g.resident[k] + g.streamed[k] > 0)
            .collect();
        match (has.first(), has.last()) {
            (Some(a), Some(b)) => (*a, *b),
            _ => (0, 0),
        }
    };
    let mut order: Vec<&crate::problem::GroupChoice> = choice.groups.iter().collect();
    order.sort_by_key(|g| (span(g), g.group.clone()));
    let mut next = vec![0u32; kinds.len()];
    let mut parts: Vec<Part> = Vec::new();
    let buffers = req.constraints.stream_buffers;
    for g in order {
        let (first, last) = span(g);
        // (kind, count, residency) runs in order for this group.
        let mut runs: Vec<(usize, u32, Residency)> = Vec::new();
        for k in first..=last {
            for res in spread(g.resident[k], g.streamed[k]) {
                match runs.last_mut() {
                    Some((rk, n, rr)) if *rk == k && *rr == res => *n += 1,
                    _ => runs.push((k, 1, res)),
                }
            }
        }
        for (k, n, res) in runs {
            if n == 0 {
                continue;
            }
            let range = BlockRange::new(&kinds[k].name, next[k], next[k] + n);
            next[k] += n;
            match parts.last_mut() {
                Some(p)
                    if p.devices == g.group.devices
                        && (p.tp, p.sp) == (g.group.tp, g.group.sp)
                        && p.residency == res =>
                {
                    p.blocks.push(range)
                }
                _ => parts.push(Part {
                    blocks: vec![range],
                    devices: g.group.devices.clone(),
                    tp: g.group.tp,
                    sp: g.group.sp,
                    residency: res,
                    stream_buffers: (res == Residency::Streamed).then_some(buffers),
                }),
            }
        }
    }
    parts
}

/// `resident + streamed` residencies in order with the streamed ones spread evenly, the
/// first block resident (it overlaps the copy of the first streamed one) whenever any is.
pub(crate) fn spread(resident: u32, streamed: u32) -> Vec<Residency> {
    let n = resident + streamed;
    (0..n)
        .map(|i| {
            // Block i is streamed when the running share of streamed blocks steps up.
            let before = (i as u64 * streamed as u64) / n as u64;
            let after = ((i as u64 + 1) * streamed as u64) / n as u64;
            if after > before {
                Residency::Streamed
            } else {
                Residency::Resident
            }
        })
        .collect()
}

/// Builds the plan for a solver choice, with its evaluated prediction.
pub fn plan_from_choice(
    req: &Request,
    choice: &Choice,
    family: Family,
    status: &str,
    solve_time_ms: f64,
) -> Plan {
    let mut plan = unpriced(req, choice, family, status, solve_time_ms);
    plan.predicted = mold_cost::evaluate(&plan, &req.model, &req.machine).prediction();
    plan
}

/// The plan for a choice, its prediction left zero: for choices not yet validated
/// (`mold_cost::evaluate` needs a valid plan).
pub(crate) fn unpriced(
    req: &Request,
    choice: &Choice,
    family: Family,
    status: &str,
    solve_time_ms: f64,
) -> Plan {
    let mut components: Vec<ComponentPlan> = req
        .model
        .components
        .iter()
        .map(|c| {
            // Every component has a place in a choice; the host stands in otherwise, and
            // validation refuses what that breaks.
            let dev = choice
                .placement
                .get(&c.name)
                .cloned()
                .unwrap_or(mold_plan::DeviceId::Host);
            ComponentPlan {
                name: c.name.clone(),
                role: c.role,
                dtype: req.dtype(&c.name),
                attention: None,
                parts: vec![Part {
                    blocks: vec![],
                    devices: vec![dev],
                    tp: 1,
                    sp: 1,
                    residency: Residency::Resident,
                    stream_buffers: None,
                }],
            }
        })
        .collect();
    // Execution order: encoders, transformer, VAE.
    let vae_at = components
        .iter()
        .position(|c| c.role == ComponentRole::Vae)
        .unwrap_or(components.len());
    components.insert(
        vae_at,
        ComponentPlan {
            name: "transformer".into(),
            role: ComponentRole::Transformer,
            dtype: req.dtype("transformer"),
            attention: req.attention(),
            parts: layout(req, choice),
        },
    );
    Plan {
        version: PLAN_VERSION,
        model: ModelRef {
            id: req.model.id.clone(),
            checkpoint: req.checkpoint.clone(),
        },
        workload: req.workload.clone(),
        cfg: req.cfg_mode().map(|mode| mold_plan::CfgPlan { mode }),
        memory_phases: req.memory_phases,
        machine: req.machine.identity(),
        components,
        replicas: None,
        predicted: mold_cost::Evaluation::default_prediction(),
        solver: SolverRecord {
            solver: "microlp (good_lp)".into(),
            status: status.into(),
            objective: req.objective.name().into(),
            objective_value: mold_cost::round6(choice.objective),
            strategy: family.name().into(),
            solve_time_ms: (solve_time_ms * 1000.0).round() / 1000.0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(v: &[Residency]) -> String {
        v.iter()
            .map(|r| if *r == Residency::Streamed { 'S' } else { 'r' })
            .collect()
    }

    #[test]
    fn streamed_blocks_are_spread_evenly() {
        assert_eq!(show(&spread(3, 0)), "rrr");
        assert_eq!(show(&spread(0, 3)), "SSS");
        assert_eq!(show(&spread(2, 2)), "rSrS");
        assert_eq!(show(&spread(4, 2)), "rrSrrS");
        assert_eq!(show(&spread(1, 3)), "rSSS");
        for (r, s) in [(21, 17), (16, 22), (0, 38), (37, 1)] {
            let v = spread(r, s);
            assert_eq!(v.len() as u32, r + s);
            assert_eq!(
                v.iter().filter(|x| **x == Residency::Streamed).count() as u32,
                s
            );
            // No two streamed blocks in a row while resident ones remain to put between.
            if r >= s {
                assert!(!show(&v).contains("SS"), "{r} {s}: {}", show(&v));
            }
        }
    }
}
