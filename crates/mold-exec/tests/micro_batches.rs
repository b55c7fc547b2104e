//! Micro-batches through a split as a pipeline (`Executor::forward_micro_batches`): each
//! micro-batch's output is bit for bit `forward` of it alone, for FLUX and Qwen-Image,
//! over splits of 2 and 3 parts, tensor- and sequence-parallel parts inside a split,
//! streamed parts and parts sharing a device, for 1, 2 and 3 micro-batches; the profile
//! and the timeline name the micro-batches; a failing part stops the pipeline with its
//! own error.

mod common;

use common::*;
use mold_exec::model::qwen;
use mold_exec::*;
use mold_plan::Part;
use proptest::prelude::*;

/// For k = 1, 2, 3 distinct micro-batches: each output equals `forward` of it alone,
/// before and after the pipelined call (the executor's state, e.g. weight rings, carries
/// over both ways).
fn check_exact<M: Transformer>(exec: &Executor<M>, inputs: &[M::Inputs], what: &str) {
    let alone: Vec<Tensor> = inputs.iter().map(|x| exec.forward(x).unwrap()).collect();
    for k in 1..=inputs.len() {
        let batch: Vec<&M::Inputs> = inputs[..k].iter().collect();
        let out = exec.forward_micro_batches(&batch).unwrap();
        assert_eq!(out.len(), k, "{what}");
        for (j, (o, a)) in out.iter().zip(&alone).enumerate() {
            assert_same(o, a, &format!("{what}: k = {k}, micro-batch {j}"));
        }
    }
    let again = exec.forward(&inputs[0]).unwrap();
    assert_same(&again, &alone[0], &format!("{what}: forward after"));
}

fn flux_exact(parts: Vec<Part>) {
    let ckpt = tiny_checkpoint(11);
    let exec = Executor::new(&FluxConfig::flux_tiny(), &plan(parts.clone()), &ckpt).unwrap();
    let inputs: Vec<FluxInputs> = (0..3).map(|s| tiny_inputs(200 + s)).collect();
    check_exact(&exec, &inputs, &format!("{parts:?}"));
}

#[test]
fn split_two() {
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:1"], &["double 1..2", "single 0..3"], false),
    ]);
}

#[test]
fn split_three() {
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:1"], &["double 1..2", "single 0..2"], false),
        part(&["emu:2"], &["single 2..3"], false),
    ]);
}

#[test]
fn tensor_parallel_parts_inside_a_split() {
    flux_exact(vec![
        part(&["emu:0", "emu:1"], &["double 0..2", "single 0..1"], false),
        part(&["emu:2", "emu:3"], &["single 1..3"], false),
    ]);
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:1", "emu:2"], &["double 1..2", "single 0..3"], false),
    ]);
}

#[test]
fn sequence_parallel_part_inside_a_split() {
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part_par(
            &["emu:1", "emu:2"],
            1,
            2,
            &["double 1..2", "single 0..2"],
            false,
        ),
        part(&["emu:3"], &["single 2..3"], false),
    ]);
}

/// Streamed parts: every device's weight ring is still fetched in its order (it never
/// drains and restarts after the first fill), micro-batch after micro-batch.
#[test]
fn streamed_parts_keep_their_ring_order() {
    let parts = vec![
        part(&["emu:0"], &["double 0..1"], true),
        part(&["emu:1"], &["double 1..2", "single 0..3"], true),
    ];
    let ckpt = tiny_checkpoint(11);
    let exec = Executor::new(&FluxConfig::flux_tiny(), &plan(parts), &ckpt).unwrap();
    let inputs: Vec<FluxInputs> = (0..3).map(|s| tiny_inputs(300 + s)).collect();
    check_exact(&exec, &inputs, "streamed split");
    let rings = exec.streaming_report();
    assert_eq!(rings.len(), 2);
    for (dev, r) in rings {
        assert_eq!(r.restarts, 1, "{dev}: {r:?}");
    }
}

/// Parts sharing a device (resident then streamed on emu:0, and a part back on emu:0
/// after emu:1) run in turn on one stage, still exactly.
#[test]
fn parts_sharing_a_device() {
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:0"], &["double 1..2"], true),
        part(&["emu:1"], &["single 0..3"], false),
    ]);
    flux_exact(vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:1"], &["double 1..2"], false),
        part(&["emu:0", "emu:2"], &["single 0..3"], true),
    ]);
}

#[test]
fn one_part_and_no_micro_batches() {
    flux_exact(vec![part(
        &["emu:0"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let ckpt = tiny_checkpoint(11);
    let exec = Executor::new(
        &FluxConfig::flux_tiny(),
        &plan(vec![
            part(&["emu:0"], &["double 0..1"], false),
            part(&["emu:1"], &["double 1..2", "single 0..3"], false),
        ]),
        &ckpt,
    )
    .unwrap();
    assert!(exec.forward_micro_batches(&[]).unwrap().is_empty());
    assert!(exec.last_micro_batch_timeline().is_empty());
}

fn qwen_checkpoint(seed: u64) -> Checkpoint {
    let dir = tmpdir(&format!("mb-qwen-{seed}"));
    qwen::testdata::write_testdata(
        &QwenConfig::qwen_image_tiny(),
        &dir,
        seed,
        DType::F32,
        1 << 30,
    )
    .unwrap();
    Checkpoint::open(&dir).unwrap()
}

fn qwen_exec(parts: Vec<Part>, ckpt: &Checkpoint) -> Executor<QwenConfig> {
    let mut p = plan(parts);
    p.model.id = "qwen-image-tiny".into();
    p.workload.guidance = None;
    Executor::new(&QwenConfig::qwen_image_tiny(), &p, ckpt).unwrap()
}

/// Qwen-Image through the same runtime: 2 and 3 stages, a tensor-parallel stage, a
/// streamed one.
#[test]
fn qwen_image() {
    let ckpt = qwen_checkpoint(4);
    let cfg = QwenConfig::qwen_image_tiny();
    let inputs: Vec<QwenInputs> = (0..3)
        .map(|s| qwen::random_inputs(&cfg, 64, 48, 7, 1, 40 + s).unwrap())
        .collect();
    for parts in [
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part(&["emu:1"], &["block 1..3"], false),
        ],
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part(&["emu:1"], &["block 1..2"], true),
            part(&["emu:2"], &["block 2..3"], false),
        ],
        vec![
            part(&["emu:0", "emu:1"], &["block 0..2"], false),
            part(&["emu:2"], &["block 2..3"], true),
        ],
    ] {
        let exec = qwen_exec(parts.clone(), &ckpt);
        check_exact(&exec, &inputs, &format!("qwen-image {parts:?}"));
    }
}

/// The profile labels each micro-batch's phases, and the timeline has one span per
/// part and micro-batch, each micro-batch leaving a part before the next part takes it
/// and a part taking micro-batches in order.
#[test]
fn profile_and_timeline_name_the_micro_batches() {
    let ckpt = tiny_checkpoint(11);
    let exec = Executor::new(
        &FluxConfig::flux_tiny(),
        &plan(vec![
            part(&["emu:0"], &["double 0..1"], false),
            part(&["emu:1"], &["double 1..2", "single 0..3"], false),
        ]),
        &ckpt,
    )
    .unwrap()
    .with_profiling(true);
    let (a, b) = (tiny_inputs(1), tiny_inputs(2));
    exec.forward_micro_batches(&[&a, &b]).unwrap();
    let report = exec.profile_report();
    assert_eq!(report.len(), 2);
    for (dev, phases) in &report {
        for mb in ["mb0 ", "mb1 "] {
            assert!(
                phases.iter().any(|p| p.0.starts_with(mb)),
                "{dev}: {phases:?}"
            );
        }
        assert!(
            phases.iter().all(|p| p.0.starts_with("mb")),
            "{dev}: {phases:?}"
        );
    }
    assert!(report[0].1.iter().any(|p| p.0 == "mb1 stem"), "{report:?}");
    assert!(
        report[1].1.iter().any(|p| p.0 == "mb0 final layer"),
        "{report:?}"
    );
    // A plain call keeps the model's own labels, beside the micro-batches'.
    exec.forward(&a).unwrap();
    assert!(exec.profile_report()[0].1.iter().any(|p| p.0 == "stem"));
    exec.clear_profile();
    assert!(exec.profile_report().is_empty());

    let spans = exec.last_micro_batch_timeline();
    let at = |part: usize, mb: usize| {
        spans
            .iter()
            .find(|s| s.part == part && s.micro_batch == mb)
            .unwrap_or_else(|| panic!("no span for part {part}, mb{mb}: {spans:?}"))
    };
    assert_eq!(spans.len(), 4);
    for mb in 0..2 {
        assert!(at(0, mb).end_s <= at(1, mb).start_s, "{spans:?}");
        assert!(at(1, mb).devices == vec![mold_plan::DeviceId::Emu(1)]);
    }
    for part in 0..2 {
        assert!(at(part, 0).end_s <= at(part, 1).start_s, "{spans:?}");
    }
}

/// A part that fails stops the pipeline with its own error (not a neighbour's), at any
/// stage, for an error and for a panic; the other stages do not hang.
#[test]
fn a_failing_part_stops_the_pipeline_with_its_error() {
    let ckpt = tiny_checkpoint(11);
    let parts = vec![
        part(&["emu:0"], &["double 0..1"], false),
        part(&["emu:1"], &["double 1..2"], false),
        part(&["emu:2", "emu:3"], &["single 0..3"], false),
    ];
    let (a, b) = (tiny_inputs(1), tiny_inputs(2));
    for (at, want) in [
        ("emu:0@double 0", "injected fault (MOLD_FAULT) on emu:0"),
        ("emu:1@double 1", "injected fault (MOLD_FAULT) on emu:1"),
        ("emu:3@single 2", "injected fault (MOLD_FAULT) on emu:3"),
        ("emu:1@double 1:panic", "panicked"),
    ] {
        let opts = ExecOptions {
            fault: Some(Fault::parse(at).unwrap()),
            ..ExecOptions::default()
        };
        let exec =
            Executor::with_options(&FluxConfig::flux_tiny(), &plan(parts.clone()), &ckpt, opts)
                .unwrap();
        let e = exec
            .forward_micro_batches(&[&a, &b])
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{at}: {e}");
    }
}

/// Bad inputs are refused before anything runs, naming the problem.
#[test]
fn inputs_are_checked_first() {
    let ckpt = tiny_checkpoint(11);
    let exec = Executor::new(
        &FluxConfig::flux_tiny(),
        &plan(vec![
            part(&["emu:0"], &["double 0..1"], false),
            part(&["emu:1"], &["double 1..2", "single 0..3"], false),
        ]),
        &ckpt,
    )
    .unwrap();
    let good = tiny_inputs(1);
    let mut bad = tiny_inputs(2);
    bad.txt = bad.txt.narrow(2, 0, 3).unwrap();
    let e = exec
        .forward_micro_batches(&[&good, &bad])
        .unwrap_err()
        .to_string();
    assert!(e.contains("txt must be"), "{e}");
    assert!(exec.last_micro_batch_timeline().is_empty());
}

/// Random splits of FLUX's 5 blocks into 1–3 parts on 4 emulated devices (parts may
/// share devices), each part's degrees and residency random.
fn arb_parts() -> impl Strategy<Value = Vec<Part>> {
    (
        proptest::collection::btree_set(1usize..5, 0..=2),
        proptest::collection::vec(
            (
                prop_oneof![Just((1usize, 1usize)), Just((2, 1)), Just((1, 2))],
                0usize..4,
                any::<bool>(),
            ),
            3,
        ),
    )
        .prop_map(|(cuts, shapes)| {
            let mut bounds = vec![0];
            bounds.extend(cuts);
            bounds.push(5);
            bounds
                .windows(2)
                .zip(shapes)
                .map(|(w, ((tp, sp), first, streamed))| {
                    let (a, b) = (w[0], w[1]);
                    let mut blocks = Vec::new();
                    if a < 2 {
                        blocks.push(format!("double {a}..{}", b.min(2)));
                    }
                    if b > 2 {
                        blocks.push(format!("single {}..{}", a.max(2) - 2, b - 2));
                    }
                    let devices: Vec<String> = (0..tp * sp)
                        .map(|k| format!("emu:{}", (first + k) % 4))
                        .collect();
                    let d: Vec<&str> = devices.iter().map(|s| s.as_str()).collect();
                    let bl: Vec<&str> = blocks.iter().map(|s| s.as_str()).collect();
                    part_par(&d, tp as u32, sp as u32, &bl, streamed)
                })
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]
    /// Any placement: two micro-batches through it give `forward`'s outputs bit for bit.
    #[test]
    fn any_placement_is_exact(parts in arb_parts(), seed in 0u64..100) {
        let ckpt = tiny_checkpoint(seed);
        let exec = Executor::new(&FluxConfig::flux_tiny(), &plan(parts.clone()), &ckpt).unwrap();
        let (a, b) = (tiny_inputs(seed + 1), tiny_inputs(seed + 2));
        let out = exec.forward_micro_batches(&[&a, &b]).unwrap();
        assert_same(&out[0], &exec.forward(&a).unwrap(), &format!("mb0 {parts:?}"));
        assert_same(&out[1], &exec.forward(&b).unwrap(), &format!("mb1 {parts:?}"));
    }
}
