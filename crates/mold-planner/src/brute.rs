//! An exhaustive enumerator over every valid plan of a small request, used to check the
//! integer program: same candidate groups, every split of every kind's blocks over
//! (group, resident/streamed) that can be laid out contiguously, every component
//! placement; costs summed directly from `mold-cost`'s per-block figures.

use crate::ilp::{
    block_costs, candidate_groups, component_options, GroupChoice, MEMORY_LATENCY_WEIGHT,
};
use crate::{Choice, Family, Objective, Request};
use mold_cost::Ctx;
use mold_plan::GIB;
use std::collections::BTreeMap;

/// Every way to write `total` as an ordered sum of `slots` non-negative parts.
fn compositions(total: u32, slots: usize) -> Vec<Vec<u32>> {
    if slots == 0 {
        return if total == 0 { vec![vec![]] } else { vec![] };
    }
    let mut out = Vec::new();
    for first in 0..=total {
        for mut rest in compositions(total - first, slots - 1) {
            rest.insert(0, first);
            out.push(rest);
        }
    }
    out
}

/// Whether per-group kind sets can be laid out as contiguous ranges.
pub fn contiguous(uses: &[Vec<bool>], counts: &[u32], blocks: &[Vec<u32>]) -> bool {
    let nk = counts.len();
    for (g, u) in uses.iter().enumerate() {
        let has: Vec<usize> = (0..nk).filter(|&k| u[k]).collect();
        if has.is_empty() {
            continue;
        }
        let (a, b) = (has[0], *has.last().unwrap());
        for m in a + 1..b {
            if blocks[g][m] != counts[m] {
                return false; // a group spanning three kinds must run all of the middle one
            }
        }
    }
    for j in 0..nk.saturating_sub(1) {
        if uses.iter().filter(|u| u[j] && u[j + 1]).count() > 1 {
            return false;
        }
    }
    true
}

fn family_of(groups: &[Vec<mold_plan::DeviceId>], used: &[bool]) -> Family {
    let n_used = used.iter().filter(|u| **u).count();
    let tp = groups
        .iter()
        .zip(used)
        .filter(|(g, u)| **u && g.len() > 1)
        .count();
    match (n_used, tp) {
        (1, 0) => Family::Single,
        (_, 0) => Family::Split,
        (1, _) => Family::Tensor,
        _ => Family::Mixed,
    }
}

/// The best plan of `family` (or of all) and how many valid plans were looked at.
pub fn best(req: &Request, family: Option<Family>) -> (Option<Choice>, u64) {
    let ctx = Ctx::new(&req.model, &req.machine, &req.workload);
    let groups = candidate_groups(req);
    let bc = block_costs(req, &ctx, &groups);
    let comps = component_options(req, &ctx);
    let kinds = &req.model.transformer.kinds;
    let nk = kinds.len();
    let counts: Vec<u32> = kinds.iter().map(|k| k.count).collect();
    let stream = req.constraints.stream;
    let res_opts = if stream { 2 } else { 1 };
    let slots = groups.len() * res_opts;
    let per_kind: Vec<Vec<Vec<u32>>> = counts.iter().map(|c| compositions(*c, slots)).collect();
    let dtype = req.dtype("transformer");
    let handoff = ctx.handoff_s(dtype);
    let stem = req.model.transformer.stem_bytes(dtype);
    let nbuf = req.constraints.stream_buffers as u64;
    let steps = req.workload.steps as f64;
    let devs = &req.machine.devices;
    let mut best: Option<Choice> = None;
    let mut seen = 0u64;

    // Component placements: every combination of allowed locations.
    let mut placements: Vec<Vec<usize>> = vec![vec![]];
    for (_, opts) in &comps {
        placements = placements
            .into_iter()
            .flat_map(|p| {
                (0..opts.len()).map(move |i| {
                    let mut q = p.clone();
                    q.push(i);
                    q
                })
            })
            .collect();
    }

    let mut idx = vec![0usize; nk];
    'outer: loop {
        // blocks[g][k] = resident + streamed; res[g][k], st[g][k].
        let mut res = vec![vec![0u32; nk]; groups.len()];
        let mut st = vec![vec![0u32; nk]; groups.len()];
        for k in 0..nk {
            let c = &per_kind[k][idx[k]];
            for g in 0..groups.len() {
                res[g][k] = c[g * res_opts];
                if stream {
                    st[g][k] = c[g * res_opts + 1];
                }
            }
        }
        let blocks: Vec<Vec<u32>> = (0..groups.len())
            .map(|g| (0..nk).map(|k| res[g][k] + st[g][k]).collect())
            .collect();
        let uses: Vec<Vec<bool>> = blocks
            .iter()
            .map(|b| b.iter().map(|n| *n > 0).collect())
            .collect();
        let used: Vec<bool> = uses.iter().map(|u| u.iter().any(|x| *x)).collect();
        let fam_ok = family.is_none_or(|f| family_of(&groups, &used) == f);
        if fam_ok && contiguous(&uses, &counts, &blocks) {
            // Transformer: time per step and memory per device.
            let mut step = 0.0;
            let mut mem = vec![0u64; devs.len()];
            let mut act = vec![0u64; devs.len()];
            let mut pinned = 0u64;
            for g in 0..groups.len() {
                if !used[g] {
                    continue;
                }
                step += handoff;
                let mut fill: f64 = 0.0;
                let mut buf = 0u64;
                for k in 0..nk {
                    let b = &bc[g][k];
                    step += b.group_kind_s(res[g][k] as u64, st[g][k] as u64);
                    if st[g][k] > 0 {
                        fill = fill.max(b.fill_s());
                        buf = buf.max(nbuf * b.weight_bytes);
                        pinned += st[g][k] as u64 * b.weight_bytes * groups[g].len() as u64;
                    }
                    for (di, d) in devs.iter().enumerate() {
                        if groups[g].contains(&d.id) {
                            mem[di] += res[g][k] as u64 * b.weight_bytes;
                            if uses[g][k] {
                                act[di] = act[di].max(b.activation_bytes);
                            }
                        }
                    }
                }
                step += fill;
                for (di, d) in devs.iter().enumerate() {
                    if groups[g].contains(&d.id) {
                        mem[di] += buf;
                    }
                }
            }
            step -= handoff;
            for (di, d) in devs.iter().enumerate() {
                if groups
                    .iter()
                    .zip(&used)
                    .any(|(g, u)| *u && g.contains(&d.id))
                {
                    mem[di] += stem;
                }
            }
            if pinned <= req.machine.host.pinned_limit.0 {
                for p in &placements {
                    let mut m = mem.clone();
                    let mut a = act.clone();
                    let mut host = pinned;
                    let mut t = steps * step;
                    for (ci, (_, opts)) in comps.iter().enumerate() {
                        let o = &opts[p[ci]];
                        t += o.seconds;
                        match devs.iter().position(|d| d.id == o.at) {
                            Some(di) => {
                                m[di] += o.weight_bytes;
                                a[di] = a[di].max(o.activation_bytes);
                            }
                            None => host += o.weight_bytes + o.activation_bytes,
                        }
                    }
                    let fits = host <= req.machine.host.memory.0
                        && devs
                            .iter()
                            .enumerate()
                            .all(|(di, d)| m[di] + a[di] + d.headroom.0 <= d.budget.0);
                    if !fits {
                        continue;
                    }
                    seen += 1;
                    let obj = match req.objective {
                        Objective::Latency => t,
                        Objective::Memory => {
                            (0..devs.len())
                                .map(|di| (m[di] + a[di]) as f64 / GIB as f64)
                                .sum::<f64>()
                                + MEMORY_LATENCY_WEIGHT * t
                        }
                    };
                    if best.as_ref().is_none_or(|b| obj < b.objective) {
                        let mut placement = BTreeMap::new();
                        for (ci, (name, opts)) in comps.iter().enumerate() {
                            placement.insert(name.clone(), opts[p[ci]].at.clone());
                        }
                        best = Some(Choice {
                            groups: (0..groups.len())
                                .filter(|g| used[*g])
                                .map(|g| GroupChoice {
                                    devices: groups[g].clone(),
                                    resident: res[g].clone(),
                                    streamed: st[g].clone(),
                                })
                                .collect(),
                            placement,
                            objective: obj,
                        });
                    }
                }
            }
        }
        // Next combination of per-kind compositions.
        for k in 0..nk {
            idx[k] += 1;
            if idx[k] < per_kind[k].len() {
                continue 'outer;
            }
            idx[k] = 0;
        }
        break;
    }
    (best, seen)
}
