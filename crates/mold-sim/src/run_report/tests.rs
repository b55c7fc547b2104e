use super::*;
use crate::run_compare::check_plan;
use mold_machine::Machine;
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/run-report.json"))
        .unwrap()
}

/// A shipped plan, its machine and its simulation.
fn shipped(name: &str, machine: &str) -> (Plan, SimReport) {
    let plan = Plan::load(&root().join("plans").join(name)).unwrap();
    let m = Machine::load(&root().join("sim/machines").join(machine)).unwrap();
    let model = mold_models::find(&plan.model.id).unwrap();
    let sim = crate::simulate(&plan, &model, &m).unwrap();
    (plan, sim)
}

fn report(plan: &Plan, phases: Vec<PhaseRow>) -> RunReport {
    RunReport {
        version: RUN_REPORT_VERSION,
        plan: PlanId {
            fingerprint: plan_fingerprint(plan),
            model: plan.model.id.clone(),
            machine: plan.machine.name.clone(),
        },
        run: RunInfo {
            kind: RunKind::Pipeline,
            steps: plan.workload.steps,
            width: plan.workload.width,
            height: plan.workload.height,
            profiled: false,
            predicted_by: "mold sim".into(),
        },
        phases,
        memory: vec![],
    }
}

#[test]
fn the_compare_table_of_a_fixed_report() {
    let r = RunReport::from_json(&fixture(), "run-report.json").unwrap();
    insta::assert_snapshot!(r.table());
}

#[test]
fn the_fixed_report_round_trips() {
    let r = RunReport::from_json(&fixture(), "run-report.json").unwrap();
    let again = RunReport::from_json(&r.to_json(), "again").unwrap();
    assert_eq!(r, again);
    let (what, d) = r.largest_deviation().unwrap();
    assert_eq!(what, "encode: t5");
    assert!(d > 20.0, "{d}");
    let s = r.summary();
    assert!(
        s.starts_with("step 111.8 ms measured vs 96.2 ms predicted (+16.2 %)"),
        "{s}"
    );
}

#[test]
fn malformed_reports_are_refused_in_one_line_naming_the_field() {
    let text = fixture();
    let cases = [
        (
            text.replace("\"version\": 1", "\"version\": 2"),
            "run report version 2, this mold reads version 1",
        ),
        (text.replace("\"version\": 1,", ""), "no `version` number"),
        (
            text.replace(
                "\"kind\": \"pipeline\"",
                "\"kind\": \"pipeline\", \"colour\": 1",
            ),
            "unknown field `colour`",
        ),
        (
            text.replace("\"measured_s\": 0.2301", "\"measured_s\": -0.2301"),
            "phases[0].measured_s: -0.2301 is not a time",
        ),
        (
            text.replace(
                "\"fingerprint\": \"fnv1a:0123456789abcdef\"",
                "\"fingerprint\": \"\"",
            ),
            "plan.fingerprint: empty",
        ),
        ("{".to_string(), "not a mold run report"),
        ("[]".to_string(), "no `version` number"),
    ];
    for (bad, want) in cases {
        let e = RunReport::from_json(&bad, "run.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("run.json: "), "{e}");
        assert!(e.contains(want), "{want}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}

#[test]
fn a_report_of_another_plan_is_refused() {
    let (plan, sim) = shipped("flux-dev@2x-h200.yaml", "2x-h200.yaml");
    let r = report(&plan, predicted_phases(&plan, &sim, RunKind::Pipeline));
    check_plan(&r, "run.json", &plan, "plan.yaml").unwrap();
    let (other, _) = shipped("flux-dev@1x-rtx4090.yaml", "1x-rtx4090.yaml");
    let e = check_plan(&r, "run.json", &other, "other.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("run.json: plan.fingerprint: the report is of another plan"),
        "{e}"
    );
    assert!(e.contains("other.yaml"), "{e}");
    assert!(e.contains("flux-dev on 2x-h200"), "{e}");
    // The same plan with another workload is another plan too.
    let mut changed = plan.clone();
    changed.workload.steps += 1;
    assert!(check_plan(&r, "run.json", &changed, "changed.yaml").is_err());
}

#[test]
fn predictions_are_the_simulations() {
    let (plan, sim) = shipped("flux-dev@2x-h200.yaml", "2x-h200.yaml");
    let rows = predicted_phases(&plan, &sim, RunKind::Pipeline);
    let get = |name: &str| {
        rows.iter()
            .find(|r| r.phase == name)
            .unwrap_or_else(|| panic!("{name}: {rows:?}"))
            .predicted_s
            .unwrap()
    };
    assert_eq!(get("step"), sim.step_s);
    assert_eq!(get("encode"), sim.encode_s);
    assert_eq!(get("decode"), sim.decode_s);
    assert_eq!(get("request"), sim.request_s);
    assert_eq!(get("denoise"), sim.denoise_s);
    // Every encoder the plan places has its row.
    for c in plan
        .components
        .iter()
        .filter(|c| c.role == mold_plan::ComponentRole::Encoder)
    {
        assert!(get(&format!("encode: {}", c.name)) > 0.0, "{}", c.name);
    }
    // The parts' compute and collectives fit in the step.
    let tc = plan.transformer().unwrap();
    let mut within = 0.0;
    for pi in 0..tc.parts.len() {
        within += get(&format!("part {}: blocks", pi + 1));
        if let Some(c) = rows
            .iter()
            .find(|r| r.phase == format!("part {}: collectives", pi + 1))
        {
            within += c.predicted_s.unwrap();
        }
    }
    assert!(
        within > 0.0 && within <= sim.step_s * (1.0 + 1e-9),
        "{within} vs {}",
        sim.step_s
    );
    // A transformer-only run has no encode, decode or request rows.
    let t = predicted_phases(&plan, &sim, RunKind::Transformer);
    assert!(t.iter().all(|r| !matches!(
        r.kind,
        PhaseKind::Encode | PhaseKind::Decode | PhaseKind::Request
    )));
}

/// `plan`'s machine with measured encoder and decoder runs for its components (H200's
/// figures from issue 19: T5 32.4 ms warm, CLIP 4.7 ms, the VAE 613.5 ms), each with
/// `first` as its first use in a fresh process (T5 0.098 s, CLIP 0.105 s, VAE 0.039 s),
/// or none.
fn with_component_runs(plan: &Plan, first: bool) -> Machine {
    let mut m = Machine::load(&root().join("sim/machines/2x-h200.yaml")).unwrap();
    let model = mold_models::find(&plan.model.id).unwrap();
    let w = &plan.workload;
    let mut t = mold_machine::OpTables {
        model: plan.model.id.clone(),
        dtype: plan.transformer().unwrap().dtype,
        device: m.devices[0].name.clone(),
        gemm: vec![],
        attention: vec![],
        fp8_attention: vec![],
        elementwise_gbps: 1000.0,
        layout_copy_gbps: None,
        htod_busy_ratio: None,
        estimated: None,
        library_bytes: None,
        collectives: Default::default(),
        components: vec![],
    };
    for (name, size, warm, first_use) in [
        ("t5", model.text_tokens as u64, 0.0324, 0.098),
        ("clip", 77, 0.0047, 0.105),
        ("vae", w.width as u64 * w.height as u64, 0.6135, 0.039),
    ] {
        let c = plan.components.iter().find(|c| c.name == name).unwrap();
        t.components.push(mold_machine::ComponentPoint {
            component: name.into(),
            dtype: c.dtype,
            size,
            seconds: warm,
            first_use_seconds: first.then_some(first_use),
        });
    }
    t.sort();
    m.set_op_tables(t);
    m.validate("2x-h200.yaml").unwrap();
    m
}

/// A one-shot run's encode and decode are predicted warm plus the calibrated first use,
/// each part named in the row's note; without first-use figures, as before; the
/// simulation itself (what the planner and `mold serve` see) is warm either way.
#[test]
fn a_one_shot_run_adds_the_calibrated_first_use_to_encode_and_decode() {
    let plan = Plan::load(&root().join("plans/flux-dev@2x-h200.yaml")).unwrap();
    let model = mold_models::find(&plan.model.id).unwrap();
    let sim_on =
        |first: bool| crate::simulate(&plan, &model, &with_component_runs(&plan, first)).unwrap();
    let (with, without) = (sim_on(true), sim_on(false));
    assert!(without.first_use.is_empty(), "{:?}", without.first_use);
    assert_eq!(with.first_use.len(), 3, "{:?}", with.first_use);
    for (a, b) in [
        (with.encode_s, without.encode_s),
        (with.decode_s, without.decode_s),
        (with.request_s, without.request_s),
        (with.step_s, without.step_s),
    ] {
        assert_eq!(a, b);
    }
    let rows_with = predicted_phases(&plan, &with, RunKind::Pipeline);
    let rows_without = predicted_phases(&plan, &without, RunKind::Pipeline);
    let get = |rows: &[PhaseRow], name: &str| {
        rows.iter()
            .find(|r| r.phase == name)
            .unwrap_or_else(|| panic!("{name}: {rows:?}"))
            .clone()
    };
    let prompts = plan.workload.effective_batch() as f64;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.max(1.0);
    // Without first use: the warm measured runs, no note.
    let t5 = get(&rows_without, "encode: t5");
    assert!(close(t5.predicted_s.unwrap(), 0.0324 * prompts), "{t5:?}");
    assert_eq!(t5.note, None);
    assert_eq!(
        get(&rows_without, "encode").predicted_s,
        Some(without.encode_s)
    );
    assert_eq!(
        get(&rows_without, "decode").predicted_s,
        Some(without.decode_s)
    );
    assert_eq!(
        get(&rows_without, "request").predicted_s,
        Some(without.request_s)
    );
    // With it: warm + first use, the two parts in the note.
    for (name, first) in [
        ("encode: t5", 0.098),
        ("encode: clip", 0.105),
        ("encode", 0.098 + 0.105),
        ("decode", 0.039),
        ("request", 0.098 + 0.105 + 0.039),
    ] {
        let (a, b) = (get(&rows_with, name), get(&rows_without, name));
        let (a_s, b_s) = (a.predicted_s.unwrap(), b.predicted_s.unwrap());
        assert!(close(a_s, b_s + first), "{name}: {a_s} vs {b_s} + {first}");
        let note = a.note.unwrap_or_default();
        assert!(
            note.contains(&format!("{} warm + {} first use", ms(b_s), ms(first))),
            "{name}: {note}"
        );
    }
    // The transformer's rows are the same; a transformer-only run has no first use.
    assert_eq!(get(&rows_with, "step"), get(&rows_without, "step"));
    assert_eq!(
        predicted_phases(&plan, &with, RunKind::Transformer),
        predicted_phases(&plan, &without, RunKind::Transformer)
    );
    // `sim --compare` shows the sum and, in its notes, the parts.
    let table = report(&plan, rows_with).table();
    assert!(
        table.contains("first use in a fresh process (t5, clip"),
        "{table}"
    );
}

#[test]
fn a_tensor_parallel_plan_predicts_collectives() {
    let (plan, sim) = shipped("flux-dev@2x-h200.yaml", "2x-h200.yaml");
    let tc = plan.transformer().unwrap();
    let rows = predicted_phases(&plan, &sim, RunKind::Transformer);
    for (pi, p) in tc.parts.iter().enumerate() {
        let c = rows
            .iter()
            .find(|r| r.phase == format!("part {}: collectives", pi + 1));
        if p.devices.len() > 1 {
            assert!(c.unwrap().predicted_s.unwrap() > 0.0, "{rows:?}");
        }
    }
}

#[test]
fn a_streamed_plan_predicts_copies_and_waits_per_device() {
    let (plan, sim) = shipped("flux-dev@1x-rtx4090.yaml", "1x-rtx4090.yaml");
    let rows = predicted_phases(&plan, &sim, RunKind::Transformer);
    let copies = rows
        .iter()
        .find(|r| r.phase == "streaming copies: cuda:0")
        .unwrap_or_else(|| panic!("{rows:?}"));
    assert!(copies.predicted_s.unwrap() > 0.0);
    let wait = rows
        .iter()
        .find(|r| r.phase == "streamed weight wait: cuda:0")
        .unwrap();
    let w = wait.predicted_s.unwrap();
    assert!(w >= 0.0 && w <= sim.step_s, "{w}");
}

#[test]
fn measurements_go_beside_their_predictions() {
    let (plan, sim) = shipped("flux-dev@2x-h200.yaml", "2x-h200.yaml");
    let mut m = Measurements {
        encoders: vec![("t5".into(), 0.25)],
        encode_s: Some(0.3),
        step_s: Some(0.11),
        denoise_s: Some(3.0),
        decode_s: Some(0.6),
        request_s: Some(4.0),
        ..Default::default()
    };
    let rows = phase_rows(&plan, &sim, RunKind::Pipeline, &m);
    let get =
        |rows: &[PhaseRow], name: &str| rows.iter().find(|r| r.phase == name).unwrap().clone();
    assert_eq!(get(&rows, "encode: t5").measured_s, Some(0.25));
    assert_eq!(get(&rows, "encode: clip").measured_s, None);
    assert_eq!(get(&rows, "step").measured_s, Some(0.11));
    assert_eq!(get(&rows, "decode").measured_s, Some(0.6));
    let part = get(&rows, "part 1: blocks");
    assert_eq!(part.measured_s, None);
    assert!(part.note.unwrap().contains("MOLD_PROFILE"));
    m.profiled = true;
    m.parts.insert(
        0,
        PartMeasured {
            compute_s: 0.09,
            collective_s: 0.01,
        },
    );
    let rows = phase_rows(&plan, &sim, RunKind::Pipeline, &m);
    assert_eq!(get(&rows, "part 1: blocks").measured_s, Some(0.09));
    assert_eq!(get(&rows, "part 1: blocks").note, None);
}

/// Times JSON writes and reads back exactly (binary fractions of few digits; serde_json
/// without `float_roundtrip` may miss the last bit of others).
fn seconds() -> impl Strategy<Value = f64> {
    (0u32..10_000_000).prop_map(|k| k as f64 / 1024.0)
}

fn row_strategy() -> impl Strategy<Value = PhaseRow> {
    (
        "[a-z :0-9]{1,20}",
        prop::sample::select(vec![
            PhaseKind::Encode,
            PhaseKind::Compute,
            PhaseKind::Collective,
            PhaseKind::HandOff,
            PhaseKind::Streaming,
            PhaseKind::Decode,
            PhaseKind::Step,
            PhaseKind::Denoise,
            PhaseKind::Request,
        ]),
        any::<bool>(),
        prop::option::of(seconds()),
        prop::option::of(seconds()),
        prop::option::of("[a-z ]{0,12}"),
        prop::collection::vec(0u32..8, 0..3),
    )
        .prop_map(|(phase, kind, per_step, p, m, note, devs)| PhaseRow {
            phase,
            kind,
            per_step,
            devices: devs.into_iter().map(DeviceId::Cuda).collect(),
            predicted_s: p,
            measured_s: m,
            note,
        })
}

fn memory_strategy() -> impl Strategy<Value = MemoryRow> {
    (
        0u32..8,
        prop::option::of(any::<u64>()),
        prop::option::of(any::<u64>()),
        prop::option::of((
            any::<bool>(),
            any::<u64>(),
            prop::option::of(any::<u64>()),
            prop::collection::vec(("[a-z 0-9]{1,10}", any::<u64>()), 0..3),
        )),
    )
        .prop_map(|(d, p, a, m)| MemoryRow {
            device: DeviceId::Cuda(d),
            predicted_peak_bytes: p,
            accounted_peak_bytes: a,
            measured: m.map(|(alloc, peak, pool, samples)| MeasuredPeak {
                source: if alloc {
                    MemorySource::Allocator
                } else {
                    MemorySource::Accounted
                },
                peak_bytes: peak,
                pool_high_bytes: pool,
                outside_pool_bytes: pool.map(|p| p % 1_000_003),
                samples: samples
                    .into_iter()
                    .map(|(phase, bytes)| MemorySample { phase, bytes })
                    .collect(),
            }),
        })
}

proptest! {
    /// Whatever a report holds, it reads back as written, and its largest deviation is
    /// one of its rows' and no smaller than any other's.
    #[test]
    fn any_report_round_trips(
        phases in prop::collection::vec(row_strategy(), 0..8),
        memory in prop::collection::vec(memory_strategy(), 0..4),
    ) {
        let plan = Plan::load(&root().join("plans/flux-tiny@cpu-emu-4.yaml")).unwrap();
        let mut r = report(&plan, phases);
        r.memory = memory;
        let back = RunReport::from_json(&r.to_json(), "r.json").unwrap();
        prop_assert_eq!(&back, &r);
        if let Some((_, d)) = r.largest_deviation() {
            for p in &r.phases {
                if let Some(x) = p.deviation() { prop_assert!(x.abs() <= d.abs()); }
            }
            for m in &r.memory {
                if let Some(x) = m.deviation() { prop_assert!(x.abs() <= d.abs()); }
            }
        }
    }
}
