//! The integer program as data: variables with their bounds, and constraints and the
//! objective written in good_lp's algebra (`Expression`, `constraint!`), handed to
//! microlp 0.7 here.
//!
//! good_lp 1.15 drives microlp 0.6, whose dual simplex accepts pivots down to 1e-10 and
//! on some instances ends on a basis it cannot factorise ("Singular matrix"): qwen-image
//! on two 8 GiB GPUs over PCIe lost its mixed family, the best plan there, to it, and
//! where no family fits `mold plan` ended in "the solver failed" instead of "no plan
//! fits". microlp 0.7 (presolve, scaling, an answer checked against the program or an
//! error) solves those instances; good_lp does not drive it yet. A few instances still
//! end on a pivot of 1e-31 (flux-dev on a 24 GiB and an 8 GiB GPU without peer links,
//! `tests/data/24gib-8gib-no-peer.yaml`); a failure is retried once on the program with
//! every row and the objective scaled to a largest coefficient of 1, which solves them.

use good_lp::{Constraint, Expression, IntoAffineExpression, ProblemVariables, Variable};
use microlp::{ComparisonOp, OptimizationDirection, SolutionStatus, SolveOptions};
use std::collections::HashMap;
use std::time::Duration;

/// A variable's domain and bounds.
#[derive(Clone, Copy, Debug)]
enum Domain {
    /// An integer in `0..=max`.
    Integer(i32),
    Binary,
    Real(f64, f64),
}

/// Variables, constraints, and where each variable sits in the solver's problem.
pub(crate) struct Model {
    vars: ProblemVariables,
    index: HashMap<Variable, usize>,
    domains: Vec<Domain>,
    constraints: Vec<Constraint>,
}

/// What one solve came to.
pub(crate) enum Outcome {
    /// Values of every variable; `proven` when the solver proved them optimal.
    Solved {
        values: HashMap<Variable, f64>,
        proven: bool,
    },
    Infeasible,
    /// The time limit passed before any solution was found.
    TimeLimit,
    /// The solver gave up (numerically, say), with its message.
    Failed(String),
}

impl Model {
    pub fn new() -> Model {
        Model {
            vars: ProblemVariables::new(),
            index: HashMap::new(),
            domains: Vec::new(),
            constraints: Vec::new(),
        }
    }

    fn add(&mut self, domain: Domain) -> Variable {
        let v = self.vars.add_variable();
        self.index.insert(v, self.domains.len());
        self.domains.push(domain);
        v
    }

    /// An integer variable in `0..=max` (`max` a whole count of blocks).
    pub fn integer(&mut self, max: f64) -> Variable {
        self.add(Domain::Integer(max.clamp(0.0, i32::MAX as f64) as i32))
    }

    pub fn binary(&mut self) -> Variable {
        self.add(Domain::Binary)
    }

    /// A real variable in `min..=max` (`f64::INFINITY` for no upper bound).
    pub fn real(&mut self, min: f64, max: f64) -> Variable {
        self.add(Domain::Real(min, max))
    }

    pub fn with(&mut self, c: Constraint) {
        self.constraints.push(c);
    }

    /// Minimises `objective` subject to the constraints and `extra`, within `limit`.
    pub fn minimise(
        &self,
        objective: &Expression,
        extra: Option<&Constraint>,
        limit: Duration,
    ) -> Outcome {
        let start = std::time::Instant::now();
        match self.solve(objective, extra, limit, false) {
            // The same program with every row and the objective scaled to a largest
            // coefficient of 1: the same optimum, other pivots. microlp's dual simplex
            // fails numerically on a few instances (a pivot of 1e-31) that it solves so.
            Outcome::Failed(first) => match self.solve(
                objective,
                extra,
                limit.saturating_sub(start.elapsed()),
                true,
            ) {
                o @ (Outcome::Solved { .. } | Outcome::Infeasible) => o,
                _ => Outcome::Failed(first),
            },
            o => o,
        }
    }

    fn solve(
        &self,
        objective: &Expression,
        extra: Option<&Constraint>,
        limit: Duration,
        scaled: bool,
    ) -> Outcome {
        let mut coefficients: HashMap<Variable, f64> =
            objective.clone().linear_coefficients().collect();
        if scaled {
            let top = coefficients.values().fold(0.0f64, |m, k| m.max(k.abs()));
            if top > 0.0 && top.is_finite() {
                coefficients.values_mut().for_each(|k| *k /= top);
            }
        }
        let mut problem = microlp::Problem::new(OptimizationDirection::Minimize);
        let mut solver_vars = vec![None; self.domains.len()];
        // Variables in the order they were made, so the solver's problem is the same
        // from run to run.
        let mut order: Vec<(&Variable, &usize)> = self.index.iter().collect();
        order.sort_by_key(|(_, i)| **i);
        for (v, &i) in order {
            let c = coefficients.get(v).copied().unwrap_or(0.0);
            solver_vars[i] = Some(match self.domains[i] {
                Domain::Integer(max) => problem.add_integer_var(c, (0, max)),
                Domain::Binary => problem.add_binary_var(c),
                Domain::Real(min, max) => problem.add_var(c, (min, max)),
            });
        }
        let var_of = |v: &Variable| self.index.get(v).and_then(|&i| solver_vars[i]);
        for c in self.constraints.iter().chain(extra) {
            // good_lp keeps every constraint as `expression <= 0` (or `== 0`).
            let e = c.expression();
            let mut terms = Vec::new();
            for (v, k) in e.clone().linear_coefficients() {
                if k == 0.0 {
                    continue;
                }
                match var_of(&v) {
                    Some(sv) => terms.push((sv, k)),
                    None => {
                        return Outcome::Failed("a constraint names an unknown variable".into())
                    }
                }
            }
            terms.sort_by_key(|(sv, _)| sv.idx());
            let op = if c.is_equality() {
                ComparisonOp::Eq
            } else {
                ComparisonOp::Le
            };
            let mut rhs = -e.constant();
            if scaled {
                let top = terms.iter().fold(0.0f64, |m, (_, k)| m.max(k.abs()));
                if top > 0.0 && top.is_finite() {
                    terms.iter_mut().for_each(|(_, k)| *k /= top);
                    rhs /= top;
                }
            }
            problem.add_constraint(terms, op, rhs);
        }
        let mut options = SolveOptions::default();
        options.time_limit = Some(limit);
        // A panic inside the solver is one more failure: the family's search goes on
        // without it (`search.rs`) rather than taking `mold plan` down.
        let solved =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| problem.solve_with(options)));
        let outcome = match solved {
            Ok(Ok(o)) => o,
            Ok(Err(microlp::Error::Infeasible)) => return Outcome::Infeasible,
            Ok(Err(e)) => return Outcome::Failed(e.to_string()),
            Err(_) => return Outcome::Failed("the solver panicked".into()),
        };
        let Ok(solution) = outcome.into_solution() else {
            return Outcome::TimeLimit;
        };
        let proven = solution.status() == SolutionStatus::Optimal;
        let values = self
            .index
            .iter()
            .filter_map(|(v, &i)| solver_vars[i].map(|sv| (*v, solution.var_value(sv))))
            .collect();
        Outcome::Solved { values, proven }
    }
}
