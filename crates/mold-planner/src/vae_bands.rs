//! The VAE's decode in row bands over several GPUs (`--vae-bands`): after the search has
//! placed everything, the VAE's one device is widened to the bands that shorten the request
//! most, priced by mold-cost ([`mold_cost::Ctx::decode_bands_s`]) and kept only where every
//! budget still holds; unasked, only over GPUs of one peer domain (NVLink or PCIe peer
//! access), where the bands' copies go device to device. The decode runs after the transformer's last step, so the devices it
//! borrows are idle then; only their memory (the decoder's weights on each, a band's share
//! of its activations) competes with what stays loaded.

use crate::constraints::ParallelChoice;
use crate::problem::Problem;
use crate::{Family, Objective, PlanError, Request};
use mold_models::Workkind;
use mold_plan::{ComponentRole, DeviceId, Plan};

/// A banded decode must be at least this much shorter than the one-device decode (and the
/// request shorter): a smaller gain is within the cost model's error for a decode and not
/// worth the devices' memory.
const MIN_GAIN: f64 = 0.10;

/// Widens `plan`'s VAE to row bands as `req.constraints.vae_bands` asks: `Auto` where it
/// shortens the request (latency objective, one replica, no CFG-parallel), `Degree(k)`
/// exactly `k` bands (an error where the model's VAE cannot decode in bands or `k` GPUs are
/// not there or do not fit), `Off` never.
pub(crate) fn widen(req: &Request, plan: &mut Plan, family: Family) -> Result<(), PlanError> {
    let choice = req.constraints.vae_bands;
    let Some(vi) = plan
        .components
        .iter()
        .position(|c| c.role == ComponentRole::Vae)
    else {
        return Ok(());
    };
    let name = plan.components[vi].name.clone();
    let bandable = req.model.component(&name).is_some_and(|c| {
        matches!(
            c.work,
            Workkind::VaeDecoder {
                band_exchanges: Some(_),
                ..
            }
        )
    });
    let wanted = match choice {
        ParallelChoice::Off | ParallelChoice::Degree(1) => return Ok(()),
        ParallelChoice::Degree(k) => Some(k as usize),
        ParallelChoice::Auto => None,
    };
    let refuse = |why: String| match wanted {
        Some(k) => Err(PlanError::Constraint(format!("--vae-bands {k}: {why}"))),
        None => Ok(()),
    };
    if !bandable {
        return refuse(format!(
            "{}'s `{name}` decodes on one device only (mold decodes FLUX's autoencoder in bands)",
            req.model.id
        ));
    }
    if plan.replicas.is_some() || req.cfg_mode() == Some(mold_plan::CfgMode::Parallel) {
        return refuse(
            "a plan of replicas or CFG-parallel passes keeps the VAE on one device".into(),
        );
    }
    if wanted.is_none() && req.objective != Objective::Latency {
        return Ok(());
    }
    let first = plan.components[vi].parts[0].devices[0].clone();
    if first.is_host() {
        return refuse("the VAE is planned on the host: bands run on GPUs".into());
    }
    // The first band on the VAE's planned device (the latents arrive there), then the other
    // GPUs in the machine's order, within the VAE's pins.
    let allowed = |d: &DeviceId| {
        req.constraints
            .pins
            .get(&name)
            .is_none_or(|pins| pins.contains(d))
    };
    let mut order = vec![first.clone()];
    order.extend(
        req.machine
            .devices
            .iter()
            .map(|d| d.id.clone())
            .filter(|d| !d.is_host() && *d != first && allowed(d)),
    );
    let ks: Vec<usize> = match wanted {
        Some(k) if k > order.len() => {
            return refuse(format!(
                "{} GPU(s) can take the VAE ({}): ask for at most {}",
                order.len(),
                order
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                order.len()
            ))
        }
        Some(k) => vec![k],
        None => (2..=order.len()).collect(),
    };
    let problem = Problem::new(req);
    let base = mold_cost::evaluate(plan, &req.model, &req.machine);
    let mut best: Option<(f64, Plan)> = None;
    for k in ks {
        // Unasked, bands only within one peer domain: their copies are the event-ordered
        // peer copies measured; through host memory each would wait for the host.
        if wanted.is_none() && req.machine.domain_of(&order[..k]).is_none() {
            continue;
        }
        let mut p = plan.clone();
        let part = &mut p.components[vi].parts[0];
        part.devices = order[..k].to_vec();
        part.sp = k as u32;
        if mold_cost::validate(&p, &req.model, &req.machine).is_err() {
            continue;
        }
        let ev = mold_cost::evaluate(&p, &req.model, &req.machine);
        if !problem.fits(&p, &ev, family) {
            continue;
        }
        let gain = wanted.is_some()
            || (ev.decode_s < base.decode_s * (1.0 - MIN_GAIN) && ev.request_s < base.request_s);
        if gain && best.as_ref().is_none_or(|(s, _)| ev.request_s < *s) {
            p.predicted = ev.prediction();
            best = Some((ev.request_s, p));
        }
    }
    match best {
        Some((_, p)) => {
            *plan = p;
            Ok(())
        }
        None => {
            refuse("the bands do not fit the devices' budgets beside the rest of the plan".into())
        }
    }
}
