//! The text encoders and the VAE decoder of a FLUX or Qwen-Image pipeline timed on one
//! device, for the cost model's tables (`mold devices --calibrate --model M`): each built at its real
//! size from zero weights (the time of dense kernels does not depend on the values),
//! run `warmup` times, then timed `iters` times, synchronised; the median is kept. The
//! encoders run at the model's prompt lengths, the decoder at each requested image size.
//!
//! [`first_use`] builds the same components the same way in the order a one-shot `mold
//! exec` runs them and times each one's first run apart from its warm runs: meant for a
//! fresh process (the CLI spawns one), where the CUDA libraries load what they load on
//! first use (cuBLAS's kernels, candle's modules) inside those first runs, as they do in
//! `mold exec`'s encoders. [`record_first_use`] puts the difference into the points.

use crate::error::{PipelineError, Result};
use crate::flux::testdata::{clip_l_config, t5_xxl_config, tiny_clip_config, tiny_t5_config};
use crate::flux::text;
use crate::flux::vae::{AeConfig, VaeOptions};
use crate::qwen::lm::QwenLm;
use crate::qwen::testdata::TextSize;
use crate::qwen::text::{CandleLm, QwenTextConfig};
use crate::qwen::vae::{QwenVae, QwenVaeConfig};
use crate::{component_dtype, on_device_dtype};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::clip::text_model::ClipTextConfig;
use candle_transformers::models::t5;
use mold_exec::FluxConfig;
use mold_machine::ComponentPoint;
use mold_models::ModelSpec;
use serde::{Deserialize, Serialize};
use std::rc::Rc;
use std::time::Instant;

/// Qwen-Image's text encoder, as the catalogue names it.
const QWEN_TEXT: &str = "qwen2.5-vl";

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

/// `model`'s text encoders (FLUX: T5 and CLIP; Qwen-Image: Qwen2.5-VL's language model) and
/// VAE decoder (each in its catalogue dtype) timed on `dev`; the decoder once per `(width,
/// height)` of `sizes`. FLUX and Qwen-Image models only.
pub fn time_components(
    model: &str,
    dev: &Device,
    sizes: &[(u32, u32)],
    bench: &ComponentBench,
    vae: VaeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ComponentPoint>> {
    let c = Components::of(model)?;
    let mut points = Vec::new();
    for &name in c.encoders() {
        let mut b = c.encoder(name, dev, vae.kernels)?;
        progress(&b.label);
        let seconds = median(dev, bench, &mut b.run)?;
        points.push(b.point(seconds));
        // Released before the next is built, as a one-shot run does.
        drop(b);
    }
    let vae = c.decoder(dev, vae)?;
    for &size in sizes {
        progress(&vae.label(size));
        // A size the device cannot decode (its memory) is left out, not the whole
        // calibration: the cost model extrapolates from the sizes measured.
        let timed = vae.at(size, dev).and_then(|mut b| {
            let seconds = median(dev, bench, &mut b.run)?;
            Ok(b.point(seconds))
        });
        match timed {
            Ok(p) => points.push(p),
            Err(e) => progress(&format!("vae decoding {}x{} left out: {e}", size.0, size.1)),
        }
    }
    points.sort_by_key(|p| (p.component.clone(), p.size));
    points.dedup_by(|a, b| a.component == b.component && a.size == b.size);
    Ok(points)
}

/// Whether [`time_components`] and [`first_use`] time `model`'s components (FLUX and
/// Qwen-Image models).
pub fn components_timed(model: &str) -> bool {
    FluxConfig::by_name(model).is_some() || matches!(model, "qwen-image" | "qwen-image-tiny")
}

/// One component's first run in a process beside its warm runs after it ([`first_use`]);
/// what the fresh process `mold devices --calibrate --model M` spawns prints, as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirstUseRun {
    /// `t5`, `clip`, `qwen2.5-vl`, `vae`.
    pub component: String,
    /// As [`ComponentPoint::size`]: prompt tokens, or the image's pixels.
    pub size: u64,
    /// The first run, synchronised.
    pub cold_seconds: f64,
    /// The median of the runs after it, in the same process.
    pub warm_seconds: f64,
}

impl FirstUseRun {
    /// What the first run costs beyond a warm one: `max(0, cold − warm)`, to the
    /// nanosecond (what a clock resolves).
    pub fn first_use_seconds(&self) -> f64 {
        let d = self.cold_seconds - self.warm_seconds;
        if d.is_finite() {
            ((d * 1e9).round() / 1e9).max(0.0)
        } else {
            0.0
        }
    }
}

/// `model`'s text encoders (in the order its pipeline runs them: for FLUX
/// [`crate::flux::resident::ENCODERS`]'), then its VAE decoder at `size`, each built from zero weights as
/// [`time_components`] builds it and run once cold (timed alone, synchronised), then
/// `bench.iters` times warm (their median; `bench.warmup` is not used: the cold run is
/// the warm-up). Each is dropped before the next is built, as in a one-shot run. Run it
/// in a fresh process: whatever was loaded before it is not first use any more.
pub fn first_use(
    model: &str,
    dev: &Device,
    size: (u32, u32),
    bench: &ComponentBench,
    vae: VaeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<FirstUseRun>> {
    let c = Components::of(model)?;
    let mut runs = Vec::new();
    let mut time = |mut b: Built, progress: &mut dyn FnMut(&str)| -> Result<()> {
        progress(&format!("first use of {}", b.label));
        dev.synchronize()?;
        let start = Instant::now();
        let out = (b.run)()?;
        dev.synchronize()?;
        let cold_seconds = start.elapsed().as_secs_f64();
        drop(out);
        let warm_seconds = mold_exec::calibrate::median_time(dev, 0, bench.iters, &mut b.run)?;
        runs.push(FirstUseRun {
            component: b.component.to_string(),
            size: b.size,
            cold_seconds,
            warm_seconds,
        });
        Ok(())
    };
    for &name in c.encoders() {
        time(c.encoder(name, dev, vae.kernels)?, progress)?;
    }
    // A size the device cannot decode (its memory) leaves the decoder out, not the
    // encoders' runs.
    let vae = c.decoder(dev, vae)?;
    if let Err(e) = vae.at(size, dev).and_then(|b| time(b, progress)) {
        progress(&format!("vae decoding {}x{} left out: {e}", size.0, size.1));
    }
    Ok(runs)
}

/// Sets each of `points`' `first_use_seconds` from `runs` of fresh processes (its
/// component and size): the mean where several processes ran it (the encoders run in
/// each). First use varies from process to process (on an H200 CLIP's from about 90 to
/// 135 ms, in two clusters): the mean is what a run pays on average, where a median of a
/// few would land in one cluster. A point no run measured is left as it was.
pub fn record_first_use(points: &mut [ComponentPoint], runs: &[FirstUseRun]) {
    for p in points.iter_mut() {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| r.component == p.component && r.size == p.size)
            .map(FirstUseRun::first_use_seconds)
            .collect();
        if !v.is_empty() {
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            p.first_use_seconds = Some((mean * 1e9).round() / 1e9);
        }
    }
}

/// A model's text encoders and VAE decoder as calibration builds them.
struct Components {
    model: String,
    spec: ModelSpec,
    parts: Parts,
}

/// The configurations of a family's components.
enum Parts {
    Flux {
        t5: t5::Config,
        clip: ClipTextConfig,
        ae: AeConfig,
    },
    Qwen {
        text: QwenTextConfig,
        vae: QwenVaeConfig,
    },
}

/// A component built from zero weights on a device, with its input: each call of `run`
/// is one forward pass.
struct Built {
    component: &'static str,
    planned: mold_plan::DType,
    size: u64,
    /// What runs, for progress: `t5 over 512 tokens (bf16)`.
    label: String,
    run: Box<dyn FnMut() -> candle_core::Result<Tensor>>,
}

impl Built {
    fn point(&self, seconds: f64) -> ComponentPoint {
        ComponentPoint {
            component: self.component.into(),
            dtype: self.planned,
            size: self.size,
            seconds,
            first_use_seconds: None,
        }
    }
}

/// Decodes a latent `(1, z, h / 8, w / 8)`.
type Decode = dyn Fn(&Tensor) -> Result<Tensor>;

/// The decoder, built once for every size.
struct Vae {
    planned: mold_plan::DType,
    dt: DType,
    z_channels: usize,
    decode: Rc<Decode>,
}

impl Vae {
    fn label(&self, (w, h): (u32, u32)) -> String {
        format!("vae decoding {w}x{h} ({})", self.planned)
    }

    /// The decoder with a latent of a `w`×`h` image.
    fn at(&self, (w, h): (u32, u32), dev: &Device) -> Result<Built> {
        let z = Tensor::zeros(
            (1, self.z_channels, h as usize / 8, w as usize / 8),
            self.dt,
            dev,
        )?;
        let decode = Rc::clone(&self.decode);
        Ok(Built {
            component: "vae",
            planned: self.planned,
            size: w as u64 * h as u64,
            label: self.label((w, h)),
            run: Box::new(move || decode(&z).map_err(|e| candle_core::Error::Msg(e.to_string()))),
        })
    }
}

impl Components {
    /// FLUX and Qwen-Image models only.
    fn of(model: &str) -> Result<Components> {
        let bad = |m: String| PipelineError::Plan(m);
        if !components_timed(model) {
            return Err(bad(format!(
                "model `{model}`: its text encoders and VAE are timed for FLUX and Qwen-Image models (flux-dev, flux-schnell, flux-tiny, qwen-image, qwen-image-tiny)"
            )));
        }
        let spec = mold_models::find(model).map_err(|e| bad(e.to_string()))?;
        let parts = if let Some(flux) = FluxConfig::by_name(model) {
            let (t5_json, clip_json, ae) = if model == "flux-tiny" {
                (
                    tiny_t5_config(&flux),
                    tiny_clip_config(&flux),
                    AeConfig::tiny(),
                )
            } else {
                (t5_xxl_config(), clip_l_config(), AeConfig::flux())
            };
            let t5 = serde_json::from_value(t5_json)
                .map_err(|e| bad(format!("the T5 config of `{model}`: {e}")))?;
            let clip = text::clip_config_from(clip_json, std::path::Path::new("clip_l_config()"))?;
            Parts::Flux { t5, clip, ae }
        } else {
            let (size, vae) = match model {
                "qwen-image" => (TextSize::QWEN25_VL_7B, QwenVaeConfig::qwen_image()),
                "qwen-image-tiny" => (
                    TextSize::tiny(mold_exec::QwenConfig::qwen_image_tiny().joint_attention_dim),
                    QwenVaeConfig::tiny(),
                ),
                _ => {
                    return Err(bad(format!(
                        "model `{model}`: its text encoders and VAE are timed for FLUX and Qwen-Image models (flux-dev, flux-schnell, flux-tiny, qwen-image, qwen-image-tiny)"
                    )))
                }
            };
            Parts::Qwen {
                text: size.text_config(),
                vae,
            }
        };
        Ok(Components {
            model: model.to_string(),
            spec,
            parts,
        })
    }

    /// The text encoders, in the order the pipeline runs them.
    fn encoders(&self) -> &'static [&'static str] {
        match self.parts {
            Parts::Flux { .. } => &crate::flux::resident::ENCODERS,
            Parts::Qwen { .. } => &[QWEN_TEXT],
        }
    }

    /// The dtype a plan gives the component, and the one it computes in on `dev`
    /// (candle's CPU matrix products have no bf16: f32 on a CPU device, where only
    /// emulated devices' figures come from).
    fn dtypes(&self, name: &str, dev: &Device) -> Result<(mold_plan::DType, DType)> {
        let planned = self
            .spec
            .component(name)
            .ok_or_else(|| {
                PipelineError::Plan(format!("model `{}` has no `{name}` component", self.model))
            })?
            .default_dtype;
        let (dt, _) = component_dtype(name, planned)?;
        Ok((planned, on_device_dtype(dt, dev)))
    }

    /// A text encoder (`t5`, `clip`, `qwen2.5-vl`) over its prompt: T5 and Qwen2.5-VL at the
    /// model's prompt length, CLIP at its fixed positions; the network `mold exec` runs for
    /// `kernels`.
    fn encoder(&self, name: &str, dev: &Device, kernels: mold_exec::Kernels) -> Result<Built> {
        let (planned, dt) = self.dtypes(name, dev)?;
        let vb = VarBuilder::zeros(dt, dev);
        type Run = Box<dyn FnMut() -> candle_core::Result<Tensor>>;
        let tokens = self.spec.text_tokens as usize;
        let (component, tokens, run): (&'static str, usize, Run) = match (&self.parts, name) {
            (Parts::Flux { t5, .. }, "t5") => {
                let mut m = crate::flux::text::T5Net::new(vb, t5, kernels)?;
                let ids = Tensor::zeros((1, tokens), DType::U32, dev)?;
                ("t5", tokens, Box::new(move || m.forward(&ids)))
            }
            (Parts::Flux { clip, .. }, "clip") => {
                let len = clip.max_position_embeddings;
                let mut m = crate::flux::text::ClipNet::new(vb.pp("text_model"), clip, kernels)?;
                let ids = Tensor::zeros((1, len), DType::U32, dev)?;
                ("clip", len, Box::new(move || m.forward(&ids)))
            }
            (Parts::Qwen { text, .. }, QWEN_TEXT) => {
                let ids = vec![0u32; tokens];
                let run: Run = if kernels == mold_exec::Kernels::Candle {
                    let m = CandleLm::new(vb, text)?;
                    Box::new(move || {
                        m.forward(&ids)
                            .map_err(|e| candle_core::Error::Msg(e.to_string()))
                    })
                } else {
                    let m = QwenLm::new(vb, text, kernels)?;
                    Box::new(move || m.forward(&ids))
                };
                (QWEN_TEXT, tokens, run)
            }
            (_, other) => {
                return Err(PipelineError::Plan(format!(
                    "`{other}` is not a text encoder of `{}` (its encoders: {})",
                    self.model,
                    self.encoders().join(", ")
                )))
            }
        };
        Ok(Built {
            component,
            planned,
            size: tokens as u64,
            label: format!("{component} over {tokens} tokens ({planned})"),
            run,
        })
    }

    /// The decoder `mold exec` would run (`opts`: the channels-last one on CUDA where
    /// cuDNN loads, else candle's), from zero weights.
    fn decoder(&self, dev: &Device, opts: VaeOptions) -> Result<Vae> {
        let (planned, dt) = self.dtypes("vae", dev)?;
        let vb = VarBuilder::zeros(dt, dev);
        let (z_channels, decode): (usize, Rc<Decode>) = match &self.parts {
            Parts::Flux { ae, .. } => {
                let d = crate::flux::vae::Vae::from_varbuilder(vb, ae.clone(), dt, dev, opts, 0)?;
                (ae.z_channels, Rc::new(move |z: &Tensor| d.decode(z)))
            }
            Parts::Qwen { vae, .. } => {
                let nhwc = crate::nhwc::NhwcOptions {
                    conv: mold_exec::model::conv::ConvOptions {
                        kernels: opts.kernels,
                        tune: false,
                    },
                    subpixel: true,
                };
                let d =
                    QwenVae::from_varbuilder(vae.clone(), vb, dt, dev, nhwc, 0, "zero weights")?;
                (vae.z_dim, Rc::new(move |z: &Tensor| d.decode(z)))
            }
        };
        Ok(Vae {
            planned,
            dt,
            z_channels,
            decode,
        })
    }
}

/// The median of `bench.iters` synchronised runs of `f` after `bench.warmup` untimed ones.
fn median(
    dev: &Device,
    bench: &ComponentBench,
    f: impl FnMut() -> candle_core::Result<Tensor>,
) -> Result<f64> {
    Ok(mold_exec::calibrate::median_time(dev, bench.warmup, bench.iters, f)?.max(1e-9))
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
            VaeOptions::default(),
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
            "sd3.5-large",
            &Device::Cpu,
            &[(64, 64)],
            &ComponentBench::default(),
            VaeOptions::default(),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("FLUX and Qwen-Image models"), "{e}");
        assert!(!components_timed("sd3.5-large") && components_timed("qwen-image"));
    }

    /// Qwen-Image's language model at the prompt length and its decoder at each size, on
    /// mold's layers and as the candle reference.
    #[test]
    fn qwen_image_tiny_components_are_timed() {
        for kernels in [mold_exec::Kernels::Auto, mold_exec::Kernels::Candle] {
            let p = time_components(
                "qwen-image-tiny",
                &Device::Cpu,
                &[(32, 32), (64, 48)],
                &ComponentBench {
                    warmup: 0,
                    iters: 1,
                },
                VaeOptions::with_kernels(kernels),
                &mut |_| {},
            )
            .unwrap();
            let names: Vec<(&str, u64)> =
                p.iter().map(|p| (p.component.as_str(), p.size)).collect();
            let tokens = mold_models::find("qwen-image-tiny").unwrap().text_tokens as u64;
            assert_eq!(
                names,
                [("qwen2.5-vl", tokens), ("vae", 1024), ("vae", 64 * 48)],
                "{kernels:?}"
            );
            assert!(p.iter().all(|p| p.seconds.is_finite() && p.seconds > 0.0));
        }
    }

    /// Each component once cold and warm in the exec's order (encoders, then the
    /// decoder at the size asked), the same sizes the warm timings have.
    #[test]
    fn first_use_times_each_component_cold_then_warm_in_exec_order() {
        let mut seen = Vec::new();
        let runs = first_use(
            "flux-tiny",
            &Device::Cpu,
            (64, 32),
            &ComponentBench {
                warmup: 5,
                iters: 2,
            },
            VaeOptions::default(),
            &mut |s| seen.push(s.to_string()),
        )
        .unwrap();
        let tokens = mold_models::find("flux-tiny").unwrap().text_tokens as u64;
        let names: Vec<(&str, u64)> = runs
            .iter()
            .map(|r| (r.component.as_str(), r.size))
            .collect();
        assert_eq!(names, [("t5", tokens), ("clip", 77), ("vae", 64 * 32)]);
        for r in &runs {
            assert!(r.cold_seconds.is_finite() && r.cold_seconds > 0.0, "{r:?}");
            assert!(r.warm_seconds.is_finite() && r.warm_seconds > 0.0, "{r:?}");
            let f = r.first_use_seconds();
            assert!(f.is_finite() && f >= 0.0, "{r:?}");
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen[0].starts_with("first use of t5 over"), "{seen:?}");
        // What a child prints is what the parent reads.
        let json = serde_json::to_string(&runs).unwrap();
        let back: Vec<FirstUseRun> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, runs);
        let e = first_use(
            "sd3.5-large",
            &Device::Cpu,
            (64, 64),
            &ComponentBench::default(),
            VaeOptions::default(),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("FLUX and Qwen-Image models"), "{e}");
        let runs = first_use(
            "qwen-image-tiny",
            &Device::Cpu,
            (32, 32),
            &ComponentBench {
                warmup: 0,
                iters: 1,
            },
            VaeOptions::default(),
            &mut |_| {},
        )
        .unwrap();
        let names: Vec<&str> = runs.iter().map(|r| r.component.as_str()).collect();
        assert_eq!(names, ["qwen2.5-vl", "vae"]);
    }

    #[test]
    fn recorded_first_use_is_the_mean_over_processes_never_negative() {
        let point = |c: &str, size: u64| ComponentPoint {
            component: c.into(),
            dtype: mold_plan::DType::Bf16,
            size,
            seconds: 0.01,
            first_use_seconds: None,
        };
        let mut points = vec![
            point("clip", 77),
            point("t5", 512),
            point("vae", 1024),
            point("vae", 4096),
        ];
        let run = |c: &str, size: u64, cold: f64, warm: f64| FirstUseRun {
            component: c.into(),
            size,
            cold_seconds: cold,
            warm_seconds: warm,
        };
        record_first_use(
            &mut points,
            &[
                run("t5", 512, 0.5, 0.1),
                run("t5", 512, 0.3, 0.1),
                run("t5", 512, 1.0, 0.1),
                // Faster cold than warm (noise): no first use, not a negative one.
                run("clip", 77, 0.01, 0.02),
                run("vae", 4096, 0.25, 0.05),
            ],
        );
        let got: Vec<Option<f64>> = points.iter().map(|p| p.first_use_seconds).collect();
        assert_eq!(got.len(), 4);
        assert_eq!(got[0], Some(0.0));
        assert!((got[1].unwrap() - 0.5).abs() < 1e-12, "{got:?}");
        assert_eq!(got[2], None);
        assert!((got[3].unwrap() - 0.2).abs() < 1e-12, "{got:?}");
    }
}
