//! LoRAs for FLUX, in the formats they are shared in, merged into the transformer's
//! weights as they are read: `W += strength · alpha/rank · B·A` (`B = up`, `A = down`).
//!
//! A LoRA file pairs, per target layer, a down (`A`, `[rank, in]`) and an up (`B`,
//! `[out, rank]`) matrix, and optionally a scalar `alpha` (default: the rank). Names:
//!
//! - kohya / sd-scripts: `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`,
//!   `.lora_up.weight`, `.alpha` (BFL's layer names with `_` for `.`);
//! - BFL-style (ComfyUI and others): `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`
//!   (`lora_A`/`lora_B` or `lora_down`/`lora_up`; the prefix may be absent);
//! - diffusers / PEFT: `transformer.transformer_blocks.0.attn.to_q.lora_A.weight`
//!   (diffusers' layer names, mapped onto BFL's by [`mold_models::diffusers`]: a LoRA on
//!   `to_q` updates the first third of the rows of BFL's fused `qkv`, one on
//!   `norm_out.linear` the swapped halves of `final_layer.adaLN_modulation.1`).
//!
//! A tensor that is none of these, targets no layer of the transformer (a text-encoder
//! LoRA, another model's), or does not fit its layer's shape is refused, naming it. The
//! merge is computed per slice ([`Delta::slice`]): each tensor-parallel rank merges the
//! rows and columns it holds, each block once, at load.

use super::TensorHeader;
use crate::error::{ExecError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::PathBuf;

/// A LoRA file and its strength, as `--lora PATH[:STRENGTH]` gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub path: PathBuf,
    pub strength: f64,
}

impl LoraSpec {
    /// Parses `PATH[:STRENGTH]` (strength 1 when absent; a `:` followed by something
    /// that is not a number is part of the path).
    pub fn parse(s: &str) -> std::result::Result<LoraSpec, String> {
        let (path, strength) = match s.rsplit_once(':').map(|(p, x)| (p, x.parse::<f64>())) {
            Some((_, Ok(v))) if !v.is_finite() => {
                return Err(format!("`{s}`: strength {v} is not a finite number"))
            }
            Some((p, Ok(v))) => (p, v),
            _ => (s, 1.0),
        };
        if path.is_empty() {
            return Err(format!(
                "`{s}`: give a LoRA file, as PATH or PATH:STRENGTH (e.g. style.safetensors:0.8)"
            ));
        }
        Ok(LoraSpec {
            path: PathBuf::from(path),
            strength,
        })
    }
}

/// One update of (some rows of) a BFL tensor: rows `rows` of `target` get
/// `scale · b · a`.
#[derive(Clone, Debug)]
pub struct Delta {
    pub target: String,
    pub rows: Range<usize>,
    /// `[rows.len(), rank]`, f32.
    pub b: Tensor,
    /// `[rank, in]`, f32.
    pub a: Tensor,
    pub scale: f64,
}

impl Delta {
    /// The update of a slice of the target (the given row ranges, each of the given
    /// column ranges, concatenated in order, as [`super::Checkpoint::read_slice`] reads
    /// them), f32; `None` when the slice has none of the updated rows.
    pub fn slice(
        &self,
        rows: &[Range<usize>],
        cols: Option<&[Range<usize>]>,
    ) -> Result<Option<Tensor>> {
        let rank = self.a.dim(0)?;
        let mut parts = Vec::new();
        let mut touched = false;
        for r in rows {
            let (a, b) = (r.start.max(self.rows.start), r.end.min(self.rows.end));
            if a >= b {
                parts.push(Tensor::zeros((r.len(), rank), DType::F32, &Device::Cpu)?);
                continue;
            }
            touched = true;
            if a > r.start {
                parts.push(Tensor::zeros(
                    (a - r.start, rank),
                    DType::F32,
                    &Device::Cpu,
                )?);
            }
            parts.push(self.b.narrow(0, a - self.rows.start, b - a)?);
            if r.end > b {
                parts.push(Tensor::zeros((r.end - b, rank), DType::F32, &Device::Cpu)?);
            }
        }
        if !touched {
            return Ok(None);
        }
        let b = Tensor::cat(&parts, 0)?;
        let a = match cols {
            None => self.a.clone(),
            Some(cs) => {
                let v = cs
                    .iter()
                    .map(|c| self.a.narrow(1, c.start, c.len()))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&v, 1)?
            }
        };
        Ok(Some(b.matmul(&a)?.affine(self.scale, 0.0)?))
    }
}

fn bad(spec: &LoraSpec, message: String) -> ExecError {
    ExecError::Lora {
        path: spec.path.display().to_string(),
        message,
    }
}

/// What a LoRA tensor is, from its name's ending.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Down,
    Up,
    Alpha,
}

const ENDINGS: [(&str, Role); 9] = [
    (".lora_A.weight", Role::Down),
    (".lora_B.weight", Role::Up),
    (".lora_down.weight", Role::Down),
    (".lora_up.weight", Role::Up),
    (".lora.down.weight", Role::Down),
    (".lora.up.weight", Role::Up),
    (".lora_A.default.weight", Role::Down),
    (".lora_B.default.weight", Role::Up),
    (".alpha", Role::Alpha),
];

/// Prefixes LoRA files put before the layer name.
const PREFIXES: [&str; 5] = [
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "unet.",
];

/// Where one LoRA layer goes: rows `bfl_rows` of BFL tensor `target` get rows
/// `lora_rows` of the layer's update.
#[derive(Clone, Debug)]
struct Target {
    target: String,
    bfl_rows: Range<usize>,
    lora_rows: Range<usize>,
}

/// The layers a LoRA can target, by every name it may use for them.
struct Targets {
    by_name: HashMap<String, (Vec<Target>, usize)>,
}

impl Targets {
    /// From the checkpoint's BFL tensors: BFL names, their kohya forms, and diffusers'
    /// names (with their kohya-like forms) through the map. Each entry also gives the
    /// layer's output rows (what a LoRA's up matrix must have).
    fn new(tensors: &BTreeMap<String, TensorHeader>) -> Targets {
        let mut by_name: HashMap<String, (Vec<Target>, usize)> = HashMap::new();
        for (name, t) in tensors {
            let Some(layer) = name.strip_suffix(".weight") else {
                continue;
            };
            if t.shape.len() != 2 {
                continue;
            }
            let n = t.shape[0];
            let tg = vec![Target {
                target: name.clone(),
                bfl_rows: 0..n,
                lora_rows: 0..n,
            }];
            by_name.insert(layer.to_string(), (tg.clone(), n));
            by_name.insert(format!("lora_unet_{}", layer.replace('.', "_")), (tg, n));
        }
        // diffusers' names for the same layers.
        let mut h = mold_models::checkpoint::Header {
            tensors: BTreeMap::new(),
            sha256: String::new(),
        };
        for (name, t) in tensors {
            h.tensors.insert(
                name.clone(),
                mold_models::checkpoint::TensorInfo {
                    dtype: t.dtype.clone(),
                    shape: t.shape.iter().map(|&d| d as u64).collect(),
                    bytes: 0,
                    file: PathBuf::new(),
                },
            );
        }
        if let Ok(dims) = mold_models::diffusers::FluxDims::from_bfl(&h, "".as_ref()) {
            let mut diff: BTreeMap<String, Vec<Target>> = BTreeMap::new();
            for l in mold_models::diffusers::links(&dims) {
                let (Some(layer), Some(t)) =
                    (l.diffusers.strip_suffix(".weight"), tensors.get(&l.bfl))
                else {
                    continue;
                };
                if t.shape.len() != 2 {
                    continue;
                }
                let (bfl_rows, lora_rows) = match l.rows {
                    None => (0..t.shape[0], 0..t.shape[0]),
                    Some((b, d)) => (
                        b.start as usize..b.end as usize,
                        d.start as usize..d.end as usize,
                    ),
                };
                diff.entry(layer.to_string()).or_default().push(Target {
                    target: l.bfl,
                    bfl_rows,
                    lora_rows,
                });
            }
            for (layer, tg) in diff {
                let n = tg.iter().map(|t| t.lora_rows.end).max().unwrap_or(0);
                by_name.insert(
                    format!("lora_transformer_{}", layer.replace('.', "_")),
                    (tg.clone(), n),
                );
                by_name.entry(layer).or_insert((tg, n));
            }
        }
        Targets { by_name }
    }

    fn find(&self, layer: &str) -> Option<&(Vec<Target>, usize)> {
        if let Some(t) = self.by_name.get(layer) {
            return Some(t);
        }
        PREFIXES
            .iter()
            .find_map(|p| self.by_name.get(layer.strip_prefix(p)?))
    }
}

/// A 2-D LoRA matrix as f32, or why not.
fn matrix(spec: &LoraSpec, name: &str, t: &Tensor) -> Result<Tensor> {
    if t.rank() != 2 {
        return Err(bad(
            spec,
            format!(
                "tensor `{name}` has shape {:?}: LoRA matrices are 2-D (convolution LoRAs are not for FLUX's transformer)",
                t.dims()
            ),
        ));
    }
    Ok(t.to_dtype(DType::F32)?)
}

/// Reads a LoRA file and maps it onto the checkpoint's tensors (`tensors`, BFL names).
pub fn load(spec: &LoraSpec, tensors: &BTreeMap<String, TensorHeader>) -> Result<Vec<Delta>> {
    let path = &spec.path;
    // Headers first (the one checked reader): names are refused before any data is read.
    let header =
        mold_models::checkpoint::read_header(path).map_err(|e| bad(spec, e.to_string()))?;
    let targets = Targets::new(tensors);
    // layer -> (down, up, alpha) tensor names.
    let mut layers: BTreeMap<String, [Option<String>; 3]> = BTreeMap::new();
    for name in header.tensors.keys() {
        let Some((layer, role)) = ENDINGS
            .iter()
            .find_map(|(e, r)| name.strip_suffix(e).map(|l| (l, *r)))
        else {
            let why = if name.contains("dora_scale") {
                "DoRA (weight-decomposed) LoRAs are not supported"
            } else {
                "not a LoRA down/up matrix or alpha (names end in .lora_A.weight/.lora_B.weight, .lora_down.weight/.lora_up.weight or .alpha)"
            };
            return Err(bad(spec, format!("tensor `{name}`: {why}")));
        };
        if targets.find(layer).is_none() {
            let why = if layer.starts_with("lora_te") || layer.starts_with("text_encoder") {
                "it is for a text encoder; mold merges LoRAs into the transformer only: use a LoRA without text-encoder layers".to_string()
            } else {
                format!("`{layer}` is no layer of this FLUX transformer (BFL, kohya or diffusers names): is the LoRA for another model?")
            };
            return Err(bad(spec, format!("tensor `{name}`: {why}")));
        }
        let slot = &mut layers.entry(layer.to_string()).or_default()[role as usize];
        if let Some(other) = slot {
            return Err(bad(
                spec,
                format!(
                    "tensors `{other}` and `{name}` both give the same matrix of layer `{layer}`"
                ),
            ));
        }
        *slot = Some(name.clone());
    }
    if layers.is_empty() {
        return Err(bad(spec, "holds no tensors".into()));
    }
    let data = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(spec, format!("cannot read its tensors: {e}")))?;
    let mut out = Vec::new();
    for (layer, [down, up, alpha]) in layers {
        let (down, up) = match (down, up) {
            (Some(d), Some(u)) => (d, u),
            (Some(n), None) | (None, Some(n)) => {
                return Err(bad(
                    spec,
                    format!("tensor `{n}` has no partner: a LoRA layer needs both its down (A) and up (B) matrices"),
                ))
            }
            (None, None) => {
                let n = alpha.unwrap_or(layer);
                return Err(bad(spec, format!("tensor `{n}`: an alpha without matrices")));
            }
        };
        let a = matrix(spec, &down, &data[&down])?;
        let b = matrix(spec, &up, &data[&up])?;
        let (rank, cols) = a.dims2()?;
        let (rows, rank_b) = b.dims2()?;
        let (tg, layer_rows) = targets.find(&layer).expect("checked above");
        let in_cols = tensors[&tg[0].target].shape[1];
        if rank_b != rank || cols != in_cols || rows != *layer_rows {
            return Err(bad(
                spec,
                format!(
                    "tensors `{down}` {:?} and `{up}` {:?} do not fit layer `{layer}` ([{layer_rows}, {in_cols}]): want down [rank, {in_cols}] and up [{layer_rows}, rank]",
                    a.dims(),
                    b.dims()
                ),
            ));
        }
        let alpha = match alpha {
            None => rank as f64,
            Some(n) => {
                let v = data[&n]
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                match v.as_slice() {
                    [x] if x.is_finite() => *x as f64,
                    _ => {
                        return Err(bad(
                            spec,
                            format!("tensor `{n}`: alpha must be one finite number, found {v:?}"),
                        ))
                    }
                }
            }
        };
        let scale = spec.strength * alpha / rank.max(1) as f64;
        for t in tg {
            out.push(Delta {
                target: t.target.clone(),
                rows: t.bfl_rows.clone(),
                b: b.narrow(0, t.lora_rows.start, t.lora_rows.len())?,
                a: a.clone(),
                scale,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strength_parses_after_the_last_colon() {
        let p = |s: &str| LoraSpec::parse(s);
        assert_eq!(p("a.safetensors").unwrap().strength, 1.0);
        let s = p("dir/a.safetensors:0.8").unwrap();
        assert_eq!(
            (s.path.to_str(), s.strength),
            (Some("dir/a.safetensors"), 0.8)
        );
        // A colon inside a path that is not followed by a number stays in the path.
        assert_eq!(
            p("c:/x.safetensors").unwrap().path.to_str(),
            Some("c:/x.safetensors")
        );
        assert!(p(":0.5").is_err());
        assert!(p("").is_err());
        assert!(p("a:inf").unwrap_err().contains("finite"));
    }

    #[test]
    fn a_slice_of_the_update_is_the_update_of_the_slice() {
        let dev = Device::Cpu;
        let b = Tensor::arange(0f32, 12., &dev)
            .unwrap()
            .reshape((6, 2))
            .unwrap();
        let a = Tensor::arange(0f32, 10., &dev)
            .unwrap()
            .reshape((2, 5))
            .unwrap();
        // Rows 4..10 of a 12-row target are updated.
        let d = Delta {
            target: "w".into(),
            rows: 4..10,
            b: b.clone(),
            a: a.clone(),
            scale: 0.5,
        };
        let full = {
            let z = Tensor::zeros((4, 5), DType::F32, &dev).unwrap();
            let mid = b.matmul(&a).unwrap().affine(0.5, 0.0).unwrap();
            let z2 = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
            Tensor::cat(&[&z, &mid, &z2], 0).unwrap()
        };
        let rows = [2..5, 9..12];
        let cols = [1..3, 4..5];
        let got = d.slice(&rows, Some(&cols)).unwrap().unwrap();
        let pick_rows = Tensor::cat(
            &rows
                .iter()
                .map(|r| full.narrow(0, r.start, r.len()).unwrap())
                .collect::<Vec<_>>(),
            0,
        )
        .unwrap();
        let want = Tensor::cat(
            &cols
                .iter()
                .map(|c| pick_rows.narrow(1, c.start, c.len()).unwrap())
                .collect::<Vec<_>>(),
            1,
        )
        .unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        assert!(d.slice(&[0..4, 10..12], None).unwrap().is_none());
    }
}
