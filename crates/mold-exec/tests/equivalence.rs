//! Every placement of the tiny model gives the single-device reference's output.

mod common;

use common::*;
use mold_exec::*;
use proptest::prelude::*;

const TOL: f64 = 1e-5;
const SEEDS: [u64; 3] = [1, 7, 42];

fn check(parts: impl Fn() -> Vec<mold_plan::Part>) {
    for seed in SEEDS {
        let ckpt = tiny_checkpoint(seed);
        let err = error_vs_reference(&ckpt, &plan(parts()), seed);
        assert!(
            err <= TOL,
            "seed {seed}: max relative error {err:e} > {TOL:e}"
        );
    }
}

#[test]
fn one_device() {
    check(|| vec![part(&["emu:0"], &["double 0..2", "single 0..3"], false)]);
}

#[test]
fn split_two_inside_double_blocks() {
    check(|| {
        vec![
            part(&["emu:0"], &["double 0..1"], false),
            part(&["emu:1"], &["double 1..2", "single 0..3"], false),
        ]
    });
}

#[test]
fn split_three_crossing_double_to_single() {
    check(|| {
        vec![
            part(&["emu:0"], &["double 0..1"], false),
            part(&["emu:1"], &["double 1..2", "single 0..2"], false),
            part(&["emu:2"], &["single 2..3"], false),
        ]
    });
}

#[test]
fn split_three_at_the_boundary() {
    check(|| {
        vec![
            part(&["emu:0"], &["double 0..2"], false),
            part(&["emu:1"], &["single 0..1"], false),
            part(&["emu:2"], &["single 1..3"], false),
        ]
    });
}

#[test]
fn tensor_parallel_2() {
    check(|| {
        vec![part(
            &["emu:0", "emu:1"],
            &["double 0..2", "single 0..3"],
            false,
        )]
    });
}

#[test]
fn tensor_parallel_4() {
    check(|| {
        vec![part(
            &["emu:0", "emu:1", "emu:2", "emu:3"],
            &["double 0..2", "single 0..3"],
            false,
        )]
    });
}

#[test]
fn tensor_parallel_2_times_split_2() {
    check(|| {
        vec![
            part(&["emu:0", "emu:1"], &["double 0..2", "single 0..1"], false),
            part(&["emu:2", "emu:3"], &["single 1..3"], false),
        ]
    });
}

const ALL: [&str; 2] = ["double 0..2", "single 0..3"];

/// Ulysses over 2 ranks: 7 text and 12 image tokens, 4 heads.
#[test]
fn sequence_parallel_2() {
    check(|| vec![part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false)]);
    // Each rank really holds about half of the tokens: its largest activation shrinks.
    let ckpt = tiny_checkpoint(5);
    let cfg = FluxConfig::flux_tiny();
    let largest = |p: mold_plan::Part| {
        let exec = Executor::new(&cfg, &plan(vec![p]), &ckpt).unwrap();
        exec.forward(&tiny_inputs(5)).unwrap();
        exec.memory_report()[0].largest_activation_bytes
    };
    let one = largest(part(&["emu:0"], &ALL, false));
    let sp2 = largest(part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false));
    assert!(
        sp2 * 10 <= one * 6,
        "one device {one} bytes, SP2 rank 0 {sp2}"
    );
}

/// The ranks of a sequence-parallel group hold the same weights: each block is read from
/// the checkpoint once per tensor-parallel shard and copied to the other ranks' devices.
#[test]
fn sequence_parallel_ranks_copy_their_weights_instead_of_reading_them() {
    let ckpt = tiny_checkpoint(3);
    let cfg = FluxConfig::flux_tiny();
    let copied = |p: mold_plan::Part| {
        Executor::new(&cfg, &plan(vec![p]), &ckpt)
            .unwrap()
            .blocks_copied()
    };
    // 5 blocks (2 double, 3 single).
    assert_eq!(copied(part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false)), 5);
    let four = ["emu:0", "emu:1", "emu:2", "emu:3"];
    assert_eq!(copied(part_par(&four, 1, 4, &ALL, false)), 15);
    // SP2 × TP2: the second pair copies the first pair's two shards.
    assert_eq!(copied(part_par(&four, 2, 2, &ALL, false)), 10);
    // Tensor parallel ranks hold different shards; streamed blocks go through the ring.
    assert_eq!(copied(part_par(&["emu:0", "emu:1"], 2, 1, &ALL, false)), 0);
    assert_eq!(copied(part_par(&["emu:0", "emu:1"], 1, 2, &ALL, true)), 0);
}

/// 3 ranks: uneven tokens (3/2/2 text, 4 image each) and heads (2/1/1).
#[test]
fn sequence_parallel_3_uneven() {
    check(|| vec![part_par(&["emu:0", "emu:1", "emu:2"], 1, 3, &ALL, false)]);
}

#[test]
fn sequence_parallel_4() {
    check(|| {
        vec![part_par(
            &["emu:0", "emu:1", "emu:2", "emu:3"],
            1,
            4,
            &ALL,
            false,
        )]
    });
}

/// Hybrid: two tensor-parallel pairs, sequence parallel across them.
#[test]
fn sequence_parallel_2_times_tensor_parallel_2() {
    check(|| {
        vec![part_par(
            &["emu:0", "emu:1", "emu:2", "emu:3"],
            2,
            2,
            &ALL,
            false,
        )]
    });
}

/// Sequence parallel on one part of a split, handing off whole activations both ways.
#[test]
fn sequence_parallel_on_one_part_of_a_split() {
    check(|| {
        vec![
            part(&["emu:0"], &["double 0..1"], false),
            part_par(
                &["emu:1", "emu:2"],
                1,
                2,
                &["double 1..2", "single 0..2"],
                false,
            ),
            part(&["emu:3"], &["single 2..3"], false),
        ]
    });
}

#[test]
fn sequence_parallel_streamed() {
    check(|| {
        vec![
            part_par(&["emu:0", "emu:1"], 1, 2, &["double 0..2"], true),
            part_par(&["emu:0", "emu:1", "emu:2"], 1, 3, &["single 0..3"], true),
        ]
    });
}

/// Consecutive parts on the same devices with the same layout (as the planner writes a
/// streamed sequence-parallel group): each rank's slice goes straight on to the next
/// part, gathered only before the final layer.
#[test]
fn sequence_parallel_consecutive_parts_keep_their_slices() {
    let two = ["emu:0", "emu:1"];
    check(|| {
        vec![
            part_par(&two, 1, 2, &["double 0..1"], true),
            part_par(&two, 1, 2, &["double 1..2", "single 0..1"], true),
            part_par(&two, 1, 2, &["single 1..3"], false),
        ]
    });
    let four = ["emu:0", "emu:1", "emu:2", "emu:3"];
    check(|| {
        vec![
            part_par(&four, 2, 2, &["double 0..2"], false),
            part_par(&four, 2, 2, &["single 0..3"], true),
        ]
    });
}

#[test]
fn sequence_parallel_refusals() {
    let ckpt = tiny_checkpoint(3);
    let cfg = FluxConfig::flux_tiny();
    // 5 ranks for 4 heads.
    let devs = ["emu:0", "emu:1", "emu:2", "emu:3", "emu:4"];
    let e = Executor::new(&cfg, &plan(vec![part_par(&devs, 1, 5, &ALL, false)]), &ckpt)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("at least 5 attention heads") && e.contains("sp ≤ 4"),
        "{e}"
    );
    // tp × sp must be the device count.
    let e = Executor::new(
        &cfg,
        &plan(vec![part_par(&["emu:0", "emu:1"], 2, 2, &ALL, false)]),
        &ckpt,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("tp 2 × sp 2 must equal its 2 devices"), "{e}");
}

#[test]
fn streamed_parts() {
    check(|| {
        vec![
            part(&["emu:0"], &["double 0..1"], true),
            part(&["emu:1"], &["double 1..2", "single 0..3"], true),
        ]
    });
}

#[test]
fn mixed() {
    check(|| {
        vec![
            part(&["emu:0", "emu:1"], &["double 0..2"], true),
            part(&["host"], &["single 0..1"], false),
            part(
                &["emu:0", "emu:1", "emu:2", "emu:3"],
                &["single 1..3"],
                true,
            ),
        ]
    });
}

#[test]
fn plan_from_yaml() {
    let mut p = plan(vec![]);
    p.components[0].parts = vec![
        part(&["emu:0", "emu:1"], &["double 0..2"], false),
        part(&["emu:2"], &["single 0..3"], true),
    ];
    let yaml = p.to_yaml();
    let parsed = mold_plan::Plan::from_yaml(&yaml, "test.yaml").unwrap();
    let ckpt = tiny_checkpoint(3);
    assert!(error_vs_reference(&ckpt, &parsed, 3) <= TOL);
}

#[test]
fn sharded_checkpoint_matches_single_file() {
    let cfg = FluxConfig::flux_tiny();
    let dir = tmpdir("sharded");
    let index = write_testdata_sharded(&cfg, &dir, 5, DType::F32, 200_000).unwrap();
    let sharded = Checkpoint::open(&index).unwrap();
    assert!(sharded.files().len() > 3, "{:?}", sharded.files());
    // The directory form finds the index too.
    assert_eq!(
        Checkpoint::open(&dir).unwrap().files().len(),
        sharded.files().len()
    );
    let single = tiny_checkpoint(5);
    let x = tiny_inputs(5);
    let p = plan(vec![part(
        &["emu:0", "emu:1"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let a = Executor::new(&cfg, &p, &sharded)
        .unwrap()
        .forward(&x)
        .unwrap();
    let b = Executor::new(&cfg, &p, &single)
        .unwrap()
        .forward(&x)
        .unwrap();
    assert_eq!(max_relative_error(&a, &b).unwrap(), 0.0);
}

#[test]
fn bf16_checkpoint_and_compute() {
    let cfg = FluxConfig::flux_tiny();
    let dir = tmpdir("bf16");
    let path = write_testdata(&cfg, &dir, 9, DType::BF16).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    assert_eq!(ckpt.tensors()["img_in.weight"].dtype, "BF16");
    let x = tiny_inputs(9);
    let reference = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    let p = plan_with(
        vec![part(
            &["emu:0", "emu:1"],
            &["double 0..2", "single 0..3"],
            false,
        )],
        mold_plan::DType::Bf16,
    );
    let exec = Executor::new(&cfg, &p, &ckpt).unwrap();
    assert_eq!(exec.dtype(), DType::BF16);
    let out = exec.forward(&x).unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let err = max_relative_error(&out, &reference).unwrap();
    assert!(err < 0.05, "bf16 vs f32: {err}");
}

#[test]
fn memory_report_accounts_weights_streams_and_activations() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(11);
    let x = tiny_inputs(11);
    let whole = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32).unwrap();
    let total = whole.memory_report()[0].resident_weight_bytes;
    assert_eq!(total, cfg.param_count() * 4);

    let p = plan(vec![
        part(&["emu:0", "emu:1"], &["double 0..2"], false),
        part(&["emu:2"], &["single 0..3"], true),
    ]);
    let exec = Executor::new(&cfg, &p, &ckpt).unwrap();
    exec.forward(&x).unwrap();
    let m = exec.memory_report();
    assert_eq!(m.len(), 3);
    let ids: Vec<String> = m.iter().map(|d| d.device.to_string()).collect();
    assert_eq!(ids, ["emu:0", "emu:1", "emu:2"]);
    // The TP ranks hold the same number of bytes (replicated stem + halves of blocks).
    assert_eq!(m[0].resident_weight_bytes, m[1].resident_weight_bytes);
    assert_eq!(m[0].stream_buffer_bytes, 0);
    // The streamed part keeps its 3 blocks in host memory and two buffers on the
    // device, each the size of one block (tensors 256-byte aligned).
    assert!(m[2].host_weight_bytes > 0);
    assert_eq!(m[2].stream_buffers, 2);
    assert!(
        !m[2].host_pinned,
        "emulated devices stream from pageable memory"
    );
    let block = m[2].host_weight_bytes / 3;
    assert!(m[2].stream_buffer_bytes >= 2 * block);
    assert!(m[2].stream_buffer_bytes <= 2 * (block + 20 * 256));
    // Everything is accounted once, except what TP ranks replicate: the stem, and in
    // each block the QK-norm scales and the row-parallel biases (the modulation is
    // sharded like the other linears).
    let (h, d) = (cfg.hidden as u64, cfg.head_dim as u64);
    let bytes_of = |prefix: &str| -> u64 {
        cfg.tensor_specs()
            .iter()
            .filter(|s| s.name.starts_with(prefix))
            .map(|s| s.shape.iter().product::<usize>() as u64 * 4)
            .sum()
    };
    let stem = ["img_in", "txt_in", "time_in", "vector_in", "guidance_in"]
        .iter()
        .map(|p| bytes_of(p))
        .sum::<u64>();
    let replicated_per_double = 2 * (2 * d + 2 * h) * 4;
    let sum: u64 = m
        .iter()
        .map(|d| d.resident_weight_bytes + d.host_weight_bytes)
        .sum();
    assert_eq!(sum, total + stem + cfg.depth as u64 * replicated_per_double);
    // Largest tensors: on a TP-2 rank the MLP hidden shard (batch 2, 12 image tokens,
    // 256/2 columns); on the single-device single-block part linear1's output (batch 2,
    // 19 tokens, 3·64 + 256 columns). f32.
    assert_eq!(m[0].largest_activation_bytes, 2 * 12 * 128 * 4);
    assert_eq!(m[2].largest_activation_bytes, 2 * 19 * (3 * 64 + 256) * 4);
    assert!(m.iter().all(|d| d.largest_activation_bytes > 0));
}

/// Random partitions of the 5 blocks (2 double, 3 single) into 1–3 parts, each with
/// random tensor- and sequence-parallel degrees and residency.
fn arb_parts() -> impl Strategy<Value = Vec<mold_plan::Part>> {
    (
        proptest::collection::btree_set(1usize..5, 0..=2),
        proptest::collection::vec(
            (
                prop_oneof![
                    Just((1usize, 1usize)),
                    Just((2, 1)),
                    Just((4, 1)),
                    Just((1, 2)),
                    Just((1, 3)),
                    Just((2, 2))
                ],
                any::<bool>(),
            ),
            3,
        ),
    )
        .prop_map(|(cuts, shapes)| {
            let mut bounds = vec![0];
            bounds.extend(cuts);
            bounds.push(5);
            let mut parts = Vec::new();
            let mut next_dev = 0;
            for (i, w) in bounds.windows(2).enumerate() {
                let (a, b) = (w[0], w[1]);
                let mut blocks = Vec::new();
                if a < 2 {
                    blocks.push(format!("double {a}..{}", b.min(2)));
                }
                if b > 2 {
                    blocks.push(format!("single {}..{}", a.max(2) - 2, b - 2));
                }
                let ((tp, sp), streamed) = shapes[i];
                let devices: Vec<String> = (0..tp * sp)
                    .map(|k| format!("emu:{}", (next_dev + k) % 6))
                    .collect();
                next_dev += tp * sp;
                let d: Vec<&str> = devices.iter().map(|s| s.as_str()).collect();
                let bl: Vec<&str> = blocks.iter().map(|s| s.as_str()).collect();
                parts.push(part_par(&d, tp as u32, sp as u32, &bl, streamed));
            }
            parts
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, .. ProptestConfig::default() })]
    #[test]
    fn any_placement_matches_reference(seed in 0u64..1000, parts in arb_parts()) {
        let ckpt = tiny_checkpoint(seed);
        let err = error_vs_reference(&ckpt, &plan(parts.clone()), seed);
        prop_assert!(err <= TOL, "max relative error {:e} for {:?}", err, parts);
    }
}

/// Tensor parallelism whose row-parallel products are made in token chunks, each chunk's
/// all-reduce started before the next chunk's product (`CommOptions::overlap_chunks`):
/// 320 image tokens (256 × 320 pixels), batch 1, so the image segment splits into aligned
/// chunks. Every chunk count gives the single-device output, on TP2, TP4 and SP2 × TP2.
#[test]
fn tensor_parallel_with_overlapped_chunks() {
    let cfg = FluxConfig::flux_tiny();
    let seed = 11;
    let ckpt = tiny_checkpoint(seed);
    let x = random_inputs(&cfg, 256, 320, 7, 1, seed).unwrap();
    let reference = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    let plans = [
        plan(vec![part(&["emu:0", "emu:1"], &ALL, false)]),
        plan(vec![part(
            &["emu:0", "emu:1", "emu:2", "emu:3"],
            &ALL,
            false,
        )]),
        plan(vec![part_par(
            &["emu:0", "emu:1", "emu:2", "emu:3"],
            2,
            2,
            &ALL,
            false,
        )]),
    ];
    for p in &plans {
        let mut outs = Vec::new();
        for chunks in [1usize, 3, 4] {
            let mut opts = ExecOptions::default();
            opts.comm.overlap_chunks = chunks;
            let out = Executor::with_options(&cfg, p, &ckpt, opts)
                .unwrap()
                .forward(&x)
                .unwrap();
            let err = max_relative_error(&out, &reference).unwrap();
            assert!(err <= TOL, "{chunks} chunks: {err:e}");
            outs.push(out);
        }
        // Host-staged sums add in rank order, chunked or not.
        assert!(max_relative_error(&outs[1], &outs[0]).unwrap() <= TOL);
    }
}

/// Token-split tensor parallelism (`CommOptions::token_split`): between the products of
/// every block each rank holds its share of the text and of the image tokens; every
/// layout gives the single-device output: TP2, TP4, SP2 × TP2, and two TP2 parts that
/// split at their first block (double, or single) and gather at their end, with the
/// boundary between double blocks or between single blocks. 8 text and 320 image tokens
/// (every group divides both), batch 1 and 2; 7 text tokens (shares padded: 4 + 3 over
/// two ranks, 2 + 2 + 2 + 1 over four); 1 text token over four ranks (three empty text
/// shares); 357 image tokens (padded image shares). Two SP2 × TP2 parts on the same GPUs
/// hand the shares on without gathering. The profile shows the split ran: the token reduce-scatter is a phase of every
/// rank's report, and of none with the option off.
#[test]
fn tensor_parallel_with_split_tokens() {
    let cfg = FluxConfig::flux_tiny();
    let seed = 13;
    let ckpt = tiny_checkpoint(seed);
    let four = ["emu:0", "emu:1", "emu:2", "emu:3"];
    let plans = [
        plan(vec![part(&["emu:0", "emu:1"], &ALL, false)]),
        plan(vec![part(&four, &ALL, false)]),
        plan(vec![part_par(&four, 2, 2, &ALL, false)]),
        plan(vec![
            part(&["emu:0", "emu:1"], &["double 0..2", "single 0..1"], false),
            part(&["emu:2", "emu:3"], &["single 1..3"], true),
        ]),
        plan(vec![
            part(&["emu:0", "emu:1"], &["double 0..1"], false),
            part(&["emu:2", "emu:3"], &["double 1..2", "single 0..3"], false),
        ]),
        // Two SP2 × TP2 parts on the same GPUs: the shares pass to the next part as they
        // are, within each sequence slice.
        plan(vec![
            part_par(&four, 2, 2, &["double 0..2"], false),
            part_par(&four, 2, 2, &["single 0..3"], false),
        ]),
    ];
    let sizes = [
        (256, 320, 8usize, 1usize),
        (256, 320, 8, 2),
        (256, 320, 7, 1),
        (256, 320, 7, 2),
        (256, 320, 1, 1),
        // 357 image tokens: padded image shares too.
        (272, 336, 7, 2),
    ];
    for (height, width, txt, batch) in sizes {
        let x = random_inputs(&cfg, height, width, txt, batch, seed).unwrap();
        let reference = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32)
            .unwrap()
            .forward(&x)
            .unwrap();
        for (i, p) in plans.iter().enumerate() {
            // (Sequence parallelism over 2 needs 2 text tokens.)
            if txt < 2 && (i == 2 || i == 5) {
                continue;
            }
            let mut opts = ExecOptions::default();
            opts.comm.token_split = true;
            let exec = Executor::with_options(&cfg, p, &ckpt, opts)
                .unwrap()
                .with_profiling(true);
            let out = exec.forward(&x).unwrap();
            let err = max_relative_error(&out, &reference).unwrap();
            assert!(
                err <= TOL,
                "plan {i}, {txt} text tokens, batch {batch}: {err:e}"
            );
            for (dev, phases) in exec.profile_report() {
                assert!(
                    phases.iter().any(|p| p.0 == "reduce-scatter (tokens)"),
                    "plan {i}, {txt} text tokens, batch {batch}, {dev}: {phases:?}"
                );
            }
        }
    }
    // Off by default: the same plan runs its blocks unsplit.
    let x = random_inputs(&cfg, 256, 320, 8, 1, seed).unwrap();
    let exec = Executor::with_options(&cfg, &plans[0], &ckpt, ExecOptions::default())
        .unwrap()
        .with_profiling(true);
    exec.forward(&x).unwrap();
    for (dev, phases) in exec.profile_report() {
        assert!(
            !phases.iter().any(|p| p.0 == "reduce-scatter (tokens)"),
            "{dev}: {phases:?}"
        );
    }
}
