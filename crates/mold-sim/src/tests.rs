//! Pins the simulator's arithmetic on a toy model whose figures are round numbers.
//!
//! Toy block: 250 M joint weights (bf16: 500 MB), 2 heads of dim 1, 2 all-reduces; the
//! workload is 16x16 with 1 text token, so 1 image + 1 text token (T = 2). FLOPs per
//! block on one device: 2·P·T + 4·(heads·head_dim)·T² = 1e9 + 32. A device of 1 TFLOP/s
//! and 1000 GB/s runs it in ~1 ms (reading 500 MB takes 0.5 ms: compute-bound), plus
//! its element-wise passes: (7·hidden·2 + 12·hidden + 2·mlp) = 34 M elements a token,
//! 136 MB for T = 2 in bf16, 0.136 ms at 1000 GB/s on any rank.

use super::*;
use mold_cost::Evaluation;
use mold_models::{Attention, BlockKind, LatentSpec, TransformerSpec};
use mold_plan::{
    BlockRange, ComponentPlan, ComponentRole, DType, ModelRef, Part, Residency, SolverRecord,
};

const P: u64 = 250_000_000;

fn toy_model(count: u32) -> ModelSpec {
    let w = Workload {
        width: 16,
        height: 16,
        frames: 1,
        batch: 1,
        steps: 1,
        guidance: None,
        cfg_scale: None,
    };
    ModelSpec {
        id: "toy".into(),
        description: "toy".into(),
        components: vec![],
        transformer: TransformerSpec {
            kinds: vec![BlockKind {
                name: "blk".into(),
                count,
                hidden: 1_000_000,
                heads: 2,
                head_dim: 1,
                mlp_hidden: 4_000_000,
                img_params: 0,
                txt_params: 0,
                joint_params: P,
                per_sample_params: 0,
                replicated_params: 0,
                attention: Attention::Joint,
                allreduces: 2,
                streams: 1,
                checkpoint_bytes: None,
                checkpoint_dtype: None,
            }],
            stem_params: 0,
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::Bf16,
            modulation_ahead: false,
        },
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        text_tokens: 1,
        video: false,
        default_workload: w,
    }
}

/// cuda:0 1 TFLOP/s, cuda:1 0.5 TFLOP/s (for heterogeneous groups), cuda:2 like
/// cuda:0; cuda:0 and cuda:1 share a peer domain (10 µs + 100 GB/s all-reduce), cuda:2
/// reaches the others through the host.
fn toy_machine(pinned_gbps: f64, budget: u64) -> Machine {
    let yaml = format!(
        r#"
name: toy
calibration: {{source: spec-sheet}}
host: {{memory: 64GiB, pinned_limit: 32GiB, tflops: 1.0, mem_bandwidth_gbps: 50}}
devices:
- {{id: cuda:0, name: A, memory: 80GiB, budget: {budget}, headroom: 1000000, bf16_tflops: 1, mem_bandwidth_gbps: 1000}}
- {{id: cuda:1, name: B, memory: 80GiB, budget: {budget}, headroom: 1000000, bf16_tflops: 0.5, mem_bandwidth_gbps: 1000}}
- {{id: cuda:2, name: A, memory: 80GiB, budget: {budget}, headroom: 1000000, bf16_tflops: 1, mem_bandwidth_gbps: 1000}}
links:
  host_pinned_gbps: {pinned_gbps}
  host_pageable_gbps: 10
  peer:
  - {{devices: [cuda:0, cuda:1], kind: nvlink, gbps: 100, allreduce: {{latency_us: 10, gbps: 100}}}}
"#
    );
    Machine::from_yaml(&yaml, "toy.yaml").unwrap()
}

fn part(blocks: (u32, u32), devices: &[u32], streamed: Option<u32>) -> Part {
    Part {
        blocks: vec![BlockRange::new("blk", blocks.0, blocks.1)],
        devices: devices.iter().map(|&d| DeviceId::Cuda(d)).collect(),
        tp: devices.len() as u32,
        sp: 1,
        residency: if streamed.is_some() {
            Residency::Streamed
        } else {
            Residency::Resident
        },
        stream_buffers: streamed,
    }
}

fn toy_plan(model: &ModelSpec, machine: &Machine, parts: Vec<Part>, steps: u32) -> Plan {
    let mut w = model.default_workload.clone();
    w.steps = steps;
    Plan {
        version: mold_plan::PLAN_VERSION,
        model: ModelRef {
            id: model.id.clone(),
            checkpoint: None,
        },
        workload: w,
        cfg: None,
        memory_phases: Default::default(),
        machine: machine.identity(),
        components: vec![ComponentPlan {
            name: "transformer".into(),
            role: ComponentRole::Transformer,
            dtype: DType::Bf16,
            attention: None,
            parts,
        }],
        replicas: None,
        predicted: Evaluation::default_prediction(),
        solver: SolverRecord {
            solver: "test".into(),
            status: "test".into(),
            objective: "none".into(),
            objective_value: 0.0,
            strategy: "test".into(),
            solve_time_ms: 0.0,
        },
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
}

/// Element-wise seconds of one toy block on one rank of any group without sequence
/// parallel: 136 MB at 1000 GB/s.
const ELEMENTWISE: f64 = 136e6 / 1000e9;

/// Compute seconds of one toy block on `tflops`, at tensor-parallel degree `tp`:
/// (2·P·T + 4·(heads·head_dim)·T²) / tp / (tflops·1e12), with T = 2, plus the
/// element-wise passes every rank runs in full.
fn compute(tflops: f64, tp: f64) -> f64 {
    (2.0 * P as f64 * 2.0 + 4.0 * 2.0 * 4.0) / tp / (tflops * 1e12) + ELEMENTWISE
}

fn events(r: &SimReport, dev: u32, lane: Lane, step: u32) -> Vec<&Event> {
    let tag = format!("step {step},");
    r.events
        .iter()
        .filter(|e| e.device == DeviceId::Cuda(dev) && e.lane == lane && e.phase.starts_with(&tag))
        .collect()
}

#[test]
fn resident_chain_is_the_sum_of_its_blocks() {
    let m = toy_model(4);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], None)], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let c = compute(1.0, 1.0);
    assert!(close(c, 1.000000032e-3 + 1.36e-4), "{c}");
    assert!(close(r.step_s, 4.0 * c), "{} vs {}", r.step_s, 4.0 * c);
    let ev = events(&r, 0, Lane::Compute, 1);
    assert_eq!(ev.len(), 4);
    for (i, e) in ev.iter().enumerate() {
        assert!(close(e.start_s, i as f64 * c));
    }
    // The closed form agrees exactly on a resident chain.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(close(r.step_s, eval.step_s));
    assert!(!r.first_step_differs);
    assert!(r.fits());
}

#[test]
fn streaming_copy_bound_exposes_only_the_first_copy() {
    // 500 MB at 250 GB/s: copy 2 ms > compute 1 ms.
    let m = toy_model(4);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(2))], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let (k, c): (f64, f64) = (2e-3, compute(1.0, 1.0));
    // First copy exposed, then max(copy, compute) a block, then the last compute.
    let want = k + 3.0 * k.max(c) + c;
    assert!(close(r.step_s, want), "{} vs {want}", r.step_s);
    // Compute of block i starts when its copy lands: (i+1)·k.
    for (i, e) in events(&r, 0, Lane::Compute, 1).iter().enumerate() {
        assert!(
            close(e.start_s, (i + 1) as f64 * k),
            "block {i}: {}",
            e.start_s
        );
    }
    // The planner's closed form: n·max + min(copy, compute).
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(close(eval.step_s, 4.0 * k + c));
    assert!(close(r.step_s, eval.step_s));
}

/// The toy machine with a busy host→device rate: `ratio` of the idle one.
fn toy_machine_busy(pinned_gbps: f64, ratio: f64) -> Machine {
    let mut mc = toy_machine(pinned_gbps, 60_000_000_000);
    mc.links.host_pinned_busy_gbps = Some(pinned_gbps * ratio);
    mc.validate("toy.yaml").unwrap();
    mc
}

#[test]
fn copies_beside_compute_run_at_the_busy_rate() {
    // Copy-bound (k = 2 ms, c ≈ 1.14 ms) with copies at half rate while the device
    // computes: the first copy runs alone; each later one shares c with the block
    // before it, so it ends k + (1 − ρ)·c after it starts.
    let m = toy_model(4);
    let (k, c, rho) = (2e-3, compute(1.0, 1.0), 0.5);
    let mc = toy_machine_busy(250.0, rho);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(2))], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let want = k + 3.0 * (k + (1.0 - rho) * c) + c;
    assert!(close(r.step_s, want), "{} vs {want}", r.step_s);
    let copies = events(&r, 0, Lane::Copy, 1);
    assert!(close(copies[0].duration_s(), k));
    for e in &copies[1..] {
        assert!(close(e.duration_s(), k + (1.0 - rho) * c), "{e:?}");
    }
    // Slower than the same plan on a profile without a busy rate (4k + c) ...
    let idle = toy_machine(250.0, 60_000_000_000);
    let r_idle = simulate(&plan, &m, &idle).unwrap();
    assert!(close(r_idle.step_s, 4.0 * k + c));
    assert!(r.step_s > r_idle.step_s + 1e-4);
    // ... and the planner's closed form charges the same.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(close(eval.step_s, want), "{} vs {want}", eval.step_s);
    // A busy rate equal to the idle one changes nothing.
    let same = toy_machine_busy(250.0, 1.0);
    assert!(close(
        simulate(&plan, &m, &same).unwrap().step_s,
        r_idle.step_s
    ));
}

#[test]
fn copy_end_integrates_the_busy_rate() {
    use crate::engine::copy_end;
    let busy = [(1.0, 2.0), (3.0, 5.0)];
    // Idle all the way.
    assert_eq!(copy_end(&busy, 5.0, 1.0, 0.5), 6.0);
    assert_eq!(copy_end(&busy, 0.0, 0.5, 0.5), 0.5);
    // 1 s idle, then 1 s busy at half rate (0.5 done), then 0.5 idle.
    assert!(close(copy_end(&busy, 0.0, 2.0, 0.5), 2.5));
    // Starting inside an interval: 0.5 s busy = 0.25, then 1 s idle, then busy.
    assert!(close(copy_end(&busy, 1.5, 1.5, 0.5), 3.5));
    // Past the last interval.
    assert!(close(
        copy_end(&busy, 0.0, 10.0, 0.5),
        5.0 + (10.0 - 1.0 - 0.5 - 1.0 - 1.0)
    ));
    // Ratio 1: the idle time, whatever runs.
    assert_eq!(copy_end(&busy, 0.0, 2.0, 1.0), 2.0);
}

#[test]
fn streaming_compute_bound_hides_copies_after_the_first() {
    // 500 MB at 1000 GB/s: copy 0.5 ms < compute 1 ms.
    let m = toy_model(4);
    let mc = toy_machine(1000.0, 60_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(2))], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let (k, c) = (0.5e-3, compute(1.0, 1.0));
    assert!(close(r.step_s, k + 4.0 * c), "{}", r.step_s);
    // Two buffers: block 2's copy waits for block 0's compute to free its buffer.
    let copies = events(&r, 0, Lane::Copy, 1);
    assert!(close(copies[1].start_s, k));
    assert!(close(copies[2].start_s, k + c), "{}", copies[2].start_s);
    // Three buffers: it starts as soon as the copy stream is free.
    let plan3 = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(3))], 1);
    let r3 = simulate(&plan3, &m, &mc).unwrap();
    let copies = events(&r3, 0, Lane::Copy, 1);
    assert!(close(copies[2].start_s, 2.0 * k));
    assert!(close(copies[3].start_s, k + c), "{}", copies[3].start_s);
}

#[test]
fn earlier_compute_hides_the_first_streamed_copy() {
    // Resident blocks 0..2, then streamed 2..4 on the same device: the copy stream is
    // idle during the resident blocks, so the streamed copies are done before they run.
    let m = toy_model(4);
    let mc = toy_machine(1000.0, 60_000_000_000);
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 2), &[0], None), part((2, 4), &[0], Some(2))],
        1,
    );
    let r = simulate(&plan, &m, &mc).unwrap();
    let (k, c) = (0.5e-3, compute(1.0, 1.0));
    assert!(close(r.step_s, 4.0 * c), "{}", r.step_s);
    // The planner charges the fill; the planner-model replay does too.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(close(eval.step_s, 4.0 * c + k));
    let coarse = simulate_with(&plan, &m, &mc, SimOptions::planner()).unwrap();
    assert!(close(coarse.step_s, eval.step_s), "{}", coarse.step_s);
    let cmp = {
        let mut p = plan.clone();
        p.predicted.step_time_s = eval.step_s;
        compare(&p, &m, &mc).unwrap()
    };
    assert!(
        cmp.explain().contains("streamed copies run ahead"),
        "{}",
        cmp.explain()
    );
}

#[test]
fn allreduce_waits_for_the_slowest_rank() {
    // TP over cuda:0 (1 TFLOP/s) and cuda:1 (0.5 TFLOP/s): each computes half.
    let m = toy_model(1);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 1), &[0, 1], None)], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let fast = compute(1.0, 2.0);
    let slow = compute(0.5, 2.0);
    // One all-reduce of S = T·hidden·2 bytes over n = 2 ranks:
    // latency + 2(n−1)/n · S / bandwidth.
    let s_bytes = 2.0 * 1e6 * 2.0;
    let one = 10e-6 + 2.0 * (2.0 - 1.0) / 2.0 * s_bytes / 100e9;
    assert!(close(one, 50e-6));
    let c0 = events(&r, 0, Lane::Compute, 1);
    let c1 = events(&r, 1, Lane::Compute, 1);
    assert!(close(c0[0].duration_s(), fast));
    assert!(close(c1[0].duration_s(), slow));
    for d in [0, 1] {
        let ar = events(&r, d, Lane::Comm, 1);
        assert_eq!(ar.len(), 1);
        assert_eq!(ar[0].kind, EventKind::AllReduce);
        assert!(
            close(ar[0].start_s, slow),
            "all-reduce starts at {}",
            ar[0].start_s
        );
        assert!(close(ar[0].duration_s(), 2.0 * one));
    }
    assert!(close(r.step_s, slow + 2.0 * one));
    // The all-reduce buffer is live beside the block's activations at the peak.
    let d0 = r.device(&DeviceId::Cuda(0)).unwrap();
    assert!(d0.peak_live.iter().any(|l| l.what == "all-reduce buffer"));
}

#[test]
fn handoff_uses_the_actual_link() {
    let m = toy_model(2);
    let mc = toy_machine(250.0, 60_000_000_000);
    let c = compute(1.0, 1.0);
    let hb = 2.0 * 1e6 * 2.0; // (img + txt) · hidden · 2 bytes
                              // cuda:0 → cuda:2: no peer path, staged through host at pinned / 2 = 125 GB/s.
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 1), &[0], None), part((1, 2), &[2], None)],
        1,
    );
    let r = simulate(&plan, &m, &mc).unwrap();
    assert!(close(r.step_s, 2.0 * c + hb / 125e9), "{}", r.step_s);
    // cuda:0 → cuda:1 over the peer domain at 100 GB/s; the planner prices the slowest
    // path of the machine (125 GB/s staged is faster here, but cuda:1 computes slower).
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 1), &[0], None), part((1, 2), &[1], None)],
        1,
    );
    let r = simulate(&plan, &m, &mc).unwrap();
    assert!(
        close(r.step_s, c + hb / 100e9 + compute(0.5, 1.0)),
        "{}",
        r.step_s
    );
    let h = events(&r, 1, Lane::Comm, 1);
    assert_eq!(h[0].kind, EventKind::HandOff);
    assert!(h[0].what.contains("peer"), "{}", h[0].what);
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    let coarse = simulate_with(&plan, &m, &mc, SimOptions::planner()).unwrap();
    assert!(
        close(coarse.step_s, eval.step_s),
        "{} vs {}",
        coarse.step_s,
        eval.step_s
    );
}

#[test]
fn overrun_names_device_moment_and_what_was_live() {
    // Weights 4 × 500 MB = 2 GB; activations of a block 2 · (2h + 4h + mlp) · 2 = 40 MB.
    let m = toy_model(4);
    let budget = 2_020_000_000u64;
    let mc = toy_machine(250.0, budget);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], None)], 3);
    let r = simulate(&plan, &m, &mc).unwrap();
    assert!(!r.fits());
    assert_eq!(r.overflows.len(), 1);
    let o = &r.overflows[0];
    assert_eq!(o.device, "cuda:0");
    assert_eq!(o.moment, "step 1, part 1, blk 0");
    assert!(
        o.message.starts_with("cuda:0: over budget"),
        "{}",
        o.message
    );
    assert!(o.message.contains("step 1, part 1, blk 0"), "{}", o.message);
    assert!(
        o.message.contains("transformer blocks blk 0..4"),
        "{}",
        o.message
    );
    assert!(o.message.contains("activations of blk 0"), "{}", o.message);
    let d = r.device(&DeviceId::Cuda(0)).unwrap();
    assert_eq!(d.peak, 2_000_000_000 + 40_000_000);
    // Memory with the planner's accounting matches the closed form exactly.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    let coarse = simulate_with(&plan, &m, &mc, SimOptions::planner()).unwrap();
    assert_eq!(coarse.devices[0].peak, eval.devices[0].peak);
}

#[test]
fn host_pinned_overrun_names_host() {
    let m = toy_model(4);
    let mut mc = toy_machine(250.0, 60_000_000_000);
    mc.host.pinned_limit = mold_plan::ByteSize(1_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(2))], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    assert_eq!(r.host.pinned, 2_000_000_000);
    let o = r.overflows.iter().find(|o| o.device == "host").unwrap();
    assert!(
        o.message.starts_with("host: pinned memory"),
        "{}",
        o.message
    );
    assert!(
        o.message.contains("streamed weights of part 1"),
        "{}",
        o.message
    );
}

#[test]
fn steps_after_the_first_repeat_and_request_extrapolates() {
    let m = toy_model(4);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], Some(2))], 10);
    let r = simulate(&plan, &m, &mc).unwrap();
    assert_eq!(r.simulated_steps, 3);
    let (k, c): (f64, f64) = (2e-3, compute(1.0, 1.0));
    // Copy-bound: the copy stream runs ahead into the next step, so only the first
    // step pays the pipeline fill.
    assert!(close(r.first_step_s, 4.0 * k + c));
    assert!(close(r.step_s, 4.0 * k), "{}", r.step_s);
    assert!(r.first_step_differs);
    assert!(
        close(r.request_s, r.first_step_s + 9.0 * r.step_s),
        "{}",
        r.request_s
    );
    assert!(r.steps_note().contains("first step differs"));
}

#[test]
fn invalid_plans_are_one_line_errors() {
    let m = toy_model(4);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 1), &[0], None), part((2, 4), &[0], None)],
        1,
    );
    let e = simulate(&plan, &m, &mc).unwrap_err().to_string();
    assert!(e.contains("leaves a gap") && !e.contains('\n'), "{e}");
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[7], None)], 1);
    let e = simulate(&plan, &m, &mc).unwrap_err().to_string();
    assert!(e.contains("cuda:7 is not a device"), "{e}");
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0, 1, 2], None)], 1);
    let e = simulate(&plan, &m, &mc).unwrap_err().to_string();
    assert!(e.contains("does not divide"), "{e}");
    let mut plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], None)], 1);
    plan.model.id = "nope".into();
    let e = prepare(&plan, &mc, false).unwrap_err().to_string();
    assert!(e.contains("unknown model `nope`"), "{e}");
    // Another machine: an error, or a warning with force.
    let plan = toy_plan(&m, &mc, vec![part((0, 4), &[0], None)], 1);
    let other = mc.select(&[DeviceId::Cuda(0)]).unwrap();
    let e = mold_cost::check_machine(&plan, &other, false).unwrap_err();
    assert!(e.to_string().contains("--force"));
}

#[test]
fn svg_has_lanes_memory_and_axis() {
    let m = toy_model(4);
    let mc = toy_machine(250.0, 60_000_000_000);
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 2), &[0, 1], None), part((2, 4), &[2], Some(2))],
        5,
    );
    let r = simulate(&plan, &m, &mc).unwrap();
    let svg = r.svg();
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    for want in [
        r#"data-lane="compute""#,
        r#"data-lane="copy""#,
        r#"data-lane="comm""#,
        r#"id="dev-cuda-0""#,
        r#"id="dev-cuda-2""#,
        "budget",
        "time (ms)",
        "steps 4–5 repeat step 3",
    ] {
        assert!(svg.contains(want), "missing {want}");
    }
    assert_eq!(svg.matches("<g").count(), svg.matches("</g>").count());
    let t = r.table();
    assert!(t.contains("cuda:0") && t.contains("bottleneck:"), "{t}");
    let j: serde_json::Value = serde_json::from_str(&r.to_json(None)).unwrap();
    assert_eq!(j["fits"], true);
}

#[test]
fn sequence_parallel_all_to_alls_and_closing_all_gather() {
    // SP over cuda:0 (1 TFLOP/s) and cuda:1 (0.5 TFLOP/s), two blocks: each rank runs the
    // linears on 1 of the 2 tokens and attention on 1 of the 2 heads over both tokens.
    let m = toy_model(2);
    let mc = toy_machine(250.0, 60_000_000_000);
    let mut p = part((0, 2), &[0, 1], None);
    (p.tp, p.sp) = (1, 2);
    let plan = toy_plan(&m, &mc, vec![p], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    // Per rank: (2·P·1 + 4·2·4 / 2) FLOPs, and the element-wise passes on 1 token.
    let per_rank = |tflops: f64| (2.0 * P as f64 + 16.0) / (tflops * 1e12) + ELEMENTWISE / 2.0;
    let slow = per_rank(0.5);
    // Two all-to-alls a block over the 10 µs + 100 GB/s link: q, k and v stacked (3
    // shards of 1 token × hidden × 2 bytes, half of each sent) and the output (1 shard),
    // with the copy after them (2 shards at 1000 GB/s: the output's pieces joined); one
    // all-gather of the
    // other rank's half of the hidden state (2 tokens × hidden × 2 bytes) at the end.
    let a2a = (10e-6 + 3e6 / 100e9) + (10e-6 + 1e6 / 100e9) + 2.0 * 2e6 / 1000e9;
    let gather = 10e-6 + 2e6 / 100e9;
    for d in [0, 1] {
        let comm = events(&r, d, Lane::Comm, 1);
        let kinds: Vec<EventKind> = comm.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::AllToAll,
                EventKind::AllToAll,
                EventKind::AllGather
            ]
        );
        assert!(close(comm[0].start_s, slow), "{}", comm[0].start_s);
        assert!(close(comm[0].duration_s(), a2a));
        assert!(close(comm[2].duration_s(), gather));
        let c = events(&r, d, Lane::Compute, 1);
        assert!(close(c[0].duration_s(), per_rank([1.0, 0.5][d as usize])));
    }
    assert!(close(r.step_s, 2.0 * (slow + a2a) + gather), "{}", r.step_s);
    // The planner's closed form, replayed as events, is the same figure.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    let coarse = simulate_with(&plan, &m, &mc, SimOptions::planner()).unwrap();
    assert!(
        close(coarse.step_s, eval.step_s),
        "{} vs {}",
        coarse.step_s,
        eval.step_s
    );
    assert!(close(eval.step_s, r.step_s));
    // Both ranks hold every weight.
    let w = |d: u32| r.device(&DeviceId::Cuda(d)).unwrap().weights;
    assert_eq!((w(0), w(1)), (2 * 500_000_000, 2 * 500_000_000));
}

#[test]
fn sequence_parallel_part_of_a_split() {
    // Block 0 on cuda:2 alone, block 1 sequence parallel over cuda:0 and cuda:1: the
    // hand-off reaches both ranks, the run ends with an all-gather, and only the
    // sequence-parallel ranks pay all-to-alls.
    let m = toy_model(2);
    let mc = toy_machine(250.0, 60_000_000_000);
    let mut sp = part((1, 2), &[0, 1], None);
    (sp.tp, sp.sp) = (1, 2);
    let plan = toy_plan(&m, &mc, vec![part((0, 1), &[2], None), sp], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let kinds = |d: u32| -> Vec<EventKind> {
        events(&r, d, Lane::Comm, 1)
            .iter()
            .map(|e| e.kind)
            .collect()
    };
    assert_eq!(
        kinds(0),
        [
            EventKind::HandOff,
            EventKind::AllToAll,
            EventKind::AllGather
        ]
    );
    assert_eq!(kinds(1), kinds(0));
    assert!(kinds(2).is_empty());
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(eval.gather_s > 0.0 && eval.handoff_s > 0.0);
    let coarse = simulate_with(&plan, &m, &mc, SimOptions::planner()).unwrap();
    assert!(
        close(coarse.step_s, eval.step_s),
        "{} vs {}",
        coarse.step_s,
        eval.step_s
    );
}

/// `toy_machine` with cuda:2 on a second node, 20 GB/s + 50 µs InfiniBand between.
fn toy_two_nodes() -> Machine {
    let mut m = toy_machine(250.0, 60_000_000_000);
    m.devices[2].node = 1;
    m.links.inter_node = Some(mold_machine::InterNode {
        kind: mold_machine::NetworkKind::Infiniband,
        gbps: 20.0,
        latency_us: 50.0,
    });
    Machine::from_yaml(&m.to_yaml(), "toy2.yaml").unwrap()
}

#[test]
fn inter_node_transfers_and_collectives_use_the_network() {
    let m = toy_model(2);
    let mc = toy_two_nodes();
    let c = compute(1.0, 1.0);
    let hb = 2.0 * 1e6 * 2.0;
    // cuda:0 → cuda:2 across nodes: latency + bytes over the network (not the host).
    let plan = toy_plan(
        &m,
        &mc,
        vec![part((0, 1), &[0], None), part((1, 2), &[2], None)],
        1,
    );
    let r = simulate(&plan, &m, &mc).unwrap();
    assert!(close(r.step_s, 2.0 * c + 50e-6 + hb / 20e9), "{}", r.step_s);
    let h = events(&r, 2, Lane::Comm, 1);
    assert_eq!(h[0].kind, EventKind::HandOff);
    assert!(
        h[0].what.contains("InfiniBand between nodes"),
        "{}",
        h[0].what
    );
    // The closed form prices the same path (the machine's slowest) for this hand-off.
    let eval = mold_cost::evaluate(&plan, &m, &mc);
    assert!(
        close(eval.handoff_s, 50e-6 + hb / 20e9),
        "{}",
        eval.handoff_s
    );
    // Tensor parallel across the nodes: its all-reduces go over the network.
    let plan = toy_plan(&m, &mc, vec![part((0, 2), &[0, 2], None)], 1);
    let r = simulate(&plan, &m, &mc).unwrap();
    let ar: Vec<_> = events(&r, 0, Lane::Comm, 1)
        .into_iter()
        .filter(|e| e.kind == EventKind::AllReduce)
        .collect();
    assert!(!ar.is_empty());
    assert!(
        ar[0].what.contains("InfiniBand between nodes"),
        "{}",
        ar[0].what
    );
    let across = mold_cost::evaluate(&plan, &m, &mc).parts[0].allreduce_s;
    let inside = mold_cost::evaluate(
        &toy_plan(&m, &mc, vec![part((0, 2), &[0, 1], None)], 1),
        &m,
        &mc,
    )
    .parts[0]
        .allreduce_s;
    assert!(across > inside, "{across} vs {inside}");
}

mod cfg;
mod libraries;
