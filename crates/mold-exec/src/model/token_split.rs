//! Token-split tensor parallelism ([`crate::comm::CommOptions::token_split`]; FLUX and
//! Qwen-Image): between products each rank of a tensor-parallel group holds a share of the
//! text tokens and a share of the image tokens, so the norms, modulation and gated
//! residuals are not repeated on every rank.
//!
//! Shares are equal, as NCCL's all-gather and reduce-scatter need: `ceil(n / world)` rows
//! of a stream of `n` tokens, rank `r` holding tokens `r · share ..` of it, the rows past
//! the stream's end zero (only the last ranks have any). A stream gathered from its shares
//! is the stream followed by those padding rows, which are cut off; a partial sum is
//! padded before it is reduce-scattered. Single-stream blocks gather both shares of every
//! rank side by side ([`TokenSplit::gather_single`]): the tokens rank by rank, padding
//! left out, attended with the rotation table laid out alike (FLUX's `shared_pe`).

use crate::model::mat::{Input, Mat};
use crate::model::modulation::ModOut;
use crate::model::Ctx;
use candle_core::Tensor;
use std::ops::Range;

type CResult<T> = candle_core::Result<T>;

/// Rank `rank` of a tensor-parallel group of `world` holds its share of the group's `txt`
/// text and `img` image tokens (its sequence-parallel slice, or the whole sequence); `pe`
/// is the group's rotation table in the sequence's order (text, then image), restored
/// when a single-stream part gathers.
#[derive(Clone, Debug)]
pub struct TokenSplit {
    pub rank: usize,
    pub world: usize,
    pub txt: usize,
    pub img: usize,
    pub pe: Tensor,
}

impl TokenSplit {
    /// The split of `txt` text and `img` image tokens over the tensor-parallel group, where
    /// it applies: token split asked for and a group of two or more.
    fn of(txt: usize, img: usize, pe: &Tensor, ctx: &Ctx) -> Option<TokenSplit> {
        let world = ctx.comm.world_size();
        (ctx.token_split && world > 1 && txt + img > 0).then(|| TokenSplit {
            rank: ctx.comm.rank(),
            world,
            txt,
            img,
            pe: pe.clone(),
        })
    }

    /// Rows of a text and of an image share.
    pub(crate) fn share_lens(&self) -> (usize, usize) {
        (self.txt.div_ceil(self.world), self.img.div_ceil(self.world))
    }

    /// Rank `r`'s text and image tokens (empty past a stream's end).
    pub(crate) fn ranges(&self, r: usize) -> (Range<usize>, Range<usize>) {
        let (t, i) = self.share_lens();
        let range = |share: usize, n: usize| (r * share).min(n)..((r + 1) * share).min(n);
        (range(t, self.txt), range(i, self.img))
    }

    /// Whether any share holds padding rows.
    fn padded(&self) -> bool {
        !(self.txt.is_multiple_of(self.world) && self.img.is_multiple_of(self.world))
    }

    /// This rank's shares of the whole streams `txt` and `img` (`(b, n, h)` each), padded.
    fn shares(&self, txt: &Tensor, img: &Tensor) -> CResult<(Tensor, Tensor)> {
        let (t, i) = self.ranges(self.rank);
        let (ts, is) = self.share_lens();
        Ok((
            take(txt, t, ts)?.contiguous()?,
            take(img, i, is)?.contiguous()?,
        ))
    }

    /// The text and image streams of a part's first block as this rank's shares where the
    /// group splits them ([`TokenSplit::of`]); streams already split (`split`) pass as
    /// they are. Returns the text, the image and the split.
    pub(crate) fn streams(
        split: Option<TokenSplit>,
        txt: Tensor,
        img: Tensor,
        pe: &Tensor,
        ctx: &Ctx,
    ) -> CResult<(Tensor, Tensor, Option<TokenSplit>)> {
        if split.is_some() {
            return Ok((txt, img, split));
        }
        match TokenSplit::of(txt.dim(1)?, img.dim(1)?, pe, ctx) {
            Some(s) => {
                let (t, i) = s.shares(&txt, &img)?;
                Ok((t, i, Some(s)))
            }
            None => Ok((txt, img, None)),
        }
    }

    /// One stream gathered from every rank's share (`(b, share, h)`): `(b, n, h)`, the
    /// stream in order.
    pub(crate) fn gather_stream(&self, share: &Tensor, n: usize, ctx: &Ctx) -> CResult<Tensor> {
        gather(share, ctx)?.narrow(1, 0, n)
    }

    /// Single-stream tokens gathered from every rank's shares (`(b, ts + is, h)`, text share
    /// then image share): every rank's text tokens then its image tokens, rank by rank,
    /// padding left out.
    pub(crate) fn gather_single(&self, share: &Tensor, ctx: &Ctx) -> CResult<Tensor> {
        let all = gather(share, ctx)?;
        if !self.padded() {
            return Ok(all);
        }
        let (ts, is) = self.share_lens();
        let mut real = Vec::with_capacity(2 * self.world);
        for r in 0..self.world {
            let (t, i) = self.ranges(r);
            let at = r * (ts + is);
            real.push(all.narrow(1, at, t.len())?);
            real.push(all.narrow(1, at + ts, i.len())?);
        }
        Tensor::cat(&real, 1)
    }

    /// The whole sequence (`(b, txt + img, h)`, text then image) from single-stream tokens
    /// laid out rank by rank as [`TokenSplit::gather_single`] gives them.
    pub(crate) fn unshare(&self, ranked: &Tensor) -> CResult<Tensor> {
        let mut txt = Vec::with_capacity(self.world);
        let mut img = Vec::with_capacity(self.world);
        let mut at = 0;
        for r in 0..self.world {
            let (t, i) = self.ranges(r);
            txt.push(ranked.narrow(1, at, t.len())?);
            img.push(ranked.narrow(1, at + t.len(), i.len())?);
            at += t.len() + i.len();
        }
        txt.extend(img);
        Tensor::cat(&txt, 1)
    }

    /// The sums over the group of a single-stream partial product (`(b, txt + img, h)`,
    /// rank by rank as [`TokenSplit::gather_single`] lays it out): this rank's text share
    /// then image share, `(b, ts + is, h)`.
    pub(crate) fn scatter_single(&self, partial: &Tensor, ctx: &Ctx) -> CResult<Tensor> {
        if !self.padded() {
            return scatter(partial, ctx);
        }
        let (ts, is) = self.share_lens();
        let mut pieces = Vec::with_capacity(4 * self.world);
        let mut at = 0;
        for r in 0..self.world {
            let (t, i) = self.ranges(r);
            pieces.push(take(partial, at..at + t.len(), ts)?);
            at += t.len();
            pieces.push(take(partial, at..at + i.len(), is)?);
            at += i.len();
        }
        scatter(&Tensor::cat(&pieces, 1)?, ctx)
    }

    /// The sums over the group of both streams' partial products (`(b, txt, h)` and `(b,
    /// img, h)`): this rank's text and image shares, from one reduce-scatter of the
    /// partials laid out rank by rank (each rank's text share, then its image share).
    pub(crate) fn scatter_streams(
        &self,
        txt: Tensor,
        img: Tensor,
        ctx: &Ctx,
    ) -> CResult<(Tensor, Tensor)> {
        let (ts, is) = self.share_lens();
        let mut pieces = Vec::with_capacity(2 * self.world);
        for r in 0..self.world {
            let (t, i) = self.ranges(r);
            pieces.push(take(&txt, t, ts)?);
            pieces.push(take(&img, i, is)?);
        }
        let laid = Tensor::cat(&pieces, 1)?;
        drop((pieces, txt, img));
        ctx.meter.see(&laid);
        let share = scatter(&laid, ctx)?;
        Ok((share.narrow(1, 0, ts)?, share.narrow(1, ts, is)?))
    }

    /// Checks that the group gathering is the one that split.
    pub(crate) fn check(&self, ctx: &Ctx) -> CResult<()> {
        let (w, r) = (ctx.comm.world_size(), ctx.comm.rank());
        if (w, r) != (self.world, self.rank) {
            candle_core::bail!(
                "token share of rank {} of {} gathered by rank {r} of {w}",
                self.rank,
                self.world
            );
        }
        Ok(())
    }
}

/// Which stream of a double-stream block a share belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Txt,
    Img,
}

/// `share` (this rank's normed share of stream `side` under `split`) as the whole stream, for
/// a column-parallel product: gathered where the tokens are split, else `share` itself.
pub(crate) fn whole(
    split: Option<&TokenSplit>,
    share: Tensor,
    side: Side,
    ctx: &Ctx,
) -> CResult<Tensor> {
    match split {
        Some(s) => {
            let n = if side == Side::Txt { s.txt } else { s.img };
            s.gather_stream(&share, n, ctx)
        }
        None => Ok(share),
    }
}

/// `layer_norm(x) * (1 + scale) + shift` of this rank's share `x` of stream `side` as the
/// input of the column-parallel product `w`, `b` (`gelu`: through GELU): gathered whole
/// where the tokens are split ([`whole`]); else quantized per token in the norm's pass where
/// it is an FP8 product that takes that ([`ModOut::norm_scale_shift_for`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn whole_input(
    split: Option<&TokenSplit>,
    m: &ModOut,
    x: &Tensor,
    eps: f32,
    (w, b): (&Mat, &Tensor),
    gelu: bool,
    side: Side,
    ctx: &Ctx,
) -> CResult<Input> {
    let k = ctx.kernels;
    match split {
        Some(_) => Ok(Input::Dense(whole(
            split,
            m.norm_scale_shift(x, eps, k)?,
            side,
            ctx,
        )?)),
        None => {
            let fp8 = w.takes_rows(x, &[(Some(b), gelu)], k);
            m.norm_scale_shift_for(x, eps, fp8, k)
        }
    }
}

/// Rows `rows` of `t` (`(b, n, h)`), then zero rows up to `len`: `(b, len, h)` (a view
/// where nothing is padded).
fn take(t: &Tensor, rows: Range<usize>, len: usize) -> CResult<Tensor> {
    let real = t.narrow(1, rows.start, rows.len())?;
    let pad = len - rows.len();
    if pad == 0 {
        return Ok(real);
    }
    let (b, _, h) = t.dims3()?;
    let zeros = Tensor::zeros((b, pad, h), t.dtype(), t.device())?;
    Tensor::cat(&[&real, &zeros], 1)
}

/// Every rank's `t` (`(b, m, h)`) along the tokens, in rank order: `(b, m · world, h)`.
/// Above batch 1 the gathered samples are interleaved back (one copy).
fn gather(t: &Tensor, ctx: &Ctx) -> CResult<Tensor> {
    let (b, m, h) = t.dims3()?;
    let n = ctx.comm.world_size();
    let g = ctx.comm.all_gather_cat(&t.contiguous()?)?;
    if b == 1 {
        return g.reshape((1, n * m, h));
    }
    g.reshape((n, b, m, h))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((b, n * m, h))
}

/// The sum over the group of `t` (`(b, L, h)`, `L` a multiple of the group's size), this
/// rank's `L / world` tokens of it. Above batch 1 each rank's tokens of every sample are
/// laid side by side first (one copy).
fn scatter(t: &Tensor, ctx: &Ctx) -> CResult<Tensor> {
    let (b, l, h) = t.dims3()?;
    let n = ctx.comm.world_size();
    if !l.is_multiple_of(n) {
        candle_core::bail!("token split: {l} tokens do not split over {n} ranks");
    }
    let laid = if b == 1 {
        t.reshape((l, h))?
    } else {
        t.reshape((b, n, l / n, h))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n * b, l / n, h))?
    };
    ctx.comm.reduce_scatter_sum(&laid)?.reshape((b, l / n, h))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares cover each stream once, in rank order, padding only at the end.
    #[test]
    fn shares_cover_the_streams_with_padding_at_the_end() {
        let pe = Tensor::zeros(
            (2, 1, 14, 4),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for (txt, img, world) in [(7, 7, 2), (8, 6, 4), (1, 13, 4), (5, 0, 3)] {
            let s = TokenSplit {
                rank: 0,
                world,
                txt,
                img,
                pe: pe.clone(),
            };
            let (ts, is) = s.share_lens();
            let (mut t_at, mut i_at) = (0, 0);
            for r in 0..world {
                let (t, i) = s.ranges(r);
                assert_eq!((t.start, i.start), (t_at, i_at), "{txt} {img} {world} {r}");
                assert!(t.len() <= ts && i.len() <= is);
                (t_at, i_at) = (t.end, i.end);
            }
            assert_eq!((t_at, i_at), (txt, img));
            assert_eq!(s.padded(), ts * world != txt || is * world != img);
        }
    }
}
