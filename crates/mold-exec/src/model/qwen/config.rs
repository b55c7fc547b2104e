//! Qwen-Image hyper-parameters and the checkpoint layout they imply (diffusers'
//! `QwenImageTransformer2DModel` names, as published in the repository's `transformer/`).

use crate::model::transformer::TensorSpec;
use serde::{Deserialize, Serialize};

/// Hyper-parameters of a Qwen-Image transformer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QwenConfig {
    /// Channels of a packed latent token (16 latent channels × 2×2 patch = 64).
    pub in_channels: usize,
    /// Latent channels per patch position out of the model: `proj_out` writes
    /// `patch² · out_channels` per token.
    pub out_channels: usize,
    pub patch: usize,
    /// Inner dimension (`heads · head_dim`).
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Feed-forward width (4 × `hidden` in the published model).
    pub mlp_hidden: usize,
    /// Dual-stream blocks.
    pub depth: usize,
    /// Width of the text encoder's hidden states.
    pub joint_attention_dim: usize,
    /// RoPE dimensions per axis (frame, height, width); they sum to `head_dim`.
    pub axes_dim: [usize; 3],
    pub theta: f64,
}

/// Width of the sinusoidal timestep embedding fed to `time_text_embed.timestep_embedder`.
pub const TIME_EMBED_DIM: usize = 256;

impl QwenConfig {
    /// The config of a Qwen-Image architecture as the catalogue defines it
    /// ([`mold_models::arch`]: one definition for the planner's sizes and this).
    pub fn from_arch(a: &mold_models::arch::QwenArch) -> Self {
        QwenConfig {
            in_channels: a.in_channels as usize,
            out_channels: a.out_channels as usize,
            patch: a.patch as usize,
            hidden: a.hidden as usize,
            heads: a.heads as usize,
            head_dim: a.head_dim as usize,
            mlp_hidden: a.mlp_hidden as usize,
            depth: a.depth as usize,
            joint_attention_dim: a.joint_attention_dim as usize,
            axes_dim: a.axes_dim.map(|d| d as usize),
            theta: a.theta,
        }
    }

    /// Qwen-Image (20B).
    pub fn qwen_image() -> Self {
        Self::from_arch(&mold_models::arch::QWEN_IMAGE)
    }

    /// A tiny model with Qwen-Image's structure, for tests and emulated runs.
    pub fn qwen_image_tiny() -> Self {
        Self::from_arch(&mold_models::arch::QWEN_IMAGE_TINY)
    }

    /// A config by catalogue id: `qwen-image` or `qwen-image-tiny`.
    pub fn by_name(name: &str) -> Option<Self> {
        mold_models::arch::qwen(name).map(|a| Self::from_arch(&a))
    }

    /// Channels of an output token (`patch² · out_channels`).
    pub fn out_features(&self) -> usize {
        self.patch * self.patch * self.out_channels
    }

    /// Checks the config is self-consistent; returns a message saying what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.heads == 0 || self.heads * self.head_dim != self.hidden {
            return Err(format!(
                "heads ({}) × head_dim ({}) must equal hidden ({})",
                self.heads, self.head_dim, self.hidden
            ));
        }
        if self.axes_dim.iter().sum::<usize>() != self.head_dim {
            return Err(format!(
                "axes_dim {:?} must sum to head_dim ({})",
                self.axes_dim, self.head_dim
            ));
        }
        if self.axes_dim.iter().any(|d| d % 2 == 1) {
            return Err(format!("axes_dim {:?} must all be even", self.axes_dim));
        }
        if self.mlp_hidden == 0 || self.out_features() == 0 || self.in_channels == 0 {
            return Err(format!(
                "mlp_hidden ({}), in_channels ({}) and patch² × out_channels ({}) must be positive",
                self.mlp_hidden,
                self.in_channels,
                self.out_features()
            ));
        }
        Ok(())
    }

    /// Every tensor of the checkpoint with its shape, in a fixed order (stem, blocks,
    /// final layer). Linear weights are `[out, in]`.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let h = self.hidden;
        let m = self.mlp_hidden;
        let d = self.head_dim;
        let mut out = Vec::new();
        let vector = |out: &mut Vec<TensorSpec>, name: String, n: usize| {
            out.push(TensorSpec {
                name,
                shape: vec![n],
            });
        };
        let linear = |out: &mut Vec<TensorSpec>, name: String, o: usize, i: usize| {
            out.push(TensorSpec {
                name: format!("{name}.weight"),
                shape: vec![o, i],
            });
            vector(out, format!("{name}.bias"), o);
        };
        linear(&mut out, "img_in".into(), h, self.in_channels);
        vector(&mut out, "txt_norm.weight".into(), self.joint_attention_dim);
        linear(&mut out, "txt_in".into(), h, self.joint_attention_dim);
        let t = "time_text_embed.timestep_embedder";
        linear(&mut out, format!("{t}.linear_1"), h, TIME_EMBED_DIM);
        linear(&mut out, format!("{t}.linear_2"), h, h);
        for i in 0..self.depth {
            let p = format!("transformer_blocks.{i}");
            linear(&mut out, format!("{p}.img_mod.1"), 6 * h, h);
            linear(&mut out, format!("{p}.txt_mod.1"), 6 * h, h);
            for n in [
                "to_q",
                "to_k",
                "to_v",
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
            ] {
                linear(&mut out, format!("{p}.attn.{n}"), h, h);
            }
            for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
                vector(&mut out, format!("{p}.attn.{n}.weight"), d);
            }
            linear(&mut out, format!("{p}.attn.to_out.0"), h, h);
            linear(&mut out, format!("{p}.attn.to_add_out"), h, h);
            for s in ["img_mlp", "txt_mlp"] {
                linear(&mut out, format!("{p}.{s}.net.0.proj"), m, h);
                linear(&mut out, format!("{p}.{s}.net.2"), h, m);
            }
        }
        linear(&mut out, "norm_out.linear".into(), 2 * h, h);
        linear(&mut out, "proj_out".into(), self.out_features(), h);
        out
    }

    /// Number of parameters.
    pub fn param_count(&self) -> u64 {
        self.tensor_specs()
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The executor's configs and the catalogue's sizes come from one definition: the
    /// parameters the executor loads equal the catalogue's transformer parameters.
    #[test]
    fn configs_match_the_catalogue() {
        for id in ["qwen-image", "qwen-image-tiny"] {
            let cfg = QwenConfig::by_name(id).unwrap();
            cfg.validate().unwrap();
            let spec = mold_models::find(id).unwrap();
            assert_eq!(cfg.param_count(), spec.transformer.params(), "{id}");
            let k = &spec.transformer.kinds;
            assert_eq!(k.len(), 1, "{id}");
            assert_eq!(k[0].count as usize, cfg.depth, "{id}");
            assert_eq!(k[0].heads as usize, cfg.heads, "{id}");
            assert_eq!(k[0].mlp_hidden as usize, cfg.mlp_hidden, "{id}");
        }
        assert!(QwenConfig::by_name("flux-dev").is_none());
    }

    /// 20.4 B parameters (the published 40.9 GB of bf16), 60 blocks of 24 × 128 heads.
    #[test]
    fn qwen_image_has_about_20b_params() {
        let c = QwenConfig::qwen_image();
        let n = c.param_count();
        assert!((20_300_000_000..20_500_000_000).contains(&n), "{n}");
        assert_eq!((c.depth, c.heads, c.head_dim), (60, 24, 128));
        assert_eq!((c.joint_attention_dim, c.out_features()), (3584, 64));
    }
}
