//! A run's inputs and outputs as files, for comparing mold with another implementation
//! (`benches/parity/`): the initial noise read from a file (`--latents`), and
//! everything the transformer was given and produced written to one (`--save-io`).
//!
//! `--save-io FILE` writes a safetensors file of f32 tensors (batch 1), named:
//!
//! | name | shape | what |
//! |---|---|---|
//! | `t5` | `(1, tokens, context_in_dim)` | T5's output, as the transformer receives it (its dtype, widened to f32) |
//! | `clip` | `(1, vec_in_dim)` | CLIP's pooled vector, likewise |
//! | `img_ids`, `txt_ids` | `(1, L, 3)`, `(1, tokens, 3)` | token positions |
//! | `guidance` | `(1,)` | distilled guidance (models that have it) |
//! | `timesteps` | `(steps + 1,)` | the schedule, 1 → 0 |
//! | `latents` | `(1, L, 64)` | initial noise, packed in 2×2 patches |
//! | `step.{i}.latents` | `(1, L, 64)` | the transformer's input at step `i` (from 0) |
//! | `step.{i}.t` | `(1,)` | its time (the transformer's `timesteps`) |
//! | `step.{i}.velocity` | `(1, L, 64)` | its output, as the Euler step used it: `(x_{i+1} − x_i) / (t_{i+1} − t_i)` in f32 |
//! | `final` | `(1, L, 64)` | the latents after the last step |
//! | `image` | `(1, 3, height, width)` | the decoded image in [−1, 1], before 8-bit conversion |
//!
//! Its `__metadata__` holds the prompt, seed, steps, size, guidance and model id, and
//! under `mold` the file's stamp (`mold-sha256:…`: mold wrote it and nobody changed it).

use crate::error::{PipelineError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

fn bad(path: &Path, message: String) -> PipelineError {
    PipelineError::Config {
        path: path.display().to_string(),
        message,
    }
}

/// The initial noise for a `width` × `height` image from `path`'s tensor `latents`,
/// packed `(1, L, 64)` f32 on the CPU. It may be stored packed (`(1, L, 64)`) or as the
/// autoencoder's latents (`(1, 16, height/8, width/8)`, packed here), with or without
/// the batch dimension, in f32, bf16 or f16. Any other shape is refused naming both.
pub fn read_latents(path: &Path, width: u32, height: u32) -> Result<Tensor> {
    let all = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| {
        bad(
            path,
            format!("--latents: not a readable safetensors file: {e}"),
        )
    })?;
    let Some(t) = all.get("latents") else {
        let names: Vec<&str> = all.keys().map(|s| s.as_str()).collect();
        return Err(bad(
            path,
            format!(
                "--latents: no tensor `latents` (the file has {}): save the initial noise under that name",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            ),
        ));
    };
    let (h, w) = (height as usize / 8, width as usize / 8);
    let tokens = (h / 2) * (w / 2);
    let c = crate::sampling::LATENT_CHANNELS;
    // Without the batch dimension: `(L, 64)` or `(16, h, w)`.
    let t = match t.rank() {
        2 => t.unsqueeze(0)?,
        3 if t.dim(0)? == c => t.unsqueeze(0)?,
        _ => t.clone(),
    };
    let x = match t.dims() {
        [1, l, p] if *l == tokens && *p == c * 4 => t,
        [1, ch, hh, ww] if *ch == c && *hh == h && *ww == w => crate::sampling::pack(&t)?,
        d => {
            return Err(bad(
                path,
                format!(
                    "--latents: tensor `latents` has shape {d:?}; a {width}x{height} image needs [1, {c}, {h}, {w}] (the autoencoder's latents) or [1, {tokens}, {}] (packed)",
                    c * 4
                ),
            ))
        }
    };
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(bad(
            path,
            format!(
                "--latents: tensor `latents` is {:?}: give f32, bf16 or f16",
                x.dtype()
            ),
        ));
    }
    Ok(x.to_dtype(DType::F32)?.contiguous()?)
}

/// The transformer's inputs before the first step: the conditioning (`t5`, `clip`), the
/// positions, the guidance, the schedule and the initial `latents`.
pub fn record_inputs(r: &mut IoRecord, x: &mold_exec::FluxInputs, sched: &[f64]) -> Result<()> {
    r.add("t5", &x.txt)?;
    r.add("clip", &x.y)?;
    r.add("img_ids", &x.img_ids)?;
    r.add("txt_ids", &x.txt_ids)?;
    if let Some(g) = &x.guidance {
        r.add("guidance", g)?;
    }
    let ts: Vec<f32> = sched.iter().map(|&t| t as f32).collect();
    r.add("timesteps", &Tensor::new(ts.as_slice(), &Device::Cpu)?)?;
    r.add("latents", &x.img)
}

/// The `__metadata__` key of the file's stamp ([`mold_files::Stamp::Embedded`]).
pub const STAMP_KEY: &str = "mold";

/// The file's `__metadata__`: the PNG's settings ([`crate::flux::metadata`]).
pub fn metadata(
    model_id: &str,
    req: &crate::Request,
    guidance: Option<f64>,
) -> BTreeMap<String, String> {
    crate::flux::metadata(model_id, req, guidance)
        .into_iter()
        .collect()
}

/// What `--save-io` collects during a run, written at the end ([`IoRecord::write`]).
#[derive(Default)]
pub struct IoRecord {
    tensors: BTreeMap<String, Tensor>,
    pub metadata: BTreeMap<String, String>,
}

impl IoRecord {
    /// Keeps `t` (moved to the CPU as f32) under `name`.
    pub fn add(&mut self, name: impl Into<String>, t: &Tensor) -> Result<()> {
        let t = t
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        self.tensors.insert(name.into(), t);
        Ok(())
    }

    /// The tensor kept under `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// Derives `step.{i}.velocity` from the steps' latents and times (and `final`).
    pub fn add_velocities(&mut self, sched: &[f64]) -> Result<()> {
        for i in 0..sched.len().saturating_sub(1) {
            let next = if i + 2 == sched.len() {
                "final".to_string()
            } else {
                format!("step.{}.latents", i + 1)
            };
            let (Some(a), Some(b)) = (self.get(&format!("step.{i}.latents")), self.get(&next))
            else {
                continue;
            };
            let v = ((b - a)? / (sched[i + 1] - sched[i]))?;
            self.tensors.insert(format!("step.{i}.velocity"), v);
        }
        Ok(())
    }

    /// Writes the tensors (f32, little-endian) and the metadata as one safetensors file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut header = serde_json::Map::new();
        // The stamp ([`mold_files::Stamp::Embedded`]): a file mold wrote and nobody
        // changed since is one `--save-io` may replace.
        let mut metadata = self.metadata.clone();
        metadata.insert(STAMP_KEY.into(), mold_files::PLACEHOLDER.into());
        header.insert("__metadata__".into(), serde_json::json!(metadata));
        let mut offset = 0usize;
        let mut data: Vec<Vec<f32>> = Vec::new();
        for (name, t) in &self.tensors {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            let n = v.len() * 4;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "F32", "shape": t.dims(), "data_offsets": [offset, offset + n]}),
            );
            offset += n;
            data.push(v);
        }
        let mut h = serde_json::to_vec(&header).expect("json");
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = Vec::with_capacity(8 + h.len() + offset);
        out.extend_from_slice(&(h.len() as u64).to_le_bytes());
        out.extend_from_slice(&h);
        for v in &data {
            for x in v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        let out = mold_files::stamp(mold_files::Stamp::Embedded, &out).ok_or_else(|| {
            PipelineError::Refused(format!(
                "{}: the stamp's placeholder is not in the header (a bug in mold)",
                path.display()
            ))
        })?;
        // Through a temporary file renamed over `path`: never through a symlink there,
        // never half a file. Whether `path` may be replaced is the caller's to check
        // first ([`mold_files::Dest::check`]).
        mold_files::write_bytes(path, &out).map_err(PipelineError::io(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(path: &Path, name: &str, t: &Tensor) {
        let mut m = std::collections::HashMap::new();
        m.insert(name.to_string(), t.clone());
        candle_core::safetensors::save(&m, path).unwrap();
    }

    #[test]
    fn latents_are_read_packed_or_unpacked_and_refused_otherwise() {
        let d = std::env::temp_dir().join(format!("mold-io-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let x = crate::sampling::noise(3, 1, 64, 48).unwrap();
        let packed = crate::sampling::pack(&x).unwrap();
        let p = d.join("unpacked.safetensors");
        save(&p, "latents", &x.to_dtype(DType::BF16).unwrap());
        let a = read_latents(&p, 64, 48).unwrap();
        let want = crate::sampling::pack(
            &x.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(a.to_vec3::<f32>().unwrap(), want.to_vec3::<f32>().unwrap());
        let p = d.join("packed.safetensors");
        save(&p, "latents", &packed.squeeze(0).unwrap());
        let b = read_latents(&p, 64, 48).unwrap();
        assert_eq!(
            b.to_vec3::<f32>().unwrap(),
            packed.to_vec3::<f32>().unwrap()
        );
        let e = read_latents(&p, 64, 64).unwrap_err().to_string();
        assert!(
            e.contains("[1, 12, 64]")
                && e.contains("[1, 16, 8, 8] (the autoencoder's latents) or [1, 16, 64] (packed)"),
            "{e}"
        );
        let p = d.join("other.safetensors");
        save(&p, "noise", &packed);
        let e = read_latents(&p, 64, 48).unwrap_err().to_string();
        assert!(
            e.contains("no tensor `latents` (the file has noise)"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_record_derives_velocities_and_reads_back() {
        let d = std::env::temp_dir().join(format!("mold-io-rec-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let mut r = IoRecord::default();
        let x0 = Tensor::new(&[[1f32, 2.]], &Device::Cpu).unwrap();
        let x1 = Tensor::new(&[[0.5f32, 1.]], &Device::Cpu).unwrap();
        r.add("step.0.latents", &x0).unwrap();
        r.add("final", &x1).unwrap();
        r.add_velocities(&[1.0, 0.5]).unwrap();
        assert_eq!(
            r.get("step.0.velocity").unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![1f32, 2.]]
        );
        r.metadata.insert("prompt".into(), "a fox".into());
        let p = d.join("io.safetensors");
        r.write(&p).unwrap();
        let back = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        assert_eq!(back.len(), 3);
        let h = mold_models::checkpoint::read_header(&p).unwrap();
        assert_eq!(h.tensors["final"].shape, vec![1, 2]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
