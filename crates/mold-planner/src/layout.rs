//! Turns block counts per group into contiguous block ranges in execution order, and a
//! choice into a plan.

use crate::{Choice, Family, Request};
use mold_plan::{
    BlockRange, ComponentPlan, ComponentRole, ModelRef, Part, Plan, Residency, SolverRecord,
    PLAN_VERSION,
};

/// Orders groups so each runs one contiguous range: by the first kind they run, then by
/// the last (a group that continues into the next kind comes last among its kind's).
/// Within a group, streamed blocks of its first kind come first and streamed blocks of
/// its last kind come last, so resident blocks stay together.
pub fn layout(req: &Request, choice: &Choice) -> Vec<Part> {
    let kinds = &req.model.transformer.kinds;
    let span = |g: &crate::ilp::GroupChoice| {
        let has: Vec<usize> = (0..kinds.len())
            .filter(|&k| g.resident[k] + g.streamed[k] > 0)
            .collect();
        (has[0], *has.last().unwrap())
    };
    let mut order: Vec<&crate::ilp::GroupChoice> = choice.groups.iter().collect();
    order.sort_by_key(|g| (span(g), g.devices.clone()));
    let mut next = vec![0u32; kinds.len()];
    let mut parts: Vec<Part> = Vec::new();
    let buffers = req.constraints.stream_buffers;
    for g in order {
        let (first, last) = span(g);
        // (kind, count, residency) runs in order for this group.
        let mut runs: Vec<(usize, u32, Residency)> = Vec::new();
        for k in first..=last {
            let (r, s) = (g.resident[k], g.streamed[k]);
            if k == first && k != last {
                runs.push((k, s, Residency::Streamed));
                runs.push((k, r, Residency::Resident));
            } else {
                runs.push((k, r, Residency::Resident));
                runs.push((k, s, Residency::Streamed));
            }
        }
        for (k, n, res) in runs {
            if n == 0 {
                continue;
            }
            let range = BlockRange::new(&kinds[k].name, next[k], next[k] + n);
            next[k] += n;
            match parts.last_mut() {
                Some(p) if p.devices == g.devices && p.residency == res => p.blocks.push(range),
                _ => parts.push(Part {
                    blocks: vec![range],
                    devices: g.devices.clone(),
                    residency: res,
                    stream_buffers: (res == Residency::Streamed).then_some(buffers),
                }),
            }
        }
    }
    parts
}

/// Builds the plan for a solver choice, with its evaluated prediction.
pub fn plan_from_choice(
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
            let dev = choice.placement[&c.name].clone();
            ComponentPlan {
                name: c.name.clone(),
                role: c.role,
                dtype: req.dtype(&c.name),
                parts: vec![Part {
                    blocks: vec![],
                    devices: vec![dev],
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
            parts: layout(req, choice),
        },
    );
    let mut plan = Plan {
        version: PLAN_VERSION,
        model: ModelRef {
            id: req.model.id.clone(),
            checkpoint: req.checkpoint.clone(),
        },
        workload: req.workload.clone(),
        machine: req.machine.identity(),
        components,
        predicted: mold_cost::Evaluation::default_prediction(),
        solver: SolverRecord {
            solver: "microlp (good_lp)".into(),
            status: status.into(),
            objective: req.objective.name().into(),
            objective_value: mold_cost::round6(choice.objective),
            strategy: family.name().into(),
            solve_time_ms: (solve_time_ms * 1000.0).round() / 1000.0,
        },
    };
    let ev = mold_cost::evaluate(&plan, &req.model, &req.machine);
    plan.predicted = ev.prediction();
    plan
}
