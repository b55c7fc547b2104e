//! T5's encoder (v1.1 and v1.0: gated GELU/SiLU or plain ReLU/GELU feed-forward, relative
//! position bias) on mold's layers: the one-pass RMS norm, q/k/v as one product and the two
//! gated inputs as one product (weights concatenated at load) activated and multiplied in
//! one pass, each residual accumulated into the hidden state inside the output product
//! (cuBLASLt, beta = 1), the position bias built once per length and kept on the device.
//! Attention adds the bias to the unscaled scores before the softmax: on GPUs in one cuDNN
//! fused-attention kernel where cuDNN takes it, else (and on the CPU) as the
//! product–softmax–product composition.
//!
//! Weight names are Hugging Face's (`shared.weight`, `encoder.block.{i}.layer.0.
//! SelfAttention.{q,k,v,o}.weight`, …); the reference is candle-transformers' `t5`, which
//! `MOLD_KERNELS=candle` runs instead (`crate::flux::text`).

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Activation, VarBuilder};
use candle_transformers::models::t5::Config;
use mold_exec::model::ops::{self, Gate};
use mold_exec::model::{attention, gemm};
use mold_exec::Kernels;

type CResult<T> = candle_core::Result<T>;

/// The largest f16 value T5 lets a hidden state reach (Hugging Face clamps at
/// `finfo(float16).max - 1000` after each sub-layer; bf16 and f32 need no clamp).
const F16_CLAMP: f64 = 65504.0 - 1000.0;

struct Block {
    ln_attn: Tensor,
    /// `(3 · inner, d_model)`: q, k, v stacked.
    qkv: Tensor,
    o: Tensor,
    ln_ff: Tensor,
    /// Gated: `(2 · d_ff, d_model)`, the activated input then the linear one; else `(d_ff,
    /// d_model)`.
    wi: Tensor,
    wo: Tensor,
}

/// The encoder stack and its embedding.
pub struct T5Encoder {
    embed: Tensor,
    /// `(buckets, heads)`: block 0's relative attention bias, shared by every block.
    rel_bias: Tensor,
    blocks: Vec<Block>,
    final_ln: Tensor,
    cfg: Config,
    dtype: DType,
    device: Device,
    kernels: Kernels,
    /// `(heads, len, len)` for the last length asked.
    bias_cache: Option<(usize, Tensor)>,
}

impl T5Encoder {
    /// Loads the encoder from `vb` (rooted where `shared.weight` and `encoder.` live) in
    /// `vb`'s dtype on its device.
    pub fn new(vb: VarBuilder, cfg: &Config, kernels: Kernels) -> CResult<T5Encoder> {
        let (d, inner, ff) = (cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff);
        let embed = if vb.contains_tensor("shared.weight") {
            vb.get((cfg.vocab_size, d), "shared.weight")?
        } else {
            vb.get((cfg.vocab_size, d), "encoder.embed_tokens.weight")?
        };
        let enc = vb.pp("encoder");
        let rel_bias = enc.get(
            (cfg.relative_attention_num_buckets, cfg.num_heads),
            "block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        )?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let b = enc.pp(format!("block.{i}"));
            let sa = b.pp("layer.0.SelfAttention");
            let qkv = Tensor::cat(
                &[
                    sa.get((inner, d), "q.weight")?,
                    sa.get((inner, d), "k.weight")?,
                    sa.get((inner, d), "v.weight")?,
                ],
                0,
            )?;
            let ffb = b.pp("layer.1.DenseReluDense");
            let wi = if cfg.feed_forward_proj.gated {
                Tensor::cat(
                    &[
                        ffb.get((ff, d), "wi_0.weight")?,
                        ffb.get((ff, d), "wi_1.weight")?,
                    ],
                    0,
                )?
            } else {
                ffb.get((ff, d), "wi.weight")?
            };
            blocks.push(Block {
                ln_attn: b.get(d, "layer.0.layer_norm.weight")?,
                qkv,
                o: sa.get((d, inner), "o.weight")?,
                ln_ff: b.get(d, "layer.1.layer_norm.weight")?,
                wi,
                wo: ffb.get((d, ff), "wo.weight")?,
            });
        }
        Ok(T5Encoder {
            embed,
            rel_bias,
            blocks,
            final_ln: enc.get(d, "final_layer_norm.weight")?,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            kernels,
            bias_cache: None,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `(1, len, d_model)` for `ids` `(1, len)`.
    pub fn forward(&mut self, ids: &Tensor) -> CResult<Tensor> {
        let (b, len) = ids.dims2()?;
        if b != 1 {
            candle_core::bail!("T5: one prompt at a time, not {b}");
        }
        let bias = self.position_bias(len)?;
        let k = self.kernels;
        let eps = self.cfg.layer_norm_epsilon as f32;
        let (heads, dkv) = (self.cfg.num_heads, self.cfg.d_kv);
        let inner = heads * dkv;
        let mut x = self.embed.index_select(&ids.flatten_all()?, 0)?;
        for blk in &self.blocks {
            // Self-attention.
            let h = candle_nn::ops::rms_norm(&x, &blk.ln_attn, eps)?;
            let qkv = gemm::matmul(&h, &blk.qkv)?
                .reshape((len, 3, heads, dkv))?
                .permute((1, 2, 0, 3))?
                .contiguous()?;
            let (q, kk, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            // One fused kernel where cuDNN takes it (scale 1: T5 does not scale).
            let fused = attention::biased_attention(
                k,
                &q.unsqueeze(0)?,
                &kk.unsqueeze(0)?,
                &v.unsqueeze(0)?,
                &bias,
                1.0,
            )?;
            let attn = match fused {
                Some(a) => a.reshape((len, inner))?,
                None => {
                    let scores = q.matmul(&kk.t()?)?.add(&bias)?;
                    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                    drop(scores);
                    probs
                        .matmul(&v)?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((len, inner))?
                }
            };
            x = self.clamp(gemm::add_matmul(x, &attn, &blk.o, k)?)?;
            // Feed-forward.
            let h = candle_nn::ops::rms_norm(&x, &blk.ln_ff, eps)?;
            let u = gemm::matmul(&h, &blk.wi)?;
            let act = self.cfg.feed_forward_proj.activation;
            let gate = match act {
                Activation::NewGelu | Activation::GeluPytorchTanh => Some(Gate::GeluTanh),
                Activation::Silu => Some(Gate::Silu),
                _ => None,
            };
            let a = match (self.cfg.feed_forward_proj.gated, gate) {
                (true, Some(g)) => ops::gated(&u, g, k)?,
                (true, None) => {
                    let ff = self.cfg.d_ff;
                    activate(&u.narrow(D::Minus1, 0, ff)?, act)?.mul(&u.narrow(
                        D::Minus1,
                        ff,
                        ff,
                    )?)?
                }
                (false, _) => activate(&u, act)?,
            };
            drop(u);
            x = self.clamp(gemm::add_matmul(x, &a, &blk.wo, k)?)?;
        }
        candle_nn::ops::rms_norm(&x, &self.final_ln, eps)?.unsqueeze(0)
    }

    fn clamp(&self, x: Tensor) -> CResult<Tensor> {
        if self.dtype == DType::F16 {
            x.clamp(-F16_CLAMP, F16_CLAMP)
        } else {
            Ok(x)
        }
    }

    /// `(heads, len, len)`: the bias of each query–key pair's relative-position bucket.
    fn position_bias(&mut self, len: usize) -> CResult<Tensor> {
        if let Some((l, t)) = &self.bias_cache {
            if *l == len {
                return Ok(t.clone());
            }
        }
        let buckets = relative_buckets(
            len,
            self.cfg.relative_attention_num_buckets,
            self.cfg.relative_attention_max_distance,
        );
        let idx = Tensor::from_vec(buckets, len * len, &self.device)?;
        let t = self
            .rel_bias
            .index_select(&idx, 0)?
            .reshape((len, len, self.cfg.num_heads))?
            .permute((2, 0, 1))?
            .contiguous()?;
        self.bias_cache = Some((len, t.clone()));
        Ok(t)
    }
}

fn activate(x: &Tensor, act: Activation) -> CResult<Tensor> {
    match act {
        Activation::NewGelu | Activation::GeluPytorchTanh => x.gelu(),
        Activation::Gelu => x.gelu_erf(),
        Activation::Relu => x.relu(),
        Activation::Silu => x.silu(),
        other => candle_core::bail!("T5: feed-forward activation {other:?} is not supported"),
    }
}

/// T5's bidirectional relative-position buckets, row `i` (query) by column `j` (key), as
/// Hugging Face's `_relative_position_bucket` (computed in f32).
pub fn relative_buckets(len: usize, num_buckets: usize, max_distance: usize) -> Vec<u32> {
    let half = (num_buckets / 2) as u32;
    let max_exact = half / 2;
    let large = |d: u32| -> u32 {
        let b = ((d as f32 / max_exact as f32).ln() / (max_distance as f32 / max_exact as f32).ln()
            * (half - max_exact) as f32) as u32;
        (max_exact + b).min(half - 1)
    };
    let mut out = Vec::with_capacity(len * len);
    for i in 0..len as u32 {
        for j in 0..len as u32 {
            let (side, d) = if j > i { (half, j - i) } else { (0, i - j) };
            out.push(side + if d < max_exact { d } else { large(d) });
        }
    }
    out
}

/// The activation names a T5 config may give that [`T5Encoder`] runs.
pub fn supported(cfg: &Config) -> Result<(), String> {
    match cfg.feed_forward_proj.activation {
        Activation::NewGelu
        | Activation::GeluPytorchTanh
        | Activation::Gelu
        | Activation::Relu
        | Activation::Silu => Ok(()),
        a => Err(format!(
            "feed_forward_proj: activation {a:?} is not supported (gated-gelu, gated-silu, relu, gelu)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::VarMap;
    use candle_transformers::models::t5;

    fn tiny(gated: bool, act: Activation) -> Config {
        Config {
            vocab_size: 64,
            d_model: 32,
            d_kv: 8,
            d_ff: 48,
            num_layers: 3,
            num_decoder_layers: None,
            num_heads: 4,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            dropout_rate: 0.0,
            layer_norm_epsilon: 1e-6,
            initializer_factor: 1.0,
            feed_forward_proj: t5::ActivationWithOptionalGating {
                gated,
                activation: act,
            },
            tie_word_embeddings: false,
            is_decoder: false,
            is_encoder_decoder: true,
            use_cache: false,
            pad_token_id: 0,
            eos_token_id: 1,
            decoder_start_token_id: None,
        }
    }

    /// Random weights: candle-transformers' model creates them through the `VarMap`, and
    /// mold's reads the same map.
    fn pair(cfg: &Config, dtype: DType) -> (t5::T5EncoderModel, T5Encoder) {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let reference = t5::T5EncoderModel::load(vb, cfg).unwrap();
        // Layer norm weights start at 1 in the reference: make them differ per channel.
        for (name, var) in map.data().lock().unwrap().iter() {
            if name.contains("layer_norm") {
                let n = var.dims()[0];
                let w = Tensor::rand(0.5f32, 1.5, n, &Device::Cpu).unwrap();
                var.set(&w).unwrap();
            }
        }
        let tensors: std::collections::HashMap<String, Tensor> = map
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().to_dtype(dtype).unwrap()))
            .collect();
        let vb = VarBuilder::from_tensors(tensors, dtype, &Device::Cpu);
        let ours = T5Encoder::new(vb, cfg, Kernels::Auto).unwrap();
        (reference, ours)
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
        let n = b.sqr().unwrap().sum_all().unwrap();
        (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
    }

    #[test]
    fn matches_candle_transformers_t5() {
        for (gated, act) in [
            (true, Activation::NewGelu),
            (true, Activation::Silu),
            (false, Activation::Relu),
        ] {
            let cfg = tiny(gated, act);
            let (mut reference, mut ours) = pair(&cfg, DType::F32);
            // Longer than the exact buckets (8) and than max_distance / 2 is not needed:
            // 40 tokens reach the logarithmic buckets on both sides.
            for len in [1usize, 7, 40] {
                let ids: Vec<u32> = (0..len as u32).map(|i| (i * 7 + 3) % 64).collect();
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let want = reference.forward(&ids).unwrap();
                let got = ours.forward(&ids).unwrap();
                assert_eq!(got.dims(), want.dims());
                let e = rel(&got, &want);
                assert!(
                    e < 1e-5,
                    "gated {gated} {act:?} len {len}: relative error {e}"
                );
            }
        }
    }

    #[test]
    fn buckets_match_the_reference_formula() {
        // Hugging Face's bidirectional buckets for 32 buckets, max distance 128, at a few
        // distances (computed with transformers' `_relative_position_bucket`).
        let b = relative_buckets(200, 32, 128);
        let at = |i: usize, j: usize| b[i * 200 + j];
        assert_eq!(at(0, 0), 0);
        assert_eq!(at(5, 0), 5); // key before the query: the lower half
        assert_eq!(at(0, 5), 21); // key after: 16 + 5
        assert_eq!(at(8, 0), 8); // first logarithmic bucket
        assert_eq!(at(0, 8), 24);
        assert_eq!(at(20, 0), 10);
        assert_eq!(at(199, 0), 15); // past max distance: the last bucket of the half
        assert_eq!(at(0, 199), 31);
    }

    #[test]
    fn f16_clamps_and_stays_finite() {
        let cfg = tiny(true, Activation::NewGelu);
        let (_, mut ours) = pair(&cfg, DType::F16);
        // Embeddings at ±f16's largest value and outputs scaled up: each residual sum
        // overflows f16 unless it is clamped (without the clamp the output is NaN).
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let up = f32_of(&ours.embed)
            .ge(0f64)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        ours.embed = ((up * 2.0).unwrap() - 1.0)
            .unwrap()
            .affine(65504.0, 0.0)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        for b in &mut ours.blocks {
            b.o = (f32_of(&b.o) * 1e3).unwrap().to_dtype(DType::F16).unwrap();
            b.wo = (f32_of(&b.wo) * 1e3).unwrap().to_dtype(DType::F16).unwrap();
        }
        let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap();
        let out = ours.forward(&ids).unwrap().to_dtype(DType::F32).unwrap();
        let finite = out
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite());
        assert!(finite);
    }
}
