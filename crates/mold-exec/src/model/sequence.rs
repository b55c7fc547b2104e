//! Sequence parallelism (Ulysses): the ranks of a sequence-parallel group each hold a
//! slice of the tokens and every weight of their tensor-parallel shard. Everything but
//! attention works token by token, so it runs on the rank's slice as is; attention needs
//! every token, so an all-to-all turns the token slices of all heads into all tokens of
//! a slice of the heads, attention runs on those, and a second all-to-all turns them back.
//!
//! Neither tokens nor heads need divide evenly ([`split`]): the all-to-alls carry each
//! rank's own counts, so nothing is padded and the result equals one rank's computation
//! (up to the attention kernel's own rounding). Each rank needs at least one head.

use super::attention::Fp8Scales;
use super::fp8::Fp8Rows;
use super::mat::Input;
use super::{ops, Ctx};
use crate::comm::Exchange;
use candle_core::{DType, Device, IndexOp, Result, Shape, Tensor};
use std::ops::Range;

/// Rank `rank`'s share of `n` tokens over `world` ranks: contiguous, the first `n %
/// world` ranks one token more.
pub fn split(n: usize, rank: usize, world: usize) -> Range<usize> {
    let (q, r) = (n / world, n % world);
    let start = rank * q + rank.min(r);
    start..start + q + usize::from(rank < r)
}

/// q, k and v of this rank's tokens, ready for [`attention`].
pub enum Qkv {
    /// Each `(b, heads, L_r, head_dim)`: every head of the rank's tensor-parallel shard.
    Heads(Tensor, Tensor, Tensor),
    /// [`Qkv::Heads`] with the three tensors' largest magnitudes, partial maxima `(3,
    /// parts, stride)` f32 the fused preparation took as it wrote them
    /// ([`ops::qkv_prep_fused_amax`]): FP8 attention's scales on one rank without a pass
    /// of their own.
    Measured(Tensor, Tensor, Tensor, Tensor),
    /// The q/k/v all-to-all's messages, as [`messages`] lays them out (or the fused
    /// preparation writes them, `ops::qkv_prep_fused_groups`): message j `(L_r, 3, b,
    /// heads_j, head_dim)`, heads `split(heads, j, n)` of q, k and v token-major. `recv`,
    /// where given, is the buffer the pieces are received into, `(L, 3, b, heads_r,
    /// head_dim)`, the rank's own piece already in it (and message `rank` a view of it).
    /// `amax`: the partial maxima `(3, parts, stride)` f32 of this rank's q, k and v (every
    /// head) where the fused preparation took them, for the e4m3 exchange
    /// ([`exchange_e4m3`]).
    Messages {
        send: Vec<Tensor>,
        recv: Option<Tensor>,
        amax: Option<Tensor>,
    },
}

impl Qkv {
    /// Prepared q, k, v `(b, heads, L_r, head_dim)` as [`attention`] takes them in a
    /// sequence-parallel group of `n`: as they are for one rank, else as the messages.
    pub fn new(q: Tensor, k: Tensor, v: Tensor, n: usize) -> Result<Qkv> {
        if n <= 1 {
            return Ok(Qkv::Heads(q, k, v));
        }
        Ok(Qkv::Messages {
            send: messages(&q, &k, &v, n)?,
            recv: None,
            amax: None,
        })
    }
}

/// Attention over the whole sequence for a rank that holds a slice of it: [`start`],
/// [`QkvInFlight::attend`] and [`OutInFlight::finish`] one after the other, with nothing
/// queued between them.
/// `fp8`: attention in FP8 ([`fp8_attention`]); on one rank its e4m3 output may come back
/// as it is, for the output projection's FP8 product ([`Input::Fp8`]).
pub fn attention(qkv: Qkv, lens: &[usize], fp8: bool, ctx: &Ctx) -> Result<Input> {
    start(qkv, lens, fp8, ctx)?.attend(ctx)?.finish(ctx)
}

/// Whether q, k and v reach FP8 attention in e4m3 under sequence parallelism (`--fp8-attention`
/// over a sequence-parallel group; `MOLD_FP8_EXCHANGE=wide` sends them in the activations'
/// dtype instead): each rank takes the largest magnitudes of its q, k and v (every head,
/// its tokens), the group all-gathers them, every rank quantizes its messages with the one
/// scale per tensor they give — the scale one GPU takes over the whole tensors — and sends
/// e4m3, half the bytes; attention reads the received buffer in place, and its e4m3 output
/// goes back in e4m3 and on to the output projection as its quantized rows
/// ([`Input::Fp8`]), as on one GPU: no pass takes the maxima of the received heads, none
/// quantizes them, none widens the output, the projection does not round it again. Where
/// cuDNN's FP8 attention runs (CUDA: bf16/f16, head size 64 or 128, Hopper or later,
/// libraries allowed) and in the CPU emulation; elsewhere they go in the activations'
/// dtype and each rank quantizes what it receives. Depends only on what every rank of a
/// group of like GPUs shares, so every rank decides alike.
pub fn exchange_e4m3(dtype: DType, d: usize, device: &Device, kernels: ops::Kernels) -> bool {
    if !super::fp8::options().exchange_e4m3 {
        return false;
    }
    match device {
        Device::Cpu => true,
        Device::Cuda(_) => {
            matches!(dtype, DType::BF16 | DType::F16)
                && matches!(d, 64 | 128)
                && kernels.uses_libraries()
                && super::attention::fp8_attention_available(device)
        }
        _ => false,
    }
}

/// Whether a block whose weights are held in FP8 (`fp8_block`) runs its attention in FP8:
/// where the run asks for it ([`Ctx::fp8_attention`]: the plan's `attention: fp8`, or
/// `MOLD_FP8_ATTENTION=on`; [`crate::model::attention::fp8_attention`]); otherwise in the
/// activations' dtype.
pub fn fp8_attention(fp8_block: bool, ctx: &Ctx) -> bool {
    fp8_block && ctx.fp8_attention
}

/// The q/k/v all-to-all started ([`start`]); work queued before [`QkvInFlight::attend`]
/// runs while it moves, on the GPU's compute stream beside the exchange where the group
/// runs exchanges on a side stream (`Comm::all_to_all_start`).
pub struct QkvInFlight<'a> {
    state: QkvState<'a>,
    /// Attention in FP8 ([`fp8_attention`]).
    fp8: bool,
}

enum QkvState<'a> {
    /// One rank: nothing to exchange (with the maxima of [`Qkv::Measured`]).
    Local(Tensor, Tensor, Tensor, Option<Tensor>),
    Moving {
        exchange: Box<dyn Exchange + 'a>,
        lens: Vec<usize>,
        /// The heads each rank's attention covers (message j's).
        heads_each: Vec<usize>,
        /// Batch and head size.
        b: usize,
        d: usize,
        /// Where q, k and v come in e4m3 ([`exchange_e4m3`]): their scales, and the
        /// activations' dtype.
        e4m3: Option<(Fp8Scales, DType)>,
    },
}

/// The attention output's all-to-all started ([`QkvInFlight::attend`]); work queued
/// before [`OutInFlight::finish`] runs while it moves, as for [`QkvInFlight`].
pub struct OutInFlight<'a> {
    state: OutState<'a>,
}

enum OutState<'a> {
    Done(Input),
    Moving(Box<dyn Exchange + 'a>),
    /// FP8 attention's output coming back in e4m3, every token with v's scale.
    MovingE4m3 {
        exchange: Box<dyn Exchange + 'a>,
        scales: Fp8Scales,
        dtype: DType,
        b: usize,
    },
}

/// Starts attention over the whole sequence for a rank that holds a slice of it: the
/// q/k/v all-to-all.
///
/// `qkv` holds this rank's tokens (normed and rotated with their own positions) for
/// every head of the rank's tensor-parallel shard; `lens[j]` is how many tokens rank j of
/// `ctx.sp` holds. [`OutInFlight::finish`] gives `(b, L_r, heads · head_dim)` for this
/// rank's tokens. The keys arrive in rank order, not in sequence order; attention does
/// not depend on the order of the keys (each key comes with its value), and each query's
/// output goes back to the rank that holds it.
///
/// The messages are token-major, so the pieces every rank sends here, received one after
/// another into one buffer (`Comm::all_to_all_cat`), are `(L, 3, b, heads_r, head_dim)`:
/// attention reads q, k and v from it in place, with strides, and nothing is copied to
/// put the pieces together. The fused preparation (CUDA, head size 64 or 128) writes the
/// rank's own piece straight into that buffer, so there only the output's pieces are
/// joined by a copy; the candle path makes the messages and the buffer by copies.
pub fn start<'a>(qkv: Qkv, lens: &[usize], fp8: bool, ctx: &Ctx<'a>) -> Result<QkvInFlight<'a>> {
    let sp = ctx.sp;
    let (n, me) = (sp.world_size(), sp.rank());
    let (send, into, amax) = match qkv {
        Qkv::Heads(q, k, v) if n == 1 => {
            return Ok(QkvInFlight {
                state: QkvState::Local(q, k, v, None),
                fp8,
            })
        }
        Qkv::Measured(q, k, v, amax) if n == 1 => {
            return Ok(QkvInFlight {
                state: QkvState::Local(q, k, v, Some(amax)),
                fp8,
            })
        }
        // The maxima are of this rank's tokens of every head, not of every token of the
        // heads its attention covers: not used.
        Qkv::Heads(q, k, v) | Qkv::Measured(q, k, v, _) => (messages(&q, &k, &v, n)?, None, None),
        Qkv::Messages { send, recv, amax } => (send, recv, amax),
    };
    if send.len() != n || lens.len() != n {
        candle_core::bail!(
            "sequence parallel attention: rank {me} of {n} has {} messages, shares {lens:?}",
            send.len()
        );
    }
    let (l, _, b, hs, d) = send[me].dims5()?;
    // Message j carries rank j's heads; they add up to this rank's.
    let heads_each: Vec<usize> = send.iter().map(|t| t.dim(3)).collect::<Result<_>>()?;
    if lens[me] != l {
        candle_core::bail!(
            "sequence parallel attention: rank {me} of {n} holds {l} tokens, shares {lens:?}"
        );
    }
    // Every rank's tokens of this rank's heads come back, one after another.
    let shapes: Vec<Shape> = lens.iter().map(|&lj| (lj, 3, b, hs, d).into()).collect();
    let dtype = send[me].dtype();
    let (send, into, e4m3) = if fp8 && exchange_e4m3(dtype, d, send[me].device(), ctx.kernels) {
        let (send, recv, scales) = quantize_for_exchange(send, amax, lens, b, ctx)?;
        (send, recv, Some((scales, dtype)))
    } else {
        (send, into, None)
    };
    let exchange = sp.all_to_all_start(send, shapes, Some(into))?;
    Ok(QkvInFlight {
        fp8,
        state: QkvState::Moving {
            exchange,
            lens: lens.to_vec(),
            heads_each,
            b,
            d,
            e4m3,
        },
    })
}

/// The q/k/v messages in e4m3 ([`exchange_e4m3`]): this rank's maxima (the preparation's
/// `amax`, else taken from the messages), every rank's exchanged, the messages quantized
/// with the scales they give. Returns the e4m3 messages, the receive buffer (on CUDA, the
/// own piece already in it) and the scales.
fn quantize_for_exchange(
    send: Vec<Tensor>,
    amax: Option<Tensor>,
    lens: &[usize],
    b: usize,
    ctx: &Ctx,
) -> Result<(Vec<Tensor>, Option<Tensor>, Fp8Scales)> {
    let (n, me) = (ctx.sp.world_size(), ctx.sp.rank());
    let local = match amax {
        Some(a) => a,
        None => messages_amax(&send)?,
    };
    // Every rank's maxima by an all-gather (NCCL's on GPUs, queued on the compute stream:
    // the ranks' threads do not meet as for the copy engines' all-to-alls), then `(3, n ·
    // parts, stride)`: every rank's partial maxima of q, then of k, then of v.
    let (three, parts, stride) = local.dims3()?;
    let maxima = ctx
        .sp
        .all_gather_cat(&local.contiguous()?)?
        .reshape((n, three, parts, stride))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((three, n * parts, stride))?;
    ctx.mark("q/k/v scales (all-gather)", &maxima);
    // The rows of this rank's attention output once its heads come back (the GPU's
    // per-token scales; the emulation makes its own).
    let tokens = b * lens[me];
    #[cfg(feature = "cuda")]
    if send[me].device().is_cuda() {
        let before: usize = lens[..me].iter().sum();
        let total: usize = lens.iter().sum();
        let q = super::fp8::cuda::quantize_messages(&send, me, (before, total), &maxima, tokens)?;
        ctx.mark("q/k/v to e4m3", &q.recv);
        let scales = Fp8Scales::Device {
            scales: q.scales,
            v_tokens: q.v_tokens,
        };
        return Ok((q.send, Some(q.recv), scales));
    }
    let _ = tokens;
    let a: Vec<f32> = maxima.flatten_from(1)?.max(1)?.to_vec1()?;
    let amax = [a[0], a[1], a[2]];
    let send = send
        .iter()
        .map(|m| super::fp8::quantize_thirds_host(m, amax))
        .collect::<Result<Vec<_>>>()?;
    Ok((send, None, Fp8Scales::Host(amax)))
}

/// The largest magnitudes of q, k and v in messages `(L, 3, b, heads_j, d)`, `(3, 1, 1)`
/// f32 (NaN skipped where the backend's maximum skips it).
fn messages_amax(send: &[Tensor]) -> Result<Tensor> {
    let each = send
        .iter()
        .map(|m| {
            m.abs()?
                .transpose(0, 1)?
                .flatten_from(1)?
                .max(1)?
                .to_dtype(DType::F32)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&each, 0)?.max(0)?.reshape((3, 1, 1))
}

impl<'a> QkvInFlight<'a> {
    /// Waits for q, k and v, runs attention over this rank's heads and starts sending
    /// each rank its tokens back.
    pub fn attend(self, ctx: &Ctx<'a>) -> Result<OutInFlight<'a>> {
        let fp8 = self.fp8;
        let (exchange, lens, heads_each, b, d, e4m3) = match self.state {
            QkvState::Local(q, k, v, amax) => {
                return Ok(OutInFlight {
                    state: OutState::Done(local(&q, &k, &v, amax.as_ref(), fp8, ctx)?),
                })
            }
            QkvState::Moving {
                exchange,
                lens,
                heads_each,
                b,
                d,
                e4m3,
            } => (exchange, lens, heads_each, b, d, e4m3),
        };
        let all = exchange
            .finish()?
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("all-to-all: nothing received".into()))?;
        ctx.mark("all-to-all (q, k, v)", &all);
        let out = match &e4m3 {
            // (b, L, hs·d) e4m3, every token with v's scale: sent back as it is.
            Some((scales, dtype)) => {
                let out = super::attention::fp8_attention_tokens(&all, scales, *dtype, ctx.meter)?;
                ctx.mark("attention", &out);
                out
            }
            None => {
                // (b, hs, L, d) views of the (L, 3, b, hs, d) buffer.
                let part = |i: usize| all.i((.., i))?.permute((1, 2, 0, 3));
                // (b, L, hs·d), widened to be sent.
                local(&part(0)?, &part(1)?, &part(2)?, None, fp8, ctx)?.widen()?
            }
        };
        drop(all);
        // Each rank's tokens back to it; the head groups side by side, in rank order.
        let send = token_pieces(&out, &lens)?;
        drop(out);
        let me = ctx.sp.rank();
        let shapes: Vec<Shape> = heads_each
            .iter()
            .map(|&h| (b, lens[me], h * d).into())
            .collect();
        let exchange = ctx.sp.all_to_all_start(send, shapes, None)?;
        let state = match e4m3 {
            Some((scales, dtype)) => OutState::MovingE4m3 {
                exchange,
                scales,
                dtype,
                b,
            },
            None => OutState::Moving(exchange),
        };
        Ok(OutInFlight { state })
    }
}

impl OutInFlight<'_> {
    /// This rank's tokens of attention over every head, `(b, L_r, heads · head_dim)`
    /// (FP8 attention's e4m3 rows as they are on one rank).
    pub fn finish(self, ctx: &Ctx) -> Result<Input> {
        match self.state {
            OutState::Done(t) => Ok(t),
            OutState::Moving(exchange) => {
                let out = join_heads(&exchange.finish()?)?;
                ctx.mark("all-to-all (output)", &out);
                Ok(Input::Dense(out))
            }
            OutState::MovingE4m3 {
                exchange,
                scales,
                dtype,
                b,
            } => {
                // The head groups side by side, (b, L_r, heads · d) e4m3: one scale for all.
                let out = join_heads(&exchange.finish()?)?;
                ctx.mark("all-to-all (output)", &out);
                let (_, l, k) = out.dims3()?;
                let rows = out.reshape((b * l, k))?;
                let s = scales.v_descale(b * l, rows.device())?;
                Ok(Input::Fp8(Fp8Rows::new(rows, s, &[b, l, k], dtype)?))
            }
        }
    }
}

/// Each rank's tokens of `(b, L, w)`, contiguous, in rank order (`lens[j]` tokens for rank
/// j): the attention output's all-to-all back.
fn token_pieces(out: &Tensor, lens: &[usize]) -> Result<Vec<Tensor>> {
    let mut off = 0;
    lens.iter()
        .map(|&lj| {
            let t = out.narrow(1, off, lj)?.contiguous();
            off += lj;
            t
        })
        .collect()
}

/// q, k, v for [`attention`] by the fused preparation (CUDA; the families' blocks check
/// `ops::qkv_prep_supported` first), with the RoPE tables `(cos, sin)`: on one rank
/// `(b, heads, L, d)` — where attention runs in FP8 (`fp8`, [`fp8_attention`]) with their
/// largest magnitudes taken in the same pass ([`Qkv::Measured`]); under sequence
/// parallelism written as the all-to-all's messages, this rank's own piece straight into
/// the buffer the others' arrive in — after the tokens of the ranks before it, `lens` being
/// every rank's count.
pub fn prepare_fused(
    segs: &[ops::QkvSegment],
    heads: usize,
    (cos, sin): (&Tensor, &Tensor),
    eps: f32,
    lens: &[usize],
    fp8: bool,
    ctx: &Ctx,
) -> Result<Qkv> {
    let (n, me) = (ctx.sp.world_size(), ctx.sp.rank());
    if n == 1 && fp8 {
        let (t, amax) = ops::qkv_prep_fused_amax(segs, heads, cos, sin, eps)?;
        ctx.mark("qk norm + rope + layout", &t);
        return Ok(Qkv::Measured(t.i(0)?, t.i(1)?, t.i(2)?, amax));
    }
    if n == 1 {
        let t = ops::qkv_prep_fused(segs, heads, cos, sin, eps)?;
        ctx.mark("qk norm + rope + layout", &t);
        return Ok(Qkv::Heads(t.i(0)?, t.i(1)?, t.i(2)?));
    }
    if lens.len() != n {
        candle_core::bail!("sequence parallel attention: {n} ranks, shares {lens:?}");
    }
    // With q, k and v sent in e4m3 the maxima are taken as they are written, and the own
    // piece stays among the messages: it is quantized into the receive buffer.
    let first = segs[0].qkv;
    let d = segs[0].q_scale.dims1()?;
    let e4m3 = fp8 && exchange_e4m3(first.dtype(), d, first.device(), ctx.kernels);
    let own = ops::OwnPiece {
        rank: me,
        before: lens[..me].iter().sum(),
        total: lens.iter().sum(),
    };
    let own = (!e4m3).then_some(own);
    let m = ops::qkv_prep_fused_groups(segs, heads, n, own, e4m3, cos, sin, eps)?;
    ctx.mark("qk norm + rope + layout", &m.send[n - 1]);
    Ok(Qkv::Messages {
        send: m.send,
        recv: m.recv,
        amax: m.amax,
    })
}

/// The messages of the q/k/v all-to-all from q, k, v `(b, heads, L, d)`: message j
/// `(L, 3, b, heads_j, d)` holds heads `split(heads, j, n)` of the three, token-major,
/// contiguous. The fused q/k/v preparation writes the same bytes without this copy.
pub fn messages(q: &Tensor, k: &Tensor, v: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let heads = q.dim(1)?;
    if heads < n {
        candle_core::bail!("sequence parallel attention: {n} ranks but {heads} heads");
    }
    (0..n)
        .map(|j| {
            let h = split(heads, j, n);
            let pick = |t: &Tensor| t.narrow(1, h.start, h.len());
            Tensor::stack(&[pick(q)?, pick(k)?, pick(v)?], 0)? // (3, b, hs, L, d)
                .permute((3, 0, 1, 2, 4))?
                .contiguous()
        })
        .collect()
}

/// The attention output's pieces received from every rank (`(b, L, hs_j · d)`) put
/// together along the features, in rank order (one vectorised copy per piece on CUDA).
/// The calibration times this copy as it runs here.
pub(crate) fn join_heads(got: &[Tensor]) -> Result<Tensor> {
    crate::model::ops::join_columns(got)
}

fn local(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    amax: Option<&Tensor>,
    fp8: bool,
    ctx: &Ctx,
) -> Result<Input> {
    use crate::model::attention::{attention_with, fp8_attention};
    let out = if fp8 {
        fp8_attention(ctx.kernels, q, k, v, amax, ctx.meter)?
    } else {
        Input::Dense(attention_with(ctx.kernels, q, k, v, ctx.meter)?)
    };
    ctx.mark("attention", out.tensor());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Message j holds heads `split(heads, j, n)` of q, k and v token-major, `(L, 3, b,
    /// heads_j, d)`: the layout the fused preparation writes and attention reads in place
    /// once the pieces of every rank are put one after another. Uneven heads included.
    #[test]
    fn messages_are_each_rank_s_heads_token_major() {
        use candle_core::Device;
        let (b, heads, l, d) = (2usize, 5usize, 3usize, 4usize);
        let make = |c: usize| {
            let v: Vec<f32> = (0..b * heads * l * d)
                .map(|i| (1000 * c + i) as f32)
                .collect();
            Tensor::from_vec(v, (b, heads, l, d), &Device::Cpu).unwrap()
        };
        let (q, k, v) = (make(0), make(1), make(2));
        for n in [1usize, 2, 3, 5] {
            let m = messages(&q, &k, &v, n).unwrap();
            assert_eq!(m.len(), n);
            for (j, piece) in m.iter().enumerate() {
                let h = split(heads, j, n);
                assert_eq!(piece.dims(), &[l, 3, b, h.len(), d], "n {n} j {j}");
                assert!(piece.is_contiguous());
                let flat: Vec<f32> = piece.flatten_all().unwrap().to_vec1().unwrap();
                let mut i = 0;
                for t in 0..l {
                    for (c, src) in [&q, &k, &v].into_iter().enumerate() {
                        for bi in 0..b {
                            for hh in h.clone() {
                                let row: Vec<f32> = src.i((bi, hh, t)).unwrap().to_vec1().unwrap();
                                assert_eq!(&flat[i..i + d], &row[..], "n {n} j {j} t {t} c {c}");
                                i += d;
                            }
                        }
                    }
                }
            }
        }
        assert!(messages(&q, &k, &v, 6).is_err(), "more ranks than heads");
        assert!(matches!(
            Qkv::new(q.clone(), k.clone(), v.clone(), 1).unwrap(),
            Qkv::Heads(..)
        ));
        assert!(matches!(
            Qkv::new(q, k, v, 2).unwrap(),
            Qkv::Messages { send, recv: None, amax: None } if send.len() == 2
        ));
    }

    /// FP8 attention over a sequence-parallel group (CPU emulation; q, k and v sent in e4m3
    /// with the scales the group agrees on, the output back in e4m3) gives every rank the
    /// rows one rank computes for its tokens, bit for bit, with the same scale: uneven
    /// tokens and heads, and a batch of two (each rank's tokens of each sample), included.
    /// Quantizing each rank's received heads with scales of its own (the exchange in the
    /// activations' dtype) does not.
    #[test]
    fn fp8_attention_over_a_group_equals_one_rank_bit_for_bit() {
        for b in [1usize, 2] {
            fp8_attention_over_a_group(b);
        }
    }

    fn fp8_attention_over_a_group(b: usize) {
        use crate::comm::{Comm, ThreadComm};
        use crate::model::ActivationMeter;
        use crate::Kernels;
        use candle_core::Device;
        let (heads, l, d) = (5usize, 7usize, 8usize);
        // Each head's values on its own scale, so per-head maxima differ from the whole's.
        let make = |seed: u64| {
            let v: Vec<f32> = (0..b * heads * l * d)
                .map(|i| {
                    let x = ((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0;
                    x * (1 + (i / (l * d)) % heads) as f32
                })
                .collect();
            Tensor::from_vec(v, (b, heads, l, d), &Device::Cpu).unwrap()
        };
        let (q, k, v) = (make(1), make(2), make(3));
        let run = |world: usize| -> Vec<(Vec<u8>, Vec<f32>)> {
            let comms = ThreadComm::group(world);
            std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        let (q, k, v) = (&q, &k, &v);
                        s.spawn(move || {
                            let meter = ActivationMeter::default();
                            let ctx = Ctx {
                                comm: &crate::comm::LocalComm,
                                sp: c,
                                meter: &meter,
                                kernels: Kernels::Candle,
                                token_split: false,
                                profile: None,
                                ahead: None,
                                slot: 0,
                                fp8_attention: true,
                            };
                            let lens: Vec<usize> =
                                (0..world).map(|r| split(l, r, world).len()).collect();
                            let mine = split(l, c.rank(), world);
                            let pick = |t: &Tensor| t.narrow(2, mine.start, mine.len()).unwrap();
                            let qkv = Qkv::new(pick(q), pick(k), pick(v), world).unwrap();
                            let Input::Fp8(rows) = attention(qkv, &lens, true, &ctx).unwrap()
                            else {
                                panic!("FP8 attention's rows");
                            };
                            assert_eq!(rows.dims(), &[b, mine.len(), heads * d]);
                            let vals: Vec<u8> = rows
                                .rows()
                                .values()
                                .flatten_all()
                                .unwrap()
                                .to_vec1::<float8::F8E4M3>()
                                .unwrap()
                                .iter()
                                .map(|x| x.to_bits())
                                .collect();
                            let sc: Vec<f32> = rows.rows().scales().to_vec1().unwrap();
                            (vals, sc)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let one = run(1).pop().unwrap();
        let width = heads * d;
        for world in [2usize, 3] {
            let got = run(world);
            // Sample by sample, each rank's tokens in rank order: one rank's rows.
            let (mut vals, mut sc) = (Vec::new(), Vec::new());
            for bi in 0..b {
                for (r, (v, s)) in got.iter().enumerate() {
                    let lr = split(l, r, world).len();
                    vals.extend_from_slice(&v[bi * lr * width..(bi + 1) * lr * width]);
                    sc.extend_from_slice(&s[bi * lr..(bi + 1) * lr]);
                }
            }
            assert_eq!(vals, one.0, "batch {b}, world {world}: values");
            assert_eq!(sc, one.1, "batch {b}, world {world}: scales");
        }
        // The exchange in the activations' dtype: each rank's scales are of its own heads.
        let wide = crate::model::attention::fp8_attention_rows_reference(
            &q.narrow(1, 0, 3).unwrap(),
            &k.narrow(1, 0, 3).unwrap(),
            &v.narrow(1, 0, 3).unwrap(),
            &ActivationMeter::default(),
        )
        .unwrap();
        let s0: Vec<f32> = wide.rows().scales().to_vec1().unwrap();
        assert_ne!(
            s0[0], one.1[0],
            "the heads of rank 0 alone have another v scale"
        );
    }

    #[test]
    fn split_covers_every_token_once_in_order() {
        for n in 0..40 {
            for world in 1..9 {
                let mut next = 0;
                for r in 0..world {
                    let s = split(n, r, world);
                    assert_eq!(s.start, next, "n {n} world {world} rank {r}");
                    assert!(s.len() == n / world || s.len() == n / world + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(split(10, 0, 3), 0..4);
        assert_eq!(split(10, 2, 3), 7..10);
    }
}
