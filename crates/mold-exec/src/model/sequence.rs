//! Sequence parallelism (Ulysses): the ranks of a sequence-parallel group each hold a
//! slice of the tokens and every weight of their tensor-parallel shard. Everything but
//! attention works token by token, so it runs on the rank's slice as is; attention needs
//! every token, so an all-to-all turns the token slices of all heads into all tokens of
//! a slice of the heads, attention runs on those, and a second all-to-all turns them back.
//!
//! Neither tokens nor heads need divide evenly ([`split`]): the all-to-alls carry each
//! rank's own counts, so nothing is padded and the result equals one rank's computation
//! (up to the attention kernel's own rounding). Each rank needs at least one head.

use super::Ctx;
use candle_core::{IndexOp, Result, Shape, Tensor};
use std::ops::Range;

/// Rank `rank`'s share of `n` tokens over `world` ranks: contiguous, the first `n %
/// world` ranks one token more.
pub fn split(n: usize, rank: usize, world: usize) -> Range<usize> {
    let (q, r) = (n / world, n % world);
    let start = rank * q + rank.min(r);
    start..start + q + usize::from(rank < r)
}

/// Attention over the whole sequence for a rank that holds a slice of it.
///
/// `q`, `k`, `v` are `(b, heads, L_r, head_dim)`: this rank's tokens (normed and rotated
/// with their own positions) for every head of the rank's tensor-parallel shard;
/// `lens[j]` is how many tokens rank j of `ctx.sp` holds. Returns `(b, L_r, heads ·
/// head_dim)` for this rank's tokens. The keys arrive in rank order, not in sequence
/// order; attention does not depend on the order of the keys (each key comes with its
/// value), and each query's output goes back to the rank that holds it.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[usize], ctx: &Ctx) -> Result<Tensor> {
    let sp = ctx.sp;
    let (n, me) = (sp.world_size(), sp.rank());
    if n == 1 {
        return local(q, k, v, ctx);
    }
    let (b, heads, l, d) = q.dims4()?;
    if lens.len() != n || lens[me] != l {
        candle_core::bail!(
            "sequence parallel attention: rank {me} of {n} holds {l} tokens, shares {lens:?}"
        );
    }
    if heads < n {
        candle_core::bail!("sequence parallel attention: {n} ranks but {heads} heads");
    }
    let hr = |j: usize| split(heads, j, n);
    let hs = hr(me).len();
    // Every rank's tokens of this rank's heads come back.
    let send = stack_heads(q, k, v, n)?;
    let shapes: Vec<Shape> = lens.iter().map(|&lj| (3, b, hs, lj, d).into()).collect();
    let got = sp.all_to_all(&send, &shapes)?;
    drop(send);
    let all = join_tokens(&got)?;
    drop(got);
    ctx.mark("all-to-all (q, k, v)", &all);
    let out = local(&all.i(0)?, &all.i(1)?, &all.i(2)?, ctx)?; // (b, L, hs·d)
    drop(all);
    // Each rank's tokens back to it; the head groups side by side, in rank order.
    let mut send = Vec::with_capacity(n);
    let mut off = 0;
    for &lj in lens {
        send.push(out.narrow(1, off, lj)?.contiguous()?);
        off += lj;
    }
    let shapes: Vec<Shape> = (0..n).map(|j| (b, l, hr(j).len() * d).into()).collect();
    let got = sp.all_to_all(&send, &shapes)?;
    let out = join_heads(&got)?;
    ctx.mark("all-to-all (output)", &out);
    Ok(out)
}

/// The messages of the q/k/v all-to-all: heads `split(heads, j, n)` of `q`, `k` and `v`
/// (`(b, heads, L, d)`) for rank j, stacked into one `(3, b, heads_j, L, d)` (one copy,
/// one message). The calibration times these layout copies as they run here.
pub(crate) fn stack_heads(q: &Tensor, k: &Tensor, v: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let heads = q.dim(1)?;
    (0..n)
        .map(|j| {
            let h = split(heads, j, n);
            let pick = |t: &Tensor| t.narrow(1, h.start, h.len());
            Tensor::stack(&[pick(q)?, pick(k)?, pick(v)?], 0)
        })
        .collect()
}

/// The q/k/v pieces received from every rank (`(3, b, hs, L_j, d)`) put together along
/// the tokens.
pub(crate) fn join_tokens(got: &[Tensor]) -> Result<Tensor> {
    Tensor::cat(got, 3)
}

/// The attention output's pieces received from every rank (`(b, L, hs_j · d)`) put
/// together along the features, in rank order.
pub(crate) fn join_heads(got: &[Tensor]) -> Result<Tensor> {
    Tensor::cat(got, 2)
}

fn local(q: &Tensor, k: &Tensor, v: &Tensor, ctx: &Ctx) -> Result<Tensor> {
    let out = crate::model::attention::attention_with(ctx.kernels, q, k, v, ctx.meter)?;
    ctx.mark("attention", &out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
