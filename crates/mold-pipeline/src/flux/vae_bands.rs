//! The decoder's image split into row bands, one per device, each band decoded by its own
//! host thread ([`crate::flux::vae_nhwc`] runs one band's layers through a [`Band`]).
//! Exact, not approximate: what crosses between bands is what the whole image's decode
//! would read there.
//!
//! - a 3×3 convolution reads one row beyond its band on either side: [`Band::halo`] copies
//!   the neighbours' edge rows in before it (the image's own edges stay zero-padded);
//! - a group norm's statistics are the whole image's: each band's (count, mean, squared
//!   deviations) per group are copied to every band's device and merged there (Chan's
//!   formula, f64; on CUDA one small kernel), so every band is normalised with the same
//!   coefficients ([`Band::norm`]);
//! - the mid attention reads every pixel: each band gathers the normalised input of all
//!   bands ([`Band::gather`]) for its keys and values and keeps its own rows' queries.
//!
//! **Threads.** Band 0 runs on the calling thread, every other band on a thread of its
//! own, each queuing only its own device's work. (Before, one thread queued every band's
//! ~180 operations in turn, each exchange joining both devices' streams, and four bands of a
//! 1024² image took longer than one GPU's whole decode; the threaded decode is not yet
//! measured across GPUs: BENCHMARKS.md.) The bands meet at each exchange on a [`Board`]:
//! each posts what the others need (contiguous, with a [`Ready`] point recorded on its own
//! stream) and each copies what it needs onto its own device itself, after the sender's
//! point on the GPU ([`mold_exec::runtime::pull`]) — the hosts wait only for each other's
//! posts, never for a GPU. What a band posted stays on the board until the decode ends and
//! every band's stream is done, so no copy reads memory its sender has freed; a post owns
//! its memory (an edge row is copied out of its activation, which would otherwise be kept
//! whole to the end).

use crate::error::{PipelineError, Result};
pub use crate::nhwc::Halo;
use candle_core::{Device, Tensor};
use mold_exec::model::group_norm::{
    group_norm_apply_nhwc, group_norm_coefficients_nhwc, group_stats_nhwc,
};
use mold_exec::runtime::{pull, ready, Ready};
use mold_exec::Kernels;
use std::sync::{Condvar, Mutex};

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

/// The devices of a banded decode, in band order (band 0 holds the image's top rows).
pub struct Bands<'a> {
    devices: &'a [Device],
    peer_copies: bool,
    kernels: Kernels,
}

/// What one band posted at one exchange: its tensors, done at `ready`.
#[derive(Clone)]
struct Post {
    tensors: Vec<Tensor>,
    ready: Ready,
}

/// Every band's posts, exchange by exchange, kept until the decode ends.
struct Board {
    k: usize,
    state: Mutex<BoardState>,
    posted: Condvar,
}

#[derive(Default)]
struct BoardState {
    /// `rounds[i][b]`: band `b`'s post at exchange `i`.
    rounds: Vec<Vec<Option<Post>>>,
    /// The band that failed first, and why: the others leave at their next exchange.
    failed: Option<(usize, String)>,
}

impl Board {
    fn new(k: usize) -> Board {
        Board {
            k,
            state: Mutex::new(BoardState::default()),
            posted: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Band `b`'s post at exchange `round`; every band's once all have posted.
    fn exchange(&self, round: usize, b: usize, post: Post) -> Result<Vec<Post>> {
        let mut g = self.lock();
        while g.rounds.len() <= round {
            g.rounds.push(vec![None; self.k]);
        }
        g.rounds[round][b] = Some(post);
        self.posted.notify_all();
        loop {
            if let Some((f, why)) = &g.failed {
                return Err(component(format!(
                    "band {b} stopped: band {f} failed: {why}"
                )));
            }
            if g.rounds[round].iter().all(Option::is_some) {
                return Ok(g.rounds[round].iter().flatten().cloned().collect());
            }
            g = self.posted.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Band `b` failed: every band stops at its next exchange (the first failure is kept).
    fn fail(&self, b: usize, why: String) {
        let mut g = self.lock();
        g.failed.get_or_insert((b, why));
        self.posted.notify_all();
    }

    /// The band that failed first.
    fn first_failed(&self) -> Option<usize> {
        self.lock().failed.as_ref().map(|f| f.0)
    }
}

/// Marks the board failed when a band's thread unwinds (a panic) without having said why.
struct FailOnUnwind<'a>(&'a Board, usize);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(self.1, "panicked".into());
        }
    }
}

fn component(message: String) -> PipelineError {
    PipelineError::Component {
        component: "vae".into(),
        message,
    }
}

/// A band's neighbours' edge rows on its device: the last row of the band above and the
/// first row of the band below, `None` at the image's edges.
type Edges = (Option<Tensor>, Option<Tensor>);

/// One band of a decode, as its thread sees the others: its exchanges.
pub struct Band<'a> {
    b: usize,
    devices: &'a [Device],
    peer_copies: bool,
    kernels: Kernels,
    board: &'a Board,
    /// This band's exchanges so far (every band meets the others in the same order).
    round: std::cell::Cell<usize>,
}

impl Band<'_> {
    /// This band's position (0: the image's top rows).
    pub fn index(&self) -> usize {
        self.b
    }

    fn len(&self) -> usize {
        self.devices.len()
    }

    fn device(&self) -> &Device {
        &self.devices[self.b]
    }

    /// Posts `tensors` (made contiguous here) and returns every band's posts.
    fn exchange(&self, tensors: Vec<Tensor>) -> Result<Vec<Post>> {
        let tensors = tensors
            .into_iter()
            .map(|t| t.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let at = match tensors.first() {
            Some(t) => ready(t)?,
            None => Ready::default(),
        };
        let round = self.round.get();
        self.round.set(round + 1);
        self.board
            .exchange(round, self.b, Post { tensors, ready: at })
    }

    /// Tensor `i` of `post`, copied onto this band's device.
    fn take(&self, post: &Post, i: usize) -> Result<Tensor> {
        Ok(pull(
            &post.tensors[i],
            &post.ready,
            self.device(),
            self.peer_copies,
        )?)
    }

    /// Posts this band's edge rows (first, last) after `extra` and returns, with every
    /// band's posts, this band's neighbours' edge rows: (the last row of the band above, the
    /// first row of the band below), `None` at the image's edges. The edge rows sit at
    /// positions `extra.len()` and `extra.len() + 1` of each post.
    fn edges_with(&self, x: &Tensor, extra: Vec<Tensor>) -> Result<(Vec<Post>, Edges)> {
        let at = extra.len();
        let rows = x.dim(1)?;
        let mut post = extra;
        // Copies: a view would keep the whole activation on the board to the end.
        post.push(x.narrow(1, 0, 1)?.force_contiguous()?);
        post.push(x.narrow(1, rows - 1, 1)?.force_contiguous()?);
        let posts = self.exchange(post)?;
        let above = match self.b {
            0 => None,
            b => Some(self.take(&posts[b - 1], at + 1)?),
        };
        let below = match self.b + 1 < self.len() {
            true => Some(self.take(&posts[self.b + 1], at)?),
            false => None,
        };
        Ok((posts, (above, below)))
    }

    /// `x` between the edge rows `e`.
    fn surround(x: &Tensor, e: Edges) -> Result<Halo> {
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

    /// This band with its neighbours' edge rows around it (one row each side).
    pub fn halo(&self, x: &Tensor) -> Result<Halo> {
        if self.len() == 1 {
            return Ok(Halo::bare(x.clone()));
        }
        let (_, e) = self.edges_with(x, Vec::new())?;
        Self::surround(x, e)
    }

    /// The group norm of the whole image on this band: every band's statistics copied here
    /// and merged, then this band (with its neighbours' edge rows when `halo`, which travel
    /// in the same exchange) normalised with them. `(gamma, beta)` are on this band's
    /// device; `single` runs the one-band case (the fused norm of
    /// [`mold_exec::model::group_norm::group_norm_nhwc`]).
    #[allow(clippy::too_many_arguments)]
    pub fn norm(
        &self,
        x: &Tensor,
        (gamma, beta): (&Tensor, &Tensor),
        groups: usize,
        eps: f32,
        silu: bool,
        halo: bool,
        single: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Halo> {
        if self.len() == 1 {
            return Ok(Halo::bare(single(x)?));
        }
        let stats = group_stats_nhwc(x, groups, self.kernels)?;
        let (posts, e) = if halo {
            self.edges_with(x, vec![stats])?
        } else {
            (self.exchange(vec![stats])?, (None, None))
        };
        let all = posts
            .iter()
            .map(|p| self.take(p, 0))
            .collect::<Result<Vec<_>>>()?;
        let all = Tensor::stack(&all, 0)?;
        let ab = group_norm_coefficients_nhwc(&all, gamma, beta, eps, self.kernels)?;
        let h = Self::surround(x, e)?;
        Ok(Halo {
            t: group_norm_apply_nhwc(&h.t, &ab, silu, self.kernels)?,
            top: h.top,
            bottom: h.bottom,
        })
    }

    /// The whole image (every band's `x`, joined along the rows) on this band's device.
    pub fn gather(&self, x: &Tensor) -> Result<Tensor> {
        if self.len() == 1 {
            return Ok(x.clone());
        }
        let posts = self.exchange(vec![x.clone()])?;
        let parts = posts
            .iter()
            .enumerate()
            .map(|(b, p)| match b == self.b {
                true => Ok(x.clone()),
                false => self.take(p, 0),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// Every band's `y` joined along `dim` on band 0's device (`Some` there, `None` on the
    /// other bands).
    pub fn join(&self, y: &Tensor, dim: usize) -> Result<Option<Tensor>> {
        if self.len() == 1 {
            return Ok(Some(y.clone()));
        }
        let posts = self.exchange(vec![y.clone()])?;
        if self.b != 0 {
            return Ok(None);
        }
        let parts = posts
            .iter()
            .enumerate()
            .map(|(b, p)| match b {
                0 => Ok(y.clone()),
                _ => self.take(p, 0),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&parts, dim)?))
    }
}

/// What one band's decode returns to [`Bands::run`]: the joined image on band 0, nothing
/// elsewhere; and the band's own account (for example what ran).
pub type BandOut<S> = (Option<Tensor>, S);

impl<'a> Bands<'a> {
    /// `peer_copies`: rows move by peer copies where a pair of GPUs allows it, else through
    /// host memory ([`mold_exec::runtime::pull`]).
    pub fn new(devices: &'a [Device], peer_copies: bool, kernels: Kernels) -> Bands<'a> {
        Bands {
            devices,
            peer_copies,
            kernels,
        }
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// `x` `(n, h, w, c)` (on band 0's device, queued by this thread) cut into the bands'
    /// rows, each band's rows run by `f` on its device and thread — band 0's on this thread
    /// with `first` (band 0's extra argument, e.g. a profiler's marks) — and the image band
    /// 0's `f` joins returned with every band's account. With several bands, returns once
    /// every band's work is done on its device; one band runs on this thread as `f` queues
    /// it.
    pub fn run<S: Send, A>(
        &self,
        x: &Tensor,
        first: A,
        f: impl Fn(&Band, Tensor, Option<A>) -> Result<BandOut<S>> + Sync,
    ) -> Result<(Tensor, Vec<S>)> {
        let k = self.len();
        let rows = x.dim(1)?;
        if k == 0 || rows < k {
            return Err(component(format!(
                "{rows} latent rows cannot be split into {k} bands: decode on fewer devices"
            )));
        }
        if k == 1 {
            // The one-device decode: on this thread, nothing to wait for.
            let me = Band {
                b: 0,
                devices: self.devices,
                peer_copies: self.peer_copies,
                kernels: self.kernels,
                board: &Board::new(1),
                round: std::cell::Cell::new(0),
            };
            let (y, s) = f(&me, x.clone(), Some(first))?;
            let y = y.ok_or_else(|| component("band 0 joined no image".into()))?;
            return Ok((y, vec![s]));
        }
        let parts = band_rows(rows, k)
            .into_iter()
            .map(|(s, e)| Ok(x.narrow(1, s, e - s)?.contiguous()?))
            .collect::<Result<Vec<Tensor>>>()?;
        let at = ready(&parts[k - 1])?;
        let board = Board::new(k);
        let band = |b: usize| Band {
            b,
            devices: self.devices,
            peer_copies: self.peer_copies,
            kernels: self.kernels,
            board: &board,
            round: std::cell::Cell::new(0),
        };
        // A band's thread: its rows onto its device, its decode, then its stream drained
        // (so that what it posted or read is no longer in use when the board drops).
        let one = |b: usize, a: Option<A>| -> Result<BandOut<S>> {
            let _unwind = FailOnUnwind(&board, b);
            let me = band(b);
            let out = pull(&parts[b], &at, me.device(), self.peer_copies)
                .map_err(PipelineError::from)
                .and_then(|xb| f(&me, xb, a));
            if let Err(e) = &out {
                board.fail(b, e.to_string());
            }
            let drained = me.device().synchronize();
            let out = out?;
            drained?;
            Ok(out)
        };
        let (first_out, rest) = std::thread::scope(|scope| {
            let handles: Vec<_> = (1..k)
                .map(|b| {
                    let one = &one;
                    let h = std::thread::Builder::new()
                        .name(format!("vae-band-{b}"))
                        .spawn_scoped(scope, move || one(b, None));
                    if let Err(e) = &h {
                        // No thread will post for this band: the others must not wait.
                        board.fail(b, format!("no thread: {e}"));
                    }
                    h
                })
                .collect();
            let first_out = one(0, Some(first));
            let rest: Vec<Result<BandOut<S>>> = handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(component(format!("band {} panicked", i + 1)))),
                    Err(e) => Err(component(format!("band {}: no thread: {e}", i + 1))),
                })
                .collect();
            (first_out, rest)
        });
        // The error of the band that failed first (the others only stopped for it).
        let mut outs: Vec<Result<BandOut<S>>> = std::iter::once(first_out).chain(rest).collect();
        if outs.iter().any(|o| o.is_err()) {
            let first = board
                .first_failed()
                .filter(|&b| outs[b].is_err())
                .or_else(|| outs.iter().position(|o| o.is_err()))
                .unwrap_or(0);
            return match outs.swap_remove(first) {
                Err(e) => Err(e),
                Ok(_) => Err(component("a band failed".into())),
            };
        }
        let mut accounts = Vec::with_capacity(k);
        let mut image = None;
        for (y, s) in outs.into_iter().flatten() {
            image = image.or(y);
            accounts.push(s);
        }
        let image = image.ok_or_else(|| component("band 0 joined no image".into()))?;
        Ok((image, accounts))
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

    fn rows(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Each band, on its own thread, gets its rows, its neighbours' edge rows, the whole
    /// image, and band 0 the joined image.
    #[test]
    fn halo_rows_come_from_the_neighbours() {
        let devs = vec![Device::Cpu; 3];
        let bands = Bands::new(&devs, true, Kernels::Auto);
        let x = Tensor::arange(0f32, 7.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 7, 1, 1))
            .unwrap();
        let want_own = [vec![0., 1., 2.], vec![3., 4.], vec![5., 6.]];
        let want_halo = [
            (vec![0., 1., 2., 3.], (0, 1)),
            (vec![2., 3., 4., 5.], (1, 1)),
            (vec![4., 5., 6.], (1, 0)),
        ];
        let (joined, seen) = bands
            .run(&x, (), |band, xb, _| {
                let b = band.index();
                assert_eq!(rows(&xb), want_own[b]);
                let h = band.halo(&xb)?;
                assert_eq!((rows(&h.t), (h.top, h.bottom)), want_halo[b]);
                assert_eq!(rows(&band.gather(&xb)?), rows(&x));
                Ok((band.join(&xb, 1)?, b))
            })
            .unwrap();
        assert_eq!(rows(&joined), rows(&x));
        assert_eq!(seen, [0, 1, 2]);
        // More bands than rows is refused in words.
        let e = bands
            .run(&x.narrow(1, 0, 2).unwrap(), (), |_, _, _| Ok((None, ())))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot be split into 3 bands"), "{e}");
    }

    /// A band that fails stops the others at their next exchange (none waits forever), and
    /// its own reason is the one returned; a panicking band likewise.
    #[test]
    fn a_failing_band_stops_the_others() {
        let devs = vec![Device::Cpu; 4];
        let bands = Bands::new(&devs, true, Kernels::Auto);
        let x = Tensor::zeros((1, 8, 2, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = bands
            .run(&x, (), |band, xb, _| {
                if band.index() == 2 {
                    return Err(component("band two's own trouble".into()));
                }
                for _ in 0..3 {
                    band.halo(&xb)?;
                }
                Ok((band.join(&xb, 1)?, ()))
            })
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("band two's own trouble"), "{e}");
        let e = bands
            .run(&x, (), |band, xb, _| {
                if band.index() == 1 {
                    panic!("band one panics");
                }
                band.halo(&xb)?;
                Ok((band.join(&xb, 1)?, ()))
            })
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("panicked"), "{e}");
    }
}
