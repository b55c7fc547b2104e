//! One FLUX call's inputs: their checks, the denoising loop's view of them, and
//! deterministic random inputs for benchmarks and tests.

use super::FluxConfig;
use crate::error::{ExecError, Result};
use crate::model::transformer::Inputs;
use crate::random_weights::normals;
use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Inputs of one transformer call (BFL / candle `Flux::forward` argument order).
#[derive(Clone, Debug)]
pub struct FluxInputs {
    /// Packed latent tokens `(b, L_img, in_channels)`.
    pub img: Tensor,
    /// `(b, L_img, 3)` positions (0, row, col).
    pub img_ids: Tensor,
    /// Text-encoder tokens `(b, L_txt, context_in_dim)`.
    pub txt: Tensor,
    /// `(b, L_txt, 3)`, zeros for FLUX.
    pub txt_ids: Tensor,
    /// `(b,)` in [0, 1].
    pub timesteps: Tensor,
    /// Pooled vector `(b, vec_in_dim)`.
    pub y: Tensor,
    /// `(b,)` distilled guidance; required by guidance-distilled models.
    pub guidance: Option<Tensor>,
    /// The request's times, when the denoising loop gave them ([`Inputs::set_schedule`]):
    /// the blocks' modulation is then computed for a window of steps at once
    /// ([`crate::model::modulation`]).
    pub schedule: Option<Schedule>,
}

/// Every time of a request's steps, in order, and which of them the inputs are at.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub times: Arc<[f64]>,
    /// Process-unique ([`crate::model::modulation::next_request`]).
    pub request: u64,
    /// The step whose time `timesteps` holds; `None` for a time not in `times`.
    pub step: Option<usize>,
}

impl Inputs for FluxInputs {
    fn latents(&self) -> &Tensor {
        &self.img
    }
    fn set_latents(&mut self, x: Tensor) {
        self.img = x;
    }
    fn set_time(&mut self, t: f64) -> candle_core::Result<()> {
        self.timesteps = self.timesteps.ones_like()?.affine(t, 0.0)?;
        if let Some(s) = &mut self.schedule {
            s.step = s.times.iter().position(|x| *x == t);
        }
        Ok(())
    }
    fn set_schedule(&mut self, times: &[f64]) -> candle_core::Result<()> {
        self.schedule = Some(Schedule {
            times: times.into(),
            request: crate::model::modulation::next_request(),
            step: None,
        });
        Ok(())
    }
    fn map(
        &self,
        f: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            img: f(&self.img)?,
            img_ids: f(&self.img_ids)?,
            txt: f(&self.txt)?,
            txt_ids: f(&self.txt_ids)?,
            timesteps: f(&self.timesteps)?,
            y: f(&self.y)?,
            guidance: self.guidance.as_ref().map(&mut *f).transpose()?,
            schedule: self.schedule.clone(),
        })
    }
}

/// Checks `x` against the model: shapes, and guidance for guidance-distilled models.
pub(crate) fn check(c: &FluxConfig, x: &FluxInputs) -> Result<()> {
    fn bad<T>(m: String) -> Result<T> {
        Err(ExecError::Input(m))
    }
    let (b, l_img, ch) = x.img.dims3().or_else(|_| {
        bad(format!(
            "img must be (batch, tokens, {}), got {:?}",
            c.in_channels,
            x.img.shape()
        ))
    })?;
    if ch != c.in_channels {
        return bad(format!(
            "img has {ch} channels per token, the model takes {}",
            c.in_channels
        ));
    }
    let (tb, _, tc) = x.txt.dims3().or_else(|_| {
        bad(format!(
            "txt must be (batch, tokens, {}), got {:?}",
            c.context_in_dim,
            x.txt.shape()
        ))
    })?;
    if tb != b || tc != c.context_in_dim {
        return bad(format!(
            "txt must be ({b}, tokens, {}), got {:?}",
            c.context_in_dim,
            x.txt.shape()
        ));
    }
    if x.img_ids.dims() != [b, l_img, 3] {
        return bad(format!(
            "img_ids must be ({b}, {l_img}, 3), got {:?}",
            x.img_ids.shape()
        ));
    }
    if x.txt_ids.dims() != [b, x.txt.dim(1)?, 3] {
        return bad(format!(
            "txt_ids must be ({b}, {}, 3), got {:?}",
            x.txt.dim(1)?,
            x.txt_ids.shape()
        ));
    }
    if x.y.dims() != [b, c.vec_in_dim] {
        return bad(format!(
            "y must be ({b}, {}), got {:?}",
            c.vec_in_dim,
            x.y.shape()
        ));
    }
    if x.timesteps.dims() != [b] {
        return bad(format!(
            "timesteps must be ({b},), got {:?}",
            x.timesteps.shape()
        ));
    }
    match &x.guidance {
        None if c.guidance_embed => {
            bad("this model is guidance distilled: pass a guidance strength (e.g. 3.5)".into())
        }
        Some(g) if g.dims() != [b] => bad(format!("guidance must be ({b},), got {:?}", g.shape())),
        _ => Ok(()),
    }
}

/// Deterministic random inputs for an image of `width` × `height` pixels
/// (`(height/16) * (width/16)` latent tokens) and `txt_len` text tokens, as f32 on the
/// CPU: latents, text and pooled vector ~ N(0, 1), image ids (0, row, col), text ids 0,
/// timesteps uniform in [0, 1), guidance 3.5 when the model takes it.
pub fn random_inputs(
    cfg: &FluxConfig,
    width: u32,
    height: u32,
    txt_len: usize,
    batch: usize,
    seed: u64,
) -> Result<FluxInputs> {
    let (h, w) = ((height / 16) as usize, (width / 16) as usize);
    if h == 0 || w == 0 {
        return Err(ExecError::Input(format!(
            "{width}x{height} is smaller than one 16x16 latent patch"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let dev = &Device::Cpu;
    let mut randn = |shape: &[usize]| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n);
        normals(&mut rng, n, |x| v.push(x));
        Ok(Tensor::from_vec(v, shape, dev)?)
    };
    let img = randn(&[batch, h * w, cfg.in_channels])?;
    let txt = randn(&[batch, txt_len, cfg.context_in_dim])?;
    let y = randn(&[batch, cfg.vec_in_dim])?;
    let mut ids = Vec::with_capacity(batch * h * w * 3);
    for _ in 0..batch {
        for r in 0..h {
            for c in 0..w {
                ids.extend_from_slice(&[0f32, r as f32, c as f32]);
            }
        }
    }
    let img_ids = Tensor::from_vec(ids, (batch, h * w, 3), dev)?;
    let txt_ids = Tensor::zeros((batch, txt_len, 3), DType::F32, dev)?;
    let ts: Vec<f32> = (0..batch).map(|_| rng.gen::<f32>()).collect();
    let timesteps = Tensor::from_vec(ts, batch, dev)?;
    let guidance = if cfg.guidance_embed {
        Some(Tensor::full(3.5f32, batch, dev)?)
    } else {
        None
    };
    Ok(FluxInputs {
        img,
        img_ids,
        txt,
        txt_ids,
        timesteps,
        y,
        guidance,
        schedule: None,
    })
}
