//! Random snapshots in the layout of the Hugging Face repositories of FLUX.1 (both
//! transformer formats: BFL's single file and diffusers' shards), for `mold testdata
//! NAME-hf`.

use super::{
    clip_l_config, list_tensors, t5_xxl_config, tiny_clip_config, tiny_t5_config, tok_err,
    write_file, write_json, WORDS,
};
use crate::error::{PipelineError, Result};
use crate::flux::vae::AeConfig;
use candle_core::DType;
use candle_transformers::models::clip::text_model::ClipTextTransformer;
use candle_transformers::models::t5;
use mold_exec::FluxConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Which random snapshot [`write_hf_snapshot`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfModel {
    /// The tiny model (f32), shaped as the tiny pipeline; its BFL file is named as dev's.
    Tiny,
    Dev,
    Schnell,
}

impl HfModel {
    /// `flux-tiny`, `flux-dev`, `flux-schnell` (as `mold testdata NAME-hf`).
    pub fn by_name(model: &str) -> Option<HfModel> {
        match model {
            "flux-tiny" => Some(HfModel::Tiny),
            "flux-dev" => Some(HfModel::Dev),
            "flux-schnell" => Some(HfModel::Schnell),
            _ => None,
        }
    }
    fn id(self) -> &'static str {
        match self {
            HfModel::Tiny => "flux-tiny",
            HfModel::Dev => "flux-dev",
            HfModel::Schnell => "flux-schnell",
        }
    }
}

/// GPT-2/CLIP's map of bytes to printable characters (`bytes_to_unicode`), in CLIP's
/// vocabulary order.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    cs.into_iter().filter_map(char::from_u32).collect()
}

/// CLIP's tokenizer files as the FLUX repositories ship them (`vocab.json`,
/// `merges.txt`, `tokenizer_config.json`, `special_tokens_map.json`; no `tokenizer.json`),
/// over a small vocabulary built as CLIP's is: the 256 byte characters, the same with
/// `</w>`, then one token per merge (here: merges that spell [`WORDS`]), then
/// `<|startoftext|>` and `<|endoftext|>` (the highest id, as pooling needs).
fn write_clip_bpe(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(PipelineError::io(dir))?;
    let base = bytes_to_unicode();
    let mut vocab: Vec<String> = base.iter().map(|c| c.to_string()).collect();
    vocab.extend(base.iter().map(|c| format!("{c}</w>")));
    let mut merges: Vec<(String, String)> = Vec::new();
    for w in WORDS
        .iter()
        .filter(|w| w.chars().all(|c| c.is_ascii_alphabetic()))
    {
        let chars: Vec<String> = w.chars().map(String::from).collect();
        let mut syms: Vec<String> = chars.clone();
        if let Some(last) = syms.last_mut() {
            last.push_str("</w>");
        }
        let mut cur = syms[0].clone();
        for s in &syms[1..] {
            let pair = (cur.clone(), s.clone());
            cur = format!("{cur}{s}");
            if !merges.contains(&pair) {
                merges.push(pair);
                if !vocab.contains(&cur) {
                    vocab.push(cur.clone());
                }
            }
        }
    }
    vocab.push("<|startoftext|>".into());
    vocab.push("<|endoftext|>".into());
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let mut written = Vec::new();
    let p = dir.join("vocab.json");
    write_file(&p, serde_json::to_string(&map).expect("json").as_bytes())?;
    written.push(p);
    let p = dir.join("merges.txt");
    let mut text = String::from("#version: 0.2\n");
    for (a, b) in &merges {
        text.push_str(&format!("{a} {b}\n"));
    }
    write_file(&p, text.as_bytes())?;
    written.push(p);
    let specials = serde_json::json!({
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"
    });
    let p = dir.join("special_tokens_map.json");
    write_json(&p, &specials)?;
    written.push(p);
    let mut cfg = specials;
    cfg["tokenizer_class"] = "CLIPTokenizer".into();
    cfg["model_max_length"] = 77.into();
    cfg["do_lower_case"] = true.into();
    cfg["clean_up_tokenization_spaces"] = true.into();
    let p = dir.join("tokenizer_config.json");
    write_json(&p, &cfg)?;
    written.push(p);
    Ok(written)
}

/// T5's `tokenizer.json` as the FLUX repositories ship it (a SentencePiece Unigram model:
/// `<pad>` 0, `</s>` 1, `<unk>` 2, whitespace split, `▁` before each word, `</s>`
/// appended), over a small vocabulary: `▁`, the words of [`WORDS`] with `▁`, and single
/// characters, scored so that whole words win. Without SentencePiece's precompiled
/// normalizer (the only part left out). transformers rebuilds its T5 tokenizer from this
/// Unigram vocabulary, so mold and transformers give the same ids.
fn write_t5_unigram(path: &Path) -> Result<()> {
    let mut vocab: Vec<(String, f64)> = vec![
        ("<pad>".into(), 0.0),
        ("</s>".into(), 0.0),
        ("<unk>".into(), 0.0),
        ("\u{2581}".into(), -2.0),
    ];
    vocab.extend(WORDS.iter().map(|w| (format!("\u{2581}{w}"), -5.0)));
    for c in ('a'..='z').chain(['.', ',', '!']) {
        vocab.push((c.to_string(), -8.0));
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let meta = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
        "prepend_scheme": "always", "split": true});
    let j = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, meta]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}
        },
        "decoder": meta,
        "model": {"type": "Unigram", "unk_id": 2, "vocab": vocab, "byte_fallback": false}
    });
    write_json(path, &j)?;
    // Prove it loads.
    Tokenizer::from_file(path).map_err(tok_err(path))?;
    Ok(())
}

/// One tensor of a file derived from another: rows of source tensors, concatenated.
struct Derived {
    name: String,
    shape: Vec<usize>,
    /// (source tensor, its rows), in order.
    pieces: Vec<(String, std::ops::Range<usize>)>,
}

/// Writes `items` into one safetensors file, each tensor's bytes copied from the rows of
/// `src`'s tensors (same dtype), tensor by tensor (memory bounded by one tensor).
fn write_derived(
    path: &Path,
    src: &candle_core::safetensors::MmapedSafetensors,
    items: &[Derived],
) -> Result<()> {
    let io = PipelineError::io(path);
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut dtype = "F32";
    let mut sizes = Vec::new();
    for it in items {
        let mut n = 0;
        for (s, rows) in &it.pieces {
            let v = src.get(s)?;
            dtype = match format!("{:?}", v.dtype()).as_str() {
                "BF16" => "BF16",
                "F16" => "F16",
                _ => "F32",
            };
            let row_bytes = v.data().len() / v.shape().first().copied().unwrap_or(1).max(1);
            n += rows.len() * row_bytes;
        }
        header.insert(
            it.name.clone(),
            serde_json::json!({"dtype": dtype, "shape": it.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
        sizes.push(n);
    }
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    mold_files::write_with(path, |w| {
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        for it in items {
            for (s, rows) in &it.pieces {
                let v = src.get(s).map_err(std::io::Error::other)?;
                let row_bytes = v.data().len() / v.shape().first().copied().unwrap_or(1).max(1);
                w.write_all(&v.data()[rows.start * row_bytes..rows.end * row_bytes])?;
            }
        }
        Ok(())
    })
    .map_err(io)
}

/// Writes `items` (from `src`) as `dir/{stem}-0000N-of-0000M.safetensors` shards of at
/// most `max_bytes` (or one tensor) plus `dir/{index}` (a weight map).
fn write_sharded(
    dir: &Path,
    stem: &str,
    index: &str,
    src: &candle_core::safetensors::MmapedSafetensors,
    items: Vec<Derived>,
    max_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let mut shards: Vec<Vec<Derived>> = vec![Vec::new()];
    let mut size = 0u64;
    let mut total = 0u64;
    for it in items {
        let mut n = 0u64;
        for (s, rows) in &it.pieces {
            let v = src.get(s)?;
            n += (v.data().len() / v.shape().first().copied().unwrap_or(1).max(1) * rows.len())
                as u64;
        }
        if size + n > max_bytes && !shards.last().is_some_and(|s| s.is_empty()) {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        total += n;
        shards.last_mut().expect("a shard").push(it);
    }
    let count = shards.len();
    let mut map = serde_json::Map::new();
    let mut written = Vec::new();
    for (i, items) in shards.iter().enumerate() {
        let name = format!("{stem}-{:05}-of-{count:05}.safetensors", i + 1);
        let p = dir.join(&name);
        write_derived(&p, src, items)?;
        for it in items {
            map.insert(it.name.clone(), name.clone().into());
        }
        written.push(p);
    }
    let p = dir.join(index);
    write_json(
        &p,
        &serde_json::json!({"metadata": {"total_size": total}, "weight_map": map}),
    )?;
    written.push(p);
    Ok(written)
}

/// Rows of a diffusers tensor, the BFL tensor they come from, and its rows.
type RowLink = (std::ops::Range<usize>, String, std::ops::Range<usize>);

/// The diffusers-format transformer's tensors from a BFL file's: diffusers' names, each
/// the rows of one BFL tensor its conversion takes (`to_q` the first third of `qkv`,
/// `norm_out.linear` the swapped halves of `final_layer.adaLN_modulation.1`, …).
fn diffusers_transformer_items(flux: &FluxConfig) -> Vec<Derived> {
    let dims = mold_models::diffusers::FluxDims {
        hidden: flux.hidden as u64,
        mlp_hidden: flux.mlp_hidden() as u64,
        depth: flux.depth as u32,
        depth_single: flux.depth_single as u32,
        guidance: flux.guidance_embed,
    };
    let shapes: BTreeMap<String, Vec<usize>> = flux
        .tensor_specs()
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect();
    // diffusers name -> (its rows, BFL name, BFL rows).
    let mut by_name: BTreeMap<String, Vec<RowLink>> = BTreeMap::new();
    for l in mold_models::diffusers::links(&dims) {
        let n = shapes[&l.bfl][0];
        let (b, d) = match l.rows {
            None => (0..n, 0..n),
            Some((b, d)) => (
                b.start as usize..b.end as usize,
                d.start as usize..d.end as usize,
            ),
        };
        by_name.entry(l.diffusers).or_default().push((d, l.bfl, b));
    }
    by_name
        .into_iter()
        .map(|(name, mut parts)| {
            parts.sort_by_key(|p| p.0.start);
            let rows: usize = parts.iter().map(|p| p.0.len()).sum();
            let mut shape = shapes[&parts[0].1].clone();
            shape[0] = rows;
            Derived {
                name,
                shape,
                pieces: parts.into_iter().map(|(_, s, r)| (s, r)).collect(),
            }
        })
        .collect()
}

/// diffusers' name of a tensor of BFL's autoencoder (`ae.safetensors`, LDM names) in
/// `AutoencoderKL` (`vae/`), as diffusers' `convert_ldm_vae_checkpoint` renames it, and
/// whether it is an attention 1×1 convolution that becomes a linear weight.
fn diffusers_vae_name(ldm: &str, levels: usize) -> (String, bool) {
    let mut parts: Vec<String> = ldm.split('.').map(String::from).collect();
    // encoder.down.I.block.J / decoder.up.I.block.J (up blocks are reversed).
    if parts.len() > 3 && (parts[1] == "down" || parts[1] == "up") {
        let i: usize = parts[2].parse().unwrap_or(0);
        let (blocks, idx) = if parts[1] == "down" {
            ("down_blocks", i)
        } else {
            ("up_blocks", levels - 1 - i)
        };
        let rest = match parts[3].as_str() {
            "block" => format!("resnets.{}", parts[4]),
            "downsample" => "downsamplers.0".into(),
            _ => "upsamplers.0".into(),
        };
        let skip = if parts[3] == "block" { 5 } else { 4 };
        let tail = parts[skip..]
            .join(".")
            .replace("nin_shortcut", "conv_shortcut");
        return (format!("{}.{blocks}.{idx}.{rest}.{tail}", parts[0]), false);
    }
    if parts.len() > 3 && parts[1] == "mid" {
        let tail = parts[3..]
            .join(".")
            .replace("nin_shortcut", "conv_shortcut");
        return match parts[2].as_str() {
            "block_1" => (format!("{}.mid_block.resnets.0.{tail}", parts[0]), false),
            "block_2" => (format!("{}.mid_block.resnets.1.{tail}", parts[0]), false),
            _ => {
                let layer = match parts[3].as_str() {
                    "norm" => "group_norm",
                    "q" => "to_q",
                    "k" => "to_k",
                    "v" => "to_v",
                    _ => "to_out.0",
                };
                let linear = parts[3] != "norm" && parts[4] == "weight";
                (
                    format!("{}.mid_block.attentions.0.{layer}.{}", parts[0], parts[4]),
                    linear,
                )
            }
        };
    }
    if parts.len() > 1 && parts[1] == "norm_out" {
        parts[1] = "conv_norm_out".into();
    }
    (parts.join("."), false)
}

/// Writes a random snapshot in the layout of the Hugging Face repositories of FLUX.1
/// (`black-forest-labs/FLUX.1-dev`, `-schnell`): `model_index.json`,
/// `flux1-dev.safetensors` (BFL names; `flux1-schnell.safetensors` for schnell) and the
/// same weights as diffusers' sharded `transformer/`, `ae.safetensors` (BFL) and the same
/// autoencoder as diffusers' `vae/`, CLIP-L in `text_encoder/` with its BPE files in
/// `tokenizer/` (vocab.json, merges.txt; no tokenizer.json), T5 in `text_encoder_2/`
/// (sharded, with its index) with `tokenizer_2/tokenizer.json`, and
/// `scheduler/scheduler_config.json`. Weights are random (seeded by name, so both
/// transformer formats hold the same values), and the tiny model's files are the tiny
/// pipeline's shapes (plus `ae.json`, since its autoencoder is smaller than FLUX's).
/// `tokenizer_2/spiece.model` (SentencePiece's binary file) is not written: mold and
/// diffusers' fast tokenizer read `tokenizer.json`.
pub fn write_hf_snapshot(
    dir: &Path,
    model: HfModel,
    seed: u64,
    dtype: DType,
) -> Result<Vec<PathBuf>> {
    let id = model.id();
    let flux = FluxConfig::by_name(id).expect("a FLUX model");
    let tiny = model == HfModel::Tiny;
    let (t5_cfg, mut clip_cfg, ae) = if tiny {
        (
            tiny_t5_config(&flux),
            tiny_clip_config(&flux),
            AeConfig::tiny(),
        )
    } else {
        (t5_xxl_config(), clip_l_config(), AeConfig::flux())
    };
    // As the repositories' CLIP config: pooling at the highest id (`eos_token_id` 2 is
    // transformers' marker for that legacy behaviour).
    clip_cfg["bos_token_id"] = 0.into();
    clip_cfg["eos_token_id"] = 2.into();
    clip_cfg["pad_token_id"] = 1.into();
    let mut written = Vec::new();
    let sub = |n: &str| -> Result<PathBuf> {
        let d = dir.join(n);
        std::fs::create_dir_all(&d).map_err(PipelineError::io(&d))?;
        Ok(d)
    };
    sub("")?;

    // The transformer: BFL's file, then diffusers' folder from it.
    let bfl = dir.join(if model == HfModel::Schnell {
        "flux1-schnell.safetensors"
    } else {
        "flux1-dev.safetensors"
    });
    mold_exec::write_safetensors(&bfl, &flux.tensor_specs(), seed, dtype)?;
    written.push(bfl.clone());
    let td = sub("transformer")?;
    // SAFETY: the file was just written and is not modified while mapped.
    let mm = unsafe { candle_core::safetensors::MmapedSafetensors::new(&bfl)? };
    let items = diffusers_transformer_items(&flux);
    let total: u64 = flux.param_count() * dtype.size_in_bytes() as u64;
    // Shards of at most a third, as the published transformer has three.
    let max = if tiny { total / 3 + 1 } else { 10_000_000_000 };
    written.extend(write_sharded(
        &td,
        "diffusion_pytorch_model",
        "diffusion_pytorch_model.safetensors.index.json",
        &mm,
        items,
        max,
    )?);
    drop(mm);
    let p = td.join("config.json");
    write_json(
        &p,
        &serde_json::json!({
            "_class_name": "FluxTransformer2DModel",
            "_diffusers_version": "0.30.0.dev0",
            "attention_head_dim": flux.head_dim,
            "axes_dims_rope": flux.axes_dim,
            "guidance_embeds": flux.guidance_embed,
            "in_channels": flux.in_channels,
            "joint_attention_dim": flux.context_in_dim,
            "num_attention_heads": flux.heads,
            "num_layers": flux.depth,
            "num_single_layers": flux.depth_single,
            "patch_size": 1,
            "pooled_projection_dim": flux.vec_in_dim,
            "out_channels": null
        }),
    )?;
    written.push(p);

    // The autoencoder: BFL's file (encoder and decoder), then diffusers' vae/ from it.
    let cc = ae.to_candle();
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| candle_transformers::models::flux::autoencoder::AutoEncoder::new(&cc, vb).map(|_| ()),
    )?;
    let ae_path = dir.join("ae.safetensors");
    mold_exec::write_safetensors(&ae_path, &specs, seed ^ 0xae, dtype)?;
    written.push(ae_path.clone());
    if tiny {
        let p = dir.join(crate::layout::AE_CONFIG);
        write_json(&p, &serde_json::to_value(&ae).expect("json"))?;
        written.push(p);
    }
    let vd = sub("vae")?;
    // SAFETY: as above.
    let mm = unsafe { candle_core::safetensors::MmapedSafetensors::new(&ae_path)? };
    let levels = ae.ch_mult.len();
    let items: Vec<Derived> = specs
        .iter()
        .map(|s| {
            let (name, linear) = diffusers_vae_name(&s.name, levels);
            let shape = if linear {
                s.shape[..2].to_vec()
            } else {
                s.shape.clone()
            };
            Derived {
                name,
                shape,
                pieces: vec![(s.name.clone(), 0..s.shape[0])],
            }
        })
        .collect();
    let p = vd.join("diffusion_pytorch_model.safetensors");
    write_derived(&p, &mm, &items)?;
    drop(mm);
    written.push(p);
    let p = vd.join("config.json");
    write_json(
        &p,
        &serde_json::json!({
            "_class_name": "AutoencoderKL",
            "_diffusers_version": "0.30.0.dev0",
            "act_fn": "silu",
            "block_out_channels": ae.ch_mult.iter().map(|m| m * ae.ch).collect::<Vec<_>>(),
            "down_block_types": vec!["DownEncoderBlock2D"; levels],
            "force_upcast": true,
            "in_channels": ae.in_channels,
            "latent_channels": ae.z_channels,
            "latents_mean": null,
            "latents_std": null,
            "layers_per_block": ae.num_res_blocks,
            "mid_block_add_attention": true,
            "norm_num_groups": 32,
            "out_channels": ae.out_ch,
            "sample_size": 1024,
            "scaling_factor": ae.scale_factor,
            "shift_factor": ae.shift_factor,
            "up_block_types": vec!["UpDecoderBlock2D"; levels],
            "use_post_quant_conv": false,
            "use_quant_conv": false
        }),
    )?;
    written.push(p);

    // CLIP-L: text_encoder/ and its BPE tokenizer files in tokenizer/.
    let cd = sub("text_encoder")?;
    let files = crate::layout::EncoderFiles {
        config: cd.join("config.json"),
        weights: vec![cd.join("model.safetensors")],
        tokenizer: dir.join("tokenizer").join("vocab.json"),
    };
    write_json(&files.config, &clip_cfg)?;
    let ccfg = crate::flux::text::clip_config(&files)?;
    let specs = list_tensors(
        |n| n.to_string(),
        |vb| ClipTextTransformer::new(vb.pp("text_model"), &ccfg).map(|_| ()),
    )?;
    mold_exec::write_safetensors(&files.weights[0], &specs, seed ^ 0xc1, dtype)?;
    written.extend([files.config.clone(), files.weights[0].clone()]);
    written.extend(write_clip_bpe(&dir.join("tokenizer"))?);

    // T5: text_encoder_2/ in two shards with an index, tokenizer_2/tokenizer.json.
    let t5d = sub("text_encoder_2")?;
    let p = t5d.join("config.json");
    write_json(&p, &t5_cfg)?;
    written.push(p.clone());
    let cfg = crate::flux::text::t5_config(&crate::layout::EncoderFiles {
        config: p,
        weights: vec![],
        tokenizer: PathBuf::new(),
    })?;
    let specs = list_tensors(
        |n| {
            if n == "encoder.embed_tokens.weight" {
                "shared.weight".into()
            } else {
                n.to_string()
            }
        },
        |vb| t5::T5EncoderModel::load(vb, &cfg).map(|_| ()),
    )?;
    let half = specs.len() / 2;
    let mut map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, part) in [&specs[..half], &specs[half..]].into_iter().enumerate() {
        let name = format!("model-{:05}-of-00002.safetensors", i + 1);
        let p = t5d.join(&name);
        mold_exec::write_safetensors(&p, part, seed ^ 0x75, dtype)?;
        for s in part {
            total += (s.shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64;
            map.insert(s.name.clone(), name.clone().into());
        }
        written.push(p);
    }
    let p = t5d.join("model.safetensors.index.json");
    write_json(
        &p,
        &serde_json::json!({"metadata": {"total_size": total}, "weight_map": map}),
    )?;
    written.push(p);
    let tk = sub("tokenizer_2")?;
    let p = tk.join("tokenizer.json");
    write_t5_unigram(&p)?;
    written.push(p);
    let specials =
        serde_json::json!({"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"});
    let p = tk.join("special_tokens_map.json");
    write_json(&p, &specials)?;
    written.push(p);
    let mut tcfg = specials;
    tcfg["tokenizer_class"] = "T5Tokenizer".into();
    tcfg["model_max_length"] = 512.into();
    tcfg["extra_ids"] = 0.into();
    tcfg["additional_special_tokens"] = serde_json::json!([]);
    let p = tk.join("tokenizer_config.json");
    write_json(&p, &tcfg)?;
    written.push(p);

    // The scheduler and the pipeline's index, as diffusers' FluxPipeline reads them.
    let sd = sub("scheduler")?;
    let p = sd.join("scheduler_config.json");
    let dynamic = flux.guidance_embed;
    write_json(
        &p,
        &serde_json::json!({
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "_diffusers_version": "0.30.0.dev0",
            "base_image_seq_len": 256,
            "base_shift": 0.5,
            "max_image_seq_len": 4096,
            "max_shift": 1.15,
            "num_train_timesteps": 1000,
            "shift": if dynamic { 3.0 } else { 1.0 },
            "use_dynamic_shifting": dynamic
        }),
    )?;
    written.push(p);
    let p = dir.join("model_index.json");
    write_json(
        &p,
        &serde_json::json!({
            "_class_name": "FluxPipeline",
            "_diffusers_version": "0.30.0.dev0",
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "FluxTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"]
        }),
    )?;
    written.push(p);
    Ok(written)
}
