//! Collective communication between the ranks of a group: a tensor-parallel group
//! (all-reduce, all-gather) or a sequence-parallel one (all-to-all).
//!
//! Model code sees only the [`Comm`] trait. Implementations:
//! - [`LocalComm`]: a group of one (no communication).
//! - [`ThreadComm`]: ranks are threads of this process; tensors are staged through host
//!   memory and summed in rank order, so every rank gets bit-identical results. It is
//!   the implementation for emulated devices and works (slowly) for any candle device.
//! - [`TcpComm`]: ranks in several processes, host-staged over the [`crate::dist::Mesh`],
//!   bit-identical to [`ThreadComm`].
//! - `nccl::NcclComm` (feature `nccl`): one GPU per rank; all-reduce through NCCL on
//!   candle's compute streams, with a watchdog that aborts the group instead of hanging.
//! - [`HandOff`]: activations from one process to another (a part's output to the next
//!   part's process): NCCL send/recv between the two GPUs, else TCP.
//!
//! [`make_group`] picks the implementation for a group inside one process and
//! [`cross_process_group`] for a group that spans processes. Failures are typed
//! ([`CommError`]; [`root_cause`] picks the rank that failed first); settings come in
//! as [`CommOptions`].

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod board;
#[cfg(feature = "cuda")]
pub(crate) mod buffers;
#[cfg(feature = "cuda")]
mod copy_engine;
mod error;
mod group;
mod handoff;
mod options;
mod tcp;
mod thread;

#[cfg(feature = "nccl")]
pub mod nccl;

pub use error::{root_cause, AbortSignal, CommError};
pub use group::{cross_process_group, make_group};
pub use handoff::{decode_header, encode_header, HandOff};
pub use options::{
    timeout_secs, CommOptions, LargeGroupCopies, Secret, DEFAULT_DIST_TIMEOUT_S,
    DEFAULT_EXCHANGE_BESIDE, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_NCCL_TIMEOUT_S,
    DEFAULT_OVERLAP_CHUNKS, DEFAULT_PENDING_PER_ADDR, MAX_OVERLAP_CHUNKS, MAX_TIMEOUT_S,
};
pub use tcp::TcpComm;
pub use thread::ThreadComm;

use candle_core::{Result, Shape, Tensor};

/// A rank's handle on its tensor-parallel group.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum of `t` over all ranks; every rank must call it, in the same order,
    /// with tensors of the same shape and dtype. The result is on `t`'s device.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's `t`, stacked in rank order: shape `(world_size, ..t.shape)`. Every
    /// rank must call it with a tensor of the same shape and dtype.
    ///
    /// The provided implementation is an all-reduce of a `world_size`-times larger tensor
    /// that is zero except for this rank's slot, which is exact (x + 0 = x) and costs one
    /// all-reduce's latency: meant for small tensors (modulation vectors).
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.world_size();
        if n == 1 {
            return t.unsqueeze(0);
        }
        let zero = t.zeros_like()?.unsqueeze(0)?;
        let mine = t.unsqueeze(0)?;
        let slots: Vec<&Tensor> = (0..n)
            .map(|i| if i == self.rank() { &mine } else { &zero })
            .collect();
        self.all_reduce_sum(&Tensor::cat(&slots, 0)?)
    }
    /// Every rank's `t` concatenated along dimension 0 in rank order: shape
    /// `(world_size · d0, ..)`. Every rank must call it with a tensor of the same shape and
    /// dtype (token-split tensor parallelism: each rank's tokens, before a column-parallel
    /// product). The provided implementation reshapes [`Comm::all_gather`]'s stack.
    fn all_gather_cat(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.world_size();
        if n == 1 {
            return Ok(t.clone());
        }
        let mut dims = t.dims().to_vec();
        let Some(d0) = dims.first_mut() else {
            candle_core::bail!("all-gather: a scalar has no dimension 0");
        };
        *d0 *= n;
        self.all_gather(t)?.reshape(dims)
    }
    /// The element-wise sum of `t` over all ranks, of which this rank keeps slice `rank`
    /// of `world_size` equal slices along dimension 0 (token-split tensor parallelism: the
    /// sum of a row-parallel product, each rank keeping its tokens). Every rank must call
    /// it with tensors of the same shape and dtype, dimension 0 divisible by
    /// `world_size`. The provided implementation sums with [`Comm::all_reduce_sum`] and
    /// keeps its slice.
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.world_size();
        let d0 = match t.dims().first() {
            Some(d) if d % n == 0 => *d,
            _ => candle_core::bail!(
                "reduce-scatter of shape {:?}: dimension 0 must split evenly over {n} ranks",
                t.dims()
            ),
        };
        if n == 1 {
            return Ok(t.clone());
        }
        let m = d0 / n;
        self.all_reduce_sum(t)?
            .narrow(0, self.rank() * m, m)?
            .contiguous()
    }
    /// Sends `send[j]` to rank j and returns, in rank order, what every rank sent to this
    /// one; `recv[j]` is the shape rank j sends here. Every rank must call it, in the same
    /// order, with `world_size` tensors of one dtype each way; tensors may differ in shape
    /// between pairs (uneven sequence shards). `send[rank]` comes back as is. The results
    /// are contiguous, on the device of `send[rank]`.
    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> Result<Vec<Tensor>>;
    /// [`Comm::all_to_all`] with what every rank sent here put one after another along
    /// dimension 0, in rank order, in one contiguous tensor (the shapes in `recv` must
    /// agree past dimension 0). `into`, where given, is a contiguous buffer of that shape
    /// on this rank's device whose own piece already holds `send[rank]`'s values (the
    /// fused q/k/v preparation writes it there): a backend may receive into it and return
    /// it, so the own piece is not copied. The provided implementation concatenates
    /// [`Comm::all_to_all`]'s pieces (and ignores `into`); NCCL receives them into one
    /// buffer, `into` where given.
    fn all_to_all_cat(
        &self,
        send: &[Tensor],
        recv: &[Shape],
        into: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _ = into;
        cat_shape(recv)?;
        let got = self.all_to_all(send, recv)?;
        if got.len() == 1 {
            return got[0].contiguous();
        }
        Tensor::cat(&got, 0)
    }
    /// [`Comm::all_to_all`] (`into: None`, the pieces apart) or [`Comm::all_to_all_cat`]
    /// (`Some(into)`: one tensor, received into `into` where given) started now and
    /// finished by [`Exchange::finish`], so that work queued between the two, which must
    /// not read what arrives, may run while the pieces move (a one-process group of two GPUs with
    /// [`CommOptions::exchange_beside`]: by the copy engines, `copy_engine.rs`). Every rank must start
    /// and finish its exchanges in the same order, and start no other collective on this
    /// group between the two. The provided implementation exchanges now and hands the
    /// result back at `finish`.
    fn all_to_all_start(
        &self,
        send: Vec<Tensor>,
        recv: Vec<Shape>,
        into: Option<Option<Tensor>>,
    ) -> Result<Box<dyn Exchange + '_>> {
        let got = match into {
            None => self.all_to_all(&send, &recv)?,
            Some(buf) => vec![self.all_to_all_cat(&send, &recv, buf.as_ref())?],
        };
        Ok(Box::new(Exchanged(got)))
    }
    /// How many token chunks a row-parallel product is split into so that each chunk's
    /// sum over the group runs beside the next chunk's product ([`Comm::chunked_sum`]);
    /// 1: one sum after the whole product. The provided implementation says 1.
    fn overlap_chunks(&self) -> usize {
        1
    }
    /// A sum over the group of a partial product given in chunks along dimension 1
    /// (tokens), `total` long in all: each chunk's sum may start as soon as it is pushed,
    /// beside the work queued after it (NCCL: on a stream of its own). Every rank must
    /// push chunks of the same shapes in the same order. The provided implementation sums
    /// each chunk with [`Comm::all_reduce_sum`] when pushed and concatenates the sums.
    fn chunked_sum(&self, total: usize) -> Box<dyn ChunkedSum + '_> {
        Box::new(SerialSum {
            comm: self,
            total,
            sums: Vec::new(),
        })
    }
    /// Marks the group failed so the other ranks stop waiting for this one (called when a
    /// rank errors or panics); they then fail with [`CommError::PeerAborted`]. The
    /// default does nothing.
    fn abort(&self) {}
    /// Fails if the group failed since this rank's last collective (called after the
    /// rank's work is done, because a collective may fail after it was enqueued). The
    /// default has nothing to check.
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// An all-to-all started by [`Comm::all_to_all_start`].
pub trait Exchange {
    /// What every rank sent here, ordered after the exchange on this rank's stream: the
    /// pieces in rank order, or the one tensor they were received into.
    fn finish(self: Box<Self>) -> Result<Vec<Tensor>>;
}

/// [`Comm::all_to_all_start`]'s provided implementation: exchanged when started.
struct Exchanged(Vec<Tensor>);

impl Exchange for Exchanged {
    fn finish(self: Box<Self>) -> Result<Vec<Tensor>> {
        Ok(self.0)
    }
}

/// A sum over the group taken in chunks ([`Comm::chunked_sum`]).
pub trait ChunkedSum {
    /// The next chunk of the partial product, `(b, len, ..)`: its sum over the group starts.
    fn push(&mut self, partial: Tensor) -> Result<()>;
    /// The sums of every chunk, in order along dimension 1: `(b, total, ..)`. Fails
    /// unless the chunks pushed are `total` long together.
    fn finish(self: Box<Self>) -> Result<Tensor>;
}

/// [`Comm::chunked_sum`]'s provided implementation: each chunk summed when pushed.
struct SerialSum<'a, C: ?Sized> {
    comm: &'a C,
    total: usize,
    sums: Vec<Tensor>,
}

impl<C: Comm + ?Sized> ChunkedSum for SerialSum<'_, C> {
    fn push(&mut self, partial: Tensor) -> Result<()> {
        self.sums.push(self.comm.all_reduce_sum(&partial)?);
        Ok(())
    }
    fn finish(self: Box<Self>) -> Result<Tensor> {
        let len: usize = self.sums.iter().map(|t| t.dim(1)).sum::<Result<usize>>()?;
        if len != self.total || self.sums.is_empty() {
            return Err(CommError::Local(format!(
                "chunked sum: chunks {len} long in all, expected {}",
                self.total
            ))
            .into());
        }
        if self.sums.len() == 1 {
            return Ok(self.sums.into_iter().next().expect("one"));
        }
        Tensor::cat(&self.sums, 1)
    }
}

/// `n` token chunks of `total` tokens for [`Comm::chunked_sum`]: `(start, len)`, in
/// order, covering `0..total`, as even as multiples of `align` allow (the last takes the
/// rest); fewer when `total` is too short for `n` aligned chunks, at least one.
pub fn token_chunks(total: usize, n: usize, align: usize) -> Vec<(usize, usize)> {
    let align = align.max(1);
    let units = total / align;
    let n = n.max(1).min(units.max(1));
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let len = if i + 1 == n {
            total - start
        } else {
            // Even shares of the aligned units, rounded so the chunks stay aligned.
            (units * (i + 1) / n - units * i / n) * align
        };
        out.push((start, len));
        start += len;
    }
    out
}

/// The group of one: all-reduce is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalComm;

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> Result<Vec<Tensor>> {
        check_all_to_all(0, 1, send, recv)?;
        Ok(send.to_vec())
    }
}

/// The checks of [`Comm::all_to_all_cat`]'s `into`: a contiguous buffer of the pieces'
/// `shape`, of the dtype and on the device of this rank's own piece `own` (the GPU
/// backends receive into it).
#[cfg(feature = "cuda")]
pub(crate) fn check_cat_buffer(own: &Tensor, shape: &Shape, into: &Tensor) -> Result<()> {
    if into.shape() != shape
        || !into.is_contiguous()
        || into.dtype() != own.dtype()
        || !into.device().same_device(own.device())
    {
        return Err(CommError::Local(format!(
            "all_to_all_cat: a buffer {:?} {:?} for pieces of {shape:?} {:?}",
            into.shape(),
            into.dtype(),
            own.dtype()
        ))
        .into());
    }
    Ok(())
}

/// The shape of [`Comm::all_to_all_cat`]'s result: `recv`'s shapes one after another
/// along dimension 0. Fails unless they agree past it.
pub(crate) fn cat_shape(recv: &[Shape]) -> Result<Shape> {
    let Some(first) = recv.first() else {
        return Err(CommError::Local("all_to_all_cat: no shapes".into()).into());
    };
    let tail = first.dims().get(1..).unwrap_or(&[]);
    if first.rank() == 0 || recv.iter().any(|s| s.rank() == 0 || &s.dims()[1..] != tail) {
        return Err(CommError::Local(format!(
            "all_to_all_cat: shapes {recv:?} differ past dimension 0"
        ))
        .into());
    }
    let mut dims = first.dims().to_vec();
    dims[0] = recv.iter().map(|s| s.dims()[0]).sum();
    Ok(dims.into())
}

/// The checks every [`Comm::all_to_all`] makes before communicating: one tensor and one
/// shape per rank, this rank's own tensor of the shape it expects from itself.
pub(crate) fn check_all_to_all(
    rank: usize,
    world: usize,
    send: &[Tensor],
    recv: &[Shape],
) -> Result<()> {
    if send.len() != world || recv.len() != world {
        return Err(CommError::Local(format!(
            "all_to_all over {world} ranks given {} tensors and {} shapes",
            send.len(),
            recv.len()
        ))
        .into());
    }
    if send[rank].shape() != &recv[rank] {
        return Err(CommError::Local(format!(
            "all_to_all: rank {rank} sends itself {:?} but expects {:?}",
            send[rank].shape(),
            recv[rank]
        ))
        .into());
    }
    if let Some(t) = send.iter().find(|t| t.dtype() != send[rank].dtype()) {
        return Err(CommError::Local(format!(
            "all_to_all: mixed dtypes {:?} and {:?}",
            t.dtype(),
            send[rank].dtype()
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::token_chunks;
    use proptest::prelude::*;

    #[test]
    fn token_chunks_examples() {
        assert_eq!(
            token_chunks(4608, 4, 128),
            vec![(0, 1152), (1152, 1152), (2304, 1152), (3456, 1152)]
        );
        assert_eq!(token_chunks(512, 1, 128), vec![(0, 512)]);
        // Too short for two aligned chunks: one.
        assert_eq!(token_chunks(200, 4, 128), vec![(0, 200)]);
        assert_eq!(token_chunks(0, 3, 128), vec![(0, 0)]);
        assert_eq!(token_chunks(10, 3, 1), vec![(0, 3), (3, 3), (6, 4)]);
    }

    proptest! {
        /// The chunks cover 0..total in order, at most n and at least one, every one but
        /// the last a multiple of the alignment.
        #[test]
        fn token_chunks_cover_the_tokens(total in 0usize..20_000, n in 0usize..70, align in 0usize..300) {
            let c = token_chunks(total, n, align);
            prop_assert!(!c.is_empty() && c.len() <= n.max(1));
            let mut at = 0;
            for (i, &(s, l)) in c.iter().enumerate() {
                prop_assert_eq!(s, at);
                if i + 1 < c.len() {
                    prop_assert!(l > 0 && l % align.max(1) == 0);
                }
                at += l;
            }
            prop_assert_eq!(at, total);
        }
    }
}
