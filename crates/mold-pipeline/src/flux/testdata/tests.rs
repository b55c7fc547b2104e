//! The test data's own tests: every file loads as the pipeline reads it.

use super::*;
use crate::flux::text::{Clip, T5};
use crate::flux::vae::Vae;
use crate::WeightsLayout;
use candle_nn::VarMap;
use mold_exec::Kernels;

#[test]
fn recorder_lists_what_the_varmap_lists() {
    let flux = FluxConfig::flux_tiny();
    let cfg: t5::Config = serde_json::from_value(tiny_t5_config(&flux)).unwrap();
    let listed = list_tensors(
        |n| n.to_string(),
        |vb| t5::T5EncoderModel::load(vb, &cfg).map(|_| ()),
    )
    .unwrap();
    let vm = VarMap::new();
    t5::T5EncoderModel::load(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg).unwrap();
    let data = vm.data().lock().unwrap();
    let mut want: Vec<(String, Vec<usize>)> = data
        .iter()
        .map(|(k, v)| {
            // An empty VarMap has no `shared.weight`, so T5 falls back to this name;
            // the recorder claims every name, as a real checkpoint has `shared`.
            let k = if k == "encoder.embed_tokens.weight" {
                "shared.weight"
            } else {
                k
            };
            (k.to_string(), v.as_tensor().dims().to_vec())
        })
        .collect();
    want.sort();
    let got: Vec<(String, Vec<usize>)> = listed.into_iter().map(|s| (s.name, s.shape)).collect();
    assert_eq!(got, want);
    // Full size, without allocating it: T5-XXL has 4.76 B parameters in the encoder.
    let xxl: t5::Config = serde_json::from_value(t5_xxl_config()).unwrap();
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| t5::T5EncoderModel::load(vb, &xxl).map(|_| ()),
    )
    .unwrap();
    let params: usize = specs
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum();
    assert!((4_700_000_000..4_800_000_000).contains(&params), "{params}");
    // The full-size configs go through the same parsers as real ones.
    let d = std::env::temp_dir().join(format!("mold-full-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let files = crate::layout::EncoderFiles {
        config: d.join("config.json"),
        weights: vec![],
        tokenizer: d.join("tokenizer.json"),
    };
    write_json(&files.config, &clip_l_config()).unwrap();
    let c = crate::flux::text::clip_config(&files).unwrap();
    assert_eq!(
        (c.embed_dim, c.num_hidden_layers, c.vocab_size),
        (768, 12, 49408)
    );
    write_json(&files.config, &t5_xxl_config()).unwrap();
    assert_eq!(crate::flux::text::t5_config(&files).unwrap().d_model, 4096);
}

#[test]
fn tiny_pipeline_loads_and_runs_each_component() {
    let d = std::env::temp_dir().join(format!("mold-pipeline-tiny-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    write_tiny_pipeline(&d, 0).unwrap();
    let l = WeightsLayout::locate(&d, "flux-tiny").unwrap();
    let flux = FluxConfig::flux_tiny();
    let dev = Device::Cpu;
    let files = mold_exec::weights_copy::WeightsFrom::files(true);

    let mut t5 = T5::load(&l.t5, 8, DType::F32, &dev, Kernels::Auto, &files).unwrap();
    let txt = t5.encode("a red fox in snow").unwrap();
    assert_eq!(txt.dims(), [1, 8, flux.context_in_dim]);
    // Truncation: a long prompt still gives 8 tokens.
    let long = "a red fox ".repeat(20);
    assert_eq!(t5.encode(&long).unwrap().dims(), [1, 8, 32]);
    let tok = crate::flux::text::load_tokenizer(&l.t5.tokenizer, 8, &["<pad>"]).unwrap();
    let ids = crate::text::tokenize(&tok, &l.t5.tokenizer, "A red fox").unwrap();
    // a, red, fox, </s>, then <pad> (0).
    assert_eq!(&ids[3..], &[1, 0, 0, 0, 0]);
    assert!(ids[..3].iter().all(|&i| i > 2), "{ids:?}");

    let mut clip = Clip::load(&l.clip, DType::F32, &dev, Kernels::Auto, &files).unwrap();
    let y = clip.encode("a red fox in snow").unwrap();
    assert_eq!(y.dims(), [1, flux.vec_in_dim]);
    let ctok =
        crate::flux::text::load_tokenizer(&l.clip.tokenizer, 77, &["<|endoftext|>"]).unwrap();
    let ids = crate::text::tokenize(&ctok, &l.clip.tokenizer, "red fox").unwrap();
    let eot = ctok.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(ids.len(), 77);
    assert_eq!(ids[0], ctok.token_to_id("<|startoftext|>").unwrap());
    assert!(ids[3..].iter().all(|&i| i == eot), "{ids:?}");
    assert_eq!(ids.iter().copied().max(), Some(eot));

    let vae = Vae::load(&l, DType::F32, &dev).unwrap();
    let z = Tensor::zeros((1, 16, 4, 6), DType::F32, &dev).unwrap();
    assert_eq!(vae.decode(&z).unwrap().dims(), [1, 3, 32, 48]);
    // A plan's bf16 VAE on the host or an emulated device decodes too (in f32).
    let vae = Vae::load(&l, DType::BF16, &dev).unwrap();
    let z = Tensor::zeros((1, 16, 4, 6), DType::BF16, &dev).unwrap();
    assert_eq!(vae.decode(&z).unwrap().dims(), [1, 3, 32, 48]);
    std::fs::remove_dir_all(&d).unwrap();
}

/// An encoder or VAE loaded by copying another instance's kept weights
/// (`WeightsFrom::CopyOf`) computes what the instance read from the files computes, bit for
/// bit: the builders redo their fusions on the copies.
#[test]
fn copied_encoders_and_vae_equal_the_ones_read() {
    use mold_exec::weights_copy::{Kept, WeightsFrom};
    let d = std::env::temp_dir().join(format!("mold-pipeline-copies-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    write_tiny_pipeline(&d, 0).unwrap();
    let l = WeightsLayout::locate(&d, "flux-tiny").unwrap();
    let dev = Device::Cpu;
    // Equal digests (FNV-1a of the values' f32 bits): equal outputs, bit for bit.
    let bits = |t: &Tensor| mold_exec::digest(t).unwrap();
    let keep = |kept: &Kept| WeightsFrom::Files {
        staged: true,
        keep: Some(kept.clone()),
    };
    let copy = |kept: &Kept| WeightsFrom::CopyOf {
        kept: kept.clone(),
        peer_copies: true,
    };
    let prompt = "a red fox in snow";
    // Doubles the kept tensor whose name ends with `suffix`.
    let double_one = |kept: &Kept, suffix: &str| {
        let name = kept
            .names()
            .into_iter()
            .find(|n| n.ends_with(suffix))
            .unwrap_or_else(|| panic!("no kept {suffix}: {:?}", kept.names()));
        kept.keep(&name, &(kept.get(&name).unwrap() * 2.).unwrap());
    };

    let kept = Kept::on("emu:0");
    let mut read = T5::load(&l.t5, 8, DType::F32, &dev, Kernels::Auto, &keep(&kept)).unwrap();
    assert!(!kept.is_empty());
    let mut copied = T5::load(&l.t5, 8, DType::F32, &dev, Kernels::Auto, &copy(&kept)).unwrap();
    assert_eq!(
        bits(&read.encode(prompt).unwrap()),
        bits(&copied.encode(prompt).unwrap())
    );
    assert_eq!(kept.misses(), 0);
    // The copy took the kept tensors: a kept weight changed changes the copy's output.
    double_one(&kept, "shared.weight");
    let mut changed = T5::load(&l.t5, 8, DType::F32, &dev, Kernels::Auto, &copy(&kept)).unwrap();
    assert_ne!(
        bits(&read.encode(prompt).unwrap()),
        bits(&changed.encode(prompt).unwrap())
    );

    let kept = Kept::on("emu:0");
    let mut read = Clip::load(&l.clip, DType::F32, &dev, Kernels::Auto, &keep(&kept)).unwrap();
    let mut copied = Clip::load(&l.clip, DType::F32, &dev, Kernels::Auto, &copy(&kept)).unwrap();
    assert_eq!(
        bits(&read.encode(prompt).unwrap()),
        bits(&copied.encode(prompt).unwrap())
    );
    assert_eq!(kept.misses(), 0);
    double_one(&kept, "final_layer_norm.weight");
    let mut changed = Clip::load(&l.clip, DType::F32, &dev, Kernels::Auto, &copy(&kept)).unwrap();
    assert_ne!(
        bits(&read.encode(prompt).unwrap()),
        bits(&changed.encode(prompt).unwrap())
    );

    let kept = Kept::on("emu:0");
    let opts = crate::flux::vae::VaeOptions::default();
    let read = Vae::load_from(&l, DType::F32, &dev, opts, &keep(&kept)).unwrap();
    let copied = Vae::load_from(&l, DType::F32, &dev, opts, &copy(&kept)).unwrap();
    let z = Tensor::randn(0f32, 1., (1, 16, 4, 6), &dev).unwrap();
    assert_eq!(
        bits(&read.decode(&z).unwrap()),
        bits(&copied.decode(&z).unwrap())
    );
    // The copy took the kept tensors: a kept weight changed changes the copy's output.
    assert_eq!(kept.misses(), 0);
    double_one(&kept, "conv_out.weight");
    let changed = Vae::load_from(&l, DType::F32, &dev, opts, &copy(&kept)).unwrap();
    assert_ne!(
        bits(&read.decode(&z).unwrap()),
        bits(&changed.decode(&z).unwrap())
    );
    std::fs::remove_dir_all(&d).unwrap();
}
