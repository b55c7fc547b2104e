//! Loading priced from the host's read rate and the links (`load.rs`).

use super::{layout_part, machine4, plan_on};
use crate::*;

/// FLUX.1-dev's every block.
const ALL: &[(&str, u32, u32)] = &[("double", 0, 19), ("single", 0, 38)];

/// The four-GPU unit machine (page-locked uploads at 1 GB/s, NVLink at 100 GB/s) with a
/// host read rate, and without peer access where `peers` is false.
fn box4(read: Option<f64>, peers: bool) -> Machine {
    let mut m = machine4();
    m.host.read_gbps = read;
    if !peers {
        m.links.peer.clear();
    }
    m
}

/// The transformer's load of FLUX.1-dev placed as `devs` in `tp` × `sp` on `m`.
fn transformer_s(m: &Machine, devs: &[u32], tp: u32, sp: u32) -> f64 {
    let (plan, model) = plan_on("flux-dev", vec![layout_part(ALL, devs, tp, sp)], m);
    load_time(&plan, &Ctx::new(&model, m, &plan.workload)).transformer_s
}

fn near(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn one_gpu_loads_at_the_slower_of_reading_and_uploading() {
    // Reading below the 1 GB/s upload: half the rate, about twice the time (the stem's
    // upload from pageable memory does not change).
    let slow = transformer_s(&box4(Some(0.25), true), &[0], 1, 1);
    let half = transformer_s(&box4(Some(0.5), true), &[0], 1, 1);
    assert!(near(slow, 2.0 * half, 0.02), "{slow} {half}");
    // Reading above it: the upload sets the time (the stem's own read aside).
    let a = transformer_s(&box4(Some(2.0), true), &[0], 1, 1);
    let b = transformer_s(&box4(Some(8.0), true), &[0], 1, 1);
    assert!(near(a, b, 0.01), "{a} {b}");
    // About FLUX.1-dev's 23.8 GB at 1 GB/s.
    assert!(a > 20.0 && a < 30.0, "{a}");
}

#[test]
fn a_sequence_parallel_group_reads_once_and_copies_over_its_links() {
    let m = box4(Some(0.5), true);
    let one = transformer_s(&m, &[0], 1, 1);
    let sp4 = transformer_s(&m, &[0, 1, 2, 3], 1, 4);
    // The copies (3 × 23.8 GB over 100 GB/s) run beside the reading: the stem's three
    // extra uploads are all SP4 adds.
    assert!(sp4 >= one && near(sp4, one, 0.02), "one {one}, SP4 {sp4}");
    // Without peer access every rank reads its own copy.
    let alone = transformer_s(&box4(Some(0.5), false), &[0, 1, 2, 3], 1, 4);
    assert!(
        near(alone, 4.0 * one, 0.02),
        "one {one}, SP4 without peers {alone}"
    );
    // Where the links are slower than the reading, the copies set the time.
    let mut slow_links = box4(Some(50.0), true);
    slow_links.links.host_pinned_gbps = 50.0;
    for p in &mut slow_links.links.peer {
        p.gbps = 1.0;
    }
    let one_fast = transformer_s(&slow_links, &[0], 1, 1);
    let sp4_slow = transformer_s(&slow_links, &[0, 1, 2, 3], 1, 4);
    assert!(
        sp4_slow > 20.0 * one_fast,
        "one {one_fast}, SP4 over 1 GB/s links {sp4_slow}"
    );
}

#[test]
fn tensor_parallel_ranks_read_their_shards_at_once() {
    // Reading-bound: the four quarters share the host's rate, as one GPU reads the whole.
    let m = box4(Some(0.5), true);
    let one = transformer_s(&m, &[0], 1, 1);
    let tp4 = transformer_s(&m, &[0, 1, 2, 3], 4, 1);
    assert!(near(tp4, one, 0.05), "one {one}, TP4 {tp4}");
    // Upload-bound: each GPU uploads a quarter, at the same time.
    let m = box4(Some(100.0), true);
    let one = transformer_s(&m, &[0], 1, 1);
    let tp4 = transformer_s(&m, &[0, 1, 2, 3], 4, 1);
    assert!(tp4 < 0.3 * one, "one {one}, TP4 {tp4}");
}

#[test]
fn without_a_measured_rate_the_default_prices_reading() {
    let m = box4(None, true);
    let (plan, model) = plan_on("flux-dev", vec![layout_part(ALL, &[0], 1, 1)], &m);
    let ctx = Ctx::new(&model, &m, &plan.workload);
    assert_eq!(ctx.host_read_gbps(), DEFAULT_HOST_READ_GBPS);
    let l = load_time(&plan, &ctx);
    // Every component is priced, and the total is their sum with the transformer.
    assert_eq!(l.components.len(), model.components.len());
    assert!(l.components.iter().all(|(_, s)| *s > 0.0), "{l:?}");
    let sum: f64 = l.components.iter().map(|(_, s)| s).sum::<f64>() + l.transformer_s;
    assert!(near(l.total_s, sum, 1e-12), "{l:?}");
}
