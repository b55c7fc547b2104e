//! A loaded transformer copied onto another replica's devices
//! ([`Executor::replicate`]) computes what the replica loaded from the checkpoint
//! computes, bit for bit, on emulated devices; what it cannot copy it refuses in one line.

mod common;

use common::*;
use mold_exec::*;

#[test]
fn a_replica_copied_equals_the_replica_read() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(31);
    let x = tiny_inputs(5);
    // One device; a split over two; TP2; SP2 × TP2: each copied to other devices.
    let layouts: Vec<(Vec<mold_plan::Part>, Vec<mold_plan::Part>)> = vec![
        (
            vec![part(&["emu:0"], &["double 0..2", "single 0..3"], false)],
            vec![part(&["emu:1"], &["double 0..2", "single 0..3"], false)],
        ),
        (
            vec![
                part(&["emu:0"], &["double 0..2"], false),
                part(&["emu:1"], &["single 0..3"], false),
            ],
            vec![
                part(&["emu:2"], &["double 0..2"], false),
                part(&["emu:3"], &["single 0..3"], false),
            ],
        ),
        (
            vec![part(
                &["emu:0", "emu:1"],
                &["double 0..2", "single 0..3"],
                false,
            )],
            vec![part(
                &["emu:2", "emu:3"],
                &["double 0..2", "single 0..3"],
                false,
            )],
        ),
        (
            // Two sequence-parallel parts on the same devices: slices handed straight on.
            vec![
                part_par(&["emu:0", "emu:1"], 1, 2, &["double 0..2"], false),
                part_par(&["emu:0", "emu:1"], 1, 2, &["single 0..3"], false),
            ],
            vec![
                part_par(&["emu:2", "emu:3"], 1, 2, &["double 0..2"], false),
                part_par(&["emu:2", "emu:3"], 1, 2, &["single 0..3"], false),
            ],
        ),
        (
            vec![part_par(
                &["emu:0", "emu:1", "emu:2", "emu:3"],
                2,
                2,
                &["double 0..2", "single 0..3"],
                false,
            )],
            vec![part_par(
                &["emu:4", "emu:5", "emu:6", "emu:7"],
                2,
                2,
                &["double 0..2", "single 0..3"],
                false,
            )],
        ),
    ];
    for (a, b) in layouts {
        let (pa, pb) = (plan(a), plan(b));
        let loaded = Executor::new(&cfg, &pa, &ckpt).unwrap();
        let read = Executor::new(&cfg, &pb, &ckpt).unwrap();
        let copied = loaded.replicate(&pb).unwrap();
        let want = read.forward(&x).unwrap();
        assert_same(&copied.forward(&x).unwrap(), &want, "copied replica");
        assert_same(
            &loaded.forward(&x).unwrap(),
            &want,
            "the source, still whole",
        );
        // Every block was copied, and the memory is on the replica's devices.
        let blocks: usize = pb
            .transformer()
            .unwrap()
            .parts
            .iter()
            .map(|p| p.devices.len() * p.blocks.iter().map(|r| r.len() as usize).sum::<usize>())
            .sum();
        assert_eq!(copied.blocks_copied(), blocks);
        let devices = |e: &Executor<FluxConfig>| {
            e.memory_report()
                .into_iter()
                .map(|m| (m.device, m.resident_weight_bytes))
                .collect::<Vec<_>>()
        };
        let on_b: Vec<_> = devices(&read);
        assert_eq!(devices(&copied), on_b);
    }
}

#[test]
fn what_cannot_be_copied_is_refused_in_one_line() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(32);
    let all = ["double 0..2", "single 0..3"];
    let loaded = Executor::new(&cfg, &plan(vec![part(&["emu:0"], &all, false)]), &ckpt).unwrap();
    let refused = |p: mold_plan::Plan, says: &str| {
        let e = loaded.replicate(&p).unwrap_err().to_string();
        assert!(!e.contains('\n') && e.contains(says), "{e}");
        assert!(e.contains("load it from the checkpoint instead"), "{e}");
    };
    // Another layout, another split, streamed blocks.
    refused(
        plan(vec![part(&["emu:1", "emu:2"], &all, false)]),
        "part 0 differs",
    );
    refused(
        plan(vec![
            part(&["emu:1"], &["double 0..2"], false),
            part(&["emu:2"], &["single 0..3"], false),
        ]),
        "2 parts against 1",
    );
    refused(plan(vec![part(&["emu:1"], &all, true)]), "not resident");
    // Another dtype, or FP8 products where the loaded one has none.
    refused(
        plan_with(vec![part(&["emu:1"], &all, false)], mold_plan::DType::Bf16),
        "computes in BF16, the loaded one in F32",
    );
    refused(
        plan_with(vec![part(&["emu:1"], &all, false)], mold_plan::DType::Fp8),
        "computes in BF16 with FP8 products, the loaded one in F32",
    );
    // A loaded executor that streams cannot be the source.
    let streams = Executor::new(&cfg, &plan(vec![part(&["emu:0"], &all, true)]), &ckpt).unwrap();
    let e = streams
        .replicate(&plan(vec![part(&["emu:1"], &all, true)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("streams blocks"), "{e}");
}
