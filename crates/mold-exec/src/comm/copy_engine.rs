//! All-to-alls by the GPUs' copy engines, beside the compute: a sequence-parallel group of
//! two (of more where [`super::CommOptions::large_group_copies`] asks) whose ranks are
//! threads of this process on GPUs with peer access sends each message with one peer copy
//! (`cuMemcpyPeerAsync`) straight into the receiving rank's buffer, on a stream of its own
//! (or one per receiver). Copy engines take no SMs, so the products the model queues while
//! an exchange moves ([`Comm::all_to_all_start`]: a FLUX single block's MLP) run at full
//! speed beside it;
//! NCCL's all-to-all kernels run on SMs, and beside a product neither gets the GPU (a
//! FLUX.1-dev SP2 step on 2 × H200 lost 0.8 ms with NCCL's all-to-alls on a side stream,
//! BENCHMARKS.md). Everything else goes to the group's NCCL communicator.
//!
//! One exchange, round `k` (every rank runs its exchanges in the same order):
//! 1. **post**: each rank makes its receive buffers on its compute stream, records an
//!    event there (`ready`: its messages written, its buffers made) and posts where each
//!    rank's piece must land in them;
//! 2. **copy**: once every rank has posted, each rank's copy stream waits for its own
//!    `ready` and every receiver's (whose buffer may reuse memory freed earlier in the
//!    receiver's stream order), copies each message into its receiver's buffer (one copy
//!    stream per receiver where there are several, joined back) and records `sent`;
//! 3. **finish**: the compute stream waits for every rank's `sent` (what arrived here is
//!    complete, and this rank's messages were read), then the messages may be freed.
//!
//! Where the group's GPUs cannot all reach each other (no peer access, or `--no-peer`) the
//! group stays on NCCL: every rank sees the same posts, so all decide alike. The host waits
//! only for the other ranks' threads to post (with the NCCL watchdog's limit); the GPUs
//! wait for each other through events.

use super::buffers::{address, uninit};
use super::{
    board, cat_shape, check_all_to_all, check_cat_buffer, ChunkedSum, Comm, CommError, Exchange,
};
use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use candle_core::cuda::CudaDevice;
use candle_core::{Device, Result, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a group's ranks share: each round's posts and copies ([`board`](super::board)),
/// and the exchanges' timings where traced.
pub(crate) struct Board {
    meet: board::Board<Post, CudaEvent>,
    /// Whether every pair of the group's GPUs copies directly: decided at the first
    /// exchange from every rank's post, so every rank decides alike; where they do not, the
    /// later exchanges go to NCCL without meeting.
    direct: std::sync::OnceLock<bool>,
    /// Each exchange's timing events, printed when the board is dropped
    /// ([`super::CommOptions::trace_exchanges`]).
    trace: Option<Mutex<Vec<Trace>>>,
    /// Each receiver's copy on a copy stream of its own (groups of more than two).
    per_peer: bool,
}

/// One rank's exchange, timed (CUDA events with timing): `ready` on the compute stream,
/// the copy stream once it waited for every `ready` and once it copied, the compute stream
/// when `finish` was called and once it waited; and whether the GPU had passed `ready`
/// before the host queued the copies (the host behind).
struct Trace {
    rank: usize,
    k: u64,
    ready: Arc<CudaEvent>,
    copy_start: CudaEvent,
    copy_end: Arc<CudaEvent>,
    finish_called: Option<CudaEvent>,
    finish_done: Option<CudaEvent>,
    host_behind: bool,
    host_wait: Duration,
}

impl Drop for Board {
    fn drop(&mut self) {
        if self.trace.is_none() {
            return;
        }
        // Timing and dropping the events binds their GPUs' contexts: the thread's current
        // one is put back after (`_restore` is dropped after `t`, declared after it).
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out pointer; a null result (no context) is handled below.
        let _ = unsafe { sys::cuCtxGetCurrent(&mut current) };
        let _restore = RestoreContext(current);
        let Some(t) = self.trace.take() else { return };
        let t = t.into_inner().unwrap_or_else(|e| e.into_inner());
        let ms = |a: &CudaEvent, b: &CudaEvent| {
            let _ = b.synchronize();
            a.elapsed_ms(b).map(f64::from).unwrap_or(f64::NAN)
        };
        // Per rank, the exchanges by their place in a pair (a block's first, q/k/v, and
        // second, its output) and by whether the work queued between start and finish
        // outlasted the copies (something ran beside them) or not.
        let mut sums: std::collections::BTreeMap<(usize, u64, bool), [f64; 7]> = Default::default();
        for x in &t {
            let (Some(fc), Some(fd)) = (&x.finish_called, &x.finish_done) else {
                continue;
            };
            let (wait, copies, until_finish) = (
                ms(&x.ready, &x.copy_start),
                ms(&x.copy_start, &x.copy_end),
                ms(&x.ready, fc),
            );
            let e = sums
                .entry((x.rank, x.k % 2, until_finish > copies))
                .or_default();
            e[0] += wait;
            e[1] += copies;
            e[2] += until_finish;
            e[3] += ms(fc, fd);
            e[4] += f64::from(u8::from(x.host_behind));
            e[5] += x.host_wait.as_secs_f64() * 1e3;
            e[6] += 1.0;
        }
        for ((rank, second, beside), v) in sums {
            eprintln!(
                "exchange trace rank {rank}, {} of {} exchanges ({} of a pair, {}): \
                 ready->copy {:.2} ms, copies {:.2} ms, ready->finish called {:.2} ms, \
                 finish wait {:.2} ms, host behind {} times, host waited for posts {:.2} ms",
                v[6],
                t.len(),
                if second == 1 { "second" } else { "first" },
                if beside {
                    "work beside"
                } else {
                    "nothing beside"
                },
                v[0],
                v[1],
                v[2],
                v[3],
                v[4],
                v[5]
            );
        }
    }
}

/// Makes `.0` the thread's current context again when dropped (where there was one).
struct RestoreContext(sys::CUcontext);

impl Drop for RestoreContext {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the context was current on this thread when taken and the GPU's
            // primary context stays alive while the process holds its devices.
            let _ = unsafe { sys::cuCtxSetCurrent(self.0) };
        }
    }
}

/// One rank's post for a round.
struct Post {
    device: CudaDevice,
    /// Recorded on the rank's compute stream once its messages and buffers are made.
    ready: Arc<CudaEvent>,
    /// Where rank j's piece lands (device address) and how many bytes it is.
    dst: Vec<(sys::CUdeviceptr, usize)>,
    /// How many bytes the rank sends rank j.
    sends: Vec<usize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Board {
    pub(crate) fn new(
        world: usize,
        limit: Option<Duration>,
        trace: bool,
        per_peer: bool,
    ) -> Arc<Board> {
        Arc::new(Board {
            meet: board::Board::new(world, limit),
            direct: std::sync::OnceLock::new(),
            trace: trace.then(|| Mutex::new(Vec::new())),
            per_peer,
        })
    }
}

/// A rank's copy stream `slot` (0: the one every exchange joins on; 1.. one per receiver
/// where a group's copies go on streams of their own), one per GPU and slot, made on
/// first use.
fn copy_stream(ctx: &Arc<CudaContext>, slot: usize) -> Result<Arc<CudaStream>> {
    /// (GPU ordinal, slot) and its stream.
    type Streams = Vec<((usize, usize), Arc<CudaStream>)>;
    static STREAMS: Mutex<Streams> = Mutex::new(Vec::new());
    let key = (ctx.ordinal(), slot);
    let mut streams = lock(&STREAMS);
    if let Some((_, s)) = streams.iter().find(|(o, _)| *o == key) {
        return Ok(s.clone());
    }
    let s = ctx
        .new_stream()
        .map_err(|e| CommError::Local(format!("cannot make a copy stream: {e:?}")))?;
    streams.push((key, s.clone()));
    Ok(s)
}

fn cuda_err(
    what: &str,
) -> impl Fn(candle_core::cuda::cudarc::driver::DriverError) -> candle_core::Error + '_ {
    move |e| CommError::Local(format!("copy-engine all-to-all: {what}: {e:?}")).into()
}

const NO_TIMING: Option<sys::CUevent_flags> = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
/// Events a trace times (cudarc's default, `None`, disables timing).
const TIMING: Option<sys::CUevent_flags> = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);

/// One rank of a group whose all-to-alls go by the copy engines; the rest by `inner`.
pub(crate) struct CopyEngineComm {
    inner: Box<dyn Comm>,
    board: Arc<Board>,
    rank: usize,
    /// This rank's next round.
    next: AtomicU64,
}

impl CopyEngineComm {
    pub(crate) fn new(inner: Box<dyn Comm>, board: Arc<Board>) -> CopyEngineComm {
        CopyEngineComm {
            rank: inner.rank(),
            inner,
            board,
            next: AtomicU64::new(0),
        }
    }

    /// Starts an all-to-all (see [`Comm::all_to_all_start`]).
    fn start(
        &self,
        send: Vec<Tensor>,
        recv: Vec<Shape>,
        into: Option<Option<Tensor>>,
    ) -> Result<Box<dyn Exchange + '_>> {
        let (rank, world) = (self.rank, self.board.meet.world());
        check_all_to_all(rank, world, &send, &recv)?;
        let Device::Cuda(dev) = send[rank].device().clone() else {
            return self.on_inner(send, recv, into);
        };
        let k = self.next.fetch_add(1, Ordering::SeqCst);
        if self.board.direct.get() == Some(&false) {
            return self.on_inner(send, recv, into);
        }
        let send: Vec<Tensor> = send.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
        if let Some(t) = send
            .iter()
            .find(|t| !t.device().same_device(send[rank].device()))
        {
            return Err(CommError::Local(format!(
                "all_to_all got a tensor on {:?}, expected this rank's GPU",
                t.device().location()
            ))
            .into());
        }
        let compute = dev.cuda_stream();
        let dtype = send[rank].dtype();
        let size = dtype.size_in_bytes();
        // The receive buffers: one (the caller's, or a new one with the own piece copied
        // in) or one per other rank.
        let mut dst: Vec<(sys::CUdeviceptr, usize)> = Vec::with_capacity(world);
        let got: Vec<Tensor> = match &into {
            Some(buf) => {
                let shape = cat_shape(&recv)?;
                let whole = match buf {
                    Some(t) => {
                        check_cat_buffer(&send[rank], &shape, t)?;
                        t.clone()
                    }
                    None => {
                        let (t, base, _) = uninit(&dev, &compute, dtype, &shape)?;
                        let before: usize = recv[..rank].iter().map(Shape::elem_count).sum();
                        let (own, bytes) = address(&send[rank], &compute)?;
                        if bytes > 0 {
                            compute
                                .context()
                                .bind_to_thread()
                                .map_err(cuda_err("binding the GPU"))?;
                            // SAFETY: the own piece (`bytes`, contiguous) lands at its offset
                            // in the new buffer, which holds every rank's piece; both on this
                            // GPU, in the compute stream's order.
                            unsafe {
                                result::memcpy_dtod_async(
                                    base + (before * size) as u64,
                                    own,
                                    bytes,
                                    compute.cu_stream(),
                                )
                            }
                            .map_err(cuda_err("the own piece"))?;
                        }
                        t
                    }
                };
                let (base, _) = address(&whole, &compute)?;
                let mut off = 0usize;
                for s in &recv {
                    let bytes = s.elem_count() * size;
                    dst.push((base + off as u64, bytes));
                    off += bytes;
                }
                vec![whole]
            }
            None => {
                let mut got = Vec::with_capacity(world);
                for (j, s) in recv.iter().enumerate() {
                    if j == rank {
                        dst.push((0, s.elem_count() * size));
                        got.push(send[rank].clone());
                        continue;
                    }
                    let (t, p, bytes) = uninit(&dev, &compute, dtype, s)?;
                    dst.push((p, bytes));
                    got.push(t);
                }
                got
            }
        };
        let ctx = compute.context().clone();
        let tracing = self.board.trace.is_some();
        let flags = if tracing { TIMING } else { NO_TIMING };
        let ready = Arc::new(compute.record_event(flags).map_err(cuda_err("an event"))?);
        let posted = Instant::now();
        let post = Arc::new(Post {
            device: dev.clone(),
            ready,
            dst,
            sends: send.iter().map(|t| t.elem_count() * size).collect(),
        });
        self.board
            .meet
            .put(k, |r| r.posts[rank] = Some(post.clone()));
        let posts: Vec<Arc<Post>> = self.board.meet.wait_for(
            rank,
            k,
            "messages",
            |r| r.posts.iter().all(Option::is_some),
            |r| r.posts.iter().flatten().cloned().collect(),
        )?;
        let host_wait = posted.elapsed();
        let host_behind = tracing && matches!(post.ready.try_is_complete(), Ok(true));
        // Every rank reads the same posts: the group goes by the copy engines only where
        // every pair has peer access (checked once per pair, the answer kept).
        let direct = *self.board.direct.get_or_init(|| {
            posts.iter().all(|a| {
                posts.iter().all(|b| {
                    a.device.same_device(&b.device)
                        || crate::runtime::peer_access(&a.device, &b.device)
                })
            })
        });
        // Every rank checks every pair's sizes before anyone copies, so all refuse alike.
        let mismatch = (0..world)
            .flat_map(|s| (0..world).map(move |j| (s, j)))
            .find_map(|(s, j)| {
                let sent = posts[s].sends.get(j).copied();
                let room = posts[j].dst.get(s).map(|d| d.1);
                (s != j && sent != room).then(|| {
                    format!("all_to_all: rank {s} sends rank {j} {sent:?} bytes, which expects {room:?}")
                })
            });
        if !direct || mismatch.is_some() {
            // Nobody copies this round: the buffers are free to go.
            drop(got);
            drop(posts);
            self.finished(k);
            // Dropping another GPU's event may have made its context current.
            ctx.bind_to_thread().map_err(cuda_err("binding the GPU"))?;
            if let Some(m) = mismatch {
                return Err(CommError::Local(m).into());
            }
            return self.on_inner(send, recv, into);
        }
        match self.copy(k, &ctx, &post, &posts, &send, tracing) {
            Ok((side, sent, copy_start)) => {
                let trace = copy_start.map(|copy_start| Trace {
                    rank,
                    k,
                    ready: post.ready.clone(),
                    copy_start,
                    copy_end: sent,
                    finish_called: None,
                    finish_done: None,
                    host_behind,
                    host_wait,
                });
                Ok(Box::new(InFlight {
                    comm: self,
                    k,
                    compute,
                    side,
                    got,
                    keep: send,
                    joined: false,
                    trace,
                }))
            }
            Err(e) => {
                // Copies may be queued into these buffers, and from these messages: they are
                // never freed (the group stops; the others are released by the board).
                self.board.meet.fail();
                std::mem::forget(got);
                std::mem::forget(send);
                Err(e)
            }
        }
    }

    /// Queues this rank's copies of round `k` on its copy stream, after every rank's
    /// `ready`, and posts `sent`: the copy stream, `sent`, and the trace's first event.
    fn copy(
        &self,
        k: u64,
        ctx: &Arc<CudaContext>,
        post: &Post,
        posts: &[Arc<Post>],
        send: &[Tensor],
        tracing: bool,
    ) -> Result<(Arc<CudaStream>, Arc<CudaEvent>, Option<CudaEvent>)> {
        let rank = self.rank;
        let flags = if tracing { TIMING } else { NO_TIMING };
        let side = copy_stream(ctx, 0)?;
        side.wait(&post.ready).map_err(cuda_err("ordering"))?;
        for (j, peer) in posts.iter().enumerate() {
            if j != rank {
                side.wait(&peer.ready).map_err(cuda_err("ordering"))?;
            }
        }
        let copy_start = if tracing {
            Some(side.record_event(TIMING).map_err(cuda_err("an event"))?)
        } else {
            None
        };
        // Groups of more than two: each receiver's copy on a stream of its own, started
        // once every rank is ready and joined back on `side`.
        let apart = self.board.per_peer && posts.len() > 2;
        let go = if apart {
            Some(side.record_event(NO_TIMING).map_err(cuda_err("an event"))?)
        } else {
            None
        };
        let mut ends = Vec::new();
        for (j, peer) in posts.iter().enumerate() {
            if j == rank {
                continue;
            }
            let stream = match &go {
                Some(go) => {
                    let s = copy_stream(ctx, 1 + j - usize::from(j > rank))?;
                    s.wait(go).map_err(cuda_err("ordering"))?;
                    s
                }
                None => side.clone(),
            };
            let (to, room) = peer.dst[rank];
            let (from, bytes) = address(&send[j], &stream)?;
            if bytes != room {
                return Err(CommError::Local(format!(
                    "all_to_all: rank {rank} sends rank {j} {bytes} bytes, which expects {room}"
                ))
                .into());
            }
            if bytes == 0 {
                continue;
            }
            let peer_ctx = peer.device.cuda_stream().context().clone();
            ctx.bind_to_thread().map_err(cuda_err("binding the GPU"))?;
            // SAFETY: `from` holds `bytes` of this rank's message to rank j (contiguous, kept
            // until this rank's compute stream waited for the copy: `stream` is joined back
            // on `side` before `sent`) and `to` is rank j's buffer for it, `bytes` long,
            // made before its `ready` event, which the copy stream waited for (directly,
            // or through `go`); rank j reads it only after waiting for `sent`.
            unsafe {
                result::memcpy_peer_async(
                    peer_ctx.cu_ctx(),
                    to,
                    ctx.cu_ctx(),
                    from,
                    bytes,
                    stream.cu_stream(),
                )
            }
            .map_err(cuda_err("cuMemcpyPeerAsync"))?;
            if go.is_some() {
                ends.push(
                    stream
                        .record_event(NO_TIMING)
                        .map_err(cuda_err("an event"))?,
                );
            }
        }
        for end in &ends {
            side.wait(end).map_err(cuda_err("ordering"))?;
        }
        let sent = Arc::new(side.record_event(flags).map_err(cuda_err("an event"))?);
        self.board
            .meet
            .put(k, |r| r.sent[rank] = Some(sent.clone()));
        Ok((side, sent, copy_start))
    }

    /// The exchange by the inner communicator, now.
    fn on_inner(
        &self,
        send: Vec<Tensor>,
        recv: Vec<Shape>,
        into: Option<Option<Tensor>>,
    ) -> Result<Box<dyn Exchange + '_>> {
        self.inner.all_to_all_start(send, recv, into)
    }

    /// This rank is done with round `k`.
    fn finished(&self, k: u64) {
        self.board.meet.finished(k);
    }
}

/// An exchange whose copies are queued.
struct InFlight<'a> {
    comm: &'a CopyEngineComm,
    k: u64,
    compute: Arc<CudaStream>,
    /// The copy stream, which reads `keep`.
    side: Arc<CudaStream>,
    got: Vec<Tensor>,
    /// The messages, kept until the compute stream waited for the copies that read them.
    keep: Vec<Tensor>,
    joined: bool,
    trace: Option<Trace>,
}

impl InFlight<'_> {
    /// The compute stream waits for every rank's copies of this round.
    /// Set `joined` only once the waits are queued.
    fn join(&mut self) -> Result<()> {
        if self.joined {
            return Ok(());
        }
        let c = self.comm;
        let sent: Vec<Arc<CudaEvent>> = c.board.meet.wait_for(
            c.rank,
            self.k,
            "copies",
            |r| r.sent.iter().all(Option::is_some),
            |r| r.sent.iter().flatten().cloned().collect(),
        )?;
        if let Some(t) = self.trace.as_mut() {
            t.finish_called = self.compute.record_event(TIMING).ok();
        }
        for ev in &sent {
            self.compute.wait(ev).map_err(cuda_err("ordering"))?;
        }
        self.joined = true;
        if let Some(mut t) = self.trace.take() {
            t.finish_done = self.compute.record_event(TIMING).ok();
            if let Some(all) = &c.board.trace {
                lock(all).push(t);
            }
        }
        drop(sent);
        c.finished(self.k);
        // Dropping the other GPU's events may have made its context current.
        self.compute
            .context()
            .bind_to_thread()
            .map_err(cuda_err("binding the GPU"))
    }
}

impl Exchange for InFlight<'_> {
    fn finish(mut self: Box<Self>) -> Result<Vec<Tensor>> {
        self.join()?;
        self.keep.clear();
        Ok(std::mem::take(&mut self.got))
    }
}

impl Drop for InFlight<'_> {
    /// Dropped without `finish` (an error in between): the messages and buffers are freed
    /// only after the compute stream waited for every rank's copies; where that cannot be
    /// queued (the group failed before every rank posted its copies), they are never freed:
    /// a peer's copy may still write into them.
    fn drop(&mut self) {
        if !self.joined && self.join().is_err() {
            let _ = self.side.synchronize();
            std::mem::forget(std::mem::take(&mut self.got));
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}

impl Comm for CopyEngineComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.inner.all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.inner.all_gather(t)
    }
    fn all_gather_cat(&self, t: &Tensor) -> Result<Tensor> {
        self.inner.all_gather_cat(t)
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.inner.reduce_scatter_sum(t)
    }
    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> Result<Vec<Tensor>> {
        self.start(send.to_vec(), recv.to_vec(), None)?.finish()
    }
    fn all_to_all_cat(
        &self,
        send: &[Tensor],
        recv: &[Shape],
        into: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.start(send.to_vec(), recv.to_vec(), Some(into.cloned()))?
            .finish()?
            .pop()
            .ok_or_else(|| CommError::Local("all_to_all_cat: nothing received".into()).into())
    }
    fn all_to_all_start(
        &self,
        send: Vec<Tensor>,
        recv: Vec<Shape>,
        into: Option<Option<Tensor>>,
    ) -> Result<Box<dyn Exchange + '_>> {
        self.start(send, recv, into)
    }
    fn overlap_chunks(&self) -> usize {
        self.inner.overlap_chunks()
    }
    fn chunked_sum(&self, total: usize) -> Box<dyn ChunkedSum + '_> {
        self.inner.chunked_sum(total)
    }
    fn abort(&self) {
        self.board.meet.fail();
        self.inner.abort();
    }
    fn check(&self) -> Result<()> {
        self.inner.check()
    }
}
