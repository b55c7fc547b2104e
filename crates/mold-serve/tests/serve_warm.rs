//! The start-up warm-up (`ServeOptions::warm_up`): one request per replica before the
//! server answers, kept out of the metrics; a warm-up that fails is the server's failure
//! to start, in one line.

mod common;

use common::*;
use mold_serve::{Hooks, ServeOptions, Stage};

#[test]
fn warm_up_runs_one_request_per_replica_before_serving_and_counts_none() {
    let (lines, log) = keep_log();
    let o = ServeOptions {
        warm_up: true,
        // One warm-up request at a time: unpinned, each would take the first idle device.
        queue: 1,
        ..opts()
    };
    let h = Detached(Some(
        mold_serve::spawn_logged(&deployment(2), &o, log).unwrap(),
    ));
    // Done before spawn returned: the log says so, and the replicas ran the requests.
    {
        let l = lines.lock().unwrap();
        let w = l.iter().find(|l| l.starts_with("warm-up: 2 requests at"));
        assert!(w.is_some(), "{l:?}");
        // The second replica's transformer was copied from the first's, not read again:
        // its copy finished, and nothing was refused.
        let copied = l.iter().any(|l| {
            l.starts_with("replica copies: load   transformer on emu:2: ") && l.contains(" in ")
        }) && l.iter().any(|l| l.contains("(copied from emu:0)"))
            && !l.iter().any(|l| l.contains("cannot copy"));
        assert!(copied, "{l:?}");
        // With the encoder pool on (the default), every device holding an encoder or the
        // VAE ran each of them once more, pinned there: both replicas' devices.
        let pinned = l.iter().any(|l| {
            l.starts_with("warm-up: the encoders and the VAE on 2 of 2 devices (emu:0, emu:2) at")
        });
        assert!(pinned, "{l:?}");
    }
    assert_eq!(
        metric(h.addr(), "mold_requests_total{outcome=\"ok\"} "),
        0.0
    );
    let url = format!("http://{}/v1/generate", h.addr());
    let r = client().post(&url).json(&body(1, 1)).send().unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text());
    let s = shutdown_within(h.take());
    assert_eq!((s.ok, s.failed), (1, 0));
}

#[test]
fn a_failing_warm_up_stops_the_start_in_one_line() {
    let (lines, log) = keep_log();
    let o = ServeOptions {
        warm_up: true,
        hooks: Hooks::default().panic_at(Stage::Decode, 1),
        ..opts()
    };
    let e = match mold_serve::spawn_logged(&deployment(1), &o, log) {
        Ok(_) => panic!("a server whose warm-up failed started"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("warm-up request") && e.contains("--warm-up off"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    // The cause is in the log under the request's id.
    let l = lines.lock().unwrap();
    assert!(
        l.iter()
            .any(|l| l.contains("request 1: panicked in the VAE")),
        "{l:?}"
    );
}

#[test]
fn warm_up_sizes_run_after_the_plans_size_each_once() {
    let (lines, log) = keep_log();
    let o = ServeOptions {
        warm_up: true,
        // The plan's 64x64 again and 32x32 twice: each size runs once.
        warm_up_sizes: vec![(32, 32), (64, 64), (32, 32)],
        ..opts()
    };
    let h = Detached(Some(
        mold_serve::spawn_logged(&deployment(1), &o, log).unwrap(),
    ));
    {
        let l = lines.lock().unwrap();
        let warm: Vec<&String> = l.iter().filter(|l| l.starts_with("warm-up: ")).collect();
        assert_eq!(warm.len(), 2, "{l:?}");
        assert!(
            warm[0].starts_with("warm-up: 1 request at 64x64"),
            "{warm:?}"
        );
        assert!(
            warm[1].starts_with("warm-up: 1 request at 32x32"),
            "{warm:?}"
        );
    }
    assert_eq!(
        metric(h.addr(), "mold_requests_total{outcome=\"ok\"} "),
        0.0
    );
    shutdown_within(h.take());
}

#[test]
fn a_warm_up_size_no_request_could_ask_for_is_refused_before_loading() {
    for (size, names) in [((128, 128), "width"), ((64, 40), "height")] {
        let (lines, log) = keep_log();
        let o = ServeOptions {
            warm_up: true,
            warm_up_sizes: vec![size],
            ..opts()
        };
        let e = match mold_serve::spawn_logged(&deployment(1), &o, log) {
            Ok(_) => panic!("a server with warm-up size {size:?} started"),
            Err(e) => e.to_string(),
        };
        let want = format!("--warm-up-sizes {}x{}: size: {names}", size.0, size.1);
        assert!(e.starts_with(&want), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // Refused before any weight loaded: nothing was logged.
        assert!(
            lines.lock().unwrap().is_empty(),
            "{:?}",
            lines.lock().unwrap()
        );
    }
}
