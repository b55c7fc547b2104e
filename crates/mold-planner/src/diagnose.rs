//! Why no plan fits, in numbers, and the cheapest relaxation that would make one fit.

use crate::{search, Request, SpChoice, TpChoice};
use mold_plan::{ByteSize, DType};

fn gb(b: u64) -> String {
    crate::report::decimal_bytes(b)
}

/// A one-paragraph explanation: what does not fit where, by how much, and what to relax.
pub fn explain(req: &Request) -> String {
    let ctx = req.cost_ctx();
    let dtype = req.dtype("transformer");
    let t = &req.model.transformer;
    let total = t.weight_bytes(dtype);
    let caps: Vec<(String, u64)> = req
        .machine
        .devices
        .iter()
        .filter(|d| req.constraints.allowed("transformer", &d.id))
        .map(|d| {
            let cap = d.budget.0.saturating_sub(d.headroom.0);
            let libraries = ctx.library_bytes(&d.id, dtype);
            (d.id.to_string(), cap.saturating_sub(libraries))
        })
        .collect();
    let (big_id, big) = caps
        .iter()
        .max_by_key(|c| c.1)
        .cloned()
        .unwrap_or(("none".into(), 0));
    let sum: u64 = caps.iter().map(|c| c.1).fold(0, u64::saturating_add);
    let one = mold_cost::Group::single(req.machine.devices[0].id.clone());
    let (buf, act) = t.kinds.iter().fold((0u64, 0u64), |(b, a), k| {
        let bc = ctx.block(k, &one, dtype);
        (b.max(bc.weight_bytes), a.max(bc.activation_bytes))
    });
    let mut facts = vec![format!(
        "transformer needs {} resident ({} {dtype} weights + {} activations at {}x{}); largest budget {} ({big_id}){}",
        gb(total.saturating_add(act)),
        gb(total),
        gb(act),
        req.workload.width,
        req.workload.height,
        gb(big),
        if caps.len() > 1 {
            format!(", all {} allowed devices together {}", caps.len(), gb(sum))
        } else {
            String::new()
        }
    )];
    // The least a device needs to run the transformer at all: stem, stream buffers and
    // the largest block's activations.
    let floor = t
        .stem_bytes(dtype)
        .saturating_add((req.constraints.stream_buffers as u64).saturating_mul(buf))
        .saturating_add(act);
    if floor > big {
        facts.push(format!(
            "even streaming every block needs {} on one device (stem, {} block buffers, activations at {}x{}) > {}",
            gb(floor),
            req.constraints.stream_buffers,
            req.workload.width,
            req.workload.height,
            gb(big)
        ));
    }
    for c in &req.model.components {
        let d = req.dtype(&c.name);
        let need = c
            .weight_bytes(d)
            .saturating_add(ctx.component_activation(c, d));
        if need > big && !req.constraints.allowed(&c.name, &mold_plan::DeviceId::Host) {
            facts.push(format!(
                "{} needs {} and may not run on the host",
                c.name,
                gb(need)
            ));
        }
    }
    let pinned = req.machine.host.pinned_limit.0;
    if total > sum && total - sum > pinned {
        facts.push(format!(
            "streaming the {} that no device holds exceeds the host pinned limit {}",
            gb(total - sum),
            ByteSize(pinned)
        ));
    }

    // Relaxations, cheapest first; the first that yields a plan is suggested.
    let mut tries: Vec<(&str, Request)> = Vec::new();
    if req.dtype("transformer") == DType::Fp8 {
        let mut r = req.clone();
        r.dtypes.insert("transformer".into(), DType::Bf16);
        r.constraints.stream = true;
        tries.push((
            if req.constraints.stream {
                "hold the transformer in bf16 so that blocks can stream (--dtype transformer=bf16): FP8 blocks stay resident"
            } else {
                "hold the transformer in bf16 and let blocks stream (--dtype transformer=bf16, drop --no-stream): FP8 blocks stay resident"
            },
            r,
        ));
    } else if !req.constraints.stream {
        let mut r = req.clone();
        r.constraints.stream = true;
        tries.push(("allow streaming (drop --no-stream)", r));
    }
    if req.constraints.tp != TpChoice::Auto {
        let mut r = req.clone();
        r.constraints.tp = TpChoice::Auto;
        tries.push(("allow any tensor-parallel degree (--tp auto)", r));
    }
    if req.constraints.sp != SpChoice::Auto {
        let mut r = req.clone();
        r.constraints.sp = SpChoice::Auto;
        tries.push(("allow any sequence-parallel degree (--sp auto)", r));
    }
    if !req.constraints.pins.is_empty() {
        let mut r = req.clone();
        r.constraints.pins.clear();
        tries.push(("drop the --pin placements", r));
    }
    if !req.constraints.host_components {
        let mut r = req.clone();
        r.constraints.host_components = true;
        tries.push(("let encoders run on the host", r));
    }
    let mut all = req.clone();
    all.constraints.stream = true;
    all.constraints.tp = TpChoice::Auto;
    all.constraints.sp = SpChoice::Auto;
    all.constraints.pins.clear();
    all.constraints.host_components = true;
    if tries.len() > 1 {
        tries.push((
            "lift every constraint (streaming, --tp auto, --sp auto, no pins)",
            all,
        ));
    }
    // Each relaxation gets a share of one family's time: a relaxation the search cannot
    // settle in it is passed over.
    let limit = req.time_limit / 4;
    let mut advice = None;
    for (what, r) in &tries {
        if search::solve_family(r, None, limit).choice.is_some() {
            advice = Some(format!("cheapest relaxation: {what}"));
            break;
        }
    }
    let advice = advice.unwrap_or_else(|| {
        "add a device or memory (--max-vram/--devices may be limiting), lower the size or batch, or use a smaller dtype (--dtype transformer=q8)".into()
    });
    format!("{}; {advice}", facts.join("; "))
}
