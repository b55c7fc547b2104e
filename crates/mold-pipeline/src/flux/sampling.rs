//! FLUX's side of sampling ([`crate::sampling`] holds what the families share: sizes,
//! seeded noise, 2×2 patch packing, the one denoising loop): the token positions the
//! rotary embedding reads and the resolution-shifted schedule.

use crate::error::Result;
use candle_core::{DType, Device, Tensor};

/// Image token positions `(b, h/16 · w/16, 3)`: (0, row, col), f32 on the CPU.
pub fn img_ids(batch: usize, width: u32, height: u32) -> Result<Tensor> {
    let (h, w) = (height as usize / 16, width as usize / 16);
    let mut ids = Vec::with_capacity(batch * h * w * 3);
    for _ in 0..batch {
        for r in 0..h {
            for c in 0..w {
                ids.extend_from_slice(&[0f32, r as f32, c as f32]);
            }
        }
    }
    Ok(Tensor::from_vec(ids, (batch, h * w, 3), &Device::Cpu)?)
}

/// Text token positions: zeros `(b, len, 3)`.
pub fn txt_ids(batch: usize, len: usize) -> Result<Tensor> {
    Ok(Tensor::zeros((batch, len, 3), DType::F32, &Device::Cpu)?)
}

/// The timesteps from 1 to 0, `steps + 1` of them. With `shift` (FLUX dev), they are
/// shifted toward 1 by the image's token count: mu goes linearly from 0.5 at 256 tokens
/// to 1.15 at 4096 (candle-transformers' `get_schedule`, BFL's `get_schedule`).
pub fn schedule(steps: u32, image_tokens: usize, shift: bool) -> Vec<f64> {
    candle_transformers::models::flux::sampling::get_schedule(
        steps as usize,
        shift.then_some((image_tokens, 0.5, 1.15)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::linear_schedule;

    #[test]
    fn img_ids_are_one_per_patch() {
        assert_eq!(img_ids(1, 64, 32).unwrap().dims(), [1, 8, 3]);
    }

    #[test]
    fn linear_schedule_is_the_unshifted_one() {
        assert_eq!(linear_schedule(4), schedule(4, 4096, false));
        assert_eq!(linear_schedule(1), vec![1.0, 0.0]);
    }

    #[test]
    fn schedule_shift() {
        let s = schedule(4, 4096, false);
        assert_eq!(s, vec![1.0, 0.75, 0.5, 0.25, 0.0]);
        let s = schedule(4, 4096, true);
        assert_eq!(s.len(), 5);
        assert_eq!(s[0], 1.0);
        assert_eq!(s[4], 0.0);
        // mu = 1.15 at 4096 tokens: t' = e^mu / (e^mu + 1/t - 1).
        let e = 1.15f64.exp();
        assert!((s[2] - e / (e + 1.0)).abs() < 1e-12);
        assert!(s[1] > 0.75 && s[3] > 0.25);
    }
}
