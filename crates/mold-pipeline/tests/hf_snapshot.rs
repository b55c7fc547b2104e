//! The Hugging Face repository layout of FLUX.1 (`mold testdata flux-tiny-hf`): found by
//! the weights layout, the diffusers-format transformer read as BFL's, the CLIP BPE
//! tokenizer built from vocab.json + merges.txt, and the same outputs from either
//! transformer format, on one device, split and tensor parallel.

use mold_exec::{max_relative_error, Checkpoint, DType, Executor, FluxConfig, Tensor};
use mold_pipeline::flux::testdata::hf::{write_hf_snapshot, HfModel};
use mold_pipeline::WeightsLayout;
use mold_plan::{ComponentRole, Part, Plan};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn tmpdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("mold-pipeline")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One tiny snapshot (seed 7) with both transformer formats, written once.
fn snapshot() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tmpdir("hf-both");
        write_hf_snapshot(&d, HfModel::Tiny, 7, DType::F32).unwrap();
        d
    })
}

/// The same snapshot without BFL's file: only diffusers' `transformer/` is left.
fn diffusers_only() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tmpdir("hf-diffusers");
        write_hf_snapshot(&d, HfModel::Tiny, 7, DType::F32).unwrap();
        std::fs::remove_file(d.join("flux1-dev.safetensors")).unwrap();
        d
    })
}

/// The tiny plan with the transformer on `parts`: (devices, blocks, tp).
fn plan(parts: &[(&[&str], &[&str], u32)]) -> Plan {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plans/flux-tiny@cpu-emu-4.yaml");
    let mut plan = Plan::load(&p).unwrap();
    let tf = plan
        .components
        .iter_mut()
        .find(|c| c.role == ComponentRole::Transformer)
        .unwrap();
    let base = tf.parts[0].clone();
    tf.parts = parts
        .iter()
        .map(|(devices, blocks, tp)| Part {
            blocks: blocks.iter().map(|b| b.parse().unwrap()).collect(),
            devices: devices.iter().map(|d| d.parse().unwrap()).collect(),
            tp: *tp,
            ..base.clone()
        })
        .collect();
    plan
}

fn plans() -> Vec<(&'static str, Plan)> {
    vec![
        (
            "1 device",
            plan(&[(&["emu:0"], &["double 0..2", "single 0..3"], 1)]),
        ),
        (
            "split",
            plan(&[
                (&["emu:0"], &["double 0..2", "single 0..1"], 1),
                (&["emu:1"], &["single 1..3"], 1),
            ]),
        ),
        (
            "tp2",
            plan(&[(&["emu:0", "emu:1"], &["double 0..2", "single 0..3"], 2)]),
        ),
    ]
}

#[test]
fn the_layout_finds_the_hugging_face_files() {
    let d = snapshot();
    let l = WeightsLayout::locate(d, "flux-tiny").unwrap();
    assert!(l.transformer.ends_with("flux1-dev.safetensors"));
    assert!(l.t5.config.ends_with("text_encoder_2/config.json"));
    assert_eq!(l.t5.weights.len(), 2, "{:?}", l.t5.weights);
    assert!(l.t5.tokenizer.ends_with("tokenizer_2/tokenizer.json"));
    assert!(l.clip.weights[0].ends_with("text_encoder/model.safetensors"));
    assert!(l.clip.tokenizer.ends_with("tokenizer/vocab.json"));
    assert!(!d.join("tokenizer/tokenizer.json").exists());
    // Without BFL's file, the diffusers folder is the transformer.
    let l = WeightsLayout::locate(diffusers_only(), "flux-tiny").unwrap();
    assert!(l
        .transformer
        .ends_with("transformer/diffusion_pytorch_model.safetensors.index.json"));
    // A hub cache repository folder is taken to the snapshot refs/main names.
    let cache = tmpdir("hub");
    let repo = cache.join("models--black-forest-labs--FLUX.1-dev");
    std::fs::create_dir_all(repo.join("snapshots")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(d, repo.join("snapshots/abc123")).unwrap();
    #[cfg(unix)]
    {
        let l = WeightsLayout::locate(&repo, "flux-tiny").unwrap();
        assert!(l.dir.ends_with("snapshots/abc123"), "{:?}", l.dir);
        let found =
            mold_models::snapshot::find_weights(std::slice::from_ref(&cache), "flux-dev").unwrap();
        assert!(found.ends_with("snapshots/abc123"));
        let looked =
            mold_models::snapshot::find_weights(std::slice::from_ref(&cache), "flux-schnell")
                .unwrap_err();
        assert!(looked
            .iter()
            .any(|p| p.ends_with("models--black-forest-labs--FLUX.1-schnell")));
    }
}

#[test]
fn a_missing_file_is_named_with_where_it_was_looked_for() {
    let d = tmpdir("hf-missing");
    write_hf_snapshot(&d, HfModel::Tiny, 1, DType::F32).unwrap();
    std::fs::remove_file(d.join("tokenizer/merges.txt")).unwrap();
    std::fs::remove_file(d.join("text_encoder_2/model-00002-of-00002.safetensors")).unwrap();
    std::fs::remove_file(d.join("flux1-dev.safetensors")).unwrap();
    std::fs::remove_file(d.join("transformer/diffusion_pytorch_model.safetensors.index.json"))
        .unwrap();
    let e = WeightsLayout::locate(&d, "flux-tiny")
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n'), "{e}");
    for want in [
        "text_encoder_2/model-00002-of-00002.safetensors (a T5 encoder shard named by text_encoder_2/model.safetensors.index.json)",
        "tokenizer/tokenizer.json or vocab.json + merges.txt (the CLIP text model tokenizer)",
        "the transformer (looked for flux-transformer.safetensors, flux-transformer.safetensors.index.json, flux1-dev.safetensors, transformer/diffusion_pytorch_model.safetensors.index.json or diffusion_pytorch_model.safetensors)",
    ] {
        assert!(e.contains(want), "{want}\n in {e}");
    }
}

#[test]
fn the_clip_tokenizer_is_built_from_vocab_and_merges() {
    let d = snapshot();
    let vocab = d.join("tokenizer/vocab.json");
    let tok = mold_pipeline::flux::text::load_tokenizer(&vocab, 77, &["<|endoftext|>"]).unwrap();
    let ids = mold_pipeline::text::tokenize(&tok, &vocab, "A  red FOX, in snow!").unwrap();
    let v: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&vocab).unwrap()).unwrap();
    let id = |t: &str| v[t].as_u64().unwrap() as u32;
    let want = [
        id("<|startoftext|>"),
        id("a</w>"),
        id("red</w>"),
        id("fox</w>"),
        id(",</w>"),
        id("in</w>"),
        id("snow</w>"),
        id("!</w>"),
        id("<|endoftext|>"),
    ];
    assert_eq!(&ids[..want.len()], &want);
    assert_eq!(ids.len(), 77);
    assert!(ids[want.len()..].iter().all(|&i| i == id("<|endoftext|>")));
    // A word the merges do not spell falls back to byte characters.
    let ids = mold_pipeline::text::tokenize(&tok, &vocab, "zq").unwrap();
    assert_eq!(&ids[1..3], &[id("z"), id("q</w>")]);
}

#[test]
fn the_t5_tokenizer_is_a_unigram_model() {
    let p = snapshot().join("tokenizer_2/tokenizer.json");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(j["model"]["type"], "Unigram");
    let tok = mold_pipeline::flux::text::load_tokenizer(&p, 8, &["<pad>"]).unwrap();
    let ids = mold_pipeline::text::tokenize(&tok, &p, "a red fox in snow!").unwrap();
    let vocab = j["model"]["vocab"].as_array().unwrap();
    let id = |t: &str| vocab.iter().position(|v| v[0] == t).unwrap() as u32;
    // Words with `▁`, a character alone after its word, `</s>`, then `<pad>`.
    assert_eq!(
        ids,
        [
            id("▁a"),
            id("▁red"),
            id("▁fox"),
            id("▁in"),
            id("▁snow"),
            id("!"),
            1,
            0
        ]
    );
}

#[test]
fn the_diffusers_transformer_reads_as_bfl_tensors() {
    let d = snapshot();
    let bfl = Checkpoint::open(&d.join("flux1-dev.safetensors")).unwrap();
    let diff = Checkpoint::open(&d.join("transformer")).unwrap_or_else(|_| {
        Checkpoint::open(&d.join("transformer/diffusion_pytorch_model.safetensors.index.json"))
            .unwrap()
    });
    assert_eq!((bfl.format(), diff.format()), ("BFL", "diffusers"));
    assert!(diff.files().len() > 2, "{:?}", diff.files());
    let names = |c: &Checkpoint| {
        c.tensors()
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.clone(), t.dtype.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&bfl), names(&diff));
    let cfg = FluxConfig::flux_tiny();
    diff.check(&cfg, "flux-tiny").unwrap();
    let eq = |a: &Tensor, b: &Tensor| {
        assert_eq!(a.dims(), b.dims());
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar::<f32>().unwrap() == 0.0
    };
    for (name, t) in bfl.tensors() {
        let a = bfl.read_slice(name, None, None, DType::F32).unwrap();
        let b = diff.read_slice(name, None, None, DType::F32).unwrap();
        assert!(eq(&a, &b), "{name}");
        // A rank's share: rows that straddle the pieces (q|k|v|mlp, shift|scale), and
        // columns.
        let n = t.shape[0];
        let rows = [n / 5..n / 2 + 1, n - 3..n];
        let cols = (t.shape.len() == 2).then(|| [1..t.shape[1] / 2, t.shape[1] - 1..t.shape[1]]);
        let a = bfl
            .read_slice(name, Some(&rows), cols.as_ref().map(|c| &c[..]), DType::F32)
            .unwrap();
        let b = diff
            .read_slice(name, Some(&rows), cols.as_ref().map(|c| &c[..]), DType::F32)
            .unwrap();
        assert!(eq(&a, &b), "{name} rows {rows:?}");
    }
    // Planning from the folder: the same sizes as from BFL's file.
    let a = mold_models::checkpoint::refine(&d.join("flux1-dev.safetensors"), None).unwrap();
    let b = mold_models::checkpoint::refine(diffusers_only(), None).unwrap();
    assert_eq!(b.model.id, "flux-tiny");
    assert_eq!(
        format!("{:?}", a.model.transformer),
        format!("{:?}", b.model.transformer)
    );
    // The snapshot directory itself plans from its BFL file.
    let c = mold_models::checkpoint::refine(d, None).unwrap();
    assert_eq!(c.header_sha256, a.header_sha256);
}

#[test]
fn both_transformer_formats_give_identical_outputs() {
    let d = snapshot();
    let cfg = FluxConfig::flux_tiny();
    let bfl = Checkpoint::open(&d.join("flux1-dev.safetensors")).unwrap();
    let diff = Checkpoint::open(diffusers_only()).unwrap();
    assert_eq!(diff.format(), "diffusers");
    let x = mold_exec::random_inputs(&cfg, 64, 48, 8, 1, 3).unwrap();
    for (what, plan) in plans() {
        let a = Executor::new(&cfg, &plan, &bfl)
            .unwrap()
            .forward(&x)
            .unwrap();
        let b = Executor::new(&cfg, &plan, &diff)
            .unwrap()
            .forward(&x)
            .unwrap();
        assert_eq!(max_relative_error(&a, &b).unwrap(), 0.0, "{what}");
    }
}

#[test]
fn both_transformer_formats_give_identical_images() {
    let req = mold_pipeline::Request {
        prompt: "a red fox in snow".into(),
        seed: 5,
        steps: 2,
        guidance: None,
        width: 64,
        height: 48,
        ..Default::default()
    };
    let opts = mold_exec::ExecOptions::default();
    for (what, plan) in plans() {
        let mut images = Vec::new();
        for dir in [snapshot(), diffusers_only()] {
            let prep = mold_pipeline::flux::prepare(&plan, dir).unwrap();
            let out =
                mold_pipeline::flux::generate(&plan, &prep, &req, &opts, &mut |_| {}).unwrap();
            images.push(out.image.data);
        }
        assert!(
            images[0] == images[1],
            "{what}: the diffusers-format transformer's image differs from BFL's"
        );
    }
}

/// `no_digests` (what `mold serve` asks for) takes no digest at any stage and changes
/// nothing else: the same image, and every event but the digests the same.
#[test]
fn a_request_without_digests_takes_none_and_gives_the_same_image() {
    use mold_pipeline::Progress;
    let (_, plan) = plans().into_iter().next().unwrap();
    let prep = mold_pipeline::flux::prepare(&plan, snapshot()).unwrap();
    let opts = mold_exec::ExecOptions::default();
    let run = |no_digests: bool| {
        let req = mold_pipeline::Request {
            prompt: "a red fox in snow".into(),
            seed: 5,
            steps: 2,
            width: 64,
            height: 48,
            no_digests,
            ..Default::default()
        };
        let mut digests = Vec::new();
        let out = mold_pipeline::flux::generate(&plan, &prep, &req, &opts, &mut |p| match p {
            Progress::Encoded { digest, .. } | Progress::Step { digest, .. } => {
                digests.push(*digest)
            }
            Progress::Decoded {
                latents_digest,
                image_digest,
                ..
            } => digests.extend([*latents_digest, *image_digest]),
            _ => {}
        })
        .unwrap();
        (out.image.data, digests)
    };
    let (with, taken) = run(false);
    let (without, none) = run(true);
    assert_eq!(with, without);
    // Two encoders, two steps, the final latents and the image.
    assert_eq!(taken.len(), 6, "{taken:?}");
    assert!(taken.iter().all(Option::is_some), "{taken:?}");
    assert_eq!(none, vec![None; 6]);
}
