//! The server end to end on emulated devices with the tiny pipeline: a real HTTP client
//! (or a raw socket, for what clients misbehaving do) against a server on an ephemeral
//! port. Nothing waits on speed: a test that needs a request held holds it at a
//! [`Gate`] (`ServeOptions::hooks`), and waits are for a condition, with a generous bound.

use mold_plan::{DeviceId, Plan};
use mold_serve::{Deployment, Gate, Hooks, ServeOptions, Stage};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The bound on every wait for a condition (never reached when things work).
const PATIENCE: Duration = Duration::from_secs(60);

/// Opens a gate when dropped: a failing test's server still drains (declared after the
/// server's handle, it is dropped first).
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny pipeline's weights, written once per test process.
fn weights() -> &'static Path {
    static W: OnceLock<PathBuf> = OnceLock::new();
    W.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("mold-serve-test-{}", std::process::id()));
        mold_pipeline::flux::testdata::write_tiny_pipeline(&d, 0).unwrap();
        d
    })
}

fn machine() -> mold_machine::Machine {
    mold_machine::Machine::load(&root().join("sim/machines/cpu-emu-4.yaml")).unwrap()
}

fn emu(i: u32) -> DeviceId {
    DeviceId::Emu(i)
}

/// flux-tiny planned on emu:0 and emu:1 (no tensor or sequence parallelism), then with
/// `replicas` copies of it on emu:0-1, emu:2-3.
fn plan(replicas: usize) -> Plan {
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

fn deployment(replicas: usize) -> Deployment {
    Deployment {
        replicas: plan(replicas).replica_plans().unwrap(),
        model: mold_models::find("flux-tiny").unwrap(),
        machine: machine(),
        weights: weights().to_path_buf(),
        exec: mold_exec::ExecOptions::default(),
    }
}

fn opts() -> ServeOptions {
    ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..ServeOptions::default()
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

fn request(seed: u64, steps: u32) -> mold_pipeline::Request {
    mold_pipeline::Request {
        prompt: "a red fox in snow".into(),
        seed,
        steps,
        guidance: Some(3.5),
        width: 64,
        height: 64,
        latents: None,
        save_io: None,
    }
}

fn body(seed: u64, steps: u32) -> serde_json::Value {
    serde_json::json!({"prompt": "a red fox in snow", "seed": seed, "steps": steps,
        "guidance": 3.5, "width": 64, "height": 64})
}

/// The request run alone, by `mold_pipeline::flux::generate` (what `mold exec --prompt` runs).
fn alone(plan: &Plan, seed: u64, steps: u32) -> Vec<u8> {
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

#[test]
fn resident_pipeline_gives_the_same_png_as_a_run_alone() {
    let plan = plan(1);
    let prep = mold_pipeline::flux::prepare(&plan, weights()).unwrap();
    let res = mold_pipeline::flux::resident::Resident::load(
        &plan,
        prep,
        &Default::default(),
        &mut |_| {},
    )
    .unwrap();
    let never = std::sync::atomic::AtomicBool::new(false);
    for seed in [1, 2] {
        let out = res
            .generate(&request(seed, 2), &mut |_| {}, &never)
            .unwrap();
        let png = mold_pipeline::encode_png(&out.image, &out.metadata).unwrap();
        assert!(png == alone(&plan, seed, 2), "seed {seed}");
    }
    // A set cancel flag stops it before anything runs.
    let cancel = std::sync::atomic::AtomicBool::new(true);
    let e = res
        .generate(&request(1, 2), &mut |_| {}, &cancel)
        .unwrap_err();
    assert!(matches!(e, mold_pipeline::PipelineError::Cancelled), "{e}");
}

#[test]
fn sixteen_concurrent_requests_over_two_replicas_equal_each_run_alone() {
    let d = deployment(2);
    assert_eq!(d.replicas.len(), 2);
    let h = mold_serve::spawn(&d, &opts()).unwrap();
    let url = format!("http://{}/v1/generate", h.addr());
    let seeds: Vec<u64> = (0..16).map(|i| i % 4).collect();
    let threads: Vec<_> = seeds
        .iter()
        .map(|&s| {
            let url = url.clone();
            std::thread::spawn(move || {
                let r = client().post(&url).json(&body(s, 2)).send().unwrap();
                assert_eq!(r.status(), 200, "{:?}", r.text());
                let replica = r.headers()["x-mold-replica"].to_str().unwrap().to_string();
                (replica, r.bytes().unwrap().to_vec())
            })
        })
        .collect();
    let got: Vec<(String, Vec<u8>)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let want: Vec<Vec<u8>> = (0..4).map(|s| alone(&d.replicas[0], s, 2)).collect();
    for (s, (_, png)) in seeds.iter().zip(&got) {
        assert!(
            png == &want[*s as usize],
            "seed {s}: differs from the request run alone"
        );
    }
    // Both replicas served.
    let used: std::collections::BTreeSet<&str> = got.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(used.len(), 2, "{used:?}");
    // The OpenAI endpoint: n images, seeds seed, seed + 1, as b64 PNGs.
    let r: serde_json::Value = client()
        .post(format!("http://{}/v1/images/generations", h.addr()))
        .json(&serde_json::json!({"prompt": "a red fox in snow", "n": 2, "size": "64x64", "seed": 0, "steps": 2}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let data = r["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["seed"], 1);
    let status: serde_json::Value = client()
        .get(format!("http://{}/status", h.addr()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(status["devices"].as_array().unwrap().len(), 4, "{status}");
    let metrics = client()
        .get(format!("http://{}/metrics", h.addr()))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        metrics.contains("mold_requests_total{outcome=\"ok\"} 18"),
        "{metrics}"
    );
    assert!(
        metrics.contains("mold_device_busy_seconds_total{device=\"emu:2\"}"),
        "{metrics}"
    );
    let s = h.shutdown().unwrap();
    assert_eq!(s.ok, 18);
}

#[test]
fn bad_requests_get_a_4xx_with_one_line_naming_the_field() {
    let o = ServeOptions {
        token: Some("s3cret".into()),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let c = client();
    let post = |path: &str, token: Option<&str>, body: String| {
        let mut r = c
            .post(format!("http://{}{path}", h.addr()))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().unwrap();
        let status = r.status().as_u16();
        let text = r.text().unwrap();
        (status, text)
    };
    let cases: Vec<(&str, Option<&str>, String, u16, &str)> = vec![
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":"x","colour":"red"}"#.into(),
            400,
            "unknown field `colour`",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":"x","width":100}"#.into(),
            400,
            "width: 100 is not a multiple of 16",
        ),
        (
            "/v1/images/generations",
            Some("s3cret"),
            r#"{"prompt":"x","size":"64x72"}"#.into(),
            400,
            "size: height 72 is not a multiple of 16",
        ),
        (
            "/v1/images/generations",
            Some("s3cret"),
            r#"{"prompt":"x","size":"4096x64"}"#.into(),
            400,
            "size: width 4096 is more than flux-tiny supports",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":"x","width":2048}"#.into(),
            400,
            "width: 2048 is more than the 64 this server's plan was sized for (64x64); ask for at most 64x64, or serve a plan made with `mold plan --size 2048x64`",
        ),
        (
            "/v1/images/generations",
            Some("s3cret"),
            r#"{"prompt":"x","size":"64x128"}"#.into(),
            400,
            "size: height 128 is more than the 64 this server's plan was sized for",
        ),
        (
            "/v1/images/generations",
            Some("s3cret"),
            r#"{"prompt":"x","n":1000}"#.into(),
            400,
            "n: 1000; ask for 1 to 8 images",
        ),
        (
            "/v1/images/generations",
            Some("s3cret"),
            r#"{"prompt":"x","response_format":"url"}"#.into(),
            400,
            "response_format: `url`",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":"   "}"#.into(),
            400,
            "prompt: empty",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":"x","steps":0}"#.into(),
            400,
            "steps: 0",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            r#"{"prompt":3}"#.into(),
            400,
            "prompt: invalid type",
        ),
        (
            "/v1/generate",
            Some("wrong"),
            r#"{"prompt":"x"}"#.into(),
            401,
            "bearer token",
        ),
        (
            "/v1/generate",
            None,
            r#"{"prompt":"x"}"#.into(),
            401,
            "bearer token",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            format!(r#"{{"prompt":"{}"}}"#, "x".repeat(100_000)),
            413,
            "at most 65536 bytes",
        ),
        (
            "/v1/images/generations",
            Some("wrong"),
            r#"{"prompt":"x"}"#.into(),
            401,
            "bearer token",
        ),
        (
            "/v1/generate",
            Some("s3cret"),
            format!(r#"{{"prompt":"{}"}}"#, "x".repeat(5000)),
            400,
            "prompt: 5000 characters",
        ),
    ];
    for (path, tok, b, want_status, want) in cases {
        let (status, text) = post(path, tok, b);
        assert_eq!(status, want_status, "{path}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(want), "{want}: {msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }
    // /health needs no token; a good request still goes through.
    assert_eq!(
        c.get(format!("http://{}/health", h.addr()))
            .send()
            .unwrap()
            .status(),
        200
    );
    let (status, _) = post("/v1/generate", Some("s3cret"), body(3, 1).to_string());
    assert_eq!(status, 200);
    assert_eq!(h.shutdown().unwrap().ok, 1);
}

#[test]
fn beyond_the_queue_bound_requests_get_429() {
    // One replica held at its transformer by the gate: one request runs, one waits (the
    // queue holds one), the next is refused, whatever the speed of the machine.
    let gate = Gate::new();
    let o = ServeOptions {
        queue: 1,
        encoder_pool: false,
        hooks: Hooks::default().hold_at(Stage::Denoise, gate.clone()),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let _open = OpenOnDrop(gate.clone());
    let addr = h.addr();
    let post = move |seed: u64| {
        std::thread::spawn(move || {
            let r = client()
                .post(format!("http://{addr}/v1/generate"))
                .json(&body(seed, 1))
                .send()
                .unwrap();
            let status = r.status().as_u16();
            (status, r.text().unwrap_or_default())
        })
    };
    let running = post(0);
    assert!(
        gate.wait_arrived(1, PATIENCE),
        "the first request never ran"
    );
    let waiting = post(1);
    wait_for(
        || metric(addr, "mold_queue_depth ") == 1.0,
        "the second request queued",
    );
    let r = client()
        .post(format!("http://{addr}/v1/generate"))
        .json(&body(2, 1))
        .send()
        .unwrap();
    assert_eq!(r.status(), 429);
    let text = r.text().unwrap();
    assert!(
        text.contains("queue full: 1 requests are waiting already"),
        "{text}"
    );
    gate.open();
    assert_eq!(running.join().unwrap().0, 200);
    assert_eq!(waiting.join().unwrap().0, 200);
    let s = h.shutdown().unwrap();
    assert_eq!((s.ok, s.failed), (2, 0));
}

/// Reads server-sent events from a raw connection until one named `name`.
fn read_until_event(r: &mut impl BufRead, name: &str) {
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

fn metric(addr: std::net::SocketAddr, line_start: &str) -> f64 {
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

#[test]
fn a_client_that_goes_away_cancels_its_request() {
    let h = mold_serve::spawn(&deployment(1), &opts()).unwrap();
    let addr = h.addr();
    let b = body(5, 200).to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/generate/stream HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    read_until_event(&mut r, "queued");
    read_until_event(&mut r, "progress");
    // The first step has run: go away.
    drop(r);
    s.shutdown(std::net::Shutdown::Both).unwrap();
    drop(s);
    let start = Instant::now();
    while metric(addr, "mold_requests_total{outcome=\"cancelled\"}") < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "never cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let summary = h.shutdown().unwrap();
    assert_eq!((summary.ok, summary.cancelled), (0, 1));
}

#[test]
fn shutdown_finishes_the_requests_in_flight() {
    let h = mold_serve::spawn(&deployment(1), &opts()).unwrap();
    let addr = h.addr();
    let threads: Vec<_> = (0..3)
        .map(|s| {
            std::thread::spawn(move || {
                let r = client()
                    .post(format!("http://{addr}/v1/generate"))
                    .json(&body(s, 4))
                    .send()
                    .unwrap();
                let status = r.status().as_u16();
                let mut png = Vec::new();
                r.take(u64::MAX).read_to_end(&mut png).unwrap();
                (status, png)
            })
        })
        .collect();
    // All three admitted, then stop.
    let start = Instant::now();
    while metric(addr, "mold_queue_depth ") + metric(addr, "mold_requests_running ") < 3.0 {
        assert!(start.elapsed() < Duration::from_secs(120), "never admitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let summary = h.shutdown().unwrap();
    for t in threads {
        let (status, png) = t.join().unwrap();
        assert_eq!(status, 200);
        assert!(png.starts_with(b"\x89PNG"));
    }
    assert_eq!(summary.ok, 3);
    // Nothing listens any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

/// Seconds each device was busy, from `/metrics`, after `n` concurrent requests on one
/// replica (on emu:0-1 of four devices) with the encoder pool on or off.
fn busy_after_load(encoder_pool: bool, n: u64) -> Vec<f64> {
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

#[test]
fn with_the_encoder_pool_off_encoders_and_the_vae_stay_where_the_plan_puts_them() {
    // Off (`mold serve --encoder-pool off`): the replica's own devices only.
    let off = busy_after_load(false, 8);
    assert!(off[0] + off[1] > 0.0, "{off:?}");
    assert_eq!((off[2], off[3]), (0.0, 0.0), "{off:?}");
    // On, with the same load: encoders borrow the idle emu:2 and emu:3 (eight requests
    // queued at once, four encoder workers, the planned device taken by the first).
    let on = busy_after_load(true, 8);
    assert!(on[2] + on[3] > 0.0, "{on:?}");
}

#[test]
fn a_server_that_cannot_start_says_why_once() {
    let empty = std::env::temp_dir().join(format!("mold-serve-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let d = Deployment {
        weights: empty.clone(),
        ..deployment(1)
    };
    let e = match mold_serve::spawn(&d, &opts()) {
        Ok(_) => panic!("a server without weights started"),
        Err(e) => e,
    };
    // What `mold serve` prints: the error and its sources (anyhow's `{:#}`).
    let mut chain = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        chain.push_str(&format!(": {s}"));
        src = s.source();
    }
    assert_eq!(chain.matches("lacks files").count(), 1, "{chain}");
    assert!(
        chain.contains("mold testdata flux-tiny-pipeline"),
        "{chain}"
    );
    assert!(!chain.contains('\n'), "{chain}");
    let _ = std::fs::remove_dir_all(&empty);
}

/// Waits until `cond` holds (bounded by [`PATIENCE`]), naming what it waited for.
fn wait_for(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A raw HTTP/1.1 response: status, head (lowercased), body.
struct Raw {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Raw {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The one-line error message of a JSON error body.
    fn message(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()));
        let m = v["error"]["message"].as_str().unwrap().to_string();
        assert!(!m.contains('\n'), "{m}");
        m
    }
}

fn parse_response(raw: &[u8]) -> Raw {
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
fn raw(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Raw {
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

const JSON: (&str, &str) = ("content-type", "application/json");

/// Whether the server closed `s` (EOF or reset) before `limit`; false if it is still open.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
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
        // The issue's request: a form-like POST from another site.
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

type Lines = Arc<Mutex<Vec<String>>>;

/// A log that keeps its lines, for tests.
fn keep_log() -> (Lines, Arc<dyn Fn(String) + Send + Sync>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    (lines, Arc::new(move |s| l.lock().unwrap().push(s)))
}

/// A server handle that, left to drop (a failing test), is dropped on a thread of its
/// own: a drain that hangs, what these tests catch, fails the test instead of hanging it.
struct Detached(Option<mold_serve::Handle>);

impl std::ops::Deref for Detached {
    type Target = mold_serve::Handle;
    fn deref(&self) -> &mold_serve::Handle {
        self.0.as_ref().unwrap()
    }
}

impl Detached {
    fn take(mut self) -> mold_serve::Handle {
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
fn shutdown_within(h: mold_serve::Handle) -> mold_serve::Summary {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.shutdown());
    });
    rx.recv_timeout(PATIENCE)
        .expect("draining the server hangs")
        .unwrap()
}

/// A 500 that names the request's id and nothing internal; returns the id.
fn assert_opaque_500(r: reqwest::blocking::Response) -> u64 {
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

#[test]
fn a_panicking_worker_fails_one_request_and_the_next_succeeds() {
    for (stage, encoder_pool) in [
        (Stage::Encode, true),
        (Stage::Encode, false),
        (Stage::Denoise, true),
        (Stage::Decode, true),
        (Stage::Png, false),
    ] {
        let (lines, log) = keep_log();
        let o = ServeOptions {
            encoder_pool,
            hooks: Hooks::default().panic_at(stage, 1),
            ..opts()
        };
        let h = Detached(Some(
            mold_serve::spawn_logged(&deployment(1), &o, log).unwrap(),
        ));
        let url = format!("http://{}/v1/generate", h.addr());
        let id = assert_opaque_500(client().post(&url).json(&body(1, 1)).send().unwrap());
        // The log has the cause under that id.
        let want = format!("request {id}: panicked in {stage}");
        wait_for(
            || lines.lock().unwrap().iter().any(|l| l.contains(&want)),
            &want,
        );
        // The next request is served (a transformer that panicked reloaded first).
        let r = client().post(&url).json(&body(2, 1)).send().unwrap();
        assert_eq!(r.status(), 200, "{stage}: {:?}", r.text());
        let s = shutdown_within(h.take());
        assert_eq!((s.ok, s.failed), (1, 1), "{stage}");
        if stage == Stage::Denoise {
            let l = lines.lock().unwrap();
            assert!(
                l.iter().any(|l| l.contains("replica 0: serving again")),
                "{l:?}"
            );
        }
    }
}

#[test]
fn health_is_not_ready_when_no_replica_can_serve() {
    // The transformer panics, and so does its reload: the only replica is out.
    let (lines, log) = keep_log();
    let o = ServeOptions {
        hooks: Hooks::default()
            .panic_at(Stage::Denoise, 1)
            .panic_at(Stage::Reload, 1),
        ..opts()
    };
    let h = Detached(Some(
        mold_serve::spawn_logged(&deployment(1), &o, log).unwrap(),
    ));
    let addr = h.addr();
    assert_eq!(raw(addr, "GET", "/health", &[], "").status, 200);
    let r = client()
        .post(format!("http://{addr}/v1/generate"))
        .json(&body(1, 1))
        .send()
        .unwrap();
    assert_eq!(r.status(), 500);
    wait_for(
        || {
            let r = raw(addr, "GET", "/health", &[], "");
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["failed"] == 1
        },
        "the replica marked failed",
    );
    let r = raw(addr, "GET", "/health", &[], "");
    assert_eq!(r.status, 503, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["status"], "unavailable", "{v}");
    assert_eq!(v["serving"], 0, "{v}");
    assert!(r.message().contains("no replica can serve"), "{v}");
    // New requests are refused at once, not queued for good.
    let r = raw(
        addr,
        "POST",
        "/v1/generate",
        &[JSON],
        &body(2, 1).to_string(),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.message().contains("no replica can serve"));
    assert_eq!(metric(addr, "mold_replicas_serving "), 0.0);
    let s = shutdown_within(h.take());
    assert_eq!((s.ok, s.failed), (0, 1));
    let l = lines.lock().unwrap();
    assert!(
        l.iter()
            .any(|l| l.starts_with("replica 0: out of service:")),
        "{l:?}"
    );
}

#[test]
fn a_failure_inside_the_pipeline_tells_the_client_only_its_id() {
    // The executor's own fault injection (MOLD_FAULT): an error at the first block.
    let mut d = deployment(1);
    let tf = d.replicas[0].transformer().unwrap();
    let dev = tf.parts[0].devices[0].clone();
    d.exec.fault = Some(mold_exec::Fault::parse(&format!("{dev}@double 0")).unwrap());
    let (lines, log) = keep_log();
    let h = Detached(Some(mold_serve::spawn_logged(&d, &opts(), log).unwrap()));
    let id = assert_opaque_500(
        client()
            .post(format!("http://{}/v1/generate", h.addr()))
            .json(&body(1, 1))
            .send()
            .unwrap(),
    );
    let l = lines.lock().unwrap().clone();
    assert!(
        l.iter()
            .any(|l| l.starts_with(&format!("request {id}: failed: ")) && l.contains("MOLD_FAULT")),
        "{l:?}"
    );
    let s = shutdown_within(h.take());
    assert_eq!((s.ok, s.failed), (0, 1));
}

#[test]
fn more_images_than_the_queue_holds_is_400_and_draining_is_503() {
    let o = ServeOptions { queue: 2, ..opts() };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let addr = h.addr();
    let r = raw(
        addr,
        "POST",
        "/v1/images/generations",
        &[JSON],
        r#"{"prompt":"x","n":3}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.message()
            .contains("n: 3 images, more than this server's queue holds (2); ask for at most 2"),
        "{}",
        r.message()
    );
    h.shutdown().unwrap();
    // A request read whole, held just before admission while the server starts
    // draining: it is answered 503 (not 429: retrying here will not help).
    let gate = Gate::new();
    let o = ServeOptions {
        hooks: Hooks::default().hold_at(Stage::Admit, gate.clone()),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let _open = OpenOnDrop(gate.clone());
    let addr = h.addr();
    let late = std::thread::spawn(move || {
        raw(
            addr,
            "POST",
            "/v1/generate",
            &[JSON],
            &body(1, 1).to_string(),
        )
    });
    assert!(gate.wait_arrived(1, PATIENCE), "the request never came");
    let engine = h.engine().clone();
    let stopper = std::thread::spawn(move || h.shutdown());
    wait_for(|| engine.draining(), "draining begins");
    gate.open();
    let r = late.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.message().contains("shutting down"), "{}", r.message());
    let summary = stopper.join().unwrap().unwrap();
    assert_eq!(summary.ok, 0);
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

#[test]
fn an_idle_event_stream_gets_keep_alive_comments() {
    let gate = Gate::new();
    let o = ServeOptions {
        encoder_pool: false,
        sse_keep_alive: Duration::from_millis(100),
        hooks: Hooks::default().hold_at(Stage::Denoise, gate.clone()),
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let _open = OpenOnDrop(gate.clone());
    let addr = h.addr();
    let b = body(5, 1).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST /v1/generate/stream HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    read_until_event(&mut r, "queued");
    assert!(gate.wait_arrived(1, PATIENCE));
    // Held: nothing happens, but the stream says it is alive.
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).expect("no keep-alive comment") > 0);
        if line.starts_with(':') {
            break;
        }
    }
    gate.open();
    read_until_event(&mut r, "image");
    drop(r);
    drop(s);
    assert_eq!(shutdown_within(h).ok, 1);
}
