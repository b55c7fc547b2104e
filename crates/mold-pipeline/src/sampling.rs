//! What the families' samplers share: image sizes, seeded noise, 2×2 latent patch
//! packing, the benchmark's linear schedule; and the denoising loop every transformer
//! run shares, with where a step's passes run ([`Passes`]: true CFG's two serially,
//! CFG-parallel or pipelined). A family's own schedule and token positions are in its
//! folder ([`crate::flux::sampling`], [`crate::qwen::sampling`]).

use crate::error::{PipelineError, Result};
use candle_core::{Device, Tensor};
use mold_exec::{Executor, Transformer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Image sides must be multiples of this: 8× VAE down-sampling, then 2×2 latent patches.
pub const SIZE_MULTIPLE: u32 = 16;

/// Latent channels of the FLUX autoencoder.
pub const LATENT_CHANNELS: usize = 16;

/// The multiples of 16 either side of `v` (just the one above when below 16).
fn neighbours(v: u32) -> (Option<u32>, u32) {
    let lo = v / SIZE_MULTIPLE * SIZE_MULTIPLE;
    let hi = lo + SIZE_MULTIPLE;
    ((lo > 0).then_some(lo), hi)
}

/// The multiple of 16 nearest `v` (ties round up; at least 16).
pub fn nearest_valid(v: u32) -> u32 {
    if v.is_multiple_of(SIZE_MULTIPLE) && v > 0 {
        return v;
    }
    match neighbours(v) {
        (Some(lo), hi) if v - lo < hi - v => lo,
        (_, hi) => hi,
    }
}

/// Refuses image sizes FLUX cannot make, naming the nearest valid ones.
pub fn check_size(width: u32, height: u32) -> Result<()> {
    let mut bad = Vec::new();
    for (what, v) in [("width", width), ("height", height)] {
        if v == 0 || !v.is_multiple_of(SIZE_MULTIPLE) {
            let near = match neighbours(v) {
                (Some(lo), hi) => format!("{lo} or {hi}"),
                (None, hi) => format!("{hi}"),
            };
            bad.push(format!("{what} {v} is not a multiple of 16 (use {near})"));
        }
    }
    if bad.is_empty() {
        return Ok(());
    }
    Err(PipelineError::Size(format!(
        "image size {width}x{height}: {}; FLUX needs multiples of 16 (8x VAE down-sampling, then 2x2 latent patches): the nearest valid size is {}x{}",
        bad.join(", "),
        nearest_valid(width),
        nearest_valid(height)
    )))
}

/// Standard normal f32 samples (Box–Muller) from a seeded [`StdRng`]: the same on every
/// device and every run.
fn normals(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        v.push((r * th.cos()) as f32);
        if v.len() < n {
            v.push((r * th.sin()) as f32);
        }
    }
    v
}

/// Initial latent noise `(batch, 16, height/8, width/8)`, f32 on the CPU, from `seed`.
pub fn noise(seed: u64, batch: usize, width: u32, height: u32) -> Result<Tensor> {
    let (h, w) = (height as usize / 8, width as usize / 8);
    let mut rng = StdRng::seed_from_u64(seed);
    let n = batch * LATENT_CHANNELS * h * w;
    Ok(Tensor::from_vec(
        normals(&mut rng, n),
        (batch, LATENT_CHANNELS, h, w),
        &Device::Cpu,
    )?)
}

/// Packs latents `(b, c, h, w)` into 2×2 patch tokens `(b, h/2 · w/2, 4c)` (BFL's
/// `rearrange(img, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)`).
pub fn pack(x: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    Ok(x.reshape((b, c, h / 2, 2, w / 2, 2))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((b, h / 2 * w / 2, c * 4))?)
}

/// The inverse of [`pack`] for an image of `width` × `height` pixels:
/// `(b, L, 64)` → `(b, 16, height/8, width/8)`.
pub fn unpack(x: &Tensor, width: u32, height: u32) -> Result<Tensor> {
    Ok(candle_transformers::models::flux::sampling::unpack(
        &x.contiguous()?,
        height as usize,
        width as usize,
    )?)
}

/// The timesteps of the transformer-only benchmark: `steps + 1` of them, evenly from 1
/// to 0 (the schedule without the resolution shift).
pub fn linear_schedule(steps: u32) -> Vec<f64> {
    (0..=steps).map(|i| 1.0 - i as f64 / steps as f64).collect()
}

/// One denoising step as the loop reports it: its index (from 0), its time, how long it
/// took (the device finished) and, where asked for, the digest of the latents it produced
/// ([`mold_exec::digest`], taken after the clock stopped): two runs that differ can be
/// compared step by step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    pub index: usize,
    pub t: f64,
    pub seconds: f64,
    pub digest: Option<u64>,
}

/// Where a step's transformer passes run. True CFG has two a step (the conditional and
/// the unconditional one), run as the plan's CFG mode says ([`mold_plan::CfgMode`]);
/// without it, a step is one pass on the conditional executor.
pub enum Passes<'a, M: Transformer> {
    /// Every pass on one executor, one after the other.
    Serial(&'a Executor<M>),
    /// CFG-parallel: the conditional pass on `cond`, the unconditional one on `uncond`
    /// (another device group holding the same transformer), at the same time; the
    /// unconditional prediction moves to the conditional one's device to be combined.
    Parallel {
        cond: &'a Executor<M>,
        uncond: &'a Executor<M>,
    },
    /// Pipelined CFG: both passes on one executor as two micro-batches, the conditional
    /// one first ([`Executor::forward_micro_batches`]): with a block split, one stage runs
    /// the unconditional pass while the next runs the conditional one.
    Pipelined(&'a Executor<M>),
}

impl<M: Transformer> Passes<'_, M> {
    /// The executor of the conditional pass (the only one without true CFG).
    pub fn cond(&self) -> &Executor<M> {
        match self {
            Passes::Serial(e) | Passes::Pipelined(e) | Passes::Parallel { cond: e, .. } => e,
        }
    }
}

/// One step's predictions: the conditional one and, given the unconditional pass's inputs
/// `neg`, the unconditional one, run where `passes` says.
pub fn predict<M: Transformer>(
    passes: &Passes<M>,
    cond: &M::Inputs,
    neg: Option<&M::Inputs>,
) -> Result<(Tensor, Option<Tensor>)> {
    match (passes, neg) {
        (p, None) => Ok((p.cond().forward(cond)?, None)),
        (Passes::Serial(e), Some(n)) => Ok((e.forward(cond)?, Some(e.forward(n)?))),
        (Passes::Pipelined(e), Some(n)) => {
            match <[Tensor; 2]>::try_from(e.forward_micro_batches(&[cond, n])?) {
                Ok([vc, vn]) => Ok((vc, Some(vn))),
                Err(v) => Err(PipelineError::Component {
                    component: "transformer".into(),
                    message: format!("pipelined CFG: {} outputs for 2 passes", v.len()),
                }),
            }
        }
        (Passes::Parallel { cond: a, uncond: b }, Some(n)) => {
            let (va, vb) = std::thread::scope(|s| {
                let h = s.spawn(|| b.forward(n).map_err(PipelineError::from));
                let va = a.forward(cond);
                (va, h.join())
            });
            let vb = vb.map_err(|_| PipelineError::Component {
                component: "transformer".into(),
                message: "the unconditional pass's thread panicked".into(),
            })?;
            Ok((va?, Some(vb?)))
        }
    }
}

/// Gives `inputs` the times of every step of `sched` (all but its last entry), so the
/// model may compute what depends only on the time ahead ([`mold_exec::Inputs::set_schedule`]).
pub fn set_schedule<I: mold_exec::Inputs>(inputs: &mut I, sched: &[f64]) -> Result<()> {
    inputs.set_schedule(&sched[..sched.len().saturating_sub(1)])?;
    Ok(())
}

/// True CFG's unconditional pass for [`denoise_passes`]: its inputs (each step gives
/// them the conditional inputs' latents and time) and how a step's two predictions
/// combine into one (conditional, unconditional → velocity).
pub struct Guided<'a, I> {
    pub neg: I,
    pub combine: &'a dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
}

/// The denoising loop, the one every path runs: rectified-flow Euler steps over `sched`
/// (`x ← x + (t_next − t) · v(x, t)`). The model computes in the plan's dtype; the latents
/// stay in theirs, on their device. Each step waits for the device before reading the
/// clock; `on_step` sees it. One pass a step on `exec` ([`denoise_passes`] with
/// [`Passes::Serial`] and no unconditional pass).
pub fn denoise<M: Transformer>(
    exec: &Executor<M>,
    inputs: &mut M::Inputs,
    sched: &[f64],
    digests: bool,
    on_step: &mut dyn FnMut(StepTime),
) -> crate::Result<()> {
    denoise_passes(&Passes::Serial(exec), inputs, None, sched, digests, on_step)
}

/// [`denoise`] with true CFG's passes: `v` is the conditional prediction or, with
/// `guided`, the combination of the conditional and the unconditional one, the passes run
/// where `passes` says. A step's time covers both passes and the combination. With `digests` each
/// step's latents are digested after its clock stopped (the host hashes them before it
/// queues the next step).
pub fn denoise_passes<M: Transformer>(
    passes: &Passes<M>,
    inputs: &mut M::Inputs,
    mut guided: Option<Guided<'_, M::Inputs>>,
    sched: &[f64],
    digests: bool,
    on_step: &mut dyn FnMut(StepTime),
) -> crate::Result<()> {
    use mold_exec::Inputs;
    for (index, w) in sched.windows(2).enumerate() {
        let (t, t_next) = (w[0], w[1]);
        let start = std::time::Instant::now();
        inputs.set_time(t)?;
        if let Some(g) = &mut guided {
            g.neg.set_latents(inputs.latents().clone());
            g.neg.set_time(t)?;
        }
        // The pipeline's CUDA devices queue work on the calling thread's own stream; the
        // executor reads the inputs from its rank threads, on other streams: finish what
        // this thread queued (the time, the last update, the conditioning) before they
        // read it.
        inputs.latents().device().synchronize()?;
        let x = inputs.latents().clone();
        let peer = passes.cond().options().peer_copies;
        let v = match (
            predict(passes, inputs, guided.as_ref().map(|g| &g.neg))?,
            &guided,
        ) {
            ((vc, Some(vn)), Some(g)) => {
                // CFG-parallel: the unconditional prediction comes from another GPU.
                let vn = mold_exec::runtime::hand_off_ordered(&vn, vc.device(), peer)?;
                (g.combine)(&vc, &vn)?
            }
            ((vc, _), _) => vc,
        };
        let v = mold_exec::runtime::hand_off_ordered(&v, x.device(), peer)?.to_dtype(x.dtype())?;
        let next = (&x + v.affine(t_next - t, 0.0)?)?;
        // GPU kernels run asynchronously: wait for them before reading the clock.
        next.device().synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        let digest = crate::digest_if(digests, &next)?;
        inputs.set_latents(next);
        on_step(StepTime {
            index,
            t,
            seconds,
            digest,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert!(check_size(1024, 768).is_ok());
        let e = check_size(1000, 1024).unwrap_err().to_string();
        assert!(e.contains("width 1000") && e.contains("992 or 1008"), "{e}");
        assert!(e.contains("1008x1024"), "{e}");
        let e = check_size(8, 0).unwrap_err().to_string();
        assert!(e.contains("use 16") && e.contains("16x16"), "{e}");
        assert_eq!(nearest_valid(1000), 1008);
        assert_eq!(nearest_valid(999), 992);
        assert_eq!(nearest_valid(1001), 1008);
        assert_eq!(nearest_valid(995), 992);
    }

    /// The inputs get every step's time (not the schedule's final 0), so the step each
    /// later time names is found.
    #[test]
    fn the_schedule_s_step_times_reach_the_inputs() {
        let cfg = mold_exec::FluxConfig::flux_tiny();
        let mut x = mold_exec::random_inputs(&cfg, 32, 32, 2, 1, 1).unwrap();
        let sched = crate::flux::sampling::schedule(4, 4, false);
        set_schedule(&mut x, &sched).unwrap();
        let s = x.schedule.clone().unwrap();
        assert_eq!(&s.times[..], &sched[..4]);
        mold_exec::Inputs::set_time(&mut x, sched[2]).unwrap();
        assert_eq!(x.schedule.unwrap().step, Some(2));
    }

    #[test]
    fn pack_unpack_round_trip() {
        let x = noise(3, 1, 64, 32).unwrap();
        assert_eq!(x.dims(), [1, 16, 4, 8]);
        let p = pack(&x).unwrap();
        assert_eq!(p.dims(), [1, 2 * 4, 64]);
        let y = unpack(&p, 64, 32).unwrap();
        let d = (x - y).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn noise_is_seeded() {
        let a = noise(7, 1, 32, 32).unwrap().flatten_all().unwrap();
        let b = noise(7, 1, 32, 32).unwrap().flatten_all().unwrap();
        let c = noise(8, 1, 32, 32).unwrap().flatten_all().unwrap();
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        assert_ne!(a.to_vec1::<f32>().unwrap(), c.to_vec1::<f32>().unwrap());
    }
}
