//! One Qwen-Image call's inputs: their checks, the denoising loop's view of them, and
//! deterministic random inputs for benchmarks and tests.

use super::QwenConfig;
use crate::error::{ExecError, Result};
use crate::model::transformer::Inputs;
use crate::random_weights::normals;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Inputs of one transformer call (diffusers `QwenImageTransformer2DModel.forward`:
/// `hidden_states`, `encoder_hidden_states`, `timestep`, `img_shapes`). Every text token
/// is attended to (no padding mask: the reference pipeline passes none when every
/// prompt token is valid).
#[derive(Clone, Debug)]
pub struct QwenInputs {
    /// Packed latent tokens `(b, h·w, in_channels)`, row-major over the patch grid.
    pub img: Tensor,
    /// The text encoder's hidden states `(b, L_txt, joint_attention_dim)`.
    pub txt: Tensor,
    /// `(b,)` in [0, 1] (the pipeline's `timestep / 1000`, i.e. the flow-matching sigma).
    pub timesteps: Tensor,
    /// The patch grid: `h` rows × `w` columns (`img_shapes = [(1, h, w)]`).
    pub grid: (usize, usize),
}

impl Inputs for QwenInputs {
    fn latents(&self) -> &Tensor {
        &self.img
    }
    fn set_latents(&mut self, x: Tensor) {
        self.img = x;
    }
    fn set_time(&mut self, t: f64) -> candle_core::Result<()> {
        self.timesteps = self.timesteps.ones_like()?.affine(t, 0.0)?;
        Ok(())
    }
    fn map(
        &self,
        f: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            img: f(&self.img)?,
            txt: f(&self.txt)?,
            timesteps: f(&self.timesteps)?,
            grid: self.grid,
        })
    }
}

/// Checks `x` against the model's shapes.
pub(crate) fn check(c: &QwenConfig, x: &QwenInputs) -> Result<()> {
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
    let (h, w) = x.grid;
    if h == 0 || w == 0 || h * w != l_img {
        return bad(format!(
            "the patch grid {h}×{w} must hold img's {l_img} tokens: give the rows and columns of 2×2 latent patches"
        ));
    }
    match x.txt.dims3() {
        Ok((tb, tl, tc)) if tb == b && tl > 0 && tc == c.joint_attention_dim => {}
        _ => {
            return bad(format!(
                "txt must be ({b}, tokens ≥ 1, {}), got {:?}",
                c.joint_attention_dim,
                x.txt.shape()
            ))
        }
    }
    if x.timesteps.dims() != [b] {
        return bad(format!(
            "timesteps must be ({b},), got {:?}",
            x.timesteps.shape()
        ));
    }
    Ok(())
}

/// Deterministic random inputs for an image of `width` × `height` pixels (a patch grid
/// of `height/16` × `width/16`) and `txt_len` text tokens, as f32 on the CPU: latents
/// and text ~ N(0, 1), timesteps uniform in [0, 1).
pub fn random_inputs(
    cfg: &QwenConfig,
    width: u32,
    height: u32,
    txt_len: usize,
    batch: usize,
    seed: u64,
) -> Result<QwenInputs> {
    let (h, w) = ((height / 16) as usize, (width / 16) as usize);
    if h == 0 || w == 0 {
        return Err(ExecError::Input(format!(
            "{width}x{height} is smaller than one 16x16 latent patch"
        )));
    }
    if txt_len == 0 {
        return Err(ExecError::Input(
            "Qwen-Image needs at least 1 text token".into(),
        ));
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
    let txt = randn(&[batch, txt_len, cfg.joint_attention_dim])?;
    let ts: Vec<f32> = (0..batch).map(|_| rng.gen::<f32>()).collect();
    let timesteps = Tensor::from_vec(ts, batch, dev)?;
    Ok(QwenInputs {
        img,
        txt,
        timesteps,
        grid: (h, w),
    })
}
