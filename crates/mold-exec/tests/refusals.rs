//! Checkpoints and plans that do not fit the model are refused before any tensor data is
//! read, with messages that name the problem.

mod common;

use common::*;
use mold_exec::*;
use std::collections::HashMap;

fn tiny_tensors(seed: u64) -> HashMap<String, Tensor> {
    let dir = tmpdir("src");
    let p = write_testdata(&FluxConfig::flux_tiny(), &dir, seed, DType::F32).unwrap();
    candle_core::safetensors::load(&p, &Device::Cpu).unwrap()
}

fn save(tensors: &HashMap<String, Tensor>, name: &str) -> Checkpoint {
    let dir = tmpdir(name);
    let p = dir.join("bad.safetensors");
    candle_core::safetensors::save(tensors, &p).unwrap();
    Checkpoint::open(&p).unwrap()
}

fn whole_model() -> mold_plan::Plan {
    plan(vec![part(
        &["emu:0"],
        &["double 0..2", "single 0..3"],
        false,
    )])
}

fn err_of(r: Result<Executor<FluxConfig>, ExecError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn refuses_a_checkpoint_missing_a_tensor() {
    let mut t = tiny_tensors(1);
    t.remove("single_blocks.1.linear2.weight");
    let ckpt = save(&t, "missing");
    let cfg = FluxConfig::flux_tiny();
    let msg = ckpt.check(&cfg, "flux-tiny").unwrap_err().to_string();
    assert!(
        msg.contains("lacks tensor `single_blocks.1.linear2.weight`"),
        "{msg}"
    );
    assert!(msg.contains("[64, 320]"), "{msg}");
    let msg = err_of(Executor::new(&cfg, &whole_model(), &ckpt));
    assert!(msg.contains("single_blocks.1.linear2.weight"), "{msg}");
}

#[test]
fn refuses_a_tensor_of_the_wrong_shape() {
    let mut t = tiny_tensors(2);
    t.insert(
        "double_blocks.0.img_attn.qkv.weight".into(),
        Tensor::zeros((192, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let ckpt = save(&t, "shape");
    let msg = err_of(Executor::new(
        &FluxConfig::flux_tiny(),
        &whole_model(),
        &ckpt,
    ));
    assert!(
        msg.contains("`double_blocks.0.img_attn.qkv.weight`"),
        "{msg}"
    );
    assert!(
        msg.contains("has shape [192, 32], expected [192, 64]"),
        "{msg}"
    );
}

#[test]
fn refuses_a_checkpoint_of_another_model() {
    // A tiny checkpoint checked against flux-dev: the first tensor already differs.
    let ckpt = tiny_checkpoint(3);
    let msg = ckpt
        .check(&FluxConfig::flux_dev(), "flux-dev")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`img_in.weight` has shape [64, 64], expected [3072, 64]"),
        "{msg}"
    );
    assert!(msg.contains("flux-dev"), "{msg}");
}

#[test]
fn refuses_an_unsupported_tensor_dtype() {
    let mut t = tiny_tensors(4);
    let w = t["img_in.bias"].to_dtype(DType::F64).unwrap();
    t.insert("img_in.bias".into(), w);
    let ckpt = save(&t, "dtype");
    let msg = ckpt
        .check(&FluxConfig::flux_tiny(), "flux-tiny")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`img_in.bias` is stored as F64"), "{msg}");
}

#[test]
fn refuses_a_range_past_the_model() {
    let p = plan(vec![
        part(&["cuda:0"], &["double 0..25"], false),
        part(&["cuda:1"], &["single 0..38"], false),
    ]);
    let msg = check_plan(&FluxConfig::flux_dev(), &p)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`double 0..25`"), "{msg}");
    assert!(msg.contains("19 double blocks"), "{msg}");
    assert!(msg.contains("part 0"), "{msg}");

    // Executor::new refuses it too, before touching devices or weights.
    let p = plan(vec![part(
        &["emu:0"],
        &["double 0..3", "single 0..3"],
        false,
    )]);
    let msg = err_of(Executor::new(
        &FluxConfig::flux_tiny(),
        &p,
        &tiny_checkpoint(5),
    ));
    assert!(
        msg.contains("`double 0..3`") && msg.contains("2 double blocks"),
        "{msg}"
    );
}

#[test]
fn refuses_unknown_kinds_overlaps_gaps_and_disorder() {
    let cfg = FluxConfig::flux_tiny();
    let cases: Vec<(Vec<mold_plan::Part>, &[&str])> = vec![
        (
            vec![part(&["emu:0"], &["double 0..2", "triple 0..3"], false)],
            &["`triple 0..3`", "unknown block kind"],
        ),
        (
            vec![
                part(&["emu:0"], &["double 0..2"], false),
                part(&["emu:1"], &["double 1..2", "single 0..3"], false),
            ],
            &["`double 1..2`", "block double 1 is already run by part 0"],
        ),
        (
            vec![part(&["emu:0"], &["double 0..2", "single 0..2"], false)],
            &["no part runs block(s) single 2"],
        ),
        (
            vec![
                part(&["emu:0"], &["single 0..3"], false),
                part(&["emu:1"], &["double 0..2"], false),
            ],
            &["model order"],
        ),
        (
            vec![part(
                &["emu:0", "emu:1", "emu:2"],
                &["double 0..2", "single 0..3"],
                false,
            )],
            &[
                "tensor parallel over 3 devices",
                "does not divide the 4 attention heads",
            ],
        ),
    ];
    for (parts, needles) in cases {
        let msg = check_plan(&cfg, &plan(parts)).unwrap_err().to_string();
        for n in needles {
            assert!(msg.contains(n), "`{n}` not in: {msg}");
        }
    }
}

#[test]
fn refuses_a_plan_without_transformer_or_with_unsupported_dtype() {
    let cfg = FluxConfig::flux_tiny();
    let mut p = whole_model();
    p.components[0].role = mold_plan::ComponentRole::Vae;
    assert!(check_plan(&cfg, &p)
        .unwrap_err()
        .to_string()
        .contains("no transformer"));
    let p = plan_with(
        vec![part(&["emu:0"], &["double 0..2", "single 0..3"], false)],
        mold_plan::DType::Q8,
    );
    let msg = err_of(Executor::new(&cfg, &p, &tiny_checkpoint(6)));
    assert!(msg.contains("dtype q8"), "{msg}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let p = plan(vec![part(
        &["cuda:0"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    let msg = err_of(Executor::new(
        &FluxConfig::flux_tiny(),
        &p,
        &tiny_checkpoint(7),
    ));
    assert!(
        msg.contains("cuda:0: this build has no CUDA: rebuild with --features cuda"),
        "{msg}"
    );
}

#[test]
fn checks_read_headers_only() {
    // Truncate the data of a valid checkpoint: opening it reads the header alone, whose
    // offsets now run past the file, so it is refused before any tensor data is read,
    // naming the file and the truncation.
    let dir = tmpdir("truncated");
    let path = write_testdata(&FluxConfig::flux_tiny(), &dir, 8, DType::F32).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    std::fs::write(&path, &bytes[..8 + header_len + 100]).unwrap();
    let msg = Checkpoint::open(&path).unwrap_err().to_string();
    assert!(msg.contains("truncated"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    // Plan checks need headers only: a bad range is refused before any weight is read.
    let ckpt = tiny_checkpoint(8);
    let cfg = FluxConfig::flux_tiny();
    ckpt.check(&cfg, "flux-tiny").unwrap();
    let bad = plan(vec![part(&["emu:0"], &["double 0..9"], false)]);
    assert!(err_of(Executor::new(&cfg, &bad, &ckpt)).contains("`double 0..9`"));
}

#[test]
fn refuses_bad_inputs() {
    let cfg = FluxConfig::flux_tiny();
    let exec = Executor::new(&cfg, &whole_model(), &tiny_checkpoint(9)).unwrap();
    let mut x = tiny_inputs(9);
    x.guidance = None;
    let msg = exec.forward(&x).unwrap_err().to_string();
    assert!(msg.contains("guidance distilled"), "{msg}");
    let mut x = tiny_inputs(9);
    x.txt = Tensor::zeros((2, 7, 31), DType::F32, &Device::Cpu).unwrap();
    let msg = exec.forward(&x).unwrap_err().to_string();
    assert!(msg.contains("txt must be (2, tokens, 32)"), "{msg}");
}

#[test]
fn testdata_is_deterministic() {
    let cfg = FluxConfig::flux_tiny();
    let a = write_testdata(&cfg, &tmpdir("det-a"), 3, DType::F32).unwrap();
    let b = write_testdata(&cfg, &tmpdir("det-b"), 3, DType::F32).unwrap();
    let c = write_testdata(&cfg, &tmpdir("det-c"), 4, DType::F32).unwrap();
    let (a, b, c) = (
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        std::fs::read(c).unwrap(),
    );
    assert_eq!(a, b);
    assert_ne!(a, c);
    let x = tiny_inputs(1);
    let y = tiny_inputs(1);
    assert_eq!(max_relative_error(&x.img, &y.img).unwrap(), 0.0);
    assert_eq!(x.img.dims(), &[2, 12, 64]);
    assert_eq!(x.img_ids.dims(), &[2, 12, 3]);
}

#[test]
fn max_relative_error_is_relative_to_the_reference_max() {
    let b = Tensor::new(&[1f32, -4.0, 0.0], &Device::Cpu).unwrap();
    let a = Tensor::new(&[1f32, -4.0, 0.5], &Device::Cpu).unwrap();
    assert_eq!(max_relative_error(&a, &b).unwrap(), 0.125);
    assert_eq!(max_relative_error(&b, &b).unwrap(), 0.0);
}
