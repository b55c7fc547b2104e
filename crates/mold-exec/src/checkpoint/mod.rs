//! Safetensors checkpoints: header reading (names, dtypes, shapes; no data), checks
//! against a model's tensors ([`Transformer::tensor_specs`]), and memory-mapped reading
//! of tensor slices.
//!
//! A checkpoint is one `.safetensors` file, a `*.safetensors.index.json` weight map
//! naming several files, or a directory holding either (a Hugging Face repository of
//! FLUX.1 included: [`mold_models::snapshot::find_transformer`]). Tensors are presented
//! under BFL's names whatever the layout: a diffusers-format transformer is read through
//! [`diffusers`] (a fused projection is served as slices of the concatenation of
//! diffusers' separate ones). LoRAs ([`lora`]) are merged into the slices as they are
//! read, so every rank merges exactly the rows and columns it holds.

pub mod diffusers;
pub mod lora;

pub use lora::LoraSpec;

use crate::error::{ExecError, Result};
use crate::model::Transformer;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What a safetensors header says about one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    /// Safetensors dtype name: `F32`, `BF16`, `F16`, …
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
}

/// How the stored tensors relate to the names the model asks for.
enum Layout {
    /// Stored under BFL's names.
    Bfl,
    /// diffusers' `FluxTransformer2DModel` names: each BFL tensor is these pieces.
    Diffusers(diffusers::Adapter),
}

/// A checkpoint whose headers have been read. Tensor data is memory-mapped on first
/// use and only the requested bytes are touched.
pub struct Checkpoint {
    display: String,
    files: Vec<PathBuf>,
    /// The tensors as the model sees them (BFL names).
    tensors: BTreeMap<String, TensorHeader>,
    /// The tensors as stored (the same as `tensors` for a BFL checkpoint).
    stored: BTreeMap<String, TensorHeader>,
    layout: Layout,
    loras: Vec<lora::Delta>,
    mmap: OnceLock<MmapedSafetensors>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.display)
            .field("format", &self.format())
            .field("files", &self.files)
            .field("tensors", &self.tensors.len())
            .field("lora_deltas", &self.loras.len())
            .finish()
    }
}

/// Candle dtype of a safetensors dtype name, for the dtypes exec reads.
fn candle_dtype(st: &str) -> Option<DType> {
    match st {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::BF16),
        "F16" => Some(DType::F16),
        // FP8 checkpoints as users download them (`flux1-dev-fp8`, ComfyUI's scaled FP8):
        // dequantized at load ([`Checkpoint::read_slice`]).
        "F8_E4M3" => Some(DType::F8E4M3),
        _ => None,
    }
}

/// The scale tensor stored beside an FP8 weight `X.weight`: `X.scale_weight` (ComfyUI's
/// scaled FP8 files); `None` for other names.
fn scale_name(weight: &str) -> Option<String> {
    weight
        .strip_suffix(".weight")
        .map(|stem| format!("{stem}.scale_weight"))
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ExecError + '_ {
    move |source| ExecError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Headers in `files`' indexing, with dimensions as `usize`.
fn headers(
    display: &str,
    h: BTreeMap<String, mold_models::checkpoint::TensorInfo>,
    files: &[PathBuf],
) -> Result<BTreeMap<String, TensorHeader>> {
    let mut out = BTreeMap::new();
    for (name, t) in h {
        let file = files.binary_search(&t.file).unwrap_or(0);
        let shape = t
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| ExecError::BadCheckpointFile {
                path: display.to_string(),
                message: format!("tensor `{name}`: a dimension does not fit this machine"),
            })?;
        out.insert(
            name,
            TensorHeader {
                dtype: t.dtype,
                shape,
                file,
            },
        );
    }
    Ok(out)
}

impl Checkpoint {
    /// Reads the headers of a checkpoint: a `.safetensors` file, a
    /// `*.safetensors.index.json`, or a directory holding one index or `.safetensors`
    /// files, or a weights directory (its transformer: BFL's file, else diffusers'
    /// `transformer/`; a hub cache repository folder is taken to its snapshot). No
    /// tensor data is read.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let display = path.display().to_string();
        let resolved = mold_models::snapshot::resolve_weights_path(path);
        let path = resolved.as_path();
        if path.is_dir() && mold_models::snapshot::find_transformer(path, None).is_none() {
            let indexes = std::fs::read_dir(path)
                .map_err(io_err(path))?
                .filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .ends_with(".safetensors.index.json")
                })
                .count();
            if indexes > 1 {
                return Err(ExecError::BadCheckpointFile {
                    path: display,
                    message:
                        "the directory holds several *.safetensors.index.json: point at one of them"
                            .into(),
                });
            }
        }
        // The one safetensors header reader (mold-models'): bounded lengths, checked
        // offsets, shards of an index followed.
        let bad = |e: mold_models::ModelError| ExecError::BadCheckpointFile {
            path: display.clone(),
            message: e.to_string(),
        };
        let header = mold_models::checkpoint::read_header(path).map_err(bad)?;
        let mut files: Vec<PathBuf> = header.tensors.values().map(|t| t.file.clone()).collect();
        files.sort();
        files.dedup();
        if mold_models::diffusers::is_diffusers_flux(&header) {
            let (view, pieces) = mold_models::diffusers::bfl_view(&header, path).map_err(bad)?;
            let tensors = headers(&display, view.tensors, &files)?;
            let stored = headers(&display, header.tensors, &files)?;
            return Ok(Checkpoint {
                display,
                files,
                tensors,
                stored,
                layout: Layout::Diffusers(diffusers::Adapter::new(&pieces)),
                loras: Vec::new(),
                mmap: OnceLock::new(),
            });
        }
        let tensors = headers(&display, header.tensors, &files)?;
        Ok(Checkpoint {
            display,
            files,
            stored: tensors.clone(),
            tensors,
            layout: Layout::Bfl,
            loras: Vec::new(),
            mmap: OnceLock::new(),
        })
    }

    /// Merges a LoRA into every slice read from now on (`W += scale · alpha/rank · B·A`,
    /// computed in f32 for the rows and columns read). Its file is checked against this
    /// checkpoint first: a tensor that targets no layer, or does not fit the layer it
    /// targets, is refused naming it; the LoRA's tensors (small) are then read.
    pub fn add_lora(&mut self, spec: &LoraSpec) -> Result<()> {
        let deltas = lora::load(spec, &self.tensors)?;
        self.loras.extend(deltas);
        Ok(())
    }

    /// [`Checkpoint::add_lora`] for each of `specs`, in order.
    pub fn with_loras(mut self, specs: &[LoraSpec]) -> Result<Checkpoint> {
        for s in specs {
            self.add_lora(s)?;
        }
        Ok(self)
    }

    /// `BFL` or `diffusers`: the names the tensors are stored under.
    pub fn format(&self) -> &'static str {
        match self.layout {
            Layout::Bfl => "BFL",
            Layout::Diffusers(_) => "diffusers",
        }
    }

    /// The path the checkpoint was opened from.
    pub fn path(&self) -> &str {
        &self.display
    }

    /// The safetensors files, in the order [`TensorHeader::file`] indexes.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every tensor the model can read, under BFL's names (for a diffusers-format
    /// checkpoint: the concatenations its tensors make).
    pub fn tensors(&self) -> &BTreeMap<String, TensorHeader> {
        &self.tensors
    }

    /// Checks, from headers alone, that the checkpoint holds every tensor model `m` needs
    /// with the right shape and a readable dtype. Extra tensors are ignored.
    pub fn check<M: Transformer>(&self, m: &M, model: &str) -> Result<()> {
        for spec in m.tensor_specs() {
            match self.tensors.get(&spec.name) {
                None => {
                    return Err(ExecError::MissingTensor {
                        checkpoint: self.display.clone(),
                        model: model.to_string(),
                        name: spec.name,
                        expected: spec.shape,
                    })
                }
                Some(t) if t.shape != spec.shape => {
                    return Err(ExecError::ShapeMismatch {
                        checkpoint: self.display.clone(),
                        model: model.to_string(),
                        name: spec.name,
                        expected: spec.shape,
                        found: t.shape.clone(),
                    })
                }
                Some(t) if candle_dtype(&t.dtype).is_none() => {
                    return Err(ExecError::UnsupportedTensorDtype {
                        checkpoint: self.display.clone(),
                        name: spec.name,
                        dtype: t.dtype.clone(),
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    fn mmap(&self) -> Result<&MmapedSafetensors> {
        if let Some(m) = self.mmap.get() {
            return Ok(m);
        }
        // SAFETY: the files are mapped read-only; like every mmap reader we rely on them
        // not being modified while mapped (the executor copies what it needs at load).
        let m = unsafe { MmapedSafetensors::multi(&self.files) }?;
        Ok(self.mmap.get_or_init(|| m))
    }

    /// Reads part of a 1-D or 2-D tensor into host memory as `dtype`: the given `rows`
    /// (dim 0: output features; `None` = all), and of each row the given `cols` (dim 1:
    /// input features; `None` = all). Ranges are concatenated in the order given. Only
    /// the selected bytes of the mapped files are read; LoRAs added to the checkpoint are
    /// merged into exactly these rows and columns.
    pub fn read_slice(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
        dtype: DType,
    ) -> Result<Tensor> {
        let header = self
            .tensors
            .get(name)
            .ok_or_else(|| ExecError::MissingTensor {
                checkpoint: self.display.clone(),
                model: "?".into(),
                name: name.to_string(),
                expected: vec![],
            })?;
        let n_rows = header.shape.first().copied().unwrap_or(0);
        let all_rows = 0..n_rows;
        let rows = rows.unwrap_or(std::slice::from_ref(&all_rows));
        if let Some(r) = rows.iter().find(|r| r.end > n_rows) {
            return Err(ExecError::BadCheckpointFile {
                path: self.display.clone(),
                message: format!(
                    "tensor `{name}`: rows {}..{} out of bounds (it has {n_rows})",
                    r.start, r.end
                ),
            });
        }
        let base = match &self.layout {
            Layout::Bfl => self.read_dequantized(name, rows, cols)?,
            Layout::Diffusers(a) => {
                let mut parts = Vec::new();
                for (source, ranges) in a.sources(name, rows)? {
                    parts.push(self.read_dequantized(&source, &ranges, cols)?);
                }
                Tensor::cat(&parts, 0)?
            }
        };
        let deltas: Vec<&lora::Delta> = self.loras.iter().filter(|d| d.target == name).collect();
        if deltas.is_empty() {
            return Ok(base.to_dtype(dtype)?);
        }
        let mut w = base.to_dtype(DType::F32)?;
        for d in deltas {
            if let Some(delta) = d.slice(rows, cols)? {
                w = (w + delta)?;
            }
        }
        Ok(w.to_dtype(dtype)?)
    }

    /// [`Checkpoint::read_stored`], an FP8 tensor widened to f32 and multiplied by its
    /// stored scale ([`scale_name`]: one value for the tensor, or one per row), or by 1
    /// where it has none (a plain `e4m3fn` cast of the weights).
    fn read_dequantized(
        &self,
        name: &str,
        rows: &[Range<usize>],
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        let t = self.read_stored(name, rows, cols)?;
        if t.dtype() != DType::F8E4M3 {
            return Ok(t);
        }
        let t = t.to_dtype(DType::F32)?;
        let Some(scale) = scale_name(name).filter(|s| self.stored.contains_key(s)) else {
            return Ok(t);
        };
        let h = &self.stored[&scale];
        let bad = |message: String| ExecError::BadCheckpointFile {
            path: self.display.clone(),
            message: format!("tensor `{scale}`: {message}"),
        };
        let n: usize = h.shape.iter().product();
        let n_rows = self.stored[name].shape.first().copied().unwrap_or(0);
        let all = self.read_scalars(&scale, n)?;
        if let Some(v) = all.iter().find(|v| !v.is_finite()) {
            return Err(bad(format!("the scale {v} is not finite")));
        }
        let out = if n == 1 {
            (t * all[0] as f64)?
        } else if n == n_rows {
            let picked: Vec<f32> = rows.iter().flat_map(|r| all[r.clone()].to_vec()).collect();
            let len = picked.len();
            let s = Tensor::from_vec(picked, (len, 1), t.device())?;
            t.broadcast_mul(&s)?
        } else {
            return Err(bad(format!(
                "{n} scales for {n_rows} rows: an FP8 weight's scale is one value or one per row"
            )));
        };
        Ok(out)
    }

    /// All `n` values of a small tensor as f32.
    fn read_scalars(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let h = &self.stored[name];
        let dtype = candle_dtype(&h.dtype).ok_or_else(|| ExecError::UnsupportedTensorDtype {
            checkpoint: self.display.clone(),
            name: name.to_string(),
            dtype: h.dtype.clone(),
        })?;
        let data = self.mmap()?.get(name)?;
        if data.data().len() != n * dtype.size_in_bytes() {
            return Err(ExecError::BadCheckpointFile {
                path: self.display.clone(),
                message: format!("tensor `{name}`: truncated data"),
            });
        }
        let t = Tensor::from_raw_buffer(data.data(), dtype, &[n], &candle_core::Device::Cpu)?;
        Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    /// Rows `rows` (and columns `cols`) of a tensor as stored, in its stored dtype.
    fn read_stored(
        &self,
        name: &str,
        rows: &[Range<usize>],
        cols: Option<&[Range<usize>]>,
    ) -> Result<Tensor> {
        let sel = self.select(name, rows, cols)?;
        let mut bytes = Vec::with_capacity(sel.len());
        for p in &sel.pieces {
            bytes.extend_from_slice(p);
        }
        Ok(Tensor::from_raw_buffer(
            &bytes,
            sel.dtype,
            &sel.shape,
            &Device::Cpu,
        )?)
    }

    /// The bytes of `rows` (and of each row, `cols`) of a stored tensor, in order, as
    /// slices of the mapped files: what [`Checkpoint::read_stored`] concatenates. The
    /// bounds and the data's length are checked here.
    fn select(
        &self,
        name: &str,
        rows: &[Range<usize>],
        cols: Option<&[Range<usize>]>,
    ) -> Result<Selection<'_>> {
        let header = self
            .stored
            .get(name)
            .ok_or_else(|| ExecError::MissingTensor {
                checkpoint: self.display.clone(),
                model: "?".into(),
                name: name.to_string(),
                expected: vec![],
            })?;
        let src_dtype =
            candle_dtype(&header.dtype).ok_or_else(|| ExecError::UnsupportedTensorDtype {
                checkpoint: self.display.clone(),
                name: name.to_string(),
                dtype: header.dtype.clone(),
            })?;
        let view = self.mmap()?.get(name)?;
        let data = view.data();
        let es = src_dtype.size_in_bytes();
        let shape = &header.shape;
        let (n_rows, n_cols) = match shape.len() {
            1 => (shape[0], 1),
            2 => (shape[0], shape[1]),
            _ => {
                return Err(ExecError::BadCheckpointFile {
                    path: self.display.clone(),
                    message: format!("tensor `{name}` is not 1-D or 2-D"),
                })
            }
        };
        let out_rows: usize = rows.iter().map(|r| r.len()).sum();
        let out_cols: usize = match cols {
            None => n_cols,
            Some(c) => c.iter().map(|r| r.len()).sum(),
        };
        let oob = rows.iter().any(|r| r.start > r.end || r.end > n_rows)
            || cols.is_some_and(|c| c.iter().any(|r| r.start > r.end || r.end > n_cols));
        if oob || data.len() != n_rows * n_cols * es {
            return Err(ExecError::BadCheckpointFile {
                path: self.display.clone(),
                message: format!("tensor `{name}`: slice out of bounds or truncated data"),
            });
        }
        let mut pieces = Vec::new();
        for r in rows {
            match cols {
                None => pieces.push(&data[r.start * n_cols * es..r.end * n_cols * es]),
                Some(cs) => {
                    for row in r.clone() {
                        let base = row * n_cols;
                        for c in cs {
                            pieces.push(&data[(base + c.start) * es..(base + c.end) * es]);
                        }
                    }
                }
            }
        }
        pieces.retain(|p| !p.is_empty());
        let shape = if shape.len() == 1 {
            vec![out_rows]
        } else {
            vec![out_rows, out_cols]
        };
        Ok(Selection {
            dtype: src_dtype,
            shape,
            pieces,
        })
    }

    /// The stored bytes of a slice where they are the tensor the model asks for, as
    /// stored: a BFL-named tensor with no LoRA merged into it and not FP8 (whose stored
    /// scale [`Checkpoint::read_slice`] applies). A loader may then copy these bytes to the
    /// device itself and cast there ([`crate::staging`]); `None` where the slice must go
    /// through [`Checkpoint::read_slice`].
    pub fn stored_slice(
        &self,
        name: &str,
        rows: Option<&[Range<usize>]>,
        cols: Option<&[Range<usize>]>,
    ) -> Result<Option<Selection<'_>>> {
        if !matches!(self.layout, Layout::Bfl) || self.loras.iter().any(|d| d.target == name) {
            return Ok(None);
        }
        let Some(h) = self.stored.get(name) else {
            return Ok(None);
        };
        if h.dtype.starts_with("F8") {
            return Ok(None);
        }
        let all = 0..h.shape.first().copied().unwrap_or(0);
        let rows = rows.unwrap_or(std::slice::from_ref(&all));
        self.select(name, rows, cols).map(Some)
    }
}

/// A tensor slice as stored: its bytes are `pieces` concatenated, `shape` in `dtype`.
#[derive(Debug)]
pub struct Selection<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub pieces: Vec<&'a [u8]>,
}

impl Selection<'_> {
    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
