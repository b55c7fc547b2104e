//! The stand-in where the integer program gives a family no plan (the solver failed, or
//! its time ran out before it found one) and the instance is too large to enumerate: a
//! local search over the same plans, each priced exactly by `mold_cost::evaluate`.
//!
//! A point of the search is an ordered list of candidate groups (`candidates.rs`) with
//! the number of blocks each runs, cut in that order from the blocks in execution order
//! (so each group runs one contiguous range, as the program's kind-interval constraints
//! allow), the blocks of each kind each group keeps resident (the rest stream), and each
//! component's place. From a few starts (group sets the family can use, blocks shared by
//! capacity) it descends, lexicographically, the bytes the plan breaks its budgets by
//! (`Problem::overflow`), then the objective: components move, groups give their place
//! to others of their kind or change places, block boundaries move and groups keep more
//! or fewer blocks resident by steps of …, 4, 2, 1 blocks, a group stops streaming or
//! hands its blocks to a neighbour. At a local optimum it tries each move even where it does worse and a
//! short descent after it ("kicks"), keeping what ends better. It stops there or after
//! a bound on plans priced and on time, so it answers in bounded time; its answer fits
//! every budget but is not proven the family's best, and is labelled so.

use crate::candidates::candidate_groups;
use crate::layout::unpriced;
use crate::problem::{family_of, Choice, GroupChoice, Problem};
use crate::{Family, Request};
use mold_cost::Group;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Plans priced at most by one family's search (one `mold_cost::evaluate` each: from
/// about 20 µs on two GPUs to 300 µs on eight, so at most about half a second).
pub const MAX_PRICED: usize = 1500;

/// Plans priced at most by the short descent after each kick (`Search::climb`).
const KICK_PRICED: usize = 40;

/// Starts tried at most, each a group set.
const MAX_STARTS: usize = 12;

/// One point of the search.
#[derive(Clone, Debug, PartialEq)]
struct State {
    /// Candidate groups, in the order their blocks are cut.
    groups: Vec<usize>,
    /// Blocks each group runs (0: unused).
    sizes: Vec<u32>,
    /// Resident blocks of each kind on each group (at most its blocks of that kind: the
    /// rest stream, where streaming is allowed).
    resident: Vec<Vec<u32>>,
    /// Each component's option (`Problem::components`).
    at: Vec<usize>,
}

/// (bytes over budget, objective): lower is better, lexicographically.
type Score = (u64, f64);

struct Search<'p, 'a> {
    p: &'p Problem<'a>,
    family: Family,
    cands: Vec<Group>,
    /// Plans priced so far.
    priced: usize,
    /// Where the current start's search stops: plans priced, and the clock (`None`: a
    /// time too long to count).
    stop: usize,
    deadline: Option<Instant>,
}

/// The best plan of `family` for `req` the local search finds within [`MAX_PRICED`]
/// plans priced and `time`, priced exactly; `None` where it finds none that fits (one
/// may fit all the same). `mold plan` falls back on it where the solver gives a family
/// no plan and the instance is too large to enumerate.
pub fn best(req: &Request, family: Family, time: Duration) -> Option<Choice> {
    let p = Problem::new(req);
    let deadline = Instant::now().checked_add(time);
    search(&p, family, MAX_PRICED, deadline)
        .and_then(|c| crate::search::price(&p, &c).map(|objective| Choice { objective, ..c }))
}

/// The best plan of `family` the search finds within `max_priced` plans priced (half of
/// what is left to each start, the most promising first, what one leaves going to the
/// next) and by `deadline`, or `None` where it finds none that fits.
fn search(
    p: &Problem,
    family: Family,
    max_priced: usize,
    deadline: Option<Instant>,
) -> Option<Choice> {
    if !p.family_allowed(family) {
        return None;
    }
    let mut s = Search {
        p,
        family,
        cands: candidate_groups(p),
        priced: 0,
        stop: 0,
        deadline,
    };
    // Each start's first point, the most promising climbed first.
    s.stop = max_priced;
    let mut firsts: Vec<(Score, State)> = Vec::new();
    for start in s.starts() {
        if s.spent(usize::MAX) {
            break;
        }
        firsts.extend(s.initial(&start));
    }
    firsts.sort_by(|a, b| a.0 .0.cmp(&b.0 .0).then(a.0 .1.total_cmp(&b.0 .1)));
    let mut best: Option<(Score, State)> = None;
    let n = firsts.len();
    for (j, first) in firsts.into_iter().enumerate() {
        // Half of what is left for each start but the last: the most promising gets
        // the most.
        let left = max_priced.saturating_sub(s.priced);
        s.stop = s.priced + if j + 1 < n { left / 2 } else { left };
        if s.spent(usize::MAX) {
            break;
        }
        let found = s.climb(first);
        if found.0 .0 == 0 && best.as_ref().is_none_or(|b| found.0 .1 < b.0 .1) {
            best = Some(found);
        }
    }
    let (score, state) = best?;
    let mut choice = s.choice(&state);
    choice.objective = score.1;
    Some(choice)
}

impl Search<'_, '_> {
    /// Whether the current start has priced what it may (or `bound` plans), or the
    /// clock has run out.
    fn spent(&self, bound: usize) -> bool {
        self.priced >= bound.min(self.stop) || self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    fn total(&self) -> u32 {
        self.p.counts.iter().sum()
    }

    /// Group sets the family can use, in order: each a start.
    fn starts(&self) -> Vec<Vec<usize>> {
        let singles: Vec<usize> = (0..self.cands.len())
            .filter(|&g| self.cands[g].len() == 1)
            .collect();
        let of = |f: Family| -> Vec<usize> {
            (0..self.cands.len())
                .filter(|&g| {
                    let c = &self.cands[g];
                    c.len() > 1 && Family::of_layout(c.tp, c.sp) == f
                })
                .collect()
        };
        let disjoint = |a: &Group, b: &Group| !a.devices.iter().any(|d| b.devices.contains(d));
        let mut out: Vec<Vec<usize>> = match self.family {
            Family::Single => singles.iter().map(|&g| vec![g]).collect(),
            Family::Split if singles.len() >= 2 => {
                // Every single device, then the devices by capacity taking the first
                // two, three, … of them.
                let mut by_cap = singles.clone();
                by_cap.sort_by_key(|&g| std::cmp::Reverse(self.capacity(g)));
                let mut v = vec![singles.clone()];
                for n in 2..by_cap.len() {
                    let mut set = by_cap[..n].to_vec();
                    set.sort();
                    v.push(set);
                }
                v
            }
            Family::Split => vec![],
            Family::Tensor | Family::Sequence | Family::Hybrid => {
                of(self.family).into_iter().map(|g| vec![g]).collect()
            }
            Family::Mixed => {
                let parallel: Vec<usize> = (0..self.cands.len())
                    .filter(|&g| self.cands[g].len() > 1)
                    .collect();
                let mut v = Vec::new();
                // Each parallel group with the roomiest single device beside it (outside
                // it, where pipelined stages must not share devices), then with every
                // single device outside it, then with each other parallel group.
                let room = |g: &usize| self.capacity(*g);
                let mut firsts = Vec::new();
                let mut rests = Vec::new();
                for &a in &parallel {
                    let outside: Vec<usize> = singles
                        .iter()
                        .copied()
                        .filter(|&g| disjoint(&self.cands[a], &self.cands[g]))
                        .collect();
                    let beside = if self.p.pipelined { &outside } else { &singles };
                    if let Some(&b) = beside.iter().max_by_key(|g| room(g)) {
                        firsts.push(vec![a, b]);
                    }
                    if outside.len() > 1 {
                        rests.push([vec![a], outside].concat());
                    }
                }
                for &a in &parallel {
                    for &b in &parallel {
                        if a < b && (!self.p.pipelined || disjoint(&self.cands[a], &self.cands[b]))
                        {
                            rests.push(vec![a, b]);
                        }
                    }
                }
                v.extend(firsts);
                v.extend(rests);
                v
            }
        };
        out.truncate(MAX_STARTS);
        out
    }

    /// Bytes group `g` may hold on each of its devices together: the least capacity of
    /// its devices times how many there are.
    fn capacity(&self, g: usize) -> u64 {
        let devs = &self.p.req.machine.devices;
        let c = &self.cands[g];
        let least = c
            .devices
            .iter()
            .filter_map(|id| devs.iter().position(|d| &d.id == id))
            .map(|d| self.p.cap(d))
            .min()
            .unwrap_or(0);
        least.saturating_mul(c.len() as u64)
    }

    /// Blocks of each kind that group position `i` of `state` runs.
    fn kinds_of(&self, state: &State, i: usize) -> Vec<u32> {
        let start: u32 = state.sizes[..i].iter().sum();
        let end = start + state.sizes[i];
        let mut at = 0u32;
        self.p
            .counts
            .iter()
            .map(|&n| {
                let (a, b) = (at, at + n);
                at = b;
                end.min(b).saturating_sub(start.max(a))
            })
            .collect()
    }

    fn choice(&self, state: &State) -> Choice {
        let mut groups = Vec::new();
        for (i, &g) in state.groups.iter().enumerate() {
            let blocks = self.kinds_of(state, i);
            if blocks.iter().all(|n| *n == 0) {
                continue;
            }
            let resident: Vec<u32> = if self.p.stream {
                blocks
                    .iter()
                    .zip(&state.resident[i])
                    .map(|(n, r)| (*r).min(*n))
                    .collect()
            } else {
                blocks.clone()
            };
            groups.push(GroupChoice {
                group: self.cands[g].clone(),
                streamed: blocks.iter().zip(&resident).map(|(n, r)| n - r).collect(),
                resident,
            });
        }
        let placement: BTreeMap<String, mold_plan::DeviceId> = self
            .p
            .components
            .iter()
            .zip(&state.at)
            .filter_map(|(c, &i)| Some((c.name.clone(), c.options.get(i)?.at.clone())))
            .collect();
        Choice {
            groups,
            placement,
            objective: 0.0,
        }
    }

    /// Prices a state: `None` where it is no plan of the family.
    fn score(&mut self, state: &State) -> Option<Score> {
        self.priced += 1;
        let p = self.p;
        let c = self.choice(state);
        if c.groups.is_empty() {
            return None;
        }
        let used: Vec<&Group> = c.groups.iter().map(|g| &g.group).collect();
        if family_of(&used) != self.family {
            return None;
        }
        // Pipelined CFG: each device in one stage.
        if p.pipelined {
            let mut seen = std::collections::BTreeSet::new();
            if used
                .iter()
                .flat_map(|g| &g.devices)
                .any(|d| !seen.insert(d.clone()))
            {
                return None;
            }
        }
        let plan = unpriced(p.req, &c, self.family, "", 0.0);
        mold_cost::validate(&plan, &p.req.model, &p.req.machine).ok()?;
        let ev = mold_cost::evaluate(&plan, &p.req.model, &p.req.machine);
        let bytes = ev
            .devices
            .iter()
            .map(|d| d.peak)
            .fold(0u64, u64::saturating_add);
        let objective = p.objective(ev.request_s, bytes);
        objective
            .is_finite()
            .then(|| (p.overflow(&plan, &ev, self.family), objective))
    }

    /// The first point of a start: blocks shared by the groups' capacities, and the
    /// best of three guesses at what each keeps resident: what its capacity holds
    /// beside two stream buffers, everything, or (streaming allowed) nothing;
    /// components where there is most room (the host first).
    fn initial(&mut self, groups: &[usize]) -> Option<(Score, State)> {
        let total = self.total();
        let caps: Vec<u64> = groups.iter().map(|&g| self.capacity(g).max(1)).collect();
        let sum: u128 = caps.iter().map(|c| *c as u128).sum();
        let mut sizes: Vec<u32> = caps
            .iter()
            .map(|c| ((*c as u128 * total as u128) / sum.max(1)) as u32)
            .collect();
        let short = total - sizes.iter().sum::<u32>().min(total);
        if let Some(i) = (0..caps.len()).max_by_key(|&i| caps[i]) {
            sizes[i] += short;
        }
        let devs = &self.p.req.machine.devices;
        // Each component on the host where allowed, or on the device with most room.
        let place = |host: bool| -> Vec<usize> {
            let room = |id: &mold_plan::DeviceId| match devs.iter().position(|d| &d.id == id) {
                Some(d) => self.p.cap(d),
                None if host => u64::MAX,
                None => 0,
            };
            (self.p.components.iter())
                .map(|c| {
                    (0..c.options.len())
                        .max_by_key(|&i| room(&c.options[i].at))
                        .unwrap_or(0)
                })
                .collect()
        };
        let nk = self.p.counts.len();
        let all = State {
            groups: groups.to_vec(),
            sizes,
            resident: vec![vec![0; nk]; groups.len()],
            at: place(true),
        };
        let mut tries = Vec::new();
        let mut full = all.clone();
        for i in 0..groups.len() {
            full.resident[i] = self.kinds_of(&all, i);
        }
        tries.push(full);
        if self.p.stream {
            let mut share = all.clone();
            for (i, &g) in groups.iter().enumerate() {
                let blocks = self.kinds_of(&all, i);
                let costs = self.p.costs(&self.cands[g]);
                let buffer = costs.iter().map(|c| c.weight_bytes).max().unwrap_or(0);
                let mut left = (self.capacity(g) / self.cands[g].len() as u64)
                    .saturating_sub(self.p.stem)
                    .saturating_sub(self.p.buffers * buffer);
                for k in 0..nk {
                    let w = costs[k].weight_bytes.max(1);
                    let fit = (left / w).min(blocks[k] as u64) as u32;
                    share.resident[i][k] = fit;
                    left -= fit as u64 * w;
                }
            }
            tries.push(share);
            tries.push(all.clone());
        }
        let on_devices = place(false);
        if on_devices != all.at {
            let more: Vec<State> = (tries.iter())
                .map(|t| State {
                    at: on_devices.clone(),
                    ..t.clone()
                })
                .collect();
            tries.extend(more);
        }
        let mut best: Option<(Score, State)> = None;
        for t in tries {
            if let Some(sc) = self.score(&t) {
                if best.as_ref().is_none_or(|b| better(sc, b.0)) {
                    best = Some((sc, t));
                }
            }
        }
        best
    }

    /// Points one move away from `s`, larger steps first: a component moves, a group
    /// gives its place to another candidate of its kind, two neighbouring groups change
    /// places, a block boundary moves by
    /// `d` blocks (where streaming is allowed, those that cross stream on the group they
    /// join, or are resident there), a group keeps `d` blocks of a
    /// kind more or fewer resident, a group stops streaming (its neighbour streams
    /// what it did) or hands all its blocks to a neighbour.
    fn neighbours(&self, s: &State) -> Vec<State> {
        let mut out = Vec::new();
        for (ci, c) in self.p.components.iter().enumerate() {
            for oi in 0..c.options.len() {
                if oi != s.at[ci] {
                    let mut n = s.clone();
                    n.at[ci] = oi;
                    out.push(n);
                }
            }
        }
        // A group gives its place (and blocks) to another candidate of its kind (a single
        // device for a single device, a parallel group for a parallel group).
        for i in 0..s.groups.len() {
            let single = self.cands[s.groups[i]].len() == 1;
            for c in 0..self.cands.len() {
                if (self.cands[c].len() == 1) == single && !s.groups.contains(&c) {
                    let mut n = s.clone();
                    n.groups[i] = c;
                    out.push(n);
                }
            }
        }
        // Two neighbouring groups change places, each with its blocks.
        for i in 0..s.groups.len().saturating_sub(1) {
            let mut n = s.clone();
            n.groups.swap(i, i + 1);
            n.sizes.swap(i, i + 1);
            n.resident.swap(i, i + 1);
            out.push(n);
        }
        let total = self.total();
        let mut steps = vec![];
        let mut d = 1u32;
        while d <= total.div_ceil(2).max(1) {
            steps.push(d);
            d *= 2;
        }
        steps.reverse();
        let m = s.groups.len();
        let pairs: Vec<(usize, usize)> = (0..m.saturating_sub(1))
            .flat_map(|i| [(i, i + 1), (i + 1, i)])
            .collect();
        if self.p.stream {
            for &(from, to) in &pairs {
                let kept: u32 = (s.resident[from].iter())
                    .zip(self.kinds_of(s, from))
                    .map(|(r, n)| (*r).min(n))
                    .sum();
                // `from` keeps what it holds resident (one block at least) and stops
                // streaming: `to` streams the rest.
                let keep = kept.max(1);
                if s.sizes[from] > keep {
                    let mut n = s.clone();
                    n.sizes[to] += s.sizes[from] - keep;
                    n.sizes[from] = keep;
                    n.resident[from] = self.kinds_of(&n, from);
                    out.push(n);
                }
            }
        }
        for &(from, to) in &pairs {
            if s.sizes[from] > 0 {
                let mut n = s.clone();
                n.sizes[to] += n.sizes[from];
                n.sizes[from] = 0;
                out.push(n);
            }
        }
        for &d in &steps {
            for &(from, to) in &pairs {
                if s.sizes[from] >= d {
                    let mut n = s.clone();
                    n.sizes[from] -= d;
                    n.sizes[to] += d;
                    if self.p.stream {
                        // The blocks that cross may arrive resident, too.
                        let mut r = n.clone();
                        let (before, after) = (self.kinds_of(s, to), self.kinds_of(&n, to));
                        for k in 0..after.len() {
                            r.resident[to][k] =
                                s.resident[to][k].min(before[k]) + after[k] - before[k];
                        }
                        out.push(n);
                        out.push(r);
                    } else {
                        out.push(n);
                    }
                }
            }
            if self.p.stream {
                for i in 0..m {
                    let blocks = self.kinds_of(s, i);
                    for (k, &n_k) in blocks.iter().enumerate() {
                        let have = s.resident[i][k].min(n_k);
                        if have + d <= n_k {
                            let mut n = s.clone();
                            n.resident[i][k] = have + d;
                            out.push(n);
                        }
                        if have >= d {
                            let mut n = s.clone();
                            n.resident[i][k] = have - d;
                            out.push(n);
                        }
                    }
                }
            }
        }
        out
    }

    /// Takes the first move that improves, until none does or the plans priced reach
    /// `bound`.
    fn descend(&mut self, (mut score, mut state): (Score, State), bound: usize) -> (Score, State) {
        'descend: loop {
            for n in self.neighbours(&state) {
                if self.spent(bound) {
                    break 'descend;
                }
                if let Some(sc) = self.score(&n) {
                    if better(sc, score) {
                        (score, state) = (sc, n);
                        continue 'descend;
                    }
                }
            }
            break;
        }
        (score, state)
    }

    /// Descends; then, from the local optimum, takes each move in turn even where it
    /// does worse and descends a little from there ([`KICK_PRICED`] plans), keeping the
    /// first that ends better; until none does or the plans priced reach their bound.
    fn climb(&mut self, start: (Score, State)) -> (Score, State) {
        let mut at = self.descend(start, usize::MAX);
        'kick: loop {
            for n in self.neighbours(&at.1) {
                if self.spent(usize::MAX) {
                    break 'kick;
                }
                let Some(sc) = self.score(&n) else { continue };
                let bound = self.priced + KICK_PRICED;
                let found = self.descend((sc, n), bound);
                if better(found.0, at.0) {
                    at = self.descend(found, usize::MAX);
                    continue 'kick;
                }
            }
            break;
        }
        at
    }
}

/// Fewer bytes over budget, then a lower objective (by more than round-off).
fn better(a: Score, b: Score) -> bool {
    a.0 < b.0 || (a.0 == b.0 && a.1 < b.1 - 1e-12 * b.1.abs())
}
