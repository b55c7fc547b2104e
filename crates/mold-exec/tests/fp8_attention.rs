//! FP8 attention (`MOLD_FP8_ATTENTION=on`) in an FP8 plan: the executor applies the option,
//! the blocks whose products are FP8 run their attention in FP8 (emulated here), and the
//! output moves by FP8's rounding — no further. One test in its own binary: the options
//! are process-wide.

mod common;

use common::*;
use mold_exec::model::attention;
use mold_exec::*;

#[test]
fn fp8_attention_runs_in_fp8_blocks_only_when_asked() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(24);
    let x = tiny_inputs(24);
    let all = ["double 0..2", "single 0..3"];
    let run = |dtype: mold_plan::DType, fp8_attention: bool| {
        let opts = ExecOptions {
            fp8: Fp8Options {
                attention: fp8_attention,
                ..Default::default()
            },
            ..Default::default()
        };
        let p = plan_with(vec![part(&["emu:0"], &all, false)], dtype);
        let exec = Executor::with_options(&cfg, &p, &ckpt, opts).unwrap();
        let before = attention::report()
            .calls
            .get("emulated FP8")
            .copied()
            .unwrap_or(0);
        let out = exec.forward(&x).unwrap();
        let after = attention::report()
            .calls
            .get("emulated FP8")
            .copied()
            .unwrap_or(0);
        (out, after - before)
    };
    let (products, none) = run(mold_plan::DType::Fp8, false);
    assert_eq!(none, 0, "FP8 attention ran without being asked");
    let (fp8, calls) = run(mold_plan::DType::Fp8, true);
    // flux-tiny: 2 double and 3 single blocks, one attention each.
    assert_eq!(calls, 5);
    let moved = max_relative_error(&fp8, &products).unwrap();
    assert!(
        moved > 0.0 && moved < 5e-2,
        "FP8 attention moved the output by {moved}"
    );
    // A dense plan's attention stays in its dtype even when FP8 attention is asked for.
    let (_, dense_calls) = run(mold_plan::DType::Bf16, true);
    assert_eq!(dense_calls, 0);
}
