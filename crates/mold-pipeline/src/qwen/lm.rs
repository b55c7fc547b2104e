//! Qwen2.5-VL's language model (Qwen-Image's text encoder) on mold's layers: candle's
//! one-pass RMS norm; q, k and v as one product with their biases in cuBLASLt's epilogue
//! (weights and biases concatenated at load); q and k rotated and k and v repeated to the
//! query heads in one pass over the product's rows (`ops::qkv_rope_gqa`); each residual
//! accumulated into the hidden state inside the output product (cuBLASLt, beta = 1); gate
//! and up as one product, SiLU and the gate's product in one pass over it. Attention runs
//! in one cuDNN fused-attention kernel with the causal mask as a bias shared by the heads
//! (kept per length, rows padded to 16 bytes); where cuDNN does not run it (CPU, f32,
//! `MOLD_KERNELS=mold|candle`, a refusal) the product–mask–softmax–product composition in
//! f32.
//!
//! A run's tokens are padded at the end to a multiple of [`PAD_TOKENS`]: exact under the
//! causal mask (no token attends to a later one, and every other step is per token), and
//! cuDNN then builds one attention plan per 64 tokens of length instead of one per prompt
//! length (each a runtime-compiled kernel the first time).
//!
//! The reference is [`super::text::CandleLm`] (candle's ops, attention in f32), which
//! `MOLD_KERNELS=candle` runs instead; both equal candle-transformers' Qwen2 in f32.

use super::text::{rope_tables, QwenTextConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mold_exec::model::ops::{self, Gate, GroupedHeads};
use mold_exec::model::{attention, gemm};
use mold_exec::Kernels;
use std::sync::Mutex;

type CResult<T> = candle_core::Result<T>;

/// Runs are padded to a multiple of this many tokens.
pub const PAD_TOKENS: usize = 64;

/// How many lengths' tables are kept.
const KEPT_LENGTHS: usize = 4;

struct Layer {
    ln_attn: Tensor,
    /// `(hidden + 2 · kv, hidden)`: q, k, v stacked (weight only; the bias apart).
    qkv: candle_nn::Linear,
    /// `(hidden + 2 · kv)`.
    qkv_bias: Tensor,
    o: Tensor,
    ln_mlp: Tensor,
    /// `(2 · intermediate, hidden)`: gate then up.
    gate_up: Tensor,
    down: Tensor,
}

/// What a length needs: the rotary tables `(L, head_dim / 2)` in f32 and,
/// where the fused attention may run, the causal mask `(1, L, row)` in the model's dtype
/// (0 on and below the diagonal, the dtype's lowest value above; `row` = L rounded up to 8).
#[derive(Clone)]
struct Tables {
    len: usize,
    cos: Tensor,
    sin: Tensor,
    mask: Option<Tensor>,
}

/// The language model on one device.
pub struct QwenLm {
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    cfg: QwenTextConfig,
    dtype: DType,
    device: Device,
    kernels: Kernels,
    /// The tables of the last [`KEPT_LENGTHS`] lengths run (a prompt and its negative
    /// prompt are usually of two lengths), the newest last.
    tables: Mutex<Vec<Tables>>,
}

impl QwenLm {
    /// Loads the model from `vb` (rooted where `embed_tokens`, `layers` and `norm` live) in
    /// `vb`'s dtype on its device.
    pub fn new(vb: VarBuilder, cfg: &QwenTextConfig, kernels: Kernels) -> CResult<QwenLm> {
        let (h, kv, m) = (
            cfg.hidden_size,
            cfg.num_key_value_heads * cfg.head_dim(),
            cfg.intermediate_size,
        );
        let embed = vb.get((cfg.vocab_size, h), "embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp("layers").pp(i);
            let a = l.pp("self_attn");
            let mlp = l.pp("mlp");
            let qkv = Tensor::cat(
                &[
                    a.get((h, h), "q_proj.weight")?,
                    a.get((kv, h), "k_proj.weight")?,
                    a.get((kv, h), "v_proj.weight")?,
                ],
                0,
            )?;
            let qkv_bias = Tensor::cat(
                &[
                    a.get(h, "q_proj.bias")?,
                    a.get(kv, "k_proj.bias")?,
                    a.get(kv, "v_proj.bias")?,
                ],
                0,
            )?;
            let gate_up = Tensor::cat(
                &[
                    mlp.get((m, h), "gate_proj.weight")?,
                    mlp.get((m, h), "up_proj.weight")?,
                ],
                0,
            )?;
            layers.push(Layer {
                ln_attn: l.get(h, "input_layernorm.weight")?,
                qkv: candle_nn::Linear::new(qkv, None),
                qkv_bias,
                o: a.get((h, h), "o_proj.weight")?,
                ln_mlp: l.get(h, "post_attention_layernorm.weight")?,
                gate_up,
                down: mlp.get((h, m), "down_proj.weight")?,
            });
        }
        Ok(QwenLm {
            embed,
            layers,
            norm: vb.get(h, "norm.weight")?,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            kernels,
            tables: Mutex::new(Vec::new()),
        })
    }

    /// The last hidden state (after the final norm) of `ids`: `(1, len, hidden)`.
    pub fn forward(&self, ids: &[u32]) -> CResult<Tensor> {
        let n = ids.len();
        if n == 0 {
            candle_core::bail!("qwen2.5-vl: no tokens to encode");
        }
        // Padded at the end with token 0 (any id would do: no real token sees them).
        let mut ids = ids.to_vec();
        ids.resize(n.div_ceil(PAD_TOKENS) * PAD_TOKENS, 0);
        let t = self.tables(ids.len())?;
        let eps = self.cfg.rms_norm_eps as f32;
        let k = self.kernels;
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        // The composition's f32 mask, built once a run where the fused attention does not run.
        let mut mask32 = None;
        for l in &self.layers {
            let h = candle_nn::ops::rms_norm(&x, &l.ln_attn, eps)?;
            let qkv = gemm::linear(&h, &l.qkv, &l.qkv_bias, false, k)?;
            drop(h);
            let a = self.attend(&qkv, &t, &mut mask32)?;
            drop(qkv);
            x = gemm::add_matmul(x, &a, &l.o, k)?;
            let h = candle_nn::ops::rms_norm(&x, &l.ln_mlp, eps)?;
            let gu = gemm::matmul(&h, &l.gate_up)?;
            drop(h);
            let a = ops::gated(&gu, Gate::Silu, k)?;
            drop(gu);
            x = gemm::add_matmul(x, &a, &l.down, k)?;
        }
        candle_nn::ops::rms_norm(&x.narrow(0, 0, n)?, &self.norm, eps)?.unsqueeze(0)
    }

    /// Causal self-attention of `qkv` `(L, hidden + 2 · kv)`: `(L, hidden)`; `mask32`, the
    /// composition's mask once built.
    fn attend(&self, qkv: &Tensor, t: &Tables, mask32: &mut Option<Tensor>) -> CResult<Tensor> {
        let n = t.len;
        let (heads, kvh, d) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim(),
        );
        // q and k rotated, k and v repeated to the query heads: (3, L, heads, d), one pass.
        let g = GroupedHeads { heads, kv: kvh, d };
        let qkv = ops::qkv_rope_gqa(qkv, g, &t.cos, &t.sin, self.kernels)?;
        // (1, heads, L, d) views of the (L, heads, d) rows.
        let part = |i: usize| -> CResult<Tensor> { qkv.get(i)?.unsqueeze(0)?.transpose(1, 2) };
        let (q, kk, v) = (part(0)?, part(1)?, part(2)?);
        let scale = 1.0 / (d as f64).sqrt();
        if let Some(mask) = &t.mask {
            if let Some(o) =
                attention::biased_attention(self.kernels, &q, &kk, &v, mask, scale as f32)?
            {
                return o.squeeze(0);
            }
        }
        // The composition, in f32, with the causal mask added to the scaled scores.
        let f = |t: Tensor| t.to_dtype(DType::F32)?.contiguous();
        let (q, kk, v) = (f(q)?, f(kk)?, f(v)?);
        let mask = match mask32 {
            Some(m) => m,
            None => {
                let m: Vec<f32> = (0..n)
                    .flat_map(|i| (0..n).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                    .collect();
                mask32.insert(Tensor::from_vec(m, (1, 1, n, n), &self.device)?)
            }
        };
        let att = (q.matmul(&kk.t()?)? * scale)?.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        att.matmul(&v)?
            .transpose(1, 2)?
            .reshape((n, heads * d))?
            .to_dtype(self.dtype)
    }

    /// The tables of length `n`, kept for later calls of the same length.
    fn tables(&self, n: usize) -> CResult<Tables> {
        let mut kept = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = kept.iter().find(|t| t.len == n) {
            return Ok(t.clone());
        }
        let (cos, sin) = rope_tables(n, self.cfg.head_dim(), self.cfg.rope_theta, &self.device)
            .map_err(candle_core::Error::wrap)?;
        let probe = Tensor::zeros((1, 1, 1, self.cfg.head_dim()), self.dtype, &self.device)?;
        let mask = if attention::fused_supported(&probe) && self.kernels.uses_libraries() {
            Some(causal_mask(n, self.dtype, &self.device)?)
        } else {
            None
        };
        let t = Tables {
            len: n,
            cos,
            sin,
            mask,
        };
        if kept.len() == KEPT_LENGTHS {
            kept.remove(0);
        }
        kept.push(t.clone());
        Ok(t)
    }
}

/// `(1, n, row)` in `dtype`: 0 where key `j` ≤ query `i`, the dtype's lowest value
/// elsewhere (padding columns included); `row` is `n` rounded up to 8 elements.
fn causal_mask(n: usize, dtype: DType, dev: &Device) -> CResult<Tensor> {
    let row = n.div_ceil(8) * 8;
    let low = match dtype {
        DType::F16 => -65504.0,
        // bf16's lowest finite value (f32's exponent, 8 bits of mantissa).
        DType::BF16 => -3.389_531_4e38,
        _ => f32::MIN,
    };
    let m: Vec<f32> = (0..n)
        .flat_map(|i| (0..row).map(move |j| if j > i { low } else { 0.0 }))
        .collect();
    Tensor::from_vec(m, (1, n, row), dev)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_hides_later_keys_and_the_padding() {
        let m = causal_mask(3, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(m.dims(), [1, 3, 8]);
        let rows = m.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        for (i, r) in rows.iter().enumerate() {
            for (j, v) in r.iter().enumerate() {
                assert_eq!(*v == 0.0, j <= i, "({i}, {j}) = {v}");
            }
        }
        let b = causal_mask(9, DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(b.dims(), [1, 9, 16]);
        let low = b
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .min(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(low.is_finite() && low < -1e38, "{low}");
    }
}
