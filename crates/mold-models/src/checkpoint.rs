//! Sizes from a safetensors checkpoint's header: names, dtypes, shapes and byte offsets,
//! read without touching tensor data. A `*.safetensors.index.json` (sharded checkpoint)
//! is followed to each shard's header.

use crate::{builtin, ModelError, ModelSpec};
use mold_plan::DType;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One tensor as the header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub bytes: u64,
    pub file: PathBuf,
}

/// All tensors of a checkpoint, by name, and the sha256 of its header bytes.
#[derive(Clone, Debug)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub sha256: String,
}

fn err(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Checkpoint {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Upper bound on a header's size: real headers are a few MB at most.
const MAX_HEADER: u64 = 100 << 20;

fn read_one(
    path: &Path,
    hasher: &mut Sha256,
    out: &mut BTreeMap<String, TensorInfo>,
) -> Result<(), ModelError> {
    let mut f = std::fs::File::open(path).map_err(|e| err(path, format!("cannot open: {e}")))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        err(
            path,
            "too short to be a safetensors file (no 8-byte header length)",
        )
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n + 8 > len {
        return Err(err(
            path,
            format!("header length {n} is impossible for a {len}-byte file: not a safetensors file, or truncated"),
        ));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .map_err(|e| err(path, format!("cannot read the header: {e}")))?;
    hasher.update(&buf);
    parse_header(path, &buf, len - 8 - n, out)
}

/// Bytes per element of a safetensors dtype; `None` for one mold does not know (its
/// tensors' sizes are then taken from their offsets alone).
fn element_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Parses one header (the JSON after the length) of a file with `data_len` bytes of
/// tensor data: every tensor's dtype, shape and offsets must be present, agree with each
/// other, lie inside the data and not overlap.
fn parse_header(
    path: &Path,
    buf: &[u8],
    data_len: u64,
    out: &mut BTreeMap<String, TensorInfo>,
) -> Result<(), ModelError> {
    let json: serde_json::Value = serde_json::from_slice(buf)
        .map_err(|e| err(path, format!("the header is not valid JSON: {e}")))?;
    let map = json
        .as_object()
        .ok_or_else(|| err(path, "the header is not a JSON object"))?;
    let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        // Names are quoted as Rust would (escapes included): one line whatever they hold.
        let bad =
            |field: &str, what: String| err(path, format!("tensor {name:?}: {field}: {what}"));
        // No model's tensor name holds a control character; refusing one here keeps every
        // later message that quotes a name (LoRA, shape, missing-tensor) on one line.
        if name.chars().any(char::is_control) {
            return Err(err(
                path,
                format!("tensor {name:?}: its name holds a control character: the header is damaged; re-download or re-export the file"),
            ));
        }
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("dtype", "missing, or not a string such as \"BF16\"".into()))?
            .to_string();
        let shape = v
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("shape", "missing, or not a list such as [3072, 64]".into()))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| bad("shape", format!("{x} is not a dimension (an integer ≥ 0)")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let offs = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("data_offsets", "missing, or not a pair [start, end]".into()))?;
        let (a, b) = match (offs[0].as_u64(), offs[1].as_u64()) {
            (Some(a), Some(b)) if a <= b => (a, b),
            _ => {
                return Err(bad(
                    "data_offsets",
                    format!(
                        "[{}, {}] is not a byte range [start, end] with start ≤ end",
                        offs[0], offs[1]
                    ),
                ))
            }
        };
        if b > data_len {
            return Err(bad(
                "data_offsets",
                format!("[{a}, {b}] runs past the file's {data_len} bytes of tensor data: the file is truncated or not a safetensors file"),
            ));
        }
        if let Some(size) = element_bytes(&dtype) {
            let want = shape
                .iter()
                .try_fold(size, |acc, &d| acc.checked_mul(d))
                .filter(|&w| w == b - a);
            if want.is_none() {
                return Err(bad(
                    "data_offsets",
                    format!(
                        "[{a}, {b}] holds {} bytes, but shape {shape:?} of {dtype} needs a different number",
                        b - a
                    ),
                ));
            }
        }
        ranges.push((a, b, name));
        out.insert(
            name.clone(),
            TensorInfo {
                dtype,
                shape,
                bytes: b - a,
                file: path.to_path_buf(),
            },
        );
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((_, end, first), (start, _, second)) = (w[0], w[1]);
        if start < end {
            return Err(err(
                path,
                format!("tensor {second:?}: data_offsets: overlaps tensor {first:?}: not a valid safetensors file"),
            ));
        }
    }
    Ok(())
}

/// Why `name`, a shard an index's `weight_map` names, is not a plain file name beside the
/// index (a `/` or `\`, `.` or `..`, an absolute path, an empty name); `None` when it is.
/// Every reader of an index goes through it (or [`shard_path`]): an index may not point
/// mold at a file outside its own folder.
pub fn bad_shard_name(name: &str) -> Option<String> {
    let plain = !name.is_empty()
        && !name.contains(['/', '\\', '\0'])
        && name != "."
        && name != ".."
        && !Path::new(name).is_absolute()
        && Path::new(name).components().count() == 1;
    (!plain).then(|| {
        format!(
            "weight_map names shard {name:?}: a shard is a plain file name beside the index (no `/` or `\\`, no `..`, not absolute)"
        )
    })
}

/// The path of shard `name` of the index `index` (beside it), refused naming the index
/// and the name unless the name is plain ([`bad_shard_name`]).
pub fn shard_path(index: &Path, name: &str) -> Result<PathBuf, ModelError> {
    if let Some(m) = bad_shard_name(name) {
        return Err(err(index, m));
    }
    Ok(index.parent().unwrap_or(Path::new(".")).join(name))
}

/// Reads the header of a `.safetensors` file, or of every shard named by an
/// `.index.json`, or of a directory's transformer ([`crate::snapshot::find_transformer`]:
/// a BFL-named file, else diffusers' `transformer/` folder), or else of every
/// `.safetensors` file in the directory.
pub fn read_header(path: &Path) -> Result<Header, ModelError> {
    if path.is_dir() {
        if let Some(t) = crate::snapshot::find_transformer(path, None) {
            return read_header(&t);
        }
    }
    let mut files: Vec<PathBuf> = Vec::new();
    let name = path.to_string_lossy();
    if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|e| err(path, format!("cannot list: {e}")))?;
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                files.push(p);
            }
        }
        if files.is_empty() {
            return Err(err(path, "no .safetensors files in this directory"));
        }
    } else if name.ends_with(".json") {
        let text =
            std::fs::read_to_string(path).map_err(|e| err(path, format!("cannot read: {e}")))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(path, format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| err(path, "no `weight_map` object: not a safetensors index"))?;
        for f in map.values() {
            let f = f
                .as_str()
                .ok_or_else(|| err(path, "weight_map values must be file names"))?;
            let p = shard_path(path, f)?;
            if !files.contains(&p) {
                files.push(p);
            }
        }
    } else {
        files.push(path.to_path_buf());
    }
    files.sort();
    let mut hasher = Sha256::new();
    let mut tensors = BTreeMap::new();
    for f in &files {
        read_one(f, &mut hasher, &mut tensors)?;
    }
    Ok(Header {
        tensors,
        sha256: format!("{:x}", hasher.finalize()),
    })
}

/// Prefix of block `i` of `kind` in the checkpoint layout of `model`.
fn block_prefix(model: &str, kind: &str) -> String {
    match (model, kind) {
        (m, "double") if m.starts_with("flux") => "double_blocks.".into(),
        (m, "single") if m.starts_with("flux") => "single_blocks.".into(),
        (_, "joint") => "joint_blocks.".into(),
        (_, "layer") => "layers.".into(),
        (_, k) if k.ends_with("refiner") => format!("{k}."),
        _ => "transformer_blocks.".into(),
    }
}

fn dtype_of(st: &str) -> Option<DType> {
    match st {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::Bf16),
        "F16" => Some(DType::Fp16),
        "F8_E4M3" | "F8_E5M2" => Some(DType::Fp8),
        _ => None,
    }
}

/// A catalogue model refined by a checkpoint: exact bytes per block kind (largest block)
/// and for the stem, the checkpoint's dominant dtype, and the header hash.
#[derive(Debug)]
pub struct Refined {
    pub model: ModelSpec,
    pub dtype: DType,
    pub header_sha256: String,
}

/// Recognises which catalogue model a transformer checkpoint is, from its tensor names.
pub fn identify(h: &Header) -> Option<String> {
    let count = |prefix: &str| {
        h.tensors
            .keys()
            .filter_map(|k| k.strip_prefix(prefix))
            .filter_map(|r| r.split('.').next()?.parse::<u32>().ok())
            .max()
            .map(|m| m + 1)
            .unwrap_or(0)
    };
    let hidden = h
        .tensors
        .get("img_in.weight")
        .and_then(|t| t.shape.first().copied());
    let (d, s) = (count("double_blocks."), count("single_blocks."));
    if d > 0 || s > 0 {
        return Some(
            match (
                hidden,
                h.tensors.contains_key("guidance_in.in_layer.weight"),
            ) {
                (Some(64), _) => "flux-tiny",
                (_, true) => "flux-dev",
                (_, false) => "flux-schnell",
            }
            .into(),
        );
    }
    if count("joint_blocks.") > 0 {
        return Some("sd3.5-large".into());
    }
    if count("layers.") > 0 && count("noise_refiner.") > 0 {
        return Some("z-image-turbo".into());
    }
    match count("transformer_blocks.") {
        60 => Some("qwen-image".into()),
        28 => Some("ltx-video-2b".into()),
        48 => Some("ltx-video-13b".into()),
        _ => None,
    }
}

/// Builds the model description of a checkpoint: the catalogue entry it matches (or
/// `model_hint`), with weight bytes taken from the header.
pub fn refine(path: &Path, model_hint: Option<&str>) -> Result<Refined, ModelError> {
    let path = &crate::snapshot::resolve_weights_path(path);
    let mut h = read_header(path)?;
    // A diffusers-format transformer is sized as the BFL tensors it holds.
    if crate::diffusers::is_diffusers_flux(&h) {
        h = crate::diffusers::bfl_view(&h, path)?.0;
    }
    let id = match model_hint {
        Some(id) => id.to_string(),
        None => identify(&h).ok_or_else(|| {
            err(
                path,
                "cannot tell which model this checkpoint is from its tensor names: name it with --model-id (e.g. --model-id flux-dev)",
            )
        })?,
    };
    let mut model = builtin()
        .into_iter()
        .find(|m| m.id == id)
        .ok_or_else(|| err(path, format!("unknown model id `{id}`")))?;
    let mut claimed = 0u64;
    for kind in model.transformer.kinds.iter_mut() {
        let prefix = block_prefix(&model.id, &kind.name);
        let mut per_block = vec![0u64; kind.count as usize];
        for (name, t) in &h.tensors {
            if let Some(rest) = name.strip_prefix(&prefix) {
                if let Some(i) = rest.split('.').next().and_then(|x| x.parse::<usize>().ok()) {
                    if i >= per_block.len() {
                        return Err(err(
                            path,
                            format!(
                                "tensor {name:?}: block {i} but {} has {} `{}` blocks: this checkpoint is not {}",
                                model.id, kind.count, kind.name, model.id
                            ),
                        ));
                    }
                    per_block[i] = per_block[i].saturating_add(t.bytes);
                }
            }
        }
        if let Some(i) = per_block.iter().position(|&b| b == 0) {
            return Err(err(
                path,
                format!(
                    "no tensors for `{}{i}.*`: {} needs {} `{}` blocks; is this the right checkpoint?",
                    prefix, model.id, kind.count, kind.name
                ),
            ));
        }
        claimed = per_block.iter().fold(claimed, |a, &b| a.saturating_add(b));
        kind.checkpoint_bytes = per_block.iter().copied().max();
    }
    let total = h
        .tensors
        .values()
        .fold(0u64, |a, t| a.saturating_add(t.bytes));
    model.transformer.stem_checkpoint_bytes = Some(total.saturating_sub(claimed));
    // The dtype holding most bytes names the checkpoint's precision.
    let mut by_dtype: BTreeMap<&str, u64> = BTreeMap::new();
    for t in h.tensors.values() {
        let e = by_dtype.entry(t.dtype.as_str()).or_default();
        *e = e.saturating_add(t.bytes);
    }
    let main = by_dtype
        .iter()
        .max_by_key(|(_, b)| **b)
        .map(|(d, _)| *d)
        .unwrap_or("BF16");
    let dtype = dtype_of(main).ok_or_else(|| {
        err(
            path,
            format!("tensors are mostly {main:?}, which mold does not plan for: use f32, bf16, f16 or f8 weights"),
        )
    })?;
    model.transformer.checkpoint_dtype = Some(dtype);
    for k in &mut model.transformer.kinds {
        k.checkpoint_dtype = Some(dtype);
    }
    Ok(Refined {
        model,
        dtype,
        header_sha256: h.sha256,
    })
}
