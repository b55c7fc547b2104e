//! One strategy family, searched within its time limit: the integer program first; where
//! it gives no plan (the solver failed, or its time ran out first), the exhaustive
//! enumerator on an instance small enough to walk, else a bounded local search
//! (`local.rs`), so a solver's failure never leaves a family without a plan that a search
//! can find. Every answer is priced exactly (`mold_cost::evaluate` on the plan it makes)
//! and checked against the budgets in bytes before it counts.

use crate::brute::{self, Space};
use crate::ilp::{self, Failure, Solved};
use crate::layout::unpriced;
use crate::local;
use crate::problem::{family_of, Choice, Problem};
use crate::{Family, Request};
use std::cell::RefCell;
use std::time::{Duration, Instant};

/// Instances whose enumeration walks at most this many block splits × placements (a
/// bound: contiguity and budgets prune most) are small enough for the exhaustive
/// enumerator: flux-tiny on four devices, in about a second.
const BRUTE_LIMIT: f64 = 2e7;

/// How a family's answer was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// The integer program (microlp).
    Solver,
    /// The exhaustive enumerator, after the solver gave no plan.
    Exhaustive,
    /// The local search, after the solver gave no plan on an instance too large to
    /// enumerate: its plan fits, but is not proven the family's best.
    #[serde(rename = "local-search")]
    LocalSearch,
}

/// The outcome of one family's search.
#[derive(Clone, Debug)]
pub struct FamilySolution {
    /// The best plan found, priced exactly; `None` when no plan was found.
    pub choice: Option<Choice>,
    /// Whether `choice` is proven the family's best (or, without a choice, that no plan
    /// of the family fits).
    pub proven: bool,
    pub method: Method,
    /// Why the search fell short, when it did (the solver's error, the time limit).
    pub trouble: Option<String>,
}

/// Searches `family` within `limit`; with `None`, every family in turn, for the best of
/// all, each within an equal share of what is left of `limit`: the time an easy family
/// does not use goes to the families after it (the mixed family, the hardest, is last).
pub fn solve_family(req: &Request, family: Option<Family>, limit: Duration) -> FamilySolution {
    let Some(family) = family else {
        let start = Instant::now();
        let mut all: Vec<FamilySolution> = Vec::with_capacity(Family::ALL.len());
        for (i, f) in Family::ALL.into_iter().enumerate() {
            let left = limit.saturating_sub(start.elapsed());
            let share = left / (Family::ALL.len() - i) as u32;
            all.push(solve_family(req, Some(f), share));
        }
        let proven = all.iter().all(|s| s.proven);
        let trouble = all
            .iter()
            .zip(Family::ALL)
            .filter_map(|(s, f)| s.trouble.as_ref().map(|t| format!("{}: {t}", f.name())))
            .collect::<Vec<_>>();
        let best = all
            .iter_mut()
            .filter(|s| s.choice.is_some())
            .min_by(|a, b| {
                let o =
                    |s: &FamilySolution| s.choice.as_ref().map_or(f64::INFINITY, |c| c.objective);
                o(a).total_cmp(&o(b))
            });
        let (choice, method) = match best {
            Some(s) => (s.choice.take(), s.method),
            None => (None, Method::Solver),
        };
        return FamilySolution {
            choice,
            proven,
            method,
            trouble: (!trouble.is_empty()).then(|| trouble.join("; ")),
        };
    };
    let p = Problem::new(req);
    let price = |c: &Choice| price(&p, c);
    let failure = match injected(family) {
        Some(e) => Failure::Solver(e),
        None => match ilp::solve(&p, family, limit, &price) {
            Ok(Solved::Infeasible) => {
                return FamilySolution {
                    choice: None,
                    proven: true,
                    method: Method::Solver,
                    trouble: None,
                }
            }
            Ok(Solved::Plan { choice, proven }) => {
                return FamilySolution {
                    choice: Some(choice),
                    proven,
                    method: Method::Solver,
                    trouble: (!proven).then(|| {
                        format!(
                            "best found within the {} time limit, not proven optimal",
                            secs(limit)
                        )
                    }),
                }
            }
            Err(f) => f,
        },
    };
    let trouble = match &failure {
        Failure::TimeLimit => format!("no plan found within the {} time limit", secs(limit)),
        Failure::Solver(e) => format!("solver failed: {e}"),
    };
    // Where the enumeration is small, it answers instead, exactly.
    if brute::size(req, Space::Aligned) <= BRUTE_LIMIT {
        let (best, _) = brute::best(req, Some(family), Space::Aligned);
        let choice = best.and_then(|c| price(&c).map(|objective| Choice { objective, ..c }));
        return FamilySolution {
            choice,
            proven: true,
            method: Method::Exhaustive,
            trouble: Some(trouble),
        };
    }
    // Else a local search: a plan that fits, not proven the best. (With no plan found
    // it proves nothing either: one may still fit.)
    // It may take the family's time limit again, a fifth of a second at least.
    let choice = local::best(req, family, limit.max(Duration::from_millis(200)));
    FamilySolution {
        method: if choice.is_some() {
            Method::LocalSearch
        } else {
            Method::Solver
        },
        choice,
        proven: false,
        trouble: Some(trouble),
    }
}

thread_local! {
    /// Families whose integer program fails on this thread, and the solver's error
    /// ([`with_solver_failing`]).
    static FAILING: RefCell<Option<(Vec<Family>, String)>> = const { RefCell::new(None) };
}

/// The error the integer program fails with on `family`, where a test made it fail.
fn injected(family: Family) -> Option<String> {
    FAILING.with(|f| {
        (f.borrow().as_ref())
            .filter(|(families, _)| families.contains(&family))
            .map(|(_, e)| e.clone())
    })
}

/// Runs `f` with the integer program failing with `error` on `families`, on this thread:
/// the tests of what stands in for a failed solver reproduce a failure (microlp 0.6's
/// "Singular matrix", say) on the instance where it happened, whatever today's solver
/// makes of it. For tests only.
#[doc(hidden)]
pub fn with_solver_failing<R>(families: &[Family], error: &str, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(Vec<Family>, String)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FAILING.with(|f| *f.borrow_mut() = self.0.take());
        }
    }
    let before = FAILING.with(|f| f.replace(Some((families.to_vec(), error.to_string()))));
    let _restore = Restore(before);
    f()
}

/// The exact objective of a choice, from `mold_cost::evaluate` on the plan it makes, or
/// `None` when that plan breaks a budget (with the transfer reserves) by any byte.
pub(crate) fn price(p: &Problem, c: &Choice) -> Option<f64> {
    if c.groups.is_empty() {
        return None;
    }
    let family = family_of(&c.groups.iter().map(|g| &g.group).collect::<Vec<_>>());
    let plan = unpriced(p.req, c, family, "", 0.0);
    mold_cost::validate(&plan, &p.req.model, &p.req.machine).ok()?;
    let ev = mold_cost::evaluate(&plan, &p.req.model, &p.req.machine);
    if !p.fits(&plan, &ev, family) {
        return None;
    }
    let bytes = ev
        .devices
        .iter()
        .map(|d| d.peak)
        .fold(0u64, u64::saturating_add);
    Some(p.objective(ev.request_s, bytes))
}

pub(crate) fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.1} s")
    } else {
        format!("{:.0} ms", s * 1e3)
    }
}
