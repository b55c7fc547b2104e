//! Several processes: one `mold exec` per node (or per GPU), each running the ranks of its
//! own devices.
//!
//! # Launch
//!
//! Every process is started with the same arguments and three variables:
//! `MOLD_WORLD_SIZE` (processes), `MOLD_RANK` (this one, `0..MOLD_WORLD_SIZE`) and
//! `MOLD_MASTER_ADDR` (`host:port` where process 0 listens; the port defaults to
//! [`DEFAULT_PORT`]). No launcher is needed: processes may start in any order within the
//! timeout.
//!
//! # Who runs what ([`Ownership`])
//!
//! The devices of the plan's transformer, sorted, are cut into `MOLD_WORLD_SIZE`
//! contiguous shares as equal as possible; process `p` owns share `p` and loads and runs
//! only the ranks on those devices. A process sees its own GPUs as `cuda:0, cuda:1, …` in
//! the order of its share (as on a node of its own; on one shared host give each process
//! its GPUs with `CUDA_VISIBLE_DEVICES`).
//!
//! # Transport ([`Mesh`])
//!
//! Process 0 listens at `MOLD_MASTER_ADDR`; the others connect, say who they are and what
//! they run (a fingerprint of the plan and the arguments: processes that disagree are
//! refused, naming the difference), and get the address of every other process back, so
//! each pair of processes shares one TCP connection. A reader thread per connection files
//! incoming messages by sender and tag.
//!
//! - Activations handed from a part in one process to a part in another travel over TCP,
//!   staged through host memory, and so does the last part's output, which goes to every
//!   process so that all of them run the same sampler.
//! - A tensor-parallel group that spans processes all-reduces through NCCL on GPUs (the
//!   `ncclUniqueId` travels over the mesh) and through [`TcpComm`] otherwise (emulated
//!   devices: host-staged, summed in rank order, bit-identical to one process).
//! - A process that fails tells the others (an abort message naming it) before it exits;
//!   one that dies closes its connections. Either way every other process stops waiting
//!   at once, aborts its communicators and exits non-zero naming the process at fault.
//!   Waits are bounded by `MOLD_DIST_TIMEOUT_S` (default 120 s).

use crate::comm::Comm;
use crate::error::{ExecError, Result};
use candle_core::{DType, Device, Tensor};
use mold_plan::DeviceId;
use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Port of `MOLD_MASTER_ADDR` when it names only a host.
pub const DEFAULT_PORT: u16 = 29517;
/// Default of `MOLD_DIST_TIMEOUT_S`.
pub const DEFAULT_TIMEOUT_S: f64 = 120.0;

/// This process's place among the processes of one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// `MOLD_RANK`.
    pub rank: usize,
    /// `MOLD_WORLD_SIZE`.
    pub world: usize,
    /// `MOLD_MASTER_ADDR`, with the port filled in.
    pub master: String,
}

fn launch_err(m: String) -> ExecError {
    ExecError::Launch(m)
}

impl Launch {
    /// Reads `MOLD_RANK`, `MOLD_WORLD_SIZE` and `MOLD_MASTER_ADDR`. `None` when none is set
    /// (one process); an error naming the variable when they are incomplete or wrong.
    pub fn from_env() -> Result<Option<Launch>> {
        let get = |k: &str| std::env::var(k).ok();
        Launch::parse(
            get("MOLD_RANK").as_deref(),
            get("MOLD_WORLD_SIZE").as_deref(),
            get("MOLD_MASTER_ADDR").as_deref(),
        )
    }

    /// [`Launch::from_env`] on given values.
    pub fn parse(
        rank: Option<&str>,
        world: Option<&str>,
        master: Option<&str>,
    ) -> Result<Option<Launch>> {
        if rank.is_none() && world.is_none() && master.is_none() {
            return Ok(None);
        }
        let world = match world {
            None => {
                return Err(launch_err(
                    "MOLD_WORLD_SIZE is not set (MOLD_RANK or MOLD_MASTER_ADDR is): set it to \
                     the number of processes, the same in every process"
                        .into(),
                ))
            }
            Some(w) => match w.trim().parse::<usize>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    return Err(launch_err(format!(
                        "MOLD_WORLD_SIZE={w:?}: give the number of processes (1 or more)"
                    )))
                }
            },
        };
        let rank = match rank {
            None if world == 1 => 0,
            None => {
                return Err(launch_err(format!(
                    "MOLD_RANK is not set: give each of the {world} processes its own rank, \
                     0..{world}"
                )))
            }
            Some(r) => match r.trim().parse::<usize>() {
                Ok(n) if n < world => n,
                _ => {
                    return Err(launch_err(format!(
                        "MOLD_RANK={r:?}: must be a whole number below MOLD_WORLD_SIZE={world} \
                         (0..{world})"
                    )))
                }
            },
        };
        if world == 1 {
            return Ok(None);
        }
        let master = match master.map(str::trim) {
            None | Some("") => {
                return Err(launch_err(
                    "MOLD_MASTER_ADDR is not set: give host:port where process 0 listens \
                     (the same in every process), e.g. node0:29517"
                        .into(),
                ))
            }
            Some(m) => m,
        };
        let master = match master.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !h.ends_with(':') => match p.parse::<u16>() {
                Ok(_) => master.to_string(),
                Err(_) => {
                    return Err(launch_err(format!(
                        "MOLD_MASTER_ADDR={master:?}: the port `{p}` is not a number 1..65535"
                    )))
                }
            },
            _ => format!("{master}:{DEFAULT_PORT}"),
        };
        Ok(Some(Launch {
            rank,
            world,
            master,
        }))
    }
}

/// `MOLD_DIST_TIMEOUT_S` (seconds, default [`DEFAULT_TIMEOUT_S`]): the longest a process
/// waits for another one (rendezvous, a hand-off, a host-staged all-reduce).
pub fn timeout() -> Result<Duration> {
    match std::env::var("MOLD_DIST_TIMEOUT_S") {
        Err(_) => Ok(Duration::from_secs_f64(DEFAULT_TIMEOUT_S)),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(launch_err(format!(
                "MOLD_DIST_TIMEOUT_S={v:?}: give seconds, more than 0"
            ))),
        },
    }
}

/// Which process runs which device: the sorted devices cut into contiguous shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    shares: Vec<Vec<DeviceId>>,
}

impl Ownership {
    /// Cuts `devices` (any order; sorted here) into `world` contiguous shares, the first
    /// ones one larger when they do not divide evenly.
    pub fn split(devices: &[DeviceId], world: usize) -> Result<Ownership> {
        let mut ds: Vec<DeviceId> = devices.to_vec();
        ds.sort_by_key(|d| {
            (
                d.to_string().split(':').next().map(str::to_owned),
                d.ordinal(),
            )
        });
        ds.dedup();
        if ds.len() < world {
            return Err(launch_err(format!(
                "MOLD_WORLD_SIZE={world}, but the plan's transformer runs on {} device(s) ({}): \
                 start at most one process per device",
                ds.len(),
                ds.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let (base, extra) = (ds.len() / world, ds.len() % world);
        let mut shares = Vec::with_capacity(world);
        let mut it = ds.into_iter();
        for p in 0..world {
            shares.push(it.by_ref().take(base + usize::from(p < extra)).collect());
        }
        Ok(Ownership { shares })
    }

    /// The process that runs `d`.
    pub fn owner(&self, d: &DeviceId) -> Option<usize> {
        self.shares.iter().position(|s| s.contains(d))
    }

    /// The devices of process `p`.
    pub fn share(&self, p: usize) -> &[DeviceId] {
        &self.shares[p]
    }

    /// How process `p` opens `d`: its position among the share's devices of the same
    /// kind (`cuda:N` → the process's `cuda:K`).
    pub fn local_id(&self, p: usize, d: &DeviceId) -> Option<DeviceId> {
        let share = &self.shares[p];
        if !share.contains(d) {
            return None;
        }
        let k = share
            .iter()
            .filter(|x| std::mem::discriminant(*x) == std::mem::discriminant(d))
            .position(|x| x == d)? as u32;
        Some(match d {
            DeviceId::Cuda(_) => DeviceId::Cuda(k),
            other => other.clone(),
        })
    }
}

// ------------------------------------------------------------------ wire format

const KIND_DATA: u8 = 0;
const KIND_ABORT: u8 = 1;
const KIND_BYE: u8 = 2;

fn write_frame(w: &mut impl Write, kind: u8, tag: &str, payload: &[u8]) -> std::io::Result<()> {
    w.write_all(&[kind])?;
    w.write_all(&(tag.len() as u32).to_le_bytes())?;
    w.write_all(tag.as_bytes())?;
    w.write_all(&(payload.len() as u64).to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, String, Vec<u8>)> {
    let mut kind = [0u8; 1];
    r.read_exact(&mut kind)?;
    let mut n4 = [0u8; 4];
    r.read_exact(&mut n4)?;
    let n = u32::from_le_bytes(n4) as usize;
    if n > 1 << 16 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a mold message (tag too long)",
        ));
    }
    let mut tag = vec![0u8; n];
    r.read_exact(&mut tag)?;
    let mut n8 = [0u8; 8];
    r.read_exact(&mut n8)?;
    let len = u64::from_le_bytes(n8) as usize;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    let tag = String::from_utf8(tag).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "not a mold message (tag)")
    })?;
    Ok((kind[0], tag, payload))
}

/// `k=v;k=v` → pairs.
fn parse_kv(s: &str) -> HashMap<String, String> {
    s.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

// ------------------------------------------------------------------ mesh

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

/// The first failure any mesh of this process has seen (for NCCL's watchdog, which polls
/// it so that a rank waiting on a collective with a failed process stops at once).
static FAILURE: Mutex<Option<String>> = Mutex::new(None);

/// Why the run failed in another process (or this one), once a mesh knows it.
pub fn failure() -> Option<String> {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn note_failure(why: &str) {
    let mut f = FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    if f.is_none() {
        *f = Some(why.to_string());
    }
}

/// One TCP connection to every other process of the run.
pub struct Mesh {
    rank: usize,
    world: usize,
    /// Writer per peer (`None` for this process).
    peers: Vec<Option<Mutex<BufWriter<TcpStream>>>>,
    streams: Vec<Option<TcpStream>>,
    inbox: Arc<Inbox>,
    timeout: Duration,
    closing: Arc<AtomicBool>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(process {} of {})", self.rank, self.world)
    }
}

fn io_err(what: &str, e: std::io::Error) -> ExecError {
    ExecError::Dist(format!("{what}: {e}"))
}

/// Connects to `addr`, retrying until `deadline` (the other side may not listen yet).
fn connect_retry(addr: &str, deadline: Instant, what: &str) -> Result<TcpStream> {
    let mut last = String::new();
    while Instant::now() < deadline {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match TcpStream::connect_timeout(
                        &a,
                        left.clamp(Duration::from_millis(1), Duration::from_secs(2)),
                    ) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            return Ok(s);
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            Err(e) => last = format!("cannot resolve it: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(ExecError::Dist(format!(
        "cannot reach {what} at {addr} ({last}); is it running, and is MOLD_MASTER_ADDR the same \
         in every process? (MOLD_DIST_TIMEOUT_S sets how long to wait)"
    )))
}

/// Accepts one connection before `deadline`.
fn accept_until(l: &TcpListener, deadline: Instant) -> std::io::Result<Option<TcpStream>> {
    l.set_nonblocking(true)?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                let _ = s.set_nodelay(true);
                return Ok(Some(s));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads one frame with a deadline (rendezvous only).
fn read_frame_by(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, String, Vec<u8>)> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    let r = read_frame(s);
    s.set_read_timeout(None)?;
    r
}

impl Mesh {
    /// Rendezvous of all `launch.world` processes. `run` describes what this process is
    /// about to run (`key=value` pairs: plan fingerprint, seed, …); every process must
    /// give the same, else process 0 refuses them all, naming the first difference.
    pub fn connect(launch: &Launch, run: &[(&str, String)], timeout: Duration) -> Result<Mesh> {
        for (k, v) in run {
            if k.contains(['=', ';']) || v.contains(['=', ';']) {
                return Err(ExecError::Dist(format!(
                    "run key {k}={v}: no '=' or ';' allowed"
                )));
            }
        }
        let desc: String = run
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";");
        let deadline = Instant::now() + timeout;
        let (rank, world) = (launch.rank, launch.world);
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if rank == 0 {
            let port = launch
                .master
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .unwrap_or(DEFAULT_PORT);
            let host = launch.master.rsplit_once(':').map(|(h, _)| h).unwrap_or("");
            // Listen on every interface unless the master is a loopback address.
            let loopback = matches!(host, "127.0.0.1" | "localhost" | "::1" | "[::1]");
            let bind = if loopback {
                launch.master.clone()
            } else {
                format!("0.0.0.0:{port}")
            };
            let listener = TcpListener::bind(&bind).map_err(|e| {
                ExecError::Dist(format!(
                    "process 0 cannot listen on {bind} (MOLD_MASTER_ADDR={}): {e}; pick a free port",
                    launch.master
                ))
            })?;
            let mut addrs: Vec<String> = vec![String::new(); world];
            let mut got = 0;
            while got < world - 1 {
                let Some(mut s) =
                    accept_until(&listener, deadline).map_err(|e| io_err("accept", e))?
                else {
                    let missing: Vec<String> = (1..world)
                        .filter(|r| streams[*r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(ExecError::Dist(format!(
                        "process 0 waited {:.0} s at {} for process(es) {} of MOLD_WORLD_SIZE={world}: \
                         start them (same MOLD_MASTER_ADDR), or raise MOLD_DIST_TIMEOUT_S",
                        timeout.as_secs_f64(),
                        launch.master,
                        missing.join(", ")
                    )));
                };
                let (kind, tag, payload) = match read_frame_by(&mut s, deadline) {
                    Ok(f) => f,
                    Err(_) => continue, // not one of ours (a port scan?)
                };
                if kind != KIND_DATA || tag != "hello" {
                    continue;
                }
                let head = payload.split(|b| *b == 0).next().unwrap_or(&[]);
                let hello = parse_kv(&String::from_utf8_lossy(head));
                let r: usize = hello
                    .get("rank")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(usize::MAX);
                let w: usize = hello.get("world").and_then(|v| v.parse().ok()).unwrap_or(0);
                let refuse = |msg: String, s: &mut TcpStream| -> ExecError {
                    let _ = write_frame(s, KIND_ABORT, "refused", msg.as_bytes());
                    ExecError::Dist(msg)
                };
                if w != world || r == 0 || r >= world {
                    return Err(refuse(
                        format!(
                            "a process says it is MOLD_RANK={r} of MOLD_WORLD_SIZE={w}, but process 0 \
                             has MOLD_WORLD_SIZE={world}: start every process with the same \
                             MOLD_WORLD_SIZE and distinct ranks 1..{world} besides 0"
                        ),
                        &mut s,
                    ));
                }
                if streams[r].is_some() {
                    return Err(refuse(
                        format!("two processes say MOLD_RANK={r}: give each its own rank"),
                        &mut s,
                    ));
                }
                let theirs = theirs_decode(&payload);
                if theirs != desc {
                    let other = parse_kv(&theirs);
                    let diff = run
                        .iter()
                        .find(|(k, v)| other.get(*k) != Some(v))
                        .map(|(k, v)| {
                            format!(
                                "{k} is {} in process {r} but {v} in process 0",
                                other.get(*k).map(String::as_str).unwrap_or("missing")
                            )
                        })
                        .unwrap_or_else(|| {
                            format!("`{theirs}` in process {r}, `{desc}` in process 0")
                        });
                    return Err(refuse(
                        format!(
                            "processes disagree on what to run: {diff}; start every process \
                             with the same plan and arguments"
                        ),
                        &mut s,
                    ));
                }
                let port: u16 = hello.get("port").and_then(|v| v.parse().ok()).unwrap_or(0);
                let ip = s.peer_addr().map_err(|e| io_err("peer address", e))?.ip();
                addrs[r] = SocketAddr::new(ip, port).to_string();
                streams[r] = Some(s);
                got += 1;
            }
            let table = addrs.join(",");
            for s in streams.iter_mut().flatten() {
                write_frame(s, KIND_DATA, "table", table.as_bytes())
                    .map_err(|e| io_err("sending the address table", e))?;
            }
        } else {
            let listener =
                TcpListener::bind("0.0.0.0:0").map_err(|e| io_err("listening for peers", e))?;
            let port = listener
                .local_addr()
                .map_err(|e| io_err("listen address", e))?
                .port();
            let mut s = connect_retry(&launch.master, deadline, "process 0 (MOLD_MASTER_ADDR)")?;
            // Who this is, then (after a NUL) what it runs.
            let mut payload = format!("rank={rank};world={world};port={port}").into_bytes();
            payload.push(0);
            payload.extend_from_slice(desc.as_bytes());
            write_frame(&mut s, KIND_DATA, "hello", &payload)
                .map_err(|e| io_err("greeting process 0", e))?;
            let (kind, tag, payload) = read_frame_by(&mut s, deadline).map_err(|e| {
                ExecError::Dist(format!(
                    "process 0 did not answer within {:.0} s ({e}): are all {world} processes \
                     started? (MOLD_DIST_TIMEOUT_S)",
                    timeout.as_secs_f64()
                ))
            })?;
            if kind == KIND_ABORT {
                return Err(ExecError::Dist(format!(
                    "process 0 refused this process: {}",
                    String::from_utf8_lossy(&payload)
                )));
            }
            if tag != "table" {
                return Err(ExecError::Dist(format!(
                    "unexpected message `{tag}` from process 0"
                )));
            }
            let table: Vec<String> = String::from_utf8_lossy(&payload)
                .split(',')
                .map(str::to_owned)
                .collect();
            streams[0] = Some(s);
            // Lower ranks listen, higher ranks connect.
            for (q, addr) in table.iter().enumerate().take(rank).skip(1) {
                let mut c = connect_retry(addr, deadline, &format!("process {q}"))?;
                write_frame(&mut c, KIND_DATA, "peer", rank.to_string().as_bytes())
                    .map_err(|e| io_err("greeting a peer", e))?;
                streams[q] = Some(c);
            }
            for _ in rank + 1..world {
                let Some(mut c) =
                    accept_until(&listener, deadline).map_err(|e| io_err("accept", e))?
                else {
                    return Err(ExecError::Dist(format!(
                        "process {rank} waited {:.0} s for a connection from a higher-ranked process",
                        timeout.as_secs_f64()
                    )));
                };
                let (_, tag, payload) =
                    read_frame_by(&mut c, deadline).map_err(|e| io_err("reading a greeting", e))?;
                let q: usize = String::from_utf8_lossy(&payload).parse().unwrap_or(0);
                if tag != "peer" || q <= rank || q >= world || streams[q].is_some() {
                    return Err(ExecError::Dist(format!(
                        "unexpected connection (`{tag}` from process {q}) during rendezvous"
                    )));
                }
                streams[q] = Some(c);
            }
        }
        let inbox = Arc::new(Inbox {
            state: Mutex::new(InboxState::default()),
            cv: Condvar::new(),
        });
        let closing = Arc::new(AtomicBool::new(false));
        let mut peers = Vec::with_capacity(world);
        let mut kept = Vec::with_capacity(world);
        for (q, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                kept.push(None);
                continue;
            };
            let reader = s.try_clone().map_err(|e| io_err("socket", e))?;
            let (inbox, closing) = (inbox.clone(), closing.clone());
            std::thread::Builder::new()
                .name(format!("mold-dist-rx-{q}"))
                .spawn(move || reader_loop(q, reader, inbox, closing))
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
            timeout,
            closing,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Sends `payload` to process `to` under `tag` (to itself: straight into the inbox).
    pub fn send(&self, to: usize, tag: &str, payload: &[u8]) -> Result<()> {
        if to == self.rank {
            self.inbox.push(to, tag.to_string(), payload.to_vec());
            return Ok(());
        }
        let w = self.peers[to]
            .as_ref()
            .expect("a peer for every other process");
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, KIND_DATA, tag, payload).map_err(|e| {
            let why = format!("process {to} cannot be reached ({e}): it exited or crashed");
            self.inbox.fail(why.clone());
            note_failure(&why);
            ExecError::Dist(why)
        })
    }

    /// Waits for the message `tag` from process `from`. Fails at once when any process
    /// failed, and after the timeout.
    pub fn recv(&self, from: usize, tag: &str) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        let key = (from, tag.to_string());
        let mut st = self.inbox.lock();
        loop {
            if let Some(why) = &st.failure {
                return Err(ExecError::Dist(why.clone()));
            }
            if let Some(m) = st.msgs.get_mut(&key).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            if st.left.contains(&from) {
                return Err(ExecError::Dist(format!(
                    "process {from} finished without sending `{tag}`: the processes ran \
                     different steps (same arguments everywhere?)"
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ExecError::Dist(format!(
                    "process {} waited {:.0} s for `{tag}` from process {from}: it is stuck or \
                     slower than MOLD_DIST_TIMEOUT_S",
                    self.rank,
                    self.timeout.as_secs_f64()
                )));
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
        note_failure(why);
        for w in self.peers.iter().flatten() {
            if let Ok(mut w) = w.try_lock() {
                let _ = write_frame(&mut *w, KIND_ABORT, "abort", why.as_bytes());
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

/// The run description of a hello (after its NUL).
fn theirs_decode(payload: &[u8]) -> String {
    match payload.iter().position(|b| *b == 0) {
        Some(i) => String::from_utf8_lossy(&payload[i + 1..]).into_owned(),
        None => String::new(),
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
            let deadline = Instant::now() + self.timeout;
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

fn reader_loop(from: usize, s: TcpStream, inbox: Arc<Inbox>, closing: Arc<AtomicBool>) {
    let mut r = BufReader::with_capacity(1 << 20, s);
    loop {
        match read_frame(&mut r) {
            Ok((KIND_DATA, tag, payload)) => inbox.push(from, tag, payload),
            Ok((KIND_ABORT, _, payload)) => {
                let why = String::from_utf8_lossy(&payload).into_owned();
                note_failure(&why);
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
                    note_failure(&why);
                    inbox.fail(why);
                }
                return;
            }
        }
    }
}

// ------------------------------------------------------------------ tensors on the wire

fn dtype_code(d: DType) -> Result<u8> {
    Ok(match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
        DType::U32 => 4,
        DType::I64 => 5,
        DType::U8 => 6,
        other => {
            return Err(ExecError::Dist(format!(
                "cannot send a {other:?} tensor between processes"
            )))
        }
    })
}

/// Flat data of tensors (any device; copied to the host): dtype and little-endian values.
fn encode_flat(ts: &[&Tensor]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(&(ts.len() as u32).to_le_bytes());
    for t in ts {
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        out.push(dtype_code(t.dtype())?);
        out.push(0);
        out.extend_from_slice(&(t.elem_count() as u64).to_le_bytes());
        macro_rules! put {
            ($ty:ty) => {
                for v in t.to_vec1::<$ty>()? {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            };
        }
        match t.dtype() {
            DType::F32 => put!(f32),
            DType::BF16 => put!(half::bf16),
            DType::F16 => put!(half::f16),
            DType::F64 => put!(f64),
            DType::U32 => put!(u32),
            DType::I64 => put!(i64),
            DType::U8 => put!(u8),
            _ => unreachable!("checked by dtype_code"),
        }
    }
    Ok(out)
}

/// Serialises tensors (any device; copied to the host): shapes, then dtype and
/// little-endian data of each.
pub fn encode_shaped(ts: &[&Tensor]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(&(ts.len() as u32).to_le_bytes());
    for t in ts {
        out.push(t.rank() as u8);
        for d in t.dims() {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
    }
    out.extend_from_slice(&encode_flat(ts)?);
    Ok(out)
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(ExecError::Dist("truncated tensor message".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// Inverse of [`encode_shaped`]: the tensors, on the host.
pub fn decode_shaped(b: &[u8]) -> Result<Vec<Tensor>> {
    let mut c = Cursor(b);
    let n = c.u32()? as usize;
    let mut shapes = Vec::with_capacity(n);
    for _ in 0..n {
        let rank = c.u8()? as usize;
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            dims.push(c.u64()? as usize);
        }
        shapes.push(dims);
    }
    let m = c.u32()? as usize;
    if m != n {
        return Err(ExecError::Dist("malformed tensor message".into()));
    }
    let mut out = Vec::with_capacity(n);
    for dims in shapes {
        let code = c.u8()?;
        c.u8()?;
        let count = c.u64()? as usize;
        if count != dims.iter().product::<usize>() {
            return Err(ExecError::Dist("malformed tensor message (sizes)".into()));
        }
        macro_rules! get {
            ($ty:ty, $w:expr) => {{
                let raw = c.take(count * $w)?;
                let v: Vec<$ty> = raw
                    .chunks_exact($w)
                    .map(|ch| <$ty>::from_le_bytes(ch.try_into().expect("width")))
                    .collect();
                Tensor::from_vec(v, dims.as_slice(), &Device::Cpu)?
            }};
        }
        out.push(match code {
            0 => get!(f32, 4),
            1 => get!(half::bf16, 2),
            2 => get!(half::f16, 2),
            3 => get!(f64, 8),
            4 => get!(u32, 4),
            5 => get!(i64, 8),
            6 => get!(u8, 1),
            _ => return Err(ExecError::Dist(format!("unknown dtype code {code}"))),
        });
    }
    Ok(out)
}

// ------------------------------------------------------------------ host-staged all-reduce

/// A tensor-parallel rank whose group spans processes, all-reducing over the [`Mesh`]:
/// every rank sends its tensor (host-staged) to every other rank and sums all of them in
/// rank order, so every rank, and a one-process run with [`crate::comm::ThreadComm`], gets
/// bit-identical results. For emulated devices and builds without NCCL.
pub struct TcpComm {
    mesh: Arc<Mesh>,
    /// Names the group in tags (the part index).
    group: String,
    rank: usize,
    /// The process of each rank of the group.
    procs: Vec<usize>,
    seq: AtomicU64,
}

impl TcpComm {
    /// The handle of group rank `rank`; `procs[r]` is the process running rank r.
    pub fn new(mesh: Arc<Mesh>, group: String, rank: usize, procs: Vec<usize>) -> TcpComm {
        TcpComm {
            mesh,
            group,
            rank,
            procs,
            seq: AtomicU64::new(0),
        }
    }
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.procs.len()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let to_candle = |e: ExecError| candle_core::Error::Msg(e.to_string());
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let host = t.to_device(&Device::Cpu)?;
        let bytes = encode_shaped(&[&host]).map_err(to_candle)?;
        let tag = |from: usize, to: usize| format!("ar/{}/{seq}/{from}>{to}", self.group);
        for (r, &p) in self.procs.iter().enumerate() {
            if r != self.rank {
                self.mesh
                    .send(p, &tag(self.rank, r), &bytes)
                    .map_err(to_candle)?;
            }
        }
        let mut acc: Option<Tensor> = None;
        for (r, &p) in self.procs.iter().enumerate() {
            let part = if r == self.rank {
                host.clone()
            } else {
                let b = self.mesh.recv(p, &tag(r, self.rank)).map_err(to_candle)?;
                decode_shaped(&b).map_err(to_candle)?.remove(0)
            };
            acc = Some(match acc {
                None => part,
                Some(a) => {
                    if a.shape() != part.shape() || a.dtype() != part.dtype() {
                        candle_core::bail!(
                            "all_reduce_sum: ranks passed {:?}/{:?} and {:?}/{:?}",
                            a.shape(),
                            a.dtype(),
                            part.shape(),
                            part.dtype()
                        );
                    }
                    (a + part)?
                }
            });
        }
        acc.expect("at least one rank").to_device(t.device())
    }
    /// Releases this process's ranks waiting on the mesh; the executor then tells the
    /// other processes, with the error that stopped this rank.
    fn abort(&self) {
        self.mesh.fail_local(&format!(
            "another rank of the tensor-parallel group failed (rank {} of group {}, in process {})",
            self.rank,
            self.group,
            self.mesh.rank()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_from_variables() {
        assert_eq!(Launch::parse(None, None, None).unwrap(), None);
        assert_eq!(Launch::parse(None, Some("1"), None).unwrap(), None);
        let l = Launch::parse(Some("1"), Some("2"), Some("node0"))
            .unwrap()
            .unwrap();
        assert_eq!(
            l,
            Launch {
                rank: 1,
                world: 2,
                master: format!("node0:{DEFAULT_PORT}")
            }
        );
        let l = Launch::parse(Some("0"), Some("2"), Some("10.0.0.1:4000"))
            .unwrap()
            .unwrap();
        assert_eq!(l.master, "10.0.0.1:4000");
        let msg = |r, w, m| Launch::parse(r, w, m).unwrap_err().to_string();
        assert!(msg(Some("0"), None, Some("h")).contains("MOLD_WORLD_SIZE is not set"));
        assert!(msg(None, Some("2"), Some("h")).contains("MOLD_RANK is not set"));
        assert!(msg(Some("2"), Some("2"), Some("h")).contains("MOLD_RANK=\"2\""));
        assert!(msg(Some("0"), Some("2"), None).contains("MOLD_MASTER_ADDR is not set"));
        assert!(msg(Some("0"), Some("x"), Some("h")).contains("MOLD_WORLD_SIZE=\"x\""));
        assert!(msg(Some("0"), Some("2"), Some("h:port")).contains("not a number"));
    }

    #[test]
    fn ownership_cuts_sorted_devices_into_contiguous_shares() {
        let d = |s: &str| s.parse::<DeviceId>().unwrap();
        let devs = [
            d("cuda:3"),
            d("cuda:0"),
            d("cuda:2"),
            d("cuda:1"),
            d("cuda:4"),
        ];
        let o = Ownership::split(&devs, 2).unwrap();
        assert_eq!(o.share(0), &[d("cuda:0"), d("cuda:1"), d("cuda:2")]);
        assert_eq!(o.share(1), &[d("cuda:3"), d("cuda:4")]);
        assert_eq!(o.owner(&d("cuda:3")), Some(1));
        assert_eq!(o.local_id(1, &d("cuda:4")), Some(d("cuda:1")));
        assert_eq!(o.local_id(0, &d("cuda:4")), None);
        let e = Ownership::split(&devs[..1], 2).unwrap_err().to_string();
        assert!(e.contains("at most one process per device"), "{e}");
        let emu = Ownership::split(&[d("emu:1"), d("emu:0")], 2).unwrap();
        assert_eq!(emu.local_id(1, &d("emu:1")), Some(d("emu:1")));
    }

    #[test]
    fn tensors_round_trip_with_shape_and_dtype() {
        let a = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = a.to_dtype(DType::BF16).unwrap();
        let c = Tensor::new(&[7u32], &Device::Cpu).unwrap();
        let back = decode_shaped(&encode_shaped(&[&a, &b, &c]).unwrap()).unwrap();
        assert_eq!(
            back[0].to_vec2::<f32>().unwrap(),
            a.to_vec2::<f32>().unwrap()
        );
        assert_eq!(back[1].dtype(), DType::BF16);
        assert_eq!(back[1].dims(), &[2, 3]);
        assert_eq!(back[2].to_vec1::<u32>().unwrap(), vec![7]);
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn meshes(world: usize, run: Vec<Vec<(&'static str, String)>>) -> Vec<Result<Mesh>> {
        let master = format!("127.0.0.1:{}", free_port());
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let l = Launch {
                        rank,
                        world,
                        master: master.clone(),
                    };
                    let run = run[rank].clone();
                    s.spawn(move || Mesh::connect(&l, &run, Duration::from_secs(10)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn three_processes_exchange_messages_and_all_reduce() {
        let run = vec![vec![("plan", "abc".to_string())]; 3];
        let ms: Vec<Arc<Mesh>> = meshes(3, run)
            .into_iter()
            .map(|m| Arc::new(m.unwrap()))
            .collect();
        ms[2].send(1, "x", b"hi").unwrap();
        assert_eq!(ms[1].recv(2, "x").unwrap(), b"hi");
        // A group of 4 ranks over 3 processes (process 1 runs two of them).
        let procs = vec![0, 1, 1, 2];
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = procs
                .iter()
                .enumerate()
                .map(|(r, &p)| {
                    let c = TcpComm::new(ms[p].clone(), "g".into(), r, procs.clone());
                    s.spawn(move || {
                        let t = Tensor::new(&[r as f32, 1.0], &Device::Cpu).unwrap();
                        let x = c.all_reduce_sum(&t).unwrap();
                        c.all_reduce_sum(&x).unwrap().to_vec1::<f32>().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outs {
            assert_eq!(o, vec![24.0, 16.0]);
        }
        // Each waits for the others' goodbyes: drop them together.
        std::thread::scope(|s| {
            for m in ms {
                s.spawn(move || drop(m));
            }
        });
    }

    #[test]
    fn a_failing_process_releases_the_others_naming_itself() {
        let run = vec![vec![("plan", "abc".to_string())]; 2];
        let ms: Vec<Mesh> = meshes(2, run).into_iter().map(|m| m.unwrap()).collect();
        ms[1].abort_all("process 1: cuda:1 ran out of memory");
        let e = ms[0].recv(1, "never").unwrap_err().to_string();
        assert!(e.contains("process 1: cuda:1 ran out of memory"), "{e}");
    }

    #[test]
    fn a_process_that_dies_is_noticed() {
        let run = vec![vec![("plan", "abc".to_string())]; 2];
        let mut ms: Vec<Mesh> = meshes(2, run).into_iter().map(|m| m.unwrap()).collect();
        let m1 = ms.pop().unwrap();
        // Gone without a goodbye, as a crash would.
        m1.closing.store(true, Ordering::SeqCst);
        for s in m1.streams.iter().flatten() {
            s.shutdown(Shutdown::Both).unwrap();
        }
        std::mem::forget(m1);
        let e = ms[0].recv(1, "never").unwrap_err().to_string();
        assert!(e.contains("process 1 closed its connection"), "{e}");
    }

    #[test]
    fn processes_that_disagree_are_refused_naming_the_difference() {
        let run = vec![
            vec![("plan", "abc".to_string()), ("seed", "0".to_string())],
            vec![("plan", "abc".to_string()), ("seed", "7".to_string())],
        ];
        let rs = meshes(2, run);
        let e0 = rs[0].as_ref().unwrap_err().to_string();
        assert!(
            e0.contains("seed is 7 in process 1 but 0 in process 0"),
            "{e0}"
        );
        let e1 = rs[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains("refused"), "{e1}");
    }

    #[test]
    fn a_missing_process_is_named_after_the_timeout() {
        let master = format!("127.0.0.1:{}", free_port());
        let l = Launch {
            rank: 0,
            world: 3,
            master,
        };
        let e = Mesh::connect(&l, &[], Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(e.contains("for process(es) 1, 2"), "{e}");
    }
}
