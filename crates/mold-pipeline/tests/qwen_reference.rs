//! Qwen-Image's text encoder and VAE decoder against values transformers 5.17 and
//! diffusers 0.42.1 computed (CPU, f32) on the same random weights (mold's test data,
//! written here from a fixed seed) and inputs: the conditioning of
//! `QwenImagePipeline.encode_prompt` and `AutoencoderKLQwenImage.decode`.
//! The reference values were taken with the script in each test's comment; the full
//! comparison is `benches/parity/qwen_pipeline_diffusers.py`.

use candle_core::{DType, Device, Tensor};
use mold_pipeline::qwen::testdata::write_tiny_pipeline;
use mold_pipeline::qwen::text::QwenText;
use mold_pipeline::qwen::vae::{QwenVae, QwenVaeConfig, QwenVaeFiles};
use mold_pipeline::qwen::QwenLayout;
use mold_plan::DType as ModelDType;
use std::path::PathBuf;

fn tmpdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("mold-pipeline")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `want`: (index, value) pairs and the reference's max |x|; every picked element
/// within `1e-5 · max |x|`, and the mean and mean |x| too.
fn check(
    what: &str,
    got: &Tensor,
    shape: &[usize],
    stats: (f32, f32, f32),
    picks: &[(&[usize], f32)],
) {
    assert_eq!(got.dims(), shape, "{what}: shape");
    let (max, mean, mean_abs) = stats;
    let tol = 1e-5 * max;
    let flat: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    let n = flat.len() as f32;
    let got_max = flat.iter().fold(0f32, |m, x| m.max(x.abs()));
    let got_mean = flat.iter().sum::<f32>() / n;
    let got_mean_abs = flat.iter().map(|x| x.abs()).sum::<f32>() / n;
    assert!(
        (got_max - max).abs() <= tol,
        "{what}: max |x| {got_max}, want {max}"
    );
    assert!(
        (got_mean - mean).abs() <= tol,
        "{what}: mean {got_mean}, want {mean}"
    );
    assert!(
        (got_mean_abs - mean_abs).abs() <= tol,
        "{what}: mean |x| {got_mean_abs}, want {mean_abs}"
    );
    for (idx, want) in picks {
        let mut off = 0;
        for (i, d) in idx.iter().zip(shape) {
            off = off * d + i;
        }
        let g = flat[off];
        assert!(
            (g - want).abs() <= tol,
            "{what}{idx:?}: {g}, diffusers {want} (|diff| {} > {tol})",
            (g - want).abs()
        );
    }
}

/// The tiny model's text encoder is f32 like the rest of it (the parity script compares
/// it with diffusers in f32; a bf16 default made the conditioning differ by ~2e-2).
#[test]
fn qwen_image_tiny_plans_every_component_in_f32() {
    let m = mold_models::find("qwen-image-tiny").unwrap();
    assert_eq!(m.transformer.default_dtype, ModelDType::F32);
    for c in &m.components {
        assert_eq!(c.default_dtype, ModelDType::F32, "component {}", c.name);
    }
}

/// `encode_prompt("a red fox in the snow")` on `mold testdata qwen-image-tiny-pipeline`
/// (seed 0): transformers' `hidden_states[-1]` (after the final norm) less the
/// template's first 34 tokens: the prompt's 6 tokens and the template's 5 closing ones.
///
/// ```python
/// pipe = QwenImagePipeline.from_pretrained(W, torch_dtype=torch.float32)
/// e = pipe.encode_prompt(prompt="a red fox in the snow", device="cpu")[0][0]
/// ```
#[test]
fn text_encoder_matches_transformers() {
    let dir = tmpdir("qwen-ref-text");
    write_tiny_pipeline(&dir, 0).unwrap();
    let layout = QwenLayout::locate(&dir).unwrap();
    let enc = QwenText::load(
        &layout.text,
        DType::F32,
        &Device::Cpu,
        mold_exec::Kernels::Auto,
    )
    .unwrap();
    let c = enc
        .encode("a red fox in the snow")
        .unwrap()
        .squeeze(0)
        .unwrap();
    check(
        "conditioning",
        &c,
        &[11, 32],
        (2.858_249_4, 0.309_721_05, 0.778_859_7),
        &[
            (&[0, 0], 0.449_240_36),
            (&[0, 31], 0.474_287_8),
            (&[1, 7], 1.161_473_3),
            (&[2, 3], 1.440_665_7),
            (&[3, 20], -0.478_015_48),
            (&[4, 11], 1.084_720_5),
            (&[5, 0], 0.572_499_6),
            (&[6, 30], -0.693_902_1),
            (&[7, 15], -0.131_455_88),
            (&[8, 9], 0.265_709_5),
            (&[9, 1], -1.098_451_5),
            (&[10, 31], 0.622_287_8),
        ],
    );
}

/// The latents `1.5 · sin(0.37 c + 0.91 i + 1.3 j)`, `(1, 16, 4, 6)`, normalized.
fn latents() -> Tensor {
    let mut v = Vec::new();
    for c in 0..16 {
        for i in 0..4 {
            for j in 0..6 {
                v.push(((0.37 * c as f64 + 0.91 * i as f64 + 1.3 * j as f64).sin() * 1.5) as f32);
            }
        }
    }
    Tensor::from_vec(v, (1, 16, 4, 6), &Device::Cpu).unwrap()
}

/// `AutoencoderKLQwenImage.decode(z · latents_std + latents_mean)` of [`latents`], the
/// decoder of the tiny pipeline (seed 0).
///
/// ```python
/// vc = pipe.vae.config
/// mean = torch.tensor(vc.latents_mean).view(1, 16, 1, 1)
/// std = torch.tensor(vc.latents_std).view(1, 16, 1, 1)
/// img = pipe.vae.decode((z * std + mean).unsqueeze(2))[0][:, :, 0][0]
/// ```
#[test]
fn tiny_vae_matches_diffusers() {
    let dir = tmpdir("qwen-ref-vae");
    write_tiny_pipeline(&dir, 0).unwrap();
    let layout = QwenLayout::locate(&dir).unwrap();
    let vae = QwenVae::load(&layout.vae, DType::F32, &Device::Cpu).unwrap();
    let img = vae.decode(&latents()).unwrap().squeeze(0).unwrap();
    check(
        "image",
        &img,
        &[3, 32, 48],
        (1.0, 0.030_243_674, 0.163_197_2),
        &[
            (&[0, 0, 0], 0.180_864_59),
            (&[0, 31, 47], 0.108_733_24),
            (&[1, 5, 9], -0.111_243_61),
            (&[2, 17, 30], -0.182_033_73),
            (&[1, 8, 8], 0.136_041_66),
            (&[0, 20, 3], -0.132_366_75),
            (&[2, 0, 47], -0.233_258_63),
            (&[1, 31, 0], 0.007_876_255),
            (&[0, 12, 25], -0.144_493_49),
            (&[2, 25, 40], 0.085_061_71),
            (&[1, 14, 33], 0.048_290_61),
            (&[2, 3, 21], 0.178_491_17),
        ],
    );
}

/// Qwen-Image's VAE structure at width 16 (`dim_mult` [1, 2, 4, 4], 2 residual blocks
/// per level: the published one's shape, channel changes in the residual shortcuts and
/// up-samplers), random weights from seed 5, on [`latents`].
#[test]
fn qwen_image_shaped_vae_matches_diffusers() {
    let dir = tmpdir("qwen-ref-vae16");
    let cfg = QwenVaeConfig {
        base_dim: 16,
        dim_mult: vec![1, 2, 4, 4],
        num_res_blocks: 2,
        ..QwenVaeConfig::qwen_image()
    };
    let files = QwenVaeFiles {
        config: dir.join("config.json"),
        weights: vec![dir.join("diffusion_pytorch_model.safetensors")],
    };
    std::fs::write(&files.config, cfg.diffusers_config().to_string()).unwrap();
    mold_exec::write_safetensors(&files.weights[0], &cfg.tensor_specs(), 5, DType::F32).unwrap();
    let vae = QwenVae::load(&files, DType::F32, &Device::Cpu).unwrap();
    let img = vae.decode(&latents()).unwrap().squeeze(0).unwrap();
    check("image", &img, &[3, 32, 48], VAE16_STATS, VAE16_PICKS);
}
/// diffusers' output for [`qwen_image_shaped_vae_matches_diffusers`]:
///
/// ```python
/// v = AutoencoderKLQwenImage.from_pretrained(DIR, torch_dtype=torch.float32)
/// img = v.decode((z * std + mean).unsqueeze(2))[0][:, :, 0][0]
/// ```
const VAE16_STATS: (f32, f32, f32) = (0.998_651_5, -0.019_988_188, 0.159_396_17);
const VAE16_PICKS: &[(&[usize], f32)] = &[
    (&[0, 0, 0], -0.105_789_706),
    (&[0, 31, 47], 0.072_310_1),
    (&[1, 5, 9], 0.087_881_9),
    (&[2, 17, 30], -0.133_544_43),
    (&[1, 8, 8], 0.155_927_26),
    (&[0, 20, 3], -0.141_629_31),
    (&[2, 0, 47], -0.087_707_13),
    (&[1, 31, 0], 0.062_125_653),
    (&[0, 12, 25], -0.314_868_24),
    (&[2, 25, 40], 0.198_784_44),
    (&[1, 14, 33], 0.079_644_31),
    (&[2, 3, 21], -0.185_601_07),
];
