//! FP8 checkpoints as users download them (e4m3 weights, with or without a
//! `*.scale_weight` beside each), dequantized at load: the tiny model run from an FP8
//! file equals the same model run from an f32 file of the dequantized weights, sharded or
//! not; a malformed scale is refused in one line.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use mold_exec::*;
use std::collections::HashMap;

/// `src`'s 2-D weights quantized to e4m3 (per-row scales when `per_row`, one per tensor
/// otherwise, none for every third weight), the rest as they are; written to `fp8`, and
/// the dequantized values to `f32`.
fn quantize(src: &std::path::Path, fp8: &std::path::Path, f32: &std::path::Path, per_row: bool) {
    let tensors = candle_core::safetensors::load(src, &Device::Cpu).unwrap();
    let mut q: HashMap<String, Tensor> = HashMap::new();
    let mut d: HashMap<String, Tensor> = HashMap::new();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let t = &tensors[name];
        if t.rank() != 2 || !name.ends_with(".weight") {
            q.insert(name.clone(), t.clone());
            d.insert(name.clone(), t.clone());
            continue;
        }
        let stem = name.strip_suffix(".weight").unwrap();
        let amax = if per_row {
            t.abs().unwrap().max_keepdim(1).unwrap()
        } else {
            t.abs().unwrap().max_all().unwrap().reshape((1, 1)).unwrap()
        };
        let scale = (amax / 448.0).unwrap().clamp(1e-12, f64::MAX).unwrap();
        let scaled = i % 3 != 2;
        let w8 = if scaled {
            t.broadcast_div(&scale).unwrap()
        } else {
            t.clone()
        }
        .to_dtype(DType::F8E4M3)
        .unwrap();
        let back = w8.to_dtype(DType::F32).unwrap();
        let back = if scaled {
            let s = if per_row {
                scale.flatten_all().unwrap()
            } else {
                scale.reshape(()).unwrap()
            };
            q.insert(format!("{stem}.scale_weight"), s);
            back.broadcast_mul(&scale).unwrap()
        } else {
            back
        };
        q.insert(name.clone(), w8);
        d.insert(name.clone(), back);
    }
    candle_core::safetensors::save(&q, fp8).unwrap();
    candle_core::safetensors::save(&d, f32).unwrap();
}

#[test]
fn an_fp8_checkpoint_runs_as_its_dequantized_weights() {
    let dir = tmpdir("fp8");
    let src = write_testdata(&FluxConfig::flux_tiny(), &dir.join("src"), 11, DType::F32).unwrap();
    let cfg = FluxConfig::flux_tiny();
    let x = tiny_inputs(11);
    for per_row in [false, true] {
        let (fp8, f32) = (
            dir.join(format!("q-{per_row}.safetensors")),
            dir.join(format!("d-{per_row}.safetensors")),
        );
        quantize(&src, &fp8, &f32, per_row);
        let (a, b) = (
            Checkpoint::open(&fp8).unwrap(),
            Checkpoint::open(&f32).unwrap(),
        );
        for parts in [
            vec![part(&["emu:0"], &["double 0..2", "single 0..3"], false)],
            vec![part(
                &["emu:0", "emu:1"],
                &["double 0..2", "single 0..3"],
                false,
            )],
        ] {
            let p = plan(parts);
            let ya = Executor::new(&cfg, &p, &a).unwrap().forward(&x).unwrap();
            let yb = Executor::new(&cfg, &p, &b).unwrap().forward(&x).unwrap();
            let e = max_relative_error(&ya, &yb).unwrap();
            assert!(e <= 1e-6, "per_row {per_row}: {e}");
        }
        // And FP8 is not the f32 model: the quantization error is there.
        let orig = Checkpoint::open(&src).unwrap();
        let p = plan(vec![part(
            &["emu:0"],
            &["double 0..2", "single 0..3"],
            false,
        )]);
        let y0 = Executor::new(&cfg, &p, &orig).unwrap().forward(&x).unwrap();
        let ya = Executor::new(&cfg, &p, &a).unwrap().forward(&x).unwrap();
        let e = max_relative_error(&ya, &y0).unwrap();
        assert!(e > 1e-4 && e < 0.2, "fp8 against f32: {e}");
    }
}

#[test]
fn a_scale_of_the_wrong_size_is_refused_in_one_line() {
    let dir = tmpdir("fp8-bad");
    let src = write_testdata(&FluxConfig::flux_tiny(), &dir.join("src"), 12, DType::F32).unwrap();
    let (fp8, f32) = (dir.join("q.safetensors"), dir.join("d.safetensors"));
    quantize(&src, &fp8, &f32, true);
    let mut t = candle_core::safetensors::load(&fp8, &Device::Cpu).unwrap();
    let key = t
        .keys()
        .find(|k| k.ends_with(".scale_weight"))
        .unwrap()
        .clone();
    t.insert(
        key.clone(),
        Tensor::ones(3, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&t, &fp8).unwrap();
    let c = Checkpoint::open(&fp8).unwrap();
    let p = plan(vec![part(
        &["emu:0"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let e = Executor::new(&FluxConfig::flux_tiny(), &p, &c)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&key) && e.contains("one value or one per row"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}
