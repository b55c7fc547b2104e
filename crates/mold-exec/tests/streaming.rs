//! Streamed and partially resident plans give exactly the resident plan's output, step
//! after step, whatever the number of buffers and the streaming mode.

mod common;

use common::*;
use mold_exec::*;
use mold_plan::Part;
use proptest::prelude::*;

fn with_buffers(mut p: Part, n: u32) -> Part {
    p.stream_buffers = Some(n);
    p
}

/// Runs `parts` and the all-resident plan on the same device for `steps` calls with
/// different inputs each call; the outputs must be identical (not merely close: the
/// same arithmetic on the same weights).
fn identical_to_resident(parts: Vec<Part>, streaming: Streaming, steps: u64) {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(5);
    let resident = Executor::new_with_streaming(
        &cfg,
        &plan(vec![part(
            &["emu:0"],
            &["double 0..2", "single 0..3"],
            false,
        )]),
        &ckpt,
        streaming,
    )
    .unwrap();
    let streamed =
        Executor::new_with_streaming(&cfg, &plan(parts.clone()), &ckpt, streaming).unwrap();
    for s in 0..steps {
        let x = tiny_inputs(100 + s);
        let a = resident.forward(&x).unwrap();
        let b = streamed.forward(&x).unwrap();
        assert_eq!(
            max_relative_error(&b, &a).unwrap(),
            0.0,
            "step {s}, {streaming}: {parts:?}"
        );
    }
    if streaming == Streaming::Sync {
        assert!(streamed.streaming_report().is_empty());
        return;
    }
    // The ring never drains in steady state: one fill, then one copy per streamed
    // block fetched (none at all once every block has its own buffer).
    let m: u64 = parts
        .iter()
        .filter(|p| p.residency == mold_plan::Residency::Streamed)
        .map(|p| p.block_count() as u64)
        .sum();
    for (dev, r) in streamed.streaming_report() {
        assert_eq!(r.restarts, 1, "{dev}: {r:?}");
        let n = r.buffers as u64;
        let expect = if n >= m { m } else { n + steps * m };
        assert_eq!(
            r.copies, expect,
            "{dev}: {r:?} ({m} streamed blocks, {steps} steps)"
        );
    }
}

#[test]
fn all_streamed_double_buffered_over_several_steps() {
    identical_to_resident(
        vec![part(&["emu:0"], &["double 0..2", "single 0..3"], true)],
        Streaming::Pinned,
        4,
    );
}

#[test]
fn one_buffer_three_buffers_and_more_buffers_than_blocks() {
    for n in [1, 3, 5, 9] {
        identical_to_resident(
            vec![with_buffers(
                part(&["emu:0"], &["double 0..2", "single 0..3"], true),
                n,
            )],
            Streaming::Pinned,
            3,
        );
    }
}

#[test]
fn partial_residency_shares_one_ring_across_parts() {
    // Streamed, resident, streamed on one device: the ring runs across the resident
    // part and wraps into the next step.
    identical_to_resident(
        vec![
            part(&["emu:0"], &["double 0..1"], true),
            part(&["emu:0"], &["double 1..2", "single 0..1"], false),
            part(&["emu:0"], &["single 1..3"], true),
        ],
        Streaming::Pinned,
        3,
    );
}

#[test]
fn parts_on_one_device_follow_each_other_without_a_wait() {
    // Streamed and resident parts alternating on one device run on one stream, in
    // order: the host waits once per call (the last part), not at each boundary (which
    // drained the GPU 44 times a step in a 16 GiB flux-dev plan). Parts on two devices
    // are finished at each boundary, as the next device's stream is not ordered with it.
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(5);
    let cases = [
        (
            vec![
                part(&["emu:0"], &["double 0..1"], true),
                part(&["emu:0"], &["double 1..2", "single 0..1"], false),
                part(&["emu:0"], &["single 1..3"], true),
            ],
            1,
        ),
        (
            vec![
                part(&["emu:0"], &["double 0..2"], false),
                part(&["emu:1"], &["single 0..2"], false),
                part(&["emu:1"], &["single 2..3"], true),
            ],
            2,
        ),
        (
            vec![
                part(&["emu:0", "emu:1"], &["double 0..2"], false),
                part(&["emu:0"], &["single 0..3"], false),
            ],
            2,
        ),
        // A tensor-parallel group's consecutive parts run as one: each rank's thread
        // goes on to the next part itself, and the host waits once (the last part).
        (
            vec![
                part(&["emu:0", "emu:1"], &["double 0..1"], true),
                part(&["emu:0", "emu:1"], &["double 1..2", "single 0..1"], false),
                part(&["emu:0", "emu:1"], &["single 1..3"], true),
            ],
            1,
        ),
        (
            vec![
                part(&["emu:0", "emu:1"], &["double 0..2"], false),
                part(&["emu:1", "emu:0"], &["single 0..3"], false),
            ],
            2,
        ),
    ];
    for (parts, waits) in cases {
        let ex = Executor::new_with_streaming(&cfg, &plan(parts.clone()), &ckpt, Streaming::Pinned)
            .unwrap();
        for call in 1..=2u64 {
            ex.forward(&tiny_inputs(call)).unwrap();
            assert_eq!(ex.part_waits(), call * waits, "call {call}: {parts:?}");
        }
    }
}

#[test]
fn sync_and_pageable_modes() {
    for mode in [Streaming::Sync, Streaming::Pageable] {
        identical_to_resident(
            vec![
                part(&["emu:0"], &["double 0..1"], false),
                part(&["emu:0"], &["double 1..2", "single 0..3"], true),
            ],
            mode,
            2,
        );
    }
}

#[test]
fn tensor_parallel_parts_stream_their_shards() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(9);
    let tp = |streamed| {
        plan(vec![
            part(&["emu:0", "emu:1"], &["double 0..2"], streamed),
            part(&["emu:0", "emu:1"], &["single 0..3"], streamed),
        ])
    };
    let a = Executor::new(&cfg, &tp(false), &ckpt).unwrap();
    let b = Executor::new(&cfg, &tp(true), &ckpt).unwrap();
    for s in 0..3 {
        let x = tiny_inputs(s);
        let (ya, yb) = (a.forward(&x).unwrap(), b.forward(&x).unwrap());
        assert_eq!(max_relative_error(&yb, &ya).unwrap(), 0.0, "step {s}");
    }
    // Each rank's ring holds its own shards: half the block bytes (plus replicas).
    let m = b.memory_report();
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].host_weight_bytes, m[1].host_weight_bytes);
    assert_eq!(m[0].stream_buffers, 2);
}

/// A tensor-parallel group's parts run as one run (no wait, no copy to the ranks
/// between them) give exactly what the same group gives as one resident part, step
/// after step.
#[test]
fn a_tensor_parallel_group_s_parts_run_as_one_unchanged() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(11);
    let group = ["emu:0", "emu:1"];
    let one = plan(vec![part(&group, &["double 0..2", "single 0..3"], false)]);
    let parts = plan(vec![
        part(&group, &["double 0..1"], true),
        part(&group, &["double 1..2", "single 0..1"], false),
        part(&group, &["single 1..3"], true),
    ]);
    let a = Executor::new(&cfg, &one, &ckpt).unwrap();
    let b = Executor::new_with_streaming(&cfg, &parts, &ckpt, Streaming::Pinned).unwrap();
    for s in 0..3 {
        let x = tiny_inputs(200 + s);
        let (ya, yb) = (a.forward(&x).unwrap(), b.forward(&x).unwrap());
        assert_eq!(max_relative_error(&yb, &ya).unwrap(), 0.0, "step {s}");
    }
    assert_eq!(b.part_waits(), 3);
}

#[test]
fn memory_report_counts_one_buffer_set_per_device() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(2);
    let p = plan(vec![
        with_buffers(part(&["emu:0"], &["double 0..1"], true), 3),
        part(&["emu:0"], &["double 1..2"], false),
        part(&["emu:0"], &["single 0..3"], true),
    ]);
    let exec = Executor::new_with_streaming(&cfg, &p, &ckpt, Streaming::Pinned).unwrap();
    let m = &exec.memory_report()[0];
    // Three buffers (the largest request on the device), each a double block (the
    // largest streamed layout).
    assert_eq!(m.stream_buffers, 3);
    let whole = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32).unwrap();
    let all = whole.memory_report()[0].resident_weight_bytes;
    assert_eq!(m.resident_weight_bytes + m.host_weight_bytes, all);
    let sync = Executor::new_with_streaming(&cfg, &p, &ckpt, Streaming::Sync).unwrap();
    let ms = &sync.memory_report()[0];
    assert_eq!(ms.stream_buffers, 1);
    assert_eq!(ms.host_weight_bytes, m.host_weight_bytes);
    assert!(m.stream_buffer_bytes >= 3 * ms.stream_buffer_bytes);
}

#[test]
fn streaming_modes_parse_and_name_the_choices() {
    assert_eq!(Streaming::parse("PINNED"), Ok(Streaming::Pinned));
    assert_eq!(Streaming::parse("sync"), Ok(Streaming::Sync));
    let e = Streaming::parse("fast").unwrap_err();
    assert!(
        e.contains("`fast`") && e.contains("pinned") && e.contains("sync"),
        "{e}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]
    /// Any residency per block run and any buffer count: identical to resident.
    #[test]
    fn any_partial_residency_is_identical(
        cuts in proptest::collection::btree_set(1usize..5, 0..=3),
        streamed in proptest::collection::vec(any::<bool>(), 4),
        buffers in 1u32..5,
    ) {
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(5);
        let mut parts = Vec::new();
        for (i, w) in bounds.windows(2).enumerate() {
            let (a, b) = (w[0], w[1]);
            let mut blocks = Vec::new();
            if a < 2 {
                blocks.push(format!("double {a}..{}", b.min(2)));
            }
            if b > 2 {
                blocks.push(format!("single {}..{}", a.max(2) - 2, b - 2));
            }
            let bl: Vec<&str> = blocks.iter().map(|s| s.as_str()).collect();
            parts.push(with_buffers(part(&["emu:0"], &bl, streamed[i]), buffers));
        }
        identical_to_resident(parts, Streaming::Pinned, 2);
    }
}
