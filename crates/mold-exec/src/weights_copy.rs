//! Another instance of a loaded component (a text encoder, a VAE) by copying the weights
//! its first instance read, device to device, instead of reading the checkpoint again.
//!
//! The first instance loads through [`WeightsFrom::Files`] with a [`Kept`]: every tensor
//! its builder takes (as loaded: on its device, in the asked dtype) is kept there under its
//! name. Each other instance loads through [`WeightsFrom::CopyOf`]: its builder asks for the
//! same names in the same order, and gets each kept tensor moved to its own device
//! ([`crate::runtime::hand_off`]: a peer copy where the GPUs allow, through host memory
//! elsewhere). The builder then does on the new device exactly what it did on the first
//! (fusing products, folding scales), so the copy equals an instance read from the files,
//! bit for bit. A name nothing kept (none, for one model's builder) is read from the files.
//!
//! A [`Kept`] holds the first instance's tensors, including those its builder merged into
//! others and would have freed: drop it once the copies are loaded (each load waits for its
//! device before it returns).

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Tensors a load took, by name, for copies of it; and where they are (a label).
#[derive(Clone, Default)]
pub struct Kept(
    Arc<Mutex<HashMap<String, Tensor>>>,
    Arc<str>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl Kept {
    /// Nothing kept yet, of a load on `on` (a label for reports, such as `cuda:0`).
    pub fn on(on: &str) -> Kept {
        Kept(Arc::default(), on.into(), Arc::default())
    }

    /// How many tensors the copies asked for that nothing kept, so read from the files
    /// (none, where the copies' builders are the first load's).
    pub fn misses(&self) -> usize {
        self.2.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn missed(&self) {
        self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Where the kept tensors are.
    pub fn source(&self) -> &str {
        &self.1
    }

    /// How many tensors are kept.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tensor>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The kept tensors' names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.lock().keys().cloned().collect();
        n.sort();
        n
    }

    /// The tensor kept under `name`.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        self.lock().get(name).cloned()
    }

    /// Keeps `t` under `name` (replacing what was kept there).
    pub fn keep(&self, name: &str, t: &Tensor) {
        self.lock().insert(name.to_string(), t.clone());
    }
}

/// Where a component's weights come from.
#[derive(Clone)]
pub enum WeightsFrom {
    /// Its files: through page-locked buffers where `staged` (and the files are large
    /// enough, [`crate::staging::var_builder`]); every tensor taken also kept in `keep`.
    Files { staged: bool, keep: Option<Kept> },
    /// Copies of the tensors another load of the same component kept; `peer_copies` as
    /// [`crate::ExecOptions::peer_copies`].
    CopyOf { kept: Kept, peer_copies: bool },
}

impl WeightsFrom {
    /// The files, nothing kept.
    pub fn files(staged: bool) -> WeightsFrom {
        WeightsFrom::Files { staged, keep: None }
    }
}

/// A `VarBuilder` over the safetensors `files` for `dev` in `dtype`, as `from` says.
pub fn var_builder(
    files: &[PathBuf],
    dtype: DType,
    dev: &Device,
    from: &WeightsFrom,
) -> candle_core::Result<VarBuilder<'static>> {
    match from {
        WeightsFrom::Files { staged, keep: None } => {
            crate::staging::var_builder(files, dtype, dev, *staged)
        }
        WeightsFrom::Files {
            staged,
            keep: Some(kept),
        } => {
            let inner = crate::staging::var_builder(files, dtype, dev, *staged)?;
            let backend: Box<dyn SimpleBackend> = Box::new(Keeping {
                inner,
                kept: kept.clone(),
            });
            Ok(VarBuilder::from_backend(backend, dtype, dev.clone()))
        }
        WeightsFrom::CopyOf { kept, peer_copies } => {
            let files = crate::staging::var_builder(files, dtype, dev, false)?;
            let backend: Box<dyn SimpleBackend> = Box::new(Copying {
                files,
                kept: kept.clone(),
                peer_copies: *peer_copies,
            });
            Ok(VarBuilder::from_backend(backend, dtype, dev.clone()))
        }
    }
}

/// Reads through `inner` and keeps what it read.
struct Keeping {
    inner: VarBuilder<'static>,
    kept: Kept,
}

impl SimpleBackend for Keeping {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self
            .inner
            .get_with_hints_dtype(s, name, Init::Const(0.), dtype)?
            .to_device(dev)?;
        self.kept.keep(name, &t);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self
            .inner
            .get_unchecked_dtype(name, dtype)?
            .to_device(dev)?;
        self.kept.keep(name, &t);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// Moves kept tensors to the builder's device; reads what was not kept from the files.
struct Copying {
    files: VarBuilder<'static>,
    kept: Kept,
    peer_copies: bool,
}

impl Copying {
    fn copy(&self, t: &Tensor, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        crate::runtime::hand_off(t, dev, self.peer_copies)?.to_dtype(dtype)
    }
}

impl SimpleBackend for Copying {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.kept.get(name) {
            Some(t) if t.shape() == &s => self.copy(&t, dtype, dev),
            Some(t) => Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name} (kept from the first load)"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt()),
            None => {
                self.kept.missed();
                self.files
                    .get_with_hints_dtype(s, name, Init::Const(0.), dtype)?
                    .to_device(dev)
            }
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match self.kept.get(name) {
            Some(t) => self.copy(&t, dtype, dev),
            None => {
                self.kept.missed();
                self.files.get_unchecked_dtype(name, dtype)?.to_device(dev)
            }
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.kept.get(name).is_some() || self.files.contains_tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::safetensors::save;

    fn file(dir: &std::path::Path) -> PathBuf {
        let mut m = HashMap::new();
        let dev = Device::Cpu;
        m.insert(
            "a.weight".to_string(),
            Tensor::arange(0f32, 12., &dev)
                .unwrap()
                .reshape((3, 4))
                .unwrap(),
        );
        m.insert(
            "b.bias".to_string(),
            Tensor::new(&[1f32, -2.5, 3.25], &dev).unwrap(),
        );
        let p = dir.join("w.safetensors");
        save(&m, &p).unwrap();
        p
    }

    #[test]
    fn a_copy_takes_what_the_first_load_kept_and_reads_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let files = [file(dir.path())];
        let dev = Device::Cpu;
        let kept = Kept::on("emu:0");
        assert_eq!(kept.source(), "emu:0");
        let first = var_builder(
            &files,
            DType::F32,
            &dev,
            &WeightsFrom::Files {
                staged: false,
                keep: Some(kept.clone()),
            },
        )
        .unwrap();
        let a = first.get((3, 4), "a.weight").unwrap();
        assert_eq!(kept.len(), 1);
        // What the copy gets is the kept tensor, not the file's: change the kept one.
        kept.keep("a.weight", &(a * 2.).unwrap());
        let copy = var_builder(
            &files,
            DType::F32,
            &dev,
            &WeightsFrom::CopyOf {
                kept: kept.clone(),
                peer_copies: true,
            },
        )
        .unwrap();
        let got = copy.get((3, 4), "a.weight").unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap()[2], vec![16., 18., 20., 22.]);
        assert_eq!(kept.misses(), 0);
        // Not kept: read from the files, and counted.
        let b = copy.get(3, "b.bias").unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![1., -2.5, 3.25]);
        assert_eq!(kept.misses(), 1);
        // Another dtype asked: the kept tensor cast.
        let copy16 = var_builder(
            &files,
            DType::BF16,
            &dev,
            &WeightsFrom::CopyOf {
                kept: kept.clone(),
                peer_copies: true,
            },
        )
        .unwrap();
        assert_eq!(copy16.get((3, 4), "a.weight").unwrap().dtype(), DType::BF16);
        // A shape other than the kept one is refused, naming the tensor.
        let e = copy.get((4, 3), "a.weight").unwrap_err().to_string();
        assert!(e.contains("a.weight"), "{e}");
        assert!(copy.contains_tensor("b.bias") && !copy.contains_tensor("c"));
    }
}
