//! Checks a plan against its model and a machine before anything is simulated or
//! loaded. Each problem is one line naming the field and what to do.

use crate::{invalid, CostError};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{ComponentRole, DeviceId, Plan};

/// Checks that the plan's components, block ranges, devices and parallel layouts (tensor
/// and sequence parallel: `tp × sp` must divide every block kind's heads) make sense for
/// `model` on `machine`. With `replicas:`, every replica is checked so, on its own
/// devices, and must fit in their memory (the replicas' pinned host memory together
/// within the machine's limit); errors then start with `replicas[i]`.
///
/// A plan with `cfg` must be for a model with true CFG (a `cfg_scale` in its default
/// workload). Under CFG-parallel the two replicas are one request's two passes: each is
/// checked as a placement, and the pair must fit together (the encoders and the VAE
/// where replica 0 places them, a transformer on each replica's devices).
pub fn validate(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Result<(), CostError> {
    if plan.cfg.is_some() && model.default_workload.cfg_scale.is_none() {
        return Err(invalid(
            "cfg",
            format!(
                "{} has no true CFG (its workload has no cfg_scale: it is guidance-distilled): remove `cfg` and workload.cfg_scale",
                model.id
            ),
        ));
    }
    let replicas = plan
        .replica_plans()
        .map_err(|e| invalid(e.field, e.message))?;
    if plan.replicas.is_none() {
        return validate_placement(plan, model, machine);
    }
    if plan.cfg_mode() == Some(mold_plan::CfgMode::Parallel) {
        for (ri, r) in replicas.iter().enumerate() {
            validate_placement(r, model, machine).map_err(
                |CostError::Invalid { field, message }| {
                    invalid(format!("replicas[{ri}]: {field}"), message)
                },
            )?;
        }
        let e = crate::evaluate(plan, model, machine);
        if let Some(d) = e.overflows().first() {
            return Err(invalid(
                "cfg.mode",
                format!(
                    "CFG-parallel does not fit on {}: it needs {} with headroom but the budget is {}: use a placement that fits there, or `mode: serial`",
                    d.device,
                    mold_plan::ByteSize(d.peak.saturating_add(d.headroom)).ceil_mib(),
                    mold_plan::ByteSize(d.budget).ceil_mib()
                ),
            ));
        }
        if e.host_pinned > e.host_pinned_limit {
            return Err(invalid(
                "cfg.mode",
                format!(
                    "the two replicas pin {} of host memory for streamed weights, over the limit of {}: use fewer streamed blocks, or `mode: serial`",
                    mold_plan::ByteSize(e.host_pinned).ceil_mib(),
                    mold_plan::ByteSize(e.host_pinned_limit).ceil_mib()
                ),
            ));
        }
        return Ok(());
    }
    let mut pinned = 0u64;
    for (ri, r) in replicas.iter().enumerate() {
        let at = |CostError::Invalid { field, message }| {
            invalid(format!("replicas[{ri}]: {field}"), message)
        };
        validate_placement(r, model, machine).map_err(at)?;
        let e = crate::evaluate(r, model, machine);
        if let Some(d) = e.overflows().first() {
            return Err(invalid(
                format!("replicas[{ri}]"),
                format!(
                    "does not fit on {}: it needs {} with headroom but the budget is {}: use fewer replicas or a placement that fits there",
                    d.device,
                    mold_plan::ByteSize(d.peak.saturating_add(d.headroom)).ceil_mib(),
                    mold_plan::ByteSize(d.budget).ceil_mib()
                ),
            ));
        }
        pinned = pinned.saturating_add(e.host_pinned);
        if pinned > e.host_pinned_limit {
            return Err(invalid(
                format!("replicas[{ri}]"),
                format!(
                    "the replicas up to this one pin {} of host memory for streamed weights, over the limit of {}: use fewer replicas or fewer streamed blocks",
                    mold_plan::ByteSize(pinned).ceil_mib(),
                    mold_plan::ByteSize(e.host_pinned_limit).ceil_mib()
                ),
            ));
        }
    }
    Ok(())
}

/// [`validate`] for one placement (the plan's parts as written, `replicas:` aside).
fn validate_placement(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Result<(), CostError> {
    if plan.model.id != model.id {
        return Err(invalid(
            "model.id",
            format!(
                "the plan is for `{}` but the model given is `{}`",
                plan.model.id, model.id
            ),
        ));
    }
    model
        .check_workload(&plan.workload)
        .map_err(|e| invalid("workload", e.to_string()))?;
    for (ci, c) in plan.components.iter().enumerate() {
        let f = format!("components[{ci}]");
        match c.role {
            ComponentRole::Transformer => {
                if c.name != "transformer" {
                    return Err(invalid(
                        format!("{f}.name"),
                        format!(
                            "the transformer component is named `transformer`, not `{}`",
                            c.name
                        ),
                    ));
                }
            }
            _ => {
                let spec = model.component(&c.name).ok_or_else(|| {
                    invalid(
                        format!("{f}.name"),
                        format!(
                            "`{}` is not a component of {} (it has {}, transformer)",
                            c.name,
                            model.id,
                            model
                                .components
                                .iter()
                                .map(|c| c.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                })?;
                if spec.role != c.role {
                    return Err(invalid(
                        format!("{f}.role"),
                        format!(
                            "`{}` is a {:?} component, not {:?}",
                            c.name, spec.role, c.role
                        )
                        .to_lowercase(),
                    ));
                }
                // The VAE may decode in row bands, one per device: `sp` devices, no `tp`.
                let banded = c.role == ComponentRole::Vae
                    && c.parts.len() == 1
                    && c.parts[0].devices.len() > 1;
                if banded {
                    let p = &c.parts[0];
                    let n = p.devices.len();
                    if p.tp != 1 || p.sp as usize != n || p.devices.iter().any(|d| d.is_host()) {
                        return Err(invalid(
                            format!("{f}.parts[0]"),
                            format!(
                                "`{}` over {n} devices decodes in row bands, one a device: set `sp: {n}`, no `tp`, and GPUs only",
                                c.name
                            ),
                        ));
                    }
                    let mut seen = p.devices.clone();
                    seen.sort();
                    seen.dedup();
                    if seen.len() != n {
                        return Err(invalid(
                            format!("{f}.parts[0].devices"),
                            format!(
                                "`{}` names a device twice: list each band's device once",
                                c.name
                            ),
                        ));
                    }
                } else if c.parts.len() != 1
                    || c.parts[0].devices.len() != 1
                    || !c.parts[0].blocks.is_empty()
                    || c.parts[0].tp != 1
                    || c.parts[0].sp != 1
                {
                    return Err(invalid(
                        format!("{f}.parts"),
                        format!(
                            "`{}` runs whole on one device: give it one part with one device and no blocks{}",
                            c.name,
                            if c.role == ComponentRole::Vae {
                                " (or several devices with `sp` equal to their count: row bands)"
                            } else {
                                ""
                            }
                        ),
                    ));
                }
                if c.parts[0].residency != mold_plan::Residency::Resident {
                    return Err(invalid(
                        format!("{f}.parts[0].residency"),
                        format!("only transformer blocks stream: make `{}` resident", c.name),
                    ));
                }
            }
        }
        for (pi, p) in c.parts.iter().enumerate() {
            for d in &p.devices {
                if !d.is_host() && machine.device(d).is_none() {
                    return Err(invalid(
                        format!("{f}.parts[{pi}].devices"),
                        format!(
                            "{d} is not a device of machine `{}` (it has {}): re-plan for this machine or name one of those",
                            machine.name,
                            machine.device_list()
                        ),
                    ));
                }
            }
        }
    }
    for spec in &model.components {
        if !plan.components.iter().any(|c| c.name == spec.name) {
            return Err(invalid(
                "components",
                format!("`{}` of {} has no placement: add it", spec.name, model.id),
            ));
        }
    }
    let tc = plan.transformer().ok_or_else(|| {
        invalid(
            "components",
            "no transformer component: add one with role transformer",
        )
    })?;
    let ti = plan
        .components
        .iter()
        .position(|c| c.role == ComponentRole::Transformer)
        .unwrap();
    // Walk the execution order: every kind in turn, every block once.
    let kinds = &model.transformer.kinds;
    let (mut k, mut next) = (0usize, 0u32);
    for (pi, p) in tc.parts.iter().enumerate() {
        let f = format!("components[{ti}].parts[{pi}]");
        if p.blocks.is_empty() {
            return Err(invalid(
                format!("{f}.blocks"),
                "a transformer part needs at least one block range",
            ));
        }
        if p.devices.iter().any(|d| d.is_host()) {
            return Err(invalid(
                format!("{f}.devices"),
                "transformer blocks run on devices: to keep weights on the host, use `residency: streamed`",
            ));
        }
        // `tp × sp` devices is checked with the plan's structure; each rank attends
        // with `heads / (tp·sp)` heads (the tokens need not divide: the executor splits
        // them unevenly, exactly).
        let degree = p.tp.saturating_mul(p.sp).max(1);
        for (bi, r) in p.blocks.iter().enumerate() {
            let fb = format!("{f}.blocks[{bi}]");
            let (ki, kind) = model.transformer.kind(&r.kind).ok_or_else(|| {
                invalid(
                    fb.clone(),
                    format!(
                        "`{}` is not a block kind of {} (kinds: {})",
                        r.kind,
                        model.id,
                        kinds
                            .iter()
                            .map(|k| k.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })?;
            if r.end > kind.count {
                return Err(invalid(
                    fb,
                    format!(
                        "`{r}` runs past the last block: {} has {} `{}` blocks (0..{})",
                        model.id, kind.count, kind.name, kind.count
                    ),
                ));
            }
            // Skip kinds completed before this range.
            while k < ki && next == kinds[k].count {
                k += 1;
                next = 0;
            }
            let expected = if k < kinds.len() {
                format!("{} {}", kinds[k].name, next)
            } else {
                "nothing (every block is placed already)".into()
            };
            if ki != k || r.start != next {
                let why = if ki < k || (ki == k && r.start < next) {
                    "overlaps an earlier range or runs out of execution order"
                } else {
                    "leaves a gap"
                };
                return Err(invalid(
                    fb,
                    format!("`{r}` {why}: the next block in execution order is {expected}"),
                ));
            }
            if kind.heads % degree != 0 {
                return Err(if p.sp > 1 {
                    invalid(
                        format!("{f}.sp"),
                        format!(
                            "tp {} × sp {} = {degree} does not divide the {} attention heads of `{}` blocks: use tp × sp dividing {}",
                            p.tp, p.sp, kind.heads, kind.name, kind.heads
                        ),
                    )
                } else {
                    invalid(
                        format!("{f}.devices"),
                        format!(
                            "tensor-parallel degree {degree} does not divide the {} attention heads of `{}` blocks: use a degree dividing {}",
                            kind.heads, kind.name, kind.heads
                        ),
                    )
                });
            }
            next = r.end;
        }
    }
    while k < kinds.len() && next == kinds[k].count {
        k += 1;
        next = 0;
    }
    if k < kinds.len() {
        return Err(invalid(
            format!("components[{ti}].parts"),
            format!(
                "blocks from {} {}..{} are not placed: add them to a part",
                kinds[k].name, next, kinds[k].count
            ),
        ));
    }
    Ok(())
}

/// Result of comparing the plan's recorded machine with the machine at hand.
#[derive(Debug, PartialEq, Eq)]
pub enum MachineCheck {
    Same,
    /// Differs, and the caller allowed it: this warning should be shown.
    Warn(String),
}

/// Compares the plan's machine fingerprint with `machine`'s: a different machine is an
/// error unless `force`, then a warning.
pub fn check_machine(
    plan: &Plan,
    machine: &Machine,
    force: bool,
) -> Result<MachineCheck, CostError> {
    let fp = machine.fingerprint();
    if plan.machine.fingerprint == fp {
        return Ok(MachineCheck::Same);
    }
    // A plan made for some of this box's devices (`--devices`, `--gpus`): the same
    // devices here are the same machine for it.
    let ids: Vec<DeviceId> = plan.machine.devices.iter().map(|d| d.id.clone()).collect();
    if !ids.is_empty()
        && ids.iter().all(|i| machine.device(i).is_some())
        && plan.machine.fingerprint == machine.fingerprint_of(&ids)
    {
        return Ok(MachineCheck::Same);
    }
    let msg = format!(
        "the plan was made for machine `{}` ({}) but this is `{}` ({}): the plan's predictions do not hold here",
        plan.machine.name, plan.machine.fingerprint, machine.name, fp
    );
    if force {
        Ok(MachineCheck::Warn(msg))
    } else {
        Err(invalid(
            "machine.fingerprint",
            format!("{msg}; re-plan with `mold plan --machine ...`, or pass --force to go on"),
        ))
    }
}
