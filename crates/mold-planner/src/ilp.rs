//! The integer program: the problem (`problem.rs`) over the candidate groups
//! (`candidates.rs`), written with good_lp's algebra and solved by the pure-Rust microlp
//! (`lp.rs`).
//!
//! For each candidate group g and block kind k:
//!   nr[g,k], ns[g,k] ∈ 0..=count_k   resident / streamed blocks of kind k on g
//!   u[g,k] ∈ {0,1}                    g runs some kind-k block   (u ≤ nr+ns ≤ count·u)
//!   s[g,k] ∈ {0,1}                    g streams some kind-k block (s ≤ ns ≤ count·s)
//!   used[g] ∈ {0,1}                   g runs some block
//!   buf[g] ≥ buffers · bytes(g,k) · s[g,k]     stream buffers on each device of g
//!   fill[g] ≥ min(copy, compute)(g,k) · s[g,k]  pipeline fill of g's streaming
//! Contiguity: the kinds a group runs form an interval, at most one group straddles each
//! boundary between kinds (a[j,g] ≥ u[g,j] + u[g,j+1] − 1, Σ_g a[j,g] ≤ 1), and a group
//! spanning three kinds runs all of the middle one. Given that, the groups can always be
//! ordered so each runs one contiguous range (`layout.rs` does it).
//! Per device d: components' weights + resident blocks + buffers + stem (if d runs any
//! transformer part) + the largest activation A[d] + the transfer reserves + headroom ≤
//! budget less the CUDA libraries' measured memory (`Problem::cap`). Host: streamed
//! weights ≤ pinned limit; host components + pinned ≤ host memory.
//!   t[g,k] ≥ compute(g,k) · (nr+ns), t[g,k] ≥ copy(g,k) · ns   kind k's time on g
//! Memory phases one-shot: per device, the encode phase (encoders' weights + their
//! largest activation), the denoise phase (the transformer's bytes + its largest
//! activation + the transfer reserve) and the decode phase (the VAE's weights,
//! activation and latents) each within the budget, `peak[d]` the largest of them.
//! Objective (latency): Σ component times + steps · (Σ t + Σ fill + Σ gather(g) ·
//! used[g] + hand-offs · (groups used − 1)), steps doubled under serial true CFG; under
//! pipelined CFG plus a bottleneck b ≥ time(g) + hand-off · hands[g] for every group,
//! b ≥ one hand-off, with each device in at most one used group (each group a stage) —
//! `mold_cost::evaluate`'s request time, term for term (a group's blocks are one run of
//! parts, so a sequence-parallel group's closing all-gather is paid once when it is
//! used). A stage makes its own hand-off before it takes the next micro-batch, so
//! hands[g] is 1 for every used group but the last in `layout.rs`'s order (by first
//! kind, last kind, then `Group`'s order), with K the last kind that has blocks:
//!   only[g] ≤ u[g,K], only[g] ≤ 1 − u[g,k] (k < K), only[g] ≥ u[g,K] − Σ_{k<K} u[g,k]
//!     (g runs kind K only; a group running K and an earlier kind straddles into K and
//!     comes before those)
//!   hands[g] ≥ used[g] − u[g,K]            (g runs no block of K: a later group does)
//!   after[i] ≥ only[order i], after[i] ≥ after[i+1]   (groups in `Group`'s order)
//!   hands[order i] ≥ after[i+1]            (a group of K only follows it)
//!   hands[g] ≥ after[0] − only[g]          (g straddles into K, a group of K only follows)
//! No big-M is needed: an unused group's hands[g] may be forced to 1, giving b ≥ one
//! hand-off, which holds anyway.
//!
//! Units: bytes are counted in the instance's largest memory coefficient and seconds in
//! its largest time coefficient of a constraint, so every constraint's coefficient is at
//! most 1 whatever the model's size (GiB and seconds made coefficients of 1e-6 on small
//! models, beside the binaries' 1, and the solver's factorisation failed with "Singular
//! matrix").

use crate::candidates::candidate_groups;
use crate::lp::{Model, Outcome};
use crate::problem::{Choice, GroupChoice, Problem, MEMORY_LATENCY_WEIGHT};
use crate::{Family, Objective};
use good_lp::{constraint, Expression, Solution, Variable};
use mold_plan::{DeviceId, MemoryPhases, GIB};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What one solve came to.
#[derive(Clone, Debug)]
pub(crate) enum Solved {
    /// No plan of the family fits.
    Infeasible,
    /// A plan; `proven` when the solver proved it optimal within the time limit.
    Plan { choice: Choice, proven: bool },
}

/// Why a solve gave no answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Failure {
    /// The time limit passed before any plan was found.
    TimeLimit,
    /// The solver failed (numerically, say).
    Solver(String),
}

/// Solves the program restricted to `family` within `limit`; `price`
/// gives a choice's exact objective, or `None` when it breaks a budget (the solver
/// meets its constraints only to tolerances).
///
/// Ties (identical devices, say) are broken by a second solve, in what is left of the
/// time, that keeps the optimum and prefers fewer device groups and lower device
/// indices, so equal machines get the plan a person would write (`cuda:0` before
/// `cuda:3`); then of the plans that cost the same, the one that streams least
/// ([`stream_least`]).
pub(crate) fn solve(
    p: &Problem,
    family: Family,
    limit: Duration,
    price: &dyn Fn(&Choice) -> Option<f64>,
) -> Result<Solved, Failure> {
    let start = Instant::now();
    let (first, proven) = match solve_with(p, family, None, limit)? {
        Solved::Plan { choice, proven } => (choice, proven),
        Solved::Infeasible => return Ok(Solved::Infeasible),
    };
    let Some(exact) = price(&first) else {
        return Err(Failure::Solver(
            "its answer breaks a budget once rounded to whole blocks and bytes".into(),
        ));
    };
    let left = limit.saturating_sub(start.elapsed());
    let first_priced = Choice {
        objective: exact,
        ..first.clone()
    };
    if !proven || left < Duration::from_millis(20) {
        return Ok(Solved::Plan {
            choice: stream_least(first_priced, price),
            proven,
        });
    }
    // The second solve is a nicety: if the solver trips on it, runs out of time, or its
    // answer costs measurably more than the first (beyond 1e-7 relative), the first
    // answer stands.
    let tidy = match solve_with(p, family, Some(first.objective), left) {
        Ok(Solved::Plan { choice: t, .. }) => price(&t)
            .filter(|v| *v <= exact + 1e-7 * exact.abs())
            .map(|v| Choice { objective: v, ..t }),
        _ => None,
    };
    Ok(Solved::Plan {
        choice: stream_least(tidy.unwrap_or(first_priced), price),
        proven,
    })
}

/// `c` with its streamed blocks made resident, one at a time, wherever that fits and
/// costs no more (beyond 1e-9 relative). Where copies hide behind compute, streaming
/// more blocks costs no time, and which of those equal plans the solver returns was its
/// chance (microlp 0.7 streamed 27 of flux-dev's blocks on one RTX 4090 where 3 do):
/// of them, the one that streams least, with the least pinned memory and copy traffic.
fn stream_least(mut c: Choice, price: &dyn Fn(&Choice) -> Option<f64>) -> Choice {
    let bound = c.objective + 1e-9 * c.objective.abs();
    for g in 0..c.groups.len() {
        for k in 0..c.groups[g].streamed.len() {
            while c.groups[g].streamed[k] > 0 {
                let mut t = c.clone();
                t.groups[g].streamed[k] -= 1;
                t.groups[g].resident[k] += 1;
                match price(&t) {
                    Some(v) if v <= bound => c = Choice { objective: v, ..t },
                    _ => break,
                }
            }
        }
    }
    c
}

fn sum<I: IntoIterator<Item = Expression>>(it: I) -> Expression {
    it.into_iter().fold(Expression::from(0.0), |a, b| a + b)
}

/// One solve: minimise the objective, or (with `optimum`, in the objective's scaled
/// units) the tie-break among plans within it.
fn solve_with(
    p: &Problem,
    family: Family,
    optimum: Option<f64>,
    limit: Duration,
) -> Result<Solved, Failure> {
    let req = p.req;
    if !p.family_allowed(family) {
        return Ok(Solved::Infeasible);
    }
    let groups = candidate_groups(p);
    let single: Vec<bool> = groups.iter().map(|g| g.len() == 1).collect();
    // The one-group family each parallel group belongs to (Single for one device).
    let layout: Vec<Family> = groups
        .iter()
        .map(|g| Family::of_layout(g.tp, g.sp))
        .collect();
    match family {
        Family::Single | Family::Split if !single.iter().any(|s| *s) => {
            return Ok(Solved::Infeasible)
        }
        Family::Mixed if single.iter().all(|s| *s) => return Ok(Solved::Infeasible),
        Family::Tensor | Family::Sequence | Family::Hybrid if !layout.contains(&family) => {
            return Ok(Solved::Infeasible)
        }
        _ => {}
    }
    let nk = p.counts.len();
    let counts: Vec<f64> = p.counts.iter().map(|c| *c as f64).collect();
    let bc: Vec<Vec<mold_cost::BlockCost>> = groups.iter().map(|g| p.costs(g)).collect();
    let gather: Vec<f64> = groups.iter().map(|g| p.gather_s(g)).collect();
    let comps = &p.components;
    let devs = &req.machine.devices;
    let reserve = p.transformer_reserve(family);

    // Units: the largest memory and time coefficients.
    let mut mu: f64 = 1.0;
    let mut tu: f64 = 0.0;
    for c in bc.iter().flatten() {
        mu = mu
            .max(c.weight_bytes as f64 * p.buffers as f64)
            .max(c.activation_bytes as f64);
        tu = tu.max(c.resident_s()).max(c.copy_s);
    }
    // Components' seconds are objective coefficients only, so they leave the time unit
    // alone: a text encoder run on the host (17 s) made block times coefficients of 1e-4.
    for c in comps {
        for o in &c.options {
            mu = mu.max(o.weight_bytes as f64).max(o.activation_bytes as f64);
        }
    }
    mu = mu
        .max(p.stem as f64)
        .max(reserve as f64)
        .max(p.vae_reserve() as f64);
    tu = tu.max(p.handoff_s);
    for g in &gather {
        tu = tu.max(*g);
    }
    if !(tu > 0.0 && tu.is_finite()) {
        tu = 1.0;
    }
    let mem = |b: u64| b as f64 / mu;
    let sec = |s: f64| s / tu;

    let mut lp = Model::new();
    let mut nr = vec![vec![]; groups.len()];
    let mut ns: Vec<Vec<Option<Variable>>> = vec![vec![]; groups.len()];
    let mut u = vec![vec![]; groups.len()];
    let mut s: Vec<Vec<Option<Variable>>> = vec![vec![]; groups.len()];
    for g in 0..groups.len() {
        for c in &counts {
            nr[g].push(lp.integer(*c));
            ns[g].push(p.stream.then(|| lp.integer(*c)));
            u[g].push(lp.binary());
            s[g].push(p.stream.then(|| lp.binary()));
        }
    }
    let used: Vec<Variable> = groups.iter().map(|_| lp.binary()).collect();
    let buf: Vec<Variable> = groups.iter().map(|_| lp.real(0.0, f64::INFINITY)).collect();
    let fill: Vec<Variable> = groups.iter().map(|_| lp.real(0.0, f64::INFINITY)).collect();
    let straddle: Vec<Vec<Variable>> = (0..nk.saturating_sub(1))
        .map(|_| groups.iter().map(|_| lp.binary()).collect())
        .collect();
    let act: Vec<Variable> = devs.iter().map(|_| lp.real(0.0, f64::INFINITY)).collect();
    let ud: Vec<Variable> = devs.iter().map(|_| lp.binary()).collect();
    let x: Vec<Vec<Variable>> = comps
        .iter()
        .map(|c| c.options.iter().map(|_| lp.binary()).collect())
        .collect();
    // Kind k on group g: max(compute of all its blocks, copies of the streamed ones
    // slowed by the compute beside them) (`BlockCost::group_kind_s`), as t[g][k] ≥ both.
    let t: Vec<Vec<Option<Variable>>> = (0..groups.len())
        .map(|g| {
            (0..nk)
                .map(|k| ns[g][k].map(|_| lp.real(0.0, f64::INFINITY)))
                .collect()
        })
        .collect();

    let blocks_of = |g: usize, k: usize| -> Expression {
        let mut e: Expression = nr[g][k].into();
        if let Some(v) = ns[g][k] {
            e += v;
        }
        e
    };

    // Objective pieces, in time units.
    let mut comp_time = Expression::from(0.0);
    for (ci, c) in comps.iter().enumerate() {
        for (oi, o) in c.options.iter().enumerate() {
            comp_time += sec(o.seconds) * x[ci][oi];
        }
    }
    let handoff = sec(p.handoff_s);
    let mut step = Expression::from(-handoff);
    // Each group's time in a pass: under pipelined CFG, a stage.
    let mut stages: Vec<Expression> = Vec::new();
    for g in 0..groups.len() {
        let mut stage = Expression::from(0.0);
        for k in 0..nk {
            match t[g][k] {
                Some(tv) => stage += tv,
                None => stage += sec(bc[g][k].resident_s()) * nr[g][k],
            }
        }
        stage += fill[g];
        stage += sec(gather[g]) * used[g];
        step += stage.clone();
        step += handoff * used[g];
        stages.push(stage);
    }
    // Pipelined CFG: the second micro-batch ends one bottleneck after the first: the
    // largest of every stage's time plus the hand-off it makes, the last stage's time
    // alone (`mold_cost::pipelined_bottleneck`). At least one hand-off, since a
    // pipeline has two stages or more.
    let bottleneck = p.pipelined.then(|| lp.real(handoff, f64::INFINITY));
    if let Some(b) = bottleneck {
        step += b;
    }
    // Pipelined CFG: which groups hand off, i.e. every used group but the last in
    // `layout.rs`'s order (by the first kind a group runs, then its last kind, then the
    // group itself). Continuous in [0, 1], each exact once the u are whole:
    //   only[g]   g runs blocks of the last kind only
    //   after[i]  some group at or after position i of `Group`'s order does
    //   hands[g]  some used group comes after g (g's stage makes a hand-off)
    let pipe = bottleneck.map(|_| {
        let mut unit = || -> Vec<Variable> { groups.iter().map(|_| lp.real(0.0, 1.0)).collect() };
        (unit(), unit(), unit())
    });
    let latency = comp_time + p.steps * step;

    // Per-device memory (memory units), reused by the memory objective: resident, every
    // component's weights and the largest activation of all (`act`); one-shot, the
    // largest of the encode phase (`enc_act`: the encoders' largest activation), the
    // denoise phase (`act`: the transformer's) and the decode phase (`peak`).
    let one_shot = p.phases == MemoryPhases::OneShot;
    let enc_act: Vec<Variable> = devs.iter().map(|_| lp.real(0.0, f64::INFINITY)).collect();
    let peak: Vec<Variable> = devs.iter().map(|_| lp.real(0.0, f64::INFINITY)).collect();
    let mut dev_mem: Vec<Expression> = Vec::new();
    let mut encode_mem: Vec<Expression> = Vec::new();
    let mut decode_mem: Vec<Expression> = Vec::new();
    let mut denoise_mem: Vec<Expression> = Vec::new();
    for (di, d) in devs.iter().enumerate() {
        let (mut enc, mut dec, mut den) = (
            Expression::from(0.0),
            Expression::from(0.0),
            Expression::from(0.0),
        );
        for (ci, c) in comps.iter().enumerate() {
            for (oi, o) in c.options.iter().enumerate() {
                if o.at == d.id {
                    if c.is_vae {
                        dec += mem(o.weight_bytes + o.activation_bytes) * x[ci][oi];
                    } else {
                        enc += mem(o.weight_bytes) * x[ci][oi];
                    }
                }
            }
        }
        enc += enc_act[di];
        for (g, grp) in groups.iter().enumerate() {
            if grp.devices.contains(&d.id) {
                for k in 0..nk {
                    den += mem(bc[g][k].weight_bytes) * nr[g][k];
                }
                den += buf[g];
            }
        }
        den += mem(p.stem) * ud[di];
        den += act[di];
        let e = if one_shot {
            Expression::from(peak[di])
        } else {
            // Resident: `act` is the largest activation of all; the encoders' and the
            // VAE's weights count beside the transformer's.
            let mut e = den.clone();
            for (ci, c) in comps.iter().enumerate() {
                for (oi, o) in c.options.iter().enumerate() {
                    if o.at == d.id {
                        e += mem(o.weight_bytes) * x[ci][oi];
                    }
                }
            }
            e
        };
        dev_mem.push(e);
        encode_mem.push(enc);
        decode_mem.push(dec);
        denoise_mem.push(den);
    }

    let objective = match req.objective {
        // Throughput compares whole plans of each replica width (`throughput.rs`): each
        // of them is the latency optimum on its devices.
        Objective::Latency | Objective::Throughput => latency.clone(),
        // GiB + weight · seconds, divided by (memory unit in GiB).
        Objective::Memory => {
            sum(dev_mem.iter().cloned())
                + (MEMORY_LATENCY_WEIGHT * tu * GIB as f64 / mu) * latency.clone()
        }
    };
    // The tie-break: a group or placement costs 1 + the indices of its devices (the host
    // counts as the last).
    let index = |id: &DeviceId| devs.iter().position(|d| &d.id == id).unwrap_or(devs.len()) as f64;
    let mut tiebreak = Expression::from(0.0);
    for (g, grp) in groups.iter().enumerate() {
        tiebreak += (1.0 + grp.devices.iter().map(index).sum::<f64>()) * used[g];
    }
    for (ci, c) in comps.iter().enumerate() {
        for (oi, o) in c.options.iter().enumerate() {
            tiebreak += (1.0 + index(&o.at)) * x[ci][oi];
        }
    }

    for (k, c) in counts.iter().enumerate() {
        lp.with(constraint!(
            sum((0..groups.len()).map(|g| blocks_of(g, k))) == *c
        ));
    }
    for g in 0..groups.len() {
        for k in 0..nk {
            lp.with(constraint!(blocks_of(g, k) <= counts[k] * u[g][k]));
            lp.with(constraint!(u[g][k] <= blocks_of(g, k)));
            lp.with(constraint!(used[g] >= u[g][k]));
            if let (Some(sv), Some(nv), Some(tv)) = (s[g][k], ns[g][k], t[g][k]) {
                let b = &bc[g][k];
                lp.with(constraint!(tv >= sec(b.resident_s()) * (nr[g][k] + nv)));
                // Copies, and what the compute beside them (every block's but one
                // streamed block's, `sv` being 1 when any is) takes from their rate.
                let slowed = sec(b.copy_contention * b.resident_s());
                lp.with(constraint!(
                    tv >= sec(b.copy_s) * nv + slowed * (nr[g][k] + nv) - slowed * sv
                ));
                lp.with(constraint!(nv <= counts[k] * sv));
                lp.with(constraint!(sv <= nv));
                lp.with(constraint!(buf[g] >= mem(p.buffers * b.weight_bytes) * sv));
                lp.with(constraint!(fill[g] >= sec(b.fill_s()) * sv));
            }
        }
        lp.with(constraint!(
            used[g] <= sum(u[g].iter().map(|v| Expression::from(*v)))
        ));
        for j in 0..nk.saturating_sub(1) {
            lp.with(constraint!(straddle[j][g] >= u[g][j] + u[g][j + 1] - 1.0));
        }
        for i in 0..nk {
            for m in i + 1..nk {
                for l in m + 1..nk {
                    lp.with(constraint!(u[g][m] >= u[g][i] + u[g][l] - 1.0));
                    lp.with(constraint!(
                        blocks_of(g, m) >= counts[m] * (u[g][i] + u[g][l] - 1.0)
                    ));
                }
            }
        }
    }
    for row in &straddle {
        lp.with(constraint!(
            sum(row.iter().map(|v| Expression::from(*v))) <= 1.0
        ));
    }
    for (di, d) in devs.iter().enumerate() {
        for (g, grp) in groups.iter().enumerate() {
            if grp.devices.contains(&d.id) {
                lp.with(constraint!(ud[di] >= used[g]));
                for k in 0..nk {
                    lp.with(constraint!(
                        act[di] >= mem(bc[g][k].activation_bytes) * u[g][k]
                    ));
                }
            }
        }
        let mut reserved = mem(reserve) * ud[di];
        let mut vae_reserved = Expression::from(0.0);
        for (ci, c) in comps.iter().enumerate() {
            for (oi, o) in c.options.iter().enumerate() {
                if o.at == d.id {
                    if !one_shot {
                        lp.with(constraint!(act[di] >= mem(o.activation_bytes) * x[ci][oi]));
                    } else if !c.is_vae {
                        lp.with(constraint!(
                            enc_act[di] >= mem(o.activation_bytes) * x[ci][oi]
                        ));
                    }
                    if c.is_vae {
                        vae_reserved += mem(p.vae_reserve()) * x[ci][oi];
                    }
                }
            }
        }
        let cap = mem(p.cap(di));
        if one_shot {
            for phase in [&encode_mem[di], &denoise_mem[di], &decode_mem[di]] {
                lp.with(constraint!(peak[di] >= phase.clone()));
            }
            lp.with(constraint!(encode_mem[di].clone() <= cap));
            lp.with(constraint!(denoise_mem[di].clone() + reserved <= cap));
            lp.with(constraint!(decode_mem[di].clone() + vae_reserved <= cap));
        } else {
            reserved += vae_reserved;
            lp.with(constraint!(dev_mem[di].clone() + reserved <= cap));
        }
    }
    // Pipelined CFG: each device in one stage; the bottleneck over every stage, plus a
    // hand-off for each but the last.
    if let (Some(b), Some((only, after, hands))) = (bottleneck, &pipe) {
        for (g, stage) in stages.iter().enumerate() {
            lp.with(constraint!(b >= stage.clone() + handoff * hands[g]));
        }
        // The last kind that has blocks: the last stage runs some of it.
        if let Some(last) = (0..nk).rev().find(|&k| counts[k] > 0.0) {
            for g in 0..groups.len() {
                let earlier = sum(u[g][..last].iter().map(|v| Expression::from(*v)));
                lp.with(constraint!(only[g] <= u[g][last]));
                for v in &u[g][..last] {
                    lp.with(constraint!(only[g] <= 1.0 - *v));
                }
                lp.with(constraint!(only[g] >= u[g][last] - earlier));
                // A group without blocks of the last kind comes before one with them.
                lp.with(constraint!(hands[g] >= used[g] - u[g][last]));
            }
            // Groups of the last kind only come after every other group, in `Group`'s
            // order among themselves.
            let mut order: Vec<usize> = (0..groups.len()).collect();
            order.sort_by(|a, c| groups[*a].cmp(&groups[*c]));
            for (i, &g) in order.iter().enumerate() {
                lp.with(constraint!(after[i] >= only[g]));
                if i + 1 < order.len() {
                    lp.with(constraint!(after[i] >= after[i + 1]));
                    // A group of the last kind only follows g in `Group`'s order.
                    lp.with(constraint!(hands[g] >= after[i + 1]));
                }
                // g runs an earlier kind too, and some group runs the last kind only.
                lp.with(constraint!(hands[g] >= after[0] - only[g]));
            }
        }
        for d in devs {
            let on = groups
                .iter()
                .enumerate()
                .filter(|(_, grp)| grp.devices.contains(&d.id))
                .map(|(g, _)| Expression::from(used[g]));
            lp.with(constraint!(sum(on) <= 1.0));
        }
    }
    let mut pinned = Expression::from(0.0);
    for (g, grp) in groups.iter().enumerate() {
        for k in 0..nk {
            if let Some(v) = ns[g][k] {
                pinned += mem(bc[g][k].weight_bytes) * grp.len() as f64 * v;
            }
        }
    }
    lp.with(constraint!(
        pinned.clone() <= mem(req.machine.host.pinned_limit.0)
    ));
    let mut host = pinned;
    for (ci, c) in comps.iter().enumerate() {
        lp.with(constraint!(
            sum(x[ci].iter().map(|v| Expression::from(*v))) == 1.0
        ));
        for (oi, o) in c.options.iter().enumerate() {
            if o.at.is_host() {
                host += mem(o.weight_bytes + o.activation_bytes) * x[ci][oi];
            }
        }
    }
    lp.with(constraint!(host <= mem(req.machine.host.memory.0)));

    let used_where = |pred: &dyn Fn(usize) -> bool| {
        sum((0..groups.len())
            .filter(|g| pred(*g))
            .map(|g| Expression::from(used[g])))
    };
    match family {
        Family::Single => {
            lp.with(constraint!(used_where(&|g| single[g]) == 1.0));
            lp.with(constraint!(used_where(&|g| !single[g]) == 0.0));
        }
        Family::Split => {
            lp.with(constraint!(used_where(&|g| single[g]) >= 2.0));
            lp.with(constraint!(used_where(&|g| !single[g]) == 0.0));
        }
        Family::Tensor | Family::Sequence | Family::Hybrid => {
            lp.with(constraint!(used_where(&|g| layout[g] == family) == 1.0));
            lp.with(constraint!(used_where(&|g| layout[g] != family) == 0.0));
        }
        Family::Mixed => {
            lp.with(constraint!(used_where(&|g| !single[g]) >= 1.0));
            lp.with(constraint!(used_where(&|_| true) >= 2.0));
        }
    }

    let outcome = match optimum {
        None => lp.minimise(&objective, None, limit),
        Some(v) => lp.minimise(
            &tiebreak,
            Some(&constraint!(
                objective.clone() <= v + 1e-8 * v.abs().max(1e-6)
            )),
            limit,
        ),
    };
    let (sol, proven) = match outcome {
        Outcome::Solved { values, proven } => (values, proven),
        Outcome::Infeasible => return Ok(Solved::Infeasible),
        Outcome::TimeLimit => return Err(Failure::TimeLimit),
        Outcome::Failed(e) => return Err(Failure::Solver(e)),
    };
    let round = |v: Variable| sol.value(v).round().max(0.0) as u32;
    let mut chosen = Vec::new();
    for g in 0..groups.len() {
        let resident: Vec<u32> = (0..nk).map(|k| round(nr[g][k])).collect();
        let streamed: Vec<u32> = (0..nk).map(|k| ns[g][k].map(round).unwrap_or(0)).collect();
        if resident.iter().chain(streamed.iter()).any(|n| *n > 0) {
            chosen.push(GroupChoice {
                group: groups[g].clone(),
                resident,
                streamed,
            });
        }
    }
    let mut placement = BTreeMap::new();
    for (ci, c) in comps.iter().enumerate() {
        let Some(oi) = (0..c.options.len())
            .max_by(|a, b| sol.value(x[ci][*a]).total_cmp(&sol.value(x[ci][*b])))
        else {
            return Err(Failure::Solver(format!("{} has no allowed place", c.name)));
        };
        placement.insert(c.name.clone(), c.options[oi].at.clone());
    }
    Ok(Solved::Plan {
        choice: Choice {
            groups: chosen,
            placement,
            // In the program's units; `crate::plan` prices the choice exactly.
            objective: sol.eval(&objective),
        },
        proven,
    })
}
