//! Qwen-Image's 3-axis RoPE (diffusers `QwenEmbedRope` with `scale_rope=True`), as a
//! table of the joint sequence `[text; image]`.
//!
//! An image of `h × w` patches (one frame) puts token `(r, c)` at positions
//! `(0, r - (h - h/2), c - (w - w/2))`: rows and columns centred on zero, negative above
//! and left. Text token `j` sits at `m + j` on all three axes, `m = max(h/2, w/2)` (just
//! past the image's largest positive position). Axis `a` rotates `axes_dim[a] / 2` pairs
//! at frequencies `1 / θ^(2i / axes_dim[a])`; the angles are computed in f32, as the
//! reference does.

use candle_core::{Device, Result, Tensor};

/// Positions `(frame, row, col)` of every token of the joint sequence, text first.
pub fn positions(h: usize, w: usize, txt_len: usize) -> Vec<[i64; 3]> {
    let (h0, w0) = ((h - h / 2) as i64, (w - w / 2) as i64);
    let m = (h / 2).max(w / 2) as i64;
    let txt = (0..txt_len as i64).map(|j| [m + j; 3]);
    let img = (0..h as i64).flat_map(|r| (0..w as i64).map(move |c| [0, r - h0, c - w0]));
    txt.chain(img).collect()
}

/// The rotation table of the joint sequence: `(2, txt_len + h·w, head_dim / 2)` f32,
/// cosines then sines, pairs ordered axis by axis.
pub fn table(
    axes_dim: &[usize; 3],
    theta: f64,
    h: usize,
    w: usize,
    txt_len: usize,
    dev: &Device,
) -> Result<Tensor> {
    let inv: Vec<Vec<f32>> = axes_dim
        .iter()
        .map(|&d| {
            (0..d)
                .step_by(2)
                .map(|i| 1f32 / (theta as f32).powf(i as f32 / d as f32))
                .collect()
        })
        .collect();
    let half: usize = axes_dim.iter().sum::<usize>() / 2;
    let pos = positions(h, w, txt_len);
    let mut cos = Vec::with_capacity(pos.len() * half);
    let mut sin = Vec::with_capacity(pos.len() * half);
    for p in &pos {
        for (axis, freqs) in inv.iter().enumerate() {
            for f in freqs {
                let a = p[axis] as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    cos.extend(sin);
    Tensor::from_vec(cos, (2, pos.len(), half), dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference's positions: rows and columns centred (an odd side has one more
    /// negative position), text after the image's largest positive position.
    #[test]
    fn positions_follow_the_reference() {
        let p = positions(3, 4, 2);
        assert_eq!(p.len(), 2 + 12);
        // max(3/2, 4/2) = 2
        assert_eq!(&p[..2], &[[2, 2, 2], [3, 3, 3]]);
        let rows: Vec<i64> = p[2..].iter().step_by(4).map(|q| q[1]).collect();
        assert_eq!(rows, vec![-2, -1, 0]);
        let cols: Vec<i64> = p[2..6].iter().map(|q| q[2]).collect();
        assert_eq!(cols, vec![-2, -1, 0, 1]);
        assert!(p[2..].iter().all(|q| q[0] == 0));
    }

    #[test]
    fn table_is_cos_then_sin_of_position_times_frequency() {
        let t = table(&[2, 2, 4], 10_000.0, 2, 2, 1, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[2, 5, 4]);
        let v = t.to_vec3::<f32>().unwrap();
        // Image token (1, 1) is at (0, 0, 0); its last pair's frequency is 1/100.
        assert!(v[0][4].iter().all(|c| (*c - 1.0).abs() < 1e-7));
        assert!(v[1][4].iter().all(|s| s.abs() < 1e-7));
        // Text token 0 is at 1 on every axis: angles 1, 1, 1 and 1/100.
        assert!((v[0][0][3] - (0.01f32).cos()).abs() < 1e-7);
        assert!((v[1][0][2] - 1f32.sin()).abs() < 1e-7);
    }
}
