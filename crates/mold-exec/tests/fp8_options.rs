//! The executor applies its FP8 options to the process (`ExecOptions::fp8`, resolved from
//! `MOLD_FP8_*` by the CLI): the products deep in the model code read them from there. One
//! test in its own binary: the options are process-wide.

mod common;

use common::*;
use mold_exec::model::fp8;
use mold_exec::*;

#[test]
fn an_executor_applies_its_fp8_options() {
    let cfg = FluxConfig::flux_tiny();
    let ckpt = tiny_checkpoint(3);
    let p = plan(vec![part(
        &["emu:0"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    assert_eq!(fp8::options(), Fp8Options::default());
    let off = Fp8Options {
        quantize_in_norm: false,
        fast_accumulation: false,
        plain_quantize: true,
        attention: Some(true),
        sm_carveout: 16,
        exchange_e4m3: false,
    };
    let opts = ExecOptions {
        fp8: off,
        ..Default::default()
    };
    let _exec = Executor::with_options(&cfg, &p, &ckpt, opts).unwrap();
    // The products' options are the process's; attention's is the executor's (its plan's,
    // or the override), so the process keeps none.
    assert_eq!(
        fp8::options(),
        Fp8Options {
            attention: None,
            ..off
        }
    );
    let _exec = Executor::new(&cfg, &p, &ckpt).unwrap();
    assert_eq!(fp8::options(), Fp8Options::default());
}
