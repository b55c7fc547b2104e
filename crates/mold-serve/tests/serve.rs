//! The server end to end on emulated devices with the tiny pipeline, its requests and
//! their results: a real HTTP client (or a raw socket) against a server on an ephemeral
//! port. Nothing waits on speed: a test that needs a request held holds it at a
//! [`Gate`] (`ServeOptions::hooks`), and waits are for a condition, with a generous bound.
//! The limits are in `serve_limits.rs`, the faults and draining in `serve_faults.rs`;
//! what they share in `common/`.

mod common;

use common::*;
use mold_serve::{Gate, Hooks, ServeOptions, Stage};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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
                check_server_timing(r.headers());
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

/// A `Server-Timing` header naming every phase in order, each a duration in ms, with the
/// phases (queue included) adding up to the total, and the request's work not nothing.
fn check_server_timing(h: &reqwest::header::HeaderMap) {
    let v = h["server-timing"].to_str().unwrap();
    let got: Vec<(&str, f64)> = v
        .split(", ")
        .map(|m| {
            let (name, dur) = m.split_once(";dur=").unwrap_or_else(|| panic!("{v}"));
            (name, dur.parse::<f64>().unwrap_or_else(|_| panic!("{v}")))
        })
        .collect();
    let names: Vec<&str> = got.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        ["queue", "encode", "denoise", "decode", "png", "total"],
        "{v}"
    );
    assert!(got.iter().all(|(_, d)| *d >= 0.0), "{v}");
    let parts: f64 = got[..5].iter().map(|(_, d)| d).sum();
    let total = got[5].1;
    // Each figure is rounded to 0.1 ms.
    assert!((parts - total).abs() <= 0.3 || parts < total, "{v}");
    for work in [1, 2, 3] {
        assert!(got[work].1 > 0.0, "{v}");
    }
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

/// The progress stream's lines carry each stage's digest (someone reads them there), so a
/// streamed request takes them; a plain request takes none (tests/api.rs).
#[test]
fn the_progress_stream_carries_the_digests() {
    let h = mold_serve::spawn(&deployment(1), &opts()).unwrap();
    let addr = h.addr();
    let b = body(5, 2).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/generate/stream HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut lines = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "no image: {lines:?}");
        if line.trim_end() == "event: image" {
            break;
        }
        if let Some(d) = line.strip_prefix("data:") {
            let v: serde_json::Value = serde_json::from_str(d.trim()).unwrap();
            if let Some(l) = v.get("line").and_then(|l| l.as_str()) {
                lines.push(l.to_string());
            }
        }
    }
    let steps: Vec<&String> = lines.iter().filter(|l| l.starts_with("step")).collect();
    assert_eq!(steps.len(), 2, "{lines:?}");
    assert!(
        steps.iter().all(|l| l.contains("latents digest")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("decode") && l.contains("image digest")),
        "{lines:?}"
    );
    drop(r);
    drop(s);
    assert_eq!(shutdown_within(h).ok, 1);
}
