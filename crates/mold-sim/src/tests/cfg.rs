//! True CFG's passes on the timeline (serial, CFG-parallel, pipelined micro-batches) and
//! memory by phase, against the closed form.

use crate::*;
use mold_plan::{MemoryPhases, Plan};

fn machine() -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join("sim/machines/2x-h200.yaml")).unwrap()
}

/// qwen-image on 2x-h200: the encoder and VAE on cuda:0, the transformer's blocks
/// `a..30` on cuda:0 and `30..60` on cuda:1 (`split`), or all on cuda:0.
fn plan(mode: Option<&str>, split: bool, phases: &str, m: &Machine) -> Plan {
    let cuts: &[u32] = if split { &[30] } else { &[] };
    plan_cut(mode, cuts, phases, m)
}

/// As [`plan`], the transformer's 60 blocks cut at `cuts` over cuda:0, cuda:1, ….
fn plan_cut(mode: Option<&str>, cuts: &[u32], phases: &str, m: &Machine) -> Plan {
    let mut parts = String::new();
    let ends: Vec<u32> = cuts.iter().copied().chain([60]).collect();
    let mut start = 0;
    for (d, end) in ends.iter().enumerate() {
        parts += &format!(
            "  - {{blocks: [block {start}..{end}], devices: [cuda:{d}], residency: resident}}\n"
        );
        start = *end;
    }
    let cfg = mode
        .map(|m| format!("cfg: {{mode: {m}}}\n"))
        .unwrap_or_default();
    let replicas = if mode == Some("parallel") {
        "replicas:\n- {cuda:0: cuda:0}\n- {cuda:0: cuda:1}\n"
    } else {
        ""
    };
    let text = format!(
        "version: 4\nmodel: {{id: qwen-image}}\nworkload: {{width: 1024, height: 1024, steps: 4, cfg_scale: 4.0}}\n{cfg}memory_phases: {phases}\nmachine: {}\ncomponents:\n- {{name: qwen2.5-vl, role: encoder, dtype: bf16, parts: [{{devices: [cuda:0], residency: resident}}]}}\n- name: transformer\n  role: transformer\n  dtype: bf16\n  parts:\n{parts}- {{name: vae, role: vae, dtype: bf16, parts: [{{devices: [cuda:0], residency: resident}}]}}\n{replicas}predicted: {}\nsolver: {{solver: hand, status: n/a, objective: none, objective_value: 0, strategy: hand, solve_time_ms: 0}}\n",
        serde_json::to_string(&m.identity()).unwrap(),
        serde_json::to_string(&mold_cost::Evaluation::default_prediction()).unwrap(),
    );
    Plan::from_yaml(&text, "cfg.yaml").unwrap()
}

fn model() -> ModelSpec {
    mold_models::find("qwen-image").unwrap()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs())
}

/// With every refinement off the simulation replays the closed form's step, for each
/// CFG mode.
#[test]
fn planner_replay_equals_the_closed_form_per_mode() {
    let m = machine();
    let model = model();
    for (mode, split) in [
        (None, true),
        (Some("serial"), true),
        (Some("pipelined"), true),
        (Some("parallel"), false),
    ] {
        let p = plan(mode, split, "resident", &m);
        let e = mold_cost::evaluate(&p, &model, &m);
        let r = simulate_with(&p, &model, &m, SimOptions::planner()).unwrap();
        assert!(
            close(r.step_s, e.step_s, 1e-9),
            "{mode:?}: simulated {} vs closed form {}",
            r.step_s,
            e.step_s
        );
        let fine = simulate(&p, &model, &m).unwrap();
        assert!(fine.fits(), "{mode:?}");
        assert!(close(fine.step_s, e.step_s, 0.05), "{mode:?}");
    }
}

/// Pipelined: both micro-batches on each device, the second stage's first micro-batch
/// overlapping the first stage's second.
#[test]
fn pipelined_micro_batches_overlap_across_devices() {
    let m = machine();
    let r = simulate(&plan(Some("pipelined"), true, "resident", &m), &model(), &m).unwrap();
    let blocks = |dev: &str, mb: &str| -> Vec<&Event> {
        r.events
            .iter()
            .filter(|e| {
                e.device.to_string() == dev
                    && e.kind == EventKind::Block
                    && e.phase.starts_with("step 2,")
                    && e.phase.contains(mb)
            })
            .collect()
    };
    for dev in ["cuda:0", "cuda:1"] {
        for mb in ["mb0", "mb1"] {
            assert_eq!(blocks(dev, mb).len(), 30, "{dev} {mb}");
        }
    }
    // cuda:0 runs mb1 while cuda:1 runs mb0.
    let c0_mb1 = blocks("cuda:0", "mb1");
    let c1_mb0 = blocks("cuda:1", "mb0");
    let (a0, a1) = (c0_mb1[0].start_s, c0_mb1.last().unwrap().end_s);
    let (b0, b1) = (c1_mb0[0].start_s, c1_mb0.last().unwrap().end_s);
    assert!(
        a0 < b1 && b0 < a1,
        "no overlap: [{a0}, {a1}] vs [{b0}, {b1}]"
    );
    // The timeline draws the second micro-batch lighter.
    assert!(r.svg().contains("fill-opacity=\"0.55\""));
    // Faster than serial on the same split.
    let serial = simulate(&plan(Some("serial"), true, "resident", &m), &model(), &m).unwrap();
    assert!(
        r.step_s < 0.8 * serial.step_s,
        "{} {}",
        r.step_s,
        serial.step_s
    );
}

/// Pipelined: a stage takes its second micro-batch only once it has handed its first
/// one on (the executor's stage thread makes the copy and waits for it), so the replay
/// of the planner's model is the closed form's `pass + max(t_i + h …, t_last)`
/// whichever stage is the slowest, over two stages and three.
#[test]
fn pipelined_stage_waits_for_its_hand_off() {
    let model = model();
    let h100 = {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        Machine::load(&root.join("sim/machines/4x-h100.yaml")).unwrap()
    };
    let cases: [(&Machine, &[u32]); 6] = [
        (&machine(), &[30]),
        (&machine(), &[29]),
        (&machine(), &[31]),
        (&h100, &[20, 40]),
        (&h100, &[25, 50]),
        (&h100, &[10, 30]),
    ];
    for (m, cuts) in cases {
        let p = plan_cut(Some("pipelined"), cuts, "resident", m);
        let e = mold_cost::evaluate(&p, &model, m);
        let h = e.handoff_s / cuts.len() as f64;
        assert!(h > 0.0);
        assert!(close(
            e.bottleneck_s,
            mold_cost::pipelined_bottleneck(&e.stage_s, h),
            1e-12
        ));
        let r = simulate_with(&p, &model, m, SimOptions::planner()).unwrap();
        assert!(
            close(r.step_s, e.step_s, 1e-9),
            "{cuts:?}: simulated {} vs closed form {}",
            r.step_s,
            e.step_s
        );
        // Event by event: the first stage's second micro-batch starts when its first
        // one's hand-off to the second stage ends.
        let fine = simulate(&p, &model, m).unwrap();
        let handoff_end = fine
            .events
            .iter()
            .filter(|e| e.kind == EventKind::HandOff && e.phase == "step 2, mb0, part 2")
            .map(|e| e.end_s)
            .fold(0.0, f64::max);
        let mb1_start = fine
            .events
            .iter()
            .filter(|e| {
                e.device.to_string() == "cuda:0"
                    && e.kind == EventKind::Block
                    && e.phase == "step 2, mb1, part 1"
            })
            .map(|e| e.start_s)
            .fold(f64::INFINITY, f64::min);
        assert!(handoff_end > 0.0 && mb1_start.is_finite(), "{cuts:?}");
        assert!(
            close(mb1_start, handoff_end, 1e-12),
            "{cuts:?}: mb1 starts at {mb1_start}, mb0's hand-off ends at {handoff_end}"
        );
    }
}

/// CFG-parallel: the unconditional pass on cuda:1 at the same time as the conditional
/// one on cuda:0, then its output to cuda:0.
#[test]
fn parallel_runs_the_passes_at_once_and_combines() {
    let m = machine();
    let p = plan(Some("parallel"), false, "resident", &m);
    let r = simulate(&p, &model(), &m).unwrap();
    let first = |dev: &str, pass: &str| {
        r.events
            .iter()
            .find(|e| {
                e.device.to_string() == dev
                    && e.kind == EventKind::Block
                    && e.phase.starts_with(&format!("step 1, {pass},"))
            })
            .unwrap()
            .start_s
    };
    assert_eq!(first("cuda:0", "cond"), first("cuda:1", "uncond"));
    assert!(r.events.iter().any(
        |e| e.phase == "step 1, combine" && e.what.contains("unconditional output from cuda:1")
    ));
    // cuda:1 holds a transformer, and nothing of the encoder or the VAE.
    let d1 = r.device(&mold_plan::DeviceId::Cuda(1)).unwrap();
    assert!(d1
        .peak_live
        .iter()
        .all(|l| !l.what.contains("qwen2.5-vl weights") && !l.what.contains("vae weights")));
    assert!(d1.weights > 30 * mold_plan::GIB);
}

/// One-shot: the encoder is freed before the transformer loads, so cuda:0's peak is the
/// larger phase, not their sum.
#[test]
fn one_shot_peaks_by_phase() {
    let m = machine();
    let model = model();
    let resident = plan(Some("serial"), false, "resident", &m);
    let mut shot = resident.clone();
    shot.memory_phases = MemoryPhases::OneShot;
    let (e_r, e_s) = (
        mold_cost::evaluate(&resident, &model, &m),
        mold_cost::evaluate(&shot, &model, &m),
    );
    let (r_r, r_s) = (
        simulate_with(&resident, &model, &m, SimOptions::planner()).unwrap(),
        simulate_with(&shot, &model, &m, SimOptions::planner()).unwrap(),
    );
    let d = mold_plan::DeviceId::Cuda(0);
    // The replay's peaks are the closed form's, in either mode.
    assert_eq!(r_r.device(&d).unwrap().peak, e_r.devices[0].peak);
    assert_eq!(r_s.device(&d).unwrap().peak, e_s.devices[0].peak);
    assert_eq!(e_s.devices[0].peak, e_s.devices[0].phases.denoise);
    assert!(e_s.devices[0].peak + 15 * mold_plan::GIB < e_r.devices[0].peak);
    // The encoder's weights are gone when the first block runs.
    let fine = simulate(&shot, &model, &m).unwrap();
    let c0 = fine.device(&d).unwrap();
    assert!(c0.peak_moment.starts_with("step"), "{}", c0.peak_moment);
    assert!(c0
        .peak_live
        .iter()
        .all(|l| !l.what.contains("qwen2.5-vl weights")));
    assert_eq!(fine.workload.cfg_scale, Some(4.0));
}
