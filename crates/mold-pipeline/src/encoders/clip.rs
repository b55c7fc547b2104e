//! CLIP's text transformer (CLIP-L as FLUX and SD3 use it) on mold's layers: the one-pass
//! layer norm, q/k/v as one product with the bias in cuBLASLt's epilogue and the
//! `1/√head_dim` scale folded into q's weights at load, the causal mask built once per
//! length, quick-GELU after the first MLP product. Returns the final-layer-normed hidden
//! states; pooling is the caller's (`crate::flux::text`).
//!
//! Weight names are Hugging Face's `CLIPTextModel` ones under `text_model.`; the
//! reference is candle-transformers' `clip::text_model`, which `MOLD_KERNELS=candle` runs
//! instead.

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::clip::text_model::ClipTextConfig;
use mold_exec::model::gemm;
use mold_exec::Kernels;

type CResult<T> = candle_core::Result<T>;

/// CLIP's layer-norm epsilon.
const EPS: f32 = 1e-5;

struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn load(vb: &VarBuilder, d: usize) -> CResult<Norm> {
        Ok(Norm {
            w: vb.get(d, "weight")?,
            b: vb.get(d, "bias")?,
        })
    }

    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        candle_nn::ops::layer_norm(x, &self.w, &self.b, EPS)
    }
}

/// A product with its bias (held apart, for cuBLASLt's epilogue).
struct Lin {
    w: candle_nn::Linear,
    b: Tensor,
}

impl Lin {
    fn new(w: Tensor, b: Tensor) -> Lin {
        Lin {
            w: candle_nn::Linear::new(w, None),
            b,
        }
    }

    fn forward(&self, x: &Tensor, k: Kernels) -> CResult<Tensor> {
        gemm::linear(x, &self.w, &self.b, false, k)
    }
}

fn lin(vb: &VarBuilder, out: usize, inp: usize) -> CResult<(Tensor, Tensor)> {
    Ok((vb.get((out, inp), "weight")?, vb.get(out, "bias")?))
}

struct Layer {
    ln1: Norm,
    /// q (pre-scaled), k, v stacked: `(3 · d, d)`.
    qkv: Lin,
    out: Lin,
    ln2: Norm,
    fc1: Lin,
    fc2: Lin,
}

/// The text transformer with its embeddings.
pub struct ClipText {
    token: Tensor,
    position: Tensor,
    layers: Vec<Layer>,
    final_ln: Norm,
    heads: usize,
    kernels: Kernels,
    device: Device,
    /// `(len, len)`: 0 on and below the diagonal, −∞ above, for the last length asked.
    mask: Option<(usize, Tensor)>,
}

impl ClipText {
    /// Loads from `vb` rooted at `text_model`, in `vb`'s dtype on its device.
    pub fn new(vb: VarBuilder, cfg: &ClipTextConfig, kernels: Kernels) -> CResult<ClipText> {
        let d = cfg.embed_dim;
        let heads = cfg.num_attention_heads;
        if heads == 0 || !d.is_multiple_of(heads) {
            candle_core::bail!("CLIP: hidden size {d} does not divide into {heads} heads");
        }
        let scale = ((d / heads) as f64).powf(-0.5);
        let emb = vb.pp("embeddings");
        let enc = vb.pp("encoder.layers");
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = enc.pp(i.to_string());
            let sa = l.pp("self_attn");
            let (q, k, v) = (
                lin(&sa.pp("q_proj"), d, d)?,
                lin(&sa.pp("k_proj"), d, d)?,
                lin(&sa.pp("v_proj"), d, d)?,
            );
            let qkv = Lin::new(
                Tensor::cat(&[(q.0 * scale)?, k.0, v.0], 0)?,
                Tensor::cat(&[(q.1 * scale)?, k.1, v.1], 0)?,
            );
            let one = |(w, b): (Tensor, Tensor)| Lin::new(w, b);
            layers.push(Layer {
                ln1: Norm::load(&l.pp("layer_norm1"), d)?,
                qkv,
                out: one(lin(&sa.pp("out_proj"), d, d)?),
                ln2: Norm::load(&l.pp("layer_norm2"), d)?,
                fc1: one(lin(&l.pp("mlp.fc1"), cfg.intermediate_size, d)?),
                fc2: one(lin(&l.pp("mlp.fc2"), d, cfg.intermediate_size)?),
            });
        }
        Ok(ClipText {
            token: emb.get((cfg.vocab_size, d), "token_embedding.weight")?,
            position: emb.get(
                (cfg.max_position_embeddings, d),
                "position_embedding.weight",
            )?,
            layers,
            final_ln: Norm::load(&vb.pp("final_layer_norm"), d)?,
            heads,
            kernels,
            device: vb.device().clone(),
            mask: None,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The final-layer-normed hidden states `(1, len, hidden)` for `ids` `(1, len)`.
    pub fn forward(&mut self, ids: &Tensor) -> CResult<Tensor> {
        let (b, len) = ids.dims2()?;
        if b != 1 {
            candle_core::bail!("CLIP: one prompt at a time, not {b}");
        }
        if len > self.position.dim(0)? {
            candle_core::bail!(
                "CLIP: {len} tokens, more than its {} positions",
                self.position.dim(0)?
            );
        }
        let k = self.kernels;
        let mask = self.causal_mask(len)?;
        let d = self.token.dim(1)?;
        let (heads, hd) = (self.heads, d / self.heads);
        let mut x = self
            .token
            .index_select(&ids.flatten_all()?, 0)?
            .add(&self.position.narrow(0, 0, len)?)?;
        for l in &self.layers {
            let h = l.ln1.forward(&x)?;
            let qkv = l
                .qkv
                .forward(&h, k)?
                .reshape((len, 3, heads, hd))?
                .permute((1, 2, 0, 3))?
                .contiguous()?;
            let (q, kk, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            let scores = q.matmul(&kk.t()?)?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let attn = probs
                .matmul(&v)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((len, d))?;
            x = (x + l.out.forward(&attn, k)?)?;
            let h = l.ln2.forward(&x)?;
            let u = l.fc1.forward(&h, k)?;
            // quick GELU: u · σ(1.702 u).
            let a = u.mul(&candle_nn::ops::sigmoid(&(&u * 1.702)?)?)?;
            x = (x + l.fc2.forward(&a, k)?)?;
        }
        self.final_ln.forward(&x)?.unsqueeze(0)
    }

    fn causal_mask(&mut self, len: usize) -> CResult<Tensor> {
        if let Some((l, m)) = &self.mask {
            if *l == len {
                return Ok(m.clone());
            }
        }
        let v: Vec<f32> = (0..len)
            .flat_map(|i| (0..len).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let m = Tensor::from_vec(v, (len, len), &self.device)?.to_dtype(self.token.dtype())?;
        self.mask = Some((len, m.clone()));
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use candle_nn::VarMap;
    use candle_transformers::models::clip::text_model::{Activation, ClipTextTransformer};

    fn tiny() -> ClipTextConfig {
        ClipTextConfig {
            vocab_size: 50,
            embed_dim: 32,
            activation: Activation::QuickGelu,
            intermediate_size: 56,
            max_position_embeddings: 16,
            pad_with: None,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            projection_dim: 32,
        }
    }

    #[test]
    fn matches_candle_transformers_clip() {
        let cfg = tiny();
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let reference = ClipTextTransformer::new(vb.pp("text_model"), &cfg).unwrap();
        // Norm weights and biases start at 1 and 0: make them differ per channel.
        for (name, var) in map.data().lock().unwrap().iter() {
            if name.contains("layer_norm") {
                let n = var.dims()[0];
                let w = Tensor::rand(-0.5f32, 1.5, n, &Device::Cpu).unwrap();
                var.set(&w).unwrap();
            }
        }
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let mut ours = ClipText::new(vb.pp("text_model"), &cfg, Kernels::Auto).unwrap();
        for len in [1usize, 5, 16] {
            let ids: Vec<u32> = (0..len as u32).map(|i| (i * 11 + 2) % 50).collect();
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let want = reference.forward_with_mask(&ids, usize::MAX).unwrap();
            let got = ours.forward(&ids).unwrap();
            assert_eq!(got.dims(), want.dims());
            let d = (&got - &want).unwrap().sqr().unwrap().sum_all().unwrap();
            let n = want.sqr().unwrap().sum_all().unwrap();
            let e = (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt();
            assert!(e < 1e-5, "len {len}: relative error {e}");
        }
    }

    #[test]
    fn too_many_tokens_is_an_error_not_a_panic() {
        let cfg = tiny();
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let _ = ClipTextTransformer::new(vb.pp("text_model"), &cfg).unwrap();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let mut ours = ClipText::new(vb.pp("text_model"), &cfg, Kernels::Auto).unwrap();
        let ids = Tensor::zeros((1, 17), DType::U32, &Device::Cpu).unwrap();
        let e = ours.forward(&ids).unwrap_err().to_string();
        assert!(e.contains("17 tokens"), "{e}");
    }
}
