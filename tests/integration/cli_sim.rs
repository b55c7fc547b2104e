//! `mold sim` as a user runs it, from the repository root.

use crate::util::mold;

fn run(args: &[&str]) -> (i32, String, String) {
    let mut a = vec!["sim"];
    a.extend_from_slice(args);
    let o = mold(&a);
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const PLAN: &str = "sim/scenarios/plans/flux-dev-one-l40s.yaml";

#[test]
fn simulates_a_plan_on_its_machine() {
    let (code, out, err) = run(&[PLAN]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "machine profile: sim/machines/",
        "cuda:0",
        "bottleneck:",
        "request",
        "vs plan:",
        "fits",
    ] {
        assert!(out.contains(want), "missing {want}: {out}");
    }
}

#[test]
fn json_and_timeline() {
    let svg = std::env::temp_dir().join(format!("mold-sim-{}.svg", std::process::id()));
    let (code, out, err) = run(&[PLAN, "--json", "--timeline", svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["fits"], true);
    assert!(v["simulation"]["step_s"].as_f64().unwrap() > 0.0);
    assert!(v["vs_plan"]["step_deviation"].as_f64().unwrap().abs() < 0.02);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"));
    assert!(text.trim_end().ends_with("</svg>"));
    for lane in ["compute", "copy", "comm"] {
        assert!(text.contains(&format!(r#"data-lane="{lane}""#)));
    }
    std::fs::remove_file(&svg).ok();
}

#[test]
fn another_machine_needs_force() {
    let (code, out, err) = run(&[PLAN, "--machine", "sim/machines/1x-rtx4090.yaml"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("the plan was made for machine `2x-l40s`"),
        "{err}"
    );
    assert!(err.contains("--force"), "{err}");
    let (code, out, err) = run(&[PLAN, "--machine", "sim/machines/1x-rtx4090.yaml", "--force"]);
    // Forced: a warning, then the overrun as an error.
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("warning: the plan was made for machine"),
        "{err}"
    );
    assert!(err.contains("error: cuda:0: over budget"), "{err}");
    assert!(out.contains("OVER"), "{out}");
}

#[test]
fn check_walks_plans_and_scenarios() {
    let (code, out, err) = run(&["--check", "plans/", "sim/scenarios/"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("ok   sim/scenarios/split-flux-dev-2x-rtx4090.yaml"),
        "{out}"
    );
    assert!(out.contains(" 0 failed"), "{out}");
    let dir = std::env::temp_dir().join(format!("mold-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("wrong.yaml"),
        format!(
            "machine: sim/machines/1x-rtx4090.yaml\nplan_file: {PLAN}\nforce: true\nexpect: fits\n"
        ),
    )
    .unwrap();
    let (code, out, _) = run(&["--check", dir.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL") && out.contains("expected to fit"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A throughput plan (2 replicas) under a request stream: its invariants, from the JSON.
#[test]
fn request_stream_over_replicas() {
    let d = crate::util::tempdir("sim-stream");
    let p = d.join("plan.yaml");
    let p = p.to_str().unwrap();
    crate::util::mold_ok(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/2x-h200.yaml",
        "--objective",
        "throughput",
        "--clients",
        "8",
        "-o",
        p,
    ]);
    let stream = |flags: &[&str]| {
        let mut a = vec![p, "--json"];
        a.extend_from_slice(flags);
        let (code, out, err) = run(&a);
        assert_eq!(code, 0, "{out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        v["stream"].clone()
    };
    let s = stream(&["--requests", "32", "--clients", "8"]);
    let reps = s["replicas"].as_array().unwrap();
    assert_eq!(reps.len(), 2);
    let request_s = reps[0]["request_s"].as_f64().unwrap();
    let f = |k: &str| s[k].as_f64().unwrap();
    // No more than every replica busy all the time; p50 ≤ p95.
    assert!(
        f("images_per_min") <= 60.0 * 2.0 / request_s * (1.0 + 1e-9),
        "{s}"
    );
    assert!(f("images_per_min") > 60.0 * 1.5 / request_s, "{s}");
    assert!(f("latency_p50_s") <= f("latency_p95_s"), "{s}");
    // One client: a request's latency is its time on a replica.
    let s = stream(&["--requests", "8", "--clients", "1"]);
    assert!(
        (s["latency_p95_s"].as_f64().unwrap() - request_s).abs() < 1e-9,
        "{s}"
    );
    // The text report.
    let (code, out, err) = run(&[p, "--requests", "16", "--arrival-rate", "0.25"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("request stream: 16 requests, arriving at 0.25 a second, evenly spaced, over 2 replicas"), "{out}");
    assert!(out.contains("images/min") && out.contains("p95"), "{out}");
    // Stream flags name themselves.
    for (flags, want) in [
        (
            vec![p, "--requests", "8"],
            "--requests 8: say how requests come",
        ),
        (
            vec![p, "--arrival-rate", "0"],
            "--arrival-rate 0: give requests a second",
        ),
        (
            vec!["--check", "plans/", "--clients", "2"],
            "--check runs each plan once",
        ),
    ] {
        let (code, out, err) = run(&flags);
        assert_ne!(code, 0, "{out}");
        assert!(err.contains(want), "{err}");
    }
}
