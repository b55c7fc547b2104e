//! Mesh tests on loopback: messages, all-reduce, failures, and a rendezvous that
//! survives stray and hostile connections.

use super::auth::{self, Side, NONCE_BYTES};
use super::wire::{
    read_frame, read_hello, write_frame, write_hello, Hello, Role, KIND_ABORT, KIND_DATA, MAGIC,
    PROTOCOL_VERSION, TAG_CHALLENGE, TAG_PROOF,
};
use super::*;
use crate::comm::{Comm, CommError, CommOptions, TcpComm};
use crate::error::Result;
use candle_core::{Device, Tensor};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn opts(timeout_ms: u64) -> CommOptions {
    CommOptions {
        dist_timeout: Duration::from_millis(timeout_ms),
        ..CommOptions::default()
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn meshes(world: usize, run: Vec<Vec<(&'static str, String)>>) -> Vec<Result<Mesh>> {
    meshes_with(world, run, &opts(10_000))
}

fn meshes_with(
    world: usize,
    run: Vec<Vec<(&'static str, String)>>,
    o: &CommOptions,
) -> Vec<Result<Mesh>> {
    let master = format!("127.0.0.1:{}", free_port());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let l = Launch {
                    rank,
                    world,
                    master: master.clone(),
                    local_rank: None,
                    launcher: Launcher::Mold,
                };
                let run = run[rank].clone();
                s.spawn(move || Mesh::connect(&l, &run, o))
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
        local_rank: None,
        launcher: Launcher::Mold,
    };
    let e = Mesh::connect(&l, &[], &opts(300)).unwrap_err().to_string();
    assert!(e.contains("for process(es) 1, 2"), "{e}");
}

#[test]
fn failures_are_typed_for_communicators_and_raise_the_signal() {
    let run = vec![vec![("plan", "abc".to_string())]; 2];
    let ms: Vec<Arc<Mesh>> = meshes_with(2, run, &opts(1_000))
        .into_iter()
        .map(|m| Arc::new(m.unwrap()))
        .collect();
    let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    let c = TcpComm::new(ms[0].clone(), "g".into(), 0, vec![0, 1]);
    // Process 1 never joins the all-reduce: a Timeout after MOLD_DIST_TIMEOUT_S.
    let e = c.all_reduce_sum(&t).unwrap_err();
    assert!(
        matches!(CommError::of(&e), Some(CommError::Timeout { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("MOLD_DIST_TIMEOUT_S"), "{e}");
    // Process 1 fails: process 0's rank is released as PeerAborted, naming it.
    ms[1].abort_all("process 1: cuda:1 ran out of memory");
    let e = c.all_reduce_sum(&t).unwrap_err();
    assert!(
        matches!(
            CommError::of(&e),
            Some(CommError::PeerAborted { cause, .. }) if cause.contains("cuda:1 ran out of memory")
        ),
        "{e}"
    );
    assert_eq!(
        ms[0].abort_signal().reason().as_deref(),
        Some("process 1: cuda:1 ran out of memory")
    );
}

/// Connects to `addr` once it listens.
fn connect_when_listening(addr: &str) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{addr}: {e}"),
        }
    }
}

/// A 2-process rendezvous where `stray` runs against process 0's address after process 0
/// listens and before process 1 starts: both processes must still join and talk. Returns
/// what `stray` returned (a connection it keeps open).
fn survives<T: Send>(o: &CommOptions, stray: impl FnOnce(&str) -> T + Send) -> T {
    let master = format!("127.0.0.1:{}", free_port());
    let run = vec![("plan", "abc".to_string())];
    let run = &run;
    std::thread::scope(|s| {
        let l0 = Launch {
            rank: 0,
            world: 2,
            master: master.clone(),
            local_rank: None,
            launcher: Launcher::Mold,
        };
        let l1 = Launch {
            rank: 1,
            ..l0.clone()
        };
        let h0 = s.spawn(move || Mesh::connect(&l0, run, o));
        let kept = stray(&master);
        let h1 = s.spawn(move || Mesh::connect(&l1, run, o));
        let m0 = h0.join().unwrap().expect("process 0 joined");
        let m1 = h1.join().unwrap().expect("process 1 joined");
        m1.send(0, "x", b"ok").unwrap();
        assert_eq!(m0.recv(1, "x").unwrap(), b"ok");
        assert_eq!(m0.failure(), None);
        s.spawn(move || drop(m0));
        drop(m1);
        kept
    })
}

/// Reads until the other side closes (or resets); fails if it stays open 10 s.
fn closed_by_peer(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the connection was not dropped: {e}"),
    }
    got
}

#[test]
fn random_bytes_are_dropped_and_the_rendezvous_completes() {
    let o = opts(10_000);
    let mut s = survives(&o, |addr| {
        let mut s = connect_when_listening(addr);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        s.write_all(&noise).unwrap();
        s
    });
    closed_by_peer(&mut s);
}

#[test]
fn huge_lengths_are_refused_without_allocating_them() {
    let o = opts(10_000);
    let (mut a, mut b) = survives(&o, |addr| {
        // A handshake announcing a 4 GiB body...
        let mut a = connect_when_listening(addr);
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&u32::MAX.to_le_bytes());
        a.write_all(&h).unwrap();
        // ...and a frame announcing 16 EiB (the old protocol's hello).
        let mut b = connect_when_listening(addr);
        let mut f = vec![0u8, 5, 0, 0, 0];
        f.extend_from_slice(b"hello");
        f.extend_from_slice(&u64::MAX.to_le_bytes());
        b.write_all(&f).unwrap();
        (a, b)
    });
    closed_by_peer(&mut a);
    closed_by_peer(&mut b);
}

#[test]
fn a_wrong_magic_is_dropped() {
    let o = opts(10_000);
    let mut s = survives(&o, |addr| {
        let mut s = connect_when_listening(addr);
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        s
    });
    assert!(closed_by_peer(&mut s).is_empty());
}

fn hello_of(rank: u32, world: u32) -> Hello {
    Hello {
        role: Role::Join,
        rank,
        world,
        port: 1,
        nonce: auth::nonce(),
        run: "plan=abc".into(),
    }
}

/// A client's handshake with `version` in its header: the bytes and the body.
fn hello(version: u32) -> (Hello, Vec<u8>, Vec<u8>) {
    let h = hello_of(1, 2);
    let mut b = Vec::new();
    let body = write_hello(&mut b, &h).unwrap();
    b[8..12].copy_from_slice(&version.to_le_bytes());
    (h, b, body)
}

/// Sends a handshake as rank 1 of 2 and answers the challenge with the proof that
/// `secret` gives (the real one or a guess).
fn handshake_with(addr: &str, secret: Option<&str>) -> TcpStream {
    let mut s = connect_when_listening(addr);
    let (h, b, body) = hello(PROTOCOL_VERSION);
    s.write_all(&b).unwrap();
    let (kind, tag, payload) = read_frame(&mut s).unwrap();
    assert_eq!((kind, tag.as_str()), (KIND_DATA, TAG_CHALLENGE));
    let theirs: auth::Nonce = payload[..NONCE_BYTES].try_into().unwrap();
    let proof = auth::prove(secret, Side::Connecting, &h.nonce, &theirs, &body);
    write_frame(&mut s, KIND_DATA, TAG_PROOF, &proof).unwrap();
    s
}

/// The refusal frame a dropped mold process gets (after the challenge, if any).
fn refusal(s: &mut TcpStream) -> String {
    let got = closed_by_peer(s);
    let mut r = got.as_slice();
    loop {
        let (kind, tag, payload) = read_frame(&mut r).unwrap();
        if tag == TAG_CHALLENGE {
            continue;
        }
        assert_eq!((kind, tag.as_str()), (KIND_ABORT, "refused"));
        return String::from_utf8(payload).unwrap();
    }
}

#[test]
fn a_wrong_secret_or_version_is_refused_and_dropped() {
    let mut o = opts(10_000);
    o.secret = Some("s3cret".into());
    let (mut a, mut b, mut c) = survives(&o, |addr| {
        let a = handshake_with(addr, Some("guess"));
        let b = handshake_with(addr, None);
        let mut c = connect_when_listening(addr);
        c.write_all(&hello(99).1).unwrap();
        (a, b, c)
    });
    assert!(refusal(&mut a).contains("MOLD_DIST_SECRET"));
    assert!(refusal(&mut b).contains("MOLD_DIST_SECRET"));
    let v = refusal(&mut c);
    assert!(
        v.contains("protocol version 99") && !v.contains('\n'),
        "{v}"
    );
}

#[test]
fn a_process_with_the_wrong_secret_is_refused_and_process_0_keeps_waiting() {
    let master = format!("127.0.0.1:{}", free_port());
    let mut o0 = opts(1_500);
    o0.secret = Some("a".into());
    let mut o1 = o0.clone();
    o1.secret = Some("b".into());
    let (r0, r1) = std::thread::scope(|s| {
        let l0 = Launch {
            rank: 0,
            world: 2,
            master: master.clone(),
            local_rank: None,
            launcher: Launcher::Mold,
        };
        let l1 = Launch {
            rank: 1,
            ..l0.clone()
        };
        let o0 = &o0;
        let h0 = s.spawn(move || Mesh::connect(&l0, &[], o0));
        let t = Instant::now();
        let r1 = Mesh::connect(&l1, &[], &o1);
        assert!(
            t.elapsed() < Duration::from_millis(1_400),
            "refused at once"
        );
        (h0.join().unwrap(), r1)
    });
    let e1 = r1.unwrap_err().to_string();
    assert!(
        e1.contains("refused") && e1.contains("MOLD_DIST_SECRET"),
        "{e1}"
    );
    let e0 = r0.unwrap_err().to_string();
    assert!(e0.contains("for process(es) 1"), "{e0}");
}

#[test]
fn a_silent_client_does_not_hold_up_the_rendezvous_and_is_dropped() {
    let mut o = opts(10_000);
    o.handshake_timeout = Duration::from_secs(3);
    let (mut s, t) = survives(&o, |addr| (connect_when_listening(addr), Instant::now()));
    // The rendezvous went on while the silent client was still connected...
    assert!(t.elapsed() < o.handshake_timeout, "{:?}", t.elapsed());
    // ...which is dropped once its handshake time is up.
    assert!(closed_by_peer(&mut s).is_empty());
    assert!(t.elapsed() >= o.handshake_timeout - Duration::from_millis(100));
}

#[test]
fn a_stray_frame_after_the_handshake_is_bounded() {
    // A frame too long to be one of ours ends the connection as a failure, not an
    // allocation of its length.
    let mut b = Vec::new();
    write_frame(&mut b, 0, "x", b"").unwrap();
    let n = b.len();
    b[n - 8..].copy_from_slice(&(MAX_FRAME_BYTES + 1).to_le_bytes());
    let e = super::wire::read_frame(&mut b.as_slice()).unwrap_err();
    assert!(e.to_string().contains("over the limit"), "{e}");
}

/// Connects to `addr` from the loopback address `from` (127.0.0.2, …: another IP than
/// the real processes', which connect from 127.0.0.1), once `addr` listens.
fn connect_from(from: &str, addr: &str) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let to: std::net::SocketAddr = addr.parse().unwrap();
    let local: std::net::SocketAddr = format!("{from}:0").parse().unwrap();
    let t = Instant::now();
    loop {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        s.bind(&local.into()).unwrap();
        match s.connect(&to.into()) {
            Ok(()) => return s.into(),
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{addr} from {from}: {e}"),
        }
    }
}

/// Copies bytes both ways between `a` and `b` until either closes; returns what `a` sent.
fn relay(a: TcpStream, b: TcpStream) -> Arc<std::sync::Mutex<Vec<u8>>> {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let pump =
        |mut from: TcpStream, mut to: TcpStream, log: Option<Arc<std::sync::Mutex<Vec<u8>>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 1 << 14];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    if let Some(l) = &log {
                        l.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Write);
            });
        };
    pump(
        a.try_clone().unwrap(),
        b.try_clone().unwrap(),
        Some(seen.clone()),
    );
    pump(b, a, None);
    seen
}

fn launch_at(rank: usize, world: usize, master: &str) -> Launch {
    Launch {
        rank,
        world,
        master: master.to_string(),
        local_rank: None,
        launcher: Launcher::Mold,
    }
}

#[test]
fn a_trickling_client_is_dropped_at_the_handshake_deadline() {
    let mut o = opts(10_000);
    o.handshake_timeout = Duration::from_secs(1);
    let trickler = survives(&o, |addr| {
        let mut s = connect_when_listening(addr);
        let t = Instant::now();
        std::thread::spawn(move || {
            // The start of a handshake announcing a 60 kB body, one byte every 200 ms:
            // each read gets a byte well within any per-read timeout.
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            h.extend_from_slice(&60_000u32.to_le_bytes());
            h.resize(50, b'x');
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            for b in h {
                if s.write_all(&[b]).is_err() {
                    return Some(t.elapsed());
                }
                match s.read(&mut [0u8; 64]) {
                    Ok(0) => return Some(t.elapsed()),
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => return Some(t.elapsed()),
                }
            }
            // Still connected after 50 bytes (10 s).
            None
        })
    });
    let after = trickler
        .join()
        .unwrap()
        .expect("the trickling client was never dropped");
    assert!(
        after >= Duration::from_millis(800) && after < Duration::from_secs(5),
        "dropped after {after:?}, its handshake time being 1 s"
    );
}

#[test]
fn connections_past_the_cap_from_one_address_are_dropped_unread() {
    let mut o = opts(30_000);
    o.handshake_timeout = Duration::from_secs(30);
    o.pending_per_addr = 2;
    let (mut a, mut b, mut c) = survives(&o, |addr| {
        // Two silent connections from 127.0.0.2 hold its two slots...
        let a = connect_from("127.0.0.2", addr);
        let b = connect_from("127.0.0.2", addr);
        // ...so a third from there is dropped at once, not after 30 s.
        let c = connect_from("127.0.0.2", addr);
        (a, b, c)
    });
    assert!(closed_by_peer(&mut c).is_empty());
    // The first two are still waiting for their handshake.
    for s in [&mut a, &mut b] {
        s.set_nonblocking(true).unwrap();
        let e = s.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    }
}

#[test]
fn a_process_whose_first_connection_is_dropped_connects_again_and_joins() {
    let o = opts(10_000);
    let master = format!("127.0.0.1:{}", free_port());
    // Process 1 reaches process 0 through a front that drops its first connection once
    // the handshake arrived, then relays the next one.
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let front_addr = front.local_addr().unwrap().to_string();
    let run = vec![("plan", "abc".to_string())];
    let (run, o) = (&run, &o);
    std::thread::scope(|sc| {
        let (l0, l1) = (launch_at(0, 2, &master), launch_at(1, 2, &front_addr));
        let h0 = sc.spawn(move || Mesh::connect(&l0, run, o));
        let h1 = sc.spawn(move || Mesh::connect(&l1, run, o));
        let (mut first, _) = front.accept().unwrap();
        first.read_exact(&mut [0u8; 16]).unwrap();
        drop(first);
        // Process 1 connects again (a process that gave up would never: 10 s at most).
        front.set_nonblocking(true).unwrap();
        let t = Instant::now();
        let second = loop {
            match front.accept() {
                Ok((s, _)) => break Some(s),
                Err(_) if t.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(_) => break None,
            }
        };
        let second = second.expect("process 1 did not connect again");
        second.set_nonblocking(false).unwrap();
        relay(second, connect_when_listening(&master));
        let m0 = h0.join().unwrap().expect("process 0 joined");
        let m1 = h1
            .join()
            .unwrap()
            .expect("process 1 joined on its second connection");
        m1.send(0, "x", b"ok").unwrap();
        assert_eq!(m0.recv(1, "x").unwrap(), b"ok");
        sc.spawn(move || drop(m0));
        drop(m1);
    });
}

#[test]
fn a_master_that_cannot_prove_the_secret_gets_no_proof() {
    let mut o = opts(10_000);
    o.secret = Some("right".into());
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = launch_at(1, 2, &fake.local_addr().unwrap().to_string());
    let o = &o;
    std::thread::scope(|sc| {
        let h1 = sc.spawn(move || Mesh::connect(&l1, &[], o));
        let (mut s, _) = fake.accept().unwrap();
        let (h, body) = read_hello(&mut s).unwrap();
        let ours = auth::nonce();
        let proof = auth::prove(Some("wrong"), Side::Accepting, &ours, &h.nonce, &body);
        write_frame(
            &mut s,
            KIND_DATA,
            TAG_CHALLENGE,
            &[&ours[..], &proof[..]].concat(),
        )
        .unwrap();
        let e = h1.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("refused process 0") && e.contains("MOLD_DIST_SECRET"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
        // All the fake master gets back is the refusal, no proof.
        let got = closed_by_peer(&mut s);
        let mut r = got.as_slice();
        let (kind, _, _) = read_frame(&mut r).unwrap();
        assert_eq!(kind, KIND_ABORT);
        assert!(r.is_empty(), "more than the refusal: {got:?}");
    });
}

#[test]
fn a_captured_proof_replayed_does_not_authenticate() {
    let mut o = opts(10_000);
    o.secret = Some("s3cret".into());
    let master = format!("127.0.0.1:{}", free_port());
    // Process 1 joins through a relay that records what it sends.
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let front_addr = front.local_addr().unwrap().to_string();
    let (o, master) = (&o, &master);
    std::thread::scope(|sc| {
        let l0 = launch_at(0, 3, master);
        let l1 = launch_at(1, 3, &front_addr);
        let l2 = launch_at(2, 3, master);
        let h0 = sc.spawn(move || Mesh::connect(&l0, &[], o));
        let h1 = sc.spawn(move || Mesh::connect(&l1, &[], o));
        let (a, _) = front.accept().unwrap();
        let seen = relay(a, connect_when_listening(master));
        // Process 1's handshake and proof, as an eavesdropper sees them.
        let t = Instant::now();
        let captured = loop {
            let got = seen.lock().unwrap().clone();
            let mut r = got.as_slice();
            if read_hello(&mut r).is_ok() && read_frame(&mut r).is_ok() {
                break got[..got.len() - r.len()].to_vec();
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no proof came");
            std::thread::sleep(Duration::from_millis(5));
        };
        // Replayed on a connection of its own, it answers a challenge it was not made for.
        let mut r = connect_when_listening(master);
        r.write_all(&captured).unwrap();
        let why = refusal(&mut r);
        assert!(why.contains("MOLD_DIST_SECRET"), "{why}");
        // The run goes on: process 2 joins, and all three talk.
        let h2 = sc.spawn(move || Mesh::connect(&l2, &[], o));
        let ms: Vec<Mesh> = [h0, h1, h2]
            .into_iter()
            .map(|h| h.join().unwrap().expect("joined"))
            .collect();
        ms[2].send(1, "x", b"ok").unwrap();
        assert_eq!(ms[1].recv(2, "x").unwrap(), b"ok");
        for m in ms {
            sc.spawn(move || drop(m));
        }
    });
}

#[test]
fn a_master_address_off_loopback_needs_a_secret() {
    for (rank, master) in [
        (0, "192.0.2.1:29517"),
        (1, "node0.invalid:29517"),
        (1, "[2001:db8::1]:1"),
    ] {
        let e = Mesh::connect(&launch_at(rank, 2, master), &[], &opts(10_000))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MOLD_DIST_SECRET") && e.contains("not a loopback address"),
            "{master}: {e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // With the secret set, the same launch goes on to the network (where process 0
    // cannot listen: that address is not this host's).
    let mut o = opts(500);
    o.secret = Some("s".into());
    let e = Mesh::connect(&launch_at(0, 2, "192.0.2.1:29517"), &[], &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot listen"), "{e}");
    for a in [
        "127.0.0.1:1",
        "127.9.9.9:5",
        "localhost:1",
        "LOCALHOST",
        "[::1]:29517",
        "::1",
        "[::ffff:127.0.0.1]:1",
    ] {
        assert!(is_loopback_host(a), "{a}");
    }
    for a in [
        "10.0.0.1:1",
        "node0:1",
        "0.0.0.0:1",
        "[::]:1",
        "localhost.example.com:1",
        "",
        "128.0.0.1",
    ] {
        assert!(!is_loopback_host(a), "{a}");
    }
}

#[test]
fn mesh_sockets_have_a_write_timeout_and_keep_alive() {
    let o = opts(3_000);
    let run = vec![vec![("plan", "abc".to_string())]; 2];
    let ms: Vec<Mesh> = meshes_with(2, run, &o)
        .into_iter()
        .map(|m| m.unwrap())
        .collect();
    for m in &ms {
        for s in m.streams.iter().flatten() {
            assert_eq!(s.write_timeout().unwrap(), Some(o.dist_timeout));
            let r = socket2::SockRef::from(s);
            assert!(r.keepalive().unwrap());
            #[cfg(target_os = "linux")]
            assert_eq!(r.tcp_keepalive_time().unwrap(), super::mesh::KEEPALIVE_IDLE);
        }
    }
    std::thread::scope(|s| {
        for m in ms {
            s.spawn(move || drop(m));
        }
    });
}
