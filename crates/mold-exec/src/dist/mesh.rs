//! [`Mesh`]: one TCP connection to every other process of the run, a reader thread per
//! connection filing incoming messages by sender and tag, and the run's failure state
//! (an [`AbortSignal`] the communicators share).

use super::rendezvous;
use super::wire::{read_frame, write_frame, KIND_ABORT, KIND_BYE, KIND_DATA};
use super::Launch;
use crate::comm::{AbortSignal, CommError, CommOptions};
use crate::error::{ExecError, Result};
use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, BufWriter};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

#[derive(Default)]
struct InboxState {
    msgs: HashMap<(usize, String), VecDeque<Vec<u8>>>,
    /// The first failure anywhere (this process or another), for every waiter.
    failure: Option<String>,
    /// Processes that said goodbye (finished normally).
    left: Vec<usize>,
}

struct Inbox {
    state: Mutex<InboxState>,
    cv: Condvar,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn push(&self, from: usize, tag: String, payload: Vec<u8>) {
        self.lock()
            .msgs
            .entry((from, tag))
            .or_default()
            .push_back(payload);
        self.cv.notify_all();
    }
    fn fail(&self, why: String) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some(why);
        }
        self.cv.notify_all();
    }
}

/// One TCP connection to every other process of the run.
pub struct Mesh {
    rank: usize,
    world: usize,
    /// Writer per peer (`None` for this process).
    peers: Vec<Option<Mutex<BufWriter<TcpStream>>>>,
    pub(super) streams: Vec<Option<TcpStream>>,
    inbox: Arc<Inbox>,
    opts: CommOptions,
    /// Raised when the run failed (here or in another process); not by
    /// [`Mesh::fail_local`].
    signal: AbortSignal,
    pub(super) closing: Arc<AtomicBool>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(process {} of {})", self.rank, self.world)
    }
}

fn io_err(what: &str, e: std::io::Error) -> ExecError {
    ExecError::Dist(format!("{what}: {e}"))
}

/// How long a mesh connection may stay idle before TCP probes the other end.
pub(crate) const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(30);
/// Then between probes, and how many go unanswered before the connection is dropped
/// (about a minute in all: the reader thread then reports the process gone).
#[cfg(target_os = "linux")]
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
#[cfg(target_os = "linux")]
const KEEPALIVE_RETRIES: u32 = 3;

/// A mesh connection's options: a write that the other end does not take within
/// `dist_timeout` fails (it stopped reading), and TCP keep-alive notices a host that
/// vanished while this end only reads.
fn tune(s: &TcpStream, opts: &CommOptions) -> std::io::Result<()> {
    s.set_write_timeout(Some(opts.dist_timeout))?;
    let keepalive = socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE);
    #[cfg(target_os = "linux")]
    let keepalive = keepalive
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    socket2::SockRef::from(s).set_tcp_keepalive(&keepalive)
}

impl Mesh {
    /// Rendezvous of all `launch.world` processes. `run` describes what this process is
    /// about to run (`key=value` pairs: plan fingerprint, seed, …); every process must
    /// give the same, else process 0 refuses them all, naming the first difference.
    /// `opts` gives the waits (`dist_timeout`, `handshake_timeout`) and the shared secret;
    /// the mesh keeps them ([`Mesh::options`]).
    pub fn connect(launch: &Launch, run: &[(&str, String)], opts: &CommOptions) -> Result<Mesh> {
        let streams = rendezvous::rendezvous(launch, run, opts)?;
        let (rank, world) = (launch.rank, launch.world);
        let inbox = Arc::new(Inbox {
            state: Mutex::new(InboxState::default()),
            cv: Condvar::new(),
        });
        let signal = AbortSignal::new();
        let closing = Arc::new(AtomicBool::new(false));
        let mut peers = Vec::with_capacity(world);
        let mut kept = Vec::with_capacity(world);
        for (q, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                kept.push(None);
                continue;
            };
            tune(&s, opts).map_err(|e| io_err("setting up a connection", e))?;
            let reader = s.try_clone().map_err(|e| io_err("socket", e))?;
            let (inbox, closing, signal) = (inbox.clone(), closing.clone(), signal.clone());
            std::thread::Builder::new()
                .name(format!("mold-dist-rx-{q}"))
                .spawn(move || reader_loop(q, reader, inbox, closing, signal))
                .map_err(|e| io_err("starting a reader thread", e))?;
            kept.push(Some(s.try_clone().map_err(|e| io_err("socket", e))?));
            peers.push(Some(Mutex::new(BufWriter::with_capacity(1 << 20, s))));
        }
        Ok(Mesh {
            rank,
            world,
            peers,
            streams: kept,
            inbox,
            opts: opts.clone(),
            signal,
            closing,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// The options the mesh was connected with.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// The run's failure signal, for communicators that must stop when any process fails.
    pub fn abort_signal(&self) -> &AbortSignal {
        &self.signal
    }

    /// Sends `payload` to process `to` under `tag` (to itself: straight into the inbox).
    pub fn send(&self, to: usize, tag: &str, payload: &[u8]) -> Result<()> {
        self.send_typed(to, tag, payload, &format!("process {}", self.rank))
            .map_err(dist_err)
    }

    /// Waits for the message `tag` from process `from`. Fails at once when any process
    /// failed, and after the timeout.
    pub fn recv(&self, from: usize, tag: &str) -> Result<Vec<u8>> {
        self.recv_typed(from, tag, &format!("process {}", self.rank))
            .map_err(dist_err)
    }

    /// [`Mesh::send`] for a communicator (`who` names its rank in errors): a process that
    /// cannot be reached is a [`CommError::PeerAborted`].
    pub(crate) fn send_typed(
        &self,
        to: usize,
        tag: &str,
        payload: &[u8],
        who: &str,
    ) -> std::result::Result<(), CommError> {
        if to == self.rank {
            self.inbox.push(to, tag.to_string(), payload.to_vec());
            return Ok(());
        }
        let Some(w) = self.peers.get(to).and_then(Option::as_ref) else {
            return Err(CommError::Local(format!(
                "{who}: no process {to} in a run of {}",
                self.world
            )));
        };
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, KIND_DATA, tag, payload).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                return CommError::Local(format!("{who}: {e}"));
            }
            let why = if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                format!(
                    "process {to} took no data for {:.0} s: it is stuck or gone \
                     (MOLD_DIST_TIMEOUT_S)",
                    self.opts.dist_timeout.as_secs_f64()
                )
            } else {
                format!("process {to} cannot be reached ({e}): it exited or crashed")
            };
            self.inbox.fail(why.clone());
            self.signal.raise(&why);
            CommError::PeerAborted {
                rank: who.to_string(),
                cause: why,
            }
        })
    }

    /// [`Mesh::recv`] for a communicator: the run's failure is a
    /// [`CommError::PeerAborted`], the deadline a [`CommError::Timeout`].
    pub(crate) fn recv_typed(
        &self,
        from: usize,
        tag: &str,
        who: &str,
    ) -> std::result::Result<Vec<u8>, CommError> {
        let start = Instant::now();
        let deadline = start + self.opts.dist_timeout;
        let key = (from, tag.to_string());
        let mut st = self.inbox.lock();
        loop {
            if let Some(why) = &st.failure {
                return Err(CommError::PeerAborted {
                    rank: who.to_string(),
                    cause: why.clone(),
                });
            }
            if let Some(m) = st.msgs.get_mut(&key).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            if st.left.contains(&from) {
                return Err(CommError::Local(format!(
                    "{who}: process {from} finished without sending `{tag}`: the processes \
                     ran different steps (same arguments everywhere?)"
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: who.to_string(),
                    what: format!("waiting for `{tag}` from process {from}"),
                    waited: now - start,
                    why: "it is stuck or slower than MOLD_DIST_TIMEOUT_S".into(),
                });
            }
            st = self
                .inbox
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Marks the run failed here and tells every other process why (best effort).
    pub fn abort_all(&self, why: &str) {
        self.inbox.fail(why.to_string());
        self.signal.raise(why);
        // A writer may be busy with another frame (a rank thread's send): wait for it a
        // little rather than skip the peer, or the peer sees only the closed connection
        // and names the wrong cause. Bounded, so a peer that stopped reading cannot hold
        // the abort up.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        for w in self.peers.iter().flatten() {
            loop {
                if let Ok(mut w) = w.try_lock() {
                    let _ = write_frame(&mut *w, KIND_ABORT, "abort", why.as_bytes());
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    /// Marks the run failed in this process only (its waiters return at once).
    pub fn fail_local(&self, why: &str) {
        self.inbox.fail(why.to_string());
    }

    /// The failure seen so far, if any.
    pub fn failure(&self) -> Option<String> {
        self.inbox.lock().failure.clone()
    }
}

/// A mesh error for the executor: the failure itself (a peer's message names its
/// process), else the whole message.
fn dist_err(e: CommError) -> ExecError {
    match e {
        CommError::PeerAborted { cause, .. } => ExecError::Dist(cause),
        other => ExecError::Dist(other.to_string()),
    }
}

impl Drop for Mesh {
    /// A normal end: says goodbye to every process and waits (at most the timeout) for
    /// theirs, so that no process closes a connection the other side still reads from
    /// (a close with unread data resets it and could lose the last messages).
    fn drop(&mut self) {
        if self.inbox.lock().failure.is_none() {
            for w in self.peers.iter().flatten() {
                if let Ok(mut w) = w.lock() {
                    let _ = write_frame(&mut *w, KIND_BYE, "bye", &[]);
                }
            }
            let deadline = Instant::now() + self.opts.dist_timeout;
            let mut st = self.inbox.lock();
            while st.failure.is_none()
                && (0..self.world).any(|q| q != self.rank && !st.left.contains(&q))
            {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                st = self
                    .inbox
                    .cv
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        self.closing.store(true, Ordering::SeqCst);
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn reader_loop(
    from: usize,
    s: TcpStream,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    signal: AbortSignal,
) {
    let mut r = BufReader::with_capacity(1 << 20, s);
    loop {
        match read_frame(&mut r) {
            Ok((KIND_DATA, tag, payload)) => inbox.push(from, tag, payload),
            Ok((KIND_ABORT, _, payload)) => {
                let why = String::from_utf8_lossy(&payload).into_owned();
                signal.raise(&why);
                inbox.fail(why);
                return;
            }
            Ok(_) => {
                // Goodbye: a normal end.
                inbox.lock().left.push(from);
                inbox.cv.notify_all();
                return;
            }
            Err(e) => {
                let left = inbox.lock().left.contains(&from);
                if !left && !closing.load(Ordering::SeqCst) {
                    let why = format!(
                        "process {from} closed its connection without finishing ({e}): it \
                         exited or crashed; see its own output"
                    );
                    signal.raise(&why);
                    inbox.fail(why);
                }
                return;
            }
        }
    }
}
