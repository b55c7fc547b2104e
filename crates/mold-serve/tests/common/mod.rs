//! What the server's end-to-end tests share: the tiny pipeline's weights and plans on
//! emulated devices, the server's options, an HTTP client and a raw one, waits bounded by
//! [`PATIENCE`], logs kept for tests, and handles that fail rather than hang.

#![allow(dead_code)]

use mold_plan::{DeviceId, Plan};
use mold_serve::{Deployment, Gate, ServeOptions};
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The bound on every wait for a condition (never reached when things work).
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Opens a gate when dropped: a failing test's server still drains (declared after the
/// server's handle, it is dropped first).
pub struct OpenOnDrop(pub Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny pipeline's weights, written once per test process.
pub fn weights() -> &'static Path {
    static W: OnceLock<PathBuf> = OnceLock::new();
    W.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("mold-serve-test-{}", std::process::id()));
        mold_pipeline::flux::testdata::write_tiny_pipeline(&d, 0).unwrap();
        d
    })
}

pub fn machine() -> mold_machine::Machine {
    mold_machine::Machine::load(&root().join("sim/machines/cpu-emu-4.yaml")).unwrap()
}

pub fn emu(i: u32) -> DeviceId {
    DeviceId::Emu(i)
}

/// flux-tiny planned on emu:0 and emu:1 (no tensor or sequence parallelism), then with
/// `replicas` copies of it on emu:0-1, emu:2-3.
pub fn plan(replicas: usize) -> Plan {
    let model = mold_models::find("flux-tiny").unwrap();
    let m = machine().select(&[emu(0), emu(1)]).unwrap();
    let mut req = mold_planner::Request::new(model.clone(), m, model.default_workload.clone());
    req.constraints.tp = mold_planner::TpChoice::Off;
    req.constraints.sp = mold_planner::SpChoice::Off;
    let mut plan = mold_planner::plan(&req).unwrap().plan;
    if replicas > 1 {
        let used: Vec<DeviceId> = plan.placement_devices().into_iter().collect();
        let groups: Vec<Vec<DeviceId>> = (0..replicas as u32)
            .map(|r| {
                used.iter()
                    .map(|d| match d {
                        DeviceId::Emu(i) => emu(i + 2 * r),
                        other => other.clone(),
                    })
                    .collect()
            })
            .collect();
        plan.replicas = Some(mold_plan::shifted_replicas(&used, &groups));
    }
    plan
}

pub fn deployment(replicas: usize) -> Deployment {
    Deployment {
        replicas: plan(replicas).replica_plans().unwrap(),
        model: mold_models::find("flux-tiny").unwrap(),
        machine: machine(),
        weights: weights().to_path_buf(),
        exec: mold_exec::ExecOptions::default(),
    }
}

pub fn opts() -> ServeOptions {
    ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..ServeOptions::default()
    }
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

pub fn request(seed: u64, steps: u32) -> mold_pipeline::Request {
    mold_pipeline::Request {
        prompt: "a red fox in snow".into(),
        seed,
        steps,
        guidance: Some(3.5),
        width: 64,
        height: 64,
        latents: None,
        save_io: None,
        no_digests: true,
    }
}

pub fn body(seed: u64, steps: u32) -> serde_json::Value {
    serde_json::json!({"prompt": "a red fox in snow", "seed": seed, "steps": steps,
        "guidance": 3.5, "width": 64, "height": 64})
}

/// The request run alone, by `mold_pipeline::flux::generate` (what `mold exec --prompt` runs).
pub fn alone(plan: &Plan, seed: u64, steps: u32) -> Vec<u8> {
    let prep = mold_pipeline::flux::prepare(plan, weights()).unwrap();
    let out = mold_pipeline::flux::generate(
        plan,
        &prep,
        &request(seed, steps),
        &mold_exec::ExecOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    mold_pipeline::encode_png(&out.image, &out.metadata).unwrap()
}

/// Reads server-sent events from a raw connection until one named `name`.
pub fn read_until_event(r: &mut impl BufRead, name: &str) {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "the stream ended before `{name}`"
        );
        if line.trim_end() == format!("event: {name}") {
            return;
        }
    }
}

pub fn metric(addr: std::net::SocketAddr, line_start: &str) -> f64 {
    let text = client()
        .get(format!("http://{addr}/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Seconds each device was busy, from `/metrics`, after `n` concurrent requests on one
/// replica (on emu:0-1 of four devices) with the encoder pool on or off.
pub fn busy_after_load(encoder_pool: bool, n: u64) -> Vec<f64> {
    let o = ServeOptions {
        encoder_pool,
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    let threads: Vec<_> = (0..n)
        .map(|s| {
            std::thread::spawn(move || {
                let r = client()
                    .post(format!("http://{addr}/v1/generate"))
                    .json(&body(s, 2))
                    .send()
                    .unwrap();
                assert_eq!(r.status(), 200);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let status: serde_json::Value = client()
        .get(format!("http://{addr}/status"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(status["encoder_pool"], encoder_pool, "{status}");
    let busy = (0..4)
        .map(|d| {
            metric(
                addr,
                &format!("mold_device_busy_seconds_total{{device=\"emu:{d}\"}}"),
            )
        })
        .collect();
    assert_eq!(h.shutdown().unwrap().ok, n);
    busy
}

/// Waits until `cond` holds (bounded by [`PATIENCE`]), naming what it waited for.
pub fn wait_for(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A raw HTTP/1.1 response: status, head (lowercased), body.
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Raw {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The one-line error message of a JSON error body.
    pub fn message(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()));
        let m = v["error"]["message"].as_str().unwrap().to_string();
        assert!(!m.contains('\n'), "{m}");
        m
    }
}

pub fn parse_response(raw: &[u8]) -> Raw {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response: {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        let mut b = &body[..];
        loop {
            let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
            let n =
                usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
            b = &b[eol + 2 + n + 2..];
        }
        body = out;
    }
    Raw { status, head, body }
}

/// One request over a fresh connection, with the given extra header lines (a `host`
/// line among them replaces the default, the server's own address).
pub fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Raw {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    s.write_all(head.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    parse_response(&out)
}

pub const JSON: (&str, &str) = ("content-type", "application/json");

/// Whether the server closed `s` (EOF or reset) before `limit`; false if it is still open.
pub fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // a 408, then the close
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

pub type Lines = Arc<Mutex<Vec<String>>>;

/// A log that keeps its lines, for tests.
pub fn keep_log() -> (Lines, Arc<dyn Fn(String) + Send + Sync>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    (lines, Arc::new(move |s| l.lock().unwrap().push(s)))
}

/// A server handle that, left to drop (a failing test), is dropped on a thread of its
/// own: a drain that hangs, what these tests catch, fails the test instead of hanging it.
pub struct Detached(pub Option<mold_serve::Handle>);

impl std::ops::Deref for Detached {
    type Target = mold_serve::Handle;
    fn deref(&self) -> &mold_serve::Handle {
        self.0.as_ref().unwrap()
    }
}

impl Detached {
    pub fn take(mut self) -> mold_serve::Handle {
        self.0.take().unwrap()
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            std::thread::spawn(move || drop(h));
        }
    }
}

/// Shuts the server down on another thread; fails (rather than hangs) if draining does
/// not end.
pub fn shutdown_within(h: mold_serve::Handle) -> mold_serve::Summary {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.shutdown());
    });
    rx.recv_timeout(PATIENCE)
        .expect("draining the server hangs")
        .unwrap()
}

/// A 500 that names the request's id and nothing internal; returns the id.
pub fn assert_opaque_500(r: reqwest::blocking::Response) -> u64 {
    let status = r.status();
    let header = r
        .headers()
        .get("x-mold-request-id")
        .map(|v| v.to_str().unwrap().to_string());
    let text = r.text().unwrap();
    assert_eq!(status, 500, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let id = v["error"]["request_id"].as_u64().unwrap();
    assert_eq!(header, Some(id.to_string()));
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains(&format!("request {id}")), "{m}");
    for secret in ["panic", "injected", "MOLD_FAULT", "emu:", "/", "block"] {
        assert!(!m.contains(secret), "{secret}: {m}");
    }
    id
}
