//! FP8 plans (`dtype: fp8`) on emulated devices: products' weights held in FP8 (a byte a
//! weight and a scale a row), the same answer sharded as unsharded, and an approximation
//! of the dense model.

mod common;

use common::*;
use mold_exec::*;
use mold_plan::DeviceId;

const ALL: [&str; 2] = ["double 0..2", "single 0..3"];

fn fp8_plan(p: mold_plan::Part) -> mold_plan::Plan {
    plan_with(vec![p], mold_plan::DType::Fp8)
}

/// The unsharded FP8 reference: the same quantized weights, bf16 activations.
fn fp8_reference(ckpt: &Checkpoint, x: &FluxInputs) -> candle_core::Tensor {
    Executor::reference_products(
        &FluxConfig::flux_tiny(),
        ckpt,
        &DeviceId::Host,
        DType::BF16,
        true,
    )
    .unwrap()
    .forward(x)
    .unwrap()
}

#[test]
fn an_fp8_plan_runs_as_its_unsharded_reference_on_one_device_and_sharded() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(21);
    let x = tiny_inputs(21);
    let want = fp8_reference(&ckpt, &x);
    let one = Executor::new(&cfg, &fp8_plan(part(&["emu:0"], &ALL, false)), &ckpt).unwrap();
    let got = one.forward(&x).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    assert_eq!(max_relative_error(&got, &want).unwrap(), 0.0);
    // Sharded, the bf16 activations round differently (the exchange, attention's and the
    // all-reduce's sums), and a value rounded differently can land in another e4m3 step:
    // the error is that of the same sharding in bf16, grown by FP8's coarser steps. Tensor
    // parallel row products also scale each rank's slice of a token on its own.
    let bf16_ref = Executor::reference(&cfg, &ckpt, &DeviceId::Host, DType::BF16)
        .unwrap()
        .forward(&x)
        .unwrap();
    for p in [
        part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false),
        part(&["emu:0", "emu:1"], &ALL, false),
    ] {
        let exec = Executor::new(&cfg, &fp8_plan(p.clone()), &ckpt).unwrap();
        let err = max_relative_error(&exec.forward(&x).unwrap(), &want).unwrap();
        let dense = Executor::new(
            &cfg,
            &plan_with(vec![p.clone()], mold_plan::DType::Bf16),
            &ckpt,
        )
        .unwrap();
        let base = max_relative_error(&dense.forward(&x).unwrap(), &bf16_ref).unwrap();
        // Measured: SP2 2.6e-2 (bf16 7.6e-3), TP2 3.8e-2 (bf16 1.1e-2).
        assert!(
            err < 6e-2 && err < 5.0 * base.max(1e-3),
            "tp {} sp {}: {err} (bf16: {base})",
            p.tp,
            p.sp
        );
    }
}

#[test]
fn an_fp8_plan_holds_a_byte_a_weight_and_approximates_the_dense_model() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(22);
    let x = tiny_inputs(22);
    let bf16 = Executor::new(
        &cfg,
        &plan_with(vec![part(&["emu:0"], &ALL, false)], mold_plan::DType::Bf16),
        &ckpt,
    )
    .unwrap();
    let fp8 = Executor::new(&cfg, &fp8_plan(part(&["emu:0"], &ALL, false)), &ckpt).unwrap();
    let dense = bf16.forward(&x).unwrap();
    let got = fp8.forward(&x).unwrap();
    let err = max_relative_error(&got, &dense).unwrap();
    assert!(err > 0.0 && err < 0.15, "FP8 against bf16: {err}");
    let (b, f) = (
        bf16.memory_report()[0].resident_weight_bytes,
        fp8.memory_report()[0].resident_weight_bytes,
    );
    // The products' weights are most of a block: FP8 holds well under 60 % of bf16.
    assert!(f * 10 < b * 6, "bf16 {b} bytes, FP8 {f} bytes");
}

#[test]
fn an_fp8_plan_that_streams_is_refused_before_loading() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(23);
    let e = Executor::new(&cfg, &fp8_plan(part(&["emu:0"], &ALL, true)), &ckpt)
        .expect_err("a streamed FP8 plan ran");
    let msg = e.to_string();
    assert!(msg.contains("FP8 weights are held resident only"), "{msg}");
    assert_eq!(msg.lines().count(), 1, "{msg}");
}
