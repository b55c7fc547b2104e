//! The text encoders and the VAE decoder of a FLUX pipeline timed on one device, for the
//! cost model's tables (`mold devices --calibrate --model M`): each built at its real
//! size from zero weights (the time of dense kernels does not depend on the values),
//! run `warmup` times, then timed `iters` times, synchronised; the median is kept. The
//! encoders run at the model's prompt lengths, the decoder at each requested image size.

use crate::error::{PipelineError, Result};
use crate::testdata::{clip_l_config, t5_xxl_config, tiny_clip_config, tiny_t5_config};
use crate::vae::AeConfig;
use crate::{component_dtype, on_device_dtype, text};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::clip::text_model::ClipTextTransformer;
use candle_transformers::models::flux::autoencoder::Decoder;
use candle_transformers::models::t5;
use mold_exec::FluxConfig;
use mold_machine::ComponentPoint;

/// How many runs: untimed first, then timed.
#[derive(Clone, Copy, Debug)]
pub struct ComponentBench {
    pub warmup: usize,
    pub iters: usize,
}

impl Default for ComponentBench {
    fn default() -> Self {
        ComponentBench {
            warmup: 1,
            iters: 3,
        }
    }
}

/// `model`'s T5, CLIP and VAE decoder (each in its catalogue dtype) timed on `dev`; the
/// decoder once per `(width, height)` of `sizes`. FLUX models only.
pub fn time_components(
    model: &str,
    dev: &Device,
    sizes: &[(u32, u32)],
    bench: &ComponentBench,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ComponentPoint>> {
    let bad = |m: String| PipelineError::Plan(m);
    let flux = FluxConfig::by_name(model).ok_or_else(|| {
        bad(format!(
            "model `{model}`: its text encoders and VAE are timed for FLUX models (flux-dev, flux-schnell, flux-tiny)"
        ))
    })?;
    let spec = mold_models::find(model).map_err(|e| bad(e.to_string()))?;
    let (t5_json, clip_json, ae) = if model == "flux-tiny" {
        (
            tiny_t5_config(&flux),
            tiny_clip_config(&flux),
            AeConfig::tiny(),
        )
    } else {
        (t5_xxl_config(), clip_l_config(), AeConfig::flux())
    };
    // The dtype a plan gives the component, and the one it computes in here (candle's
    // CPU matrix products have no bf16: f32 on a CPU device, where only emulated
    // devices' figures come from).
    let dtypes = |name: &str| -> Result<(mold_plan::DType, DType)> {
        let planned = spec
            .component(name)
            .ok_or_else(|| bad(format!("model `{model}` has no `{name}` component")))?
            .default_dtype;
        let (dt, _) = component_dtype(name, planned)?;
        Ok((planned, on_device_dtype(dt, dev)))
    };
    let mut points = Vec::new();

    let (planned, dt) = dtypes("t5")?;
    let tokens = spec.text_tokens as usize;
    progress(&format!("t5 over {tokens} tokens ({planned})"));
    let cfg: t5::Config = serde_json::from_value(t5_json)
        .map_err(|e| bad(format!("the T5 config of `{model}`: {e}")))?;
    let mut m = t5::T5EncoderModel::load(VarBuilder::zeros(dt, dev), &cfg)?;
    let ids = Tensor::zeros((1, tokens), DType::U32, dev)?;
    let seconds = median(dev, bench, || m.forward(&ids))?;
    drop(m);
    points.push(ComponentPoint {
        component: "t5".into(),
        dtype: planned,
        size: tokens as u64,
        seconds,
    });

    let (planned, dt) = dtypes("clip")?;
    let cfg = text::clip_config_from(clip_json, std::path::Path::new("clip_l_config()"))?;
    let len = cfg.max_position_embeddings;
    progress(&format!("clip over {len} tokens ({planned})"));
    let m = ClipTextTransformer::new(VarBuilder::zeros(dt, dev).pp("text_model"), &cfg)?;
    let ids = Tensor::zeros((1, len), DType::U32, dev)?;
    let seconds = median(dev, bench, || m.forward_with_mask(&ids, usize::MAX))?;
    drop(m);
    points.push(ComponentPoint {
        component: "clip".into(),
        dtype: planned,
        size: len as u64,
        seconds,
    });

    let (planned, dt) = dtypes("vae")?;
    let decoder = Decoder::new(&ae.to_candle(), VarBuilder::zeros(dt, dev).pp("decoder"))?;
    for &(w, h) in sizes {
        progress(&format!("vae decoding {w}x{h} ({planned})"));
        // A size the device cannot decode (its memory) is left out, not the whole
        // calibration: the cost model extrapolates from the sizes measured.
        let timed = Tensor::zeros((1, ae.z_channels, h as usize / 8, w as usize / 8), dt, dev)
            .map_err(PipelineError::from)
            .and_then(|z| median(dev, bench, || decoder.forward(&z)));
        match timed {
            Ok(seconds) => points.push(ComponentPoint {
                component: "vae".into(),
                dtype: planned,
                size: w as u64 * h as u64,
                seconds,
            }),
            Err(e) => progress(&format!("vae decoding {w}x{h} left out: {e}")),
        }
    }
    points.sort_by_key(|p| (p.component.clone(), p.size));
    points.dedup_by(|a, b| a.component == b.component && a.size == b.size);
    Ok(points)
}

/// The median of `bench.iters` synchronised runs of `f` after `bench.warmup` untimed ones.
fn median(
    dev: &Device,
    bench: &ComponentBench,
    f: impl FnMut() -> candle_core::Result<Tensor>,
) -> Result<f64> {
    Ok(mold_exec::calibrate_ops::median_time(dev, bench.warmup, bench.iters, f)?.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flux_tiny_components_are_timed_and_others_refused() {
        let mut seen = Vec::new();
        let p = time_components(
            "flux-tiny",
            &Device::Cpu,
            &[(32, 32), (64, 64), (64, 64)],
            &ComponentBench {
                warmup: 0,
                iters: 1,
            },
            &mut |s| seen.push(s.to_string()),
        )
        .unwrap();
        let names: Vec<(&str, u64)> = p.iter().map(|p| (p.component.as_str(), p.size)).collect();
        let tokens = mold_models::find("flux-tiny").unwrap().text_tokens as u64;
        assert_eq!(
            names,
            [("clip", 77), ("t5", tokens), ("vae", 1024), ("vae", 4096)],
            "{p:?}"
        );
        assert!(p.iter().all(|p| p.seconds.is_finite() && p.seconds > 0.0));
        assert_eq!(seen.len(), 5, "{seen:?}");
        let e = time_components(
            "qwen-image",
            &Device::Cpu,
            &[(64, 64)],
            &ComponentBench::default(),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("FLUX models"), "{e}");
    }
}
