//! The human summary `mold plan` prints.

use crate::{Family, Outcome};
use mold_cost::Group;
use mold_plan::{ByteSize, ComponentRole, DeviceId, Part, Plan, Residency};
use std::fmt::Write;

fn secs(s: f64) -> String {
    if s >= 100.0 {
        format!("{s:.0} s")
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// Bytes in decimal units that suit them: `24.1 GB`, `3.2 MB`, `850.0 kB`, `512 B` (a
/// tiny model's sizes are not all `0.0 GB`).
pub fn decimal_bytes(b: u64) -> String {
    let x = b as f64;
    if x >= 1e9 {
        format!("{:.1} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} kB", x / 1e3)
    } else {
        format!("{b} B")
    }
}

/// Devices as `cuda:0`, `cuda:0+cuda:1`, or `cuda:0-7` for a consecutive run.
fn device_list(devs: &[DeviceId]) -> String {
    let consecutive = devs.len() > 2
        && devs.windows(2).all(|w| match (&w[0], &w[1]) {
            (DeviceId::Cuda(a), DeviceId::Cuda(b)) | (DeviceId::Emu(a), DeviceId::Emu(b)) => {
                b == &(a + 1)
            }
            _ => false,
        });
    if consecutive {
        let last = devs.last().and_then(|d| d.ordinal()).unwrap_or(0);
        format!("{}-{last}", devs[0])
    } else {
        devs.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// A component's dtype as the placement shows it: `fp8 (attention fp8)` where its attention
/// runs in FP8 too.
fn dtype_label(c: &mold_plan::ComponentPlan) -> String {
    if c.fp8_attention() {
        format!("{} (attention fp8)", c.dtype)
    } else {
        c.dtype.to_string()
    }
}

/// Where each component and block range runs, one line a part, naming each parallel
/// group's layout, and its link when `machine` is given.
fn placement_on(plan: &Plan, machine: Option<&mold_machine::Machine>) -> String {
    let mut out = String::new();
    // The dtype column: as wide as its widest label, at least 5.
    let dw = plan
        .components
        .iter()
        .map(|c| dtype_label(c).len())
        .fold(5, usize::max);
    for c in &plan.components {
        let mut i = 0;
        while i < c.parts.len() {
            let p = &c.parts[i];
            let name = if i == 0 { c.name.as_str() } else { "" };
            let dtype = if i == 0 {
                dtype_label(c)
            } else {
                String::new()
            };
            // Streamed parts spread among resident ones on the same devices: one line.
            let run = c.parts[i..]
                .iter()
                .take_while(|q| Group::of(q) == Group::of(p))
                .count();
            let mixed = c.role == ComponentRole::Transformer
                && run > 2
                && c.parts[i..i + run]
                    .iter()
                    .any(|q| q.residency == Residency::Streamed);
            if mixed {
                let parts = &c.parts[i..i + run];
                let mut ranges: Vec<mold_plan::BlockRange> = Vec::new();
                for r in parts.iter().flat_map(|q| q.blocks.iter()) {
                    match ranges.last_mut() {
                        Some(l) if l.kind == r.kind && l.end == r.start => l.end = r.end,
                        _ => ranges.push(r.clone()),
                    }
                }
                let count = |res: Residency| -> u32 {
                    parts
                        .iter()
                        .filter(|q| q.residency == res)
                        .map(|q| q.block_count())
                        .sum()
                };
                let buffers = parts.iter().map(|q| q.buffers()).max().unwrap_or(0);
                let tp = if p.devices.len() > 1 {
                    format!("{}{}, ", Group::of(p).describe(), link(machine, p))
                } else {
                    String::new()
                };
                let blocks = ranges
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ");
                let _ = writeln!(
                    out,
                    "  {name:<12} {dtype:<dw$} {:<14} {blocks:<28} {tp}{} resident, {} streamed from host spread among them ({buffers} buffers; {} parts in the plan)",
                    device_list(&p.devices),
                    count(Residency::Resident),
                    count(Residency::Streamed),
                    run
                );
                i += run;
                continue;
            }
            let blocks = p
                .blocks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            let devs = device_list(&p.devices);
            let how = match (c.role, p.residency, p.devices.len()) {
                (ComponentRole::Transformer, Residency::Streamed, n) if n > 1 => {
                    format!(
                        "{}{}, streamed ({} buffers)",
                        Group::of(p).describe(),
                        link(machine, p),
                        p.buffers()
                    )
                }
                (ComponentRole::Transformer, Residency::Streamed, _) => {
                    format!("streamed from host ({} buffers)", p.buffers())
                }
                (ComponentRole::Transformer, _, n) if n > 1 => {
                    format!("{}{}", Group::of(p).describe(), link(machine, p))
                }
                (ComponentRole::Transformer, _, _) => "resident".into(),
                (ComponentRole::Vae, _, n) if n > 1 => format!("row bands ×{n}, one a device"),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "  {name:<12} {dtype:<dw$} {devs:<14} {blocks:<28} {how}"
            )
            .map(|_| ());
            i += 1;
        }
    }
    out.lines()
        .map(|l| l.trim_end().to_string() + "\n")
        .collect()
}

/// The whole summary: placement, prediction, memory, solver, and the family table.
pub fn summary(o: &Outcome) -> String {
    let p = &o.plan;
    let e = &o.evaluation;
    let w = &p.workload;
    let mut s = String::new();
    let size = if w.frames > 1 {
        format!("{}x{}x{} frames", w.width, w.height, w.frames)
    } else {
        format!("{}x{}", w.width, w.height)
    };
    let _ = writeln!(
        s,
        "{} on {} ({} device{}), {size}, {} steps, batch {}{}",
        p.model.id,
        p.machine.name,
        p.machine.devices.len(),
        if p.machine.devices.len() == 1 {
            ""
        } else {
            "s"
        },
        w.steps,
        w.batch,
        match (w.cfg_scale.is_some(), p.cfg) {
            (false, _) => String::new(),
            (true, None) => " (CFG: 2 passes a step)".to_string(),
            (true, Some(c)) => format!(" (true CFG: 2 passes a step, {})", c.mode),
        }
    );
    if let Some(c) = p.cfg {
        let how = match c.mode {
            mold_plan::CfgMode::Serial => {
                format!("serial, 2 × the pass {}", secs(e.pass_s))
            }
            mold_plan::CfgMode::Parallel => format!(
                "parallel, the unconditional pass on replicas[1] at the same time: pass {} + combine {}",
                secs(e.pass_s),
                secs(e.combine_s)
            ),
            mold_plan::CfgMode::Pipelined => format!(
                "pipelined, two micro-batches through {} stages: pass {} + bottleneck {}",
                e.stage_s.len(),
                secs(e.pass_s),
                secs(e.bottleneck_s)
            ),
        };
        let _ = writeln!(s, "true CFG: {how}");
    }
    let _ = writeln!(
        s,
        "memory phases: {}",
        match p.memory_phases {
            mold_plan::MemoryPhases::OneShot =>
                "one-shot (encoders freed before the transformer loads; peaks per phase)",
            mold_plan::MemoryPhases::Resident => "resident (every component loaded at once)",
        }
    );
    let _ = writeln!(
        s,
        "\nplacement — strategy: {} ({})",
        p.solver.strategy,
        family_desc(&p.solver.strategy)
    );
    s += &placement_on(p, Some(&o.machine));
    if let Some(t) = &o.throughput {
        let c = &t.candidates[t.chosen];
        if c.replicas > 1 {
            let _ = writeln!(
                s,
                "  replicas: {}, the placement above on {}",
                c.replicas,
                replica_list(&c.devices)
            );
        }
    }
    if let Some(t) = p.transformer() {
        let total: u32 = t.parts.iter().map(|x| x.block_count()).sum();
        let streamed: u32 = t
            .parts
            .iter()
            .filter(|x| x.residency == Residency::Streamed)
            .map(|x| x.block_count())
            .sum();
        if streamed == 0 {
            let _ = writeln!(s, "  streaming: none, every block resident");
        } else {
            let _ = writeln!(
                s,
                "  streaming: {streamed} of {total} blocks stream from host memory, {} a step over {:.1} GB/s pinned",
                ByteSize(e.streamed_per_step).human(),
                0.0f64.max(e.streamed_per_step as f64 / 1e9 / e.parts.iter().map(|x| x.copy_s).sum::<f64>().max(1e-12))
            );
        }
    }
    let _ = writeln!(
        s,
        "\npredicted: step {}, request {} = encode {} + {} steps × {} + decode {}",
        secs(e.step_s),
        secs(e.request_s),
        secs(e.encode_s),
        w.steps,
        secs(e.step_s),
        secs(e.decode_s)
    );
    // Loading, which a one-shot `mold exec` pays before the request and `mold serve` once.
    let ctx = mold_cost::Ctx::for_plan(&o.model, &o.machine, p);
    let load = mold_cost::load_time(p, &ctx);
    let _ = writeln!(
        s,
        "load before a one-shot request: {} (transformer {}; host read {:.1} GB/s, {})",
        secs(load.total_s),
        secs(load.transformer_s),
        ctx.host_read_gbps(),
        if ctx.host_read_measured() {
            "measured"
        } else {
            "the default until `mold devices --calibrate`"
        }
    );
    let _ = writeln!(s, "\nmemory        peak + headroom / budget");
    for d in &e.devices {
        let used = d.peak + d.headroom;
        let _ = writeln!(
            s,
            "  {:<10} {:>10} + {:>8} / {:>10}  {:>3.0}%{}",
            d.device.to_string(),
            ByteSize(d.peak).human(),
            ByteSize(d.headroom).human(),
            ByteSize(d.budget).human(),
            100.0 * used as f64 / d.budget as f64,
            if d.peak == 0 {
                "  (unused)".to_string()
            } else if d.libraries > 0 {
                format!("  (CUDA libraries {})", ByteSize(d.libraries).human())
            } else {
                String::new()
            }
        );
    }
    let _ = writeln!(
        s,
        "  host pinned {} / {}",
        ByteSize(e.host_pinned).human(),
        ByteSize(e.host_pinned_limit).human()
    );
    let _ = writeln!(
        s,
        "\nsolver: {}, {}, objective {} = {:.4}, {:.1} ms for {} strategy families",
        p.solver.solver,
        p.solver.status,
        p.solver.objective,
        p.solver.objective_value,
        o.solve_time_ms,
        o.families.len()
    );
    let _ = writeln!(s, "\nbest plan of each strategy family:");
    let _ = writeln!(
        s,
        "  {:<24} {:>10} {:>10} {:>12} {:>9}  status",
        "family", "step", "request", "peak/budget", "streamed"
    );
    for f in &o.families {
        let mark = if f.family.name() == p.solver.strategy {
            "*"
        } else {
            " "
        };
        match (f.step_time_s, f.request_time_s) {
            (Some(st), Some(rq)) => {
                let _ = writeln!(
                    s,
                    "{mark} {:<24} {:>10} {:>10} {:>11.0}% {:>9}  {} ({:.1} ms)",
                    f.family.describe(),
                    secs(st),
                    secs(rq),
                    100.0 * f.max_peak_fraction.unwrap_or(0.0),
                    f.streamed_blocks.unwrap_or(0),
                    f.status,
                    f.solve_time_ms
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "{mark} {:<24} {:>10} {:>10} {:>12} {:>9}  {}",
                    f.family.describe(),
                    "-",
                    "-",
                    "-",
                    "-",
                    f.status
                );
            }
        }
    }
    if !o.cfg_modes.is_empty() {
        let _ = writeln!(s, "\ntrue CFG modes (families above: the chosen mode's):");
        let _ = writeln!(
            s,
            "  {:<10} {:>10} {:>10}  strategy / status",
            "mode", "step", "request"
        );
        for c in &o.cfg_modes {
            let mark = if c.chosen { "*" } else { " " };
            match (c.step_time_s, c.request_time_s) {
                (Some(st), Some(rq)) => {
                    let _ = writeln!(
                        s,
                        "{mark} {:<10} {:>10} {:>10}  {}",
                        c.mode.name(),
                        secs(st),
                        secs(rq),
                        c.strategy.as_deref().map(family_desc).unwrap_or("")
                    );
                }
                _ => {
                    let _ = writeln!(
                        s,
                        "{mark} {:<10} {:>10} {:>10}  {}",
                        c.mode.name(),
                        "-",
                        "-",
                        c.status
                    );
                }
            }
        }
    }
    if let Some(t) = &o.throughput {
        s += &throughput_table(t);
    }
    s
}

/// Each replica's devices: `cuda:0 | cuda:1`.
fn replica_list(devices: &[Vec<DeviceId>]) -> String {
    devices
        .iter()
        .map(|d| device_list(d))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The throughput objective's candidates: one row per replica width.
fn throughput_table(t: &crate::Throughput) -> String {
    let mut s = String::new();
    let bound = t
        .max_latency_s
        .map(|b| format!(", a request within --max-latency {}", secs(b)))
        .unwrap_or_default();
    let _ = writeln!(
        s,
        "\nthroughput with {} request{} in flight{bound}:",
        t.clients,
        if t.clients == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        s,
        "  {:<28} {:<20} {:>10} {:>10} {:>11}  status",
        "replicas", "strategy", "request", "latency", "images/min"
    );
    for (i, c) in t.candidates.iter().enumerate() {
        let mark = if i == t.chosen { "*" } else { " " };
        match (c.request_time_s, c.latency_s, c.images_per_s) {
            (Some(rq), Some(lat), Some(ips)) => {
                let status = if c.within_bound {
                    c.status.clone()
                } else {
                    format!("{}; request over the bound", c.status)
                };
                let _ = writeln!(
                    s,
                    "{mark} {:<28} {:<20} {:>10} {:>10} {:>11.1}  {status}",
                    format!("{} × {}", c.replicas, replica_list(&c.devices)),
                    c.strategy.map(Family::describe).unwrap_or("-"),
                    secs(rq),
                    secs(lat),
                    ips * 60.0
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "{mark} {:<28} {:<20} {:>10} {:>10} {:>11}  {}",
                    format!("{} device(s) each", c.width),
                    "-",
                    "-",
                    "-",
                    "-",
                    c.status
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "  (request: one request on its replica; latency: from submission, waiting included, mean)"
    );
    s
}

/// A parallel part's collectives and the link they take.
fn link(machine: Option<&mold_machine::Machine>, p: &Part) -> String {
    let what = match (p.tp > 1, p.sp > 1) {
        (true, false) => "all-reduce",
        (false, true) => "all-to-all",
        _ => "all-reduce, all-to-all",
    };
    match machine.map(|m| m.group_link(&p.devices)) {
        Some(l) if l.staged => format!(" ({what} staged through host)"),
        Some(l) => format!(
            " ({what} over {})",
            match l.kind {
                Some(mold_machine::LinkKind::Nvlink) => "NVLink",
                _ => "PCIe peer",
            }
        ),
        None => String::new(),
    }
}

fn family_desc(name: &str) -> &'static str {
    Family::ALL
        .iter()
        .find(|f| f.name() == name)
        .map(|f| f.describe())
        .unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::decimal_bytes;

    #[test]
    fn sizes_take_the_unit_that_suits_them() {
        assert_eq!(decimal_bytes(23_800_000_000), "23.8 GB");
        assert_eq!(decimal_bytes(3_200_000), "3.2 MB");
        assert_eq!(decimal_bytes(850_000), "850.0 kB");
        assert_eq!(decimal_bytes(512), "512 B");
        assert_eq!(decimal_bytes(0), "0 B");
    }
}
