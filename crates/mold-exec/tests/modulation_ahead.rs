//! The blocks' modulation computed ahead for a window of steps
//! (`mold_exec::model::modulation`) gives what each step computes alone, on every layout,
//! and holds one window of outputs.

mod common;

use candle_core::Tensor;
use common::*;
use mold_exec::model::modulation::AHEAD_STEPS;
use mold_exec::*;

const TOL: f64 = 1e-5;
/// More than a window: the second window's first step computes it again.
const STEPS: usize = AHEAD_STEPS + 4;

fn times() -> Vec<f64> {
    (0..STEPS).map(|i| 1.0 - i as f64 / STEPS as f64).collect()
}

/// Every step's output for the inputs of `seed`, with the request's schedule given
/// (`ahead`) or not.
fn run(exec: &Executor<FluxConfig>, seed: u64, ahead: bool) -> Vec<Tensor> {
    let mut x = tiny_inputs(seed);
    if ahead {
        x.set_schedule(&times()).unwrap();
    }
    times()
        .iter()
        .map(|t| {
            x.set_time(*t).unwrap();
            exec.forward(&x).unwrap()
        })
        .collect()
}

fn ahead_bytes(exec: &Executor<FluxConfig>) -> u64 {
    exec.memory_report().iter().map(|m| m.ahead_bytes).sum()
}

/// The bytes one rank holds for `steps` steps of the tiny model's window, batch 2, f32:
/// every block's full modulation outputs (6·hidden twice a double block, 3·hidden a
/// single block).
fn window_bytes(steps: usize) -> u64 {
    let c = FluxConfig::flux_tiny();
    let per_row = c.depth * 2 * 6 * c.hidden + c.depth_single * 3 * c.hidden;
    (per_row * steps * 2 * 4) as u64
}

fn layouts() -> Vec<(&'static str, Vec<mold_plan::Part>, u64)> {
    const ALL: [&str; 2] = ["double 0..2", "single 0..3"];
    vec![
        ("one device", vec![part(&["emu:0"], &ALL, false)], 1),
        (
            "split in two",
            vec![
                part(&["emu:0"], &["double 0..1"], false),
                part(&["emu:1"], &["double 1..2", "single 0..3"], false),
            ],
            1,
        ),
        ("TP2", vec![part(&["emu:0", "emu:1"], &ALL, false)], 2),
        (
            "SP2",
            vec![part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false)],
            2,
        ),
        (
            "SP2 × TP2",
            vec![part_par(
                &["emu:0", "emu:1", "emu:2", "emu:3"],
                2,
                2,
                &ALL,
                false,
            )],
            4,
        ),
        ("streamed", vec![part(&["emu:0"], &ALL, true)], 1),
    ]
}

#[test]
fn ahead_equals_each_step_alone_on_every_layout() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(3);
    for (name, parts, ranks) in layouts() {
        let exec = Executor::new(&cfg, &plan(parts), &ckpt).unwrap();
        let alone = run(&exec, 3, false);
        assert_eq!(
            ahead_bytes(&exec),
            0,
            "{name}: nothing ahead without a schedule"
        );
        let ahead = run(&exec, 3, true);
        for (i, (a, b)) in ahead.iter().zip(&alone).enumerate() {
            let err = max_relative_error(a, b).unwrap();
            assert!(err <= TOL, "{name}, step {i}: {err:e}");
        }
        // Each rank held one window at a time (the first, 16 steps, at most) and
        // computed it once per block: two windows, five blocks.
        assert_eq!(
            ahead_bytes(&exec),
            ranks * window_bytes(AHEAD_STEPS),
            "{name}"
        );
        assert_eq!(exec.modulation_ahead_misses(), ranks * 2 * 5, "{name}");
        exec.release_modulation_ahead();
        run(&exec, 3, true);
        assert_eq!(
            exec.modulation_ahead_misses(),
            ranks * 4 * 5,
            "{name}: released"
        );
    }
}

/// True CFG alternates two requests on the same ranks: both are kept, and each step
/// equals its own request's.
#[test]
fn two_requests_alternating_each_get_their_own() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(4);
    let p = plan(vec![part(
        &["emu:0", "emu:1"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let exec = Executor::new(&cfg, &p, &ckpt).unwrap();
    let (a_alone, b_alone) = (run(&exec, 4, false), run(&exec, 9, false));
    let (mut a, mut b) = (tiny_inputs(4), tiny_inputs(9));
    a.set_schedule(&times()).unwrap();
    b.set_schedule(&times()).unwrap();
    for (i, t) in times().iter().enumerate() {
        a.set_time(*t).unwrap();
        b.set_time(*t).unwrap();
        let ya = exec.forward(&a).unwrap();
        let yb = exec.forward(&b).unwrap();
        assert!(
            max_relative_error(&ya, &a_alone[i]).unwrap() <= TOL,
            "a, step {i}"
        );
        assert!(
            max_relative_error(&yb, &b_alone[i]).unwrap() <= TOL,
            "b, step {i}"
        );
    }
    // Both requests' windows at once on each of the two ranks, each computed once.
    assert_eq!(ahead_bytes(&exec), 2 * 2 * window_bytes(AHEAD_STEPS));
    assert_eq!(exec.modulation_ahead_misses(), 2 * 2 * 2 * 5);
}

/// `MOLD_MODULATION_AHEAD=off` (`ExecOptions::modulation_ahead`): nothing is held, the
/// same outputs; a time outside the schedule is computed alone.
#[test]
fn off_and_times_outside_the_schedule_compute_each_step_alone() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(6);
    let p = plan(vec![part(
        &["emu:0"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let opts = ExecOptions {
        modulation_ahead: false,
        ..Default::default()
    };
    let off = Executor::with_options(&cfg, &p, &ckpt, opts).unwrap();
    let on = Executor::new(&cfg, &p, &ckpt).unwrap();
    let a = run(&off, 6, true);
    assert_eq!(ahead_bytes(&off), 0);
    let b = run(&on, 6, false);
    for (x, y) in a.iter().zip(&b) {
        assert!(max_relative_error(x, y).unwrap() <= TOL);
    }
    assert_eq!(off.modulation_ahead_misses(), 0);
    let mut x = tiny_inputs(6);
    x.set_schedule(&times()).unwrap();
    x.set_time(0.123).unwrap();
    on.forward(&x).unwrap();
    assert_eq!((ahead_bytes(&on), on.modulation_ahead_misses()), (0, 0));
}

/// FP8 plans (the modulation linear held in e4m3, its input scaled per row): ahead gives
/// each step's own output within bf16's rounding, grown by FP8's steps, on one device and
/// under TP2, and holds the window's bf16 outputs.
#[test]
fn fp8_plans_compute_the_modulation_ahead_too() {
    const ALL: [&str; 2] = ["double 0..2", "single 0..3"];
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(8);
    for (name, p, ranks) in [
        ("one device", part(&["emu:0"], &ALL, false), 1),
        ("TP2", part(&["emu:0", "emu:1"], &ALL, false), 2),
    ] {
        let fp8 = plan_with(vec![p], mold_plan::DType::Fp8);
        let exec = Executor::new(&cfg, &fp8, &ckpt).unwrap();
        let alone = run(&exec, 8, false);
        let ahead = run(&exec, 8, true);
        for (i, (a, b)) in ahead.iter().zip(&alone).enumerate() {
            let err = max_relative_error(a, b).unwrap();
            assert!(err < 2e-2, "{name}, step {i}: {err:e}");
        }
        // bf16 outputs: half the f32 window's bytes.
        assert_eq!(
            ahead_bytes(&exec),
            ranks * window_bytes(AHEAD_STEPS) / 2,
            "{name}"
        );
    }
}
