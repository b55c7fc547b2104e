//! An exhaustive enumerator over every valid plan of a small request: the integer
//! program's check, and its stand-in where the solver fails on a small instance.
//!
//! It shares the problem's data with the integer program (`problem.rs`: block costs,
//! component options, budgets, reserves) but neither its encoding nor its candidate
//! groups: it forms device groups itself from every subset of the allowed devices, each
//! in every permitted layout (`tp × sp`), and sums costs directly. [`Space::Aligned`]
//! keeps the groups the integer program considers (parallel groups are aligned runs of
//! consecutive allowed devices, of all of them or of one node's), stated here as a rule on subsets rather than
//! generated; [`Space::All`] keeps every subset, to see what that restriction costs.

use crate::problem::{family_of, Choice, GroupChoice, Problem};
use crate::{Family, Request};
use mold_cost::{BlockCost, Group};
use std::collections::BTreeMap;

/// Which device groups the enumeration forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    /// Every subset of the allowed devices (of a permitted size), in every permitted
    /// layout.
    All,
    /// Single devices, and parallel groups that are aligned runs of consecutive allowed
    /// devices (of all of them, or of one node's), in every permitted layout: the
    /// integer program's candidates.
    Aligned,
}

/// The best plan of each family (indexed as [`Family::ALL`]) and how many valid plans of
/// it were looked at.
pub type PerFamily = [(Option<Choice>, u64); 6];

/// The best plan of `family` (or of all families) and how many valid plans were looked
/// at.
pub fn best(req: &Request, family: Option<Family>, space: Space) -> (Option<Choice>, u64) {
    let all = best_per_family(req, space);
    match family {
        Some(f) => {
            let i = Family::ALL.iter().position(|x| *x == f).unwrap_or(0);
            all[i].clone()
        }
        None => {
            let seen = all.iter().map(|(_, n)| n).sum();
            let best =
                all.into_iter()
                    .filter_map(|(c, _)| c)
                    .fold(None::<Choice>, |b, c| match b {
                        Some(b) if b.objective <= c.objective => Some(b),
                        _ => Some(c),
                    });
            (best, seen)
        }
    }
}

/// Device groups of `space`, by subset of the allowed devices and layout.
fn groups(p: &Problem, space: Space) -> Vec<Group> {
    let n = p.allowed.len();
    let m = &p.req.machine;
    let node: Vec<u32> = p.allowed.iter().map(|d| m.node_of(d)).collect();
    // Each allowed device's index among the allowed devices of its node.
    let local: Vec<usize> = (0..n)
        .map(|i| (0..i).filter(|&j| node[j] == node[i]).count())
        .collect();
    let mut out = Vec::new();
    for mask in 1u32..(1u32 << n) {
        let members: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
        let size = members.len();
        let run = |at: &[usize]| {
            at[members[0]].is_multiple_of(size)
                && members.windows(2).all(|w| at[w[1]] == at[w[0]] + 1)
        };
        let global: Vec<usize> = (0..n).collect();
        // An aligned run of all the allowed devices, or of one node's.
        let aligned =
            run(&global) || (members.iter().all(|&i| node[i] == node[members[0]]) && run(&local));
        if space == Space::Aligned && !aligned {
            continue;
        }
        let devices: Vec<_> = members.iter().map(|&i| p.allowed[i].clone()).collect();
        if size == 1 {
            out.push(Group::new(devices, 1, 1));
            continue;
        }
        for (tp, sp) in p.layouts(size) {
            out.push(Group::new(devices.clone(), tp, sp));
        }
    }
    // Singles first, then by size: the order plans are reported in.
    out.sort_by_key(|g: &Group| g.len());
    out
}

/// The number of ways to split `n` blocks over `slots` places, a bound on what
/// [`best`] walks, for deciding whether it is small enough to run.
pub fn size(req: &Request, space: Space) -> f64 {
    let p = Problem::new(req);
    let slots = groups(&p, space).len() * if p.stream { 2 } else { 1 };
    let placements: f64 = p
        .components
        .iter()
        .map(|c| c.options.len() as f64)
        .product();
    p.counts
        .iter()
        .map(|&c| binomial(c as u64 + slots as u64, slots as u64))
        .product::<f64>()
        * placements.max(1.0)
}

fn binomial(n: u64, k: u64) -> f64 {
    let k = k.min(n - k.min(n));
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
}

struct Walk<'p, 'a> {
    p: &'p Problem<'a>,
    groups: Vec<Group>,
    /// Machine index of each group's devices.
    members: Vec<Vec<usize>>,
    costs: Vec<Vec<BlockCost>>,
    /// Per group: (resident, streamed) of each kind.
    pick: Vec<Vec<(u32, u32)>>,
    best: PerFamily,
}

/// Every valid plan, best of each family.
pub fn best_per_family(req: &Request, space: Space) -> PerFamily {
    let p = Problem::new(req);
    let groups = groups(&p, space);
    let devs = &req.machine.devices;
    let members = groups
        .iter()
        .map(|g| {
            g.devices
                .iter()
                .filter_map(|id| devs.iter().position(|d| &d.id == id))
                .collect()
        })
        .collect();
    let costs = groups.iter().map(|g| p.costs(g)).collect();
    let mut w = Walk {
        p: &p,
        members,
        costs,
        pick: Vec::new(),
        best: Default::default(),
        groups,
    };
    let remaining = p.counts.clone();
    w.group(0, &remaining);
    w.best
}

impl Walk<'_, '_> {
    /// Chooses the blocks of group `g` onwards; `remaining` of each kind are unplaced.
    fn group(&mut self, g: usize, remaining: &[u32]) {
        if g == self.groups.len() {
            if remaining.iter().all(|r| *r == 0) {
                self.leaf();
            }
            return;
        }
        let mut pick = vec![(0u32, 0u32); remaining.len()];
        self.kind(g, 0, remaining, &mut pick);
    }

    /// Chooses group `g`'s (resident, streamed) blocks of kind `k` onwards.
    fn kind(&mut self, g: usize, k: usize, remaining: &[u32], pick: &mut Vec<(u32, u32)>) {
        if k == remaining.len() {
            if !self.interval(pick) || !self.fits_so_far(g, pick) {
                return;
            }
            let rest: Vec<u32> = remaining
                .iter()
                .zip(pick.iter())
                .map(|(r, (a, b))| r - a - b)
                .collect();
            self.pick.push(pick.clone());
            self.group(g + 1, &rest);
            self.pick.pop();
            return;
        }
        for total in 0..=remaining[k] {
            let streamed_max = if self.p.stream { total } else { 0 };
            for s in 0..=streamed_max {
                pick[k] = (total - s, s);
                self.kind(g, k + 1, remaining, pick);
            }
        }
        pick[k] = (0, 0);
    }

    /// A group's kinds form an interval, all of any middle kind's blocks included.
    fn interval(&self, pick: &[(u32, u32)]) -> bool {
        let used: Vec<usize> = (0..pick.len())
            .filter(|&k| pick[k].0 + pick[k].1 > 0)
            .collect();
        let (Some(&a), Some(&b)) = (used.first(), used.last()) else {
            return true;
        };
        (a + 1..b).all(|m| pick[m].0 + pick[m].1 == self.p.counts[m])
    }

    /// Transformer memory of the groups chosen so far (with `pick` for group `g`) fits
    /// every device: a bound, since later groups only add.
    fn fits_so_far(&self, g: usize, pick: &[(u32, u32)]) -> bool {
        let mut picks: Vec<(usize, &[(u32, u32)])> = self
            .pick
            .iter()
            .enumerate()
            .map(|(i, p)| (i, p.as_slice()))
            .collect();
        picks.push((g, pick));
        let mem = self.transformer_memory(&picks);
        mem.iter()
            .enumerate()
            .all(|(d, (bytes, act))| bytes + act <= self.p.cap(d))
    }

    /// Per machine device: transformer bytes held (weights, buffers, stem) and the
    /// largest block activation.
    fn transformer_memory(&self, picks: &[(usize, &[(u32, u32)])]) -> Vec<(u64, u64)> {
        let n = self.p.req.machine.devices.len();
        let mut mem = vec![(0u64, 0u64); n];
        let mut stem = vec![false; n];
        for (g, pick) in picks {
            if pick.iter().all(|(r, s)| r + s == 0) {
                continue;
            }
            let mut buffer = 0u64;
            for (k, (r, s)) in pick.iter().enumerate() {
                let c = &self.costs[*g][k];
                for &d in &self.members[*g] {
                    mem[d].0 += *r as u64 * c.weight_bytes;
                    if r + s > 0 {
                        mem[d].1 = mem[d].1.max(c.activation_bytes);
                    }
                }
                if *s > 0 {
                    buffer = buffer.max(self.p.buffers * c.weight_bytes);
                }
            }
            for &d in &self.members[*g] {
                mem[d].0 += buffer;
                stem[d] = true;
            }
        }
        for (d, s) in stem.iter().enumerate() {
            if *s {
                mem[d].0 += self.p.stem;
            }
        }
        mem
    }

    /// A complete split of the blocks: check it can be laid out, then price it with
    /// every component placement.
    fn leaf(&mut self) {
        let nk = self.p.counts.len();
        let used: Vec<usize> = (0..self.groups.len())
            .filter(|&g| self.pick[g].iter().any(|(r, s)| r + s > 0))
            .collect();
        // At most one group straddles each boundary between consecutive kinds.
        for j in 0..nk.saturating_sub(1) {
            let straddling = used
                .iter()
                .filter(|&&g| {
                    let p = &self.pick[g];
                    p[j].0 + p[j].1 > 0 && p[j + 1].0 + p[j + 1].1 > 0
                })
                .count();
            if straddling > 1 {
                return;
            }
        }
        let family = family_of(&used.iter().map(|&g| &self.groups[g]).collect::<Vec<_>>());
        if !self.p.family_allowed(family) {
            return;
        }
        // Pipelined CFG: each device in one stage.
        if self.p.pipelined {
            let mut seen = vec![false; self.p.req.machine.devices.len()];
            for &g in &used {
                for &d in &self.members[g] {
                    if std::mem::replace(&mut seen[d], true) {
                        return;
                    }
                }
            }
        }
        let picks: Vec<(usize, &[(u32, u32)])> =
            used.iter().map(|&g| (g, self.pick[g].as_slice())).collect();
        let mem = self.transformer_memory(&picks);
        let mut step = self.p.handoff_s * (used.len() as f64 - 1.0);
        let mut pinned = 0u64;
        // Each used group's time, with where the plan puts it: by the first kind it
        // runs, then its last, then the group (`layout.rs`).
        let mut stages: Vec<((usize, usize, &Group), f64)> = Vec::new();
        for &g in &used {
            // A group's blocks are one run of parts: its closing all-gather, once.
            let mut stage = self.p.gather_s(&self.groups[g]);
            let mut fill: f64 = 0.0;
            for (k, (r, s)) in self.pick[g].iter().enumerate() {
                let c = &self.costs[g][k];
                stage += c.group_kind_s(*r as u64, *s as u64);
                if *s > 0 {
                    fill = fill.max(c.fill_s());
                    pinned += *s as u64 * c.weight_bytes * self.groups[g].len() as u64;
                }
            }
            stage += fill;
            step += stage;
            let runs: Vec<usize> = (0..nk)
                .filter(|&k| self.pick[g][k].0 + self.pick[g][k].1 > 0)
                .collect();
            let first = runs.first().copied().unwrap_or(0);
            let last = runs.last().copied().unwrap_or(0);
            stages.push(((first, last, &self.groups[g]), stage));
        }
        if self.p.pipelined {
            // Pipelined CFG: the slowest stage once more, each stage but the last with
            // the hand-off it makes before it takes the second micro-batch.
            stages.sort_by(|a, b| a.0.cmp(&b.0));
            let mut bottleneck: f64 = 0.0;
            for (i, (_, stage)) in stages.iter().enumerate() {
                let hands_off = i + 1 < stages.len();
                let busy = if hands_off {
                    stage + self.p.handoff_s
                } else {
                    *stage
                };
                bottleneck = bottleneck.max(busy);
            }
            step += bottleneck;
        }
        let host = &self.p.req.machine.host;
        if pinned > host.pinned_limit.0 {
            return;
        }
        let runs: Vec<bool> = mem.iter().map(|(b, _)| *b > 0).collect();
        let reserve = self.p.transformer_reserve(family);
        let fi = Family::ALL.iter().position(|f| *f == family).unwrap_or(0);
        let comps = &self.p.components;
        let mut at = vec![0usize; comps.len()];
        loop {
            self.price(&mem, &runs, reserve, pinned, step, &at, fi, &used);
            // Next placement.
            let mut i = 0;
            loop {
                if i == comps.len() {
                    return;
                }
                at[i] += 1;
                if at[i] < comps[i].options.len() {
                    break;
                }
                at[i] = 0;
                i += 1;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn price(
        &mut self,
        mem: &[(u64, u64)],
        runs: &[bool],
        reserve: u64,
        pinned: u64,
        step: f64,
        at: &[usize],
        fi: usize,
        used: &[usize],
    ) {
        let devs = &self.p.req.machine.devices;
        let mut m: Vec<(u64, u64)> = mem.to_vec();
        let mut extra = vec![0u64; devs.len()];
        // One-shot phases: the encoders' (weights, largest activation) and the VAE's
        // bytes on each device.
        let mut enc = vec![(0u64, 0u64); devs.len()];
        let mut dec = vec![0u64; devs.len()];
        let mut host = pinned;
        let mut t = self.p.steps * step;
        for (c, &i) in self.p.components.iter().zip(at) {
            let Some(o) = c.options.get(i) else { return };
            t += o.seconds;
            match devs.iter().position(|d| d.id == o.at) {
                Some(d) => {
                    m[d].0 += o.weight_bytes;
                    m[d].1 = m[d].1.max(o.activation_bytes);
                    if c.is_vae {
                        extra[d] += self.p.vae_reserve();
                        dec[d] += o.weight_bytes + o.activation_bytes;
                    } else {
                        enc[d].0 += o.weight_bytes;
                        enc[d].1 = enc[d].1.max(o.activation_bytes);
                    }
                }
                None => host += o.weight_bytes + o.activation_bytes,
            }
        }
        if host > self.p.req.machine.host.memory.0 {
            return;
        }
        let one_shot = self.p.phases == mold_plan::MemoryPhases::OneShot;
        let mut bytes = 0u64;
        for d in 0..devs.len() {
            let r = if runs[d] { reserve } else { 0 };
            let cap = self.p.cap(d);
            if one_shot {
                let (e, n, v) = (enc[d].0 + enc[d].1, mem[d].0 + mem[d].1, dec[d]);
                if e > cap || n + r > cap || v + extra[d] > cap {
                    return;
                }
                bytes += e.max(n).max(v);
            } else {
                if m[d].0 + m[d].1 + r + extra[d] > cap {
                    return;
                }
                bytes += m[d].0 + m[d].1;
            }
        }
        self.best[fi].1 += 1;
        let objective = self.p.objective(t, bytes);
        if self.best[fi]
            .0
            .as_ref()
            .is_some_and(|b| b.objective <= objective)
        {
            return;
        }
        let placement: BTreeMap<String, mold_plan::DeviceId> = self
            .p
            .components
            .iter()
            .zip(at)
            .map(|(c, &i)| (c.name.clone(), c.options[i].at.clone()))
            .collect();
        self.best[fi].0 = Some(Choice {
            groups: used
                .iter()
                .map(|&g| GroupChoice {
                    group: self.groups[g].clone(),
                    resident: self.pick[g].iter().map(|(r, _)| *r).collect(),
                    streamed: self.pick[g].iter().map(|(_, s)| *s).collect(),
                })
                .collect(),
            placement,
            objective,
        });
    }
}
