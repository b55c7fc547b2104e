//! The rendezvous: process 0 listens at `MOLD_MASTER_ADDR` (bound to that address only),
//! every other process joins there, and then each pair of processes connects directly.
//!
//! Every connection opens with a handshake ([`super::wire::Hello`]) and a
//! challenge–response over the shared secret ([`super::auth`]), read on a thread of its
//! own within one deadline (`handshake_timeout` from its accept, whatever it sends
//! meanwhile): one that is not a mold process (wrong magic, oversized or broken, too
//! slow) or must not join (another protocol version, no proof of the secret) is logged in
//! one line and dropped, and the rendezvous goes on waiting for the real processes. At
//! most `pending_per_addr` connections from one IP address (and [`MAX_PENDING`] in all)
//! are read at once; more are dropped unread. A process whose connection is dropped
//! before it was taken connects again, until `MOLD_DIST_TIMEOUT_S`. A process that passes
//! the handshake but disagrees on the run (world size, rank, plan fingerprint, arguments)
//! is refused and the rendezvous fails, naming the difference.

use super::auth::{self, Side, NONCE_BYTES, PROOF_BYTES};
use super::wire::{
    read_frame, read_hello, write_frame, write_hello, Hello, Reject, Role, KIND_ABORT, KIND_DATA,
    TAG_CHALLENGE, TAG_PROOF, TAG_WELCOME,
};
use super::Launch;
use crate::comm::CommOptions;
use crate::error::{ExecError, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections whose handshake is being read at once; more are dropped unread.
pub(crate) const MAX_PENDING: usize = 64;

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

/// A socket read against one deadline: each read waits at most what is left of it, so a
/// peer that trickles bytes cannot stretch the wait.
struct Deadlined<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "out of time for it",
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

/// Reads one frame by `deadline`.
fn read_frame_by(s: &TcpStream, deadline: Instant) -> std::io::Result<(u8, String, Vec<u8>)> {
    let r = read_frame(&mut Deadlined { s, deadline });
    s.set_read_timeout(None)?;
    r
}

/// A read that ran out of time (as opposed to a connection that ended).
fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
}

/// A connection the other end closed or reset.
fn dropped(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::NotConnected
    )
}

/// The accepting end of a handshake, by `deadline`: reads the hello, sends the challenge
/// (its nonce and proof), checks the connecting end's proof.
fn accept_handshake(
    s: &mut TcpStream,
    secret: Option<&str>,
    deadline: Instant,
    limit: Duration,
) -> std::result::Result<Hello, Reject> {
    let late = |what: &str, e: std::io::Error| {
        if timed_out(&e) {
            Reject::Stray(format!(
                "no complete {what} within {:.1} s of connecting",
                limit.as_secs_f64()
            ))
        } else {
            Reject::Stray(format!("{what}: {e}"))
        }
    };
    let (hello, body) = read_hello(&mut Deadlined { s, deadline }).map_err(|r| match r {
        // `read_hello` words its own errors; only a timeout needs the limit.
        Reject::Stray(why) if Instant::now() >= deadline => Reject::Stray(format!(
            "no complete handshake within {:.1} s of connecting ({why})",
            limit.as_secs_f64()
        )),
        r => r,
    })?;
    let ours = auth::nonce();
    let proof = auth::prove(secret, Side::Accepting, &ours, &hello.nonce, &body);
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| late("challenge", e))?;
    write_frame(
        s,
        KIND_DATA,
        TAG_CHALLENGE,
        &[&ours[..], &proof[..]].concat(),
    )
    .map_err(|e| late("challenge", e))?;
    let (kind, tag, payload) =
        read_frame(&mut Deadlined { s, deadline }).map_err(|e| late("proof", e))?;
    if kind == KIND_ABORT {
        return Err(Reject::Stray(format!(
            "it refused this process: {}",
            String::from_utf8_lossy(&payload)
        )));
    }
    if tag != TAG_PROOF {
        return Err(Reject::Stray(format!(
            "malformed handshake (`{}` where its proof belongs)",
            tag.escape_debug()
        )));
    }
    if !auth::verify(
        secret,
        Side::Connecting,
        &hello.nonce,
        &ours,
        &body,
        &payload,
    ) {
        return Err(Reject::Refused(
            "it did not prove it knows this process's MOLD_DIST_SECRET (wrong or missing \
             secret): set the same MOLD_DIST_SECRET in every process"
                .into(),
        ));
    }
    let reset = |e| Reject::Stray(format!("socket: {e}"));
    s.set_read_timeout(None).map_err(reset)?;
    s.set_write_timeout(None).map_err(reset)?;
    Ok(hello)
}

/// Why a connecting handshake failed.
enum Attempt {
    /// The other end closed the connection before it took this one: connect again.
    Dropped(String),
    /// Anything else: the rendezvous fails with this message.
    Fatal(String),
}

/// The connecting end of a handshake with `what` at `addr`, by `deadline`: sends `hello`
/// (with a fresh nonce), checks the challenge's proof, sends its own, and waits for the
/// welcome.
fn connect_handshake(
    s: &mut TcpStream,
    hello: &Hello,
    opts: &CommOptions,
    deadline: Instant,
    what: &str,
    addr: &str,
) -> std::result::Result<(), Attempt> {
    let secret = opts.secret.as_ref().map(|s| s.expose());
    let mut hello = hello.clone();
    hello.nonce = auth::nonce();
    let fatal = Attempt::Fatal;
    let waited = opts.dist_timeout.as_secs_f64();
    // Any failure to read: dropped (connect again), out of time, or not a mold answer.
    let failed = |step: &str, e: std::io::Error| {
        if dropped(&e) {
            Attempt::Dropped(format!("{step}: {e}"))
        } else if timed_out(&e) {
            fatal(format!(
                "{what} at {addr} did not answer within {waited:.0} s ({step}): is it running, \
                 and are all processes started? (MOLD_DIST_TIMEOUT_S)"
            ))
        } else {
            fatal(format!("{what} at {addr}: {step}: {e}"))
        }
    };
    let refused = |payload: &[u8]| {
        fatal(format!(
            "{what} refused this process: {}",
            String::from_utf8_lossy(payload)
        ))
    };
    let body = write_hello(s, &hello).map_err(|e| {
        if e.kind() == ErrorKind::InvalidData {
            fatal(format!("greeting {what}: {e}"))
        } else {
            failed("greeting it", e)
        }
    })?;
    let (kind, tag, payload) =
        read_frame_by(s, deadline).map_err(|e| failed("its challenge", e))?;
    if kind == KIND_ABORT {
        return Err(refused(&payload));
    }
    if tag != TAG_CHALLENGE || payload.len() != NONCE_BYTES + PROOF_BYTES {
        return Err(fatal(format!(
            "{what} at {addr} did not answer as a mold process of protocol version {}: \
             is MOLD_MASTER_ADDR right, and is the same mold build run everywhere?",
            super::PROTOCOL_VERSION
        )));
    }
    let (theirs, proof) = payload.split_at(NONCE_BYTES);
    let theirs: auth::Nonce = theirs.try_into().unwrap_or([0; NONCE_BYTES]);
    if !auth::verify(secret, Side::Accepting, &theirs, &hello.nonce, &body, proof) {
        let why = "it did not prove it knows this process's MOLD_DIST_SECRET";
        let _ = write_frame(s, KIND_ABORT, "refused", why.as_bytes());
        return Err(fatal(format!(
            "refused {what} at {addr}: {why} (wrong or missing secret): set the same \
             MOLD_DIST_SECRET in every process, and check that nothing else listens there"
        )));
    }
    let ours = auth::prove(secret, Side::Connecting, &hello.nonce, &theirs, &body);
    write_frame(s, KIND_DATA, TAG_PROOF, &ours).map_err(|e| failed("sending the proof", e))?;
    let (kind, tag, payload) = read_frame_by(s, deadline).map_err(|e| failed("its welcome", e))?;
    match kind {
        KIND_ABORT => Err(refused(&payload)),
        KIND_DATA if tag == TAG_WELCOME => Ok(()),
        _ => Err(fatal(format!(
            "{what} at {addr}: unexpected answer `{}` (not a welcome)",
            tag.escape_debug()
        ))),
    }
}

/// Connects to `what` at `addr` and passes the handshake, connecting again (with a
/// growing pause) while the other end drops the connection before taking it, until
/// `deadline`. `first` is a connection already open to `addr`.
fn dial(
    addr: &str,
    what: &str,
    hello: &Hello,
    opts: &CommOptions,
    deadline: Instant,
    mut first: Option<TcpStream>,
) -> Result<TcpStream> {
    let mut pause = Duration::from_millis(50);
    loop {
        let mut s = match first.take() {
            Some(s) => s,
            None => connect_retry(addr, deadline, what)?,
        };
        match connect_handshake(&mut s, hello, opts, deadline, what, addr) {
            Ok(()) => return Ok(s),
            Err(Attempt::Fatal(m)) => return Err(ExecError::Dist(m)),
            Err(Attempt::Dropped(why)) => {
                if Instant::now() + pause >= deadline {
                    return Err(ExecError::Dist(format!(
                        "{what} at {addr} kept dropping this process's connection ({why}) for \
                         {:.0} s: is it a mold process of this run? (MOLD_DIST_TIMEOUT_S)",
                        opts.dist_timeout.as_secs_f64()
                    )));
                }
                eprintln!(
                    "warning: process {}: {what} at {addr} dropped the connection ({why}); \
                     connecting again",
                    hello.rank
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }
}

type Greeting = (SocketAddr, std::result::Result<(TcpStream, Hello), Reject>);

/// Connections whose handshake is being read: in all, and by IP address.
#[derive(Default)]
struct Pending {
    total: usize,
    by_addr: HashMap<IpAddr, usize>,
}

/// One connection counted in [`Pending`] until it is dropped (whatever ends its thread).
struct PendingSlot {
    pending: Arc<Mutex<Pending>>,
    ip: IpAddr,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.total = p.total.saturating_sub(1);
        if let Some(n) = p.by_addr.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                p.by_addr.remove(&self.ip);
            }
        }
    }
}

/// Accepts connections and reads their handshakes, each on a thread of its own.
struct Acceptor {
    listener: TcpListener,
    tx: mpsc::Sender<Greeting>,
    rx: mpsc::Receiver<Greeting>,
    pending: Arc<Mutex<Pending>>,
    per_addr: usize,
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
            pending: Arc::default(),
            per_addr: opts.pending_per_addr,
            limit: opts.handshake_limit(),
            secret: opts.secret.as_ref().map(|s| s.expose().to_string()),
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
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(io_err("accepting a connection", e)),
            }
        }
    }

    /// Counts a new connection from `ip` as pending; why not, when there are too many.
    fn hold(&self, ip: IpAddr) -> std::result::Result<PendingSlot, String> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.total >= MAX_PENDING {
            return Err(format!(
                "{MAX_PENDING} connections are still to say who they are"
            ));
        }
        let n = p.by_addr.entry(ip).or_insert(0);
        if *n >= self.per_addr {
            return Err(format!(
                "{n} connections from {ip} are still to say who they are (at most {} at once)",
                self.per_addr
            ));
        }
        *n += 1;
        p.total += 1;
        Ok(PendingSlot {
            pending: self.pending.clone(),
            ip,
        })
    }

    /// Reads `s`'s handshake on a thread of its own, by one deadline from now.
    fn greet(&self, mut s: TcpStream, addr: SocketAddr) {
        let slot = match self.hold(addr.ip()) {
            Ok(slot) => slot,
            Err(why) => return self.drop_line(&addr, &why),
        };
        let deadline = Instant::now() + self.limit;
        let (tx, limit, me) = (self.tx.clone(), self.limit, self.me);
        let secret = self.secret.clone();
        let spawned = std::thread::Builder::new()
            .name("mold-dist-hello".into())
            .spawn(move || {
                let r = (|| {
                    s.set_nonblocking(false)
                        .map_err(|e| Reject::Stray(format!("socket: {e}")))?;
                    let _ = s.set_nodelay(true);
                    match accept_handshake(&mut s, secret.as_deref(), deadline, limit) {
                        Ok(h) => Ok((s, h)),
                        Err(Reject::Refused(why)) => {
                            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                            let msg = format!("process {me} refused this connection: {why}");
                            let _ = write_frame(&mut s, KIND_ABORT, "refused", msg.as_bytes());
                            Err(Reject::Refused(why))
                        }
                        Err(Reject::Stray(why)) => Err(Reject::Stray(why)),
                    }
                })();
                drop(slot);
                let _ = tx.send((addr, r));
            });
        if let Err(e) = spawned {
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
    launch.check_secret(opts)?;
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
            let why = "a peer greeting where processes join";
            let _ = write_frame(&mut s, KIND_ABORT, "refused", why.as_bytes());
            acc.drop_line(&peer, why);
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
        if let Err(e) = write_frame(&mut s, KIND_DATA, TAG_WELCOME, &[]) {
            // Gone before it was taken: it connects again.
            acc.drop_line(&peer, &format!("closed before its welcome: {e}"));
            continue;
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

/// Process `launch.rank` > 0: joins at process 0 (connecting again while process 0
/// drops the connection before taking it), then connects to the lower-ranked processes
/// and accepts the higher-ranked ones.
fn join(
    launch: &Launch,
    desc: &str,
    opts: &CommOptions,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let (rank, world) = (launch.rank, launch.world);
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let what = "process 0 (MOLD_MASTER_ADDR)";
    let first = connect_retry(&launch.master, deadline, what)?;
    // Listen on the interface that reaches process 0 (the address it will hand out).
    let ip = first
        .local_addr()
        .map_err(|e| io_err("local address", e))?
        .ip();
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
        nonce: [0; NONCE_BYTES],
        run: desc.to_string(),
    };
    let s = dial(
        &launch.master,
        what,
        &hello(Role::Join, port),
        opts,
        deadline,
        Some(first),
    )?;
    let (kind, tag, payload) = read_frame_by(&s, deadline).map_err(|e| {
        ExecError::Dist(format!(
            "process 0 did not send the address table within {:.0} s ({e}): are all {world} \
             processes started? (MOLD_DIST_TIMEOUT_S)",
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
            "unexpected answer `{}` from process 0 (not an address table for {world} processes)",
            tag.escape_debug()
        )));
    }
    streams[0] = Some(s);
    // Higher ranks connect to lower ones, which accept.
    for (q, addr) in table.iter().enumerate().take(rank).skip(1) {
        let what = format!("process {q}");
        let c = dial(addr, &what, &hello(Role::Peer, 0), opts, deadline, None)?;
        streams[q] = Some(c);
    }
    let mut acc = Acceptor::new(listener, opts, rank)?;
    let mut got = 0;
    while got < world - 1 - rank {
        let Some((mut c, peer, h)) = acc.next(deadline)? else {
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
            let why = format!(
                "not a process of this run ({:?} from MOLD_RANK={q} of {})",
                h.role, h.world
            );
            let msg = format!("process {rank} refused this connection: {why}");
            let _ = write_frame(&mut c, KIND_ABORT, "refused", msg.as_bytes());
            acc.drop_line(&peer, &why);
            continue;
        }
        if let Err(e) = write_frame(&mut c, KIND_DATA, TAG_WELCOME, &[]) {
            acc.drop_line(&peer, &format!("closed before its welcome: {e}"));
            continue;
        }
        streams[q] = Some(c);
        got += 1;
    }
    Ok(streams)
}
