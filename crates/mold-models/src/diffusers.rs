//! FLUX's transformer in diffusers' layout (`FluxTransformer2DModel`, the `transformer/`
//! folder of the Hugging Face repositories) as BFL's names: the one name map both the
//! planner (sizes from headers) and the executor (the tensors themselves) use.
//!
//! Every BFL tensor is a concatenation, along dim 0 (rows: output features), of row
//! ranges of diffusers tensors; the map is diffusers' own conversion
//! (`scripts/convert_flux_to_diffusers.py`, `convert_flux_transformer_checkpoint_to_diffusers`):
//!
//! - fused projections are split: a double block's `img_attn.qkv` is `attn.to_q`,
//!   `attn.to_k`, `attn.to_v` (its `txt_attn.qkv` the `add_{q,k,v}_proj`), a single
//!   block's `linear1` is `attn.to_q`, `to_k`, `to_v`, then `proj_mlp`;
//! - `final_layer.adaLN_modulation.1` is `(shift, scale)` where `norm_out.linear` is
//!   `(scale, shift)`: its two halves are swapped;
//! - everything else is renamed one to one (a single block's `linear2` is `proj_out`,
//!   whose input is the concatenated `[attention, MLP]`, exactly as BFL's).

use crate::checkpoint::{Header, TensorInfo};
use crate::ModelError;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// The sizes the map depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FluxDims {
    pub hidden: u64,
    pub mlp_hidden: u64,
    pub depth: u32,
    pub depth_single: u32,
    pub guidance: bool,
}

/// Rows `bfl_rows` of BFL tensor `bfl` are rows `diffusers_rows` of diffusers tensor
/// `diffusers` (`None`: the whole tensor, one to one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub bfl: String,
    pub diffusers: String,
    pub rows: Option<(Range<u64>, Range<u64>)>,
}

/// One piece of a BFL tensor: rows `rows` of diffusers tensor `source`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub source: String,
    pub rows: Range<u64>,
}

/// The pieces of every BFL tensor, in row order.
pub type Pieces = BTreeMap<String, Vec<Piece>>;

/// Every link of a FLUX transformer of `d`'s sizes (weights and biases; norm scales).
pub fn links(d: &FluxDims) -> Vec<Link> {
    let mut v = Vec::new();
    let whole = |v: &mut Vec<Link>, bfl: String, diffusers: String| {
        v.push(Link {
            bfl,
            diffusers,
            rows: None,
        })
    };
    // A linear layer renamed: weight and bias.
    let lin = |v: &mut Vec<Link>, bfl: &str, diffusers: &str| {
        for s in ["weight", "bias"] {
            whole(v, format!("{bfl}.{s}"), format!("{diffusers}.{s}"));
        }
    };
    // A fused linear layer: `parts` (diffusers prefix, rows) stacked in order.
    let fused = |v: &mut Vec<Link>, bfl: &str, parts: &[(String, u64)]| {
        for s in ["weight", "bias"] {
            let mut at = 0;
            for (p, n) in parts {
                v.push(Link {
                    bfl: format!("{bfl}.{s}"),
                    diffusers: format!("{p}.{s}"),
                    rows: Some((at..at + n, 0..*n)),
                });
                at += n;
            }
        }
    };
    let h = d.hidden;
    lin(&mut v, "img_in", "x_embedder");
    lin(&mut v, "txt_in", "context_embedder");
    lin(
        &mut v,
        "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_1",
    );
    lin(
        &mut v,
        "time_in.out_layer",
        "time_text_embed.timestep_embedder.linear_2",
    );
    lin(
        &mut v,
        "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_1",
    );
    lin(
        &mut v,
        "vector_in.out_layer",
        "time_text_embed.text_embedder.linear_2",
    );
    if d.guidance {
        lin(
            &mut v,
            "guidance_in.in_layer",
            "time_text_embed.guidance_embedder.linear_1",
        );
        lin(
            &mut v,
            "guidance_in.out_layer",
            "time_text_embed.guidance_embedder.linear_2",
        );
    }
    for i in 0..d.depth {
        let b = format!("double_blocks.{i}");
        let t = format!("transformer_blocks.{i}");
        lin(
            &mut v,
            &format!("{b}.img_mod.lin"),
            &format!("{t}.norm1.linear"),
        );
        lin(
            &mut v,
            &format!("{b}.txt_mod.lin"),
            &format!("{t}.norm1_context.linear"),
        );
        let qkv = |names: [&str; 3]| names.map(|n| (format!("{t}.attn.{n}"), h));
        fused(
            &mut v,
            &format!("{b}.img_attn.qkv"),
            &qkv(["to_q", "to_k", "to_v"]),
        );
        fused(
            &mut v,
            &format!("{b}.txt_attn.qkv"),
            &qkv(["add_q_proj", "add_k_proj", "add_v_proj"]),
        );
        for (s, q, k) in [
            ("img", "norm_q", "norm_k"),
            ("txt", "norm_added_q", "norm_added_k"),
        ] {
            whole(
                &mut v,
                format!("{b}.{s}_attn.norm.query_norm.scale"),
                format!("{t}.attn.{q}.weight"),
            );
            whole(
                &mut v,
                format!("{b}.{s}_attn.norm.key_norm.scale"),
                format!("{t}.attn.{k}.weight"),
            );
        }
        lin(
            &mut v,
            &format!("{b}.img_attn.proj"),
            &format!("{t}.attn.to_out.0"),
        );
        lin(
            &mut v,
            &format!("{b}.txt_attn.proj"),
            &format!("{t}.attn.to_add_out"),
        );
        for (s, ff) in [("img", "ff"), ("txt", "ff_context")] {
            lin(
                &mut v,
                &format!("{b}.{s}_mlp.0"),
                &format!("{t}.{ff}.net.0.proj"),
            );
            lin(
                &mut v,
                &format!("{b}.{s}_mlp.2"),
                &format!("{t}.{ff}.net.2"),
            );
        }
    }
    for i in 0..d.depth_single {
        let b = format!("single_blocks.{i}");
        let t = format!("single_transformer_blocks.{i}");
        lin(
            &mut v,
            &format!("{b}.modulation.lin"),
            &format!("{t}.norm.linear"),
        );
        fused(
            &mut v,
            &format!("{b}.linear1"),
            &[
                (format!("{t}.attn.to_q"), h),
                (format!("{t}.attn.to_k"), h),
                (format!("{t}.attn.to_v"), h),
                (format!("{t}.proj_mlp"), d.mlp_hidden),
            ],
        );
        whole(
            &mut v,
            format!("{b}.norm.query_norm.scale"),
            format!("{t}.attn.norm_q.weight"),
        );
        whole(
            &mut v,
            format!("{b}.norm.key_norm.scale"),
            format!("{t}.attn.norm_k.weight"),
        );
        lin(&mut v, &format!("{b}.linear2"), &format!("{t}.proj_out"));
    }
    lin(&mut v, "final_layer.linear", "proj_out");
    // BFL: (shift, scale); diffusers: (scale, shift).
    for s in ["weight", "bias"] {
        for (bfl_rows, diffusers_rows) in [(0..h, h..2 * h), (h..2 * h, 0..h)] {
            v.push(Link {
                bfl: format!("final_layer.adaLN_modulation.1.{s}"),
                diffusers: format!("norm_out.linear.{s}"),
                rows: Some((bfl_rows, diffusers_rows)),
            });
        }
    }
    v
}

/// Whether a header holds a FLUX transformer in diffusers' names.
pub fn is_diffusers_flux(h: &Header) -> bool {
    h.tensors.contains_key("x_embedder.weight")
        && h.tensors.contains_key("context_embedder.weight")
        && h.tensors.keys().any(|k| {
            k.starts_with("transformer_blocks.") || k.starts_with("single_transformer_blocks.")
        })
}

/// Blocks with prefix `p` (`transformer_blocks.`): one more than the largest index.
fn count(h: &Header, p: &str) -> u32 {
    h.tensors
        .keys()
        .filter_map(|k| k.strip_prefix(p)?.split('.').next()?.parse::<u32>().ok())
        .max()
        .map(|m| m + 1)
        .unwrap_or(0)
}

fn rows_of(h: &Header, path: &Path, name: &str) -> Result<u64, ModelError> {
    h.tensors
        .get(name)
        .and_then(|t| t.shape.first().copied())
        .ok_or_else(|| err(path, format!("diffusers FLUX transformer without `{name}`: is the transformer/ folder complete?")))
}

fn err(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Checkpoint {
        path: path.display().to_string(),
        message: message.into(),
    }
}

impl FluxDims {
    /// The sizes of a diffusers-format FLUX transformer, from its header.
    pub fn from_diffusers(h: &Header, path: &Path) -> Result<FluxDims, ModelError> {
        let depth_single = count(h, "single_transformer_blocks.");
        let mlp_hidden = if depth_single > 0 {
            rows_of(h, path, "single_transformer_blocks.0.proj_mlp.weight")?
        } else {
            rows_of(h, path, "transformer_blocks.0.ff.net.0.proj.weight")?
        };
        Ok(FluxDims {
            hidden: rows_of(h, path, "x_embedder.weight")?,
            mlp_hidden,
            depth: count(h, "transformer_blocks."),
            depth_single,
            guidance: h
                .tensors
                .contains_key("time_text_embed.guidance_embedder.linear_1.weight"),
        })
    }

    /// The sizes of a BFL-format FLUX transformer, from its header.
    pub fn from_bfl(h: &Header, path: &Path) -> Result<FluxDims, ModelError> {
        let depth = count(h, "double_blocks.");
        let mlp_hidden = if depth > 0 {
            rows_of(h, path, "double_blocks.0.img_mlp.0.weight")?
        } else {
            let h3m = rows_of(h, path, "single_blocks.0.linear1.weight")?;
            h3m.saturating_sub(3 * rows_of(h, path, "img_in.weight")?)
        };
        Ok(FluxDims {
            hidden: rows_of(h, path, "img_in.weight")?,
            mlp_hidden,
            depth,
            depth_single: count(h, "single_blocks."),
            guidance: h.tensors.contains_key("guidance_in.in_layer.weight"),
        })
    }
}

/// The BFL tensors of a diffusers-format FLUX transformer: each as its pieces, and a
/// header of BFL names (shapes, bytes, the file of the first piece). Every piece is
/// checked against the diffusers header (present, rows inside, same trailing
/// dimensions and dtype across pieces), so a bad folder is refused naming the tensor.
pub fn bfl_view(h: &Header, path: &Path) -> Result<(Header, Pieces), ModelError> {
    let dims = FluxDims::from_diffusers(h, path)?;
    let mut pieces: Pieces = BTreeMap::new();
    for l in links(&dims) {
        let src = h.tensors.get(&l.diffusers).ok_or_else(|| {
            err(
                path,
                format!(
                    "diffusers FLUX transformer without `{}` (BFL `{}`): is the transformer/ folder complete?",
                    l.diffusers, l.bfl
                ),
            )
        })?;
        let n = src.shape.first().copied().unwrap_or(1);
        let rows = match l.rows {
            None => 0..n,
            Some((_, d)) if d.end > n => {
                return Err(err(
                    path,
                    format!(
                    "tensor `{}` has {n} rows, but FLUX of hidden size {} needs rows {}..{} of it",
                    l.diffusers, dims.hidden, d.start, d.end
                ),
                ))
            }
            Some((_, d)) => d,
        };
        // Links come per BFL tensor in BFL row order (the swapped halves too).
        pieces.entry(l.bfl).or_default().push(Piece {
            source: l.diffusers,
            rows,
        });
    }
    let mut out = BTreeMap::new();
    for (bfl, ps) in &pieces {
        let first = &h.tensors[&ps[0].source];
        let mut rows = 0u64;
        let mut bytes = 0u64;
        for p in ps {
            let t = &h.tensors[&p.source];
            if t.dtype != first.dtype || t.shape.get(1..) != first.shape.get(1..) {
                return Err(err(
                    path,
                    format!(
                        "`{}` ({} {:?}) does not stack with `{}` ({} {:?}) into BFL `{bfl}`",
                        p.source, t.dtype, t.shape, ps[0].source, first.dtype, first.shape
                    ),
                ));
            }
            let n = t.shape.first().copied().unwrap_or(1).max(1);
            rows += p.rows.end - p.rows.start;
            bytes += t.bytes / n * (p.rows.end - p.rows.start);
        }
        let mut shape = first.shape.clone();
        if let Some(d) = shape.first_mut() {
            *d = rows;
        }
        out.insert(
            bfl.clone(),
            TensorInfo {
                dtype: first.dtype.clone(),
                shape,
                bytes,
                file: first.file.clone(),
            },
        );
    }
    Ok((
        Header {
            tensors: out,
            sha256: h.sha256.clone(),
        },
        pieces,
    ))
}
