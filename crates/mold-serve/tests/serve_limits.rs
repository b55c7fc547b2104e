//! The server's limits end to end, against misbehaving clients over raw sockets: header,
//! body, write and request deadlines, the connection cap, cross-site requests, listening
//! beyond loopback.

mod common;

use common::*;
use mold_serve::{Gate, Hooks, ServeOptions, Stage};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[test]
fn a_slow_header_is_cut_off_while_health_answers() {
    let o = ServeOptions {
        header_timeout: Duration::from_secs(1),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    // Twenty clients send half a header and stop; one sends nothing at all.
    let mut slow: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-half: ")
                .unwrap();
            s
        })
        .collect();
    slow.push(TcpStream::connect(addr).unwrap());
    // The others are served meanwhile.
    assert_eq!(raw(addr, "GET", "/health", &[], "").status, 200);
    // Each is closed at the header timeout (1 s; hyper's own default is 30 s, and without
    // a timer none): well within 20 s.
    for s in &mut slow {
        assert!(
            closed_within(s, Duration::from_secs(20)),
            "a half-sent header still holds its connection"
        );
    }
    assert_eq!(raw(addr, "GET", "/health", &[], "").status, 200);
    h.shutdown().unwrap();
}

#[test]
fn a_body_that_does_not_arrive_in_time_gets_408() {
    let o = ServeOptions {
        body_timeout: Duration::from_secs(1),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    // A tenth of the body it announces, then nothing.
    write!(
        s,
        "POST /v1/generate HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"prompt\":"
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = parse_response(&out);
    assert_eq!(r.status, 408, "{}", r.text());
    assert!(
        r.message()
            .starts_with("body: not all of it arrived within 1 s (the server's --body-timeout)"),
        "{}",
        r.message()
    );
    h.shutdown().unwrap();
}

#[test]
fn connections_beyond_the_cap_are_refused_and_the_admitted_ones_work() {
    let o = ServeOptions {
        max_connections: 2,
        header_timeout: Duration::from_secs(120),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    // Two connections take both places (accepted in the order they connected).
    let mut held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // A third is answered 503 and closed (or reset), never served.
    let mut third = TcpStream::connect(addr).unwrap();
    third.set_read_timeout(Some(PATIENCE)).unwrap();
    let _ = write!(
        third,
        "GET /health HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    );
    let mut got = Vec::new();
    let _ = third.read_to_end(&mut got);
    let got = String::from_utf8_lossy(&got);
    assert!(!got.contains(" 200 "), "served beyond the cap: {got}");
    if !got.is_empty() {
        assert!(got.starts_with("HTTP/1.1 503"), "{got}");
        assert!(got.contains("too many connections"), "{got}");
    }
    // The admitted ones are served.
    for s in &mut held {
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        write!(
            s,
            "GET /health HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        assert_eq!(parse_response(&out).status, 200);
    }
    drop(held);
    // Their places are given back once they close.
    wait_for(
        || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(PATIENCE)).unwrap();
            let _ = write!(
                s,
                "GET /health HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
            );
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            out.starts_with(b"HTTP/1.1 200")
        },
        "a place freed",
    );
    h.shutdown().unwrap();
}

#[test]
fn a_client_that_does_not_read_is_cut_off_at_the_write_timeout() {
    let o = ServeOptions {
        write_timeout: Duration::from_secs(1),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    // Pipelined requests, more and more, whose answers it never reads: the server's
    // writes stall once the socket buffers are full, then so do the client's.
    let chunk = format!("GET /status HTTP/1.1\r\nhost: {addr}\r\n\r\n").repeat(1000);
    let s = TcpStream::connect(addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(120))).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || loop {
        if let Err(e) = w.write_all(chunk.as_bytes()) {
            let _ = tx.send(e.kind());
            return;
        }
    });
    // The server gives up on the connection: the client's write fails (reset or
    // broken pipe) instead of blocking for good.
    match rx.recv_timeout(PATIENCE) {
        Ok(kind) => assert!(
            !matches!(
                kind,
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the connection of a client that does not read stays open ({kind:?})"
        ),
        Err(_) => panic!("the connection of a client that does not read stays open"),
    }
    drop(s);
    assert_eq!(raw(addr, "GET", "/health", &[], "").status, 200);
    h.shutdown().unwrap();
}

#[test]
fn cross_site_requests_are_refused() {
    let o = ServeOptions {
        allow_hosts: vec!["gpu-box.lan".into()],
        allow_origins: vec!["https://app.example".into()],
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    let own_origin = format!("http://{addr}");
    let b = body(3, 1).to_string();
    /// Method, path, extra headers, the status and what its message says.
    type Case<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>, u16, &'a str);
    let refusals: Vec<Case> = vec![
        // The request: a form-like POST from another site.
        (
            "POST",
            "/v1/generate",
            vec![("content-type", "text/plain"), ("host", "evil.example")],
            421,
            "host: `evil.example` is not this server",
        ),
        (
            "POST",
            "/v1/generate",
            vec![("content-type", "text/plain")],
            415,
            "content-type: `text/plain`; send the body as JSON",
        ),
        (
            "POST",
            "/v1/images/generations",
            vec![],
            415,
            "content-type: missing",
        ),
        (
            "GET",
            "/status",
            vec![("host", "evil.example:80")],
            421,
            "--allow-host",
        ),
        (
            "GET",
            "/metrics",
            vec![("host", "localhost:1")],
            421,
            "host:",
        ),
        (
            "POST",
            "/v1/generate",
            vec![JSON, ("origin", "http://evil.example")],
            403,
            "origin: `http://evil.example` may not call this server",
        ),
        (
            "POST",
            "/v1/generate",
            vec![JSON, ("origin", "null")],
            403,
            "--allow-origin",
        ),
    ];
    for (method, path, headers, status, want) in refusals {
        let r = raw(addr, method, path, &headers, &b);
        assert_eq!(
            r.status,
            status,
            "{method} {path} {headers:?}: {}",
            r.text()
        );
        let m = r.message();
        assert!(m.contains(want), "{want}: {m}");
    }
    // Names the server answers to: its address, localhost at its port, --allow-host (any
    // port); origins: its own, --allow-origin. Probes reach /health under any name.
    let port = addr.port().to_string();
    let localhost = format!("localhost:{port}");
    for headers in [
        vec![("host", localhost.as_str())],
        vec![("host", "gpu-box.lan")],
        vec![("host", "GPU-box.lan.:8443")],
        vec![("origin", own_origin.as_str())],
        vec![("origin", "https://app.example")],
        vec![("host", "gpu-box.lan"), ("origin", "https://gpu-box.lan")],
    ] {
        let r = raw(addr, "GET", "/status", &headers, "");
        assert_eq!(r.status, 200, "{headers:?}: {}", r.text());
    }
    assert_eq!(
        raw(addr, "GET", "/health", &[("host", "10.1.2.3:7680")], "").status,
        200
    );
    // A good request, from its own origin, with a charset.
    let r = raw(
        addr,
        "POST",
        "/v1/generate",
        &[
            ("content-type", "application/json; charset=utf-8"),
            ("origin", &own_origin),
        ],
        &b,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.body.starts_with(b"\x89PNG"));
    assert_eq!(h.shutdown().unwrap().ok, 1);
}

#[test]
fn listening_beyond_loopback_needs_a_token_or_insecure() {
    let open = ServeOptions {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..opts()
    };
    let e = match mold_serve::spawn(&deployment(1), &open) {
        Ok(_) => panic!("served every address without a token"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.starts_with("--listen 0.0.0.0:0: beyond this machine without --token-file"),
        "{e}"
    );
    assert!(e.contains("--insecure") && !e.contains('\n'), "{e}");
    for o in [
        ServeOptions {
            insecure: true,
            ..open.clone()
        },
        ServeOptions {
            token: Some("s3cret".into()),
            ..open.clone()
        },
    ] {
        assert!(o.check().is_ok());
        let h = mold_serve::spawn(&deployment(1), &o).unwrap();
        let local: SocketAddr = format!("127.0.0.1:{}", h.addr().port()).parse().unwrap();
        assert_eq!(raw(local, "GET", "/health", &[], "").status, 200);
        // Without a token, anything; with one, 401 without it.
        let want = if o.token.is_some() { 401 } else { 200 };
        assert_eq!(raw(local, "GET", "/status", &[], "").status, want);
        h.shutdown().unwrap();
    }
}

#[test]
fn a_request_past_its_deadline_gets_504_and_frees_its_slot() {
    let gate = Gate::new();
    let o = ServeOptions {
        queue: 1,
        encoder_pool: false,
        request_timeout: Duration::from_secs(1),
        hooks: Hooks::default().hold_at(Stage::Denoise, gate.clone()),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let _open = OpenOnDrop(gate.clone());
    let addr = h.addr();
    let post = move |seed: u64| {
        std::thread::spawn(move || {
            raw(
                addr,
                "POST",
                "/v1/generate",
                &[JSON],
                &body(seed, 1).to_string(),
            )
        })
    };
    // A runs (held at the gate), B waits in the queue's one place; both pass their
    // deadline.
    let a = post(0);
    assert!(
        gate.wait_arrived(1, PATIENCE),
        "the first request never ran"
    );
    let b = post(1).join().unwrap();
    assert_eq!(b.status, 504, "{}", b.text());
    assert!(
        b.message()
            .contains("not done within 1 s (the server's --request-timeout), so cancelled"),
        "{}",
        b.message()
    );
    assert!(b.head.contains("x-mold-request-id: "), "{}", b.head);
    // B's place was freed: C is admitted (not 429), and times out in turn.
    let c = post(2).join().unwrap();
    assert_eq!(c.status, 504, "{}", c.text());
    let a = a.join().unwrap();
    assert_eq!(a.status, 504, "{}", a.text());
    assert_eq!(metric(addr, "mold_request_timeouts_total "), 3.0);
    gate.open();
    let s = shutdown_within(h);
    assert_eq!((s.ok, s.cancelled, s.failed), (0, 3, 0));
}
