//! Qwen-Image on the model interface: every placement of the tiny model (one device,
//! block splits, tensor parallel, streamed, sequence parallel) gives the single-device
//! reference's output; its weights load by the published names from the repository's
//! sharded `transformer/` layout; bad placements are refused in one line.

mod common;

use common::*;
use mold_exec::model::qwen::{random_inputs, testdata};
use mold_exec::*;
use mold_plan::{DeviceId, Part};

const TOL: f64 = 1e-5;
const SEEDS: [u64; 2] = [1, 42];
const ALL: [&str; 1] = ["block 0..3"];

fn cfg() -> QwenConfig {
    QwenConfig::qwen_image_tiny()
}

/// A tiny f32 checkpoint for `seed` in the published layout (several shards + index).
fn checkpoint(seed: u64) -> Checkpoint {
    let dir = tmpdir(&format!("qwen-tiny-{seed}"));
    testdata::write_testdata(&cfg(), &dir, seed, DType::F32, 400_000).unwrap();
    Checkpoint::open(&dir).unwrap()
}

/// 64×48 pixels: a 3 × 4 patch grid (an odd side: rows at -2, -1, 0), 7 text tokens,
/// batch 2.
fn inputs(seed: u64) -> QwenInputs {
    random_inputs(&cfg(), 64, 48, 7, 2, seed).unwrap()
}

fn qwen_plan(parts: Vec<Part>, dtype: mold_plan::DType) -> mold_plan::Plan {
    let mut p = plan_with(parts, dtype);
    p.model.id = "qwen-image-tiny".into();
    p.workload.guidance = None;
    p
}

fn error_vs_reference(ckpt: &Checkpoint, parts: Vec<Part>, seed: u64) -> f64 {
    let x = inputs(seed);
    let reference = Executor::reference(&cfg(), ckpt, &DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    let exec = Executor::new(&cfg(), &qwen_plan(parts, mold_plan::DType::F32), ckpt).unwrap();
    let out = exec.forward(&x).unwrap();
    assert_eq!(out.dims(), &[2, 12, 64]);
    let again = exec.forward(&x).unwrap();
    assert_eq!(max_relative_error(&again, &out).unwrap(), 0.0);
    max_relative_error(&out, &reference).unwrap()
}

fn check(parts: impl Fn() -> Vec<Part>) {
    for seed in SEEDS {
        let ckpt = checkpoint(seed);
        let err = error_vs_reference(&ckpt, parts(), seed);
        assert!(
            err <= TOL,
            "seed {seed}: max relative error {err:e} > {TOL:e}"
        );
    }
}

#[test]
fn one_device() {
    check(|| vec![part(&["emu:0"], &ALL, false)]);
}

#[test]
fn split_two() {
    check(|| {
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part(&["emu:1"], &["block 1..3"], false),
        ]
    });
}

#[test]
fn split_three() {
    check(|| {
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part(&["emu:1"], &["block 1..2"], false),
            part(&["emu:2"], &["block 2..3"], false),
        ]
    });
}

#[test]
fn tensor_parallel_2() {
    check(|| vec![part(&["emu:0", "emu:1"], &ALL, false)]);
}

#[test]
fn tensor_parallel_4() {
    check(|| vec![part(&["emu:0", "emu:1", "emu:2", "emu:3"], &ALL, false)]);
}

#[test]
fn tensor_parallel_2_times_split_2() {
    check(|| {
        vec![
            part(&["emu:0", "emu:1"], &["block 0..2"], false),
            part(&["emu:2", "emu:3"], &["block 2..3"], false),
        ]
    });
}

#[test]
fn streamed() {
    check(|| vec![part(&["emu:0"], &ALL, true)]);
    check(|| {
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part(&["emu:0"], &["block 1..3"], true),
        ]
    });
    check(|| vec![part(&["emu:0", "emu:1"], &ALL, true)]);
}

/// Ulysses over 2 ranks: 7 text and 12 image tokens, 4 heads.
#[test]
fn sequence_parallel_2() {
    check(|| vec![part_par(&["emu:0", "emu:1"], 1, 2, &ALL, false)]);
}

/// 3 ranks: uneven tokens (3/2/2 text, 4 image each) and heads (2/1/1).
#[test]
fn sequence_parallel_3_uneven() {
    check(|| vec![part_par(&["emu:0", "emu:1", "emu:2"], 1, 3, &ALL, false)]);
}

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

#[test]
fn sequence_parallel_on_one_part_of_a_split_and_streamed() {
    check(|| {
        vec![
            part(&["emu:0"], &["block 0..1"], false),
            part_par(&["emu:1", "emu:2"], 1, 2, &["block 1..2"], true),
            part_par(&["emu:1", "emu:2"], 1, 2, &["block 2..3"], false),
        ]
    });
}

/// bf16 weights and compute stay close to the f32 reference.
#[test]
fn bf16_compute_is_close_to_f32() {
    let ckpt = checkpoint(3);
    let x = inputs(3);
    let f32_out = Executor::reference(&cfg(), &ckpt, &DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    let p = qwen_plan(
        vec![part(&["emu:0", "emu:1"], &ALL, false)],
        mold_plan::DType::Bf16,
    );
    let out = Executor::new(&cfg(), &p, &ckpt)
        .unwrap()
        .forward(&x)
        .unwrap();
    let err = max_relative_error(&out.to_dtype(DType::F32).unwrap(), &f32_out).unwrap();
    assert!(err < 3e-2, "bf16 vs f32: {err:e}");
}

/// The checkpoint is the published layout: `transformer/` with numbered shards, the
/// index and diffusers' config; every tensor the model reads is there under the
/// published names, and a checkpoint without one is refused naming it.
#[test]
fn weights_load_by_the_published_names() {
    let dir = tmpdir("qwen-layout");
    let files = testdata::write_testdata(&cfg(), &dir, 9, DType::F32, 400_000).unwrap();
    let t = dir.join("transformer");
    let names: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(&t).unwrap().display().to_string())
        .collect();
    assert!(names.len() >= 4, "{names:?}");
    assert!(names[0].starts_with("diffusion_pytorch_model-00001-of-"));
    assert!(names.contains(&"diffusion_pytorch_model.safetensors.index.json".into()));
    assert!(names.contains(&"config.json".into()));
    let config = std::fs::read_to_string(t.join("config.json")).unwrap();
    assert!(config.contains("QwenImageTransformer2DModel"), "{config}");
    let ckpt = Checkpoint::open(&dir).unwrap();
    ckpt.check(&cfg(), "qwen-image-tiny").unwrap();
    for name in [
        "img_in.weight",
        "txt_norm.weight",
        "time_text_embed.timestep_embedder.linear_2.bias",
        "transformer_blocks.2.attn.add_k_proj.weight",
        "transformer_blocks.0.attn.norm_added_q.weight",
        "transformer_blocks.1.attn.to_out.0.weight",
        "transformer_blocks.1.txt_mlp.net.0.proj.weight",
        "transformer_blocks.0.img_mod.1.bias",
        "norm_out.linear.weight",
        "proj_out.bias",
    ] {
        assert!(ckpt.tensors().contains_key(name), "{name}");
    }
    // The full-size model's names and shapes are the same family's.
    let full = QwenConfig::qwen_image().tensor_specs();
    let q = full
        .iter()
        .find(|s| s.name == "transformer_blocks.59.attn.to_q.weight")
        .unwrap();
    assert_eq!(q.shape, vec![3072, 3072]);
    let txt_in = full.iter().find(|s| s.name == "txt_in.weight").unwrap();
    assert_eq!(txt_in.shape, vec![3072, 3584]);

    // A flux-tiny checkpoint is not a Qwen-Image one: the first missing name is given.
    let flux = tiny_checkpoint(1);
    let e = flux
        .check(&cfg(), "qwen-image-tiny")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("img_in.weight") || e.contains("txt_norm.weight"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
}

/// Placements the model cannot run are refused before anything loads, in one line
/// naming what to change.
#[test]
fn refusals() {
    let ckpt = checkpoint(2);
    let refused = |parts: Vec<Part>| {
        Executor::new(&cfg(), &qwen_plan(parts, mold_plan::DType::F32), &ckpt)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = refused(vec![part(&["emu:0", "emu:1", "emu:2"], &ALL, false)]);
    assert!(e.contains("does not divide the 4 attention heads"), "{e}");
    let e2 = refused(vec![part_par(
        &["emu:0", "emu:1", "emu:2", "emu:3", "emu:4"],
        1,
        5,
        &ALL,
        false,
    )]);
    assert!(e2.contains("sp ≤ 4"), "{e2}");
    let e3 = refused(vec![part(&["emu:0"], &["double 0..3"], false)]);
    assert!(e3.contains("`block`"), "{e3}");
    let e4 = refused(vec![part(&["emu:0"], &["block 0..4"], false)]);
    assert!(e4.contains("block 0..3"), "{e4}");
    for e in [e, e2, e3, e4] {
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // Inputs that do not fit the model are refused naming the field.
    let exec = Executor::new(
        &cfg(),
        &qwen_plan(vec![part(&["emu:0"], &ALL, false)], mold_plan::DType::F32),
        &ckpt,
    )
    .unwrap();
    let mut x = inputs(2);
    x.grid = (4, 4);
    let e = exec.forward(&x).unwrap_err().to_string();
    assert!(e.contains("patch grid 4×4"), "{e}");
    let mut x = inputs(2);
    x.txt = Tensor::zeros((2, 7, 16), DType::F32, &Device::Cpu).unwrap();
    let e = exec.forward(&x).unwrap_err().to_string();
    assert!(e.contains("txt must be (2, tokens ≥ 1, 32)"), "{e}");
}

/// Token-split tensor parallelism (`CommOptions::token_split`): between products each
/// rank holds its share of the 7 text tokens (padded: 4 + 3 over two ranks, 2 + 2 + 2 + 1
/// over four) and of the 12 image tokens, batch 2. TP2, TP4, two TP2 parts, and SP2 × TP2
/// give the single-device output, and every rank's profile has the token reduce-scatter.
#[test]
fn tensor_parallel_with_split_tokens() {
    let four = ["emu:0", "emu:1", "emu:2", "emu:3"];
    let layouts = [
        vec![part(&["emu:0", "emu:1"], &ALL, false)],
        vec![part(&four, &ALL, false)],
        vec![
            part(&["emu:0", "emu:1"], &["block 0..2"], false),
            part(&["emu:2", "emu:3"], &["block 2..3"], true),
        ],
        vec![part_par(&four, 2, 2, &ALL, false)],
    ];
    for seed in SEEDS {
        let ckpt = checkpoint(seed);
        let x = inputs(seed);
        let reference = Executor::reference(&cfg(), &ckpt, &DeviceId::Host, DType::F32)
            .unwrap()
            .forward(&x)
            .unwrap();
        for (i, parts) in layouts.iter().enumerate() {
            let mut opts = ExecOptions::default();
            opts.comm.token_split = true;
            let p = qwen_plan(parts.clone(), mold_plan::DType::F32);
            let exec = Executor::with_options(&cfg(), &p, &ckpt, opts)
                .unwrap()
                .with_profiling(true);
            let err = max_relative_error(&exec.forward(&x).unwrap(), &reference).unwrap();
            assert!(err <= TOL, "seed {seed}, layout {i}: {err:e}");
            for (dev, phases) in exec.profile_report() {
                assert!(
                    phases.iter().any(|p| p.0 == "reduce-scatter (tokens)"),
                    "layout {i}, {dev}: {phases:?}"
                );
            }
        }
    }
}
