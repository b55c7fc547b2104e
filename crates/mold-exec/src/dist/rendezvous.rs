//! The rendezvous: process 0 listens at `MOLD_MASTER_ADDR` (bound to that address only),
//! every other process joins there, and then each pair of processes connects directly.
//!
//! Every connection opens with a handshake ([`super::wire::Hello`]), read on a thread of
//! its own within `handshake_timeout`: one that is not a mold process (wrong magic,
//! oversized or broken, silent) or must not join (another protocol version, wrong
//! secret) is logged in one line and dropped, and the rendezvous goes on waiting for
//! the real processes. A process that passes the handshake but disagrees on the run
//! (world size, rank, plan fingerprint, arguments) is refused and the rendezvous fails,
//! naming the difference.

use super::wire::{
    read_frame, read_hello, write_frame, write_hello, Hello, Reject, Role, KIND_ABORT, KIND_DATA,
};
use super::Launch;
use crate::comm::CommOptions;
use crate::error::{ExecError, Result};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Connections whose handshake is being read at once; more are dropped unread.
const MAX_PENDING: usize = 64;

fn io_err(what: &str, e: std::io::Error) -> ExecError {
    ExecError::Dist(format!("{what}: {e}"))
}

/// `k=v;k=v` → pairs.
fn parse_kv(s: &str) -> HashMap<String, String> {
    s.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
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

/// Reads one frame with a deadline.
fn read_frame_by(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, String, Vec<u8>)> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    let r = read_frame(s);
    s.set_read_timeout(None)?;
    r
}

type Greeting = (SocketAddr, std::result::Result<(TcpStream, Hello), Reject>);

/// Accepts connections and reads their handshakes, each on a thread of its own.
struct Acceptor {
    listener: TcpListener,
    tx: mpsc::Sender<Greeting>,
    rx: mpsc::Receiver<Greeting>,
    pending: Arc<AtomicUsize>,
    limit: Duration,
    secret: Option<String>,
    /// This process's rank, for log lines.
    me: usize,
}

impl Acceptor {
    fn new(listener: TcpListener, opts: &CommOptions, me: usize) -> Result<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("listening", e))?;
        let (tx, rx) = mpsc::channel();
        Ok(Acceptor {
            listener,
            tx,
            rx,
            pending: Arc::new(AtomicUsize::new(0)),
            limit: opts.handshake_limit(),
            secret: opts.secret.clone(),
            me,
        })
    }

    /// Logs a dropped connection (one line).
    fn drop_line(&self, addr: &SocketAddr, why: &str) {
        eprintln!(
            "warning: process {}: dropped a connection from {addr}: {why}",
            self.me
        );
    }

    /// The next connection that passed the handshake; `None` at the deadline.
    fn next(&mut self, deadline: Instant) -> Result<Option<(TcpStream, SocketAddr, Hello)>> {
        loop {
            while let Ok((addr, r)) = self.rx.try_recv() {
                match r {
                    Ok((s, h)) => return Ok(Some((s, addr, h))),
                    Err(Reject::Stray(why) | Reject::Refused(why)) => self.drop_line(&addr, &why),
                }
            }
            match self.listener.accept() {
                Ok((s, addr)) => self.greet(s, addr),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(io_err("accepting a connection", e)),
            }
        }
    }

    /// Reads `s`'s handshake on a thread of its own.
    fn greet(&self, mut s: TcpStream, addr: SocketAddr) {
        if self.pending.load(Ordering::SeqCst) >= MAX_PENDING {
            self.drop_line(&addr, "too many connections are still to say who they are");
            return;
        }
        let (tx, pending, limit) = (self.tx.clone(), self.pending.clone(), self.limit);
        let secret = self.secret.clone();
        let me = self.me;
        pending.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new()
            .name("mold-dist-hello".into())
            .spawn(move || {
                let r = (|| {
                    let setup = |e| Reject::Stray(format!("socket: {e}"));
                    s.set_nonblocking(false).map_err(setup)?;
                    s.set_read_timeout(Some(limit.max(Duration::from_millis(1))))
                        .map_err(setup)?;
                    let _ = s.set_nodelay(true);
                    match read_hello(&mut s, secret.as_deref()) {
                        Ok(h) => {
                            s.set_read_timeout(None).map_err(setup)?;
                            Ok((s, h))
                        }
                        Err(Reject::Refused(why)) => {
                            let _ = s.set_write_timeout(Some(limit));
                            let msg = format!("process {me} refused this connection: {why}");
                            let _ = write_frame(&mut s, KIND_ABORT, "refused", msg.as_bytes());
                            Err(Reject::Refused(why))
                        }
                        Err(Reject::Stray(why)) => Err(Reject::Stray(why)),
                    }
                })();
                pending.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send((addr, r));
            });
        if let Err(e) = spawned {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            self.drop_line(&addr, &format!("cannot start a thread to read it: {e}"));
        }
    }
}

/// Connects this process to every other one; `result[q]` is the connection to process q.
pub(super) fn rendezvous(
    launch: &Launch,
    run: &[(&str, String)],
    opts: &CommOptions,
) -> Result<Vec<Option<TcpStream>>> {
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
    let deadline = Instant::now() + opts.dist_timeout;
    if launch.rank == 0 {
        master(launch, run, &desc, opts, deadline)
    } else {
        join(launch, &desc, opts, deadline)
    }
}

/// Process 0: waits for every other process at `launch.master`, checks it runs the same,
/// then sends everyone the address table.
fn master(
    launch: &Launch,
    run: &[(&str, String)],
    desc: &str,
    opts: &CommOptions,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let world = launch.world;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let listener = TcpListener::bind(&launch.master).map_err(|e| {
        ExecError::Dist(format!(
            "process 0 cannot listen on MOLD_MASTER_ADDR={} ({e}): give an address of process \
             0's host and a free port",
            launch.master
        ))
    })?;
    let mut acc = Acceptor::new(listener, opts, 0)?;
    let mut addrs: Vec<String> = vec![String::new(); world];
    let mut got = 0;
    while got < world - 1 {
        let Some((mut s, peer, hello)) = acc.next(deadline)? else {
            let missing: Vec<String> = (1..world)
                .filter(|r| streams[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(ExecError::Dist(format!(
                "process 0 waited {:.0} s at {} for process(es) {} of MOLD_WORLD_SIZE={world}: \
                 start them (same MOLD_MASTER_ADDR), or raise MOLD_DIST_TIMEOUT_S",
                opts.dist_timeout.as_secs_f64(),
                launch.master,
                missing.join(", ")
            )));
        };
        if hello.role != Role::Join {
            acc.drop_line(&peer, "a peer greeting where processes join");
            continue;
        }
        let (r, w) = (hello.rank as usize, hello.world as usize);
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
        if hello.run != desc {
            let other = parse_kv(&hello.run);
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
                    format!("`{}` in process {r}, `{desc}` in process 0", hello.run)
                });
            return Err(refuse(
                format!(
                    "processes disagree on what to run: {diff}; start every process \
                     with the same plan and arguments"
                ),
                &mut s,
            ));
        }
        addrs[r] = SocketAddr::new(peer.ip(), hello.port).to_string();
        streams[r] = Some(s);
        got += 1;
    }
    let table = addrs.join(",");
    for s in streams.iter_mut().flatten() {
        write_frame(s, KIND_DATA, "table", table.as_bytes())
            .map_err(|e| io_err("sending the address table", e))?;
    }
    Ok(streams)
}

/// Process `launch.rank` > 0: joins at process 0, then connects to the lower-ranked
/// processes and accepts the higher-ranked ones.
fn join(
    launch: &Launch,
    desc: &str,
    opts: &CommOptions,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let (rank, world) = (launch.rank, launch.world);
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut s = connect_retry(&launch.master, deadline, "process 0 (MOLD_MASTER_ADDR)")?;
    // Listen on the interface that reaches process 0 (the address it will hand out).
    let ip = s.local_addr().map_err(|e| io_err("local address", e))?.ip();
    let listener = TcpListener::bind((ip, 0)).map_err(|e| io_err("listening for peers", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| io_err("listen address", e))?
        .port();
    let hello = |role, port| Hello {
        role,
        rank: rank as u32,
        world: world as u32,
        port,
        secret: opts.secret.clone().unwrap_or_default().into_bytes(),
        run: desc.to_string(),
    };
    write_hello(&mut s, &hello(Role::Join, port)).map_err(|e| io_err("greeting process 0", e))?;
    let (kind, tag, payload) = read_frame_by(&mut s, deadline).map_err(|e| {
        ExecError::Dist(format!(
            "process 0 did not answer within {:.0} s ({e}): are all {world} processes \
             started? (MOLD_DIST_TIMEOUT_S)",
            opts.dist_timeout.as_secs_f64()
        ))
    })?;
    if kind == KIND_ABORT {
        return Err(ExecError::Dist(format!(
            "process 0 refused this process: {}",
            String::from_utf8_lossy(&payload)
        )));
    }
    let table: Vec<String> = String::from_utf8_lossy(&payload)
        .split(',')
        .map(str::to_owned)
        .collect();
    if tag != "table" || table.len() != world {
        return Err(ExecError::Dist(format!(
            "unexpected answer `{tag}` from process 0 (not an address table for {world} processes)"
        )));
    }
    streams[0] = Some(s);
    // Lower ranks listen, higher ranks connect.
    for (q, addr) in table.iter().enumerate().take(rank).skip(1) {
        let mut c = connect_retry(addr, deadline, &format!("process {q}"))?;
        write_hello(&mut c, &hello(Role::Peer, 0)).map_err(|e| io_err("greeting a peer", e))?;
        streams[q] = Some(c);
    }
    let mut acc = Acceptor::new(listener, opts, rank)?;
    let mut got = 0;
    while got < world - 1 - rank {
        let Some((c, peer, h)) = acc.next(deadline)? else {
            return Err(ExecError::Dist(format!(
                "process {rank} waited {:.0} s for a connection from a higher-ranked process",
                opts.dist_timeout.as_secs_f64()
            )));
        };
        let q = h.rank as usize;
        if h.role != Role::Peer
            || h.world as usize != world
            || q <= rank
            || q >= world
            || streams[q].is_some()
            || h.run != desc
        {
            acc.drop_line(
                &peer,
                &format!(
                    "not a process of this run ({:?} from MOLD_RANK={q} of {})",
                    h.role, h.world
                ),
            );
            continue;
        }
        streams[q] = Some(c);
        got += 1;
    }
    Ok(streams)
}
