//! FLUX hyper-parameters and the checkpoint layout they imply.

use crate::model::transformer::TensorSpec;
use serde::{Deserialize, Serialize};

/// Hyper-parameters of a FLUX-family transformer (BFL `FluxParams`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FluxConfig {
    /// Channels of a packed latent token (16 latent channels × 2×2 patch = 64).
    pub in_channels: usize,
    /// Hidden size (`heads * head_dim`).
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// MLP hidden size is `hidden * mlp_ratio`.
    pub mlp_ratio: f64,
    /// Number of double-stream blocks.
    pub depth: usize,
    /// Number of single-stream blocks.
    pub depth_single: usize,
    /// Width of the text-encoder (T5) tokens.
    pub context_in_dim: usize,
    /// Width of the pooled vector (CLIP).
    pub vec_in_dim: usize,
    /// RoPE dimensions per position axis; they sum to `head_dim`.
    pub axes_dim: [usize; 3],
    pub theta: f64,
    /// Whether the model has a distilled-guidance embedder (`guidance_in`).
    pub guidance_embed: bool,
}

/// Width of the sinusoidal timestep / guidance embedding fed to `time_in` / `guidance_in`.
pub const TIME_EMBED_DIM: usize = 256;

impl FluxConfig {
    /// The config of a FLUX architecture as the catalogue defines it
    /// ([`mold_models::arch`]: one definition for the planner's sizes and this).
    pub fn from_arch(a: &mold_models::arch::FluxArch) -> Self {
        FluxConfig {
            in_channels: a.in_channels as usize,
            hidden: a.hidden as usize,
            heads: a.heads as usize,
            head_dim: a.head_dim as usize,
            mlp_ratio: a.mlp_hidden as f64 / a.hidden as f64,
            depth: a.depth as usize,
            depth_single: a.depth_single as usize,
            context_in_dim: a.context_in_dim as usize,
            vec_in_dim: a.vec_in_dim as usize,
            axes_dim: a.axes_dim.map(|d| d as usize),
            theta: a.theta,
            guidance_embed: a.guidance_embed,
        }
    }

    /// FLUX.1 \[dev\] (12B, guidance distilled).
    pub fn flux_dev() -> Self {
        Self::from_arch(&mold_models::arch::FLUX_DEV)
    }

    /// FLUX.1 \[schnell\]: dev's shapes without the guidance embedder.
    pub fn flux_schnell() -> Self {
        Self::from_arch(&mold_models::arch::FLUX_SCHNELL)
    }

    /// A tiny model with FLUX's structure, for tests and emulated runs.
    pub fn flux_tiny() -> Self {
        Self::from_arch(&mold_models::arch::FLUX_TINY)
    }

    /// A config by catalogue id: `flux-dev`, `flux-schnell` or `flux-tiny`.
    pub fn by_name(name: &str) -> Option<Self> {
        mold_models::arch::flux(name).map(|a| Self::from_arch(&a))
    }

    /// The MLP hidden size.
    pub fn mlp_hidden(&self) -> usize {
        (self.hidden as f64 * self.mlp_ratio) as usize
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
        if self.mlp_hidden() == 0 {
            return Err(format!("mlp_ratio {} gives an empty MLP", self.mlp_ratio));
        }
        Ok(())
    }

    /// Every tensor of the checkpoint with its shape, in a fixed order (stem, double
    /// blocks, single blocks, final layer). Linear weights are `[out, in]`.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let h = self.hidden;
        let m = self.mlp_hidden();
        let d = self.head_dim;
        let mut out = Vec::new();
        let linear = |out: &mut Vec<TensorSpec>, name: String, o: usize, i: usize| {
            out.push(TensorSpec {
                name: format!("{name}.weight"),
                shape: vec![o, i],
            });
            out.push(TensorSpec {
                name: format!("{name}.bias"),
                shape: vec![o],
            });
        };
        linear(&mut out, "img_in".into(), h, self.in_channels);
        linear(&mut out, "txt_in".into(), h, self.context_in_dim);
        linear(&mut out, "time_in.in_layer".into(), h, TIME_EMBED_DIM);
        linear(&mut out, "time_in.out_layer".into(), h, h);
        linear(&mut out, "vector_in.in_layer".into(), h, self.vec_in_dim);
        linear(&mut out, "vector_in.out_layer".into(), h, h);
        if self.guidance_embed {
            linear(&mut out, "guidance_in.in_layer".into(), h, TIME_EMBED_DIM);
            linear(&mut out, "guidance_in.out_layer".into(), h, h);
        }
        for i in 0..self.depth {
            for s in ["img", "txt"] {
                let p = format!("double_blocks.{i}.{s}");
                linear(&mut out, format!("{p}_mod.lin"), 6 * h, h);
                linear(&mut out, format!("{p}_attn.qkv"), 3 * h, h);
                for n in ["query_norm", "key_norm"] {
                    out.push(TensorSpec {
                        name: format!("{p}_attn.norm.{n}.scale"),
                        shape: vec![d],
                    });
                }
                linear(&mut out, format!("{p}_attn.proj"), h, h);
                linear(&mut out, format!("{p}_mlp.0"), m, h);
                linear(&mut out, format!("{p}_mlp.2"), h, m);
            }
        }
        for i in 0..self.depth_single {
            let p = format!("single_blocks.{i}");
            linear(&mut out, format!("{p}.linear1"), 3 * h + m, h);
            linear(&mut out, format!("{p}.linear2"), h, h + m);
            for n in ["query_norm", "key_norm"] {
                out.push(TensorSpec {
                    name: format!("{p}.norm.{n}.scale"),
                    shape: vec![d],
                });
            }
            linear(&mut out, format!("{p}.modulation.lin"), 3 * h, h);
        }
        linear(&mut out, "final_layer.linear".into(), self.in_channels, h);
        linear(&mut out, "final_layer.adaLN_modulation.1".into(), 2 * h, h);
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

    #[test]
    fn configs_are_consistent() {
        for c in [
            FluxConfig::flux_dev(),
            FluxConfig::flux_schnell(),
            FluxConfig::flux_tiny(),
        ] {
            c.validate().unwrap();
        }
    }

    /// The executor's configs and the catalogue's sizes come from one definition: the
    /// parameters the executor loads equal the catalogue's transformer parameters.
    #[test]
    fn configs_match_the_catalogue() {
        for id in ["flux-dev", "flux-schnell", "flux-tiny"] {
            let cfg = FluxConfig::by_name(id).unwrap();
            let spec = mold_models::find(id).unwrap();
            assert_eq!(cfg.param_count(), spec.transformer.params(), "{id}");
            let kinds = &spec.transformer.kinds;
            assert_eq!(
                (kinds[0].count as usize, kinds[1].count as usize),
                (cfg.depth, cfg.depth_single),
                "{id}"
            );
            assert_eq!(kinds[0].heads as usize, cfg.heads, "{id}");
            assert_eq!(kinds[0].mlp_hidden as usize, cfg.mlp_hidden(), "{id}");
        }
        assert!(FluxConfig::by_name("qwen-image").is_none());
    }

    #[test]
    fn flux_dev_has_about_12b_params() {
        let n = FluxConfig::flux_dev().param_count();
        assert!((11_800_000_000..12_000_000_000).contains(&n), "{n}");
    }
}
