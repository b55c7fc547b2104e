//! The LoRA reader (`mold exec --lora FILE`: `mold_exec::checkpoint::lora::load`) fuzzed
//! like the parsers of `parsers.rs`: arbitrary bytes up to 4 KiB, and byte mutations of
//! a valid LoRA for flux-tiny (kohya and diffusers names, with alphas), with its header
//! length sometimes wrong too, never panic; every refusal is one line naming the file;
//! what is accepted merges (each delta's update computes). Bounded proptests (256 cases).

use crate::parsers::{mutate, mutations, refusal_ok, scratch};
use crate::util::*;
use mold_exec::checkpoint::{lora, LoraSpec};
use mold_exec::TensorHeader;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// flux-tiny's tensors (the LoRA's targets) and a valid LoRA file for it.
struct Base {
    tensors: BTreeMap<String, TensorHeader>,
    lora: Vec<u8>,
}

/// A safetensors file of f32 tensors `(name, shape)`, values from their index.
fn safetensors(tensors: &[(&str, Vec<usize>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        let start = data.len();
        for i in 0..n {
            data.extend_from_slice(&((i % 7) as f32 * 0.01).to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    out
}

fn base() -> &'static Base {
    static B: OnceLock<Base> = OnceLock::new();
    B.get_or_init(|| {
        let d = tempdir("parsers-lora");
        let cfg = mold_exec::FluxConfig::flux_tiny();
        let ckpt = mold_exec::write_testdata(&cfg, &d, 7, mold_exec::DType::F32).unwrap();
        let tensors = mold_exec::Checkpoint::open(&ckpt)
            .unwrap()
            .tensors()
            .clone();
        let shape = |n: &str| tensors[n].shape.clone();
        let qkv = shape("double_blocks.0.img_attn.qkv.weight");
        let lin = shape("single_blocks.0.linear2.weight");
        let (rank, hidden) = (2, qkv[1]);
        let lora = safetensors(&[
            // kohya names, with an alpha.
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                vec![rank, qkv[1]],
            ),
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
                vec![qkv[0], rank],
            ),
            ("lora_unet_double_blocks_0_img_attn_qkv.alpha", vec![]),
            // diffusers names: `to_q` is the first third of BFL's fused qkv.
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
                vec![rank, hidden],
            ),
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_B.weight",
                vec![hidden, rank],
            ),
            // BFL names.
            (
                "diffusion_model.single_blocks.0.linear2.lora_A.weight",
                vec![rank, lin[1]],
            ),
            (
                "diffusion_model.single_blocks.0.linear2.lora_B.weight",
                vec![lin[0], rank],
            ),
        ]);
        Base { tensors, lora }
    })
}

/// Reads `path` as a LoRA for flux-tiny: an accepted one merges (each delta's update of
/// its rows computes); a refusal is one line naming the file.
fn lora_ok(path: &Path) -> Result<(), TestCaseError> {
    let spec = LoraSpec {
        path: path.to_path_buf(),
        strength: 0.8,
    };
    match lora::load(&spec, &base().tensors) {
        Ok(deltas) => {
            for d in deltas {
                let r = d.slice(std::slice::from_ref(&d.rows), None);
                prop_assert!(r.is_ok(), "{}: {:?}", d.target, r.err());
            }
        }
        Err(e) => refusal_ok(&e.to_string(), &path.display().to_string())?,
    }
    Ok(())
}

#[test]
fn the_valid_lora_loads_and_merges() {
    let b = base();
    let p = scratch("valid-lora.safetensors");
    std::fs::write(&p, &b.lora).unwrap();
    let deltas = lora::load(
        &LoraSpec {
            path: p.clone(),
            strength: 1.0,
        },
        &b.tensors,
    )
    .unwrap();
    // qkv (kohya), its q rows (diffusers), linear2 (BFL).
    assert_eq!(deltas.len(), 3, "{deltas:?}");
    assert!(
        b.lora.len() > 400,
        "the base file is {} bytes",
        b.lora.len()
    );
    lora_ok(&p).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_as_a_lora(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let p = scratch("bytes-lora.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        lora_ok(&p)?;
    }

    /// Arbitrary bytes behind a well-formed length prefix: the header parser itself.
    #[test]
    fn arbitrary_headers_never_panic_as_a_lora(
        header in prop::collection::vec(any::<u8>(), 0..4096),
        data in 0usize..4096,
    ) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        bytes.resize(bytes.len() + data, 0);
        let p = scratch("header-lora.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        lora_ok(&p)?;
    }

    /// The valid LoRA mutated anywhere (header, names, shapes, offsets, tensor data),
    /// its length prefix sometimes wrong and its data sometimes cut or extended.
    #[test]
    fn mutated_lora_never_panics(
        ops in mutations(),
        prefix in prop_oneof![Just(None), any::<u64>().prop_map(Some), (0u64..4096).prop_map(Some)],
        resize in prop_oneof![Just(None), (0usize..4096).prop_map(Some)],
    ) {
        let b = base();
        let mut bytes = mutate(&b.lora, &ops);
        if let (Some(p), true) = (prefix, bytes.len() >= 8) {
            bytes[..8].copy_from_slice(&p.to_le_bytes());
        }
        if let Some(n) = resize {
            bytes.resize(n, 0);
        }
        let p = scratch("mutated-lora.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        lora_ok(&p)?;
    }

    /// The valid LoRA's header JSON mutated (names, shapes, dtypes, offsets), the data
    /// kept, the length prefix recomputed: deeper into the reader than byte noise gets.
    #[test]
    fn mutated_lora_header_never_panics(ops in mutations()) {
        let b = base();
        let n = u64::from_le_bytes(b.lora[..8].try_into().unwrap()) as usize;
        let header = mutate(&b.lora[8..8 + n], &ops);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&b.lora[8 + n..]);
        let p = scratch("mutated-header-lora.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        lora_ok(&p)?;
    }
}
