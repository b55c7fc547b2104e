//! Safetensors checkpoints: header reading (names, dtypes, shapes; no data), checks
//! against a model's tensors ([`Transformer::tensor_specs`]), and memory-mapped reading of tensor slices.
//!
//! A checkpoint is one `.safetensors` file, a `*.safetensors.index.json` weight map
//! naming several files, or a directory holding either.

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

/// A checkpoint whose headers have been read. Tensor data is memory-mapped on first
/// use and only the requested bytes are touched.
pub struct Checkpoint {
    display: String,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, TensorHeader>,
    mmap: OnceLock<MmapedSafetensors>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.display)
            .field("files", &self.files)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ExecError + '_ {
    move |source| ExecError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Candle dtype of a safetensors dtype name, for the dtypes exec reads.
fn candle_dtype(st: &str) -> Option<DType> {
    match st {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::BF16),
        "F16" => Some(DType::F16),
        _ => None,
    }
}

impl Checkpoint {
    /// Reads the headers of a checkpoint: a `.safetensors` file, a
    /// `*.safetensors.index.json`, or a directory holding one index or `.safetensors`
    /// files. No tensor data is read.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let display = path.display().to_string();
        if path.is_dir() {
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
        let header = mold_models::checkpoint::read_header(path).map_err(|e| {
            ExecError::BadCheckpointFile {
                path: display.clone(),
                message: e.to_string(),
            }
        })?;
        let mut files: Vec<PathBuf> = header.tensors.values().map(|t| t.file.clone()).collect();
        files.sort();
        files.dedup();
        let mut tensors = BTreeMap::new();
        for (name, t) in header.tensors {
            let file = files.binary_search(&t.file).unwrap_or(0);
            let shape = t
                .shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<Vec<usize>, _>>()
                .map_err(|_| ExecError::BadCheckpointFile {
                    path: display.clone(),
                    message: format!("tensor `{name}`: a dimension does not fit this machine"),
                })?;
            tensors.insert(
                name,
                TensorHeader {
                    dtype: t.dtype,
                    shape,
                    file,
                },
            );
        }
        Ok(Checkpoint {
            display,
            files,
            tensors,
            mmap: OnceLock::new(),
        })
    }

    /// The path the checkpoint was opened from.
    pub fn path(&self) -> &str {
        &self.display
    }

    /// The safetensors files, in the order [`TensorHeader::file`] indexes.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every tensor the headers list.
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
    /// the selected bytes of the mapped file are read.
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
        let all_rows = 0..n_rows;
        let rows = rows.unwrap_or(std::slice::from_ref(&all_rows));
        let out_rows: usize = rows.iter().map(|r| r.len()).sum();
        let out_cols: usize = match cols {
            None => n_cols,
            Some(c) => c.iter().map(|r| r.len()).sum(),
        };
        let oob = rows.iter().any(|r| r.end > n_rows)
            || cols.is_some_and(|c| c.iter().any(|r| r.end > n_cols));
        if oob || data.len() != n_rows * n_cols * es {
            return Err(ExecError::BadCheckpointFile {
                path: self.display.clone(),
                message: format!("tensor `{name}`: slice out of bounds or truncated data"),
            });
        }
        let mut bytes = Vec::with_capacity(out_rows * out_cols * es);
        for r in rows {
            match cols {
                None => bytes.extend_from_slice(&data[r.start * n_cols * es..r.end * n_cols * es]),
                Some(cs) => {
                    for row in r.clone() {
                        for c in cs {
                            let base = row * n_cols;
                            bytes.extend_from_slice(
                                &data[(base + c.start) * es..(base + c.end) * es],
                            );
                        }
                    }
                }
            }
        }
        let out_shape: Vec<usize> = if shape.len() == 1 {
            vec![out_rows]
        } else {
            vec![out_rows, out_cols]
        };
        let t = Tensor::from_raw_buffer(&bytes, src_dtype, &out_shape, &Device::Cpu)?;
        Ok(t.to_dtype(dtype)?)
    }
}
