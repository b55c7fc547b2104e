//! The server end to end on emulated devices with the tiny pipeline: a real HTTP client
//! against a server on an ephemeral port.

use mold_plan::{DeviceId, Plan};
use mold_serve::{Deployment, ServeOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny pipeline's weights, written once per test process.
fn weights() -> &'static Path {
    static W: OnceLock<PathBuf> = OnceLock::new();
    W.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("mold-serve-test-{}", std::process::id()));
        mold_pipeline::testdata::write_tiny_pipeline(&d, 0).unwrap();
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

/// The request run alone, by `mold_pipeline::generate` (what `mold exec --prompt` runs).
fn alone(plan: &Plan, seed: u64, steps: u32) -> Vec<u8> {
    let prep = mold_pipeline::prepare(plan, weights()).unwrap();
    let out = mold_pipeline::generate(
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
    let prep = mold_pipeline::prepare(&plan, weights()).unwrap();
    let res = mold_pipeline::Resident::load(&plan, prep, &Default::default(), &mut |_| {}).unwrap();
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
    let o = ServeOptions {
        queue: 1,
        encoder_pool: false,
        ..opts()
    };
    let h = mold_serve::spawn(&deployment(1), &o).unwrap();
    let url = format!("http://{}/v1/generate", h.addr());
    // Eight at once on one replica with a queue of one: at most two are admitted before
    // the first of them finishes (one running, one waiting).
    let threads: Vec<_> = (0..8)
        .map(|s| {
            let url = url.clone();
            std::thread::spawn(move || {
                let r = client().post(&url).json(&body(s, 20)).send().unwrap();
                let status = r.status().as_u16();
                (status, r.text().unwrap())
            })
        })
        .collect();
    let got: Vec<(u16, String)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let busy: Vec<&(u16, String)> = got.iter().filter(|(s, _)| *s == 429).collect();
    assert!(
        !busy.is_empty(),
        "{:?}",
        got.iter().map(|g| g.0).collect::<Vec<_>>()
    );
    assert!(busy[0].1.contains("queue full"), "{}", busy[0].1);
    assert!(got.iter().all(|(s, _)| *s == 200 || *s == 429));
    let s = h.shutdown().unwrap();
    assert_eq!(s.ok as usize, got.len() - busy.len());
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
        "POST /v1/generate/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
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
