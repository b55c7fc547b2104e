//! Checks of a plan's transformer parts against the model, before anything loads.

use crate::error::{ExecError, Result};
use crate::model::{BlockRef, Transformer};
use candle_core::DType;
use mold_plan::{Part, Plan};

/// Maps a plan's transformer dtype to the compute dtype.
pub fn compute_dtype(d: mold_plan::DType) -> Result<DType> {
    match d {
        mold_plan::DType::F32 => Ok(DType::F32),
        mold_plan::DType::Bf16 => Ok(DType::BF16),
        mold_plan::DType::Fp16 => Ok(DType::F16),
        other => Err(ExecError::UnsupportedDtype(other.to_string())),
    }
}

/// A plan's transformer dtype as the compute dtype and whether the products' weights are
/// held in FP8 (`fp8`: bf16 activations, norms and attention, FP8 products).
pub fn weights_dtype(d: mold_plan::DType) -> Result<(DType, bool)> {
    match d {
        mold_plan::DType::Fp8 => Ok((DType::BF16, true)),
        d => Ok((compute_dtype(d)?, false)),
    }
}

/// Checks the transformer parts of `plan` against model `m` without loading anything:
/// every block range names a known kind and lies inside the model, every block runs
/// exactly once, kinds in the model's order and each in ascending order, and each
/// part's tensor- and sequence-parallel degrees suit the model
/// ([`Transformer::tp_refusal`], [`Transformer::sp_refusal`]). Returns each
/// part's blocks in execution order.
pub fn check_plan<M: Transformer>(m: &M, plan: &Plan) -> Result<Vec<Vec<BlockRef>>> {
    let comp = transformer_of(plan)?;
    check_parts(m, &comp.parts)
}

pub(crate) fn transformer_of(plan: &Plan) -> Result<&mold_plan::ComponentPlan> {
    plan.transformer().ok_or_else(|| {
        ExecError::Plan("no transformer component: add one (role: transformer) or regenerate the plan with `mold plan`".into())
    })
}

pub(crate) fn check_parts<M: Transformer>(m: &M, parts: &[Part]) -> Result<Vec<Vec<BlockRef>>> {
    let kinds = m.block_kinds();
    // The first global index of each kind.
    let mut bases = Vec::with_capacity(kinds.len());
    let mut total = 0usize;
    for (_, n) in &kinds {
        bases.push(total);
        total += n;
    }
    let names: Vec<String> = kinds.iter().map(|(k, _)| format!("`{k}`")).collect();
    let spans: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} 0..{n}")).collect();
    let mut out = Vec::with_capacity(parts.len());
    let mut owner: Vec<Option<(usize, String)>> = vec![None; total];
    let mut order = Vec::new();
    for (pi, p) in parts.iter().enumerate() {
        let (tp, sp) = (p.tp as usize, p.sp as usize);
        if tp == 0 || sp == 0 || tp * sp != p.devices.len() {
            return Err(ExecError::Plan(format!(
                "part {pi}: tp {tp} × sp {sp} must equal its {} devices: fix tp/sp or the device list",
                p.devices.len()
            )));
        }
        if let Some(what) = m.tp_refusal(tp) {
            return Err(ExecError::TpDegree {
                part: pi,
                degree: tp,
                what,
            });
        }
        if let Some(what) = m.sp_refusal(tp, sp) {
            return Err(ExecError::Plan(format!("part {pi}: {what}")));
        }
        let mut steps = Vec::new();
        for r in &p.blocks {
            let bad = |message: String| ExecError::BadRange {
                part: pi,
                range: r.to_string(),
                message,
            };
            let Some(ki) = kinds.iter().position(|(k, _)| *k == r.kind.as_str()) else {
                return Err(bad(format!(
                    "unknown block kind `{}`: {} has {} blocks",
                    r.kind,
                    m.family(),
                    names.join(" and ")
                )));
            };
            let (kind, n) = kinds[ki];
            let base = bases[ki];
            if r.start >= r.end {
                return Err(bad("empty: write start..end with start < end".into()));
            }
            if r.end as usize > n {
                return Err(bad(format!(
                    "goes past the model's {n} {kind} blocks (valid: {kind} 0..{n}): fix the range or regenerate the plan for this model"
                )));
            }
            for i in r.start as usize..r.end as usize {
                if let Some((op, orange)) = &owner[base + i] {
                    return Err(bad(format!(
                        "block {kind} {i} is already run by part {op} (`{orange}`): each block runs exactly once"
                    )));
                }
                owner[base + i] = Some((pi, r.to_string()));
                order.push(base + i);
                steps.push(BlockRef { kind, index: i });
            }
        }
        out.push(steps);
    }
    let missing: Vec<String> = owner
        .iter()
        .enumerate()
        .filter(|(_, o)| o.is_none())
        .map(|(g, _)| {
            let ki = bases.iter().rposition(|b| *b <= g).unwrap_or(0);
            format!("{} {}", kinds[ki].0, g - bases[ki])
        })
        .collect();
    if !missing.is_empty() {
        return Err(ExecError::Plan(format!(
            "no part runs block(s) {}: the transformer parts must cover {}",
            missing.join(", "),
            spans.join(" and ")
        )));
    }
    if order.windows(2).any(|w| w[0] > w[1]) {
        return Err(ExecError::Plan(format!(
            "blocks must run in model order ({}) across parts: reorder the parts or ranges",
            spans.join(", then ")
        )));
    }
    Ok(out)
}
