//! The server's faults end to end: a start that fails, panics and failures inside the
//! pipeline (one request fails, the rest go on), health with no replica left, and
//! shutdown draining what is in flight.

mod common;

use common::*;
use mold_serve::{Deployment, Hooks, ServeOptions, Stage};
use std::io::Read;
use std::time::{Duration, Instant};

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
