//! The decoder's image split into row bands, one per device ([`crate::flux::vae_nhwc`] runs
//! every layer band by band). Exact, not approximate: what crosses between bands is what
//! the whole image's decode would read there.
//!
//! - a 3×3 convolution reads one row beyond its band on either side: [`Bands::halo`] copies
//!   the neighbours' edge rows in before it (the image's own edges stay zero-padded);
//! - a group norm's statistics are the whole image's: each band's (count, mean, squared
//!   deviations) per group are copied to every band's device and merged there (Chan's
//!   formula, f64; on CUDA one small kernel), so every band is normalised with the same
//!   coefficients ([`Bands::norm`]);
//! - the mid attention reads every pixel: each band gathers the normalised input of all
//!   bands ([`Bands::gather`]) for its keys and values and keeps its own rows' queries.
//!
//! One thread queues every band's work, layer by layer. A tensor moves between devices
//! through the [`Mover`] the caller gives: on GPUs, peer copies ordered by events (the
//! receiving stream waits for the sender's on the GPU), so the host queues the whole decode
//! without waiting for a GPU; through host memory where a pair has no peer access.

use crate::error::{PipelineError, Result};
use candle_core::{Device, Tensor};
use mold_exec::model::group_norm::{
    group_norm_apply_nhwc, group_norm_coefficients_nhwc, group_stats_nhwc,
};
use mold_exec::Kernels;

/// Moves a tensor to a band's device.
pub type Mover<'a> = &'a (dyn Fn(&Tensor, &Device) -> candle_core::Result<Tensor> + Sync);

/// A band's activation with the neighbours' rows around it: `top` rows above its own and
/// `bottom` below (0 at the image's edges, and everywhere with one band).
pub struct Halo {
    pub t: Tensor,
    pub top: usize,
    pub bottom: usize,
}

impl Halo {
    /// A band without neighbours' rows.
    pub fn bare(t: Tensor) -> Halo {
        Halo {
            t,
            top: 0,
            bottom: 0,
        }
    }
}

/// The devices of a banded decode, in band order (band 0 holds the image's top rows).
pub struct Bands<'a> {
    devices: &'a [Device],
    mover: Mover<'a>,
    kernels: Kernels,
}

/// The rows `[start, end)` of `k` bands over `rows` rows: as even as can be, the first bands
/// one row longer where `k` does not divide `rows`.
pub fn band_rows(rows: usize, k: usize) -> Vec<(usize, usize)> {
    let k = k.max(1);
    let (q, r) = (rows / k, rows % k);
    let mut out = Vec::with_capacity(k);
    let mut start = 0;
    for b in 0..k {
        let len = q + usize::from(b < r);
        out.push((start, start + len));
        start += len;
    }
    out
}

impl<'a> Bands<'a> {
    pub fn new(devices: &'a [Device], mover: Mover<'a>, kernels: Kernels) -> Bands<'a> {
        Bands {
            devices,
            mover,
            kernels,
        }
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    fn to(&self, t: &Tensor, b: usize) -> Result<Tensor> {
        if t.device().same_device(&self.devices[b]) {
            return Ok(t.clone());
        }
        Ok((self.mover)(&t.contiguous()?, &self.devices[b])?)
    }

    /// `x` `(n, h, w, c)` on any device, cut into the bands' rows, each on its device.
    pub fn split(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let rows = x.dim(1)?;
        if rows < self.len() {
            return Err(PipelineError::Component {
                component: "vae".into(),
                message: format!(
                    "{rows} latent rows cannot be split into {} bands: decode on fewer devices",
                    self.len()
                ),
            });
        }
        band_rows(rows, self.len())
            .into_iter()
            .enumerate()
            .map(|(b, (s, e))| self.to(&x.narrow(1, s, e - s)?, b))
            .collect()
    }

    /// Each band's neighbours' edge rows on its device: (the last row of the band above, the
    /// first row of the band below), `None` at the image's edges.
    fn edges(&self, xs: &[Tensor]) -> Result<Vec<(Option<Tensor>, Option<Tensor>)>> {
        let k = xs.len();
        (0..k)
            .map(|b| {
                let above = match b {
                    0 => None,
                    _ => {
                        let r = &xs[b - 1];
                        Some(self.to(&r.narrow(1, r.dim(1)? - 1, 1)?, b)?)
                    }
                };
                let below = match b + 1 < k {
                    true => Some(self.to(&xs[b + 1].narrow(1, 0, 1)?, b)?),
                    false => None,
                };
                Ok((above, below))
            })
            .collect()
    }

    /// `x` between the edge rows `e`.
    fn surround(x: &Tensor, e: (Option<Tensor>, Option<Tensor>)) -> Result<Halo> {
        let (above, below) = e;
        let (top, bottom) = (usize::from(above.is_some()), usize::from(below.is_some()));
        if top + bottom == 0 {
            return Ok(Halo::bare(x.clone()));
        }
        let parts: Vec<Tensor> = above
            .into_iter()
            .chain(std::iter::once(x.clone()))
            .chain(below)
            .collect();
        Ok(Halo {
            t: Tensor::cat(&parts, 1)?,
            top,
            bottom,
        })
    }

    /// Each band with its neighbours' edge rows around it (one row each side).
    ///
    /// Every copy of an exchange is queued before any band's work on what it copied: a copy
    /// orders the two devices' streams (each waits for the other's work queued so far), so
    /// a band's work queued between two copies would hold up every band after it.
    pub fn halo(&self, xs: &[Tensor]) -> Result<Vec<Halo>> {
        if xs.len() == 1 {
            return Ok(vec![Halo::bare(xs[0].clone())]);
        }
        let edges = self.edges(xs)?;
        xs.iter()
            .zip(edges)
            .map(|(x, e)| Self::surround(x, e))
            .collect()
    }

    /// The group norm of the whole image, band by band: every band's statistics gathered on
    /// every band's device and merged there, then each band (with its neighbours' edge rows
    /// when `halo`) normalised with them. `params[b]` is the norm's `(gamma, beta)` on band
    /// `b`'s device; `single` runs the one-band case (the fused norm of
    /// [`mold_exec::model::group_norm::group_norm_nhwc`]). As in [`Bands::halo`], every copy
    /// is queued before any band's norm.
    #[allow(clippy::too_many_arguments)]
    pub fn norm(
        &self,
        xs: &[Tensor],
        params: &[(&Tensor, &Tensor)],
        groups: usize,
        eps: f32,
        silu: bool,
        halo: bool,
        single: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Halo>> {
        if xs.len() == 1 {
            return Ok(vec![Halo::bare(single(&xs[0])?)]);
        }
        let stats: Vec<Tensor> = xs
            .iter()
            .map(|x| group_stats_nhwc(x, groups, self.kernels))
            .collect::<candle_core::Result<_>>()?;
        // The copies: every band's statistics to every band, the edge rows.
        let gathered: Vec<Vec<Tensor>> = (0..xs.len())
            .map(|b| stats.iter().map(|s| self.to(s, b)).collect())
            .collect::<Result<_>>()?;
        let edges = if halo {
            self.edges(xs)?
        } else {
            vec![(None, None); xs.len()]
        };
        // Then each band's work.
        xs.iter()
            .zip(edges)
            .zip(gathered)
            .zip(params)
            .map(|(((x, e), all), (gamma, beta))| {
                let all = Tensor::stack(&all, 0)?;
                let ab = group_norm_coefficients_nhwc(&all, gamma, beta, eps, self.kernels)?;
                let h = Self::surround(x, e)?;
                Ok(Halo {
                    t: group_norm_apply_nhwc(&h.t, &ab, silu, self.kernels)?,
                    top: h.top,
                    bottom: h.bottom,
                })
            })
            .collect()
    }

    /// The whole image on every band's device: band `b` gets every other band's rows (all
    /// copies queued before the joins, as in [`Bands::halo`]).
    pub fn gather(&self, xs: &[Tensor]) -> Result<Vec<Tensor>> {
        if xs.len() == 1 {
            return Ok(vec![xs[0].clone()]);
        }
        let copies: Vec<Vec<Tensor>> = (0..xs.len())
            .map(|b| xs.iter().map(|x| self.to(x, b)).collect())
            .collect::<Result<_>>()?;
        copies
            .iter()
            .map(|parts| Ok(Tensor::cat(parts, 1)?))
            .collect()
    }

    /// The bands joined along `dim` on the first band's device.
    pub fn join(&self, ys: &[Tensor], dim: usize) -> Result<Tensor> {
        if ys.len() == 1 {
            return Ok(ys[0].clone());
        }
        let parts: Vec<Tensor> = ys.iter().map(|y| self.to(y, 0)).collect::<Result<_>>()?;
        Ok(Tensor::cat(&parts, dim)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cover_the_rows_evenly_in_order() {
        assert_eq!(band_rows(8, 4), [(0, 2), (2, 4), (4, 6), (6, 8)]);
        assert_eq!(band_rows(7, 3), [(0, 3), (3, 5), (5, 7)]);
        assert_eq!(band_rows(5, 1), [(0, 5)]);
        for rows in 1..40 {
            for k in 1..=rows.min(8) {
                let r = band_rows(rows, k);
                assert_eq!(r.len(), k);
                assert_eq!((r[0].0, r[k - 1].1), (0, rows));
                assert!(r.windows(2).all(|w| w[0].1 == w[1].0));
                let lens: Vec<usize> = r.iter().map(|(s, e)| e - s).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn halo_rows_come_from_the_neighbours() {
        let devs = vec![Device::Cpu; 3];
        let mv = |t: &Tensor, d: &Device| t.to_device(d);
        let bands = Bands::new(&devs, &mv, Kernels::Auto);
        let x = Tensor::arange(0f32, 7.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 7, 1, 1))
            .unwrap();
        let xs = bands.split(&x).unwrap();
        let rows = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            xs.iter().map(rows).collect::<Vec<_>>(),
            [vec![0., 1., 2.], vec![3., 4.], vec![5., 6.]]
        );
        let h = bands.halo(&xs).unwrap();
        assert_eq!(rows(&h[0].t), [0., 1., 2., 3.]);
        assert_eq!((h[0].top, h[0].bottom), (0, 1));
        assert_eq!(rows(&h[1].t), [2., 3., 4., 5.]);
        assert_eq!((h[1].top, h[1].bottom), (1, 1));
        assert_eq!(rows(&h[2].t), [4., 5., 6.]);
        assert_eq!((h[2].top, h[2].bottom), (1, 0));
        for g in bands.gather(&xs).unwrap() {
            assert_eq!(rows(&g), rows(&x));
        }
        assert_eq!(rows(&bands.join(&xs, 1).unwrap()), rows(&x));
        // More bands than rows is refused in words.
        let e = bands
            .split(&x.narrow(1, 0, 2).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot be split into 3 bands"), "{e}");
    }
}
