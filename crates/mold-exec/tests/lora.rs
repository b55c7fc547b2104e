//! LoRAs merged at load equal the explicit `W + s·alpha/rank·B·A`, computed by hand on
//! the whole tensors and written as a checkpoint of its own, on 1 device, split and
//! tensor parallel; every LoRA naming style; refusals name the tensor at fault.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use mold_exec::checkpoint::LoraSpec;
use mold_exec::*;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

const RANK: usize = 4;

fn randn(seed: u64, shape: (usize, usize)) -> Tensor {
    // Deterministic without a global RNG: candle's CPU randn is seeded per device.
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn save(path: &Path, tensors: &HashMap<String, Tensor>) {
    candle_core::safetensors::save(tensors, path).unwrap();
}

/// One LoRA layer: (down name, up name, alpha name or none, alpha, up rows, in cols),
/// and where its update goes by hand: (BFL tensor, [(BFL rows, rows of B·A)]).
struct Layer {
    prefix: &'static str,
    down: &'static str,
    up: &'static str,
    alpha: Option<f32>,
    out: usize,
    cols: usize,
    target: &'static str,
    rows: Vec<(Range<usize>, Range<usize>)>,
}

fn layers() -> Vec<Vec<Layer>> {
    let cfg = FluxConfig::flux_tiny();
    let (h, m) = (cfg.hidden, cfg.mlp_hidden());
    let kohya = |p, out, cols, target, rows| Layer {
        prefix: p,
        down: ".lora_down.weight",
        up: ".lora_up.weight",
        alpha: Some(2.0),
        out,
        cols,
        target,
        rows,
    };
    let peft = |p, out, cols, target, rows| Layer {
        prefix: p,
        down: ".lora_A.weight",
        up: ".lora_B.weight",
        alpha: None,
        out,
        cols,
        target,
        rows,
    };
    vec![
        // kohya / sd-scripts: BFL layers, `_` for `.`, alpha.
        vec![
            kohya(
                "lora_unet_double_blocks_0_img_attn_qkv",
                3 * h,
                h,
                "double_blocks.0.img_attn.qkv.weight",
                vec![(0..3 * h, 0..3 * h)],
            ),
            kohya(
                "lora_unet_single_blocks_1_linear2",
                h,
                h + m,
                "single_blocks.1.linear2.weight",
                vec![(0..h, 0..h)],
            ),
            kohya(
                "lora_unet_final_layer_adaLN_modulation_1",
                2 * h,
                h,
                "final_layer.adaLN_modulation.1.weight",
                vec![(0..2 * h, 0..2 * h)],
            ),
        ],
        // diffusers / PEFT: diffusers' layers, mapped onto BFL's.
        vec![
            peft(
                "transformer.transformer_blocks.1.attn.to_k",
                h,
                h,
                "double_blocks.1.img_attn.qkv.weight",
                vec![(h..2 * h, 0..h)],
            ),
            peft(
                "transformer.single_transformer_blocks.0.proj_mlp",
                m,
                h,
                "single_blocks.0.linear1.weight",
                vec![(3 * h..3 * h + m, 0..m)],
            ),
            peft(
                "transformer.transformer_blocks.0.ff_context.net.2",
                h,
                m,
                "double_blocks.0.txt_mlp.2.weight",
                vec![(0..h, 0..h)],
            ),
            // (scale, shift) in diffusers, (shift, scale) in BFL.
            peft(
                "transformer.norm_out.linear",
                2 * h,
                h,
                "final_layer.adaLN_modulation.1.weight",
                vec![(0..h, h..2 * h), (h..2 * h, 0..h)],
            ),
        ],
        // BFL-style with ComfyUI's prefix.
        vec![Layer {
            alpha: Some(8.0),
            ..peft(
                "diffusion_model.double_blocks.1.txt_mod.lin",
                6 * h,
                h,
                "double_blocks.1.txt_mod.lin.weight",
                vec![(0..6 * h, 0..6 * h)],
            )
        }],
    ]
}

/// Writes the LoRA files (seeded) and returns them with their strengths; applies each
/// update by hand to `w` (BFL tensors).
fn write_loras(dir: &Path, w: &mut HashMap<String, Tensor>) -> Vec<LoraSpec> {
    let strengths = [0.8, 1.0, 0.5];
    let mut specs = Vec::new();
    for (i, (file, strength)) in layers().into_iter().zip(strengths).enumerate() {
        let mut t = HashMap::new();
        for (j, l) in file.iter().enumerate() {
            let seed = (i * 10 + j) as u64;
            let a = randn(seed, (RANK, l.cols));
            let b = randn(seed + 100, (l.out, RANK));
            t.insert(format!("{}{}", l.prefix, l.down), a.clone());
            t.insert(format!("{}{}", l.prefix, l.up), b.clone());
            if let Some(al) = l.alpha {
                t.insert(
                    format!("{}.alpha", l.prefix),
                    Tensor::new(al, &Device::Cpu).unwrap(),
                );
            }
            let scale = strength * l.alpha.unwrap_or(RANK as f32) as f64 / RANK as f64;
            let delta = b.matmul(&a).unwrap().affine(scale, 0.0).unwrap();
            let old = &w[l.target];
            let mut rows: Vec<Tensor> = Vec::new();
            let n = old.dim(0).unwrap();
            for r in 0..n {
                let mut row = old.narrow(0, r, 1).unwrap();
                for (bfl, d) in &l.rows {
                    if bfl.contains(&r) {
                        let dr = d.start + (r - bfl.start);
                        row = (row + delta.narrow(0, dr, 1).unwrap()).unwrap();
                    }
                }
                rows.push(row);
            }
            w.insert(l.target.to_string(), Tensor::cat(&rows, 0).unwrap());
        }
        let p = dir.join(format!("lora{i}.safetensors"));
        save(&p, &t);
        specs.push(LoraSpec { path: p, strength });
    }
    specs
}

fn tiny(dir: &Path, seed: u64) -> PathBuf {
    write_testdata(&FluxConfig::flux_tiny(), dir, seed, DType::F32).unwrap()
}

#[test]
fn merged_loras_equal_the_explicit_update_on_every_placement() {
    let d = tmpdir("lora-merge");
    let base = tiny(&d, 11);
    let mut w = candle_core::safetensors::load(&base, &Device::Cpu).unwrap();
    let before = w.clone();
    let specs = write_loras(&d, &mut w);
    let by_hand = d.join("by-hand.safetensors");
    save(&by_hand, &w);
    assert!(w
        .iter()
        .any(|(k, v)| max_relative_error(v, &before[k]).unwrap() > 1e-3));

    let cfg = FluxConfig::flux_tiny();
    let with = Checkpoint::open(&base).unwrap().with_loras(&specs).unwrap();
    let want = Checkpoint::open(&by_hand).unwrap();
    let plain = Checkpoint::open(&base).unwrap();
    let x = tiny_inputs(4);
    for (what, p) in [
        (
            "1 device",
            plan(vec![part(
                &["emu:0"],
                &["double 0..2", "single 0..3"],
                false,
            )]),
        ),
        (
            "split",
            plan(vec![
                part(&["emu:0"], &["double 0..2"], false),
                part(&["emu:1"], &["single 0..3"], true),
            ]),
        ),
        (
            "tp2",
            plan(vec![part(
                &["emu:0", "emu:1"],
                &["double 0..2", "single 0..3"],
                false,
            )]),
        ),
        (
            "tp4",
            plan(vec![part(
                &["emu:0", "emu:1", "emu:2", "emu:3"],
                &["double 0..2", "single 0..3"],
                false,
            )]),
        ),
    ] {
        let a = Executor::new(&cfg, &p, &with).unwrap().forward(&x).unwrap();
        let b = Executor::new(&cfg, &p, &want).unwrap().forward(&x).unwrap();
        let c = Executor::new(&cfg, &p, &plain)
            .unwrap()
            .forward(&x)
            .unwrap();
        let err = max_relative_error(&a, &b).unwrap();
        assert!(err < 1e-5, "{what}: merged at load vs by hand: {err:e}");
        assert!(
            max_relative_error(&c, &b).unwrap() > 1e-3,
            "{what}: the LoRAs change nothing: the test would pass without them"
        );
    }
}

/// Writes a LoRA of `tensors` (name, shape) and returns the refusal merging it gives.
fn refusal(name: &str, tensors: &[(&str, (usize, usize))]) -> String {
    let d = tmpdir(&format!("lora-bad-{name}"));
    let base = tiny(&d, 1);
    let mut t = HashMap::new();
    for (i, (n, shape)) in tensors.iter().enumerate() {
        t.insert(n.to_string(), randn(i as u64, *shape));
    }
    let p = d.join(format!("{name}.safetensors"));
    save(&p, &t);
    let spec = LoraSpec {
        path: p.clone(),
        strength: 1.0,
    };
    let e = Checkpoint::open(&base)
        .unwrap()
        .with_loras(&[spec])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with(&format!("LoRA {}: ", p.display())), "{e}");
    assert!(!e.contains('\n'), "{e}");
    e
}

#[test]
fn loras_that_do_not_fit_are_refused_naming_the_tensor() {
    let h = FluxConfig::flux_tiny().hidden;
    let e = refusal(
        "unknown",
        &[
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                (RANK, h),
            ),
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
                (3 * h, RANK),
            ),
            ("lora_unet_input_blocks_1_proj.lora_down.weight", (RANK, h)),
        ],
    );
    assert!(
        e.contains("tensor `lora_unet_input_blocks_1_proj.lora_down.weight`")
            && e.contains("is no layer of this FLUX transformer"),
        "{e}"
    );
    let e = refusal(
        "te",
        &[(
            "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
            (RANK, 16),
        )],
    );
    assert!(e.contains("text encoder"), "{e}");
    let e = refusal(
        "shape",
        &[
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
                (RANK, h),
            ),
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_B.weight",
                (3 * h, RANK),
            ),
        ],
    );
    assert!(
        e.contains("`transformer.transformer_blocks.0.attn.to_q.lora_B.weight` [192, 4]")
            && e.contains(&format!("up [{h}, rank]")),
        "{e}"
    );
    let e = refusal(
        "alone",
        &[("double_blocks.0.img_mod.lin.lora_A.weight", (RANK, h))],
    );
    assert!(e.contains("has no partner"), "{e}");
    let e = refusal(
        "dora",
        &[("double_blocks.0.img_mod.lin.dora_scale", (1, h))],
    );
    assert!(e.contains("DoRA"), "{e}");
}

/// In an FP8 plan LoRAs are merged before the weights are quantized: the plan over the base
/// checkpoint with LoRAs runs as the FP8 plan over the merged checkpoint (measured: the same
/// output), and not as the base model's (5.9e-2 away).
#[test]
fn loras_are_merged_before_fp8_quantization() {
    let d = tmpdir("lora-fp8");
    let base = tiny(&d, 12);
    let mut w = candle_core::safetensors::load(&base, &Device::Cpu).unwrap();
    let specs = write_loras(&d, &mut w);
    let by_hand = d.join("by-hand.safetensors");
    save(&by_hand, &w);
    let cfg = FluxConfig::flux_tiny();
    let with = Checkpoint::open(&base).unwrap().with_loras(&specs).unwrap();
    let want = Checkpoint::open(&by_hand).unwrap();
    let plain = Checkpoint::open(&base).unwrap();
    let x = tiny_inputs(5);
    let p = plan_with(
        vec![part(&["emu:0"], &["double 0..2", "single 0..3"], false)],
        mold_plan::DType::Fp8,
    );
    let run = |c: &Checkpoint| Executor::new(&cfg, &p, c).unwrap().forward(&x).unwrap();
    let (a, b, c) = (run(&with), run(&want), run(&plain));
    let merged = max_relative_error(&a, &b).unwrap();
    let without = max_relative_error(&a, &c).unwrap();
    assert!(
        merged <= 1e-6,
        "FP8 with LoRAs against FP8 of the merged weights: {merged}"
    );
    assert!(without > 1e-2, "the LoRAs' effect: {without}");
}
