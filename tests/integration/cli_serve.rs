//! `mold serve` as a process: the same PNG as `mold exec --prompt`, the bearer token,
//! SIGTERM draining what is in flight, and the flags' refusals. (The server's behaviour
//! under load, cancellation and the lock pool: crates/mold-serve/tests/.)

use crate::util::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request over a fresh connection; the status and the body.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

/// A `mold serve` process, killed (if still running) and reaped when dropped.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `mold serve` with `args` on an ephemeral port; returns it and its address
/// (from its "listening on" line), its stderr reader left for the rest.
fn serve(args: &[&str]) -> (Served, SocketAddr, BufReader<std::process::ChildStderr>) {
    let (served, addr, err, _) = serve_said(args);
    (served, addr, err)
}

/// [`serve`], with what it printed before listening.
fn serve_said(
    args: &[&str],
) -> (
    Served,
    SocketAddr,
    BufReader<std::process::ChildStderr>,
    String,
) {
    let mut all = vec!["serve"];
    if !args.contains(&"--listen") {
        all.extend(["--listen", "127.0.0.1:0"]);
    }
    all.extend(args);
    let mut served = Served(
        mold_command(&all, &[])
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(served.0.stderr.take().unwrap());
    let mut line = String::new();
    let mut said = String::new();
    loop {
        line.clear();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "mold serve exited before listening: {said}"
        );
        if let Some(rest) = line.strip_prefix("listening on http://") {
            let addr = rest.split(' ').next().unwrap().parse().unwrap();
            return (served, addr, err, said);
        }
        said.push_str(&line);
    }
}

fn metric(addr: SocketAddr, token: &str, name: &str) -> f64 {
    let (_, body) = http(addr, "GET", "/metrics", Some(token), "");
    String::from_utf8(body)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn plan(d: &Path) -> String {
    let p = d.join("one.yaml");
    mold_ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "off",
        "-o",
        p.to_str().unwrap(),
    ]);
    p.to_str().unwrap().to_string()
}

#[test]
fn serve_matches_exec_and_drains_on_sigterm() {
    let d = tempdir("serve");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);
    let p = plan(&d);
    let tok = d.join("token");
    std::fs::write(&tok, "s3cret\n").unwrap();
    let (mut served, addr, mut err) = serve(&[
        "--plan",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--token-file",
        tok.to_str().unwrap(),
    ]);
    let body = r#"{"prompt":"a red fox in snow","seed":42,"steps":3,"guidance":3.5}"#;
    let (status, png) = http(addr, "POST", "/v1/generate", Some("s3cret"), body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&png));
    let out = d.join("exec.png");
    mold_ok(&[
        "exec",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a red fox in snow",
        "--seed",
        "42",
        "--steps",
        "3",
        "--guidance",
        "3.5",
        "--out",
        out.to_str().unwrap(),
    ]);
    // The same image and settings; a file `mold exec` writes also carries its stamp
    // (the last tEXt chunk), which an HTTP response has no use for.
    let from_server = d.join("served.png");
    std::fs::write(&from_server, &png).unwrap();
    let (img, text) = mold_pipeline::read_png(&from_server).unwrap();
    let (exec_img, mut exec_text) = mold_pipeline::read_png(&out).unwrap();
    exec_text.retain(|(k, _)| k != mold_pipeline::image::STAMP_KEYWORD);
    assert!(
        img == exec_img && text == exec_text,
        "the server's PNG differs from mold exec's: {text:?} vs {exec_text:?}"
    );
    let (status, msg) = http(addr, "POST", "/v1/generate", Some("nope"), body);
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&msg));

    // A long request in flight, then SIGTERM: it finishes, the server exits 0.
    let long = r#"{"prompt":"a red fox in snow","seed":1,"steps":40}"#;
    let t = std::thread::spawn(move || http(addr, "POST", "/v1/generate", Some("s3cret"), long));
    let start = Instant::now();
    while metric(addr, "s3cret", "mold_requests_running ")
        + metric(addr, "s3cret", "mold_queue_depth ")
        < 1.0
    {
        assert!(start.elapsed() < Duration::from_secs(120), "never admitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &served.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let (status, png) = t.join().unwrap();
    assert_eq!(status, 200);
    assert!(png.starts_with(b"\x89PNG"));
    assert!(served.0.wait().unwrap().success());
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("stopped: 2 images served, 0 cancelled"),
        "{rest}"
    );
}

#[test]
fn serve_refuses_bad_flags_in_one_line() {
    let d = tempdir("serve-flags");
    let w = d.join("w");
    std::fs::create_dir_all(&w).unwrap();
    let p = plan(&d);
    let empty = d.join("empty");
    std::fs::write(&empty, "\n").unwrap();
    for (args, want) in [
        (vec!["--listen", "nonsense"], "--listen nonsense"),
        (vec!["--queue", "0"], "--queue 0"),
        (
            vec!["--token-file", empty.to_str().unwrap()],
            "empty; put the bearer token",
        ),
        (
            vec!["--listen", "0.0.0.0:0"],
            "--listen 0.0.0.0:0: beyond this machine without --token-file",
        ),
        (
            vec!["--listen", "[::]:7680"],
            "--listen [::]:7680: beyond this machine without --token-file",
        ),
        (
            vec!["--max-connections", "0"],
            "--max-connections 0: give a positive value",
        ),
        (
            vec!["--allow-host", "http://evil.example/"],
            "--allow-host `http://evil.example/`: write a host name",
        ),
        (
            vec!["--allow-origin", "evil.example"],
            "--allow-origin `evil.example`: write SCHEME://HOST[:PORT]",
        ),
        (
            vec!["--warm-up-sizes", "64x64,wide"],
            "--warm-up-sizes wide: write WIDTHxHEIGHT",
        ),
        (
            vec!["--warm-up-sizes", "32x32", "--warm-up", "off"],
            "--warm-up-sizes with --warm-up off",
        ),
    ] {
        let mut all = vec!["serve", "--plan", &p, "--weights", w.to_str().unwrap()];
        all.extend(args);
        let e = mold_fails(&all);
        assert!(e.contains(want), "{want}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
    let e = mold_fails(&[
        "serve",
        "--plan",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--header-timeout",
        "0",
    ]);
    assert!(
        e.contains("--header-timeout") && e.contains("give a number of seconds above 0"),
        "{e}"
    );
    let e = mold_fails(&[
        "serve",
        "--plan",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--encoder-pool",
        "maybe",
    ]);
    assert!(
        e.contains("--encoder-pool") && e.contains("[possible values: on, off]"),
        "{e}"
    );
    // The weights directory is checked (files missing) before any weight loads.
    let e = mold_fails(&[
        "serve",
        "--plan",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(
        e.contains("lacks") && e.contains("mold testdata flux-tiny-pipeline"),
        "{e}"
    );
}

#[test]
fn serve_beyond_loopback_with_insecure_warns_and_serves() {
    let d = tempdir("serve-insecure");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);
    let p = plan(&d);
    let (_served, addr, _err, said) = serve_said(&[
        "--plan",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--listen",
        "0.0.0.0:0",
        "--insecure",
        "--header-timeout",
        "0.5",
    ]);
    assert!(addr.ip().is_unspecified(), "{addr}");
    assert!(
        said.contains("warning: --insecure: listening on 0.0.0.0:0 without --token-file"),
        "{said}"
    );
    let local: SocketAddr = format!("127.0.0.1:{}", addr.port()).parse().unwrap();
    let (status, body) = http(local, "GET", "/health", None, "");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // No token needed, and --header-timeout reached the server: a silent connection is
    // closed within seconds.
    let (status, _) = http(local, "GET", "/status", None, "");
    assert_eq!(status, 200);
    let mut s = TcpStream::connect(local).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = Vec::new();
    assert!(
        s.read_to_end(&mut buf).is_ok(),
        "a silent connection outlived --header-timeout 0.5"
    );
}
